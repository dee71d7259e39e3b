// Knob search over fixed grids. Per structure (CP, micro-batch): the knob groups act on separate
// time terms (dispatch: the cap; vocabulary: ring size and blocks; boundaries: SCO layers and
// prefetch; optimizer: bucket size and depth), and on the peaks through per-phase parts that
// FastPeaks keeps apart. For each (ring size, prefetch, n offloaded layers) one O(layers) pass
// gives the slack of every rule; the fastest cap and blocks that fit follow from lists sorted by
// time. n starts at the fewest layers that fit (bisection: peaks fall with n) and grows while a
// larger n can still pay for its host-link time.
#include "knob_search.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <tuple>

#include <fmt/format.h>

#include "spec/sizes.h"

namespace flatpeak::planner {

std::vector<int64_t> chunk_cap_grid(int64_t rows) {
  std::vector<int64_t> g;
  for (int64_t c = 64; c < rows; c *= 2) g.push_back(c);
  g.push_back(std::max<int64_t>(1, rows));
  return g;
}

std::vector<int64_t> token_block_grid(int64_t tokens) {
  std::vector<int64_t> g;
  for (int64_t b = 256; b < tokens && b <= 65536; b *= 2) g.push_back(b);
  if (tokens <= 65536 || g.empty()) g.push_back(std::max<int64_t>(1, std::min<int64_t>(tokens, 65536)));
  return g;
}

std::vector<int64_t> vocab_block_grid(int64_t shard) {
  std::vector<int64_t> g;
  for (int64_t d = 1; d <= 8; d *= 2) {
    const int64_t v = ceil_div(shard, d);
    if (v >= 1 && (g.empty() || v < g.back())) g.push_back(v);
  }
  std::reverse(g.begin(), g.end());
  return g;
}

std::vector<int64_t> bucket_grid(int64_t shard_params) {
  std::vector<int64_t> g;
  for (int64_t b = int64_t{16} << 20; b <= int64_t{1} << 30; b *= 2) {
    g.push_back(b);
    if (b >= shard_params) break;  // larger buckets behave as one bucket of the whole shard
  }
  return g;
}

std::vector<int64_t> ring_size_grid(int64_t gpus, int64_t gpus_per_node) {
  std::vector<int64_t> g;
  for (int64_t r = 1; r <= std::min(gpus, gpus_per_node); ++r)
    if (gpus % r == 0) g.push_back(r);
  return g;
}

namespace {

using Disp = FastPeaks::Disp;
using Voc = FastPeaks::Voc;
using Bnd = FastPeaks::Bnd;
constexpr int64_t kNone = std::numeric_limits<int64_t>::min() / 4;

RingRotate auto_rotate(int64_t vocab, int64_t ring, int64_t tokens) {
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
// MTP modules and losses count L - n plus a constant; the rest counts nothing.
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
      if (!small || b.bucket * b.depth < small->bucket * small->depth) small = &b;
    if (small) c.bucket_params = small->bucket, c.bucket_depth = small->depth;
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
      case Bnd::Forward: return resident(layer) + (layer >= L_ ? 1 : off(layer));
      case Bnd::Backward: {
        if (layer >= L_) return resident(layer);
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
      if (head.bf16 != 0 || head.fp32 != 0) {
        specials_.push_back(Special{value, bnd, layer, head, group});
        return;
      }
      Envelope& e = group >= 0 ? env_[static_cast<size_t>(group)] : env_voc_[static_cast<size_t>(-group - 1)];
      switch (bnd) {
        case Bnd::None: e.add_flat(value); break;
        case Bnd::Loss: e.add_resident(value, layer + 1); break;
        case Bnd::Forward:
          if (layer >= L_) e.add_resident(value, layer - L_ + 2);
          else e.add_forward(layer, value);
          break;
        case Bnd::Backward:
          if (layer >= L_) e.add_resident(value, layer - L_ + 1);
          else e.add_backward(layer, value);
          break;
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
      if (h <= fp_.host_budget_bytes()) {
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
      for (const MoeBasis* b : bases) c.loads.push_back(load_with_cap(*b, run_, cap));
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
      for (int64_t d : depths) buckets_.push_back(BucketCand{b, d, tm_.optimizer(b, d).exposed_s});
    std::stable_sort(buckets_.begin(), buckets_.end(), [](const BucketCand& a, const BucketCand& b) {
      if (a.y != b.y) return a.y < b.y;
      if (a.bucket * a.depth != b.bucket * b.depth) return a.bucket * a.depth < b.bucket * b.depth;
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
  std::vector<double> sco_memo_;
};

// ---- candidates over CP and micro-batch -----------------------------------------------------

std::vector<int64_t> cp_candidates(const RunSpec& spec) {
  if (!spec.cp_auto) return {spec.cp.value_or(1)};
  std::vector<int64_t> out;
  for (int64_t cp = 1; cp <= spec.gpus; cp *= 2)
    if (spec.gpus % cp == 0 && spec.context_tokens % cp == 0) out.push_back(cp);
  return out;
}

std::vector<int64_t> micro_batch_candidates(const RunSpec& spec, int64_t cp) {
  if (spec.micro_batch) return {*spec.micro_batch};
  if (!spec.global_batch) return {1};
  const int64_t dp = spec.gpus / cp;
  std::vector<int64_t> out;
  if (*spec.global_batch % dp != 0) return {1};
  const int64_t per = *spec.global_batch / dp;
  for (int64_t b = 1; b <= per; ++b)
    if (per % b == 0) out.push_back(b);
  return out;
}

std::string gib(int64_t bytes) { return format_bytes(bytes); }

RunSpec apply(const RunSpec& spec, const SearchChoice& c, const Structure& s) {
  RunSpec out = spec;
  out.cp = c.cp;
  out.cp_auto = false;
  out.micro_batch = c.micro_batch;
  const ResolvedRun& r = s.run();
  if (s.cap_free()) out.chunk_cap_rows = c.chunk_cap_rows;
  if (r.vocab == VocabMode::RingDtp) {
    if (!spec.ring_size) out.ring_size = c.ring_size;
    if (!spec.token_block) out.token_block = c.token_block;
    if (!spec.vocab_block) out.vocab_block = c.vocab_block;
  }
  if (s.sco_free()) out.sco_layers = std::to_string(c.sco_layers);
  if (r.boundaries == BoundaryMode::Sco && !spec.sco_prefetch) out.sco_prefetch = c.sco_prefetch;
  if (s.bucket_free()) {
    if (!spec.bucket_params) out.bucket_params = c.bucket_params;
    if (!spec.bucket_depth) out.bucket_depth = c.bucket_depth;
  }
  return out;
}

// Why each searched knob has its value: the faster values of that knob alone (others fixed)
// that do not fit, or the time term it minimises.
std::vector<KnobReason> explain(Structure& s, const SearchChoice& best, const std::vector<int64_t>& cps,
                                const std::vector<int64_t>& bs, const RunSpec& spec) {
  std::vector<KnobReason> out;
  const auto base = s.evaluate(best);
  auto why = [&](const char* name, const nlohmann::ordered_json& value, const char* term,
                 const std::vector<std::pair<std::string, SearchChoice>>& alternatives) {
    std::string blocked, slower;
    double slower_delta = std::numeric_limits<double>::infinity();
    for (const auto& [label, alt] : alternatives) {
      const auto e = s.evaluate(alt);
      if (e.step == 0) continue;
      if (e.step < base.step && !(e.gpu_fits && e.host_fits)) {
        if (blocked.empty())
          blocked = !e.gpu_fits ? fmt::format("{} would be {:.3g} s faster but the GPU needs {} more", label, base.step - e.step,
                                              gib(s.peaks().required_bytes(e.gpu_peak) - s.peaks().device_budget_bytes()))
                                : fmt::format("{} would be {:.3g} s faster but the host needs {} more per node", label,
                                              base.step - e.step, gib(e.host_peak - s.peaks().host_budget_bytes()));
      } else if (e.step > base.step && e.step - base.step < slower_delta) {
        slower_delta = e.step - base.step;
        slower = fmt::format("{} adds {:.3g} s", label, slower_delta);
      } else if (e.step == base.step && e.gpu_fits && e.host_fits && slower.empty()) {
        slower = fmt::format("{} ties on step time with a higher peak", label);
      }
    }
    std::string reason;
    if (!blocked.empty()) reason = "binding: " + blocked;
    else reason = std::string("time: minimises ") + term + (slower.empty() ? "" : " (" + slower + ")");
    out.push_back(KnobReason{name, value, reason});
  };
  if (s.cap_free()) {
    std::vector<std::pair<std::string, SearchChoice>> alts;
    for (const auto& c : s.caps())
      if (c.cap != best.chunk_cap_rows) {
        SearchChoice a = best;
        a.chunk_cap_rows = c.cap;
        alts.emplace_back(fmt::format("cap {}", c.cap), a);
      }
    const CapCand* cc = s.find_cap(best.chunk_cap_rows);
    why("chunk_cap_rows", best.chunk_cap_rows, "expert GEMMs and the EP all-to-all", alts);
    if (cc && !cc->loads.empty()) out.back().reason += fmt::format("; {} rounds", cc->loads.front().rounds);
  }
  if (s.vocab_free()) {
    std::vector<std::pair<std::string, SearchChoice>> ring_alts, tb_alts, vb_alts;
    for (int64_t R : s.rings())
      if (R != best.ring_size) {
        for (const auto& v : s.vocab().at(R))
          if (v.tb == best.token_block) {
            SearchChoice a = best;
            a.ring_size = R;
            a.vocab_block = v.vb;
            ring_alts.emplace_back(fmt::format("ring size {}", R), a);
            break;
          }
      }
    for (const auto& v : s.vocab().at(best.ring_size)) {
      if (v.tb != best.token_block && v.vb == best.vocab_block) {
        SearchChoice a = best;
        a.token_block = v.tb;
        tb_alts.emplace_back(fmt::format("token block {}", v.tb), a);
      }
      if (v.vb != best.vocab_block && v.tb == best.token_block) {
        SearchChoice a = best;
        a.vocab_block = v.vb;
        vb_alts.emplace_back(fmt::format("vocab block {}", v.vb), a);
      }
    }
    if (s.rings().size() > 1) why("ring_size", best.ring_size, "Ring-DTP hops and the LM head's FSDP traffic", ring_alts);
    if (!spec.token_block) why("token_block", best.token_block, "logits block GEMMs and launches", tb_alts);
    if (!spec.vocab_block) why("vocab_block", best.vocab_block, "logits block GEMMs and launches", vb_alts);
  }
  if (s.sco_free()) {
    const int64_t fewest = s.fewest_layers(best);
    std::string reason;
    if (best.sco_layers == 0) reason = "the boundaries fit on the device: no host-link traffic";
    else if (best.sco_layers == fewest)
      reason = fmt::format("binding: checkpoint boundaries: the fewest first layers at which the GPU fits ({} would not)", best.sco_layers - 1);
    else
      reason = fmt::format("time: {} more layers than the fewest that fit ({}) let larger caps or blocks run faster",
                           best.sco_layers - fewest, fewest);
    out.push_back(KnobReason{"sco_layers", std::to_string(best.sco_layers), reason});
  }
  if (s.run().boundaries == BoundaryMode::Sco && !spec.sco_prefetch) {
    std::vector<std::pair<std::string, SearchChoice>> alts;
    for (int64_t p : s.prefetches())
      if (p != best.sco_prefetch) {
        SearchChoice a = best;
        a.sco_prefetch = p;
        alts.emplace_back(fmt::format("prefetch {}", p), a);
      }
    why("sco_prefetch", best.sco_prefetch, "host-link waits in backward", alts);
  }
  if (s.bucket_free()) {
    std::vector<std::pair<std::string, SearchChoice>> size_alts, depth_alts;
    for (const auto& b : s.buckets()) {
      if (b.depth == best.bucket_depth && b.bucket != best.bucket_params) {
        SearchChoice a = best;
        a.bucket_params = b.bucket;
        size_alts.emplace_back(fmt::format("{} params per bucket", format_tokens(b.bucket)), a);
      }
      if (b.bucket == best.bucket_params && b.depth != best.bucket_depth) {
        SearchChoice a = best;
        a.bucket_depth = b.depth;
        depth_alts.emplace_back(fmt::format("depth {}", b.depth), a);
      }
    }
    if (!spec.bucket_params) why("bucket_params", best.bucket_params, "the optimizer step's exposed time", size_alts);
    if (!spec.bucket_depth) why("bucket_depth", best.bucket_depth, "the optimizer step's exposed time", depth_alts);
  }
  if (spec.cp_auto)
    out.push_back(KnobReason{"cp", best.cp, fmt::format("the least time per token of the CPs that fit ({{{}}} tried)",
                                                        fmt::join(cps, ", "))});
  if (!spec.micro_batch && spec.global_batch)
    out.push_back(KnobReason{"micro_batch", best.micro_batch,
                             fmt::format("the least time per token of the micro-batches that fit at global batch {} ({{{}}} tried)",
                                         spec.global_batch.value_or(0), fmt::join(bs, ", "))});
  return out;
}

}  // namespace

Diagnosis diagnose(const ModelSpec& model, const HardwareSpec& hardware, const RunSpec& spec, const Efficiency& efficiency,
                   LoadCache& cache, const SearchResult& failed, const FastPeaks& peaks);

std::vector<std::string> searchable_knobs(const ModelSpec& model, const RunSpec& spec) {
  std::vector<std::string> out;
  const bool moe = model.num_experts > 0 && model.count_layers(FfnKind::Moe) > 0;
  const bool flat = spec.schedule == Schedule::Flatpeak;
  if (spec.cp_auto) out.push_back("cp");
  if (!spec.micro_batch && spec.global_batch) out.push_back("micro_batch");
  if (moe && spec.llep.value_or(flat) && !spec.chunk_cap_rows) out.push_back("chunk_cap_rows");
  if (spec.ring_dtp.value_or(flat)) {
    if (!spec.ring_size && spec.vocab_backward != VocabBackward::InForward) out.push_back("ring_size");
    if (!spec.token_block) out.push_back("token_block");
    if (!spec.vocab_block) out.push_back("vocab_block");
  }
  if (spec.sco.value_or(flat)) {
    if (!spec.sco_layers) out.push_back("sco_layers");
    if (!spec.sco_prefetch) out.push_back("sco_prefetch");
  }
  if (spec.optimizer.value_or(flat ? OptimizerPlacement::Stream : OptimizerPlacement::Gpu) == OptimizerPlacement::Stream) {
    if (!spec.bucket_params) out.push_back("bucket_params");
    if (!spec.bucket_depth) out.push_back("bucket_depth");
  }
  return out;
}

SearchResult search_knobs(const ModelSpec& model, const HardwareSpec& hardware, const RunSpec& spec,
                          const Efficiency& efficiency, LoadCache* cache, const SearchOptions& options) {
  LoadCache local;
  LoadCache& loads = cache ? *cache : local;
  SearchResult result;
  if (searchable_knobs(model, spec).empty()) {
    // Nothing to search: the plan at its knobs, without the search's structures.
    InputErrors errs;
    ResolvedRun run = resolve_run(model, hardware, spec, errs);
    errs.throw_if_any();
    const Workload work = fast_workload(model, run, loads);
    const FastPeaks fp(model, hardware, run, work);
    result.summary = fp.evaluate(fp.knobs_of(run, work));
    result.found = result.summary.fits();
    result.time = TimeModel(model, hardware, run, work, efficiency).full(run, work);
    result.spec = spec;
    result.choice.cp = run.cp;
    result.choice.micro_batch = run.micro_batch;
    result.choice.chunk_cap_rows = run.chunk_cap_rows;
    result.choice.ring_size = run.ring_size;
    result.choice.ring_rotate = run.ring_rotate;
    result.choice.token_block = run.token_block;
    result.choice.vocab_block = run.vocab_block;
    result.choice.sco_prefetch = run.sco_prefetch;
    result.choice.bucket_params = run.bucket_params;
    result.choice.bucket_depth = run.bucket_depth;
    result.candidates = 1;
    result.run = std::move(run);
    if (options.explain && !result.found) {
      LoadCache& c = loads;
      result.diagnosis = diagnose(model, hardware, spec, efficiency, c, result, fp);
    }
    return result;
  }
  const std::vector<int64_t> cps = cp_candidates(spec);
  Best best;
  std::unique_ptr<Structure> best_structure;
  std::vector<int64_t> best_bs;
  // The most memory-frugal structure, for plans that fit nowhere.
  std::unique_ptr<Structure> frugal_structure;
  SearchChoice frugal_choice;
  int64_t frugal_required = std::numeric_limits<int64_t>::max();
  bool resolved_any = false;
  for (int64_t cp : cps) {
    if (options.first_fit && best.any) break;
    const std::vector<int64_t> bs = micro_batch_candidates(spec, cp);
    for (int64_t b : bs) {
      RunSpec s = spec;
      s.cp_auto = false;
      s.cp = cp;
      s.micro_batch = b;
      InputErrors errs;
      const ResolvedRun run = resolve_run(model, hardware, s, errs, spec.cp_auto ? std::optional<int64_t>(cp) : std::nullopt);
      if (!errs.empty()) {
        if (!resolved_any && cp == cps.back() && b == bs.back()) errs.throw_if_any();
        continue;
      }
      resolved_any = true;
      auto st = std::make_unique<Structure>(model, hardware, spec, run, efficiency, loads);
      Best here = st->search(options.first_fit);
      result.candidates += st->evaluated();
      if (here.any && here.better_than(best)) {
        best = here;
        best_structure = std::move(st);
        best_bs = bs;
        if (options.first_fit) break;
        continue;
      }
      if (!best.any) {
        const SearchChoice f = st->frugal();
        const auto e = st->evaluate(f);
        const int64_t required = st->peaks().required_bytes(e.gpu_peak);
        if (required < frugal_required) {
          frugal_required = required;
          frugal_choice = f;
          frugal_structure = std::move(st);
        }
      }
    }
  }
  if (!resolved_any) {
    InputErrors errs;
    resolve_run(model, hardware, spec, errs, spec.cp_auto ? std::optional<int64_t>(1) : std::nullopt);
    errs.throw_if_any();
  }
  Structure* chosen = best.any ? best_structure.get() : frugal_structure.get();
  if (!chosen) return result;
  result.found = best.any;
  result.choice = best.any ? best.c : frugal_choice;
  result.spec = apply(spec, result.choice, *chosen);
  result.run = chosen->run();
  if (options.first_fit && result.found) return result;  // a yes/no question: no peaks or time
  // Peaks and time at the choice, from the real rules (FastPeaks evaluate, TimeModel).
  PeakKnobs k = chosen->peaks().knobs_of(chosen->run(), chosen->work());
  if (const CapCand* c = chosen->find_cap(result.choice.chunk_cap_rows)) k.loads = c->loads;
  k.ring_size = result.choice.ring_size;
  k.ring_rotate = result.choice.ring_rotate;
  k.token_block = result.choice.token_block;
  k.vocab_block = result.choice.vocab_block;
  k.sco_first = result.choice.sco_layers;
  k.sco_prefetch = result.choice.sco_prefetch;
  k.bucket_params = result.choice.bucket_params;
  k.bucket_depth = result.choice.bucket_depth;
  result.summary = chosen->peaks().evaluate(k);
  {
    ResolvedRun r = chosen->run();
    Workload w = chosen->work();
    w.moe_loads = k.loads;
    r.chunk_cap_rows = result.choice.chunk_cap_rows;
    if (r.vocab == VocabMode::RingDtp) r.ring_size = result.choice.ring_size;
    r.ring_rotate = result.choice.ring_rotate;
    r.token_block = result.choice.token_block;
    r.vocab_block = result.choice.vocab_block;
    if (result.choice.sco_layers >= 0) {
      r.sco_offloaded.assign(static_cast<size_t>(model.num_layers), false);
      for (int64_t i = 0; i < std::min(result.choice.sco_layers, model.num_layers); ++i) r.sco_offloaded[static_cast<size_t>(i)] = true;
    }
    r.sco_prefetch = result.choice.sco_prefetch;
    r.bucket_params = result.choice.bucket_params;
    r.bucket_depth = result.choice.bucket_depth;
    result.time = chosen->time_model().full(r, w);
  }
  if (options.explain && best.any) result.reasons = explain(*chosen, best.c, cps, best_bs, spec);
  if (options.explain && !best.any) result.diagnosis = diagnose(model, hardware, spec, efficiency, loads, result, chosen->peaks());
  return result;
}

namespace {

std::string gpus_text(int64_t n) { return n == 1 ? "1 GPU" : std::to_string(n) + " GPUs"; }

}  // namespace

Diagnosis diagnose(const ModelSpec& model, const HardwareSpec& hardware, const RunSpec& spec, const Efficiency& efficiency,
                   LoadCache& cache, const SearchResult& failed, const FastPeaks& peaks) {
  Diagnosis d;
  const FastSummary& fs = failed.summary;
  SearchOptions quiet;
  quiet.explain = false;
  quiet.first_fit = true;
  auto fits = [&](const RunSpec& s) {
    try {
      return search_knobs(model, hardware, s, efficiency, &cache, quiet);
    } catch (const InputError&) {
      return SearchResult{};
    }
  };
  if (!fs.gpu_fits) {
    d.peak = to_string(fs.binding);
    d.over_bytes = fs.required_bytes - peaks.device_budget_bytes();
  } else {
    d.peak = "host";
    d.over_bytes = fs.host_peak_bytes - peaks.host_budget_bytes();
  }
  // More GPUs: shards (and the host's optimizer state per GPU) shrink. Fitting only gets easier
  // with N: bisect over N = 2N .. 64N (powers of two).
  auto fits_on = [&](int64_t n) {
    RunSpec s = spec;
    s.gpus = n;
    s.global_batch.reset();
    s.ep.reset();
    return fits(s).found;
  };
  if (!fits_on(spec.gpus * 64)) {
    d.remedies.push_back(fmt::format("more GPUs alone do not make it fit (tried up to {})", gpus_text(spec.gpus * 64)));
  } else {
    int64_t lo = 1, hi = 6;  // exponents: 2^hi fits
    while (lo < hi) {
      const int64_t mid = (lo + hi) / 2;
      if (fits_on(spec.gpus << mid)) hi = mid;
      else lo = mid + 1;
    }
    d.remedies.push_back(fmt::format("more GPUs: it fits on {} at the same CP", gpus_text(spec.gpus << lo)));
  }
  // Context parallelism: fewer tokens per GPU.
  if (!spec.cp_auto) {
    RunSpec s = spec;
    s.cp.reset();
    s.cp_auto = true;
    s.global_batch.reset();
    const SearchResult r = fits(s);
    if (r.found) d.remedies.push_back(fmt::format("context parallelism: it fits at CP = {} (--cp auto)", r.choice.cp));
    else d.remedies.push_back("context parallelism alone does not make it fit (--cp auto tried every power of two dividing N)");
  }
  // Host memory: what the host would need if the GPU can fit with more boundaries offloaded
  // (the fastest knobs then; they offload the fewest layers that fit).
  {
    RunSpec s = spec;
    s.host_memory_bytes_per_node = int64_t{1} << 60;
    SearchResult r;
    try {
      r = search_knobs(model, hardware, s, efficiency, &cache, SearchOptions{false, false});
    } catch (const InputError&) {
    }
    if (r.found) {
      const auto needed = static_cast<int64_t>(std::ceil(static_cast<double>(r.summary.host_peak_bytes) / kHostUsableFraction));
      d.remedies.push_back(fmt::format("host memory: it fits with {} of host DRAM per node (--host-memory; {} of it usable)",
                                       format_bytes(needed), format_bytes(r.summary.host_peak_bytes)));
    }
  }
  // What is out of scope here.
  if (d.peak == "layer")
    d.remedies.push_back("out of scope: tiling inside a layer or tensor parallelism would bound the layer working set, "
                         "which only CP bounds here");
  else if (d.peak == "optimizer")
    d.remedies.push_back("out of scope: pipeline or tensor parallelism would shrink the per-GPU model state");
  else if (d.peak == "dispatch")
    d.remedies.push_back("out of scope: expert-tensor parallelism would split the expert activations");
  else if (d.peak == "vocab" || d.peak == "checkpoint")
    d.remedies.push_back("out of scope: tensor or pipeline parallelism would split the remaining tensors");
  return d;
}


nlohmann::ordered_json diagnosis_to_json(const Diagnosis& d) {
  nlohmann::ordered_json j;
  j["peak"] = d.peak;
  j["over_bytes"] = d.over_bytes;
  j["remedies"] = d.remedies;
  return j;
}

Plan make_searched_plan(const ModelSpec& model, const HardwareSpec& hardware, const RunSpec& spec,
                        const Efficiency& efficiency) {
  if (searchable_knobs(model, spec).empty()) {
    Plan p = make_plan(model, hardware, spec);
    p.time = estimate_step_time(p.model, p.hardware, p.run, p.work, efficiency);
    return p;
  }
  const SearchResult r = search_knobs(model, hardware, spec, efficiency);
  Plan p = make_plan(model, hardware, r.spec);
  p.run.cp_auto = spec.cp_auto;
  p.time = estimate_step_time(p.model, p.hardware, p.run, p.work, efficiency);
  const std::vector<std::string> searched = searchable_knobs(model, spec);
  const std::string frugal = "nothing fits: the most memory-frugal value on the grid (see diagnosis)";
  for (const std::string& name : searched) {
    std::string reason = frugal;
    for (const KnobReason& k : r.reasons)
      if (k.name == name) reason = "searched: " + k.reason;
    bool found = false;
    for (Knob& knob : p.run.knobs)
      if (knob.name == name) {
        knob.reason = reason;
        found = true;
      }
    if (!found && (name == "cp" || name == "micro_batch"))
      p.run.knobs.push_back(Knob{name, name == "cp" ? p.run.cp : p.run.micro_batch, reason});
  }
  if (r.diagnosis) p.diagnosis = diagnosis_to_json(*r.diagnosis);
  return p;
}

}  // namespace flatpeak::planner
