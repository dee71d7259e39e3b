// Ring-DTP across R ranks (ring_dtp_schedule.h). Each rank's shard is the rows
// [p·ceil(V/R), min(V, (p+1)·ceil(V/R))) of W; a token's online state folds the shards in the
// order the ring brings them (its own rank's shard first), each shard's vocabulary blocks in
// order. The per-element math is the blocked op's (ops/cross_entropy.h: lse_fold,
// cross_entropy_dlogit; the GEMM of cpu/gemm_cpu.h), so at R = 1 this is the blocked schedule.
//   RingDtpResult r = run_ring_dtp_schedule(comm, alloc, config);
#include "executor/schedules/ring_dtp_schedule.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>

#include "executor/cpu/gemm_cpu.h"
#include "executor/memory/tensor.h"
#include "executor/ops/cross_entropy.h"
#include "executor/ops/dtype.h"
#include "executor/schedules/ring_dtp_internal.h"
#include "executor/schedules/schedule_util.h"

namespace flatpeak::exec {

namespace {

using Dims = RingDims;

using PhaseCounter = exec::BlockPhaseCounter<TrackingAllocator>;

// The shard a token block meets: rows [first_row, first_row + rows) of W at `w`.
struct ShardView {
  const Bf16* w;
  int64_t first_row, rows;
};

// Folds the logits of `tb` tokens against one shard into their online state (max, sum, target
// logit), vocabulary block by block: the blocked op's forward step with a state that persists
// across shards.
void fold_shard(const Dims& d, const Bf16* x, const int32_t* targets, int64_t tb, const ShardView& shard,
                float* row_max, float* row_sum, float* target_logit, float* logits, PhaseCounter& phase) {
  for (int64_t v0 = 0; v0 < shard.rows; v0 += d.Vb) {
    const int64_t vb = std::min(d.Vb, shard.rows - v0);
    phase.advance();
    gemm_cpu(false, true, tb, vb, d.H, 1.0f, x, d.H, shard.w + v0 * d.H, d.H, false, logits, vb);
    for (int64_t r = 0; r < tb; ++r) {
      const float* z = logits + r * vb;
      float block_max = -INFINITY;
      for (int64_t c = 0; c < vb; ++c) block_max = std::max(block_max, z[c]);
      float block_sum = 0.0f;
      for (int64_t c = 0; c < vb; ++c) block_sum += std::exp(z[c] - block_max);
      lse_fold(row_max[r], row_sum[r], block_max, block_sum);
      const int64_t y = targets[r] - (shard.first_row + v0);
      if (y >= 0 && y < vb) target_logit[r] = z[y];
    }
  }
}

// Recomputes the logits of `tb` tokens against one shard and adds their gradients:
// dz = g·(e^(z−lse) − onehot) rounded to bf16 once, dX += dz·W_blk and dW_blk += dzᵀ·X (fp32).
void grad_shard(const Dims& d, const Bf16* x, const int32_t* targets, const float* lse, int64_t tb,
                const ShardView& shard, float* d_x, float* d_w, float* logits, Bf16* dlogits, PhaseCounter& phase) {
  for (int64_t v0 = 0; v0 < shard.rows; v0 += d.Vb) {
    const int64_t vb = std::min(d.Vb, shard.rows - v0);
    phase.advance();
    gemm_cpu(false, true, tb, vb, d.H, 1.0f, x, d.H, shard.w + v0 * d.H, d.H, false, logits, vb);
    for (int64_t r = 0; r < tb; ++r) {
      const int64_t y = targets[r];
      for (int64_t c = 0; c < vb; ++c) {
        const float dz = y < 0 ? 0.0f
                               : cross_entropy_dlogit(logits[r * vb + c], lse[r], shard.first_row + v0 + c == y, d.grad_scale);
        dlogits[r * vb + c] = f32_to_bf16(dz);
      }
    }
    gemm_cpu(false, false, tb, d.H, vb, 1.0f, dlogits, vb, shard.w + v0 * d.H, d.H, true, d_x, d.H);
    gemm_cpu(true, false, vb, d.H, tb, 1.0f, dlogits, vb, x, d.H, true, d_w + v0 * d.H, d.H);
  }
}

void zero(Tensor& t) { std::memset(t.raw(), 0, static_cast<size_t>(t.bytes())); }

// The rank's inputs, equal to the single-rank schedule's global X, W and targets at its offsets.
struct RankData {
  Tensor x, w, targets;
  RankData(TrackingAllocator& alloc, const Dims& d, const Ring& ring, uint64_t seed)
      : x(alloc, DType::BF16, {d.T, d.H}, Category::Vocab),             // [T, H] bf16
        w(alloc, DType::BF16, {d.shard, d.H}, Category::Vocab),         // [ceil(V/R), H] bf16
        targets(alloc, DType::I32, {d.T}, Category::Workspace) {         // [T] i32 labels
    const uint64_t x_offset = static_cast<uint64_t>(ring.position * d.T * d.H);
    Bf16* px = x.data<Bf16>();
    for (int64_t i = 0; i < d.T * d.H; ++i)
      px[i] = f32_to_bf16(1.0f * uniform_pm1(seed * 3 + 1, x_offset + static_cast<uint64_t>(i)));
    zero(w);  // the padding rows of a short last shard stay zero and are never read
    const int64_t rows = d.rows_of(ring.position);
    const uint64_t w_offset = static_cast<uint64_t>(ring.position * d.shard * d.H);
    Bf16* pw = w.data<Bf16>();
    for (int64_t i = 0; i < rows * d.H; ++i)
      pw[i] = f32_to_bf16(0.5f * uniform_pm1(seed * 3 + 2, w_offset + static_cast<uint64_t>(i)));
    int32_t* pt = targets.data<int32_t>();
    const uint64_t t_offset = static_cast<uint64_t>(ring.position * d.T);
    for (int64_t i = 0; i < d.T; ++i)
      pt[i] = static_cast<int32_t>(mix64(seed * 3 + 3, t_offset + static_cast<uint64_t>(i)) % static_cast<uint64_t>(d.V));
  }
};

// What the forward leaves for the gradients: lse and the per-token loss [T] fp32.
struct LossState {
  Tensor lse, loss;
};

void finish_rows(const int32_t* targets, const float* row_max, const float* row_sum, const float* target_logit,
                 int64_t rows, float* lse, float* loss) {
  for (int64_t r = 0; r < rows; ++r) {
    lse[r] = row_max[r] + std::log(row_sum[r]);
    loss[r] = targets[r] >= 0 ? lse[r] - target_logit[r] : 0.0f;
  }
}

// ---- Rotating activations -------------------------------------------------------------------

// Every token block goes once around the ring with its online state; the last hop brings only
// the state home, where it becomes lse and loss.
void forward_activations(TrackingAllocator& alloc, const Dims& d, Ring& ring, RankData& in, LossState& out,
                         PhaseCounter& phase) {
  Tensor x_flight(alloc, DType::BF16, {2, d.Tb, d.H}, Category::Vocab);  // [2, T_blk, H] bf16
  Tensor state_flight(alloc, DType::F32, {2, 3, d.Tb}, Category::Vocab);  // [2, 3, T_blk] fp32
  Tensor targets_flight(alloc, DType::I32, {2, d.Tb}, Category::Workspace);  // [2, T_blk] i32
  Tensor logits(alloc, DType::F32, {d.Tb, d.Vb}, Category::Vocab);        // [T_blk, V_blk] fp32
  const ShardView own{in.w.data<Bf16>(), ring.position * d.shard, d.rows_of(ring.position)};
  for (int64_t b = 0; b < d.token_blocks; ++b) {
    const int64_t t0 = b * d.Tb, tb = std::min(d.Tb, d.T - t0);
    const Bf16* x = in.x.data<Bf16>() + t0 * d.H;
    const int32_t* targets = in.targets.data<int32_t>() + t0;
    int slot = 0;  // the state's current slot; X and targets start at home
    float* state = state_flight.data<float>();
    std::fill(state, state + d.Tb, -INFINITY);
    std::fill(state + d.Tb, state + 3 * d.Tb, 0.0f);
    for (int64_t step = 0; step < d.R; ++step) {
      float* s = state + slot * 3 * d.Tb;
      fold_shard(d, x, targets, tb, own, s, s + d.Tb, s + 2 * d.Tb, logits.data<float>(), phase);
      float* s_next = state + (1 - slot) * 3 * d.Tb;
      ring.shift(s, s_next, 3 * d.Tb, DType::F32);
      if (step + 1 < d.R) {
        Bf16* x_next = x_flight.data<Bf16>() + (1 - slot) * d.Tb * d.H;
        int32_t* t_next = targets_flight.data<int32_t>() + (1 - slot) * d.Tb;
        ring.shift(x, x_next, tb * d.H, DType::BF16);
        ring.shift(targets, t_next, tb, DType::I32);
        x = x_next;
        targets = t_next;
      }
      slot = 1 - slot;
    }
    // Home again: the block's state is complete.
    const float* s = state + slot * 3 * d.Tb;
    finish_rows(in.targets.data<int32_t>() + t0, s, s + d.Tb, s + 2 * d.Tb, tb, out.lse.data<float>() + t0,
                out.loss.data<float>() + t0);
  }
}

// Every token block goes around again with its lse and an fp32 dX block that each rank adds its
// shard's part to; the last hop lands the complete dX block in dX [T, H] at home.
void gradients_activations(TrackingAllocator& alloc, const Dims& d, Ring& ring, RankData& in, const LossState& ls,
                           Tensor& d_x, Tensor& d_w, PhaseCounter& phase) {
  Tensor x_flight(alloc, DType::BF16, {2, d.Tb, d.H}, Category::Vocab);    // [2, T_blk, H] bf16
  Tensor lse_flight(alloc, DType::F32, {2, d.Tb}, Category::Vocab);        // [2, T_blk] fp32
  Tensor dx_flight(alloc, DType::F32, {2, d.Tb, d.H}, Category::Vocab);    // [2, T_blk, H] fp32
  Tensor targets_flight(alloc, DType::I32, {2, d.Tb}, Category::Workspace);  // [2, T_blk] i32
  Tensor logits(alloc, DType::F32, {d.Tb, d.Vb}, Category::Vocab);         // [T_blk, V_blk] fp32
  Tensor dlogits(alloc, DType::BF16, {d.Tb, d.Vb}, Category::Vocab);       // [T_blk, V_blk] bf16
  const ShardView own{in.w.data<Bf16>(), ring.position * d.shard, d.rows_of(ring.position)};
  for (int64_t b = 0; b < d.token_blocks; ++b) {
    const int64_t t0 = b * d.Tb, tb = std::min(d.Tb, d.T - t0);
    const Bf16* x = in.x.data<Bf16>() + t0 * d.H;
    const int32_t* targets = in.targets.data<int32_t>() + t0;
    const float* lse = ls.lse.data<float>() + t0;
    int slot = 0;
    float* dx = dx_flight.data<float>();
    std::fill(dx, dx + d.Tb * d.H, 0.0f);
    for (int64_t step = 0; step < d.R; ++step) {
      grad_shard(d, x, targets, lse, tb, own, dx, d_w.data<float>(), logits.data<float>(), dlogits.data<Bf16>(), phase);
      if (step + 1 < d.R) {
        float* dx_next = dx_flight.data<float>() + (1 - slot) * d.Tb * d.H;
        Bf16* x_next = x_flight.data<Bf16>() + (1 - slot) * d.Tb * d.H;
        float* lse_next = lse_flight.data<float>() + (1 - slot) * d.Tb;
        int32_t* t_next = targets_flight.data<int32_t>() + (1 - slot) * d.Tb;
        ring.shift(dx, dx_next, tb * d.H, DType::F32);
        ring.shift(x, x_next, tb * d.H, DType::BF16);
        ring.shift(lse, lse_next, tb, DType::F32);
        ring.shift(targets, t_next, tb, DType::I32);
        dx = dx_next;
        x = x_next;
        lse = lse_next;
        targets = t_next;
        slot = 1 - slot;
      } else if (d.R > 1) {
        // A short last block sends only its tb rows (every rank's block b has the same tb).
        float* landing = dx_flight.data<float>() + (1 - slot) * d.Tb * d.H;
        ring.shift(dx, landing, tb * d.H, DType::F32);
        std::memcpy(d_x.data<float>() + t0 * d.H, landing, static_cast<size_t>(tb * d.H) * sizeof(float));
      } else {
        std::memcpy(d_x.data<float>() + t0 * d.H, dx, static_cast<size_t>(tb * d.H) * sizeof(float));
      }
    }
  }
}

// ---- Rotating weights -----------------------------------------------------------------------

// The W shard in use and the one arriving; after R hops the rank's own shard is home again.
struct WeightRing {
  Tensor in_flight;  // [ceil(V/R), H] bf16
  Tensor* current;   // in.w or in_flight
  Tensor* other;
  int64_t owner;     // ring position whose shard `current` holds
};

void hop(Ring& ring, const Dims& d, WeightRing& wr) {
  ring.shift(wr.current->raw(), wr.other->raw(), d.shard * d.H, DType::BF16);
  std::swap(wr.current, wr.other);
  wr.owner = (wr.owner + d.R - 1) % d.R;
}

// The rank's tokens stay; each shard's vocabulary blocks fold into the state of all T tokens.
void forward_weights(TrackingAllocator& alloc, const Dims& d, Ring& ring, RankData& in, WeightRing& wr,
                     LossState& out, PhaseCounter& phase) {
  Tensor state(alloc, DType::F32, {3, d.T}, Category::Vocab);       // [3, T] fp32: max, sum, target logit
  Tensor logits(alloc, DType::F32, {d.Tb, d.Vb}, Category::Vocab);  // [T_blk, V_blk] fp32
  float* row_max = state.data<float>();
  float* row_sum = row_max + d.T;
  float* target_logit = row_sum + d.T;
  std::fill(row_max, row_max + d.T, -INFINITY);
  std::fill(row_sum, row_sum + 2 * d.T, 0.0f);
  for (int64_t step = 0; step < d.R; ++step) {
    const ShardView shard{wr.current->data<Bf16>(), wr.owner * d.shard, d.rows_of(wr.owner)};
    for (int64_t t0 = 0; t0 < d.T; t0 += d.Tb) {
      const int64_t tb = std::min(d.Tb, d.T - t0);
      fold_shard(d, in.x.data<Bf16>() + t0 * d.H, in.targets.data<int32_t>() + t0, tb, shard, row_max + t0,
                 row_sum + t0, target_logit + t0, logits.data<float>(), phase);
    }
    if (d.R > 1) hop(ring, d, wr);
  }
  finish_rows(in.targets.data<int32_t>(), row_max, row_sum, target_logit, d.T, out.lse.data<float>(),
              out.loss.data<float>());
}

// Each visiting shard carries its fp32 dW accumulator; the rank adds its tokens' part and passes
// both on. After R hops the home shard and its complete gradient are back; the other dW buffer
// is released, so `d_w` ends as the rank's own shard's gradient.
void gradients_weights(TrackingAllocator& alloc, const Dims& d, Ring& ring, RankData& in, const LossState& ls,
                       WeightRing& wr, Tensor& d_x, Tensor& d_w, PhaseCounter& phase) {
  Tensor logits(alloc, DType::F32, {d.Tb, d.Vb}, Category::Vocab);    // [T_blk, V_blk] fp32
  Tensor dlogits(alloc, DType::BF16, {d.Tb, d.Vb}, Category::Vocab);  // [T_blk, V_blk] bf16
  Tensor dw_arriving;                                                   // [ceil(V/R), H] fp32
  if (d.R > 1) dw_arriving = Tensor(alloc, DType::F32, {d.shard, d.H}, Category::Vocab);
  Tensor* dw_current = &d_w;
  Tensor* dw_other = &dw_arriving;
  for (int64_t step = 0; step < d.R; ++step) {
    const ShardView shard{wr.current->data<Bf16>(), wr.owner * d.shard, d.rows_of(wr.owner)};
    for (int64_t t0 = 0; t0 < d.T; t0 += d.Tb) {
      const int64_t tb = std::min(d.Tb, d.T - t0);
      grad_shard(d, in.x.data<Bf16>() + t0 * d.H, in.targets.data<int32_t>() + t0, ls.lse.data<float>() + t0, tb,
                 shard, d_x.data<float>() + t0 * d.H, dw_current->data<float>(), logits.data<float>(),
                 dlogits.data<Bf16>(), phase);
    }
    if (d.R > 1) {
      ring.shift(dw_current->raw(), dw_other->raw(), d.shard * d.H, DType::F32);
      std::swap(dw_current, dw_other);
      hop(ring, d, wr);
    }
  }
  if (dw_current != &d_w) d_w = std::move(*dw_current);  // moving releases the other buffer
  dw_arriving.reset();
}

void copy_out(const Dims& d, const Ring& ring, Communicator& comm, const LossState& ls, const Tensor& d_x,
              const Tensor& d_w, const RingDtpResultSink& sink, RingDtpResult& r) {
  const float* loss = ls.loss.data<float>();
  r.loss.assign(loss, loss + d.T);
  r.shard_first_row = ring.position * d.shard;
  r.shard_rows = d.rows_of(ring.position);
  if (sink) {
    sink(RingDtpResultPart::Dx, 0, d_x.data<float>(), d.T * d.H);
    sink(RingDtpResultPart::Dw, 0, d_w.data<float>(), r.shard_rows * d.H);
  } else {
    r.d_x.assign(d_x.data<float>(), d_x.data<float>() + d.T * d.H);
    r.d_w.assign(d_w.data<float>(), d_w.data<float>() + r.shard_rows * d.H);
  }
  // The mean in global token order, as the single-rank schedule sums it.
  std::vector<float> all(static_cast<size_t>(comm.size() * d.T));
  comm.all_gather(loss, all.data(), d.T, DType::F32);
  double sum = 0.0;
  for (int64_t p = 0; p < d.R; ++p)
    for (int64_t t = 0; t < d.T; ++t) sum += static_cast<double>(all[static_cast<size_t>(ring.rank_of(p) * d.T + t)]);
  r.mean_loss = sum / static_cast<double>(d.R * d.T);
}

}  // namespace

RingDtpResult run_ring_dtp_schedule(Communicator& comm, TrackingAllocator& alloc, const RingDtpConfig& config) {
  check_ring_dtp(comm, config);
  const Dims d = ring_dims_of(config);
  Ring ring(comm, d.R, [](void* dst, const void* src, int64_t bytes) { std::memcpy(dst, src, static_cast<size_t>(bytes)); });
  const bool activations = config.rotation == RingRotation::Activations;
  RankData in(alloc, d, ring, config.seed);
  LossState ls{Tensor(alloc, DType::F32, {d.T}, Category::Vocab),   // lse [T] fp32
               Tensor(alloc, DType::F32, {d.T}, Category::Vocab)};  // per-token loss [T] fp32
  WeightRing wr{Tensor(), &in.w, nullptr, ring.position};
  if (!activations && d.R > 1) wr.in_flight = Tensor(alloc, DType::BF16, {d.shard, d.H}, Category::Vocab);
  wr.other = &wr.in_flight;

  PhaseCounter fwd{alloc, "loss/fwd/blk"};
  if (activations) forward_activations(alloc, d, ring, in, ls, fwd);
  else forward_weights(alloc, d, ring, in, wr, ls, fwd);

  // The gradients pass: right away (gradients in forward) or as the loss backward.
  PhaseCounter bwd{alloc, "loss/bwd/blk"};
  PhaseCounter& grad_phase = config.gradients_in_forward ? fwd : bwd;
  if (!config.gradients_in_forward) alloc.set_phase("loss/bwd/blk0");  // it holds the gradients from its start
  Tensor d_x(alloc, DType::F32, {d.T, d.H}, Category::Vocab);      // [T, H] fp32
  Tensor d_w(alloc, DType::F32, {d.shard, d.H}, Category::Vocab);  // [ceil(V/R), H] fp32, +=
  zero(d_x);
  zero(d_w);
  if (activations) gradients_activations(alloc, d, ring, in, ls, d_x, d_w, grad_phase);
  else gradients_weights(alloc, d, ring, in, ls, wr, d_x, d_w, grad_phase);

  if (config.gradients_in_forward) {
    // Nothing left to compute: X, the W shards and lse are released; dX, dW and the per-token
    // loss wait for the layers' backward.
    in.x.reset();
    in.w.reset();
    wr.in_flight.reset();
    ls.lse.reset();
    alloc.set_phase("loss/bwd");
  }
  RingDtpResult result;
  copy_out(d, ring, comm, ls, d_x, d_w, config.result_sink, result);
  return result;
}

}  // namespace flatpeak::exec
