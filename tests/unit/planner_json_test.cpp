// The plan JSON interface scripts rely on, flag validation in one pass, and overflow guarding.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include "planner_test_util.h"
#include "spec/sizes.h"

namespace flatpeak::planner::test {
namespace {

TEST(PlannerJson, InterfacePathsAndKeyOrder) {
  const Plan p = plan_of(tiny_moe(), tiny_gpu(), {{"--gpus", "2"}, {"--context", "16"}, {"--schedule", "flatpeak"}});
  const nlohmann::ordered_json j = plan_to_json(p);
  std::vector<std::string> keys;
  for (const auto& item : j.items()) keys.push_back(item.key());
  EXPECT_EQ(keys, (std::vector<std::string>{"schema_version", "inputs", "knobs", "routing", "peaks", "gpu", "host",
                                            "time", "timeline", "baseline", "warnings"}));
  EXPECT_EQ(j["schema_version"], 1);
  for (const char* peak : {"dispatch", "vocab", "checkpoint", "optimizer", "layer"}) {
    const auto& pj = j["peaks"][peak];
    EXPECT_TRUE(pj["bytes"].is_number_integer()) << peak;
    EXPECT_TRUE(pj["component_bytes"].is_number_integer()) << peak;
    EXPECT_TRUE(pj["phase"].is_string()) << peak;
    EXPECT_TRUE(pj["terms"].is_array()) << peak;
    EXPECT_TRUE(j["baseline"]["peaks"][peak]["bytes"].is_number_integer()) << peak;
  }
  for (const char* key : {"peak_bytes", "required_bytes", "budget_bytes"}) EXPECT_TRUE(j["gpu"][key].is_number_integer());
  EXPECT_TRUE(j["gpu"]["fits"].is_boolean());
  EXPECT_TRUE(j["gpu"]["binding"].is_string());
  for (const char* key : {"peak_bytes", "budget_bytes"}) EXPECT_TRUE(j["host"][key].is_number_integer());
  EXPECT_TRUE(j["host"]["fits"].is_boolean());
  // Defaults are printed in inputs; knobs carry their reasons.
  EXPECT_EQ(j["inputs"]["run"]["ep"], 2);
  EXPECT_EQ(j["inputs"]["run"]["overhead_bytes"], 1000);
  EXPECT_EQ(j["knobs"]["llep"]["reason"], "schedule flatpeak");
  EXPECT_EQ(j["knobs"]["sco_layers"]["value"], "0");  // auto: nothing needs offloading here
  // Every peak term's bytes sum to component_bytes; timeline totals equal the phases'.
  for (const auto& [name, pj] : j["peaks"].items()) {
    int64_t sum = 0;
    for (const auto& t : pj["terms"]) sum += t["bytes"].get<int64_t>();
    EXPECT_EQ(sum, pj["component_bytes"].get<int64_t>()) << name;
  }
  ASSERT_EQ(j["timeline"]["phases"].size(), p.timeline.phases.size());
  EXPECT_EQ(j["timeline"]["phases"][0]["device"]["total"], p.timeline.phases[0].device_bytes());
}

// At EP = 1 PipelinedLLEP's rounds still cap the dispatch; the LLA defaults clamp to EP (was: an
// error naming --llep-alpha and --llep-lambda, which the user never gave). A value given out of
// [1, EP] is still an error.
TEST(PlannerJson, FlatpeakAtEpOneClampsTheLlaDefaults) {
  InputErrors errs;
  const RunSpec s = parse_run_flags({{"--gpus", "2"}, {"--context", "16"}, {"--ep", "1"}, {"--schedule", "flatpeak"}}, errs);
  const ResolvedRun r = resolve_run(tiny_moe(), tiny_gpu(), s, errs);
  EXPECT_TRUE(errs.empty()) << errs.diagnostics()[0].to_string();
  EXPECT_TRUE(r.llep);
  EXPECT_EQ(r.llep_alpha, 1.0);
  EXPECT_EQ(r.llep_lambda, 1.0);
  InputErrors given_errs;
  const RunSpec given = parse_run_flags({{"--gpus", "2"}, {"--context", "16"}, {"--ep", "1"}, {"--schedule", "flatpeak"},
                                         {"--llep-alpha", "1.1"}},
                                        given_errs);
  resolve_run(tiny_moe(), tiny_gpu(), given, given_errs);
  ASSERT_EQ(given_errs.size(), 1u);
  EXPECT_EQ(given_errs.diagnostics()[0].to_string(), "--llep-alpha: must lie in [1, EP = 1] (got 1.1)");
}

TEST(PlannerJson, EveryBadFlagInOnePass) {
  InputErrors errs;
  const RunSpec s = parse_run_flags({{"--gpus", "8"}, {"--context", "1M"}, {"--ep", "3"}, {"--cp", "3"},
                                     {"--ring-dtp", "on"}, {"--ring-size", "5"}, {"--bucket-params", "4M"},
                                     {"--llep-alpha", "abc"}},
                                    errs);
  ASSERT_EQ(errs.size(), 1u);  // --llep-alpha is not a number
  ModelSpec m = tiny_moe();
  resolve_run(m, tiny_gpu(), s, errs);
  std::vector<std::string> flags;
  for (const auto& d : errs.diagnostics()) flags.push_back(d.pointer);
  EXPECT_EQ(flags, (std::vector<std::string>{"--llep-alpha", "--cp", "--ep", "--ring-size", "--bucket-params"}));
  EXPECT_EQ(errs.diagnostics()[2].message, "must divide both N = 8 and E = 4 (got 3)");
  EXPECT_EQ(errs.diagnostics()[2].hint, "valid: 1, 2, 4");
  EXPECT_EQ(errs.diagnostics()[3].hint, "valid: 1, 2, 4, 8");
}

TEST(PlannerJson, DenseModelHasNoDispatchPeak) {
  ModelSpec m = tiny_moe();
  m.num_experts = 0;
  m.top_k = 0;
  m.expert_ffn_width = 0;
  m.dense_ffn_width = 16;
  for (auto& l : m.layers) l.ffn = FfnKind::Dense;
  const Plan p = plan_of(m, tiny_gpu(), {{"--gpus", "2"}, {"--context", "16"}});
  EXPECT_EQ(p.run.ep, 1);
  EXPECT_TRUE(p.summary.peak(PeakKind::Dispatch).phase.empty());
  const nlohmann::ordered_json j = plan_to_json(p);
  EXPECT_TRUE(j["peaks"]["dispatch"]["phase"].is_null());
  EXPECT_EQ(j["peaks"]["dispatch"]["bytes"], 0);
  EXPECT_FALSE(j.contains("routing"));
  // --llep on is refused for a dense model.
  EXPECT_THROW(plan_of(m, tiny_gpu(), {{"--gpus", "2"}, {"--context", "16"}, {"--llep", "on"}}), InputError);
}

TEST(PlannerJson, ContextAboveMaxPositionsIsAWarning) {
  ModelSpec m = tiny_moe();
  m.max_position_embeddings = 8;
  const Plan p = plan_of(m, tiny_gpu(), {{"--gpus", "2"}, {"--context", "16"}});
  ASSERT_EQ(p.warnings.size(), 1u);
  EXPECT_EQ(p.warnings[0], "context S = 16 exceeds the model's max_position_embeddings = 8");
}

// A tied head: the part of its memory the plan leaves out is said, with its size (4·V·H bytes).
TEST(PlannerJson, TiedEmbeddingsAreAWarning) {
  ModelSpec m = tiny_moe();
  m.tie_word_embeddings = true;
  const Plan p = plan_of(m, tiny_gpu(), {{"--gpus", "2"}, {"--context", "16"}});
  ASSERT_EQ(p.warnings.size(), 1u);
  EXPECT_EQ(p.warnings[0], fmt::format("tie_word_embeddings: this plan does not reduce the LM head's gradient into the "
                                       "tied embedding's shard; expect up to 4 x V x H bytes = {} more per GPU in the "
                                       "backward (planner/README.md, \"Tied embeddings\")",
                                       format_bytes(4 * m.vocab_size * m.hidden_size)));
  m.tie_word_embeddings = false;
  EXPECT_TRUE(plan_of(m, tiny_gpu(), {{"--gpus", "2"}, {"--context", "16"}}).warnings.empty());
}

TEST(PlannerJson, SizesThatOverflowInt64AreInputErrors) {
  ModelSpec m = tiny_moe();
  m.vocab_size = int64_t{1} << 30;
  try {
    plan_of(m, tiny_gpu(), {{"--gpus", "2"}, {"--context", "1G"}, {"--micro-batch", "4"}});
    FAIL() << "expected InputError";
  } catch (const InputError& e) {
    EXPECT_EQ(e.diagnostics()[0].pointer, "--context");
  }
  // More than 2^32 tokens per GPU is refused up front.
  try {
    plan_of(tiny_moe(), tiny_gpu(), {{"--gpus", "2"}, {"--context", "1G"}, {"--micro-batch", "8"}});
    FAIL() << "expected InputError";
  } catch (const InputError& e) {
    EXPECT_EQ(e.diagnostics()[0].pointer, "--context");
  }
}

}  // namespace
}  // namespace flatpeak::planner::test
