// verify --component optimizer: for three model shapes scaled from real cards (gpt-oss-120b,
// Qwen3-30B-A3B, GLM-4.5 with its dense layers and MTP module), the baseline (optimizer on the
// device), serial offload and flatpeak (OffloadStreamAdamW) plans measure device and host peaks
// within 1 % of the planner's prediction; the stream's device peak is the bf16 param and grad
// shards only; a prediction raised by 2 % fails; bad knobs are input errors naming the knob.
#include <gtest/gtest.h>

#include <cctype>
#include <cmath>
#include <optional>
#include <string>
#include <utility>
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

// A plan as `flatpeak plan --format json` writes it, at 8 × H200 and 64K context.
nlohmann::json make_plan_json(const std::string& model_name, Flags flags) {
  const ModelSpec model = load_model(model_name);
  const HardwareSpec hardware = load_hardware("H200");
  flags.insert(flags.begin(), {{"--gpus", "8"}, {"--context", "64K"}});
  InputErrors errs;
  const planner::RunSpec spec = planner::parse_run_flags(flags, errs);
  errs.throw_if_any();
  return nlohmann::json::parse(planner::plan_to_json(planner::make_plan(model, hardware, spec)).dump());
}

// --scale auto on one rank: T ≤ 512, H ≤ 64, L ≤ 4, E/EP experts, F and the GQA heads scaled
// with H (scale_config); a step is a few million parameters.
ScaledConfig small_scale(const VerifyInputs& in) { return scale_config(in, std::nullopt); }

const VerifyRow& peak_row(const VerifyReport& r, const std::string& space) {
  for (const auto& row : r.rows)
    if (row.component == "optimizer" && row.space == space && row.phase == "peak") return row;
  throw std::logic_error("no optimizer peak row for " + space);
}

struct Case {
  std::string model;
  std::string placement;  // gpu | serial | stream
};

class VerifyOptimizerShapes : public ::testing::TestWithParam<Case> {};

TEST_P(VerifyOptimizerShapes, MeasuredPeaksWithinOnePercentOfThePrediction) {
  const Case& c = GetParam();
  Flags flags;
  if (c.placement == "gpu") flags = {{"--schedule", "baseline"}};
  if (c.placement == "serial") flags = {{"--schedule", "baseline"}, {"--optimizer", "serial"}};
  if (c.placement == "stream") flags = {{"--schedule", "flatpeak"}};
  const VerifyInputs in = read_plan_inputs(make_plan_json(c.model, flags), "plan.json");
  ASSERT_EQ(in.knob_values.value("optimizer", std::string()), c.placement);
  const ScaledConfig s = small_scale(in);
  const VerifyReport r = run_verification(in, s, {"optimizer"}, 0.01);
  const VerifyRow& device = peak_row(r, "device");
  const VerifyRow& host = peak_row(r, "host");
  EXPECT_TRUE(r.pass);
  EXPECT_GT(device.measured_bytes, 1000000);  // millions of parameters really ran
  EXPECT_LE(std::abs(device.relative_error), 0.01) << device.predicted_bytes << " vs " << device.measured_bytes;
  EXPECT_LE(std::abs(host.relative_error), 0.01) << host.predicted_bytes << " vs " << host.measured_bytes;
  if (c.placement == "gpu") {
    EXPECT_EQ(host.measured_bytes, 0);
  } else {
    // Host: fp32 master, m, v and grad staging (16 bytes a parameter) plus the bf16 transfer
    // staging; device: bf16 param and grad shards (4 bytes a parameter).
    EXPECT_GT(host.measured_bytes, 4 * device.measured_bytes - 1);
  }
  // Phases as the planner names them.
  std::vector<std::string> device_phases;
  for (const auto& row : r.rows)
    if (row.space == "device" && row.phase != "peak") device_phases.push_back(row.phase);
  std::vector<std::string> want_phases{"opt/bucket0"};
  if (c.placement == "gpu") want_phases = {"opt/step"};
  if (c.placement == "serial") want_phases = {"opt/d2h", "opt/cpu_step", "opt/h2d"};
  EXPECT_EQ(device_phases, want_phases);
}

INSTANTIATE_TEST_SUITE_P(RealCards, VerifyOptimizerShapes,
                         ::testing::Values(Case{"gpt-oss-120b", "gpu"}, Case{"gpt-oss-120b", "serial"},
                                           Case{"gpt-oss-120b", "stream"}, Case{"Qwen3-30B-A3B", "gpu"},
                                           Case{"Qwen3-30B-A3B", "serial"}, Case{"Qwen3-30B-A3B", "stream"},
                                           Case{"GLM-4.5", "gpu"}, Case{"GLM-4.5", "serial"}, Case{"GLM-4.5", "stream"}),
                         [](const ::testing::TestParamInfo<Case>& param_info) {
                           std::string name = param_info.param.model + "_" + param_info.param.placement;
                           for (char& ch : name)
                             if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           return name;
                         });

// The same scaled parameters: the stream keeps 4 bytes a parameter on the device, the on-device
// optimizer 16 (fp32 master, grad, m, v).
TEST(VerifyOptimizer, StreamDevicePeakIsAQuarterOfTheOnDeviceOne) {
  const VerifyInputs gpu = read_plan_inputs(make_plan_json("Qwen3-30B-A3B", {{"--schedule", "baseline"}}), "plan.json");
  const VerifyInputs stream = read_plan_inputs(make_plan_json("Qwen3-30B-A3B", {{"--schedule", "flatpeak"}}), "plan.json");
  const int64_t gpu_peak = peak_row(run_verification(gpu, small_scale(gpu), {"optimizer"}, 0.01), "device").measured_bytes;
  const int64_t stream_peak = peak_row(run_verification(stream, small_scale(stream), {"optimizer"}, 0.01), "device").measured_bytes;
  EXPECT_NEAR(static_cast<double>(stream_peak) / static_cast<double>(gpu_peak), 0.25, 0.001);
}

TEST(VerifyOptimizer, APredictionRaisedByTwoPercentFails) {
  const VerifyInputs in = read_plan_inputs(make_plan_json("Qwen3-30B-A3B", {{"--schedule", "flatpeak"}}), "plan.json");
  const auto raise_host_optimizer = [](nlohmann::ordered_json& timeline) {
    for (auto& phase : timeline["phases"]) {
      auto& bytes = phase["host"]["optimizer"];
      bytes = bytes.get<int64_t>() + bytes.get<int64_t>() / 50;
    }
  };
  const VerifyReport r = run_verification(in, small_scale(in), {"optimizer"}, 0.01, raise_host_optimizer);
  EXPECT_FALSE(r.pass);
  EXPECT_NEAR(peak_row(r, "host").relative_error, -0.0196, 0.0005);
}

// The stream's bucket is scaled with the rank's parameter count, so the number of buckets is kept.
TEST(VerifyOptimizer, ScaledBucketKeepsTheNumberOfBuckets) {
  const nlohmann::json plan = make_plan_json("Qwen3-30B-A3B", {{"--schedule", "flatpeak"}});
  const VerifyInputs in = read_plan_inputs(plan, "plan.json");
  const ScaledConfig s = scale_config(in, std::nullopt);
  int64_t plan_params = 0, params = 0;
  for (const auto& v : s.values)
    if (v.name == "P (params per rank)") plan_params = v.original, params = v.scaled;
  ASSERT_GT(params, 0);
  const int64_t plan_bucket = in.knob_values["bucket_params"].get<int64_t>();
  const int64_t plan_buckets = (plan_params + plan_bucket - 1) / plan_bucket;
  EXPECT_GT(plan_buckets, 10);
  EXPECT_EQ((params + s.bucket_params - 1) / s.bucket_params, plan_buckets);
  EXPECT_EQ(s.bucket_depth, in.knob_values["bucket_depth"].get<int64_t>());
  // The plan's own timeline folds the same number of buckets (read here only to check the count).
  for (const auto& phase : plan["timeline"]["phases"])
    if (phase["name"] == "opt/bucket0") {
      EXPECT_EQ(phase["folds"], "bucket0-bucket" + std::to_string(plan_buckets - 1));
    }
}

// Every bad knob in one pass, each naming /knobs/<name>/value, the rule and the value.
TEST(VerifyOptimizer, BadKnobsAreInputErrors) {
  nlohmann::json plan = make_plan_json("Qwen3-30B-A3B", {{"--schedule", "flatpeak"}});
  plan["knobs"]["bucket_params"]["value"] = 0;
  plan["knobs"]["bucket_depth"]["value"] = 9;
  VerifyInputs in = read_plan_inputs(plan, "plan.json");
  try {
    scale_config(in, std::nullopt);
    FAIL() << "bucket_params 0 and bucket_depth 9 must be refused";
  } catch (const InputError& e) {
    ASSERT_EQ(e.diagnostics().size(), 2u);
    EXPECT_EQ(e.diagnostics()[0].to_string(), "plan.json: /knobs/bucket_params/value: must be an integer >= 1 (got 0)");
    EXPECT_EQ(e.diagnostics()[1].to_string(), "plan.json: /knobs/bucket_depth/value: must be an integer in 1..8 (got 9)");
  }
  plan["knobs"]["optimizer"]["value"] = "cpu";
  in = read_plan_inputs(plan, "plan.json");
  try {
    scale_config(in, std::nullopt);
    FAIL() << "optimizer 'cpu' must be refused";
  } catch (const InputError& e) {
    ASSERT_EQ(e.diagnostics().size(), 1u);
    EXPECT_EQ(e.diagnostics()[0].to_string(), "plan.json: /knobs/optimizer/value: must be gpu, serial or stream (got \"cpu\")");
  }
}

}  // namespace
}  // namespace flatpeak::cli
