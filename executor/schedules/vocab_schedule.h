// The vocabulary projection and loss on one rank, as a component run: the naive materialised
// schedule (bf16 logits [T, V], fp32 log-softmax and fp32 dlogits) or the blocked one (Ring-DTP at
// R = 1: [T_blk, V_blk] logits blocks folded into an online log-sum-exp), with either backward.
//   TrackingAllocator alloc({512});
//   VocabScheduleConfig c; c.tokens = 512; c.hidden = 64; c.vocab = 1000; c.mode = VocabScheduleMode::Blocked;
//   VocabScheduleResult r = run_vocab_schedule(alloc, c);   // phases loss/fwd/blkI, loss/bwd/blkI
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "executor/memory/tensor.h"
#include "executor/memory/tracking_allocator.h"

namespace flatpeak::exec {

enum class VocabScheduleMode { Materialized, Blocked };

struct VocabScheduleConfig {
  int64_t tokens = 0;            // T
  int64_t hidden = 0;            // H
  int64_t vocab = 0;             // V (need not divide by the block)
  int64_t token_block_rows = 0;  // T_blk (blocked only)
  int64_t vocab_block_rows = 0;  // V_blk (blocked only)
  VocabScheduleMode mode = VocabScheduleMode::Blocked;
  bool gradients_in_forward = false;  // blocked only: dX, dW computed during the forward pass
  uint64_t seed = 1;                  // X, W and targets are a pure function of the seed
  // W's buffer as a step gathers it, the LM head unit: `head_unit_before_w` elements (the final
  // norm's weight) before W [V, H] and `head_unit_after_w` (the head's bias) after it; dW's buffer
  // is the unit's grads, laid out the same. 0 and 0: W alone.
  int64_t head_unit_before_w = 0;
  int64_t head_unit_after_w = 0;
  // The LM head's bias: the first V elements after W (head_unit_after_w >= V), added to the logits;
  // its gradient lands in the same place of the unit's grads.
  bool head_bias = false;
};

// Results copied out of the tracked buffers (after they are released).
struct VocabScheduleResult {
  double mean_loss = 0.0;
  std::vector<float> d_x;  // [T, H] (bf16 values widened)
  std::vector<float> d_w;  // [V, H] fp32
  std::vector<float> d_bias;  // [V] with head_bias (widened), else empty
};

// The elements of W's buffer, the head unit: head_unit_before_w + V·H + head_unit_after_w. Throws
// std::invalid_argument for a negative part or a head bias without V elements after W. The CPU
// and CUDA schedules both size W and dW by it.
int64_t vocab_head_unit_params(const VocabScheduleConfig& config);

// Runs forward and backward with every buffer from `alloc`; sets the traces/ phase names
// loss/fwd[/blkI] and loss/bwd[/blkI] (I = token block); with gradients in forward, loss/bwd is
// one phase in which dX and dW are held. Buffers and categories:
//   X [T, H] bf16, the head unit holding W [V, H] bf16, lse [T] fp32, per-token loss [T] fp32, dX
//   [T, H] bf16, the head unit's grads holding dW [V, H] (fp32 blocked, bf16 materialised) — vocab;
//   targets [T] i32 — workspace (input labels, no timeline column);
//   blocked: the op's workspace (fp32 logits block [T_blk, V_blk], dX rows [T_blk, H], row state) — vocab;
//   materialised: logits [T, V] bf16, log-softmax [T, V] fp32, dlogits [T, V] fp32 — vocab.
VocabScheduleResult run_vocab_schedule(TrackingAllocator& alloc, const VocabScheduleConfig& config);

// The same loss inside a whole step (step_schedule.h): X, W, the targets and dW's storage are the
// caller's, the phases and every other buffer as above.
struct LossInputs {
  Tensor x;                          // [T, H] bf16 (vocab); may be left empty and made by on_forward
  Tensor w_storage;                  // the buffer holding W (a gathered LM head unit)
  const Bf16* w = nullptr;           // [V, H] inside w_storage
  const Bf16* bias = nullptr;        // [V] the LM head's bias inside w_storage, or null
  const int32_t* targets = nullptr;  // [T]
  // Called once, right after the first forward phase is entered (before any loss buffer): a step
  // computes X there (its final norm).
  std::function<void()> on_forward;
  // Called once when dW is first needed (after dX is allocated): a zeroed [V, H] buffer of `dtype`
  // (F32: the blocked accumulator; BF16: the materialised GEMM output) that the caller owns.
  std::function<void*(DType dtype)> make_dw;
  // With a bias: where its gradient [V] goes (of make_dw's dtype), set by make_dw.
  void* d_bias = nullptr;
  // Called once, right after the first backward phase is entered (a step prefetches there).
  std::function<void()> on_backward;
  // Called right before X, W and lse are released: after the forward pass with gradients in
  // forward, after the backward otherwise (a step keeps what its final norm's backward needs).
  std::function<void()> before_release;
  // Set: the backward is deferred (a step's MTP modules and their losses run in between). Called
  // once between the passes with the saved set held: without gradients in forward X, lse and the
  // per-token loss (materialised: and the logits and log-softmax), W released before it (on_backward
  // must set w_storage, w and bias again); with them dX, dW's buffer and the per-token loss.
  std::function<void()> between;
  // The phases' prefix: "loss" (loss/fwd..., loss/bwd...), or an MTP loss's "loss/mtp0".
  std::string phase_prefix = "loss";
};

struct LossOutputs {
  double mean_loss = 0.0;
  Tensor d_x;   // [T, H] bf16 (vocab)
  Tensor loss;  // [T] fp32 per-token loss (vocab)
};

// Runs forward and backward; on return X, W (w_storage), lse and every transient are released,
// dX and the per-token loss are the caller's, dW is in the make_dw buffer.
LossOutputs run_vocab_loss(TrackingAllocator& alloc, const VocabScheduleConfig& config, LossInputs& in);

}  // namespace flatpeak::exec
