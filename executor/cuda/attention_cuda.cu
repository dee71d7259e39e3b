// CUDA twin of the causal GQA attention forward (executor/cpu/attention_cpu.cpp): no [T, T]
// buffer; each block owns one (query row, head) and walks the keys up to the row in tiles of
// blockDim.x, folding each tile into the running (max, sum) with the shared
// online_softmax_rescale and rescaling its fp32 output accumulator; saves lse [a, T] in fp32.
// The backward recomputes the probabilities from lse: dQ one block per (query row, head) over
// its key tiles; dK, dV one block per (key row, kv head) over the query rows at or after it, for
// every head of the group. Reference kernels, not fast ones (K and V are read once per row).
// attention_forward_cuda / attention_backward_cuda pick the tensor-core kernels
// (attention_tc_cuda.cu) where they apply (bf16, head_dim a multiple of 16 up to 128), else these;
// both paths share the argument checks, the delta kernel and the workspace. The kernels' source
// is in attention_ref_kernels.cuh with its launch functions; this file holds the checks.
#include <string>

#include "executor/cpu/op_util.h"
#include "executor/cuda/attention_ref_kernels.cuh"
#include "executor/cuda/attention_tc_cuda.h"
#include "executor/cuda/cuda_check.h"
#include "executor/cuda/kernel_util.cuh"
#include "executor/cuda/ops_cuda.h"

namespace flatpeak::exec {
namespace {

using cuda_detail::kAttentionThreads;
using cuda_detail::kDimsPerThread;

}  // namespace

const char* attention_kernel_name(AttentionKernel kernel) {
  switch (kernel) {
    case AttentionKernel::Auto: return "auto";
    case AttentionKernel::Reference: return "reference";
    case AttentionKernel::TensorCore: return "tensor-core";
  }
  return "unknown";
}

namespace {

// True for the tensor-core kernels. Asking for them where they do not apply (the arguments, or a
// device whose per-block shared memory is smaller than their tiles) is an argument error naming
// the rule and the values; Auto then takes the reference kernels.
bool use_tensor_cores(const AttentionArgs& a, AttentionKernel kernel) {
  if (kernel == AttentionKernel::Reference) return false;
  const bool applies = cuda_detail::attention_tc_applies(a);
  if (kernel == AttentionKernel::TensorCore && !applies) {
    fail("attention", std::string("the tensor-core kernel needs dtype bf16 and head_dim a multiple "
                                  "of 16, at most 128 (got dtype ") +
                          dtype_name(a.dtype) + ", head_dim " + std::to_string(a.head_dim) + ")");
  }
  if (!applies) return false;
  const int64_t need = cuda_detail::attention_tc_shared_bytes(a.head_dim);
  const int64_t allowed = cuda_detail::device_shared_bytes_per_block_optin();
  if (need <= allowed) return true;
  if (kernel == AttentionKernel::TensorCore) {
    fail("attention", "the tensor-core kernel needs " + std::to_string(need) +
                          " bytes of shared memory per block at head_dim " +
                          std::to_string(a.head_dim) + "; this device allows " +
                          std::to_string(allowed));
  }
  return false;
}

float softmax_scale_of(const AttentionArgs& a) {
  return a.softmax_scale != 0.0f ? a.softmax_scale : 1.0f / sqrtf(static_cast<float>(a.head_dim));
}

}  // namespace

void attention_forward_cuda(const AttentionArgs& a, cudaStream_t stream, AttentionKernel kernel) {
  require(a.tokens >= 0 && a.q_heads > 0 && a.kv_heads > 0 && a.head_dim > 0, "attention",
          "tokens must be >= 0, heads and head_dim > 0");
  require(a.q_heads % a.kv_heads == 0, "attention", "q_heads must be a multiple of kv_heads");
  require(a.q && a.k && a.v && a.out && a.lse, "attention", "needs q, k, v, out and lse");
  require(a.head_dim <= kAttentionThreads * kDimsPerThread, "attention",
          "head_dim must be <= 512 on CUDA");
  if (attention_v_dim(a) != a.head_dim)
    fail("attention", "v_head_dim must equal head_dim on CUDA (got " + std::to_string(a.v_head_dim) + " and " +
                          std::to_string(a.head_dim) + "; MLA's distinct value width runs on the CPU only)");
  require(a.tokens <= 0x7fffffff && a.q_heads <= 65535, "attention",
          "tokens must be < 2^31 and q_heads <= 65535 on CUDA");
  const bool tensor_cores = use_tensor_cores(a, kernel);
  if (a.tokens == 0) return;
  const float scale = softmax_scale_of(a);
  if (tensor_cores) {
    cuda_detail::attention_forward_tc(a, scale, stream);
    return;
  }
  dispatch_compute(a.dtype, "attention", [&](auto tag) {
    using T = decltype(tag);
    cuda_detail::launch_attention_ref_forward(
        static_cast<const T*>(a.q), static_cast<const T*>(a.k), static_cast<const T*>(a.v),
        static_cast<T*>(a.out), a.lse, a.tokens, a.q_heads, a.kv_heads, a.head_dim, scale, stream);
  });
}

int64_t attention_backward_workspace_bytes_cuda(const AttentionArgs& a) {
  return a.q_heads * a.tokens * 4;  // D [a, T] fp32
}

void attention_backward_cuda(const AttentionArgs& a, cudaStream_t stream, AttentionKernel kernel) {
  require(a.tokens >= 0 && a.q_heads > 0 && a.kv_heads > 0 && a.head_dim > 0, "attention",
          "tokens must be >= 0, heads and head_dim > 0");
  require(a.q_heads % a.kv_heads == 0, "attention", "q_heads must be a multiple of kv_heads");
  require(a.q && a.k && a.v && a.out && a.lse, "attention", "needs q, k, v, out and lse");
  require(a.d_out && a.d_q && a.d_k && a.d_v, "attention", "backward needs d_out, d_q, d_k and d_v");
  require(a.workspace != nullptr, "attention",
          "backward needs a workspace of attention_backward_workspace_bytes_cuda()");
  require(a.head_dim <= kAttentionThreads * kDimsPerThread, "attention",
          "head_dim must be <= 512 on CUDA");
  if (attention_v_dim(a) != a.head_dim)
    fail("attention", "v_head_dim must equal head_dim on CUDA (got " + std::to_string(a.v_head_dim) + " and " +
                          std::to_string(a.head_dim) + "; MLA's distinct value width runs on the CPU only)");
  require(a.tokens <= 0x7fffffff && a.q_heads <= 65535, "attention",
          "tokens must be < 2^31 and q_heads <= 65535 on CUDA");
  const bool tensor_cores = use_tensor_cores(a, kernel);
  if (a.tokens == 0) return;
  const float scale = softmax_scale_of(a);
  float* delta = a.workspace;  // [a, T]
  dispatch_compute(a.dtype, "attention", [&](auto tag) {
    using T = decltype(tag);
    const T* q = static_cast<const T*>(a.q);
    const T* k = static_cast<const T*>(a.k);
    const T* v = static_cast<const T*>(a.v);
    const T* d_out = static_cast<const T*>(a.d_out);
    cuda_detail::launch_attention_delta(static_cast<const T*>(a.out), d_out, delta, a.tokens,
                                        a.q_heads, a.head_dim, stream);
    if (tensor_cores) {
      cuda_detail::attention_backward_tc(a, delta, scale, stream);
      return;
    }
    cuda_detail::launch_attention_ref_backward(q, k, v, d_out, a.lse, delta, static_cast<T*>(a.d_q),
                                               static_cast<T*>(a.d_k), static_cast<T*>(a.d_v),
                                               a.tokens, a.q_heads, a.kv_heads, a.head_dim, scale,
                                               stream);
  });
}

}  // namespace flatpeak::exec
