// The device fill kernels of schedule_util_cuda.cuh and their launches (internal): the same
// (seed, index) → value functions as executor/schedules/schedule_util.h. Kept apart from the
// CUDA-only helpers so that the same launches also run on the host through
// tests/unit/cuda_emulation.h (FLATPEAK_CUDA_EMULATION).
//   fill_bf16_cuda(x, n, seed, 1.0f, stream);   fill_targets_cuda(y, T, V, seed, stream);
#pragma once

#include <cstdint>

#include "executor/cuda/kernel_util.cuh"
#include "executor/ops/dtype.h"

namespace flatpeak::exec::cuda_detail {

// schedule_util.h's mix64 and uniform_pm1, for the device.
__device__ inline uint64_t mix64_device(uint64_t seed, uint64_t index) {
  uint64_t z = seed * 0x9E3779B97F4A7C15ULL + index + 0x632BE59BD9B4E019ULL;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}
__device__ inline float uniform_pm1_device(uint64_t seed, uint64_t index) {
  return static_cast<float>(static_cast<double>(mix64_device(seed, index) >> 11) * 0x1.0p-52 - 1.0);
}

// Templates so that a header kernel is defined once per program however many files include it.
// Element i holds the value of index first_index + i (a rank's slice of a global tensor).
template <class T>
__global__ void fill_bf16_kernel(T* p, int64_t n, uint64_t seed, float scale, uint64_t first_index) {
  for (int64_t i = global_thread(); i < n; i += grid_threads())
    p[i] = f32_to_bf16(scale * uniform_pm1_device(seed, first_index + static_cast<uint64_t>(i)));
}

template <class I>
__global__ void fill_targets_kernel(I* p, int64_t n, int64_t vocab, uint64_t seed, uint64_t first_index) {
  for (int64_t i = global_thread(); i < n; i += grid_threads())
    p[i] = static_cast<I>(mix64_device(seed, first_index + static_cast<uint64_t>(i)) % static_cast<uint64_t>(vocab));
}

// Element i of p [n] bf16 = scale · uniform_pm1(seed, first_index + i).
inline void fill_bf16_cuda(Bf16* p, int64_t n, uint64_t seed, float scale, cudaStream_t stream, uint64_t first_index = 0) {
  if (n <= 0) return;
  FLATPEAK_LAUNCH(fill_bf16_kernel<Bf16>, grid_for(n), kThreads, 0, stream, p, n, seed, scale, first_index);
}

// Element i of p [n] i32 = mix64(seed, first_index + i) % vocab.
inline void fill_targets_cuda(int32_t* p, int64_t n, int64_t vocab, uint64_t seed, cudaStream_t stream,
                              uint64_t first_index = 0) {
  if (n <= 0) return;
  FLATPEAK_LAUNCH(fill_targets_kernel<int32_t>, grid_for(n), kThreads, 0, stream, p, n, vocab, seed, first_index);
}

}  // namespace flatpeak::exec::cuda_detail
