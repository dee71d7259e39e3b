// The compute of the dispatch schedule (dispatch_internal.h): the router's forward (logits,
// softmax, the renormalised top-k weights) and backward, and the grouped SwiGLU experts' forward
// and backward over rows in expert order, the prob applied to the activation (act*prob). The
// same code serves the uncapped pass and every capped round.
#include "executor/schedules/dispatch_internal.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "executor/cpu/gemm_cpu.h"
#include "executor/ops/expert_ffn.h"

namespace flatpeak::exec::dispatch_detail {

namespace {

// Calls fn(i, j) for every expert-order row i with j its prob index.
template <class Fn>
void for_each_row(const Grouping& g, const Probs& pr, Fn fn) {
  for (const auto& ch : g.chunks)
    for (int64_t r = 0; r < ch.rows; ++r) fn(ch.exp_row + r, pr.by_recv ? ch.recv_row + r : ch.exp_row + r);
}

// Calls fn(l, i0, m) for every local expert l with rows: its m > 0 rows from expert-order row i0.
template <class Fn>
void for_each_expert(const Grouping& g, Fn fn) {
  for (size_t l = 0; l + 1 < g.begin.size(); ++l) {
    const int64_t i0 = g.begin[l], m = g.begin[l + 1] - i0;
    if (m > 0) fn(l, i0, m);
  }
}

}  // namespace

void compute_routing(const Dims& d, const LayerData& L, const std::vector<int32_t>& ids, Routing& r) {
  float* logits = r.logits.data<float>();
  gemm_cpu(false, true, d.T, d.E, d.H, 1.0f, L.x.data<Bf16>(), d.H, L.w_router.data<Bf16>(), d.H, false, logits, d.E);
  float* scores = r.scores.data<float>();
  float* scattered = r.scattered.data<float>();
  auto* map = static_cast<uint8_t*>(r.map.raw());
  std::memset(map, 0, z(d.T * d.E));
  float* w = r.topk_w.data<float>();
  int64_t* id = r.topk_ids.data<int64_t>();
  for (int64_t t = 0; t < d.T; ++t) {
    const float* zt = logits + t * d.E;
    float max = zt[0];
    for (int64_t e = 1; e < d.E; ++e) max = std::max(max, zt[e]);
    float sum = 0.0f;
    for (int64_t e = 0; e < d.E; ++e) sum += (scores[t * d.E + e] = std::exp(zt[e] - max));
    for (int64_t e = 0; e < d.E; ++e) scores[t * d.E + e] /= sum;
    float kept = 0.0f;
    for (int64_t s = 0; s < d.k; ++s) kept += scores[t * d.E + ids[z(t * d.k + s)]];
    std::fill(scattered + t * d.E, scattered + (t + 1) * d.E, 0.0f);
    for (int64_t s = 0; s < d.k; ++s) {
      const int64_t e = ids[z(t * d.k + s)];
      id[t * d.k + s] = e;
      w[t * d.k + s] = scores[t * d.E + e] / kept;
      scattered[t * d.E + e] = w[t * d.k + s];
      map[t * d.E + e] = 1;
    }
  }
}

std::vector<ExpertSlot> expert_slots(const Dims& d, const RowPlan& p, LayerData& L, const Tensor* foreign_w, Tensor* foreign_dw) {
  std::vector<ExpertSlot> out;
  for (int64_t l = 0; l < p.locals(); ++l) {
    ExpertSlot s{};
    if (l < d.L) {
      s.gu = L.w_gate_up.data<Bf16>() + l * 2 * d.F * d.H;
      s.down = L.w_down.data<Bf16>() + l * d.H * d.F;
      s.dgu = L.dw_gate_up.data<float>() + l * 2 * d.F * d.H;
      s.ddown = L.dw_down.data<float>() + l * d.H * d.F;
      if (d.Pb > 0) {
        s.bias = L.b_expert.data<Bf16>() + l * d.Pb;
        s.dbias = L.db_expert.data<float>() + l * d.Pb;
      }
    } else {
      const int64_t off = (l - d.L) * d.P;
      s.gu = foreign_w->data<Bf16>() + off;
      s.down = s.gu + 2 * d.F * d.H;
      if (d.Pb > 0) s.bias = s.gu + 3 * d.F * d.H;
      if (foreign_dw && !foreign_dw->empty()) {
        s.dgu = foreign_dw->data<float>() + off;
        s.ddown = s.dgu + 2 * d.F * d.H;
        if (d.Pb > 0) s.dbias = s.dgu + 3 * d.F * d.H;
      }
    }
    out.push_back(s);
  }
  return out;
}

void experts_fc2(const Dims& d, const std::vector<ExpertSlot>& w, const Grouping& g, const Bf16* act, Bf16* fc2) {
  const bool bias = d.Pb > 0;
  for_each_expert(g, [&](size_t l, int64_t i0, int64_t m) {
    if (bias) copy_bias_rows(w[l].bias + 2 * d.F, m, d.H, fc2 + i0 * d.H);  // b_down, then += the GEMM
    gemm_cpu(false, true, m, d.H, d.F, 1.0f, act + i0 * d.F, d.F, w[l].down, d.F, bias, fc2 + i0 * d.H, d.H);
  });
}

void experts_forward(const Dims& d, const std::vector<ExpertSlot>& w, const Grouping& g, const Probs& pr, const Bf16* in,
                     Bf16* fc1, Bf16* act, Bf16* fc2) {
  const bool bias = d.Pb > 0;
  for_each_expert(g, [&](size_t l, int64_t i0, int64_t m) {
    if (bias) copy_bias_rows(w[l].bias, m, 2 * d.F, fc1 + i0 * 2 * d.F);  // b_gu, then += the GEMM
    gemm_cpu(false, true, m, 2 * d.F, d.H, 1.0f, in + i0 * d.H, d.H, w[l].gu, d.H, bias, fc1 + i0 * 2 * d.F, 2 * d.F);
  });
  for_each_row(g, pr, [&](int64_t i, int64_t j) {
    for (int64_t f = 0; f < d.F; ++f) {
      const float gt = to_f32(fc1[i * 2 * d.F + f]), u = to_f32(fc1[i * 2 * d.F + d.F + f]);
      act[i * d.F + f] = f32_to_bf16(silu_f32(gt) * u * pr.p[j]);
    }
  });
  if (fc2) experts_fc2(d, w, g, act, fc2);
}

void experts_backward_fc(const Dims& d, const std::vector<ExpertSlot>& w, const Grouping& g, const Probs& pr, const Bf16* fc1,
                         const Bf16* act, const Bf16* d_fc2, Bf16* d_act, Bf16* d_fc1) {
  for_each_expert(g, [&](size_t l, int64_t i0, int64_t m) {
    gemm_cpu(false, false, m, d.F, d.H, 1.0f, d_fc2 + i0 * d.H, d.H, w[l].down, d.F, false, d_act + i0 * d.F, d.F);
    gemm_cpu(true, false, d.H, d.F, m, 1.0f, d_fc2 + i0 * d.H, d.H, act + i0 * d.F, d.F, true, w[l].ddown, d.F);
    if (w[l].dbias) add_row_sums(d_fc2 + i0 * d.H, m, d.H, w[l].dbias + 2 * d.F);
  });
  for_each_row(g, pr, [&](int64_t i, int64_t j) {
    float dp = 0.0f;
    for (int64_t f = 0; f < d.F; ++f) {
      const float gt = to_f32(fc1[i * 2 * d.F + f]), u = to_f32(fc1[i * 2 * d.F + d.F + f]);
      const float dh = to_f32(d_act[i * d.F + f]);
      dp += dh * silu_f32(gt) * u;
      const float da = dh * pr.p[j];
      d_fc1[i * 2 * d.F + f] = f32_to_bf16(da * u * silu_grad_f32(gt));
      d_fc1[i * 2 * d.F + d.F + f] = f32_to_bf16(da * silu_f32(gt));
    }
    pr.p[j] = dp;
  });
}

void experts_backward_in(const Dims& d, const std::vector<ExpertSlot>& w, const Grouping& g, const Bf16* in, const Bf16* d_fc1,
                         Bf16* d_in) {
  for_each_expert(g, [&](size_t l, int64_t i0, int64_t m) {
    gemm_cpu(true, false, 2 * d.F, d.H, m, 1.0f, d_fc1 + i0 * 2 * d.F, 2 * d.F, in + i0 * d.H, d.H, true, w[l].dgu, d.H);
    if (w[l].dbias) add_row_sums(d_fc1 + i0 * 2 * d.F, m, 2 * d.F, w[l].dbias);
    gemm_cpu(false, false, m, d.H, 2 * d.F, 1.0f, d_fc1 + i0 * 2 * d.F, 2 * d.F, w[l].gu, d.H, false, d_in + i0 * d.H, d.H);
  });
}

// The router's backward once every d prob is in r.scores ([t, e] at the chosen experts): the kept
// weights are a softmax over the kept logits, so dz_e = w_e·(dw_e − Σ_j w_j dw_j) for kept e,
// 0 elsewhere (into r.logits); then d_x += dz·W_router and dW_router += dzᵀ·x.
void router_backward(const Dims& d, LayerData& L, Routing& r, float* d_x) {
  float* dz = r.logits.data<float>();
  const float* dw = r.scores.data<float>();
  const float* w = r.topk_w.data<float>();
  const int64_t* ids = r.topk_ids.data<int64_t>();
  std::vector<float> row(z(d.E));
  for (int64_t t = 0; t < d.T; ++t) {
    float dot = 0.0f;
    for (int64_t s = 0; s < d.k; ++s) dot += w[t * d.k + s] * dw[t * d.E + ids[t * d.k + s]];
    std::fill(row.begin(), row.end(), 0.0f);
    for (int64_t s = 0; s < d.k; ++s) {
      const int64_t e = ids[t * d.k + s];
      row[z(e)] = w[t * d.k + s] * (dw[t * d.E + e] - dot);
    }
    std::copy(row.begin(), row.end(), dz + t * d.E);
  }
  gemm_cpu(false, false, d.T, d.H, d.E, 1.0f, dz, d.E, L.w_router.data<Bf16>(), d.H, true, d_x, d.H);
  gemm_cpu(true, false, d.E, d.H, d.T, 1.0f, dz, d.E, L.x.data<Bf16>(), d.H, true, L.dw_router.data<float>(), d.H);
}

}  // namespace flatpeak::exec::dispatch_detail
