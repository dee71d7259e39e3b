// Cross-entropy of the vocabulary projection, blocked with an online log-sum-exp (no [T, V]
// buffer: one [T_blk, V_blk] fp32 block of logits at a time), and the materialised version the
// naive schedule runs, for comparison.
// With a head bias the logits are x·Wᵀ + b (the bias added in fp32 before the one rounding) and its
// gradient is Σ_t dz, summed in fp32 over the tokens (blocked: of the rounded dz the GEMMs read).
//   CrossEntropyArgs a; a.x = x; a.w = w; a.targets = y; a.lse = lse; a.loss = loss;
//   a.tokens = T; a.vocab = V; a.hidden = H; a.grad_scale = 1.0f / T; a.workspace = ws;
//   blocked_cross_entropy_forward_cpu(a);  a.d_x = dx; a.d_w = dw; blocked_cross_entropy_backward_cpu(a);
#pragma once

#include <cmath>
#include <cstdint>

#include "executor/ops/dtype.h"

namespace flatpeak::exec {

struct CrossEntropyArgs {
  DType dtype = DType::F32;         // storage of x, w, d_x (f32 or bf16)
  const void* x = nullptr;          // [T, H] final hidden states
  const void* w = nullptr;          // [V, H] LM head
  const void* bias = nullptr;       // [V] LM head bias in the storage dtype (Phi-3.5-MoE), or null
  const int32_t* targets = nullptr; // [T] in 0..V-1, or negative: ignored (loss 0, no gradient)
  float* lse = nullptr;             // [T] fp32 log-sum-exp of the logits; forward writes
  float* loss = nullptr;            // [T] fp32 lse − z_target (0 for ignored tokens)
  float grad_scale = 1.0f;          // g = dL/dloss_t for every kept token (1 / N_kept for a mean)
  void* d_x = nullptr;              // [T, H] overwritten
  float* d_w = nullptr;             // [V, H] fp32, accumulated (+=) over token blocks
  float* d_bias = nullptr;          // [V] fp32, accumulated (+=) over token blocks; with bias, backward
  float* workspace = nullptr;       // blocked_cross_entropy_{forward_,backward_,}workspace_bytes()
  int64_t tokens = 0;
  int64_t vocab = 0;
  int64_t hidden = 0;
  int64_t token_block_rows = 64;    // T_blk
  int64_t vocab_block_rows = 256;   // V_blk; V need not be a multiple
};

// fp32 [T_blk, V_blk] logits block + fp32 [T_blk, H] dX accumulator + fp32 per-row max, sum,
// target logit + a [T_blk, V_blk] dlogits block in the compute dtype (the GEMM operand).
int64_t blocked_cross_entropy_workspace_bytes(const CrossEntropyArgs& args);
// What blocked_cross_entropy_forward_cpu alone needs: the logits block and the row state.
int64_t blocked_cross_entropy_forward_workspace_bytes(const CrossEntropyArgs& args);
// What blocked_cross_entropy_backward_cpu alone needs: the logits block, the dX accumulator and the
// dlogits block; no row state (it reads the saved lse: 3·T_blk fp32 less than the fused pass).
int64_t blocked_cross_entropy_backward_workspace_bytes(const CrossEntropyArgs& args);
// Writes lse and loss. Per token, over vocab blocks in order, the block's (b = max z,
// Σ e^(z−b)) is merged into the running (m, s) with lse_fold; then lse = m + log s. All fp32.
void blocked_cross_entropy_forward_cpu(const CrossEntropyArgs& args);
// Recomputes each logits block from x, w and the saved lse: dz = g·(e^(z−lse) − onehot),
// rounded to the compute dtype in the dlogits block; dX += dz·W_blk (fp32 across vocab blocks), dW_blk += dzᵀ·X (fp32 across token blocks).
void blocked_cross_entropy_backward_cpu(const CrossEntropyArgs& args);
// Gradients in the forward pass (valid for a terminal loss whose g is known now): per token
// block, the forward fold and then the backward blocks, with the same code and order as
// forward + backward, so lse, loss, d_x and d_w are bitwise equal to the two-call version. With
// one vocab block (vocab_block_rows >= V) the backward reads the logits block the forward left
// instead of recomputing it: 3 GEMMs a token block, as the materialised loss, not 4.
void blocked_cross_entropy_fused_cpu(const CrossEntropyArgs& args);

// The naive schedule: logits [T, V] in the compute dtype, fp32 log-softmax [T, V] and fp32
// d_logits [T, V] all materialised (10 bytes per element in bf16); dW is one GEMM over all T
// with fp32 accumulation inside and its output in the compute dtype.
struct MaterializedCrossEntropyArgs {
  DType dtype = DType::F32;          // storage of x, w, logits, d_x
  const void* x = nullptr;           // [T, H]
  const void* w = nullptr;           // [V, H]
  const void* bias = nullptr;        // [V] compute dtype, or null
  const int32_t* targets = nullptr;  // [T], negative = ignored
  void* logits = nullptr;            // [T, V] compute dtype
  float* log_probs = nullptr;        // [T, V] fp32
  float* d_logits = nullptr;         // [T, V] fp32
  float* lse = nullptr;              // [T] fp32
  float* loss = nullptr;             // [T] fp32
  float grad_scale = 1.0f;
  void* d_x = nullptr;               // [T, H] overwritten
  void* d_w = nullptr;               // [V, H] compute dtype, overwritten
  void* d_bias = nullptr;            // [V] compute dtype, overwritten; with bias, backward
  int64_t tokens = 0;
  int64_t vocab = 0;
  int64_t hidden = 0;
};

void materialized_cross_entropy_forward_cpu(const MaterializedCrossEntropyArgs& args);
void materialized_cross_entropy_backward_cpu(const MaterializedCrossEntropyArgs& args);

// Folds a block's (max, Σ e^(z − max)) into a running (max, sum): the online log-sum-exp step.
FLATPEAK_HD inline void lse_fold(float& running_max, float& running_sum, float block_max,
                                 float block_sum_at_block_max) {
  const float m = running_max > block_max ? running_max : block_max;
  const float old_part = running_max == -INFINITY ? 0.0f : running_sum * expf(running_max - m);
  const float new_part = block_max == -INFINITY ? 0.0f : block_sum_at_block_max * expf(block_max - m);
  running_max = m;
  running_sum = old_part + new_part;
}

// dL/dz for one logit: g · (softmax − onehot).
FLATPEAK_HD inline float cross_entropy_dlogit(float z, float lse, bool is_target, float g) {
  return g * (expf(z - lse) - (is_target ? 1.0f : 0.0f));
}

}  // namespace flatpeak::exec
