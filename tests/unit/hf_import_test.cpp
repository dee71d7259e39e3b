// Hugging Face config.json import: the dims and exact parameter counts of real models, every
// error path with its exact text, and a robustness loop over mutated and truncated configs.
// Fixtures and where they come from: tests/data/hf/SOURCES.md.
#include "spec/hf_import.h"

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "spec/errors.h"
#include "spec/json_util.h"
#include "spec/model_loader.h"
#include "spec/param_count.h"

namespace flatpeak {
namespace {

using nlohmann::json;

std::string fixture_path(const std::string& model) {
  return std::string(FLATPEAK_TEST_DATA_DIR) + "/hf/" + model + "/config.json";
}

json fixture_json(const std::string& model) {
  const std::string path = fixture_path(model);
  return parse_json_text(read_text_file(path), path);
}

ModelSpec import_fixture(const std::string& model) {
  return import_hf_config(fixture_json(model), fixture_path(model));
}

// The diagnostics an import of `config` reports (fails the test when it succeeds).
std::vector<Diagnostic> import_errors(const json& config) {
  try {
    import_hf_config(config, "config.json");
  } catch (const InputError& e) {
    return e.diagnostics();
  }
  ADD_FAILURE() << "expected an InputError for " << config.dump();
  return {};
}

std::string only_error(const json& config) {
  const auto diagnostics = import_errors(config);
  EXPECT_EQ(diagnostics.size(), 1u);
  return diagnostics.empty() ? "" : diagnostics[0].to_string();
}

int64_t count_window(const ModelSpec& m, AttentionWindow window) {
  int64_t n = 0;
  for (const auto& layer : m.layers) n += layer.window == window ? 1 : 0;
  return n;
}

// ---------------------------------------------------------------------------------------------
// The eight reference models: exact integers of ../shared/reference/models/README.md
// ("Exact integers and per-layer building blocks"), the same the card path must give.

struct ReferenceCounts {
  const char* model;
  int64_t total;
  int64_t active;                 // excludes the input embedding, includes the lm head
  int64_t active_with_embedding;
  int64_t embedding;
  int64_t attention_per_layer;
  int64_t dense_layer;            // 0 where the model has no dense layer
  int64_t moe_layer_total;
  int64_t moe_layer_active;
  int64_t mtp;
};

const ReferenceCounts kReference[] = {
    {"DeepSeek-V3", 671026419200, 36625618432, 37552297472, 926679040, 187107328, 583483392, 11507286272,
     585318656, 11610068224},
    {"GLM-4.5", 352797829024, 32856319904, 33632266144, 775946240, 136329472, 325083392, 3935625632, 349495712,
     3988069792},
    {"Mixtral-8x7B", 46702792704, 12748853248, 12879925248, 131072000, 41943040, 0, 1451270144, 394305536, 0},
    {"OLMoE-1B-7B", 6919161856, 1178994688, 1282017280, 103022592, 16781312, 0, 419569664, 67248128, 0},
    {"Qwen3-235B-A22B", 235093634560, 21568433664, 22190763520, 622329856, 71303424, 0, 2487755008, 222830848, 0},
    {"Qwen3-30B-A3B", 30532122624, 3041867776, 3353032704, 311164928, 18874624, 0, 623120640, 56889600, 0},
    {"gpt-oss-120b", 116829156672, 5132849472, 5711982912, 579133440, 26550144, 0, 3213080192, 126492032, 0},
    {"gpt-oss-20b", 20914757184, 3608307264, 4187440704, 579133440, 26550144, 0, 823186976, 126215456, 0},
};

TEST(HfImport, ReferenceModelsCountExactly) {
  for (const auto& ref : kReference) {
    SCOPED_TRACE(ref.model);
    const ModelSpec m = import_fixture(ref.model);
    const ParamCounts p = count_params(m);
    EXPECT_EQ(p.total, ref.total);
    EXPECT_EQ(p.active, ref.active);
    EXPECT_EQ(p.active_with_embedding, ref.active_with_embedding);
    EXPECT_EQ(p.embedding, ref.embedding);
    EXPECT_EQ(p.lm_head, ref.embedding);  // none of the eight ties its embeddings
    EXPECT_EQ(p.attention_per_layer + p.layer_norms_per_layer, ref.attention_per_layer + 2 * m.hidden_size);
    if (ref.dense_layer > 0) {
      EXPECT_EQ(p.dense_layer_total, ref.dense_layer);
    }
    EXPECT_EQ(p.moe_layer_total, ref.moe_layer_total);
    EXPECT_EQ(p.moe_layer_active, ref.moe_layer_active);
    EXPECT_EQ(p.mtp, ref.mtp);
  }
}

// The config.json path and the card path (models/<name>.json) describe the same model.
TEST(HfImport, SameModelAsTheCard) {
  for (const auto& ref : kReference) {
    SCOPED_TRACE(ref.model);
    const ModelSpec hf = load_model(fixture_path(ref.model));  // detected as an HF config by content
    const ModelSpec card = load_model(ref.model);
    EXPECT_EQ(hf.architecture, card.architecture);
    const ParamCounts a = count_params(hf);
    const ParamCounts b = count_params(card);
    EXPECT_EQ(a.total, b.total);
    EXPECT_EQ(a.active, b.active);
    EXPECT_EQ(a.active_with_embedding, b.active_with_embedding);
    EXPECT_EQ(a.mtp, b.mtp);
    ASSERT_EQ(hf.layers.size(), card.layers.size());
    for (size_t i = 0; i < hf.layers.size(); ++i) {
      EXPECT_EQ(hf.layers[i].ffn, card.layers[i].ffn) << "layer " << i;
      EXPECT_EQ(hf.layers[i].window, card.layers[i].window) << "layer " << i;
      EXPECT_EQ(hf.layers[i].attention_window_tokens, card.layers[i].attention_window_tokens) << "layer " << i;
    }
    EXPECT_EQ(hf.head_dim, card.head_dim);
    EXPECT_EQ(hf.v_head_dim, card.v_head_dim);
    EXPECT_EQ(hf.num_kv_heads, card.num_kv_heads);
    EXPECT_EQ(hf.max_position_embeddings, card.max_position_embeddings);
    EXPECT_EQ(hf.qk_norm, card.qk_norm);
    EXPECT_DOUBLE_EQ(hf.partial_rotary_factor, card.partial_rotary_factor);
  }
}

TEST(HfImport, NameArchitectureAndSource) {
  const ModelSpec m = import_fixture("DeepSeek-V3");
  EXPECT_EQ(m.name, "DeepSeek-V3");  // ".../DeepSeek-V3/config.json" is named after its folder
  EXPECT_EQ(m.architecture, "deepseek_v3");
  EXPECT_EQ(m.source, fixture_path("DeepSeek-V3"));
  EXPECT_EQ(import_hf_config(fixture_json("Mixtral-8x7B"), "mixtral.json").name, "mixtral");
}

TEST(HfImport, DeepSeekV3Dims) {
  const ModelSpec m = import_fixture("DeepSeek-V3");
  EXPECT_EQ(m.num_layers, 61);
  ASSERT_EQ(m.layers.size(), 61u);
  EXPECT_EQ(m.count_layers(FfnKind::Dense), 3);  // first_k_dense_replace
  EXPECT_EQ(m.count_layers(FfnKind::Moe), 58);
  EXPECT_EQ(m.layers[2].ffn, FfnKind::Dense);
  EXPECT_EQ(m.layers[3].ffn, FfnKind::Moe);
  EXPECT_EQ(m.attention, AttentionKind::Mla);
  EXPECT_EQ(m.num_heads, 128);
  EXPECT_EQ(m.num_kv_heads, 128);
  EXPECT_EQ(m.q_lora_rank, 1536);
  EXPECT_EQ(m.kv_lora_rank, 512);
  EXPECT_EQ(m.head_dim, 192);  // nope 128 + rope 64
  EXPECT_EQ(m.v_head_dim, 128);
  EXPECT_EQ(m.dense_ffn_width, 18432);
  EXPECT_EQ(m.num_experts, 256);
  EXPECT_EQ(m.top_k, 8);
  EXPECT_EQ(m.expert_ffn_width, 2048);
  EXPECT_EQ(m.num_shared_experts, 1);
  EXPECT_EQ(m.shared_expert_ffn_width, 2048);
  EXPECT_TRUE(m.router_correction_bias);  // topk_method noaux_tc
  EXPECT_EQ(m.mtp_layers, 1);
  EXPECT_EQ(m.max_position_embeddings, 163840);
  EXPECT_EQ(m.vocab_size, 129280);
  EXPECT_EQ(count_window(m, AttentionWindow::Full), 61);
}

TEST(HfImport, GptOssSlidingLayersSinksAndBiases) {
  const ModelSpec m = import_fixture("gpt-oss-120b");
  EXPECT_EQ(m.count_layers(FfnKind::Moe), 36);
  EXPECT_EQ(count_window(m, AttentionWindow::Sliding), 18);
  EXPECT_EQ(m.layers[0].window, AttentionWindow::Sliding);  // even layers slide
  EXPECT_EQ(m.layers[0].attention_window_tokens, 128);
  EXPECT_EQ(m.layers[1].window, AttentionWindow::Full);
  EXPECT_EQ(m.layers[1].attention_window_tokens, 0);
  EXPECT_TRUE(m.attention_sinks && m.qkv_bias && m.o_bias && m.router_bias && m.expert_bias);
  EXPECT_EQ(m.num_experts, 128);  // num_local_experts
  EXPECT_EQ(m.top_k, 4);
  EXPECT_EQ(m.head_dim, 64);  // not 2880 / 64
  EXPECT_EQ(import_fixture("gpt-oss-20b").num_experts, 32);
}

TEST(HfImport, GptOssTopKUnderItsOwnKeyName) {
  json config = fixture_json("gpt-oss-20b");
  config.erase("num_experts_per_tok");  // the config also spells it experts_per_token
  EXPECT_EQ(import_hf_config(config, "config.json").top_k, 4);
}

TEST(HfImport, GptOssDefaultLayerTypesAlternate) {
  json config = fixture_json("gpt-oss-20b");
  config.erase("layer_types");
  const ModelSpec m = import_hf_config(config, "config.json");
  EXPECT_EQ(count_window(m, AttentionWindow::Sliding), 12);
  EXPECT_EQ(m.layers[22].window, AttentionWindow::Sliding);
  EXPECT_EQ(m.layers[23].window, AttentionWindow::Full);
}

TEST(HfImport, Qwen3HeadDimAndSparseStep) {
  const ModelSpec m = import_fixture("Qwen3-235B-A22B");
  EXPECT_EQ(m.head_dim, 128);  // hidden / heads would be 64
  EXPECT_EQ(m.qk_norm, QkNorm::PerHead);
  EXPECT_EQ(m.count_layers(FfnKind::Moe), 94);
  EXPECT_EQ(m.dense_ffn_width, 0);  // intermediate_size is in the config but no layer uses it

  json config = fixture_json("Qwen3-30B-A3B");
  config["decoder_sparse_step"] = 2;    // MoE on layers 1, 3, 5, ...
  config["mlp_only_layers"] = {3, 47};  // ... except these
  const ModelSpec s = import_hf_config(config, "config.json");
  EXPECT_EQ(s.count_layers(FfnKind::Moe), 22);
  EXPECT_EQ(s.layers[1].ffn, FfnKind::Moe);
  EXPECT_EQ(s.layers[3].ffn, FfnKind::Dense);
  EXPECT_EQ(s.layers[4].ffn, FfnKind::Dense);
  EXPECT_EQ(s.dense_ffn_width, 6144);
}

TEST(HfImport, Glm45PartialRotaryBiasAndSharedExpert) {
  const ModelSpec m = import_fixture("GLM-4.5");
  EXPECT_DOUBLE_EQ(m.partial_rotary_factor, 0.5);
  EXPECT_TRUE(m.qkv_bias);
  EXPECT_FALSE(m.o_bias);
  EXPECT_EQ(m.qk_norm, QkNorm::PerHead);
  EXPECT_EQ(m.count_layers(FfnKind::Dense), 3);
  EXPECT_EQ(m.num_shared_experts, 1);
  EXPECT_TRUE(m.router_correction_bias);
  EXPECT_EQ(m.mtp_layers, 1);
  EXPECT_EQ(m.num_kv_heads, 8);
}

TEST(HfImport, MixtralAndOlmoe) {
  const ModelSpec mixtral = import_fixture("Mixtral-8x7B");
  EXPECT_EQ(count_window(mixtral, AttentionWindow::Full), 32);  // sliding_window null
  EXPECT_EQ(mixtral.num_experts, 8);
  EXPECT_EQ(mixtral.top_k, 2);
  EXPECT_EQ(mixtral.expert_ffn_width, 14336);
  json windowed = fixture_json("Mixtral-8x7B");
  windowed["sliding_window"] = 4096;
  EXPECT_EQ(count_window(import_hf_config(windowed, "c.json"), AttentionWindow::Sliding), 32);

  const ModelSpec olmoe = import_fixture("OLMoE-1B-7B");
  EXPECT_EQ(olmoe.qk_norm, QkNorm::FullProjection);
  EXPECT_EQ(olmoe.num_kv_heads, 16);
  EXPECT_EQ(olmoe.num_experts, 64);
}

// ---------------------------------------------------------------------------------------------
// Families with no config in the reference. Expected counts worked out by hand below (the same
// formulas as the reference README: gated FFNs 3·H·F, two RMSNorms per layer, final norm, router
// H·E, untied lm head), then compared with the publishers' headline figures.

// Kimi-K2 (kimi_k2; gogongxt/python scripts/models/kimi_k2_instruct.md): H 7168, V 163840,
// 61 layers = 1 dense (FFN 18432) + 60 MoE, MLA a 64, q_lora 1536, kv_lora 512, nope 128,
// rope 64, v 128; 384 experts top-8 of width 2048, 1 shared expert, noaux_tc correction bias.
//   attention = q: 7168·1536 + 1536 + 1536·64·192 = 29,885,952
//               kv: 7168·(512+64) + 512 + 512·64·(128+128) = 12,517,888
//               o: 64·128·7168 = 58,720,256                           -> 101,124,096
//   dense layer = 101,124,096 + 2·7168 + 3·7168·18432 = 497,500,160
//   expert = 3·7168·2048 = 44,040,192; router = 7168·384 + 384 = 2,752,896
//   MoE layer total = 101,124,096 + 14,336 + 2,752,896 + 44,040,192 (shared) + 384·44,040,192
//                   = 17,059,365,248; active (8 routed) = 500,253,056
//   embedding = lm head = 163840·7168 = 1,174,405,120
//   total  = 2·1,174,405,120 + 7168 + 497,500,160 + 60·17,059,365,248 = 1,026,408,232,448
//   active = 1,174,405,120 + 7168 + 497,500,160 + 60·500,253,056    =    31,687,095,808
// Official: "1T total, 32B activated" (MoonshotAI/Kimi-K2 README). The total also equals, to the
// parameter, the sum of the weight tensors listed for the published checkpoint in the same source.
TEST(HfImport, KimiK2) {
  const ModelSpec m = import_fixture("Kimi-K2");
  EXPECT_EQ(m.architecture, "kimi_k2");
  EXPECT_EQ(m.count_layers(FfnKind::Dense), 1);
  EXPECT_EQ(m.num_heads, 64);
  EXPECT_TRUE(m.router_correction_bias);
  EXPECT_EQ(m.mtp_layers, 0);
  const ParamCounts p = count_params(m);
  EXPECT_EQ(p.attention_per_layer, 101124096);
  EXPECT_EQ(p.dense_layer_total, 497500160);
  EXPECT_EQ(p.moe_layer_total, 17059365248);
  EXPECT_EQ(p.moe_layer_active, 500253056);
  EXPECT_EQ(p.total, 1026408232448);
  EXPECT_EQ(p.active, 31687095808);
  EXPECT_EQ(p.active_with_embedding, 32861500928);
  EXPECT_NEAR(static_cast<double>(p.total), 1.0e12, 0.03e12);          // "1T"
  EXPECT_NEAR(static_cast<double>(p.active_with_embedding), 32e9, 1e9);  // "32B"
}

// MiniMax-M2 (minimax_m2; the publisher's config class defaults, see tests/data/hf/SOURCES.md):
// H 3072, V 200064 untied, 62 layers all MoE, 48 query / 8 kv heads of 128, no biases, RMSNorm
// over the whole q (6144) and k (1024) projections, 256 experts top-8 of width 1536, sigmoid
// routing with a correction bias, 3 MTP modules of one decoder layer.
//   attention = q 3072·6144 + k, v 2·3072·1024 + o 6144·3072 + norms 6144 + 1024 = 44,047,360
//   expert = 3·3072·1536 = 14,155,776; router = 3072·256 + 256 (correction bias) = 786,688
//   MoE layer total  = 44,047,360 + 6144 + 786,688 + 256·14,155,776 = 3,668,718,848
//   MoE layer active = 44,047,360 + 6144 + 786,688 +   8·14,155,776 =   158,086,400
//   total  = 2·614,596,608 + 3072 + 62·3,668,718,848 = 228,689,764,864  (official "230B")
//   active = 614,596,608 + 3072 + 62·158,086,400     =  10,415,956,480  (official "10B"; it is
//            9.80B without the lm head). The MTP modules, outside the total, add 11.06B (3 decoder
//            layers and their 2H x H projections and norms), which the official 230B leaves out.
TEST(HfImport, MiniMaxM2) {
  const ModelSpec m = import_fixture("MiniMax-M2");
  EXPECT_EQ(m.architecture, "minimax_m2");
  EXPECT_EQ(m.qk_norm, QkNorm::FullProjection);
  EXPECT_FALSE(m.qkv_bias);
  EXPECT_FALSE(m.o_bias);
  EXPECT_DOUBLE_EQ(m.partial_rotary_factor, 0.5);
  EXPECT_TRUE(m.router_correction_bias);
  EXPECT_EQ(m.num_shared_experts, 0);
  EXPECT_EQ(m.mtp_layers, 3);
  EXPECT_FALSE(m.tie_word_embeddings);
  EXPECT_EQ(count_window(m, AttentionWindow::Full), 62);
  const ParamCounts p = count_params(m);
  EXPECT_EQ(p.attention_per_layer + p.layer_norms_per_layer, 44047360 + 6144);
  EXPECT_EQ(p.moe_layer_total, 3668718848);
  EXPECT_EQ(p.moe_layer_active, 158086400);
  EXPECT_EQ(p.total, 228689764864);
  EXPECT_EQ(p.active, 10415956480);
  EXPECT_NEAR(static_cast<double>(p.total), 230e9, 2e9);
  EXPECT_NEAR(static_cast<double>(p.active), 10e9, 0.5e9);
  // Found by its class when model_type is a fine-tune's own name.
  json config = fixture_json("MiniMax-M2");
  config["model_type"] = "my_minimax";
  EXPECT_EQ(import_hf_config(config, "c.json").architecture, "minimax_m2");
}

// The HF-native config (transformers' MiniMaxM2Config) has none of the remote-code keys: full
// RoPE unless told otherwise, no MTP modules (transformers builds none), QK norm and the routing
// bias as the model always has them.
TEST(HfImport, MiniMaxM2TransformersKeysOnly) {
  json config = fixture_json("MiniMax-M2");
  for (const char* key : {"rotary_dim", "use_mtp", "num_mtp_modules", "mtp_transformer_layers", "use_qk_norm",
                          "qk_norm_type", "use_routing_bias", "attn_type_list", "shared_intermediate_size"}) {
    config.erase(key);
  }
  const ModelSpec m = import_hf_config(config, "config.json");
  EXPECT_EQ(m.mtp_layers, 0);
  EXPECT_EQ(m.qk_norm, QkNorm::FullProjection);
  EXPECT_TRUE(m.router_correction_bias);
  EXPECT_DOUBLE_EQ(m.partial_rotary_factor, 1.0);
  EXPECT_EQ(count_params(m).total, 228689764864);
  config["qk_norm_type"] = "per_head";
  EXPECT_EQ(import_hf_config(config, "config.json").qk_norm, QkNorm::PerHead);
  config["use_qk_norm"] = false;
  EXPECT_EQ(import_hf_config(config, "config.json").qk_norm, QkNorm::None);
}

// What M2 does not use and the memory model does not express is refused, naming the key.
TEST(HfImport, MiniMaxM2RefusesWhatItCannotModel) {
  auto error_with = [](const char* key, const json& value) {
    json config = fixture_json("MiniMax-M2");
    config[key] = value;
    return only_error(config);
  };
  json linear = json::array();
  for (int i = 0; i < 62; ++i) linear.push_back(i == 7 ? 0 : 1);
  EXPECT_EQ(error_with("attn_type_list", linear),
            "config.json: /attn_type_list: must be all 1 (softmax attention): linear-attention layers are "
            "not modelled (got 0 at layer 7)");
  EXPECT_EQ(error_with("shared_intermediate_size", 512),
            "config.json: /shared_intermediate_size: must be 0: a MiniMax shared expert is not modelled (got 512)");
  EXPECT_EQ(error_with("sliding_window", 4096),
            "config.json: /sliding_window: must be null: MiniMax-M2 attends to the whole context, and windows "
            "are not modelled for minimax_m2 (got 4096)");
  EXPECT_EQ(error_with("attention_bias", true),
            "config.json: /attention_bias: must be false: MiniMax-M2's projections have no biases (got true)");
  EXPECT_EQ(error_with("mtp_transformer_layers", 2),
            "config.json: /mtp_transformer_layers: must be 1: an MTP module of several decoder layers is not "
            "modelled (got 2)");
  EXPECT_EQ(error_with("rotary_dim", 256),
            "config.json: /rotary_dim: must be in 1..head_dim (got 256, head_dim = 128)");
  EXPECT_EQ(error_with("qk_norm_type", "per_token"),
            "config.json: /qk_norm_type: must be \"per_layer\" or \"per_head\" (got \"per_token\")");
  EXPECT_EQ(error_with("num_experts_per_tok", 300),
            "config.json: /num_experts_per_tok: must be in 1..num_local_experts (got 300, num_local_experts = 256)");
}

// ERNIE-4.5-21B-A3B (ernie4_5_moe; transformers' defaults, see tests/data/hf/SOURCES.md): H 2560,
// V 103424 tied, 28 layers = 1 dense (FFN 12288) + 27 MoE, 20 query / 4 kv heads of 128, no
// biases, 64 experts top-6 of width 1536, 2 shared experts (one MLP of 3072), a correction bias.
//   attention = q 2560·2560 + k, v 2·2560·512 + o 2560·2560 = 15,728,640; norms 5120
//   dense layer = 15,728,640 + 5120 + 3·2560·12288 = 110,105,600
//   expert = 3·2560·1536 = 11,796,480; shared = 3·2560·3072 = 23,592,960; router = 64·2560 + 64
//   MoE layer total  = 15,728,640 + 5120 + 163,904 + 23,592,960 + 64·11,796,480 = 794,465,344
//   MoE layer active = ...                                        +  6·11,796,480 = 110,269,504
//   total  = 264,765,440 + 2560 + 110,105,600 + 27·794,465,344 = 21,825,437,888  (official "21B")
//   active = 264,765,440 + 2560 + 110,105,600 + 27·110,269,504 =  3,352,150,208  (official "3B";
//            3.09B without the tied embedding, which flatpeak counts once, as the head)
TEST(HfImport, Ernie45Moe) {
  const ModelSpec m = import_fixture("ERNIE-4.5-21B-A3B");
  EXPECT_EQ(m.architecture, "ernie4_5_moe");
  EXPECT_TRUE(m.tie_word_embeddings);
  EXPECT_TRUE(m.router_correction_bias);
  EXPECT_EQ(m.num_shared_experts, 2);
  EXPECT_EQ(m.shared_expert_ffn_width, 3072);
  EXPECT_EQ(m.dense_ffn_width, 12288);
  EXPECT_EQ(m.layers[0].ffn, FfnKind::Dense);
  for (size_t i = 1; i < m.layers.size(); ++i) EXPECT_EQ(m.layers[i].ffn, FfnKind::Moe) << "layer " << i;
  const ParamCounts p = count_params(m);
  EXPECT_EQ(p.attention_per_layer, 15728640);
  EXPECT_EQ(p.dense_layer_total, 110105600);
  EXPECT_EQ(p.moe_layer_total, 794465344);
  EXPECT_EQ(p.moe_layer_active, 110269504);
  EXPECT_EQ(p.total, 21825437888);
  EXPECT_EQ(p.active, 3352150208);
  EXPECT_NEAR(static_cast<double>(p.total), 21e9, 1e9);
  EXPECT_EQ(p.lm_head, 0);  // tied: the embedding is the head, counted in active once
  EXPECT_NEAR(static_cast<double>(p.active - p.embedding), 3e9, 0.1e9);
}

// Qwen2-57B-A14B (qwen2_moe; see tests/data/hf/SOURCES.md): H 3584, 28 layers, 28/4 heads of 128.
// attention = q 3584² + k, v 2·3584·512 + o 3584² + the q, k, v biases 3584 + 2·512 = 29,364,736;
// norms 7,168; router 64·3584 = 229,376; one expert 3·3584·2560 = 27,525,120, 64 of them
// 1,761,607,680; the shared expert 3·3584·20480 + its gate 3584 = 220,204,544. A MoE layer
// 2,011,413,504, ×28 = 56,319,578,112; embedding and head 2·151936·3584 = 1,089,077,248; final norm
// 3584: total 57,408,658,944 (Qwen: "57B"). Active: a layer with 8 experts 470,006,784, ×28 =
// 13,160,189,952, + head and final norm = 13,704,732,160; with the embedding 14,249,270,784 ("A14B").
TEST(HfImport, Qwen2Moe57B) {
  const ModelSpec m = import_fixture("Qwen2-57B-A14B");
  EXPECT_EQ(m.architecture, "qwen2_moe");
  EXPECT_TRUE(m.qkv_bias);
  EXPECT_FALSE(m.o_bias);
  EXPECT_EQ(m.num_shared_experts, 1);
  EXPECT_EQ(m.shared_expert_ffn_width, 20480);
  EXPECT_TRUE(m.shared_expert_gate);
  EXPECT_FALSE(m.router_correction_bias);
  EXPECT_EQ(m.dense_ffn_width, 0);  // intermediate_size is read only for mlp_only_layers
  EXPECT_EQ(m.count_layers(FfnKind::Moe), 28);
  const ParamCounts p = count_params(m);
  EXPECT_EQ(p.attention_per_layer, 29364736);
  EXPECT_EQ(p.shared_experts_per_layer, 220204544);
  EXPECT_EQ(p.moe_layer_total, 2011413504);
  EXPECT_EQ(p.moe_layer_active, 470006784);
  EXPECT_EQ(p.total, 57408658944);
  EXPECT_EQ(p.active, 13704732160);
  EXPECT_EQ(p.active_with_embedding, 14249270784);
}

// Qwen1.5-MoE-A2.7B: H 2048, 24 layers, 16/16 heads of 128. attention 4·2048² + 3·2048 =
// 16,783,360; norms 4,096; router 60·2048 = 122,880; experts 60·3·2048·1408 = 519,045,120; shared
// 3·2048·5632 + 2048 = 34,605,056. A layer 570,560,512, ×24 = 13,693,452,288, + embedding and head
// 2·151936·2048 = 622,329,856 + 2048: total 14,315,784,192 (Qwen: "14.3B"). Active with the
// embedding: 24·(16,783,360 + 4,096 + 122,880 + 4·8,650,752 + 34,605,056) + 622,331,904 =
// 2,689,173,504 ("2.7B activated").
TEST(HfImport, Qwen15MoeA27B) {
  const ModelSpec m = import_fixture("Qwen1.5-MoE-A2.7B");
  const ParamCounts p = count_params(m);
  EXPECT_EQ(p.moe_layer_total, 570560512);
  EXPECT_EQ(p.total, 14315784192);
  EXPECT_EQ(p.active_with_embedding, 2689173504);
}

// mlp_only_layers and decoder_sparse_step as qwen3_moe reads them; qkv_bias false drops the
// biases; windows are refused, whichever key asks for them.
TEST(HfImport, Qwen2MoeLayersBiasAndWindows) {
  json config = fixture_json("Qwen1.5-MoE-A2.7B");
  config["decoder_sparse_step"] = 2;
  config["mlp_only_layers"] = {1};
  config["qkv_bias"] = false;
  const ModelSpec m = import_hf_config(config, "config.json");
  for (size_t i = 0; i < m.layers.size(); ++i) {
    const bool moe = (i + 1) % 2 == 0 && i != 1;
    EXPECT_EQ(m.layers[i].ffn, moe ? FfnKind::Moe : FfnKind::Dense) << "layer " << i;
  }
  EXPECT_EQ(m.dense_ffn_width, 5632);
  EXPECT_FALSE(m.qkv_bias);
  EXPECT_EQ(count_params(m).attention_per_layer, 4 * 2048 * 2048);
  config = fixture_json("Qwen1.5-MoE-A2.7B");
  config["use_sliding_window"] = true;
  EXPECT_EQ(only_error(config),
            "config.json: /use_sliding_window: must be false: sliding windows are not modelled for qwen2_moe (got true)");
  config.erase("use_sliding_window");
  config["layer_types"] = json::array();
  for (int i = 0; i < 24; ++i) config["layer_types"].push_back(i == 3 ? "sliding_attention" : "full_attention");
  EXPECT_EQ(only_error(config),
            "config.json: /layer_types: must be all \"full_attention\": windowed layers are not modelled for qwen2_moe "
            "(got \"sliding_attention\" at layer 3)");
  config.erase("layer_types");
  config.erase("shared_expert_intermediate_size");
  EXPECT_NE(only_error(config).find("/shared_expert_intermediate_size: required key missing"), std::string::npos);
}

// The layer rule: moe_layer_end_index -1 is the last layer; an interval of 2 with a start of 3
// makes layers 3, 5, 7, ... MoE; transformers' defaults (2 shared experts, tied) when absent.
TEST(HfImport, Ernie45MoeLayersAndDefaults) {
  json config = fixture_json("ERNIE-4.5-21B-A3B");
  config["moe_layer_end_index"] = -1;
  config["moe_layer_start_index"] = 3;
  config["moe_layer_interval"] = 2;
  config.erase("moe_num_shared_experts");
  config.erase("tie_word_embeddings");
  const ModelSpec m = import_hf_config(config, "config.json");
  for (size_t i = 0; i < m.layers.size(); ++i) {
    const bool moe = i >= 3 && (i + 1) % 2 == 0;
    EXPECT_EQ(m.layers[i].ffn, moe ? FfnKind::Moe : FfnKind::Dense) << "layer " << i;
  }
  EXPECT_EQ(m.num_shared_experts, 2);
  EXPECT_TRUE(m.tie_word_embeddings);
  config["use_bias"] = true;
  EXPECT_EQ(only_error(config),
            "config.json: /use_bias: must be false: biases on the MLPs and the head are not modelled (got true)");
  config.erase("use_bias");
  config["moe_layer_start_index"] = 28;
  EXPECT_EQ(only_error(config), "config.json: /moe_layer_start_index: must be at most 27 (got 28)");
}

// DeepSeek-V2-Lite (deepseek_v2; zkkython/llmsim hf_config/deepseek-ai__DeepSeek-V2-Lite.json):
// H 2048, V 102400, 27 layers = 1 dense (FFN 10944) + 26 MoE, MLA a 16 with q_lora_rank null
// (q straight from H), kv_lora 512, nope 128, rope 64, v 128; 64 experts top-6 of width 1408,
// 2 shared experts (one MLP of width 2816); topk_method greedy: no correction bias.
//   attention = q: 2048·16·192 = 6,291,456; kv: 2048·576 + 512 + 512·16·256 = 3,277,312;
//               o: 16·128·2048 = 4,194,304                              -> 13,763,072
//   dense layer = 13,763,072 + 4096 + 3·2048·10944 = 81,007,104
//   expert = 3·2048·1408 = 8,650,752; shared = 3·2048·2816 = 17,301,504; router = 2048·64
//   MoE layer total = 13,763,072 + 4096 + 131,072 + 17,301,504 + 64·8,650,752 = 584,847,872
//   MoE layer active = ... + 6·8,650,752 = 83,104,256
//   total  = 2·209,715,200 + 2048 + 81,007,104 + 26·584,847,872 = 15,706,484,224  (official 15.7B)
//   active = 209,715,200 + 2048 + 81,007,104 + 26·83,104,256    =  2,451,435,008  (official 2.4B)
TEST(HfImport, DeepSeekV2Lite) {
  const ModelSpec m = import_fixture("DeepSeek-V2-Lite");
  EXPECT_EQ(m.architecture, "deepseek_v2");
  EXPECT_EQ(m.q_lora_rank, 0);
  EXPECT_FALSE(m.router_correction_bias);
  EXPECT_EQ(m.num_shared_experts, 2);
  EXPECT_EQ(m.shared_expert_ffn_width, 2816);
  const ParamCounts p = count_params(m);
  EXPECT_EQ(p.attention_per_layer, 13763072);
  EXPECT_EQ(p.moe_layer_total, 584847872);
  EXPECT_EQ(p.total, 15706484224);
  EXPECT_EQ(p.active, 2451435008);
  EXPECT_EQ(p.active_with_embedding, 2661150208);
  EXPECT_NEAR(static_cast<double>(p.total), 15.7e9, 0.05e9);
  EXPECT_NEAR(static_cast<double>(p.active), 2.4e9, 0.1e9);
}

// DeepSeek-V2 (236B) has the V2-Lite layout with a q low-rank projection: 60 layers = 1 dense
// (FFN 12288) + 59 MoE, H 5120, a 128, q_lora 1536, 160 experts top-6 of width 1536, 2 shared
// (the dims of its published config and README; no stored verbatim copy was found, so the
// V2-Lite fixture is edited to them).
//   attention = q: 5120·1536 + 1536 + 1536·128·192 = 45,614,592; kv: 5120·576 + 512 + 512·128·256
//               = 19,726,848; o: 128·128·5120 = 83,886,080                -> 149,227,520
//   dense layer = 149,227,520 + 10,240 + 3·5120·12288 = 337,981,440
//   expert = 3·5120·1536 = 23,592,960; shared = 2 experts; router = 5120·160 = 819,200
//   MoE layer total = 149,227,520 + 10,240 + 819,200 + 47,185,920 + 160·23,592,960 = 3,972,116,480
//   MoE layer active = ... + 6·23,592,960 = 338,800,640
//   total  = 2·524,288,000 + 5120 + 337,981,440 + 59·3,972,116,480 = 235,741,434,880 (official 236B)
//   active = 524,288,000 + 5120 + 337,981,440 + 59·338,800,640   =  20,851,512,320 (official 21B;
//            21.38B with the embedding)
TEST(HfImport, DeepSeekV2WithQLowRank) {
  json config = fixture_json("DeepSeek-V2-Lite");
  config["hidden_size"] = 5120;
  config["num_hidden_layers"] = 60;
  config["num_attention_heads"] = 128;
  config["num_key_value_heads"] = 128;
  config["q_lora_rank"] = 1536;
  config["intermediate_size"] = 12288;
  config["moe_intermediate_size"] = 1536;
  config["n_routed_experts"] = 160;
  config["topk_method"] = "group_limited_greedy";
  const ModelSpec m = import_hf_config(config, "config.json");
  EXPECT_EQ(m.q_lora_rank, 1536);
  EXPECT_FALSE(m.router_correction_bias);
  const ParamCounts p = count_params(m);
  EXPECT_EQ(p.attention_per_layer, 149227520);
  EXPECT_EQ(p.dense_layer_total, 337981440);
  EXPECT_EQ(p.moe_layer_total, 3972116480);
  EXPECT_EQ(p.moe_layer_active, 338800640);
  EXPECT_EQ(p.total, 235741434880);
  EXPECT_EQ(p.active, 20851512320);
  EXPECT_NEAR(static_cast<double>(p.total), 236e9, 0.5e9);
  EXPECT_NEAR(static_cast<double>(p.active), 21e9, 0.5e9);
}

// Llama-4-Scout (llama4, text_config): H 5120, V 202048, 48 layers all MoE
// (interleave_moe_layer_step 1), GQA 40/8 heads of 128, 16 experts top-1 of width 8192 plus one
// shared expert of width 8192; use_qk_norm is a weightless L2 norm.
//   attention = 5120·5120 + 2·5120·1024 + 5120·5120 = 62,914,560
//   expert = shared = 3·5120·8192 = 125,829,120; router = 5120·16 = 81,920
//   MoE layer total = 62,914,560 + 10,240 + 81,920 + 125,829,120 + 16·125,829,120 = 2,202,101,760
//   MoE layer active = ... + 1·125,829,120 = 314,664,960
//   total  = 2·1,034,485,760 + 5120 + 48·2,202,101,760 = 107,769,861,120
//   active = 1,034,485,760 + 5120 + 48·314,664,960      =  16,138,408,960 (+ embedding: 17.17B)
// Official: 109B total, 17B active. The 109B also counts the vision encoder and projector, which
// the text model leaves out; 17B matches the active count with the embedding.
TEST(HfImport, Llama4Scout) {
  const ModelSpec m = import_fixture("Llama-4-Scout");
  EXPECT_EQ(m.architecture, "llama4");
  EXPECT_EQ(m.count_layers(FfnKind::Moe), 48);
  EXPECT_EQ(m.dense_ffn_width, 0);
  EXPECT_EQ(m.qk_norm, QkNorm::None);
  EXPECT_EQ(m.num_shared_experts, 1);
  EXPECT_EQ(m.shared_expert_ffn_width, 8192);
  // Every 4th layer is NoPE and attends to the whole context; the others attend within chunks.
  EXPECT_EQ(count_window(m, AttentionWindow::Chunked), 36);
  EXPECT_FALSE(m.layers[3].rope);
  EXPECT_EQ(m.layers[3].window, AttentionWindow::Full);
  EXPECT_TRUE(m.layers[0].rope);
  EXPECT_EQ(m.layers[0].attention_window_tokens, 8192);
  EXPECT_EQ(m.max_position_embeddings, 262144);
  const ParamCounts p = count_params(m);
  EXPECT_EQ(p.moe_layer_total, 2202101760);
  EXPECT_EQ(p.total, 107769861120);
  EXPECT_EQ(p.active, 16138408960);
  EXPECT_EQ(p.active_with_embedding, 17172894720);
  EXPECT_NEAR(static_cast<double>(p.active_with_embedding), 17e9, 0.5e9);
}

// Llama-4-Maverick (NVIDIA/TensorRT-LLM test fixture restored to 48 layers): as Scout but 128
// experts and interleave_moe_layer_step 2 — MoE on layers 1, 3, ..., 47; the 24 others are dense
// with FFN width intermediate_size_mlp 16384.
//   dense layer = 62,914,560 + 10,240 + 3·5120·16384 = 314,583,040
//   MoE layer total = 62,914,560 + 10,240 + 5120·128 + 125,829,120 + 128·125,829,120
//                   = 16,295,536,640; active = 315,238,400
//   total  = 2·1,034,485,760 + 5120 + 24·314,583,040 + 24·16,295,536,640 = 400,711,848,960
//   active = 1,034,485,760 + 5120 + 24·314,583,040 + 24·315,238,400     =  16,150,205,440
// Official: 400B total, 17B active (17.18B with the embedding).
TEST(HfImport, Llama4Maverick) {
  const ModelSpec m = import_fixture("Llama-4-Maverick");
  EXPECT_EQ(m.count_layers(FfnKind::Moe), 24);
  EXPECT_EQ(m.layers[0].ffn, FfnKind::Dense);
  EXPECT_EQ(m.layers[1].ffn, FfnKind::Moe);
  EXPECT_EQ(m.dense_ffn_width, 16384);
  EXPECT_EQ(m.expert_ffn_width, 8192);
  const ParamCounts p = count_params(m);
  EXPECT_EQ(p.dense_layer_total, 314583040);
  EXPECT_EQ(p.moe_layer_total, 16295536640);
  EXPECT_EQ(p.total, 400711848960);
  EXPECT_EQ(p.active, 16150205440);
  EXPECT_EQ(p.active_with_embedding, 17184691200);
  EXPECT_NEAR(static_cast<double>(p.total), 400e9, 2e9);
}

TEST(HfImport, Llama4TextOnlyConfigAndExplicitMoeLayers) {
  json config = fixture_json("Llama-4-Maverick")["text_config"];  // model_type llama4_text
  config["moe_layers"] = {0, 1, 2};
  const ModelSpec m = import_hf_config(config, "config.json");
  EXPECT_EQ(m.architecture, "llama4");
  EXPECT_EQ(m.count_layers(FfnKind::Moe), 3);
  EXPECT_EQ(m.layers[3].ffn, FfnKind::Dense);
}

// Qwen3-VL-30B-A3B (qwen3_vl_moe; tests/data/hf/SOURCES.md): the language model under text_config
// is Qwen3-30B-A3B's shape (48 layers, H 2048, 32/4 heads of 128, 128 experts top-8 of 768, per-head
// QK norm, untied), so its counts are that card's, exactly; the vision tower is not counted. A
// config of the text model alone (model_type qwen3_vl_moe_text) reads the same; the wrapper's
// tie_word_embeddings applies when the text model does not say.
TEST(HfImport, Qwen3VlMoeTextModel) {
  const ModelSpec m = import_fixture("Qwen3-VL-30B-A3B-Instruct");
  EXPECT_EQ(m.architecture, "qwen3_vl_moe");
  EXPECT_EQ(m.qk_norm, QkNorm::PerHead);
  EXPECT_FALSE(m.tie_word_embeddings);
  const ParamCounts p = count_params(m), card = count_params(load_model("Qwen3-30B-A3B"));
  EXPECT_EQ(p.total, card.total);
  EXPECT_EQ(p.total, 30532122624);
  EXPECT_EQ(p.active, card.active);
  json text = fixture_json("Qwen3-VL-30B-A3B-Instruct")["text_config"];  // model_type qwen3_vl_moe_text
  EXPECT_EQ(count_params(import_hf_config(text, "config.json")).total, p.total);
  json tied = fixture_json("Qwen3-VL-30B-A3B-Instruct");
  tied["tie_word_embeddings"] = true;
  EXPECT_TRUE(import_hf_config(tied, "config.json").tie_word_embeddings);
  tied["text_config"]["tie_word_embeddings"] = false;
  EXPECT_FALSE(import_hf_config(tied, "config.json").tie_word_embeddings);
  tied["tie_word_embeddings"] = false;
  tied["text_config"]["tie_word_embeddings"] = true;  // the text model's own word wins
  EXPECT_TRUE(import_hf_config(tied, "config.json").tie_word_embeddings);
  tied["text_config"] = json::array();
  EXPECT_EQ(only_error(tied), "config.json: /text_config: must be an object (got [])");
  tied.erase("text_config");
  EXPECT_EQ(only_error(tied), "config.json: /text_config: required key missing");
}

// GLM-4.5V (glm4v_moe; tests/data/hf/SOURCES.md): its language model is glm4_moe's (GLM-4.5-Air's
// dims: 46 layers, layer 0 dense of 10944, then 128 experts top-8 of 1408 and one shared expert, 96
// query and 8 kv heads of 128 with q/k/v biases and none on o, vocab 151552, untied, no MTP). The
// published checkpoint's tensor list gives the language model's count exactly:
//   embedding and lm head 2 · 151552 · 4096 = 1,241,513,984; attention a layer: q 4096·12288 +
//   12288, k and v 4096·1024 + 1024 each, o 12288·4096, two norms 2·4096 = 109,074,432 (× 46);
//   the dense FFN 3 · 4096 · 10944 = 134,479,872; a MoE block 128 · 3 · 4096 · 1408 (experts) +
//   128 · 4096 (router) + 128 (correction bias) + 3 · 4096 · 1408 (shared) = 2,232,418,432 (× 45);
//   final norm 4096: 106,852,251,264. The vision tower's tensors add 858,681,856, the file's total
//   107,710,933,120; the tower is not counted.
TEST(HfImport, Glm45vTextModel) {
  const ModelSpec m = import_fixture("GLM-4.5V");
  EXPECT_EQ(m.architecture, "glm4v_moe");
  EXPECT_EQ(m.num_layers, 46);
  EXPECT_EQ(m.count_layers(FfnKind::Dense), 1);
  EXPECT_EQ(m.num_kv_heads, 8);
  EXPECT_TRUE(m.qkv_bias);
  EXPECT_FALSE(m.o_bias);
  EXPECT_EQ(m.qk_norm, QkNorm::None);
  EXPECT_DOUBLE_EQ(m.partial_rotary_factor, 0.5);
  EXPECT_EQ(m.mtp_layers, 0);
  const ParamCounts p = count_params(m);
  EXPECT_EQ(p.total, 106852251264);
  EXPECT_EQ(p.total + 858681856, 107710933120);
  EXPECT_EQ(p.active, 12803372672);  // GLM: "12B active"
  json text = fixture_json("GLM-4.5V")["text_config"];  // model_type glm4v_moe_text
  EXPECT_EQ(count_params(import_hf_config(text, "config.json")).total, p.total);
  json tied = fixture_json("GLM-4.5V");
  tied["text_config"].erase("tie_word_embeddings");
  tied["tie_word_embeddings"] = true;  // the wrapper's word when the text model does not say
  EXPECT_TRUE(import_hf_config(tied, "config.json").tie_word_embeddings);
  tied["text_config"]["num_nextn_predict_layers"] = 1;
  EXPECT_EQ(import_hf_config(tied, "config.json").mtp_layers, 1);
  // Glm4vMoeTextConfig's defaults: q/k/v biases; its attention has no QK norm whatever the key says.
  tied["text_config"].erase("attention_bias");
  tied["text_config"]["use_qk_norm"] = true;
  const ModelSpec defaults = import_hf_config(tied, "config.json");
  EXPECT_TRUE(defaults.qkv_bias);
  EXPECT_EQ(defaults.qk_norm, QkNorm::None);
  tied.erase("text_config");
  EXPECT_EQ(only_error(tied), "config.json: /text_config: required key missing");
}

// dots.llm1 (dots1; tests/data/hf/SOURCES.md): Qwen3's attention (32 heads of 128, kv 32, per-head
// QK norm, no biases) with DeepSeek-V3's MoE (128 experts top-6 of 1408, 2 shared experts, the
// correction bias; layer 0 dense of 10944), vocab 152064, untied:
//   embedding and lm head 2 · 152064 · 4096 = 1,245,708,288; attention a layer 4 · 4096 · 4096 + QK
//   norms 2 · 128 + two layer norms 2 · 4096 = 67,117,312 (× 62); the dense FFN 3 · 4096 · 10944 =
//   134,479,872; a MoE block 128 · 3 · 4096 · 1408 + 128 · 4096 + 128 + 2 · 3 · 4096 · 1408 =
//   2,249,719,936 (× 61); final norm 4096: 142,774,381,696 ("142B"). Active: six experts, not 128:
//   13,393,734,784, with the embedding 14,016,588,928 ("14B activated").
TEST(HfImport, Dots1) {
  const ModelSpec m = import_fixture("dots.llm1.inst");
  EXPECT_EQ(m.architecture, "dots1");
  EXPECT_EQ(m.count_layers(FfnKind::Dense), 1);
  EXPECT_EQ(m.count_layers(FfnKind::Moe), 61);
  EXPECT_EQ(m.qk_norm, QkNorm::PerHead);
  EXPECT_EQ(m.shared_expert_ffn_width, 2 * 1408);
  EXPECT_TRUE(m.router_correction_bias);
  EXPECT_EQ(count_window(m, AttentionWindow::Full), 62);  // max_window_layers 62 of 62 layers
  const ParamCounts p = count_params(m);
  EXPECT_EQ(p.total, 142774381696);
  EXPECT_EQ(p.active, 13393734784);
  EXPECT_EQ(p.active_with_embedding, 14016588928);

  json config = fixture_json("dots.llm1.inst");
  config["max_window_layers"] = 60;  // sliding_window absent: transformers' default 4096
  ModelSpec w = import_hf_config(config, "config.json");
  EXPECT_EQ(count_window(w, AttentionWindow::Sliding), 2);
  EXPECT_EQ(w.layers[61].attention_window_tokens, 4096);
  config["sliding_window"] = 1024;
  EXPECT_EQ(import_hf_config(config, "config.json").layers[60].attention_window_tokens, 1024);
  config["sliding_window"] = nullptr;  // no window at all
  EXPECT_EQ(count_window(import_hf_config(config, "config.json"), AttentionWindow::Full), 62);
  config["layer_types"] = json::array();
  for (int i = 0; i < 62; ++i) config["layer_types"].push_back(i == 5 ? "sliding_attention" : "full_attention");
  EXPECT_EQ(count_window(import_hf_config(config, "config.json"), AttentionWindow::Full), 62);  // still none
  config["sliding_window"] = 512;
  w = import_hf_config(config, "config.json");  // layer_types wins over max_window_layers
  EXPECT_EQ(count_window(w, AttentionWindow::Sliding), 1);
  EXPECT_EQ(w.layers[5].attention_window_tokens, 512);
  config["layer_types"][3] = "chunked_attention";
  EXPECT_EQ(only_error(config),
            "config.json: /layer_types/3: must be \"sliding_attention\" or \"full_attention\" (got \"chunked_attention\")");
  config = fixture_json("dots.llm1.inst");
  config["max_window_layers"] = nullptr;  // transformers compares each layer index with it
  EXPECT_EQ(only_error(config), "config.json: /max_window_layers: must be an integer when sliding_window is set "
                                "and layer_types is not given (got null)");
  config["sliding_window"] = nullptr;
  EXPECT_EQ(count_window(import_hf_config(config, "config.json"), AttentionWindow::Full), 62);
  config = fixture_json("dots.llm1.inst");
  config.erase("n_shared_experts");
  EXPECT_EQ(only_error(config), "config.json: /n_shared_experts: required key missing");
}

// Phi-3.5-MoE: Mixtral's layout with LayerNorm (weight and bias) norms, q/k/v/o biases and an LM
// head bias. Expected: embedding 32064·4096 = 131,334,144; per layer attention 41,943,040 weights
// + 10,240 biases, norms 2·2·4096, router 16·4096, experts 16·3·4096·6400; final norm 2·4096;
// head 131,334,144 + 32,064. Total 41,873,153,344, the published breakdown's sum exactly
// (Microsoft: "41.9B"); active with the embedding 6,640,999,744 ("6.6B active").
TEST(HfImport, Phi35Moe) {
  const ModelSpec m = import_fixture("Phi-3.5-MoE-instruct");
  EXPECT_EQ(m.architecture, "phimoe");
  EXPECT_TRUE(m.norm_bias);
  EXPECT_TRUE(m.lm_head_bias);
  EXPECT_TRUE(m.qkv_bias);
  EXPECT_TRUE(m.o_bias);
  EXPECT_EQ(m.num_experts, 16);
  EXPECT_EQ(m.top_k, 2);
  EXPECT_EQ(count_window(m, AttentionWindow::Sliding), 32);
  const ParamCounts p = count_params(m);
  EXPECT_EQ(p.layer_norms_per_layer, 4 * 4096);
  EXPECT_EQ(p.final_norm, 2 * 4096);
  EXPECT_EQ(p.lm_head, 131334144 + 32064);
  EXPECT_EQ(p.total, 41873153344);
  EXPECT_EQ(p.active_with_embedding, 6640999744);
  // PhimoeConfig's defaults: no attention or head bias (the norms are LayerNorm whatever the config says).
  json plain = fixture_json("Phi-3.5-MoE-instruct");
  plain.erase("attention_bias");
  plain.erase("lm_head_bias");
  const ModelSpec defaults = import_hf_config(plain, "config.json");
  EXPECT_FALSE(defaults.qkv_bias || defaults.o_bias || defaults.lm_head_bias);
  EXPECT_TRUE(defaults.norm_bias);
  EXPECT_EQ(count_params(defaults).total, 41873153344 - 32 * 10240 - 32064);
  plain["architectures"] = json::array({"PhimoeForCausalLM"});
  plain.erase("model_type");
  EXPECT_EQ(import_hf_config(plain, "config.json").architecture, "phimoe");
}

// ---------------------------------------------------------------------------------------------
// Recognition and errors, with their exact text.

TEST(HfImport, RecognisesConfigsAndListsFamilies) {
  EXPECT_TRUE(looks_like_hf_config(fixture_json("OLMoE-1B-7B")));
  EXPECT_TRUE(looks_like_hf_config(json{{"architectures", {"X"}}}));
  EXPECT_FALSE(looks_like_hf_config(json{{"name", "gpt-oss-120b"}}));
  EXPECT_FALSE(looks_like_hf_config(json::array()));
  // A card with a stray `architectures` (a typo for `architecture`) or `model_type` is a card.
  EXPECT_FALSE(looks_like_hf_config(json{{"name", "x"}, {"architectures", "mixtral"}, {"attention_type", "gqa"}}));
  EXPECT_FALSE(looks_like_hf_config(json{{"model_type", "mixtral"}, {"architecture", "mixtral"}}));
  EXPECT_EQ(supported_hf_architectures().size(), 16u);
}

TEST(HfImport, ArchitecturesIsTheFallBack) {
  json config = fixture_json("Mixtral-8x7B");
  config.erase("model_type");
  EXPECT_EQ(import_hf_config(config, "c.json").architecture, "mixtral");
  config["model_type"] = "my_mixtral_finetune";  // an unknown model_type with a known class
  EXPECT_EQ(import_hf_config(config, "c.json").architecture, "mixtral");
}

TEST(HfImport, UnknownArchitectureListsTheSupportedOnes) {
  EXPECT_EQ(only_error(json{{"model_type", "mamba2"}, {"architectures", {"Mamba2ForCausalLM"}}}),
            "config.json: /model_type: unsupported architecture (got \"mamba2\"); supported: deepseek_v2, "
            "deepseek_v3, kimi_k2, qwen3_moe, gpt_oss, mixtral, glm4_moe, olmoe, llama4, minimax_m2, ernie4_5_moe, qwen2_moe, "
            "qwen3_vl_moe, glm4v_moe, dots1, phimoe");
  EXPECT_EQ(only_error(json{{"architectures", {"BertModel"}}}),
            "config.json: /architectures: unsupported architecture (got [\"BertModel\"]); supported: "
            "deepseek_v2, deepseek_v3, kimi_k2, qwen3_moe, gpt_oss, mixtral, glm4_moe, olmoe, llama4, minimax_m2, ernie4_5_moe, qwen2_moe, "
            "qwen3_vl_moe, glm4v_moe, dots1, phimoe");
  EXPECT_EQ(only_error(json{{"architectures", "MixtralForCausalLM"}}),  // not an array: no class to go by
            "config.json: /model_type: required key missing; supported architectures: deepseek_v2, deepseek_v3, "
            "kimi_k2, qwen3_moe, gpt_oss, mixtral, glm4_moe, olmoe, llama4, minimax_m2, ernie4_5_moe, qwen2_moe, "
            "qwen3_vl_moe, glm4v_moe, dots1, phimoe");
  EXPECT_EQ(only_error(json{{"model_type", 7}}), "config.json: /model_type: must be a string (got 7)");
  EXPECT_EQ(only_error(json::array()), "config.json: a Hugging Face config must be a JSON object (got [])");
}

TEST(HfImport, MissingKeySuggestsANearMissPresentInTheFile) {
  json config = fixture_json("Mixtral-8x7B");
  config.erase("num_experts_per_tok");
  config["num_expert_per_tok"] = 2;
  EXPECT_EQ(only_error(config),
            "config.json: /num_experts_per_tok: required key missing (did you mean \"num_expert_per_tok\", "
            "present in the file?)");
}

TEST(HfImport, MissingKeyNeverSuggestsAKeyTheImporterReads) {
  json config = fixture_json("Qwen3-30B-A3B");
  config.erase("num_experts");  // "num_experts_per_tok" is present but is a key of its own
  EXPECT_EQ(only_error(config), "config.json: /num_experts: required key missing");
}

TEST(HfImport, EveryProblemInOnePass) {
  json config = fixture_json("DeepSeek-V3");
  config["hidden_size"] = 0;
  config["num_hidden_layers"] = -2;
  config["vocab_size"] = "129280";
  config["q_lora_rank"] = 0;
  config["num_experts_per_tok"] = 300;
  config.erase("kv_lora_rank");
  std::vector<std::string> messages;
  for (const auto& d : import_errors(config)) messages.push_back(d.pointer + ": " + d.message);
  const std::vector<std::string> expected = {
      "/num_hidden_layers: must be a positive integer (got -2)",
      "/hidden_size: must be a positive integer (got 0)",
      "/vocab_size: must be an integer (got \"129280\")",
      "/q_lora_rank: must be a positive integer (got 0)",
      "/kv_lora_rank: required key missing",
      "/num_experts_per_tok: must be in 1..n_routed_experts (got 300, n_routed_experts = 256)",
  };
  EXPECT_EQ(messages, expected);
}

TEST(HfImport, TopKLargerThanExperts) {
  json config = fixture_json("Mixtral-8x7B");
  config["num_experts_per_tok"] = 9;
  EXPECT_EQ(only_error(config),
            "config.json: /num_experts_per_tok: must be in 1..num_local_experts (got 9, num_local_experts = 8)");
}

TEST(HfImport, NestedAndListErrorsNameTheirPointer) {
  json llama = fixture_json("Llama-4-Scout");
  llama["text_config"]["num_local_experts"] = 1e30;
  llama["text_config"]["no_rope_layers"] = {1, 2};
  const auto diagnostics = import_errors(llama);
  ASSERT_EQ(diagnostics.size(), 2u);
  EXPECT_EQ(diagnostics[0].to_string(),
            "config.json: /text_config/num_local_experts: must be an integer (got 1e+30)");
  EXPECT_EQ(diagnostics[1].to_string(),
            "config.json: /text_config/no_rope_layers/1: must be at most 1 (got 2)");

  json no_text = fixture_json("Llama-4-Scout");
  no_text.erase("text_config");
  EXPECT_EQ(only_error(no_text), "config.json: /text_config: required key missing");

  json gpt = fixture_json("gpt-oss-20b");
  gpt["layer_types"][5] = "local_attention";
  EXPECT_EQ(only_error(gpt), "config.json: /layer_types/5: must be \"sliding_attention\" or \"full_attention\" "
                             "(got \"local_attention\")");
  gpt["layer_types"] = {"full_attention"};
  EXPECT_EQ(only_error(gpt),
            "config.json: /layer_types: must have one entry per layer (got 1 entries, num_hidden_layers = 24)");

  json qwen = fixture_json("Qwen3-30B-A3B");
  qwen["mlp_only_layers"] = {48};
  EXPECT_EQ(only_error(qwen), "config.json: /mlp_only_layers/0: must be at most 47 (got 48)");
}

TEST(HfImport, AbsurdSizesAreInputErrors) {
  json config = fixture_json("OLMoE-1B-7B");
  config["num_hidden_layers"] = 100000;
  EXPECT_EQ(only_error(config), "config.json: /num_hidden_layers: must be at most 4096 (got 100000)");
  config = fixture_json("OLMoE-1B-7B");
  config["intermediate_size"] = int64_t{1} << 29;
  config["num_experts"] = 65536;
  config["num_experts_per_tok"] = 1;
  EXPECT_EQ(only_error(config),
            "config.json: implausible model size: the dimensions give about 3.67e+18 parameters (limit 1e+15)");
  config = fixture_json("OLMoE-1B-7B");
  config["hidden_size"] = 18446744073709551615u;
  EXPECT_EQ(only_error(config),
            "config.json: /hidden_size: must be at most 1073741824 (got 18446744073709551615)");
}

// ---------------------------------------------------------------------------------------------
// Robustness: deterministic mutations of every fixture (each value replaced by other JSON types,
// zero, negative, huge; each key deleted) and truncations of the text at many byte offsets.
// Each input must give a consistent ModelSpec or an InputError, nothing else.

void expect_model_or_input_error(const std::function<ModelSpec()>& load, const std::string& what) {
  try {
    const ModelSpec m = load();
    ASSERT_EQ(static_cast<int64_t>(m.layers.size()), m.num_layers) << what;
    ASSERT_GE(m.num_layers, 1) << what;
    ASSERT_GE(m.top_k, 1) << what;
    ASSERT_LE(m.top_k, m.num_experts) << what;
    ASSERT_GE(m.hidden_size, 1) << what;
    ASSERT_GE(m.head_dim, 1) << what;
    try {
      const ParamCounts p = count_params(m);
      ASSERT_GT(p.total, 0) << what;
      ASSERT_LE(p.active, p.total) << what;
    } catch (const InputError&) {
      // counts too large for int64 are an input error too
    }
  } catch (const InputError& e) {
    ASSERT_FALSE(e.diagnostics().empty()) << what;
  } catch (const std::exception& e) {
    FAIL() << what << ": unexpected exception: " << e.what();
  }
}

TEST(HfImport, MutatedAndTruncatedConfigsNeverEscapeAsOtherErrors) {
  const std::vector<std::string> models = {"DeepSeek-V3", "GLM-4.5",       "Mixtral-8x7B",  "OLMoE-1B-7B",
                                           "Qwen3-235B-A22B", "Qwen3-30B-A3B", "gpt-oss-120b", "gpt-oss-20b",
                                           "Kimi-K2",     "DeepSeek-V2-Lite", "Llama-4-Scout", "Llama-4-Maverick",
                                           "GLM-4.5V",    "dots.llm1.inst"};
  const std::vector<json> replacements = {
      json(nullptr), json("x"),     json(true), json::array(), json::object(), json(0),
      json(-1),      json(1e30),    json(1.5),  json(int64_t{9223372036854775807}),
      json(uint64_t{18446744073709551615u}),   json(2147483648), json({1, 2, 3})};
  int64_t cases = 0;
  for (const auto& model : models) {
    const json original = fixture_json(model);
    // Mutate every key of the config and, for Llama 4, of its text_config.
    std::vector<std::string> parents = {""};
    if (original.contains("text_config")) parents.push_back("/text_config");
    for (const auto& parent : parents) {
      const json& object = parent.empty() ? original : original.at(json::json_pointer(parent));
      for (const auto& item : object.items()) {
        const json::json_pointer at(parent + "/" + item.key());
        for (const auto& replacement : replacements) {
          json mutated = original;
          mutated[at] = replacement;
          expect_model_or_input_error([&] { return import_hf_config(mutated, "m.json"); },
                                      model + " " + at.to_string() + " = " + replacement.dump());
          ++cases;
        }
        json deleted = original;
        deleted.at(json::json_pointer(parent)).erase(item.key());
        expect_model_or_input_error([&] { return import_hf_config(deleted, "m.json"); },
                                    model + " without " + at.to_string());
        ++cases;
      }
    }
    // Truncations of the text, parsed the way a file is.
    const std::string text = read_text_file(fixture_path(model));
    for (size_t cut = 0; cut < text.size(); cut += 97) {
      expect_model_or_input_error(
          [&] { return import_hf_config(parse_json_text(text.substr(0, cut), "t.json"), "t.json"); },
          model + " truncated at " + std::to_string(cut));
      ++cases;
    }
  }
  EXPECT_GE(cases, 1000);
}

}  // namespace
}  // namespace flatpeak
