// Capacity queries: a knob-searched plan's fit is monotone in S; reach is exact at its edge
// (fits at the largest context, not 1024 tokens further); reach never shrinks with more GPUs,
// more host memory or more device memory; --target-context finds the smallest N; compare holds
// the global batch equal and attributes each technique.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "planner_test_util.h"
#include "reach.h"

namespace flatpeak::planner::test {
namespace {

HardwareSpec small_gpu(int64_t device_bytes, int64_t host_bytes) {
  HardwareSpec h = tiny_gpu();
  h.device_memory_bytes = device_bytes;
  h.host_memory_bytes_per_node = host_bytes;
  h.runtime_overhead_bytes = 1000;
  h.bf16_dense_flops = 1e12;
  h.hbm_bandwidth_bytes_per_s = 1e11;
  h.scale_up_bandwidth_bytes_per_s = 1e9;
  h.inter_node_bandwidth_bytes_per_s = 1e8;
  h.host_link_bandwidth_bytes_per_s = 1e7;
  h.host_memory_bandwidth_bytes_per_s = 1e8;
  return h;
}

// Host memory per node that leaves `room` bytes beside the fixed 16 GiB per node.
int64_t host_with_room(int64_t room) {
  return static_cast<int64_t>(std::ceil(static_cast<double>(kHostFixedBytesPerNode + room) / kHostUsableFraction));
}

Query query_of(int64_t gpus, bool cp_auto) {
  Query q;
  q.base.gpus = gpus;
  q.base.cp_auto = cp_auto;
  q.limit_tokens = int64_t{1} << 22;
  return q;
}

bool fits(const ModelSpec& m, const HardwareSpec& h, const Query& q, Schedule s, int64_t context) {
  RunSpec spec = q.base;
  spec.schedule = s;
  spec.context_tokens = context;
  LoadCache cache;
  return run_schedule(m, h, spec, q.efficiency, cache, true).fits;
}

TEST(PlannerReach, FitIsMonotoneInContext) {
  std::mt19937_64 rng(4);
  auto pick = [&](std::vector<int64_t> v) { return v[std::uniform_int_distribution<size_t>(0, v.size() - 1)(rng)]; };
  for (int trial = 0; trial < 12; ++trial) {
    ModelSpec m = tiny_moe(pick({1, 2, 3}));
    m.hidden_size = pick({8, 16});
    const HardwareSpec h = small_gpu(pick({400000, 1000000, 3000000}), pick({host_with_room(300000), int64_t{1} << 40}));
    const Query q = query_of(pick({2, 4}), pick({0, 1}) == 1);
    for (Schedule s : {Schedule::Baseline, Schedule::Practice, Schedule::Flatpeak}) {
      bool failed = false;
      for (int64_t context = 1024; context <= 32768; context += 1024) {
        const bool f = fits(m, h, q, s, context);
        EXPECT_FALSE(failed && f) << "trial " << trial << " " << to_string(s) << ": fits at S = " << context
                                  << " after failing at a smaller S";
        failed = failed || !f;
      }
    }
  }
}

TEST(PlannerReach, ReachIsExactAtItsEdge) {
  const ModelSpec m = tiny_moe(2);
  const HardwareSpec h = small_gpu(1500000, int64_t{1} << 40);
  for (bool cp_auto : {false, true}) {
    const Query q = query_of(2, cp_auto);
    const std::vector<Reach> r = reach(m, h, q);
    ASSERT_EQ(r.size(), 3u);
    for (const Reach& x : r) {
      const Schedule s = x.schedule == "baseline" ? Schedule::Baseline
                         : x.schedule == "practice" ? Schedule::Practice
                                                    : Schedule::Flatpeak;
      ASSERT_GT(x.max_context_tokens, 0) << x.schedule;
      EXPECT_EQ(x.max_context_tokens % 1024, 0) << x.schedule;
      EXPECT_TRUE(fits(m, h, q, s, x.max_context_tokens)) << x.schedule;
      if (!x.at_limit) {
        EXPECT_FALSE(fits(m, h, q, s, x.max_context_tokens + 1024)) << x.schedule;
        EXPECT_NE(x.binding, "") << x.schedule;
      }
      EXPECT_LE(x.max_power_of_two_tokens, x.max_context_tokens) << x.schedule;
      EXPECT_GT(2 * x.max_power_of_two_tokens, x.max_context_tokens) << x.schedule;
      EXPECT_TRUE(x.at_max.fits) << x.schedule;
    }
    EXPECT_LE(r[0].max_context_tokens, r[2].max_context_tokens);  // flatpeak reaches at least the baseline
  }
}

TEST(PlannerReach, ReachNeverShrinksWithMoreGpusHostOrDeviceMemory) {
  const ModelSpec m = tiny_moe(3);
  const int64_t device = 1200000, host = host_with_room(400000);
  for (bool cp_auto : {false, true}) {
    const std::vector<Reach> base = reach(m, small_gpu(device, host), query_of(2, cp_auto));
    const std::vector<Reach> gpus = reach(m, small_gpu(device, host), query_of(4, cp_auto));
    const std::vector<Reach> host2 = reach(m, small_gpu(device, host_with_room(800000)), query_of(2, cp_auto));
    const std::vector<Reach> dev2 = reach(m, small_gpu(2 * device, host), query_of(2, cp_auto));
    for (size_t i = 0; i < 3; ++i) {
      const std::string what = base[i].schedule + (cp_auto ? " cp auto" : " cp 1");
      EXPECT_GE(gpus[i].max_context_tokens, base[i].max_context_tokens) << what;
      EXPECT_GE(host2[i].max_context_tokens, base[i].max_context_tokens) << what;
      EXPECT_GE(dev2[i].max_context_tokens, base[i].max_context_tokens) << what;
    }
    // And more of everything does help somewhere: device memory lets every schedule reach further.
    for (size_t i = 0; i < 3; ++i) EXPECT_GT(dev2[i].max_context_tokens, base[i].max_context_tokens) << base[i].schedule;
  }
}

TEST(PlannerReach, TargetContextFindsTheSmallestGpuCount) {
  const ModelSpec m = tiny_moe(2);
  const HardwareSpec h = small_gpu(1200000, int64_t{1} << 40);
  Query q = query_of(1, true);
  const std::vector<TargetFit> t = reach_target(m, h, q, 16384, 64);
  ASSERT_EQ(t.size(), 3u);
  for (const TargetFit& x : t) {
    const Schedule s = x.schedule == "baseline" ? Schedule::Baseline
                       : x.schedule == "practice" ? Schedule::Practice
                                                  : Schedule::Flatpeak;
    ASSERT_GT(x.gpus, 0) << x.schedule;
    Query at = q;
    at.base.gpus = x.gpus;
    at.base.cp_auto = false;
    at.base.cp = x.cp;
    EXPECT_TRUE(fits(m, h, at, s, 16384)) << x.schedule;
    if (x.gpus > 1) {
      Query half = q;
      half.base.gpus = x.gpus / 2;
      EXPECT_FALSE(fits(m, h, half, s, 16384)) << x.schedule << ": fits on " << x.gpus / 2;
    }
  }
}

// The GPU counts tried are those at which the flags resolve (EP, CP, routing and tokens per GPU
// depend on N); none at all is an input error, not "nothing fits" with a row of zeros. And
// --max-gpus is an upper bound (5 tried 8).
TEST(PlannerReach, TargetContextTriesOnlyGpuCountsTheFlagsAllow) {
  const ModelSpec m = tiny_moe(2);  // E = 4, k = 2; 2 GPUs per node: EP = 1 at N = 1, 2 beyond
  const HardwareSpec h = small_gpu(1200000, int64_t{1} << 40);
  Query q = query_of(1, true);
  q.base.imbalance = "rho=2";  // needs EP >= 2: N = 1 does not resolve
  for (const TargetFit& x : reach_target(m, h, q, 16384, 64)) {
    EXPECT_NE(x.gpus, 1) << x.schedule;
    if (x.gpus == 0) {
      EXPECT_GT(x.at.search.summary.budget_bytes, 0) << x.schedule << ": a plan, not zeros";
    }
  }
  q.base.imbalance = "rho=3";  // beyond EP·min(k, E/EP)/k = 2 at every N
  try {
    reach_target(m, h, q, 16384, 64);
    ADD_FAILURE() << "rho=3 resolves nowhere: expected an InputError";
  } catch (const InputError& e) {
    EXPECT_EQ(e.diagnostics().front().pointer, "--imbalance");
  }
  q.base.imbalance.reset();
  for (const TargetFit& x : reach_target(m, h, q, 16384, 5)) EXPECT_LE(x.gpus, 4) << x.schedule;
}

TEST(PlannerReach, CompareHoldsTheGlobalBatchAndAttributesEachTechnique) {
  const ModelSpec m = tiny_moe(2);
  const HardwareSpec h = small_gpu(int64_t{1} << 30, int64_t{1} << 40);
  const Comparison c = compare(m, h, query_of(2, false), 2048);
  EXPECT_EQ(c.global_batch, 16);  // 8 x N / CP
  ASSERT_EQ(c.schedules.size(), 3u);
  for (const ScheduleRun& s : c.schedules) {
    ASSERT_TRUE(s.fits) << s.name;
    // b x accumulation x DP = the global batch, whatever micro-batch each picked.
    EXPECT_EQ(s.search.choice.micro_batch * s.search.time.micro_batches * 2, 16) << s.name;
    EXPECT_DOUBLE_EQ(s.search.time.tokens_per_second, 16.0 * 2048 / s.search.time.step_seconds) << s.name;
  }
  std::vector<std::string> alone, without;
  for (const auto& t : c.alone) alone.push_back(t.name);
  for (const auto& t : c.all_but_one) without.push_back(t.name);
  const std::vector<std::string> names = {"pipelined_llep", "ring_dtp", "sco", "offload_stream_adamw"};
  EXPECT_EQ(alone, names);
  EXPECT_EQ(without, names);
  for (const auto& t : c.alone) {
    const ResolvedRun& r = t.run.search.run;
    const bool on = t.name == "pipelined_llep" ? r.llep
                    : t.name == "ring_dtp"     ? r.vocab == VocabMode::RingDtp
                    : t.name == "sco"          ? r.boundaries == BoundaryMode::Sco
                                               : r.optimizer == OptimizerPlacement::Stream;
    EXPECT_TRUE(on) << t.name << " alone";
  }
  for (const auto& t : c.all_but_one) {
    const ResolvedRun& r = t.run.search.run;
    const bool off = t.name == "pipelined_llep" ? !r.llep
                     : t.name == "ring_dtp"     ? r.vocab == VocabMode::Materialized
                     : t.name == "sco"          ? r.boundaries == BoundaryMode::Device
                                                : r.optimizer != OptimizerPlacement::Stream;
    EXPECT_TRUE(off) << "flatpeak without " << t.name;
  }
}

}  // namespace
}  // namespace flatpeak::planner::test
