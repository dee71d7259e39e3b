// The reduction kernels of DeviceThreadsCommunicator (internal to executor/cuda): n ranks'
// contributions staged one after another, reduced element by element in rank order as the CPU's
// reduce_in_rank_order (executor/comm/communicator.h). device_threads_comm.cu calls the launch
// function at the end; tests/unit/executor_device_threads_comm_emulation_test.cpp runs the same
// one on the host (FLATPEAK_CUDA_EMULATION, tests/unit/cuda_emulation.h) against
// reduce_in_rank_order.
//   launch_reduce_rank_order(staged, out, count, DType::F32, n, sum, stream);
#pragma once

#include <cstdint>

#include "executor/cuda/kernel_util.cuh"
#include "executor/ops/dtype.h"

// One translation unit per binary includes this header (the kernels have internal linkage).
namespace flatpeak::exec::cuda_detail {
namespace {

// The CPU's reduce_in_rank_order, element by element: acc starts at rank 0's value and adds (or
// takes the max of) ranks 1..n−1 in order, in Acc; the result is rounded once to T.
template <class T, class Acc>
__global__ void reduce_rank_order_kernel(const T* staged, T* out, int64_t count, int n, bool sum) {
  for (int64_t i = global_thread(); i < count; i += grid_threads()) {
    Acc acc = static_cast<Acc>(staged[i]);
    for (int p = 1; p < n; ++p) {
      const Acc v = static_cast<Acc>(staged[static_cast<int64_t>(p) * count + i]);
      acc = sum ? static_cast<Acc>(acc + v) : (acc < v ? v : acc);
    }
    out[i] = static_cast<T>(acc);
  }
}

__global__ void reduce_rank_order_bf16_kernel(const exec::Bf16* staged, exec::Bf16* out, int64_t count, int n,
                                              bool sum) {
  for (int64_t i = global_thread(); i < count; i += grid_threads()) {
    float acc = exec::to_f32(staged[i]);
    for (int p = 1; p < n; ++p) {
      const float v = exec::to_f32(staged[static_cast<int64_t>(p) * count + i]);
      acc = sum ? __fadd_rn(acc, v) : (acc < v ? v : acc);
    }
    out[i] = exec::f32_to_bf16(acc);
  }
}

// staged [n, count] in `dtype` → out [count]: the kernel and accumulator type of the dtype.
inline void launch_reduce_rank_order(const void* staged, void* out, int64_t count, exec::DType dtype,
                                     int n, bool sum, cudaStream_t stream) {
  if (count <= 0) return;
  switch (dtype) {
    case exec::DType::F32:
      FLATPEAK_LAUNCH((reduce_rank_order_kernel<float, float>), grid_for(count), kThreads, 0, stream,
                      static_cast<const float*>(staged), static_cast<float*>(out), count, n, sum);
      break;
    case exec::DType::BF16:
      FLATPEAK_LAUNCH(reduce_rank_order_bf16_kernel, grid_for(count), kThreads, 0, stream,
                      static_cast<const exec::Bf16*>(staged), static_cast<exec::Bf16*>(out), count, n, sum);
      break;
    case exec::DType::I32:
      FLATPEAK_LAUNCH((reduce_rank_order_kernel<int32_t, int64_t>), grid_for(count), kThreads, 0, stream,
                      static_cast<const int32_t*>(staged), static_cast<int32_t*>(out), count, n, sum);
      break;
    case exec::DType::I64:
      FLATPEAK_LAUNCH((reduce_rank_order_kernel<int64_t, int64_t>), grid_for(count), kThreads, 0, stream,
                      static_cast<const int64_t*>(staged), static_cast<int64_t*>(out), count, n, sum);
      break;
  }
}

}  // namespace
}  // namespace flatpeak::exec::cuda_detail
