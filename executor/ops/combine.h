// MoE combine: out[t] = Σ_{s=0..k-1} w[t,s] · y[t,s], summed in fp32 in slot order s = 0..k-1
// whatever the order experts ran in, so the forward is bitwise independent of dispatch rounds.
//   CombineArgs a; a.y = y_slots; a.weights = w; a.out = out; a.tokens = T; a.top_k = k; a.hidden = H;
//   combine_forward_cpu(a);   a.d_out = dout; a.d_y = dy; a.d_weights = dw; combine_backward_cpu(a);
//   a.slot_to_row = s2r;      // optional: read y in permuted [T·k, H] order (fused unpermute)
#pragma once

#include <cstdint>

#include "executor/ops/dtype.h"

namespace flatpeak::exec {

struct CombineArgs {
  DType dtype = DType::F32;            // storage of y, out, d_out, d_y
  const void* y = nullptr;             // [T, k, H] (or [T·k, H] permuted when slot_to_row)
  const float* weights = nullptr;      // [T, k] fp32 router weights
  const int32_t* slot_to_row = nullptr;  // [T·k] optional, from moe_route_cpu
  void* out = nullptr;                 // [T, H] overwritten
  const void* d_out = nullptr;         // [T, H]
  void* d_y = nullptr;                 // same layout as y, overwritten
  float* d_weights = nullptr;          // [T, k] fp32 overwritten: dot(d_out[t], y[t,s])
  int64_t tokens = 0;
  int64_t top_k = 0;
  int64_t hidden = 0;
};

void combine_forward_cpu(const CombineArgs& args);
void combine_backward_cpu(const CombineArgs& args);

}  // namespace flatpeak::exec
