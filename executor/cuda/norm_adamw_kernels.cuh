// The kernels of AdamW, embedding, RMSNorm, LayerNorm and the router (internal to executor/cuda), with the
// per-element formulas of the CPU ops (the same FLATPEAK_HD functions). norm_adamw_cuda.cu runs
// the launch sequences at the end; tests/unit/executor_norm_adamw_emulation_test.cpp runs the
// same ones on the host (FLATPEAK_CUDA_EMULATION, tests/unit/cuda_emulation.h) against the CPU
// ops (executor/cpu/{adamw,embedding,rmsnorm,router}_cpu.cpp), without a GPU.
//   #include "executor/cuda/norm_adamw_kernels.cuh"
//   launch_rmsnorm_forward(x, w, out, rstd, tokens, hidden, eps, stream);
#pragma once

#include <cmath>
#include <cstdint>

#include "executor/cuda/kernel_util.cuh"
#include "executor/ops/adamw.h"
#include "executor/ops/dtype.h"
#include "executor/ops/layernorm.h"
#include "executor/ops/rmsnorm.h"

// One translation unit per binary includes this header (the kernels have internal linkage).
namespace flatpeak::exec::cuda_detail {
namespace {

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

// ---- LayerNorm ---------------------------------------------------------------------------

// One block per token: the mean, then the squared deviations from it (two passes, as the CPU).
template <class T>
__global__ void layernorm_forward_kernel(const T* x, const T* w, const T* b, T* out, float* mean_out,
                                         float* rstd_out, int64_t hidden, float eps) {
  __shared__ float scratch[32];
  const int64_t t = blockIdx.x;
  const T* xr = x + t * hidden;
  float partial = 0.0f;
  for (int64_t h = threadIdx.x; h < hidden; h += blockDim.x) partial += to_f32(xr[h]);
  const float mean = block_sum(partial, scratch) / static_cast<float>(hidden);
  partial = 0.0f;
  for (int64_t h = threadIdx.x; h < hidden; h += blockDim.x) partial += (to_f32(xr[h]) - mean) * (to_f32(xr[h]) - mean);
  const float rstd = layernorm_rstd(block_sum(partial, scratch), hidden, eps);
  if (threadIdx.x == 0) {
    mean_out[t] = mean;
    rstd_out[t] = rstd;
  }
  for (int64_t h = threadIdx.x; h < hidden; h += blockDim.x) {
    store_f32(&out[t * hidden + h], (to_f32(xr[h]) - mean) * rstd * to_f32(w[h]) + to_f32(b[h]));
  }
}

// dx = rstd · (g − mean(g) − x̂ · mean(g ⊙ x̂)), g = w ⊙ dy, one block per token.
template <class T>
__global__ void layernorm_backward_dx_kernel(const T* x, const T* w, const T* dy, const float* mean_in,
                                             const float* rstd_in, T* dx, int64_t hidden) {
  __shared__ float scratch[32];
  const int64_t row = static_cast<int64_t>(blockIdx.x) * hidden;
  const float mean = mean_in[blockIdx.x], rstd = rstd_in[blockIdx.x];
  float partial_g = 0.0f, partial_g_xhat = 0.0f;
  for (int64_t h = threadIdx.x; h < hidden; h += blockDim.x) {
    const float g = to_f32(w[h]) * to_f32(dy[row + h]);
    partial_g += g;
    partial_g_xhat += g * (to_f32(x[row + h]) - mean) * rstd;
  }
  const float mean_g = block_sum(partial_g, scratch) / static_cast<float>(hidden);
  const float mean_g_xhat = block_sum(partial_g_xhat, scratch) / static_cast<float>(hidden);
  for (int64_t h = threadIdx.x; h < hidden; h += blockDim.x) {
    const float xhat = (to_f32(x[row + h]) - mean) * rstd;
    store_f32(&dx[row + h], layernorm_dx(to_f32(w[h]) * to_f32(dy[row + h]), xhat, rstd, mean_g, mean_g_xhat));
  }
}

// dw += Σ_t dy ⊙ x̂ and db += Σ_t dy: one thread per column, tokens in order, added once.
template <class T>
__global__ void layernorm_backward_dw_db_kernel(const T* x, const T* dy, const float* mean_in, const float* rstd_in,
                                                T* dw, T* db, int64_t tokens, int64_t hidden) {
  for (int64_t h = global_thread(); h < hidden; h += grid_threads()) {
    float sum_w = 0.0f, sum_b = 0.0f;
    for (int64_t t = 0; t < tokens; ++t) {
      const float d = to_f32(dy[t * hidden + h]);
      sum_w += d * (to_f32(x[t * hidden + h]) - mean_in[t]) * rstd_in[t];
      sum_b += d;
    }
    store_f32(&dw[h], to_f32(dw[h]) + sum_w);
    store_f32(&db[h], to_f32(db[h]) + sum_b);
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

// ---- launch sequences (norm_adamw_cuda.cu's, after its argument checks) ----

template <class G>
void launch_adamw(float* master, const G* grad, float* m, float* v, Bf16* param_out, int64_t n,
                  const AdamWScalars& s, cudaStream_t stream) {
  FLATPEAK_LAUNCH(adamw_kernel<G>, grid_for(n), kThreads, 0, stream, master, grad, m, v,
                  param_out, n, s);
}

template <class T>
void launch_embedding_forward(const int32_t* ids, const T* table, T* out, int64_t tokens,
                              int64_t hidden, cudaStream_t stream) {
  FLATPEAK_LAUNCH(embedding_forward_kernel<T>, grid_for(tokens * hidden), kThreads, 0, stream, ids,
                  table, out, tokens, hidden);
}

// One thread per column h (grid-stride), each summing its tokens in order.
template <class T>
void launch_embedding_backward(const int32_t* ids, const T* d_out, T* d_table, int64_t tokens,
                               int64_t hidden, cudaStream_t stream) {
  FLATPEAK_LAUNCH(embedding_backward_kernel<T>, grid_for(hidden), kThreads, 0, stream, ids, d_out,
                  d_table, tokens, hidden);
}

// One block per token (tokens < 2^31, checked by the caller).
template <class T>
void launch_rmsnorm_forward(const T* x, const T* w, T* out, float* rstd, int64_t tokens,
                            int64_t hidden, float eps, cudaStream_t stream) {
  FLATPEAK_LAUNCH(rmsnorm_forward_kernel<T>, static_cast<unsigned>(tokens), kThreads, 0, stream, x,
                  w, out, rstd, hidden, eps);
}

// dx one block per token, then dw one thread per column.
template <class T>
void launch_rmsnorm_backward(const T* x, const T* w, const T* dy, const float* rstd, T* dx, T* dw,
                             int64_t tokens, int64_t hidden, cudaStream_t stream) {
  FLATPEAK_LAUNCH(rmsnorm_backward_dx_kernel<T>, static_cast<unsigned>(tokens), kThreads, 0, stream,
                  x, w, dy, rstd, dx, hidden);
  FLATPEAK_LAUNCH(rmsnorm_backward_dw_kernel<T>, grid_for(hidden), kThreads, 0, stream, x, dy, rstd,
                  dw, tokens, hidden);
}

template <class T>
void launch_layernorm_forward(const T* x, const T* w, const T* b, T* out, float* mean, float* rstd, int64_t tokens,
                              int64_t hidden, float eps, cudaStream_t stream) {
  FLATPEAK_LAUNCH(layernorm_forward_kernel<T>, static_cast<unsigned>(tokens), kThreads, 0, stream, x, w, b, out, mean,
                  rstd, hidden, eps);
}

// dx one block per token, then dw and db one thread per column.
template <class T>
void launch_layernorm_backward(const T* x, const T* w, const T* dy, const float* mean, const float* rstd, T* dx, T* dw,
                               T* db, int64_t tokens, int64_t hidden, cudaStream_t stream) {
  FLATPEAK_LAUNCH(layernorm_backward_dx_kernel<T>, static_cast<unsigned>(tokens), kThreads, 0, stream, x, w, dy, mean,
                  rstd, dx, hidden);
  FLATPEAK_LAUNCH(layernorm_backward_dw_db_kernel<T>, grid_for(hidden), kThreads, 0, stream, x, dy, mean, rstd, dw, db,
                  tokens, hidden);
}

// One thread per token, in blocks of 128.
inline void launch_router_forward(const float* logits, int32_t* topk_ids, float* topk_weights,
                                  int64_t tokens, int64_t experts, int64_t top_k,
                                  cudaStream_t stream) {
  FLATPEAK_LAUNCH(router_forward_kernel, grid_for(tokens, 128), 128, 0, stream, logits, topk_ids,
                  topk_weights, tokens, experts, top_k);
}

inline void launch_router_backward(const int32_t* topk_ids, const float* topk_weights,
                                   const float* d_topk_weights, float* d_logits, int64_t tokens,
                                   int64_t experts, int64_t top_k, cudaStream_t stream) {
  FLATPEAK_LAUNCH(router_backward_kernel, grid_for(tokens, 128), 128, 0, stream, topk_ids,
                  topk_weights, d_topk_weights, d_logits, tokens, experts, top_k);
}

}  // namespace
}  // namespace flatpeak::exec::cuda_detail
