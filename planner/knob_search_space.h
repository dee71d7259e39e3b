// The search space of one (CP, micro-batch) structure, internal to knob_search.cpp: the knob
// grids with each candidate's time term and peak parts, the per-rule envelopes of the peaks, and
// the search over (ring size, prefetch, offloaded layers) with the fastest cap, blocks and buckets
// that fit.
//   Structure st(model, hardware, spec, resolved_run, efficiency, cache);
//   Best best = st.search();   // best.any: a knob set fits; best.c: the knobs
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <limits>
#include <map>
#include <tuple>
#include <vector>

#include "fast_peaks.h"
#include "knob_search.h"
#include "step_time.h"

#ifdef FLATPEAK_CHECK_ENVELOPE  // debugging: every O(1) slack checked against the O(layers) one
#include <stdexcept>

#include <fmt/format.h>
#endif

namespace flatpeak::planner::search_detail {

using Disp = FastPeaks::Disp;
using Voc = FastPeaks::Voc;
using Bnd = FastPeaks::Bnd;
constexpr int64_t kNone = std::numeric_limits<int64_t>::min() / 4;

inline RingRotate auto_rotate(int64_t vocab, int64_t ring, int64_t tokens) {
  return ceil_div(vocab, ring) <= tokens ? RingRotate::Weights : RingRotate::Activations;
}

struct CapCand {
  int64_t cap = 0;
  std::vector<MoeLoad> loads;
  std::vector<std::array<int64_t, 4>> disp;  // [load][Disp]
  double x = 0;
};

struct VocCand {
  int64_t ring = 1, tb = 0, vb = 0;
  RingRotate rotate = RingRotate::Weights;
  int64_t fwd = 0, bwd = 0;
  double x = 0;
};

struct BucketCand {
  int64_t bucket = 0, depth = 0;
  double y = 0;
  // Parameters staged in host buffers: min(bucket, shard) · depth. A bucket larger than the shard
  // stages only the shard (and bucket · depth itself can overflow: --bucket-params is up to 2^62).
  int64_t staged = 0;
};

// A layer pass (a layer's forward or backward phases) reduced to what the knobs move.
struct Pass {
  int64_t layer = 0;
  bool forward = true;
  int64_t fixed = kNone;  // base + the largest transient without dispatch rounds
  int64_t round_total[2] = {kNone, kNone};
  Disp round_kind[2] = {Disp::None, Disp::None};
  int32_t load = 0;
  FastPeaks::HeadRoles head;
};

struct Lone {
  int64_t fixed = 0;
  Bnd bnd = Bnd::None;
  int64_t layer = 0;
  Voc voc = Voc::None;
  FastPeaks::HeadRoles head;
};

// The largest value over a set of phases whose boundary count depends on (n, p) for first-n
// offload sets, in O(1): decoder-layer passes use prefix and suffix maxima of the piecewise
// count (forward: 1 below n, l+1-n from n on; backward: l+1 below p, p+1 below n+p, l+1-n after);
// losses count L - n plus a constant; MTP module passes (which always involve the LM head unit)
// are specials; the rest counts nothing.
class Envelope {
 public:
  explicit Envelope(int64_t layers) : L_(layers), fwd_v_(static_cast<size_t>(layers), kNone), bwd_v_(static_cast<size_t>(layers), kNone) {}
  void add_forward(int64_t l, int64_t v) { fwd_v_[static_cast<size_t>(l)] = std::max(fwd_v_[static_cast<size_t>(l)], v); }
  void add_backward(int64_t l, int64_t v) { bwd_v_[static_cast<size_t>(l)] = std::max(bwd_v_[static_cast<size_t>(l)], v); }
  void add_resident(int64_t v, int64_t k) { tail_ = std::max(tail_, v + k * one_); }  // count = L - n + k
  void add_flat(int64_t v) { flat_ = std::max(flat_, v); }
  void set_one(int64_t one) { one_ = one; }
  void finish() {
    const auto L = static_cast<size_t>(L_);
    fwd_pre_v_.assign(L + 1, kNone);
    fwd_suf_w_.assign(L + 1, kNone);
    bwd_pre_w_.assign(L + 1, kNone);
    bwd_suf_w_.assign(L + 1, kNone);
    for (size_t l = 0; l < L; ++l) {
      fwd_pre_v_[l + 1] = std::max(fwd_pre_v_[l], fwd_v_[l]);
      bwd_pre_w_[l + 1] = std::max(bwd_pre_w_[l], w(bwd_v_[l], l));
    }
    for (size_t l = L; l-- > 0;) {
      fwd_suf_w_[l] = std::max(fwd_suf_w_[l + 1], w(fwd_v_[l], l));
      bwd_suf_w_[l] = std::max(bwd_suf_w_[l + 1], w(bwd_v_[l], l));
    }
    for (size_t p = 0; p < from_v_.size(); ++p) {
      from_v_[p].assign(L + 1, kNone);
      for (size_t j = p; j < L; ++j) from_v_[p][j + 1] = std::max(from_v_[p][j], bwd_v_[j]);
    }
  }
  int64_t eval(int64_t n, int64_t p) const {
    const int64_t nn = std::min(n, L_);
    int64_t r = flat_;
    if (tail_ != kNone) r = std::max(r, tail_ + (L_ - nn) * one_);
    if (nn > 0 && fwd_pre_v_[static_cast<size_t>(nn)] != kNone) r = std::max(r, fwd_pre_v_[static_cast<size_t>(nn)] + one_);
    if (nn < L_ && fwd_suf_w_[static_cast<size_t>(nn)] != kNone) r = std::max(r, fwd_suf_w_[static_cast<size_t>(nn)] - nn * one_);
    const int64_t a = std::min(p, L_), b = std::min(nn + p, L_);
    if (a > 0 && bwd_pre_w_[static_cast<size_t>(a)] != kNone) r = std::max(r, bwd_pre_w_[static_cast<size_t>(a)]);
    if (b > a && p < static_cast<int64_t>(from_v_.size()) && from_v_[static_cast<size_t>(p)][static_cast<size_t>(b)] != kNone)
      r = std::max(r, from_v_[static_cast<size_t>(p)][static_cast<size_t>(b)] + (p + 1) * one_);
    if (b < L_ && bwd_suf_w_[static_cast<size_t>(b)] != kNone) r = std::max(r, bwd_suf_w_[static_cast<size_t>(b)] - nn * one_);
    return r;
  }

 private:
  int64_t w(int64_t v, size_t l) const { return v == kNone ? kNone : v + static_cast<int64_t>(l + 1) * one_; }
  int64_t L_ = 0, one_ = 0, tail_ = kNone, flat_ = kNone;
  std::vector<int64_t> fwd_v_, bwd_v_, fwd_pre_v_, fwd_suf_w_, bwd_pre_w_, bwd_suf_w_;
  std::array<std::vector<int64_t>, 5> from_v_;  // [p][j]: max of backward v over [p, j)
};

// The best candidate so far, compared lexicographically.
struct Best {
  bool any = false;
  double per_token = 0, step = 0;
  int64_t gpu_peak = 0, host_peak = 0;
  SearchChoice c;
  std::vector<int64_t> key() const {
    return {c.cp, c.micro_batch, c.chunk_cap_rows, c.ring_size, c.token_block, c.vocab_block, c.sco_layers,
            c.sco_prefetch, c.bucket_params, c.bucket_depth};
  }
  bool better_than(const Best& o) const {
    if (!o.any) return true;
    if (per_token != o.per_token) return per_token < o.per_token;
    if (gpu_peak != o.gpu_peak) return gpu_peak < o.gpu_peak;
    if (host_peak != o.host_peak) return host_peak < o.host_peak;
    return key() < o.key();
  }
};

// One (CP, micro-batch) structure: resolved run, workload, peaks and time models, and the grids.
class Structure {
 public:
  Structure(const ModelSpec& model, const HardwareSpec& hw, const RunSpec& spec, const ResolvedRun& run,
            const Efficiency& eff, LoadCache& cache)
      : model_(model), hw_(hw), spec_(spec), run_(run), work_(fast_workload(model, run_, cache)),
        fp_(model, hw, run_, work_), tm_(model, hw, run_, work_, eff) {
    L_ = model.num_layers;
    budget_ = fp_.gpu_peak_budget();
    make_passes();
    make_envelopes();
    make_caps(cache);
    make_vocab();
    make_sco();
    make_buckets();
  }

  const ResolvedRun& run() const { return run_; }
  const Workload& work() const { return work_; }
  const FastPeaks& peaks() const { return fp_; }
  const TimeModel& time_model() const { return tm_; }
  int64_t evaluated() const { return evaluated_; }

  // The best feasible knob set of this structure (any = false when none fits); with
  // `first_fit`, the first one found.
  Best search(bool first_fit = false) {
    Best best;
    for (int64_t R : rings_) {
      for (int64_t p : prefetches_) {
        if (!sco_free_) {
          consider(best, R, p, -1);
          if (first_fit && best.any) return best;
          continue;
        }
        // Fewest layers at which the GPU fits (peaks never rise with n).
        int64_t lo = 0, hi = L_;
        if (!gpu_feasible(R, p, L_)) continue;
        while (lo < hi) {
          const int64_t mid = lo + (hi - lo) / 2;
          if (gpu_feasible(R, p, mid)) hi = mid;
          else lo = mid + 1;
        }
        for (int64_t n = lo; n <= L_; ++n) {
          const int stop = consider(best, R, p, n);
          if (first_fit && best.any) return best;
          if (stop != 0) break;
          // A larger n only adds host-link time unless the cap or the blocks are still held back.
          if (n + 1 <= L_ && best.any) {
            const double lb = tm_.combine(caps_.front().x, vocab_[R].front().x, sco_time(n + 1, p), buckets_y_min_);
            if (lb / tm_.tokens_per_step() > best.per_token) break;
          }
        }
      }
    }
    return best;
  }

  // The fastest knobs that fit the GPU with the host budget ignored (for plans where only the
  // host does not fit: the diagnosis then says how much host memory they need).
  Best search_gpu_only() {
    ignore_host_ = true;
    Best best = search();
    ignore_host_ = false;
    return best;
  }

  // Evaluates one full choice (for reasons): feasible, peaks, time. Returns false when a value is
  // off the grids.
  struct Eval {
    bool gpu_fits = false, host_fits = false;
    double step = 0;
    int64_t gpu_peak = 0, host_peak = 0;
  };
  Eval evaluate(const SearchChoice& c) {
    Eval e;
    const CapCand* cap = find_cap(c.chunk_cap_rows);
    const VocCand* voc = find_voc(c.ring_size, c.token_block, c.vocab_block);
    if (!cap || !voc) return e;
    Slack s = slack(c.ring_size, c.sco_prefetch, c.sco_layers);
    e.gpu_peak = std::max(layers_peak(s, *cap), loss_peak(s, *voc));
    e.gpu_fits = e.gpu_peak <= budget_;
    const int64_t n = c.sco_layers >= 0 ? c.sco_layers : given_offloaded_;
    e.host_peak = fp_.host_peak_bytes(fp_.host_per_gpu_bytes(n, c.bucket_params, c.bucket_depth));
    e.host_fits = e.host_peak <= fp_.host_budget_bytes();
    e.step = tm_.combine(cap->x, voc->x, sco_time(c.sco_layers, c.sco_prefetch),
                         tm_.optimizer(c.bucket_params, c.bucket_depth).exposed_s);
    return e;
  }

  // The most memory-frugal choice (for plans that fit nowhere and the diagnosis).
  SearchChoice frugal() {
    SearchChoice c = base_choice();
    int64_t best_peak = std::numeric_limits<int64_t>::max();
    for (int64_t R : rings_) {
      const int64_t n = sco_free_ ? L_ : -1;
      const int64_t p = prefetches_.front();
      Slack s = slack(R, p, n);
      const CapCand* cap = nullptr;
      int64_t cap_peak = 0;
      for (const auto& cc : caps_) {
        const int64_t v = layers_peak(s, cc);
        if (!cap || v < cap_peak) cap = &cc, cap_peak = v;
      }
      const VocCand* voc = nullptr;
      int64_t voc_peak = 0;
      for (const auto& vc : vocab_[R]) {
        const int64_t v = loss_peak(s, vc);
        if (!voc || v < voc_peak) voc = &vc, voc_peak = v;
      }
      const int64_t peak = std::max(cap_peak, voc_peak);
      if (peak < best_peak) {
        best_peak = peak;
        c.ring_size = R;
        c.chunk_cap_rows = cap->cap;
        c.token_block = voc->tb;
        c.vocab_block = voc->vb;
        c.ring_rotate = voc->rotate;
        c.sco_layers = n;
        c.sco_prefetch = p;
      }
    }
    const BucketCand* small = nullptr;
    for (const auto& b : buckets_)
      if (!small || b.staged < small->staged) small = &b;
    if (small) c.bucket_params = small->bucket, c.bucket_depth = small->depth;
    // When the GPU fits and only the host does not: the fewest offloaded layers that fit the GPU
    // (the least host memory), so the diagnosis says how far the host is from fitting.
    if (sco_free_ && evaluate(c).gpu_fits) c.sco_layers = std::max<int64_t>(0, fewest_layers(c));
    return c;
  }

  // Fewest offloaded layers at which the GPU fits with the choice's other knobs (-1: none).
  int64_t fewest_layers(const SearchChoice& c) {
    if (!sco_free_) return -1;
    for (int64_t n = 0; n <= L_; ++n) {
      SearchChoice t = c;
      t.sco_layers = n;
      if (evaluate(t).gpu_fits) return n;
    }
    return -1;
  }

  SearchChoice base_choice() const {
    SearchChoice c;
    c.cp = run_.cp;
    c.micro_batch = run_.micro_batch;
    c.chunk_cap_rows = caps_.front().cap;
    c.ring_size = rings_.front();
    c.token_block = vocab_.at(c.ring_size).front().tb;
    c.vocab_block = vocab_.at(c.ring_size).front().vb;
    c.ring_rotate = vocab_.at(c.ring_size).front().rotate;
    c.sco_layers = sco_free_ ? 0 : -1;
    c.sco_prefetch = prefetches_.front();
    c.bucket_params = buckets_.front().bucket;
    c.bucket_depth = buckets_.front().depth;
    return c;
  }

  // Grids, for the reasons.
  const std::vector<CapCand>& caps() const { return caps_; }
  const std::map<int64_t, std::vector<VocCand>>& vocab() const { return vocab_; }
  const std::vector<int64_t>& rings() const { return rings_; }
  const std::vector<int64_t>& prefetches() const { return prefetches_; }
  const std::vector<BucketCand>& buckets() const { return buckets_; }
  bool sco_free() const { return sco_free_; }
  bool cap_free() const { return cap_free_; }
  bool vocab_free() const { return vocab_free_; }
  bool bucket_free() const { return bucket_free_; }
  const CapCand* find_cap(int64_t cap) const {
    for (const auto& c : caps_)
      if (c.cap == cap) return &c;
    return nullptr;
  }
  const VocCand* find_voc(int64_t R, int64_t tb, int64_t vb) const {
    auto it = vocab_.find(R);
    if (it == vocab_.end()) return nullptr;
    for (const auto& v : it->second)
      if (v.tb == tb && v.vb == vb) return &v;
    return nullptr;
  }
  double sco_time(int64_t n, int64_t p) {
    if (n < 0) return tm_.boundaries(run_.sco_offloaded, p).exposed_s;
    const size_t key = static_cast<size_t>(n) * 8 + static_cast<size_t>(p);
    if (sco_memo_.size() <= key) sco_memo_.resize(key + 1, -1);
    if (sco_memo_[key] < 0) sco_memo_[key] = tm_.boundaries_first(n, p).exposed_s;
    return sco_memo_[key];
  }

 private:
  // Per (ring size, prefetch, n): the largest fixed part of every rule.
  struct Slack {
    int64_t fixed = kNone;                            // layer passes without rounds, lone phases without logits blocks
    std::vector<std::array<int64_t, 4>> round;        // [load][Disp]: largest base + transient
    int64_t voc[3] = {kNone, kNone, kNone};           // [Voc]
  };

  int64_t boundaries(Bnd rule, int64_t layer, int64_t n, int64_t p) const {
    if (n >= 0) return fp_.boundary_count(rule, layer, n, p);
    // The given set (general): prefix counts.
    const int64_t last = L_ - 1;
    auto resident = [&](int64_t l) {
      const int64_t i = std::min(l, last);
      return (i + 1) - prefix_[static_cast<size_t>(i + 1)] + (l >= L_ ? l - L_ + 1 : 0);
    };
    auto off = [&](int64_t l) { return prefix_[static_cast<size_t>(l + 1)] - prefix_[static_cast<size_t>(l)]; };
    switch (rule) {
      case Bnd::None: return 0;
      // An MTP module: h_L and, with x_0 offloaded, its fetched copy (FastPeaks::evaluate).
      case Bnd::Forward: return resident(layer) + (layer >= L_ ? 1 + off(0) : off(layer));
      case Bnd::Backward: {
        if (layer >= L_) return resident(layer) + 1 + off(0);
        const int64_t lo = std::max<int64_t>(0, layer - p);
        return resident(layer) + off(layer) + (prefix_[static_cast<size_t>(layer)] - prefix_[static_cast<size_t>(lo)]);
      }
      case Bnd::Loss: return resident(last) + layer + 1;
    }
    return 0;
  }

  Slack slack(int64_t R, int64_t p, int64_t n) {
    ++evaluated_;
    if (n < 0 || p >= 5) return slack_general(R, p, n);
    Slack s;
    s.round.assign(work_.moe_loads.size(), {kNone, kNone, kNone, kNone});
    s.fixed = env_[0].eval(n, p);
    for (size_t i = 0; i < s.round.size(); ++i)
      for (size_t k = 1; k < 4; ++k) s.round[i][k] = env_[1 + 3 * i + (k - 1)].eval(n, p);
    s.voc[1] = env_voc_[0].eval(n, p);
    s.voc[2] = env_voc_[1].eval(n, p);
    // Phases with the LM head's FSDP share: few; counted one by one.
    const int64_t one = fp_.boundary_one();
    for (const Special& sp : specials_) {
      const int64_t v = sp.value + fp_.boundary_count(sp.bnd, sp.layer, n, p) * one + fp_.head_bytes(sp.head, R);
      int64_t& slot = sp.group == 0 ? s.fixed
                      : sp.group > 0 ? s.round[static_cast<size_t>((sp.group - 1) / 3)][static_cast<size_t>((sp.group - 1) % 3 + 1)]
                                     : s.voc[static_cast<size_t>(-sp.group)];
      slot = std::max(slot, v);
    }
#ifdef FLATPEAK_CHECK_ENVELOPE
    const Slack g = slack_general(R, p, n);
    if (g.fixed != s.fixed || g.voc[1] != s.voc[1] || g.voc[2] != s.voc[2] || g.round != s.round)
      throw std::logic_error(fmt::format("envelope mismatch at R={} p={} n={}: fixed {} vs {}", R, p, n, s.fixed, g.fixed));
#endif
    return s;
  }

  // Any offload set: every pass, O(layers).
  Slack slack_general(int64_t R, int64_t p, int64_t n) const {
    Slack s;
    s.round.assign(work_.moe_loads.size(), {kNone, kNone, kNone, kNone});
    const int64_t one = fp_.boundary_one();
    const int64_t head_one[2] = {fp_.head_bytes(FastPeaks::HeadRoles{1, 0}, R), fp_.head_bytes(FastPeaks::HeadRoles{0, 1}, R)};
    auto head = [&](FastPeaks::HeadRoles h) { return h.bf16 * head_one[0] + h.fp32 * head_one[1]; };
    for (const Pass& ps : passes_) {
      const int64_t extra = boundaries(ps.forward ? Bnd::Forward : Bnd::Backward, ps.layer, n, p) * one + head(ps.head);
      s.fixed = std::max(s.fixed, ps.fixed + extra);
      for (int i = 0; i < 2; ++i)
        if (ps.round_kind[i] != Disp::None) {
          int64_t& slot = s.round[static_cast<size_t>(ps.load)][static_cast<size_t>(ps.round_kind[i])];
          slot = std::max(slot, ps.round_total[i] + extra);
        }
    }
    for (const Lone& ln : lones_) {
      const int64_t v = ln.fixed + boundaries(ln.bnd, ln.layer, n, p) * one + head(ln.head);
      if (ln.voc == Voc::None) s.fixed = std::max(s.fixed, v);
      else s.voc[static_cast<size_t>(ln.voc)] = std::max(s.voc[static_cast<size_t>(ln.voc)], v);
    }
    return s;
  }

  // Envelopes of every rule (phases with LM-head FSDP roles kept apart as specials).
  struct Special {
    int64_t value;
    Bnd bnd;
    int64_t layer;
    FastPeaks::HeadRoles head;
    int group;  // 0 fixed, 1 + 3·load + kind-1 rounds, -1/-2 logits blocks forward/backward
  };
  void make_envelopes() {
    const int64_t one = fp_.boundary_one();
    env_.assign(1 + 3 * work_.moe_loads.size(), Envelope(L_));
    env_voc_.assign(2, Envelope(L_));
    for (auto& e : env_) e.set_one(one);
    for (auto& e : env_voc_) e.set_one(one);
    auto put = [&](int group, Bnd bnd, int64_t layer, int64_t value, FastPeaks::HeadRoles head) {
      if (value == kNone) return;
      // An MTP module's count has a term in n > 0 (x_0 fetched), which no envelope keeps.
      const bool mtp_pass = (bnd == Bnd::Forward || bnd == Bnd::Backward) && layer >= L_;
      if (head.bf16 != 0 || head.fp32 != 0 || mtp_pass) {
        specials_.push_back(Special{value, bnd, layer, head, group});
        return;
      }
      Envelope& e = group >= 0 ? env_[static_cast<size_t>(group)] : env_voc_[static_cast<size_t>(-group - 1)];
      switch (bnd) {
        case Bnd::None: e.add_flat(value); break;
        case Bnd::Loss: e.add_resident(value, layer + 1); break;
        case Bnd::Forward: e.add_forward(layer, value); break;
        case Bnd::Backward: e.add_backward(layer, value); break;
      }
    };
    for (const Pass& ps : passes_) {
      const Bnd bnd = ps.forward ? Bnd::Forward : Bnd::Backward;
      put(0, bnd, ps.layer, ps.fixed, ps.head);
      for (int i = 0; i < 2; ++i)
        if (ps.round_kind[i] != Disp::None)
          put(1 + 3 * ps.load + (static_cast<int>(ps.round_kind[i]) - 1), bnd, ps.layer, ps.round_total[i], ps.head);
    }
    for (const Lone& ln : lones_) put(ln.voc == Voc::None ? 0 : -static_cast<int>(ln.voc), ln.bnd, ln.layer, ln.fixed, ln.head);
    for (auto& e : env_) e.finish();
    for (auto& e : env_voc_) e.finish();
  }

  int64_t layers_peak(const Slack& s, const CapCand& c) const {
    int64_t peak = s.fixed;
    for (size_t i = 0; i < s.round.size(); ++i)
      for (size_t k = 1; k < 4; ++k)
        if (s.round[i][k] != kNone) peak = std::max(peak, s.round[i][k] + c.disp[i][k]);
    return peak;
  }
  int64_t loss_peak(const Slack& s, const VocCand& v) const {
    int64_t peak = kNone;
    if (s.voc[1] != kNone) peak = std::max(peak, s.voc[1] + v.fwd);
    if (s.voc[2] != kNone) peak = std::max(peak, s.voc[2] + v.bwd);
    return peak;
  }

  bool gpu_feasible(int64_t R, int64_t p, int64_t n) {
    const Slack s = slack(R, p, n);
    if (s.fixed > budget_) return false;
    bool cap_ok = false, voc_ok = false;
    for (const auto& c : caps_)
      if (layers_peak(s, c) <= budget_) {
        cap_ok = true;
        break;
      }
    for (const auto& v : vocab_[R])
      if (loss_peak(s, v) <= budget_) {
        voc_ok = true;
        break;
      }
    return cap_ok && voc_ok;
  }

  // Evaluates (R, p, n) with the fastest cap, blocks and buckets that fit; updates `best`.
  // Returns 1 when a larger n cannot help (host full, or cap and blocks already the fastest).
  int consider(Best& best, int64_t R, int64_t p, int64_t n) {
    const Slack s = slack(R, p, n);
    if (s.fixed > budget_) return 0;
    const CapCand* cap = nullptr;
    for (const auto& c : caps_)
      if (layers_peak(s, c) <= budget_) {
        cap = &c;
        break;
      }
    const VocCand* voc = nullptr;
    for (const auto& v : vocab_[R])
      if (loss_peak(s, v) <= budget_) {
        voc = &v;
        break;
      }
    if (!cap || !voc) return 0;
    const int64_t offloaded = n >= 0 ? n : given_offloaded_;
    const BucketCand* bucket = nullptr;
    int64_t host_peak = 0;
    for (const auto& b : buckets_) {
      const int64_t h = fp_.host_peak_bytes(fp_.host_per_gpu_bytes(offloaded, b.bucket, b.depth));
      if (h <= fp_.host_budget_bytes() || ignore_host_) {
        bucket = &b;
        host_peak = h;
        break;
      }
    }
    if (!bucket) return 1;  // the host is full; more offloaded layers only add host memory
    Best cand;
    cand.any = true;
    cand.step = tm_.combine(cap->x, voc->x, sco_time(n, p), bucket->y);
    cand.per_token = cand.step / tm_.tokens_per_step();
    cand.gpu_peak = std::max(layers_peak(s, *cap), loss_peak(s, *voc));
    cand.host_peak = host_peak;
    cand.c.cp = run_.cp;
    cand.c.micro_batch = run_.micro_batch;
    cand.c.chunk_cap_rows = cap->cap;
    cand.c.ring_size = R;
    cand.c.token_block = voc->tb;
    cand.c.vocab_block = voc->vb;
    cand.c.ring_rotate = voc->rotate;
    cand.c.sco_layers = n;
    cand.c.sco_prefetch = p;
    cand.c.bucket_params = bucket->bucket;
    cand.c.bucket_depth = bucket->depth;
    if (cand.better_than(best)) best = cand;
    return cap == &caps_.front() && voc == &vocab_[R].front() ? 1 : 0;
  }

  void make_passes() {
    const auto& kinds = fp_.kinds();
    for (const FastPeaks::Step& step : fp_.order()) {
      if (step.type == FastPeaks::Step::Type::Phase) {
        const FastPeaks::Phase& p = fp_.phases()[static_cast<size_t>(step.index)];
        int64_t total = 0;
        for (int64_t v : p.fixed) total += v;
        lones_.push_back(Lone{total, p.bnd, p.layer, p.voc, p.head});
        continue;
      }
      const FastPeaks::Layer& e = fp_.layer_entries()[static_cast<size_t>(step.index)];
      const bool forward = step.type == FastPeaks::Step::Type::Forward;
      for (uint8_t b : forward ? std::vector<uint8_t>{0} : std::vector<uint8_t>{1, 2}) {
        Pass ps;
        ps.layer = e.layer;
        ps.forward = forward;
        ps.load = e.load_index;
        ps.head = e.head[b];
        int rounds = 0;
        for (const auto& x : kinds[static_cast<size_t>(e.kind)]) {
          if (x.base != b) continue;
          const int64_t total = e.base_total[b] + x.total;
          if (x.disp == Disp::None) ps.fixed = std::max(ps.fixed, total);
          else if (rounds < 2) ps.round_total[rounds] = total, ps.round_kind[rounds++] = x.disp;
        }
        passes_.push_back(ps);
      }
    }
  }

  void make_caps(LoadCache& cache) {
    const bool pipelined = run_.llep && run_.chunk_cap_rows > 0;
    cap_free_ = pipelined && !spec_.chunk_cap_rows.has_value();
    std::vector<int64_t> grid{run_.chunk_cap_rows};
    if (cap_free_) grid = chunk_cap_grid(checked_mul(work_.tokens, model_.top_k));
    std::vector<const MoeBasis*> bases;
    for (size_t i = 0; i < work_.moe_loads.size(); ++i)
      bases.push_back(&cache.basis(model_, run_, work_.tokens, static_cast<int64_t>(i)));
    for (int64_t cap : grid) {
      CapCand c;
      c.cap = cap;
      for (const MoeBasis* b : bases) c.loads.push_back(load_with_cap(*b, model_, run_, cap));
      c.disp.assign(c.loads.size(), {0, 0, 0, 0});
      if (pipelined)
        for (size_t i = 0; i < c.loads.size(); ++i)
          for (Disp k : {Disp::ForwardRound, Disp::RecomputeRound, Disp::BackwardRound})
            c.disp[i][static_cast<size_t>(k)] = fp_.dispatch_bytes(k, c.loads[i]);
      c.x = tm_.dispatch(c.loads).total();
      caps_.push_back(std::move(c));
    }
    std::stable_sort(caps_.begin(), caps_.end(), [](const CapCand& a, const CapCand& b) {
      return a.x != b.x ? a.x < b.x : a.cap < b.cap;
    });
  }

  void make_vocab() {
    const bool ring = run_.vocab == VocabMode::RingDtp;
    vocab_free_ = ring && (!spec_.ring_size || !spec_.token_block || !spec_.vocab_block);
    const int64_t V = model_.vocab_size, T = work_.tokens;
    // Gradients in forward keep the dW shard of the ring size live past the loss (FastPeaks'
    // fixed terms): the ring size is then not searched.
    const bool ring_free = ring && !spec_.ring_size && run_.vocab_backward != VocabBackward::InForward;
    vocab_free_ = vocab_free_ && (ring_free || !spec_.token_block || !spec_.vocab_block);
    if (ring_free) rings_ = ring_size_grid(run_.gpus, run_.gpus_per_node);
    else rings_ = {ring ? run_.ring_size : 1};
    const bool blocks = run_.vocab != VocabMode::Materialized;
    for (int64_t R : rings_) {
      const int64_t shard = ceil_div(V, R);
      std::vector<int64_t> tbs{run_.token_block}, vbs{run_.vocab_block};
      RingRotate rotate = run_.ring_rotate;
      if (ring) {
        if (!spec_.token_block) tbs = token_block_grid(T);
        if (!spec_.vocab_block) vbs = vocab_block_grid(shard);
        if (!spec_.ring_rotate && ring_free) rotate = auto_rotate(V, R, T);
      }
      std::vector<VocCand>& list = vocab_[R];
      for (int64_t tb : tbs)
        for (int64_t vb : vbs) {
          if (blocks && (tb < 1 || tb > T || vb < 1 || vb > shard)) continue;
          VocCand v;
          v.ring = R;
          v.tb = tb;
          v.vb = vb;
          v.rotate = rotate;
          if (blocks) {
            v.fwd = fp_.vocab_bytes(Voc::BlockForward, R, rotate, tb, vb);
            v.bwd = fp_.vocab_bytes(Voc::BlockBackward, R, rotate, tb, vb);
          }
          v.x = tm_.vocab(R, rotate, tb, vb).total();
          list.push_back(v);
        }
      std::stable_sort(list.begin(), list.end(), [](const VocCand& a, const VocCand& b) {
        if (a.x != b.x) return a.x < b.x;
        if (a.fwd + a.bwd != b.fwd + b.bwd) return a.fwd + a.bwd < b.fwd + b.bwd;
        return std::tie(a.tb, a.vb) < std::tie(b.tb, b.vb);
      });
    }
    std::vector<int64_t> kept;
    for (int64_t R : rings_)
      if (!vocab_[R].empty()) kept.push_back(R);
    rings_ = kept;
  }

  void make_sco() {
    const bool sco = run_.boundaries == BoundaryMode::Sco;
    sco_free_ = sco && (!spec_.sco_layers || *spec_.sco_layers == "auto");
    if (sco && !spec_.sco_prefetch) prefetches_ = {0, 1, 2, 3, 4};
    else prefetches_ = {run_.sco_prefetch};
    prefix_.assign(static_cast<size_t>(L_ + 1), 0);
    for (int64_t i = 0; i < L_; ++i) {
      const bool off = static_cast<size_t>(i) < run_.sco_offloaded.size() && run_.sco_offloaded[static_cast<size_t>(i)];
      prefix_[static_cast<size_t>(i + 1)] = prefix_[static_cast<size_t>(i)] + (off ? 1 : 0);
    }
    given_offloaded_ = prefix_[static_cast<size_t>(L_)];
  }

  void make_buckets() {
    const bool stream = run_.optimizer == OptimizerPlacement::Stream;
    bucket_free_ = stream && (!spec_.bucket_params || !spec_.bucket_depth);
    std::vector<int64_t> sizes{run_.bucket_params}, depths{run_.bucket_depth};
    if (stream && !spec_.bucket_params) sizes = bucket_grid(work_.shard_params);
    if (stream && !spec_.bucket_depth) depths = {1, 2, 3, 4, 5, 6, 7, 8};
    for (int64_t b : sizes)
      for (int64_t d : depths)
        buckets_.push_back(BucketCand{b, d, tm_.optimizer(b, d).exposed_s, std::min(b, work_.shard_params) * d});
    std::stable_sort(buckets_.begin(), buckets_.end(), [](const BucketCand& a, const BucketCand& b) {
      if (a.y != b.y) return a.y < b.y;
      if (a.staged != b.staged) return a.staged < b.staged;
      return std::tie(a.bucket, a.depth) < std::tie(b.bucket, b.depth);
    });
    buckets_y_min_ = buckets_.front().y;
  }

  const ModelSpec& model_;
  const HardwareSpec& hw_;
  const RunSpec& spec_;
  ResolvedRun run_;
  Workload work_;
  FastPeaks fp_;
  TimeModel tm_;
  int64_t L_ = 0, budget_ = 0, evaluated_ = 0, given_offloaded_ = 0;
  std::vector<Pass> passes_;
  std::vector<Lone> lones_;
  std::vector<Envelope> env_, env_voc_;
  std::vector<Special> specials_;
  std::vector<CapCand> caps_;
  std::map<int64_t, std::vector<VocCand>> vocab_;
  std::vector<int64_t> rings_, prefetches_, prefix_;
  std::vector<BucketCand> buckets_;
  double buckets_y_min_ = 0;
  bool sco_free_ = false, cap_free_ = false, vocab_free_ = false, bucket_free_ = false;
  bool ignore_host_ = false;
  std::vector<double> sco_memo_;
};

}  // namespace flatpeak::planner::search_detail
