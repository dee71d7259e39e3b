// Ring-DTP on the GPU (ring_dtp_schedule_cuda.h): ring_dtp_schedule.cpp's passes, buffer for
// buffer, with cuBLAS logits blocks and the blocked cross-entropy's per-block kernels
// (cross_entropy_blocks_cuda.h). Everything runs on blas.stream(); a ring hop is the
// communicator's, which orders its device copies after the work queued before it.
#include "executor/cuda/ring_dtp_schedule_cuda.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <utility>

#include "executor/cuda/cross_entropy_blocks_cuda.h"
#include "executor/cuda/cuda_check.h"
#include "executor/cuda/device_communicator.h"
#include "executor/cuda/schedule_util_cuda.cuh"
#include "executor/schedules/ring_dtp_internal.h"

namespace flatpeak::cuda {

namespace {

using exec::Bf16;
using exec::Category;
using exec::DType;
using exec::Ring;
using exec::RingDims;
using exec::cuda_detail::ScopedEvent;
using exec::cuda_detail::event_seconds;

constexpr Category kVocab = Category::Vocab;

using PhaseCounter = exec::BlockPhaseCounter<DeviceAllocator>;

// What every pass needs: the shape, the cuBLAS context (its stream runs everything) and the ring.
struct Pass {
  const RingDims& d;
  const CublasContext& blas;
  Ring& ring;
  cudaStream_t stream() const { return blas.stream(); }
};

void zero(const DeviceBuffer& b, cudaStream_t s) {
  FLATPEAK_CUDA_CHECK(cudaMemsetAsync(b.raw(), 0, static_cast<size_t>(b.bytes()), s));
}

void copy_d2d(void* dst, const void* src, int64_t bytes, cudaStream_t s) {
  if (bytes > 0) FLATPEAK_CUDA_CHECK(cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes), cudaMemcpyDeviceToDevice, s));
}

// The shard a token block meets: rows [first_row, first_row + rows) of W at `w`.
struct ShardView {
  const Bf16* w;
  int64_t first_row, rows;
};

// fold_shard of the CPU schedule: each [tb, V_blk] fp32 logits block of the shard folded into the
// tokens' online state (max, sum, target logit).
void fold_shard(const Pass& p, const Bf16* x, const int32_t* targets, int64_t tb, const ShardView& shard, float* row_max,
                float* row_sum, float* target_logit, float* logits, PhaseCounter& phase) {
  const RingDims& d = p.d;
  for (int64_t v0 = 0; v0 < shard.rows; v0 += d.Vb) {
    const int64_t vb = std::min(d.Vb, shard.rows - v0);
    phase.advance();
    gemm_cuda(p.blas, false, true, tb, vb, d.H, 1.0f, DType::BF16, x, d.H, DType::BF16, shard.w + v0 * d.H, d.H, false,
              DType::F32, logits, vb);
    exec::cuda_detail::fold_logits_block_cuda(logits, tb, vb, shard.first_row + v0, targets, row_max, row_sum, target_logit,
                                              p.stream());
  }
}

// grad_shard of the CPU schedule: dz rounded to bf16 once, dX += dz·W_blk, dW_blk += dzᵀ·X (fp32).
void grad_shard(const Pass& p, const Bf16* x, const int32_t* targets, const float* lse, int64_t tb, const ShardView& shard,
                float* d_x, float* d_w, float* logits, Bf16* dlogits, PhaseCounter& phase) {
  const RingDims& d = p.d;
  for (int64_t v0 = 0; v0 < shard.rows; v0 += d.Vb) {
    const int64_t vb = std::min(d.Vb, shard.rows - v0);
    phase.advance();
    const Bf16* w_blk = shard.w + v0 * d.H;
    gemm_cuda(p.blas, false, true, tb, vb, d.H, 1.0f, DType::BF16, x, d.H, DType::BF16, w_blk, d.H, false, DType::F32,
              logits, vb);
    exec::cuda_detail::dlogits_block_bf16_cuda(logits, dlogits, tb, vb, shard.first_row + v0, targets, lse, d.grad_scale,
                                               p.stream());
    gemm_cuda(p.blas, false, false, tb, d.H, vb, 1.0f, DType::BF16, dlogits, vb, DType::BF16, w_blk, d.H, true, DType::F32,
              d_x, d.H);
    gemm_cuda(p.blas, true, false, vb, d.H, tb, 1.0f, DType::BF16, dlogits, vb, DType::BF16, x, d.H, true, DType::F32,
              d_w + v0 * d.H, d.H);
  }
}

// The rank's inputs: the CPU schedule's RankData values (its global X, W and targets at the
// rank's offsets), filled on the device.
struct RankData {
  DeviceBuffer x, w, targets;
  RankData(DeviceAllocator& alloc, const RingDims& d, const Ring& ring, uint64_t seed, cudaStream_t s)
      : x(alloc, d.T * d.H * 2, kVocab, s),                     // [T, H] bf16
        w(alloc, d.shard * d.H * 2, kVocab, s),                 // [ceil(V/R), H] bf16
        targets(alloc, d.T * 4, Category::Workspace, s) {       // [T] i32 labels
    using exec::cuda_detail::fill_bf16_cuda;
    fill_bf16_cuda(x.as<Bf16>(), d.T * d.H, seed * 3 + 1, 1.0f, s, static_cast<uint64_t>(ring.position * d.T * d.H));
    zero(w, s);  // the padding rows of a short last shard stay zero and are never read
    fill_bf16_cuda(w.as<Bf16>(), d.rows_of(ring.position) * d.H, seed * 3 + 2, 0.5f, s,
                   static_cast<uint64_t>(ring.position * d.shard * d.H));
    exec::cuda_detail::fill_targets_cuda(targets.as<int32_t>(), d.T, d.V, seed * 3 + 3, s,
                                         static_cast<uint64_t>(ring.position * d.T));
  }
};

// What the forward leaves for the gradients: lse and the per-token loss [T] fp32.
struct LossState {
  DeviceBuffer lse, loss;
};

// ---- Rotating activations -------------------------------------------------------------------

void forward_activations(DeviceAllocator& alloc, const Pass& p, RankData& in, LossState& out, PhaseCounter& phase) {
  const RingDims& d = p.d;
  const cudaStream_t s = p.stream();
  DeviceBuffer x_flight(alloc, 2 * d.Tb * d.H * 2, kVocab, s);             // [2, T_blk, H] bf16
  DeviceBuffer state_flight(alloc, 2 * 3 * d.Tb * 4, kVocab, s);           // [2, 3, T_blk] fp32
  DeviceBuffer targets_flight(alloc, 2 * d.Tb * 4, Category::Workspace, s);  // [2, T_blk] i32
  DeviceBuffer logits(alloc, d.Tb * d.Vb * 4, kVocab, s);                  // [T_blk, V_blk] fp32
  const ShardView own{in.w.as<Bf16>(), p.ring.position * d.shard, d.rows_of(p.ring.position)};
  for (int64_t b = 0; b < d.token_blocks; ++b) {
    const int64_t t0 = b * d.Tb, tb = std::min(d.Tb, d.T - t0);
    const Bf16* x = in.x.as<Bf16>() + t0 * d.H;
    const int32_t* targets = in.targets.as<int32_t>() + t0;
    int64_t slot = 0;  // the state's current slot; X and targets start at home
    float* state = state_flight.as<float>();
    exec::cuda_detail::init_online_rows_cuda(state, state + d.Tb, state + 2 * d.Tb, d.Tb, s);
    for (int64_t step = 0; step < d.R; ++step) {
      float* st = state + slot * 3 * d.Tb;
      fold_shard(p, x, targets, tb, own, st, st + d.Tb, st + 2 * d.Tb, logits.as<float>(), phase);
      float* st_next = state + (1 - slot) * 3 * d.Tb;
      p.ring.shift(st, st_next, 3 * d.Tb, DType::F32);
      if (step + 1 < d.R) {
        Bf16* x_next = x_flight.as<Bf16>() + (1 - slot) * d.Tb * d.H;
        int32_t* t_next = targets_flight.as<int32_t>() + (1 - slot) * d.Tb;
        p.ring.shift(x, x_next, tb * d.H, DType::BF16);
        p.ring.shift(targets, t_next, tb, DType::I32);
        x = x_next;
        targets = t_next;
      }
      slot = 1 - slot;
    }
    // Home again: the block's state is complete.
    const float* st = state + slot * 3 * d.Tb;
    exec::cuda_detail::finish_online_rows_cuda(st, st + d.Tb, st + 2 * d.Tb, in.targets.as<int32_t>() + t0,
                                               out.lse.as<float>() + t0, out.loss.as<float>() + t0, tb, s);
  }
}

void gradients_activations(DeviceAllocator& alloc, const Pass& p, RankData& in, const LossState& ls, DeviceBuffer& d_x,
                           DeviceBuffer& d_w, PhaseCounter& phase) {
  const RingDims& d = p.d;
  const cudaStream_t s = p.stream();
  DeviceBuffer x_flight(alloc, 2 * d.Tb * d.H * 2, kVocab, s);             // [2, T_blk, H] bf16
  DeviceBuffer lse_flight(alloc, 2 * d.Tb * 4, kVocab, s);                 // [2, T_blk] fp32
  DeviceBuffer dx_flight(alloc, 2 * d.Tb * d.H * 4, kVocab, s);            // [2, T_blk, H] fp32
  DeviceBuffer targets_flight(alloc, 2 * d.Tb * 4, Category::Workspace, s);  // [2, T_blk] i32
  DeviceBuffer logits(alloc, d.Tb * d.Vb * 4, kVocab, s);                  // [T_blk, V_blk] fp32
  DeviceBuffer dlogits(alloc, d.Tb * d.Vb * 2, kVocab, s);                 // [T_blk, V_blk] bf16
  const ShardView own{in.w.as<Bf16>(), p.ring.position * d.shard, d.rows_of(p.ring.position)};
  for (int64_t b = 0; b < d.token_blocks; ++b) {
    const int64_t t0 = b * d.Tb, tb = std::min(d.Tb, d.T - t0);
    const Bf16* x = in.x.as<Bf16>() + t0 * d.H;
    const int32_t* targets = in.targets.as<int32_t>() + t0;
    const float* lse = ls.lse.as<float>() + t0;
    int64_t slot = 0;
    float* dx = dx_flight.as<float>();
    FLATPEAK_CUDA_CHECK(cudaMemsetAsync(dx, 0, static_cast<size_t>(d.Tb * d.H) * 4, s));
    for (int64_t step = 0; step < d.R; ++step) {
      grad_shard(p, x, targets, lse, tb, own, dx, d_w.as<float>(), logits.as<float>(), dlogits.as<Bf16>(), phase);
      if (step + 1 < d.R) {
        float* dx_next = dx_flight.as<float>() + (1 - slot) * d.Tb * d.H;
        Bf16* x_next = x_flight.as<Bf16>() + (1 - slot) * d.Tb * d.H;
        float* lse_next = lse_flight.as<float>() + (1 - slot) * d.Tb;
        int32_t* t_next = targets_flight.as<int32_t>() + (1 - slot) * d.Tb;
        p.ring.shift(dx, dx_next, tb * d.H, DType::F32);
        p.ring.shift(x, x_next, tb * d.H, DType::BF16);
        p.ring.shift(lse, lse_next, tb, DType::F32);
        p.ring.shift(targets, t_next, tb, DType::I32);
        dx = dx_next;
        x = x_next;
        lse = lse_next;
        targets = t_next;
        slot = 1 - slot;
      } else if (d.R > 1) {
        // A short last block sends only its tb rows (every rank's block b has the same tb).
        float* landing = dx_flight.as<float>() + (1 - slot) * d.Tb * d.H;
        p.ring.shift(dx, landing, tb * d.H, DType::F32);
        copy_d2d(d_x.as<float>() + t0 * d.H, landing, tb * d.H * 4, s);
      } else {
        copy_d2d(d_x.as<float>() + t0 * d.H, dx, tb * d.H * 4, s);
      }
    }
  }
}

// ---- Rotating weights -----------------------------------------------------------------------

// The W shard in use and the one arriving; after R hops the rank's own shard is home again.
struct WeightRing {
  DeviceBuffer in_flight;  // [ceil(V/R), H] bf16
  DeviceBuffer* current;   // in.w or in_flight
  DeviceBuffer* other;
  int64_t owner;           // ring position whose shard `current` holds
};

void hop(const Pass& p, WeightRing& wr) {
  p.ring.shift(wr.current->raw(), wr.other->raw(), p.d.shard * p.d.H, DType::BF16);
  std::swap(wr.current, wr.other);
  wr.owner = (wr.owner + p.d.R - 1) % p.d.R;
}

void forward_weights(DeviceAllocator& alloc, const Pass& p, RankData& in, WeightRing& wr, LossState& out,
                     PhaseCounter& phase) {
  const RingDims& d = p.d;
  const cudaStream_t s = p.stream();
  DeviceBuffer state(alloc, 3 * d.T * 4, kVocab, s);        // [3, T] fp32: max, sum, target logit
  DeviceBuffer logits(alloc, d.Tb * d.Vb * 4, kVocab, s);  // [T_blk, V_blk] fp32
  float* row_max = state.as<float>();
  float* row_sum = row_max + d.T;
  float* target_logit = row_sum + d.T;
  exec::cuda_detail::init_online_rows_cuda(row_max, row_sum, target_logit, d.T, s);
  for (int64_t step = 0; step < d.R; ++step) {
    const ShardView shard{wr.current->as<Bf16>(), wr.owner * d.shard, d.rows_of(wr.owner)};
    for (int64_t t0 = 0; t0 < d.T; t0 += d.Tb) {
      const int64_t tb = std::min(d.Tb, d.T - t0);
      fold_shard(p, in.x.as<Bf16>() + t0 * d.H, in.targets.as<int32_t>() + t0, tb, shard, row_max + t0, row_sum + t0,
                 target_logit + t0, logits.as<float>(), phase);
    }
    if (d.R > 1) hop(p, wr);
  }
  exec::cuda_detail::finish_online_rows_cuda(row_max, row_sum, target_logit, in.targets.as<int32_t>(), out.lse.as<float>(),
                                             out.loss.as<float>(), d.T, s);
}

void gradients_weights(DeviceAllocator& alloc, const Pass& p, RankData& in, const LossState& ls, WeightRing& wr,
                       DeviceBuffer& d_x, DeviceBuffer& d_w, PhaseCounter& phase) {
  const RingDims& d = p.d;
  const cudaStream_t s = p.stream();
  DeviceBuffer logits(alloc, d.Tb * d.Vb * 4, kVocab, s);   // [T_blk, V_blk] fp32
  DeviceBuffer dlogits(alloc, d.Tb * d.Vb * 2, kVocab, s);  // [T_blk, V_blk] bf16
  DeviceBuffer dw_arriving;                                 // [ceil(V/R), H] fp32
  if (d.R > 1) dw_arriving = DeviceBuffer(alloc, d.shard * d.H * 4, kVocab, s);
  DeviceBuffer* dw_current = &d_w;
  DeviceBuffer* dw_other = &dw_arriving;
  for (int64_t step = 0; step < d.R; ++step) {
    const ShardView shard{wr.current->as<Bf16>(), wr.owner * d.shard, d.rows_of(wr.owner)};
    for (int64_t t0 = 0; t0 < d.T; t0 += d.Tb) {
      const int64_t tb = std::min(d.Tb, d.T - t0);
      grad_shard(p, in.x.as<Bf16>() + t0 * d.H, in.targets.as<int32_t>() + t0, ls.lse.as<float>() + t0, tb, shard,
                 d_x.as<float>() + t0 * d.H, dw_current->as<float>(), logits.as<float>(), dlogits.as<Bf16>(), phase);
    }
    if (d.R > 1) {
      // The arriving accumulator is overwritten whole by the hop, so it needs no zeroing.
      p.ring.shift(dw_current->raw(), dw_other->raw(), d.shard * d.H, DType::F32);
      std::swap(dw_current, dw_other);
      hop(p, wr);
    }
  }
  if (dw_current != &d_w) d_w = std::move(*dw_current);  // moving releases the other buffer
  dw_arriving.reset();
}

template <class T>
std::vector<T> to_host(const T* device, int64_t count, cudaStream_t s) {
  std::vector<T> host(static_cast<size_t>(count));
  if (count > 0)
    FLATPEAK_CUDA_CHECK(cudaMemcpyAsync(host.data(), device, static_cast<size_t>(count) * sizeof(T), cudaMemcpyDeviceToHost, s));
  FLATPEAK_CUDA_CHECK(cudaStreamSynchronize(s));
  return host;
}

int64_t aligned(int64_t bytes, int64_t a) { return (bytes + a - 1) / a * a; }

}  // namespace

int64_t ring_dtp_schedule_cuda_peak_bytes(const exec::RingDtpConfig& c, int64_t al) {
  if (c.tokens <= 0 || c.hidden <= 0 || c.vocab <= 0 || c.ring_size <= 0 || c.token_block_rows <= 0 || c.vocab_block_rows <= 0)
    throw std::invalid_argument("ring-dtp schedule: tokens, hidden, vocab, ring_size and blocks must be positive");
  const RingDims d = exec::ring_dims_of(c);
  const bool weights = c.rotation == exec::RingRotation::Weights;
  const int64_t blocks = aligned(d.Tb * d.Vb * 4, al);  // the fp32 logits block
  int64_t held = aligned(d.T * d.H * 2, al) + aligned(d.shard * d.H * 2, al) + aligned(d.T * 4, al) + 2 * aligned(d.T * 4, al);
  if (weights && d.R > 1) held += aligned(d.shard * d.H * 2, al);  // the W shard in flight
  const int64_t forward = weights ? aligned(3 * d.T * 4, al) + blocks
                                  : aligned(2 * d.Tb * d.H * 2, al) + aligned(2 * 3 * d.Tb * 4, al) + aligned(2 * d.Tb * 4, al) + blocks;
  int64_t gradients = aligned(d.T * d.H * 4, al) + aligned(d.shard * d.H * 4, al) + blocks + aligned(d.Tb * d.Vb * 2, al);
  gradients += weights ? (d.R > 1 ? aligned(d.shard * d.H * 4, al) : 0)
                       : aligned(2 * d.Tb * d.H * 2, al) + aligned(2 * d.Tb * 4, al) + aligned(2 * d.Tb * d.H * 4, al) +
                             aligned(2 * d.Tb * 4, al);
  return held + std::max(forward, gradients);
}

RingDtpCudaResult run_ring_dtp_schedule_cuda(exec::Communicator& comm, DeviceAllocator& alloc, const CublasContext& blas,
                                             const exec::RingDtpConfig& config, bool copy_results) {
  exec::check_ring_dtp(comm, config);
  if (config.vocab > 0x7fffffff) throw std::invalid_argument("ring-dtp schedule: vocab must be < 2^31 (int32 targets)");
  // Every collective here (the hops, the final all-gather) moves device pointers, written and
  // read by kernels on blas.stream(): a device communicator on that same stream (NCCL queues its
  // collectives there, cuda-threads synchronises it), or nothing orders them.
  require_device_communicator(comm, blas.stream(), "ring-dtp schedule");
  const RingDims d = exec::ring_dims_of(config);
  const cudaStream_t s = blas.stream();
  Ring ring(comm, d.R, [s](void* dst, const void* src, int64_t bytes) { copy_d2d(dst, src, bytes, s); });
  const Pass p{d, blas, ring};
  const bool activations = config.rotation == exec::RingRotation::Activations;
  RingDtpCudaResult result;
  result.shard_first_row = ring.position * d.shard;
  result.shard_rows = d.rows_of(ring.position);
  {
    RankData in(alloc, d, ring, config.seed, s);
    ScopedEvent start, mid, stop;
    start.record(s);
    LossState ls{DeviceBuffer(alloc, d.T * 4, kVocab, s),   // lse [T] fp32
                 DeviceBuffer(alloc, d.T * 4, kVocab, s)};  // per-token loss [T] fp32
    WeightRing wr{DeviceBuffer(), &in.w, nullptr, ring.position};
    if (!activations && d.R > 1) wr.in_flight = DeviceBuffer(alloc, d.shard * d.H * 2, kVocab, s);
    wr.other = &wr.in_flight;

    PhaseCounter fwd{alloc, "loss/fwd/blk"};
    if (activations) forward_activations(alloc, p, in, ls, fwd);
    else forward_weights(alloc, p, in, wr, ls, fwd);
    if (!config.gradients_in_forward) mid.record(s);

    PhaseCounter bwd{alloc, "loss/bwd/blk"};
    PhaseCounter& grad_phase = config.gradients_in_forward ? fwd : bwd;
    if (!config.gradients_in_forward) alloc.set_phase("loss/bwd/blk0");  // it holds the gradients from its start
    DeviceBuffer d_x(alloc, d.T * d.H * 4, kVocab, s);      // [T, H] fp32
    DeviceBuffer d_w(alloc, d.shard * d.H * 4, kVocab, s);  // [ceil(V/R), H] fp32, +=
    zero(d_x, s);
    zero(d_w, s);
    if (activations) gradients_activations(alloc, p, in, ls, d_x, d_w, grad_phase);
    else gradients_weights(alloc, p, in, ls, wr, d_x, d_w, grad_phase);
    if (config.gradients_in_forward) mid.record(s);
    stop.record(s);

    if (config.gradients_in_forward) {
      // Nothing left to compute: X, the W shards and lse are released; dX, dW and the per-token
      // loss wait for the layers' backward.
      in.x.reset();
      in.w.reset();
      wr.in_flight.reset();
      ls.lse.reset();
      alloc.set_phase("loss/bwd");
    }
    FLATPEAK_CUDA_CHECK(cudaEventSynchronize(stop.get()));
    result.seconds = event_seconds(start.get(), stop.get());
    result.forward_s = event_seconds(start.get(), mid.get());
    result.backward_s = event_seconds(mid.get(), stop.get());
    result.loss = to_host(ls.loss.as<float>(), d.T, s);
    if (copy_results) {
      result.d_x = to_host(d_x.as<float>(), d.T * d.H, s);
      result.d_w = to_host(d_w.as<float>(), result.shard_rows * d.H, s);
    }
  }
  // The mean in global token order, as the CPU schedule sums it. Gathered after every buffer of
  // the run is released, so it adds nothing to the run's peak (workspace, inside loss/bwd).
  {
    DeviceBuffer mine(alloc, d.T * 4, Category::Workspace, s);                 // [T] fp32
    DeviceBuffer all(alloc, comm.size() * d.T * 4, Category::Workspace, s);    // [ranks, T] fp32
    FLATPEAK_CUDA_CHECK(cudaMemcpyAsync(mine.raw(), result.loss.data(), static_cast<size_t>(d.T) * 4, cudaMemcpyHostToDevice, s));
    comm.all_gather(mine.raw(), all.raw(), d.T, DType::F32);
    const std::vector<float> every = to_host(all.as<float>(), comm.size() * d.T, s);
    double sum = 0.0;
    for (int64_t q = 0; q < d.R; ++q)
      for (int64_t t = 0; t < d.T; ++t) sum += static_cast<double>(every[static_cast<size_t>(ring.rank_of(q) * d.T + t)]);
    result.mean_loss = sum / static_cast<double>(d.R * d.T);
  }
  return result;
}

}  // namespace flatpeak::cuda
