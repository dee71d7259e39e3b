// The layer component run (layer_schedule.h): one DecoderLayer (decoder_layer.h) on weights drawn
// from the seed straight into their tracked buffers (or given in LayerInputs), the loss proxy
// Σ y ⊙ r, and the backward with recompute (or the naive reference). Each weight and its gradient
// is its own buffer (category fsdp), allocated in the order of layer_weight_shapes: the weights
// and x in "init", the gradients when the backward starts.
//   LayerScheduleResult r = run_layer_schedule(alloc, config, {});  // layer_schedule.h
#include "executor/schedules/layer_schedule.h"

#include <cmath>
#include <cstring>
#include <stdexcept>
#include <utility>

#include "executor/memory/tensor.h"
#include "executor/schedules/schedule_util.h"

namespace flatpeak::exec {

namespace {

// How an input is drawn from the seed: value(i) = offset + scale · uniform_pm1(stream, first + i).
struct DrawnInput {
  std::string name;
  int64_t numel = 0;
  uint64_t stream = 0;
  float scale = 1.0f, offset = 0.0f;
  int64_t first = 0;  // x and r of CP rank r: the r-th T·H values of the sequence's stream
  float value(int64_t i) const { return offset + scale * uniform_pm1(stream, static_cast<uint64_t>(first + i)); }
};

// Every input in drawing order: input j draws from stream seed·16 + j + 1; x and r from token
// `first_token` of the sequence on.
std::vector<DrawnInput> drawn_inputs(const LayerScheduleConfig& c, int64_t first_token = 0) {
  const int64_t T = c.tokens, H = c.hidden, A = c.q_heads, G = c.kv_heads, D = c.head_dim, E = c.experts, F = c.expert_ffn;
  std::vector<DrawnInput> out;
  auto add = [&](const char* name, int64_t n, float scale, float offset) {
    out.push_back({name, n, c.seed * 16 + out.size() + 1, scale, offset});
  };
  const float inv_h = 1.0f / std::sqrt(static_cast<float>(H));
  add("x", T * H, 1.0f, 0.0f);
  add("r", T * H, 1.0f, 0.0f);
  out[0].first = out[1].first = first_token * H;
  const int64_t Dv = c.v_head_dim > 0 ? c.v_head_dim : D;
  add("norm1", H, 0.1f, 1.0f);
  if (c.kv_lora > 0) {  // MLA: each projection scaled by 1/sqrt of its input width
    if (c.q_lora > 0) {
      add("wq_a", c.q_lora * H, inv_h, 0.0f);
      add("q_norm", c.q_lora, 0.1f, 1.0f);
      add("wq_b", A * D * c.q_lora, 1.0f / std::sqrt(static_cast<float>(c.q_lora)), 0.0f);
    } else {
      add("wq", A * D * H, inv_h, 0.0f);
    }
    add("wkv_a", (c.kv_lora + c.rope_dim) * H, inv_h, 0.0f);
    add("kv_norm", c.kv_lora, 0.1f, 1.0f);
    add("wkv_b", A * (D - c.rope_dim + Dv) * c.kv_lora, 1.0f / std::sqrt(static_cast<float>(c.kv_lora)), 0.0f);
  } else {
    add("wq", A * D * H, inv_h, 0.0f);
    add("wk", G * D * H, inv_h, 0.0f);
    add("wv", G * Dv * H, inv_h, 0.0f);
  }
  add("wo", H * A * Dv, 1.0f / std::sqrt(static_cast<float>(A * Dv)), 0.0f);
  add("norm2", H, 0.1f, 1.0f);
  add("router", E * H, inv_h, 0.0f);
  add("w_gate_up", E * 2 * F * H, inv_h, 0.0f);
  add("w_down", E * H * F, 1.0f / std::sqrt(static_cast<float>(F)), 0.0f);
  if (c.shared_ffn > 0) {
    add("shared_gate_up", 2 * c.shared_ffn * H, inv_h, 0.0f);
    add("shared_down", H * c.shared_ffn, 1.0f / std::sqrt(static_cast<float>(c.shared_ffn)), 0.0f);
    if (c.shared_gate) add("shared_gate", H, inv_h, 0.0f);
  }
  // Last, so that every other input keeps its stream.
  if (c.layer_norm) {
    add("norm1_bias", H, 0.1f, 0.0f);
    add("norm2_bias", H, 0.1f, 0.0f);
  }
  if (c.expert_bias) add("b_expert", E * (2 * F + H), 0.5f, 0.0f);
  return out;
}

// Input `name`'s values: the caller's (LayerInputs::values) or drawn, element by element.
class InputValues {
 public:
  InputValues(const LayerScheduleConfig& c, const LayerInputs& in, const std::string& name, int64_t numel, int64_t first_token) {
    const auto given = in.values.find(name);
    if (given != in.values.end()) {
      given_ = &given->second;
      if (static_cast<int64_t>(given_->size()) != numel)
        throw std::invalid_argument("layer schedule: input '" + name + "' has " + std::to_string(given_->size()) +
                                    " values, not " + std::to_string(numel));
      return;
    }
    for (DrawnInput& d : drawn_inputs(c, first_token))
      if (d.name == name) drawn_ = std::move(d);
    if (drawn_.numel != numel) throw std::invalid_argument("layer schedule: no input '" + name + "' of " + std::to_string(numel) + " values");
  }
  float operator[](int64_t i) const { return given_ != nullptr ? (*given_)[static_cast<size_t>(i)] : drawn_.value(i); }

 private:
  const std::vector<float>* given_ = nullptr;
  DrawnInput drawn_;
};

// A tensor of `shape` in the layer's dtype holding input `name` (rounded to it).
Tensor tensor_of(TrackingAllocator& alloc, const LayerScheduleConfig& c, const LayerInputs& in, const std::string& name,
                 std::vector<int64_t> shape, Category category, int64_t first_token) {
  Tensor t(alloc, c.dtype, std::move(shape), category);
  const InputValues values(c, in, name, t.numel(), first_token);
  for (int64_t i = 0; i < t.numel(); ++i) {
    if (c.dtype == DType::F32) t.data<float>()[i] = values[i];
    else t.data<Bf16>()[i] = f32_to_bf16(values[i]);
  }
  return t;
}

Tensor zeros(TrackingAllocator& alloc, const LayerScheduleConfig& c, std::vector<int64_t> shape, Category category) {
  Tensor t(alloc, c.dtype, std::move(shape), category);
  std::memset(t.raw(), 0, static_cast<size_t>(t.bytes()));  // 0.0 in bf16 and fp32
  return t;
}

StoredValues stored(const Tensor& t) {
  StoredValues out;
  out.dtype = t.dtype();
  const auto* p = static_cast<const unsigned char*>(t.raw());
  out.bytes.assign(p, p + t.numel() * dtype_bytes(t.dtype()));
  return out;
}

}  // namespace

int64_t StoredValues::size() const { return static_cast<int64_t>(bytes.size()) / dtype_bytes(dtype); }

float StoredValues::operator[](int64_t i) const {
  if (dtype == DType::F32) {
    float v;
    std::memcpy(&v, bytes.data() + i * 4, sizeof v);
    return v;
  }
  Bf16 b;
  std::memcpy(&b.bits, bytes.data() + i * 2, sizeof b.bits);
  return to_f32(b);
}

int64_t layer_gradient_elements(const LayerScheduleConfig& c) { return c.tokens * c.hidden + layer_weight_elems(c); }

LayerInputs make_layer_inputs(const LayerScheduleConfig& c) {
  check_layer_config(c);
  LayerInputs in;
  for (const DrawnInput& d : drawn_inputs(c)) {
    std::vector<float>& v = in.values[d.name];
    v.resize(static_cast<size_t>(d.numel));
    for (int64_t i = 0; i < d.numel; ++i) v[static_cast<size_t>(i)] = d.value(i);
  }
  return in;
}

LayerScheduleResult run_layer_schedule(TrackingAllocator& alloc, const LayerScheduleConfig& c, const LayerInputs& in, bool keep_output,
                                       Communicator* cp_group) {
  check_layer_config(c);
  if (c.cp > 1 && (cp_group == nullptr || cp_group->size() != c.cp))
    throw std::invalid_argument("layer schedule: cp = " + std::to_string(c.cp) + " needs a Communicator of that many ranks");
  const int64_t T = c.tokens, H = c.hidden;
  const int64_t first_token = c.cp > 1 ? cp_group->rank() * T : 0;  // this rank's place in the sequence
  alloc.set_phase("init");
  // The gathered weights of the layer's unit (category fsdp), one buffer each, then the boundary x.
  const std::vector<LayerWeightShape> shapes = layer_weight_shapes(c);
  std::vector<Tensor> weights;
  LayerWeightPtrs w;
  for (const auto& s : shapes) {
    weights.push_back(tensor_of(alloc, c, in, s.name, s.shape, Category::Fsdp, 0));
    layer_weight_ptr(w, s.name) = weights.back().raw();
  }
  const Tensor x = tensor_of(alloc, c, in, "x", {T, H}, Category::Boundaries, first_token);
  // The gradient stream starts from r in the storage dtype (activations).
  const TensorSource r_stream = [&] { return tensor_of(alloc, c, in, "r", {T, H}, Category::Activations, first_token); };
  // The unsharded grads of the unit (fsdp, +=), zeroed, one buffer each, when the backward starts.
  std::vector<Tensor> grads;
  const GradSource make_grads = [&] {
    LayerWeightPtrs g;
    for (const auto& s : shapes) {
      grads.push_back(zeros(alloc, c, s.shape, Category::Fsdp));
      layer_weight_ptr(g, s.name) = grads.back().raw();
    }
    return g;
  };

  LayerScheduleResult result;
  const std::string layer = "L" + std::to_string(c.layer_index);
  DecoderLayer run(alloc, c, w, nullptr, cp_group);
  Tensor y = c.checkpointed ? run.forward_no_grad(x, "fwd/" + layer + "/") : run.forward_saving(x, "fwd/" + layer + "/", true, nullptr);
  // The loss proxy Σ y ⊙ r, r rounded to the storage dtype as the gradient stream holds it.
  const InputValues r(c, in, "r", T * H, first_token);
  for (int64_t i = 0; i < T * H; ++i) {
    const float yi = c.dtype == DType::F32 ? y.data<float>()[i] : to_f32(y.data<Bf16>()[i]);
    const float ri = c.dtype == DType::F32 ? r[i] : to_f32(f32_to_bf16(r[i]));
    result.loss += static_cast<double>(yi) * static_cast<double>(ri);
  }
  if (keep_output) result.y = stored(y);
  y.reset();
  if (c.checkpointed) {
    DecoderLayer again(alloc, c, w, nullptr, cp_group);
    again.forward_saving(x, "bwd/" + layer + "/recompute/", false, r_stream);
    const Tensor dx = again.backward(x, "bwd/" + layer + "/", nullptr, make_grads);
    result.grads["x"] = stored(dx);
  } else {
    const Tensor dx = run.backward(x, "bwd/" + layer + "/", r_stream, make_grads);
    result.grads["x"] = stored(dx);
  }
  for (size_t i = 0; i < shapes.size(); ++i) result.grads[shapes[i].name] = stored(grads[i]);
  return result;
}

}  // namespace flatpeak::exec
