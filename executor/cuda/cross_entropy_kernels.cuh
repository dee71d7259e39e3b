// The cross-entropy kernels (internal to executor/cuda): the blocked online log-sum-exp steps
// (init_rows, fold_block, finish_rows), the blocked backward's dlogits and the dX store, and the
// materialised baseline's log_softmax_rows and materialized_dlogits. All fp32 arithmetic with the
// CPU twin's shared lse_fold and cross_entropy_dlogit; "one block per row" kernels take a row per
// blockIdx.x and stride its columns by blockDim.x (a multiple of 32: block_max/block_sum).
// The launch sequences at the end (grids, order, the GEMMs between as callables) are what
// cross_entropy_cuda.cu runs; tests/unit/executor_cross_entropy_emulation_test.cpp runs the same
// sequences on the host (FLATPEAK_CUDA_EMULATION, tests/unit/cuda_emulation.h) against the CPU op.
//   #include "executor/cuda/cross_entropy_kernels.cuh"
//   blocked_forward_block(logits, row_max, row_sum, target_logit, targets, lse, loss, tb, V, Vb, stream, gemm);
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "executor/cuda/kernel_util.cuh"
#include "executor/ops/cross_entropy.h"
#include "executor/ops/dtype.h"

// One translation unit per binary includes this header (the kernels have internal linkage).
namespace flatpeak::exec::cuda_detail {
namespace {

// ---- blocked (online log-sum-exp over vocab blocks) ----

__global__ void init_rows_kernel(float* row_max, float* row_sum, float* target_logit, int64_t rows) {
  for (int64_t r = global_thread(); r < rows; r += grid_threads()) {
    row_max[r] = -INFINITY;
    row_sum[r] = 0.0f;
    target_logit[r] = 0.0f;
  }
}

// One block per row of the logits block: (block max, Σ e^(z − max)) folded into the running pair.
__global__ void fold_block_kernel(const float* logits, int64_t vb, int64_t v0, const int32_t* targets,
                                  float* row_max, float* row_sum, float* target_logit) {
  __shared__ float scratch[32];
  const int64_t r = blockIdx.x;
  const float* z = logits + r * vb;
  float m = -INFINITY;
  for (int64_t c = threadIdx.x; c < vb; c += blockDim.x) m = fmaxf(m, z[c]);
  const float bmax = block_max(m, scratch);
  float s = 0.0f;
  for (int64_t c = threadIdx.x; c < vb; c += blockDim.x) s += expf(z[c] - bmax);
  const float bsum = block_sum(s, scratch);
  if (threadIdx.x == 0) {
    lse_fold(row_max[r], row_sum[r], bmax, bsum);
    const int64_t y = targets[r];
    if (y >= v0 && y < v0 + vb) target_logit[r] = z[y - v0];
  }
}

__global__ void finish_rows_kernel(const float* row_max, const float* row_sum,
                                   const float* target_logit, const int32_t* targets, float* lse,
                                   float* loss, int64_t rows) {
  for (int64_t r = global_thread(); r < rows; r += grid_threads()) {
    const float l = row_max[r] + logf(row_sum[r]);
    lse[r] = l;
    loss[r] = targets[r] >= 0 ? l - target_logit[r] : 0.0f;
  }
}

// dz = g · (e^(z − lse) − onehot), 0 for ignored tokens, rounded once to the compute dtype. One
// block per row of the block: no 64-bit division per element.
template <class T>
__global__ void dlogits_kernel(const float* logits, T* dz, int64_t vb, int64_t v0,
                               const int32_t* targets, const float* lse, float g) {
  const int64_t r = blockIdx.x;
  const int64_t y = targets[r];
  const float l = lse[r];
  for (int64_t c = threadIdx.x; c < vb; c += blockDim.x) {
    const int64_t i = r * vb + c;
    store_f32(&dz[i], y < 0 ? 0.0f : cross_entropy_dlogit(logits[i], l, v0 + c == y, g));
  }
}

template <class T>
__global__ void store_kernel(const float* src, T* dst, int64_t n) {
  for (int64_t i = global_thread(); i < n; i += grid_threads()) store_f32(&dst[i], src[i]);
}

// ---- the LM head's bias (both schedules) ----

// out[r, c] = bias[c] over [rows, cols]: the logits GEMM then adds x·Wᵀ into it (beta = 1) and rounds
// once, as the CPU op does.
template <class Tb, class To>
__global__ void broadcast_bias_kernel(const Tb* bias, To* out, int64_t rows, int64_t cols) {
  for (int64_t i = global_thread(); i < rows * cols; i += grid_threads()) store_f32(&out[i], to_f32(bias[i % cols]));
}

// One thread per column: d_bias[c] (+)= Σ_r dz[r, c], the sum in fp32 over the rows in order (the
// CPU's order). Adjacent threads read adjacent columns.
template <class Tz, class To>
__global__ void bias_grad_kernel(const Tz* dz, int64_t rows, int64_t cols, To* d_bias, bool accumulate) {
  for (int64_t c = global_thread(); c < cols; c += grid_threads()) {
    float sum = 0.0f;
    for (int64_t r = 0; r < rows; ++r) sum += to_f32(dz[r * cols + c]);
    store_f32(&d_bias[c], accumulate ? to_f32(d_bias[c]) + sum : sum);
  }
}

// ---- materialised (the naive baseline) ----

// One block per token row: max and Σ e^(z − max) over the stored logits, then the fp32 log-probs.
template <class T>
__global__ void log_softmax_rows_kernel(const T* logits, float* log_probs, const int32_t* targets,
                                        float* lse, float* loss, int64_t V) {
  __shared__ float scratch[32];
  const int64_t t = blockIdx.x;
  const T* z = logits + t * V;
  float* lp = log_probs + t * V;
  float m = -INFINITY;
  for (int64_t j = threadIdx.x; j < V; j += blockDim.x) m = fmaxf(m, to_f32(z[j]));
  const float row_max = block_max(m, scratch);
  float s = 0.0f;
  for (int64_t j = threadIdx.x; j < V; j += blockDim.x) s += expf(to_f32(z[j]) - row_max);
  const float l = row_max + logf(block_sum(s, scratch));
  for (int64_t j = threadIdx.x; j < V; j += blockDim.x) lp[j] = to_f32(z[j]) - l;
  if (threadIdx.x == 0) {
    lse[t] = l;
    const int64_t y = targets[t];
    // l − z_y, not −lp[y]: lp[y] may have been written by another thread (no barrier since), and
    // fl(l − z) = −fl(z − l), so this is the CPU's −lp[y] bit for bit.
    loss[t] = (y >= 0 && y < V) ? l - to_f32(z[y]) : 0.0f;
  }
}

// d_logits = g · (e^lp − onehot) in fp32, and its compute-dtype rounding into dz (the GEMM
// operand). One block per token row: no 64-bit division per element over T·V elements.
template <class T>
__global__ void materialized_dlogits_kernel(const float* log_probs, float* d_logits, T* dz,
                                            const int32_t* targets, int64_t V, float g) {
  const int64_t t = blockIdx.x;
  const int64_t y = targets[t];
  const int64_t base = t * V;
  for (int64_t j = threadIdx.x; j < V; j += blockDim.x) {
    const float d = y < 0 ? 0.0f : g * (expf(log_probs[base + j]) - (j == y ? 1.0f : 0.0f));
    d_logits[base + j] = d;
    store_f32(&dz[base + j], d);
  }
}

// ---- launches ----

// The online steps one launch each (also cross_entropy_blocks_cuda.h's, for the vocab schedules).
inline void launch_init_rows(float* row_max, float* row_sum, float* target_logit, int64_t rows,
                             cudaStream_t stream) {
  FLATPEAK_LAUNCH(init_rows_kernel, grid_for(rows), kThreads, 0, stream, row_max, row_sum,
                  target_logit, rows);
}
// One block per row of logits [rows, vb] (rows < 2^31).
inline void launch_fold_block(const float* logits, int64_t rows, int64_t vb, int64_t v0,
                              const int32_t* targets, float* row_max, float* row_sum,
                              float* target_logit, cudaStream_t stream) {
  FLATPEAK_LAUNCH(fold_block_kernel, static_cast<unsigned>(rows), kThreads, 0, stream, logits, vb,
                  v0, targets, row_max, row_sum, target_logit);
}
inline void launch_finish_rows(const float* row_max, const float* row_sum,
                               const float* target_logit, const int32_t* targets, float* lse,
                               float* loss, int64_t rows, cudaStream_t stream) {
  FLATPEAK_LAUNCH(finish_rows_kernel, grid_for(rows), kThreads, 0, stream, row_max, row_sum,
                  target_logit, targets, lse, loss, rows);
}
// One block per row of logits [rows, vb] → dz [rows, vb] (T).
template <class T>
void launch_dlogits(const float* logits, T* dz, int64_t rows, int64_t vb, int64_t v0,
                    const int32_t* targets, const float* lse, float grad_scale,
                    cudaStream_t stream) {
  FLATPEAK_LAUNCH(dlogits_kernel<T>, static_cast<unsigned>(rows), kThreads, 0, stream, logits, dz,
                  vb, v0, targets, lse, grad_scale);
}

// The head bias's two steps (no-ops without a bias).
template <class Tb, class To>
void launch_broadcast_bias(const Tb* bias, To* out, int64_t rows, int64_t cols, cudaStream_t stream) {
  if (bias == nullptr || rows <= 0 || cols <= 0) return;
  FLATPEAK_LAUNCH((broadcast_bias_kernel<Tb, To>), grid_for(rows * cols), kThreads, 0, stream, bias, out, rows, cols);
}
template <class Tz, class To>
void launch_bias_grad(const Tz* dz, int64_t rows, int64_t cols, To* d_bias, bool accumulate, cudaStream_t stream) {
  if (d_bias == nullptr || cols <= 0) return;
  FLATPEAK_LAUNCH((bias_grad_kernel<Tz, To>), grid_for(cols), kThreads, 0, stream, dz, rows, cols, d_bias, accumulate);
}

// The blocked forward of one token block of tb rows: the running (max, sum) initialised, then per
// vocab block logits_gemm(v0, vb) fills logits [tb, vb] fp32 and fold_block folds it in; then lse
// and loss. targets, lse and loss point at the block's first token.
template <class LogitsGemm>
void blocked_forward_block(const float* logits, float* row_max, float* row_sum, float* target_logit,
                           const int32_t* targets, float* lse, float* loss, int64_t tb,
                           int64_t vocab, int64_t vocab_block_rows, cudaStream_t stream,
                           LogitsGemm logits_gemm) {
  launch_init_rows(row_max, row_sum, target_logit, tb, stream);
  for (int64_t v0 = 0; v0 < vocab; v0 += vocab_block_rows) {
    const int64_t vb = std::min(vocab_block_rows, vocab - v0);
    logits_gemm(v0, vb);
    launch_fold_block(logits, tb, vb, v0, targets, row_max, row_sum, target_logit, stream);
  }
  launch_finish_rows(row_max, row_sum, target_logit, targets, lse, loss, tb, stream);
}

// The blocked backward of one token block (dx_acc [tb, H] fp32 zeroed before): per vocab block
// logits_gemm(v0, vb) refills logits [tb, vb], dlogits_kernel turns it into dz [tb, vb] (T), and
// grad_gemms(v0, vb) adds dz · W_blk into dx_acc and dzᵀ · X_blk into d_w; then dx_acc is stored
// into d_x [tb, H] (T). targets, lse and d_x point at the block's first token.
template <class T, class LogitsGemm, class GradGemms>
void blocked_backward_block(const float* logits, T* dz, const float* dx_acc, T* d_x,
                            const int32_t* targets, const float* lse, float grad_scale, int64_t tb,
                            int64_t hidden, int64_t vocab, int64_t vocab_block_rows,
                            cudaStream_t stream, LogitsGemm logits_gemm, GradGemms grad_gemms) {
  for (int64_t v0 = 0; v0 < vocab; v0 += vocab_block_rows) {
    const int64_t vb = std::min(vocab_block_rows, vocab - v0);
    logits_gemm(v0, vb);
    launch_dlogits(logits, dz, tb, vb, v0, targets, lse, grad_scale, stream);
    grad_gemms(v0, vb);
  }
  FLATPEAK_LAUNCH(store_kernel<T>, grid_for(tb * hidden), kThreads, 0, stream, dx_acc, d_x,
                  tb * hidden);
}

// The materialised forward after its logits GEMM: one block per token over logits [T, V] (T).
template <class T>
void materialized_log_softmax(const T* logits, float* log_probs, const int32_t* targets,
                              float* lse, float* loss, int64_t tokens, int64_t vocab,
                              cudaStream_t stream) {
  FLATPEAK_LAUNCH(log_softmax_rows_kernel<T>, static_cast<unsigned>(tokens), kThreads, 0, stream,
                  logits, log_probs, targets, lse, loss, vocab);
}

// The materialised backward before its two GEMMs: d_logits [T, V] fp32 and dz [T, V] (T).
template <class T>
void materialized_dlogits(const float* log_probs, float* d_logits, T* dz, const int32_t* targets,
                          int64_t tokens, int64_t vocab, float grad_scale, cudaStream_t stream) {
  FLATPEAK_LAUNCH(materialized_dlogits_kernel<T>, static_cast<unsigned>(tokens), kThreads, 0,
                  stream, log_probs, d_logits, dz, targets, vocab, grad_scale);
}

}  // namespace
}  // namespace flatpeak::exec::cuda_detail
