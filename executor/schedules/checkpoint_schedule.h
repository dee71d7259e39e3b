// An L-layer checkpointed decoder stack on one rank, as a component run: each layer's input (its
// checkpoint boundary, [T, H] bf16) stays on the device or goes to pinned host memory (SCO, or
// synchronous offload of every layer); backward recomputes each layer from its boundary.
//   TrackingAllocator alloc({512});
//   CheckpointScheduleConfig c; c.tokens = 512; c.hidden = 64; c.layers = 4; c.offloaded = {true, true, false, false}; c.prefetch = 1;
//   CheckpointScheduleResult r = run_checkpoint_schedule(alloc, c);   // phases fwd/LI/..., loss/..., bwd/LI/...
#pragma once

#include <cstdint>
#include <vector>

#include "executor/memory/tracking_allocator.h"

namespace flatpeak::exec {

struct CheckpointScheduleConfig {
  int64_t tokens = 0;  // T
  int64_t hidden = 0;  // H
  int64_t layers = 0;  // L
  int64_t heads = 0;   // attention heads (query = key/value heads), head dim H / heads; 0: 4, 2 or 1, the first dividing H
  int64_t ffn = 0;     // SwiGLU width F; 0: 2H
  // Per layer (size L, or empty for none): its boundary goes to the host during forward and
  // comes back for its backward.
  std::vector<bool> offloaded;
  int64_t prefetch = 0;    // offloaded boundaries fetched ahead in backward (SCO's depth); 0: on demand
  bool checkpoint = true;  // false: the naive reference, no recompute: forward keeps every saved tensor
  uint64_t seed = 1;       // inputs, weights and the loss target are a pure function of the seed
};

// Results copied out of the tracked buffers (after they are released), as the bf16 bit patterns
// the buffers held: exact, and half the untracked heap of widened fp32 copies (verify keeps two
// results, a technique's and the naive one's, beside the run). bf16_value() widens one.
struct CheckpointScheduleResult {
  double loss = 0.0;
  std::vector<uint16_t> d_input;    // [T, H] gradient of the stack's input (bf16 bits)
  std::vector<uint16_t> d_weights;  // every weight gradient, layer by layer, then the final norm (bf16 bits)
};

// The stack's resolved dims (heads and F defaulted as CheckpointScheduleConfig says), after
// checking the config: throws std::invalid_argument for non-positive sizes, heads not dividing H,
// an offloaded list of the wrong length, a negative prefetch, or the naive run offloading.
struct CheckpointDims {
  int64_t tokens = 0, hidden = 0, ffn = 0, heads = 0;
};
CheckpointDims checkpoint_dims(const CheckpointScheduleConfig& config);

// The value of a bf16 bit pattern of a CheckpointScheduleResult.
float bf16_value(uint16_t bits);

// Elements of CheckpointScheduleResult::d_weights for `config`: per layer the norms (2H), q, k, v
// and o (4H²), gate/up (2FH) and down (FH), then the final norm (H).
int64_t checkpoint_weight_gradient_elements(const CheckpointScheduleConfig& config);

// Runs forward, a loss and backward with every buffer from `alloc`, setting the phase names
// fwd/LI/attn, fwd/LI/ffn, loss/fwd, loss/bwd, bwd/LI/recompute/attn, bwd/LI/recompute/ffn
// (checkpoint only), bwd/LI/ffn, bwd/LI/attn. Each layer is RMSNorm → q, k, v projections →
// causal attention → output projection → residual, then RMSNorm → SwiGLU → residual.
// Buffers and categories (the traces/ columns):
//   boundaries (device): the layer inputs x_l [T, H] bf16 on the device, an offloaded one from the
//     start of its layer's forward (the D2H copy in flight) to the end of it, and again from its
//     fetch in backward (its layer's, or `prefetch` layers ahead) to the end of its layer's
//     backward; the final hidden h_L [T, H] until the final norm's backward is done.
//   boundaries (host): one pinned arena [offloaded layers, T, H] bf16, allocated before the step.
//   activations: the layer working set (norm outputs and rstd, q, k, v, attention output and lse,
//     the attention residual, SwiGLU gate/up and output, op workspaces, the gradient stream);
//   params / grads: the weights and their gradients (bf16); vocab: the final norm's output and
//     its gradient; workspace: the loss target.
CheckpointScheduleResult run_checkpoint_schedule(TrackingAllocator& alloc, const CheckpointScheduleConfig& config);

}  // namespace flatpeak::exec
