// One uncapped dispatch per pass (dispatch_internal.h): standard EP's single all-to-allv
// dispatch and combine, LLEP's with its repeated tokens and borrowed weights; the no-grad
// forward, the recompute and the backward of run_uncapped.
#include "executor/schedules/dispatch_internal.h"

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

namespace flatpeak::exec::dispatch_detail {

namespace {

// Calls fn(t, pos, n): for every token in order, the send positions of its k copies in
// increasing expert order (n = k).
template <class Fn>
void for_each_token(const RowPlan& p, const Dims& d, const int64_t* ids, Fn fn) {
  std::vector<int64_t> seen(z(d.E), 0), order(z(d.k)), pos(z(d.k));  // O(E + k) bookkeeping
  for (int64_t t = 0; t < d.T; ++t) {
    for (int64_t s = 0; s < d.k; ++s) order[z(s)] = s;
    std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return ids[t * d.k + a] < ids[t * d.k + b]; });
    for (int64_t s = 0; s < d.k; ++s) {
      const int64_t e = ids[t * d.k + s];
      pos[z(s)] = p.position(e, seen[z(e)]++);
    }
    for (int64_t s = 0; s < d.k; ++s) order[z(s)] = pos[z(order[z(s)])];
    fn(t, order.data(), d.k);
  }
}

// A pass's send order (send position → slot) and its copies' probs in that order.
struct Meta {
  Tensor sort, pprobs;
  Meta(TrackingAllocator& alloc, const Dims& d, const RowPlan& p, const Routing& r)
      : sort(alloc, DType::I64, {d.N}, kDsp),     // [T·k] int64 send position → slot
        pprobs(alloc, DType::F32, {d.N}, kDsp) {  // [T·k] fp32 permuted probs (send order)
    fill_send_order(p, d, r.topk_ids.data<int64_t>(), sort.data<int64_t>(), nullptr, nullptr);
    for (int64_t i = 0; i < d.N; ++i) pprobs.data<float>()[i] = r.topk_w.data<float>()[sort.data<int64_t>()[i]];
  }
};

// What a dispatch leaves for the experts: their input in expert order and, at EP > 1, the probs
// as received (source-major; at one rank the experts read the permuted probs).
struct Dispatched {
  Tensor in, recv_probs;
};

// Dispatch: the send buffer gathers the rows in send order (LLEP: from the reference's repeated
// tokens [T·k, H]), the all-to-all moves them and their probs into the receive buffers, the send
// side is freed, and (EP > 1) the received rows are regrouped into the expert input.
Dispatched uncapped_dispatch(Communicator& comm, TrackingAllocator& alloc, const Dims& d, const LayerData& L, const RowPlan& p,
                             const Grouping& g, const Meta& m, bool repeated_tokens) {
  const int64_t R = p.received();
  Tensor repeated;
  if (repeated_tokens) {
    repeated = Tensor(alloc, DType::BF16, {d.N, d.H}, kDsp);  // [T·k, H] bf16, slot order
    for (int64_t i = 0; i < d.N; ++i) copy_rows(L.x.data<Bf16>() + (i / d.k) * d.H, repeated.data<Bf16>() + i * d.H, 1, d.H);
  }
  Tensor send(alloc, DType::BF16, {d.N, d.H}, kDsp);    // [T·k, H] bf16
  Tensor recv(alloc, DType::BF16, {R, d.H}, kDsp);      // [R, H] bf16
  Tensor recv_probs(alloc, DType::F32, {R}, kDsp);      // [R] fp32
  const int64_t* sort = m.sort.data<int64_t>();
  for (int64_t i = 0; i < d.N; ++i) {
    const Bf16* row = repeated_tokens ? repeated.data<Bf16>() + sort[i] * d.H : L.x.data<Bf16>() + (sort[i] / d.k) * d.H;
    copy_rows(row, send.data<Bf16>() + i * d.H, 1, d.H);
  }
  const std::vector<int64_t> out = row_of(p.send_rows, d.me), in = column_of(p.send_rows, d.me);
  exchange(comm, send.raw(), out, p.dest_begin, recv.raw(), in, p.recv_begin, d.H, DType::BF16);
  exchange(comm, m.pprobs.raw(), out, p.dest_begin, recv_probs.raw(), in, p.recv_begin, 1, DType::F32);
  send.reset();
  repeated.reset();
  if (d.ep == 1) return Dispatched{std::move(recv), Tensor()};
  Tensor input(alloc, DType::BF16, {R, d.H}, kDsp);     // [R, H] bf16, expert order
  regroup(g, recv.data<Bf16>(), input.data<Bf16>(), d.H);
  return Dispatched{std::move(input), std::move(recv_probs)};
}

// Combine: fc2 rows back to source-major order, the all-to-all back, and the MoE output [T, H]
// bf16 summing each token's k rows in increasing expert order.
void uncapped_combine(Communicator& comm, TrackingAllocator& alloc, const Dims& d, const RowPlan& p, const Grouping& g,
                      const Routing& r, const Tensor& fc2, std::vector<float>* out_values) {
  const int64_t R = p.received();
  Tensor unperm(alloc, DType::BF16, {R, d.H}, kDsp);       // [R, H] bf16, source-major
  Tensor comb_recv(alloc, DType::BF16, {d.N, d.H}, kDsp);  // [T·k, H] bf16, send order
  Tensor out(alloc, DType::BF16, {d.T, d.H}, kDsp);        // [T, H] bf16
  ungroup(g, fc2.data<Bf16>(), unperm.data<Bf16>(), d.H);
  exchange(comm, unperm.raw(), column_of(p.send_rows, d.me), p.recv_begin, comb_recv.raw(), row_of(p.send_rows, d.me), p.dest_begin,
           d.H, DType::BF16);
  const Bf16* rows = comb_recv.data<Bf16>();
  for_each_token(p, d, r.topk_ids.data<int64_t>(), [&](int64_t t, const int64_t* pos, int64_t n) {
    for (int64_t h = 0; h < d.H; ++h) {
      float sum = 0.0f;
      for (int64_t s = 0; s < n; ++s) sum += to_f32(rows[pos[s] * d.H + h]);
      out.data<Bf16>()[t * d.H + h] = f32_to_bf16(sum);
    }
  });
  if (out_values) {
    out_values->resize(z(d.T * d.H));
    for (int64_t i = 0; i < d.T * d.H; ++i) (*out_values)[z(i)] = to_f32(out.data<Bf16>()[i]);
  }
}

Grouping uncapped_grouping(const RowPlan& p) {
  std::vector<int64_t> first(z(p.ep), 0), count;
  for (int64_t s = 0; s < p.ep; ++s) count.push_back(p.send_rows[z(s)][z(p.me)]);
  return make_grouping(p, first, count);
}

}  // namespace

void run_uncapped(Communicator& comm, TrackingAllocator& alloc, const Dims& d, LayerData& L, const RowPlan& p,
                  const std::vector<int32_t>& ids, const DispatchScheduleConfig& c, DispatchScheduleResult& res) {
  const bool llep = c.llep;  // the reference's repeated tokens ride with LLEP's dispatch
  const Grouping g = uncapped_grouping(p);
  const int64_t R = p.received();
  // No-grad forward: nothing is kept; each phase frees what the next does not read.
  {
    const std::string pre = "fwd/" + c.layer + "/moe/";
    alloc.set_phase(pre + "route");
    Routing r(alloc, d);
    compute_routing(d, L, ids, r);
    alloc.set_phase(pre + "dispatch");
    Tensor foreign = borrow_weights(comm, alloc, d, p, L, static_cast<int64_t>(p.foreign.size()));
    const std::vector<ExpertSlot> w = expert_slots(d, p, L, &foreign, nullptr);
    Meta m(alloc, d, p, r);
    Dispatched in = uncapped_dispatch(comm, alloc, d, L, p, g, m, llep);
    alloc.set_phase(pre + "experts");
    Tensor fc1(alloc, DType::BF16, {R, 2 * d.F}, kDsp);  // [R, 2F] bf16
    Tensor act(alloc, DType::BF16, {R, d.F}, kDsp);      // [R, F] bf16
    const Probs pr = d.ep == 1 ? Probs{m.pprobs.data<float>(), false} : Probs{in.recv_probs.data<float>(), true};
    experts_forward(d, w, g, pr, in.in.data<Bf16>(), fc1.data<Bf16>(), act.data<Bf16>(), nullptr);
    in.recv_probs.reset();
    in.in.reset();
    fc1.reset();
    Tensor fc2(alloc, DType::BF16, {R, d.H}, kDsp);  // [R, H] bf16
    experts_fc2(d, w, g, act.data<Bf16>(), fc2.data<Bf16>());
    act.reset();
    alloc.set_phase(pre + "combine");
    uncapped_combine(comm, alloc, d, p, g, r, fc2, &res.out);
    res.topk_weights.assign(r.topk_w.data<float>(), r.topk_w.data<float>() + d.N);
  }
  // Recompute: the same forward, keeping expert input, fc1 and act*prob (and the received probs)
  // for the backward; the borrowed weights stay until the backward has returned their gradients.
  const std::string q = "bwd/" + c.layer + "/recompute/moe/";
  alloc.set_phase(q + "dispatch");
  Routing r(alloc, d);
  compute_routing(d, L, ids, r);
  Tensor foreign = borrow_weights(comm, alloc, d, p, L, static_cast<int64_t>(p.foreign.size()));
  Meta m(alloc, d, p, r);
  const int64_t* sort = m.sort.data<int64_t>();
  const int64_t* eid = r.topk_ids.data<int64_t>();
  Dispatched in = uncapped_dispatch(comm, alloc, d, L, p, g, m, llep);
  const Probs pr = d.ep == 1 ? Probs{m.pprobs.data<float>(), false} : Probs{in.recv_probs.data<float>(), true};
  alloc.set_phase(q + "experts");
  Tensor fc1(alloc, DType::BF16, {R, 2 * d.F}, kDsp);  // [R, 2F] bf16, saved
  Tensor act(alloc, DType::BF16, {R, d.F}, kDsp);      // [R, F] bf16, saved
  Tensor fc2(alloc, DType::BF16, {R, d.H}, kDsp);      // [R, H] bf16
  {
    const std::vector<ExpertSlot> w = expert_slots(d, p, L, &foreign, nullptr);
    experts_forward(d, w, g, pr, in.in.data<Bf16>(), fc1.data<Bf16>(), act.data<Bf16>(), fc2.data<Bf16>());
  }
  alloc.set_phase(q + "combine");
  uncapped_combine(comm, alloc, d, p, g, r, fc2, nullptr);
  fc2.reset();

  // Backward. Combine: each copy's gradient is d_out of its token (unweighted sum), gathered in
  // send order; the reversed all-to-all brings them to the experts, regrouped in expert order.
  const std::string gp = "bwd/" + c.layer + "/moe/";
  alloc.set_phase(gp + "combine");
  Tensor d_fc2;
  {
    Tensor d_comb(alloc, DType::BF16, {d.N, d.H}, kDsp);  // [T·k, H] bf16, send order
    Tensor d_recv(alloc, DType::BF16, {R, d.H}, kDsp);    // [R, H] bf16, source-major
    for (int64_t i = 0; i < d.N; ++i) copy_rows(L.d_out.data<Bf16>() + (sort[i] / d.k) * d.H, d_comb.data<Bf16>() + i * d.H, 1, d.H);
    exchange(comm, d_comb.raw(), row_of(p.send_rows, d.me), p.dest_begin, d_recv.raw(), column_of(p.send_rows, d.me), p.recv_begin, d.H,
             DType::BF16);
    d_comb.reset();
    if (d.ep == 1) {
      d_fc2 = std::move(d_recv);
    } else {
      d_fc2 = Tensor(alloc, DType::BF16, {R, d.H}, kDsp);  // [R, H] bf16, expert order
      regroup(g, d_recv.data<Bf16>(), d_fc2.data<Bf16>(), d.H);
    }
  }
  alloc.set_phase(gp + "experts");
  // LLEP: the borrowed experts' fp32 gradients [S_p, P] and the lent ones coming back [S_sent, P].
  Tensor foreign_dw(alloc, DType::F32, {static_cast<int64_t>(p.foreign.size()), d.P}, kDsp);
  Tensor lent_dw(alloc, DType::F32, {p.lla_ran ? p.lent : 0, d.P}, kDsp);
  if (!foreign_dw.empty()) zero_f32(foreign_dw);
  const std::vector<ExpertSlot> w = expert_slots(d, p, L, &foreign, &foreign_dw);
  Tensor d_in;
  {
    Tensor d_act(alloc, DType::BF16, {R, d.F}, kDsp);      // [R, F] bf16
    Tensor d_fc1(alloc, DType::BF16, {R, 2 * d.F}, kDsp);  // [R, 2F] bf16
    // d prob lands over the probs the experts read; at EP > 1 the reversed all-to-all takes it
    // home into the permuted probs; then it goes to the dead router scores at [t, e].
    experts_backward_fc(d, w, g, pr, fc1.data<Bf16>(), act.data<Bf16>(), d_fc2.data<Bf16>(), d_act.data<Bf16>(), d_fc1.data<Bf16>());
    if (d.ep > 1) {
      exchange(comm, in.recv_probs.raw(), column_of(p.send_rows, d.me), p.recv_begin, m.pprobs.raw(), row_of(p.send_rows, d.me),
               p.dest_begin, 1, DType::F32);
      in.recv_probs.reset();
    }
    const float* pp = m.pprobs.data<float>();
    for (int64_t i = 0; i < d.N; ++i) r.scores.data<float>()[(sort[i] / d.k) * d.E + eid[sort[i]]] = pp[i];
    d_fc2.reset();
    d_act.reset();
    act.reset();
    fc1.reset();
    d_in = Tensor(alloc, DType::BF16, {R, d.H}, kDsp);  // [R, H] bf16, expert order
    experts_backward_in(d, w, g, in.in.data<Bf16>(), d_fc1.data<Bf16>(), d_in.data<Bf16>());
    in.in.reset();
  }
  // Dispatch: d in back to source-major order (EP > 1), the reversed all-to-all to the sources,
  // and each token's k rows summed in increasing expert order into the fp32 d_x.
  alloc.set_phase(gp + "dispatch");
  Tensor d_src;
  if (d.ep > 1) {
    d_src = Tensor(alloc, DType::BF16, {R, d.H}, kDsp);  // [R, H] bf16, source-major
    ungroup(g, d_in.data<Bf16>(), d_src.data<Bf16>(), d.H);
    d_in.reset();
  }
  Tensor d_rows(alloc, DType::BF16, {d.N, d.H}, kDsp);  // [T·k, H] bf16, send order (reversed all-to-all)
  Tensor d_x(alloc, DType::F32, {d.T, d.H}, kDsp);      // [T, H] fp32 d norm-2 output accumulator
  exchange(comm, d.ep > 1 ? d_src.raw() : d_in.raw(), column_of(p.send_rows, d.me), p.recv_begin, d_rows.raw(), row_of(p.send_rows, d.me),
           p.dest_begin, d.H, DType::BF16);
  d_src.reset();
  zero_f32(d_x);
  for_each_token(p, d, eid, [&](int64_t t, const int64_t* pos, int64_t n) {
    for (int64_t s = 0; s < n; ++s)
      for (int64_t h = 0; h < d.H; ++h) d_x.data<float>()[t * d.H + h] += to_f32(d_rows.data<Bf16>()[pos[s] * d.H + h]);
  });
  router_backward(d, L, r, d_x.data<float>());
  res.d_x.assign(d_x.data<float>(), d_x.data<float>() + d_x.numel());
  if (p.lla_ran) return_weight_grads(comm, d, p, L, foreign_dw, lent_dw);
}

}  // namespace flatpeak::exec::dispatch_detail
