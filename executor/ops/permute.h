// MoE permutation: the routing plan groups the T·k token copies by expert (stable: within an
// expert, copies keep their (token, slot) order); permute gathers rows into that order and
// unpermute brings expert outputs back to slot order.
//   PermuteArgs a; a.topk_ids = ids; a.tokens = T; a.top_k = k; a.experts = E; a.hidden = H;
//   a.expert_counts = counts; a.slot_to_row = s2r; a.row_to_slot = r2s;  moe_route_cpu(a);
//   a.x = x; a.x_perm = xp; permute_forward_cpu(a);   a.y_perm = yp; a.y_slots = ys; unpermute_forward_cpu(a);
#pragma once

#include <cstdint>

#include "executor/ops/dtype.h"

namespace flatpeak::exec {

struct PermuteArgs {
  DType dtype = DType::F32;           // storage of x, x_perm, y_perm, y_slots and gradients
  const int32_t* topk_ids = nullptr;  // [T, k] experts in 0..E-1, distinct within a token
  int64_t* expert_counts = nullptr;   // [E] rows per expert (moe_route_cpu writes)
  int32_t* slot_to_row = nullptr;     // [T·k] permuted row of copy (t, s) at index t·k + s
  int32_t* row_to_slot = nullptr;     // [T·k] the inverse
  const void* x = nullptr;            // [T, H]
  void* x_perm = nullptr;             // [T·k, H] rows grouped by expert, overwritten
  const void* d_x_perm = nullptr;     // [T·k, H]
  void* d_x = nullptr;                // [T, H] overwritten: Σ over its k copies, s = 0..k-1
  const void* y_perm = nullptr;       // [T·k, H] expert outputs in permuted order
  void* y_slots = nullptr;            // [T, k, H] overwritten
  const void* d_y_slots = nullptr;    // [T, k, H]
  void* d_y_perm = nullptr;           // [T·k, H] overwritten
  int64_t tokens = 0;
  int64_t top_k = 0;
  int64_t experts = 0;
  int64_t hidden = 0;
};

void moe_route_cpu(const PermuteArgs& args);  // counts, slot_to_row, row_to_slot
void permute_forward_cpu(const PermuteArgs& args);
void permute_backward_cpu(const PermuteArgs& args);
void unpermute_forward_cpu(const PermuteArgs& args);
void unpermute_backward_cpu(const PermuteArgs& args);

}  // namespace flatpeak::exec
