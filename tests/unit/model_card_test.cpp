// The model card loader: names and aliases, loading from paths, every validation rule with its
// exact message, several problems in one pass, and a robustness loop of mutated and truncated cards
// (each must give a valid ModelSpec or an InputError, nothing else).
#include "spec/model_loader.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <filesystem>
#include <map>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include <unistd.h>

#include "spec/embedded_cards.h"
#include "spec/errors.h"
#include "spec/json_util.h"
#include "spec/param_count.h"

namespace flatpeak {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

std::string lower(std::string text) {
  for (char& c : text) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return text;
}

json embedded_card_json(const std::string& name) {
  for (const auto& card : embedded_model_cards()) {
    if (card.name == name) return json::parse(card.json);
  }
  ADD_FAILURE() << "no embedded card " << name;
  return json::object();
}

// The diagnostics of parsing `card` as "card.json", one "file: /pointer: message" line each;
// empty when the card is valid.
std::vector<std::string> problems(const json& card) {
  try {
    parse_model_card(card, "card.json");
  } catch (const InputError& e) {
    std::vector<std::string> lines;
    for (const auto& d : e.diagnostics()) lines.push_back(d.to_string());
    return lines;
  }
  return {};
}

// A temporary folder removed at the end of the test.
class TempDir {
 public:
  TempDir() {
    static int counter = 0;
    path_ = fs::temp_directory_path() /
            ("flatpeak_model_card_test_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string write(const std::string& name, const std::string& text) const {
    const fs::path file = path_ / name;
    std::ofstream(file, std::ios::binary) << text;
    return file.string();
  }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

// ---------------------------------------------------------------------------------------------
// Embedded cards, names and aliases

TEST(ModelCards, EveryEmbeddedCardParsesAndIsNamedLikeItsFile) {
  const std::vector<std::string> expected = {"DeepSeek-V3",   "GLM-4.5",         "gpt-oss-120b",  "gpt-oss-20b",
                                             "Mixtral-8x7B",  "OLMoE-1B-7B",     "Qwen3-235B-A22B", "Qwen3-30B-A3B"};
  std::vector<std::string> names;
  for (const auto& card : list_model_cards()) names.push_back(card.name);
  EXPECT_EQ(names, expected);  // sorted case-insensitively
  for (const auto& card : embedded_model_cards()) {
    const ModelSpec model = parse_model_card(json::parse(card.json), card.name);
    EXPECT_EQ(model.name, card.name);
    EXPECT_EQ(static_cast<int64_t>(model.layers.size()), model.num_layers);
    EXPECT_TRUE(model.params_total_official.has_value()) << card.name;
    EXPECT_TRUE(model.params_active_official.has_value()) << card.name;
    EXPECT_FALSE(model.params_official_statement.empty()) << card.name;
  }
}

TEST(ModelCards, NamesAndAliasesAreUniqueIgnoringCase) {
  std::set<std::string> seen;
  for (const auto& card : list_model_cards()) {
    EXPECT_TRUE(seen.insert(lower(card.name)).second) << card.name;
    for (const auto& alias : card.aliases) EXPECT_TRUE(seen.insert(lower(alias)).second) << alias;
  }
}

TEST(ModelCards, ArchitecturesAreHuggingFaceModelTypes) {
  std::map<std::string, std::string> architecture;
  for (const auto& card : list_model_cards()) architecture[card.name] = card.architecture;
  EXPECT_EQ(architecture["gpt-oss-120b"], "gpt_oss");
  EXPECT_EQ(architecture["DeepSeek-V3"], "deepseek_v3");
  EXPECT_EQ(architecture["GLM-4.5"], "glm4_moe");
  EXPECT_EQ(architecture["Qwen3-30B-A3B"], "qwen3_moe");
  EXPECT_EQ(architecture["Mixtral-8x7B"], "mixtral");
  EXPECT_EQ(architecture["OLMoE-1B-7B"], "olmoe");
}

// MTP modules are bounded (each holds every earlier module's tensors: plans grow with the square);
// LayerNorm and an LM head bias are read from their keys.
TEST(ModelLoader, MtpModulesBoundedAndNormKindRead) {
  json card = embedded_card_json("DeepSeek-V3");
  card["num_nextn_predict_layers"] = 65;
  ASSERT_EQ(problems(card).size(), 1u);
  EXPECT_NE(problems(card)[0].find("/num_nextn_predict_layers"), std::string::npos) << problems(card)[0];
  card["num_nextn_predict_layers"] = 64;
  EXPECT_TRUE(problems(card).empty());
  card["layer_norm"] = "layernorm";
  card["lm_head_bias"] = true;
  const ModelSpec m = parse_model_card(card, "card.json");
  EXPECT_TRUE(m.norm_bias);
  EXPECT_TRUE(m.lm_head_bias);
  card["layer_norm"] = "batchnorm";
  ASSERT_EQ(problems(card).size(), 1u);
  EXPECT_NE(problems(card)[0].find("/layer_norm"), std::string::npos) << problems(card)[0];
}

TEST(ModelLoader, AliasesResolveToTheirCard) {
  EXPECT_EQ(load_model("OLMoE-1B-7B-0924").name, "OLMoE-1B-7B");
  EXPECT_EQ(load_model("allenai/OLMoE-1B-7B-0924").name, "OLMoE-1B-7B");
  EXPECT_EQ(load_model("openai/gpt-oss-120b").name, "gpt-oss-120b");
  EXPECT_EQ(load_model("deepseek-ai/DeepSeek-V3").name, "DeepSeek-V3");
  EXPECT_EQ(load_model("mistralai/Mixtral-8x7B-v0.1").name, "Mixtral-8x7B");
  EXPECT_EQ(load_model("GLM-4.5").source, "embedded:GLM-4.5");
}

TEST(ModelLoader, NamesAreCaseInsensitive) {
  EXPECT_EQ(load_model("GPT-OSS-120B").name, "gpt-oss-120b");
  EXPECT_EQ(load_model("deepseek-v3").name, "DeepSeek-V3");
  EXPECT_EQ(load_model("qwen/qwen3-30b-a3b").name, "Qwen3-30B-A3B");
  EXPECT_EQ(load_model("olmoe-1b-7b-0924").name, "OLMoE-1B-7B");
}

TEST(ModelLoader, ResolvedDimsOfGptOss120b) {
  const ModelSpec m = load_model("gpt-oss-120b");
  EXPECT_EQ(m.architecture, "gpt_oss");
  EXPECT_EQ(m.num_layers, 36);
  EXPECT_EQ(m.hidden_size, 2880);
  EXPECT_EQ(m.vocab_size, 201088);
  EXPECT_EQ(m.max_position_embeddings, 131072);
  EXPECT_EQ(m.num_heads, 64);
  EXPECT_EQ(m.num_kv_heads, 8);
  EXPECT_EQ(m.head_dim, 64);
  EXPECT_EQ(m.v_head_dim, 64);
  EXPECT_TRUE(m.qkv_bias && m.o_bias && m.attention_sinks && m.router_bias && m.expert_bias);
  EXPECT_EQ(m.num_experts, 128);
  EXPECT_EQ(m.top_k, 4);
  EXPECT_EQ(m.expert_ffn_width, 2880);
  EXPECT_EQ(m.count_layers(FfnKind::Moe), 36);
  for (size_t i = 0; i < m.layers.size(); ++i) {
    // layer_types alternates sliding_attention (even) and full_attention (odd).
    EXPECT_EQ(m.layers[i].window, i % 2 == 0 ? AttentionWindow::Sliding : AttentionWindow::Full) << i;
    EXPECT_EQ(m.layers[i].attention_window_tokens, i % 2 == 0 ? 128 : 0) << i;
  }
  EXPECT_EQ(*m.params_total_official, 116830000000);
  EXPECT_EQ(*m.params_active_official, 5130000000);
}

TEST(ModelLoader, ResolvedDimsOfDeepSeekV3) {
  const ModelSpec m = load_model("DeepSeek-V3");
  EXPECT_EQ(m.attention, AttentionKind::Mla);
  EXPECT_EQ(m.num_kv_heads, 128);
  EXPECT_EQ(m.head_dim, 192);
  EXPECT_EQ(m.v_head_dim, 128);
  EXPECT_EQ(m.q_lora_rank, 1536);
  EXPECT_EQ(m.kv_lora_rank, 512);
  EXPECT_EQ(m.dense_ffn_width, 18432);
  EXPECT_EQ(m.num_shared_experts, 1);
  EXPECT_EQ(m.shared_expert_ffn_width, 2048);
  EXPECT_TRUE(m.router_correction_bias);
  EXPECT_FALSE(m.router_bias);
  EXPECT_EQ(m.mtp_layers, 1);
  EXPECT_EQ(m.count_layers(FfnKind::Dense), 3);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(m.layers[static_cast<size_t>(i)].ffn, FfnKind::Dense);
  EXPECT_EQ(m.layers[3].ffn, FfnKind::Moe);
  EXPECT_DOUBLE_EQ(load_model("GLM-4.5").partial_rotary_factor, 0.5);
  EXPECT_EQ(load_model("OLMoE-1B-7B").qk_norm, QkNorm::FullProjection);
  EXPECT_EQ(load_model("Qwen3-235B-A22B").qk_norm, QkNorm::PerHead);
}

TEST(ModelLoader, UnknownNameSuggestsTheNearestCard) {
  try {
    load_model("gpt-oss-12b");
    FAIL() << "expected InputError";
  } catch (const InputError& e) {
    ASSERT_EQ(e.diagnostics().size(), 1u);
    const Diagnostic& d = e.diagnostics()[0];
    EXPECT_EQ(d.to_string(),
              "unknown model 'gpt-oss-12b': not a model card or alias built in from models/*.json (see 'flatpeak "
              "models'), nor a path to a model card or a Hugging Face config.json");
    EXPECT_EQ(d.hint, "did you mean 'gpt-oss-120b'?");
  }
  try {
    load_model("deepseek-ai/DeepSeek-V4");
    FAIL() << "expected InputError";
  } catch (const InputError& e) {
    EXPECT_EQ(e.diagnostics()[0].hint, "did you mean 'deepseek-ai/DeepSeek-V3'?");
  }
}

TEST(ModelLoader, UnknownNameWithoutNearMissListsTheCards) {
  try {
    load_model("llama");
    FAIL() << "expected InputError";
  } catch (const InputError& e) {
    EXPECT_EQ(e.diagnostics()[0].hint,
              "known model cards: DeepSeek-V3, GLM-4.5, gpt-oss-120b, gpt-oss-20b, Mixtral-8x7B, OLMoE-1B-7B, "
              "Qwen3-235B-A22B, Qwen3-30B-A3B");
  }
}

// ---------------------------------------------------------------------------------------------
// Loading from paths

TEST(ModelLoader, LoadsACardFromAPath) {
  TempDir dir;
  json card = embedded_card_json("Mixtral-8x7B");
  card["name"] = "my-mixtral";
  card["num_hidden_layers"] = 16;
  const std::string path = dir.write("my-mixtral.json", card.dump(2));
  const ModelSpec m = load_model(path);
  EXPECT_EQ(m.name, "my-mixtral");
  EXPECT_EQ(m.source, path);
  EXPECT_EQ(m.num_layers, 16);
}

TEST(ModelLoader, ProblemsInACardFileNameTheFile) {
  TempDir dir;
  json card = embedded_card_json("Mixtral-8x7B");
  card["hidden_size"] = 0;
  const std::string path = dir.write("bad.json", card.dump(2));
  try {
    load_model(path);
    FAIL() << "expected InputError";
  } catch (const InputError& e) {
    ASSERT_EQ(e.diagnostics().size(), 1u);
    EXPECT_EQ(e.diagnostics()[0].to_string(), path + ": /hidden_size: must be > 0 (got 0)");
  }
}

TEST(ModelLoader, MalformedJsonReportsLineAndColumn) {
  TempDir dir;
  const std::string path = dir.write("broken.json", "{\n  \"name\": \"x\",\n  \"hidden_size\": ,\n}\n");
  try {
    load_model(path);
    FAIL() << "expected InputError";
  } catch (const InputError& e) {
    ASSERT_EQ(e.diagnostics().size(), 1u);
    EXPECT_EQ(e.diagnostics()[0].file, path);
    EXPECT_EQ(e.diagnostics()[0].pointer, "3:18");
    EXPECT_EQ(e.diagnostics()[0].message.rfind("malformed JSON: syntax error", 0), 0u) << e.diagnostics()[0].message;
  }
}

TEST(ModelLoader, NumberBeyondDoubleRangeIsAnInputError) {
  TempDir dir;
  const std::string path = dir.write("huge.json", "{\"hidden_size\": 1E400}");
  try {
    load_model(path);
    FAIL() << "expected InputError";
  } catch (const InputError& e) {
    ASSERT_EQ(e.diagnostics().size(), 1u);
    EXPECT_EQ(e.diagnostics()[0].to_string(), path + ": malformed JSON: number overflow parsing '1E400'");
  }
}

TEST(ModelLoader, HuggingFaceConfigPathGoesThroughTheImporter) {
  // Same model both ways: the card and the HF config.json give the same parameter counts.
  const std::string config = std::string(FLATPEAK_TEST_DATA_DIR) + "/hf/Mixtral-8x7B/config.json";
  const ModelSpec imported = load_model(config);
  EXPECT_EQ(imported.architecture, "mixtral");
  EXPECT_EQ(count_params(imported).total, count_params(load_model("Mixtral-8x7B")).total);
  // A snapshot folder stands for its config.json.
  const ModelSpec from_folder = load_model(std::string(FLATPEAK_TEST_DATA_DIR) + "/hf/Mixtral-8x7B");
  EXPECT_EQ(count_params(from_folder).total, count_params(imported).total);
}

TEST(ModelLoader, FolderWithoutConfigIsAnInputError) {
  TempDir dir;
  try {
    load_model(dir.path().string());
    FAIL() << "expected InputError";
  } catch (const InputError& e) {
    EXPECT_EQ(e.diagnostics()[0].to_string(),
              dir.path().string() + ": is a folder without a config.json; give a model card or a config.json");
  }
}

// ---------------------------------------------------------------------------------------------
// Validation rules, one by one, with the exact text

class CardRules : public ::testing::Test {
 protected:
  json gqa = embedded_card_json("Mixtral-8x7B");  // 32 layers, 32/8 heads, 8 experts top-2
  json mla = embedded_card_json("DeepSeek-V3");   // 61 layers, 3 dense, MLA, 1 shared expert
};

TEST_F(CardRules, TheCardsThemselvesAreValid) {
  EXPECT_EQ(problems(gqa), std::vector<std::string>{});
  EXPECT_EQ(problems(mla), std::vector<std::string>{});
}

TEST_F(CardRules, UnknownKeySuggestsTheNearestKey) {
  gqa["num_expert_per_tok"] = gqa["num_experts_per_tok"];
  gqa.erase("num_experts_per_tok");
  EXPECT_EQ(problems(gqa), (std::vector<std::string>{
                               "card.json: /num_expert_per_tok: unknown key (did you mean \"num_experts_per_tok\"?)",
                               "card.json: /num_experts_per_tok: required key is missing",
                           }));
}

TEST_F(CardRules, UnknownKeyWithoutNearMiss) {
  gqa["colour"] = "blue";
  EXPECT_EQ(problems(gqa), std::vector<std::string>{"card.json: /colour: unknown key"});
}

TEST_F(CardRules, UnknownKeyInsideAnObject) {
  gqa["sliding_window"] = {{"tokens", 4096}, {"layer", {{"every", 2}}}};
  EXPECT_EQ(problems(gqa), (std::vector<std::string>{
                               "card.json: /sliding_window/layer: unknown key (did you mean \"layers\"?)",
                               "card.json: /sliding_window/layers: required key is missing",
                           }));
  gqa["sliding_window"] = {{"tokens", 4096}, {"layers", {{"evry", 2}}}};
  EXPECT_EQ(problems(gqa), (std::vector<std::string>{
                               "card.json: /sliding_window/layers/evry: unknown key (did you mean \"every\"?)",
                               "card.json: /sliding_window/layers: must have \"first\" or \"every\"",
                           }));
}

TEST_F(CardRules, ZeroAndNegativeDimensions) {
  gqa["hidden_size"] = 0;
  gqa["vocab_size"] = -5;
  gqa["n_shared_experts"] = -1;
  EXPECT_EQ(problems(gqa), (std::vector<std::string>{
                               "card.json: /hidden_size: must be > 0 (got 0)",
                               "card.json: /vocab_size: must be > 0 (got -5)",
                               "card.json: /n_shared_experts: must be >= 0 (got -1)",
                           }));
}

TEST_F(CardRules, HugeAndNonIntegerNumbers) {
  gqa["hidden_size"] = 9223372036854775808ull;  // 2^63
  gqa["vocab_size"] = 1e30;
  gqa["head_dim"] = 128.0;
  gqa["num_hidden_layers"] = 100000;
  gqa["max_position_embeddings"] = std::numeric_limits<int64_t>::min();
  EXPECT_EQ(problems(gqa), (std::vector<std::string>{
                               "card.json: /num_hidden_layers: must be <= 4096 (got 100000)",
                               "card.json: /hidden_size: must be <= 2147483647 (got 9223372036854775808)",
                               "card.json: /vocab_size: must be an integer (got 1e+30)",
                               "card.json: /max_position_embeddings: must be > 0 (got -9223372036854775808)",
                               "card.json: /head_dim: must be an integer (got 128.0)",
                           }));
}

// Far above any real model, and what the planner can search in seconds: the same bounds as a
// Hugging Face config (4097 layers made the knob search take minutes; 2^31 experts exhausted the
// host memory of the routing tables).
TEST_F(CardRules, LayerAndExpertCountsAreBounded) {
  gqa["num_hidden_layers"] = 4097;
  gqa["n_routed_experts"] = 65537;
  EXPECT_EQ(problems(gqa), (std::vector<std::string>{
                               "card.json: /num_hidden_layers: must be <= 4096 (got 4097)",
                               "card.json: /n_routed_experts: must be <= 65536 (got 65537)",
                           }));
  gqa["num_hidden_layers"] = 4096;
  gqa["n_routed_experts"] = 65536;
  EXPECT_EQ(problems(gqa), std::vector<std::string>{});
}

TEST_F(CardRules, WrongTypes) {
  gqa["hidden_size"] = "4096";
  gqa["tie_word_embeddings"] = "no";
  gqa["name"] = 7;
  gqa["aliases"] = "mixtral";
  gqa["num_attention_heads"] = nullptr;
  gqa["partial_rotary_factor"] = "half";
  EXPECT_EQ(problems(gqa), (std::vector<std::string>{
                               "card.json: /name: must be a string (got 7)",
                               "card.json: /aliases: must be an array of strings (got \"mixtral\")",
                               "card.json: /hidden_size: must be an integer (got \"4096\")",
                               "card.json: /tie_word_embeddings: must be true or false (got \"no\")",
                               "card.json: /num_attention_heads: must be an integer (got null)",
                               "card.json: /partial_rotary_factor: must be a number (got \"half\")",
                           }));
}

TEST_F(CardRules, EnumValues) {
  gqa["attention_type"] = "mha";
  gqa["qk_norm"] = "per-head";
  EXPECT_EQ(problems(gqa), (std::vector<std::string>{
                               "card.json: /attention_type: must be one of \"gqa\", \"mla\" (got \"mha\")",
                               "card.json: /qk_norm: must be one of \"none\", \"per_head\", \"full_projection\" "
                               "(got \"per-head\")",
                           }));
}

TEST_F(CardRules, TopKMustBeWithinTheExperts) {
  gqa["num_experts_per_tok"] = 9;
  EXPECT_EQ(problems(gqa), std::vector<std::string>{
                               "card.json: /num_experts_per_tok: must be in 1..n_routed_experts (got 9, "
                               "n_routed_experts = 8)"});
  gqa["num_experts_per_tok"] = 0;
  EXPECT_EQ(problems(gqa), std::vector<std::string>{
                               "card.json: /num_experts_per_tok: must be in 1..n_routed_experts (got 0, "
                               "n_routed_experts = 8)"});
  gqa["n_routed_experts"] = 0;  // the expert count is itself wrong: top-k is checked alone
  gqa["num_experts_per_tok"] = -2;
  EXPECT_EQ(problems(gqa), (std::vector<std::string>{
                               "card.json: /n_routed_experts: must be > 0 (got 0)",
                               "card.json: /num_experts_per_tok: must be > 0 (got -2)",
                           }));
}

TEST_F(CardRules, KvHeadsMustDivideQueryHeads) {
  gqa["num_key_value_heads"] = 6;
  EXPECT_EQ(problems(gqa), std::vector<std::string>{
                               "card.json: /num_key_value_heads: must divide num_attention_heads (got 6, "
                               "num_attention_heads = 32)"});
}

TEST_F(CardRules, AttentionKeysBelongToTheirKind) {
  gqa["kv_lora_rank"] = 512;
  gqa.erase("head_dim");
  EXPECT_EQ(problems(gqa), (std::vector<std::string>{
                               "card.json: /head_dim: required key is missing",
                               "card.json: /kv_lora_rank: only valid with \"attention_type\": \"mla\"",
                           }));
  mla["head_dim"] = 192;
  mla["num_key_value_heads"] = 16;
  mla["qk_norm"] = "per_head";
  mla.erase("v_head_dim");
  EXPECT_EQ(problems(mla), (std::vector<std::string>{
                               "card.json: /v_head_dim: required key is missing",
                               "card.json: /head_dim: not used with \"attention_type\": \"mla\" (the q/k head width "
                               "is qk_nope_head_dim + qk_rope_head_dim)",
                               "card.json: /num_key_value_heads: must equal num_attention_heads with "
                               "\"attention_type\": \"mla\" (got 16, num_attention_heads = 128)",
                               "card.json: /qk_norm: must be \"none\" with \"attention_type\": \"mla\" (MLA "
                               "normalises its latents instead)",
                           }));
}

TEST_F(CardRules, MlaWithoutQueryLatent) {
  mla.erase("q_lora_rank");
  ASSERT_EQ(problems(mla), std::vector<std::string>{});
  EXPECT_EQ(parse_model_card(mla, "card.json").q_lora_rank, 0);
}

TEST_F(CardRules, LayerIndicesInRange) {
  gqa["dense_layers"] = {0, 32, -1, 0};
  gqa["intermediate_size"] = 14336;
  EXPECT_EQ(problems(gqa), (std::vector<std::string>{
                               "card.json: /dense_layers/1: layer index must be in 0..31 (got 32)",
                               "card.json: /dense_layers/2: layer index must be in 0..31 (got -1)",
                               "card.json: /dense_layers/3: duplicate layer index 0",
                           }));
  mla["dense_layers"] = {{"first", 62}};
  EXPECT_EQ(problems(mla), std::vector<std::string>{"card.json: /dense_layers/first: must be <= 61 (got 62)"});
}

TEST_F(CardRules, LayerSelectionForms) {
  gqa["no_rope_layers"] = {{"first", 2}, {"every", 4}};
  gqa["sliding_window"] = {{"tokens", 4096}, {"layers", {{"every", 2}, {"offset", 2}}}};
  gqa["chunked_attention"] = {{"tokens", 8192}, {"layers", "odd"}};
  EXPECT_EQ(problems(gqa), (std::vector<std::string>{
                               "card.json: /sliding_window/layers/offset: must be <= 1 (got 2)",
                               "card.json: /chunked_attention/layers: must be an array of layer indices, {\"first\": "
                               "k} or {\"every\": n, \"offset\": r} (got \"odd\")",
                               "card.json: /no_rope_layers: give either \"first\" or \"every\", not both",
                           }));
}

TEST_F(CardRules, SlidingAndChunkedLayersAreDisjoint) {
  gqa["sliding_window"] = {{"tokens", 4096}, {"layers", {{"every", 2}}}};
  gqa["chunked_attention"] = {{"tokens", 8192}, {"layers", {1, 2}}};
  EXPECT_EQ(problems(gqa), std::vector<std::string>{
                               "card.json: /chunked_attention/layers: layer 2 is also in /sliding_window/layers"});
  gqa["chunked_attention"] = {{"tokens", 8192}, {"layers", {1, 3}}, {"no_rope", true}};
  EXPECT_EQ(problems(gqa), std::vector<std::string>{"card.json: /chunked_attention/no_rope: unknown key"});
  gqa["chunked_attention"].erase("no_rope");
  gqa["no_rope_layers"] = {{"every", 4}, {"offset", 3}};
  const ModelSpec m = parse_model_card(gqa, "card.json");
  EXPECT_EQ(m.layers[1].window, AttentionWindow::Chunked);
  EXPECT_EQ(m.layers[1].attention_window_tokens, 8192);
  EXPECT_EQ(m.layers[2].window, AttentionWindow::Sliding);
  EXPECT_EQ(m.layers[5].window, AttentionWindow::Full);
  EXPECT_FALSE(m.layers[3].rope);
  EXPECT_TRUE(m.layers[4].rope);
}

TEST_F(CardRules, DenseWidthExactlyWhenALayerIsDense) {
  mla.erase("intermediate_size");
  EXPECT_EQ(problems(mla), std::vector<std::string>{"card.json: /intermediate_size: required key is missing"});
  gqa["intermediate_size"] = 14336;
  EXPECT_EQ(problems(gqa), std::vector<std::string>{
                               "card.json: /intermediate_size: is set but no layer is dense (dense_layers is empty)"});
}

TEST_F(CardRules, SharedWidthExactlyWhenThereAreSharedExperts) {
  mla.erase("shared_expert_intermediate_size");
  EXPECT_EQ(problems(mla),
            std::vector<std::string>{"card.json: /shared_expert_intermediate_size: required key is missing"});
  gqa["shared_expert_intermediate_size"] = 1024;
  EXPECT_EQ(problems(gqa), std::vector<std::string>{
                               "card.json: /shared_expert_intermediate_size: is set but n_shared_experts is 0"});
}

TEST_F(CardRules, SharedExpertGateNeedsASharedExpertAndCountsHParamsALayer) {
  gqa["shared_expert_gate"] = true;
  EXPECT_EQ(problems(gqa), std::vector<std::string>{"card.json: /shared_expert_gate: is true but n_shared_experts is 0: "
                                                    "there is no shared expert to gate"});
  const int64_t ungated = count_params(parse_model_card(mla, "card.json")).shared_experts_per_layer;
  mla["shared_expert_gate"] = true;
  const ModelSpec gated = parse_model_card(mla, "card.json");
  EXPECT_TRUE(gated.shared_expert_gate);
  EXPECT_EQ(count_params(gated).shared_experts_per_layer, ungated + gated.hidden_size);
  mla["shared_expert_gate"] = "yes";
  EXPECT_EQ(problems(mla).size(), 1u);
}

TEST_F(CardRules, WindowNeedsTokensAndLayers) {
  gqa["sliding_window"] = 128;
  EXPECT_EQ(problems(gqa), std::vector<std::string>{
                               "card.json: /sliding_window: must be an object {\"tokens\": n, \"layers\": ...} (got 128)"});
  gqa["sliding_window"] = {{"tokens", 0}, {"layers", json::array()}};
  EXPECT_EQ(problems(gqa), std::vector<std::string>{"card.json: /sliding_window/tokens: must be > 0 (got 0)"});
}

TEST_F(CardRules, OtherValueRules) {
  gqa["partial_rotary_factor"] = 0;
  gqa["params_active_official"] = 50000000000;
  gqa["aliases"] = {"A", "a", ""};
  gqa["architecture"] = "";
  EXPECT_EQ(problems(gqa), (std::vector<std::string>{
                               "card.json: /aliases/1: duplicate alias \"a\"",
                               "card.json: /aliases/2: must not be empty",
                               "card.json: /architecture: must not be empty",
                               "card.json: /partial_rotary_factor: must be in (0, 1] (got 0)",
                               "card.json: /params_active_official: must be <= params_total_official (got "
                               "50000000000, params_total_official = 46700000000)",
                           }));
}

TEST_F(CardRules, RequiredKeys) {
  for (const char* key : {"name", "architecture", "num_hidden_layers", "hidden_size", "vocab_size",
                          "max_position_embeddings", "attention_type", "num_attention_heads", "n_routed_experts",
                          "num_experts_per_tok", "moe_intermediate_size", "num_key_value_heads", "head_dim"}) {
    json card = gqa;
    card.erase(key);
    EXPECT_EQ(problems(card), std::vector<std::string>{"card.json: /" + std::string(key) + ": required key is missing"})
        << key;
  }
  for (const char* key : {"kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"}) {
    json card = mla;
    card.erase(key);
    EXPECT_EQ(problems(card), std::vector<std::string>{"card.json: /" + std::string(key) + ": required key is missing"})
        << key;
  }
}

TEST_F(CardRules, OptionalKeysHaveDocumentedDefaults) {
  for (const char* key : {"aliases", "source", "tie_word_embeddings", "attention_bias", "o_proj_bias", "qk_norm",
                          "attention_sinks", "partial_rotary_factor", "n_shared_experts", "router_bias",
                          "router_correction_bias", "expert_bias", "shared_expert_gate", "dense_layers", "num_nextn_predict_layers",
                          "params_total_official", "params_active_official", "params_official_statement"}) {
    gqa.erase(key);
  }
  const ModelSpec m = parse_model_card(gqa, "card.json");
  EXPECT_FALSE(m.tie_word_embeddings || m.qkv_bias || m.o_bias || m.attention_sinks || m.router_bias ||
               m.router_correction_bias || m.expert_bias || m.shared_expert_gate);
  EXPECT_EQ(m.qk_norm, QkNorm::None);
  EXPECT_DOUBLE_EQ(m.partial_rotary_factor, 1.0);
  EXPECT_EQ(m.num_shared_experts, 0);
  EXPECT_EQ(m.mtp_layers, 0);
  EXPECT_EQ(m.count_layers(FfnKind::Moe), 32);
  EXPECT_FALSE(m.params_total_official.has_value());
  EXPECT_EQ(count_params(m).total, 46702792704);
}

TEST_F(CardRules, NotAnObject) {
  EXPECT_EQ(problems(json::array({1, 2})),
            std::vector<std::string>{"card.json: a model card must be a JSON object (got [1,2])"});
  EXPECT_EQ(problems(json("text")),
            std::vector<std::string>{"card.json: a model card must be a JSON object (got \"text\")"});
}

TEST_F(CardRules, DimsWhoseCountsOverflowAreRejected) {
  for (const char* key : {"hidden_size", "vocab_size", "moe_intermediate_size"}) {
    gqa[key] = std::numeric_limits<int32_t>::max();
  }
  gqa["n_routed_experts"] = 65536;  // the most a card may have
  gqa["num_experts_per_tok"] = 1;
  EXPECT_EQ(problems(gqa), std::vector<std::string>{
                               "card.json: parameter count overflows a 64-bit integer: the model's dimensions are too "
                               "large"});
}

TEST_F(CardRules, EveryProblemIsReportedInOnePass) {
  gqa["hidden_sise"] = 4096;
  gqa.erase("hidden_size");
  gqa["vocab_size"] = 0;
  gqa["num_key_value_heads"] = 5;
  gqa["num_experts_per_tok"] = 9;
  gqa["attention_sinks"] = "yes";
  gqa["dense_layers"] = {40};
  EXPECT_EQ(problems(gqa), (std::vector<std::string>{
                               "card.json: /hidden_sise: unknown key (did you mean \"hidden_size\"?)",
                               "card.json: /hidden_size: required key is missing",
                               "card.json: /vocab_size: must be > 0 (got 0)",
                               "card.json: /num_key_value_heads: must divide num_attention_heads (got 5, "
                               "num_attention_heads = 32)",
                               "card.json: /attention_sinks: must be true or false (got \"yes\")",
                               "card.json: /num_experts_per_tok: must be in 1..n_routed_experts (got 9, "
                               "n_routed_experts = 8)",
                               "card.json: /dense_layers/0: layer index must be in 0..31 (got 40)",
                           }));
}

// ---------------------------------------------------------------------------------------------
// Robustness: mutated and truncated cards give a ModelSpec or an InputError, nothing else.

// SplitMix64: a deterministic generator whose sequence is the same on every platform.
class Random {
 public:
  explicit Random(uint64_t seed) : state_(seed) {}
  uint64_t next() {
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  size_t below(size_t n) { return static_cast<size_t>(next() % n); }

 private:
  uint64_t state_;
};

// JSON pointers of every value in a document (objects and arrays included, root excluded).
void collect_pointers(const json& value, const json::json_pointer& at, std::vector<json::json_pointer>& out) {
  if (value.is_object()) {
    for (const auto& item : value.items()) {
      out.push_back(at / item.key());
      collect_pointers(item.value(), at / item.key(), out);
    }
  } else if (value.is_array()) {
    for (size_t i = 0; i < value.size(); ++i) {
      out.push_back(at / i);
      collect_pointers(value[i], at / i, out);
    }
  }
}

std::vector<json> replacement_values() {
  return {nullptr, true, false, 0, -1, 1, 2, 3, 7, 8, 64, 1e30, -1e30, 0.5, 2.0,
          9223372036854775808ull, std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max(),
          int64_t{1} << 62, std::numeric_limits<int32_t>::max(), int64_t{std::numeric_limits<int32_t>::max()} + 1,
          "", "x", "gqa", "mla", "per_head", "full_projection", json::array(), json::array({0}),
          json::array({0, 1, 2}), json::array({-1}), json::array({1e30}), json::array({"a", "a"}), json::object(),
          json{{"first", 3}}, json{{"every", 2}, {"offset", 1}}, json{{"every", 0}}, json{{"first", -1}},
          json{{"tokens", 128}, {"layers", json::array({0})}}, json{{"tokens", 1e30}, {"layers", "all"}}};
}

// One structural mutation of `card`: replace a value, delete or rename a key, or add one.
std::string mutate(json& card, Random& random, const std::vector<json>& values) {
  std::vector<json::json_pointer> pointers;
  collect_pointers(card, json::json_pointer(), pointers);
  if (pointers.empty()) {
    card = values[random.below(values.size())];
    return "replace root";
  }
  const json::json_pointer target = pointers[random.below(pointers.size())];
  const json::json_pointer parent = target.parent_pointer();
  const std::string key = target.back();
  switch (random.below(6)) {
    case 0:
    case 1:
    case 2:
      card[target] = values[random.below(values.size())];
      return "replace " + target.to_string();
    case 3:
      if (card[parent].is_object()) {
        card[parent].erase(key);
      } else {
        card[parent].erase(static_cast<size_t>(std::stoul(key)));
      }
      return "delete " + target.to_string();
    case 4:
      if (card[parent].is_object()) {
        json value = card[parent][key];
        card[parent].erase(key);
        card[parent][key.substr(0, key.size() / 2) + "x" + key.substr(key.size() / 2)] = value;
        return "rename " + target.to_string();
      }
      card[parent].push_back(values[random.below(values.size())]);
      return "append to " + parent.to_string();
    default:
      if (card[parent].is_object()) card[parent]["extra_" + key] = values[random.below(values.size())];
      return "add key beside " + target.to_string();
  }
}

// One text mutation: truncate at a byte offset, or overwrite a byte or a number with something else.
std::string mutate_text(std::string& text, Random& random) {
  static const char* const kPieces[] = {"1E400", "-1E400", "1e30", "99999999999999999999999", "-0", "null",
                                        "\"", "{", "}", "[", "]", ",", ":", "\\u12", "\xff", ""};
  const size_t offset = random.below(text.size() + 1);
  switch (random.below(3)) {
    case 0:
      text.resize(offset);
      return "truncate at " + std::to_string(offset);
    case 1: {
      const std::string piece = kPieces[random.below(sizeof(kPieces) / sizeof(kPieces[0]))];
      text.replace(offset, std::min<size_t>(1 + random.below(4), text.size() - offset), piece);
      return "splice '" + piece + "' at " + std::to_string(offset);
    }
    default: {
      const size_t digit = text.find_first_of("0123456789", offset);
      if (digit == std::string::npos) return "unchanged";
      const std::string piece = kPieces[random.below(4)];
      text.replace(digit, 1, piece);
      return "number '" + piece + "' at " + std::to_string(digit);
    }
  }
}

TEST(ModelCardRobustness, MutatedAndTruncatedCardsGiveAModelOrAnInputError) {
  const std::vector<json> values = replacement_values();
  TempDir dir;
  Random random(20240611);
  int64_t cases = 0, valid = 0, rejected = 0;

  // Checks one outcome; anything but a ModelSpec or an InputError fails the test with the mutation.
  const auto check = [&](const std::string& label, const auto& load) {
    ++cases;
    try {
      const ModelSpec m = load();
      const ParamCounts p = count_params(m);
      EXPECT_EQ(static_cast<int64_t>(m.layers.size()), m.num_layers) << label;
      EXPECT_TRUE(m.top_k >= 1 && m.top_k <= m.num_experts) << label;
      EXPECT_GT(p.total, 0) << label;
      ++valid;
    } catch (const InputError& e) {
      EXPECT_FALSE(e.diagnostics().empty()) << label;
      for (const auto& d : e.diagnostics()) EXPECT_FALSE(d.message.empty()) << label;
      ++rejected;
    } catch (const std::exception& e) {
      ADD_FAILURE() << label << ": unexpected exception: " << e.what();
    }
  };

  for (const auto& card : embedded_model_cards()) {
    const json original = json::parse(card.json);
    for (int round = 0; round < 150; ++round) {
      json mutant = original;
      std::string label = card.name + ":";
      const size_t mutations = 1 + random.below(3);
      for (size_t i = 0; i < mutations; ++i) label += " " + mutate(mutant, random, values);
      check(label, [&] { return parse_model_card(mutant, "mutant.json"); });
    }
    for (int round = 0; round < 60; ++round) {
      std::string text = card.json;
      const std::string label = card.name + ": " + mutate_text(text, random);
      const std::string path = dir.write("mutant.json", text);
      check(label, [&] { return load_model(path); });
    }
  }
  EXPECT_GE(cases, 1000);
  // Both outcomes occur, so the loop exercises the accepting and the rejecting paths.
  EXPECT_GT(valid, 50);
  EXPECT_GT(rejected, 500);
}

}  // namespace
}  // namespace flatpeak
