// The vocabulary projection and loss (reference/vocab-checkpoint-optimizer.md §1).
// Materialized (baseline): at the loss backward, bf16 logits [T, V] + fp32 log-softmax [T, V] +
// fp32 dlogits [T, V] (10 bytes per element) + X [T, H], W [V, H] (gathered bf16), dX, dW.
// Blocked (R = 1) and Ring-DTP: blocks of [T_blk, V_blk] logits folded into an online
// log-sum-exp; fp32 for lse, the online state and every cross-block accumulator (dX, dW).
#include <algorithm>

#include "memory_model.h"

namespace flatpeak::planner {

namespace {

constexpr Category kVoc = Category::Vocab;

struct VocabShape {
  int64_t T, H, V, R, shard, Tb, Vb;
};

VocabShape shape_of(const Context& c) {
  const int64_t R = c.run.vocab == VocabMode::RingDtp ? c.run.ring_size : 1;
  return VocabShape{c.work.tokens, c.model.hidden_size, c.model.vocab_size, R, ceil_div(c.model.vocab_size, R),
                    c.run.token_block, c.run.vocab_block};
}

void add_x_w(const VocabShape& s, TermList& t) {
  t.add("X (final norm output)", {{"T", s.T}, {"H", s.H}}, kBf16, kVoc);
  if (s.R == 1) t.add("W (LM head, gathered)", {{"V", s.V}, {"H", s.H}}, kBf16, kVoc);
  else t.add("W shard (LM head, gathered)", {{"V/R", s.shard}, {"H", s.H}}, kBf16, kVoc);
}

bool in_forward(const Context& c) { return c.run.vocab_backward == VocabBackward::InForward; }

// Ring buffers for one direction of rotation; `grads` adds the travelling gradient accumulators.
void add_ring(const Context& c, const VocabShape& s, bool grads, TermList& t) {
  if (s.R <= 1) return;
  if (c.run.ring_rotate == RingRotate::Activations) {
    t.add("ring X blocks in flight", {{"2", 2}, {"T_blk", s.Tb}, {"H", s.H}}, kBf16, kVoc);
    t.add("ring online state in flight", {{"2", 2}, {"3", 3}, {"T_blk", s.Tb}}, kFp32, kVoc);
    if (grads) t.add("ring dX blocks in flight", {{"2", 2}, {"T_blk", s.Tb}, {"H", s.H}}, kFp32, kVoc);
  } else {
    t.add("ring W shard in flight", {{"V/R", s.shard}, {"H", s.H}}, kBf16, kVoc);
  }
}

void add_dw(const Context& c, const VocabShape& s, TermList& t) {
  if (s.R > 1 && c.run.ring_rotate == RingRotate::Weights)
    t.add("dW shard accumulators (travelling)", {{"2", 2}, {"V/R", s.shard}, {"H", s.H}}, kFp32, kVoc);
  else if (s.R > 1)
    t.add("dW shard accumulator", {{"V/R", s.shard}, {"H", s.H}}, kFp32, kVoc);
  else
    t.add("dW accumulator", {{"V", s.V}, {"H", s.H}}, kFp32, kVoc);
}

void add_block_forward(const Context& c, const VocabShape& s, TermList& t) {
  add_x_w(s, t);
  t.add("logits block", {{"T_blk", s.Tb}, {"V_blk", s.Vb}}, kFp32, kVoc);
  t.add("online state (max, sum, target logit)", {{"3", 3}, {"T", s.T}}, kFp32, kVoc);
  t.add("lse", {{"T", s.T}}, kFp32, kVoc);
  const bool grads = in_forward(c);
  add_ring(c, s, grads, t);
  if (grads) {
    t.add("dlogits block", {{"T_blk", s.Tb}, {"V_blk", s.Vb}}, kBf16, kVoc);
    t.add("dX accumulator", {{"T", s.T}, {"H", s.H}}, kFp32, kVoc);
    add_dw(c, s, t);
  }
}

void add_block_backward(const Context& c, const VocabShape& s, TermList& t) {
  add_x_w(s, t);
  t.add("lse", {{"T", s.T}}, kFp32, kVoc);
  t.add("logits block (recomputed)", {{"T_blk", s.Tb}, {"V_blk", s.Vb}}, kFp32, kVoc);
  t.add("dlogits block", {{"T_blk", s.Tb}, {"V_blk", s.Vb}}, kBf16, kVoc);
  add_ring(c, s, true, t);
  t.add("dX accumulator", {{"T", s.T}, {"H", s.H}}, kFp32, kVoc);
  add_dw(c, s, t);
}

std::string block_folds(const VocabShape& s) {
  const int64_t blocks = ceil_div(s.T, s.Tb) * ceil_div(s.shard, s.Vb) * s.R;
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
    t.add("logits", {{"T", s.T}, {"V", s.V}}, kBf16, kVoc);
    t.add("log-softmax", {{"T", s.T}, {"V", s.V}}, kFp32, kVoc);
    return out;
  }
  out.push_back(PhaseTerms{"fwd/blk0", block_folds(s), c.list()});
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
    t.add("logits", {{"T", s.T}, {"V", s.V}}, kBf16, kVoc);
    t.add("log-softmax", {{"T", s.T}, {"V", s.V}}, kFp32, kVoc);
    t.add("dlogits", {{"T", s.T}, {"V", s.V}}, kFp32, kVoc);
    t.add("dX", {{"T", s.T}, {"H", s.H}}, kBf16, kVoc);
    t.add("dW", {{"V", s.V}, {"H", s.H}}, kBf16, kVoc);
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
  } else if (in_forward(c)) {
    t.add(prefix + "dX (computed in forward)", {{"T", s.T}, {"H", s.H}}, kFp32, kVoc);
  } else {
    t.add(prefix + "X (saved)", {{"T", s.T}, {"H", s.H}}, kBf16, kVoc);
    t.add(prefix + "lse (saved)", {{"T", s.T}}, kFp32, kVoc);
  }
}

}  // namespace flatpeak::planner
