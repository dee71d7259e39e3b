// Parameter counts by part. Formulas follow the Hugging Face modelling code of each family; the
// exact integers they give for the eight cards in models/ are asserted in
// tests/unit/param_count_test.cpp against ../shared/reference/models/README.md.
// All arithmetic is checked: a spec whose counts do not fit in int64 is an InputError, not UB.
#include "param_count.h"

#include <fmt/format.h>

#include "errors.h"

namespace flatpeak {

namespace {

// int64 arithmetic that throws InputError on overflow instead of wrapping (UB for signed types).
class Checked {
 public:
  explicit Checked(const ModelSpec& model) : model_(model) {}

  int64_t add(int64_t a, int64_t b) const {
    int64_t r = 0;
    if (__builtin_add_overflow(a, b, &r)) overflow();
    return r;
  }
  int64_t mul(int64_t a, int64_t b) const {
    int64_t r = 0;
    if (__builtin_mul_overflow(a, b, &r)) overflow();
    return r;
  }
  int64_t mul(int64_t a, int64_t b, int64_t c) const { return mul(mul(a, b), c); }
  template <typename... Rest>
  int64_t sum(int64_t a, int64_t b, Rest... rest) const {
    if constexpr (sizeof...(rest) == 0) {
      return add(a, b);
    } else {
      return sum(add(a, b), rest...);
    }
  }

 private:
  [[noreturn]] void overflow() const {
    throw InputError(Diagnostic{model_.source, "",
                                "parameter count overflows a 64-bit integer: the model's dimensions are too large",
                                ""});
  }
  const ModelSpec& model_;
};

// Attention weights of one layer (no layer norms): projections, their biases, QK norms, sinks.
int64_t attention_params(const ModelSpec& m, const Checked& c) {
  const int64_t H = m.hidden_size;
  const int64_t a = m.num_heads;
  if (m.attention == AttentionKind::Mla) {
    // DeepSeek MLA: q either through a low-rank latent (q_a_proj, q_a_layernorm, q_b_proj) or
    // projected directly; kv_a_proj_with_mqa [H -> kv_lora + rope], kv_a_layernorm, kv_b_proj
    // [kv_lora -> a * (nope + v)], o_proj [a * v -> H]. No biases, no QK norms.
    const int64_t qk_head = c.add(m.qk_nope_head_dim, m.qk_rope_head_dim);
    int64_t q = 0;
    if (m.q_lora_rank > 0) {
      q = c.sum(c.mul(H, m.q_lora_rank), m.q_lora_rank, c.mul(m.q_lora_rank, a, qk_head));
    } else {
      q = c.mul(H, a, qk_head);
    }
    const int64_t kv = c.sum(c.mul(H, c.add(m.kv_lora_rank, m.qk_rope_head_dim)), m.kv_lora_rank,
                             c.mul(m.kv_lora_rank, a, c.add(m.qk_nope_head_dim, m.v_head_dim)));
    const int64_t o = c.mul(a, m.v_head_dim, H);
    int64_t total = c.sum(q, kv, o);
    if (m.o_bias) total = c.add(total, H);
    if (m.attention_sinks) total = c.add(total, a);
    return total;
  }
  // GQA (MHA when num_kv_heads == num_heads): q [H -> a*d], k and v [H -> g*d], o [a*d -> H].
  // ModelSpec keeps v_head_dim == head_dim for GQA; head_dim alone is used here.
  const int64_t q_width = c.mul(a, m.head_dim);
  const int64_t kv_width = c.mul(m.num_kv_heads, m.head_dim);
  int64_t total = c.sum(c.mul(H, q_width), c.mul(2, H, kv_width), c.mul(q_width, H));
  if (m.qkv_bias) total = c.sum(total, q_width, kv_width, kv_width);
  if (m.o_bias) total = c.add(total, H);
  switch (m.qk_norm) {
    case QkNorm::PerHead: total = c.sum(total, m.head_dim, m.head_dim); break;  // one d-vector each for q, k
    case QkNorm::FullProjection: total = c.sum(total, q_width, kv_width); break;
    case QkNorm::None: break;
  }
  if (m.attention_sinks) total = c.add(total, a);  // one learned logit per query head
  return total;
}

}  // namespace

ParamCounts count_params(const ModelSpec& m) {
  const Checked c(m);
  const int64_t H = m.hidden_size;
  ParamCounts p;

  // A norm: its weight [H], and a bias [H] for LayerNorm.
  const int64_t norm = m.norm_bias ? c.mul(2, H) : H;
  p.embedding = c.mul(m.vocab_size, H);
  p.lm_head = m.tie_word_embeddings ? 0 : c.mul(m.vocab_size, H);
  if (m.lm_head_bias) p.lm_head = c.add(p.lm_head, m.vocab_size);
  p.final_norm = norm;

  p.attention_per_layer = attention_params(m, c);
  p.layer_norms_per_layer = c.mul(2, norm);  // input_layernorm + post_attention_layernorm
  // Gated FFNs: gate and up [H -> F], down [F -> H].
  p.dense_ffn_per_layer = c.mul(3, H, m.dense_ffn_width);
  p.router_per_layer = c.mul(H, m.num_experts);
  if (m.router_bias) p.router_per_layer = c.add(p.router_per_layer, m.num_experts);
  if (m.router_correction_bias) p.router_per_layer = c.add(p.router_per_layer, m.num_experts);
  p.expert_params = c.mul(3, H, m.expert_ffn_width);
  if (m.expert_bias) p.expert_params = c.sum(p.expert_params, m.expert_ffn_width, m.expert_ffn_width, H);
  p.shared_experts_per_layer = c.mul(3, H, m.shared_expert_ffn_width);
  if (m.shared_expert_gate && m.shared_expert_ffn_width > 0) p.shared_experts_per_layer = c.add(p.shared_experts_per_layer, H);  // [H -> 1]

  const int64_t dense_layers = m.count_layers(FfnKind::Dense);
  const int64_t moe_layers = m.count_layers(FfnKind::Moe);
  const int64_t attention_and_norms = c.add(p.attention_per_layer, p.layer_norms_per_layer);
  p.dense_layer_total = dense_layers > 0 ? c.add(attention_and_norms, p.dense_ffn_per_layer) : 0;
  const int64_t moe_common = c.sum(attention_and_norms, p.router_per_layer, p.shared_experts_per_layer);
  p.moe_layer_total = c.add(moe_common, c.mul(m.num_experts, p.expert_params));
  p.moe_layer_active = c.add(moe_common, c.mul(m.top_k, p.expert_params));

  const int64_t layers_total = c.add(c.mul(dense_layers, p.dense_layer_total), c.mul(moe_layers, p.moe_layer_total));
  const int64_t layers_active = c.add(c.mul(dense_layers, p.dense_layer_total), c.mul(moe_layers, p.moe_layer_active));

  p.total = c.sum(p.embedding, p.lm_head, p.final_norm, layers_total);
  // The lm head is a matmul on every token; with tied embeddings its weights are the embedding's.
  const int64_t head_matmul = m.tie_word_embeddings ? p.embedding : p.lm_head;
  p.active = c.sum(head_matmul, p.final_norm, layers_active);
  p.active_with_embedding = m.tie_word_embeddings ? p.active : c.add(p.active, p.embedding);

  // One MTP module (DeepSeek-V3, GLM-4.5): enorm + hnorm + eh_proj [2H -> H] + one decoder layer
  // (MoE when the model has experts) + shared_head norm; embedding and head shared with the model.
  const int64_t mtp_decoder = m.num_experts > 0 ? p.moe_layer_total : p.dense_layer_total;
  const int64_t mtp_module = c.sum(c.mul(2, norm), c.mul(2, H, H), mtp_decoder, norm);
  p.mtp = c.mul(m.mtp_layers, mtp_module);
  return p;
}

}  // namespace flatpeak
