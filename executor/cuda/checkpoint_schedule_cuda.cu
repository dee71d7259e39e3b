// The checkpoint component on the GPU (checkpoint_schedule_cuda.h): run_checkpoint_schedule's
// order of allocations, releases and phases (so the tracked boundary bytes of every phase are the
// CPU schedule's), the CUDA op twins, and the boundaries' copies on their own streams.
//
// Stream rules (no device-wide synchronisation): every buffer is allocated and released on the
// compute stream; a copy stream touches a buffer only after waiting for an event recorded on the
// compute stream after that buffer was allocated and written, and the compute stream waits for
// the copy's event before it releases or reads the buffer.
#include "executor/cuda/checkpoint_schedule_cuda.h"

#include <cmath>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "executor/cuda/checkpoint_schedule_kernels.cuh"
#include "executor/cuda/cuda_check.h"
#include "executor/cuda/ops_cuda.h"
#include "executor/cuda/pinned_arena.h"
#include "executor/cuda/schedule_util_cuda.cuh"

namespace flatpeak::cuda {

namespace {

using exec::Bf16;
using exec::Category;
using exec::DType;
using exec::cuda_detail::kLossBlocks;
// The launches (checkpoint_schedule_kernels.cuh).
using exec::cuda_detail::launch_add2;
using exec::cuda_detail::launch_add3;
using exec::cuda_detail::launch_fill_norm;
using exec::cuda_detail::launch_loss_gradient;
using exec::cuda_detail::launch_squared_error;
using exec::cuda_detail::ScopedEvent;
using exec::cuda_detail::ScopedStream;

struct Dims {
  int64_t T = 0, H = 0, F = 0, heads = 0;
};

// ---- buffers ---------------------------------------------------------------------------------

// A bf16 or fp32 block of `elems` on the compute stream.
DeviceBuffer bf16(DeviceAllocator& alloc, int64_t elems, Category category, cudaStream_t stream) {
  return DeviceBuffer(alloc, elems * 2, category, stream);
}
DeviceBuffer f32(DeviceAllocator& alloc, int64_t elems, Category category, cudaStream_t stream) {
  return DeviceBuffer(alloc, elems * 4, category, stream);
}

struct LayerWeights {
  DeviceBuffer norm1, wq, wk, wv, wo, norm2, gate_up, down;
  std::vector<DeviceBuffer*> all() { return {&norm1, &wq, &wk, &wv, &wo, &norm2, &gate_up, &down}; }
};

// make_weights of the CPU schedule: the same shapes, order, seeds and scales.
LayerWeights make_weights(DeviceAllocator& alloc, const Dims& d, Category category, uint64_t seed, cudaStream_t stream) {
  LayerWeights w;
  const int64_t H = d.H, F = d.F;
  w.norm1 = bf16(alloc, H, category, stream);
  w.wq = bf16(alloc, H * H, category, stream);
  w.wk = bf16(alloc, H * H, category, stream);
  w.wv = bf16(alloc, H * H, category, stream);
  w.wo = bf16(alloc, H * H, category, stream);
  w.norm2 = bf16(alloc, H, category, stream);
  w.gate_up = bf16(alloc, 2 * F * H, category, stream);
  w.down = bf16(alloc, H * F, category, stream);
  // The last dim of each tensor, for the CPU's 1/sqrt(fan-in) scale: [H], [H, H] ×4, [H], [1, 2F, H], [1, H, F].
  const int64_t fan_in[] = {H, H, H, H, H, H, H, F};
  uint64_t index = 0;
  for (DeviceBuffer* t : w.all()) {
    const int64_t n = t->bytes() / 2;
    if (category == Category::Grads) {
      FLATPEAK_CUDA_CHECK(cudaMemsetAsync(t->raw(), 0, static_cast<size_t>(t->bytes()), stream));  // bf16 zero is all-zero bits
    } else if (n == d.H) {
      launch_fill_norm(t->as<Bf16>(), n, seed, index * 1000003, stream);
    } else {
      exec::cuda_detail::fill_bf16_cuda(t->as<Bf16>(), n, seed * 31 + index, 1.0f / std::sqrt(static_cast<float>(fan_in[index])), stream);
    }
    ++index;
  }
  return w;
}

struct AttnSaved {
  DeviceBuffer n1, rstd1, q, k, v, o, lse;
};
struct FfnSaved {
  DeviceBuffer n2, rstd2, gate_up;
};

exec::AttentionArgs attention_args(const Dims& d, const AttnSaved& s) {
  exec::AttentionArgs a;
  a.dtype = DType::BF16;
  a.q = s.q.raw();
  a.k = s.k.raw();
  a.v = s.v.raw();
  a.out = s.o.raw();
  a.lse = s.lse.as<float>();
  a.tokens = d.T;
  a.q_heads = d.heads;
  a.kv_heads = d.heads;
  a.head_dim = d.H / d.heads;
  return a;
}

exec::RmsNormArgs norm_args(const DeviceBuffer& x, const DeviceBuffer& weight, const DeviceBuffer& rstd, int64_t T, int64_t H) {
  exec::RmsNormArgs a;
  a.dtype = DType::BF16;
  a.x = x.raw();
  a.weight = weight.raw();
  a.rstd = rstd.as<float>();
  a.tokens = T;
  a.hidden = H;
  return a;
}

class Stack {
 public:
  Stack(DeviceAllocator& alloc, const CublasContext& blas, const Dims& d)
      : alloc_(alloc), blas_(blas), d_(d), s_(blas.stream()), rows_(d.T) {}

  DeviceBuffer act(int64_t elems) { return bf16(alloc_, elems, Category::Activations, s_); }

  void linear_fwd(const DeviceBuffer& x, const DeviceBuffer& w, DeviceBuffer& y) {
    exec::LinearArgs a{DType::BF16, x.raw(), w.raw(), y.raw(), nullptr, nullptr, nullptr, d_.T, d_.H, d_.H};
    exec::linear_forward_cuda(a, blas_);
  }
  void linear_bwd(const DeviceBuffer& x, const DeviceBuffer& w, const DeviceBuffer& dy, DeviceBuffer& dx, DeviceBuffer& dw) {
    exec::LinearArgs a{DType::BF16, x.raw(), w.raw(), nullptr, dy.raw(), dx.raw(), dw.raw(), d_.T, d_.H, d_.H};
    exec::linear_backward_cuda(a, blas_);
  }
  void add2(const DeviceBuffer& a, const DeviceBuffer& b, DeviceBuffer& c) {
    const int64_t n = d_.T * d_.H;
    launch_add2(a.as<Bf16>(), b.as<Bf16>(), c.as<Bf16>(), n, s_);
  }

  exec::ExpertFfnArgs ffn_args(const FfnSaved& s, const LayerWeights& w) const {
    exec::ExpertFfnArgs a;
    a.dtype = DType::BF16;
    a.x = s.n2.raw();
    a.expert_counts = &rows_;  // a host pointer (ops_cuda.h)
    a.w_gate_up = w.gate_up.raw();
    a.w_down = w.down.raw();
    a.gate_up = s.gate_up.raw();
    a.rows = d_.T;
    a.experts = 1;
    a.hidden = d_.H;
    a.ffn = d_.F;
    return a;
  }

  // h = x + o_proj(attention(q, k, v of norm1(x))); fills the saved set.
  DeviceBuffer attention_forward(const LayerWeights& w, const DeviceBuffer& x, AttnSaved& s) {
    const int64_t T = d_.T, H = d_.H;
    s.n1 = act(T * H);
    s.rstd1 = f32(alloc_, T, Category::Activations, s_);
    exec::RmsNormArgs n = norm_args(x, w.norm1, s.rstd1, T, H);
    n.out = s.n1.raw();
    exec::rmsnorm_forward_cuda(n, s_);
    s.q = act(T * H);
    s.k = act(T * H);
    s.v = act(T * H);
    linear_fwd(s.n1, w.wq, s.q);
    linear_fwd(s.n1, w.wk, s.k);
    linear_fwd(s.n1, w.wv, s.v);
    s.o = act(T * H);
    s.lse = f32(alloc_, d_.heads * T, Category::Activations, s_);
    exec::attention_forward_cuda(attention_args(d_, s), s_);  // no workspace on the GPU
    DeviceBuffer projected = act(T * H);
    linear_fwd(s.o, w.wo, projected);
    DeviceBuffer h = act(T * H);
    add2(x, projected, h);
    return h;
  }

  // f = SwiGLU(norm2(h)); fills the saved set.
  DeviceBuffer ffn_forward(const LayerWeights& w, const DeviceBuffer& h, FfnSaved& s) {
    const int64_t T = d_.T, H = d_.H;
    s.n2 = act(T * H);
    s.rstd2 = f32(alloc_, T, Category::Activations, s_);
    exec::RmsNormArgs n = norm_args(h, w.norm2, s.rstd2, T, H);
    n.out = s.n2.raw();
    exec::rmsnorm_forward_cuda(n, s_);
    s.gate_up = act(T * 2 * d_.F);
    DeviceBuffer f = act(T * H);
    exec::ExpertFfnArgs a = ffn_args(s, w);
    a.out = f.raw();
    DeviceBuffer ws(alloc_, exec::expert_ffn_workspace_bytes_cuda(a), Category::Activations, s_);
    a.workspace = ws.as<float>();
    exec::expert_ffn_forward_cuda(a, blas_);
    return f;
  }

  // d h = dy + d norm2(h) through the SwiGLU; weight gradients accumulate into g.
  DeviceBuffer ffn_backward(const LayerWeights& w, LayerWeights& g, const DeviceBuffer& h, FfnSaved& s, const DeviceBuffer& dy) {
    const int64_t T = d_.T, H = d_.H;
    DeviceBuffer d_n2 = act(T * H);
    {
      exec::ExpertFfnArgs a = ffn_args(s, w);
      a.d_out = dy.raw();
      a.d_x = d_n2.raw();
      a.d_w_gate_up = g.gate_up.raw();
      a.d_w_down = g.down.raw();
      DeviceBuffer ws(alloc_, exec::expert_ffn_workspace_bytes_cuda(a), Category::Activations, s_);
      a.workspace = ws.as<float>();
      exec::expert_ffn_backward_cuda(a, blas_);
    }
    DeviceBuffer d_hn = act(T * H);
    exec::RmsNormArgs n = norm_args(h, w.norm2, s.rstd2, T, H);
    n.d_out = d_n2.raw();
    n.d_x = d_hn.raw();
    n.d_weight = g.norm2.raw();
    exec::rmsnorm_backward_cuda(n, s_);  // workspace unused on the GPU
    DeviceBuffer d_h = act(T * H);
    add2(dy, d_hn, d_h);
    return d_h;
  }

  // d x = d h + d norm1(x) through attention; weight gradients accumulate into g.
  DeviceBuffer attention_backward(const LayerWeights& w, LayerWeights& g, const DeviceBuffer& x, AttnSaved& s,
                                  const DeviceBuffer& d_h) {
    const int64_t T = d_.T, H = d_.H;
    DeviceBuffer d_o = act(T * H);
    linear_bwd(s.o, w.wo, d_h, d_o, g.wo);
    DeviceBuffer d_q = act(T * H), d_k = act(T * H), d_v = act(T * H);
    {
      exec::AttentionArgs a = attention_args(d_, s);
      a.d_out = d_o.raw();
      a.d_q = d_q.raw();
      a.d_k = d_k.raw();
      a.d_v = d_v.raw();
      DeviceBuffer ws(alloc_, exec::attention_backward_workspace_bytes_cuda(a), Category::Activations, s_);
      a.workspace = ws.as<float>();
      exec::attention_backward_cuda(a, s_);
    }
    d_o.reset();
    DeviceBuffer from_q = act(T * H), from_k = act(T * H), from_v = act(T * H);
    linear_bwd(s.n1, w.wq, d_q, from_q, g.wq);
    linear_bwd(s.n1, w.wk, d_k, from_k, g.wk);
    linear_bwd(s.n1, w.wv, d_v, from_v, g.wv);
    d_q.reset(), d_k.reset(), d_v.reset();
    DeviceBuffer d_n1 = act(T * H);
    launch_add3(from_q.as<Bf16>(), from_k.as<Bf16>(), from_v.as<Bf16>(), d_n1.as<Bf16>(), T * H, s_);
    from_q.reset(), from_k.reset(), from_v.reset();
    DeviceBuffer d_xn = act(T * H);
    exec::RmsNormArgs n = norm_args(x, w.norm1, s.rstd1, T, H);
    n.d_out = d_n1.raw();
    n.d_x = d_xn.raw();
    n.d_weight = g.norm1.raw();
    exec::rmsnorm_backward_cuda(n, s_);
    DeviceBuffer d_x = act(T * H);
    add2(d_h, d_xn, d_x);
    return d_x;
  }

 private:
  DeviceAllocator& alloc_;
  const CublasContext& blas_;
  Dims d_;
  cudaStream_t s_;
  int64_t rows_;  // expert_counts of the one dense "expert": every row (a host value, as the op reads it)
};

// The boundaries: device copies x_0 .. x_L (x_L is the final hidden) and the pinned host arena,
// with the copies' streams and events.
class Boundaries {
 public:
  Boundaries(DeviceAllocator& alloc, const exec::CheckpointScheduleConfig& c, const Dims& d, cudaStream_t compute,
             const CheckpointCudaOptions& options)
      : alloc_(alloc), d_(d), compute_(compute), copy_streams_(options.copy_streams) {
    const auto L = static_cast<size_t>(c.layers);
    offloaded_ = c.offloaded.empty() ? std::vector<bool>(L, false) : c.offloaded;
    int64_t slots = 0;
    for (bool off : offloaded_) slot_.push_back(off ? slots++ : -1);
    if (slots > 0) {
      constexpr int64_t kArenaAlignment = 256;  // the carve rounds up to it: the arena holds the rounded size
      const int64_t arena_bytes = (slots * bytes() + kArenaAlignment - 1) / kArenaAlignment * kArenaAlignment;
      arena_ = std::make_unique<PinnedArena>(PinnedArenaOptions{arena_bytes, options.allow_pageable_fallback, kArenaAlignment});
      host_ = static_cast<unsigned char*>(arena_->carve_bytes(slots * bytes(), Category::Boundaries));
      host_bytes_ = alloc.tracked_bytes_for(slots * bytes());
      if (copy_streams_) {
        d2h_ = std::make_unique<ScopedStream>();
        h2d_ = std::make_unique<ScopedStream>();
      }
    }
    device_.resize(L + 1);
    d2h_done_.resize(L);
    h2d_done_.resize(L);
    for (size_t l = 0; l < L; ++l)
      if (offloaded_[l]) d2h_done_[l] = std::make_unique<ScopedEvent>(), h2d_done_[l] = std::make_unique<ScopedEvent>();
    fetch_pending_.assign(L, false);
  }
  Boundaries(const Boundaries&) = delete;
  Boundaries& operator=(const Boundaries&) = delete;
  // The step ends with the compute stream synchronised after it waited for every copy; when an
  // exception (OutOfMemory in a prefetch, say) unwinds the step instead, a copy may still be in
  // flight into a device buffer or out of the arena that the members free (a stream-ordered free
  // on the compute stream does not wait for a copy stream; cudaFreeHost is not stream-ordered):
  // let the copies land first.
  ~Boundaries() {
    if (d2h_) (void)cudaStreamSynchronize(d2h_->get());
    if (h2d_) (void)cudaStreamSynchronize(h2d_->get());
    if (arena_) (void)cudaStreamSynchronize(compute_);
  }

  int64_t bytes() const { return d_.T * d_.H * 2; }
  int64_t host_bytes() const { return host_bytes_; }
  bool pinned() const { return arena_ == nullptr || arena_->pinned(); }
  std::string fallback_reason() const { return arena_ == nullptr ? "" : arena_->fallback_reason(); }
  bool offloaded(int64_t l) const { return offloaded_[static_cast<size_t>(l)]; }
  DeviceBuffer& device(int64_t l) { return device_[static_cast<size_t>(l)]; }
  DeviceBuffer make() { return bf16(alloc_, d_.T * d_.H, Category::Boundaries, compute_); }

  // D2H of x_l into its host slot, from what the compute stream has queued so far.
  void copy_to_host(int64_t l) {
    cudaStream_t stream = copy_stream(d2h_.get());
    ordered_after_compute(stream);
    FLATPEAK_CUDA_CHECK(cudaMemcpyAsync(host_slot(l), device(l).raw(), static_cast<size_t>(bytes()), cudaMemcpyDeviceToHost, stream));
    d2h_done_[static_cast<size_t>(l)]->record(stream);
  }
  // The device copy of x_l goes once its D2H copy is done (the compute stream waits for it).
  void release_after_copy(int64_t l) {
    FLATPEAK_CUDA_CHECK(cudaStreamWaitEvent(compute_, d2h_done_[static_cast<size_t>(l)]->get(), 0));
    device(l).reset();
  }
  // H2D of x_l into a fresh device buffer, unless it is there already (prefetched).
  void fetch(int64_t l) {
    if (!offloaded(l) || device(l).raw() != nullptr) return;
    device(l) = make();
    cudaStream_t stream = copy_stream(h2d_.get());
    ordered_after_compute(stream);  // the buffer's allocation
    FLATPEAK_CUDA_CHECK(cudaMemcpyAsync(device(l).raw(), host_slot(l), static_cast<size_t>(bytes()), cudaMemcpyHostToDevice, stream));
    h2d_done_[static_cast<size_t>(l)]->record(stream);
    fetch_pending_[static_cast<size_t>(l)] = true;
  }
  // Before the compute stream reads x_l: its fetch has landed.
  void wait_fetched(int64_t l) {
    if (!fetch_pending_[static_cast<size_t>(l)]) return;
    FLATPEAK_CUDA_CHECK(cudaStreamWaitEvent(compute_, h2d_done_[static_cast<size_t>(l)]->get(), 0));
    fetch_pending_[static_cast<size_t>(l)] = false;
  }

 private:
  cudaStream_t copy_stream(ScopedStream* side) const { return copy_streams_ ? side->get() : compute_; }
  void ordered_after_compute(cudaStream_t stream) {
    if (stream == compute_) return;
    FLATPEAK_CUDA_CHECK(cudaEventRecord(compute_mark_.get(), compute_));
    FLATPEAK_CUDA_CHECK(cudaStreamWaitEvent(stream, compute_mark_.get(), 0));
  }
  unsigned char* host_slot(int64_t l) { return host_ + slot_[static_cast<size_t>(l)] * bytes(); }

  DeviceAllocator& alloc_;
  Dims d_;
  cudaStream_t compute_;
  bool copy_streams_;
  std::vector<bool> offloaded_;
  std::vector<int64_t> slot_;  // host slot of each offloaded layer, -1 for a kept one
  // Declared before the device buffers and events that are used on them: destroyed after them.
  std::unique_ptr<ScopedStream> d2h_, h2d_;
  std::unique_ptr<PinnedArena> arena_;
  unsigned char* host_ = nullptr;
  int64_t host_bytes_ = 0;
  ScopedEvent compute_mark_;
  std::vector<std::unique_ptr<ScopedEvent>> d2h_done_, h2d_done_;
  std::vector<bool> fetch_pending_;
  std::vector<DeviceBuffer> device_;
};

std::string layer_phase(const char* pass, int64_t l, const char* part) {
  return std::string(pass) + "/L" + std::to_string(l) + "/" + part;
}

void append_bits(const DeviceBuffer& t, std::vector<uint16_t>& out) {
  const size_t n = static_cast<size_t>(t.bytes() / 2);
  const size_t first = out.size();
  out.resize(first + n);
  if (n > 0) FLATPEAK_CUDA_CHECK(cudaMemcpy(out.data() + first, t.raw(), n * 2, cudaMemcpyDeviceToHost));
}

}  // namespace

CheckpointScheduleCudaResult run_checkpoint_schedule_cuda(DeviceAllocator& alloc, const CublasContext& blas,
                                                          const exec::CheckpointScheduleConfig& c, const CheckpointCudaOptions& options) {
  const exec::CheckpointDims resolved = exec::checkpoint_dims(c);  // the CPU schedule's checks
  Dims d;
  d.T = resolved.tokens;
  d.H = resolved.hidden;
  d.F = resolved.ffn;
  d.heads = resolved.heads;
  const int64_t T = d.T, H = d.H, L = c.layers;
  cudaStream_t s = blas.stream();
  Stack stack(alloc, blas, d);

  // Weights, their gradients, the final norm, the loss target and the stack's input, in the CPU
  // schedule's order and with its values.
  std::vector<LayerWeights> weights, grads;
  for (int64_t l = 0; l < L; ++l) {
    weights.push_back(make_weights(alloc, d, Category::Params, c.seed * 1009 + static_cast<uint64_t>(l), s));
    grads.push_back(make_weights(alloc, d, Category::Grads, 0, s));
  }
  DeviceBuffer final_norm = bf16(alloc, H, Category::Params, s);
  DeviceBuffer d_final_norm = bf16(alloc, H, Category::Grads, s);
  launch_fill_norm(final_norm.as<Bf16>(), H, c.seed * 7 + 5, 0, s);
  FLATPEAK_CUDA_CHECK(cudaMemsetAsync(d_final_norm.raw(), 0, static_cast<size_t>(H * 2), s));
  DeviceBuffer target = bf16(alloc, T * H, Category::Workspace, s);
  exec::cuda_detail::fill_bf16_cuda(target.as<Bf16>(), T * H, c.seed * 7 + 3, 1.0f, s);
  Boundaries b(alloc, c, d, s, options);
  b.device(0) = b.make();
  exec::cuda_detail::fill_bf16_cuda(b.device(0).as<Bf16>(), T * H, c.seed * 7 + 1, 1.0f, s);
  DeviceBuffer loss_partials(alloc, kLossBlocks * 8, Category::Workspace, s);  // [kLossBlocks] fp64 partial Σ of the squared error

  std::vector<AttnSaved> kept_attn(static_cast<size_t>(c.checkpoint ? 0 : L));
  std::vector<FfnSaved> kept_ffn(static_cast<size_t>(c.checkpoint ? 0 : L));
  std::vector<DeviceBuffer> kept_h(static_cast<size_t>(c.checkpoint ? 0 : L));

  ScopedEvent start, forward_done, stop;
  start.record(s);
  for (int64_t l = 0; l < L; ++l) {
    const LayerWeights& w = weights[static_cast<size_t>(l)];
    alloc.set_phase(layer_phase("fwd", l, "attn"));
    if (b.offloaded(l)) b.copy_to_host(l);  // SCO: the D2H copy starts with its layer
    AttnSaved attn;
    DeviceBuffer h = stack.attention_forward(w, b.device(l), attn);
    if (c.checkpoint) attn = AttnSaved{};
    alloc.set_phase(layer_phase("fwd", l, "ffn"));
    FfnSaved ffn;
    DeviceBuffer f = stack.ffn_forward(w, h, ffn);
    if (c.checkpoint) ffn = FfnSaved{};
    DeviceBuffer next = b.make();
    stack.add2(h, f, next);
    f.reset();
    if (c.checkpoint) {
      h.reset();
    } else {
      kept_attn[static_cast<size_t>(l)] = std::move(attn);
      kept_ffn[static_cast<size_t>(l)] = std::move(ffn);
      kept_h[static_cast<size_t>(l)] = std::move(h);
    }
    // As on the CPU: the layer's input is held through its forward, then released once copied.
    if (b.offloaded(l)) b.release_after_copy(l);
    b.device(l + 1) = std::move(next);
  }

  // Loss: 0.5 / T · Σ (final_norm(h_L) − target)².
  CheckpointScheduleCudaResult result;
  alloc.set_phase("loss/fwd");
  DeviceBuffer rstd = f32(alloc, T, Category::Vocab, s);
  DeviceBuffer x_final = bf16(alloc, T * H, Category::Vocab, s);
  exec::RmsNormArgs fn = norm_args(b.device(L), final_norm, rstd, T, H);
  fn.out = x_final.raw();
  exec::rmsnorm_forward_cuda(fn, s);
  launch_squared_error(x_final.as<Bf16>(), target.as<Bf16>(), loss_partials.as<double>(), T * H, s);
  forward_done.record(s);
  alloc.set_phase("loss/bwd");
  DeviceBuffer dy;
  {
    DeviceBuffer d_final = bf16(alloc, T * H, Category::Vocab, s);
    launch_loss_gradient(x_final.as<Bf16>(), target.as<Bf16>(), d_final.as<Bf16>(), T * H,
                         static_cast<float>(T), s);
    dy = stack.act(T * H);
    fn.d_out = d_final.raw();
    fn.d_x = dy.raw();
    fn.d_weight = d_final_norm.raw();
    exec::rmsnorm_backward_cuda(fn, s);
  }
  x_final.reset(), rstd.reset();
  b.device(L).reset();

  for (int64_t l = L - 1; l >= 0; --l) {
    const LayerWeights& w = weights[static_cast<size_t>(l)];
    LayerWeights& g = grads[static_cast<size_t>(l)];
    AttnSaved attn;
    FfnSaved ffn;
    DeviceBuffer h;
    if (c.checkpoint) {
      alloc.set_phase(layer_phase("bwd", l, "recompute/attn"));
      b.fetch(l);
      for (int64_t i = l - 1; i >= 0 && i >= l - c.prefetch; --i) b.fetch(i);
      b.wait_fetched(l);
      h = stack.attention_forward(w, b.device(l), attn);
      alloc.set_phase(layer_phase("bwd", l, "recompute/ffn"));
      stack.ffn_forward(w, h, ffn).reset();
    } else {
      attn = std::move(kept_attn[static_cast<size_t>(l)]);
      ffn = std::move(kept_ffn[static_cast<size_t>(l)]);
      h = std::move(kept_h[static_cast<size_t>(l)]);
    }
    alloc.set_phase(layer_phase("bwd", l, "ffn"));
    DeviceBuffer d_h = stack.ffn_backward(w, g, h, ffn, dy);
    ffn = FfnSaved{};
    h.reset();
    dy.reset();
    alloc.set_phase(layer_phase("bwd", l, "attn"));
    dy = stack.attention_backward(w, g, b.device(l), attn, d_h);
    d_h.reset();
    attn = AttnSaved{};
    b.device(l).reset();
  }
  stop.record(s);
  FLATPEAK_CUDA_CHECK(cudaStreamSynchronize(s));

  std::vector<double> partials(kLossBlocks);
  FLATPEAK_CUDA_CHECK(cudaMemcpy(partials.data(), loss_partials.raw(), partials.size() * sizeof(double), cudaMemcpyDeviceToHost));
  double sum = 0.0;
  for (double p : partials) sum += p;  // block order: the same bits every run
  result.values.loss = 0.5 * sum / static_cast<double>(T);
  result.values.d_input.reserve(static_cast<size_t>(T * H));
  append_bits(dy, result.values.d_input);
  result.values.d_weights.reserve(static_cast<size_t>(exec::checkpoint_weight_gradient_elements(c)));
  for (auto& g : grads)
    for (DeviceBuffer* t : g.all()) append_bits(*t, result.values.d_weights);
  append_bits(d_final_norm, result.values.d_weights);
  result.host_boundary_bytes = b.host_bytes();
  result.host_pinned = b.pinned();
  result.fallback_reason = b.fallback_reason();
  result.seconds = exec::cuda_detail::event_seconds(start.get(), stop.get());
  result.forward_s = exec::cuda_detail::event_seconds(start.get(), forward_done.get());
  result.backward_s = exec::cuda_detail::event_seconds(forward_done.get(), stop.get());
  return result;
}

}  // namespace flatpeak::cuda
