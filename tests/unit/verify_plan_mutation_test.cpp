// verify never crashes on an edited plan: every field of a plan's inputs (model, hardware, run)
// and every knob value, replaced in turn by values of the wrong kind or at the edges of the 64-bit
// range, is read and scaled (at the default scale on up to 8 ranks, and at --scale 1000 on one) or
// is an InputError. Another exception (std::bad_alloc for a buffer sized from an edited number, an
// out_of_range from the JSON library, a division by zero under UBSan) fails. What a plan edited
// this way that still reads does when it runs is the other verify tests' concern.
#include <gtest/gtest.h>

#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "knob_search.h"
#include "plan.h"
#include "run_spec.h"
#include "spec/errors.h"
#include "spec/hardware_loader.h"
#include "spec/model_loader.h"
#include "verify_config.h"

namespace flatpeak::cli {
namespace {

using Flags = std::vector<std::pair<std::string, std::string>>;

nlohmann::json plan_json(const std::string& model, const Flags& flags) {
  InputErrors errs;
  const planner::RunSpec spec = planner::parse_run_flags(flags, errs);
  errs.throw_if_any();
  return nlohmann::json::parse(
      planner::plan_to_json(planner::make_searched_plan(load_model(model), load_hardware("H200"), spec, planner::Efficiency{})).dump());
}

std::vector<nlohmann::json> mutations() {
  // Strings too: knobs such as sco_layers are text ("all", "0,2,5-9"), and 20 digits overflowed
  // std::stoll there (an internal error, exit 1).
  return {-1, 0, 1, 3, 2147483647, int64_t{1} << 62, 1e300, 0.5, "x", "99999999999999999999", "0-99999999999999999999",
          "", nlohmann::json::array(), nlohmann::json::object(), nullptr, true};
}

// Every pointer to a value in inputs/{model,hardware,run} (one level of objects deep) and knobs/*/value.
std::vector<std::string> pointers_of(const nlohmann::json& plan) {
  std::vector<std::string> out;
  for (const char* object : {"model", "hardware", "run"})
    for (const auto& item : plan["inputs"][object].items()) {
      if (item.value().is_object()) {
        for (const auto& inner : item.value().items())
          out.push_back(std::string("/inputs/") + object + "/" + item.key() + "/" + inner.key());
      } else {
        out.push_back(std::string("/inputs/") + object + "/" + item.key());
      }
    }
  for (const auto& item : plan["knobs"].items()) out.push_back("/knobs/" + item.key() + "/value");
  return out;
}

TEST(VerifyPlanMutation, EveryEditedFieldReadsOrIsAnInputError) {
  const std::vector<nlohmann::json> plans = {
      plan_json("Qwen3-30B-A3B", {{"--gpus", "8"}, {"--context", "32K"}, {"--schedule", "flatpeak"}}),
      plan_json("Qwen3-30B-A3B", {{"--gpus", "8"}, {"--context", "32K"}, {"--schedule", "practice"}}),
      plan_json("gpt-oss-20b", {{"--gpus", "4"}, {"--context", "16K"}, {"--schedule", "baseline"}}),
      plan_json("GLM-4.5", {{"--gpus", "16"}, {"--context", "8K"}, {"--schedule", "flatpeak"}, {"--ring-size", "2"}}),
      plan_json("Qwen3-30B-A3B", {{"--gpus", "8"}, {"--context", "32K"}, {"--schedule", "flatpeak"}, {"--sco", "on"}}),
  };
  int read = 0, refused = 0;
  for (const nlohmann::json& plan : plans) {
    for (const std::string& pointer : pointers_of(plan)) {
      for (const nlohmann::json& value : mutations()) {
        nlohmann::json edited = plan;
        edited[nlohmann::json::json_pointer(pointer)] = value;
        const std::string what = plan["inputs"]["model"]["name"].get<std::string>() + " " +
                                 plan["inputs"]["run"]["schedule"].get<std::string>() + ": " + pointer + " = " + value.dump();
        try {
          const VerifyInputs in = read_plan_inputs(edited, "plan.json");
          scale_config(in, std::nullopt, 8);
          scale_config(in, 1000.0, 1);
          ++read;
        } catch (const InputError&) {
          ++refused;
        } catch (const std::exception& e) {
          ADD_FAILURE() << what << ": " << e.what();
        }
      }
    }
  }
  EXPECT_GT(read, 100);  // documentation fields and values equal to the plan's own
  EXPECT_GT(refused, 1000);
  std::printf("%d edited plans read and scaled, %d refused\n", read, refused);
}

}  // namespace
}  // namespace flatpeak::cli
