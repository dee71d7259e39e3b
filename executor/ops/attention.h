// Causal grouped-query attention, tiled with an online softmax: no [T, T] buffer exists; the
// per-row log-sum-exp is saved for backward, which recomputes probabilities tile by tile.
//   AttentionArgs a; a.dtype = DType::BF16; a.q = q; a.k = k; a.v = v; a.out = o; a.lse = lse;
//   a.tokens = T; a.q_heads = 8; a.kv_heads = 2; a.head_dim = 64; a.workspace = ws;
//   attention_forward_cpu(a);  a.d_out = dO; a.d_q = dq; a.d_k = dk; a.d_v = dv; attention_backward_cpu(a);
#pragma once

#include <cmath>
#include <cstdint>

#include "executor/ops/dtype.h"

namespace flatpeak::exec {

struct AttentionArgs {
  DType dtype = DType::F32;     // storage of q, k, v, out and their gradients
  const void* q = nullptr;      // [T, a, d]
  const void* k = nullptr;      // [T, g, d]
  const void* v = nullptr;      // [T, g, dv]
  void* out = nullptr;          // [T, a, dv]  forward output; read by backward
  float* lse = nullptr;         // [a, T] fp32 log-sum-exp of the scaled scores, per query row
  const void* d_out = nullptr;  // [T, a, dv]
  void* d_q = nullptr;          // [T, a, d]  overwritten
  void* d_k = nullptr;          // [T, g, d]  overwritten
  void* d_v = nullptr;          // [T, g, dv]  overwritten
  float* workspace = nullptr;   // attention_workspace_bytes(): fp32 tiles, O(tile · (d + dv))
  int64_t tokens = 0;           // T (one sequence; causal over it)
  int64_t q_heads = 0;          // a; a multiple of kv_heads
  int64_t kv_heads = 0;         // g; query head h reads kv head h / (a / g)
  int64_t head_dim = 0;         // d, of q and k
  int64_t v_head_dim = 0;       // dv, of v and the output; 0 means d (MLA: d = nope + rope, dv apart)
  int64_t tile_rows = 32;       // rows per query tile and per key tile
  float softmax_scale = 0.0f;   // 0 means 1 / sqrt(d)
};

// dv: v_head_dim, or head_dim when it is 0.
inline int64_t attention_v_dim(const AttentionArgs& args) { return args.v_head_dim > 0 ? args.v_head_dim : args.head_dim; }
int64_t attention_workspace_bytes(const AttentionArgs& args);
void attention_forward_cpu(const AttentionArgs& args);
// dK and dV come from a pass over key tiles, dQ from a pass over query tiles; each recomputes
// the probabilities from lse, so every accumulator is a tile (no [T, a, d] fp32 buffer).
void attention_backward_cpu(const AttentionArgs& args);

// The online-softmax fold of one new score block into a row's running (max, sum):
// returns the factor by which earlier sums and outputs must be rescaled.
FLATPEAK_HD inline float online_softmax_rescale(float old_max, float new_max) {
  return old_max == -INFINITY ? 0.0f : expf(old_max - new_max);
}

}  // namespace flatpeak::exec
