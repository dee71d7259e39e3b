// CUDA twin of the SwiGLU expert FFN (executor/cpu/expert_ffn_cpu.cpp): per expert, cuBLAS GEMMs
// over its rows of the permuted layout, with the shared silu/silu_grad per element. Every GEMM
// runs on fp32 operands (bf16 blocks widened into the workspace), as the CPU's gemm_cpu mixes
// fp32 activations with bf16 weights; outputs are rounded once, accumulations (dW +=) add an fp32
// sum to the stored value once, as on the CPU.
#include <algorithm>

#include "executor/cpu/op_util.h"
#include "executor/cuda/cuda_check.h"
#include "executor/cuda/kernel_util.cuh"
#include "executor/cuda/ops_cuda.h"

namespace flatpeak::exec {
namespace {

using cuda_detail::global_thread;
using cuda_detail::grid_for;
using cuda_detail::grid_threads;
using cuda_detail::kThreads;

// fp32 workspace, n = the busiest expert's rows: rows [n, H] (x or dy widened), weight [2F, H]
// (W_gate_up[e] or W_down[e] widened), gu [n, 2F] (gate_up or its gradient), h [n, F],
// result [max(n, 2F) · H] (a GEMM's fp32 output before it is stored or added).
struct Workspace {
  float* rows;
  float* weight;
  float* gu;
  float* h;
  float* result;
};

int64_t max_rows_of(const ExpertFfnArgs& a) {
  int64_t n = 0;
  for (int64_t e = 0; e < a.experts; ++e) n = std::max(n, a.expert_counts[e]);
  return n;
}

int64_t workspace_elems(const ExpertFfnArgs& a, int64_t n) {
  const int64_t H = a.hidden, F = a.ffn;
  return n * H + 2 * F * H + n * 2 * F + n * F + std::max(n, 2 * F) * H;
}

Workspace carve(const ExpertFfnArgs& a, int64_t n) {
  const int64_t H = a.hidden, F = a.ffn;
  Workspace ws{};
  ws.rows = a.workspace;
  ws.weight = ws.rows + n * H;
  ws.gu = ws.weight + 2 * F * H;
  ws.h = ws.gu + n * 2 * F;
  ws.result = ws.h + n * F;
  return ws;
}

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

template <class K, class... Args>
void launch(K kernel, int64_t n, cudaStream_t stream, Args... args) {
  if (n == 0) return;
  kernel<<<grid_for(n), kThreads, 0, stream>>>(args...);
  FLATPEAK_CUDA_CHECK_LAUNCH();
}

// fp32 C [M, N] = op(A) · op(B) on the workspace, never accumulating.
void gemm_f32(const cuda::CublasContext& blas, bool ta, bool tb, int64_t M, int64_t N, int64_t K,
              const float* A, int64_t lda, const float* B, int64_t ldb, float* C, int64_t ldc) {
  cuda::gemm_cuda(blas, ta, tb, M, N, K, 1.0f, DType::F32, A, lda, DType::F32, B, ldb, false,
                  DType::F32, C, ldc);
}

template <class T>
void forward(const ExpertFfnArgs& a, const cuda::CublasContext& blas) {
  const int64_t H = a.hidden, F = a.ffn;
  cudaStream_t s = blas.stream();
  const Workspace ws = carve(a, max_rows_of(a));
  const T* x = static_cast<const T*>(a.x);
  const T* wgu = static_cast<const T*>(a.w_gate_up);
  const T* wd = static_cast<const T*>(a.w_down);
  T* gu = static_cast<T*>(a.gate_up);
  T* out = static_cast<T*>(a.out);
  int64_t row0 = 0;
  for (int64_t e = 0; e < a.experts; ++e) {
    const int64_t n = a.expert_counts[e];
    if (n > 0) {
      launch(widen_kernel<T>, n * H, s, x + row0 * H, ws.rows, n * H);
      launch(widen_kernel<T>, 2 * F * H, s, wgu + e * 2 * F * H, ws.weight, 2 * F * H);
      gemm_f32(blas, false, true, n, 2 * F, H, ws.rows, H, ws.weight, H, ws.gu, 2 * F);
      launch(store_kernel<T>, n * 2 * F, s, static_cast<const float*>(ws.gu), gu + row0 * 2 * F, n * 2 * F);
      launch(swiglu_kernel<T>, n * F, s, static_cast<const T*>(gu + row0 * 2 * F), ws.h, n, F);
      launch(widen_kernel<T>, H * F, s, wd + e * H * F, ws.weight, H * F);
      gemm_f32(blas, false, true, n, H, F, ws.h, F, ws.weight, F, ws.result, H);
      launch(store_kernel<T>, n * H, s, static_cast<const float*>(ws.result), out + row0 * H, n * H);
    }
    row0 += n;
  }
}

template <class T>
void backward(const ExpertFfnArgs& a, const cuda::CublasContext& blas) {
  const int64_t H = a.hidden, F = a.ffn;
  cudaStream_t s = blas.stream();
  const Workspace ws = carve(a, max_rows_of(a));
  const T* x = static_cast<const T*>(a.x);
  const T* wgu = static_cast<const T*>(a.w_gate_up);
  const T* wd = static_cast<const T*>(a.w_down);
  const T* gu = static_cast<const T*>(a.gate_up);
  const T* dy = static_cast<const T*>(a.d_out);
  T* dx = static_cast<T*>(a.d_x);
  T* dwgu = static_cast<T*>(a.d_w_gate_up);
  T* dwd = static_cast<T*>(a.d_w_down);
  int64_t row0 = 0;
  for (int64_t e = 0; e < a.experts; ++e) {
    const int64_t n = a.expert_counts[e];
    if (n > 0) {
      const T* gu_e = gu + row0 * 2 * F;
      launch(swiglu_kernel<T>, n * F, s, gu_e, ws.h, n, F);
      launch(widen_kernel<T>, n * H, s, dy + row0 * H, ws.rows, n * H);
      launch(widen_kernel<T>, H * F, s, wd + e * H * F, ws.weight, H * F);
      // dh = dy · W_down [n, F] into the gate half of gu (stride 2F)
      gemm_f32(blas, false, false, n, F, H, ws.rows, H, ws.weight, F, ws.gu, 2 * F);
      // dW_down += dyᵀ · h  [H, F]
      gemm_f32(blas, true, false, H, F, n, ws.rows, H, ws.h, F, ws.result, F);
      launch(add_kernel<T>, H * F, s, static_cast<const float*>(ws.result), dwd + e * H * F, H * F);
      launch(swiglu_backward_kernel<T>, n * F, s, gu_e, ws.gu, n, F);
      // dx = d[gate | up] · W_gate_up [n, H]
      launch(widen_kernel<T>, 2 * F * H, s, wgu + e * 2 * F * H, ws.weight, 2 * F * H);
      gemm_f32(blas, false, false, n, H, 2 * F, ws.gu, 2 * F, ws.weight, H, ws.result, H);
      launch(store_kernel<T>, n * H, s, static_cast<const float*>(ws.result), dx + row0 * H, n * H);
      // dW_gate_up += d[gate | up]ᵀ · x  [2F, H]
      launch(widen_kernel<T>, n * H, s, x + row0 * H, ws.rows, n * H);
      gemm_f32(blas, true, false, 2 * F, H, n, ws.gu, 2 * F, ws.rows, H, ws.result, H);
      launch(add_kernel<T>, 2 * F * H, s, static_cast<const float*>(ws.result),
             dwgu + e * 2 * F * H, 2 * F * H);
    }
    row0 += n;
  }
}

void check(const ExpertFfnArgs& a) {
  require(a.rows >= 0 && a.experts > 0 && a.hidden > 0 && a.ffn > 0, "expert_ffn",
          "need rows >= 0 and experts, hidden, ffn > 0");
  require(a.x && a.expert_counts && a.w_gate_up && a.w_down && a.gate_up, "expert_ffn",
          "needs x, expert_counts, w_gate_up, w_down and gate_up");
  require(a.workspace != nullptr, "expert_ffn", "needs a workspace");
  int64_t total = 0;
  for (int64_t e = 0; e < a.experts; ++e) {
    require(a.expert_counts[e] >= 0, "expert_ffn", "expert_counts must be >= 0");
    total += a.expert_counts[e];
  }
  require(total == a.rows, "expert_ffn", "expert_counts must sum to rows");
}

}  // namespace

int64_t expert_ffn_workspace_bytes_cuda(const ExpertFfnArgs& a) {
  return workspace_elems(a, max_rows_of(a)) * 4;
}

void expert_ffn_forward_cuda(const ExpertFfnArgs& a, const cuda::CublasContext& blas) {
  check(a);
  require(a.out != nullptr, "expert_ffn", "forward needs out");
  dispatch_compute(a.dtype, "expert_ffn", [&](auto tag) { forward<decltype(tag)>(a, blas); });
}

void expert_ffn_backward_cuda(const ExpertFfnArgs& a, const cuda::CublasContext& blas) {
  check(a);
  require(a.d_out && a.d_x && a.d_w_gate_up && a.d_w_down, "expert_ffn",
          "backward needs d_out, d_x, d_w_gate_up and d_w_down");
  dispatch_compute(a.dtype, "expert_ffn", [&](auto tag) { backward<decltype(tag)>(a, blas); });
}

}  // namespace flatpeak::exec
