// The elementwise kernels of the expert FFN on the GPU (internal to executor/cuda): widen to fp32,
// store (round once) and add (dW += the fp32 sum, rounded once) in the storage dtype, and the
// SwiGLU forward and backward on the stored gate_up with the CPU twin's silu_f32 / silu_grad_f32.
// expert_ffn_cuda.cu launches them between its cuBLAS GEMMs through the launch functions at the
// end; tests/unit/executor_expert_ffn_emulation_test.cpp runs the same functions on the host
// (FLATPEAK_CUDA_EMULATION, tests/unit/cuda_emulation.h) against the CPU's formulas.
//   launch_swiglu(gate_up, h, n, F, stream);  // h [n, F] fp32 from gate_up [n, 2F]
#pragma once

#include <cstdint>

#include "executor/cuda/kernel_util.cuh"
#include "executor/ops/dtype.h"
#include "executor/ops/expert_ffn.h"

// One translation unit per binary includes this header (the kernels have internal linkage).
namespace flatpeak::exec::cuda_detail {
namespace {

template <class T>
__global__ void widen_kernel(const T* src, float* dst, int64_t n) {
  for (int64_t i = global_thread(); i < n; i += grid_threads()) dst[i] = to_f32(src[i]);
}

template <class T>
__global__ void store_kernel(const float* src, T* dst, int64_t n) {
  for (int64_t i = global_thread(); i < n; i += grid_threads()) store_f32(&dst[i], src[i]);
}

template <class T>
__global__ void add_kernel(const float* src, T* dst, int64_t n) {
  for (int64_t i = global_thread(); i < n; i += grid_threads()) store_f32(&dst[i], to_f32(dst[i]) + src[i]);
}

// h = silu(gate) ⊙ up from the stored (rounded) gate_up, as the CPU reads it.
template <class T>
__global__ void swiglu_kernel(const T* gate_up, float* h, int64_t n, int64_t F) {
  for (int64_t i = global_thread(); i < n * F; i += grid_threads()) {
    const int64_t r = i / F;
    const int64_t f = i % F;
    h[i] = silu_f32(to_f32(gate_up[r * 2 * F + f])) * to_f32(gate_up[r * 2 * F + F + f]);
  }
}

// dgu holds dh in its gate half; turns it into d[gate | up].
template <class T>
__global__ void swiglu_backward_kernel(const T* gate_up, float* dgu, int64_t n, int64_t F) {
  for (int64_t i = global_thread(); i < n * F; i += grid_threads()) {
    const int64_t r = i / F;
    const int64_t f = i % F;
    const float g = to_f32(gate_up[r * 2 * F + f]);
    const float u = to_f32(gate_up[r * 2 * F + F + f]);
    const float dh = dgu[r * 2 * F + f];
    dgu[r * 2 * F + f] = dh * u * silu_grad_f32(g);
    dgu[r * 2 * F + F + f] = dh * silu_f32(g);
  }
}

// ---- launches (expert_ffn_cuda.cu's): grid_for(count) blocks of kThreads, none for count 0 ----

template <class K, class... Args>
void launch_elementwise(K kernel, int64_t count, cudaStream_t stream, Args... args) {
  if (count == 0) return;
  FLATPEAK_LAUNCH(kernel, grid_for(count), kThreads, 0, stream, args...);
}

template <class T>
void launch_widen(const T* src, float* dst, int64_t n, cudaStream_t stream) {
  launch_elementwise(widen_kernel<T>, n, stream, src, dst, n);
}
template <class T>
void launch_store(const float* src, T* dst, int64_t n, cudaStream_t stream) {
  launch_elementwise(store_kernel<T>, n, stream, src, dst, n);
}
template <class T>
void launch_add(const float* src, T* dst, int64_t n, cudaStream_t stream) {
  launch_elementwise(add_kernel<T>, n, stream, src, dst, n);
}
// One thread per (row, f): n · F, not the n · 2F of gate_up.
template <class T>
void launch_swiglu(const T* gate_up, float* h, int64_t n, int64_t F, cudaStream_t stream) {
  launch_elementwise(swiglu_kernel<T>, n * F, stream, gate_up, h, n, F);
}
template <class T>
void launch_swiglu_backward(const T* gate_up, float* dgu, int64_t n, int64_t F, cudaStream_t stream) {
  launch_elementwise(swiglu_backward_kernel<T>, n * F, stream, gate_up, dgu, n, F);
}

}  // namespace
}  // namespace flatpeak::exec::cuda_detail
