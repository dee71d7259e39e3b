#include "least_loaded.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <set>
#include <stdexcept>
#include <utility>

#include <fmt/format.h>

namespace flatpeak {

namespace {

size_t idx(int64_t i) { return static_cast<size_t>(i); }

__extension__ typedef __int128 wide_int;  // exact products of row counts

// floor(a·b / c) for non-negative a, b and positive c, without overflow.
int64_t mul_div_floor(int64_t a, int64_t b, int64_t c) {
  return static_cast<int64_t>(static_cast<wide_int>(a) * b / c);
}

class Planner {
 public:
  Planner(const std::vector<int64_t>& loads, int64_t ep_ranks, const LlaKnobs& knobs,
          int64_t cap, LlaResult& out)
      : loads_(loads), ep_(ep_ranks), local_(static_cast<int64_t>(loads.size()) / ep_ranks),
        m_(knobs.min_rows_per_gemm), cap_(cap), max_foreign_(knobs.max_foreign_experts), out_(out),
        pending_(idx(ep_ranks), 0), assigned_(idx(ep_ranks), 0), borrowed_(idx(ep_ranks), 0),
        holds_(idx(ep_ranks), -1) {
    for (size_t e = 0; e < loads.size(); ++e) {
      pending_[idx(static_cast<int64_t>(e) / local_)] += loads[e];
    }
  }

  void run() {
    std::vector<size_t> order(loads_.size());
    std::iota(order.begin(), order.end(), size_t{0});
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return loads_[a] > loads_[b]; });
    for (size_t e : order) {
      if (loads_[e] > 0) plan_expert(static_cast<int64_t>(e));
    }
    out_.rank_rows = assigned_;
  }

 private:
  int64_t eff(int64_t g) const { return assigned_[idx(g)] + pending_[idx(g)]; }

  // Other ranks sorted by effective load ascending (ties: lower rank), as a stable sort does.
  std::vector<int64_t> helpers_by_load(int64_t native) const {
    std::vector<int64_t> helpers;
    for (int64_t g = 0; g < ep_; ++g) {
      if (g != native) helpers.push_back(g);
    }
    std::stable_sort(helpers.begin(), helpers.end(), [&](int64_t a, int64_t b) { return eff(a) < eff(b); });
    return helpers;
  }

  void give(int64_t expert, int64_t native, int64_t rank, int64_t start, int64_t rows) {
    out_.assignment[idx(expert)].push_back(LlaRange{rank, start, rows});
    assigned_[idx(rank)] += rows;
    if (rank == native) return;
    out_.weight_transfers.push_back(LlaWeightTransfer{expert, native, rank, start, rows});
    if (holds_[idx(rank)] != expert) {  // experts are planned one at a time: a new borrowed one
      holds_[idx(rank)] = expert;
      ++borrowed_[idx(rank)];
    }
  }

  // A helper may take rows of `expert` while it borrows fewer than max_foreign experts, or when
  // it already holds this one (max_foreign < 0: no limit).
  bool may_borrow(int64_t helper, int64_t expert) const {
    return max_foreign_ < 0 || borrowed_[idx(helper)] < max_foreign_ || holds_[idx(helper)] == expert;
  }

  // Where rows no helper accepted go: `preferred` (the reference's choice) when it may borrow the
  // expert, else the first helper in `helpers` that may, else the native rank (the rows stay
  // home, beyond the cap, rather than a helper exceeding its foreign-expert pool).
  int64_t forced_target(int64_t expert, int64_t native, int64_t preferred, const std::vector<int64_t>& helpers) const {
    if (may_borrow(preferred, expert)) return preferred;
    for (int64_t h : helpers)
      if (may_borrow(h, expert)) return h;
    return native;
  }

  // The accept rule: room left, and a partial chunk below m only when it is the final remainder.
  bool accepts(int64_t avail, int64_t rest) const {
    if (avail <= 0) return false;
    const int64_t chunk = std::min(rest, avail);
    return !(chunk < m_ && rest > chunk);
  }

  void plan_expert(int64_t e) {
    const int64_t n = loads_[idx(e)];
    const int64_t g = e / local_;
    pending_[idx(g)] -= n;
    const int64_t room = cap_ - eff(g);
    if (room >= n) {  // case 1: all native
      give(e, g, g, 0, n);
      return;
    }
    if (ep_ == 1) {  // nowhere to spill: everything stays native, beyond the cap
      give(e, g, g, 0, n);
      out_.forced_rows += n - std::max<int64_t>(room, 0);
      return;
    }
    if (room > 0) {  // case 2: native takes its room, the rest spills helper by helper
      give(e, g, g, 0, room);
      int64_t rest = n - room, offset = room;
      while (rest > 0) {
        const std::vector<int64_t> helpers = helpers_by_load(g);
        bool placed = false;
        for (int64_t h : helpers) {
          const int64_t avail = cap_ - eff(h);
          if (!may_borrow(h, e) || !accepts(avail, rest)) continue;
          const int64_t chunk = std::min(rest, avail);
          give(e, g, h, offset, chunk);
          offset += chunk;
          rest -= chunk;
          placed = true;
          break;
        }
        if (!placed) {  // forced: the least-loaded helper takes all of it
          give(e, g, forced_target(e, g, helpers.front(), helpers), offset, rest);
          out_.forced_rows += rest;
          rest = 0;
        }
      }
      return;
    }
    // case 3: native is full; one pass over the helpers sorted once (availability is read when
    // a helper is visited, which equals the sort-time value since only visited helpers change).
    const std::vector<int64_t> helpers = helpers_by_load(g);
    int64_t rest = n, offset = 0;
    for (int64_t h : helpers) {
      if (rest <= 0) break;
      const int64_t avail = cap_ - eff(h);
      if (!may_borrow(h, e) || !accepts(avail, rest)) continue;
      const int64_t chunk = std::min(rest, avail);
      give(e, g, h, offset, chunk);
      offset += chunk;
      rest -= chunk;
    }
    if (rest > 0) {  // forced onto the first helper of the stale sort
      give(e, g, forced_target(e, g, helpers.front(), helpers), offset, rest);
      out_.forced_rows += rest;
    }
  }

  const std::vector<int64_t>& loads_;
  int64_t ep_, local_, m_, cap_, max_foreign_;
  LlaResult& out_;
  std::vector<int64_t> pending_, assigned_;
  std::vector<int64_t> borrowed_;  // [EP] distinct experts each rank borrows so far
  std::vector<int64_t> holds_;     // [EP] the last expert a rank borrowed (−1: none)
};

void check_send_rows(const CountMatrix& send_rows) {
  for (const auto& row : send_rows) {
    if (row.size() != send_rows.size()) {
      throw std::invalid_argument(fmt::format("send rows must be EP x EP (a row has {} of {})",
                                              row.size(), send_rows.size()));
    }
    for (int64_t n : row) {
      if (n < 0) throw std::invalid_argument("send rows must be non-negative");
    }
  }
}

// Copies of destination d (of n[d]) whose striped position is < x, for one source.
int64_t copies_before(const std::vector<int64_t>& n, int64_t total, int64_t d, int64_t x) {
  if (x <= 0 || n[idx(d)] == 0) return 0;
  if (x >= total) return n[idx(d)];
  // position(d, i) ≥ i and lies within P of x·n_d/N_s; search a window around that guess.
  const int64_t guess = mul_div_floor(x, n[idx(d)], total);
  const int64_t span = static_cast<int64_t>(n.size()) + 2;
  int64_t lo = std::max<int64_t>(0, guess - span), hi = std::min(n[idx(d)], guess + span);
  if (lo > 0 && striped_position(n, d, lo - 1) >= x) lo = 0;
  if (hi < n[idx(d)] && striped_position(n, d, hi) < x) hi = n[idx(d)];
  // smallest i in [lo, hi] with position(d, i) ≥ x (hi = n_d when none is).
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (striped_position(n, d, mid) >= x) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  return lo;
}

}  // namespace

void validate_lla_knobs(const LlaKnobs& knobs, InputErrors& errors) {
  if (!std::isfinite(knobs.llep_alpha) || knobs.llep_alpha < 1.0) {
    errors.add(Diagnostic{"", "--llep-alpha",
                          fmt::format("must be a number >= 1 (got {})", knobs.llep_alpha),
                          "1 balances exactly; the reference default is 1.1"});
  }
  if (knobs.min_rows_per_gemm < 0) {
    errors.add(Diagnostic{"", "--llep-min-rows",
                          fmt::format("must be an integer >= 0 (got {})", knobs.min_rows_per_gemm),
                          "the reference default is 1024"});
  }
  if (!std::isfinite(knobs.imbalance_trigger) || knobs.imbalance_trigger < 0.0) {
    errors.add(Diagnostic{"", "--llep-lambda",
                          fmt::format("must be a number >= 0 (got {})", knobs.imbalance_trigger),
                          "0 runs the assignment always; the paper uses 1.3"});
  }
}

void validate_chunk_cap(int64_t chunk_cap_rows, InputErrors& errors) {
  if (chunk_cap_rows < 1) {
    errors.add(Diagnostic{"", "--chunk-cap-rows",
                          fmt::format("must be an integer >= 1 (got {})", chunk_cap_rows), ""});
  }
}

LlaResult least_loaded_assignment(const std::vector<int64_t>& expert_loads, int64_t ep_ranks,
                                  const LlaKnobs& knobs) {
  if (ep_ranks < 1 || expert_loads.empty() ||
      static_cast<int64_t>(expert_loads.size()) % ep_ranks != 0) {
    throw std::invalid_argument(fmt::format(
        "least_loaded_assignment needs EP >= 1 dividing E >= 1 (got EP={}, E={})", ep_ranks,
        expert_loads.size()));
  }
  for (int64_t l : expert_loads) {
    if (l < 0) throw std::invalid_argument("expert loads must be non-negative");
  }
  const int64_t local = static_cast<int64_t>(expert_loads.size()) / ep_ranks;
  LlaResult out;
  out.assignment.resize(expert_loads.size());
  std::vector<int64_t> native(idx(ep_ranks), 0);
  for (size_t e = 0; e < expert_loads.size(); ++e) {
    native[idx(static_cast<int64_t>(e) / local)] += expert_loads[e];
  }
  out.native_imbalance = imbalance_rho(native);
  const int64_t total = std::accumulate(expert_loads.begin(), expert_loads.end(), int64_t{0});

  if (knobs.imbalance_trigger > 0.0 && out.native_imbalance < knobs.imbalance_trigger) {
    out.triggered = false;  // plain EP: every expert on its native rank
    for (size_t e = 0; e < expert_loads.size(); ++e) {
      if (expert_loads[e] > 0) {
        out.assignment[e].push_back(LlaRange{static_cast<int64_t>(e) / local, 0, expert_loads[e]});
      }
    }
    out.rank_rows = native;
  } else {
    out.triggered = true;
    const int64_t balanced = total / ep_ranks;
    int64_t cap = balanced > 0
                      ? static_cast<int64_t>(std::floor(knobs.llep_alpha * static_cast<double>(balanced)))
                      : total;
    cap = std::max<int64_t>(cap, 1);
    out.capacity_rows = cap;
    Planner(expert_loads, ep_ranks, knobs, cap, out).run();
  }

  out.foreign_experts_per_rank.assign(idx(ep_ranks), 0);
  out.lent_weights_per_rank.assign(idx(ep_ranks), 0);
  std::set<std::pair<int64_t, int64_t>> pairs;  // (expert, helper)
  for (const auto& t : out.weight_transfers) {
    if (pairs.insert({t.expert, t.to_rank}).second) {
      ++out.foreign_experts_per_rank[idx(t.to_rank)];
      ++out.lent_weights_per_rank[idx(t.from_rank)];
    }
  }
  out.rho_l = imbalance_rho(out.rank_rows);
  return out;
}

int64_t lla_slack_rows(const LlaKnobs& knobs, int64_t ep_ranks, int64_t rows_per_rank) {
  const double p = static_cast<double>(ep_ranks), a = knobs.llep_alpha;
  const double delta = static_cast<double>(ep_ranks - 1) * static_cast<double>(knobs.min_rows_per_gemm) +
                       (a + 1.0) * p - (a - 1.0) * p * static_cast<double>(rows_per_rank);
  return delta > 0.0 ? static_cast<int64_t>(std::ceil(delta)) : 0;
}

double pipelined_rho_bound(const LlaKnobs& knobs, int64_t ep_ranks, int64_t rows_per_rank) {
  const double slack = rows_per_rank > 0 ? static_cast<double>(lla_slack_rows(knobs, ep_ranks, rows_per_rank)) /
                                               static_cast<double>(rows_per_rank)
                                         : 0.0;
  return std::max({1.0, knobs.imbalance_trigger, knobs.llep_alpha}) + slack;
}

int64_t pipelined_foreign_pool(int64_t round_rows, int64_t ep_ranks, int64_t experts, const LlaKnobs& knobs) {
  if (ep_ranks <= 1) return 0;
  const int64_t local = experts / ep_ranks, others = experts - local;
  const int64_t by_gemm_rows = knobs.min_rows_per_gemm > 0 ? round_rows / knobs.min_rows_per_gemm - local : others;
  return std::clamp<int64_t>(std::min({by_gemm_rows, local, others}), 1, std::max<int64_t>(1, others));
}

int64_t pipelined_store_rows(int64_t round_rows, int64_t ep_ranks, int64_t rows_per_rank, int64_t most_rows,
                             double rho_bound) {
  if (ep_ranks <= 1) return rows_per_rank;
  const double bound = std::ceil(rho_bound * static_cast<double>(rows_per_rank));
  const int64_t rows = bound < static_cast<double>(most_rows) ? static_cast<int64_t>(bound) : most_rows;
  return std::min(most_rows, std::max(round_rows, rows));
}

std::vector<std::vector<LlaRange>> lla_source_ranges(const LlaResult& plan,
                                                     const CountMatrix& copies,
                                                     int64_t source_rank) {
  if (source_rank < 0 || source_rank >= static_cast<int64_t>(copies.size())) {
    throw std::invalid_argument(fmt::format("source rank {} outside 0..{}", source_rank, copies.size()));
  }
  const size_t experts = plan.assignment.size();
  std::vector<std::vector<LlaRange>> out(experts);
  for (size_t e = 0; e < experts; ++e) {
    int64_t before = 0, total = 0;
    for (size_t s = 0; s < copies.size(); ++s) {
      if (copies[s].size() != experts) throw std::invalid_argument("copies must be EP x E");
      if (static_cast<int64_t>(s) < source_rank) before += copies[s][e];
      total += copies[s][e];
    }
    int64_t planned = 0;
    for (const auto& r : plan.assignment[e]) planned += r.rows;
    if (planned != total) {
      throw std::invalid_argument(fmt::format("expert {}: the plan has {} rows, the copies {}", e,
                                              planned, total));
    }
    const int64_t begin = before, end = before + copies[idx(source_rank)][e];
    for (const auto& r : plan.assignment[e]) {
      const int64_t lo = std::max(begin, r.start_row), hi = std::min(end, r.start_row + r.rows);
      if (hi > lo) out[e].push_back(LlaRange{r.rank, lo - begin, hi - lo});
    }
  }
  return out;
}

CountMatrix lla_send_rows(const LlaResult& plan, const CountMatrix& copies) {
  const size_t ep = copies.size();
  CountMatrix send(ep, std::vector<int64_t>(ep, 0));
  for (size_t s = 0; s < ep; ++s) {
    for (const auto& ranges : lla_source_ranges(plan, copies, static_cast<int64_t>(s))) {
      for (const auto& r : ranges) send[s][idx(r.rank)] += r.rows;
    }
  }
  return send;
}

int64_t striped_position(const std::vector<int64_t>& rows_per_destination, int64_t destination,
                         int64_t index) {
  const auto& n = rows_per_destination;
  const int64_t nd = n[idx(destination)];
  // Key of copy (d, i) is (2i + 1)/(2·n_d). Copies of d' before it: odd o = 2i' + 1 with
  // o·n_d < (2i + 1)·n_d' (≤ for d' < d, ties go to the lower destination).
  int64_t position = index;
  for (int64_t other = 0; other < static_cast<int64_t>(n.size()); ++other) {
    const int64_t no = n[idx(other)];
    if (other == destination || no == 0) continue;
    const wide_int x = static_cast<wide_int>(2 * index + 1) * no;
    const wide_int largest_odd = other < destination ? x / nd : (x - 1) / nd;
    const wide_int count = (largest_odd + 1) / 2;
    position += count < no ? static_cast<int64_t>(count) : no;
  }
  return position;
}

int64_t round_receive_bound_rows(const CountMatrix& send_rows, int64_t chunk_cap_rows) {
  check_send_rows(send_rows);
  const size_t ep = send_rows.size();
  std::vector<int64_t> bound(ep, 0);
  for (const auto& row : send_rows) {
    const int64_t total = std::accumulate(row.begin(), row.end(), int64_t{0});
    const int64_t senders = std::count_if(row.begin(), row.end(), [](int64_t n) { return n > 0; });
    for (size_t d = 0; d < ep; ++d) {
      const int64_t n = row[d];
      if (n == 0) continue;
      const int64_t striped = mul_div_floor(n, chunk_cap_rows + senders, total) + 1;
      bound[d] += std::min({n, chunk_cap_rows, striped});
    }
  }
  return bound.empty() ? 0 : *std::max_element(bound.begin(), bound.end());
}

int64_t round_receive_bound_rows(int64_t chunk_cap_rows, int64_t ep_ranks, double rho_bound) {
  const double striped = std::ceil(static_cast<double>(chunk_cap_rows + ep_ranks) * rho_bound) +
                         static_cast<double>(ep_ranks);
  const int64_t any_routing = ep_ranks * chunk_cap_rows;
  return striped < static_cast<double>(any_routing) ? static_cast<int64_t>(striped) : any_routing;
}

PipelinedRounds pipelined_rounds(const CountMatrix& send_rows, int64_t chunk_cap_rows) {
  check_send_rows(send_rows);
  if (chunk_cap_rows < 1) throw std::invalid_argument("chunk_cap_rows must be >= 1");
  const size_t ep = send_rows.size();
  PipelinedRounds out;
  out.chunk_cap_rows = chunk_cap_rows;
  std::vector<int64_t> totals(ep, 0);
  for (size_t s = 0; s < ep; ++s) {
    totals[s] = std::accumulate(send_rows[s].begin(), send_rows[s].end(), int64_t{0});
    out.rounds = std::max(out.rounds, (totals[s] + chunk_cap_rows - 1) / chunk_cap_rows);
  }
  const size_t rounds = idx(out.rounds);
  out.send_rows.assign(rounds, CountMatrix(ep, std::vector<int64_t>(ep, 0)));
  out.received_rows.assign(rounds, std::vector<int64_t>(ep, 0));
  for (size_t s = 0; s < ep; ++s) {
    const std::vector<int64_t>& n = send_rows[s];
    for (size_t d = 0; d < ep; ++d) {
      if (n[d] == 0) continue;
      int64_t before = 0;
      for (size_t j = 0; j < rounds; ++j) {
        const int64_t boundary = std::min(totals[s], static_cast<int64_t>(j + 1) * chunk_cap_rows);
        const int64_t upto = copies_before(n, totals[s], static_cast<int64_t>(d), boundary);
        out.send_rows[j][s][d] = upto - before;
        out.received_rows[j][d] += upto - before;
        before = upto;
      }
    }
  }
  out.max_received_rows.assign(ep, 0);
  for (const auto& round : out.received_rows) {
    for (size_t d = 0; d < ep; ++d) {
      out.max_received_rows[d] = std::max(out.max_received_rows[d], round[d]);
      out.max_round_received_rows = std::max(out.max_round_received_rows, round[d]);
    }
  }
  out.received_bound_rows = round_receive_bound_rows(send_rows, chunk_cap_rows);
  return out;
}

int64_t shrink_chunk_cap(const CountMatrix& send_rows, int64_t chunk_cap_rows,
                         int64_t buffer_rows) {
  if (chunk_cap_rows < 1) throw std::invalid_argument("chunk_cap_rows must be >= 1");
  if (round_receive_bound_rows(send_rows, chunk_cap_rows) <= buffer_rows) return chunk_cap_rows;
  if (round_receive_bound_rows(send_rows, 1) > buffer_rows) return 0;
  // The bound is non-decreasing in the cap: largest cap in [1, chunk_cap_rows) that fits.
  int64_t lo = 1, hi = chunk_cap_rows - 1;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo + 1) / 2;
    if (round_receive_bound_rows(send_rows, mid) <= buffer_rows) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

}  // namespace flatpeak
