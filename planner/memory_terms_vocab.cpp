// The vocabulary projection and loss (reference/vocab-checkpoint-optimizer.md §1).
// Materialized (baseline): at the loss backward, bf16 logits [T, V] + fp32 log-softmax [T, V] +
// fp32 dlogits [T, V] (10 bytes per element) + X [T, H], W (read from the gathered final norm + LM
// head unit [H + V·H], bf16), lse and per-token loss [T] fp32, bf16 dX, and dW as one GEMM over all
// T with bf16 output into the unit's grads [H + V·H].
// Blocked (R = 1) and Ring-DTP: blocks of [T_blk, V_blk] fp32 logits folded into an online
// log-sum-exp; the backward turns each into a bf16 dlogits block (the dX and dW GEMMs' operand);
// fp32 for lse, loss, the online state and every cross-block accumulator. With R = 1 the loop is
// token-block outer, so the online state and the fp32 dX accumulator cover one token block and dX
// is written bf16 [T, H]; with R > 1 the ring visits each token block R times, so they cover T.
// With R = 1 a block's buffers are one workspace allocation (executor/ops/cross_entropy.h), aligned
// once: the logits block and the online state, or in the backward (which reads lse, not the state)
// the logits block, the dX accumulator and the dlogits block; all of them with gradients in forward.
// R > 1, what the ring carries: rotating activations, a token block travels with its online state
// in the forward and with its lse and fp32 dX block in the backward, so no rank keeps a [3, T]
// state (the block's state comes home complete and becomes lse and loss); rotating weights, a W
// shard travels with its fp32 dW accumulator and comes home after R hops, when the arriving
// buffer is released. Gradients in forward at R > 1: lse exists only after a whole ring pass, so
// the gradients are a second ring pass inside the forward, whose live set is the backward's.
#include <algorithm>
#include <string>

#include "memory_model.h"

namespace flatpeak::planner {

namespace {

constexpr Category kVoc = Category::Vocab;

struct VocabShape {
  int64_t T, H, V, R, shard, Tb, Vb;
  int64_t w_params;  // R = 1: what W is read from (loss_weight_params): the gathered head unit
  bool tied;         // W is the embedding table [V, H], the head unit (final norm) gathered beside it
};

VocabShape shape_of(const Context& c) {
  const int64_t R = c.run.vocab == VocabMode::RingDtp ? c.run.ring_size : 1;
  const int64_t T = c.work.tokens, shard = ceil_div(c.model.vocab_size, R);
  return VocabShape{T, c.model.hidden_size, c.model.vocab_size, R, shard, std::min(c.run.token_block, T),
                    std::min(c.run.vocab_block, shard), loss_weight_params(c.model, c.work), c.model.tie_word_embeddings};
}

void add_x_w(const VocabShape& s, TermList& t) {
  t.add("X (final norm output)", {{"T", s.T}, {"H", s.H}}, kBf16, kVoc);
  if (s.R == 1 && s.tied) t.add_flat("W (embedding table, gathered: tied head) and the head unit (final norm)", "V·H+U", s.w_params, kBf16, kVoc);
  else if (s.R == 1) t.add_flat("W (LM head unit, gathered: final norm, then W [V, H])", "U", s.w_params, kBf16, kVoc);
  else t.add("W shard (LM head, gathered)", {{"V/R", s.shard}, {"H", s.H}}, kBf16, kVoc);
}

bool in_forward(const Context& c) { return c.run.vocab_backward == VocabBackward::InForward; }

// Ring buffers for one direction of rotation (the one in use and the one arriving); `grads`: the
// gradient pass, where a token block carries its lse (not the forward's online state) and dX.
void add_ring(const Context& c, const VocabShape& s, bool grads, TermList& t) {
  if (s.R <= 1) return;
  if (c.run.ring_rotate == RingRotate::Activations) {
    t.add("ring X blocks in flight", {{"2", 2}, {"T_blk", s.Tb}, {"H", s.H}}, kBf16, kVoc);
    if (grads) {
      t.add("ring lse blocks in flight", {{"2", 2}, {"T_blk", s.Tb}}, kFp32, kVoc);
      t.add("ring dX blocks in flight", {{"2", 2}, {"T_blk", s.Tb}, {"H", s.H}}, kFp32, kVoc);
    } else {
      t.add("ring online state in flight", {{"2", 2}, {"3", 3}, {"T_blk", s.Tb}}, kFp32, kVoc);
    }
  } else {
    t.add("ring W shard in flight", {{"V/R", s.shard}, {"H", s.H}}, kBf16, kVoc);
  }
}

void add_lse_loss(const VocabShape& s, TermList& t) {
  t.add("lse", {{"T", s.T}}, kFp32, kVoc);
  t.add("per-token loss", {{"T", s.T}}, kFp32, kVoc);
}

// The fp32 dX accumulator and, with R = 1, the bf16 dX it is written into block by block.
void add_dx(const VocabShape& s, TermList& t) {
  if (s.R == 1) {
    t.add("dX accumulator (token block)", {{"T_blk", s.Tb}, {"H", s.H}}, kFp32, kVoc);
    t.add("dX", {{"T", s.T}, {"H", s.H}}, kBf16, kVoc);
  } else {
    t.add("dX accumulator", {{"T", s.T}, {"H", s.H}}, kFp32, kVoc);
  }
}

void add_dw(const Context& c, const VocabShape& s, TermList& t, const std::string& prefix = "",
            const std::string& suffix = "") {
  if (s.R > 1 && c.run.ring_rotate == RingRotate::Weights) {
    // Two buffers (in use, arriving), not one [2, V/R, H]: after the last hop one is released.
    t.add(prefix + "dW shard accumulators (travelling)" + suffix, {{"V/R", s.shard}, {"H", s.H}}, kFp32, kVoc, 2);
  } else if (s.R > 1)
    t.add(prefix + "dW shard accumulator" + suffix, {{"V/R", s.shard}, {"H", s.H}}, kFp32, kVoc);
  else
    t.add_flat(prefix + "dW accumulator" + suffix, "U", s.w_params, kFp32, kVoc);
}

void add_block_backward(const Context& c, const VocabShape& s, TermList& t);

// R = 1: the block's workspace, one buffer of fp32 words: the logits block [T_blk, V_blk]; the
// online state [3, T_blk] (`state`); the dX accumulator [T_blk, H] and the dlogits block in bf16,
// rounded up to whole words (`grads`).
void add_block_workspace(const VocabShape& s, bool state, bool grads, TermList& t) {
  int64_t words = checked_mul(s.Tb, s.Vb);
  std::string parts = "logits block [T_blk, V_blk] fp32";
  if (state) {
    words = checked_add(words, checked_mul(3, s.Tb));
    parts += ", online state [3, T_blk] fp32";
  }
  if (grads) {
    words = checked_add(words, checked_add(checked_mul(s.Tb, s.H), ceil_div(checked_mul(s.Tb, s.Vb), 2)));
    parts += ", dX accumulator [T_blk, H] fp32, dlogits block [T_blk, V_blk] bf16";
  }
  t.add_flat("loss block workspace (" + parts + ")", "fp32 words", words, kFp32, kVoc);
}

void add_block_forward(const Context& c, const VocabShape& s, TermList& t) {
  const bool grads = in_forward(c);
  if (s.R == 1) {
    add_x_w(s, t);
    add_block_workspace(s, true, grads, t);
    add_lse_loss(s, t);
    if (grads) {
      t.add("dX", {{"T", s.T}, {"H", s.H}}, kBf16, kVoc);
      add_dw(c, s, t);
    }
    return;
  }
  if (grads && s.R > 1) {
    // The gradient ring pass inside the forward holds more than the forward ring pass (dX, dW,
    // dlogits against the online state, which is released once lse is known).
    add_block_backward(c, s, t);
    return;
  }
  add_x_w(s, t);
  t.add("logits block", {{"T_blk", s.Tb}, {"V_blk", s.Vb}}, kFp32, kVoc);
  if (s.R == 1) t.add("online state (max, sum, target logit)", {{"3", 3}, {"T_blk", s.Tb}}, kFp32, kVoc);
  else if (c.run.ring_rotate == RingRotate::Weights)
    t.add("online state (max, sum, target logit)", {{"3", 3}, {"T", s.T}}, kFp32, kVoc);
  add_lse_loss(s, t);
  add_ring(c, s, grads, t);
  if (grads) {
    t.add("dlogits block", {{"T_blk", s.Tb}, {"V_blk", s.Vb}}, kBf16, kVoc);
    add_dx(s, t);
    add_dw(c, s, t);
  }
}

void add_block_backward(const Context& c, const VocabShape& s, TermList& t) {
  add_x_w(s, t);
  add_lse_loss(s, t);
  if (s.R == 1) {
    add_block_workspace(s, false, true, t);
    t.add("dX", {{"T", s.T}, {"H", s.H}}, kBf16, kVoc);
    add_dw(c, s, t);
    return;
  }
  t.add("logits block (recomputed)", {{"T_blk", s.Tb}, {"V_blk", s.Vb}}, kFp32, kVoc);
  t.add("dlogits block", {{"T_blk", s.Tb}, {"V_blk", s.Vb}}, kBf16, kVoc);
  add_ring(c, s, true, t);
  add_dx(s, t);
  add_dw(c, s, t);
}

// `passes`: 2 for the forward of a ring with gradients in forward (the forward and gradient passes).
std::string block_folds(const VocabShape& s, int64_t passes = 1) {
  const int64_t blocks = ceil_div(s.T, s.Tb) * ceil_div(s.shard, s.Vb) * s.R * passes;
  return blocks > 1 ? "blk0-blk" + std::to_string(blocks - 1) : "";
}

}  // namespace

std::vector<PhaseTerms> loss_forward_phases(const Context& c) {
  const VocabShape s = shape_of(c);
  std::vector<PhaseTerms> out;
  if (c.run.vocab == VocabMode::Materialized) {
    out.push_back(PhaseTerms{"fwd", "", c.list()});
    TermList& t = out.back().terms;
    add_x_w(s, t);
    add_lse_loss(s, t);
    t.add("logits", {{"T", s.T}, {"V", s.V}}, kBf16, kVoc);
    t.add("log-softmax", {{"T", s.T}, {"V", s.V}}, kFp32, kVoc);
    return out;
  }
  out.push_back(PhaseTerms{"fwd/blk0", block_folds(s, in_forward(c) && s.R > 1 ? 2 : 1), c.list()});
  add_block_forward(c, s, out.back().terms);
  return out;
}

std::vector<PhaseTerms> loss_backward_phases(const Context& c) {
  const VocabShape s = shape_of(c);
  std::vector<PhaseTerms> out;
  if (c.run.vocab == VocabMode::Materialized) {
    out.push_back(PhaseTerms{"bwd", "", c.list()});
    TermList& t = out.back().terms;
    add_x_w(s, t);
    add_lse_loss(s, t);
    t.add("logits", {{"T", s.T}, {"V", s.V}}, kBf16, kVoc);
    t.add("log-softmax", {{"T", s.T}, {"V", s.V}}, kFp32, kVoc);
    t.add("dlogits", {{"T", s.T}, {"V", s.V}}, kFp32, kVoc);
    t.add("dX", {{"T", s.T}, {"H", s.H}}, kBf16, kVoc);
    t.add_flat("dW", "U", s.w_params, kBf16, kVoc);
    return out;
  }
  if (in_forward(c)) return out;  // gradients were computed during the forward pass
  out.push_back(PhaseTerms{"bwd/blk0", block_folds(s), c.list()});
  add_block_backward(c, s, out.back().terms);
  return out;
}

void add_loss_saved(const Context& c, const std::string& prefix, TermList& t) {
  const VocabShape s = shape_of(c);
  if (c.run.vocab == VocabMode::Materialized) {
    t.add(prefix + "X (saved)", {{"T", s.T}, {"H", s.H}}, kBf16, kVoc);
    t.add(prefix + "logits (saved)", {{"T", s.T}, {"V", s.V}}, kBf16, kVoc);
    t.add(prefix + "log-softmax (saved)", {{"T", s.T}, {"V", s.V}}, kFp32, kVoc);
    t.add(prefix + "lse (saved)", {{"T", s.T}}, kFp32, kVoc);
    t.add(prefix + "per-token loss (saved)", {{"T", s.T}}, kFp32, kVoc);
  } else if (in_forward(c)) {
    // X, W and lse are released; dX, the fp32 dW accumulator and the loss wait for the backward.
    if (s.R == 1) t.add(prefix + "dX (computed in forward)", {{"T", s.T}, {"H", s.H}}, kBf16, kVoc);
    else t.add(prefix + "dX (computed in forward)", {{"T", s.T}, {"H", s.H}}, kFp32, kVoc);
    // With weights rotating the dW shard came home on the last hop: one accumulator is left.
    if (s.R > 1) t.add(prefix + "dW shard accumulator (computed in forward)", {{"V/R", s.shard}, {"H", s.H}}, kFp32, kVoc);
    else add_dw(c, s, t, prefix, " (computed in forward)");
    t.add(prefix + "per-token loss (saved)", {{"T", s.T}}, kFp32, kVoc);
  } else {
    t.add(prefix + "X (saved)", {{"T", s.T}, {"H", s.H}}, kBf16, kVoc);
    t.add(prefix + "lse (saved)", {{"T", s.T}}, kFp32, kVoc);
    t.add(prefix + "per-token loss (saved)", {{"T", s.T}}, kFp32, kVoc);
  }
}

}  // namespace flatpeak::planner
