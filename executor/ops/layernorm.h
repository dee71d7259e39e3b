// LayerNorm (Phi-3.5-MoE's norms): y = (x − mean) · rstd · w + b with rstd = 1 / sqrt(var + eps),
// var the biased variance over H; mean and rstd are saved for backward ([T] fp32 each: the
// planner's "norm mean (saved, LayerNorm)" beside the rstd every norm saves).
//   LayerNormArgs a; a.dtype = DType::BF16; a.x = x; a.weight = w; a.bias = b; a.out = y;
//   a.mean = mean; a.rstd = rstd; a.tokens = T; a.hidden = H;  layernorm_forward_cpu(a);
//   a.d_out = dy; a.d_x = dx; a.d_weight = dw; a.d_bias = db; a.workspace = ws;
//   layernorm_backward_cpu(a);
#pragma once

#include <cmath>
#include <cstdint>

#include "executor/ops/dtype.h"

namespace flatpeak::exec {

struct LayerNormArgs {
  DType dtype = DType::F32;     // storage of x, weight, bias, out and their gradients
  const void* x = nullptr;      // [T, H]
  const void* weight = nullptr; // [H]
  const void* bias = nullptr;   // [H]
  void* out = nullptr;          // [T, H] forward output (overwritten)
  float* mean = nullptr;        // [T] fp32, written by forward, read by backward
  float* rstd = nullptr;        // [T] fp32, written by forward, read by backward
  const void* d_out = nullptr;  // [T, H]
  void* d_x = nullptr;          // [T, H] overwritten
  void* d_weight = nullptr;     // [H] accumulated (+=) once, from an fp32 sum over tokens
  void* d_bias = nullptr;       // [H] accumulated (+=) once, from an fp32 sum over tokens
  float* workspace = nullptr;   // layernorm_workspace_bytes(): [2, H] fp32 (backward only)
  int64_t tokens = 0;
  int64_t hidden = 0;
  float eps = 1e-5f;
};

int64_t layernorm_workspace_bytes(const LayerNormArgs& args);
void layernorm_forward_cpu(const LayerNormArgs& args);
void layernorm_backward_cpu(const LayerNormArgs& args);

// rstd from the sum of squared deviations from the mean (two passes: the one-pass E[x²] − mean²
// cancels badly when |mean| ≫ std).
FLATPEAK_HD inline float layernorm_rstd(float sum_squared_deviations, int64_t hidden, float eps) {
  return 1.0f / sqrtf(sum_squared_deviations / static_cast<float>(hidden) + eps);
}

// One row's mean and rstd as the CPU forward computes and saves them (two passes over the row):
// a step that recomputes them for the backward calls this too, so they are the forward's bit for bit.
template <class T>
inline void layernorm_row_stats(const T* row, int64_t hidden, float eps, float& mean, float& rstd) {
  float sum = 0.0f;
  for (int64_t h = 0; h < hidden; ++h) sum += to_f32(row[h]);
  mean = sum / static_cast<float>(hidden);
  float sum_sq = 0.0f;
  for (int64_t h = 0; h < hidden; ++h) sum_sq += (to_f32(row[h]) - mean) * (to_f32(row[h]) - mean);
  rstd = layernorm_rstd(sum_sq, hidden, eps);
}

// dx for one element: rstd · (g − mean(g) − x̂ · mean(g · x̂)) with g = w ⊙ dy, x̂ = (x − mean) · rstd.
FLATPEAK_HD inline float layernorm_dx(float g, float xhat, float rstd, float mean_g, float mean_g_xhat) {
  return rstd * (g - mean_g - xhat * mean_g_xhat);
}

}  // namespace flatpeak::exec
