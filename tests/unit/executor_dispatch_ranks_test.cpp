// EP dispatch across 4 thread ranks: each schedule's combined output, input gradient, router
// weight gradient and expert-weight gradients against the single-rank reference; the per-round
// receive bound and the cap shrinking of PipelinedLLEP; the dispatch peaks' order.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <mutex>
#include <vector>

#include "executor/comm/threads_comm.h"
#include "executor/dispatch/ep_dispatch_case.h"

namespace flatpeak::exec {
namespace {

constexpr int64_t kEp = 4;

MoeDims small_dims(int64_t top_k) {
  MoeDims d;
  d.tokens = 64;
  d.hidden = 32;
  d.ffn = 16;
  d.experts = 8;
  d.top_k = top_k;
  return d;
}

EpDispatchConfig config_for(EpSchedule schedule) {
  EpDispatchConfig c;
  c.schedule = schedule;
  c.lla.llep_alpha = 1.0;
  c.lla.min_rows_per_gemm = 4;
  c.lla.imbalance_trigger = 0.0;  // LLA always runs
  c.chunk_cap_rows = 24;
  return c;
}

std::vector<EpRankResult> run_threads(const EpCase& c, const EpDispatchConfig& config) {
  std::vector<EpRankResult> results(static_cast<size_t>(c.ep));
  const RunResult run = run_ranks(static_cast<int>(c.ep), [&](int rank, Communicator& comm) {
    TrackingAllocator alloc;
    results[static_cast<size_t>(rank)] = run_ep_rank(comm, alloc, c, config);
  });
  EXPECT_TRUE(run.ok()) << run.message;
  return results;
}

// Largest |a − b| over a slice of the reference.
float max_abs_diff(const std::vector<float>& got, const std::vector<float>& ref, size_t offset) {
  float worst = 0.0f;
  for (size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::fabs(got[i] - ref[offset + i]));
  return worst;
}
float max_abs(const std::vector<float>& v) {
  float m = 0.0f;
  for (float x : v) m = std::max(m, std::fabs(x));
  return m;
}

struct Case {
  const char* routing;
  EpSchedule schedule;
};

class DispatchRanks : public ::testing::TestWithParam<Case> {};

// k = 2: a token's two slot contributions add in either order to the same fp32 value, so out,
// d_x and d_weights are bitwise the reference's in every schedule (rows are independent in the
// GEMMs). Expert-weight gradients are bitwise for uncapped EP (same rows, same order, one GEMM
// per expert); LLEP and PipelinedLLEP split an expert's rows (helpers, rounds) and add the
// partial GEMMs, so they are held to 1e-5 of the largest gradient (fp32 re-association).
TEST_P(DispatchRanks, MatchesSingleRankReference) {
  const Case param = GetParam();
  const EpCase c = make_ep_case(small_dims(2), kEp, parse_routing_model(param.routing), 11);
  const EpRankResult ref = run_ep_reference(c);
  const std::vector<EpRankResult> ranks = run_threads(c, config_for(param.schedule));
  const MoeDims& d = c.dims;
  const int64_t L = d.experts / kEp;
  const float dw_scale = std::max(max_abs(ref.d_w_gate_up), max_abs(ref.d_w_down));
  int64_t total_rows = 0;
  for (int64_t r = 0; r < kEp; ++r) {
    const EpRankResult& got = ranks[static_cast<size_t>(r)];
    const size_t tok = static_cast<size_t>(r * d.tokens * d.hidden);
    EXPECT_EQ(max_abs_diff(got.out, ref.out, tok), 0.0f) << "rank " << r;
    EXPECT_EQ(max_abs_diff(got.d_x, ref.d_x, tok), 0.0f) << "rank " << r;
    EXPECT_EQ(max_abs_diff(got.d_weights, ref.d_weights, static_cast<size_t>(r * d.tokens * 2)), 0.0f);
    const float dw_gu = max_abs_diff(got.d_w_gate_up, ref.d_w_gate_up,
                                     static_cast<size_t>(r * L * 2 * d.ffn * d.hidden));
    const float dw_d =
        max_abs_diff(got.d_w_down, ref.d_w_down, static_cast<size_t>(r * L * d.hidden * d.ffn));
    if (param.schedule == EpSchedule::Uncapped) {
      EXPECT_EQ(dw_gu, 0.0f) << "rank " << r;
      EXPECT_EQ(dw_d, 0.0f) << "rank " << r;
    } else {
      EXPECT_LE(dw_gu, 1e-5f * dw_scale) << "rank " << r;
      EXPECT_LE(dw_d, 1e-5f * dw_scale) << "rank " << r;
    }
    total_rows += got.stats.received_rows;
    EXPECT_GT(got.stats.dispatch_peak_bytes, 0);
  }
  EXPECT_EQ(total_rows, kEp * d.tokens * d.top_k);  // every copy computed exactly once
  if (param.schedule == EpSchedule::PipelinedLlep) {
    EXPECT_GT(ranks[0].stats.rounds, 1);
    for (const EpRankResult& r : ranks) {
      EXPECT_LE(r.stats.max_round_received_rows, r.stats.round_buffer_rows);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Schedules, DispatchRanks,
    ::testing::Values(Case{"balanced", EpSchedule::Uncapped}, Case{"rho=2.5", EpSchedule::Uncapped},
                      Case{"rho=2.5", EpSchedule::Llep}, Case{"hot-expert=0.6,1", EpSchedule::Llep},
                      Case{"rho=2.5", EpSchedule::PipelinedLlep},
                      Case{"hot-expert=0.6,1", EpSchedule::PipelinedLlep}));

// LLEP moves rows off the hot rank: with α = 1 every rank computes about the mean, and the hot
// expert's weights are lent (and its gradients returned: checked by the test above).
TEST(DispatchRanksLlep, BalancesRowsAndLendsWeights) {
  const EpCase c = make_ep_case(small_dims(2), kEp, parse_routing_model("rho=4"), 5);
  const std::vector<EpRankResult> ep = run_threads(c, config_for(EpSchedule::Uncapped));
  const std::vector<EpRankResult> llep = run_threads(c, config_for(EpSchedule::Llep));
  const int64_t mean_rows = c.dims.tokens * c.dims.top_k;
  EXPECT_EQ(ep[0].stats.received_rows, kEp * mean_rows);  // rho=4: rank 0 receives everything
  EXPECT_TRUE(llep[0].stats.lla_triggered);
  int64_t lent = 0, borrowed = 0;
  for (const EpRankResult& r : llep) {
    EXPECT_LE(r.stats.received_rows, mean_rows + 4) << "α = 1, m = 4: cap + rounding slack";
    lent += r.stats.lent_weights;
    borrowed += r.stats.foreign_experts;
  }
  EXPECT_EQ(lent, borrowed);
  EXPECT_GE(borrowed, 3);  // the three other ranks each borrow at least one of rank 0's experts
  EXPECT_LT(llep[0].stats.dispatch_peak_bytes, ep[0].stats.dispatch_peak_bytes);
}

// Buffers sized at launch for ρ = 1 while LLA is off (λ large) and rank 0 receives 4× the mean:
// the cap shrinks (more rounds) instead of reallocating, and results stay exact.
TEST(DispatchRanksPipelined, ShrinksCapWhenKnownLoadsWouldOverflow) {
  const EpCase c = make_ep_case(small_dims(2), kEp, parse_routing_model("rho=4"), 9);
  EpDispatchConfig config = config_for(EpSchedule::PipelinedLlep);
  config.lla.imbalance_trigger = 100.0;  // λ fall-back: plain EP loads
  config.rho_bound = 1.0;
  const std::vector<EpRankResult> ranks = run_threads(c, config);
  const EpRankResult ref = run_ep_reference(c);
  EXPECT_FALSE(ranks[0].stats.lla_triggered);
  EXPECT_LT(ranks[0].stats.chunk_cap_rows, config.chunk_cap_rows);
  EXPECT_GT(ranks[0].stats.rounds, (c.dims.tokens * 2 + config.chunk_cap_rows - 1) / config.chunk_cap_rows);
  // launch sizing: ceil((C + EP)·1) + EP rows
  EXPECT_EQ(ranks[0].stats.round_buffer_rows, config.chunk_cap_rows + 2 * kEp);
  for (int64_t r = 0; r < kEp; ++r) {
    EXPECT_LE(ranks[static_cast<size_t>(r)].stats.max_round_received_rows,
              ranks[static_cast<size_t>(r)].stats.round_buffer_rows);
    EXPECT_EQ(max_abs_diff(ranks[static_cast<size_t>(r)].out, ref.out,
                           static_cast<size_t>(r * c.dims.tokens * c.dims.hidden)),
              0.0f);
  }
}

// k = 3 in rounds: a token's slots may arrive in another order, so out and d_x are sums of three
// fp32 terms re-associated: held to 2 ulp-scale (4e-7 relative to the largest value).
TEST(DispatchRanksPipelined, TopThreeWithinReassociationBound) {
  const EpCase c = make_ep_case(small_dims(3), kEp, parse_routing_model("rho=2.5"), 3);
  const EpRankResult ref = run_ep_reference(c);
  const std::vector<EpRankResult> ranks = run_threads(c, config_for(EpSchedule::PipelinedLlep));
  const float out_scale = max_abs(ref.out), dx_scale = max_abs(ref.d_x);
  for (int64_t r = 0; r < kEp; ++r) {
    const size_t tok = static_cast<size_t>(r * c.dims.tokens * c.dims.hidden);
    EXPECT_LE(max_abs_diff(ranks[static_cast<size_t>(r)].out, ref.out, tok), 4e-7f * out_scale);
    EXPECT_LE(max_abs_diff(ranks[static_cast<size_t>(r)].d_x, ref.d_x, tok), 4e-7f * dx_scale);
    EXPECT_EQ(max_abs_diff(ranks[static_cast<size_t>(r)].d_weights, ref.d_weights,
                           static_cast<size_t>(r * c.dims.tokens * 3)),
              0.0f);
  }
}

}  // namespace
}  // namespace flatpeak::exec
