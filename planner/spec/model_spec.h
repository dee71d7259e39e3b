// ModelSpec: the resolved architecture of one model, whatever it was loaded from (our card or a
// Hugging Face config.json). Both the planner and the executor size everything from it.
//   ModelSpec m = load_model("gpt-oss-120b");            // model_loader.h
//   int64_t moe_layers = m.count_layers(FfnKind::Moe);
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace flatpeak {

enum class AttentionKind { Gqa, Mla };  // MHA is GQA with num_kv_heads == num_heads
enum class FfnKind { Dense, Moe };
// QK normalisation weights: none; per head (head_dim weights for q and for k, Qwen3, GLM);
// over the whole projection (num_heads*head_dim for q, num_kv_heads*head_dim for k, OLMoE).
enum class QkNorm { None, PerHead, FullProjection };
// How a layer's attention is restricted: full causal; a sliding window of the last
// `attention_window_tokens` tokens (gpt-oss); chunks of `attention_window_tokens` tokens that
// attend only within their chunk (Llama 4).
enum class AttentionWindow { Full, Sliding, Chunked };

struct LayerSpec {
  FfnKind ffn = FfnKind::Moe;
  AttentionWindow window = AttentionWindow::Full;
  int64_t attention_window_tokens = 0;  // 0 when window == Full
  bool rope = true;                     // false for Llama 4's NoPE layers (no effect on memory)
};

struct ModelSpec {
  std::string name;          // card name ("gpt-oss-120b") or the file's name
  std::string architecture;  // Hugging Face model_type: "gpt_oss", "deepseek_v3", ...
  std::string source;        // the file it was read from, or "embedded:<card>"

  int64_t num_layers = 0;    // L, decoder layers (MTP layers not included)
  int64_t hidden_size = 0;   // H
  int64_t vocab_size = 0;    // V
  int64_t max_position_embeddings = 0;
  bool tie_word_embeddings = false;
  bool lm_head_bias = false;  // a bias [V] on the LM head (Phi-3.5-MoE)
  // LayerNorm (a weight and a bias [H] each; mean and rstd saved for the backward) in place of
  // RMSNorm (a weight; rstd saved) for every norm of the model (Phi-3.5-MoE).
  bool norm_bias = false;

  // Attention. For GQA head_dim == v_head_dim == d. For MLA as training materialises it:
  // head_dim = qk_nope_head_dim + qk_rope_head_dim (per-head K and Q), v_head_dim per-head V.
  AttentionKind attention = AttentionKind::Gqa;
  int64_t num_heads = 0;     // a
  int64_t num_kv_heads = 0;  // g (MLA: == num_heads)
  int64_t head_dim = 0;      // d for q and k
  int64_t v_head_dim = 0;    // d for v
  int64_t q_lora_rank = 0;   // MLA: 0 = q projected directly from H
  int64_t kv_lora_rank = 0;  // MLA latent width
  int64_t qk_nope_head_dim = 0;
  int64_t qk_rope_head_dim = 0;
  bool qkv_bias = false;     // biases on q, k, v projections
  bool o_bias = false;       // bias on the output projection
  QkNorm qk_norm = QkNorm::None;
  bool attention_sinks = false;         // one learned logit per query head (gpt-oss)
  double partial_rotary_factor = 1.0;   // fraction of head_dim rotated (GLM 0.5); no memory effect

  // FFN. All FFNs are gated (SwiGLU-style: gate, up, down).
  int64_t dense_ffn_width = 0;          // width of dense layers' FFN (0 when the model has none)
  int64_t num_experts = 0;              // E routed experts
  int64_t top_k = 0;                    // k
  int64_t expert_ffn_width = 0;         // F
  int64_t num_shared_experts = 0;
  int64_t shared_expert_ffn_width = 0;  // total width of the shared-expert MLP (all shared experts)
  // A sigmoid gate on the shared experts' output, one logit per token from an [H -> 1] projection
  // (Qwen2-MoE's shared_expert_gate): H parameters a MoE layer; its backward needs the ungated
  // shared output [T, H] and the gate [T] (memory_terms_layer.cpp).
  bool shared_expert_gate = false;
  bool router_bias = false;             // bias in the router logits (gpt-oss)
  bool router_correction_bias = false;  // selection-only bias per expert (DeepSeek-V3 noaux_tc)
  bool expert_bias = false;             // biases inside each expert's projections (gpt-oss)

  std::vector<LayerSpec> layers;        // size num_layers
  int64_t mtp_layers = 0;               // multi-token-prediction modules, each one decoder layer

  // The publisher's own figures, where known (from our card); shown beside our counts.
  std::optional<int64_t> params_total_official;
  std::optional<int64_t> params_active_official;
  std::string params_official_statement;

  int64_t count_layers(FfnKind kind) const {
    int64_t count = 0;
    for (const auto& layer : layers) count += layer.ffn == kind ? 1 : 0;
    return count;
  }
};

const char* to_string(AttentionKind kind);
const char* to_string(FfnKind kind);
const char* to_string(QkNorm kind);
const char* to_string(AttentionWindow kind);

// How a rank's queries reach the keys of earlier ranks under context parallelism (CP > 1 ranks,
// each holding T consecutive tokens of one sequence). The reach is the most keys any rank's first
// query needs from before the rank's first token: w − 1 for a sliding window of w (its own key is
// the w-th); for chunks of C, max over ranks r of r·T mod C (how far into its chunk a rank
// starts; 0 when C divides T). A reach of at most T fits in the previous rank: a halo of its last
// `halo_rows` = reach keys (none at 0: no keys move). A longer reach, or full attention, takes
// `ring`: every earlier rank's K,V chunk passes by, masked to the window. The planner's terms
// follow it; the executor's decoder layer derives the same from its own mask.
struct CpKeyReach {
  bool ring = true;
  int64_t halo_rows = 0;
};
CpKeyReach cp_key_reach(AttentionWindow window, int64_t window_tokens, int64_t tokens_per_rank, int64_t cp);

}  // namespace flatpeak
