// Deterministic inputs for the schedules: every value a pure function of (seed, index), so a
// technique and the naive schedule see the same data.
//   fill_bf16(x.data<Bf16>(), x.numel(), seed, 1.0f);   // values in [-1, 1] · scale
#pragma once

#include <cstdint>

#include "executor/ops/dtype.h"

namespace flatpeak::exec {

// SplitMix64: the value at (seed, index).
inline uint64_t mix64(uint64_t seed, uint64_t index) {
  uint64_t z = seed * 0x9E3779B97F4A7C15ULL + index + 0x632BE59BD9B4E019ULL;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}
// Uniform in [-1, 1).
inline float uniform_pm1(uint64_t seed, uint64_t index) {
  return static_cast<float>(static_cast<double>(mix64(seed, index) >> 11) * 0x1.0p-52 - 1.0);
}
// Values at indices first .. first + n − 1 (a rank's slice of a global tensor).
inline void fill_bf16(Bf16* p, int64_t n, uint64_t seed, float scale, int64_t first = 0) {
  for (int64_t i = 0; i < n; ++i) p[i] = f32_to_bf16(scale * uniform_pm1(seed, static_cast<uint64_t>(first + i)));
}
inline void fill_f32(float* p, int64_t n, uint64_t seed, float scale) {
  for (int64_t i = 0; i < n; ++i) p[i] = scale * uniform_pm1(seed, static_cast<uint64_t>(i));
}
inline void fill_targets(int32_t* p, int64_t n, int64_t vocab, uint64_t seed) {
  for (int64_t i = 0; i < n; ++i)
    p[i] = static_cast<int32_t>(mix64(seed, static_cast<uint64_t>(i)) % static_cast<uint64_t>(vocab));
}

}  // namespace flatpeak::exec
