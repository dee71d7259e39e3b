#include <algorithm>

#include "executor/cpu/gemm_cpu.h"
#include "executor/cpu/op_util.h"
#include "executor/ops/expert_ffn.h"

namespace flatpeak::exec {
namespace {

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

// h = silu(gate) ⊙ up for n rows of gate_up [n, 2F], into fp32 h [n, F].
template <class T>
void swiglu(const T* gate_up, int64_t n, int64_t F, float* h) {
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t f = 0; f < F; ++f) {
      h[r * F + f] = silu_f32(to_f32(gate_up[r * 2 * F + f])) * to_f32(gate_up[r * 2 * F + F + f]);
    }
  }
}

template <class T>
void forward(const ExpertFfnArgs& a) {
  const int64_t H = a.hidden;
  const int64_t F = a.ffn;
  const T* x = static_cast<const T*>(a.x);
  const T* wgu = static_cast<const T*>(a.w_gate_up);
  const T* wd = static_cast<const T*>(a.w_down);
  T* gu = static_cast<T*>(a.gate_up);
  T* out = static_cast<T*>(a.out);
  float* h = a.workspace;  // [n, F] fp32
  int64_t row0 = 0;
  for (int64_t e = 0; e < a.experts; ++e) {
    const int64_t n = a.expert_counts[e];
    if (n > 0) {
      gemm_cpu(false, true, n, 2 * F, H, 1.0f, x + row0 * H, H, wgu + e * 2 * F * H, H, false,
               gu + row0 * 2 * F, 2 * F);
      swiglu(gu + row0 * 2 * F, n, F, h);
      gemm_cpu(false, true, n, H, F, 1.0f, static_cast<const float*>(h), F, wd + e * H * F, F,
               false, out + row0 * H, H);
    }
    row0 += n;
  }
}

template <class T>
void backward(const ExpertFfnArgs& a) {
  const int64_t H = a.hidden;
  const int64_t F = a.ffn;
  const T* x = static_cast<const T*>(a.x);
  const T* wgu = static_cast<const T*>(a.w_gate_up);
  const T* wd = static_cast<const T*>(a.w_down);
  const T* gu = static_cast<const T*>(a.gate_up);
  const T* dy = static_cast<const T*>(a.d_out);
  T* dx = static_cast<T*>(a.d_x);
  T* dwgu = static_cast<T*>(a.d_w_gate_up);
  T* dwd = static_cast<T*>(a.d_w_down);
  int64_t max_rows = 0;
  for (int64_t e = 0; e < a.experts; ++e) max_rows = std::max(max_rows, a.expert_counts[e]);
  float* h = a.workspace;                // [n, F]   silu(gate) ⊙ up, recomputed
  float* dgu = a.workspace + max_rows * F;  // [n, 2F] dL/d[gate | up]; first dL/dh in the gate half
  int64_t row0 = 0;
  for (int64_t e = 0; e < a.experts; ++e) {
    const int64_t n = a.expert_counts[e];
    if (n > 0) {
      const T* gu_e = gu + row0 * 2 * F;
      swiglu(gu_e, n, F, h);
      // dh = dy · W_down [n, F], written into the gate half of dgu (stride 2F).
      gemm_cpu(false, false, n, F, H, 1.0f, dy + row0 * H, H, wd + e * H * F, F, false, dgu,
               2 * F);
      // dW_down += dyᵀ · h
      gemm_cpu(true, false, H, F, n, 1.0f, dy + row0 * H, H, static_cast<const float*>(h), F,
               true, dwd + e * H * F, F);
      for (int64_t r = 0; r < n; ++r) {
        for (int64_t f = 0; f < F; ++f) {
          const float g = to_f32(gu_e[r * 2 * F + f]);
          const float u = to_f32(gu_e[r * 2 * F + F + f]);
          const float dh = dgu[r * 2 * F + f];
          dgu[r * 2 * F + f] = dh * u * silu_grad_f32(g);
          dgu[r * 2 * F + F + f] = dh * silu_f32(g);
        }
      }
      // dx = d[gate | up] · W_gate_up;  dW_gate_up += d[gate | up]ᵀ · x
      gemm_cpu(false, false, n, H, 2 * F, 1.0f, static_cast<const float*>(dgu), 2 * F,
               wgu + e * 2 * F * H, H, false, dx + row0 * H, H);
      gemm_cpu(true, false, 2 * F, H, n, 1.0f, static_cast<const float*>(dgu), 2 * F,
               x + row0 * H, H, true, dwgu + e * 2 * F * H, H);
    }
    row0 += n;
  }
}

}  // namespace

int64_t expert_ffn_workspace_bytes(const ExpertFfnArgs& a) {
  int64_t max_rows = 0;
  for (int64_t e = 0; e < a.experts; ++e) max_rows = std::max(max_rows, a.expert_counts[e]);
  return 3 * max_rows * a.ffn * 4;
}

void expert_ffn_forward_cpu(const ExpertFfnArgs& a) {
  check(a);
  require(a.out != nullptr, "expert_ffn", "forward needs out");
  dispatch_compute(a.dtype, "expert_ffn", [&](auto tag) { forward<decltype(tag)>(a); });
}

void expert_ffn_backward_cpu(const ExpertFfnArgs& a) {
  check(a);
  require(a.d_out && a.d_x && a.d_w_gate_up && a.d_w_down, "expert_ffn",
          "backward needs d_out, d_x, d_w_gate_up and d_w_down");
  dispatch_compute(a.dtype, "expert_ffn", [&](auto tag) { backward<decltype(tag)>(a); });
}

}  // namespace flatpeak::exec
