// verify's reading of a plan's fields beyond those it uses (check_plan_fields): every plan that
// `flatpeak plan --format json` writes passes (every model card, every hardware card, the Hugging Face
// configs in the tests' data, baseline, practice and flatpeak with the knob search, CP given and auto,
// micro-batches, the card's overhead and --overhead), and every key and knob name planner::plan_json_objects
// and plan_knob_names list is written by one of them, so the list and the writer cannot drift apart; an
// unknown key or knob is an error with a did-you-mean; a derived field that disagrees with its sources is an
// error naming both fields and their values.
#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "knob_search.h"
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

// What `flatpeak plan --format json` writes (cmd_plan.cpp: the knob search, then plan_to_json).
nlohmann::json plan_json(const std::string& model, const HardwareSpec& hardware, const Flags& flags) {
  InputErrors errs;
  const planner::RunSpec spec = planner::parse_run_flags(flags, errs);
  errs.throw_if_any();
  const planner::Plan p =
      planner::make_searched_plan(load_model(model), hardware, spec, planner::Efficiency{});
  return nlohmann::json::parse(planner::plan_to_json(p).dump());
}

nlohmann::json plan_json(const std::string& model, const std::string& gpu, const Flags& flags) {
  return plan_json(model, load_hardware(gpu), flags);
}

// H200 with a calibrated overhead and its parts, as flatpeak_calibrate writes them into a card
// (the embedded cards have none yet): the plan then carries /inputs/run/overhead_terms.
HardwareSpec calibrated_h200() {
  HardwareSpec h = load_hardware("H200");
  h.runtime_overhead_terms = OverheadTerms{true, 600 << 20, 100 << 20, 32 << 20, 300 << 20};
  h.runtime_overhead_bytes = h.runtime_overhead_terms.sum();
  h.overhead_calibrated = true;
  return h;
}

nlohmann::json qwen3_plan() {
  return plan_json("Qwen3-30B-A3B", "H200",
                   {{"--gpus", "8"}, {"--context", "16K"}, {"--schedule", "flatpeak"}});
}

std::vector<std::string> diagnostics_of(const nlohmann::json& plan) {
  std::vector<std::string> out;
  try {
    read_plan_inputs(plan, "plan.json");
  } catch (const InputError& e) {
    for (const auto& d : e.diagnostics())
      out.push_back(d.to_string() + (d.hint.empty() ? "" : " | " + d.hint));
  }
  return out;
}

// read_plan_inputs' diagnostics for `base` with the value at `pointer` replaced by `value`.
std::vector<std::string> diagnostics_with(nlohmann::json plan, const std::string& pointer, const nlohmann::json& value) {
  plan[nlohmann::json::json_pointer(pointer)] = value;
  return diagnostics_of(plan);
}

// Keys written per object of plan_json_objects(), and knob names, over every plan seen.
void collect_keys(const nlohmann::json& plan, std::map<std::string, std::set<std::string>>& keys,
                  std::set<std::string>& knobs) {
  for (const auto& object : planner::plan_json_objects()) {
    const nlohmann::json::json_pointer p(object.pointer);
    if (!plan.contains(p)) continue;
    for (const auto& item : plan.at(p).items()) keys[object.pointer].insert(item.key());
  }
  for (const auto& item : plan.at("knobs").items()) knobs.insert(item.key());
}

TEST(VerifyPlanFields, EveryPlanWrittenPassesAndEveryListedKeyIsWritten) {
  const std::string hf = std::string(FLATPEAK_TEST_DATA_DIR) + "/hf/";
  struct Case {
    std::string model;
    HardwareSpec gpu;
    Flags flags;
  };
  const HardwareSpec h200 = load_hardware("H200"), h100 = load_hardware("H100"), b200 = load_hardware("B200");
  std::vector<Case> cases;
  for (const std::string model : {"gpt-oss-120b", "gpt-oss-20b", "DeepSeek-V3", "Qwen3-30B-A3B",
                                  "Qwen3-235B-A22B", "OLMoE-1B-7B", "GLM-4.5", "Mixtral-8x7B"})
    for (const std::string schedule : {"baseline", "practice", "flatpeak"})
      cases.push_back({model, h200, {{"--gpus", "16"}, {"--context", "32K"}, {"--schedule", schedule}}});
  for (const HardwareSpec& gpu : list_hardware_cards())  // every hardware card, the knob search on
    for (const std::string model : {"gpt-oss-120b", "DeepSeek-V3", "Mixtral-8x7B"})
      cases.push_back({model, gpu, {{"--gpus", "32"}, {"--context", "128K"}, {"--schedule", "flatpeak"}}});
  for (const std::string model :
       {"DeepSeek-V2-Lite", "Kimi-K2", "Llama-4-Maverick", "Llama-4-Scout", "Qwen3-30B-A3B"})
    cases.push_back({hf + model + "/config.json",
                     h100,
                     {{"--gpus", "8"}, {"--context", "16K"}, {"--schedule", "flatpeak"}}});
  // CP given and searched, micro-batches and accumulation, --overhead (no overhead terms), MTP
  // off, a routing model, every technique knob given.
  cases.push_back({"DeepSeek-V3",
                   h200,
                   {{"--gpus", "64"}, {"--context", "1M"}, {"--schedule", "flatpeak"}, {"--cp", "auto"}}});
  cases.push_back({"Qwen3-30B-A3B",
                   calibrated_h200(),
                   {{"--gpus", "16"}, {"--context", "64K"}, {"--global-batch", "64"}}});
  cases.push_back({"gpt-oss-120b",
                   h100,
                   {{"--gpus", "16"},
                    {"--context", "64K"},
                    {"--cp", "4"},
                    {"--micro-batch", "2"},
                    {"--global-batch", "64"},
                    {"--schedule", "practice"},
                    {"--overhead", "2GiB"}}});
  cases.push_back({"GLM-4.5",
                   b200,
                   {{"--gpus", "32"},
                    {"--context", "32K"},
                    {"--mtp", "off"},
                    {"--imbalance", "rho=2.5"},
                    {"--schedule", "flatpeak"},
                    {"--micro-batch", "1"},
                    {"--cp", "2"}}});
  cases.push_back({"Qwen3-30B-A3B",
                   h200,
                   {{"--gpus", "8"},
                    {"--context", "16K"},
                    {"--schedule", "flatpeak"},
                    {"--chunk-cap-rows", "4096"},
                    {"--dispatch-mode", "store"},
                    {"--llep-alpha", "1.5"},
                    {"--llep-lambda", "1.2"},
                    {"--llep-min-rows", "512"},
                    {"--striping", "off"},
                    {"--dispatch-depth", "3"},
                    {"--ring-size", "4"},
                    {"--ring-rotate", "activations"},
                    {"--vocab-backward", "in-forward"},
                    {"--token-block", "2048"},
                    {"--vocab-block", "4096"},
                    {"--sco-layers", "0-7"},
                    {"--sco-prefetch", "2"},
                    {"--bucket-params", "16M"},
                    {"--bucket-depth", "3"},
                    {"--cp", "1"}}});
  std::map<std::string, std::set<std::string>> keys;
  std::set<std::string> knobs;
  for (const Case& c : cases) {
    std::string what = c.model;
    for (const auto& [flag, value] : c.flags) what += " " + flag + " " + value;
    const nlohmann::json plan = plan_json(c.model, c.gpu, c.flags);
    EXPECT_EQ(diagnostics_of(plan), std::vector<std::string>{}) << what;
    collect_keys(plan, keys, knobs);
  }
  for (const auto& object : planner::plan_json_objects())
    for (const auto& field : object.fields)
      EXPECT_TRUE(keys[object.pointer].count(field.key))
          << object.pointer << "/" << field.key << " is listed but no plan wrote it";
  for (const auto& name : planner::plan_knob_names())
    EXPECT_TRUE(knobs.count(name)) << "knob " << name << " is listed but no plan wrote it";
}

TEST(VerifyPlanFields, UnknownKeysAndKnobsAreErrorsWithDidYouMean) {
  nlohmann::json plan = qwen3_plan();
  plan["inputs"]["run"]["context_token"] = 16384;
  plan["inputs"]["model"]["num_expert"] = 128;
  plan["knobs"]["vocab_blok"] = {{"value", 4096}, {"reason", "given"}};
  plan["knobs"]["vocab"]["values"] = "ring-dtp";
  plan["other_tool"] = {{"x", 1}};
  EXPECT_EQ(diagnostics_of(plan), (std::vector<std::string>{
                                      "plan.json: /other_tool: unknown key: 'flatpeak plan --format json' "
                                      "writes no such key (got {\"x\":1})",
                                      "plan.json: /inputs/model/num_expert: unknown key: 'flatpeak plan "
                                      "--format json' writes no such key (got 128) | "
                                      "did you mean 'num_experts'?",
                                      "plan.json: /inputs/run/context_token: unknown key: 'flatpeak plan "
                                      "--format json' writes no such key (got 16384) | "
                                      "did you mean 'context_tokens'?",
                                      "plan.json: /knobs/vocab/values: unknown key: a knob holds value and "
                                      "reason only (got \"ring-dtp\") | did you mean 'value'?",
                                      "plan.json: /knobs/vocab_blok: unknown knob: 'flatpeak plan --format "
                                      "json' writes no such knob (got "
                                      "{\"reason\":\"given\",\"value\":4096}) | did you mean 'vocab_block'?",
                                  }));
}

TEST(VerifyPlanFields, FieldsOfTheWrongKindAreErrors) {
  nlohmann::json plan = qwen3_plan();
  plan["inputs"]["model"]["tie_word_embeddings"] = "no";
  plan["inputs"]["hardware"]["host_link_bandwidth_bytes_per_s"] = -1;
  plan["inputs"]["run"]["cp_auto"] = 0;
  plan["knobs"]["llep"] = true;
  plan["inputs"]["params"]["total"] = UINT64_MAX;  // read as -1 through int64_t
  EXPECT_EQ(diagnostics_of(plan),
            (std::vector<std::string>{
                "plan.json: /inputs/model/tie_word_embeddings: must be true or false (got \"no\")",
                "plan.json: /inputs/hardware/host_link_bandwidth_bytes_per_s: must be a non-negative number "
                "(got -1)",
                "plan.json: /inputs/run/cp_auto: must be true or false (got 0)",
                "plan.json: /inputs/params/total: must be an integer in 0..2^60 (got 18446744073709551615)",
                "plan.json: /knobs/llep: must be an object {\"value\": ..., \"reason\": \"...\"} (got true)",
            }));
}

// A value verify does not read changed by hand: the derived field it contradicts is named, with
// the fields it derives from and their values.
TEST(VerifyPlanFields, DerivedRunFieldsMustAgreeWithTheirSources) {
  const nlohmann::json base = plan_json("Qwen3-30B-A3B", "H200",
                                        {{"--gpus", "8"},
                                         {"--context", "16K"},
                                         {"--micro-batch", "2"},
                                         {"--global-batch", "32"},
                                         {"--schedule", "baseline"}});
  ASSERT_EQ(diagnostics_of(base), std::vector<std::string>{});
  auto changed = [&](const std::string& pointer, const nlohmann::json& value) {
    return diagnostics_with(base, pointer, value);
  };
  using V = std::vector<std::string>;
  EXPECT_EQ(changed("/inputs/run/context_tokens", 65536),
            V{"plan.json: /inputs/run/tokens_per_gpu: must equal /inputs/run/micro_batch x "
              "/inputs/run/context_tokens / "
              "/inputs/run/cp = 2 x 65536 / 1 = 131072 (got 32768)"});
  EXPECT_EQ(changed("/inputs/run/dp", 4),
            V{"plan.json: /inputs/run/dp: must equal /inputs/run/gpus / /inputs/run/cp = 8 / 1 = 8 (got 4)"});
  EXPECT_EQ(
      changed("/inputs/run/global_batch", 40),
      V{"plan.json: /inputs/run/global_batch: must be a multiple of /inputs/run/micro_batch x DP = 2 x 8 "
        "(DP = /inputs/run/gpus / /inputs/run/cp) (got 40)"});
  EXPECT_EQ(changed("/inputs/run/global_batch", 48),
            V{"plan.json: /inputs/run/accumulation_steps: must equal /inputs/run/global_batch / "
              "(/inputs/run/micro_batch x DP) = "
              "48 / (2 x 8) = 3 (got 2)"});
  EXPECT_EQ(changed("/inputs/run/experts_per_rank", 8),
            V{"plan.json: /inputs/run/experts_per_rank: must equal /inputs/model/num_experts / "
              "/inputs/run/ep = 128 / 8 = 16 (got 8)"});
  EXPECT_EQ(changed("/inputs/model/num_experts", 100),
            V{"plan.json: /inputs/run/ep: must divide /inputs/model/num_experts = 100 (got 8)"});
  EXPECT_EQ(changed("/inputs/run/cp", 3),
            (V{"plan.json: /inputs/run/cp: must divide /inputs/run/gpus = 8 (got 3)"}));
  EXPECT_EQ(changed("/inputs/run/gpus_per_node", 16),
            V{"plan.json: /inputs/run/gpus_per_node: must lie in 1../inputs/run/gpus = 8 (got 16)"});
  EXPECT_EQ(changed("/inputs/run/allocation_alignment_bytes", 256),
            V{"plan.json: /inputs/run/allocation_alignment_bytes: must equal "
              "/inputs/hardware/allocation_alignment_bytes = 512 (got 256)"});
  EXPECT_EQ(changed("/inputs/run/fragmentation", 1.5),
            V{"plan.json: /inputs/run/fragmentation: must lie in [0, 1) (got 1.5)"});
  EXPECT_EQ(changed("/inputs/model/layers", "MMMM"),
            V{"plan.json: /inputs/model/layers: must have one letter per layer: /inputs/model/num_layers = "
              "48 (got 4 letters)"});
  EXPECT_EQ(changed("/inputs/model/kv_lora_rank", 512),
            V{"plan.json: /inputs/model/kv_lora_rank: must be 0 with attention gqa (got 512)"});
  EXPECT_EQ(changed("/inputs/model/v_head_dim", 64),
            V{"plan.json: /inputs/model/v_head_dim: must equal /inputs/model/head_dim = 128 with attention "
              "gqa (got 64)"});
  EXPECT_EQ(changed("/inputs/run/mtp", true),
            V{"plan.json: /inputs/run/mtp: must be false: /inputs/model/mtp_layers = 0 (got true)"});
  EXPECT_EQ(changed("/inputs/model/attention", "mha"),
            V{"plan.json: /inputs/model/attention: must be gqa or mla (got 'mha')"});
}

// A plan of a built-in card is held to the card's dims as a plan of a card file is to the file
// (verify reloaded the card and ran it, while the plan's edited hidden_size scaled H); names,
// the schedule and the routing model are errors of the plan's own fields, not of CLI flags.
TEST(VerifyPlanFields, BuiltInCardsScheduleAndRoutingAreCheckedAgainstThePlan) {
  const nlohmann::json plan = qwen3_plan();
  ASSERT_EQ(plan["inputs"]["model"]["source"], "embedded:Qwen3-30B-A3B");
  const std::string edited = "the plan was edited or made by another version of flatpeak | plan again";
  EXPECT_EQ(diagnostics_with(plan, "/inputs/model/hidden_size", 1024),
            std::vector<std::string>{"plan.json: /inputs/model/hidden_size: is 1024, but the built-in card 'Qwen3-30B-A3B' gives "
                                     "2048: " + edited});
  EXPECT_EQ(diagnostics_with(plan, "/inputs/model/top_k", 4),
            std::vector<std::string>{"plan.json: /inputs/model/top_k: is 4, but the built-in card 'Qwen3-30B-A3B' gives 8: " +
                                     edited});
  const std::vector<std::string> gpu = diagnostics_with(plan, "/inputs/hardware/name", "H900");
  ASSERT_EQ(gpu.size(), 1u);
  EXPECT_EQ(gpu[0].rfind("plan.json: /inputs/hardware/name: names no built-in card: unknown hardware 'H900'", 0), 0u) << gpu[0];
  const std::vector<std::string> model = diagnostics_with(plan, "/inputs/model/name", "Qwen9");
  ASSERT_EQ(model.size(), 1u);
  EXPECT_EQ(model[0].rfind("plan.json: /inputs/model/name: names no built-in card: unknown model 'Qwen9'", 0), 0u) << model[0];
  EXPECT_EQ(diagnostics_with(plan, "/inputs/run/schedule", "fast"),
            std::vector<std::string>{"plan.json: /inputs/run/schedule: must be baseline, practice or flatpeak (got 'fast')"});
  const std::vector<std::string> rho = diagnostics_with(plan, "/inputs/run/imbalance", "rho=9");
  ASSERT_EQ(rho.size(), 1u);
  EXPECT_EQ(rho[0].rfind("plan.json: /inputs/run/imbalance: rho=X needs X <= EP*min(k,E/EP)/k = 8 at EP=8, E=128, k=8 (got 9)", 0), 0u)
      << rho[0];
  EXPECT_TRUE(diagnostics_with(plan, "/inputs/run/imbalance", "rho=2.5").empty());
}

// read_plan_inputs then scale_config (where the technique knobs are read), as verify runs them.
std::vector<std::string> scaled_diagnostics_of(const nlohmann::json& plan) {
  std::vector<std::string> out;
  try {
    scale_config(read_plan_inputs(plan, "plan.json"), std::nullopt, 2);
  } catch (const InputError& e) {
    for (const auto& d : e.diagnostics()) out.push_back(d.to_string());
  }
  return out;
}

// Knobs a plan always writes are required, and the loss must be the schedule's: an edited
// practice plan with materialised logits, or without its boundaries knob, ran a different
// schedule than it predicted and "failed" (exit 5). A ring rotation is checked at R = 1 too, and
// a bucket count verify cannot run in reasonable time is refused with the smallest bucket that is.
TEST(VerifyPlanFields, TechniqueKnobsMustBeThePlansOwn) {
  const nlohmann::json practice =
      plan_json("Qwen3-30B-A3B", "H200", {{"--gpus", "2"}, {"--context", "4K"}, {"--schedule", "practice"}});
  EXPECT_EQ(scaled_diagnostics_of(practice), std::vector<std::string>{});
  nlohmann::json edited = practice;
  edited["knobs"]["vocab"]["value"] = "materialized";
  EXPECT_EQ(scaled_diagnostics_of(edited),
            std::vector<std::string>{"plan.json: /knobs/vocab/value: must be ring-dtp or blocked under schedule practice (got 'materialized')"});
  edited = practice;
  edited["knobs"].erase("boundaries");
  EXPECT_EQ(scaled_diagnostics_of(edited), std::vector<std::string>{"plan.json: /knobs/boundaries: required field is missing"});
  edited = practice;
  edited["knobs"].erase("vocab");
  EXPECT_EQ(scaled_diagnostics_of(edited), std::vector<std::string>{"plan.json: /knobs/vocab/value: required field is missing"});

  const nlohmann::json flat = plan_json("Qwen3-30B-A3B", "H200", {{"--gpus", "2"}, {"--context", "4K"}, {"--schedule", "flatpeak"}});
  ASSERT_EQ(flat["knobs"]["ring_size"]["value"], 1);
  edited = flat;
  edited["knobs"]["ring_rotate"]["value"] = "x";
  EXPECT_EQ(scaled_diagnostics_of(edited), std::vector<std::string>{"plan.json: /knobs/ring_rotate/value: must be activations or weights (got \"x\")"});
  edited = flat;
  edited["knobs"]["vocab"]["value"] = "blocked";
  EXPECT_EQ(scaled_diagnostics_of(edited),
            std::vector<std::string>{"plan.json: /knobs/vocab/value: must be ring-dtp or materialized under schedule flatpeak (got 'blocked')"});
  // Too many buckets: the optimizer and the step refuse the plan (alone, an input error; with
  // every component, skipped with a note), the other components run (the vocab one here).
  edited = flat;
  edited["knobs"]["bucket_params"]["value"] = 1;
  EXPECT_EQ(scaled_diagnostics_of(edited), std::vector<std::string>{});
  const VerifyInputs in = read_plan_inputs(edited, "plan.json");
  const ScaledConfig s = scale_config(in, std::nullopt, 2);
  ASSERT_EQ(s.optimizer_refusal.size(), 1u);
  const std::string refusal = s.optimizer_refusal[0].to_string();
  EXPECT_EQ(refusal.rfind("plan.json: /knobs/bucket_params/value: makes ", 0), 0u) << refusal;
  EXPECT_NE(refusal.find("verify keeps the bucket count and runs at most 16384 (got 1)"), std::string::npos) << refusal;
  for (const char* component : {"optimizer", "step"}) EXPECT_THROW(run_verification(in, s, {component}, 0.01), InputError) << component;
  EXPECT_TRUE(run_verification(in, s, {"vocab"}, 0.01).pass);
  const VerifyReport every = run_verification(in, s, verify_components(), 0.01);
  int skipped = 0;
  for (const std::string& note : every.notes) skipped += note.find("not run (/knobs/bucket_params/value: makes ") != std::string::npos;
  EXPECT_EQ(skipped, 2);
}

TEST(VerifyPlanFields, OverheadTermsMustAddUpToTheOverhead) {
  nlohmann::json plan =
      plan_json("Qwen3-30B-A3B", calibrated_h200(), {{"--gpus", "8"}, {"--context", "16K"}});
  ASSERT_EQ(diagnostics_of(plan), std::vector<std::string>{});
  plan["inputs"]["run"]["overhead_terms"]["nccl_bytes"] = 0;
  EXPECT_EQ(diagnostics_of(plan),
            std::vector<std::string>{"plan.json: /inputs/run/overhead_bytes: must equal the sum of "
                                     "/inputs/run/overhead_terms = 767557632 (got 1082130432)"});
}

TEST(VerifyPlanFields, MlaDimsAndSearchedKnobsMustAgree) {
  const nlohmann::json base =
      plan_json("DeepSeek-V3", "H200",
                {{"--gpus", "64"}, {"--context", "64K"}, {"--schedule", "flatpeak"}, {"--cp", "auto"}});
  ASSERT_EQ(diagnostics_of(base), std::vector<std::string>{});
  ASSERT_EQ(base["inputs"]["model"]["attention"], "mla");
  ASSERT_TRUE(base["knobs"].contains("cp"));
  auto changed = [&](const std::string& pointer, const nlohmann::json& value) {
    return diagnostics_with(base, pointer, value);
  };
  using V = std::vector<std::string>;
  EXPECT_EQ(changed("/inputs/model/qk_rope_head_dim", 32),
            V{"plan.json: /inputs/model/head_dim: must equal /inputs/model/qk_nope_head_dim + "
              "/inputs/model/qk_rope_head_dim = "
              "128 + 32 = 160 with attention mla (got 192)"});
  EXPECT_EQ(changed("/inputs/model/num_kv_heads", 8),
            V{"plan.json: /inputs/model/num_kv_heads: must equal /inputs/model/num_heads = 128 with "
              "attention mla (got 8)"});
  EXPECT_EQ(changed("/inputs/model/kv_lora_rank", 0),
            V{"plan.json: /inputs/model/kv_lora_rank: must be at least 1 with attention mla (got 0)"});
  const int64_t cp = base["inputs"]["run"]["cp"].get<int64_t>();
  EXPECT_EQ(changed("/knobs/cp/value", cp * 2),
            V{"plan.json: /knobs/cp/value: must equal /inputs/run/cp = " + std::to_string(cp) + " (got " +
              std::to_string(cp * 2) + ")"});
}

}  // namespace
}  // namespace flatpeak::cli
