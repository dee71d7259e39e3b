// FastPeaks' term builders: memory_terms_layer.cpp, memory_terms_dispatch.cpp and
// memory_terms_vocab.cpp in numbers (see fast_peaks_terms.h).
#include "fast_peaks_terms.h"

#include <algorithm>

namespace flatpeak::planner::fast_terms {

namespace {

bool is_mla(const ModelSpec& m) { return m.attention == AttentionKind::Mla; }
int64_t latent_norms(const ModelSpec& m) { return is_mla(m) ? (m.q_lora_rank > 0 ? 2 : 1) : 0; }

enum class Moment { Kernel, QProjection, KvProjection };

void qkvo_at(const Ctx& c, Acc& t, Moment moment) {
  const ModelSpec& m = c.m;
  const int64_t T = c.T;
  if (is_mla(m) && m.q_lora_rank > 0) {
    t.add(kAct, mul(T, m.q_lora_rank), kB16);
    if (moment == Moment::QProjection) t.add(kAct, mul(T, m.q_lora_rank), kB16);  // normed q latent
  }
  t.add(kAct, mul(T, m.num_heads * m.head_dim), kB16);
  if (moment == Moment::QProjection) return;
  if (is_mla(m)) t.add(kAct, mul(T, m.kv_lora_rank), kB16);
  t.add(kAct, mul(T, m.num_kv_heads * m.head_dim), kB16);
  t.add(kAct, mul(T, m.num_kv_heads * m.v_head_dim), kB16);
  if (moment == Moment::KvProjection) {
    t.add(kAct, mul(T, m.qk_rope_head_dim), kB16);  // k rope
    t.add(kAct, mul(T, m.kv_lora_rank), kB16);      // normed kv latent
    return;
  }
  t.add(kAct, mul(T, m.num_heads * m.v_head_dim), kB16);
  t.add(kAct, mul(m.num_heads, T), kF32);
}

// `kernel`, or the larger of MLA's projection moments (a tie keeps the kernel's).
template <class Build>
Acc largest_moment(const Ctx& c, Acc kernel, const Build& build) {
  if (!is_mla(c.m)) return kernel;
  for (Moment moment : {Moment::QProjection, Moment::KvProjection}) {
    Acc at = c.acc();
    build(moment, at);
    if (at.total() > kernel.total()) kernel = at;
  }
  return kernel;
}

void saved_at(const Ctx& c, Acc& t, Moment moment) {
  t.add(kAct, mul(c.T, c.H), kB16);
  t.add(kAct, mul(2 + latent_norms(c.m), c.T), kF32);  // norm rstd [2 + latent norms, T]
  if (c.m.norm_bias) t.add(kAct, mul(2, c.T), kF32);  // LayerNorm mean [2, T]
  qkvo_at(c, t, moment);
}

}  // namespace

void qkvo(const Ctx& c, Acc& t) { qkvo_at(c, t, Moment::Kernel); }

void ring_attention(const Ctx& c, int64_t layer, bool backward, Acc& t) {
  if (c.r.cp <= 1) return;
  const ModelSpec& m = c.m;
  const int64_t T = c.T;
  const int64_t kv = m.num_kv_heads * (m.head_dim + m.v_head_dim);
  const LayerSpec s = c.spec(layer);
  const CpKeyReach reach = cp_key_reach(s.window, s.attention_window_tokens, T, c.r.cp);
  if (!reach.ring) {
    const int64_t halo = reach.halo_rows;
    if (halo == 0) return;
    t.add(kAct, mul(halo, kv), kB16);
    if (backward) t.add(kAct, mul(halo, kv), kF32, 2);  // sent and received
    return;
  }
  t.add(kAct, mul(T, kv), kB16, 2);
  if (!backward) {
    t.add(kAct, mul(T, m.num_heads * m.v_head_dim), kF32);
    t.add(kAct, mul(m.num_heads, T), kF32);
  } else {
    t.add(kAct, mul(T, kv), kF32, 2);
  }
}

void layer_grad_stream(const Ctx& c, Acc& t) {
  t.add(kAct, mul(c.T, c.H), kB16);
  t.add(kAct, mul(c.T, c.H), kF32);
}

void attention_forward(const Ctx& c, int64_t layer, Acc& t) {
  t.add(kAct, mul(c.T, c.H), kB16);
  if (is_mla(c.m)) t.add(kAct, mul(latent_norms(c.m), c.T), kF32);  // latent norms rstd
  Acc kernel = c.acc();
  qkvo(c, kernel);
  ring_attention(c, layer, false, kernel);
  t.append(largest_moment(c, kernel, [&](Moment moment, Acc& at) { qkvo_at(c, at, moment); }));
}

void attention_saved(const Ctx& c, Acc& t) { saved_at(c, t, Moment::Kernel); }

void attention_recompute(const Ctx& c, int64_t layer, Acc& t) {
  Acc kernel = c.acc();
  saved_at(c, kernel, Moment::Kernel);
  ring_attention(c, layer, false, kernel);
  t.append(largest_moment(c, kernel, [&](Moment moment, Acc& at) { saved_at(c, at, moment); }));
  layer_grad_stream(c, t);
}

void attention_backward(const Ctx& c, int64_t layer, Acc& t) {
  const ModelSpec& m = c.m;
  const int64_t T = c.T;
  attention_saved(c, t);
  layer_grad_stream(c, t);
  t.add(kAct, mul(T, m.num_heads * m.v_head_dim), kB16);
  t.add(kAct, mul(T, m.num_heads * m.head_dim), kB16);
  t.add(kAct, mul(T, m.num_kv_heads * m.head_dim), kB16);
  t.add(kAct, mul(T, m.num_kv_heads * m.v_head_dim), kB16);
  Acc kernel = c.acc();
  kernel.add(kAct, mul(T, m.num_heads * m.head_dim), kF32);
  kernel.add(kAct, mul(m.num_heads, T), kF32);
  kernel.add(kAct, mul(T, c.H), kB16);
  ring_attention(c, layer, true, kernel);
  if (is_mla(m)) {  // the projections' backward (memory_terms_layer.cpp)
    Acc q_side = c.acc(), kv_sum = c.acc(), kv_latent = c.acc();
    for (Acc* at : {&q_side, &kv_sum, &kv_latent}) at->add(kAct, mul(T, c.H), kB16);
    if (m.q_lora_rank > 0) q_side.add(kAct, mul(T, m.q_lora_rank), kB16, 2);
    kv_sum.add(kAct, mul(T, m.kv_lora_rank), kB16);
    kv_sum.add(kAct, mul(T, m.kv_lora_rank), kF32);
    kv_latent.add(kAct, mul(T, m.kv_lora_rank), kB16);
    kv_latent.add(kAct, mul(T, m.qk_rope_head_dim), kB16);
    for (Acc* at : {&q_side, &kv_sum, &kv_latent})
      if (at->total() > kernel.total()) kernel = *at;
  }
  t.append(kernel);
}

void ffn_block_inputs(const Ctx& c, Acc& t) {
  t.add(kAct, mul(c.T, c.H), kB16);
  t.add(kAct, mul(c.T, c.H), kB16);
}

void ffn_pair(const Ctx& c, int64_t width, Acc& t) {  // forward and saved: gate,up then act*up
  if (width <= 0) return;
  t.add(kAct, mul(c.T, 2 * width), kB16);
  t.add(kAct, mul(c.T, width), kB16);
}

void ffn_backward_grads(const Ctx& c, int64_t width, Acc& t) {
  if (width <= 0) return;
  t.add(kAct, mul(c.T, width), kB16);
  t.add(kAct, mul(c.T, 2 * width), kB16);
}

void shared_gate_saved(const Ctx& c, Acc& t) {
  if (!c.m.shared_expert_gate || c.m.shared_expert_ffn_width <= 0) return;
  t.add(kAct, mul(c.T, c.H), kB16);
  t.add(kAct, c.T, kB16);
}

// ---- dispatch

std::vector<MoeShape> moe_shapes(const Ctx& c, const MoeLoad& load) {
  std::vector<MoeShape> out;
  if (pipelined(c)) {  // launch-time buffers, the same on every rank (memory_terms_dispatch.cpp)
    out.push_back(MoeShape{c.T, c.H, c.m.num_experts, c.m.top_k, c.m.expert_ffn_width, load.send_rows, load.store_rows,
                           load.foreign_pool, c.r.ep > 1 ? 1 : 0, c.r.ep > 1, &load});
    return out;
  }
  for (const RankLoad& r : load.ranks)
    out.push_back(MoeShape{c.T, c.H, c.m.num_experts, c.m.top_k, c.m.expert_ffn_width, load.send_rows, r.recv_rows,
                           c.r.llep ? r.foreign_experts : 0, c.r.llep ? r.lent_experts : 0, c.r.ep > 1, &load});
  return out;
}

void received_probs(const MoeShape& s, Acc& t) {
  if (s.regroup) t.add(kDsp, s.recv, kF32);
}

void route(const MoeShape& s, Acc& t) {
  t.add(kDsp, mul(s.T, s.E), kF32, 1);
  t.add(kDsp, mul(s.T, s.E), kF32, 1);
  t.add(kDsp, mul(s.T, s.E), kF32, 1);
  t.add(kDsp, mul(s.T, s.E), kB1);
  t.add(kDsp, mul(s.T, s.k), kF32);
  t.add(kDsp, mul(s.T, s.k), kI64);
}

void meta(const MoeShape& s, Acc& t) {
  t.add(kDsp, s.sent, kI64);
  t.add(kDsp, s.sent, kF32);
}

void foreign(const Ctx& c, const MoeShape& s, Acc& t) {
  if (!c.r.llep) return;
  t.add(kDsp, mul(s.foreign, c.w.expert_params_each), kB16);
}

void foreign_grads(const Ctx& c, const MoeShape& s, Acc& t) {  // fp32 (memory_terms_dispatch.cpp)
  if (!c.r.llep) return;
  t.add(kDsp, mul(s.foreign, c.w.expert_params_each), kF32);
  t.add(kDsp, mul(s.lent, c.w.expert_params_each), kF32);
}

void saved_experts(const MoeShape& s, int64_t rows, Acc& t) {
  t.add(kDsp, mul(rows, s.H), kB16);
  t.add(kDsp, mul(rows, 2 * s.F), kB16);
  t.add(kDsp, mul(rows, s.F), kB16);
}

void expert_grads(const MoeShape& s, int64_t rows, Acc& t) {
  t.add(kDsp, mul(rows, s.H), kB16);
  t.add(kDsp, mul(rows, s.F), kB16);
  t.add(kDsp, mul(rows, 2 * s.F), kB16);
}

void dispatch_buffers(const Ctx& c, const MoeShape& s, Acc& t) {
  t.add(kDsp, mul(s.sent, s.H), kB16);
  if (c.r.llep) t.add(kDsp, mul(s.sent, s.H), kB16);
  t.add(kDsp, mul(s.recv, s.H), kB16);
  t.add(kDsp, s.recv, kF32);
}

void combine_buffers(const MoeShape& s, Acc& t) {
  t.add(kDsp, mul(s.recv, s.H), kB16);
  t.add(kDsp, mul(s.recv, s.H), kB16);
  t.add(kDsp, mul(s.sent, s.H), kB16);
  t.add(kDsp, mul(s.T, s.H), kB16);
}

// The phases of one MoE block: (suffix kind, dispatch bytes); suffix kinds tell the timeline

// where the shared expert's terms go.

// The larger of two moments of a phase (the first on ties).
Acc larger(const Acc& a, const Acc& b) { return b.c[cat(kDsp)] > a.c[cat(kDsp)] ? b : a; }

std::vector<MoeTerms> ep_phases(const Ctx& c, const MoeShape& s, bool recompute) {
  using D = FastPeaks::Disp;
  std::vector<MoeTerms> out;
  auto phase = [&](MoePhase k) -> Acc& {
    out.push_back(MoeTerms{k, D::None, c.acc()});
    route(s, out.back().terms);
    return out.back().terms;
  };
  auto common = [&](Acc& t) {
    route(s, t);
    meta(s, t);
    foreign(c, s, t);
  };
  if (!recompute) phase(MoePhase::Route);
  {
    Acc a = c.acc();
    common(a);
    dispatch_buffers(c, s, a);
    if (s.regroup) {
      Acc b = c.acc();
      common(b);
      b.add(kDsp, mul(s.recv, s.H), kB16);
      b.add(kDsp, s.recv, kF32);
      b.add(kDsp, mul(s.recv, s.H), kB16);
      a = larger(a, b);
    }
    out.push_back(MoeTerms{MoePhase::Dispatch, D::None, a});
  }
  {
    Acc& t = phase(MoePhase::Experts);
    meta(s, t);
    saved_experts(s, s.recv, t);
    if (recompute) t.add(kDsp, mul(s.recv, s.H), kB16);
    received_probs(s, t);
    foreign(c, s, t);
  }
  {
    Acc& t = phase(MoePhase::Combine);
    meta(s, t);
    if (recompute) {
      saved_experts(s, s.recv, t);
      received_probs(s, t);
    }
    combine_buffers(s, t);
    foreign(c, s, t);
  }
  return out;
}

std::vector<MoeTerms> ep_backward(const Ctx& c, const MoeShape& s) {
  using D = FastPeaks::Disp;
  std::vector<MoeTerms> out;
  auto common = [&](Acc& t) {
    route(s, t);
    meta(s, t);
    foreign(c, s, t);
  };
  {
    Acc a = c.acc();
    common(a);
    saved_experts(s, s.recv, a);
    received_probs(s, a);
    a.add(kDsp, mul(s.sent, s.H), kB16);
    a.add(kDsp, mul(s.recv, s.H), kB16);
    if (s.regroup) {
      Acc b = c.acc();
      common(b);
      saved_experts(s, s.recv, b);
      received_probs(s, b);
      b.add(kDsp, mul(s.recv, s.H), kB16);
      b.add(kDsp, mul(s.recv, s.H), kB16);
      a = larger(a, b);
    }
    out.push_back(MoeTerms{MoePhase::Combine, D::None, a});
  }
  {
    out.push_back(MoeTerms{MoePhase::Experts, D::None, c.acc()});
    Acc& t = out.back().terms;
    common(t);
    saved_experts(s, s.recv, t);
    received_probs(s, t);
    expert_grads(s, s.recv, t);
    foreign_grads(c, s, t);
  }
  {
    Acc b = c.acc();
    common(b);
    b.add(kDsp, mul(s.recv, s.H), kB16);
    b.add(kDsp, mul(s.sent, s.H), kB16);
    b.add(kDsp, mul(s.T, s.H), kF32);
    foreign_grads(c, s, b);
    if (s.regroup) {
      Acc a = c.acc();
      common(a);
      a.add(kDsp, mul(s.recv, s.H), kB16);
      a.add(kDsp, mul(s.recv, s.H), kB16);
      if (c.m.shared_expert_ffn_width > 0) a.add(kDsp, mul(s.T, s.H), kF32);  // accumulator begun by the shared experts
      foreign_grads(c, s, a);
      b = larger(a, b);
    }
    out.push_back(MoeTerms{MoePhase::Dispatch, D::None, b});
  }
  return out;
}

void round_buffers(const MoeShape& s, int64_t C, int64_t B, int64_t D, Acc& t) {
  t.add(kDsp, mul(D, C, s.H), kB16);
  t.add(kDsp, mul(D, B, s.H), kB16);
  t.add(kDsp, mul(D, B, s.H), kB16);
  t.add(kDsp, mul(D, C, s.H), kB16);
  t.add(kDsp, mul(D, 2 * (B + C)), kF32);
  t.add(kDsp, mul(D, 2 * (B + C)), kI64);
  t.add(kDsp, mul(3, s.sent), kI64);
  t.add(kDsp, mul(s.T, s.H), kF32);
}

// Dispatch bytes of a round phase (the whole Dispatch category of that phase).

Acc round_phase(const Ctx& c, const MoeShape& s, FastPeaks::Disp kind) {
  using D = FastPeaks::Disp;
  const int64_t C = s.load->launch_chunk_cap_rows, B = s.load->round_recv_rows, Dp = c.r.dispatch_depth;
  const bool store = c.r.dispatch_mode == DispatchMode::Store;
  Acc t = c.acc();
  route(s, t);
  round_buffers(s, C, B, Dp, t);
  if (kind == D::BackwardRound) {
    saved_experts(s, store ? s.recv : B, t);
    t.add(kDsp, mul(mul(Dp, 2 * (B + C)), s.H), kB16);
    expert_grads(s, B, t);
    t.add(kDsp, mul(s.T, s.H), kF32);
    foreign(c, s, t);
    foreign_grads(c, s, t);
    return t;
  }
  saved_experts(s, kind == D::RecomputeRound ? s.recv : B, t);
  t.add(kDsp, mul(B, s.H), kB16);
  t.add(kDsp, mul(B, s.H), kB16);
  foreign(c, s, t);
  return t;
}

std::vector<MoeTerms> pipelined_forward(const Ctx& c, const MoeShape& s, bool recompute) {
  using D = FastPeaks::Disp;
  const bool store = c.r.dispatch_mode == DispatchMode::Store;
  std::vector<MoeTerms> out;
  if (recompute && !store) {
    out.push_back(MoeTerms{MoePhase::Route, D::None, c.acc()});
    route(s, out.back().terms);
    foreign(c, s, out.back().terms);
    return out;
  }
  if (!recompute) {
    out.push_back(MoeTerms{MoePhase::Route, D::None, c.acc()});
    route(s, out.back().terms);
  }
  const D kind = recompute ? D::RecomputeRound : D::ForwardRound;
  out.push_back(MoeTerms{MoePhase::Round, kind, round_phase(c, s, kind)});
  return out;
}

bool pipelined(const Ctx& c) { return c.r.llep && c.r.chunk_cap_rows > 0; }

// ---- vocabulary (memory_terms_vocab.cpp)

VocabShape vocab_shape_of(int64_t T, int64_t H, int64_t V, int64_t R, int64_t token_block, int64_t vocab_block,
                          int64_t w_params) {
  const int64_t shard = ceil_div(V, R);
  return VocabShape{T, H, V, R, shard, std::min(token_block, T), std::min(vocab_block, shard), w_params};
}

void x_w(const VocabShape& s, Acc& t) {
  t.add(kVoc, mul(s.T, s.H), kB16);
  if (s.R == 1) t.add(kVoc, s.w_params, kB16);
  else t.add(kVoc, mul(s.shard, s.H), kB16);
}

void ring(RingRotate rotate, const VocabShape& s, bool grads, Acc& t) {
  if (s.R <= 1) return;
  if (rotate == RingRotate::Activations) {
    t.add(kVoc, mul(2, s.Tb, s.H), kB16);
    if (grads) {
      t.add(kVoc, mul(2, s.Tb), kF32);
      t.add(kVoc, mul(2, s.Tb, s.H), kF32);
    } else {
      t.add(kVoc, mul(2, 3, s.Tb), kF32);
    }
  } else {
    t.add(kVoc, mul(s.shard, s.H), kB16);
  }
}

void lse_loss(const VocabShape& s, Acc& t) {
  t.add(kVoc, s.T, kF32);
  t.add(kVoc, s.T, kF32);
}

void dx(const VocabShape& s, Acc& t) {
  if (s.R == 1) {
    t.add(kVoc, mul(s.Tb, s.H), kF32);
    t.add(kVoc, mul(s.T, s.H), kB16);
  } else {
    t.add(kVoc, mul(s.T, s.H), kF32);
  }
}

void dw(RingRotate rotate, const VocabShape& s, Acc& t) {
  if (s.R > 1 && rotate == RingRotate::Weights) {
    t.add(kVoc, mul(s.shard, s.H), kF32, 2);  // two buffers: after the last hop one is released
  } else if (s.R > 1) t.add(kVoc, mul(s.shard, s.H), kF32);
  else t.add(kVoc, s.w_params, kF32);
}

VocabShape vocab_shape(const Ctx& c) {
  const int64_t R = c.r.vocab == VocabMode::RingDtp ? c.r.ring_size : 1;
  return vocab_shape_of(c.T, c.H, c.m.vocab_size, R, c.r.token_block, c.r.vocab_block, loss_weight_params(c.m, c.w));
}

void loss_saved(const Ctx& c, Acc& t) {
  const VocabShape s = vocab_shape(c);
  if (c.r.vocab == VocabMode::Materialized) {
    t.add(kVoc, mul(s.T, s.H), kB16);
    t.add(kVoc, mul(s.T, s.V), kB16);
    t.add(kVoc, mul(s.T, s.V), kF32);
    t.add(kVoc, s.T, kF32);
    t.add(kVoc, s.T, kF32);
  } else if (c.r.vocab_backward == VocabBackward::InForward) {
    // X, W and lse are released; dX, the fp32 dW accumulator and the loss wait for the backward.
    t.add(kVoc, mul(s.T, s.H), s.R == 1 ? kB16 : kF32);
    if (s.R > 1) t.add(kVoc, mul(s.shard, s.H), kF32);  // the dW shard is home: one accumulator
    else dw(c.r.ring_rotate, s, t);
    t.add(kVoc, s.T, kF32);
  } else {
    t.add(kVoc, mul(s.T, s.H), kB16);
    t.add(kVoc, s.T, kF32);
    t.add(kVoc, s.T, kF32);
  }
}

}  // namespace flatpeak::planner::fast_terms
