// Parameter counts of the eight model cards, through the card path (load_model by name), against
// the exact integers of ../shared/reference/models/README.md ("Exact integers and per-layer
// building blocks"). Every column of that table is checked.
#include "spec/param_count.h"

#include <gtest/gtest.h>

#include <limits>

#include "spec/errors.h"
#include "spec/model_loader.h"

namespace flatpeak {
namespace {

struct Expected {
  const char* card;
  int64_t total;
  int64_t embedding;
  int64_t lm_head;
  int64_t active;                 // excludes the input embedding, includes the lm head
  int64_t active_with_embedding;
  int64_t attention_per_layer;
  int64_t dense_layer;            // 0 when no layer is dense
  int64_t moe_layer_total;
  int64_t moe_layer_active;
  int64_t mtp;
};

// Copied from the reference table (digits only, separators dropped).
const Expected kReference[] = {
    {"DeepSeek-V3", 671026419200, 926679040, 926679040, 36625618432, 37552297472, 187107328, 583483392,
     11507286272, 585318656, 11610068224},
    {"GLM-4.5", 352797829024, 775946240, 775946240, 32856319904, 33632266144, 136329472, 325083392, 3935625632,
     349495712, 3988069792},
    {"Mixtral-8x7B", 46702792704, 131072000, 131072000, 12748853248, 12879925248, 41943040, 0, 1451270144,
     394305536, 0},
    {"OLMoE-1B-7B", 6919161856, 103022592, 103022592, 1178994688, 1282017280, 16781312, 0, 419569664, 67248128, 0},
    {"Qwen3-235B-A22B", 235093634560, 622329856, 622329856, 21568433664, 22190763520, 71303424, 0, 2487755008,
     222830848, 0},
    {"Qwen3-30B-A3B", 30532122624, 311164928, 311164928, 3041867776, 3353032704, 18874624, 0, 623120640, 56889600,
     0},
    {"gpt-oss-120b", 116829156672, 579133440, 579133440, 5132849472, 5711982912, 26550144, 0, 3213080192,
     126492032, 0},
    {"gpt-oss-20b", 20914757184, 579133440, 579133440, 3608307264, 4187440704, 26550144, 0, 823186976, 126215456, 0},
};

class ReferenceCounts : public ::testing::TestWithParam<Expected> {};

TEST_P(ReferenceCounts, EveryColumnMatchesTheReferenceTable) {
  const Expected& e = GetParam();
  const ModelSpec model = load_model(e.card);
  const ParamCounts p = count_params(model);
  EXPECT_EQ(p.total, e.total);
  EXPECT_EQ(p.embedding, e.embedding);
  EXPECT_EQ(p.lm_head, e.lm_head);
  EXPECT_EQ(p.active, e.active);
  EXPECT_EQ(p.active_with_embedding, e.active_with_embedding);
  EXPECT_EQ(p.attention_per_layer, e.attention_per_layer);
  EXPECT_EQ(p.dense_layer_total, e.dense_layer);
  EXPECT_EQ(p.moe_layer_total, e.moe_layer_total);
  EXPECT_EQ(p.moe_layer_active, e.moe_layer_active);
  EXPECT_EQ(p.mtp, e.mtp);

  // The parts add up to the totals.
  const int64_t dense = model.count_layers(FfnKind::Dense), moe = model.count_layers(FfnKind::Moe);
  EXPECT_EQ(p.total, p.embedding + p.lm_head + p.final_norm + dense * p.dense_layer_total + moe * p.moe_layer_total);
  EXPECT_EQ(p.active, p.lm_head + p.final_norm + dense * p.dense_layer_total + moe * p.moe_layer_active);
  EXPECT_EQ(p.moe_layer_total, p.attention_per_layer + p.layer_norms_per_layer + p.router_per_layer +
                                   model.num_experts * p.expert_params + p.shared_experts_per_layer);
  EXPECT_EQ(p.final_norm, model.hidden_size);
  EXPECT_EQ(p.layer_norms_per_layer, 2 * model.hidden_size);
}

INSTANTIATE_TEST_SUITE_P(Cards, ReferenceCounts, ::testing::ValuesIn(kReference),
                         [](const ::testing::TestParamInfo<Expected>& param_info) {
                           std::string name = param_info.param.card;
                           for (char& c : name) {
                             if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
                           }
                           return name;
                         });

// Hand-derived building blocks that the reference table does not list.
TEST(ParamCount, DeepSeekV3Parts) {
  const ParamCounts p = count_params(load_model("DeepSeek-V3"));
  // Router: 256 x 7168 weights + 256 correction biases (noaux_tc), no logit bias.
  EXPECT_EQ(p.router_per_layer, 256 * 7168 + 256);
  EXPECT_EQ(p.expert_params, 3 * 7168 * 2048);
  EXPECT_EQ(p.shared_experts_per_layer, 3 * 7168 * 2048);
  EXPECT_EQ(p.dense_ffn_per_layer, int64_t{3} * 7168 * 18432);
  // MLA: q_a 7168x1536 + q_a_norm 1536 + q_b 1536x(128*192) + kv_a 7168x(512+64) + kv_a_norm 512
  //      + kv_b 512x(128*(128+128)) + o (128*128)x7168.
  EXPECT_EQ(p.attention_per_layer, int64_t{7168} * 1536 + 1536 + int64_t{1536} * 128 * 192 + int64_t{7168} * 576 +
                                       512 + int64_t{512} * 128 * 256 + int64_t{128} * 128 * 7168);
  // MTP: enorm + hnorm + eh_proj (2H -> H) + one MoE layer + shared_head norm.
  EXPECT_EQ(p.mtp, 2 * 7168 + int64_t{2} * 7168 * 7168 + p.moe_layer_total + 7168);
}

TEST(ParamCount, GptOssBiasesAndSinks) {
  const ParamCounts p = count_params(load_model("gpt-oss-120b"));
  // Router with a logit bias; experts with gate/up biases (F each) and a down bias (H).
  EXPECT_EQ(p.router_per_layer, 2880 * 128 + 128);
  EXPECT_EQ(p.expert_params, 3 * 2880 * 2880 + 2 * 2880 + 2880);
  EXPECT_EQ(p.shared_experts_per_layer, 0);
  EXPECT_EQ(p.dense_ffn_per_layer, 0);
  // q 2880x4096+4096, k and v 2880x512+512, o 4096x2880+2880, 64 sinks.
  EXPECT_EQ(p.attention_per_layer, (2880 * 4096 + 4096) + 2 * (2880 * 512 + 512) + (4096 * 2880 + 2880) + 64);
}

TEST(ParamCount, QkNormScopes) {
  // Qwen3: per-head q and k norms (2 * head_dim); OLMoE: over the whole q and k projections.
  const ParamCounts qwen = count_params(load_model("Qwen3-30B-A3B"));
  EXPECT_EQ(qwen.attention_per_layer, 2048 * 4096 + 2 * 2048 * 512 + 4096 * 2048 + 2 * 128);
  const ParamCounts olmoe = count_params(load_model("OLMoE-1B-7B"));
  EXPECT_EQ(olmoe.attention_per_layer, 4 * 2048 * 2048 + 2048 + 2048);
}

TEST(ParamCount, TiedEmbeddingsCountOnce) {
  ModelSpec model = load_model("Mixtral-8x7B");
  const ParamCounts untied = count_params(model);
  model.tie_word_embeddings = true;
  const ParamCounts tied = count_params(model);
  EXPECT_EQ(tied.lm_head, 0);
  EXPECT_EQ(tied.total, untied.total - untied.lm_head);
  // The head matmul still runs on every token, with the embedding's weights.
  EXPECT_EQ(tied.active, untied.active);
  EXPECT_EQ(tied.active_with_embedding, tied.active);
}

TEST(ParamCount, DirectQueryProjectionForMlaWithoutQLora) {
  ModelSpec model = load_model("DeepSeek-V3");
  const ParamCounts with_lora = count_params(model);
  model.q_lora_rank = 0;  // DeepSeek-V2-Lite style: q projected straight from H
  const ParamCounts direct = count_params(model);
  const int64_t q_lora_part = int64_t{7168} * 1536 + 1536 + int64_t{1536} * 128 * 192;
  EXPECT_EQ(direct.attention_per_layer, with_lora.attention_per_layer - q_lora_part + int64_t{7168} * 128 * 192);
}

TEST(ParamCount, OverflowIsAnInputErrorNotUndefinedBehaviour) {
  ModelSpec model = load_model("Mixtral-8x7B");
  model.hidden_size = std::numeric_limits<int32_t>::max();
  model.vocab_size = std::numeric_limits<int32_t>::max();
  model.expert_ffn_width = std::numeric_limits<int32_t>::max();
  EXPECT_THROW(count_params(model), InputError);
}

}  // namespace
}  // namespace flatpeak
