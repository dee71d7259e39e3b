// The capped passes of PipelinedLLEP (dispatch_internal.h): launch-time buffer sizes, the cap
// shrunk when known loads would overflow them, then the no-grad forward in rounds, the recompute
// (store mode: the rounds that fit on every rank, kept in a store sized at launch; recompute
// mode: only the routing) and the backward in rounds, with the lent weights' gradients staged home.
#include "executor/schedules/dispatch_internal.h"

#include <algorithm>
#include <string>
#include <vector>

namespace flatpeak::exec::dispatch_detail {

void run_capped(Communicator& comm, TrackingAllocator& alloc, const Dims& d, LayerData& L, const RowPlan& p,
                const std::vector<int32_t>& ids, const DispatchScheduleConfig& c, DispatchScheduleResult& res) {
  const CappedPlan cp = plan_capped(c, d, p);
  const int64_t C = cp.C, B = cp.B, D = c.depth, pool = cp.pool, store_rows = cp.store_rows, n = cp.n(), stored = cp.stored;
  const std::vector<Round>& rounds = cp.rounds;
  const std::vector<int64_t>& store_row = cp.store_row;
  res.rounds = n;
  res.chunk_cap_rows = cp.cap;
  res.launch_chunk_cap_rows = C;
  res.round_buffer_rows = B;
  res.foreign_pool = pool;
  res.store_rows = store_rows;
  res.stored_rounds = stored;
  res.max_round_received_rows = cp.max_received;
  auto round = [&](const std::string& prefix, int64_t j) { return prefix + "dispatch/r" + std::to_string(j); };
  // No-grad forward: one set of round expert buffers [B, ·], reused by every round.
  {
    const std::string pre = "fwd/" + c.layer + "/moe/";
    alloc.set_phase(pre + "route");
    Routing r(alloc, d);
    compute_routing(d, L, ids, r);
    alloc.set_phase(round(pre, 0));
    RoundSet rs(alloc, d, C, B, D, p, r.topk_ids.data<int64_t>());
    Tensor in(alloc, DType::BF16, {B, d.H}, kDsp);       // [B, H] bf16
    Tensor fc1(alloc, DType::BF16, {B, 2 * d.F}, kDsp);  // [B, 2F] bf16
    Tensor act(alloc, DType::BF16, {B, d.F}, kDsp);      // [B, F] bf16
    Tensor fc2(alloc, DType::BF16, {B, d.H}, kDsp);      // [B, H] bf16
    Tensor unperm(alloc, DType::BF16, {B, d.H}, kDsp);   // [B, H] bf16
    Tensor foreign = borrow_weights(comm, alloc, d, p, L, pool);
    const std::vector<ExpertSlot> w = expert_slots(d, p, L, &foreign, nullptr);
    for (int64_t j = 0; j < n; ++j) {
      if (j > 0) alloc.set_phase(round(pre, j));
      round_dispatch(comm, d, L, p, r, rs, rounds[z(j)], j, w, in.data<Bf16>(), fc1.data<Bf16>(), act.data<Bf16>());
      round_combine(comm, d, w, rs, rounds[z(j)], j, act.data<Bf16>(), fc2.data<Bf16>(), unperm.data<Bf16>());
    }
    res.out.resize(z(d.T * d.H));
    for (int64_t i = 0; i < d.T * d.H; ++i) res.out[z(i)] = to_f32(f32_to_bf16(rs.comb_acc.data<float>()[i]));
    res.topk_weights.assign(r.topk_w.data<float>(), r.topk_w.data<float>() + d.N);
  }
  // Recompute. Store: the rounds again, each writing its rows of the expert input, fc1 and
  // act*prob into a store allocated once when the recompute starts, sized at launch; rounds past
  // the ones that fit on every rank are skipped here and recomputed in backward into the store,
  // by then free (no per-round allocation). Recompute mode: only the routing (and the borrowed
  // weights); each round is recomputed in the backward.
  const std::string q = "bwd/" + c.layer + "/recompute/moe/";
  Tensor saved_in, saved_fc1, saved_act;  // store: [R_store, H], [R_store, 2F], [R_store, F] bf16
  if (!c.store) alloc.set_phase(q + "route");
  else alloc.set_phase(round(q, 0));
  Routing r(alloc, d);
  compute_routing(d, L, ids, r);
  const int64_t* eid = r.topk_ids.data<int64_t>();
  Tensor foreign = borrow_weights(comm, alloc, d, p, L, pool);
  if (c.store) {
    RoundSet rs(alloc, d, C, B, D, p, eid);
    Tensor fc2(alloc, DType::BF16, {B, d.H}, kDsp);     // [B, H] bf16
    Tensor unperm(alloc, DType::BF16, {B, d.H}, kDsp);  // [B, H] bf16
    saved_in = Tensor(alloc, DType::BF16, {store_rows, d.H}, kDsp);
    saved_fc1 = Tensor(alloc, DType::BF16, {store_rows, 2 * d.F}, kDsp);
    saved_act = Tensor(alloc, DType::BF16, {store_rows, d.F}, kDsp);
    const std::vector<ExpertSlot> w = expert_slots(d, p, L, &foreign, nullptr);
    for (int64_t j = 0; j < stored; ++j) {
      if (j > 0) alloc.set_phase(round(q, j));
      const int64_t s0 = store_row[z(j)];
      Bf16* act = saved_act.data<Bf16>() + s0 * d.F;
      round_dispatch(comm, d, L, p, r, rs, rounds[z(j)], j, w, saved_in.data<Bf16>() + s0 * d.H, saved_fc1.data<Bf16>() + s0 * 2 * d.F, act);
      round_combine(comm, d, w, rs, rounds[z(j)], j, act, fc2.data<Bf16>(), unperm.data<Bf16>());
    }
  }
  // Backward, rounds in forward order: the source sends each copy's gradient (d_out of its
  // token), the destination runs the expert backward and returns d in; the source adds it to
  // the fp32 d_x accumulator. d prob goes home the same way, into the dead router scores.
  const std::string gp = "bwd/" + c.layer + "/moe/";
  alloc.set_phase(round(gp, 0));
  RoundSet rs(alloc, d, C, B, D, p, eid);
  Tensor grads(alloc, DType::BF16, {D, 2 * (B + C), d.H}, kDsp);  // [D, 2(B+C), H] bf16
  Tensor d_fc2(alloc, DType::BF16, {B, d.H}, kDsp);               // [B, H] bf16 (then d in)
  Tensor d_act(alloc, DType::BF16, {B, d.F}, kDsp);               // [B, F] bf16
  Tensor d_fc1(alloc, DType::BF16, {B, 2 * d.F}, kDsp);           // [B, 2F] bf16
  Tensor d_x(alloc, DType::F32, {d.T, d.H}, kDsp);                // [T, H] fp32 d norm-2 output accumulator
  zero_f32(d_x);
  Tensor in, fc1, act;  // recompute mode: the round's recomputed expert input, fc1, act*prob [B, ·]
  if (!c.store) {
    in = Tensor(alloc, DType::BF16, {B, d.H}, kDsp);
    fc1 = Tensor(alloc, DType::BF16, {B, 2 * d.F}, kDsp);
    act = Tensor(alloc, DType::BF16, {B, d.F}, kDsp);
  }
  Tensor foreign_dw(alloc, DType::F32, {pool, d.P}, kDsp);                                  // [S_cap, P] fp32
  Tensor lent_staging(alloc, DType::F32, {d.ep > 1 && c.llep ? 1 : 0, d.P}, kDsp);          // [1, P] fp32
  if (!foreign_dw.empty()) zero_f32(foreign_dw);
  const std::vector<ExpertSlot> w = expert_slots(d, p, L, &foreign, &foreign_dw);
  for (int64_t j = 0; j < n; ++j) {
    if (j > 0) alloc.set_phase(round(gp, j));
    const Round& rd = rounds[z(j)];
    Bf16 *rin = nullptr, *rfc1 = nullptr, *ract = nullptr;
    if (c.store && j < stored) {
      const int64_t s0 = store_row[z(j)];
      rin = saved_in.data<Bf16>() + s0 * d.H;
      rfc1 = saved_fc1.data<Bf16>() + s0 * 2 * d.F;
      ract = saved_act.data<Bf16>() + s0 * d.F;
    } else if (c.store) {  // not stored: recomputed into the store, whose rounds are done
      rin = saved_in.data<Bf16>();
      rfc1 = saved_fc1.data<Bf16>();
      ract = saved_act.data<Bf16>();
      round_dispatch(comm, d, L, p, r, rs, rd, j, w, rin, rfc1, ract);
    } else {
      rin = in.data<Bf16>();
      rfc1 = fc1.data<Bf16>();
      ract = act.data<Bf16>();
      round_dispatch(comm, d, L, p, r, rs, rd, j, w, rin, rfc1, ract);
    }
    Bf16* g_send = grads.data<Bf16>() + rs.slot_of(j) * 2 * (B + C) * d.H;  // [C, H] d combine rows
    Bf16* g_recv = g_send + C * d.H;                                         // [B, H] received
    Bf16* g_back = g_recv + B * d.H;                                         // [B, H] d expert input
    Bf16* g_home = g_back + B * d.H;                                         // [C, H] d dispatch rows
    pack_round(d, p, r, rs, rd, j, L.d_out.data<Bf16>(), g_send);
    if (c.store && j < stored) send_round_probs(comm, p, rs, rd, j);  // the stored rounds' went with the recompute
    exchange(comm, g_send, rd.out, rd.out_begin, g_recv, rd.in, rd.in_begin, d.H, DType::BF16);
    regroup(rd.g, g_recv, d_fc2.data<Bf16>(), d.H);
    const Probs pr{rs.prob_part(j, C + B), false};
    experts_backward_fc(d, w, rd.g, pr, rfc1, ract, d_fc2.data<Bf16>(), d_act.data<Bf16>(), d_fc1.data<Bf16>());
    experts_backward_in(d, w, rd.g, rin, d_fc1.data<Bf16>(), d_fc2.data<Bf16>());
    ungroup(rd.g, d_fc2.data<Bf16>(), g_back, d.H);
    ungroup(rd.g, rs.prob_part(j, C + B), rs.prob_part(j, C), 1);
    exchange(comm, g_back, rd.in, rd.in_begin, g_home, rd.out, rd.out_begin, d.H, DType::BF16);
    exchange(comm, rs.prob_part(j, C), rd.in, rd.in_begin, rs.prob_part(j, 2 * B + C), rd.out, rd.out_begin, 1, DType::F32);
    const int64_t* i_home = rs.index_part(j, C + 2 * B);
    const float* dprob = rs.prob_part(j, 2 * B + C);
    for (int64_t i = 0; i < rd.sent; ++i) {
      const int64_t slot = i_home[i], t = slot / d.k;
      r.scores.data<float>()[t * d.E + eid[slot]] = dprob[i];
      for (int64_t h = 0; h < d.H; ++h) d_x.data<float>()[t * d.H + h] += to_f32(g_home[i * d.H + h]);
    }
  }
  router_backward(d, L, r, d_x.data<float>());
  res.d_x.assign(d_x.data<float>(), d_x.data<float>() + d_x.numel());
  if (p.lla_ran) return_weight_grads_staged(comm, d, p, L, foreign_dw, lent_staging);
}

}  // namespace flatpeak::exec::dispatch_detail
