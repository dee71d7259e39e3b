// CUDA twins of AdamW, embedding, RMSNorm, LayerNorm and the router (executor/cpu/{adamw,embedding,
// rmsnorm,layernorm,router}_cpu.cpp): the per-element formulas come from the same FLATPEAK_HD functions.
#include <string>

#include "executor/cpu/op_util.h"
#include "executor/cuda/cuda_check.h"
#include "executor/cuda/kernel_util.cuh"
#include "executor/cuda/norm_adamw_kernels.cuh"
#include "executor/cuda/ops_cuda.h"

namespace flatpeak::exec {
namespace {

// The launch sequences (norm_adamw_kernels.cuh).
using cuda_detail::launch_adamw;
using cuda_detail::launch_embedding_backward;
using cuda_detail::launch_embedding_forward;
using cuda_detail::launch_layernorm_backward;
using cuda_detail::launch_layernorm_forward;
using cuda_detail::launch_rmsnorm_backward;
using cuda_detail::launch_rmsnorm_forward;
using cuda_detail::launch_router_backward;
using cuda_detail::launch_router_forward;

}  // namespace

void adamw_step_cuda(const AdamWArgs& a, cudaStream_t stream) {
  require(a.elems >= 0, "adamw", "elems must be >= 0");
  require(a.step >= 1, "adamw", "step must be >= 1");
  require(a.master && a.grad && a.m && a.v, "adamw", "needs master, grad, m and v");
  if (a.elems == 0) return;
  const AdamWScalars s = adamw_scalars(a);
  if (a.grad_dtype == DType::F32) {
    launch_adamw(a.master, static_cast<const float*>(a.grad), a.m, a.v, a.param_out, a.elems, s,
                 stream);
  } else if (a.grad_dtype == DType::BF16) {
    launch_adamw(a.master, static_cast<const Bf16*>(a.grad), a.m, a.v, a.param_out, a.elems, s,
                 stream);
  } else {
    fail("adamw", "grad_dtype must be f32 or bf16");
  }
}

void embedding_forward_cuda(const EmbeddingArgs& a, cudaStream_t stream) {
  require(a.tokens >= 0 && a.vocab > 0 && a.hidden > 0, "embedding",
          "tokens must be >= 0, vocab and hidden > 0");
  require(a.token_ids && a.table && a.out, "embedding", "forward needs token_ids, table and out");
  if (a.tokens == 0) return;
  dispatch_compute(a.dtype, "embedding", [&](auto tag) {
    using T = decltype(tag);
    launch_embedding_forward(a.token_ids, static_cast<const T*>(a.table), static_cast<T*>(a.out),
                             a.tokens, a.hidden, stream);
  });
}

void embedding_backward_cuda(const EmbeddingArgs& a, cudaStream_t stream) {
  require(a.tokens >= 0 && a.vocab > 0 && a.hidden > 0, "embedding",
          "tokens must be >= 0, vocab and hidden > 0");
  require(a.token_ids && a.d_out && a.d_table, "embedding",
          "backward needs token_ids, d_out and d_table");
  if (a.tokens == 0) return;
  dispatch_compute(a.dtype, "embedding", [&](auto tag) {
    using T = decltype(tag);
    launch_embedding_backward(a.token_ids, static_cast<const T*>(a.d_out),
                              static_cast<T*>(a.d_table), a.tokens, a.hidden, stream);
  });
}

void rmsnorm_forward_cuda(const RmsNormArgs& a, cudaStream_t stream) {
  require(a.tokens >= 0 && a.hidden > 0, "rmsnorm", "tokens must be >= 0 and hidden > 0");
  require(a.x && a.weight && a.rstd && a.out, "rmsnorm", "forward needs x, weight, rstd and out");
  require(a.tokens <= 0x7fffffff, "rmsnorm", "tokens must be < 2^31 (one block per token)");
  if (a.tokens == 0) return;
  dispatch_compute(a.dtype, "rmsnorm", [&](auto tag) {
    using T = decltype(tag);
    launch_rmsnorm_forward(static_cast<const T*>(a.x), static_cast<const T*>(a.weight),
                           static_cast<T*>(a.out), a.rstd, a.tokens, a.hidden, a.eps, stream);
  });
}

void layernorm_forward_cuda(const LayerNormArgs& a, cudaStream_t stream) {
  require(a.tokens >= 0 && a.hidden > 0, "layernorm", "tokens must be >= 0 and hidden > 0");
  require(a.x && a.weight && a.bias && a.mean && a.rstd && a.out, "layernorm",
          "forward needs x, weight, bias, mean, rstd and out");
  require(a.tokens <= 0x7fffffff, "layernorm", "tokens must be < 2^31 (one block per token)");
  if (a.tokens == 0) return;
  dispatch_compute(a.dtype, "layernorm", [&](auto tag) {
    using T = decltype(tag);
    launch_layernorm_forward(static_cast<const T*>(a.x), static_cast<const T*>(a.weight), static_cast<const T*>(a.bias),
                             static_cast<T*>(a.out), a.mean, a.rstd, a.tokens, a.hidden, a.eps, stream);
  });
}

void layernorm_backward_cuda(const LayerNormArgs& a, cudaStream_t stream) {
  require(a.tokens >= 0 && a.hidden > 0, "layernorm", "tokens must be >= 0 and hidden > 0");
  require(a.x && a.weight && a.mean && a.rstd && a.d_out && a.d_x && a.d_weight && a.d_bias, "layernorm",
          "backward needs x, weight, mean, rstd, d_out, d_x, d_weight and d_bias");
  require(a.tokens <= 0x7fffffff, "layernorm", "tokens must be < 2^31 (one block per token)");
  if (a.tokens == 0) return;
  dispatch_compute(a.dtype, "layernorm", [&](auto tag) {
    using T = decltype(tag);
    launch_layernorm_backward(static_cast<const T*>(a.x), static_cast<const T*>(a.weight), static_cast<const T*>(a.d_out),
                              a.mean, a.rstd, static_cast<T*>(a.d_x), static_cast<T*>(a.d_weight),
                              static_cast<T*>(a.d_bias), a.tokens, a.hidden, stream);
  });
}

void rmsnorm_backward_cuda(const RmsNormArgs& a, cudaStream_t stream) {
  require(a.tokens >= 0 && a.hidden > 0, "rmsnorm", "tokens must be >= 0 and hidden > 0");
  require(a.x && a.weight && a.rstd && a.d_out && a.d_x && a.d_weight, "rmsnorm",
          "backward needs x, weight, rstd, d_out, d_x and d_weight");
  require(a.tokens <= 0x7fffffff, "rmsnorm", "tokens must be < 2^31 (one block per token)");
  if (a.tokens == 0) return;
  dispatch_compute(a.dtype, "rmsnorm", [&](auto tag) {
    using T = decltype(tag);
    launch_rmsnorm_backward(static_cast<const T*>(a.x), static_cast<const T*>(a.weight),
                            static_cast<const T*>(a.d_out), a.rstd, static_cast<T*>(a.d_x),
                            static_cast<T*>(a.d_weight), a.tokens, a.hidden, stream);
  });
}

void router_forward_cuda(const RouterArgs& a, cudaStream_t stream) {
  require(a.tokens >= 0 && a.experts > 0 && a.top_k > 0 && a.top_k <= a.experts, "router",
          "need tokens >= 0 and 1 <= top_k <= experts");
  require(a.logits && a.topk_ids && a.topk_weights, "router",
          "needs logits, topk_ids and topk_weights");
  if (a.tokens == 0) return;
  launch_router_forward(a.logits, a.topk_ids, a.topk_weights, a.tokens, a.experts, a.top_k, stream);
}

void router_backward_cuda(const RouterArgs& a, cudaStream_t stream) {
  require(a.tokens >= 0 && a.experts > 0 && a.top_k > 0 && a.top_k <= a.experts, "router",
          "need tokens >= 0 and 1 <= top_k <= experts");
  require(a.topk_ids && a.topk_weights && a.d_topk_weights && a.d_logits, "router",
          "backward needs topk_ids, topk_weights, d_topk_weights and d_logits");
  if (a.tokens == 0) return;
  launch_router_backward(a.topk_ids, a.topk_weights, a.d_topk_weights, a.d_logits, a.tokens,
                         a.experts, a.top_k, stream);
}

}  // namespace flatpeak::exec
