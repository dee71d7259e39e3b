// A calibrated hardware card's overhead reaches the plan and verify: overhead_calibrated and its
// parts in /inputs/run, read back by verify (the cuda backend's device view leaves NCCL's part
// out, since a one-GPU run creates no communicator); --overhead replaces them (not calibrated).
//   ctest -R VerifyCalibratedOverhead
#include <gtest/gtest.h>

#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include <unistd.h>

#include "plan.h"
#include "run_spec.h"
#include "spec/errors.h"
#include "spec/hardware_loader.h"
#include "spec/model_loader.h"
#include "verify_config.h"

namespace flatpeak::cli {
namespace {

// The H200 card as flatpeak_calibrate would leave it (figures made up for the test).
HardwareSpec calibrated_h200() {
  nlohmann::json card = nlohmann::json::parse(R"({
    "name": "H200", "aliases": [], "device_memory_bytes": 150754820096, "hbm_bandwidth_bytes_per_s": 4.8e12,
    "bf16_dense_flops": 989.4e12, "scale_up_bandwidth_bytes_per_s": 450e9, "host_link_bandwidth_bytes_per_s": 64e9,
    "inter_node_bandwidth_bytes_per_s": 50e9, "gpus_per_node": 8, "host_memory_bytes_per_node": 2048000000000,
    "host_memory_bandwidth_bytes_per_s": 5e11, "cpu_cores_per_node": 96, "runtime_overhead_bytes": 700000000,
    "fragmentation_fraction": 0.05, "allocation_alignment_bytes": 512, "overhead_calibrated": true,
    "runtime_overhead_terms": {"cuda_context_bytes": 520000000, "cublas_bytes": 80000000,
                               "cublas_workspace_bytes": 33554432, "nccl_bytes": 66445568} })");
  // Written to a file and loaded from it, as flatpeak_calibrate leaves it: verify reads the card
  // again from the plan's /inputs/hardware/source.
  // One file a process: ctest runs this file's tests as separate processes at once (and two build
  // trees may share the folder), and a shared name let one test read the card while another was
  // rewriting it.
  const std::string path = ::testing::TempDir() + "H200.calibrated." + std::to_string(::getpid()) + ".json";
  std::ofstream(path) << card.dump(2);
  return load_hardware(path);
}

nlohmann::json plan_json(const HardwareSpec& hw, std::vector<std::pair<std::string, std::string>> extra = {}) {
  std::vector<std::pair<std::string, std::string>> flags{{"--gpus", "8"}, {"--context", "64K"}, {"--schedule", "flatpeak"}};
  flags.insert(flags.end(), extra.begin(), extra.end());
  InputErrors errs;
  const planner::RunSpec spec = planner::parse_run_flags(flags, errs);
  errs.throw_if_any();
  return nlohmann::json::parse(planner::plan_to_json(planner::make_plan(load_model("gpt-oss-120b"), hw, spec)).dump());
}

TEST(VerifyCalibratedOverhead, TermsReachThePlanAndVerify) {
  const nlohmann::json plan = plan_json(calibrated_h200());
  const nlohmann::json& run = plan["inputs"]["run"];
  EXPECT_EQ(run["overhead_bytes"], 700000000);
  EXPECT_EQ(run["overhead_calibrated"], true);
  EXPECT_EQ(run["overhead_terms"]["nccl_bytes"], 66445568);
  EXPECT_EQ(run["overhead_terms"]["cuda_context_bytes"], 520000000);
  const VerifyInputs in = read_plan_inputs(plan, "plan.json");
  EXPECT_EQ(in.overhead_bytes, 700000000);
  EXPECT_TRUE(in.overhead_calibrated);
  EXPECT_EQ(in.overhead_nccl_bytes, 66445568);
}

TEST(VerifyCalibratedOverhead, OverrideIsNotCalibrated) {
  const nlohmann::json plan = plan_json(calibrated_h200(), {{"--overhead", "2GiB"}});
  const nlohmann::json& run = plan["inputs"]["run"];
  EXPECT_EQ(run["overhead_bytes"], int64_t{2} << 30);
  EXPECT_EQ(run["overhead_calibrated"], false);
  EXPECT_FALSE(run.contains("overhead_terms"));
  const VerifyInputs in = read_plan_inputs(plan, "plan.json");
  EXPECT_FALSE(in.overhead_calibrated);
  EXPECT_EQ(in.overhead_nccl_bytes, 0);
}

TEST(VerifyCalibratedOverhead, ShippedCardIsNotCalibrated) {
  const nlohmann::json plan = plan_json(load_hardware("H200"));
  EXPECT_EQ(plan["inputs"]["run"]["overhead_calibrated"], false);
  EXPECT_FALSE(plan["inputs"]["run"].contains("overhead_terms"));
}

}  // namespace
}  // namespace flatpeak::cli
