// verify --component step on 4 thread ranks (FSDP at EP = 1 and at EP = 4): for plans of real cards
// (Qwen3-30B-A3B, OLMoE-1B-7B; --gpus 4 --ep 1, baseline and flatpeak; gpt-oss-120b baseline, whose
// first layer in backward peaks at its grads' copy-in, planner_tiny_test.cpp; --ep 4: Qwen3-30B-A3B
// baseline and gpt-oss-120b flatpeak, whose router backward at this scale has d logits [T, E]
// larger than the d dispatch rows [T·k, H], so it must reuse the dead router buffers) every column
// of every phase on every rank within 1 % of the planner's one-rank share of the 4-GPU plan (at EP
// = 4 on the routing the layers realised), every baseline row exact, rows tagged with the rank
// that measured the most; loss, grad shards and updated params bitwise the single-rank reference
// with the materialised loss (at EP = 4 the loss, and the grads within the experts' rounding); a
// predicted term raised by 2 % fails. --ep 2 (OLMoE-1B-7B baseline): two EP groups of 2 ranks, each
// rank's experts sharded over the 2 replicas that hold them. GLM-4.5 baseline --ep 4: its dense
// first layers (each unit sharded whole over the 4 ranks) beside the MoE layer and its shared expert.
// CP = 2 (Qwen3-30B-A3B baseline, EP = 1 and EP = 4; gpt-oss-20b with its sliding windows): ring
// attention within pairs of ranks, every row exact, bitwise the reference at EP = 1; the ring's
// terms taken out of the prediction fail.
// Plans at 16K context, verified at --scale 128 (T = 128, H = 16-22; fast under ASan).
#include <gtest/gtest.h>

#include <cmath>
#include <ostream>
#include <set>
#include <string>
#include <vector>

#include "plan.h"
#include "run_spec.h"
#include "spec/errors.h"
#include "spec/hardware_loader.h"
#include "spec/model_loader.h"
#include "verify_common.h"
#include "verify_config.h"
#include "verify_run.h"

namespace flatpeak::cli {
namespace {

using Flags = std::vector<std::pair<std::string, std::string>>;

nlohmann::json plan_json(const std::string& model_name, Flags flags) {
  flags.insert(flags.begin(), {{"--gpus", "4"}, {"--context", "16K"}, {"--mtp", "off"}});  // the step runs no MTP module
  InputErrors errs;
  const planner::RunSpec spec = planner::parse_run_flags(flags, errs);
  errs.throw_if_any();
  return nlohmann::json::parse(planner::plan_to_json(planner::make_plan(load_model(model_name), load_hardware("H200"), spec)).dump());
}

VerifyReport verify_step_of(const VerifyInputs& in, const PredictionAdjust& adjust = nullptr) {
  return run_verification(in, scale_config(in, 128.0, 8), {"step"}, 0.01, adjust);
}

bool has_note(const VerifyReport& r, const std::string& text) {
  for (const auto& n : r.notes)
    if (n.find(text) != std::string::npos) return true;
  return false;
}

struct Case {
  std::string model, schedule;
  int ep = 1;
};
void PrintTo(const Case& c, std::ostream* os) { *os << c.model << " " << c.schedule << " EP " << c.ep; }

class VerifyStepRanks : public ::testing::TestWithParam<Case> {};

TEST_P(VerifyStepRanks, EveryRankEveryColumnWithinOnePercent) {
  const Case& c = GetParam();
  const VerifyInputs in = read_plan_inputs(plan_json(c.model, {{"--ep", std::to_string(c.ep)}, {"--schedule", c.schedule}}), "plan.json");
  const VerifyReport r = verify_step_of(in);
  const std::string what = c.model + " " + c.schedule + " EP " + std::to_string(c.ep);
  EXPECT_TRUE(r.pass) << what;
  EXPECT_EQ(r.ranks, 4) << what;
  EXPECT_TRUE(has_note(r, c.ep == 1 ? "step: 4 ranks, FSDP at EP = 1" : "step: 4 ranks, FSDP with EP = " + std::to_string(c.ep))) << what;
  std::set<int> dispatch_peak_ranks;
  std::set<std::string> peaks, phases;
  int64_t device_total = 0;
  for (const auto& row : r.rows) {
    EXPECT_LE(std::fabs(row.relative_error), 0.01) << what << " " << row.component << " " << row.space << " " << row.phase;
    if (c.schedule == "baseline") {
      EXPECT_EQ(row.measured_bytes, row.predicted_bytes) << what << " " << row.component << " " << row.phase << " rank " << row.rank;
    }
    EXPECT_GE(row.rank, 0);
    EXPECT_LT(row.rank, 4);
    if (row.phase == "peak") peaks.insert(row.component + "/" + row.space);
    if (row.component == "step.dispatch" && row.phase != "peak") dispatch_peak_ranks.insert(row.rank);
    else phases.insert(row.phase);
    if (row.phase == "peak" && row.component == "step.total" && row.space == "device") device_total = row.measured_bytes;
  }
  EXPECT_EQ(peaks.size(), 12u) << what;
  for (const char* p : {"fwd/embed", "fwd/L3/moe/combine", "bwd/L3/recompute/attn", "bwd/L1/attn", "bwd/embed"})
    EXPECT_TRUE(phases.count(p)) << what << " " << p;
  EXPECT_GT(device_total, 500000) << what;
  // EP = 4: the ranks receive different rows, so different ranks hold the dispatch maxima.
  if (c.ep > 1) {
    EXPECT_GT(dispatch_peak_ranks.size(), 1u) << what;
  }
  if (c.schedule == "baseline" && c.ep > 1) {  // the experts' grads are rounded once, not once a rank
    EXPECT_EQ(r.max_abs_dloss, 0.0) << what;
    EXPECT_GT(r.max_abs_dgrad, 0.0) << what;
    EXPECT_LT(r.max_abs_dgrad, 1e-4) << what;
  } else if (c.schedule == "baseline") {  // materialised loss, optimizer on the device: bitwise the reference
    EXPECT_EQ(r.max_abs_dloss, 0.0) << what;
    EXPECT_EQ(r.max_abs_dgrad, 0.0) << what;
    EXPECT_TRUE(has_note(r, "max |updated param - reference| over the ranks = 0 ")) << what;
  } else {  // blocked loss: the one-rank bounds (executor_step_ranks_test.cpp)
    EXPECT_LT(r.max_abs_dloss, 0.03) << what;
    EXPECT_LT(r.max_abs_dgrad, 0.01) << what;
  }
}

INSTANTIATE_TEST_SUITE_P(Cards, VerifyStepRanks,
                         ::testing::Values(Case{"Qwen3-30B-A3B", "baseline"}, Case{"Qwen3-30B-A3B", "flatpeak"},
                                           Case{"OLMoE-1B-7B", "baseline"}, Case{"OLMoE-1B-7B", "flatpeak"},
                                           Case{"gpt-oss-120b", "baseline"}, Case{"Qwen3-30B-A3B", "baseline", 4},
                                           Case{"gpt-oss-120b", "flatpeak", 4}, Case{"OLMoE-1B-7B", "baseline", 2}),
                         [](const ::testing::TestParamInfo<Case>& param) {
                           std::string name = param.param.model + "_" + param.param.schedule + "_ep" + std::to_string(param.param.ep);
                           for (char& ch : name)
                             if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           return name;
                         });

TEST(VerifyStepRanksTerms, OnePredictedTermRaisedTwoPercentFails) {
  const VerifyInputs in = read_plan_inputs(plan_json("OLMoE-1B-7B", {{"--ep", "1"}, {"--schedule", "baseline"}}), "plan.json");
  for (const char* column : {"fsdp", "grads", "params"}) {
    const PredictionAdjust raise = [column](nlohmann::ordered_json& timeline) {
      for (auto& phase : timeline["phases"])
        if (phase["name"] == "bwd/L1/attn") phase["device"][column] = static_cast<int64_t>(phase["device"][column].get<double>() * 1.02);
    };
    EXPECT_FALSE(verify_step_of(in, raise).pass) << column;
  }
}

TEST(VerifyStepRanksTerms, DispatchTermRaisedTwoPercentFailsAtEpFour) {
  const VerifyInputs in = read_plan_inputs(plan_json("OLMoE-1B-7B", {{"--ep", "4"}, {"--schedule", "baseline"}}), "plan.json");
  const PredictionAdjust raise = [](nlohmann::ordered_json& timeline) {
    for (auto& phase : timeline["phases"])
      if (phase["name"] == "bwd/L1/moe/experts") phase["device"]["dispatch"] = static_cast<int64_t>(phase["device"]["dispatch"].get<double>() * 1.02);
  };
  EXPECT_TRUE(verify_step_of(in).pass);
  EXPECT_FALSE(verify_step_of(in, raise).pass);
}

TEST(VerifyStepRanksTerms, DenseLayersBesideExpertParallelMoe) {
  const VerifyInputs in = read_plan_inputs(plan_json("GLM-4.5", {{"--ep", "4"}, {"--schedule", "baseline"}}), "plan.json");
  const VerifyReport r = verify_step_of(in);
  EXPECT_TRUE(r.pass);
  EXPECT_TRUE(has_note(r, "step: 4 ranks, FSDP with EP = 4"));
  int64_t ffn_rows = 0;
  for (const auto& row : r.rows) {
    EXPECT_LE(std::fabs(row.relative_error), 0.01) << row.component << " " << row.phase;
    if (row.phase.find("/ffn") == std::string::npos) continue;
    ++ffn_rows;
    EXPECT_EQ(row.measured_bytes, row.predicted_bytes) << row.component << " " << row.phase;
  }
  EXPECT_GT(ffn_rows, 0);
  EXPECT_EQ(r.max_abs_dloss, 0.0);
}

// Mixtral at EP = 8 on 8 GPUs, verified on 4 ranks (EP = 4 of E = 4): one expert a rank, fewer
// than top_k = 2. The layer component (one rank's experts) refuses it; the step's EP ranks route
// each token over all 4 experts, and every row is exact.
TEST(VerifyStepRanksTerms, OneExpertARankBelowTopK) {
  InputErrors errs;
  const planner::RunSpec spec = planner::parse_run_flags(
      {{"--gpus", "8"}, {"--ep", "8"}, {"--context", "16K"}, {"--schedule", "baseline"}}, errs);
  errs.throw_if_any();
  const nlohmann::json plan =
      nlohmann::json::parse(planner::plan_to_json(planner::make_plan(load_model("Mixtral-8x7B"), load_hardware("H200"), spec)).dump());
  const VerifyInputs in = read_plan_inputs(plan, "plan.json");
  const ScaledConfig scaled = scale_config(in, 128.0, 4);
  ASSERT_EQ(scaled.ep, 4);
  ASSERT_EQ(scaled.num_experts / scaled.ep, 1);
  const VerifyReport r = run_verification(in, scaled, {"step"}, 0.01);
  EXPECT_TRUE(r.pass);
  EXPECT_TRUE(has_note(r, "step: 4 ranks, FSDP with EP = 4"));
  EXPECT_FALSE(r.rows.empty());
  for (const auto& row : r.rows) EXPECT_EQ(row.measured_bytes, row.predicted_bytes) << row.component << " " << row.phase;
  EXPECT_THROW(run_verification(in, scaled, {"layer"}, 0.01), UnsupportedPlan);
}

// CP = 2 on 4 ranks: two rings of 2 (each rank T tokens of its ring's sequence). Every row exact;
// at EP = 1 with the materialised loss the loss, grads and params bitwise the reference (whose
// naive steps run their rings too); at EP = 4 the grads within the experts' rounding.
TEST(VerifyStepRanksTerms, RingAttentionInCpPairs) {
  for (const char* ep : {"1", "4"}) {
    const VerifyInputs in =
        read_plan_inputs(plan_json("Qwen3-30B-A3B", {{"--ep", ep}, {"--cp", "2"}, {"--schedule", "baseline"}}), "plan.json");
    const VerifyReport r = verify_step_of(in);
    EXPECT_TRUE(r.pass) << ep;
    EXPECT_TRUE(has_note(r, "ring attention in CP groups of 2 ranks (the plan's CP = 2)")) << ep;
    EXPECT_GT(r.rows.size(), 200u) << ep;
    for (const auto& row : r.rows) EXPECT_EQ(row.measured_bytes, row.predicted_bytes) << ep << " " << row.component << " " << row.phase;
    EXPECT_EQ(r.max_abs_dloss, 0.0) << ep;
    if (std::string(ep) == "1") EXPECT_EQ(r.max_abs_dgrad, 0.0);
    else EXPECT_LT(r.max_abs_dgrad, 1e-4);
  }
  // gpt-oss-20b at --scale 64 (T = 128, its 128-token window: the halo is the previous rank's whole
  // chunk): sliding-window layers with their halo beside full layers with the ring, every row exact.
  {
    const VerifyInputs gpt_oss = read_plan_inputs(plan_json("gpt-oss-20b", {{"--cp", "2"}, {"--schedule", "baseline"}}), "plan.json");
    const VerifyReport r = run_verification(gpt_oss, scale_config(gpt_oss, 64.0, 8), {"step"}, 0.01);
    EXPECT_TRUE(r.pass);
    EXPECT_TRUE(has_note(r, "ring attention in CP groups of 2 ranks"));
    EXPECT_GT(r.rows.size(), 200u);
    for (const auto& row : r.rows) EXPECT_EQ(row.measured_bytes, row.predicted_bytes) << "gpt-oss " << row.component << " " << row.phase;
  }
  // The forward ring buffers (two K,V chunks, the fp32 output and lse accumulators) out of the
  // predicted fwd/L3/attn: that row fails.
  const VerifyInputs in = read_plan_inputs(plan_json("Qwen3-30B-A3B", {{"--ep", "1"}, {"--cp", "2"}, {"--schedule", "baseline"}}), "plan.json");
  const ScaledConfig s = scale_config(in, 128.0, 8);
  const int64_t kv = 2 * s.tokens * s.kv_heads * s.head_dim * 2;  // [2, T, g·d] bf16
  const int64_t ring = 2 * ((kv + 511) / 512 * 512) + (s.tokens * s.q_heads * s.head_dim * 4 + 511) / 512 * 512 +
                       (s.q_heads * s.tokens * 4 + 511) / 512 * 512;
  const PredictionAdjust drop = [ring](nlohmann::ordered_json& timeline) {
    for (auto& phase : timeline["phases"])
      if (phase["name"] == "fwd/L3/attn") phase["device"]["activations"] = phase["device"]["activations"].get<int64_t>() - ring;
  };
  const VerifyReport r = run_verification(in, s, {"step"}, 0.01, drop);
  EXPECT_FALSE(r.pass);
  bool failed = false;
  for (const auto& row : r.rows)
    if (row.phase == "fwd/L3/attn" && row.component == "step.activations") failed = std::fabs(row.relative_error) > 0.01;
  EXPECT_TRUE(failed);
}

}  // namespace
}  // namespace flatpeak::cli
