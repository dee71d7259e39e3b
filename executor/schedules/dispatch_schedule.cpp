// The dispatch component run (dispatch_schedule.h). One design with planner/README.md
// ("Dispatch"): probabilities are applied to the activation (act*prob), so the combine is an
// unweighted sum and its backward needs no expert outputs; the router's weight gradient comes from
// the experts' backward (d prob = Σ_f d(act*prob)·act). At one rank the dispatch all-to-all is a
// copy from the send buffer into the receive buffer, and the received rows are already grouped by
// expert, so the receive buffer becomes the expert input.
// Buffers the backward no longer needs hold its small gradients in place: d prob goes into the
// router scores [T, E] (scattered at the chosen experts) and the router's d logits into the router
// logits [T, E]; both are dead once the routing has been recomputed.
#include "executor/schedules/dispatch_schedule.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <utility>

#include "executor/cpu/gemm_cpu.h"
#include "executor/memory/tensor.h"
#include "executor/ops/dtype.h"
#include "executor/ops/expert_ffn.h"
#include "executor/schedules/schedule_util.h"

namespace flatpeak::exec {

namespace {

constexpr Category kDsp = Category::Dispatch;
size_t z(int64_t i) { return static_cast<size_t>(i); }

struct Dims {
  int64_t T, H, E, k, F, N;  // N = T·k token copies
};

// What lives through the whole layer and is not the dispatch's own: the layer input and the
// upstream gradient (activations), the gathered weights and the fp32 gradient accumulators (fsdp).
struct LayerData {
  Tensor x, d_out, w_router, w_gate_up, w_down, dw_router, dw_gate_up, dw_down;
  LayerData(TrackingAllocator& alloc, const Dims& d)
      : x(alloc, DType::BF16, {d.T, d.H}, Category::Activations),               // [T, H] bf16
        d_out(alloc, DType::BF16, {d.T, d.H}, Category::Activations),           // [T, H] bf16
        w_router(alloc, DType::BF16, {d.E, d.H}, Category::Fsdp),               // [E, H] bf16
        w_gate_up(alloc, DType::BF16, {d.E, 2 * d.F, d.H}, Category::Fsdp),     // [E, 2F, H] bf16
        w_down(alloc, DType::BF16, {d.E, d.H, d.F}, Category::Fsdp),            // [E, H, F] bf16
        dw_router(alloc, DType::F32, {d.E, d.H}, Category::Fsdp),               // [E, H] fp32 +=
        dw_gate_up(alloc, DType::F32, {d.E, 2 * d.F, d.H}, Category::Fsdp),     // [E, 2F, H] fp32 +=
        dw_down(alloc, DType::F32, {d.E, d.H, d.F}, Category::Fsdp) {}          // [E, H, F] fp32 +=
};

// Seeds of the inputs (one stream each).
uint64_t seed_of(const DispatchScheduleConfig& c, uint64_t stream) { return c.seed * 8 + stream; }

void fill_inputs(const DispatchScheduleConfig& c, const Dims& d, Bf16* x, Bf16* d_out, Bf16* w_router, Bf16* w_gate_up,
                 Bf16* w_down) {
  fill_bf16(x, d.T * d.H, seed_of(c, 1), 1.0f);
  fill_bf16(d_out, d.T * d.H, seed_of(c, 2), 1.0f);
  fill_bf16(w_router, d.E * d.H, seed_of(c, 3), 1.0f / std::sqrt(static_cast<float>(d.H)));
  fill_bf16(w_gate_up, d.E * 2 * d.F * d.H, seed_of(c, 4), 2.0f / std::sqrt(static_cast<float>(d.H)));
  fill_bf16(w_down, d.E * d.H * d.F, seed_of(c, 5), 2.0f / std::sqrt(static_cast<float>(d.F)));
}

std::vector<int32_t> draw_routing(const DispatchScheduleConfig& c, const Dims& d) {
  const RoutingShape shape{1, d.E, d.k};
  return generate_routing(c.routing, shape, d.T, seed_of(c, 6), /*rank=*/0, /*ep_rank=*/0, c.moe_layer);
}

// The routing of one pass: router logits, softmax scores, scattered probs, routing map, the
// renormalised top-k weights over the drawn ids (softmax over the kept logits), and the ids.
struct Routing {
  Tensor logits, scores, scattered, map, topk_w, topk_ids;
  Routing(TrackingAllocator& alloc, const Dims& d)
      : logits(alloc, DType::F32, {d.T, d.E}, kDsp),     // [T, E] fp32
        scores(alloc, DType::F32, {d.T, d.E}, kDsp),     // [T, E] fp32
        scattered(alloc, DType::F32, {d.T, d.E}, kDsp),  // [T, E] fp32
        // [T, E] bool, 1 B each: held as ceil(T·E/2) two-byte cells (there is no 1-byte dtype)
        map(alloc, DType::BF16, {(d.T * d.E + 1) / 2}, kDsp),
        topk_w(alloc, DType::F32, {d.T, d.k}, kDsp),     // [T, k] fp32
        topk_ids(alloc, DType::I64, {d.T, d.k}, kDsp) {}  // [T, k] int64
};

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

// Stable grouping of the N copies by expert: sort[r] = slot t·k + s of sorted row r; unsort the
// inverse (when given). Expert e's rows are contiguous and keep their token order.
void sort_by_expert(const Dims& d, const int64_t* ids, int64_t* sort, int64_t* unsort) {
  std::vector<int64_t> start(z(d.E + 1), 0);  // O(E) bookkeeping
  for (int64_t i = 0; i < d.N; ++i) ++start[z(ids[i] + 1)];
  for (int64_t e = 0; e < d.E; ++e) start[z(e + 1)] += start[z(e)];
  for (int64_t i = 0; i < d.N; ++i) {
    const int64_t r = start[z(ids[i])]++;
    sort[r] = i;
    if (unsort) unsort[i] = r;
  }
}

// Calls fn(expert, first, count) for each run of equal experts among `n` sorted rows.
template <class Fn>
void for_each_expert_run(const int64_t* sort, const int64_t* ids, int64_t n, Fn fn) {
  int64_t i0 = 0;
  while (i0 < n) {
    const int64_t e = ids[sort[i0]];
    int64_t i1 = i0 + 1;
    while (i1 < n && ids[sort[i1]] == e) ++i1;
    fn(e, i0, i1 - i0);
    i0 = i1;
  }
}

void copy_rows(const Bf16* src, Bf16* dst, int64_t rows, int64_t H) { std::memcpy(dst, src, z(rows * H) * sizeof(Bf16)); }

// Expert forward over n sorted rows (sort, ids: the rows' slots and experts): fc1 = in·W_guᵀ,
// act*prob = silu(gate)·up·prob, and (when fc2 is given) fc2 = (act*prob)·W_downᵀ.
void experts_forward(const Dims& d, const LayerData& L, const int64_t* sort, const int64_t* ids, int64_t n,
                     const float* prob, const Bf16* in, Bf16* fc1, Bf16* act, Bf16* fc2) {
  const Bf16* wgu = L.w_gate_up.data<Bf16>();
  const Bf16* wd = L.w_down.data<Bf16>();
  for_each_expert_run(sort, ids, n, [&](int64_t e, int64_t i0, int64_t m) {
    gemm_cpu(false, true, m, 2 * d.F, d.H, 1.0f, in + i0 * d.H, d.H, wgu + e * 2 * d.F * d.H, d.H, false, fc1 + i0 * 2 * d.F, 2 * d.F);
    for (int64_t i = i0; i < i0 + m; ++i)
      for (int64_t f = 0; f < d.F; ++f) {
        const float g = to_f32(fc1[i * 2 * d.F + f]), u = to_f32(fc1[i * 2 * d.F + d.F + f]);
        act[i * d.F + f] = f32_to_bf16(silu_f32(g) * u * prob[i]);
      }
    if (fc2) gemm_cpu(false, true, m, d.H, d.F, 1.0f, act + i0 * d.F, d.F, wd + e * d.H * d.F, d.F, false, fc2 + i0 * d.H, d.H);
  });
}

// Expert backward, first half: d act = d fc2·W_down, dW_down += d fc2ᵀ·act, d fc1 from d act, and
// d prob per row (written to dprob).
void experts_backward_fc(const Dims& d, LayerData& L, const int64_t* sort, const int64_t* ids, int64_t n, const float* prob,
                         const Bf16* fc1, const Bf16* act, const Bf16* d_fc2, Bf16* d_act, Bf16* d_fc1, float* dprob) {
  const Bf16* wd = L.w_down.data<Bf16>();
  float* dwd = L.dw_down.data<float>();
  for_each_expert_run(sort, ids, n, [&](int64_t e, int64_t i0, int64_t m) {
    gemm_cpu(false, false, m, d.F, d.H, 1.0f, d_fc2 + i0 * d.H, d.H, wd + e * d.H * d.F, d.F, false, d_act + i0 * d.F, d.F);
    gemm_cpu(true, false, d.H, d.F, m, 1.0f, d_fc2 + i0 * d.H, d.H, act + i0 * d.F, d.F, true, dwd + e * d.H * d.F, d.F);
  });
  for (int64_t i = 0; i < n; ++i) {
    float dp = 0.0f;
    for (int64_t f = 0; f < d.F; ++f) {
      const float g = to_f32(fc1[i * 2 * d.F + f]), u = to_f32(fc1[i * 2 * d.F + d.F + f]);
      const float dh = to_f32(d_act[i * d.F + f]);
      dp += dh * silu_f32(g) * u;
      const float da = dh * prob[i];
      d_fc1[i * 2 * d.F + f] = f32_to_bf16(da * u * silu_grad_f32(g));
      d_fc1[i * 2 * d.F + d.F + f] = f32_to_bf16(da * silu_f32(g));
    }
    dprob[i] = dp;
  }
}

// Expert backward, second half: dW_gate_up += d fc1ᵀ·in and d in = d fc1·W_gate_up.
void experts_backward_in(const Dims& d, LayerData& L, const int64_t* sort, const int64_t* ids, int64_t n, const Bf16* in,
                         const Bf16* d_fc1, Bf16* d_in) {
  const Bf16* wgu = L.w_gate_up.data<Bf16>();
  float* dwgu = L.dw_gate_up.data<float>();
  for_each_expert_run(sort, ids, n, [&](int64_t e, int64_t i0, int64_t m) {
    gemm_cpu(true, false, 2 * d.F, d.H, m, 1.0f, d_fc1 + i0 * 2 * d.F, 2 * d.F, in + i0 * d.H, d.H, true, dwgu + e * 2 * d.F * d.H, d.H);
    gemm_cpu(false, false, m, d.H, 2 * d.F, 1.0f, d_fc1 + i0 * 2 * d.F, 2 * d.F, wgu + e * 2 * d.F * d.H, d.H, false, d_in + i0 * d.H, d.H);
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

// out[t] (fp32) += rows of token t, visited in sorted order (increasing expert): the one sum order
// every split of the rows into rounds keeps.
void accumulate_rows(const Dims& d, const int64_t* sort, int64_t r0, int64_t n, const Bf16* rows, float* acc) {
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = sort[r0 + i] / d.k;
    for (int64_t h = 0; h < d.H; ++h) acc[t * d.H + h] += to_f32(rows[i * d.H + h]);
  }
}

// ---- one uncapped dispatch (standard EP buffers)

struct Meta {
  Tensor sort, pprobs;
  Meta(TrackingAllocator& alloc, const Dims& d, const Routing& r)
      : sort(alloc, DType::I64, {d.N}, kDsp),     // [T·k] int64 sorted row → slot
        pprobs(alloc, DType::F32, {d.N}, kDsp) {  // [T·k] fp32 permuted probs
    sort_by_expert(d, r.topk_ids.data<int64_t>(), sort.data<int64_t>(), nullptr);
    for (int64_t i = 0; i < d.N; ++i) pprobs.data<float>()[i] = r.topk_w.data<float>()[sort.data<int64_t>()[i]];
  }
};

// Dispatch: the send buffer gathers the rows in expert order, the all-to-all copies them (and
// their probs) into the receive buffer. Returns the receive buffer, which becomes the expert input;
// the received probs equal the rank's own permuted probs at one rank, which the experts read.
Tensor uncapped_dispatch(TrackingAllocator& alloc, const Dims& d, const LayerData& L, const Meta& m) {
  Tensor send(alloc, DType::BF16, {d.N, d.H}, kDsp);    // [T·k, H] bf16
  Tensor recv(alloc, DType::BF16, {d.N, d.H}, kDsp);    // [R, H] bf16
  Tensor recv_probs(alloc, DType::F32, {d.N}, kDsp);    // [R] fp32
  const int64_t* sort = m.sort.data<int64_t>();
  for (int64_t r = 0; r < d.N; ++r) copy_rows(L.x.data<Bf16>() + (sort[r] / d.k) * d.H, send.data<Bf16>() + r * d.H, 1, d.H);
  copy_rows(send.data<Bf16>(), recv.data<Bf16>(), d.N, d.H);
  std::memcpy(recv_probs.raw(), m.pprobs.raw(), z(d.N) * sizeof(float));
  return recv;
}

// Combine: un-permute fc2 rows to slot order, the all-to-all back, and the MoE output [T, H] bf16
// summing each token's k rows in increasing expert order.
void uncapped_combine(TrackingAllocator& alloc, const Dims& d, const Meta& m, const Routing& r, const Tensor& fc2,
                      std::vector<float>* out_values) {
  Tensor unperm(alloc, DType::BF16, {d.N, d.H}, kDsp);     // [R, H] bf16, slot order
  Tensor comb_recv(alloc, DType::BF16, {d.N, d.H}, kDsp);  // [T·k, H] bf16
  Tensor out(alloc, DType::BF16, {d.T, d.H}, kDsp);        // [T, H] bf16
  const int64_t* sort = m.sort.data<int64_t>();
  for (int64_t i = 0; i < d.N; ++i) copy_rows(fc2.data<Bf16>() + i * d.H, unperm.data<Bf16>() + sort[i] * d.H, 1, d.H);
  copy_rows(unperm.data<Bf16>(), comb_recv.data<Bf16>(), d.N, d.H);
  const int64_t* ids = r.topk_ids.data<int64_t>();
  std::vector<int64_t> slots(z(d.k));
  for (int64_t t = 0; t < d.T; ++t) {
    for (int64_t s = 0; s < d.k; ++s) slots[z(s)] = s;
    std::sort(slots.begin(), slots.end(), [&](int64_t a, int64_t b) { return ids[t * d.k + a] < ids[t * d.k + b]; });
    for (int64_t h = 0; h < d.H; ++h) {
      float sum = 0.0f;
      for (int64_t s : slots) sum += to_f32(comb_recv.data<Bf16>()[(t * d.k + s) * d.H + h]);
      out.data<Bf16>()[t * d.H + h] = f32_to_bf16(sum);
    }
  }
  if (out_values) {
    out_values->resize(z(d.T * d.H));
    for (int64_t i = 0; i < d.T * d.H; ++i) (*out_values)[z(i)] = to_f32(out.data<Bf16>()[i]);
  }
}

void run_uncapped(TrackingAllocator& alloc, const Dims& d, LayerData& L, const std::vector<int32_t>& ids,
                  const std::string& layer, DispatchScheduleResult& res) {
  // No-grad forward: nothing is kept; each phase frees what the next does not read.
  {
    const std::string p = "fwd/" + layer + "/moe/";
    alloc.set_phase(p + "route");
    Routing r(alloc, d);
    compute_routing(d, L, ids, r);
    alloc.set_phase(p + "dispatch");
    Meta m(alloc, d, r);
    Tensor in = uncapped_dispatch(alloc, d, L, m);
    alloc.set_phase(p + "experts");
    Tensor fc1(alloc, DType::BF16, {d.N, 2 * d.F}, kDsp);  // [R, 2F] bf16
    Tensor act(alloc, DType::BF16, {d.N, d.F}, kDsp);      // [R, F] bf16
    const int64_t* sort = m.sort.data<int64_t>();
    experts_forward(d, L, sort, r.topk_ids.data<int64_t>(), d.N, m.pprobs.data<float>(), in.data<Bf16>(), fc1.data<Bf16>(),
                    act.data<Bf16>(), nullptr);
    in.reset();
    fc1.reset();
    Tensor fc2(alloc, DType::BF16, {d.N, d.H}, kDsp);  // [R, H] bf16
    for_each_expert_run(sort, r.topk_ids.data<int64_t>(), d.N, [&](int64_t e, int64_t i0, int64_t n) {
      gemm_cpu(false, true, n, d.H, d.F, 1.0f, act.data<Bf16>() + i0 * d.F, d.F, L.w_down.data<Bf16>() + e * d.H * d.F, d.F,
               false, fc2.data<Bf16>() + i0 * d.H, d.H);
    });
    act.reset();
    alloc.set_phase(p + "combine");
    uncapped_combine(alloc, d, m, r, fc2, &res.out);
    res.topk_weights.assign(r.topk_w.data<float>(), r.topk_w.data<float>() + d.N);
  }
  // Recompute: the same forward, keeping expert input, fc1 and act*prob for the backward.
  const std::string q = "bwd/" + layer + "/recompute/moe/";
  alloc.set_phase(q + "dispatch");
  Routing r(alloc, d);
  compute_routing(d, L, ids, r);
  Meta m(alloc, d, r);
  const int64_t* sort = m.sort.data<int64_t>();
  const int64_t* eid = r.topk_ids.data<int64_t>();
  Tensor in = uncapped_dispatch(alloc, d, L, m);
  alloc.set_phase(q + "experts");
  Tensor fc1(alloc, DType::BF16, {d.N, 2 * d.F}, kDsp);  // [R, 2F] bf16, saved
  Tensor act(alloc, DType::BF16, {d.N, d.F}, kDsp);      // [R, F] bf16, saved
  Tensor fc2(alloc, DType::BF16, {d.N, d.H}, kDsp);      // [R, H] bf16
  experts_forward(d, L, sort, eid, d.N, m.pprobs.data<float>(), in.data<Bf16>(), fc1.data<Bf16>(), act.data<Bf16>(),
                  fc2.data<Bf16>());
  alloc.set_phase(q + "combine");
  uncapped_combine(alloc, d, m, r, fc2, nullptr);
  fc2.reset();

  // Backward. Combine: each slot's gradient is d_out of its token (unweighted sum); the reversed
  // all-to-all brings them to the experts in sorted order.
  const std::string g = "bwd/" + layer + "/moe/";
  alloc.set_phase(g + "combine");
  Tensor d_fc2;
  {
    Tensor d_comb(alloc, DType::BF16, {d.N, d.H}, kDsp);  // [T·k, H] bf16, slot order
    Tensor d_recv(alloc, DType::BF16, {d.N, d.H}, kDsp);  // [R, H] bf16, sorted
    for (int64_t i = 0; i < d.N; ++i) copy_rows(L.d_out.data<Bf16>() + (i / d.k) * d.H, d_comb.data<Bf16>() + i * d.H, 1, d.H);
    for (int64_t r2 = 0; r2 < d.N; ++r2) copy_rows(d_comb.data<Bf16>() + sort[r2] * d.H, d_recv.data<Bf16>() + r2 * d.H, 1, d.H);
    d_fc2 = std::move(d_recv);
  }
  alloc.set_phase(g + "experts");
  Tensor d_in;
  {
    Tensor d_act(alloc, DType::BF16, {d.N, d.F}, kDsp);      // [R, F] bf16
    Tensor d_fc1(alloc, DType::BF16, {d.N, 2 * d.F}, kDsp);  // [R, 2F] bf16
    // d prob lands in the permuted probs (each row reads its prob before it is overwritten), then
    // in the dead router scores at [t, e].
    float* pp = m.pprobs.data<float>();
    experts_backward_fc(d, L, sort, eid, d.N, pp, fc1.data<Bf16>(), act.data<Bf16>(), d_fc2.data<Bf16>(), d_act.data<Bf16>(),
                        d_fc1.data<Bf16>(), pp);
    for (int64_t i = 0; i < d.N; ++i) r.scores.data<float>()[(sort[i] / d.k) * d.E + eid[sort[i]]] = pp[i];
    d_fc2.reset();
    d_act.reset();
    act.reset();
    fc1.reset();
    d_in = Tensor(alloc, DType::BF16, {d.N, d.H}, kDsp);  // [R, H] bf16
    experts_backward_in(d, L, sort, eid, d.N, in.data<Bf16>(), d_fc1.data<Bf16>(), d_in.data<Bf16>());
    in.reset();
  }
  alloc.set_phase(g + "dispatch");
  Tensor d_rows(alloc, DType::BF16, {d.N, d.H}, kDsp);  // [T·k, H] bf16, slot order (reversed all-to-all)
  Tensor d_x(alloc, DType::F32, {d.T, d.H}, kDsp);      // [T, H] fp32 d norm-2 output accumulator
  for (int64_t i = 0; i < d.N; ++i) copy_rows(d_in.data<Bf16>() + i * d.H, d_rows.data<Bf16>() + sort[i] * d.H, 1, d.H);
  std::fill(d_x.data<float>(), d_x.data<float>() + d_x.numel(), 0.0f);
  std::vector<int64_t> slots(z(d.k));
  for (int64_t t = 0; t < d.T; ++t) {
    for (int64_t s = 0; s < d.k; ++s) slots[z(s)] = s;
    std::sort(slots.begin(), slots.end(), [&](int64_t a, int64_t b) { return eid[t * d.k + a] < eid[t * d.k + b]; });
    for (int64_t s : slots)
      for (int64_t h = 0; h < d.H; ++h) d_x.data<float>()[t * d.H + h] += to_f32(d_rows.data<Bf16>()[(t * d.k + s) * d.H + h]);
  }
  router_backward(d, L, r, d_x.data<float>());
  res.d_x.assign(d_x.data<float>(), d_x.data<float>() + d_x.numel());
}

// ---- capped rounds (PipelinedLLEP at EP = 1)

// The round buffers of one pass, allocated once at its launch: send [D, C, H], receive [D, B, H],
// combine send [D, B, H], combine receive [D, C, H] (bf16), probs and indices [D, 2(B+C)] (fp32,
// int64: send and receive side, and their reverse in backward), destination/sort/unsort indices
// [3, T·k] (int64) and the combine accumulator [T, H] (fp32). At one rank B = C.
struct RoundSet {
  int64_t C, B, D;
  Tensor send, recv, comb_send, comb_recv, probs, index, dsu, comb_acc;
  RoundSet(TrackingAllocator& alloc, const Dims& d, int64_t cap, int64_t depth, const int64_t* ids)
      : C(cap), B(cap), D(depth),
        send(alloc, DType::BF16, {D, C, d.H}, kDsp),
        recv(alloc, DType::BF16, {D, B, d.H}, kDsp),
        comb_send(alloc, DType::BF16, {D, B, d.H}, kDsp),
        comb_recv(alloc, DType::BF16, {D, C, d.H}, kDsp),
        probs(alloc, DType::F32, {D, 2 * (B + C)}, kDsp),
        index(alloc, DType::I64, {D, 2 * (B + C)}, kDsp),
        dsu(alloc, DType::I64, {3, d.N}, kDsp),
        comb_acc(alloc, DType::F32, {d.T, d.H}, kDsp) {
    int64_t* p = dsu.data<int64_t>();
    std::fill(p, p + d.N, int64_t{0});  // destination rank of every copy: 0
    sort_by_expert(d, ids, p + d.N, p + 2 * d.N);
    std::fill(comb_acc.data<float>(), comb_acc.data<float>() + comb_acc.numel(), 0.0f);
  }
  const int64_t* sort() const { return dsu.data<int64_t>() + dsu.dim(1); }
  int64_t slot_of(int64_t j) const { return j % D; }
  float* prob_part(int64_t j, int64_t part) { return probs.data<float>() + slot_of(j) * 2 * (B + C) + part; }
  int64_t* index_part(int64_t j, int64_t part) { return index.data<int64_t>() + slot_of(j) * 2 * (B + C) + part; }
};

// Round j's forward up to act*prob: the source sends its rows j·C.. (sorted order) with their probs
// and slots, the destination receives them and sorts by local expert (a copy here) into `in`.
void round_dispatch(const Dims& d, const LayerData& L, const Routing& r, RoundSet& rs, int64_t j, int64_t r0, int64_t n,
                    Bf16* in, Bf16* fc1, Bf16* act) {
  const int64_t* sort = rs.sort();
  Bf16* send = rs.send.data<Bf16>() + rs.slot_of(j) * rs.C * d.H;
  Bf16* recv = rs.recv.data<Bf16>() + rs.slot_of(j) * rs.B * d.H;
  float* p_send = rs.prob_part(j, 0);
  float* p_recv = rs.prob_part(j, rs.C);
  int64_t* i_send = rs.index_part(j, 0);
  int64_t* i_recv = rs.index_part(j, rs.C);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t slot = sort[r0 + i];
    copy_rows(L.x.data<Bf16>() + (slot / d.k) * d.H, send + i * d.H, 1, d.H);
    p_send[i] = r.topk_w.data<float>()[slot];
    i_send[i] = slot;
  }
  copy_rows(send, recv, n, d.H);
  std::memcpy(p_recv, p_send, z(n) * sizeof(float));
  std::memcpy(i_recv, i_send, z(n) * sizeof(int64_t));
  copy_rows(recv, in, n, d.H);
  experts_forward(d, L, sort + r0, r.topk_ids.data<int64_t>(), n, p_recv, in, fc1, act, nullptr);
}

// Round j's fc2 and combine: fc2 rows, un-sorted at the destination, sent back and added to the
// accumulator (increasing expert order within and across rounds).
void round_combine(const Dims& d, const LayerData& L, const Routing& r, RoundSet& rs, int64_t j, int64_t r0, int64_t n,
                   const Bf16* act, Bf16* fc2, Bf16* unperm) {
  const int64_t* sort = rs.sort();
  for_each_expert_run(sort + r0, r.topk_ids.data<int64_t>(), n, [&](int64_t e, int64_t i0, int64_t m) {
    gemm_cpu(false, true, m, d.H, d.F, 1.0f, act + i0 * d.F, d.F, L.w_down.data<Bf16>() + e * d.H * d.F, d.F, false,
             fc2 + i0 * d.H, d.H);
  });
  copy_rows(fc2, unperm, n, d.H);
  Bf16* comb_send = rs.comb_send.data<Bf16>() + rs.slot_of(j) * rs.B * d.H;
  Bf16* comb_recv = rs.comb_recv.data<Bf16>() + rs.slot_of(j) * rs.C * d.H;
  copy_rows(unperm, comb_send, n, d.H);
  copy_rows(comb_send, comb_recv, n, d.H);
  accumulate_rows(d, sort, r0, n, comb_recv, rs.comb_acc.data<float>());
}

void run_capped(TrackingAllocator& alloc, const Dims& d, LayerData& L, const std::vector<int32_t>& ids,
                const DispatchScheduleConfig& c, DispatchScheduleResult& res) {
  const int64_t C = std::min(c.chunk_cap_rows, d.N), D = c.depth, B = C;
  const int64_t rounds = (d.N + C - 1) / C;
  res.rounds = rounds;
  res.chunk_cap_rows = C;
  auto rows_of = [&](int64_t j) { return std::min(C, d.N - j * C); };
  auto round = [&](const std::string& prefix, int64_t j) { return prefix + "dispatch/r" + std::to_string(j); };
  // No-grad forward: one set of round expert buffers [B, ·], reused by every round.
  {
    const std::string p = "fwd/" + c.layer + "/moe/";
    alloc.set_phase(p + "route");
    Routing r(alloc, d);
    compute_routing(d, L, ids, r);
    alloc.set_phase(round(p, 0));
    RoundSet rs(alloc, d, C, D, r.topk_ids.data<int64_t>());
    Tensor in(alloc, DType::BF16, {B, d.H}, kDsp);       // [B, H] bf16
    Tensor fc1(alloc, DType::BF16, {B, 2 * d.F}, kDsp);  // [B, 2F] bf16
    Tensor act(alloc, DType::BF16, {B, d.F}, kDsp);      // [B, F] bf16
    Tensor fc2(alloc, DType::BF16, {B, d.H}, kDsp);      // [B, H] bf16
    Tensor unperm(alloc, DType::BF16, {B, d.H}, kDsp);   // [B, H] bf16
    for (int64_t j = 0; j < rounds; ++j) {
      if (j > 0) alloc.set_phase(round(p, j));
      round_dispatch(d, L, r, rs, j, j * C, rows_of(j), in.data<Bf16>(), fc1.data<Bf16>(), act.data<Bf16>());
      round_combine(d, L, r, rs, j, j * C, rows_of(j), act.data<Bf16>(), fc2.data<Bf16>(), unperm.data<Bf16>());
    }
    res.out.resize(z(d.T * d.H));
    for (int64_t i = 0; i < d.T * d.H; ++i) res.out[z(i)] = to_f32(f32_to_bf16(rs.comb_acc.data<float>()[i]));
    res.topk_weights.assign(r.topk_w.data<float>(), r.topk_w.data<float>() + d.N);
  }
  // Recompute. Store: the rounds again, each writing its rows of the expert input, fc1 and
  // act*prob into a store of all R rows allocated once when the recompute starts (R is known from
  // the counts; no per-round allocation). Recompute mode: only the routing; each round is
  // recomputed in the backward.
  const std::string q = "bwd/" + c.layer + "/recompute/moe/";
  Tensor saved_in, saved_fc1, saved_act;  // store: [R, H], [R, 2F], [R, F] bf16
  if (!c.store) alloc.set_phase(q + "route");
  else alloc.set_phase(round(q, 0));
  Routing r(alloc, d);
  compute_routing(d, L, ids, r);
  const int64_t* eid = r.topk_ids.data<int64_t>();
  if (c.store) {
    RoundSet rs(alloc, d, C, D, eid);
    Tensor fc2(alloc, DType::BF16, {B, d.H}, kDsp);     // [B, H] bf16
    Tensor unperm(alloc, DType::BF16, {B, d.H}, kDsp);  // [B, H] bf16
    saved_in = Tensor(alloc, DType::BF16, {d.N, d.H}, kDsp);
    saved_fc1 = Tensor(alloc, DType::BF16, {d.N, 2 * d.F}, kDsp);
    saved_act = Tensor(alloc, DType::BF16, {d.N, d.F}, kDsp);
    for (int64_t j = 0; j < rounds; ++j) {
      if (j > 0) alloc.set_phase(round(q, j));
      const int64_t r0 = j * C, n = rows_of(j);
      Bf16* act = saved_act.data<Bf16>() + r0 * d.F;
      round_dispatch(d, L, r, rs, j, r0, n, saved_in.data<Bf16>() + r0 * d.H, saved_fc1.data<Bf16>() + r0 * 2 * d.F, act);
      round_combine(d, L, r, rs, j, r0, n, act, fc2.data<Bf16>(), unperm.data<Bf16>());
    }
  }
  // Backward, rounds in forward order (so d_x sums in the same order as the forward): the source
  // sends each copy's gradient (d_out of its token), the destination runs the expert backward and
  // returns d in; the source adds it to the fp32 d_x accumulator.
  const std::string g = "bwd/" + c.layer + "/moe/";
  alloc.set_phase(round(g, 0));
  RoundSet rs(alloc, d, C, D, eid);
  const int64_t* sort = rs.sort();
  Tensor grads(alloc, DType::BF16, {D, 2 * (B + C), d.H}, kDsp);  // [D, 2(B+C), H] bf16
  Tensor d_fc2(alloc, DType::BF16, {B, d.H}, kDsp);               // [B, H] bf16
  Tensor d_act(alloc, DType::BF16, {B, d.F}, kDsp);               // [B, F] bf16
  Tensor d_fc1(alloc, DType::BF16, {B, 2 * d.F}, kDsp);           // [B, 2F] bf16
  Tensor d_x(alloc, DType::F32, {d.T, d.H}, kDsp);                // [T, H] fp32 d norm-2 output accumulator
  std::fill(d_x.data<float>(), d_x.data<float>() + d_x.numel(), 0.0f);
  Tensor in, fc1, act;  // recompute mode: the round's recomputed expert input, fc1, act*prob [B, ·]
  if (!c.store) {
    in = Tensor(alloc, DType::BF16, {B, d.H}, kDsp);
    fc1 = Tensor(alloc, DType::BF16, {B, 2 * d.F}, kDsp);
    act = Tensor(alloc, DType::BF16, {B, d.F}, kDsp);
  }
  for (int64_t j = 0; j < rounds; ++j) {
    if (j > 0) alloc.set_phase(round(g, j));
    const int64_t r0 = j * C, n = rows_of(j);
    Bf16 *rin = nullptr, *rfc1 = nullptr, *ract = nullptr;
    if (c.store) {
      rin = saved_in.data<Bf16>() + r0 * d.H;
      rfc1 = saved_fc1.data<Bf16>() + r0 * 2 * d.F;
      ract = saved_act.data<Bf16>() + r0 * d.F;
    } else {
      rin = in.data<Bf16>();
      rfc1 = fc1.data<Bf16>();
      ract = act.data<Bf16>();
      round_dispatch(d, L, r, rs, j, r0, n, rin, rfc1, ract);
    }
    // The round's probs at the destination (the store mode's were sent in the recompute).
    float* prob = rs.prob_part(j, C);
    if (c.store)
      for (int64_t i = 0; i < n; ++i) prob[i] = r.topk_w.data<float>()[sort[r0 + i]];
    Bf16* g_send = grads.data<Bf16>() + rs.slot_of(j) * 2 * (B + C) * d.H;  // [C, H] d combine rows
    Bf16* g_recv = g_send + C * d.H;                                         // [B, H] received
    Bf16* g_back = g_recv + B * d.H;                                         // [B, H] d expert input
    Bf16* g_home = g_back + B * d.H;                                         // [C, H] d dispatch rows
    for (int64_t i = 0; i < n; ++i) copy_rows(L.d_out.data<Bf16>() + (sort[r0 + i] / d.k) * d.H, g_send + i * d.H, 1, d.H);
    copy_rows(g_send, g_recv, n, d.H);
    copy_rows(g_recv, d_fc2.data<Bf16>(), n, d.H);
    float* dprob = rs.prob_part(j, C + B);
    experts_backward_fc(d, L, sort + r0, eid, n, prob, rfc1, ract, d_fc2.data<Bf16>(), d_act.data<Bf16>(), d_fc1.data<Bf16>(), dprob);
    experts_backward_in(d, L, sort + r0, eid, n, rin, d_fc1.data<Bf16>(), g_back);
    std::memcpy(rs.prob_part(j, 2 * B + C), dprob, z(n) * sizeof(float));
    for (int64_t i = 0; i < n; ++i) {
      const int64_t slot = sort[r0 + i];
      r.scores.data<float>()[(slot / d.k) * d.E + eid[slot]] = rs.prob_part(j, 2 * B + C)[i];
    }
    copy_rows(g_back, g_home, n, d.H);
    accumulate_rows(d, sort, r0, n, g_home, d_x.data<float>());
  }
  router_backward(d, L, r, d_x.data<float>());
  res.d_x.assign(d_x.data<float>(), d_x.data<float>() + d_x.numel());
}

}  // namespace

DispatchInputs make_dispatch_inputs(const DispatchScheduleConfig& c) {
  const Dims d{c.tokens, c.hidden, c.experts, c.top_k, c.ffn, c.tokens * c.top_k};
  std::vector<Bf16> x(z(d.T * d.H)), dout(z(d.T * d.H)), wr(z(d.E * d.H)), wgu(z(d.E * 2 * d.F * d.H)), wd(z(d.E * d.H * d.F));
  fill_inputs(c, d, x.data(), dout.data(), wr.data(), wgu.data(), wd.data());
  auto widen = [](const std::vector<Bf16>& v) {
    std::vector<float> out(v.size());
    for (size_t i = 0; i < v.size(); ++i) out[i] = to_f32(v[i]);
    return out;
  };
  return DispatchInputs{widen(x), widen(dout), widen(wr), widen(wgu), widen(wd), draw_routing(c, d)};
}

DispatchScheduleResult run_dispatch_schedule(TrackingAllocator& alloc, const DispatchScheduleConfig& c) {
  if (c.tokens <= 0 || c.hidden <= 0 || c.experts <= 0 || c.ffn <= 0 || c.top_k <= 0 || c.top_k > c.experts)
    throw std::invalid_argument("dispatch schedule: need tokens, hidden, experts, ffn > 0 and 1 <= top_k <= experts");
  if (c.chunk_cap_rows < 0 || c.depth < 1)
    throw std::invalid_argument("dispatch schedule: chunk_cap_rows must be >= 0 and depth >= 1");
  const Dims d{c.tokens, c.hidden, c.experts, c.top_k, c.ffn, c.tokens * c.top_k};
  DispatchScheduleResult res;
  const std::vector<int32_t> ids = draw_routing(c, d);
  res.expert_counts = count_routing(ids, RoutingShape{1, d.E, d.k});
  LayerData L(alloc, d);
  fill_inputs(c, d, L.x.data<Bf16>(), L.d_out.data<Bf16>(), L.w_router.data<Bf16>(), L.w_gate_up.data<Bf16>(),
              L.w_down.data<Bf16>());
  for (Tensor* t : {&L.dw_router, &L.dw_gate_up, &L.dw_down}) std::fill(t->data<float>(), t->data<float>() + t->numel(), 0.0f);
  if (c.chunk_cap_rows == 0) run_uncapped(alloc, d, L, ids, c.layer, res);
  else run_capped(alloc, d, L, ids, c, res);
  res.d_w_router.assign(L.dw_router.data<float>(), L.dw_router.data<float>() + L.dw_router.numel());
  res.d_w_gate_up.assign(L.dw_gate_up.data<float>(), L.dw_gate_up.data<float>() + L.dw_gate_up.numel());
  res.d_w_down.assign(L.dw_down.data<float>(), L.dw_down.data<float>() + L.dw_down.numel());
  return res;
}

}  // namespace flatpeak::exec
