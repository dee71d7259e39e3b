// CUDA twins of AdamW, embedding, RMSNorm and the router (executor/cpu/{adamw,embedding,rmsnorm,
// router}_cpu.cpp): the per-element formulas come from the same FLATPEAK_HD functions.
#include <string>

#include "executor/cpu/op_util.h"
#include "executor/cuda/cuda_check.h"
#include "executor/cuda/kernel_util.cuh"
#include "executor/cuda/ops_cuda.h"

namespace flatpeak::exec {
namespace {

using cuda_detail::block_sum;
using cuda_detail::global_thread;
using cuda_detail::grid_for;
using cuda_detail::grid_threads;
using cuda_detail::kThreads;

// ---- AdamW -------------------------------------------------------------------------------

template <class G>
__global__ void adamw_kernel(float* master, const G* grad, float* m, float* v, Bf16* param_out,
                             int64_t n, AdamWScalars s) {
  for (int64_t i = global_thread(); i < n; i += grid_threads()) {
    float p = master[i];
    float mi = m[i];
    float vi = v[i];
    adamw_update(p, mi, vi, to_f32(grad[i]), s);
    master[i] = p;
    m[i] = mi;
    v[i] = vi;
    if (param_out != nullptr) param_out[i] = f32_to_bf16(p);
  }
}

// ---- embedding ---------------------------------------------------------------------------

template <class T>
__global__ void embedding_forward_kernel(const int32_t* ids, const T* table, T* out,
                                         int64_t tokens, int64_t hidden) {
  for (int64_t i = global_thread(); i < tokens * hidden; i += grid_threads()) {
    const int64_t t = i / hidden;
    const int64_t h = i % hidden;
    out[i] = table[static_cast<int64_t>(ids[t]) * hidden + h];
  }
}

// One thread per hidden column walks the tokens in order: the same sequence of rounded adds
// as the CPU for every d_table element, whatever ids repeat.
template <class T>
__global__ void embedding_backward_kernel(const int32_t* ids, const T* d_out, T* d_table,
                                          int64_t tokens, int64_t hidden) {
  for (int64_t h = global_thread(); h < hidden; h += grid_threads()) {
    for (int64_t t = 0; t < tokens; ++t) {
      T* dst = &d_table[static_cast<int64_t>(ids[t]) * hidden + h];
      store_f32(dst, to_f32(*dst) + to_f32(d_out[t * hidden + h]));
    }
  }
}

// ---- RMSNorm -----------------------------------------------------------------------------

template <class T>
__global__ void rmsnorm_forward_kernel(const T* x, const T* w, T* out, float* rstd_out,
                                       int64_t hidden, float eps) {
  __shared__ float scratch[32];
  const int64_t t = blockIdx.x;
  const T* xr = x + t * hidden;
  float partial = 0.0f;
  for (int64_t h = threadIdx.x; h < hidden; h += blockDim.x) partial += to_f32(xr[h]) * to_f32(xr[h]);
  const float rstd = rmsnorm_rstd(block_sum(partial, scratch), hidden, eps);
  if (threadIdx.x == 0) rstd_out[t] = rstd;
  for (int64_t h = threadIdx.x; h < hidden; h += blockDim.x) {
    store_f32(&out[t * hidden + h], to_f32(xr[h]) * rstd * to_f32(w[h]));
  }
}

// dx = rstd · (w ⊙ dy) − x · rstd³ / H · Σ_h (w ⊙ dy ⊙ x), one block per token.
template <class T>
__global__ void rmsnorm_backward_dx_kernel(const T* x, const T* w, const T* dy, const float* rstd_in,
                                           T* dx, int64_t hidden) {
  __shared__ float scratch[32];
  const int64_t row = static_cast<int64_t>(blockIdx.x) * hidden;
  const float rstd = rstd_in[blockIdx.x];
  float partial = 0.0f;
  for (int64_t h = threadIdx.x; h < hidden; h += blockDim.x) {
    partial += to_f32(w[h]) * to_f32(dy[row + h]) * to_f32(x[row + h]);
  }
  const float dot = block_sum(partial, scratch);
  const float coef = dot * rstd * rstd * rstd / static_cast<float>(hidden);
  for (int64_t h = threadIdx.x; h < hidden; h += blockDim.x) {
    store_f32(&dx[row + h], rstd * to_f32(w[h]) * to_f32(dy[row + h]) - coef * to_f32(x[row + h]));
  }
}

// dw += Σ_t dy ⊙ x · rstd: one thread per column, tokens in order, added once.
template <class T>
__global__ void rmsnorm_backward_dw_kernel(const T* x, const T* dy, const float* rstd_in, T* dw,
                                           int64_t tokens, int64_t hidden) {
  for (int64_t h = global_thread(); h < hidden; h += grid_threads()) {
    float sum = 0.0f;
    for (int64_t t = 0; t < tokens; ++t) {
      sum += to_f32(dy[t * hidden + h]) * to_f32(x[t * hidden + h]) * rstd_in[t];
    }
    store_f32(&dw[h], to_f32(dw[h]) + sum);
  }
}

// ---- router ------------------------------------------------------------------------------

__global__ void router_forward_kernel(const float* logits, int32_t* topk_ids, float* topk_weights,
                                      int64_t tokens, int64_t experts, int64_t top_k) {
  for (int64_t t = global_thread(); t < tokens; t += grid_threads()) {
    const float* z = logits + t * experts;
    int32_t* ids = topk_ids + t * top_k;
    float* w = topk_weights + t * top_k;
    float max_z = -INFINITY;
    for (int64_t e = 0; e < experts; ++e) max_z = fmaxf(max_z, z[e]);
    float sum = 0.0f;
    for (int64_t e = 0; e < experts; ++e) sum += expf(z[e] - max_z);
    float kept_sum = 0.0f;
    for (int64_t s = 0; s < top_k; ++s) {
      int64_t best = -1;
      for (int64_t e = 0; e < experts; ++e) {
        bool taken = false;
        for (int64_t p = 0; p < s; ++p) taken = taken || ids[p] == e;
        if (!taken && (best < 0 || z[e] > z[best])) best = e;
      }
      ids[s] = static_cast<int32_t>(best);
      w[s] = expf(z[best] - max_z) / sum;
      kept_sum += w[s];
    }
    for (int64_t s = 0; s < top_k; ++s) w[s] /= kept_sum;
  }
}

__global__ void router_backward_kernel(const int32_t* topk_ids, const float* topk_weights,
                                       const float* d_topk_weights, float* d_logits,
                                       int64_t tokens, int64_t experts, int64_t top_k) {
  for (int64_t t = global_thread(); t < tokens; t += grid_threads()) {
    const int32_t* ids = topk_ids + t * top_k;
    const float* w = topk_weights + t * top_k;
    const float* dw = d_topk_weights + t * top_k;
    float* dz = d_logits + t * experts;
    for (int64_t e = 0; e < experts; ++e) dz[e] = 0.0f;
    float weighted = 0.0f;
    for (int64_t s = 0; s < top_k; ++s) weighted += w[s] * dw[s];
    for (int64_t s = 0; s < top_k; ++s) dz[ids[s]] = w[s] * (dw[s] - weighted);
  }
}

}  // namespace

void adamw_step_cuda(const AdamWArgs& a, cudaStream_t stream) {
  require(a.elems >= 0, "adamw", "elems must be >= 0");
  require(a.step >= 1, "adamw", "step must be >= 1");
  require(a.master && a.grad && a.m && a.v, "adamw", "needs master, grad, m and v");
  if (a.elems == 0) return;
  const AdamWScalars s = adamw_scalars(a);
  if (a.grad_dtype == DType::F32) {
    adamw_kernel<<<grid_for(a.elems), kThreads, 0, stream>>>(
        a.master, static_cast<const float*>(a.grad), a.m, a.v, a.param_out, a.elems, s);
  } else if (a.grad_dtype == DType::BF16) {
    adamw_kernel<<<grid_for(a.elems), kThreads, 0, stream>>>(
        a.master, static_cast<const Bf16*>(a.grad), a.m, a.v, a.param_out, a.elems, s);
  } else {
    fail("adamw", "grad_dtype must be f32 or bf16");
  }
  FLATPEAK_CUDA_CHECK_LAUNCH();
}

void embedding_forward_cuda(const EmbeddingArgs& a, cudaStream_t stream) {
  require(a.tokens >= 0 && a.vocab > 0 && a.hidden > 0, "embedding",
          "tokens must be >= 0, vocab and hidden > 0");
  require(a.token_ids && a.table && a.out, "embedding", "forward needs token_ids, table and out");
  if (a.tokens == 0) return;
  dispatch_compute(a.dtype, "embedding", [&](auto tag) {
    using T = decltype(tag);
    embedding_forward_kernel<<<grid_for(a.tokens * a.hidden), kThreads, 0, stream>>>(
        a.token_ids, static_cast<const T*>(a.table), static_cast<T*>(a.out), a.tokens, a.hidden);
  });
  FLATPEAK_CUDA_CHECK_LAUNCH();
}

void embedding_backward_cuda(const EmbeddingArgs& a, cudaStream_t stream) {
  require(a.tokens >= 0 && a.vocab > 0 && a.hidden > 0, "embedding",
          "tokens must be >= 0, vocab and hidden > 0");
  require(a.token_ids && a.d_out && a.d_table, "embedding",
          "backward needs token_ids, d_out and d_table");
  if (a.tokens == 0) return;
  dispatch_compute(a.dtype, "embedding", [&](auto tag) {
    using T = decltype(tag);
    embedding_backward_kernel<<<grid_for(a.hidden), kThreads, 0, stream>>>(
        a.token_ids, static_cast<const T*>(a.d_out), static_cast<T*>(a.d_table), a.tokens,
        a.hidden);
  });
  FLATPEAK_CUDA_CHECK_LAUNCH();
}

void rmsnorm_forward_cuda(const RmsNormArgs& a, cudaStream_t stream) {
  require(a.tokens >= 0 && a.hidden > 0, "rmsnorm", "tokens must be >= 0 and hidden > 0");
  require(a.x && a.weight && a.rstd && a.out, "rmsnorm", "forward needs x, weight, rstd and out");
  require(a.tokens <= 0x7fffffff, "rmsnorm", "tokens must be < 2^31 (one block per token)");
  if (a.tokens == 0) return;
  dispatch_compute(a.dtype, "rmsnorm", [&](auto tag) {
    using T = decltype(tag);
    rmsnorm_forward_kernel<<<static_cast<unsigned>(a.tokens), kThreads, 0, stream>>>(
        static_cast<const T*>(a.x), static_cast<const T*>(a.weight), static_cast<T*>(a.out),
        a.rstd, a.hidden, a.eps);
  });
  FLATPEAK_CUDA_CHECK_LAUNCH();
}

void rmsnorm_backward_cuda(const RmsNormArgs& a, cudaStream_t stream) {
  require(a.tokens >= 0 && a.hidden > 0, "rmsnorm", "tokens must be >= 0 and hidden > 0");
  require(a.x && a.weight && a.rstd && a.d_out && a.d_x && a.d_weight, "rmsnorm",
          "backward needs x, weight, rstd, d_out, d_x and d_weight");
  require(a.tokens <= 0x7fffffff, "rmsnorm", "tokens must be < 2^31 (one block per token)");
  if (a.tokens == 0) return;
  dispatch_compute(a.dtype, "rmsnorm", [&](auto tag) {
    using T = decltype(tag);
    const T* x = static_cast<const T*>(a.x);
    const T* dy = static_cast<const T*>(a.d_out);
    rmsnorm_backward_dx_kernel<<<static_cast<unsigned>(a.tokens), kThreads, 0, stream>>>(
        x, static_cast<const T*>(a.weight), dy, a.rstd, static_cast<T*>(a.d_x), a.hidden);
    FLATPEAK_CUDA_CHECK_LAUNCH();
    rmsnorm_backward_dw_kernel<<<grid_for(a.hidden), kThreads, 0, stream>>>(
        x, dy, a.rstd, static_cast<T*>(a.d_weight), a.tokens, a.hidden);
  });
  FLATPEAK_CUDA_CHECK_LAUNCH();
}

void router_forward_cuda(const RouterArgs& a, cudaStream_t stream) {
  require(a.tokens >= 0 && a.experts > 0 && a.top_k > 0 && a.top_k <= a.experts, "router",
          "need tokens >= 0 and 1 <= top_k <= experts");
  require(a.logits && a.topk_ids && a.topk_weights, "router",
          "needs logits, topk_ids and topk_weights");
  if (a.tokens == 0) return;
  router_forward_kernel<<<grid_for(a.tokens, 128), 128, 0, stream>>>(
      a.logits, a.topk_ids, a.topk_weights, a.tokens, a.experts, a.top_k);
  FLATPEAK_CUDA_CHECK_LAUNCH();
}

void router_backward_cuda(const RouterArgs& a, cudaStream_t stream) {
  require(a.tokens >= 0 && a.experts > 0 && a.top_k > 0 && a.top_k <= a.experts, "router",
          "need tokens >= 0 and 1 <= top_k <= experts");
  require(a.topk_ids && a.topk_weights && a.d_topk_weights && a.d_logits, "router",
          "backward needs topk_ids, topk_weights, d_topk_weights and d_logits");
  if (a.tokens == 0) return;
  router_backward_kernel<<<grid_for(a.tokens, 128), 128, 0, stream>>>(
      a.topk_ids, a.topk_weights, a.d_topk_weights, a.d_logits, a.tokens, a.experts, a.top_k);
  FLATPEAK_CUDA_CHECK_LAUNCH();
}

}  // namespace flatpeak::exec
