// The kernels of the checkpoint schedule on the GPU (internal to executor/cuda): the CPU
// schedule's element-wise loops (residual and gradient sums, norm weights from the seed, the
// loss's gradient) and the loss's squared error, summed per block in fp64 for the host to add in
// block order. checkpoint_schedule_cuda.cu calls the launch functions at the end;
// tests/unit/executor_checkpoint_schedule_emulation_test.cpp runs the same ones on the host
// (FLATPEAK_CUDA_EMULATION, tests/unit/cuda_emulation.h) against the CPU schedule's loops.
//   launch_squared_error(x_final, target, loss_partials, T * H, stream);  // [kLossBlocks] fp64
#pragma once

#include <cstdint>

#include "executor/cuda/kernel_util.cuh"
#include "executor/cuda/schedule_fill_kernels.cuh"
#include "executor/ops/dtype.h"

// One translation unit per binary includes this header (the kernels have internal linkage).
namespace flatpeak::exec::cuda_detail {
namespace {

__global__ void add2_kernel(const Bf16* a, const Bf16* b, Bf16* c, int64_t n) {
  for (int64_t i = global_thread(); i < n; i += grid_threads()) c[i] = exec::f32_to_bf16(exec::to_f32(a[i]) + exec::to_f32(b[i]));
}
// (a + b) + c in fp32, rounded once: the CPU's order for d n1 = from_q + from_k + from_v.
__global__ void add3_kernel(const Bf16* a, const Bf16* b, const Bf16* c, Bf16* out, int64_t n) {
  for (int64_t i = global_thread(); i < n; i += grid_threads())
    out[i] = exec::f32_to_bf16(exec::to_f32(a[i]) + exec::to_f32(b[i]) + exec::to_f32(c[i]));
}
// A norm weight: 1 + 0.1 · uniform(seed, base + i), as make_weights and the final norm. The
// product and the sum are rounded separately, as on the host: nvcc would contract them into one
// fma, which rounds once and can give another bf16 weight than the CPU schedule's.
__global__ void fill_norm_kernel(Bf16* p, int64_t n, uint64_t seed, uint64_t base) {
  for (int64_t i = global_thread(); i < n; i += grid_threads())
    p[i] = exec::f32_to_bf16(
        __fadd_rn(1.0f, __fmul_rn(0.1f, exec::cuda_detail::uniform_pm1_device(seed, base + static_cast<uint64_t>(i)))));
}
// Σ (x − target)² in fp64: each of the kLossBlocks blocks writes its partial sum, which the host
// adds in block order after the step. Atomics would add the blocks' sums in whatever order they
// finish, so the loss's last bits would change from run to run (and SCO vs kept vs naive, which
// must agree bit for bit, would not).
constexpr int kLossBlocks = 256;
__global__ void squared_error_kernel(const Bf16* x, const Bf16* target, double* partials, int64_t n) {
  __shared__ double partial[kThreads];
  double local = 0.0;
  for (int64_t i = global_thread(); i < n; i += grid_threads()) {
    const double diff = static_cast<double>(exec::to_f32(x[i])) - static_cast<double>(exec::to_f32(target[i]));
    local += diff * diff;
  }
  partial[threadIdx.x] = local;
  __syncthreads();
  for (unsigned stride = blockDim.x / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) partial[threadIdx.x] += partial[threadIdx.x + stride];
    __syncthreads();
  }
  if (threadIdx.x == 0) partials[blockIdx.x] = partial[0];
}
__global__ void loss_gradient_kernel(const Bf16* x, const Bf16* target, Bf16* d, int64_t n, float tokens) {
  for (int64_t i = global_thread(); i < n; i += grid_threads())
    d[i] = exec::f32_to_bf16((exec::to_f32(x[i]) - exec::to_f32(target[i])) / tokens);
}

// ---- launches (checkpoint_schedule_cuda.cu's) ----

inline void launch_add2(const Bf16* a, const Bf16* b, Bf16* c, int64_t n, cudaStream_t stream) {
  FLATPEAK_LAUNCH(add2_kernel, grid_for(n), kThreads, 0, stream, a, b, c, n);
}
inline void launch_add3(const Bf16* a, const Bf16* b, const Bf16* c, Bf16* out, int64_t n,
                        cudaStream_t stream) {
  FLATPEAK_LAUNCH(add3_kernel, grid_for(n), kThreads, 0, stream, a, b, c, out, n);
}
inline void launch_fill_norm(Bf16* p, int64_t n, uint64_t seed, uint64_t base, cudaStream_t stream) {
  FLATPEAK_LAUNCH(fill_norm_kernel, grid_for(n), kThreads, 0, stream, p, n, seed, base);
}
// partials [kLossBlocks] fp64, one per block, for the host to add in block order.
inline void launch_squared_error(const Bf16* x, const Bf16* target, double* partials, int64_t n,
                                 cudaStream_t stream) {
  FLATPEAK_LAUNCH(squared_error_kernel, kLossBlocks, kThreads, 0, stream, x, target, partials, n);
}
inline void launch_loss_gradient(const Bf16* x, const Bf16* target, Bf16* d, int64_t n,
                                 float tokens, cudaStream_t stream) {
  FLATPEAK_LAUNCH(loss_gradient_kernel, grid_for(n), kThreads, 0, stream, x, target, d, n, tokens);
}

}  // namespace
}  // namespace flatpeak::exec::cuda_detail
