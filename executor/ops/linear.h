// Dense projection y = x · W^T (no bias), e.g. the router and attention projections.
//   LinearArgs a{DType::BF16, x, w, y, nullptr, nullptr, nullptr, T, in, out};
//   linear_forward_cpu(a);                    // y [T, out] overwritten
//   a.d_y = dy; a.d_x = dx; a.d_w = dw; linear_backward_cpu(a);  // dx =, dw +=
#pragma once

#include <cstdint>

#include "executor/ops/dtype.h"

namespace flatpeak::exec {

struct LinearArgs {
  DType dtype = DType::F32;  // storage of x, w, y and their gradients (f32 or bf16)
  const void* x = nullptr;   // [T, in]
  const void* w = nullptr;   // [out, in]
  void* y = nullptr;         // [T, out]        forward output (overwritten)
  const void* d_y = nullptr; // [T, out]        backward input
  void* d_x = nullptr;       // [T, in]         overwritten; may be null to skip
  void* d_w = nullptr;       // [out, in]       accumulated (+=); may be null to skip
  int64_t tokens = 0;
  int64_t in_features = 0;
  int64_t out_features = 0;
};

void linear_forward_cpu(const LinearArgs& args);
void linear_backward_cpu(const LinearArgs& args);

}  // namespace flatpeak::exec
