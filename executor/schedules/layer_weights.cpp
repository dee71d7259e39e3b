// The decoder layer's weights as caller-owned storage sees them (decoder_layer.h): their shapes
// in storage order, views of a flat buffer (or of a dense part and an expert part: the FSDP
// layout at EP > 1), and the config check the layer runs first.
#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "executor/schedules/decoder_layer.h"

namespace flatpeak::exec {

void check_layer_config(const LayerScheduleConfig& c) {
  if (c.tokens <= 0 || c.hidden <= 0 || c.q_heads <= 0 || c.kv_heads <= 0 || c.head_dim <= 0 || c.shared_ffn < 0 || c.dense_ffn < 0)
    throw std::invalid_argument("layer schedule: every dimension must be positive");
  if (c.q_heads % c.kv_heads != 0)
    throw std::invalid_argument("layer schedule: q_heads must be a multiple of kv_heads");
  if (c.dense_ffn > 0) {
    if (c.experts != 0 || c.shared_ffn != 0 || c.ep != 1)
      throw std::invalid_argument("layer schedule: a dense FFN layer has no experts (experts = 0, shared_ffn = 0, ep = 1)");
  } else {
    if (c.experts <= 0 || c.top_k <= 0 || c.expert_ffn <= 0)
      throw std::invalid_argument("layer schedule: every dimension must be positive");
    if (c.top_k > c.experts) throw std::invalid_argument("layer schedule: top_k must be <= experts");
    if (c.ep < 1 || c.experts % c.ep != 0) throw std::invalid_argument("layer schedule: ep must be >= 1 and divide experts");
  }
  if (c.expert_bias && c.dense_ffn > 0)
    throw std::invalid_argument("layer schedule: expert_bias needs a MoE layer (a dense FFN layer has no experts)");
  if (c.shared_gate && (c.dense_ffn > 0 || c.shared_ffn <= 0))
    throw std::invalid_argument("layer schedule: shared_gate gates shared experts: it needs shared_ffn > 0 in a MoE layer");
  if (c.cp < 1) throw std::invalid_argument("layer schedule: cp must be >= 1");
  if (c.attention_window < 0 || c.attention_chunk < 0)
    throw std::invalid_argument("layer schedule: attention_window and attention_chunk must be >= 0");
  if (c.attention_window > 0 && c.attention_chunk > 0)
    throw std::invalid_argument("layer schedule: a layer has a sliding window or chunks, not both");
  if (c.v_head_dim < 0 || c.q_lora < 0 || c.kv_lora < 0 || c.rope_dim < 0)
    throw std::invalid_argument("layer schedule: v_head_dim, q_lora, kv_lora and rope_dim must be >= 0");
  if (c.kv_lora == 0 && (c.q_lora > 0 || c.rope_dim > 0))
    throw std::invalid_argument("layer schedule: q_lora and rope_dim are MLA's: they need kv_lora > 0");
  if (c.kv_lora > 0) {
    if (c.kv_heads != c.q_heads)
      throw std::invalid_argument("layer schedule: MLA projects per-head K and V: kv_heads must equal q_heads (got " +
                                  std::to_string(c.kv_heads) + " and " + std::to_string(c.q_heads) + ")");
    if (c.rope_dim <= 0 || c.rope_dim >= c.head_dim)
      throw std::invalid_argument("layer schedule: MLA needs 0 < rope_dim < head_dim (got rope_dim " + std::to_string(c.rope_dim) +
                                  ", head_dim " + std::to_string(c.head_dim) + ")");
    if (c.layer_norm) throw std::invalid_argument("layer schedule: MLA runs with RMSNorm norms (layer_norm is not supported)");
  }
  if (c.dtype != DType::BF16 && c.dtype != DType::F32)
    throw std::invalid_argument("layer schedule: storage must be bf16 or f32");
}

int64_t LayerWeightShape::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::vector<LayerWeightShape> layer_weight_shapes(const LayerScheduleConfig& c) {
  const int64_t H = c.hidden, A = c.q_heads, G = c.kv_heads, D = c.head_dim, E = c.experts, F = c.expert_ffn;
  const int64_t Dv = c.v_head_dim > 0 ? c.v_head_dim : D;
  const int64_t EL = E / std::max<int64_t>(1, c.ep);
  std::vector<LayerWeightShape> w = {{"norm1", {H}}};
  if (c.layer_norm) w.push_back({"norm1_bias", {H}});
  if (c.kv_lora > 0) {
    if (c.q_lora > 0) w.insert(w.end(), {{"wq_a", {c.q_lora, H}}, {"q_norm", {c.q_lora}}, {"wq_b", {A * D, c.q_lora}}});
    else w.push_back({"wq", {A * D, H}});
    w.insert(w.end(), {{"wkv_a", {c.kv_lora + c.rope_dim, H}},
                       {"kv_norm", {c.kv_lora}},
                       {"wkv_b", {A * (D - c.rope_dim) + A * Dv, c.kv_lora}}});
  } else {
    w.insert(w.end(), {{"wq", {A * D, H}}, {"wk", {G * D, H}}, {"wv", {G * Dv, H}}});
  }
  w.insert(w.end(), {{"wo", {H, A * Dv}}, {"norm2", {H}}});
  if (c.layer_norm) w.push_back({"norm2_bias", {H}});
  if (c.dense_ffn > 0) {
    w.push_back({"ffn_gate_up", {2 * c.dense_ffn, H}});
    w.push_back({"ffn_down", {H, c.dense_ffn}});
    return w;
  }
  w.push_back({"router", {E, H}});
  w.push_back({"w_gate_up", {EL, 2 * F, H}});
  w.push_back({"w_down", {EL, H, F}});
  if (c.expert_bias) w.push_back({"b_expert", {EL, 2 * F + H}});
  if (c.shared_ffn > 0) {
    w.push_back({"shared_gate_up", {2 * c.shared_ffn, H}});
    w.push_back({"shared_down", {H, c.shared_ffn}});
    if (c.shared_gate) w.push_back({"shared_gate", {1, H}});
  }
  return w;
}

int64_t layer_weight_elems(const LayerScheduleConfig& c) {
  int64_t n = 0;
  for (const auto& w : layer_weight_shapes(c)) n += w.numel();
  return n;
}

void*& layer_weight_ptr(LayerWeightPtrs& w, const std::string& name) {
  if (name == "norm1") return w.norm1;
  if (name == "wq") return w.wq;
  if (name == "wk") return w.wk;
  if (name == "wv") return w.wv;
  if (name == "wo") return w.wo;
  if (name == "norm2") return w.norm2;
  if (name == "norm1_bias") return w.norm1_bias;
  if (name == "norm2_bias") return w.norm2_bias;
  if (name == "router") return w.router;
  if (name == "w_gate_up") return w.w_gate_up;
  if (name == "w_down") return w.w_down;
  if (name == "b_expert") return w.b_expert;
  // A dense layer's FFN is the same SwiGLU MLP over every token as the shared experts: one slot.
  if (name == "shared_gate_up" || name == "ffn_gate_up") return w.shared_gate_up;
  if (name == "shared_down" || name == "ffn_down") return w.shared_down;
  if (name == "shared_gate") return w.shared_gate;
  if (name == "wq_a") return w.wq_a;
  if (name == "q_norm") return w.q_norm;
  if (name == "wq_b") return w.wq_b;
  if (name == "wkv_a") return w.wkv_a;
  if (name == "kv_norm") return w.kv_norm;
  if (name == "wkv_b") return w.wkv_b;
  throw std::invalid_argument("decoder layer: no weight named '" + name + "'");
}

bool is_expert_weight(const std::string& name) { return name == "w_gate_up" || name == "w_down" || name == "b_expert"; }

LayerWeightPtrs layer_weights_in(void* base, const LayerScheduleConfig& c, void* experts) {
  LayerWeightPtrs w;
  auto* p = static_cast<unsigned char*>(base);
  auto* q = static_cast<unsigned char*>(experts);
  const int64_t elem = dtype_bytes(c.dtype);
  for (const auto& s : layer_weight_shapes(c)) {
    unsigned char*& at = experts != nullptr && is_expert_weight(s.name) ? q : p;
    layer_weight_ptr(w, s.name) = at;
    at += s.numel() * elem;
  }
  return w;
}

}  // namespace flatpeak::exec
