// FastPeaks: workload.cpp, timeline.cpp, memory_terms_*.cpp and summarize() in numbers. Each
// function below mirrors the one of the same name there (same terms, same alignment per tensor,
// same order); only names and shapes are left out. Knob-dependent parts are kept per phase as
// rules (boundary counts, dispatch round terms, logits block terms, the LM head's FSDP share).
#include "fast_peaks.h"

#include "fast_peaks_terms.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <tuple>

#include "memory_model.h"
#include "spec/least_loaded.h"

namespace flatpeak::planner {

using namespace fast_terms;

namespace {

// received_rows_per_rank (routing.h), the same sums by blocks.
std::vector<int64_t> received_rows(const CountMatrix& copies, const RoutingShape& shape) {
  const auto ep = static_cast<size_t>(shape.ep_ranks);
  const auto per = static_cast<size_t>(shape.experts_per_rank());
  std::vector<int64_t> rows(ep, 0);
  for (const auto& row : copies)
    for (size_t d = 0; d < ep; ++d)
      for (size_t e = d * per; e < (d + 1) * per && e < row.size(); ++e) rows[d] += row[e];
  return rows;
}

}  // namespace

// ---- workload -----------------------------------------------------------------------------

const MoeBasis& LoadCache::basis(const ModelSpec& model, const ResolvedRun& run, int64_t tokens, int64_t moe_layer) {
  // Expected loads depend on the routing model, the shape, T and the layer only.
  const ExpectedKey ekey{tokens, run.ep, model.num_experts, model.top_k, moe_layer, to_string(run.imbalance)};
  const Key key{ekey, run.llep, run.llep ? run.llep_alpha : 0.0, run.llep ? run.llep_lambda : 0.0,
                run.llep ? run.llep_min_rows : 0};
  auto it = entries_.find(key);
  if (it != entries_.end() && it->second) return *it->second;
  const RoutingShape shape{run.ep, model.num_experts, model.top_k};
  auto& expected = expected_[ekey];
  if (!expected) expected = std::make_unique<ExpectedLoads>(expected_loads(run.imbalance, shape, tokens, moe_layer));
  auto b = std::make_unique<MoeBasis>();
  MoeLoad& load = b->load;
  load.send_rows = checked_mul(tokens, model.top_k);
  const auto received = received_rows(expected->copies, shape);
  load.recv_rows_ep = *std::max_element(received.begin(), received.end());
  load.rho_ep = imbalance_rho(received);
  load.clamp_note = expected->clamp_note;
  std::vector<RankLoad> per_rank;
  for (int64_t r : received) per_rank.push_back(RankLoad{r, 0, 0});
  load.ranks = candidate_ranks(per_rank);
  b->copies = expected->copies;
  if (run.llep) b->send = apply_lla(load, run, expected->copies, shape, lla_knobs_of(run));
  auto& slot = entries_[key];
  slot = std::move(b);
  return *slot;
}

MoeLoad load_with_cap(const MoeBasis& basis, const ModelSpec& model, const ResolvedRun& run, int64_t chunk_cap_rows) {
  MoeLoad load = basis.load;
  if (!run.llep || chunk_cap_rows <= 0) return load;
  apply_chunk_cap(load, model, run, basis.copies, basis.send, chunk_cap_rows);
  return load;
}

Workload fast_workload(const ModelSpec& model, const ResolvedRun& run, LoadCache& cache) {
  Workload w = workload_units(model, run, false);
  const int64_t distinct = distinct_moe_routings(run, w);
  for (int64_t m = 0; m < distinct; ++m)
    w.moe_loads.push_back(load_with_cap(cache.basis(model, run, w.tokens, m), model, run, run.chunk_cap_rows));
  return w;
}

// ---- FastPeaks -----------------------------------------------------------------------------

namespace {

constexpr uint8_t home_bit(PeakKind k) { return static_cast<uint8_t>(1u << static_cast<unsigned>(k)); }

using FP = FastPeaks;

FP::Comps comps_of(const FP::Cats& c) {
  return {c[cat(Category::Dispatch)], c[cat(Category::Vocab)], c[cat(Category::Boundaries)],
          c[cat(Category::Params)] + c[cat(Category::Grads)] + c[cat(Category::Optimizer)], c[cat(Category::Activations)]};
}

// The timeline of timeline.cpp with every layer listed (build_timeline(ctx, false)); the folded
// timeline has the same peaks (tests/unit/planner_fold_test.cpp). Layers are kept implicit: a
// layer's phases are its bases (persistent state + FSDP, per forward/recompute/backward) plus the
// transient terms of its kind, computed once per kind.
class Builder {
 public:
  Builder(const Ctx& c, FP& out, std::vector<FP::Phase>& phases, std::vector<FP::Layer>& layers,
          std::vector<std::vector<FP::Extra>>& kinds, std::vector<FP::Step>& order)
      : c_(c), phases_(phases), layers_(layers), kinds_(kinds), order_(order) {
    (void)out;
    L_ = c.m.num_layers;
    M_ = c.r.mtp ? c.m.mtp_layers : 0;
    all_grads_ = c.w.accumulation_steps > 1;
    staged_ = c.r.optimizer != OptimizerPlacement::Gpu && c.w.gpus > 1;  // reduce_scatter_output_staged
    head_ = c.w.head_unit;
    // reduced_before(l) for every l, the unit in flight counted: with MTP the head first, then
    // the modules from the last; the head; then L-1 down.
    reduced_.assign(static_cast<size_t>(L_ + M_), 0);
    int64_t sum = M_ > 0 ? shard(head_) : 0;
    for (int64_t j = L_ + M_ - 1; j >= L_; --j) {
      reduced_[static_cast<size_t>(j)] = sum;
      sum += shard(unit(j));
    }
    if (M_ == 0) sum += shard(head_);
    for (int64_t i = L_ - 1; i >= 0; --i) {
      reduced_[static_cast<size_t>(i)] = sum;
      sum += shard(unit(i));
    }
    layers_.assign(static_cast<size_t>(L_ + M_), FP::Layer{});
  }

  void build() {
    using B = FP::Bnd;
    {  // fwd/embed
      Acc base = state(grads(0));
      const FP::HeadRoles head = fsdp(base, 0, unit(0), -1, -1);
      Acc t = c_.acc();
      t.add(kAct, c_.T, kI64);
      t.add(kAct, mul(c_.T, c_.H), kB16);
      phase(home_bit(PeakKind::Layer), base, t, B::None, 0, head);
    }
    for (int64_t l = 0; l < L_; ++l) forward_layer(l);
    loss_forward(0);
    for (int64_t l = L_; l < L_ + M_; ++l) {
      forward_layer(l);
      loss_forward(1 + l - L_);
    }
    for (int64_t l = L_ + M_ - 1; l >= L_; --l) {
      loss_backward(1 + l - L_);
      backward_layer(l);
    }
    loss_backward(0);
    for (int64_t l = L_ - 1; l >= 0; --l) backward_layer(l);
    {  // bwd/embed: the largest of its backward, the copy into the reduce-scatter input and the
       // new shard beside that input (timeline.cpp); none involves the LM head unit, whose bytes
       // depend on the searched ring size.
      const int64_t all = c_.w.shard_params, before = all - c_.w.units[0].shard_params;
      Acc backward = state(grads(before));
      const FP::HeadRoles head = fsdp(backward, 0, -1, 0, unit(0));
      backward.add(kAct, mul(c_.T, c_.H), kB16);
      if (M_ > 0) mtp_embedding_grad(backward);
      Acc copy = state(grads(before));
      fsdp(copy, -1, -1, 0, 0);
      Acc shard = state(grads(all));
      fsdp(shard, -1, -1, -1, 0);
      const Acc* most = &backward;
      Acc landing = state(grads(before));
      if (staged_) {  // L0's shard lands first, through its staged reduce-scatter output
        shard.add(Category::Fsdp, reduced_shard(0), kF32);
        fsdp(landing, 0, -1, -1, unit(0));
        landing.add(Category::Fsdp, reduced_shard(unit(0)), kF32);
        landing.add(kAct, mul(c_.T, c_.H), kB16);
        if (M_ > 0) mtp_embedding_grad(landing);
        most = &landing;
      }
      for (const Acc* m : {&backward, &copy, &shard})
        if (m->total() > most->total()) most = m;
      phase(home_bit(PeakKind::Layer), *most, c_.acc(), B::None, 0, most == &backward ? head : FP::HeadRoles{});
    }
    // opt phases: persistent state only (no device transients in any placement).
    const int64_t opt_phases = c_.r.optimizer == OptimizerPlacement::Serial ? 3 : 1;
    for (int64_t i = 0; i < opt_phases; ++i) phase(home_bit(PeakKind::Optimizer), state(c_.w.shard_params), c_.acc(), B::None, 0, {});
  }

 private:
  int64_t unit(int64_t l) const { return c_.w.layer_unit(l); }
  int64_t grads(int64_t reduced) const { return all_grads_ ? c_.w.shard_params : reduced; }
  int64_t shard(int64_t u) const { return c_.w.units[static_cast<size_t>(u)].shard_params; }
  int64_t reduced_shard(int64_t u) const { return c_.w.units[static_cast<size_t>(u)].reduced_shard_params; }
  int64_t reduced_before(int64_t l) const { return reduced_[static_cast<size_t>(l)]; }
  int64_t in_flight_before(int64_t l) const {
    if (l >= L_) return head_;
    return l + 1 < L_ ? unit(l + 1) : head_;
  }

  // add_mtp_pending and add_mtp_embedding_grad (timeline.cpp).
  void mtp_pending(int64_t mtp_losses, int64_t hiddens, Acc& t) const {
    for (int64_t j = 0; j <= mtp_losses; ++j) loss_saved(c_, t);
    if (grads_in_forward()) t.add(Category::Fsdp, c_.H, kB16);  // the main loss's final-norm weight
    t.add(Category::Boundaries, mul(c_.T, c_.H), kB16, hiddens);
  }
  bool grads_in_forward() const { return c_.r.vocab != VocabMode::Materialized && c_.r.vocab_backward == VocabBackward::InForward; }
  void mtp_embedding_grad(Acc& t) const { t.add(kAct, mul(c_.T, c_.H), kB16); }

  Acc state(int64_t grad_params) const {
    Acc t = c_.acc();
    const int64_t P = c_.w.shard_params;
    const bool gpu = c_.r.optimizer == OptimizerPlacement::Gpu;
    // Grad shards: one tensor per reduced unit, each aligned (memory_terms_state.cpp).
    auto [it, fresh] = grad_bytes_.try_emplace(grad_params, 0);
    if (fresh) it->second = reduced_grad_bytes(c_.w, M_, grad_params, gpu ? kF32 : kB16, c_.al);
    t.c[cat(Category::Grads)] = checked_add(t.c[cat(Category::Grads)], it->second);
    if (gpu) {
      t.add(Category::Params, P, kF32);
      t.add(Category::Optimizer, P, kF32);
      t.add(Category::Optimizer, P, kF32);
    } else {
      t.add(Category::Params, P, kB16);
    }
    return t;
  }

  // add_fsdp without the LM head unit's share (it depends on the ring size): its roles are
  // returned and counted by FastPeaks::head_bytes.
  FP::HeadRoles fsdp(Acc& t, int64_t gathered, int64_t prefetch, int64_t grad, int64_t reduce_scatter) const {
    FP::HeadRoles roles;
    auto role = [&](int64_t u, int64_t bytes) {
      if (u < 0) return;
      if (u == head_) {
        (bytes == kF32 ? roles.fp32 : roles.bf16) += 1;
        return;
      }
      t.add(Category::Fsdp, c_.w.units[static_cast<size_t>(u)].gathered_params, bytes);
    };
    role(gathered, kB16);
    role(prefetch, kB16);
    role(grad, kB16);
    role(reduce_scatter, kF32);
    return roles;
  }

  void phase(uint8_t home, const Acc& base, const Acc& extra, FP::Bnd bnd, int64_t layer, FP::HeadRoles head,
             FP::Voc voc = FP::Voc::None) {
    FP::Phase p;
    p.home = home;
    Acc sum = base;
    sum.append(extra);
    p.fixed = sum.c;
    p.bnd = bnd;
    p.layer = layer;
    p.voc = voc;
    p.head = head;
    order_.push_back(FP::Step{FP::Step::Type::Phase, static_cast<int32_t>(phases_.size())});
    phases_.push_back(p);
  }

  static uint8_t layer_home(bool moe) {
    return static_cast<uint8_t>(home_bit(PeakKind::Checkpoint) | (moe ? home_bit(PeakKind::Dispatch) : home_bit(PeakKind::Layer)));
  }

  bool moe_layer(int64_t l) const { return c_.spec(l).ffn == FfnKind::Moe && c_.m.num_experts > 0; }
  int64_t load_index(int64_t l) const {
    return c_.w.moe_index[static_cast<size_t>(l)] % static_cast<int64_t>(c_.w.moe_loads.size());
  }

  // A layer's transient terms depend only on its kind: a decoder layer, an MTP module or the
  // last MTP module, FFN kind, its attention window (with CP > 1) and its routing; computed once
  // per kind, forward and backward together.
  using Kind = std::tuple<int, int, int, int64_t, int64_t>;
  int32_t kind_of(int64_t l) {
    const LayerSpec s = c_.spec(l);
    const bool moe = moe_layer(l);
    const bool window = c_.r.cp > 1 && s.window != AttentionWindow::Full && s.attention_window_tokens > 0;
    const Kind key{l < L_ ? 0 : l + 1 < L_ + M_ ? 1 : 2, moe ? 1 : 0, window ? static_cast<int>(s.window) : 0, window ? s.attention_window_tokens : 0,
                   moe ? load_index(l) : -1};
    auto it = kind_index_.find(key);
    if (it != kind_index_.end()) return it->second;
    const auto index = static_cast<int32_t>(kinds_.size());
    kind_index_[key] = index;
    kinds_.push_back(extras(l));
    return index;
  }

  std::vector<FP::Extra> extras(int64_t l) const {
    std::vector<FP::Extra> out;
    auto add = [&](uint8_t home, const Acc& t, FP::Disp disp, uint8_t base) {
      out.push_back(FP::Extra{home, t.c, comps_of(t.c), t.total(), disp, base});
    };
    const bool mtp = l >= L_;
    const bool moe = moe_layer(l);
    const std::vector<MoeShape> shapes = moe ? moe_shapes(c_, c_.w.load_of(c_.w.moe_index[static_cast<size_t>(l)])) : std::vector<MoeShape>{};
    // Forward (base 0).
    Acc attn = c_.acc();
    attention_forward(c_, l, attn);
    if (mtp) {  // or eh_proj's moment before it, whichever holds more (a tie: the attention's)
      Acc eh_proj = c_.acc();
      eh_proj.add(kAct, mul(c_.T, 2 * c_.H), kB16);
      if (eh_proj.total() > attn.total()) attn = eh_proj;
    }
    add(layer_home(false), attn, FP::Disp::None, 0);
    if (moe) {
      for (auto& p : worst_rank(shapes, [&](const MoeShape& s) { return pipelined(c_) ? pipelined_forward(c_, s, false) : ep_phases(c_, s, false); })) {
        Acc t = c_.acc();
        ffn_block_inputs(c_, t);
        if (p.kind == MoePhase::Experts || p.kind == MoePhase::Round) ffn_pair(c_, c_.m.shared_expert_ffn_width, t);
        if (p.disp == FP::Disp::None) t.append(p.terms);
        add(layer_home(true), t, p.disp, 0);
      }
    } else {
      Acc t = c_.acc();
      ffn_block_inputs(c_, t);
      ffn_pair(c_, c_.m.dense_ffn_width, t);
      add(layer_home(false), t, FP::Disp::None, 0);
    }
    // Backward: recompute (base 1) and backward (base 2).
    Acc attn_rec = c_.acc();
    if (mtp) attn_rec.add(kAct, mul(c_.T, 2 * c_.H), kB16);
    attention_recompute(c_, l, attn_rec);
    add(layer_home(false), attn_rec, FP::Disp::None, 1);
    out.back().or_landing = true;
    // Its alternative, the landing of the unit in flight (base 4): dy [T, H] the only activation.
    Acc landing = c_.acc();
    landing.add(kAct, mul(c_.T, c_.H), kB16);
    add(layer_home(false), landing, FP::Disp::None, 4);
    Acc block = c_.acc();
    if (mtp) block.add(kAct, mul(c_.T, 2 * c_.H), kB16);
    attention_saved(c_, block);
    ffn_block_inputs(c_, block);
    layer_grad_stream(c_, block);
    if (moe) {
      const int64_t Fs = c_.m.shared_expert_ffn_width;
      for (auto& p : worst_rank(shapes, [&](const MoeShape& s) { return pipelined(c_) ? pipelined_forward(c_, s, true) : ep_phases(c_, s, true); })) {
        Acc t = block;
        ffn_pair(c_, Fs, t);
        shared_gate_saved(c_, t);
        if (p.disp == FP::Disp::None) t.append(p.terms);
        add(layer_home(true), t, p.disp, 1);
      }
      std::vector<MoeTerms> back;
      if (pipelined(c_)) back.push_back(MoeTerms{MoePhase::Round, FP::Disp::BackwardRound, c_.acc()});
      else back = worst_rank(shapes, [&](const MoeShape& s) { return ep_backward(c_, s); });
      for (auto& p : back) {
        Acc t = block;
        ffn_pair(c_, Fs, t);
        shared_gate_saved(c_, t);
        if (p.kind == MoePhase::Experts || p.kind == MoePhase::Round) ffn_backward_grads(c_, Fs, t);
        if (p.disp == FP::Disp::None) t.append(p.terms);
        add(layer_home(true), t, p.disp, 2);
      }
    } else {
      const int64_t F = c_.m.dense_ffn_width;
      Acc t = block;
      ffn_pair(c_, F, t);
      add(layer_home(false), t, FP::Disp::None, 1);
      ffn_backward_grads(c_, F, t);
      t.add(kAct, mul(c_.T, c_.H), kB16);
      add(layer_home(false), t, FP::Disp::None, 2);
    }
    Acc bwd_attn = c_.acc();
    attention_backward(c_, l, bwd_attn);
    if (mtp) {  // or eh_proj's backward, whichever holds more (a tie: the attention's)
      bwd_attn.add(kAct, mul(c_.T, 2 * c_.H), kB16);
      Acc eh_proj = c_.acc();
      eh_proj.add(kAct, mul(c_.T, 2 * c_.H), kB16);
      eh_proj.add(kAct, mul(c_.T, c_.H), kB16);
      eh_proj.add(kAct, mul(c_.T, 2 * c_.H), kB16);
      if (eh_proj.total() > bwd_attn.total()) bwd_attn = eh_proj;
    }
    add(layer_home(false), bwd_attn, FP::Disp::None, 2);
    out.back().or_copy_in = true;
    // Its alternative, the grads' copy-in (base 3): d x_l [T, H] the only activation.
    Acc copy_in = c_.acc();
    copy_in.add(kAct, mul(c_.T, c_.H), kB16);
    add(layer_home(false), copy_in, FP::Disp::None, 3);
    return out;
  }

  void set_base(FP::Layer& e, int b, const Acc& base, FP::HeadRoles head) {
    e.base[static_cast<size_t>(b)] = base.c;
    e.base_comps[static_cast<size_t>(b)] = comps_of(base.c);
    e.base_total[static_cast<size_t>(b)] = base.total();
    e.head[static_cast<size_t>(b)] = head;
  }

  void forward_layer(int64_t l) {
    FP::Layer& e = layers_[static_cast<size_t>(l)];
    e.layer = l;
    e.kind = kind_of(l);
    e.load_index = moe_layer(l) ? static_cast<int32_t>(load_index(l)) : 0;
    Acc base = state(grads(0));
    const int64_t next = l + 1 < L_ ? unit(l + 1) : head_;
    const FP::HeadRoles head = fsdp(base, unit(l), next, -1, -1);
    if (l >= L_) mtp_pending(l - L_, l - L_, base);
    set_base(e, 0, base, head);
    order_.push_back(FP::Step{FP::Step::Type::Forward, static_cast<int32_t>(l)});
  }

  void backward_layer(int64_t l) {
    FP::Layer& e = layers_[static_cast<size_t>(l)];
    const bool mtp = l >= L_, last_module = mtp && l == L_ + M_ - 1;
    const int64_t prev = mtp ? (grads_in_forward() ? -1 : head_) : (l > 0 ? unit(l - 1) : 0);
    auto pending = [&](Acc& base) {
      if (mtp) mtp_pending(l - L_, l - L_, base);
      if (M_ > 0 && !last_module) mtp_embedding_grad(base);
    };
    for (int b = 1; b <= 2; ++b) {
      Acc base = state(grads(reduced_before(l)));
      const FP::HeadRoles head = fsdp(base, unit(l), prev, b == 2 ? unit(l) : -1, in_flight_before(l));
      pending(base);
      if (mtp && b == 1) base.add(Category::Fsdp, c_.H, kB16);  // its loss's head-norm grad, held
      set_base(e, b, base, head);
    }
    {  // 3: the grads' copy-in (timeline.cpp): the layer released, its grads and fp32 input live
      Acc base = state(grads(reduced_before(l)));
      const FP::HeadRoles head = fsdp(base, -1, prev, unit(l), unit(l));
      pending(base);
      if (last_module) mtp_embedding_grad(base);
      set_base(e, 3, base, head);
    }
    const int64_t landing = in_flight_before(l);
    // With MTP the head lands again into its fp32 shard through an output (head_reduced_through_an_output).
    const bool head_again =
        M_ > 0 && landing == head_ && !last_module && c_.r.optimizer == OptimizerPlacement::Gpu && c_.w.gpus > 1;
    e.landing = landing >= 0 && (staged_ || head_again);
    if (e.landing) {  // 4: the unit in flight lands (timeline.cpp): the layer gathered, its output staged
      Acc base = state(grads(reduced_before(l)));
      const FP::HeadRoles head = fsdp(base, unit(l), -1, -1, landing);
      base.add(Category::Fsdp, reduced_shard(landing), kF32);
      pending(base);
      if (mtp) base.add(Category::Fsdp, c_.H, kB16);
      set_base(e, 4, base, head);
    }
    order_.push_back(FP::Step{FP::Step::Type::Backward, static_cast<int32_t>(l)});
  }

  void loss_forward(int64_t index) {
    Acc base = state(grads(0));
    if (index > 0) mtp_pending(index - 1, index, base);
    const uint8_t home = home_bit(PeakKind::Vocab);
    if (c_.r.vocab == VocabMode::Materialized) {
      Acc t = c_.acc();
      const VocabShape s = vocab_shape(c_);
      x_w(s, t);
      lse_loss(s, t);
      t.add(kVoc, mul(s.T, s.V), kB16);
      t.add(kVoc, mul(s.T, s.V), kF32);
      phase(home, base, t, FP::Bnd::Loss, index, {});
    } else {
      phase(home, base, c_.acc(), FP::Bnd::Loss, index, {}, FP::Voc::BlockForward);
    }
  }

  void loss_backward(int64_t index) {
    const int64_t k = index - 1;  // the MTP module of this loss (index > 0)
    int64_t reduced = reduced_before(L_ - 1) - shard(head_);
    if (index > 0) reduced = reduced_before(L_ + k) - (k == M_ - 1 ? shard(head_) : 0);
    else if (M_ > 0) reduced = reduced_before(L_ - 1);
    Acc base = state(grads(reduced));
    if (index > 0) mtp_pending(k, index, base);
    if (index == 0 ? M_ > 0 : k < M_ - 1) {  // d of this loss's input from the next module; d embedding
      base.add(kAct, mul(c_.T, c_.H), kB16);
      mtp_embedding_grad(base);
    }
    const int64_t next = index > 0 ? unit(L_ + k) : unit(L_ - 1);
    const int64_t in_flight = index > 0 ? (k + 1 < M_ ? unit(L_ + k + 1) : -1) : (M_ > 0 ? unit(L_) : -1);
    const FP::HeadRoles head = fsdp(base, -1, next, -1, in_flight);
    const uint8_t home = home_bit(PeakKind::Vocab);
    if (c_.r.vocab == VocabMode::Materialized) {
      Acc t = c_.acc();
      const VocabShape s = vocab_shape(c_);
      x_w(s, t);
      lse_loss(s, t);
      t.add(kVoc, mul(s.T, s.V), kB16);
      t.add(kVoc, mul(s.T, s.V), kF32);
      t.add(kVoc, mul(s.T, s.V), kF32);
      t.add(kVoc, mul(s.T, s.H), kB16);
      t.add(kVoc, s.w_params, kB16);  // dW: the head unit's grads
      phase(home, base, t, FP::Bnd::Loss, index, head);
    } else if (c_.r.vocab_backward == VocabBackward::InForward) {
      Acc t = c_.acc();
      loss_saved(c_, t);
      t.add(Category::Fsdp, c_.H, kB16);  // the final norm's weight, or an MTP loss's held head-norm grad (timeline.cpp)
      t.add(kAct, c_.T, kF32, c_.m.norm_bias ? 2 : 1);
      t.add(kAct, mul(c_.T, c_.H), kB16);
      phase(home, base, t, FP::Bnd::Loss, index, head);
    } else {
      phase(home, base, c_.acc(), FP::Bnd::Loss, index, head, FP::Voc::BlockBackward);
    }
  }

  const Ctx& c_;
  std::vector<FP::Phase>& phases_;
  std::vector<FP::Layer>& layers_;
  std::vector<std::vector<FP::Extra>>& kinds_;
  std::vector<FP::Step>& order_;
  int64_t L_ = 0, M_ = 0, head_ = 0;
  bool all_grads_ = false;
  bool staged_ = false;  // grad shards land through an fp32 reduce-scatter output (memory_model.h)
  std::vector<int64_t> reduced_;
  std::map<Kind, int32_t> kind_index_;
  mutable std::map<int64_t, int64_t> grad_bytes_;  // grad shard params -> their bytes
};

}  // namespace

FastPeaks::FastPeaks(const ModelSpec& model, const HardwareSpec& hardware, const ResolvedRun& run, const Workload& work)
    : model_(model), run_(run) {
  L_ = model.num_layers;
  T_ = work.tokens;
  al_ = run.alignment_bytes;
  boundary_one_ = align_up(checked_mul(checked_mul(T_, model.hidden_size), 2), al_);
  head_gathered_ = work.units[static_cast<size_t>(work.head_unit)].gathered_params;
  loss_w_params_ = loss_weight_params(model, work);
  shard_params_ = work.shard_params;
  stub_.expert_params_each = work.expert_params_each;
  const Ctx c{model, run, work, T_, model.hidden_size, al_};
  order_.reserve(static_cast<size_t>(2 * (model.num_layers + model.mtp_layers) + 12));
  Builder(c, *this, phases_, layers_, kinds_, order_).build();
  // Host terms that no searched knob moves (host_terms_per_gpu: each tensor aligned).
  const int64_t P = shard_params_;
  if (run.optimizer != OptimizerPlacement::Gpu) {
    host_fixed_per_gpu_ = checked_mul(4, align_up(checked_mul(P, 4), al_));
    if (run.optimizer == OptimizerPlacement::Serial)
      host_fixed_per_gpu_ = checked_add(host_fixed_per_gpu_, checked_mul(2, align_up(checked_mul(P, 2), al_)));
  }
  gpus_per_node_ = run.gpus_per_node;
  host_fixed_per_node_ = run.host_fixed_bytes_per_node;
  host_budget_ = static_cast<int64_t>(std::floor(run.host_usable_fraction * static_cast<double>(run.host_memory_bytes_per_node)));
  overhead_ = run.overhead_bytes;
  fragmentation_ = run.fragmentation;
  device_budget_ = hardware.device_memory_bytes;
  // Largest peak p with required_bytes(p) <= budget (required is non-decreasing in p).
  int64_t lo = -1, hi = std::max<int64_t>(0, device_budget_);
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo + 1) / 2;
    if (required_bytes(mid) <= device_budget_) lo = mid;
    else hi = mid - 1;
  }
  gpu_peak_budget_ = lo;
}

int64_t FastPeaks::required_bytes(int64_t gpu_peak) const {
  const auto frag = static_cast<int64_t>(std::ceil(fragmentation_ * static_cast<double>(gpu_peak)));
  return checked_add(checked_add(gpu_peak, overhead_), frag);
}

int64_t FastPeaks::boundary_count(Bnd rule, int64_t l, int64_t n, int64_t prefetch) const {
  // First-n offload sets: resident among inputs 0..i = (i+1) - min(n, i+1).
  const int64_t last = L_ - 1;
  switch (rule) {
    case Bnd::None: return 0;
    case Bnd::Forward: {
      const int64_t i = std::min(l, last);
      int64_t count = (i + 1) - std::min(n, i + 1);
      if (l >= L_) count += l - L_ + 1 + 1 + (n > 0 ? 1 : 0);  // MTP inputs, final hidden, x_0 fetched
      else count += l < n ? 1 : 0;                            // this layer's copy in flight
      return count;
    }
    case Bnd::Backward: {
      const int64_t i = std::min(l, last);
      int64_t count = (i + 1) - std::min(n, i + 1);
      if (l >= L_) return count + (l - L_ + 1) + 1 + (n > 0 ? 1 : 0);
      return count + (l < n ? 1 : 0) + std::max<int64_t>(0, std::min(l, n) - std::max<int64_t>(0, l - prefetch));
    }
    case Bnd::Loss: return L_ - std::min(n, L_) + l + 1;  // resident_upto(L-1) + extra + final hidden
  }
  return 0;
}

int64_t FastPeaks::dispatch_bytes(Disp kind, const MoeLoad& load) const {
  const Ctx c{model_, run_, stub_, T_, model_.hidden_size, al_};
  int64_t most = 0;  // the candidate ranks' largest
  for (const MoeShape& s : moe_shapes(c, load)) most = std::max(most, round_phase(c, s, kind).c[cat(Category::Dispatch)]);
  return most;
}

int64_t FastPeaks::vocab_bytes(Voc kind, int64_t ring_size, RingRotate rotate, int64_t token_block, int64_t vocab_block) const {
  const int64_t R = run_.vocab == VocabMode::RingDtp ? ring_size : 1;
  const VocabShape s = vocab_shape_of(T_, model_.hidden_size, model_.vocab_size, R, token_block, vocab_block, loss_w_params_);
  const bool in_forward = run_.vocab_backward == VocabBackward::InForward;
  Acc t(al_);
  x_w(s, t);
  // R > 1 with gradients in forward: the forward's largest live set is its gradient ring pass's,
  // the backward's (memory_terms_vocab.cpp).
  // R = 1: one workspace buffer per block (memory_terms_vocab.cpp, add_block_workspace).
  const auto workspace = [&](bool state, bool grads) {
    int64_t words = mul(s.Tb, s.Vb);
    if (state) words = checked_add(words, mul(3, s.Tb));
    if (grads) words = checked_add(words, checked_add(mul(s.Tb, s.H), ceil_div(mul(s.Tb, s.Vb), 2)));
    t.add(kVoc, words, kF32);
  };
  if (s.R == 1) {
    const bool forward = kind == Voc::BlockForward;
    workspace(forward, !forward || in_forward);
    lse_loss(s, t);
    if (!forward || in_forward) {
      t.add(kVoc, mul(s.T, s.H), kB16);  // dX
      dw(rotate, s, t);
    }
    return t.c[cat(kVoc)];
  }
  if (kind == Voc::BlockForward && !(in_forward && s.R > 1)) {
    t.add(kVoc, mul(s.Tb, s.Vb), kF32);
    if (rotate == RingRotate::Weights) t.add(kVoc, mul(3, s.T), kF32);  // activations: it travels
    lse_loss(s, t);
    ring(rotate, s, in_forward, t);
    if (in_forward) {
      t.add(kVoc, mul(s.Tb, s.Vb), kB16);
      dx(s, t);
      dw(rotate, s, t);
    }
  } else {
    lse_loss(s, t);
    t.add(kVoc, mul(s.Tb, s.Vb), kF32);
    t.add(kVoc, mul(s.Tb, s.Vb), kB16);
    ring(rotate, s, true, t);
    dx(s, t);
    dw(rotate, s, t);
  }
  return t.c[cat(kVoc)];
}

int64_t FastPeaks::head_bytes(HeadRoles roles, int64_t ring_size) const {
  if (roles.bf16 == 0 && roles.fp32 == 0) return 0;
  const int64_t params = run_.vocab == VocabMode::RingDtp ? ceil_div(head_gathered_, ring_size) : head_gathered_;
  return roles.bf16 * align_up(checked_mul(params, kB16), al_) + roles.fp32 * align_up(checked_mul(params, kF32), al_);
}

int64_t FastPeaks::host_per_gpu_bytes(int64_t offloaded_layers, int64_t bucket_params, int64_t bucket_depth) const {
  int64_t bytes = host_fixed_per_gpu_;
  if (run_.optimizer == OptimizerPlacement::Stream) {
    const int64_t bucket = std::min(bucket_params, shard_params_);
    if (bucket > 0 && bucket_depth > 0)
      bytes = checked_add(bytes, checked_mul(checked_mul(2, bucket_depth), align_up(checked_mul(bucket, 2), al_)));
  }
  if (offloaded_layers > 0)
    bytes = checked_add(bytes, align_up(checked_mul(offloaded_layers, checked_mul(checked_mul(T_, model_.hidden_size), 2)), al_));
  return bytes;
}

int64_t FastPeaks::host_peak_bytes(int64_t host_per_gpu) const {
  return checked_add(checked_mul(gpus_per_node_, host_per_gpu), host_fixed_per_node_);
}

PeakKnobs FastPeaks::knobs_of(const ResolvedRun& run, const Workload& work) const {
  PeakKnobs k;
  k.loads = work.moe_loads;
  k.ring_size = run.vocab == VocabMode::RingDtp ? run.ring_size : 1;
  k.ring_rotate = run.ring_rotate;
  k.token_block = run.token_block;
  k.vocab_block = run.vocab_block;
  k.offloaded = run.sco_offloaded;
  k.sco_prefetch = run.sco_prefetch;
  k.bucket_params = run.bucket_params;
  k.bucket_depth = run.bucket_depth;
  return k;
}

FastSummary FastPeaks::evaluate(const PeakKnobs& k) const {
  FastSummary s;
  // prefix[i] = offloaded among layers 0..i-1.
  std::vector<int64_t> prefix(static_cast<size_t>(L_ + 1), 0);
  for (int64_t i = 0; i < L_; ++i) {
    const bool off = k.sco_first >= 0 ? i < k.sco_first
                                      : static_cast<size_t>(i) < k.offloaded.size() && k.offloaded[static_cast<size_t>(i)];
    prefix[static_cast<size_t>(i + 1)] = prefix[static_cast<size_t>(i)] + (off ? 1 : 0);
  }
  const int64_t last = L_ - 1;
  auto resident = [&](int64_t l) {
    const int64_t i = std::min(l, last);
    return (i + 1) - prefix[static_cast<size_t>(i + 1)] + (l >= L_ ? l - L_ + 1 : 0);
  };
  auto off = [&](int64_t l) { return prefix[static_cast<size_t>(l + 1)] - prefix[static_cast<size_t>(l)]; };
  auto boundaries = [&](Bnd rule, int64_t l) -> int64_t {
    switch (rule) {
      case Bnd::None: return 0;
      // An MTP module: h_L and, with x_0 offloaded, its fetched copy.
      case Bnd::Forward: return resident(l) + (l >= L_ ? 1 + off(0) : off(l));
      case Bnd::Backward: {
        if (l >= L_) return resident(l) + 1 + off(0);
        const int64_t lo = std::max<int64_t>(0, l - k.sco_prefetch);
        return resident(l) + off(l) + (prefix[static_cast<size_t>(l)] - prefix[static_cast<size_t>(lo)]);
      }
      case Bnd::Loss: return resident(last) + l + 1;
    }
    return 0;
  };
  // Knob-dependent bytes per rule, computed once.
  std::vector<std::array<int64_t, 4>> disp(k.loads.size());
  for (size_t i = 0; i < k.loads.size(); ++i)
    for (auto kind : {Disp::ForwardRound, Disp::RecomputeRound, Disp::BackwardRound})
      disp[i][static_cast<size_t>(kind)] = dispatch_bytes(kind, k.loads[i]);
  const bool blocks = run_.vocab != VocabMode::Materialized;
  const int64_t voc[3] = {0, blocks ? vocab_bytes(Voc::BlockForward, k.ring_size, k.ring_rotate, k.token_block, k.vocab_block) : 0,
                          blocks ? vocab_bytes(Voc::BlockBackward, k.ring_size, k.ring_rotate, k.token_block, k.vocab_block) : 0};
  const int64_t head_params = run_.vocab == VocabMode::RingDtp ? ceil_div(head_gathered_, k.ring_size) : head_gathered_;
  const int64_t head_one[2] = {align_up(checked_mul(head_params, kB16), al_), align_up(checked_mul(head_params, kF32), al_)};
  auto head = [&](HeadRoles r) { return r.bf16 * head_one[0] + r.fp32 * head_one[1]; };

  std::array<int64_t, kPeakCount> best_total{};
  s.component_bytes.fill(-1);
  s.peak_phase.fill(-1);
  Comps peak_comps{};
  uint8_t peak_home = 0;
  int index = 0;
  auto visit = [&](uint8_t home, const Comps& comp, int64_t total) {
    for (int kk = 0; kk < kPeakCount; ++kk) {
      if (!(home & (1u << kk))) continue;
      const auto ku = static_cast<size_t>(kk);
      if (comp[ku] > s.component_bytes[ku] || (comp[ku] == s.component_bytes[ku] && total > best_total[ku])) {
        s.component_bytes[ku] = comp[ku];
        best_total[ku] = total;
        s.peak_phase[ku] = index;
      }
    }
    if (total > s.gpu_peak_bytes) {
      s.gpu_peak_bytes = total;
      s.gpu_peak_phase = index;
      peak_comps = comp;
      peak_home = home;
    }
    ++index;
  };
  constexpr size_t kDispatch = static_cast<size_t>(PeakKind::Dispatch);
  constexpr size_t kCheckpoint = static_cast<size_t>(PeakKind::Checkpoint);
  for (const Step& step : order_) {
    if (step.type == Step::Type::Phase) {
      const Phase& p = phases_[static_cast<size_t>(step.index)];
      Cats c = p.fixed;
      c[cat(Category::Boundaries)] += checked_mul(boundaries(p.bnd, p.layer), boundary_one_);
      c[cat(Category::Vocab)] += voc[static_cast<size_t>(p.voc)];
      c[cat(Category::Fsdp)] += head(p.head);
      int64_t total = 0;
      for (int64_t v : c) total = checked_add(total, v);
      visit(p.home, comps_of(c), total);
      continue;
    }
    // A layer pass: base + transient terms of its kind, plus boundaries, the head's FSDP share
    // and the dispatch round terms; totals and components added part by part.
    const Layer& e = layers_[static_cast<size_t>(step.index)];
    const bool forward = step.type == Step::Type::Forward;
    const int64_t bnd = checked_mul(boundaries(forward ? Bnd::Forward : Bnd::Backward, e.layer), boundary_one_);
    const std::vector<Extra>& kind = kinds_[static_cast<size_t>(e.kind)];
    for (size_t xi = 0; xi < kind.size(); ++xi) {
      const Extra& x = kind[xi];
      if (x.base >= 3) continue;  // the copy-in and the landing: taken with the extra before them
      if ((x.base == 0) != forward) continue;
      const int64_t dsp = x.disp != Disp::None ? disp[static_cast<size_t>(e.load_index)][static_cast<size_t>(x.disp)] : 0;
      const Comps& bc = e.base_comps[x.base];
      Comps comp;
      for (size_t i = 0; i < comp.size(); ++i) comp[i] = bc[i] + x.comps[i];
      comp[kDispatch] += dsp;
      comp[kCheckpoint] += bnd;
      const int64_t total = e.base_total[x.base] + x.total + bnd + head(e.head[x.base]) + dsp;
      if (x.or_landing && e.landing) {  // the larger total of the recompute and the landing (a tie: the recompute)
        const Extra& y = kind[xi + 1];
        const int64_t l = e.layer;
        // Boundaries then: the resident ones and those the previous layer's prefetch fetched.
        int64_t fetched = resident(l) + (l >= L_ ? 1 : 0);  // an MTP module: h_L
        if (l + 1 < L_) {
          const int64_t first = std::max<int64_t>(0, l + 1 - k.sco_prefetch);
          fetched += prefix[static_cast<size_t>(l + 1)] - prefix[static_cast<size_t>(first)];
        }
        const int64_t landing_bnd = checked_mul(fetched, boundary_one_);
        const int64_t landing_total = e.base_total[4] + y.total + landing_bnd + head(e.head[4]);
        if (landing_total > total) {
          Comps landing;
          for (size_t i = 0; i < landing.size(); ++i) landing[i] = e.base_comps[4][i] + y.comps[i];
          landing[kCheckpoint] += landing_bnd;
          visit(x.home, landing, landing_total);
          continue;
        }
      }
      if (x.or_copy_in) {  // the larger total of the attention backward and the copy-in (a tie: the backward)
        const Extra& y = kind[xi + 1];
        const int64_t copy_total = e.base_total[3] + y.total + bnd + head(e.head[3]);
        if (copy_total > total) {
          Comps copy;
          for (size_t i = 0; i < copy.size(); ++i) copy[i] = e.base_comps[3][i] + y.comps[i];
          copy[kCheckpoint] += bnd;
          visit(x.home, copy, copy_total);
          continue;
        }
      }
      visit(x.home, comp, total);
    }
  }
  for (int kk = 0; kk < kPeakCount; ++kk) {
    const auto ku = static_cast<size_t>(kk);
    if (s.peak_phase[ku] < 0) s.component_bytes[ku] = 0;
    else s.peak_bytes[ku] = best_total[ku];
  }
  if (s.gpu_peak_phase >= 0) {
    int64_t best = -1;
    for (int kk = 0; kk < kPeakCount; ++kk) {
      if (!(peak_home & (1u << kk))) continue;
      if (peak_comps[static_cast<size_t>(kk)] > best) {
        best = peak_comps[static_cast<size_t>(kk)];
        s.binding = static_cast<PeakKind>(kk);
      }
    }
  }
  // The model state alone does not fit the GPU: it runs out first (summarize() in plan.cpp).
  constexpr size_t kOptimizer = static_cast<size_t>(PeakKind::Optimizer);
  if (s.component_bytes[kOptimizer] > 0 && required_bytes(s.component_bytes[kOptimizer]) > device_budget_)
    s.binding = PeakKind::Optimizer;
  s.required_bytes = required_bytes(s.gpu_peak_bytes);
  s.budget_bytes = device_budget_;
  s.host_budget_bytes = host_budget_;
  s.gpu_fits = s.required_bytes <= device_budget_;
  s.host_per_gpu_bytes = host_per_gpu_bytes(prefix[static_cast<size_t>(L_)], k.bucket_params, k.bucket_depth);
  s.host_peak_bytes = host_peak_bytes(s.host_per_gpu_bytes);
  s.host_fits = s.host_peak_bytes <= host_budget_;
  return s;
}

}  // namespace flatpeak::planner
