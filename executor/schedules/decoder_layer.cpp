// One decoder layer on caller-owned weights (decoder_layer.h). The MoE block is the standard EP path of a
// Megatron-style alltoall dispatcher, on one rank (the all-to-alls are local copies, as a one-rank
// all-to-all is) or across the EP ranks of a Communicator: router → routing map and scattered
// probs → permute into the send buffer → receive buffer and received probs → expert input (sorted
// by local expert) → fc1 → act·prob → fc2 → unpermuted rows → combine receive buffer → MoE output
// (sum of the k copies in slot order). The probabilities are applied in the expert activation, so
// combine is a plain sum.
// At EP > 1 (the planner's terms, planner/README.md "Dispatch", and dispatch_schedule.h hold the
// same buffers): the received rows arrive source-major and are regrouped into the expert input
// (both live), the received probs stay beside the experts until their backward overwrites them
// with d prob for the way home, and the backward regroups twice (d received rows into d fc2 out;
// d expert input back to source-major before the reversed all-to-all), the router's backward
// then coming after that regroup. Every row's arithmetic is the one-rank layer's (the GEMMs do
// not depend on how rows are tiled), so outputs, d x and the non-expert weight grads are bitwise
// those of one rank computing every expert; an expert's weight grads sum the rows of every
// source in one GEMM (one rounding) instead of one per source.
// Attention backward is FlashAttention-2's: dK, dV per key row, dQ in an fp32 accumulator
// [T, a·d], the row delta Σ dO ⊙ O precomputed as [a, T] fp32.
// At CP > 1 attention is a ring (decoder_layer_parts.h): the K,V chunks pass round the CP ranks,
// two in flight, each folded into an fp32 output and lse accumulator; the backward passes each
// chunk on with its fp32 dK,dV accumulator, which a last shift brings home. The ring buffers are
// released with the dQ accumulator and delta, after d norm-1 output is allocated.
// A sliding-window (attention_window) or chunked (attention_chunk) layer masks its keys to the
// window. At CP > 1 a window that stays within the previous rank (halo_from_mask) takes that rank's
// last K,V rows it reaches as a halo in place of the ring, and in backward sends the halo's dK,dV
// back while the next rank's arrive (two fp32 buffers of the halo's size); chunks that never
// straddle a rank boundary need no halo, and a longer window runs the ring with the mask.
// Order of work inside a phase keeps short-lived buffers (router gradients, the norm-2
// backward) off the phase's peak; which buffers are live at each peak is listed per phase below.
//   DecoderLayer layer(alloc, config, layer_weights_in(unit.raw(), config));  Tensor y = layer.forward_no_grad(x, "fwd/L0/");
#include "executor/schedules/decoder_layer.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <stdexcept>

#include "executor/cpu/gemm_cpu.h"
#include "executor/ops/attention.h"
#include "executor/ops/expert_ffn.h"
#include "executor/ops/linear.h"
#include "executor/ops/layernorm.h"
#include "executor/ops/rmsnorm.h"
#include "executor/schedules/decoder_layer_parts.h"

namespace flatpeak::exec {

namespace {

constexpr Category kAct = Category::Activations;
constexpr Category kDsp = Category::Dispatch;

// A byte buffer (the routing map, bool [T, E]) from the allocator; Tensor has no 1-byte dtype.
class ByteBuffer {
 public:
  ByteBuffer(TrackingAllocator& alloc, int64_t bytes, Category category)
      : alloc_(&alloc), block_(alloc.allocate(bytes, category, MemorySpace::Device)) {}
  ByteBuffer(const ByteBuffer&) = delete;
  ByteBuffer& operator=(const ByteBuffer&) = delete;
  ~ByteBuffer() { reset(); }
  void reset() {
    if (alloc_ && block_.data) alloc_->release(block_);
    block_ = Allocation{};
  }
  uint8_t* data() { return static_cast<uint8_t*>(block_.data); }

 private:
  TrackingAllocator* alloc_;
  Allocation block_;
};

using layer_detail::EpRows;
using layer_detail::flash2_attention_backward;
using layer_detail::SavedAttention;

template <class S>
class LayerCore final : public DecoderLayer::Engine {
 public:
  LayerCore(TrackingAllocator& alloc, const LayerScheduleConfig& c, const LayerWeightPtrs& w, Communicator* ep_group,
            Communicator* cp_group)
      : a_(alloc), c_(c), T_(c.tokens), H_(c.hidden), A_(c.q_heads), G_(c.kv_heads),
        D_(c.head_dim), Dv_(c.v_head_dim > 0 ? c.v_head_dim : c.head_dim), QL_(c.q_lora), KL_(c.kv_lora), RD_(c.rope_dim),
        mla_(c.kv_lora > 0), E_(c.experts), EL_(c.experts / c.ep), K_(c.top_k), F_(c.expert_ffn),
        FS_(c.dense_ffn > 0 ? c.dense_ffn : c.shared_ffn), TK_(T_ * K_), dense_(c.dense_ffn > 0), gated_(c.shared_gate),
        ln_(c.layer_norm), norm1_bias_(cast(w.norm1_bias)), norm2_bias_(cast(w.norm2_bias)),
        norm1_(cast(w.norm1)), wq_(cast(w.wq)), wk_(cast(w.wk)), wv_(cast(w.wv)), wo_(cast(w.wo)), norm2_(cast(w.norm2)),
        wr_(cast(w.router)), wgu_(cast(w.w_gate_up)), wd_(cast(w.w_down)), wsgu_(cast(w.shared_gate_up)), wsd_(cast(w.shared_down)),
        wsg_(cast(w.shared_gate)), wb_(cast(w.b_expert)), wq_a_(cast(w.wq_a)), q_norm_(cast(w.q_norm)), wq_b_(cast(w.wq_b)),
        wkv_a_(cast(w.wkv_a)), kv_norm_(cast(w.kv_norm)), wkv_b_(cast(w.wkv_b)), comm_(c.ep > 1 ? ep_group : nullptr),
        cp_(c.cp > 1 ? cp_group : nullptr), mask_{c.attention_window, c.attention_chunk}, halo_(halo_from_mask(c, mask_)) {
    if (c.expert_bias != (wb_ != nullptr))
      throw std::invalid_argument("decoder layer: the b_expert weight must be given exactly when expert_bias is set");
    if (c.ep > 1 && (ep_group == nullptr || ep_group->size() != c.ep))
      throw std::invalid_argument("decoder layer: ep = " + std::to_string(c.ep) + " needs a Communicator of that many ranks");
    if (c.cp > 1 && (cp_group == nullptr || cp_group->size() != c.cp))
      throw std::invalid_argument("decoder layer: cp = " + std::to_string(c.cp) + " needs a Communicator of that many ranks");
  }

  const std::vector<int64_t>& expert_counts() const override { return counts_; }

  Tensor forward_no_grad(const Tensor& x, const std::string& prefix, const Hook& on_start) override {
    x_ = &x;
    return forward_no_grad(prefix, on_start);
  }
  Tensor forward_saving(const Tensor& x, const std::string& prefix, bool keep_output, const TensorSource& grad_stream,
                        const Hook& on_start) override {
    x_ = &x;
    return recompute_forward(prefix, keep_output, grad_stream, on_start);
  }
  Tensor backward(const Tensor& x, const std::string& prefix, const TensorSource& grad_stream, const GradSource& grads) override {
    x_ = &x;
    return backward(prefix, grad_stream, grads);
  }

 private:
  static const S* cast(const void* p) { return static_cast<const S*>(p); }

  // At CP > 1, what a windowed layer's queries need from before their rank's first token: the
  // most any rank's first query reaches back under the mask. Up to T rows come from the previous
  // rank as a halo (0: nothing moves); more, or full attention, take the ring (−1).
  static int64_t halo_from_mask(const LayerScheduleConfig& c, const layer_detail::KeyWindow& mask) {
    if (c.cp <= 1) return 0;
    if (c.attention_window <= 0 && c.attention_chunk <= 0) return -1;
    int64_t reach = 0;
    for (int64_t r = 1; r < c.cp; ++r) reach = std::max(reach, r * c.tokens - mask.first_key(r * c.tokens));
    return reach <= c.tokens ? reach : -1;
  }

  Tensor act(std::vector<int64_t> shape) { return Tensor(a_, c_.dtype, std::move(shape), kAct); }
  Tensor dsp(std::vector<int64_t> shape) { return Tensor(a_, c_.dtype, std::move(shape), kDsp); }
  Tensor f32(std::vector<int64_t> shape, Category cat) { return Tensor(a_, DType::F32, std::move(shape), cat); }

  // ---- attention pieces

  // Per-token statistics of `rows` norms ([rows, T] fp32 each): rstd, and the mean with LayerNorm.
  struct NormStats {
    Tensor rstd, mean;
  };
  NormStats norm_stats(int64_t rows) {
    NormStats s;
    s.rstd = f32({rows, T_}, kAct);
    if (ln_) s.mean = f32({rows, T_}, kAct);
    return s;
  }

  // Norm `which` (1: before attention, 2: before the FFN) of x into out, its statistics in row
  // `row` of `stats`: RMSNorm, or LayerNorm with its bias.
  void norm(int which, const Tensor& x, Tensor& out, NormStats& stats, int64_t row) {
    float* rstd = stats.rstd.template data<float>() + row * T_;
    if (!ln_) {
      RmsNormArgs n;
      n.dtype = c_.dtype;
      n.x = x.raw();
      n.weight = which == 1 ? norm1_ : norm2_;
      n.out = out.raw();
      n.rstd = rstd;
      n.tokens = T_;
      n.hidden = H_;
      rmsnorm_forward_cpu(n);
      return;
    }
    LayerNormArgs n;
    n.dtype = c_.dtype;
    n.x = x.raw();
    n.weight = which == 1 ? norm1_ : norm2_;
    n.bias = which == 1 ? norm1_bias_ : norm2_bias_;
    n.out = out.raw();
    n.mean = stats.mean.template data<float>() + row * T_;
    n.rstd = rstd;
    n.tokens = T_;
    n.hidden = H_;
    layernorm_forward_cpu(n);
  }

  void linear(const Tensor& x, const S* w, Tensor& y, int64_t in_f, int64_t out_f) {
    LinearArgs l;
    l.dtype = c_.dtype;
    l.x = x.raw();
    l.w = w;
    l.y = y.raw();
    l.tokens = T_;
    l.in_features = in_f;
    l.out_features = out_f;
    linear_forward_cpu(l);
  }

  AttentionArgs attention_args() {
    AttentionArgs at;
    at.dtype = c_.dtype;
    at.q = q_.raw();
    at.k = k_.raw();
    at.v = v_.raw();
    at.out = o_.raw();
    at.lse = lse_.data<float>();
    at.tokens = T_;
    at.q_heads = A_;
    at.kv_heads = G_;
    at.head_dim = D_;
    at.v_head_dim = Dv_;
    return at;
  }

  void norm1(NormStats& stats) {
    n1_ = act({T_, H_});
    norm(1, *x_, n1_, stats, 0);
  }

  // q, k, v (MLA: from its latents; the latent norms' statistics in rows `latent_row`.. of
  // `stats`), flash attention (o, lse). The op's tiles are on-chip memory on a GPU.
  void attention_forward(NormStats& stats, int64_t latent_row) {
    if (mla_) {
      mla_projections(stats, latent_row);
    } else {
      q_ = act({T_, A_ * D_});
      k_ = act({T_, G_ * D_});
      v_ = act({T_, G_ * Dv_});
      linear(n1_, wq_, q_, H_, A_ * D_);
      linear(n1_, wk_, k_, H_, G_ * D_);
      linear(n1_, wv_, v_, H_, G_ * Dv_);
    }
    o_ = act({T_, A_ * Dv_});
    lse_ = f32({A_, T_}, kAct);
    if (rings()) {
      ring_attention_forward();
      return;
    }
    if (windowed()) {
      windowed_attention_forward();
      return;
    }
    AttentionArgs at = attention_args();
    Tensor tiles = f32({attention_workspace_bytes(at) / 4}, Category::Workspace);
    at.workspace = tiles.data<float>();
    attention_forward_cpu(at);
  }

  // ---- MLA (multi-head latent attention; config kv_lora > 0)

  // Rows of the saved statistics MLA's latent norms take (the q latent's, then the kv latent's).
  int64_t latent_norm_rows() const { return mla_ ? (QL_ > 0 ? 2 : 1) : 0; }
  int64_t NP() const { return D_ - RD_; }  // each head's k_nope (and q_nope) width

  // RMSNorm of a latent [T, width] into out, its rstd in row `row` of `stats`.
  void latent_norm(const Tensor& latent, const S* weight, int64_t width, Tensor& out, NormStats& stats, int64_t row) {
    RmsNormArgs n;
    n.dtype = c_.dtype;
    n.x = latent.raw();
    n.weight = weight;
    n.out = out.raw();
    n.rstd = stats.rstd.template data<float>() + row * T_;
    n.tokens = T_;
    n.hidden = width;
    rmsnorm_forward_cpu(n);
  }
  void latent_norm_backward(const Tensor& latent, const S* weight, int64_t width, int64_t row, const Tensor& d_out, Tensor& d_x,
                            void* d_weight) {
    RmsNormArgs n;
    n.dtype = c_.dtype;
    n.x = latent.raw();
    n.weight = weight;
    n.rstd = stats_.rstd.template data<float>() + row * T_;
    n.d_out = d_out.raw();
    n.d_x = d_x.raw();
    n.d_weight = d_weight;
    n.tokens = T_;
    n.hidden = width;
    Tensor ws = f32({rmsnorm_workspace_bytes(n) / 4}, Category::Workspace);
    n.workspace = ws.data<float>();
    rmsnorm_backward_cpu(n);
  }

  // q, k, v from the latents. Peaks: the q side holds the q latent, its normed copy and q; the kv
  // side the kv latent, k_rope [T, rope], the normed kv latent, k and v (the normed latents and
  // k_rope freed before the attention's o and lse are made).
  void mla_projections(NormStats& stats, int64_t row) {
    q_ = act({T_, A_ * D_});
    if (QL_ > 0) {
      cq_ = act({T_, QL_});
      linear(n1_, wq_a_, cq_, H_, QL_);
      Tensor cqn = act({T_, QL_});
      latent_norm(cq_, q_norm_, QL_, cqn, stats, row);
      linear(cqn, wq_b_, q_, QL_, A_ * D_);
    } else {
      linear(n1_, wq_, q_, H_, A_ * D_);
    }
    ckv_ = act({T_, KL_});
    linear(n1_, wkv_a_, ckv_, H_, KL_);  // the first kv_lora rows of W_kv_a
    k_ = act({T_, A_ * D_});
    v_ = act({T_, A_ * Dv_});
    Tensor k_rope = act({T_, RD_});
    linear(n1_, wkv_a_ + KL_ * H_, k_rope, H_, RD_);  // its last rope_dim rows
    Tensor ckvn = act({T_, KL_});
    latent_norm(ckv_, kv_norm_, KL_, ckvn, stats, row + (QL_ > 0 ? 1 : 0));
    S* k = k_.data<S>();
    for (int64_t h = 0; h < A_; ++h)  // head h's k_nope straight into its columns of k
      gemm_cpu(false, true, T_, NP(), KL_, 1.0f, ckvn.data<S>(), KL_, wkv_b_ + h * NP() * KL_, KL_, false, k + h * D_, A_ * D_);
    gemm_cpu(false, true, T_, A_ * Dv_, KL_, 1.0f, ckvn.data<S>(), KL_, wkv_b_ + A_ * NP() * KL_, KL_, false, v_.data<S>(), A_ * Dv_);
    const S* kr = k_rope.data<S>();
    for (int64_t t = 0; t < T_; ++t)
      for (int64_t h = 0; h < A_; ++h) std::copy(kr + t * RD_, kr + (t + 1) * RD_, k + (t * A_ + h) * D_ + NP());
  }

  // The projections' backward from dq, dk, dv into d norm-1 output (overwritten) and the grads of
  // W_q_a, q_norm, W_q_b (or W_q), W_kv_a, kv_norm, W_kv_b. The normed latents are recomputed from
  // the saved latents and statistics (the same arithmetic as the forward's). Peaks: the q side
  // holds two [T, q_lora] buffers; the kv side d normed kv latent [T, kv_lora] with its fp32
  // accumulator (the heads' k_nope parts summed in fp32), then with the normed kv latent, then
  // d kv latent [T, kv_lora] with d k_rope [T, rope].
  void mla_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv, Tensor& dn1, const LayerWeightPtrs& gw) {
    const S* n1 = n1_.data<S>();
    S* out = dn1.data<S>();
    const int64_t kv_row = 2 + (QL_ > 0 ? 1 : 0);
    if (QL_ > 0) {
      Tensor d_cqn = act({T_, QL_});
      gemm_cpu(false, false, T_, QL_, A_ * D_, 1.0f, dq.data<S>(), A_ * D_, wq_b_, QL_, false, d_cqn.data<S>(), QL_);
      {
        Tensor cqn = act({T_, QL_});
        latent_norm(cq_, q_norm_, QL_, cqn, stats_, 2);  // rewrites the saved rstd with the same values
        gemm_cpu(true, false, A_ * D_, QL_, T_, 1.0f, dq.data<S>(), A_ * D_, cqn.data<S>(), QL_, true, static_cast<S*>(gw.wq_b), QL_);
      }
      Tensor d_cq = act({T_, QL_});
      latent_norm_backward(cq_, q_norm_, QL_, 2, d_cqn, d_cq, gw.q_norm);
      d_cqn.reset();
      gemm_cpu(false, false, T_, H_, QL_, 1.0f, d_cq.data<S>(), QL_, wq_a_, H_, false, out, H_);
      gemm_cpu(true, false, QL_, H_, T_, 1.0f, d_cq.data<S>(), QL_, n1, H_, true, static_cast<S*>(gw.wq_a), H_);
    } else {
      gemm_cpu(false, false, T_, H_, A_ * D_, 1.0f, dq.data<S>(), A_ * D_, wq_, H_, false, out, H_);
      gemm_cpu(true, false, A_ * D_, H_, T_, 1.0f, dq.data<S>(), A_ * D_, n1, H_, true, static_cast<S*>(gw.wq), H_);
    }
    S* g_wkvb = static_cast<S*>(gw.wkv_b);
    Tensor d_ckvn = act({T_, KL_});
    {
      Tensor acc = f32({T_, KL_}, kAct);  // d normed kv latent over every head, in fp32
      for (int64_t h = 0; h < A_; ++h)
        gemm_cpu(false, false, T_, KL_, NP(), 1.0f, dk.data<S>() + h * D_, A_ * D_, wkv_b_ + h * NP() * KL_, KL_, h > 0, acc.data<float>(),
                 KL_);
      gemm_cpu(false, false, T_, KL_, A_ * Dv_, 1.0f, dv.data<S>(), A_ * Dv_, wkv_b_ + A_ * NP() * KL_, KL_, true, acc.data<float>(), KL_);
      for (int64_t i = 0; i < T_ * KL_; ++i) store_f32(d_ckvn.data<S>() + i, acc.data<float>()[i]);
    }
    {
      Tensor ckvn = act({T_, KL_});
      latent_norm(ckv_, kv_norm_, KL_, ckvn, stats_, kv_row);
      for (int64_t h = 0; h < A_; ++h)
        gemm_cpu(true, false, NP(), KL_, T_, 1.0f, dk.data<S>() + h * D_, A_ * D_, ckvn.data<S>(), KL_, true, g_wkvb + h * NP() * KL_, KL_);
      gemm_cpu(true, false, A_ * Dv_, KL_, T_, 1.0f, dv.data<S>(), A_ * Dv_, ckvn.data<S>(), KL_, true, g_wkvb + A_ * NP() * KL_, KL_);
    }
    Tensor d_ckv = act({T_, KL_});
    latent_norm_backward(ckv_, kv_norm_, KL_, kv_row, d_ckvn, d_ckv, gw.kv_norm);
    d_ckvn.reset();
    Tensor d_kr = act({T_, RD_});  // k_rope's gradient: every head's rope columns of dk, summed in fp32
    for (int64_t t = 0; t < T_; ++t)
      for (int64_t x = 0; x < RD_; ++x) {
        float sum = 0.0f;
        for (int64_t h = 0; h < A_; ++h) sum += to_f32(dk.data<S>()[(t * A_ + h) * D_ + NP() + x]);
        store_f32(d_kr.data<S>() + t * RD_ + x, sum);
      }
    S* g_wkva = static_cast<S*>(gw.wkv_a);
    gemm_cpu(false, false, T_, H_, KL_, 1.0f, d_ckv.data<S>(), KL_, wkv_a_, H_, true, out, H_);
    gemm_cpu(false, false, T_, H_, RD_, 1.0f, d_kr.data<S>(), RD_, wkv_a_ + KL_ * H_, H_, true, out, H_);
    gemm_cpu(true, false, KL_, H_, T_, 1.0f, d_ckv.data<S>(), KL_, n1, H_, true, g_wkva, H_);
    gemm_cpu(true, false, RD_, H_, T_, 1.0f, d_kr.data<S>(), RD_, n1, H_, true, g_wkva + KL_ * H_, H_);
  }

  // This rank's K,V packed into a ring chunk (K [T, g, d] then V [T, g, dv]).
  int64_t kv_chunk_elems(int64_t rows) const { return rows * G_ * (D_ + Dv_); }
  void pack_kv(Tensor& chunk) {
    const int64_t nk = T_ * G_ * D_, nv = T_ * G_ * Dv_;
    std::copy(k_.data<S>(), k_.data<S>() + nk, chunk.data<S>());
    std::copy(v_.data<S>(), v_.data<S>() + nv, chunk.data<S>() + nk);
  }
  // The chunk held at ring step s came from rank (r − s) mod CP: its own at s = 0 (causal),
  // an earlier chunk of the sequence when that rank is below r, else a later one (skipped).
  int64_t chunk_source(int64_t step) const { return (cp_->rank() - step + c_.cp) % c_.cp; }
  // Ring attention: CP > 1 with full attention or a window that reaches past the previous rank.
  bool rings() const { return cp_ != nullptr && halo_ < 0; }
  // A sliding or chunked window, run by the windowed kernels (with a halo at CP > 1).
  bool windowed() const { return c_.attention_window > 0 || c_.attention_chunk > 0; }
  // This rank's first token's place in the sequence (where the mask counts from).
  int64_t first_position() const { return cp_ != nullptr ? cp_->rank() * T_ : 0; }

  // Ring attention forward into o, lse: peak norm-1 output, q, k, v, o, lse, two K,V chunks in
  // flight, the output accumulator [T, a·dv] and lse accumulator [a, T] (fp32).
  void ring_attention_forward() {
    const int64_t n = kv_chunk_elems(T_);
    Tensor chunk[2] = {act({n}), act({n})};
    Tensor acc = f32({T_, A_ * Dv_}, kAct), lse_acc = f32({A_, T_}, kAct);
    std::fill(acc.data<float>(), acc.data<float>() + T_ * A_ * Dv_, 0.0f);
    std::fill(lse_acc.data<float>(), lse_acc.data<float>() + A_ * T_, -INFINITY);
    pack_kv(chunk[0]);
    int cur = 0;
    for (int64_t step = 0; step < c_.cp; ++step) {
      if (step > 0) {
        cp_->sendrecv_shift(chunk[cur].raw(), chunk[1 - cur].raw(), n, c_.dtype, 1);
        cur = 1 - cur;
      }
      if (chunk_source(step) <= cp_->rank())
        layer_detail::ring_attention_fold<S>(q_.data<S>(), chunk[cur].data<S>(), acc.data<float>(), lse_acc.data<float>(), T_, A_,
                                             G_, dims(), mask_, first_position(), chunk_source(step) * T_);
    }
    for (int64_t i = 0; i < T_ * A_ * Dv_; ++i) store_f32(o_.data<S>() + i, acc.data<float>()[i]);
    std::copy(lse_acc.data<float>(), lse_acc.data<float>() + A_ * T_, lse_.data<float>());
  }

  // The halo a windowed layer needs at CP > 1: the previous rank's last `halo` K rows then V rows,
  // sent on by every rank (the first rank's, from the last rank, is not attended to).
  int64_t halo_rows() const { return cp_ != nullptr ? std::max<int64_t>(0, halo_) : 0; }
  void receive_halo(Tensor& halo_kv) {
    const int64_t rows = halo_rows(), from = T_ - rows;
    cp_->sendrecv_shift(k_.data<S>() + from * G_ * D_, halo_kv.data<S>(), rows * G_ * D_, c_.dtype, 1);
    cp_->sendrecv_shift(v_.data<S>() + from * G_ * Dv_, halo_kv.data<S>() + rows * G_ * D_, rows * G_ * Dv_, c_.dtype, 1);
  }
  layer_detail::HeadDims dims() const { return {D_, Dv_}; }
  // Whether this rank's queries attend to a halo (not the sequence's first rank), and whether its
  // own last keys are in the next rank's (not the last rank).
  bool attends_halo() const { return halo_rows() > 0 && cp_->rank() > 0; }
  bool feeds_halo() const { return halo_rows() > 0 && cp_->rank() + 1 < c_.cp; }

  // Windowed attention into o, lse; at CP > 1 peak adds the halo K,V [halo, g·(d + dv)].
  void windowed_attention_forward() {
    const int64_t halo = halo_rows();
    Tensor halo_kv;
    if (halo > 0) {
      halo_kv = act({kv_chunk_elems(halo)});
      receive_halo(halo_kv);
    }
    Tensor row = f32({Dv_}, Category::Workspace);
    layer_detail::windowed_attention_forward<S>(q_.data<S>(), k_.data<S>(), v_.data<S>(), halo > 0 ? halo_kv.data<S>() : nullptr,
                                                attends_halo() ? halo : 0, o_.data<S>(), lse_.data<float>(), row.data<float>(), T_, A_,
                                                G_, dims(), mask_, first_position());
  }

  // Windowed attention backward into dq, dk, dv. At CP > 1: the halo K,V again (chunk[0]),
  // its dK,dV (dchunk[0], sent to the previous rank) and the next rank's for this rank's last
  // rows (dchunk[1]), left for the caller to release as the ring's buffers are.
  void windowed_attention_backward(const Tensor& d_o, Tensor& dq, Tensor& dk, Tensor& dv, Tensor& dq_acc, Tensor& delta,
                                   Tensor (&chunk)[2], Tensor (&dchunk)[2]) {
    const int64_t halo = halo_rows(), n = kv_chunk_elems(halo);
    layer_detail::attention_row_delta<S>(d_o.data<S>(), o_.data<S>(), delta.data<float>(), T_, A_, Dv_);
    std::fill(dq_acc.data<float>(), dq_acc.data<float>() + T_ * A_ * D_, 0.0f);
    if (halo > 0) {
      chunk[0] = act({n});
      receive_halo(chunk[0]);
      dchunk[0] = f32({n}, kAct);
      dchunk[1] = f32({n}, kAct);
      std::fill(dchunk[0].data<float>(), dchunk[0].data<float>() + n, 0.0f);
      if (attends_halo())
        layer_detail::windowed_attention_backward_halo<S>(q_.data<S>(), d_o.data<S>(), lse_.data<float>(), delta.data<float>(),
                                                          chunk[0].data<S>(), halo, dchunk[0].data<float>(), dq_acc.data<float>(), T_,
                                                          A_, G_, dims(), mask_, first_position());
      cp_->sendrecv_shift(dchunk[0].raw(), dchunk[1].raw(), n, DType::F32, -1);  // to the previous rank, from the next
    }
    Tensor regs = f32({D_ + Dv_}, Category::Workspace);
    layer_detail::windowed_attention_backward_local<S>(q_.data<S>(), k_.data<S>(), v_.data<S>(), d_o.data<S>(), lse_.data<float>(),
                                                       delta.data<float>(), feeds_halo() ? dchunk[1].data<float>() : nullptr, halo,
                                                       regs.data<float>(), dq_acc.data<float>(), dk.data<S>(), dv.data<S>(), T_, A_,
                                                       G_, dims(), mask_, first_position());
    for (int64_t i = 0; i < T_ * A_ * D_; ++i) store_f32(dq.data<S>() + i, dq_acc.data<float>()[i]);
  }

  // Ring attention backward into dq, dk, dv; the chunks and their dK,dV accumulators are left in
  // `chunk` and `dchunk` for the caller to release (after d norm-1 output is allocated).
  void ring_attention_backward(const Tensor& d_o, Tensor& dq, Tensor& dk, Tensor& dv, Tensor& dq_acc, Tensor& delta,
                               Tensor (&chunk)[2], Tensor (&dchunk)[2]) {
    const int64_t n = kv_chunk_elems(T_);
    for (int i = 0; i < 2; ++i) chunk[i] = act({n});
    for (int i = 0; i < 2; ++i) dchunk[i] = f32({n}, kAct);
    layer_detail::attention_row_delta<S>(d_o.data<S>(), o_.data<S>(), delta.data<float>(), T_, A_, Dv_);
    std::fill(dq_acc.data<float>(), dq_acc.data<float>() + T_ * A_ * D_, 0.0f);
    std::fill(dchunk[0].data<float>(), dchunk[0].data<float>() + n, 0.0f);
    pack_kv(chunk[0]);
    int cur = 0;
    for (int64_t step = 0; step < c_.cp; ++step) {
      if (step > 0) {
        cp_->sendrecv_shift(chunk[cur].raw(), chunk[1 - cur].raw(), n, c_.dtype, 1);
        cp_->sendrecv_shift(dchunk[cur].raw(), dchunk[1 - cur].raw(), n, DType::F32, 1);
        cur = 1 - cur;
      }
      if (chunk_source(step) <= cp_->rank())
        layer_detail::ring_attention_backward_chunk<S>(q_.data<S>(), d_o.data<S>(), lse_.data<float>(), delta.data<float>(),
                                                       chunk[cur].data<S>(), dq_acc.data<float>(), dchunk[cur].data<float>(), T_,
                                                       A_, G_, dims(), mask_, first_position(), chunk_source(step) * T_);
    }
    // The chunk here is rank r + 1's: one more shift brings every dK,dV home.
    cp_->sendrecv_shift(dchunk[cur].raw(), dchunk[1 - cur].raw(), n, DType::F32, 1);
    const float* home = dchunk[1 - cur].data<float>();
    for (int64_t i = 0; i < T_ * G_ * D_; ++i) store_f32(dk.data<S>() + i, home[i]);
    for (int64_t i = 0; i < T_ * G_ * Dv_; ++i) store_f32(dv.data<S>() + i, home[T_ * G_ * D_ + i]);
    for (int64_t i = 0; i < T_ * A_ * D_; ++i) store_f32(dq.data<S>() + i, dq_acc.data<float>()[i]);
  }

  // h1 = x + o · Woᵀ (the attention residual).
  void attention_residual() {
    h1_ = act({T_, H_});
    linear(o_, wo_, h1_, A_ * Dv_, H_);
    S* h = h1_.data<S>();
    const S* x = x_->data<S>();
    for (int64_t i = 0; i < T_ * H_; ++i) store_f32(h + i, to_f32(h[i]) + to_f32(x[i]));
  }

  // ---- MoE pieces (routing and bookkeeping as in a Megatron alltoall dispatcher)

  // Router logits [T, E] fp32, scores = softmax, top-k ids [T, k] i64 (ties: lower expert),
  // top-k weights renormalised over the kept k, scattered probs [T, E] fp32, routing map [T, E].
  void route() {
    logits_ = f32({T_, E_}, kDsp);
    scores_ = f32({T_, E_}, kDsp);
    scattered_ = f32({T_, E_}, kDsp);
    map_ = std::make_unique<ByteBuffer>(a_, T_ * E_, kDsp);
    topw_ = f32({T_, K_}, kDsp);
    topid_ = Tensor(a_, DType::I64, {T_, K_}, kDsp);
    gemm_cpu(false, true, T_, E_, H_, 1.0f, n2_.data<S>(), H_, wr_, H_, false, logits_.data<float>(), E_);
    const float* z = logits_.data<float>();
    float* p = scores_.data<float>();
    float* sp = scattered_.data<float>();
    uint8_t* m = map_->data();
    int64_t* ids = topid_.data<int64_t>();
    float* w = topw_.data<float>();
    for (int64_t t = 0; t < T_; ++t) {
      float zmax = -INFINITY;
      for (int64_t e = 0; e < E_; ++e) zmax = std::max(zmax, z[t * E_ + e]);
      float sum = 0.0f;
      for (int64_t e = 0; e < E_; ++e) sum += (p[t * E_ + e] = std::exp(z[t * E_ + e] - zmax));
      for (int64_t e = 0; e < E_; ++e) p[t * E_ + e] /= sum;
      for (int64_t e = 0; e < E_; ++e) sp[t * E_ + e] = 0.0f, m[t * E_ + e] = 0;
      float kept = 0.0f;
      for (int64_t s = 0; s < K_; ++s) {
        int64_t best = -1;
        for (int64_t e = 0; e < E_; ++e)
          if (!m[t * E_ + e] && (best < 0 || p[t * E_ + e] > p[t * E_ + best])) best = e;
        m[t * E_ + best] = 1;
        ids[t * K_ + s] = best;
        kept += p[t * E_ + best];
      }
      for (int64_t s = 0; s < K_; ++s) {
        w[t * K_ + s] = p[t * E_ + ids[t * K_ + s]] / kept;
        sp[t * E_ + ids[t * K_ + s]] = w[t * K_ + s];
      }
    }
    // Rows per expert: host-side metadata (the send order; the grouped GEMM's splits).
    counts_.assign(static_cast<size_t>(E_), 0);
    for (int64_t t = 0; t < T_; ++t)
      for (int64_t e = 0; e < E_; ++e) counts_[static_cast<size_t>(e)] += m[t * E_ + e];
    offsets_.assign(static_cast<size_t>(E_) + 1, 0);
    for (int64_t e = 0; e < E_; ++e) offsets_[static_cast<size_t>(e) + 1] = offsets_[static_cast<size_t>(e)] + counts_[static_cast<size_t>(e)];
    if (comm_) {  // every rank's counts: what each receives (the dispatcher's count exchange)
      std::vector<int64_t> all(static_cast<size_t>(c_.ep * E_));
      comm_->all_gather(counts_.data(), all.data(), E_, DType::I64);
      ep_rows_ = std::make_unique<EpRows>(all, c_.ep, comm_->rank(), E_);
      R_ = ep_rows_->received;
      local_begin_ = ep_rows_->local_begin;
    } else {
      R_ = TK_;
      local_begin_ = offsets_;
    }
  }

  // Calls f(row, prob) for every expert-order row with the prob the expert applies: the permuted
  // probs at one rank, the received probs (source-major) at EP > 1.
  template <class Fn>
  void for_each_expert_row(Fn&& f) const {
    if (!comm_) {
      const float* pp = pprobs_.data<float>();
      for (int64_t r = 0; r < R_; ++r) f(r, pp[r]);
      return;
    }
    const float* rp = rprobs_.data<float>();
    for (const EpRows::Chunk& ch : ep_rows_->chunks)
      for (int64_t i = 0; i < ch.rows; ++i) f(ch.exp_row + i, rp[ch.recv_row + i]);
  }

  // Rows of local expert l in the expert input.
  int64_t expert_row0(int64_t l) const { return local_begin_[static_cast<size_t>(l)]; }
  int64_t expert_rows(int64_t l) const { return local_begin_[static_cast<size_t>(l) + 1] - local_begin_[static_cast<size_t>(l)]; }

  // Calls f(t, s, row) for every token copy, row = its place in expert-major order (within an
  // expert, tokens ascending: the order Megatron's permute gives).
  template <class Fn>
  void for_each_copy(Fn&& f) const {
    std::vector<int64_t> cursor(offsets_.begin(), offsets_.end() - 1);
    const int64_t* ids = topid_.data<int64_t>();
    for (int64_t t = 0; t < T_; ++t)
      for (int64_t s = 0; s < K_; ++s) f(t, s, cursor[static_cast<size_t>(ids[t * K_ + s])]++);
  }

  // Sort indices [T·k] i64 (token of each row), permuted probs [T·k] fp32, send buffer
  // [T·k, H] (rows of norm-2 output in expert order); the all-to-all fills the receive buffer
  // [R, H] and received probs [R]; then the send side is freed (and at one rank the received
  // probs: the experts read the permuted ones).
  void dispatch() {
    sort_idx_ = Tensor(a_, DType::I64, {TK_}, kDsp);
    pprobs_ = f32({TK_}, kDsp);
    send_ = dsp({TK_, H_});
    int64_t* si = sort_idx_.data<int64_t>();
    float* pp = pprobs_.data<float>();
    const float* w = topw_.data<float>();
    const S* n2 = n2_.data<S>();
    S* send = send_.data<S>();
    for_each_copy([&](int64_t t, int64_t s, int64_t row) {
      si[row] = t;
      pp[row] = w[t * K_ + s];
      std::copy(n2 + t * H_, n2 + (t + 1) * H_, send + row * H_);
    });
    recv_ = dsp({R_, H_});
    rprobs_ = f32({R_}, kDsp);
    if (comm_) {
      ep_rows_->exchange(*comm_, send, recv_.raw(), H_, c_.dtype, true);
      ep_rows_->exchange(*comm_, pp, rprobs_.raw(), 1, DType::F32, true);
    } else {
      std::copy(send, send + TK_ * H_, recv_.data<S>());
      std::copy(pp, pp + TK_, rprobs_.data<float>());
    }
    send_.reset();
    if (!comm_) rprobs_.reset();
  }

  // The dispatcher's last step: expert input [R, H] = the received rows sorted by local expert
  // (the same order on one rank); the receive buffer is freed once it is copied. Both are live
  // for the copy, at the end of the dispatch phase (send buffer already freed).
  void sort_to_expert_input() {
    ein_ = dsp({R_, H_});
    if (comm_) ep_rows_->regroup(recv_.data<S>(), ein_.data<S>(), H_);
    else std::copy(recv_.data<S>(), recv_.data<S>() + TK_ * H_, ein_.data<S>());
    recv_.reset();
  }

  // Expert l's bias for an output of width n at `offset` in its [2F + H] (gate/up at 0, down at
  // 2F) into its n_rows rows at `rows`, which the GEMM then accumulates onto; false without biases.
  bool bias_rows(int64_t l, int64_t offset, int64_t width, int64_t n_rows, S* rows) const {
    if (wb_ == nullptr) return false;
    copy_bias_rows(wb_ + l * (2 * F_ + H_) + offset, n_rows, width, rows);
    return true;
  }

  // fc1 [R, 2F] = [gate | up] (+ the expert's gate/up bias), act·prob [R, F] = silu(gate) ⊙ up · prob.
  void experts_fc1() {
    fc1_ = dsp({R_, 2 * F_});
    actp_ = dsp({R_, F_});
    for (int64_t l = 0; l < EL_; ++l) {
      const int64_t r0 = expert_row0(l), n = expert_rows(l);
      if (n == 0) continue;
      const bool bias = bias_rows(l, 0, 2 * F_, n, fc1_.data<S>() + r0 * 2 * F_);
      gemm_cpu(false, true, n, 2 * F_, H_, 1.0f, ein_.data<S>() + r0 * H_, H_, wgu_ + l * 2 * F_ * H_, H_, bias,
               fc1_.data<S>() + r0 * 2 * F_, 2 * F_);
    }
    const S* gu = fc1_.data<S>();
    S* ap = actp_.data<S>();
    for_each_expert_row([&](int64_t r, float prob) {
      for (int64_t f = 0; f < F_; ++f)
        store_f32(ap + r * F_ + f, silu_f32(to_f32(gu[r * 2 * F_ + f])) * to_f32(gu[r * 2 * F_ + F_ + f]) * prob);
    });
  }

  void experts_fc2() {  // fc2 [R, H] = act·prob · W_downᵀ (+ the expert's down bias)
    fc2_ = dsp({R_, H_});
    for (int64_t l = 0; l < EL_; ++l) {
      const int64_t r0 = expert_row0(l), n = expert_rows(l);
      if (n == 0) continue;
      const bool bias = bias_rows(l, 2 * F_, H_, n, fc2_.data<S>() + r0 * H_);
      gemm_cpu(false, true, n, H_, F_, 1.0f, actp_.data<S>() + r0 * F_, F_, wd_ + l * H_ * F_, F_, bias,
               fc2_.data<S>() + r0 * H_, H_);
    }
  }

  // Unpermuted rows [R, H] (back to source order), combine receive buffer [T·k, H] (the
  // all-to-all back), MoE output [T, H] = Σ over the k copies in slot order (fp32).
  void combine() {
    unp_ = dsp({R_, H_});
    crecv_ = dsp({TK_, H_});
    if (comm_) {
      ep_rows_->ungroup(fc2_.data<S>(), unp_.data<S>(), H_);
      ep_rows_->exchange(*comm_, unp_.raw(), crecv_.raw(), H_, c_.dtype, false);
    } else {
      std::copy(fc2_.data<S>(), fc2_.data<S>() + TK_ * H_, unp_.data<S>());
      std::copy(unp_.data<S>(), unp_.data<S>() + TK_ * H_, crecv_.data<S>());
    }
    moe_out_ = dsp({T_, H_});
    Tensor sum = f32({H_}, Category::Workspace);  // one token's fp32 sum (registers on a GPU)
    const S* cr = crecv_.data<S>();
    S* out = moe_out_.data<S>();
    float* acc = sum.data<float>();
    // Copies arrive token by token, slots in order 0..k-1.
    for_each_copy([&](int64_t t, int64_t s, int64_t row) {
      for (int64_t h = 0; h < H_; ++h) acc[h] = (s == 0 ? 0.0f : acc[h]) + to_f32(cr[row * H_ + h]);
      if (s == K_ - 1)
        for (int64_t h = 0; h < H_; ++h) store_f32(out + t * H_ + h, acc[h]);
    });
  }

  // Shared experts (one SwiGLU MLP of width F_s over every token): gate,up [T, 2F_s] and act*up
  // [T, F_s] (activations), from the norm-2 output.
  void shared_forward() {
    sgu_ = act({T_, 2 * FS_});
    sact_ = act({T_, FS_});
    gemm_cpu(false, true, T_, 2 * FS_, H_, 1.0f, n2_.data<S>(), H_, wsgu_, H_, false, sgu_.data<S>(), 2 * FS_);
    const S* gu = sgu_.data<S>();
    for (int64_t t = 0; t < T_; ++t)
      for (int64_t f = 0; f < FS_; ++f)
        store_f32(sact_.data<S>() + t * FS_ + f, silu_f32(to_f32(gu[t * 2 * FS_ + f])) * to_f32(gu[t * 2 * FS_ + FS_ + f]));
  }

  // target += act*up · W_downᵀ (the shared experts' output, a short-lived [T, H]); gated, each
  // token's row scaled by its gate (the saved output and gate when the recompute kept them).
  void add_shared_output(Tensor& target) {
    Tensor out;
    const S* rows = sout_.empty() ? nullptr : sout_.data<S>();
    if (rows == nullptr) {
      out = act({T_, H_});
      gemm_cpu(false, true, T_, H_, FS_, 1.0f, sact_.data<S>(), FS_, wsd_, FS_, false, out.data<S>(), H_);
      rows = out.data<S>();
    }
    S* y = target.data<S>();
    for (int64_t t = 0; t < T_; ++t) {
      // 1 when ungated (1·x is x exactly, so the ungated sum is unchanged).
      const float g = !gated_ ? 1.0f : sgate_.empty() ? shared_gate_of(t) : to_f32(sgate_.data<S>()[t]);
      for (int64_t h = 0; h < H_; ++h) store_f32(y + t * H_ + h, to_f32(y[t * H_ + h]) + g * to_f32(rows[t * H_ + h]));
    }
  }

  // Token t's shared-expert gate sigmoid(norm-2 output · shared_gate), in the storage dtype (so the
  // no-grad forward and the saving forward scale by the same value).
  float shared_gate_of(int64_t t) const {
    const S* n2 = n2_.data<S>() + t * H_;
    float z = 0.0f;
    for (int64_t h = 0; h < H_; ++h) z += to_f32(n2[h]) * to_f32(wsg_[h]);
    S g;
    store_f32(&g, 1.0f / (1.0f + std::exp(-z)));
    return to_f32(g);
  }

  // The recompute's saved ungated shared output [T, H] and gate [T] (activations), for the
  // gate's backward and the shared experts' own.
  void save_shared_output_and_gate() {
    sout_ = act({T_, H_});
    sgate_ = act({T_});
    gemm_cpu(false, true, T_, H_, FS_, 1.0f, sact_.data<S>(), FS_, wsd_, FS_, false, sout_.data<S>(), H_);
    for (int64_t t = 0; t < T_; ++t) store_f32(sgate_.data<S>() + t, shared_gate_of(t));
  }

  void free_routing() {
    logits_.reset(), scores_.reset(), scattered_.reset(), topw_.reset(), topid_.reset();
    map_.reset();
    sort_idx_.reset(), pprobs_.reset(), rprobs_.reset();
  }

  // ---- forward without grad: each buffer freed as soon as nothing later needs it.
  Tensor forward_no_grad(const std::string& p, const Hook& on_start) {
    a_.set_phase(p + "attn");  // peak: norm-1 output, q, k, v, o, lse (MLA: and its latents and their rstd,
                               // or the q or kv projection's moment: mla_projections)
    if (on_start) on_start();
    {
      NormStats stats1 = norm_stats(1);  // not saved without grad
      norm1(stats1);
    }
    {
      NormStats latent_stats = norm_stats(latent_norm_rows());  // MLA's latent norms (not saved); none without MLA
      attention_forward(latent_stats, 0);
    }
    n1_.reset(), q_.reset(), k_.reset(), v_.reset(), lse_.reset(), cq_.reset(), ckv_.reset();
    attention_residual();
    o_.reset();
    if (dense_) return dense_forward_no_grad(p);
    a_.set_phase(p + "moe/route");  // peak: h1, norm-2 output; routing
    n2_ = act({T_, H_});
    {
      NormStats stats2 = norm_stats(1);
      norm(2, h1_, n2_, stats2, 0);
    }
    route();
    a_.set_phase(p + "moe/dispatch");  // + sort indices, permuted probs, send, receive, received probs
    dispatch();
    sort_to_expert_input();
    a_.set_phase(p + "moe/experts");  // + expert input, fc1, act·prob; shared experts' gate,up and act*up
    if (FS_ > 0) shared_forward();
    experts_fc1();
    ein_.reset(), fc1_.reset(), sgu_.reset(), rprobs_.reset();
    experts_fc2();
    actp_.reset();
    if (FS_ > 0) {
      add_shared_output(h1_);  // y = (h1 + shared) + routed, in this order on every path
      sact_.reset();
    }
    a_.set_phase(p + "moe/combine");  // + fc2, unpermuted rows, combine receive buffer, MoE output
    combine();
    fc2_.reset(), unp_.reset(), crecv_.reset();
    free_routing();
    Tensor y(a_, c_.dtype, {T_, H_}, Category::Boundaries);  // the next layer's boundary
    add(h1_, moe_out_, y);
    moe_out_.reset(), h1_.reset(), n2_.reset();
    return y;
  }

  void add(const Tensor& a, const Tensor& b, Tensor& out) {
    const S* pa = a.data<S>();
    const S* pb = b.data<S>();
    S* po = out.data<S>();
    for (int64_t i = 0; i < a.numel(); ++i) store_f32(po + i, to_f32(pa[i]) + to_f32(pb[i]));
  }

  // ---- forward keeping what backward needs (the recompute; the naive reference's forward).
  // Returns the layer output (the naive reference's loss reads it).
  Tensor recompute_forward(const std::string& p, bool keep_output, const TensorSource& grad_stream, const Hook& on_start) {
    a_.set_phase(p + "attn");  // peak: saved attention set, rstd [2, T], dy and the residual grad accumulator
    if (on_start) on_start();
    if (grad_stream) start_grad_stream(grad_stream());
    stats_ = norm_stats(2 + latent_norm_rows());  // rstd (and the mean, LayerNorm) of norm-1, norm-2 and MLA's latents, saved
    norm1(stats_);
    attention_forward(stats_, 2);
    if (dense_) return dense_recompute(p, keep_output);
    a_.set_phase(p + "moe/dispatch");  // + h1, norm-2 output; routing, send, receive
    attention_residual();
    n2_ = act({T_, H_});
    norm(2, h1_, n2_, stats_, 1);
    if (FS_ > 0) shared_forward();  // saved for backward
    if (gated_) save_shared_output_and_gate();
    route();
    dispatch();
    sort_to_expert_input();
    a_.set_phase(p + "moe/experts");  // + expert input, fc1, act·prob (saved; EP > 1: received probs), fc2
    experts_fc1();
    experts_fc2();
    a_.set_phase(p + "moe/combine");  // + unpermuted rows, combine receive buffer, MoE output
    combine();
    Tensor y;
    if (keep_output) {
      y = Tensor(a_, c_.dtype, {T_, H_}, Category::Boundaries);
      std::copy(h1_.data<S>(), h1_.data<S>() + T_ * H_, y.data<S>());
      if (FS_ > 0) add_shared_output(y);
      add(y, moe_out_, y);
    }
    fc2_.reset(), unp_.reset(), crecv_.reset(), moe_out_.reset();
    return y;
  }

  // dy [T, H] (the layer output's gradient, then the residual stream's, in the storage dtype;
  // the caller's) and the residual grad accumulator [T, H] fp32, live through the whole layer
  // backward.
  void start_grad_stream(Tensor dy) {
    if (dy.dtype() != c_.dtype || dy.numel() != T_ * H_) throw std::invalid_argument("decoder layer: dy must be [T, H] in the storage dtype");
    dy_ = std::move(dy);
    res_acc_ = f32({T_, H_}, kAct);
    const S* d = dy_.data<S>();
    float* acc = res_acc_.data<float>();
    for (int64_t i = 0; i < T_ * H_; ++i) acc[i] = to_f32(d[i]);
  }

  // ---- backward

  // The d norm-2 output accumulator [T, H] fp32 (category dispatch) started by the shared
  // experts (d gate,up · W_gate_up, and their gate's d logit · its weight) as their backward ends
  // in moe/experts, at one rank and at EP > 1 alike (so d gate,up is freed there, and the sum
  // runs in the same order on every path); the router and the dispatch rows add to it later.
  Tensor shared_backward_into_accumulator(Tensor& dsgu) {
    Tensor dn2acc = f32({T_, H_}, kDsp);
    gemm_cpu(false, false, T_, H_, 2 * FS_, 1.0f, dsgu.data<S>(), 2 * FS_, wsgu_, H_, false, dn2acc.data<float>(), H_);
    dsgu.reset();
    if (gated_) {  // the gate's: d logit (over the gate, gate_backward) times its weight
      float* acc = dn2acc.data<float>();
      for (int64_t t = 0; t < T_; ++t) {
        const float dz = to_f32(sgate_.data<S>()[t]);
        for (int64_t h = 0; h < H_; ++h) acc[t * H_ + h] += dz * to_f32(wsg_[h]);
      }
    }
    return dn2acc;
  }

  // d top-k weights from each copy's d prob (send order), d logits (softmax over the kept k),
  // d logits · W_router into the d norm-2 output accumulator [T, H] fp32 (made here when the
  // shared experts did not start it), dW_router. d top-k weights and d logits are written over
  // the router scores and logits, which the backward no longer reads (so the router's backward
  // adds nothing beside the accumulator). `dprob_owner` (one rank's d prob buffer) is freed once read.
  void router_backward(const float* dprob_send_order, Tensor& dprob_owner, Tensor& dn2acc, S* g_wr) {
    const bool started = !dn2acc.empty();
    if (!started) dn2acc = f32({T_, H_}, kDsp);
    {
      float* dtopw = scores_.data<float>();  // [T, k] of the [T, E]
      for_each_copy([&](int64_t t, int64_t s, int64_t row) { dtopw[t * K_ + s] = dprob_send_order[row]; });
      dprob_owner.reset();
      float* dz = logits_.data<float>();
      const float* w = topw_.data<float>();
      const int64_t* ids = topid_.data<int64_t>();
      std::fill(dz, dz + T_ * E_, 0.0f);
      for (int64_t t = 0; t < T_; ++t) {
        float dot = 0.0f;
        for (int64_t s = 0; s < K_; ++s) dot += w[t * K_ + s] * dtopw[t * K_ + s];
        for (int64_t s = 0; s < K_; ++s)
          dz[t * E_ + ids[t * K_ + s]] = w[t * K_ + s] * (dtopw[t * K_ + s] - dot);
      }
      gemm_cpu(false, false, T_, H_, E_, 1.0f, static_cast<const float*>(dz), E_, wr_, H_, started, dn2acc.data<float>(), H_);
      gemm_cpu(true, false, E_, H_, T_, 1.0f, static_cast<const float*>(dz), E_, n2_.data<S>(), H_, true, g_wr, H_);
    }
  }

  // acc += each token's k copies of d dispatch rows (send order), in slot order.
  void add_dispatch_rows(const Tensor& ddisp, Tensor& dn2acc) const {
    float* acc = dn2acc.data<float>();
    const S* dd = ddisp.data<S>();
    for_each_copy([&](int64_t t, int64_t, int64_t row) {
      for (int64_t h = 0; h < H_; ++h) acc[t * H_ + h] += to_f32(dd[row * H_ + h]);
    });
  }

  // The MoE block's backward (phases moe/combine, moe/experts, moe/dispatch), ending with d h1
  // accumulated into the residual stream.
  void moe_backward(const std::string& p, const LayerWeightPtrs& gw) {
    S* g_wr = static_cast<S*>(gw.router);
    S* g_wgu = static_cast<S*>(gw.w_gate_up);
    S* g_wd = static_cast<S*>(gw.w_down);
    S* g_b = static_cast<S*>(gw.b_expert);  // [E/EP, 2F + H] (null without expert biases)
    if ((wb_ != nullptr) != (g_b != nullptr))
      throw std::invalid_argument("decoder layer: the b_expert gradient must be given exactly when expert_bias is set");
    const S* dy = dy_.data<S>();
    Tensor dcrow = dsp({TK_, H_});
    for_each_copy([&](int64_t t, int64_t, int64_t row) {
      std::copy(dy + t * H_, dy + (t + 1) * H_, dcrow.data<S>() + row * H_);
    });
    Tensor drecv = dsp({R_, H_});  // the combine all-to-all's backward (one rank: a copy)
    if (comm_) ep_rows_->exchange(*comm_, dcrow.raw(), drecv.raw(), H_, c_.dtype, true);
    else std::copy(dcrow.data<S>(), dcrow.data<S>() + TK_ * H_, drecv.data<S>());
    dcrow.reset();
    Tensor dfc2;
    if (comm_) {  // EP > 1: regrouped by expert here, beside the received rows
      dfc2 = dsp({R_, H_});
      ep_rows_->regroup(drecv.data<S>(), dfc2.data<S>(), H_);
      drecv.reset();
    }

    // One rank: the received rows are in expert order already, so they are d fc2 out (a copy
    // would hold both [R, H] at once, a moment the planner's moe/experts does not have).
    if (!comm_) dfc2 = std::move(drecv);
    a_.set_phase(p + "moe/experts");  // peak: saved experts, d fc2 out, d act·prob, d fc1 out
    Tensor dactp = dsp({R_, F_});
    for (int64_t l = 0; l < EL_; ++l) {
      const int64_t r0 = expert_row0(l), n = expert_rows(l);
      if (n == 0) continue;
      gemm_cpu(false, false, n, F_, H_, 1.0f, dfc2.data<S>() + r0 * H_, H_, wd_ + l * H_ * F_, F_, false,
               dactp.data<S>() + r0 * F_, F_);
      gemm_cpu(true, false, H_, F_, n, 1.0f, dfc2.data<S>() + r0 * H_, H_, actp_.data<S>() + r0 * F_, F_, true,
               g_wd + l * H_ * F_, F_);
      if (wb_ != nullptr) add_row_sums(dfc2.data<S>() + r0 * H_, n, H_, g_b + l * (2 * F_ + H_) + 2 * F_);  // d b_down
    }
    Tensor dfc1 = dsp({R_, 2 * F_});
    const S* gu = fc1_.data<S>();
    for_each_expert_row([&](int64_t r, float prob) {
      for (int64_t f = 0; f < F_; ++f) {
        const float g = to_f32(gu[r * 2 * F_ + f]), u = to_f32(gu[r * 2 * F_ + F_ + f]);
        const float dap = to_f32(dactp.data<S>()[r * F_ + f]) * prob;
        store_f32(dfc1.data<S>() + r * 2 * F_ + f, dap * u * silu_grad_f32(g));
        store_f32(dfc1.data<S>() + r * 2 * F_ + F_ + f, dap * silu_f32(g));
      }
    });
    // Shared experts' backward at the same time: d act*up [T, F_s], d gate,up [T, 2F_s].
    Tensor dsgu;
    if (FS_ > 0) dsgu = mlp_backward(gw);
    dfc2.reset();
    // d prob of each row (fp32). One rank: its own [T·k] buffer, in send order already. EP > 1:
    // written over the received probs (the experts have read them), then home into the permuted
    // probs by the reversed all-to-all.
    Tensor dprob = comm_ ? Tensor() : f32({TK_}, kDsp);
    {
      float* out = comm_ ? rprobs_.data<float>() : dprob.data<float>();
      auto dprob_of = [&](int64_t r) {
        float sum = 0.0f;
        for (int64_t f = 0; f < F_; ++f)
          sum += to_f32(dactp.data<S>()[r * F_ + f]) * silu_f32(to_f32(gu[r * 2 * F_ + f])) * to_f32(gu[r * 2 * F_ + F_ + f]);
        return sum;
      };
      if (comm_) {
        for (const EpRows::Chunk& ch : ep_rows_->chunks)
          for (int64_t i = 0; i < ch.rows; ++i) out[ch.recv_row + i] = dprob_of(ch.exp_row + i);
        ep_rows_->exchange(*comm_, rprobs_.raw(), pprobs_.raw(), 1, DType::F32, false);
        rprobs_.reset();
      } else {
        for (int64_t r = 0; r < TK_; ++r) out[r] = dprob_of(r);
      }
    }
    dactp.reset();
    Tensor dein = dsp({R_, H_});
    for (int64_t l = 0; l < EL_; ++l) {
      const int64_t r0 = expert_row0(l), n = expert_rows(l);
      if (n == 0) continue;
      gemm_cpu(false, false, n, H_, 2 * F_, 1.0f, dfc1.data<S>() + r0 * 2 * F_, 2 * F_, wgu_ + l * 2 * F_ * H_, H_,
               false, dein.data<S>() + r0 * H_, H_);
      gemm_cpu(true, false, 2 * F_, H_, n, 1.0f, dfc1.data<S>() + r0 * 2 * F_, 2 * F_, ein_.data<S>() + r0 * H_, H_, true,
               g_wgu + l * 2 * F_ * H_, H_);
      if (wb_ != nullptr) add_row_sums(dfc1.data<S>() + r0 * 2 * F_, n, 2 * F_, g_b + l * (2 * F_ + H_));  // d b_gu
    }
    dfc1.reset(), ein_.reset(), fc1_.reset(), actp_.reset();
    Tensor dn2acc;
    if (FS_ > 0) dn2acc = shared_backward_into_accumulator(dsgu);
    if (!comm_) {
      // One rank: the router's backward here, off the dispatch peak.
      router_backward(dprob.data<float>(), dprob, dn2acc, g_wr);
    }

    a_.set_phase(p + "moe/dispatch");  // peak: d expert input, d dispatch rows, d norm-2 output accumulator
    if (comm_) {
      // d expert input back to source-major order (both live), then the router's backward, then
      // the reversed all-to-all into the d dispatch rows beside the accumulator.
      Tensor dsrc = dsp({R_, H_});
      ep_rows_->ungroup(dein.data<S>(), dsrc.data<S>(), H_);
      dein.reset();
      Tensor none;
      router_backward(pprobs_.data<float>(), none, dn2acc, g_wr);
      Tensor ddisp = dsp({TK_, H_});
      ep_rows_->exchange(*comm_, dsrc.raw(), ddisp.raw(), H_, c_.dtype, false);
      dsrc.reset();
      add_dispatch_rows(ddisp, dn2acc);
    } else {
      Tensor ddisp = dsp({TK_, H_});  // the dispatch all-to-all's backward (one rank: a copy)
      std::copy(dein.data<S>(), dein.data<S>() + TK_ * H_, ddisp.data<S>());
      add_dispatch_rows(ddisp, dn2acc);
    }
    dein.reset();
    free_routing();
    // Norm-2 backward into the residual stream: d h1 = dy + rmsnorm'(d norm-2 output).
    {
      Tensor dn2 = act({T_, H_});
      for (int64_t i = 0; i < T_ * H_; ++i) store_f32(dn2.data<S>() + i, dn2acc.data<float>()[i]);
      dn2acc.reset();
      Tensor dh1 = act({T_, H_});
      norm_backward(2, h1_, 1, dn2, dh1, gw);
      accumulate_residual(dh1);
    }
    h1_.reset(), n2_.reset(), sgu_.reset(), sact_.reset(), sout_.reset(), sgate_.reset();
  }

  // ---- a dense FFN layer (the SwiGLU MLP over every token in place of the MoE block)

  // The SwiGLU MLP's backward over every token (the shared experts, or a dense layer's FFN; its
  // weights in the shared_* slots): d act*up [T, F] (live until it returns) and d gate,up [T, 2F]
  // (returned), dW_down and dW_gate_up added into the unit's grads.
  Tensor mlp_backward(const LayerWeightPtrs& gw) {
    S* g_down = static_cast<S*>(gw.shared_down);
    S* g_gate_up = static_cast<S*>(gw.shared_gate_up);
    const S* dy = dy_.data<S>();
    Tensor dsact = act({T_, FS_});
    Tensor dsgu = act({T_, 2 * FS_});
    gemm_cpu(false, false, T_, FS_, H_, 1.0f, dy, H_, wsd_, FS_, false, dsact.data<S>(), FS_);
    if (gated_) gate_backward(gw, dsact);  // scales d act*up and the saved act*up by the gate
    gemm_cpu(true, false, H_, FS_, T_, 1.0f, dy, H_, sact_.data<S>(), FS_, true, g_down, FS_);
    const S* sg = sgu_.data<S>();
    for (int64_t t = 0; t < T_; ++t)
      for (int64_t f = 0; f < FS_; ++f) {
        const float g = to_f32(sg[t * 2 * FS_ + f]), u = to_f32(sg[t * 2 * FS_ + FS_ + f]);
        const float da = to_f32(dsact.data<S>()[t * FS_ + f]);
        store_f32(dsgu.data<S>() + t * 2 * FS_ + f, da * u * silu_grad_f32(g));
        store_f32(dsgu.data<S>() + t * 2 * FS_ + FS_ + f, da * silu_f32(g));
      }
    gemm_cpu(true, false, 2 * FS_, H_, T_, 1.0f, dsgu.data<S>(), 2 * FS_, n2_.data<S>(), H_, true, g_gate_up, H_);
    return dsgu;
  }

  // The gate's backward (y = g · shared output, g = sigmoid(z), z = norm-2 output · w): d g = dy ·
  // the saved ungated output, d z = d g · g(1 - g), written over the saved gate
  // (shared_backward_into_accumulator adds d z · w to d norm-2 output); dW_gate += d zᵀ · norm-2
  // output. The shared experts' own backward sees g · dy: d act*up = g · (dy · W_down) and dW_down = dyᵀ · (g · act*up), so their
  // rows are scaled by g here (the saved act*up is not read again).
  void gate_backward(const LayerWeightPtrs& gw, Tensor& dsact) {
    S* g_gate = static_cast<S*>(gw.shared_gate);
    const S* dy = dy_.data<S>();
    const S* n2 = n2_.data<S>();
    Tensor dw_t = f32({H_}, Category::Workspace);  // dW_gate's fp32 sum over the tokens (op scratch)
    float* dw = dw_t.data<float>();
    std::fill(dw, dw + H_, 0.0f);
    for (int64_t t = 0; t < T_; ++t) {
      const float g = to_f32(sgate_.data<S>()[t]);
      float dg = 0.0f;
      for (int64_t h = 0; h < H_; ++h) dg += to_f32(dy[t * H_ + h]) * to_f32(sout_.data<S>()[t * H_ + h]);
      store_f32(sgate_.data<S>() + t, dg * g * (1.0f - g));
      const float dz = to_f32(sgate_.data<S>()[t]);
      for (int64_t h = 0; h < H_; ++h) dw[h] += dz * to_f32(n2[t * H_ + h]);
      for (int64_t f = 0; f < FS_; ++f) {
        store_f32(dsact.data<S>() + t * FS_ + f, g * to_f32(dsact.data<S>()[t * FS_ + f]));
        store_f32(sact_.data<S>() + t * FS_ + f, g * to_f32(sact_.data<S>()[t * FS_ + f]));
      }
    }
    for (int64_t h = 0; h < H_; ++h) store_f32(g_gate + h, to_f32(g_gate[h]) + dw[h]);
  }

  Tensor dense_forward_no_grad(const std::string& p) {
    a_.set_phase(p + "ffn");  // peak: h1, norm-2 output, gate,up, act*up
    n2_ = act({T_, H_});
    {
      NormStats stats2 = norm_stats(1);
      norm(2, h1_, n2_, stats2, 0);
    }
    shared_forward();
    sgu_.reset();
    add_shared_output(h1_);  // y = h1 + FFN
    sact_.reset(), n2_.reset();
    Tensor y(a_, c_.dtype, {T_, H_}, Category::Boundaries);  // the next layer's boundary
    std::copy(h1_.data<S>(), h1_.data<S>() + T_ * H_, y.data<S>());
    h1_.reset();
    return y;
  }

  Tensor dense_recompute(const std::string& p, bool keep_output) {
    a_.set_phase(p + "ffn");  // + h1, norm-2 output, gate,up and act*up (saved)
    attention_residual();
    n2_ = act({T_, H_});
    norm(2, h1_, n2_, stats_, 1);
    shared_forward();
    Tensor y;
    if (keep_output) {
      y = Tensor(a_, c_.dtype, {T_, H_}, Category::Boundaries);
      std::copy(h1_.data<S>(), h1_.data<S>() + T_ * H_, y.data<S>());
      add_shared_output(y);
    }
    return y;
  }

  // Phase ffn: d act*up [T, F_d], d gate,up [T, 2F_d] and d norm-2 output [T, H] live together
  // beside the saved set; then the norm-2 backward into the residual stream.
  void dense_backward(const LayerWeightPtrs& gw) {
    Tensor dn2 = act({T_, H_});
    {
      const Tensor dsgu = mlp_backward(gw);
      gemm_cpu(false, false, T_, H_, 2 * FS_, 1.0f, dsgu.data<S>(), 2 * FS_, wsgu_, H_, false, dn2.data<S>(), H_);
    }
    Tensor dh1 = act({T_, H_});
    norm_backward(2, h1_, 1, dn2, dh1, gw);
    dn2.reset();
    accumulate_residual(dh1);
    h1_.reset(), n2_.reset(), sgu_.reset(), sact_.reset();
  }

  Tensor backward(const std::string& p, const TensorSource& grad_stream, const GradSource& grads) {
    // peak: saved experts, d combine rows [T·k, H], d received rows [R, H] (dense: dense_backward)
    a_.set_phase(p + (dense_ ? "ffn" : "moe/combine"));
    if (dy_.empty()) start_grad_stream(grad_stream());
    // The weights' gradients (+=): the unsharded grads of the layer's unit, zeroed by their owner.
    const LayerWeightPtrs gw = grads();
    S* g_wq = static_cast<S*>(gw.wq);
    S* g_wk = static_cast<S*>(gw.wk);
    S* g_wv = static_cast<S*>(gw.wv);
    S* g_wo = static_cast<S*>(gw.wo);
    if (dense_) dense_backward(gw);
    else moe_backward(p, gw);

    a_.set_phase(p + "attn");  // peak: saved attention set, grad stream, d o, dq, dk, dv, dq accumulator, delta, d norm-1 output
                               // (CP > 1: and the ring's K,V chunks and dK,dV accumulators)
    Tensor d_o = act({T_, A_ * Dv_});
    {
      LinearArgs l;
      l.dtype = c_.dtype;
      l.x = o_.raw();
      l.w = wo_;
      l.d_y = dy_.raw();
      l.d_x = d_o.raw();
      l.d_w = g_wo;
      l.tokens = T_;
      l.in_features = A_ * Dv_;
      l.out_features = H_;
      linear_backward_cpu(l);
    }
    Tensor dq = act({T_, A_ * D_}), dk = act({T_, G_ * D_}), dv = act({T_, G_ * Dv_});
    Tensor dq_acc = f32({T_, A_ * D_}, kAct), delta = f32({A_, T_}, kAct);
    Tensor chunk[2], dchunk[2];  // CP > 1: ring attention's K,V chunks and dK,dV accumulators, or a window's halo
    if (rings()) ring_attention_backward(d_o, dq, dk, dv, dq_acc, delta, chunk, dchunk);
    else if (windowed()) windowed_attention_backward(d_o, dq, dk, dv, dq_acc, delta, chunk, dchunk);
    else flash2_backward(d_o, dq, dk, dv, dq_acc, delta);
    Tensor dn1 = act({T_, H_});
    dq_acc.reset(), delta.reset();
    for (int i = 0; i < 2; ++i) chunk[i].reset(), dchunk[i].reset();
    if (mla_) mla_backward(dq, dk, dv, dn1, gw);
    else qkv_backward(dq, dk, dv, dn1, g_wq, g_wk, g_wv);
    d_o.reset(), dq.reset(), dk.reset(), dv.reset();
    {
      Tensor dxn = act({T_, H_});
      norm_backward(1, *x_, 0, dn1, dxn, gw);
      dn1.reset();
      accumulate_residual(dxn);
    }
    n1_.reset(), q_.reset(), k_.reset(), v_.reset(), o_.reset(), lse_.reset(), cq_.reset(), ckv_.reset(), stats_ = NormStats{};
    // The layer input's gradient (the next layer's dy), in the storage dtype.
    Tensor dx = act({T_, H_});
    for (int64_t i = 0; i < T_ * H_; ++i) store_f32(dx.data<S>() + i, res_acc_.data<float>()[i]);
    res_acc_.reset(), dy_.reset();
    return dx;
  }

  // Norm `which`'s backward from its saved statistics (row `row` of stats_); its weight's (and
  // bias') gradients added into gw.
  void norm_backward(int which, const Tensor& x, int64_t row, const Tensor& d_out, Tensor& d_x, const LayerWeightPtrs& gw) {
    float* rstd = stats_.rstd.template data<float>() + row * T_;
    if (!ln_) {
      RmsNormArgs n;
      n.dtype = c_.dtype;
      n.x = x.raw();
      n.weight = which == 1 ? norm1_ : norm2_;
      n.rstd = rstd;
      n.d_out = d_out.raw();
      n.d_x = d_x.raw();
      n.d_weight = which == 1 ? gw.norm1 : gw.norm2;
      n.tokens = T_;
      n.hidden = H_;
      Tensor ws = f32({rmsnorm_workspace_bytes(n) / 4}, Category::Workspace);
      n.workspace = ws.data<float>();
      rmsnorm_backward_cpu(n);
      return;
    }
    LayerNormArgs n;
    n.dtype = c_.dtype;
    n.x = x.raw();
    n.weight = which == 1 ? norm1_ : norm2_;
    n.bias = which == 1 ? norm1_bias_ : norm2_bias_;
    n.mean = stats_.mean.template data<float>() + row * T_;
    n.rstd = rstd;
    n.d_out = d_out.raw();
    n.d_x = d_x.raw();
    n.d_weight = which == 1 ? gw.norm1 : gw.norm2;
    n.d_bias = which == 1 ? gw.norm1_bias : gw.norm2_bias;
    n.tokens = T_;
    n.hidden = H_;
    Tensor ws = f32({layernorm_workspace_bytes(n) / 4}, Category::Workspace);
    n.workspace = ws.data<float>();
    layernorm_backward_cpu(n);
  }

  // residual accumulator += d; dy := the accumulator in the storage dtype (the stream's next input).
  void accumulate_residual(const Tensor& d) {
    float* acc = res_acc_.data<float>();
    for (int64_t i = 0; i < T_ * H_; ++i) {
      acc[i] += to_f32(d.data<S>()[i]);
      store_f32(dy_.data<S>() + i, acc[i]);
    }
  }

  // FlashAttention-2's backward (decoder_layer_parts.h) over the saved q, k, v, o, lse; its dK,
  // dV row registers are a [d + dv] scratch.
  void flash2_backward(const Tensor& d_o, Tensor& dq, Tensor& dk, Tensor& dv, Tensor& dq_acc, Tensor& delta) {
    Tensor regs = f32({D_ + Dv_}, Category::Workspace);
    const SavedAttention<S> saved{q_.data<S>(), k_.data<S>(), v_.data<S>(), o_.data<S>(), lse_.data<float>(), T_, A_, G_, dims()};
    flash2_attention_backward<S>(saved, d_o.data<S>(), dq_acc.data<float>(), delta.data<float>(), regs.data<float>(), dq.data<S>(),
                                 dk.data<S>(), dv.data<S>());
  }

  // d norm-1 output = dq·Wq + dk·Wk + dv·Wv; dW_q,k,v += d{q,k,v}ᵀ · norm-1 output.
  void qkv_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv, Tensor& dn1, S* g_wq, S* g_wk, S* g_wv) {
    const S* n1 = n1_.data<S>();
    S* out = dn1.data<S>();
    gemm_cpu(false, false, T_, H_, A_ * D_, 1.0f, dq.data<S>(), A_ * D_, wq_, H_, false, out, H_);
    gemm_cpu(false, false, T_, H_, G_ * D_, 1.0f, dk.data<S>(), G_ * D_, wk_, H_, true, out, H_);
    gemm_cpu(false, false, T_, H_, G_ * Dv_, 1.0f, dv.data<S>(), G_ * Dv_, wv_, H_, true, out, H_);
    gemm_cpu(true, false, A_ * D_, H_, T_, 1.0f, dq.data<S>(), A_ * D_, n1, H_, true, g_wq, H_);
    gemm_cpu(true, false, G_ * D_, H_, T_, 1.0f, dk.data<S>(), G_ * D_, n1, H_, true, g_wk, H_);
    gemm_cpu(true, false, G_ * Dv_, H_, T_, 1.0f, dv.data<S>(), G_ * Dv_, n1, H_, true, g_wv, H_);
  }

  TrackingAllocator& a_;
  const LayerScheduleConfig c_;
  const int64_t T_, H_, A_, G_, D_, Dv_;  // Dv_: the value width (v, o), D_ that of q and k
  const int64_t QL_, KL_, RD_;            // MLA: q latent, kv latent, k_rope widths (0 without MLA; QL_ 0: no q latent)
  const bool mla_;                        // multi-head latent attention (KL_ > 0)
  const int64_t E_, EL_, K_, F_, FS_, TK_;  // E_ routed over, EL_ computed here; FS_ shared or dense FFN width
  const bool dense_;  // a dense FFN layer: the SwiGLU MLP (shared_forward) in place of the MoE block
  const bool gated_;  // the shared experts' output scaled by a per-token sigmoid gate
  const bool ln_;     // LayerNorm norms (with biases) in place of RMSNorm
  const S *norm1_bias_, *norm2_bias_;  // LayerNorm's biases (null without)
  const S *norm1_, *wq_, *wk_, *wv_, *wo_, *norm2_, *wr_, *wgu_, *wd_, *wsgu_, *wsd_, *wsg_;  // the caller's weights
  const S* wb_;                       // the experts' biases [E/EP, 2F + H] (null without)
  const S *wq_a_, *q_norm_, *wq_b_, *wkv_a_, *kv_norm_, *wkv_b_;  // MLA's projections (null without)
  Communicator* comm_;                // the EP group (EP > 1), else null
  Communicator* cp_;                  // the CP ring (CP > 1), else null
  const layer_detail::KeyWindow mask_;  // the keys each query attends to (sliding or chunked window)
  const int64_t halo_;                  // at CP > 1: the previous rank's rows the window needs; −1: the ring
  std::unique_ptr<EpRows> ep_rows_;   // EP > 1: where the current routing's rows go
  int64_t R_ = 0;                     // rows this rank's experts compute (T·k at one rank)
  std::vector<int64_t> local_begin_;  // [E/EP + 1] each local expert's first expert-input row
  const Tensor* x_ = nullptr;  // the layer's input (boundary) of the current call
  Tensor dy_, res_acc_;
  Tensor n1_, q_, k_, v_, o_, lse_, h1_, n2_, sgu_, sact_;
  Tensor cq_, ckv_;  // MLA: the q latent [T, q_lora] and kv latent [T, kv_lora], saved for the latent norms' backward
  // The saved statistics of norm-1 (row 0) and norm-2 (row 1), then MLA's latent norms (q latent, kv latent).
  NormStats stats_;
  Tensor sout_, sgate_;  // gated shared experts: their ungated output [T, H] and the gate [T] (then d gate logit), saved
  Tensor logits_, scores_, scattered_, topw_, topid_;
  std::unique_ptr<ByteBuffer> map_;
  std::vector<int64_t> counts_, offsets_;  // [E] copies per expert of this rank's tokens, send-order offsets
  Tensor sort_idx_, pprobs_, send_, recv_, rprobs_, ein_, fc1_, actp_, fc2_, unp_, crecv_, moe_out_;
};

}  // namespace

DecoderLayer::DecoderLayer(TrackingAllocator& alloc, const LayerScheduleConfig& config, const LayerWeightPtrs& weights,
                           Communicator* ep_group, Communicator* cp_group) {
  check_layer_config(config);
  if (config.dtype == DType::F32) engine_ = std::make_unique<LayerCore<float>>(alloc, config, weights, ep_group, cp_group);
  else engine_ = std::make_unique<LayerCore<Bf16>>(alloc, config, weights, ep_group, cp_group);
}
const std::vector<int64_t>& DecoderLayer::expert_counts() const { return engine_->expert_counts(); }
DecoderLayer::~DecoderLayer() = default;
DecoderLayer::DecoderLayer(DecoderLayer&&) noexcept = default;
DecoderLayer& DecoderLayer::operator=(DecoderLayer&&) noexcept = default;

Tensor DecoderLayer::forward_no_grad(const Tensor& x, const std::string& prefix, const Hook& on_start) {
  return engine_->forward_no_grad(x, prefix, on_start);
}
Tensor DecoderLayer::forward_saving(const Tensor& x, const std::string& prefix, bool keep_output, const TensorSource& grad_stream,
                                    const Hook& on_start) {
  return engine_->forward_saving(x, prefix, keep_output, grad_stream, on_start);
}
Tensor DecoderLayer::backward(const Tensor& x, const std::string& prefix, const TensorSource& grad_stream, const GradSource& grads) {
  return engine_->backward(x, prefix, grad_stream, grads);
}

}  // namespace flatpeak::exec
