// Property: at fixed knobs, every peak (bytes and component) is non-decreasing in S and in b,
// over random tiny configurations and every schedule.
#include <gtest/gtest.h>

#include <random>

#include "planner_test_util.h"

namespace flatpeak::planner::test {
namespace {

struct Config {
  ModelSpec model;
  std::vector<std::pair<std::string, std::string>> flags;  // everything but --context/--micro-batch
};

Config random_config(std::mt19937_64& rng) {
  auto pick = [&](std::vector<int64_t> v) { return v[std::uniform_int_distribution<size_t>(0, v.size() - 1)(rng)]; };
  Config c;
  c.model = tiny_moe(pick({1, 2, 3}));
  c.model.hidden_size = pick({8, 16});
  c.model.vocab_size = pick({32, 64, 96});
  c.model.num_experts = pick({2, 4});
  c.model.top_k = pick({1, 2});
  c.model.expert_ffn_width = pick({4, 8});
  c.model.num_heads = pick({2, 4});
  c.model.num_kv_heads = pick({1, 2});
  if (pick({0, 1}) == 1) c.model.layers[0].ffn = FfnKind::Dense, c.model.dense_ffn_width = 16;
  const int64_t gpus = pick({2, 4});
  c.flags = {{"--gpus", std::to_string(gpus)}};
  const char* schedules[] = {"baseline", "practice", "flatpeak"};
  const std::string schedule = schedules[pick({0, 1, 2})];
  c.flags.push_back({"--schedule", schedule});
  if (c.model.count_layers(FfnKind::Moe) > 0) c.flags.push_back({"--imbalance", pick({0, 1}) ? "balanced" : "zipf=1.2"});
  if (schedule != "baseline") {
    c.flags.push_back({"--token-block", "8"});
    c.flags.push_back({"--vocab-block", "16"});
  }
  if (schedule == "flatpeak" && c.model.count_layers(FfnKind::Moe) > 0) {
    c.flags.push_back({"--chunk-cap-rows", "16"});
    c.flags.push_back({"--llep-min-rows", "4"});
  }
  if (schedule == "flatpeak") {
    c.flags.push_back({"--bucket-params", "256"});
    c.flags.push_back({"--sco-layers", "all"});  // fixed knobs: not the auto layer count
  }
  return c;
}

Plan plan_at(const Config& c, int64_t context, int64_t micro_batch) {
  auto flags = c.flags;
  flags.push_back({"--context", std::to_string(context)});
  flags.push_back({"--micro-batch", std::to_string(micro_batch)});
  return make_plan(c.model, tiny_gpu(), spec_of(flags));
}

void expect_not_smaller(const Plan& small, const Plan& large, const std::string& what) {
  for (int k = 0; k < kPeakCount; ++k) {
    const auto kind = static_cast<PeakKind>(k);
    EXPECT_LE(small.summary.peak(kind).bytes, large.summary.peak(kind).bytes) << what << " " << to_string(kind);
    EXPECT_LE(small.summary.peak(kind).component_bytes, large.summary.peak(kind).component_bytes)
        << what << " " << to_string(kind);
  }
  EXPECT_LE(small.summary.gpu_peak_bytes, large.summary.gpu_peak_bytes) << what;
  EXPECT_LE(small.summary.host_peak_bytes, large.summary.host_peak_bytes) << what;
}

TEST(PlannerProperty, PeaksAreNonDecreasingInContextAndMicroBatch) {
  std::mt19937_64 rng(20261130);
  for (int trial = 0; trial < 60; ++trial) {
    const Config c = random_config(rng);
    const std::string what = "trial " + std::to_string(trial);
    Plan previous = plan_at(c, 16, 1);
    for (int64_t s : {32, 48, 64, 128, 256}) {
      Plan next = plan_at(c, s, 1);
      expect_not_smaller(previous, next, what + " S=" + std::to_string(s));
      previous = std::move(next);
    }
    Plan pb = plan_at(c, 32, 1);
    for (int64_t b : {2, 3, 4}) {
      Plan next = plan_at(c, 32, b);
      expect_not_smaller(pb, next, what + " b=" + std::to_string(b));
      pb = std::move(next);
    }
    if (HasFailure()) break;
  }
}

}  // namespace
}  // namespace flatpeak::planner::test
