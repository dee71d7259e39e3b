// Deterministic inputs for the CUDA schedules, filled on the device (internal): the same
// (seed, index) → value functions as executor/schedules/schedule_util.h, so a CUDA schedule and
// its CPU twin see the same X, W and targets without generating gigabytes on the host. The fills
// and their launches are in schedule_fill_kernels.cuh.
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

// Seconds between two events recorded on the device (both complete).
inline double event_seconds(cudaEvent_t start, cudaEvent_t stop) {
  float ms = 0.0f;
  FLATPEAK_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
  return static_cast<double>(ms) / 1000.0;
}

}  // namespace flatpeak::exec::cuda_detail
