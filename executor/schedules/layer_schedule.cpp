// The layer component run (layer_schedule.h): one DecoderLayer (decoder_layer.h) on weights
// loaded from LayerInputs, the loss proxy Σ y ⊙ r, and the backward with recompute (or the naive
// reference). Each weight and its gradient is its own buffer (category fsdp), allocated in the
// order of layer_weight_shapes: the weights and x in "init", the gradients when the backward starts.
//   LayerScheduleResult r = run_layer_schedule(alloc, config, make_layer_inputs(config));  // layer_schedule.h
#include "executor/schedules/layer_schedule.h"

#include <cmath>
#include <stdexcept>
#include <utility>

#include "executor/memory/tensor.h"
#include "executor/schedules/schedule_util.h"

namespace flatpeak::exec {

namespace {

// A tensor of `shape` in the layer's dtype holding `values` (rounded to it).
Tensor tensor_of(TrackingAllocator& alloc, const LayerScheduleConfig& c, const std::vector<float>& values,
                 std::vector<int64_t> shape, Category category, const std::string& name) {
  Tensor t(alloc, c.dtype, std::move(shape), category);
  if (static_cast<int64_t>(values.size()) != t.numel())
    throw std::invalid_argument("layer schedule: input '" + name + "' has the wrong size");
  for (int64_t i = 0; i < t.numel(); ++i) {
    if (c.dtype == DType::F32) t.data<float>()[i] = values[static_cast<size_t>(i)];
    else t.data<Bf16>()[i] = f32_to_bf16(values[static_cast<size_t>(i)]);
  }
  return t;
}

std::vector<float> widen(const Tensor& t) {
  std::vector<float> out(static_cast<size_t>(t.numel()));
  for (int64_t i = 0; i < t.numel(); ++i)
    out[static_cast<size_t>(i)] = t.dtype() == DType::F32 ? t.data<float>()[i] : to_f32(t.data<Bf16>()[i]);
  return out;
}

}  // namespace

LayerInputs make_layer_inputs(const LayerScheduleConfig& c) {
  check_layer_config(c);
  LayerInputs in;
  const int64_t T = c.tokens, H = c.hidden, A = c.q_heads, G = c.kv_heads, D = c.head_dim, E = c.experts, F = c.expert_ffn;
  uint64_t stream = c.seed * 16;
  auto make = [&](const std::string& name, int64_t n, float scale, float offset) {
    std::vector<float> v(static_cast<size_t>(n));
    const uint64_t s = ++stream;
    for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = offset + scale * uniform_pm1(s, static_cast<uint64_t>(i));
    in.values[name] = std::move(v);
  };
  const float inv_h = 1.0f / std::sqrt(static_cast<float>(H));
  make("x", T * H, 1.0f, 0.0f);
  make("r", T * H, 1.0f, 0.0f);
  make("norm1", H, 0.1f, 1.0f);
  make("wq", A * D * H, inv_h, 0.0f);
  make("wk", G * D * H, inv_h, 0.0f);
  make("wv", G * D * H, inv_h, 0.0f);
  make("wo", H * A * D, 1.0f / std::sqrt(static_cast<float>(A * D)), 0.0f);
  make("norm2", H, 0.1f, 1.0f);
  make("router", E * H, inv_h, 0.0f);
  make("w_gate_up", E * 2 * F * H, inv_h, 0.0f);
  make("w_down", E * H * F, 1.0f / std::sqrt(static_cast<float>(F)), 0.0f);
  if (c.shared_ffn > 0) {
    make("shared_gate_up", 2 * c.shared_ffn * H, inv_h, 0.0f);
    make("shared_down", H * c.shared_ffn, 1.0f / std::sqrt(static_cast<float>(c.shared_ffn)), 0.0f);
  }
  return in;
}

LayerScheduleResult run_layer_schedule(TrackingAllocator& alloc, const LayerScheduleConfig& c, const LayerInputs& in) {
  check_layer_config(c);
  const int64_t T = c.tokens, H = c.hidden;
  alloc.set_phase("init");
  // The gathered weights of the layer's unit (category fsdp), one buffer each, then the boundary x.
  const std::vector<LayerWeightShape> shapes = layer_weight_shapes(c);
  std::vector<Tensor> weights;
  LayerWeightPtrs w;
  for (const auto& s : shapes) {
    weights.push_back(tensor_of(alloc, c, in.values.at(s.name), s.shape, Category::Fsdp, s.name));
    layer_weight_ptr(w, s.name) = weights.back().raw();
  }
  const Tensor x = tensor_of(alloc, c, in.values.at("x"), {T, H}, Category::Boundaries, "x");
  // The gradient stream starts from r in the storage dtype (activations).
  const TensorSource r_stream = [&] { return tensor_of(alloc, c, in.values.at("r"), {T, H}, Category::Activations, "r"); };
  // The unsharded grads of the unit (fsdp, +=), zeroed, one buffer each, when the backward starts.
  std::vector<Tensor> grads;
  const GradSource make_grads = [&] {
    LayerWeightPtrs g;
    for (const auto& s : shapes) {
      grads.push_back(tensor_of(alloc, c, std::vector<float>(static_cast<size_t>(s.numel()), 0.0f), s.shape, Category::Fsdp, s.name));
      layer_weight_ptr(g, s.name) = grads.back().raw();
    }
    return g;
  };

  LayerScheduleResult result;
  const std::string layer = "L" + std::to_string(c.layer_index);
  DecoderLayer run(alloc, c, w);
  Tensor y = c.checkpointed ? run.forward_no_grad(x, "fwd/" + layer + "/") : run.forward_saving(x, "fwd/" + layer + "/", true, nullptr);
  // The loss proxy Σ y ⊙ r, r rounded to the storage dtype as the gradient stream holds it.
  const std::vector<float>& r = in.values.at("r");
  result.y = widen(y);
  for (int64_t i = 0; i < T * H; ++i) {
    const float ri = c.dtype == DType::F32 ? r[static_cast<size_t>(i)] : to_f32(f32_to_bf16(r[static_cast<size_t>(i)]));
    result.loss += static_cast<double>(result.y[static_cast<size_t>(i)]) * static_cast<double>(ri);
  }
  y.reset();
  if (c.checkpointed) {
    DecoderLayer again(alloc, c, w);
    again.forward_saving(x, "bwd/" + layer + "/recompute/", false, r_stream);
    const Tensor dx = again.backward(x, "bwd/" + layer + "/", nullptr, make_grads);
    result.grads["x"] = widen(dx);
  } else {
    const Tensor dx = run.backward(x, "bwd/" + layer + "/", r_stream, make_grads);
    result.grads["x"] = widen(dx);
  }
  for (size_t i = 0; i < shapes.size(); ++i) result.grads[shapes[i].name] = widen(grads[i]);
  return result;
}

}  // namespace flatpeak::exec
