// The layer working set: attention (flash-style, no S² tensor; GQA/MHA; MLA with per-head K and
// V as training materialises them), ring-attention buffers for CP > 1, norms, dense FFN and
// shared experts, and the gradient stream. Shapes in DESIGN.md's symbols; bf16 unless stated.
// MLA's projections (the executor's layer, executor/schedules/decoder_layer.cpp) keep the q latent
// [T, q_lora] and kv latent [T, kv_lora] with their norms' rstd; the normed latents, k_rope and the
// backward's latent gradients are transients around the flash kernel, so an MLA attention phase
// holds the largest of its moments: the kernel's, the q projection's, the kv projection's (forward),
// and the projections' backward after the kernel's accumulators are freed.
#include <algorithm>
#include <functional>

#include "memory_model.h"

namespace flatpeak::planner {

namespace {
constexpr Category kAct = Category::Activations;
}

LayerSpec Context::layer_spec(int64_t layer) const {
  if (layer < model.num_layers) return model.layers[static_cast<size_t>(layer)];
  LayerSpec s;
  s.ffn = model.num_experts > 0 ? FfnKind::Moe : FfnKind::Dense;
  return s;
}

namespace {

bool is_mla(const ModelSpec& m) { return m.attention == AttentionKind::Mla; }
// Rows of MLA's latent norms' statistics: the q latent's (with q_lora) and the kv latent's.
int64_t latent_norms(const ModelSpec& m) { return is_mla(m) ? (m.q_lora_rank > 0 ? 2 : 1) : 0; }

// Where an attention's forward stands: at the flash kernel (every attention), or at MLA's q or
// kv projection, where the normed latents and k_rope are live and the output not yet made.
enum class AttnMoment { Kernel, QProjection, KvProjection };

// Q, K, V, O and the MLA latents: the tensors flash attention reads and backward needs, as the
// forward holds them at `moment`.
void add_qkvo(const Context& c, TermList& t, const char* prefix, AttnMoment moment = AttnMoment::Kernel) {
  const ModelSpec& m = c.model;
  const int64_t T = c.work.tokens;
  const std::string p = prefix;
  if (is_mla(m) && m.q_lora_rank > 0) {
    t.add(p + "q latent", {{"T", T}, {"q_lora", m.q_lora_rank}}, kBf16, kAct);
    if (moment == AttnMoment::QProjection) t.add("normed q latent", {{"T", T}, {"q_lora", m.q_lora_rank}}, kBf16, kAct);
  }
  t.add(p + "q", {{"T", T}, {"a*d", m.num_heads * m.head_dim}}, kBf16, kAct);
  if (moment == AttnMoment::QProjection) return;
  if (is_mla(m)) t.add(p + "kv latent", {{"T", T}, {"kv_lora", m.kv_lora_rank}}, kBf16, kAct);
  t.add(p + "k", {{"T", T}, {"g*d", m.num_kv_heads * m.head_dim}}, kBf16, kAct);
  t.add(p + "v", {{"T", T}, {"g*dv", m.num_kv_heads * m.v_head_dim}}, kBf16, kAct);
  if (moment == AttnMoment::KvProjection) {
    t.add("k rope (shared by the heads)", {{"T", T}, {"rope", m.qk_rope_head_dim}}, kBf16, kAct);
    t.add("normed kv latent", {{"T", T}, {"kv_lora", m.kv_lora_rank}}, kBf16, kAct);
    return;
  }
  t.add(p + "o (flash output)", {{"T", T}, {"a*dv", m.num_heads * m.v_head_dim}}, kBf16, kAct);
  t.add(p + "lse", {{"a", m.num_heads}, {"T", T}}, kFp32, kAct);
}

// `kernel` (the flash kernel's moment), or the larger of MLA's projection moments that
// `moment_terms` builds (a tie keeps the kernel's).
TermList largest_moment(const Context& c, TermList kernel, const std::function<void(AttnMoment, TermList&)>& moment_terms) {
  if (!is_mla(c.model)) return kernel;
  for (AttnMoment moment : {AttnMoment::QProjection, AttnMoment::KvProjection}) {
    TermList at = c.list();
    moment_terms(moment, at);
    if (at.bytes(Space::Device) > kernel.bytes(Space::Device)) kernel = at;
  }
  return kernel;
}

}  // namespace

void add_attention_forward(const Context& c, int64_t layer, TermList& t) {
  const ModelSpec& m = c.model;
  const int64_t T = c.work.tokens;
  const int64_t H = m.hidden_size;
  t.add("norm-1 output", {{"T", T}, {"H", H}}, kBf16, kAct);
  if (is_mla(m)) t.add("latent norms rstd", {{"latents", latent_norms(m)}, {"T", T}}, kFp32, kAct);
  TermList kernel = c.list();
  add_qkvo(c, kernel, "");
  add_ring_attention(c, layer, false, kernel);
  t.append(largest_moment(c, kernel, [&](AttnMoment moment, TermList& at) { add_qkvo(c, at, "", moment); }));
}

namespace {

void add_attention_saved_at(const Context& c, TermList& t, bool with_residual, AttnMoment moment) {
  const int64_t T = c.work.tokens;
  const int64_t H = c.model.hidden_size;
  t.add("norm-1 output (saved)", {{"T", T}, {"H", H}}, kBf16, kAct);
  // Both norms' statistics (and MLA's latent norms') in one buffer each (the executor's layer;
  // aligned once).
  if (is_mla(c.model)) t.add("norm rstd (saved, norms and latent norms)", {{"2+latents", 2 + latent_norms(c.model)}, {"T", T}}, kFp32, kAct);
  else t.add("norm rstd (saved)", {{"2", 2}, {"T", T}}, kFp32, kAct);
  if (c.model.norm_bias) t.add("norm mean (saved, LayerNorm)", {{"2", 2}, {"T", T}}, kFp32, kAct);
  add_qkvo(c, t, "saved ", moment);
  if (with_residual) t.add("attention residual h1 (saved)", {{"T", T}, {"H", H}}, kBf16, kAct);
}

}  // namespace

void add_attention_saved(const Context& c, int64_t layer, TermList& t, bool with_residual) {
  (void)layer;
  add_attention_saved_at(c, t, with_residual, AttnMoment::Kernel);
}

void add_attention_recompute(const Context& c, int64_t layer, TermList& t) {
  TermList kernel = c.list();
  add_attention_saved_at(c, kernel, false, AttnMoment::Kernel);
  add_ring_attention(c, layer, false, kernel);
  t.append(largest_moment(c, kernel, [&](AttnMoment moment, TermList& at) { add_attention_saved_at(c, at, false, moment); }));
  add_layer_grad_stream(c, t);
}

void add_attention_backward(const Context& c, int64_t layer, TermList& t) {
  const ModelSpec& m = c.model;
  const int64_t T = c.work.tokens;
  const int64_t H = m.hidden_size;
  add_attention_saved(c, layer, t, false);
  add_layer_grad_stream(c, t);
  t.add("d o", {{"T", T}, {"a*dv", m.num_heads * m.v_head_dim}}, kBf16, kAct);
  t.add("dq", {{"T", T}, {"a*d", m.num_heads * m.head_dim}}, kBf16, kAct);
  t.add("dk", {{"T", T}, {"g*d", m.num_kv_heads * m.head_dim}}, kBf16, kAct);
  t.add("dv", {{"T", T}, {"g*dv", m.num_kv_heads * m.v_head_dim}}, kBf16, kAct);
  TermList kernel = c.list();  // the flash backward's moment, when d norm-1 output is made
  kernel.add("flash dq accumulator", {{"T", T}, {"a*d", m.num_heads * m.head_dim}}, kFp32, kAct);
  kernel.add("flash delta (rowsum dO*O)", {{"a", m.num_heads}, {"T", T}}, kFp32, kAct);
  kernel.add("d norm-1 output", {{"T", T}, {"H", H}}, kBf16, kAct);
  add_ring_attention(c, layer, true, kernel);
  if (is_mla(m)) {
    // MLA's projections' backward, after the accumulators and the ring's buffers are freed: the q
    // side holds two [T, q_lora]; the kv side d normed kv latent with its fp32 sum over the heads,
    // then d kv latent with d k_rope.
    const int64_t QL = m.q_lora_rank, KL = m.kv_lora_rank;
    TermList q_side = c.list(), kv_sum = c.list(), kv_latent = c.list();
    for (TermList* at : {&q_side, &kv_sum, &kv_latent}) at->add("d norm-1 output", {{"T", T}, {"H", H}}, kBf16, kAct);
    if (QL > 0) {
      q_side.add("d normed q latent", {{"T", T}, {"q_lora", QL}}, kBf16, kAct);
      q_side.add("normed q latent (recomputed) or d q latent", {{"T", T}, {"q_lora", QL}}, kBf16, kAct);
    }
    kv_sum.add("d normed kv latent", {{"T", T}, {"kv_lora", KL}}, kBf16, kAct);
    kv_sum.add("d normed kv latent, fp32 sum over the heads", {{"T", T}, {"kv_lora", KL}}, kFp32, kAct);
    kv_latent.add("d kv latent", {{"T", T}, {"kv_lora", KL}}, kBf16, kAct);
    kv_latent.add("d k rope", {{"T", T}, {"rope", m.qk_rope_head_dim}}, kBf16, kAct);
    for (TermList* at : {&q_side, &kv_sum, &kv_latent})
      if (at->bytes(Space::Device) > kernel.bytes(Space::Device)) kernel = *at;
  }
  t.append(kernel);
}

void add_ring_attention(const Context& c, int64_t layer, bool backward, TermList& t) {
  if (c.run.cp <= 1) return;
  const ModelSpec& m = c.model;
  const int64_t T = c.work.tokens;
  const int64_t kv = m.num_kv_heads * (m.head_dim + m.v_head_dim);
  const LayerSpec spec = c.layer_spec(layer);
  const CpKeyReach reach = cp_key_reach(spec.window, spec.attention_window_tokens, T, c.run.cp);
  if (!reach.ring) {
    // A window that stays within the previous rank: only its last halo_rows keys are attended to
    // (none for chunks that never straddle a rank boundary).
    const int64_t halo = reach.halo_rows;
    if (halo == 0) return;
    const std::string kind = spec.window == AttentionWindow::Chunked ? "chunked window" : "sliding window";
    t.add("ring halo K,V (" + kind + ")", {{"halo", halo}, {"g*(d+dv)", kv}}, kBf16, kAct);
    // Backward: the halo's dK,dV go back to the previous rank while the next rank's, for this
    // rank's last keys, arrive (a second buffer: a send and a receive cannot share one).
    if (backward) {
      t.add("ring halo dK,dV", {{"halo", halo}, {"g*(d+dv)", kv}}, kFp32, kAct);
      t.add("ring halo dK,dV received (this rank's last keys)", {{"halo", halo}, {"g*(d+dv)", kv}}, kFp32, kAct);
    }
    return;
  }
  // Double-buffered KV chunks in flight (the one computed on + the one arriving).
  t.add("ring K,V chunks in flight", {{"T", T}, {"g*(d+dv)", kv}}, kBf16, kAct, 2);
  if (!backward) {
    t.add("ring output accumulator", {{"T", T}, {"a*dv", m.num_heads * m.v_head_dim}}, kFp32, kAct);
    t.add("ring lse accumulator", {{"a", m.num_heads}, {"T", T}}, kFp32, kAct);
  } else {
    t.add("ring dK,dV travelling with the chunk", {{"T", T}, {"g*(d+dv)", kv}}, kFp32, kAct, 2);
  }
}

void add_ffn_block_inputs(const Context& c, TermList& t) {
  const int64_t T = c.work.tokens;
  const int64_t H = c.model.hidden_size;
  t.add("attention residual h1", {{"T", T}, {"H", H}}, kBf16, kAct);
  t.add("norm-2 output", {{"T", T}, {"H", H}}, kBf16, kAct);
}

void add_ffn_forward(const Context& c, const char* prefix, int64_t width, TermList& t) {
  if (width <= 0) return;
  const int64_t T = c.work.tokens;
  const std::string p = prefix;
  t.add(p + " gate,up", {{"T", T}, {"2F", 2 * width}}, kBf16, kAct);
  t.add(p + " act*up", {{"T", T}, {"F", width}}, kBf16, kAct);
}

void add_ffn_saved(const Context& c, const char* prefix, int64_t width, TermList& t) {
  if (width <= 0) return;
  const int64_t T = c.work.tokens;
  const std::string p = prefix;
  t.add(p + " gate,up (saved)", {{"T", T}, {"2F", 2 * width}}, kBf16, kAct);
  t.add(p + " act*up (saved)", {{"T", T}, {"F", width}}, kBf16, kAct);
}

void add_ffn_backward_grads(const Context& c, const char* prefix, int64_t width, TermList& t) {
  if (width <= 0) return;
  const int64_t T = c.work.tokens;
  const std::string p = prefix;
  t.add(p + " d act*up", {{"T", T}, {"F", width}}, kBf16, kAct);
  t.add(p + " d gate,up", {{"T", T}, {"2F", 2 * width}}, kBf16, kAct);
}

void add_shared_gate_saved(const Context& c, TermList& t) {
  if (!c.model.shared_expert_gate || c.model.shared_expert_ffn_width <= 0) return;
  const int64_t T = c.work.tokens;
  t.add("shared expert output, ungated (saved for its gate)", {{"T", T}, {"H", c.model.hidden_size}}, kBf16, kAct);
  t.add("shared expert gate (saved)", {{"T", T}}, kBf16, kAct);
}

void add_layer_grad_stream(const Context& c, TermList& t) {
  const int64_t T = c.work.tokens;
  const int64_t H = c.model.hidden_size;
  t.add("dy (layer output grad)", {{"T", T}, {"H", H}}, kBf16, kAct);
  t.add("residual grad accumulator", {{"T", T}, {"H", H}}, kFp32, kAct);
}

}  // namespace flatpeak::planner
