// Ring-DTP across R ranks: the vocabulary projection and loss with the LM head W [V, H] sharded
// over a ring (ceil(V/R) rows per rank), each rank holding its own tokens X [T, H]. Logits are
// computed in [T_blk, V_blk] blocks folded into an online log-sum-exp; [T, V] never exists.
//   RingDtpConfig c; c.tokens = 512; c.hidden = 64; c.vocab = 1000; c.ring_size = 4;
//   c.token_block_rows = 128; c.vocab_block_rows = 250; c.rotation = RingRotation::Weights;
//   run_ranks(4, [&](int, Communicator& comm) { TrackingAllocator a({512}); run_ring_dtp_schedule(comm, a, c); });
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "executor/comm/communicator.h"
#include "executor/memory/tracking_allocator.h"

namespace flatpeak::exec {

// What circulates around the ring.
//   Activations: each rank keeps its W shard; every token block of every rank visits every rank,
//     carrying its online state (max, sum, target logit) in the forward, its lse and an fp32 dX
//     block in the backward. dW never moves (each shard's gradient is made on its owner).
//   Weights: each rank keeps its tokens; every W shard visits every rank, carrying its fp32 dW
//     accumulator in the backward, and arrives home after R hops with its complete gradient.
enum class RingRotation { Activations, Weights };

// What a RingDtpConfig::result_sink receives: this rank's dX [T, H] or its W shard's dW
// [shard_rows, H], fp32.
enum class RingDtpResultPart { Dx, Dw };
using RingDtpResultSink = std::function<void(RingDtpResultPart part, int64_t offset, const float* values, int64_t count)>;

struct RingDtpConfig {
  int64_t tokens = 0;            // T, tokens per rank (equal on every rank)
  int64_t hidden = 0;            // H
  int64_t vocab = 0;             // V, the whole vocabulary (need not divide by R or R·V_blk)
  int64_t ring_size = 0;         // R; ranks [g·R, (g+1)·R) of the communicator form ring g
  int64_t token_block_rows = 0;  // T_blk (capped at T)
  int64_t vocab_block_rows = 0;  // V_blk (capped at ceil(V/R))
  RingRotation rotation = RingRotation::Weights;
  // false: the backward recomputes every logits block from the saved lse (phases loss/bwd/blkI);
  // true: the gradients ring runs right after the forward ring, inside loss/fwd, and the loss/bwd
  // phase only holds dX, dW and the per-token loss. Both run the same code in the same order, so
  // their results are bitwise equal.
  bool gradients_in_forward = false;
  // A ring's data is the single-rank schedule's (vocab_schedule.h) on R·T tokens with the same
  // seed: rank p of the ring holds tokens [p·T, (p+1)·T) and rows [p·ceil(V/R), ...) of W.
  uint64_t seed = 1;
  // Set: dX and dW go here instead of into the result (RingDtpResult::d_x and d_w stay empty), as
  // values [offset, offset + count) of the part, while the tracked buffers hold them: verify
  // compares them with the reference's without a copy of its own.
  RingDtpResultSink result_sink;
};

// This rank's results, copied out of the tracked buffers (dX and dW handed to the config's
// result_sink instead when it is set).
struct RingDtpResult {
  double mean_loss = 0.0;   // over the ring's R·T tokens, summed in global token order (fp64)
  std::vector<float> loss;  // [T] fp32, this rank's tokens
  std::vector<float> d_x;   // [T, H] fp32, this rank's tokens (grad scale 1 / (R·T))
  std::vector<float> d_w;   // [shard_rows, H] fp32, the gradient of this rank's W shard
  int64_t shard_first_row = 0;  // first vocabulary row of this rank's shard
  int64_t shard_rows = 0;       // rows of the shard that exist (the last one may be short)
};

// Runs the forward and the backward on this rank; every rank of `comm` calls it with the same
// config. Phases: loss/fwd/blkI and loss/bwd/blkI, where I counts the [T_blk, V_blk] logits
// blocks this rank computes in that pass (a gradients-in-forward run numbers the gradient pass's
// blocks after the forward's, then sets loss/bwd). Buffers (category vocab unless said):
//   X [T, H] bf16, W shard [ceil(V/R), H] bf16, lse and per-token loss [T] fp32,
//   fp32 logits block [T_blk, V_blk], bf16 dlogits block [T_blk, V_blk] (gradient pass),
//   dX [T, H] fp32 (the accumulator with weights rotating; where the returning dX blocks land with
//   activations rotating), targets [T] i32 (workspace: input labels, no timeline column);
//   activations: X blocks in flight [2, T_blk, H] bf16, online state in flight [2, 3, T_blk] fp32
//     (forward), lse blocks in flight [2, T_blk] fp32 and dX blocks in flight [2, T_blk, H] fp32
//     (gradient pass), targets in flight [2, T_blk] i32 (workspace), dW shard [ceil(V/R), H] fp32;
//   weights: online state [3, T] fp32 (forward), W shard in flight [ceil(V/R), H] bf16, dW shard
//     accumulators [2, ceil(V/R), H] fp32 (the one at home and the one arriving; after the last
//     hop the home shard's gradient is in one and the other is released).
// Throws std::invalid_argument for a bad config (R not dividing the communicator, an empty shard).
RingDtpResult run_ring_dtp_schedule(Communicator& comm, TrackingAllocator& alloc, const RingDtpConfig& config);

}  // namespace flatpeak::exec
