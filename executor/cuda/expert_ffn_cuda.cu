// CUDA twin of the SwiGLU expert FFN (executor/cpu/expert_ffn_cpu.cpp): per expert, cuBLAS GEMMs
// over its rows of the permuted layout, with the shared silu/silu_grad per element. The GEMMs whose
// operands are both stored tensors run on them as stored, with fp32 accumulation: in bf16 the
// forward's gate_up = x · W_gate_upᵀ and the backward's dh = dy · W_down on tensor cores, as the
// CPU's gemm_cpu multiplies the same bf16 values in fp32. The other four mix the fp32 activations
// of the CPU twin (h, d[gate | up]) with a bf16 tensor; cuBLAS has no fp32 × bf16 GEMM and rounding
// h to bf16 would change the op, so they widen the bf16 operand into the workspace and run on
// tensor cores in TF32: the widened bf16 operand is exact in TF32, h and d[gate | up] are rounded
// to rel 2^-11, eight times finer than the bf16 rounding of every output, so the op stays within
// bf16 storage's tolerance at several times the speed of exact fp32. In f32 storage every operand
// is used as stored and every GEMM is exact fp32, as the CPU's. Every GEMM writes an fp32 result
// to the workspace; outputs are then rounded once, accumulations (dW +=) add that fp32 sum to the
// stored value once, as on the CPU.
#include <algorithm>
#include <type_traits>

#include "executor/cpu/op_util.h"
#include "executor/cuda/cuda_check.h"
#include "executor/cuda/expert_ffn_kernels.cuh"
#include "executor/cuda/kernel_util.cuh"
#include "executor/cuda/ops_cuda.h"

namespace flatpeak::exec {
namespace {

// The launches (expert_ffn_kernels.cuh).
using cuda_detail::launch_add;
using cuda_detail::launch_store;
using cuda_detail::launch_swiglu;
using cuda_detail::launch_swiglu_backward;
using cuda_detail::launch_widen;

// fp32 workspace, n = the busiest expert's rows, each buffer reused once its value is dead:
//   rows   [n, H]    dy, then x, widened (bf16 backward); the forward's out and the backward's dx
//                    before they are stored
//   weight [2F · H]  W_down [H, F] widened (bf16 forward), the dW_down result [H, F], W_gate_up
//                    [2F, H] widened (bf16 backward), the dW_gate_up result [2F, H]
//   gu     [n, 2F]   gate_up before it is stored; in the backward dh, then d[gate | up]
//   h      [n, F]    silu(gate) ⊙ up from the stored gate_up
struct Workspace {
  float* rows;
  float* weight;
  float* gu;
  float* h;
};

int64_t max_rows_of(const ExpertFfnArgs& a) {
  int64_t n = 0;
  for (int64_t e = 0; e < a.experts; ++e) n = std::max(n, a.expert_counts[e]);
  return n;
}

int64_t workspace_elems(int64_t n, int64_t H, int64_t F) { return n * H + 2 * F * H + n * 2 * F + n * F; }

Workspace carve(const ExpertFfnArgs& a, int64_t n) {
  const int64_t H = a.hidden, F = a.ffn;
  Workspace ws{};
  ws.rows = a.workspace;
  ws.weight = ws.rows + n * H;
  ws.gu = ws.weight + 2 * F * H;
  ws.h = ws.gu + n * 2 * F;
  return ws;
}

template <class T>
constexpr DType storage_of() {
  return std::is_same_v<T, float> ? DType::F32 : DType::BF16;
}

// fp32 C [M, N] = op(A) · op(B) on the workspace, never accumulating; A and B stored as `dtype`
// (bf16 on tensor cores; f32 as `math` says), fp32 accumulation.
void gemm_to_f32(const cuda::CublasContext& blas, bool ta, bool tb, int64_t M, int64_t N, int64_t K, DType dtype,
                 const void* A, int64_t lda, const void* B, int64_t ldb, float* C, int64_t ldc,
                 cuda::GemmMath math = cuda::GemmMath::Exact) {
  cuda::gemm_cuda(blas, ta, tb, M, N, K, 1.0f, dtype, A, lda, dtype, B, ldb, false, DType::F32, C, ldc, math);
}

// The GEMMs of an fp32 activation with a widened bf16 tensor: TF32 in bf16 storage (see the top).
template <class T>
constexpr cuda::GemmMath mixed_math() {
  return std::is_same_v<T, float> ? cuda::GemmMath::Exact : cuda::GemmMath::Tf32;
}

// A bf16 operand for a GEMM beside an fp32 one: widened into `scratch`. An f32 one: as stored.
template <class T>
const float* as_f32(const T* src, float* scratch, int64_t count, cudaStream_t stream) {
  if constexpr (std::is_same_v<T, float>) {
    (void)scratch;
    (void)count;
    (void)stream;
    return src;
  } else {
    launch_widen(src, scratch, count, stream);
    return scratch;
  }
}

template <class T>
void forward(const ExpertFfnArgs& a, const cuda::CublasContext& blas) {
  const int64_t H = a.hidden, F = a.ffn;
  constexpr DType kStorage = storage_of<T>();
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
      // gate_up = x · W_gate_upᵀ  [n, 2F]: both stored tensors
      gemm_to_f32(blas, false, true, n, 2 * F, H, kStorage, x + row0 * H, H, wgu + e * 2 * F * H, H, ws.gu, 2 * F);
      launch_store(ws.gu, gu + row0 * 2 * F, n * 2 * F, s);
      launch_swiglu(static_cast<const T*>(gu + row0 * 2 * F), ws.h, n, F, s);
      // out = h · W_downᵀ  [n, H]: fp32 h
      const float* wd_e = as_f32(wd + e * H * F, ws.weight, H * F, s);
      gemm_to_f32(blas, false, true, n, H, F, DType::F32, ws.h, F, wd_e, F, ws.rows, H, mixed_math<T>());
      launch_store(ws.rows, out + row0 * H, n * H, s);
    }
    row0 += n;
  }
}

template <class T>
void backward(const ExpertFfnArgs& a, const cuda::CublasContext& blas) {
  const int64_t H = a.hidden, F = a.ffn;
  constexpr DType kStorage = storage_of<T>();
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
      launch_swiglu(gu_e, ws.h, n, F, s);
      // dh = dy · W_down [n, F] into the gate half of gu (stride 2F): both stored tensors
      gemm_to_f32(blas, false, false, n, F, H, kStorage, dy + row0 * H, H, wd + e * H * F, F, ws.gu, 2 * F);
      // dW_down += dyᵀ · h  [H, F]: fp32 h
      const float* dy_e = as_f32(dy + row0 * H, ws.rows, n * H, s);
      gemm_to_f32(blas, true, false, H, F, n, DType::F32, dy_e, H, ws.h, F, ws.weight, F, mixed_math<T>());
      launch_add(ws.weight, dwd + e * H * F, H * F, s);
      launch_swiglu_backward(gu_e, ws.gu, n, F, s);
      // dx = d[gate | up] · W_gate_up [n, H]: fp32 d[gate | up]
      const float* wgu_e = as_f32(wgu + e * 2 * F * H, ws.weight, 2 * F * H, s);
      gemm_to_f32(blas, false, false, n, H, 2 * F, DType::F32, ws.gu, 2 * F, wgu_e, H, ws.rows, H,
                  mixed_math<T>());
      launch_store(ws.rows, dx + row0 * H, n * H, s);
      // dW_gate_up += d[gate | up]ᵀ · x  [2F, H]: fp32 d[gate | up]
      const float* x_e = as_f32(x + row0 * H, ws.rows, n * H, s);
      gemm_to_f32(blas, true, false, 2 * F, H, n, DType::F32, ws.gu, 2 * F, x_e, H, ws.weight, H,
                  mixed_math<T>());
      launch_add(ws.weight, dwgu + e * 2 * F * H, 2 * F * H, s);
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

int64_t expert_ffn_workspace_bytes_cuda(int64_t max_expert_rows, int64_t hidden, int64_t ffn) {
  return workspace_elems(max_expert_rows, hidden, ffn) * 4;
}

int64_t expert_ffn_workspace_bytes_cuda(const ExpertFfnArgs& a) {
  return expert_ffn_workspace_bytes_cuda(max_rows_of(a), a.hidden, a.ffn);
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
