// PipelinedLLEP's rounds (dispatch_internal.h): how many rows each source sends each destination
// per round (striping or destination-major cuts), each round's traffic and receive grouping, and
// one round's dispatch and combine through the round buffers (RoundSet) allocated once per pass.
#include "executor/schedules/dispatch_internal.h"

#include <algorithm>
#include <stdexcept>
#include <utility>
#include <vector>

namespace flatpeak::exec::dispatch_detail {

std::vector<CountMatrix> round_counts(const RowPlan& p, int64_t cap, bool striping) {
  if (striping) return pipelined_rounds(p.send_rows, cap).send_rows;
  std::vector<CountMatrix> out;
  int64_t n = 0;
  for (const auto& row : p.send_rows) {
    int64_t total = 0;
    for (int64_t v : row) total += v;
    n = std::max(n, (total + cap - 1) / cap);
  }
  for (int64_t j = 0; j < n; ++j) {
    CountMatrix m(z(p.ep), std::vector<int64_t>(z(p.ep), 0));
    for (int64_t s = 0; s < p.ep; ++s) {
      const std::vector<int64_t> begin = offsets_of(p.send_rows[z(s)]);
      for (int64_t t = 0; t < p.ep; ++t) {
        const int64_t lo = std::max(begin[z(t)], j * cap), hi = std::min(begin[z(t + 1)], (j + 1) * cap);
        m[z(s)][z(t)] = std::max<int64_t>(0, hi - lo);
      }
    }
    out.push_back(std::move(m));
  }
  return out;
}

std::vector<Round> make_rounds(const RowPlan& p, const std::vector<CountMatrix>& counts) {
  std::vector<Round> rounds;
  std::vector<int64_t> sent_so_far(z(p.ep), 0), recv_so_far(z(p.ep), 0);
  for (const CountMatrix& m : counts) {
    Round r;
    r.out = row_of(m, p.me);
    r.in = column_of(m, p.me);
    r.out_begin = offsets_of(r.out);
    r.in_begin = offsets_of(r.in);
    r.sent = r.out_begin.back();
    r.received = r.in_begin.back();
    r.first_out = sent_so_far;
    r.g = make_grouping(p, recv_so_far, r.in);
    for (int64_t t = 0; t < p.ep; ++t) {
      sent_so_far[z(t)] += r.out[z(t)];
      recv_so_far[z(t)] += r.in[z(t)];
    }
    rounds.push_back(std::move(r));
  }
  return rounds;
}

namespace {

// Rounds [0, stored) whose rows fit in the store on every rank (prefix sums of each
// destination's received rows ≤ store_rows); the rest are recomputed in backward.
int64_t stored_rounds(const std::vector<CountMatrix>& counts, int64_t ep, int64_t store_rows) {
  std::vector<int64_t> used(z(ep), 0);
  for (size_t j = 0; j < counts.size(); ++j)
    for (int64_t t = 0; t < ep; ++t) {
      for (int64_t s = 0; s < ep; ++s) used[z(t)] += counts[j][z(s)][z(t)];
      if (used[z(t)] > store_rows) return static_cast<int64_t>(j);
    }
  return static_cast<int64_t>(counts.size());
}

}  // namespace

CappedPlan plan_capped(const DispatchScheduleConfig& c, const Dims& d, const RowPlan& p) {
  CappedPlan cp;
  cp.C = std::min(c.chunk_cap_rows, d.N);
  // Launch-time sizes (spec/least_loaded.h), the same whatever the routing: round buffers of B
  // rows, the foreign-weight pool (LLA lent no rank more: plan_rows), the store's rows.
  cp.B = dispatch_round_buffer_rows(c, d.ep);
  cp.pool = dispatch_foreign_pool(c, d.ep);
  cp.store_rows = c.store ? dispatch_store_rows(c, d.ep) : 0;
  // The buffers hold B rows per round whatever the routing; known loads that would overflow
  // them shrink the cap (more rounds, same memory).
  cp.cap = cp.C;
  if (d.ep > 1 && c.striping && round_receive_bound_rows(p.send_rows, cp.C) > cp.B) {
    cp.cap = shrink_chunk_cap(p.send_rows, cp.C, cp.B);
    if (cp.cap < 1) throw std::logic_error("dispatch schedule: no chunk cap fits the launch-time round buffers");
  }
  cp.counts = round_counts(p, cp.cap, c.striping);
  cp.rounds = make_rounds(p, cp.counts);
  const int64_t n = cp.n();
  cp.stored = c.store ? stored_rounds(cp.counts, d.ep, cp.store_rows) : 0;
  for (const Round& rd : cp.rounds) {
    cp.max_received = std::max(cp.max_received, rd.received);
    if (rd.received > cp.B || rd.sent > cp.C) throw std::logic_error("dispatch schedule: a round exceeds the launch-time buffers");
  }
  if (c.store && n > cp.stored && cp.max_received > cp.store_rows)
    throw std::logic_error("dispatch schedule: a recomputed round does not fit the store");
  cp.store_row.assign(z(n) + 1, 0);
  for (int64_t j = 0; j < n; ++j) cp.store_row[z(j) + 1] = cp.store_row[z(j)] + cp.rounds[z(j)].received;
  return cp;
}

void pack_round(const Dims& d, const RowPlan& p, const Routing& r, RoundSet& rs, const Round& rd, int64_t j, const Bf16* src, Bf16* rows) {
  const int64_t* sort = rs.sort();
  float* p_send = rs.prob_part(j, 0);
  int64_t* i_send = rs.index_part(j, 0);
  int64_t* i_home = rs.index_part(j, rs.C + 2 * rs.B);
  int64_t q = 0;
  for (int64_t t = 0; t < d.ep; ++t)
    for (int64_t i = 0; i < rd.out[z(t)]; ++i, ++q) {
      const int64_t slot = sort[p.dest_begin[z(t)] + rd.first_out[z(t)] + i];
      copy_rows(src + (slot / d.k) * d.H, rows + q * d.H, 1, d.H);
      p_send[q] = r.topk_w.data<float>()[slot];
      i_send[q] = r.topk_ids.data<int64_t>()[slot];
      i_home[q] = slot;
    }
}

void send_round_probs(Communicator& comm, const RowPlan& p, RoundSet& rs, const Round& rd, int64_t j) {
  exchange(comm, rs.prob_part(j, 0), rd.out, rd.out_begin, rs.prob_part(j, rs.C), rd.in, rd.in_begin, 1, DType::F32);
  exchange(comm, rs.index_part(j, 0), rd.out, rd.out_begin, rs.index_part(j, rs.C), rd.in, rd.in_begin, 1, DType::I64);
  const int64_t* got = rs.index_part(j, rs.C);
  for (const auto& ch : rd.g.chunks)
    for (int64_t i = 0; i < ch.rows; ++i)
      if (p.local_of[z(got[ch.recv_row + i])] != ch.local) throw std::logic_error("dispatch schedule: a round's rows disagree with the plan");
  regroup(rd.g, rs.prob_part(j, rs.C), rs.prob_part(j, rs.C + rs.B), 1);
}

void round_dispatch(Communicator& comm, const Dims& d, const LayerData& L, const RowPlan& p, const Routing& r, RoundSet& rs,
                    const Round& rd, int64_t j, const std::vector<ExpertSlot>& w, Bf16* in, Bf16* fc1, Bf16* act) {
  pack_round(d, p, r, rs, rd, j, L.x.data<Bf16>(), rs.send_rows(j));
  exchange(comm, rs.send_rows(j), rd.out, rd.out_begin, rs.recv_rows(j), rd.in, rd.in_begin, d.H, DType::BF16);
  send_round_probs(comm, p, rs, rd, j);
  regroup(rd.g, rs.recv_rows(j), in, d.H);
  experts_forward(d, w, rd.g, Probs{rs.prob_part(j, rs.C + rs.B), false}, in, fc1, act, nullptr);
}

void round_combine(Communicator& comm, const Dims& d, const std::vector<ExpertSlot>& w, RoundSet& rs, const Round& rd, int64_t j,
                   const Bf16* act, Bf16* fc2, Bf16* unperm) {
  experts_fc2(d, w, rd.g, act, fc2);
  ungroup(rd.g, fc2, unperm, d.H);
  Bf16* comb_send = rs.comb_send.data<Bf16>() + rs.slot_of(j) * rs.B * d.H;
  Bf16* comb_recv = rs.comb_recv.data<Bf16>() + rs.slot_of(j) * rs.C * d.H;
  copy_rows(unperm, comb_send, rd.received, d.H);
  exchange(comm, comb_send, rd.in, rd.in_begin, comb_recv, rd.out, rd.out_begin, d.H, DType::BF16);
  const int64_t* i_home = rs.index_part(j, rs.C + 2 * rs.B);
  float* acc = rs.comb_acc.data<float>();
  for (int64_t q = 0; q < rd.sent; ++q) {
    const int64_t t = i_home[q] / d.k;
    for (int64_t h = 0; h < d.H; ++h) acc[t * d.H + h] += to_f32(comb_recv[q * d.H + h]);
  }
}

}  // namespace flatpeak::exec::dispatch_detail
