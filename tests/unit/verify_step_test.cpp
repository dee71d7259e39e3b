// verify --component step: for model shapes scaled from real cards (gpt-oss-120b, Qwen3-30B-A3B,
// OLMoE-1B-7B, and Phi-3.5-MoE's LayerNorm and LM head bias), baseline, practice and flatpeak plans
// (SCO offloading half the layers, prefetch 1),
// every column of every phase, on the device and the host, and every peak, measured within 1 %
// of the planner's prediction of the same scaled step, and every row exact; loss and
// gradients bitwise the naive step's with the materialised loss, within the stated bound with the
// blocked one; one predicted term raised by 2 % fails; GLM-4.5's dense layers run (every baseline
// row exact); MTP modules run (every row exact); MLA runs. Also how
// rows are judged where one allocation unit is more than the tolerance (a --scale too fine).
// Plans at 8 × H200 and 16K context, verified at --scale 64 on one rank (T = 256, H = 32-45).
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
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
#include "verify_config.h"
#include "verify_run.h"

namespace flatpeak::cli {
namespace {

using Flags = std::vector<std::pair<std::string, std::string>>;

nlohmann::json plan_json(const std::string& model_name, Flags flags) {
  flags.insert(flags.begin(), {{"--gpus", "8"}, {"--context", "16K"}});
  InputErrors errs;
  const planner::RunSpec spec = planner::parse_run_flags(flags, errs);
  errs.throw_if_any();
  return nlohmann::json::parse(planner::plan_to_json(planner::make_plan(load_model(model_name), load_hardware("H200"), spec)).dump());
}

VerifyReport verify_step_of(const VerifyInputs& in, const PredictionAdjust& adjust = nullptr) {
  return run_verification(in, scale_config(in, 64.0, 1), {"step"}, 0.01, adjust);
}

struct Case {
  std::string model;
  std::string schedule;
  std::string sco_layers;  // flatpeak: half the layers, first ones
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.model << " " << c.schedule; }

class VerifyStepShapes : public ::testing::TestWithParam<Case> {};

TEST_P(VerifyStepShapes, EveryColumnOfEveryPhaseWithinOnePercent) {
  const Case& c = GetParam();
  Flags flags{{"--schedule", c.schedule}};
  if (!c.sco_layers.empty()) flags.insert(flags.end(), {{"--sco-layers", c.sco_layers}, {"--sco-prefetch", "1"}});
  const VerifyInputs in = read_plan_inputs(plan_json(c.model, flags), "plan.json");
  const VerifyReport r = verify_step_of(in);
  const std::string what = c.model + " " + c.schedule;
  EXPECT_TRUE(r.pass) << what;
  std::set<std::string> peaks, phases;
  int64_t host_boundaries = 0, device_total = 0;
  for (const auto& row : r.rows) {
    EXPECT_LE(std::fabs(row.relative_error), 0.01) << what << " " << row.component << " " << row.space << " " << row.phase;
    // Every row exact, the loss's included (W and dW: the gathered head unit).
    EXPECT_EQ(row.measured_bytes, row.predicted_bytes) << what << " " << row.component << " " << row.phase;
    if (row.phase == "peak") peaks.insert(row.component + "/" + row.space);
    else phases.insert(row.phase);
    if (row.phase == "peak" && row.component == "step.boundaries" && row.space == "host") host_boundaries = row.measured_bytes;
    if (row.phase == "peak" && row.component == "step.total" && row.space == "device") device_total = row.measured_bytes;
  }
  // Nine device columns (eight categories and the total), three host ones.
  EXPECT_EQ(peaks.size(), 12u) << what;
  // Every phase of the step: embedding, two layer instances, the loss, the optimizer.
  for (const char* p : {"fwd/embed", "fwd/L3/attn", "fwd/L3/moe/combine", "bwd/L3/recompute/attn", "bwd/L3/moe/experts",
                        "bwd/L0/attn", "bwd/embed"})
    EXPECT_TRUE(phases.count(p)) << what << " " << p;
  EXPECT_GT(device_total, 1000000) << what;  // a real step ran
  if (c.schedule == "baseline") {
    EXPECT_EQ(host_boundaries, 0);
  } else {
    EXPECT_GT(host_boundaries, 0) << what;  // practice: every boundary; flatpeak: SCO's half
  }
  if (c.schedule == "baseline") {
    EXPECT_EQ(r.max_abs_dloss, 0.0) << what;
    EXPECT_EQ(r.max_abs_dgrad, 0.0) << what;
  } else {
    // Blocked loss (online log-sum-exp) against the materialised one: the loss within twice the
    // bf16 rounding of the largest logit (|z| ≤ 1.1·√H, H ≤ 45), gradients close.
    EXPECT_LE(r.max_abs_dloss, 2.0 * 1.1 * std::sqrt(45.0) * std::ldexp(1.0, -9)) << what;
    EXPECT_GT(r.max_abs_dgrad, 0.0) << what;
    EXPECT_LE(r.max_abs_dgrad, 1e-3) << what;
  }
}

INSTANTIATE_TEST_SUITE_P(Cards, VerifyStepShapes,
                         ::testing::Values(Case{"gpt-oss-120b", "baseline", ""}, Case{"gpt-oss-120b", "flatpeak", "18"},
                                           Case{"Qwen3-30B-A3B", "baseline", ""}, Case{"Qwen3-30B-A3B", "flatpeak", "24"},
                                           Case{"Qwen3-30B-A3B", "practice", ""}, Case{"OLMoE-1B-7B", "baseline", ""},
                                           Case{"OLMoE-1B-7B", "flatpeak", "8"},
                                           // LayerNorm norms (the final one too) and an LM head bias
                                           Case{FLATPEAK_TEST_DATA_DIR "/hf/Phi-3.5-MoE-instruct/config.json", "baseline", ""},
                                           Case{FLATPEAK_TEST_DATA_DIR "/hf/Phi-3.5-MoE-instruct/config.json", "flatpeak", "16"}),
                         [](const ::testing::TestParamInfo<Case>& param) {
                           const std::string& model = param.param.model;
                           const bool path = model.find('/') != std::string::npos;
                           std::string name = (path ? std::string("Phi_3_5_MoE") : model) + "_" + param.param.schedule;
                           for (char& ch : name)
                             if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           return name;
                         });

// The loss reads W from the gathered head unit: the final norm before W, a head bias after it
// (Phi-3.5-MoE: LayerNorm [2H] and [V]), or, with a tied head (ERNIE-4.5-21B-A3B), the embedding
// table with the head unit gathered beside it. The vocab component holds W the same way, so every
// row is exact, for every loss schedule (the tied head was 1-2 units over when the component held
// W alone).
TEST(VerifyVocab, EveryRowExactForTiedHeadsAndHeadBiases) {
  for (const char* model : {FLATPEAK_TEST_DATA_DIR "/hf/ERNIE-4.5-21B-A3B/config.json",
                            FLATPEAK_TEST_DATA_DIR "/hf/Phi-3.5-MoE-instruct/config.json"}) {
    for (const char* schedule : {"baseline", "practice", "flatpeak"}) {
      const VerifyInputs in = read_plan_inputs(plan_json(model, {{"--schedule", schedule}}), "plan.json");
      const VerifyReport r = run_verification(in, scale_config(in, 64.0, 1), {"vocab"}, 0.01);
      EXPECT_TRUE(r.pass) << model << " " << schedule;
      EXPECT_GE(r.rows.size(), 3u) << model << " " << schedule;
      for (const auto& row : r.rows)
        EXPECT_EQ(row.measured_bytes, row.predicted_bytes) << model << " " << schedule << " " << row.phase;
    }
  }
}

TEST(VerifyStep, OnePredictedTermRaisedTwoPercentFails) {
  const VerifyInputs in = read_plan_inputs(plan_json("OLMoE-1B-7B", {{"--schedule", "baseline"}}), "plan.json");
  EXPECT_TRUE(verify_step_of(in).pass);
  for (const char* column : {"fsdp", "grads"}) {
    const PredictionAdjust raise = [column](nlohmann::ordered_json& timeline) {
      for (auto& phase : timeline["phases"])
        if (phase["name"] == "bwd/L0/attn") phase["device"][column] = static_cast<int64_t>(phase["device"][column].get<double>() * 1.02);
    };
    EXPECT_FALSE(verify_step_of(in, raise).pass) << column;
  }
}

VerifyRow row_of(int64_t predicted, int64_t measured) {
  VerifyRow row{"vocab", "device", "peak", predicted, measured, 0.0};
  row.relative_error = static_cast<double>(measured - predicted) / static_cast<double>(predicted);
  return row;
}

TEST(VerifyJudging, SetsAsideOnlyOneUnitMissesUnderOneHundredUnits) {
  VerifyReport report;
  report.rows = {row_of(43008, 42496),        // 84 units, one unit short: set aside
                 row_of(43008, 43008),        // exact: judged, passes
                 row_of(43008, 43520),        // one unit over: set aside
                 row_of(43008, 42496 - 512),  // two units short: still fails
                 row_of(102400, 101888)};     // 200 units: judged (and within 1 %)
  VerifyRow bound = row_of(4096, 4608);
  bound.phase = "bound";  // an upper bound stays judged as one
  report.rows.push_back(bound);
  set_aside_unresolved_rows(report, 0.01, 512, 1000.0);
  const std::vector<bool> aside = {true, false, true, false, false, false};
  for (size_t i = 0; i < aside.size(); ++i) {
    EXPECT_EQ(report.rows[i].below_resolution, aside[i]) << i;
    EXPECT_EQ(report.rows[i].judged, !aside[i]) << i;
  }
  EXPECT_EQ(report.unresolved_rows, 2);
  // The smallest row set aside (84 units) holds 100 at 1000 * 43008 / 51200.
  EXPECT_EQ(report.resolving_scale, 840.0);
  EXPECT_NE(report.unresolved_note.find("--scale 840 or smaller"), std::string::npos) << report.unresolved_note;
  EXPECT_FALSE(row_passes(report.rows[3], 0.01));
  EXPECT_FALSE(row_passes(report.rows[5], 0.01));

  // A tolerance asking for exactness still fails a one-unit miss at 100 units and more.
  VerifyReport strict;
  strict.rows = {row_of(102400, 101888), row_of(43008, 42496)};
  set_aside_unresolved_rows(strict, 1e-9, 512, 1000.0);
  EXPECT_FALSE(strict.rows[0].below_resolution);
  EXPECT_TRUE(strict.rows[1].below_resolution);

  VerifyReport tiny;  // at factor 1 no --scale brings 2 units to 100
  tiny.rows = {row_of(1024, 512)};
  set_aside_unresolved_rows(tiny, 0.01, 512, 1.0);
  EXPECT_EQ(tiny.unresolved_rows, 1);
  EXPECT_NE(tiny.unresolved_note.find("a larger --tolerance"), std::string::npos) << tiny.unresolved_note;
}

// Qwen3-30B-A3B's vocab component at --scale 1000 (T = 33, H = 8, V = 152), its backward's
// prediction lowered by one allocation unit (the planner is exact there now; a one-unit miss is
// what an alignment the planner does not know of gives): unresolved, not failed; at the scale the
// note names it is judged and passes.
TEST(VerifyJudging, TooFineAScaleIsUnresolvedAndTheNamedScaleJudges) {
  const PredictionAdjust one_unit_low = [](nlohmann::ordered_json& timeline) {
    for (auto& phase : timeline["phases"])
      if (phase["name"] == "loss/bwd/blk0") phase["device"]["vocab"] = phase["device"]["vocab"].get<int64_t>() - 512;
  };
  InputErrors errs;
  const planner::RunSpec spec = planner::parse_run_flags({{"--gpus", "8"}, {"--context", "32K"}, {"--schedule", "flatpeak"}}, errs);
  errs.throw_if_any();
  const nlohmann::json plan =
      nlohmann::json::parse(planner::plan_to_json(planner::make_plan(load_model("Qwen3-30B-A3B"), load_hardware("H200"), spec)).dump());
  const VerifyInputs in = read_plan_inputs(plan, "plan.json");
  const VerifyReport exact = run_verification(in, scale_config(in, 1000.0, 1), {"vocab"}, 0.01);
  EXPECT_EQ(exact.unresolved_rows, 0);
  EXPECT_TRUE(exact.pass);
  const VerifyReport fine = run_verification(in, scale_config(in, 1000.0, 1), {"vocab"}, 0.01, one_unit_low);
  ASSERT_GT(fine.unresolved_rows, 0);
  EXPECT_TRUE(fine.pass);
  ASSERT_GE(fine.resolving_scale, 1.0);
  const VerifyReport named = run_verification(in, scale_config(in, fine.resolving_scale, 1), {"vocab"}, 0.01, one_unit_low);
  EXPECT_EQ(named.unresolved_rows, 0);
  EXPECT_TRUE(named.pass);
}

// MTP modules run (GLM-4.5's and DeepSeek-V3's, trained by default): every row exact, the
// modules' and their losses' phases among them (fwd/MTP0/..., loss/mtp0/..., bwd/MTP0/...); with
// the materialised loss the loss and grads are bitwise the naive step's. DeepSeek-V3 on its
// flatpeak plan too: blocked loss with gradients in forward, SCO, the stream optimizer.
TEST(VerifyStep, MtpRuns) {
  struct MtpCase {
    std::string model;
    Flags flags;
  };
  const MtpCase cases[] = {{"GLM-4.5", {{"--schedule", "baseline"}}},
                           {"DeepSeek-V3", {{"--schedule", "baseline"}}},
                           {"DeepSeek-V3", {{"--schedule", "flatpeak"}, {"--vocab-backward", "in-forward"}}}};
  for (const MtpCase& c : cases) {
    const VerifyInputs in = read_plan_inputs(plan_json(c.model, c.flags), "plan.json");
    ASSERT_TRUE(in.mtp) << c.model;
    const VerifyReport r = verify_step_of(in);
    const std::string what = c.model + " " + c.flags.front().second;
    EXPECT_TRUE(r.pass) << what;
    std::set<std::string> mtp_phases;
    for (const auto& row : r.rows) {
      EXPECT_EQ(row.measured_bytes, row.predicted_bytes) << what << " " << row.component << " " << row.phase;
      if (row.phase.find("MTP0") != std::string::npos || row.phase.rfind("loss/mtp0", 0) == 0) mtp_phases.insert(row.phase);
    }
    for (const char* p : {"fwd/MTP0/attn", "fwd/MTP0/moe/experts", "bwd/MTP0/recompute/attn", "bwd/MTP0/attn"})
      EXPECT_TRUE(mtp_phases.count(p)) << what << " " << p;
    EXPECT_TRUE(std::any_of(mtp_phases.begin(), mtp_phases.end(), [](const std::string& p) { return p.rfind("loss/mtp0/bwd", 0) == 0; }))
        << what;
    if (c.flags.front().second == "baseline") {
      EXPECT_EQ(r.max_abs_dloss, 0.0) << what;
      EXPECT_EQ(r.max_abs_dgrad, 0.0) << what;
    }
  }
}

// `model`'s baseline plan without MTP on one rank: every row within 0.05 % (the materialised
// loss's alignment at this V, as for the other cards), the rows of phases containing `exact_part`
// exact (at least one), loss and grads bitwise the naive step.
void expect_baseline_step_without_mtp(const std::string& model, const std::string& exact_part) {
  const VerifyInputs in = read_plan_inputs(plan_json(model, {{"--mtp", "off"}, {"--schedule", "baseline"}}), "plan.json");
  const VerifyReport r = verify_step_of(in);
  EXPECT_TRUE(r.pass);
  int64_t exact_rows = 0;
  for (const auto& row : r.rows) {
    EXPECT_LE(std::fabs(row.relative_error), 0.0005) << row.component << " " << row.phase;
    if (row.phase.find(exact_part) == std::string::npos) continue;
    ++exact_rows;
    EXPECT_EQ(row.measured_bytes, row.predicted_bytes) << row.component << " " << row.phase;
  }
  EXPECT_GT(exact_rows, 0);
  EXPECT_EQ(r.max_abs_dloss, 0.0);
  EXPECT_EQ(r.max_abs_dgrad, 0.0);
}

// DeepSeek-V3 without MTP: MLA in its dense first layers and its MoE layers; the attention rows
// exact.
TEST(VerifyStep, MlaRuns) { expect_baseline_step_without_mtp("DeepSeek-V3", "/attn"); }

// GLM-4.5 without MTP: its dense first layers (scaled: L0-L2, SwiGLU FFN of the dense width) run
// beside the MoE layer with its shared expert; the dense layers' ffn rows exact.
TEST(VerifyStep, DenseLayersRun) { expect_baseline_step_without_mtp("GLM-4.5", "/ffn"); }

}  // namespace
}  // namespace flatpeak::cli
