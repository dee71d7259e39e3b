// Composes the phases of one step (the worst micro-batch, then the optimizer step):
//   fwd/embed, fwd/L<l>/..., loss/fwd..., [fwd/MTP<j>/..., loss/mtp<j>/fwd...],
//   [loss/mtp<j>/bwd..., bwd/MTP<j>/...] from the last module, loss/bwd...,
//   bwd/L<l>/recompute/..., bwd/L<l>/moe/..., bwd/L<l>/attn, bwd/embed, opt/...
// MTP modules (planner/README.md "Multi-token prediction"): each loss's backward is deferred until
// the modules after it are done; module j's output h^j stays until its loss's backward; every
// loss's backward reduce-scatters the LM head's grads (the shard accumulates), and the modules'
// gradient into the shifted embedding waits in one [T, H] buffer for bwd/embed.
// Layers with the same signature (FFN kind, attention window, routing) are folded into one
// representative: the last in forward order, which has the most boundaries resident both at the
// end of the forward pass and at the start of the backward pass.
#include "timeline.h"

#include <algorithm>
#include <map>
#include <tuple>

namespace flatpeak::planner {

namespace {

using Signature = std::tuple<bool, int, int, int64_t, int64_t>;

std::string ranges(const std::vector<int64_t>& layers, const char* prefix, int64_t base) {
  std::string out;
  for (size_t i = 0; i < layers.size();) {
    size_t j = i;
    while (j + 1 < layers.size() && layers[j + 1] == layers[j] + 1) ++j;
    if (!out.empty()) out += ",";
    out += prefix + std::to_string(layers[i] - base);
    if (j > i) out += std::string("-") + prefix + std::to_string(layers[j] - base);
    i = j + 1;
  }
  return out;
}

class Builder {
 public:
  Builder(const Context& c, bool fold) : c_(c), fold_(fold) {
    L_ = c.model.num_layers;
    M_ = c.run.mtp ? c.model.mtp_layers : 0;
    for (int64_t l = 0; l < L_; ++l) offloaded_.push_back(c.run.sco_offloaded.size() > static_cast<size_t>(l) &&
                                                         c.run.sco_offloaded[static_cast<size_t>(l)]);
    // Signatures and their representatives.
    std::map<Signature, std::vector<int64_t>> groups;
    for (int64_t l = 0; l < L_ + M_; ++l) groups[signature(l)].push_back(l);
    for (auto& [sig, members] : groups) {
      const int64_t rep = members.back();
      reps_.push_back(rep);
      members_[rep] = members;
      const bool mtp = rep >= L_;
      folds_[rep] = members.size() > 1 ? ranges(members, mtp ? "MTP" : "L", mtp ? L_ : 0) : "";
    }
    std::sort(reps_.begin(), reps_.end());
    all_grads_ = c.work.accumulation_steps > 1;
  }

  Timeline build() {
    Timeline tl;
    tl.host_per_gpu = host_terms_per_gpu(c_);
    forward_embedding();
    append_sorted(layer_instances(false), true);
    loss_forward("loss", 0);
    for (int64_t l : reps_)
      if (l >= L_) {
        forward_layer(l);
        loss_forward("loss/mtp" + std::to_string(l - L_), 1 + l - L_);
      }
    // Backward: MTP losses and modules first (created last), then the main loss and the layers.
    for (auto it = reps_.rbegin(); it != reps_.rend(); ++it)
      if (*it >= L_) {
        loss_backward("loss/mtp" + std::to_string(*it - L_), 1 + *it - L_);
        append(backward_layer(*it));
      }
    loss_backward("loss", 0);
    append_sorted(layer_instances(true), false);
    backward_embedding();
    for (auto& p : optimizer_phases(c_)) emit("opt/" + p.suffix, p.folds, persistent_state(c_.work.shard_params), p.terms);
    tl.phases = std::move(phases_);
    return tl;
  }

 private:
  // The instances that stand for each group of decoder layers: the last member (most boundaries
  // resident) and, when its live set is larger, the worst of the candidates where the maximum
  // can sit: the members next to the group's ends (their FSDP neighbours differ) and, in
  // backward, the first member (boundaries fall but reduced grad shards grow down the stack;
  // between the ends the total changes linearly, so its maximum is at an end) — or every member
  // when the group's SCO set is irregular.
  std::vector<std::vector<Phase>> layer_instances(bool backward) {
    std::vector<std::vector<Phase>> out;
    for (int64_t rep : reps_) {
      if (rep >= L_) continue;
      const std::vector<int64_t>& mem = members_[rep];
      std::vector<int64_t> candidates;
      if (mem.size() >= 2) candidates.push_back(mem[mem.size() - 2]);
      if (backward && !all_grads_ && mem.size() >= 3) candidates.push_back(mem[1]);
      if (backward && !all_grads_ && mem.size() >= 2) candidates.push_back(mem[0]);
      // A group whose members are not all offloaded alike (an irregular SCO set) is not linear
      // between its ends: boundaries prefetched or in flight depend on which layers nearby are
      // offloaded. Then every member is a candidate (still one pass over the group).
      const auto offloaded = [&](int64_t l) { return l < L_ && offloaded_[static_cast<size_t>(l)]; };
      if (std::any_of(mem.begin(), mem.end(), [&](int64_t l) { return offloaded(l) != offloaded(mem.front()); }))
        candidates.assign(mem.begin(), mem.end() - 1);
      std::vector<Phase> last = instance(rep, backward, folds_[rep]);
      std::vector<Phase> worst;
      int64_t worst_bytes = max_bytes(last);
      for (int64_t l : candidates) {
        std::vector<Phase> p = instance(l, backward, folds_[rep]);
        if (max_bytes(p) > worst_bytes) worst_bytes = max_bytes(p), worst = std::move(p);
      }
      out.push_back(std::move(last));
      if (!worst.empty()) out.push_back(std::move(worst));
    }
    return out;
  }

  std::vector<Phase> instance(int64_t l, bool backward, const std::string& folds) {
    if (backward) return backward_layer(l, folds);
    std::vector<Phase> saved;
    std::swap(saved, phases_);
    forward_layer(l, folds);
    std::swap(saved, phases_);
    return saved;
  }

  void append_sorted(std::vector<std::vector<Phase>> groups, bool ascending) {
    std::stable_sort(groups.begin(), groups.end(), [ascending](const std::vector<Phase>& a, const std::vector<Phase>& b) {
      return ascending ? layer_of(a.front().name) < layer_of(b.front().name) : layer_of(a.front().name) > layer_of(b.front().name);
    });
    for (auto& g : groups) append(std::move(g));
  }

  static int64_t max_bytes(const std::vector<Phase>& phases) {
    int64_t m = 0;
    for (const auto& p : phases) m = std::max(m, p.device_bytes());
    return m;
  }
  static int64_t layer_of(const std::string& name) {  // "bwd/L12/..." -> 12
    const size_t at = name.find("/L");
    return at == std::string::npos ? -1 : std::stoll(name.substr(at + 2));
  }
  void append(std::vector<Phase> phases) {
    for (auto& p : phases) phases_.push_back(std::move(p));
  }

  // Grad shards already reduce-scattered when the backward of layer l starts, the unit in flight
  // counted (reduction order, reduced_grad_bytes: with MTP the head first, after the last module's
  // loss, then the modules from the last; the head; layers from L-1 down).
  int64_t reduced_before(int64_t l) const {
    int64_t sum = 0;
    auto shard = [&](int64_t unit_index) { return c_.work.units[static_cast<size_t>(unit_index)].shard_params; };
    for (int64_t j = L_ + M_ - 1; j > l && j >= L_; --j) sum += shard(unit(j));
    sum += shard(c_.work.head_unit);
    if (l < L_)
      for (int64_t i = L_ - 1; i > l; --i) sum += shard(unit(i));
    return sum;
  }
  // The unit whose reduce-scatter is in flight as layer l's backward starts: the head after every
  // loss's backward (an MTP module runs right after its loss's), else the layer after l.
  int64_t in_flight_before(int64_t l) const {
    if (l >= L_) return c_.work.head_unit;
    return l + 1 < L_ ? unit(l + 1) : c_.work.head_unit;
  }

  Signature signature(int64_t l) const {
    const LayerSpec s = c_.layer_spec(l);
    const bool mtp = l >= L_;
    int64_t moe = c_.work.moe_index[static_cast<size_t>(l)];
    const int64_t routing = moe >= 0 && c_.work.moe_loads.size() > 1 ? moe % static_cast<int64_t>(c_.work.moe_loads.size()) : -1;
    const bool window_matters = c_.run.cp > 1;
    return {mtp, static_cast<int>(s.ffn), window_matters ? static_cast<int>(s.window) : 0,
            window_matters ? s.attention_window_tokens : 0, routing + (mtp || !fold_ ? (l + 1) * 1000000 : 0)};
  }

  std::string layer_name(int64_t l) const { return l < L_ ? "L" + std::to_string(l) : "MTP" + std::to_string(l - L_); }
  int64_t unit(int64_t l) const { return c_.work.layer_unit(l); }

  // Grad shards live now: all of them when accumulating, else the units already reduced.
  int64_t grads(int64_t reduced_shard_params) const { return all_grads_ ? c_.work.shard_params : reduced_shard_params; }

  TermList persistent_state(int64_t grad_params) const {
    TermList t = c_.list();
    add_model_state(c_, grad_params, t);
    return t;
  }

  int64_t resident_upto(int64_t l) const {  // device-resident boundaries among inputs 0..l
    int64_t n = 0;
    for (int64_t i = 0; i <= std::min(l, L_ - 1); ++i) n += offloaded_[static_cast<size_t>(i)] ? 0 : 1;
    if (l >= L_) n += l - L_ + 1;  // MTP module inputs stay on the device
    return n;
  }

  void emit(const std::string& name, const std::string& folds, const TermList& base, const TermList& extra) {
    Phase p{name, folds, base};
    p.terms.append(extra);
    phases_.push_back(std::move(p));
  }

  void forward_embedding() {
    TermList base = persistent_state(grads(0));
    add_fsdp(c_, FsdpLive{0, unit(0), -1, -1}, base);
    TermList t = c_.list();
    t.add("token ids", {{"T", c_.work.tokens}}, kInt64, Category::Activations);
    t.add("embedding output", {{"T", c_.work.tokens}, {"H", c_.model.hidden_size}}, kBf16, Category::Activations);
    emit("fwd/embed", "", base, t);
  }

  void forward_layer(int64_t l, const std::string& folds_override = "") {
    const bool mtp = l >= L_;
    TermList base = persistent_state(grads(0));
    // The next unit to run: the next layer, else the head (a loss follows the last layer and every
    // MTP module; a module is gathered as its forward starts).
    const int64_t next = l + 1 < L_ ? unit(l + 1) : c_.work.head_unit;
    add_fsdp(c_, FsdpLive{unit(l), next, -1, -1}, base);
    const bool in_flight = mtp ? offloaded_x0() : offloaded_[static_cast<size_t>(l)];
    add_boundaries(c_, resident_upto(l), in_flight ? 1 : 0, mtp, base);
    if (mtp) add_mtp_pending(l - L_, l - L_, base);  // the losses before it wait for their backward
    const std::string prefix = "fwd/" + layer_name(l) + "/";
    const std::string folds = folds_override.empty() ? folds_[l] : folds_override;
    TermList attn = c_.list();
    add_attention_forward(c_, l, attn);
    if (mtp) {
      // Before the attention, eh_proj: its input [T, 2H] (the norms' outputs) beside its output,
      // the module's input (a boundary); freed before the attention runs. The phase holds the
      // larger (a tie keeps the attention).
      TermList eh_proj = c_.list();
      eh_proj.add("MTP eh_proj input", {{"T", c_.work.tokens}, {"2H", 2 * c_.model.hidden_size}}, kBf16, Category::Activations);
      if (eh_proj.bytes(Space::Device) > attn.bytes(Space::Device)) attn = eh_proj;
    }
    emit(prefix + "attn", folds, base, attn);
    if (c_.layer_spec(l).ffn == FfnKind::Moe && c_.model.num_experts > 0) {
      for (auto& p : moe_forward_phases(c_, l)) {
        TermList t = c_.list();
        add_ffn_block_inputs(c_, t);
        if (p.suffix == "moe/experts" || p.suffix.rfind("moe/dispatch/r", 0) == 0)
          add_ffn_forward(c_, "shared expert", c_.model.shared_expert_ffn_width, t);
        t.append(p.terms);
        emit(prefix + p.suffix, join(folds, p.folds), base, t);
      }
    } else {
      TermList t = c_.list();
      add_ffn_block_inputs(c_, t);
      add_ffn_forward(c_, "dense FFN", c_.model.dense_ffn_width, t);
      emit(prefix + "ffn", folds, base, t);
    }
  }

  static std::string join(const std::string& a, const std::string& b) {
    if (a.empty()) return b;
    if (b.empty()) return a;
    return a + " x " + b;
  }

  // What MTP adds while module k runs (forward or backward) or its loss does: the saved sets of
  // the losses whose backward is still to come (the main loss and MTP losses 0..mtp_losses-1),
  // and the outputs h^0..h^(hiddens-1) of earlier modules (a later module's input and their own
  // loss's final-norm backward need them).
  void add_mtp_pending(int64_t mtp_losses, int64_t hiddens, TermList& t) const {
    add_loss_saved(c_, "main loss ", t);
    // With gradients in forward the main loss's final-norm weight, kept from its forward (the head
    // is not gathered again); an MTP loss's head norm is read from its module, prefetched then.
    if (loss_grads_in_forward())
      t.add("main loss final norm weight (kept for its backward)", {{"H", c_.model.hidden_size}}, kBf16, Category::Fsdp);
    for (int64_t j = 0; j < mtp_losses; ++j) add_loss_saved(c_, "MTP" + std::to_string(j) + " loss ", t);
    t.add("MTP module outputs h^j (for later modules and their losses)", {{"T", c_.work.tokens}, {"H", c_.model.hidden_size}},
          kBf16, Category::Boundaries, hiddens);
  }
  // The modules' gradient into the shifted embedding, kept for bwd/embed (one buffer: each module's
  // is added at its shift).
  void add_mtp_embedding_grad(TermList& t) const {
    t.add("MTP d shifted embedding (for bwd/embed)", {{"T", c_.work.tokens}, {"H", c_.model.hidden_size}}, kBf16,
          Category::Activations);
  }
  // MTP loss k's head-norm gradient [H]: made by the loss's final-norm backward, held until module
  // k's unsharded grads exist (its backward's first phase), through the module's recompute.
  void add_mtp_head_norm_grad(int64_t l, TermList& t) const {
    t.add("MTP" + std::to_string(l - L_) + " head norm grad (held for the module's grads)", {{"H", c_.model.hidden_size}}, kBf16,
          Category::Fsdp);
  }
  // An MTP module's embedding input is x_0 shifted: with x_0 offloaded, a copy is fetched for the
  // module's forward and again for its backward.
  bool offloaded_x0() const { return L_ > 0 && offloaded_[0]; }

  // Terms of losses whose backward has not run yet while `index` runs (MTP losses run first).
  void loss_forward(const std::string& name, int64_t index) {
    TermList base = persistent_state(grads(0));
    add_boundaries(c_, resident_upto(L_ - 1) + index, 0, true, base);
    if (index > 0) add_mtp_pending(index - 1, index, base);
    for (auto& p : loss_forward_phases(c_)) emit(name + "/" + p.suffix, p.folds, base, p.terms);
  }

  void loss_backward(const std::string& name, int64_t index) {
    // Units reduced: for the main loss, the head (with MTP, reduced after each MTP loss) and the
    // modules; for MTP loss k, the head once a later loss has run, and the modules after k.
    const int64_t k = index - 1;
    int64_t reduced = reduced_before(L_ - 1) - head_shard();
    if (index > 0) reduced = reduced_before(L_ + k) - (k == M_ - 1 ? head_shard() : 0);
    else if (M_ > 0) reduced = reduced_before(L_ - 1);
    TermList base = persistent_state(grads(reduced));
    add_boundaries(c_, resident_upto(L_ - 1) + (index > 0 ? index : 0), 0, true, base);
    if (index > 0) add_mtp_pending(k, index, base);
    // The gradient of this loss's input from the module after it (d h^k from module k+1's
    // hnorm, d h_L from module 0's), waiting to be added to the final norm's; and the modules'
    // embedding gradient once the last module's backward has run.
    if (index == 0 ? M_ > 0 : k < M_ - 1) {
      base.add("d loss input from the next MTP module", {{"T", c_.work.tokens}, {"H", c_.model.hidden_size}}, kBf16,
               Category::Activations);
      add_mtp_embedding_grad(base);
    }
    const int64_t next = index > 0 ? unit(L_ + k) : unit(L_ - 1);
    const int64_t in_flight = index > 0 ? (k + 1 < M_ ? unit(L_ + k + 1) : -1) : (M_ > 0 ? unit(L_) : -1);
    add_fsdp(c_, FsdpLive{-1, next, -1, in_flight}, base);
    auto phases = loss_backward_phases(c_);
    if (phases.empty()) {
      // Gradients were computed in the forward pass; the backward only scales them. What is left
      // is the final norm's backward (dX -> d h_L): its weight, kept from the gathered head when W
      // was released, its rstd recomputed from h_L, and d h_L, the layers' gradient stream.
      TermList t = c_.list();
      add_loss_saved(c_, "", t);
      // An MTP loss's head norm is read from its module, prefetched by now; the norm's gradient
      // is held for the module's grads (add_mtp_head_norm_grad).
      if (index == 0) t.add("final norm weight (kept for its backward)", {{"H", c_.model.hidden_size}}, kBf16, Category::Fsdp);
      else add_mtp_head_norm_grad(L_ + index - 1, t);
      t.add("final norm rstd (recomputed)", {{"T", c_.work.tokens}}, kFp32, Category::Activations);
      if (c_.model.norm_bias) t.add("final norm mean (recomputed, LayerNorm)", {{"T", c_.work.tokens}}, kFp32, Category::Activations);
      t.add("d final hidden h_L", {{"T", c_.work.tokens}, {"H", c_.model.hidden_size}}, kBf16, Category::Activations);
      emit(name + "/bwd", "", base, t);
    }
    for (auto& p : phases) emit(name + "/" + p.suffix, p.folds, base, p.terms);
  }

  bool loss_grads_in_forward() const {
    return c_.run.vocab != VocabMode::Materialized && c_.run.vocab_backward == VocabBackward::InForward;
  }

  int64_t head_shard() const { return c_.work.units[static_cast<size_t>(c_.work.head_unit)].shard_params; }

  // The backward phases of layer l (folds: the set it stands for, default its group's).
  std::vector<Phase> backward_layer(int64_t l, const std::string& folds_override = "") {
    std::vector<Phase> out;
    auto emit = [&](const std::string& name, const std::string& f, const TermList& base, const TermList& extra) {
      Phase p{name, f, base};
      p.terms.append(extra);
      out.push_back(std::move(p));
    };
    const bool mtp = l >= L_;
    const std::string prefix = "bwd/" + layer_name(l) + "/";
    const std::string folds = folds_override.empty() ? folds_[l] : folds_override;
    // Next unit in backward order: the previous layer; after an MTP module, the head (a loss's
    // backward follows; with gradients in forward it reads no W: nothing); after L0, the embedding.
    const int64_t prev = mtp ? (loss_grads_in_forward() ? -1 : c_.work.head_unit) : (l > 0 ? unit(l - 1) : 0);
    // Boundaries: inputs 0..l not offloaded, plus this layer's fetched input and the prefetch (an
    // MTP module: x_0 fetched for its embedding input, and h_L).
    int64_t in_flight = 0;
    if (!mtp) {
      in_flight += offloaded_[static_cast<size_t>(l)] ? 1 : 0;
      for (int64_t i = std::max<int64_t>(0, l - c_.run.sco_prefetch); i < l; ++i) in_flight += offloaded_[static_cast<size_t>(i)] ? 1 : 0;
    } else {
      in_flight += offloaded_x0() ? 1 : 0;
    }
    // Beside every moment: MTP's pending losses and outputs, and the modules' embedding gradient
    // (from the end of the last module's backward; the last module adds it in its attn phase).
    const bool last_module = mtp && l == L_ + M_ - 1;
    auto add_pending = [&](TermList& base) {
      if (mtp) add_mtp_pending(l - L_, l - L_, base);
      if (M_ > 0 && !last_module) add_mtp_embedding_grad(base);
    };
    auto base_of = [&](bool with_grad) {
      TermList base = persistent_state(grads(reduced_before(l)));
      add_fsdp(c_, FsdpLive{unit(l), prev, with_grad ? unit(l) : -1, in_flight_before(l)}, base);
      add_boundaries(c_, resident_upto(l), in_flight, mtp, base);
      add_pending(base);
      if (mtp && !with_grad) add_mtp_head_norm_grad(l, base);
      return base;
    };
    const TermList rec = base_of(false);
    const TermList bwd = base_of(true);
    TermList attn_rec = c_.list();
    if (mtp) attn_rec.add("MTP eh_proj input", {{"T", c_.work.tokens}, {"2H", 2 * c_.model.hidden_size}}, kBf16, Category::Activations);
    add_attention_recompute(c_, l, attn_rec);
    // The phase's first moment: the unit in flight lands its grad shard as the recompute starts,
    // before the previous unit is prefetched and this layer's input fetched. With a staged
    // reduce-scatter output (memory_model.h) its fp32 [S] is live beside the gathered layer, the
    // fp32 input in flight, the new shard, dy and the boundaries already on the device (those
    // the previous layer's SCO prefetch fetched). recompute/attn holds the larger of the two (a tie
    // keeps the recompute): the landing holds more when that output outweighs the prefetched unit
    // and the attention's saved set (the first layer in backward, whose prefetch is the
    // embedding, with every expert in the unit in flight at EP = 1).
    const int64_t landing_unit = in_flight_before(l);
    // With MTP the head lands again (every loss reduces it; the first, MTP{M-1}'s, lands before
    // the last module's backward): into its fp32 shard through an output of its own.
    const bool head_again = M_ > 0 && landing_unit == c_.work.head_unit && l != L_ + M_ - 1 && head_reduced_through_an_output(c_);
    if (landing_unit >= 0 && (reduce_scatter_output_staged(c_) || head_again)) {
      int64_t fetched = 0;  // offloaded inputs among [l+1-p, l]: the previous layer's prefetch
      if (!mtp && l + 1 < L_)
        for (int64_t i = std::max<int64_t>(0, l + 1 - c_.run.sco_prefetch); i <= l; ++i)
          fetched += offloaded_[static_cast<size_t>(i)] ? 1 : 0;
      TermList landing = persistent_state(grads(reduced_before(l)));
      add_fsdp(c_, FsdpLive{unit(l), -1, -1, landing_unit}, landing);
      add_reduce_scatter_output(c_, landing_unit, landing);
      if (head_again) add_head_accumulate_output(c_, landing);
      add_boundaries(c_, resident_upto(l), fetched, mtp, landing);
      add_pending(landing);
      if (mtp) add_mtp_head_norm_grad(l, landing);
      landing.add("dy (layer output grad)", {{"T", c_.work.tokens}, {"H", c_.model.hidden_size}}, kBf16,
                  Category::Activations);
      TermList recompute = rec;
      recompute.append(attn_rec);
      if (landing.bytes(Space::Device) > recompute.bytes(Space::Device))
        emit(prefix + "recompute/attn", folds, landing, c_.list());
      else
        emit(prefix + "recompute/attn", folds, rec, attn_rec);
    } else {
      emit(prefix + "recompute/attn", folds, rec, attn_rec);
    }

    // The FFN block's saved inputs and the attention saved set stay live through its backward.
    TermList block = c_.list();
    if (mtp) block.add("MTP eh_proj input", {{"T", c_.work.tokens}, {"2H", 2 * c_.model.hidden_size}}, kBf16, Category::Activations);
    add_attention_saved(c_, l, block, false);
    add_ffn_block_inputs(c_, block);
    add_layer_grad_stream(c_, block);
    if (c_.layer_spec(l).ffn == FfnKind::Moe && c_.model.num_experts > 0) {
      const int64_t Fs = c_.model.shared_expert_ffn_width;
      for (auto& p : moe_recompute_phases(c_, l)) {
        TermList t = block;
        add_ffn_saved(c_, "shared expert", Fs, t);
        add_shared_gate_saved(c_, t);
        t.append(p.terms);
        emit(prefix + "recompute/" + p.suffix, join(folds, p.folds), rec, t);
      }
      for (auto& p : moe_backward_phases(c_, l)) {
        TermList t = block;
        add_ffn_saved(c_, "shared expert", Fs, t);
        add_shared_gate_saved(c_, t);
        if (p.suffix == "moe/experts" || p.suffix.rfind("moe/dispatch/r", 0) == 0) add_ffn_backward_grads(c_, "shared expert", Fs, t);
        t.append(p.terms);
        emit(prefix + p.suffix, join(folds, p.folds), bwd, t);
      }
    } else {
      const int64_t F = c_.model.dense_ffn_width;
      TermList t = block;
      add_ffn_saved(c_, "dense FFN", F, t);
      emit(prefix + "recompute/ffn", folds, rec, t);
      add_ffn_backward_grads(c_, "dense FFN", F, t);
      t.add("d norm-2 output", {{"T", c_.work.tokens}, {"H", c_.model.hidden_size}}, kBf16, Category::Activations);
      emit(prefix + "ffn", folds, bwd, t);
    }
    TermList attn = c_.list();
    add_attention_backward(c_, l, attn);
    if (mtp) {
      // After the attention backward, eh_proj's: its input (kept since the recompute), d of its
      // output and d of its input [T, 2H] (then the norms' backward, which holds less). The
      // phase holds the larger (a tie keeps the attention backward).
      attn.add("MTP eh_proj input", {{"T", c_.work.tokens}, {"2H", 2 * c_.model.hidden_size}}, kBf16, Category::Activations);
      TermList eh_proj = c_.list();
      eh_proj.add("MTP eh_proj input", {{"T", c_.work.tokens}, {"2H", 2 * c_.model.hidden_size}}, kBf16, Category::Activations);
      eh_proj.add("d eh_proj output", {{"T", c_.work.tokens}, {"H", c_.model.hidden_size}}, kBf16, Category::Activations);
      eh_proj.add("d eh_proj input", {{"T", c_.work.tokens}, {"2H", 2 * c_.model.hidden_size}}, kBf16, Category::Activations);
      if (eh_proj.bytes(Space::Device) > attn.bytes(Space::Device)) attn = eh_proj;
      // The last module's backward makes the shifted embedding's gradient at the norms' backward,
      // after eh_proj's input and d output are freed: held from the copy-in below.
    }
    // The layer's last moment: once its backward is done, the gathered layer released and the
    // previous unit's reduce-scatter input freed, its unsharded grads are copied into its fp32
    // reduce-scatter input (FSDP2's copy-in), both live beside the prefetched next unit and the
    // gradient d x_l going to the next layer. bwd/Ll/attn holds the larger of the two (a tie keeps
    // the backward): the copy-in holds more when the layer unit outweighs the unit in flight and the
    // attention backward (the first layer in backward, whose in-flight unit is the LM head, with
    // every expert in the unit at EP = 1).
    TermList copy = persistent_state(grads(reduced_before(l)));
    add_fsdp(c_, FsdpLive{-1, prev, unit(l), unit(l)}, copy);
    add_boundaries(c_, resident_upto(l), in_flight, mtp, copy);
    add_pending(copy);
    if (last_module) add_mtp_embedding_grad(copy);
    copy.add("d layer input (to the next layer's backward)", {{"T", c_.work.tokens}, {"H", c_.model.hidden_size}}, kBf16,
             Category::Activations);
    TermList backward = bwd;
    backward.append(attn);
    if (copy.bytes(Space::Device) > backward.bytes(Space::Device)) emit(prefix + "attn", folds, copy, c_.list());
    else emit(prefix + "attn", folds, bwd, attn);
    return out;
  }

  // bwd/embed holds the largest of its moments, in time order (a tie keeps the earlier): with a
  // staged reduce-scatter output (memory_model.h), L0's shard landing as the phase starts, its
  // fp32 [S] output beside the gathered table, L0's input and d embedding output; the embedding's
  // backward; then, once the gathered table, d embedding output and L0's reduce-scatter input are
  // gone, its unsharded grads copied into the fp32 reduce-scatter input [U]; then, those grads
  // freed, the new grad shard allocated beside that input (and, staged, the embedding's fp32
  // output). At N GPUs the shard is U/N and the backward or L0's landing holds the most; at N = 1
  // (a one-GPU run, every verify-scaled plan) the input with the grads or the shard can hold more.
  void backward_embedding() {
    const int64_t all = c_.work.shard_params, before = all - c_.work.units[0].shard_params;
    TermList backward = persistent_state(grads(before));
    add_fsdp(c_, FsdpLive{0, -1, 0, unit(0)}, backward);
    backward.add("d embedding output", {{"T", c_.work.tokens}, {"H", c_.model.hidden_size}}, kBf16, Category::Activations);
    if (M_ > 0) add_mtp_embedding_grad(backward);  // scattered into the table's grads with the shifted ids
    TermList copy = persistent_state(grads(before));
    add_fsdp(c_, FsdpLive{-1, -1, 0, 0}, copy);
    TermList shard = persistent_state(grads(all));
    add_fsdp(c_, FsdpLive{-1, -1, -1, 0}, shard);
    add_reduce_scatter_output(c_, 0, shard);
    const TermList* most = &backward;
    TermList landing = persistent_state(grads(before));
    if (reduce_scatter_output_staged(c_)) {
      add_fsdp(c_, FsdpLive{0, -1, -1, unit(0)}, landing);
      add_reduce_scatter_output(c_, unit(0), landing);
      landing.add("d embedding output", {{"T", c_.work.tokens}, {"H", c_.model.hidden_size}}, kBf16,
                  Category::Activations);
      if (M_ > 0) add_mtp_embedding_grad(landing);
      most = &landing;
    }
    for (const TermList* m : {&backward, &copy, &shard})
      if (m->bytes(Space::Device) > most->bytes(Space::Device)) most = m;
    emit("bwd/embed", "", *most, c_.list());
  }

  const Context& c_;
  bool fold_ = true;
  int64_t L_ = 0, M_ = 0;
  std::vector<bool> offloaded_;
  std::vector<int64_t> reps_;
  std::map<int64_t, std::string> folds_;
  std::map<int64_t, std::vector<int64_t>> members_;  // representative -> its group, ascending
  bool all_grads_ = false;
  std::vector<Phase> phases_;
};

}  // namespace

Timeline build_timeline(const Context& c, bool fold) { return Builder(c, fold).build(); }

}  // namespace flatpeak::planner
