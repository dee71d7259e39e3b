// The kernels of the dispatch schedule on the GPU (internal to executor/cuda): the softmax over a
// token's kept router logits, and per round of sorted rows [r0, r0 + n) the gather into the round
// buffer, the weighted combine into an fp32 accumulator (atomics), its backward (one block per
// row: d_y and the block-summed d prob) and the scatter-add of d_in; then fp32 → bf16.
// dispatch_schedule_cuda.cu calls the launch functions at the end;
// tests/unit/executor_dispatch_schedule_emulation_test.cpp runs the same ones on the host
// (FLATPEAK_CUDA_EMULATION, tests/unit/cuda_emulation.h) against the CPU ops (router, permute,
// combine), without a GPU.
//   #include "executor/cuda/dispatch_schedule_kernels.cuh"
//   launch_gather_round(x, topk_w, row_to_slot, r0, n, H, k, in, prob, stream);
#pragma once

#include <cmath>
#include <cstdint>

#include "executor/cuda/kernel_util.cuh"
#include "executor/ops/dtype.h"

// One translation unit per binary includes this header (the kernels have internal linkage).
namespace flatpeak::exec::cuda_detail {
namespace {

// topk_w[t, s] = softmax over the token's kept router logits (the CPU's renormalised weights).
__global__ void kept_softmax_kernel(const float* logits, const int32_t* ids, float* w, int64_t T,
                                    int64_t E, int64_t k) {
  for (int64_t t = global_thread(); t < T; t += grid_threads()) {
    float m = -INFINITY;
    for (int64_t s = 0; s < k; ++s) m = fmaxf(m, logits[t * E + ids[t * k + s]]);
    float sum = 0.0f;
    for (int64_t s = 0; s < k; ++s) sum += expf(logits[t * E + ids[t * k + s]] - m);
    for (int64_t s = 0; s < k; ++s) w[t * k + s] = expf(logits[t * E + ids[t * k + s]] - m) / sum;
  }
}

// in[i] = x[token of sorted row r0 + i], prob[i] = its router weight, for i < n.
__global__ void gather_round_kernel(const Bf16* x, const float* topk_w, const int32_t* row_to_slot,
                                    int64_t r0, int64_t n, int64_t H, int64_t k, Bf16* in, float* prob) {
  for (int64_t i = global_thread(); i < n * H; i += grid_threads()) {
    const int64_t r = i / H, h = i % H;
    const int64_t slot = row_to_slot[r0 + r];
    in[i] = x[(slot / k) * H + h];
    if (h == 0) prob[r] = topk_w[slot];
  }
}

// acc[token] += prob · y[i] (fp32 atomics: a token's rows may sit in one round).
__global__ void combine_round_kernel(const Bf16* y, const float* prob, const int32_t* row_to_slot,
                                     int64_t r0, int64_t n, int64_t H, int64_t k, float* acc) {
  for (int64_t i = global_thread(); i < n * H; i += grid_threads()) {
    const int64_t r = i / H, h = i % H;
    const int64_t t = row_to_slot[r0 + r] / k;
    atomicAdd(&acc[t * H + h], prob[r] * exec::to_f32(y[i]));
  }
}

// Per round row (one block): d_y = prob · d_out[token] (bf16) and d prob = d_out[token] · y.
__global__ void combine_backward_round_kernel(const Bf16* d_out, const Bf16* y, const float* prob,
                                              const int32_t* row_to_slot, int64_t r0, int64_t H,
                                              int64_t k, Bf16* d_y, float* d_topk_w) {
  __shared__ float scratch[32];
  const int64_t r = blockIdx.x;
  const int64_t slot = row_to_slot[r0 + r];
  const Bf16* g = d_out + (slot / k) * H;
  float dot = 0.0f;
  for (int64_t h = threadIdx.x; h < H; h += blockDim.x) {
    const float gh = exec::to_f32(g[h]);
    d_y[r * H + h] = exec::f32_to_bf16(prob[r] * gh);
    dot += gh * exec::to_f32(y[r * H + h]);
  }
  dot = exec::cuda_detail::block_sum(dot, scratch);
  if (threadIdx.x == 0) d_topk_w[slot] = dot;
}

// d_x[token] += d_in[i] (fp32 atomics).
__global__ void scatter_add_round_kernel(const Bf16* d_in, const int32_t* row_to_slot, int64_t r0,
                                         int64_t n, int64_t H, int64_t k, float* d_x) {
  for (int64_t i = global_thread(); i < n * H; i += grid_threads()) {
    const int64_t r = i / H, h = i % H;
    atomicAdd(&d_x[(row_to_slot[r0 + r] / k) * H + h], exec::to_f32(d_in[i]));
  }
}

__global__ void f32_to_bf16_kernel(const float* src, Bf16* dst, int64_t n) {
  for (int64_t i = global_thread(); i < n; i += grid_threads()) dst[i] = exec::f32_to_bf16(src[i]);
}

// ---- launches (dispatch_schedule_cuda.cu's) ----

inline void launch_kept_softmax(const float* logits, const int32_t* ids, float* w, int64_t T,
                                int64_t E, int64_t k, cudaStream_t stream) {
  FLATPEAK_LAUNCH(kept_softmax_kernel, grid_for(T), kThreads, 0, stream, logits, ids, w, T, E, k);
}
inline void launch_gather_round(const Bf16* x, const float* topk_w, const int32_t* row_to_slot,
                                int64_t r0, int64_t n, int64_t H, int64_t k, Bf16* in, float* prob,
                                cudaStream_t stream) {
  FLATPEAK_LAUNCH(gather_round_kernel, grid_for(n * H), kThreads, 0, stream, x, topk_w,
                  row_to_slot, r0, n, H, k, in, prob);
}
inline void launch_combine_round(const Bf16* y, const float* prob, const int32_t* row_to_slot,
                                 int64_t r0, int64_t n, int64_t H, int64_t k, float* acc,
                                 cudaStream_t stream) {
  FLATPEAK_LAUNCH(combine_round_kernel, grid_for(n * H), kThreads, 0, stream, y, prob, row_to_slot,
                  r0, n, H, k, acc);
}
// One block per round row; none for an empty round.
inline void launch_combine_backward_round(const Bf16* d_out, const Bf16* y, const float* prob,
                                          const int32_t* row_to_slot, int64_t r0, int64_t n,
                                          int64_t H, int64_t k, Bf16* d_y, float* d_topk_w,
                                          cudaStream_t stream) {
  if (n <= 0) return;
  FLATPEAK_LAUNCH(combine_backward_round_kernel, static_cast<unsigned>(n), kThreads, 0, stream,
                  d_out, y, prob, row_to_slot, r0, H, k, d_y, d_topk_w);
}
inline void launch_scatter_add_round(const Bf16* d_in, const int32_t* row_to_slot, int64_t r0,
                                     int64_t n, int64_t H, int64_t k, float* d_x,
                                     cudaStream_t stream) {
  FLATPEAK_LAUNCH(scatter_add_round_kernel, grid_for(n * H), kThreads, 0, stream, d_in, row_to_slot,
                  r0, n, H, k, d_x);
}
inline void launch_f32_to_bf16(const float* src, Bf16* dst, int64_t n, cudaStream_t stream) {
  FLATPEAK_LAUNCH(f32_to_bf16_kernel, grid_for(n), kThreads, 0, stream, src, dst, n);
}

}  // namespace
}  // namespace flatpeak::exec::cuda_detail
