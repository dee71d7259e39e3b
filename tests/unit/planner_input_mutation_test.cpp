// Bad input never crashes the loaders or the planner: every key of every built-in model card and
// every Hugging Face config in the tests' data, and of every hardware card, replaced in turn by values of the wrong kind or at
// the edges of the 64-bit range (negative, zero, the largest card dimension, 2^62, 1e300, a
// string, an array, an object, null, a bool, a fraction), either loads or is an InputError; a
// card that loads plans (one GPU, 1K tokens, baseline and flatpeak) or is an InputError, and a plan's
// peaks and step time are finite and non-negative. Anything else (another exception, a crash
// under the sanitizers, a NaN) fails.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "plan.h"
#include "run_spec.h"
#include "spec/errors.h"
#include "spec/hardware_loader.h"
#include "spec/hf_import.h"
#include "spec/json_util.h"
#include "spec/model_loader.h"

namespace flatpeak::planner::test {
namespace {

namespace fs = std::filesystem;

std::vector<fs::path> input_files() {
  std::vector<fs::path> out;
  for (const auto& e : fs::directory_iterator(fs::path(FLATPEAK_SOURCE_DIR) / "models"))
    if (e.path().extension() == ".json") out.push_back(e.path());
  for (const auto& e : fs::directory_iterator(fs::path(FLATPEAK_TEST_DATA_DIR) / "hf"))
    if (fs::exists(e.path() / "config.json")) out.push_back(e.path() / "config.json");
  return out;
}

std::vector<nlohmann::json> mutations() {
  return {-1, 0, 2147483647, int64_t{1} << 62, 1e300, "x", "99999999999999999999", nlohmann::json::array(),
          nlohmann::json::object(), nullptr, true, 0.5};
}

ModelSpec load_document(const nlohmann::json& doc, const std::string& file) {
  return looks_like_hf_config(doc) ? import_hf_config(doc, file) : parse_model_card(doc, file);
}

// Plans `model` under every schedule; returns what went wrong beyond an InputError ("" if nothing).
std::string plan_problem(const ModelSpec& model, const HardwareSpec& hardware) {
  for (const char* schedule : {"baseline", "flatpeak"}) {
    InputErrors errs;
    const RunSpec spec = parse_run_flags({{"--gpus", "1"}, {"--context", "1K"}, {"--schedule", schedule}}, errs);
    if (!errs.empty()) return "the flags did not parse";
    try {
      const Plan p = make_plan(model, hardware, spec);
      for (const auto& peak : p.summary.peaks)
        if (peak.bytes < 0) return std::string(schedule) + ": a negative peak";
      if (!std::isfinite(p.time.step_seconds) || p.time.step_seconds < 0) return std::string(schedule) + ": step time not finite";
    } catch (const InputError&) {
      // a clear refusal is fine
    } catch (const std::exception& e) {
      return std::string(schedule) + ": " + e.what();
    }
  }
  return "";
}

// Calls `visit(what, model, value)` for every mutated model input that loads; counts the refused.
template <class Visit>
void for_each_mutated_model(int& loaded, int& refused, const Visit& visit) {
  for (const fs::path& path : input_files()) {
    const nlohmann::json original = parse_json_text(read_text_file(path.string()), path.string());
    ASSERT_TRUE(original.is_object()) << path;
    for (const auto& item : original.items()) {
      for (const nlohmann::json& value : mutations()) {
        nlohmann::json doc = original;
        doc[item.key()] = value;
        const std::string what = path.filename().string() + " " + path.parent_path().filename().string() + ": /" +
                                 item.key() + " = " + value.dump();
        try {
          const ModelSpec model = load_document(doc, path.string());
          ++loaded;
          visit(what, model, value);
        } catch (const InputError&) {
          ++refused;
        } catch (const std::exception& e) {
          ADD_FAILURE() << what << ": " << e.what();
        }
      }
    }
  }
}

TEST(PlannerInputMutation, EveryKeyOfEveryCardReplacedLoadsOrIsAnInputError) {
  int loaded = 0, refused = 0;
  for_each_mutated_model(loaded, refused, [](const std::string&, const ModelSpec&, const nlohmann::json&) {});
  // Both outcomes occur (documentation keys take any string, most dims refuse a string).
  EXPECT_GT(loaded, 1000);
  EXPECT_GT(refused, 1000);
  std::printf("%d mutated inputs loaded, %d refused\n", loaded, refused);
}

// Planning is most of the time (2 min under ASan, 8 s without): tools/test.sh runs this test
// unsanitised only, its loads run sanitised in the test above.
TEST(PlannerInputMutation, EveryMutatedCardThatLoadsPlans) {
  const HardwareSpec hardware = load_hardware("H200");
  int loaded = 0, refused = 0, planned = 0;
  for_each_mutated_model(loaded, refused, [&](const std::string& what, const ModelSpec& model, const nlohmann::json& value) {
    // A string, array, object or null that loads is a key the loader ignores or a documentation
    // field (the model is the original's): not planned again each time.
    if (!value.is_number() && !value.is_boolean()) return;
    ++planned;
    EXPECT_EQ(plan_problem(model, hardware), "") << what;
  });
  EXPECT_GT(planned, 1000);
  std::printf("%d mutated inputs with a number or a bool loaded and planned\n", planned);
}

// The same for every key of every hardware card, planned with OLMoE-1B-7B (a budget, a bandwidth,
// an overhead or an alignment at the edges must not make a time NaN or a peak negative).
TEST(PlannerInputMutation, EveryKeyOfEveryHardwareCardReplacedLoadsOrIsAnInputError) {
  const ModelSpec model = load_model("OLMoE-1B-7B");
  int planned = 0, refused = 0;
  for (const auto& e : fs::directory_iterator(fs::path(FLATPEAK_SOURCE_DIR) / "models" / "hardware")) {
    if (e.path().extension() != ".json") continue;
    const nlohmann::json original = parse_json_text(read_text_file(e.path().string()), e.path().string());
    for (const auto& item : original.items()) {
      for (const nlohmann::json& value : mutations()) {
        nlohmann::json doc = original;
        doc[item.key()] = value;
        const std::string what = e.path().filename().string() + ": /" + item.key() + " = " + value.dump();
        try {
          const HardwareSpec hardware = parse_hardware_card(doc, e.path().string());
          if (value.is_number() || value.is_boolean()) {
            ++planned;
            EXPECT_EQ(plan_problem(model, hardware), "") << what;
          }
        } catch (const InputError&) {
          ++refused;
        } catch (const std::exception& ex) {
          ADD_FAILURE() << what << ": " << ex.what();
        }
      }
    }
  }
  EXPECT_GT(planned, 20);
  EXPECT_GT(refused, 500);
}

}  // namespace
}  // namespace flatpeak::planner::test
