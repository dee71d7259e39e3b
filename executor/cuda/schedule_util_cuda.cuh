// Deterministic inputs for the CUDA schedules, filled on the device (internal): the same
// (seed, index) → value functions as executor/schedules/schedule_util.h, so a CUDA schedule and
// its CPU twin see the same X, W and targets without generating gigabytes on the host.
//   fill_bf16_cuda(x, n, seed, 1.0f, stream);   fill_targets_cuda(y, T, V, seed, stream);
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "executor/cuda/cuda_check.h"
#include "executor/cuda/cuda_raii.h"
#include "executor/cuda/kernel_util.cuh"
#include "executor/cuda/schedule_fill_kernels.cuh"
#include "executor/ops/dtype.h"

namespace flatpeak::exec::cuda_detail {

inline void fill_bf16_cuda(Bf16* p, int64_t n, uint64_t seed, float scale, cudaStream_t stream, uint64_t first_index = 0) {
  if (n <= 0) return;
  fill_bf16_kernel<Bf16><<<grid_for(n), kThreads, 0, stream>>>(p, n, seed, scale, first_index);
  FLATPEAK_CUDA_CHECK_LAUNCH();
}

inline void fill_targets_cuda(int32_t* p, int64_t n, int64_t vocab, uint64_t seed, cudaStream_t stream,
                              uint64_t first_index = 0) {
  if (n <= 0) return;
  fill_targets_kernel<int32_t><<<grid_for(n), kThreads, 0, stream>>>(p, n, vocab, seed, first_index);
  FLATPEAK_CUDA_CHECK_LAUNCH();
}

// Seconds between two events recorded on the device (both complete).
inline double event_seconds(cudaEvent_t start, cudaEvent_t stop) {
  float ms = 0.0f;
  FLATPEAK_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
  return static_cast<double>(ms) / 1000.0;
}

}  // namespace flatpeak::exec::cuda_detail
