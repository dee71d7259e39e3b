// Launch helpers and reductions shared by the kernels of executor/cuda (internal).
//   FLATPEAK_LAUNCH(kernel, grid_for(n), kThreads, 0, stream, args...);  // kernel<<<...>>>(args...)
//   float total = block_sum(partial, scratch);  // scratch: __shared__ float[32]
// Kernels written in a .cuh with only these helpers (and dtype.h) also run on the host through
// tests/unit/cuda_emulation.h (FLATPEAK_CUDA_EMULATION), which defines the CUDA names used here.
#pragma once

#ifndef FLATPEAK_CUDA_EMULATION
#include <cuda_runtime.h>

#include "executor/cuda/cuda_check.h"
// Dynamic shared memory (the launch's third argument) as `type name[]`, 16-byte aligned.
#define FLATPEAK_DYNAMIC_SHARED(type, name) extern __shared__ __align__(16) type name[]
#endif

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "executor/ops/dtype.h"

namespace flatpeak::exec::cuda_detail {

constexpr int kThreads = 256;
// Grid-stride loops cover any n; the grid is capped so that huge tensors need no 64-bit grids.
inline unsigned grid_for(int64_t n, int threads = kThreads) {
  const int64_t blocks = (n + threads - 1) / threads;
  const int64_t cap = int64_t{1} << 20;
  const unsigned grid = static_cast<unsigned>(blocks < 1 ? 1 : (blocks > cap ? cap : blocks));
#ifdef FLATPEAK_CUDA_EMULATION
  if (grid > emu::grid_cap()) return emu::grid_cap();  // a test's lower cap
#endif
  return grid;
}

// kernel<<<grid, block, smem, stream>>>(args...), or under the host emulation the same launch run
// at once by emu::launch: the launch sequences in the *_kernels.cuh headers are one code for the
// device and for the emulation tests. Through FLATPEAK_LAUNCH, which checks the launch on a device.
template <class... Params, class... Args>
void launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem_bytes,
                   cudaStream_t stream, Args&&... args) {
#ifdef FLATPEAK_CUDA_EMULATION
  emu::launch(grid, block, smem_bytes, stream, [&] { kernel(args...); });
#else
  kernel<<<grid, block, smem_bytes, stream>>>(args...);
#endif
}

__device__ inline int64_t global_thread() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ inline int64_t grid_threads() { return static_cast<int64_t>(gridDim.x) * blockDim.x; }

__device__ inline float warp_sum(float x) {
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}
__device__ inline float warp_max(float x) {
  for (int offset = 16; offset > 0; offset >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
// scratch: 32 floats of shared memory; the call synchronises the block.
__device__ inline float block_sum(float x, float* scratch) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int warp = static_cast<int>(threadIdx.x / 32);
  const int warps = static_cast<int>(blockDim.x / 32);
  x = warp_sum(x);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  x = lane < warps ? scratch[lane] : 0.0f;
  return warp_sum(x);
}

__device__ inline float block_max(float x, float* scratch) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int warp = static_cast<int>(threadIdx.x / 32);
  const int warps = static_cast<int>(blockDim.x / 32);
  x = warp_max(x);
  __syncthreads();
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  x = lane < warps ? scratch[lane] : -INFINITY;
  return warp_max(x);
}

}  // namespace flatpeak::exec::cuda_detail

// A template kernel with several arguments goes in parentheses: FLATPEAK_LAUNCH((k<A, B>), ...).
#ifdef FLATPEAK_CUDA_EMULATION
#define FLATPEAK_LAUNCH(kernel, grid, block, smem, stream, ...) \
  ::flatpeak::exec::cuda_detail::launch_kernel(kernel, grid, block, smem, stream, __VA_ARGS__)
#else
#define FLATPEAK_LAUNCH(kernel, grid, block, smem, stream, ...)                               \
  do {                                                                                        \
    ::flatpeak::exec::cuda_detail::launch_kernel(kernel, grid, block, smem, stream, __VA_ARGS__); \
    FLATPEAK_CUDA_CHECK_LAUNCH();                                                             \
  } while (0)
#endif
