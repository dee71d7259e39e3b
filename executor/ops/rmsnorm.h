// RMSNorm: y = x · rstd · w with rstd = 1 / sqrt(mean(x²) + eps); rstd is saved for backward.
//   RmsNormArgs a; a.dtype = DType::BF16; a.x = x; a.weight = w; a.out = y; a.rstd = rstd;
//   a.tokens = T; a.hidden = H;  rmsnorm_forward_cpu(a);
//   a.d_out = dy; a.d_x = dx; a.d_weight = dw; a.workspace = ws; rmsnorm_backward_cpu(a);
#pragma once

#include <cmath>
#include <cstdint>

#include "executor/ops/dtype.h"

namespace flatpeak::exec {

struct RmsNormArgs {
  DType dtype = DType::F32;     // storage of x, weight, out and their gradients
  const void* x = nullptr;      // [T, H]
  const void* weight = nullptr; // [H]
  void* out = nullptr;          // [T, H] forward output (overwritten)
  float* rstd = nullptr;        // [T] fp32, written by forward, read by backward
  const void* d_out = nullptr;  // [T, H]
  void* d_x = nullptr;          // [T, H] overwritten
  void* d_weight = nullptr;     // [H] accumulated (+=) once, from an fp32 sum over tokens
  float* workspace = nullptr;   // rmsnorm_workspace_bytes(): [H] fp32 (backward only)
  int64_t tokens = 0;
  int64_t hidden = 0;
  float eps = 1e-6f;
};

int64_t rmsnorm_workspace_bytes(const RmsNormArgs& args);
void rmsnorm_forward_cpu(const RmsNormArgs& args);
void rmsnorm_backward_cpu(const RmsNormArgs& args);

FLATPEAK_HD inline float rmsnorm_rstd(float sum_squares, int64_t hidden, float eps) {
  return 1.0f / sqrtf(sum_squares / static_cast<float>(hidden) + eps);
}

}  // namespace flatpeak::exec
