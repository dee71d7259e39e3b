// The checkpoint component run (checkpoint_schedule.h). The recompute in backward calls the same
// functions on the same boundary as the forward pass did, and an offloaded boundary comes back
// bit for bit, so kept, offloaded and naive (no checkpointing) runs give the same bits.
//
// When boundary bytes change: a boundary is allocated or fetched right after its phase is
// entered and released at the end of a phase, after the layer's working set has gone; the one
// exception is x_{l+1}, allocated at the end of fwd/Ll/ffn once that phase's working set is
// freed. So the boundary bytes at each phase's peak are what that phase holds through its work.
#include "executor/schedules/checkpoint_schedule.h"

#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>

#include "executor/memory/tensor.h"
#include "executor/ops/attention.h"
#include "executor/ops/dtype.h"
#include "executor/ops/expert_ffn.h"
#include "executor/ops/linear.h"
#include "executor/ops/rmsnorm.h"
#include "executor/schedules/schedule_util.h"

namespace flatpeak::exec {

namespace {

struct Dims {
  int64_t T = 0, H = 0, F = 0, heads = 0;
};

Tensor bf16(TrackingAllocator& alloc, std::vector<int64_t> shape, Category category,
            MemorySpace space = MemorySpace::Device) {
  return Tensor(alloc, DType::BF16, std::move(shape), category, space);
}
// fp32 scratch of `bytes` for an op's workspace.
Tensor workspace(TrackingAllocator& alloc, int64_t bytes) {
  return Tensor(alloc, DType::F32, {(bytes + 3) / 4}, Category::Activations);
}

// One decoder layer's weights (or their gradients: same shapes, zero-filled).
struct LayerWeights {
  Tensor norm1;      // [H]
  Tensor wq, wk, wv;  // [H, H] each
  Tensor wo;         // [H, H]
  Tensor norm2;      // [H]
  Tensor gate_up;    // [1, 2F, H] (one expert: a dense SwiGLU)
  Tensor down;       // [1, H, F]
  std::vector<Tensor*> all() { return {&norm1, &wq, &wk, &wv, &wo, &norm2, &gate_up, &down}; }
};

LayerWeights make_weights(TrackingAllocator& alloc, const Dims& d, Category category, uint64_t seed) {
  LayerWeights w;
  w.norm1 = bf16(alloc, {d.H}, category);
  w.wq = bf16(alloc, {d.H, d.H}, category);
  w.wk = bf16(alloc, {d.H, d.H}, category);
  w.wv = bf16(alloc, {d.H, d.H}, category);
  w.wo = bf16(alloc, {d.H, d.H}, category);
  w.norm2 = bf16(alloc, {d.H}, category);
  w.gate_up = bf16(alloc, {1, 2 * d.F, d.H}, category);
  w.down = bf16(alloc, {1, d.H, d.F}, category);
  uint64_t index = 0;
  for (Tensor* t : w.all()) {
    Bf16* p = t->data<Bf16>();
    if (category == Category::Grads) {
      for (int64_t i = 0; i < t->numel(); ++i) p[i] = f32_to_bf16(0.0f);
    } else if (t->numel() == d.H) {  // a norm weight: around 1
      for (int64_t i = 0; i < d.H; ++i) p[i] = f32_to_bf16(1.0f + 0.1f * uniform_pm1(seed, index * 1000003 + static_cast<uint64_t>(i)));
    } else {
      fill_bf16(p, t->numel(), seed * 31 + index, 1.0f / std::sqrt(static_cast<float>(t->dim(t->shape().size() - 1))));
    }
    ++index;
  }
  return w;
}

// c = a + b, rounded once to bf16 (the residual and gradient sums).
void add_into(const Tensor& a, const Tensor& b, Tensor& c) {
  const Bf16* pa = a.data<Bf16>();
  const Bf16* pb = b.data<Bf16>();
  Bf16* pc = c.data<Bf16>();
  for (int64_t i = 0; i < c.numel(); ++i) pc[i] = f32_to_bf16(to_f32(pa[i]) + to_f32(pb[i]));
}

void linear_fwd(const Tensor& x, const Tensor& w, Tensor& y, int64_t T, int64_t in, int64_t out) {
  LinearArgs a{DType::BF16, x.raw(), w.raw(), y.raw(), nullptr, nullptr, nullptr, T, in, out};
  linear_forward_cpu(a);
}
void linear_bwd(const Tensor& x, const Tensor& w, const Tensor& dy, Tensor& dx, Tensor& dw, int64_t T, int64_t in, int64_t out) {
  LinearArgs a{DType::BF16, x.raw(), w.raw(), nullptr, dy.raw(), dx.raw(), dw.raw(), T, in, out};
  linear_backward_cpu(a);
}

RmsNormArgs norm_args(const Tensor& x, const Tensor& weight, Tensor& rstd, int64_t T, int64_t H) {
  RmsNormArgs a;
  a.dtype = DType::BF16;
  a.x = x.raw();
  a.weight = weight.raw();
  a.rstd = rstd.data<float>();
  a.tokens = T;
  a.hidden = H;
  return a;
}

// What the attention half of a layer saves for its backward.
struct AttnSaved {
  Tensor n1, rstd1;  // norm-1 output [T, H] bf16, rstd [T] fp32
  Tensor q, k, v;    // [T, heads, H/heads] bf16 each
  Tensor o, lse;     // attention output [T, H] bf16, lse [heads, T] fp32
};
// What the SwiGLU half saves.
struct FfnSaved {
  Tensor n2, rstd2;  // norm-2 output [T, H] bf16, rstd [T] fp32
  Tensor gate_up;    // [T, 2F] bf16 pre-activations
};

AttentionArgs attention_args(const Dims& d, const AttnSaved& s) {
  AttentionArgs a;
  a.dtype = DType::BF16;
  a.q = s.q.raw();
  a.k = s.k.raw();
  a.v = s.v.raw();
  a.out = const_cast<void*>(s.o.raw());
  a.lse = const_cast<float*>(s.lse.data<float>());
  a.tokens = d.T;
  a.q_heads = d.heads;
  a.kv_heads = d.heads;
  a.head_dim = d.H / d.heads;
  return a;
}

// h = x + o_proj(attention(q, k, v of norm1(x))); fills the saved set.
Tensor attention_forward(TrackingAllocator& alloc, const Dims& d, const LayerWeights& w, const Tensor& x, AttnSaved& s) {
  const int64_t T = d.T, H = d.H;
  s.n1 = bf16(alloc, {T, H}, Category::Activations);
  s.rstd1 = Tensor(alloc, DType::F32, {T}, Category::Activations);
  RmsNormArgs n = norm_args(x, w.norm1, s.rstd1, T, H);
  n.out = s.n1.raw();
  rmsnorm_forward_cpu(n);
  s.q = bf16(alloc, {T, H}, Category::Activations);
  s.k = bf16(alloc, {T, H}, Category::Activations);
  s.v = bf16(alloc, {T, H}, Category::Activations);
  linear_fwd(s.n1, w.wq, s.q, T, H, H);
  linear_fwd(s.n1, w.wk, s.k, T, H, H);
  linear_fwd(s.n1, w.wv, s.v, T, H, H);
  s.o = bf16(alloc, {T, H}, Category::Activations);
  s.lse = Tensor(alloc, DType::F32, {d.heads, T}, Category::Activations);
  AttentionArgs a = attention_args(d, s);
  Tensor ws = workspace(alloc, attention_workspace_bytes(a));
  a.workspace = ws.data<float>();
  attention_forward_cpu(a);
  ws.reset();
  Tensor projected = bf16(alloc, {T, H}, Category::Activations);
  linear_fwd(s.o, w.wo, projected, T, H, H);
  Tensor h = bf16(alloc, {T, H}, Category::Activations);
  add_into(x, projected, h);
  return h;
}

// f = SwiGLU(norm2(h)) (the residual is added by the caller); fills the saved set.
Tensor ffn_forward(TrackingAllocator& alloc, const Dims& d, const LayerWeights& w, const Tensor& h, FfnSaved& s) {
  const int64_t T = d.T, H = d.H;
  s.n2 = bf16(alloc, {T, H}, Category::Activations);
  s.rstd2 = Tensor(alloc, DType::F32, {T}, Category::Activations);
  RmsNormArgs n = norm_args(h, w.norm2, s.rstd2, T, H);
  n.out = s.n2.raw();
  rmsnorm_forward_cpu(n);
  s.gate_up = bf16(alloc, {T, 2 * d.F}, Category::Activations);
  Tensor f = bf16(alloc, {T, H}, Category::Activations);
  const int64_t counts[1] = {T};
  ExpertFfnArgs a;
  a.dtype = DType::BF16;
  a.x = s.n2.raw();
  a.expert_counts = counts;
  a.w_gate_up = w.gate_up.raw();
  a.w_down = w.down.raw();
  a.gate_up = s.gate_up.raw();
  a.out = f.raw();
  a.rows = T;
  a.experts = 1;
  a.hidden = H;
  a.ffn = d.F;
  Tensor ws = workspace(alloc, expert_ffn_workspace_bytes(a));
  a.workspace = ws.data<float>();
  expert_ffn_forward_cpu(a);
  return f;
}

// d h = dy + d norm2(h) through the SwiGLU; weight gradients accumulate into g.
Tensor ffn_backward(TrackingAllocator& alloc, const Dims& d, const LayerWeights& w, LayerWeights& g, const Tensor& h,
                    FfnSaved& s, const Tensor& dy) {
  const int64_t T = d.T, H = d.H;
  Tensor d_n2 = bf16(alloc, {T, H}, Category::Activations);
  {
    const int64_t counts[1] = {T};
    ExpertFfnArgs a;
    a.dtype = DType::BF16;
    a.x = s.n2.raw();
    a.expert_counts = counts;
    a.w_gate_up = w.gate_up.raw();
    a.w_down = w.down.raw();
    a.gate_up = s.gate_up.raw();
    a.d_out = dy.raw();
    a.d_x = d_n2.raw();
    a.d_w_gate_up = g.gate_up.raw();
    a.d_w_down = g.down.raw();
    a.rows = T;
    a.experts = 1;
    a.hidden = H;
    a.ffn = d.F;
    Tensor ws = workspace(alloc, expert_ffn_workspace_bytes(a));
    a.workspace = ws.data<float>();
    expert_ffn_backward_cpu(a);
  }
  Tensor d_hn = bf16(alloc, {T, H}, Category::Activations);
  RmsNormArgs n = norm_args(h, w.norm2, s.rstd2, T, H);
  n.d_out = d_n2.raw();
  n.d_x = d_hn.raw();
  n.d_weight = g.norm2.raw();
  Tensor ws = workspace(alloc, rmsnorm_workspace_bytes(n));
  n.workspace = ws.data<float>();
  rmsnorm_backward_cpu(n);
  Tensor d_h = bf16(alloc, {T, H}, Category::Activations);
  add_into(dy, d_hn, d_h);
  return d_h;
}

// d x = d h + d norm1(x) through attention; weight gradients accumulate into g.
Tensor attention_backward(TrackingAllocator& alloc, const Dims& d, const LayerWeights& w, LayerWeights& g, const Tensor& x,
                          AttnSaved& s, const Tensor& d_h) {
  const int64_t T = d.T, H = d.H;
  Tensor d_o = bf16(alloc, {T, H}, Category::Activations);
  linear_bwd(s.o, w.wo, d_h, d_o, g.wo, T, H, H);
  Tensor d_q = bf16(alloc, {T, H}, Category::Activations);
  Tensor d_k = bf16(alloc, {T, H}, Category::Activations);
  Tensor d_v = bf16(alloc, {T, H}, Category::Activations);
  {
    AttentionArgs a = attention_args(d, s);
    a.d_out = d_o.raw();
    a.d_q = d_q.raw();
    a.d_k = d_k.raw();
    a.d_v = d_v.raw();
    Tensor ws = workspace(alloc, attention_workspace_bytes(a));
    a.workspace = ws.data<float>();
    attention_backward_cpu(a);
  }
  d_o.reset();
  // d n1 = the sum of the three projections' input gradients, in the order q, k, v.
  Tensor from_q = bf16(alloc, {T, H}, Category::Activations);
  Tensor from_k = bf16(alloc, {T, H}, Category::Activations);
  Tensor from_v = bf16(alloc, {T, H}, Category::Activations);
  linear_bwd(s.n1, w.wq, d_q, from_q, g.wq, T, H, H);
  linear_bwd(s.n1, w.wk, d_k, from_k, g.wk, T, H, H);
  linear_bwd(s.n1, w.wv, d_v, from_v, g.wv, T, H, H);
  d_q.reset(), d_k.reset(), d_v.reset();
  Tensor d_n1 = bf16(alloc, {T, H}, Category::Activations);
  {
    Bf16* out = d_n1.data<Bf16>();
    const Bf16 *pq = from_q.data<Bf16>(), *pk = from_k.data<Bf16>(), *pv = from_v.data<Bf16>();
    for (int64_t i = 0; i < d_n1.numel(); ++i) out[i] = f32_to_bf16(to_f32(pq[i]) + to_f32(pk[i]) + to_f32(pv[i]));
  }
  from_q.reset(), from_k.reset(), from_v.reset();
  Tensor d_xn = bf16(alloc, {T, H}, Category::Activations);
  RmsNormArgs n = norm_args(x, w.norm1, s.rstd1, T, H);
  n.d_out = d_n1.raw();
  n.d_x = d_xn.raw();
  n.d_weight = g.norm1.raw();
  Tensor ws = workspace(alloc, rmsnorm_workspace_bytes(n));
  n.workspace = ws.data<float>();
  rmsnorm_backward_cpu(n);
  Tensor d_x = bf16(alloc, {T, H}, Category::Activations);
  add_into(d_h, d_xn, d_x);
  return d_x;
}

void append_bits(const Tensor& t, std::vector<uint16_t>& out) {
  const Bf16* p = t.data<Bf16>();
  for (int64_t i = 0; i < t.numel(); ++i) out.push_back(p[i].bits);
}

int64_t ffn_width(const CheckpointScheduleConfig& c) { return c.ffn > 0 ? c.ffn : 2 * c.hidden; }

// The boundaries: device copies (x_0 .. x_L; x_L is the final hidden h_L) and the host arena.
class Boundaries {
 public:
  Boundaries(TrackingAllocator& alloc, const CheckpointScheduleConfig& c, const Dims& d) : alloc_(alloc), d_(d) {
    const auto L = static_cast<size_t>(c.layers);
    offloaded_ = c.offloaded.empty() ? std::vector<bool>(L, false) : c.offloaded;
    int64_t slots = 0;
    for (bool off : offloaded_) slot_.push_back(off ? slots++ : -1);
    // Pinned once for the whole step, exact size: [offloaded layers, T, H] bf16.
    if (slots > 0) host_ = bf16(alloc, {slots, d.T, d.H}, Category::Boundaries, MemorySpace::Host);
    device_.resize(L + 1);
  }
  bool offloaded(int64_t l) const { return offloaded_[static_cast<size_t>(l)]; }
  Tensor& device(int64_t l) { return device_[static_cast<size_t>(l)]; }
  Tensor make() { return bf16(alloc_, {d_.T, d_.H}, Category::Boundaries); }
  // D2H of x_l into its host slot; its device copy is released by the caller once the copy is done.
  void copy_to_host(int64_t l) {
    std::memcpy(host_slot(l), device(l).raw(), static_cast<size_t>(device(l).bytes()));
  }
  // H2D of x_l into a fresh device buffer, unless it is already there (prefetched).
  void fetch(int64_t l) {
    if (!offloaded(l) || !device(l).empty()) return;
    device(l) = make();
    std::memcpy(device(l).raw(), host_slot(l), static_cast<size_t>(device(l).bytes()));
  }

 private:
  void* host_slot(int64_t l) {
    return host_.data<Bf16>() + slot_[static_cast<size_t>(l)] * d_.T * d_.H;
  }
  TrackingAllocator& alloc_;
  Dims d_;
  std::vector<bool> offloaded_;
  std::vector<int64_t> slot_;  // host slot of each offloaded layer, -1 for a kept one
  Tensor host_;
  std::vector<Tensor> device_;
};

std::string layer_phase(const char* pass, int64_t l, const char* part) {
  return std::string(pass) + "/L" + std::to_string(l) + "/" + part;
}

}  // namespace

float bf16_value(uint16_t bits) { return to_f32(Bf16{bits}); }

CheckpointDims checkpoint_dims(const CheckpointScheduleConfig& c) {
  CheckpointDims d;
  d.tokens = c.tokens;
  d.hidden = c.hidden;
  d.ffn = ffn_width(c);
  d.heads = c.heads > 0 ? c.heads : (c.hidden % 4 == 0 ? 4 : (c.hidden % 2 == 0 ? 2 : 1));
  if (c.tokens <= 0 || c.hidden <= 0 || c.layers <= 0)
    throw std::invalid_argument("checkpoint schedule: tokens, hidden and layers must be positive");
  if (d.hidden % d.heads != 0) throw std::invalid_argument("checkpoint schedule: heads must divide hidden");
  if (!c.offloaded.empty() && static_cast<int64_t>(c.offloaded.size()) != c.layers)
    throw std::invalid_argument("checkpoint schedule: offloaded must list every layer (got " + std::to_string(c.offloaded.size()) +
                                " for " + std::to_string(c.layers) + " layers)");
  if (c.prefetch < 0) throw std::invalid_argument("checkpoint schedule: prefetch must be >= 0");
  if (!c.checkpoint && !c.offloaded.empty())
    for (bool off : c.offloaded)
      if (off) throw std::invalid_argument("checkpoint schedule: the naive run (no checkpointing) offloads nothing");
  return d;
}

int64_t checkpoint_weight_gradient_elements(const CheckpointScheduleConfig& c) {
  const int64_t H = c.hidden, F = ffn_width(c);
  return c.layers * (2 * H + 4 * H * H + 3 * F * H) + H;
}

CheckpointScheduleResult run_checkpoint_schedule(TrackingAllocator& alloc, const CheckpointScheduleConfig& c) {
  const CheckpointDims resolved = checkpoint_dims(c);
  Dims d;
  d.T = resolved.tokens;
  d.H = resolved.hidden;
  d.F = resolved.ffn;
  d.heads = resolved.heads;
  const int64_t T = d.T, H = d.H, L = c.layers;

  // Weights, their gradients, the final norm, the loss target and the stack's input.
  std::vector<LayerWeights> weights, grads;
  for (int64_t l = 0; l < L; ++l) {
    weights.push_back(make_weights(alloc, d, Category::Params, c.seed * 1009 + static_cast<uint64_t>(l)));
    grads.push_back(make_weights(alloc, d, Category::Grads, 0));
  }
  Tensor final_norm = bf16(alloc, {H}, Category::Params);
  Tensor d_final_norm = bf16(alloc, {H}, Category::Grads);
  for (int64_t i = 0; i < H; ++i) {
    final_norm.data<Bf16>()[i] = f32_to_bf16(1.0f + 0.1f * uniform_pm1(c.seed * 7 + 5, static_cast<uint64_t>(i)));
    d_final_norm.data<Bf16>()[i] = f32_to_bf16(0.0f);
  }
  Tensor target = bf16(alloc, {T, H}, Category::Workspace);  // [T, H] the loss's target
  fill_bf16(target.data<Bf16>(), target.numel(), c.seed * 7 + 3, 1.0f);
  Boundaries b(alloc, c, d);
  b.device(0) = b.make();  // x_0, the embedding output
  fill_bf16(b.device(0).data<Bf16>(), T * H, c.seed * 7 + 1, 1.0f);

  // The naive run keeps every layer's saved tensors from forward to backward.
  std::vector<AttnSaved> kept_attn(static_cast<size_t>(c.checkpoint ? 0 : L));
  std::vector<FfnSaved> kept_ffn(static_cast<size_t>(c.checkpoint ? 0 : L));
  std::vector<Tensor> kept_h(static_cast<size_t>(c.checkpoint ? 0 : L));

  for (int64_t l = 0; l < L; ++l) {
    alloc.set_phase(layer_phase("fwd", l, "attn"));
    // SCO: the D2H copy of x_l starts as soon as its layer does (a side stream on a GPU).
    if (b.offloaded(l)) b.copy_to_host(l);
    // Checkpointed, the forward saves nothing but the boundary: each half's saved set goes at once.
    AttnSaved attn;
    Tensor h = attention_forward(alloc, d, weights[static_cast<size_t>(l)], b.device(l), attn);
    if (c.checkpoint) attn = AttnSaved{};
    alloc.set_phase(layer_phase("fwd", l, "ffn"));
    FfnSaved ffn;
    Tensor f = ffn_forward(alloc, d, weights[static_cast<size_t>(l)], h, ffn);
    if (c.checkpoint) ffn = FfnSaved{};
    Tensor next = b.make();
    add_into(h, f, next);
    f.reset();
    if (c.checkpoint) {
      h.reset();
    } else {
      kept_attn[static_cast<size_t>(l)] = std::move(attn);
      kept_ffn[static_cast<size_t>(l)] = std::move(ffn);
      kept_h[static_cast<size_t>(l)] = std::move(h);
    }
    // The device copy of an offloaded x_l goes when its layer's forward returns: until then the
    // caller holds the layer's input (as an eager framework does), and the D2H copy is waited
    // for there, so a boundary in flight is counted through the whole layer.
    if (b.offloaded(l)) b.device(l).reset();
    b.device(l + 1) = std::move(next);
  }

  // Loss: 0.5 / T · Σ (final_norm(h_L) − target)²; h_L is kept for the final norm's backward.
  CheckpointScheduleResult result;
  alloc.set_phase("loss/fwd");
  Tensor rstd(alloc, DType::F32, {T}, Category::Vocab);
  Tensor x_final = bf16(alloc, {T, H}, Category::Vocab);  // [T, H] final norm output
  RmsNormArgs fn = norm_args(b.device(L), final_norm, rstd, T, H);
  fn.out = x_final.raw();
  rmsnorm_forward_cpu(fn);
  double sum = 0.0;
  for (int64_t i = 0; i < T * H; ++i) {
    const double diff = static_cast<double>(to_f32(x_final.data<Bf16>()[i])) - static_cast<double>(to_f32(target.data<Bf16>()[i]));
    sum += diff * diff;
  }
  result.loss = 0.5 * sum / static_cast<double>(T);
  alloc.set_phase("loss/bwd");
  Tensor dy;
  {
    Tensor d_final = bf16(alloc, {T, H}, Category::Vocab);
    for (int64_t i = 0; i < T * H; ++i)
      d_final.data<Bf16>()[i] = f32_to_bf16((to_f32(x_final.data<Bf16>()[i]) - to_f32(target.data<Bf16>()[i])) / static_cast<float>(T));
    dy = bf16(alloc, {T, H}, Category::Activations);  // the gradient stream [T, H]
    fn.d_out = d_final.raw();
    fn.d_x = dy.raw();
    fn.d_weight = d_final_norm.raw();
    Tensor ws = workspace(alloc, rmsnorm_workspace_bytes(fn));
    fn.workspace = ws.data<float>();
    rmsnorm_backward_cpu(fn);
  }
  x_final.reset(), rstd.reset();
  b.device(L).reset();  // h_L: the final norm's backward is done

  for (int64_t l = L - 1; l >= 0; --l) {
    const LayerWeights& w = weights[static_cast<size_t>(l)];
    LayerWeights& g = grads[static_cast<size_t>(l)];
    AttnSaved attn;
    FfnSaved ffn;
    Tensor h;
    if (c.checkpoint) {
      alloc.set_phase(layer_phase("bwd", l, "recompute/attn"));
      // This layer's boundary (unless prefetched) and the next `prefetch` layers' below it.
      b.fetch(l);
      for (int64_t i = l - 1; i >= 0 && i >= l - c.prefetch; --i) b.fetch(i);
      h = attention_forward(alloc, d, w, b.device(l), attn);
      alloc.set_phase(layer_phase("bwd", l, "recompute/ffn"));
      ffn_forward(alloc, d, w, h, ffn).reset();  // the output is not needed, only the saved set
    } else {
      attn = std::move(kept_attn[static_cast<size_t>(l)]);
      ffn = std::move(kept_ffn[static_cast<size_t>(l)]);
      h = std::move(kept_h[static_cast<size_t>(l)]);
    }
    alloc.set_phase(layer_phase("bwd", l, "ffn"));
    Tensor d_h = ffn_backward(alloc, d, w, g, h, ffn, dy);
    ffn = FfnSaved{};
    h.reset();
    dy.reset();
    alloc.set_phase(layer_phase("bwd", l, "attn"));
    dy = attention_backward(alloc, d, w, g, b.device(l), attn, d_h);
    d_h.reset();
    attn = AttnSaved{};
    b.device(l).reset();  // x_l: its layer's backward is done
  }

  // Reserved at their exact sizes: growth by doubling would hold two copies at once.
  result.d_input.reserve(static_cast<size_t>(T * H));
  append_bits(dy, result.d_input);
  result.d_weights.reserve(static_cast<size_t>(checkpoint_weight_gradient_elements(c)));
  for (auto& g : grads)
    for (Tensor* t : g.all()) append_bits(*t, result.d_weights);
  append_bits(d_final_norm, result.d_weights);
  return result;
}

}  // namespace flatpeak::exec
