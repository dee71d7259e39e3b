// The dispatch schedule across 4 thread ranks (executor/schedules/dispatch_schedule.h): each
// schedule's forward output, input gradient and weight gradients against the single-rank run
// over the same 4·T tokens; LLEP's balancing and weight lending; PipelinedLLEP's launch-time
// round buffers, the cap shrinking, and the phases every rank records.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <set>
#include <string>
#include <vector>

#include "executor/comm/threads_comm.h"
#include "executor/schedules/dispatch_schedule.h"

namespace flatpeak::exec {
namespace {

constexpr int64_t kEp = 4;
size_t z(int64_t i) { return static_cast<size_t>(i); }

enum class Kind { Uncapped, Llep, Pipelined, PipelinedStore };

// T = 64 tokens per rank, H = 32, F = 16, E = 16 (4 per rank), k = 4.
DispatchScheduleConfig config_for(Kind kind, const char* routing, int64_t top_k = 4) {
  DispatchScheduleConfig c;
  c.tokens = 64;
  c.hidden = 32;
  c.ffn = 16;
  c.experts = 16;
  c.top_k = top_k;
  c.seed = 11;
  c.routing = parse_routing_model(routing);
  c.llep = kind != Kind::Uncapped;
  c.lla.llep_alpha = 1.0;
  c.lla.min_rows_per_gemm = 4;
  c.lla.imbalance_trigger = 0.0;  // LLA always runs
  c.chunk_cap_rows = kind == Kind::Pipelined || kind == Kind::PipelinedStore ? 48 : 0;
  c.store = kind == Kind::PipelinedStore;
  return c;
}

struct Ranks {
  std::vector<DispatchScheduleResult> results;
  std::vector<std::vector<PhaseRecord>> records;
  std::vector<int64_t> live_after;
};

Ranks run_threads(const DispatchScheduleConfig& c) {
  Ranks out;
  out.results.resize(z(kEp));
  out.records.resize(z(kEp));
  out.live_after.resize(z(kEp));
  const RunResult run = run_ranks(static_cast<int>(kEp), [&](int rank, Communicator& comm) {
    TrackingAllocator alloc({512, -1, -1});
    out.results[z(rank)] = run_dispatch_schedule(comm, alloc, c);
    out.records[z(rank)] = alloc.phase_records();
    out.live_after[z(rank)] = alloc.live_allocations();
  });
  EXPECT_TRUE(run.ok()) << run.message;
  return out;
}

// The single-rank run over all 4·T tokens and E experts with the ranks' ids.
DispatchScheduleResult reference(DispatchScheduleConfig c) {
  std::vector<int32_t> ids;
  for (int64_t r = 0; r < kEp; ++r) {
    const std::vector<int32_t> mine = draw_dispatch_routing(c, kEp, r);
    ids.insert(ids.end(), mine.begin(), mine.end());
  }
  c.tokens *= kEp;
  c.llep = false;
  c.chunk_cap_rows = 0;
  c.topk_ids = &ids;
  TrackingAllocator alloc({512, -1, -1});
  return run_dispatch_schedule(alloc, c);
}

float max_abs(const std::vector<float>& v) {
  float m = 0.0f;
  for (float x : v) m = std::max(m, std::fabs(x));
  return m;
}
// Largest |got − ref[offset + i]|.
float max_diff(const std::vector<float>& got, const std::vector<float>& ref, size_t offset) {
  float worst = 0.0f;
  for (size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::fabs(got[i] - ref[offset + i]));
  return worst;
}

struct Case {
  const char* routing;
  Kind kind;
  bool expert_bias = false;  // gpt-oss's: lent with the weights, their gradients returned
};

class DispatchRanks : public ::testing::TestWithParam<Case> {};

// Uncapped EP and LLEP sum a token's k rows in increasing expert order in fp32 and every row's
// math is the reference's (borrowed weights are exact bf16 copies), so out and d_x are bitwise
// the single-rank run's. Expert dW: bitwise for uncapped EP (the native rank has the expert's
// rows in the reference's order, one GEMM); LLEP adds the helpers' fp32 parts and rounds add
// per-round parts: fp32 re-association, within 1e-5 of the largest value. PipelinedLLEP at
// EP > 1 adds a token's rows in round order: out within one bf16 step of the largest value, d_x
// within 1e-6 of its largest value. The router's dW is each rank's part of one sum over all
// tokens: within 1e-6 of its largest.
TEST_P(DispatchRanks, MatchesSingleRankReference) {
  const Case param = GetParam();
  DispatchScheduleConfig c = config_for(param.kind, param.routing);
  c.expert_bias = param.expert_bias;
  const DispatchScheduleResult ref = reference(c);
  const Ranks ranks = run_threads(c);
  const int64_t T = c.tokens, H = c.hidden, F = c.ffn, L = c.experts / kEp;
  const bool rounds = param.kind == Kind::Pipelined || param.kind == Kind::PipelinedStore;
  const float out_scale = max_abs(ref.out), dx_scale = max_abs(ref.d_x);
  const float dw_scale = std::max(max_abs(ref.d_w_gate_up), max_abs(ref.d_w_down));
  std::vector<float> router(ref.d_w_router.size(), 0.0f);
  int64_t total_rows = 0;
  for (int64_t r = 0; r < kEp; ++r) {
    const DispatchScheduleResult& got = ranks.results[z(r)];
    EXPECT_EQ(ranks.live_after[z(r)], 0);
    const size_t tok = z(r * T * H);
    if (!rounds) {
      EXPECT_EQ(max_diff(got.out, ref.out, tok), 0.0f) << "rank " << r;
      EXPECT_EQ(max_diff(got.d_x, ref.d_x, tok), 0.0f) << "rank " << r;
    } else {
      EXPECT_LE(max_diff(got.out, ref.out, tok), 0x1.0p-8f * out_scale) << "rank " << r;
      EXPECT_LE(max_diff(got.d_x, ref.d_x, tok), 1e-6f * dx_scale) << "rank " << r;
    }
    const float dgu = max_diff(got.d_w_gate_up, ref.d_w_gate_up, z(r * L * 2 * F * H));
    const float ddn = max_diff(got.d_w_down, ref.d_w_down, z(r * L * H * F));
    const int64_t Pb = c.expert_bias ? 2 * F + H : 0;
    ASSERT_EQ(got.d_b_expert.size(), z(L * Pb)) << "rank " << r;
    const float db = max_diff(got.d_b_expert, ref.d_b_expert, z(r * L * Pb));
    if (param.kind == Kind::Uncapped) {
      EXPECT_EQ(dgu, 0.0f) << "rank " << r;
      EXPECT_EQ(ddn, 0.0f) << "rank " << r;
      EXPECT_EQ(db, 0.0f) << "rank " << r;
    } else {
      EXPECT_LE(dgu, 1e-5f * dw_scale) << "rank " << r;
      EXPECT_LE(ddn, 1e-5f * dw_scale) << "rank " << r;
      EXPECT_LE(db, 1e-5f * max_abs(ref.d_b_expert)) << "rank " << r;
    }
    for (size_t i = 0; i < router.size(); ++i) router[i] += got.d_w_router[i];
    total_rows += got.received_rows;
  }
  EXPECT_LE(max_diff(router, ref.d_w_router, 0), 1e-6f * max_abs(ref.d_w_router));
  float out_d = 0.0f, dx_d = 0.0f, dw_d = 0.0f;
  for (int64_t r = 0; r < kEp; ++r) {
    const DispatchScheduleResult& got = ranks.results[z(r)];
    out_d = std::max(out_d, max_diff(got.out, ref.out, z(r * T * H)));
    dx_d = std::max(dx_d, max_diff(got.d_x, ref.d_x, z(r * T * H)));
    dw_d = std::max({dw_d, max_diff(got.d_w_gate_up, ref.d_w_gate_up, z(r * L * 2 * F * H)),
                     max_diff(got.d_w_down, ref.d_w_down, z(r * L * H * F))});
  }
  std::printf("%s %s: max |d out| %.3g, |d d_x| %.3g (of %.3g), |d dW| %.3g (of %.3g), |d dW_router| %.3g (of %.3g)\n",
              dispatch_schedule_name(c), param.routing, out_d, dx_d, dx_scale, dw_d, dw_scale,
              max_diff(router, ref.d_w_router, 0), max_abs(ref.d_w_router));
  EXPECT_EQ(total_rows, kEp * c.tokens * c.top_k);  // every copy computed exactly once
  if (c.expert_bias && c.llep) {  // the biases went out with lent weights and their grads came back
    int64_t lent = 0;
    for (const DispatchScheduleResult& r : ranks.results) lent += r.lent_weights;
    EXPECT_GT(lent, 0);
  }
  if (rounds) {
    EXPECT_GT(ranks.results[0].rounds, 1);
    for (const DispatchScheduleResult& r : ranks.results) EXPECT_LE(r.max_round_received_rows, r.round_buffer_rows);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Schedules, DispatchRanks,
    ::testing::Values(Case{"balanced", Kind::Uncapped}, Case{"rho=2.5", Kind::Uncapped}, Case{"rho=4", Kind::Uncapped},
                      Case{"rho=2.5", Kind::Llep}, Case{"hot-expert=0.6,1", Kind::Llep}, Case{"rho=4", Kind::Llep},
                      Case{"rho=2.5", Kind::Pipelined}, Case{"hot-expert=0.6,1", Kind::Pipelined},
                      Case{"rho=4", Kind::PipelinedStore}, Case{"rho=4", Kind::Uncapped, true},
                      Case{"hot-expert=0.6,1", Kind::Llep, true}, Case{"hot-expert=0.6,1", Kind::Pipelined, true},
                      Case{"rho=4", Kind::PipelinedStore, true}));

// k = 2: a token's two rows add in either order to the same fp32 value, so PipelinedLLEP's out
// and d_x are bitwise too.
TEST(DispatchRanksPipelined, TopTwoIsBitwise) {
  const DispatchScheduleConfig c = config_for(Kind::Pipelined, "rho=2.5", 2);
  const DispatchScheduleResult ref = reference(c);
  const Ranks ranks = run_threads(c);
  for (int64_t r = 0; r < kEp; ++r) {
    const size_t tok = z(r * c.tokens * c.hidden);
    EXPECT_EQ(max_diff(ranks.results[z(r)].out, ref.out, tok), 0.0f) << "rank " << r;
    EXPECT_EQ(max_diff(ranks.results[z(r)].d_x, ref.d_x, tok), 0.0f) << "rank " << r;
  }
}

// LLEP moves rows off the hot rank: with α = 1 every rank computes about the mean, and the hot
// rank's experts are lent (their gradients returned: checked above).
TEST(DispatchRanksLlep, BalancesRowsAndLendsWeights) {
  const Ranks ep = run_threads(config_for(Kind::Uncapped, "rho=4"));
  const Ranks llep = run_threads(config_for(Kind::Llep, "rho=4"));
  const int64_t mean_rows = 64 * 4;
  EXPECT_EQ(ep.results[0].received_rows, kEp * mean_rows);  // rho=4: rank 0 receives everything
  EXPECT_TRUE(llep.results[0].lla_triggered);
  int64_t lent = 0, borrowed = 0;
  for (const DispatchScheduleResult& r : llep.results) {
    EXPECT_LE(r.received_rows, mean_rows + 4) << "α = 1, m = 4: cap + rounding slack";
    lent += r.lent_weights;
    borrowed += r.foreign_experts;
  }
  EXPECT_EQ(lent, borrowed);
  EXPECT_GE(borrowed, 3);  // the three other ranks each borrow at least one of rank 0's experts
  EXPECT_EQ(llep.results[1].foreign_experts > 0, true);
}

// The receive buffers are sized at launch from C, EP and the LLA bound, whatever the routing:
// the same B under every routing model, and no round receives more.
TEST(DispatchRanksPipelined, RoundBuffersAreSizedAtLaunch) {
  std::set<int64_t> buffers;
  for (const char* routing : {"balanced", "rho=2.5", "rho=4", "hot-expert=0.6,1"}) {
    const Ranks ranks = run_threads(config_for(Kind::Pipelined, routing));
    for (const DispatchScheduleResult& r : ranks.results) {
      buffers.insert(r.round_buffer_rows);
      EXPECT_LE(r.max_round_received_rows, r.round_buffer_rows) << routing;
      EXPECT_EQ(r.rounds, ranks.results[0].rounds) << routing;
    }
  }
  EXPECT_EQ(buffers.size(), 1u);
  // α = 1, λ = 0, m = 4, N = 256: δ = (EP−1)·m + (α+1)·EP = 20 rows, ρ_B = 1 + 20/256,
  // B = ceil((C + EP)·ρ_B) + EP = ceil(52·276/256) + 4 = 61.
  EXPECT_EQ(*buffers.begin(), 61);
}

// Buffers sized at launch for ρ = 1 while LLA is off (λ large) and rank 0 receives 4× the mean:
// the cap shrinks (more rounds) instead of reallocating, and results stay within the bounds.
TEST(DispatchRanksPipelined, ShrinksCapWhenKnownLoadsWouldOverflow) {
  DispatchScheduleConfig c = config_for(Kind::Pipelined, "rho=4", 2);
  c.lla.imbalance_trigger = 100.0;  // λ fall-back: plain EP loads
  c.rho_bound = 1.0;
  const Ranks ranks = run_threads(c);
  const DispatchScheduleResult ref = reference(c);
  EXPECT_FALSE(ranks.results[0].lla_triggered);
  EXPECT_LT(ranks.results[0].chunk_cap_rows, c.chunk_cap_rows);
  EXPECT_EQ(ranks.results[0].launch_chunk_cap_rows, c.chunk_cap_rows);
  EXPECT_GT(ranks.results[0].rounds, (c.tokens * 2 + c.chunk_cap_rows - 1) / c.chunk_cap_rows);
  EXPECT_EQ(ranks.results[0].round_buffer_rows, c.chunk_cap_rows + 2 * kEp);  // ceil((C + EP)·1) + EP
  for (int64_t r = 0; r < kEp; ++r) {
    EXPECT_LE(ranks.results[z(r)].max_round_received_rows, ranks.results[z(r)].round_buffer_rows);
    EXPECT_EQ(max_diff(ranks.results[z(r)].out, ref.out, z(r * c.tokens * c.hidden)), 0.0f);  // k = 2: bitwise
  }
}

// Device dispatch peak of each rank over its phases.
std::vector<int64_t> dispatch_peaks(const Ranks& ranks) {
  std::vector<int64_t> out;
  for (const auto& records : ranks.records) {
    int64_t peak = 0;
    for (const PhaseRecord& rec : records)
      if (rec.space == MemorySpace::Device) peak = std::max(peak, rec.bytes_at_peak[static_cast<size_t>(Category::Dispatch)]);
    out.push_back(peak);
  }
  return out;
}

// m = 16 makes the foreign-weight pool one expert (floor(B/m) − E/EP = 68/16 − 4 < 1): with experts
// 0 and 1 (both rank 0's) on about every token, LLA lends each helper one expert, the first hot
// one, and the second one's rows that no helper may take stay on rank 0, beyond the store's
// launch-time rows; the rounds that no longer fit are recomputed in
// backward (store) — the same buffers, the same peak as under a balanced routing, exact results.
TEST(DispatchRanksPipelined, ForeignPoolAndStoreHoldWhateverTheRouting) {
  for (Kind kind : {Kind::Pipelined, Kind::PipelinedStore}) {
    DispatchScheduleConfig c = config_for(kind, "hot-expert=0.9,2");
    c.lla.min_rows_per_gemm = 16;
    EXPECT_EQ(dispatch_foreign_pool(c, kEp), 1);
    const Ranks hot = run_threads(c);
    const DispatchScheduleResult ref = reference(c);
    DispatchScheduleConfig balanced = c;
    balanced.routing = parse_routing_model("balanced");
    const std::vector<int64_t> hot_peaks = dispatch_peaks(hot), balanced_peaks = dispatch_peaks(run_threads(balanced));
    EXPECT_TRUE(hot.results[0].lla_triggered);
    EXPECT_GT(hot.results[0].received_rows, dispatch_store_rows(c, kEp));  // kept home, beyond the store
    if (kind == Kind::PipelinedStore) {
      EXPECT_EQ(hot.results[0].store_rows, dispatch_store_rows(c, kEp));
      EXPECT_LT(hot.results[0].stored_rounds, hot.results[0].rounds);  // some rounds recomputed in backward
      EXPECT_GT(hot.results[0].stored_rounds, 0);
    }
    const float out_scale = max_abs(ref.out), dx_scale = max_abs(ref.d_x);
    const float dw_scale = std::max(max_abs(ref.d_w_gate_up), max_abs(ref.d_w_down));
    const int64_t T = c.tokens, H = c.hidden, F = c.ffn, L = c.experts / kEp;
    for (int64_t r = 0; r < kEp; ++r) {
      const DispatchScheduleResult& got = hot.results[z(r)];
      EXPECT_EQ(got.foreign_pool, 1);
      EXPECT_LE(got.foreign_experts, 1) << "rank " << r;
      EXPECT_EQ(hot_peaks[z(r)], balanced_peaks[z(r)]) << "rank " << r;
      EXPECT_EQ(hot.live_after[z(r)], 0);
      EXPECT_LE(max_diff(got.out, ref.out, z(r * T * H)), 0x1.0p-8f * out_scale) << "rank " << r;
      EXPECT_LE(max_diff(got.d_x, ref.d_x, z(r * T * H)), 1e-6f * dx_scale) << "rank " << r;
      EXPECT_LE(max_diff(got.d_w_gate_up, ref.d_w_gate_up, z(r * L * 2 * F * H)), 1e-5f * dw_scale) << "rank " << r;
      EXPECT_LE(max_diff(got.d_w_down, ref.d_w_down, z(r * L * H * F)), 1e-5f * dw_scale) << "rank " << r;
    }
  }
}

// EP groups (config.replica) hold their own tokens: group g's rank r draws the routing stream and
// the inputs of global rank g·EP + r, so two groups of 2 ranks are the ranks of one group of 4.
TEST(DispatchRanksReplica, EachGroupDrawsItsOwnTokensAndRouting) {
  DispatchScheduleConfig c = config_for(Kind::Uncapped, "rho=2.5");
  c.routing = parse_routing_model("balanced");
  DispatchScheduleConfig second = c;
  second.replica = 1;
  EXPECT_NE(draw_dispatch_routing(c, 2, 0), draw_dispatch_routing(second, 2, 0));
  EXPECT_EQ(draw_dispatch_routing(second, 2, 1), draw_dispatch_routing(c, 4, 3));  // balanced: ep_rank unused
}

// Every rank records the one-rank schedule's phase names (rounds folded r0..rN).
TEST(DispatchRanksPhases, EveryRankRecordsTheSchedulesPhases) {
  for (Kind kind : {Kind::Uncapped, Kind::Llep, Kind::Pipelined}) {
    DispatchScheduleConfig c = config_for(kind, "rho=2.5");
    c.layer = "L3";
    const Ranks ranks = run_threads(c);
    for (int64_t r = 0; r < kEp; ++r) {
      std::set<std::string> names;
      for (const PhaseRecord& rec : ranks.records[z(r)])
        if (rec.space == MemorySpace::Device) names.insert(rec.phase);
      if (kind != Kind::Pipelined) {
        for (const char* n : {"fwd/L3/moe/route", "fwd/L3/moe/dispatch", "fwd/L3/moe/experts", "fwd/L3/moe/combine",
                              "bwd/L3/recompute/moe/dispatch", "bwd/L3/recompute/moe/experts", "bwd/L3/recompute/moe/combine",
                              "bwd/L3/moe/combine", "bwd/L3/moe/experts", "bwd/L3/moe/dispatch"})
          EXPECT_EQ(names.count(n), 1u) << n << " rank " << r;
      } else {
        const int64_t n = ranks.results[0].rounds;
        for (const std::string& s : {std::string("fwd/L3/moe/route"), std::string("bwd/L3/recompute/moe/route"),
                                     "fwd/L3/moe/dispatch/r" + std::to_string(n - 1), "bwd/L3/moe/dispatch/r" + std::to_string(n - 1)})
          EXPECT_EQ(names.count(s), 1u) << s << " rank " << r;
      }
    }
  }
}

}  // namespace
}  // namespace flatpeak::exec
