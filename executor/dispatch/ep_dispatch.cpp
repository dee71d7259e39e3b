#include "executor/dispatch/ep_dispatch.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <utility>

#include "executor/memory/tensor.h"
#include "executor/ops/combine.h"
#include "executor/ops/expert_ffn.h"
#include "executor/ops/permute.h"

namespace flatpeak::exec {

const char* ep_schedule_name(EpSchedule schedule) {
  switch (schedule) {
    case EpSchedule::Uncapped: return "uncapped";
    case EpSchedule::Llep: return "llep";
    case EpSchedule::PipelinedLlep: return "pipelined_llep";
  }
  return "?";
}

namespace {

size_t z(int64_t i) { return static_cast<size_t>(i); }

// Where every token copy goes: c[(s·E + e)·EP + d] rows of source s's copies of expert e are
// computed on rank d, taken from the source's copies of e in order (native first, then helpers
// in increasing rank of their range), identical on every rank.
struct DispatchPlan {
  int64_t ep = 1;
  int64_t experts = 0;
  int64_t local_experts = 0;  // L
  LlaResult lla;
  std::vector<int64_t> c;                       // [EP][E][EP]
  std::vector<std::vector<std::pair<int64_t, int64_t>>> source_segments;  // this rank: [E] (d, rows) in order
  int64_t rows(int64_t s, int64_t e, int64_t d) const { return c[z((s * experts + e) * ep + d)]; }
};

DispatchPlan make_plan(const CountMatrix& copies, int64_t ep, int64_t experts, int64_t my_rank,
                       bool use_lla, const LlaKnobs& knobs) {
  DispatchPlan plan;
  plan.ep = ep;
  plan.experts = experts;
  plan.local_experts = experts / ep;
  plan.c.assign(z(ep * experts * ep), 0);
  plan.source_segments.assign(z(experts), {});
  if (use_lla) plan.lla = least_loaded_assignment(expert_loads(copies), ep, knobs);
  for (int64_t s = 0; s < ep; ++s) {
    std::vector<std::vector<LlaRange>> ranges;
    if (use_lla && plan.lla.triggered) ranges = lla_source_ranges(plan.lla, copies, s);
    for (int64_t e = 0; e < experts; ++e) {
      std::vector<std::pair<int64_t, int64_t>> segments;
      if (use_lla && plan.lla.triggered) {
        std::vector<LlaRange> rs = ranges[z(e)];
        std::sort(rs.begin(), rs.end(),
                  [](const LlaRange& a, const LlaRange& b) { return a.start_row < b.start_row; });
        for (const LlaRange& r : rs) {
          if (r.rows > 0) segments.emplace_back(r.rank, r.rows);
        }
      } else if (copies[z(s)][z(e)] > 0) {
        segments.emplace_back(e / plan.local_experts, copies[z(s)][z(e)]);
      }
      for (const auto& seg : segments) plan.c[z((s * experts + e) * ep + seg.first)] += seg.second;
      if (s == my_rank) plan.source_segments[z(e)] = segments;
    }
  }
  return plan;
}

}  // namespace

EpDispatchStats moe_dispatch_backward(Communicator& comm, TrackingAllocator& alloc,
                                      const MoeDims& dims, const EpDispatchConfig& config,
                                      const MoeRankTensors& io) {
  const int64_t ep = comm.size();
  const int64_t me = comm.rank();
  const int64_t T = dims.tokens, H = dims.hidden, F = dims.ffn, E = dims.experts, k = dims.top_k;
  if (E % ep != 0) throw std::invalid_argument("moe_dispatch: E must be a multiple of EP");
  const int64_t L = E / ep;
  const int64_t N = T * k;
  const int64_t wgu_elems = 2 * F * H, wd_elems = H * F;
  {
    InputErrors errors;
    if (config.schedule != EpSchedule::Uncapped) validate_lla_knobs(config.lla, errors);
    if (config.schedule == EpSchedule::PipelinedLlep) validate_chunk_cap(config.chunk_cap_rows, errors);
    errors.throw_if_any();
  }
  const size_t phase_record_start = alloc.phase_records().size();
  alloc.set_phase(config.phase_prefix + "/dispatch/plan");
  EpDispatchStats stats;

  // Routing metadata: per-expert counts and the expert-grouped order of this rank's copies.
  Tensor counts(alloc, DType::I64, {E}, Category::Dispatch);          // [E]
  Tensor slot_to_row(alloc, DType::I32, {N}, Category::Dispatch);     // [T·k]
  Tensor row_to_slot(alloc, DType::I32, {N}, Category::Dispatch);     // [T·k]
  PermuteArgs route;
  route.topk_ids = io.topk_ids;
  route.expert_counts = counts.data<int64_t>();
  route.slot_to_row = slot_to_row.data<int32_t>();
  route.row_to_slot = row_to_slot.data<int32_t>();
  route.tokens = T;
  route.top_k = k;
  route.experts = E;
  route.hidden = H;
  moe_route_cpu(route);

  // Every rank learns the [EP][E] count matrix (its column sums are LLA's all-reduced loads).
  Tensor all_counts(alloc, DType::I64, {ep, E}, Category::Dispatch);  // [EP, E]
  comm.all_gather(counts.data<int64_t>(), all_counts.data<int64_t>(), E, DType::I64);
  CountMatrix copies(z(ep), std::vector<int64_t>(z(E)));
  for (int64_t s = 0; s < ep; ++s) {
    for (int64_t e = 0; e < E; ++e) copies[z(s)][z(e)] = all_counts.data<int64_t>()[s * E + e];
  }
  const bool use_lla = config.schedule != EpSchedule::Uncapped;
  const DispatchPlan plan = make_plan(copies, ep, E, me, use_lla, config.lla);
  stats.lla_triggered = use_lla && plan.lla.triggered;

  // [EP][EP] rows source → destination, and this rank's computed rows.
  CountMatrix send_rows(z(ep), std::vector<int64_t>(z(ep), 0));
  for (int64_t s = 0; s < ep; ++s) {
    for (int64_t e = 0; e < E; ++e) {
      for (int64_t d = 0; d < ep; ++d) send_rows[z(s)][z(d)] += plan.rows(s, e, d);
    }
  }
  std::vector<int64_t> rank_rows(z(ep), 0);
  for (int64_t s = 0; s < ep; ++s) {
    for (int64_t d = 0; d < ep; ++d) rank_rows[z(d)] += send_rows[z(s)][z(d)];
  }
  stats.received_rows = rank_rows[z(me)];
  stats.rho = imbalance_rho(rank_rows);

  // Rounds and buffer sizes. Uncapped and LLEP: one round, buffers sized by the realised counts.
  // PipelinedLLEP: receive buffers sized at launch from the cap and a ρ bound; the cap shrinks
  // (more rounds) when the known loads would overflow them.
  int64_t send_cap_rows = N;
  int64_t recv_cap_rows = stats.received_rows;
  PipelinedRounds rounds;
  if (config.schedule == EpSchedule::PipelinedLlep) {
    const double rho_bound =
        config.rho_bound > 0.0
            ? config.rho_bound
            : std::max(config.lla.imbalance_trigger, config.lla.llep_alpha) +
                  static_cast<double>(lla_slack_rows(config.lla, ep, N)) /
                      static_cast<double>(std::max<int64_t>(N, 1));
    recv_cap_rows = round_receive_bound_rows(config.chunk_cap_rows, ep, rho_bound);
    send_cap_rows = config.chunk_cap_rows;
    const int64_t cap = shrink_chunk_cap(send_rows, config.chunk_cap_rows, recv_cap_rows);
    if (cap < 1) {
      throw std::logic_error("moe_dispatch: no chunk cap fits the launch-time buffers");
    }
    rounds = pipelined_rounds(send_rows, cap);
    stats.chunk_cap_rows = cap;
    stats.launch_chunk_cap_rows = config.chunk_cap_rows;
    if (rounds.max_round_received_rows > recv_cap_rows) {
      throw std::logic_error("moe_dispatch: striped rounds exceed the launch-time buffers");
    }
  } else {
    rounds.rounds = 1;
    rounds.send_rows.push_back(send_rows);
    rounds.chunk_cap_rows = N;
    stats.chunk_cap_rows = N;
    stats.launch_chunk_cap_rows = N;
  }
  // Collectives must match: every rank runs the same number of rounds (all computed the same).
  stats.rounds = rounds.rounds;
  stats.round_buffer_rows = recv_cap_rows;

  // This rank as a source: its copies in send order, destination-major ([d][e asc][segment]).
  Tensor send_order(alloc, DType::I32, {N}, Category::Dispatch);  // [T·k] slots in send order
  std::vector<int64_t> dest_begin(z(ep) + 1, 0);
  {
    std::vector<int64_t> expert_offset(z(E) + 1, 0);
    for (int64_t e = 0; e < E; ++e) {
      expert_offset[z(e) + 1] = expert_offset[z(e)] + counts.data<int64_t>()[e];
    }
    int64_t pos = 0;
    for (int64_t d = 0; d < ep; ++d) {
      dest_begin[z(d)] = pos;
      for (int64_t e = 0; e < E; ++e) {
        int64_t offset = 0;
        for (const auto& seg : plan.source_segments[z(e)]) {
          if (seg.first == d) {
            for (int64_t i = 0; i < seg.second; ++i) {
              send_order.data<int32_t>()[pos++] =
                  row_to_slot.data<int32_t>()[expert_offset[z(e)] + offset + i];
            }
          }
          offset += seg.second;
        }
      }
    }
    dest_begin[z(ep)] = pos;
  }

  // This rank as a destination: the experts it computes (native L, then foreign by id).
  std::vector<int64_t> foreign;  // expert ids, ascending
  for (int64_t e = 0; e < E; ++e) {
    if (e / L == me) continue;
    int64_t rows = 0;
    for (int64_t s = 0; s < ep; ++s) rows += plan.rows(s, e, me);
    if (rows > 0) foreign.push_back(e);
  }
  const int64_t S = static_cast<int64_t>(foreign.size());
  std::vector<int64_t> local_index(z(E), -1);
  for (int64_t l = 0; l < L; ++l) local_index[z(me * L + l)] = l;
  for (int64_t i = 0; i < S; ++i) local_index[z(foreign[z(i)])] = L + i;
  stats.foreign_experts = S;

  // Lent weights: expert e (native here) to helper h when h computes any of e's rows.
  std::vector<std::vector<int64_t>> lent(z(ep));  // [h] expert ids, ascending
  for (int64_t h = 0; h < ep; ++h) {
    if (h == me) continue;
    for (int64_t l = 0; l < L; ++l) {
      const int64_t e = me * L + l;
      int64_t rows = 0;
      for (int64_t s = 0; s < ep; ++s) rows += plan.rows(s, e, h);
      if (rows > 0) lent[z(h)].push_back(e);
    }
  }
  std::vector<int64_t> lent_count(z(ep)), lent_displ(z(ep)), foreign_count(z(ep)),
      foreign_displ(z(ep));
  int64_t total_lent = 0;
  for (int64_t h = 0; h < ep; ++h) {
    lent_displ[z(h)] = total_lent;
    lent_count[z(h)] = static_cast<int64_t>(lent[z(h)].size());
    total_lent += lent_count[z(h)];
  }
  {
    int64_t pos = 0;
    for (int64_t s = 0; s < ep; ++s) {
      foreign_displ[z(s)] = pos;
      foreign_count[z(s)] = 0;
      for (int64_t e : foreign) foreign_count[z(s)] += (e / L == s) ? 1 : 0;
      pos += foreign_count[z(s)];
    }
  }
  stats.lent_weights = total_lent;
  auto scaled = [&](const std::vector<int64_t>& v, int64_t factor) {
    std::vector<int64_t> out(v.size());
    for (size_t i = 0; i < v.size(); ++i) out[i] = v[i] * factor;
    return out;
  };

  Tensor foreign_wgu(alloc, DType::F32, {S, 2 * F, H}, Category::Dispatch);    // [S, 2F, H]
  Tensor foreign_wd(alloc, DType::F32, {S, H, F}, Category::Dispatch);         // [S, H, F]
  Tensor foreign_dwgu(alloc, DType::F32, {S, 2 * F, H}, Category::Dispatch);   // [S, 2F, H]
  Tensor foreign_dwd(alloc, DType::F32, {S, H, F}, Category::Dispatch);        // [S, H, F]
  if (use_lla) {
    // Collective on every rank (counts may all be zero), so LLEP ranks stay in step.
    Tensor lent_wgu(alloc, DType::F32, {total_lent, 2 * F, H}, Category::Dispatch);
    Tensor lent_wd(alloc, DType::F32, {total_lent, H, F}, Category::Dispatch);
    int64_t i = 0;
    for (int64_t h = 0; h < ep; ++h) {
      for (int64_t e : lent[z(h)]) {
        std::memcpy(lent_wgu.data<float>() + i * wgu_elems, io.w_gate_up + (e - me * L) * wgu_elems,
                    z(wgu_elems) * sizeof(float));
        std::memcpy(lent_wd.data<float>() + i * wd_elems, io.w_down + (e - me * L) * wd_elems,
                    z(wd_elems) * sizeof(float));
        ++i;
      }
    }
    comm.all_to_allv(lent_wgu.data<float>(), scaled(lent_count, wgu_elems).data(),
                     scaled(lent_displ, wgu_elems).data(), foreign_wgu.data<float>(),
                     scaled(foreign_count, wgu_elems).data(),
                     scaled(foreign_displ, wgu_elems).data(), DType::F32);
    comm.all_to_allv(lent_wd.data<float>(), scaled(lent_count, wd_elems).data(),
                     scaled(lent_displ, wd_elems).data(), foreign_wd.data<float>(),
                     scaled(foreign_count, wd_elems).data(), scaled(foreign_displ, wd_elems).data(),
                     DType::F32);
    if (S > 0) std::fill_n(foreign_dwgu.data<float>(), S * wgu_elems, 0.0f);
    if (S > 0) std::fill_n(foreign_dwd.data<float>(), S * wd_elems, 0.0f);
  }

  // Round buffers, allocated once: rows carry [x | d_y] out and [y | d_x] back (2H fp32 each).
  Tensor send_buf(alloc, DType::F32, {send_cap_rows, 2 * H}, Category::Dispatch);  // [C, 2H]
  Tensor recv_buf(alloc, DType::F32, {recv_cap_rows, 2 * H}, Category::Dispatch);  // [B, 2H]
  Tensor x_sorted(alloc, DType::F32, {recv_cap_rows, H}, Category::Dispatch);      // [B, H]
  Tensor dy_sorted(alloc, DType::F32, {recv_cap_rows, H}, Category::Dispatch);     // [B, H]
  Tensor gate_up(alloc, DType::F32, {recv_cap_rows, 2 * F}, Category::Dispatch);   // [B, 2F]
  Tensor y_sorted(alloc, DType::F32, {recv_cap_rows, H}, Category::Dispatch);      // [B, H]
  Tensor dx_sorted(alloc, DType::F32, {recv_cap_rows, H}, Category::Dispatch);     // [B, H]
  Tensor sorted_pos(alloc, DType::I32, {recv_cap_rows}, Category::Dispatch);       // [B]
  Tensor ret_buf(alloc, DType::F32, {send_cap_rows, 2 * H}, Category::Dispatch);   // [C, 2H]
  Tensor slot_ret(alloc, DType::I32, {N}, Category::Dispatch);  // [T·k] row in ret_buf, or −1
  Tensor workspace(alloc, DType::F32, {3 * recv_cap_rows * F}, Category::Dispatch);

  std::fill_n(io.out, T * H, 0.0f);
  std::fill_n(io.d_x, T * H, 0.0f);
  std::fill_n(io.d_weights, T * k, 0.0f);
  std::vector<int64_t> sent_so_far(z(ep), 0);      // per destination, of this rank's d-list
  std::vector<int64_t> recv_so_far(z(ep), 0);      // per source, of its list for this rank
  std::vector<int64_t> sc(z(ep)), sd(z(ep)), rc(z(ep)), rd(z(ep));
  std::vector<int64_t> local_counts(z(L + S));
  for (int64_t j = 0; j < rounds.rounds; ++j) {
    alloc.set_phase(config.phase_prefix + "/dispatch/r" + std::to_string(j));
    const CountMatrix& m = rounds.send_rows[z(j)];
    // Source: pack [x | w·d_out] rows of this round, destination-major.
    int64_t sent = 0, received = 0;
    std::fill_n(slot_ret.data<int32_t>(), N, -1);
    for (int64_t d = 0; d < ep; ++d) {
      sc[z(d)] = m[z(me)][z(d)] * 2 * H;
      sd[z(d)] = sent * 2 * H;
      for (int64_t i = 0; i < m[z(me)][z(d)]; ++i) {
        const int32_t slot = send_order.data<int32_t>()[dest_begin[z(d)] + sent_so_far[z(d)] + i];
        const int64_t t = slot / k;
        const float w = io.topk_weights[slot];
        float* row = send_buf.data<float>() + (sent + i) * 2 * H;
        std::memcpy(row, io.x + t * H, z(H) * sizeof(float));
        for (int64_t h = 0; h < H; ++h) row[H + h] = w * io.d_out[t * H + h];
        slot_ret.data<int32_t>()[slot] = static_cast<int32_t>(sent + i);
      }
      sent += m[z(me)][z(d)];
      rc[z(d)] = m[z(d)][z(me)] * 2 * H;
      rd[z(d)] = received * 2 * H;
      received += m[z(d)][z(me)];
    }
    comm.all_to_allv(send_buf.data<float>(), sc.data(), sd.data(), recv_buf.data<float>(),
                     rc.data(), rd.data(), DType::F32);
    stats.max_round_received_rows = std::max(stats.max_round_received_rows, received);

    // Destination: the expert of each received row, from the source's list layout.
    std::fill(local_counts.begin(), local_counts.end(), 0);
    std::vector<int64_t> row_local(z(received));
    {
      int64_t r = 0;
      for (int64_t s = 0; s < ep; ++s) {
        int64_t begin = recv_so_far[z(s)];
        const int64_t end = begin + m[z(s)][z(me)];
        int64_t base = 0;
        for (int64_t e = 0; e < E && begin < end; ++e) {
          const int64_t n = plan.rows(s, e, me);
          while (begin < end && begin < base + n) {
            row_local[z(r++)] = local_index[z(e)];
            ++local_counts[z(local_index[z(e)])];
            ++begin;
          }
          base += n;
        }
        recv_so_far[z(s)] = end;
      }
    }
    std::vector<int64_t> next(z(L + S) + 1, 0);
    for (int64_t l = 0; l < L + S; ++l) next[z(l) + 1] = next[z(l)] + local_counts[z(l)];
    for (int64_t r = 0; r < received; ++r) {
      const int64_t p = next[z(row_local[z(r)])]++;
      sorted_pos.data<int32_t>()[r] = static_cast<int32_t>(p);
      const float* src = recv_buf.data<float>() + r * 2 * H;
      std::memcpy(x_sorted.data<float>() + p * H, src, z(H) * sizeof(float));
      std::memcpy(dy_sorted.data<float>() + p * H, src + H, z(H) * sizeof(float));
    }
    int64_t native_rows = 0;
    for (int64_t l = 0; l < L; ++l) native_rows += local_counts[z(l)];
    // Expert FFN forward (recompute) and backward: native experts, then borrowed ones.
    for (int part = 0; part < 2; ++part) {
      const int64_t row0 = part == 0 ? 0 : native_rows;
      const int64_t n_experts = part == 0 ? L : S;
      if (n_experts == 0) continue;
      ExpertFfnArgs a;
      a.dtype = DType::F32;
      a.x = x_sorted.data<float>() + row0 * H;
      a.expert_counts = local_counts.data() + (part == 0 ? 0 : L);
      a.w_gate_up = part == 0 ? io.w_gate_up : foreign_wgu.data<float>();
      a.w_down = part == 0 ? io.w_down : foreign_wd.data<float>();
      a.gate_up = gate_up.data<float>() + row0 * 2 * F;
      a.out = y_sorted.data<float>() + row0 * H;
      a.d_out = dy_sorted.data<float>() + row0 * H;
      a.d_x = dx_sorted.data<float>() + row0 * H;
      a.d_w_gate_up = part == 0 ? io.d_w_gate_up : foreign_dwgu.data<float>();
      a.d_w_down = part == 0 ? io.d_w_down : foreign_dwd.data<float>();
      a.workspace = workspace.data<float>();
      a.rows = part == 0 ? native_rows : received - native_rows;
      a.experts = n_experts;
      a.hidden = H;
      a.ffn = F;
      if (a.rows == 0) continue;
      expert_ffn_forward_cpu(a);
      expert_ffn_backward_cpu(a);
    }
    // [y | d_x] back in receive order (reusing the receive buffer), then to the sources.
    for (int64_t r = 0; r < received; ++r) {
      const int64_t p = sorted_pos.data<int32_t>()[r];
      float* dst = recv_buf.data<float>() + r * 2 * H;
      std::memcpy(dst, y_sorted.data<float>() + p * H, z(H) * sizeof(float));
      std::memcpy(dst + H, dx_sorted.data<float>() + p * H, z(H) * sizeof(float));
    }
    comm.all_to_allv(recv_buf.data<float>(), rc.data(), rd.data(), ret_buf.data<float>(),
                     sc.data(), sd.data(), DType::F32);
    // Source: fold the round into out, d_weights and d_x, in slot order per token.
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t s = 0; s < k; ++s) {
        const int32_t q = slot_ret.data<int32_t>()[t * k + s];
        if (q < 0) continue;
        const float* y = ret_buf.data<float>() + q * 2 * H;
        const float* dx = y + H;
        const float w = io.topk_weights[t * k + s];
        float dw = 0.0f;
        for (int64_t h = 0; h < H; ++h) {
          io.out[t * H + h] += w * y[h];
          dw += io.d_out[t * H + h] * y[h];
          io.d_x[t * H + h] += dx[h];
        }
        io.d_weights[t * k + s] = dw;
      }
    }
    for (int64_t d = 0; d < ep; ++d) sent_so_far[z(d)] += m[z(me)][z(d)];
  }

  // Gradients of borrowed weights go home; the native rank adds them in helper-rank order.
  if (use_lla) {
    alloc.set_phase(config.phase_prefix + "/dispatch/weight_grads");
    Tensor lent_dwgu(alloc, DType::F32, {total_lent, 2 * F, H}, Category::Dispatch);
    Tensor lent_dwd(alloc, DType::F32, {total_lent, H, F}, Category::Dispatch);
    comm.all_to_allv(foreign_dwgu.data<float>(), scaled(foreign_count, wgu_elems).data(),
                     scaled(foreign_displ, wgu_elems).data(), lent_dwgu.data<float>(),
                     scaled(lent_count, wgu_elems).data(), scaled(lent_displ, wgu_elems).data(),
                     DType::F32);
    comm.all_to_allv(foreign_dwd.data<float>(), scaled(foreign_count, wd_elems).data(),
                     scaled(foreign_displ, wd_elems).data(), lent_dwd.data<float>(),
                     scaled(lent_count, wd_elems).data(), scaled(lent_displ, wd_elems).data(),
                     DType::F32);
    int64_t i = 0;
    for (int64_t h = 0; h < ep; ++h) {
      for (int64_t e : lent[z(h)]) {
        float* dwgu = io.d_w_gate_up + (e - me * L) * wgu_elems;
        float* dwd = io.d_w_down + (e - me * L) * wd_elems;
        const float* gu = lent_dwgu.data<float>() + i * wgu_elems;
        const float* gd = lent_dwd.data<float>() + i * wd_elems;
        for (int64_t q = 0; q < wgu_elems; ++q) dwgu[q] += gu[q];
        for (int64_t q = 0; q < wd_elems; ++q) dwd[q] += gd[q];
        ++i;
      }
    }
  }

  const std::vector<PhaseRecord> records = alloc.phase_records();
  for (size_t r = phase_record_start; r < records.size(); ++r) {
    if (records[r].space != MemorySpace::Device) continue;
    stats.dispatch_peak_bytes =
        std::max(stats.dispatch_peak_bytes,
                 records[r].category_peak_bytes[static_cast<size_t>(Category::Dispatch)]);
  }
  return stats;
}

void moe_reference_backward(const MoeDims& dims, const MoeRankTensors& io) {
  const int64_t T = dims.tokens, H = dims.hidden, F = dims.ffn, E = dims.experts, k = dims.top_k;
  const int64_t N = T * k;
  std::vector<int64_t> counts(z(E));
  std::vector<int32_t> slot_to_row(z(N)), row_to_slot(z(N));
  std::vector<float> x_perm(z(N * H)), y_perm(z(N * H)), gate_up(z(N * 2 * F)),
      d_y(z(N * H)), d_x_perm(z(N * H));
  PermuteArgs p;
  p.dtype = DType::F32;
  p.topk_ids = io.topk_ids;
  p.expert_counts = counts.data();
  p.slot_to_row = slot_to_row.data();
  p.row_to_slot = row_to_slot.data();
  p.x = io.x;
  p.x_perm = x_perm.data();
  p.d_x_perm = d_x_perm.data();
  p.d_x = io.d_x;
  p.tokens = T;
  p.top_k = k;
  p.experts = E;
  p.hidden = H;
  moe_route_cpu(p);
  permute_forward_cpu(p);
  ExpertFfnArgs f;
  f.dtype = DType::F32;
  f.x = x_perm.data();
  f.expert_counts = counts.data();
  f.w_gate_up = io.w_gate_up;
  f.w_down = io.w_down;
  f.gate_up = gate_up.data();
  f.out = y_perm.data();
  f.d_out = d_y.data();
  f.d_x = d_x_perm.data();
  f.d_w_gate_up = io.d_w_gate_up;
  f.d_w_down = io.d_w_down;
  f.rows = N;
  f.experts = E;
  f.hidden = H;
  f.ffn = F;
  std::vector<float> workspace(z(expert_ffn_workspace_bytes(f) / 4));
  f.workspace = workspace.data();
  expert_ffn_forward_cpu(f);
  CombineArgs c;
  c.dtype = DType::F32;
  c.y = y_perm.data();
  c.weights = io.topk_weights;
  c.slot_to_row = slot_to_row.data();
  c.out = io.out;
  c.d_out = io.d_out;
  c.d_y = d_y.data();
  c.d_weights = io.d_weights;
  c.tokens = T;
  c.top_k = k;
  c.hidden = H;
  combine_forward_cpu(c);
  combine_backward_cpu(c);
  expert_ffn_backward_cpu(f);
  permute_backward_cpu(p);
}

}  // namespace flatpeak::exec
