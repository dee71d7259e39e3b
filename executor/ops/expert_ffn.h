// SwiGLU expert FFN over rows grouped by expert (the permuted layout of moe_route_cpu):
// for the rows of expert e, [gate | up] = x · W_gate_upᵀ, h = silu(gate) ⊙ up, out = h · W_downᵀ.
//   ExpertFfnArgs a; a.x = x_perm; a.expert_counts = counts; a.w_gate_up = wgu; a.w_down = wd;
//   a.gate_up = gu; a.out = y; a.rows = R; a.experts = E; a.hidden = H; a.ffn = F; a.workspace = ws;
//   expert_ffn_forward_cpu(a);   a.d_out = dy; a.d_x = dx; ...; expert_ffn_backward_cpu(a);
#pragma once

#include <cmath>
#include <cstdint>

#include "executor/ops/dtype.h"

namespace flatpeak::exec {

struct ExpertFfnArgs {
  DType dtype = DType::F32;               // storage of x, weights, gate_up, out and gradients
  const void* x = nullptr;                // [R, H] rows of expert 0, then expert 1, ...
  const int64_t* expert_counts = nullptr; // [E] rows per expert; Σ = R
  const void* w_gate_up = nullptr;        // [E, 2F, H] gate rows 0..F-1, up rows F..2F-1
  const void* w_down = nullptr;           // [E, H, F]
  void* gate_up = nullptr;                // [R, 2F] pre-activations: forward writes, backward reads
  void* out = nullptr;                    // [R, H] overwritten
  const void* d_out = nullptr;            // [R, H]
  void* d_x = nullptr;                    // [R, H] overwritten
  void* d_w_gate_up = nullptr;            // [E, 2F, H] accumulated (+=), once per expert
  void* d_w_down = nullptr;               // [E, H, F] accumulated (+=), once per expert
  float* workspace = nullptr;             // expert_ffn_workspace_bytes(): fp32 h and d_gate_up
  int64_t rows = 0;
  int64_t experts = 0;
  int64_t hidden = 0;
  int64_t ffn = 0;
};

// 3 · max_e(count_e) · F fp32: h [n, F] and d_gate_up [n, 2F] of the busiest expert.
int64_t expert_ffn_workspace_bytes(const ExpertFfnArgs& args);
void expert_ffn_forward_cpu(const ExpertFfnArgs& args);
// Recomputes h from the saved gate_up; each expert's weight gradients come from one GEMM over
// all its rows (fp32 accumulation over rows), added to d_w once.
void expert_ffn_backward_cpu(const ExpertFfnArgs& args);

// Expert biases (executor/schedules: the dispatch component and the decoder layer). A bias row
// [n] copied into m output rows, which the GEMM then accumulates onto (one rounding):
template <class T>
inline void copy_bias_rows(const T* bias, int64_t m, int64_t n, T* rows) {
  for (int64_t r = 0; r < m; ++r)
    for (int64_t c = 0; c < n; ++c) rows[r * n + c] = bias[c];
}
// Its gradient: acc[c] += Σ_r rows[r, c] over m rows of width n, each column summed in fp32 in
// row order and added once, as a weight gradient's GEMM adds its rows' sum (float or bf16 rows
// and accumulator; executor/cuda's add_row_sums_kernel is the device form).
template <class TR, class TA>
inline void add_row_sums(const TR* rows, int64_t m, int64_t n, TA* acc) {
  for (int64_t c = 0; c < n; ++c) {
    float sum = 0.0f;
    for (int64_t r = 0; r < m; ++r) sum += to_f32(rows[r * n + c]);
    store_f32(acc + c, to_f32(acc[c]) + sum);
  }
}

FLATPEAK_HD inline float sigmoid_f32(float x) { return 1.0f / (1.0f + expf(-x)); }
FLATPEAK_HD inline float silu_f32(float x) { return x * sigmoid_f32(x); }
// d silu / dx = σ(x) · (1 + x · (1 − σ(x)))
FLATPEAK_HD inline float silu_grad_f32(float x) {
  const float s = sigmoid_f32(x);
  return s * (1.0f + x * (1.0f - s));
}

}  // namespace flatpeak::exec
