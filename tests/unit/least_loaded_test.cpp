// Least-Loaded Assignment on hand-made load vectors (each result derived by hand in the comments,
// following reference/dispatch.md §2.3 step by step) and PipelinedLLEP striping rounds (§5).
#include "spec/least_loaded.h"

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>

#include <gtest/gtest.h>

namespace flatpeak {
namespace {

LlaKnobs knobs(double alpha, int64_t m, double lambda) {
  LlaKnobs k;
  k.llep_alpha = alpha;
  k.min_rows_per_gemm = m;
  k.imbalance_trigger = lambda;
  return k;
}

bool same_ranges(const std::vector<LlaRange>& got, const std::vector<LlaRange>& want) {
  if (got.size() != want.size()) return false;
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i].rank != want[i].rank || got[i].start_row != want[i].start_row ||
        got[i].rows != want[i].rows) {
      return false;
    }
  }
  return true;
}

// EP = 2, L = 2, loads 30, 10 | 5, 5: Σ = 50, cap = floor(α·25).
TEST(LeastLoaded, SpillsTheHotExpertsTail) {
  // α = 1, cap 25. e0: pending0 = 40 − 30 = 10, room = 25 − 10 = 15 < 30: native [0,15);
  // rank 1 (eff 10, avail 15) takes [15,30). e1: eff0 = 15, room 10: native. e2, e3 native.
  const LlaResult r = least_loaded_assignment({30, 10, 5, 5}, 2, knobs(1.0, 0, 0.0));
  EXPECT_TRUE(r.triggered);
  EXPECT_DOUBLE_EQ(r.native_imbalance, 1.6);  // 40 / 25
  EXPECT_EQ(r.capacity_rows, 25);
  EXPECT_TRUE(same_ranges(r.assignment[0], {{0, 0, 15}, {1, 15, 15}}));
  EXPECT_TRUE(same_ranges(r.assignment[1], {{0, 0, 10}}));
  EXPECT_TRUE(same_ranges(r.assignment[3], {{1, 0, 5}}));
  EXPECT_EQ(r.rank_rows, (std::vector<int64_t>{25, 25}));
  ASSERT_EQ(r.weight_transfers.size(), 1u);
  EXPECT_EQ(r.weight_transfers[0].expert, 0);
  EXPECT_EQ(r.weight_transfers[0].from_rank, 0);
  EXPECT_EQ(r.weight_transfers[0].to_rank, 1);
  EXPECT_EQ(r.weight_transfers[0].start_row, 15);
  EXPECT_EQ(r.weight_transfers[0].rows, 15);
  EXPECT_EQ(r.foreign_experts_per_rank, (std::vector<int64_t>{0, 1}));
  EXPECT_EQ(r.lent_weights_per_rank, (std::vector<int64_t>{1, 0}));
  EXPECT_EQ(r.forced_rows, 0);
  EXPECT_DOUBLE_EQ(r.rho_l, 1.0);
  // The reference default m = 1024 changes nothing: the chunk is the whole remainder.
  EXPECT_EQ(least_loaded_assignment({30, 10, 5, 5}, 2, knobs(1.0, 1024, 0.0)).rank_rows,
            (std::vector<int64_t>{25, 25}));
}

// The foreign-expert limit (PipelinedLLEP's pool). E = 6, EP = 3, α = 1: cap 20. e0 (30 rows,
// rank 0 full): one pass, rank 1 takes [0,20), rank 2 [20,30). e1: native [0,20), the other 10
// to rank 2 (eff 10, avail 10) without a limit; with max_foreign_experts = 1 rank 2 already
// borrows e0 and rank 1 is full, so the 10 rows stay on rank 0, beyond the cap (forced).
TEST(LeastLoaded, ForeignExpertLimitKeepsRowsHome) {
  LlaKnobs k = knobs(1.0, 0, 0.0);
  const LlaResult free = least_loaded_assignment({30, 30, 0, 0, 0, 0}, 3, k);
  EXPECT_EQ(free.rank_rows, (std::vector<int64_t>{20, 20, 20}));
  EXPECT_EQ(free.foreign_experts_per_rank, (std::vector<int64_t>{0, 1, 2}));
  EXPECT_TRUE(same_ranges(free.assignment[1], {{0, 0, 20}, {2, 20, 10}}));
  k.max_foreign_experts = 1;
  const LlaResult capped = least_loaded_assignment({30, 30, 0, 0, 0, 0}, 3, k);
  EXPECT_TRUE(same_ranges(capped.assignment[0], {{1, 0, 20}, {2, 20, 10}}));
  EXPECT_TRUE(same_ranges(capped.assignment[1], {{0, 0, 20}, {0, 20, 10}}));
  EXPECT_EQ(capped.rank_rows, (std::vector<int64_t>{30, 20, 10}));
  EXPECT_EQ(capped.foreign_experts_per_rank, (std::vector<int64_t>{0, 1, 1}));
  EXPECT_EQ(capped.forced_rows, 10);
  // Every source's copies still go somewhere (e1's two native ranges): 10 copies of each expert
  // per source; e0 [0,20) is sources 0, 1 (to rank 1), [20,30) source 2 (to rank 2); e1 all home.
  const CountMatrix copies{{10, 10, 0, 0, 0, 0}, {10, 10, 0, 0, 0, 0}, {10, 10, 0, 0, 0, 0}};
  const CountMatrix send = lla_send_rows(capped, copies);
  EXPECT_EQ(send, (CountMatrix{{10, 10, 0}, {10, 10, 0}, {10, 0, 10}}));
}

TEST(LeastLoaded, AlphaRaisesTheCap) {
  // α = 1.2, cap 30: e0 room = 30 − 10 = 20: native [0,20), rank 1 takes [20,30); loads 30 | 20.
  const LlaResult r = least_loaded_assignment({30, 10, 5, 5}, 2, knobs(1.2, 0, 0.0));
  EXPECT_EQ(r.capacity_rows, 30);
  EXPECT_TRUE(same_ranges(r.assignment[0], {{0, 0, 20}, {1, 20, 10}}));
  EXPECT_EQ(r.rank_rows, (std::vector<int64_t>{30, 20}));
  EXPECT_DOUBLE_EQ(r.rho_l, 1.2);
}

TEST(LeastLoaded, LambdaFallBackToPlainEp) {
  // Native per-rank loads 40 | 10: ratio 1.6. λ = 1.6 runs LLA (ratio ≥ λ); λ = 1.61 does not.
  EXPECT_TRUE(least_loaded_assignment({30, 10, 5, 5}, 2, knobs(1.0, 0, 1.6)).triggered);
  const LlaResult r = least_loaded_assignment({30, 10, 5, 5}, 2, knobs(1.0, 0, 1.61));
  EXPECT_FALSE(r.triggered);
  EXPECT_EQ(r.capacity_rows, 0);
  EXPECT_EQ(r.rank_rows, (std::vector<int64_t>{40, 10}));
  EXPECT_TRUE(same_ranges(r.assignment[0], {{0, 0, 30}}));
  EXPECT_TRUE(r.weight_transfers.empty());
  EXPECT_DOUBLE_EQ(r.rho_l, 1.6);
  EXPECT_DOUBLE_EQ(r.native_imbalance, 1.6);
}

// EP = 3, L = 1, loads 60 | 25 | 5, α = 1: Σ = 90, cap 30, m = 10.
TEST(LeastLoaded, FinalRemainderBelowMIsStillSpilled) {
  // e0: native [0,30); helpers by eff: rank 2 (5, avail 25) takes [30,55); then rank 1 (25,
  // avail 5) takes the final 5 < m (the paper would keep it native; the reference spills it).
  const LlaResult r = least_loaded_assignment({60, 25, 5}, 3, knobs(1.0, 10, 0.0));
  EXPECT_TRUE(same_ranges(r.assignment[0], {{0, 0, 30}, {2, 30, 25}, {1, 55, 5}}));
  EXPECT_EQ(r.rank_rows, (std::vector<int64_t>{30, 30, 30}));
  EXPECT_EQ(r.forced_rows, 0);
  EXPECT_EQ(r.foreign_experts_per_rank, (std::vector<int64_t>{0, 1, 1}));
  EXPECT_EQ(r.lent_weights_per_rank, (std::vector<int64_t>{2, 0, 0}));
}

// EP = 3, L = 2: rank 0 holds 35, 30; rank 1 holds 5, 0; rank 2 holds 11, 11. Σ = 92, cap 30.
TEST(LeastLoaded, MinRowsSkipRuleInTheOnePassCase) {
  // m = 10. e0 (35): pending0 = 30 = cap, room 0 → spill all in one pass over helpers sorted by
  // eff: rank 1 (5, avail 25) takes [0,25); rank 2 (22, avail 8): chunk 8 < m with 10 left →
  // skipped; the 10 left are forced onto rank 1, first of the stale sort: [25,35).
  // e1 (30): native. e4, e5 (11 each): native, rank 2 at 22. e2 (5): rank 1 at 35 > cap, room
  // −5 → one pass: rank 2 (22, avail 8) takes all 5. Loads 30 | 35 | 27.
  LlaResult r = least_loaded_assignment({35, 30, 5, 0, 11, 11}, 3, knobs(1.0, 10, 0.0));
  EXPECT_TRUE(same_ranges(r.assignment[0], {{1, 0, 25}, {1, 25, 10}}));
  EXPECT_TRUE(same_ranges(r.assignment[2], {{2, 0, 5}}));
  EXPECT_TRUE(r.assignment[3].empty());
  EXPECT_EQ(r.rank_rows, (std::vector<int64_t>{30, 35, 27}));
  EXPECT_EQ(r.forced_rows, 10);
  EXPECT_EQ(r.weight_transfers.size(), 3u);
  EXPECT_EQ(r.foreign_experts_per_rank, (std::vector<int64_t>{0, 1, 1}));  // distinct experts
  EXPECT_EQ(r.lent_weights_per_rank, (std::vector<int64_t>{1, 1, 0}));
  EXPECT_DOUBLE_EQ(r.rho_l, 35.0 * 3.0 / 92.0);

  // m = 0: rank 2 accepts 8 [25,33); the last 2 are forced onto rank 1 [33,35) (27 rows).
  // e1 native (30); e4, e5 native (rank 2 at 8 + 22 = 30); e2: room 3, native [0,3), the 2 left
  // find no room anywhere and are forced onto the least-loaded helper, rank 0 (tie 30/30, lower
  // rank first). Loads 32 | 30 | 30.
  r = least_loaded_assignment({35, 30, 5, 0, 11, 11}, 3, knobs(1.0, 0, 0.0));
  EXPECT_TRUE(same_ranges(r.assignment[0], {{1, 0, 25}, {2, 25, 8}, {1, 33, 2}}));
  EXPECT_TRUE(same_ranges(r.assignment[2], {{1, 0, 3}, {0, 3, 2}}));
  EXPECT_EQ(r.rank_rows, (std::vector<int64_t>{32, 30, 30}));
  EXPECT_EQ(r.forced_rows, 4);
}

TEST(LeastLoaded, ForcedOverflowWhenNoRankHasRoom) {
  // EP = 3, L = 1, loads 10 | 0 | 1: cap = floor(11/3) = 3, so the ranks hold 9 < 11 rows.
  // e0: native [0,3); rank 1 (eff 0) takes [3,6); rank 2 (eff 1, avail 2) takes [6,8); nobody
  // has room for the last 2: forced onto rank 1 (tie at eff 3, lower rank). e2 native.
  const LlaResult r = least_loaded_assignment({10, 0, 1}, 3, knobs(1.0, 0, 0.0));
  EXPECT_TRUE(same_ranges(r.assignment[0], {{0, 0, 3}, {1, 3, 3}, {2, 6, 2}, {1, 8, 2}}));
  EXPECT_EQ(r.rank_rows, (std::vector<int64_t>{3, 5, 3}));
  EXPECT_EQ(r.forced_rows, 2);
  EXPECT_EQ(r.foreign_experts_per_rank, (std::vector<int64_t>{0, 1, 1}));
  EXPECT_EQ(r.lent_weights_per_rank, (std::vector<int64_t>{2, 0, 0}));
  EXPECT_DOUBLE_EQ(r.rho_l, 15.0 / 11.0);
  // One rank: nothing to spill to.
  const LlaResult one = least_loaded_assignment({5, 7}, 1, knobs(1.0, 0, 0.0));
  EXPECT_EQ(one.rank_rows, (std::vector<int64_t>{12}));
  EXPECT_TRUE(one.weight_transfers.empty());
}

TEST(LeastLoaded, KnobValidationNamesTheFlags) {
  InputErrors errors;
  validate_lla_knobs(knobs(0.9, -1, -0.5), errors);
  ASSERT_EQ(errors.size(), 3u);
  EXPECT_EQ(errors.diagnostics()[0].to_string(), "--llep-alpha: must be a number >= 1 (got 0.9)");
  EXPECT_EQ(errors.diagnostics()[1].to_string(), "--llep-min-rows: must be an integer >= 0 (got -1)");
  EXPECT_EQ(errors.diagnostics()[2].to_string(), "--llep-lambda: must be a number >= 0 (got -0.5)");
  InputErrors fine;
  validate_lla_knobs(LlaKnobs{}, fine);
  validate_chunk_cap(1, fine);
  EXPECT_TRUE(fine.empty());
  validate_chunk_cap(0, fine);
  EXPECT_EQ(fine.diagnostics().at(0).to_string(), "--chunk-cap-rows: must be an integer >= 1 (got 0)");
}

// Sources 0 and 1 with copies 20, 5, 3, 2 and 10, 5, 2, 3 (column sums 30, 10, 5, 5). Expert 0's
// global rows: source 0 is [0,20), source 1 is [20,30); the plan computes [0,15) on rank 0 and
// [15,30) on rank 1, so source 0 sends 15 to rank 0 and 5 to rank 1, source 1 sends 10 to rank 1.
TEST(LeastLoaded, SourceRangesAndSendRows) {
  const CountMatrix copies = {{20, 5, 3, 2}, {10, 5, 2, 3}};
  const LlaResult plan = least_loaded_assignment(expert_loads(copies), 2, knobs(1.0, 0, 0.0));
  const auto s0 = lla_source_ranges(plan, copies, 0);
  EXPECT_TRUE(same_ranges(s0[0], {{0, 0, 15}, {1, 15, 5}}));
  const auto s1 = lla_source_ranges(plan, copies, 1);
  EXPECT_TRUE(same_ranges(s1[0], {{1, 0, 10}}));
  EXPECT_TRUE(same_ranges(s1[3], {{1, 0, 3}}));
  EXPECT_EQ(lla_send_rows(plan, copies), (CountMatrix{{20, 10}, {5, 15}}));
}

// Striping of the send rows above with C = 10 (derived in full):
// source 0 (20 for d0, 10 for d1; keys (2i+1)/40 and (2i+1)/20, no ties) goes d0 d1 d0 d0 d1 …:
// round 0 = 7 + 3, round 1 = 6 + 4, round 2 = 7 + 3. Source 1 (5 for d0, 15 for d1; keys
// (2i+1)/10 and (2i+1)/30, ties at 0.1, 0.3, … go to d0 first): round 0 = 3 + 7, round 1 = 2 + 8.
TEST(PipelinedRounds, StripingHandDerived) {
  const CountMatrix send = {{20, 10}, {5, 15}};
  EXPECT_EQ(striped_position({5, 15}, 0, 0), 1);  // after d1's key 1/30
  EXPECT_EQ(striped_position({5, 15}, 1, 1), 2);  // key 3/30 ties with d0's 1/10: d0 first
  EXPECT_EQ(striped_position({20, 10}, 1, 1), 4);
  const PipelinedRounds r = pipelined_rounds(send, 10);
  EXPECT_EQ(r.rounds, 3);
  ASSERT_EQ(r.send_rows.size(), 3u);
  EXPECT_EQ(r.send_rows[0], (CountMatrix{{7, 3}, {3, 7}}));
  EXPECT_EQ(r.send_rows[1], (CountMatrix{{6, 4}, {2, 8}}));
  EXPECT_EQ(r.send_rows[2], (CountMatrix{{7, 3}, {0, 0}}));
  EXPECT_EQ(r.received_rows, (CountMatrix{{10, 10}, {8, 12}, {7, 3}}));
  EXPECT_EQ(r.max_received_rows, (std::vector<int64_t>{10, 12}));
  EXPECT_EQ(r.max_round_received_rows, 12);
  // Bound for d1: min(10, 10, ⌊10·12/30⌋ + 1 = 5) + min(15, 10, ⌊15·12/20⌋ + 1 = 10) = 15;
  // d0: 9 + 4 = 13.
  EXPECT_EQ(r.received_bound_rows, 15);
  EXPECT_EQ(round_receive_bound_rows(send, 10), 15);
}

TEST(PipelinedRounds, StaticBoundAndShrinkingTheCap) {
  // min(EP·C, ceil((C + EP)·ρ) + EP) at C = 10, EP = 2.
  EXPECT_EQ(round_receive_bound_rows(10, 2, 1.0), 14);
  EXPECT_EQ(round_receive_bound_rows(10, 2, 1.25), 17);
  EXPECT_EQ(round_receive_bound_rows(10, 2, 2.0), 20);  // EP·C caps it
  // Buffers of 12 rows: at C = 9 the d1 bound is 4 + 9 = 13 > 12, at C = 8 it is
  // (⌊100/30⌋ + 1 = 4) + (⌊150/20⌋ + 1 = 8) = 12: the cap shrinks to 8 (4 rounds instead of 3).
  const CountMatrix send = {{20, 10}, {5, 15}};
  EXPECT_EQ(shrink_chunk_cap(send, 10, 12), 8);
  EXPECT_EQ(pipelined_rounds(send, 8).rounds, 4);
  EXPECT_LE(pipelined_rounds(send, 8).max_round_received_rows, 12);
  EXPECT_EQ(shrink_chunk_cap(send, 10, 15), 10);  // already fits
  EXPECT_EQ(shrink_chunk_cap(send, 10, 1), 0);    // d1 hears from 2 sources: needs ≥ 2 rows
}

// Naive striping: materialise every copy of one source with its key (2i+1)/(2·n_d), sort
// (exact rational comparison, ties by destination), cut into rounds of C.
CountMatrix naive_rounds(const std::vector<int64_t>& n, int64_t cap) {
  std::vector<std::pair<int64_t, int64_t>> copies;  // (destination, index)
  for (size_t d = 0; d < n.size(); ++d) {
    for (int64_t i = 0; i < n[d]; ++i) copies.push_back({static_cast<int64_t>(d), i});
  }
  std::sort(copies.begin(), copies.end(), [&](const auto& a, const auto& b) {
    const int64_t lhs = (2 * a.second + 1) * n[static_cast<size_t>(b.first)];
    const int64_t rhs = (2 * b.second + 1) * n[static_cast<size_t>(a.first)];
    return lhs != rhs ? lhs < rhs : a.first < b.first;
  });
  CountMatrix rounds;
  for (size_t p = 0; p < copies.size(); ++p) {
    if (p % static_cast<size_t>(cap) == 0) rounds.emplace_back(n.size(), 0);
    ++rounds.back()[static_cast<size_t>(copies[p].first)];
  }
  return rounds;
}

// Random plans: LLA invariants, and the striping bounds hold for every realised round.
TEST(PipelinedRounds, RandomLoadsStayWithinTheStatedBounds) {
  std::mt19937_64 gen(7);  // test data only; the library never uses <random>
  for (int trial = 0; trial < 200; ++trial) {
    const int64_t ep = int64_t{1} << (1 + trial % 3);  // 2, 4, 8
    const int64_t local = 1 + trial % 4;
    const RoutingShape shape{ep, ep * local, std::min<int64_t>(2, ep * local)};
    const int64_t tokens = 50 + static_cast<int64_t>(gen() % 400);
    RoutingModel model;
    model.kind = RoutingKind::Zipf;
    model.zipf_exponent = static_cast<double>(gen() % 300) / 100.0;
    const CountMatrix copies = expected_loads(model, shape, tokens, 0).copies;
    const LlaKnobs k = knobs(1.0 + static_cast<double>(gen() % 30) / 100.0,
                             static_cast<int64_t>(gen() % 40), 0.0);
    const LlaResult plan = least_loaded_assignment(expert_loads(copies), ep, k);
    // Every expert's ranges tile [0, l_e), the native range (if any) first at 0.
    const auto loads = expert_loads(copies);
    for (size_t e = 0; e < loads.size(); ++e) {
      int64_t next = 0;
      for (size_t i = 0; i < plan.assignment[e].size(); ++i) {
        const LlaRange& range = plan.assignment[e][i];
        EXPECT_EQ(range.start_row, next);
        if (range.rank == shape.rank_of_expert(static_cast<int64_t>(e))) {
          EXPECT_EQ(i, 0u);
        }
        next += range.rows;
      }
      EXPECT_EQ(next, loads[e]);
    }
    const CountMatrix send = lla_send_rows(plan, copies);
    for (int64_t d = 0; d < ep; ++d) {
      int64_t column = 0;
      for (int64_t s = 0; s < ep; ++s) column += send[static_cast<size_t>(s)][static_cast<size_t>(d)];
      EXPECT_EQ(column, plan.rank_rows[static_cast<size_t>(d)]);
    }
    const int64_t rows_per_source = tokens * shape.top_k;
    const int64_t cap = 1 + static_cast<int64_t>(gen() % static_cast<uint64_t>(rows_per_source));
    const PipelinedRounds r = pipelined_rounds(send, cap);
    EXPECT_EQ(r.rounds, (rows_per_source + cap - 1) / cap);
    for (int64_t s = 0; s < ep; ++s) {
      const CountMatrix naive = naive_rounds(send[static_cast<size_t>(s)], cap);
      ASSERT_EQ(naive.size(), r.send_rows.size());
      for (size_t j = 0; j < naive.size(); ++j) EXPECT_EQ(r.send_rows[j][static_cast<size_t>(s)], naive[j]);
    }
    for (size_t j = 0; j < r.send_rows.size(); ++j) {
      for (int64_t s = 0; s < ep; ++s) {
        const auto& row = r.send_rows[j][static_cast<size_t>(s)];
        const int64_t sent = std::accumulate(row.begin(), row.end(), int64_t{0});
        EXPECT_EQ(sent, std::min(cap, rows_per_source - static_cast<int64_t>(j) * cap));
      }
    }
    EXPECT_LE(r.max_round_received_rows, r.received_bound_rows);
    const double rho = static_cast<double>(*std::max_element(plan.rank_rows.begin(), plan.rank_rows.end())) /
                       static_cast<double>(rows_per_source);
    EXPECT_LE(r.received_bound_rows, round_receive_bound_rows(cap, ep, rho));
    // Buffers sized for a balanced load (ρ = 1) are never overflowed after shrinking.
    const int64_t buffer = round_receive_bound_rows(cap, ep, 1.0);
    const int64_t shrunk = shrink_chunk_cap(send, cap, buffer);
    ASSERT_GE(shrunk, 1);
    EXPECT_LE(pipelined_rounds(send, shrunk).max_round_received_rows, buffer);
  }
}

// §2.7's derived bound on LLA paths, R_p ≤ cap + δ, on random skewed loads.
TEST(LeastLoaded, SlackBoundOnRandomSkewedLoads) {
  EXPECT_EQ(lla_slack_rows(knobs(1.0, 1024, 0.0), 8, 131072), 7 * 1024 + 16);
  EXPECT_EQ(lla_slack_rows(knobs(1.1, 1024, 0.0), 8, 131072), 0);
  std::mt19937_64 gen(11);
  int64_t forced_trials = 0, over_cap_trials = 0;
  for (int trial = 0; trial < 2000; ++trial) {
    const int64_t ep = int64_t{1} << (1 + trial % 4);  // 2..16
    const int64_t local = 1 + static_cast<int64_t>(gen() % 8);
    const int64_t top_k = 1 + static_cast<int64_t>(gen() % static_cast<uint64_t>(std::min<int64_t>(8, ep * local)));
    const RoutingShape shape{ep, ep * local, top_k};
    RoutingModel model;
    model.kind = RoutingKind::HotExpert;
    model.hot_fraction = static_cast<double>(gen() % 100) / 100.0;
    model.hot_experts = 1 + static_cast<int64_t>(gen() % static_cast<uint64_t>(ep * local));
    const int64_t tokens = 16 + static_cast<int64_t>(gen() % 2000);
    const CountMatrix copies = expected_loads(model, shape, tokens, 0).copies;
    const LlaKnobs k = knobs(1.0 + static_cast<double>(gen() % 40) / 100.0,
                             static_cast<int64_t>(gen() % 512), 0.0);
    const LlaResult plan = least_loaded_assignment(expert_loads(copies), ep, k);
    const int64_t slack = lla_slack_rows(k, ep, tokens * top_k);
    for (int64_t rows : plan.rank_rows) {
      EXPECT_LE(rows, plan.capacity_rows + slack) << "trial " << trial;
    }
    forced_trials += plan.forced_rows > 0 ? 1 : 0;
    over_cap_trials += *std::max_element(plan.rank_rows.begin(), plan.rank_rows.end()) > plan.capacity_rows ? 1 : 0;
  }
  // The bound is exercised: forced placements and loads beyond the cap do occur.
  EXPECT_GT(forced_trials, 50) << forced_trials;
  EXPECT_GT(over_cap_trials, 20) << over_cap_trials;
}

}  // namespace
}  // namespace flatpeak
