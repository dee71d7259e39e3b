// AdamW on fp32 master weights and fp32 m, v, with a bf16 copy of the updated parameters out.
// Element-wise, so any split of the vector into buckets gives bitwise the same result.
//   AdamWArgs a; a.master = p32; a.grad = g; a.grad_dtype = DType::BF16; a.m = m; a.v = v;
//   a.param_out = p16; a.elems = n; a.step = 1; a.lr = 3e-4f;
//   adamw_step_cpu(a);                 // or adamw_step_cpu_threaded(a, 8)
#pragma once

#include <cmath>
#include <cstdint>

#include "executor/ops/dtype.h"

namespace flatpeak::exec {

struct AdamWArgs {
  float* master = nullptr;       // [n] fp32 master weights, updated in place
  const void* grad = nullptr;    // [n] grad_dtype (f32 or bf16)
  DType grad_dtype = DType::F32;
  float* m = nullptr;            // [n] fp32 first moment
  float* v = nullptr;            // [n] fp32 second moment
  Bf16* param_out = nullptr;     // [n] bf16 copy of the updated master; null to skip
  int64_t elems = 0;
  int64_t step = 1;              // t >= 1, for the bias corrections
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;     // decoupled: p ← p · (1 − lr · wd)
  float grad_scale = 1.0f;       // multiplies every gradient (clip factor, 1 / accumulation)
};

// Per-step constants, computed once so that every element (and every bucket) uses the same.
struct AdamWScalars {
  float beta1, beta2, one_minus_beta1, one_minus_beta2;
  float decay;         // 1 − lr · wd
  float step_size;     // lr / (1 − β1^t)
  float inv_sqrt_bc2;  // 1 / sqrt(1 − β2^t)
  float eps, grad_scale;
};

inline AdamWScalars adamw_scalars(const AdamWArgs& a) {
  const double t = static_cast<double>(a.step);
  const double bc1 = 1.0 - std::pow(static_cast<double>(a.beta1), t);
  const double bc2 = 1.0 - std::pow(static_cast<double>(a.beta2), t);
  AdamWScalars s{};
  s.beta1 = a.beta1;
  s.beta2 = a.beta2;
  s.one_minus_beta1 = 1.0f - a.beta1;
  s.one_minus_beta2 = 1.0f - a.beta2;
  s.decay = 1.0f - a.lr * a.weight_decay;
  s.step_size = static_cast<float>(static_cast<double>(a.lr) / bc1);
  s.inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
  s.eps = a.eps;
  s.grad_scale = a.grad_scale;
  return s;
}

// One element: the same formula on every backend.
FLATPEAK_HD inline void adamw_update(float& p, float& m, float& v, float g_raw,
                                     const AdamWScalars& s) {
  const float g = g_raw * s.grad_scale;
  m = s.beta1 * m + s.one_minus_beta1 * g;
  v = s.beta2 * v + s.one_minus_beta2 * (g * g);
  const float denom = sqrtf(v) * s.inv_sqrt_bc2 + s.eps;
  p = p * s.decay - s.step_size * (m / denom);
}

void adamw_step_cpu(const AdamWArgs& args);
// The same update with the vector split into `threads` contiguous parts run concurrently.
void adamw_step_cpu_threaded(const AdamWArgs& args, int threads);

}  // namespace flatpeak::exec
