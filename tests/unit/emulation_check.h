// Checks shared by the kernel emulation tests (tests/unit/*_emulation_test.cpp): random non-zero
// inputs as the CUDA tests draw them, guard regions past the end of buffers, and the CUDA tests'
// comparison |got − want| <= rel·|want| + floor·max|want|.
//   std::vector<Bf16> x = with_guard(to_storage<Bf16>(uniform(rng, n)), nan_of<Bf16>());
//   std::vector<float> y(n + kGuard, sentinel_of<float>());  ... launch ...
//   expect_guard("y", y, n, sentinel_of<float>());  expect_within("y", got, want, 1e-5, 1e-5);
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "executor/ops/dtype.h"

namespace flatpeak::exec::emu_check {

// Elements past the end of every guarded buffer: NaN in inputs (a read past the end turns an
// output into NaN), a sentinel in outputs (a write past the end changes it).
constexpr size_t kGuard = 64;

// ±[0.05, 1], as the CUDA tests' Rng::uniform: never zero.
inline std::vector<float> uniform(std::mt19937& rng, int64_t n) {
  std::uniform_real_distribution<float> magnitude(0.05f, 1.0f);
  std::bernoulli_distribution negative(0.5);
  std::vector<float> out(static_cast<size_t>(n));
  for (float& x : out) x = negative(rng) ? -magnitude(rng) : magnitude(rng);
  return out;
}

template <class T>
T nan_of() {
  T out{};
  store_f32(&out, std::numeric_limits<float>::quiet_NaN());
  return out;
}
// A finite value no kernel writes here: about 2.1e36, exact in bf16 (its bits 0x7bcd0000).
template <class T>
T sentinel_of() {
  T out{};
  store_f32(&out, f32_from_bits(0x7bcd0000u));
  return out;
}

// For inputs a kernel takes a maximum over: fmaxf drops a NaN, but this huge value becomes the
// maximum and sends a log-sum-exp (and any e^(z − lse)) to ±inf.
template <class T>
T huge_of() {
  return sentinel_of<T>();
}

template <class T>
std::vector<T> to_storage(const std::vector<float>& values) {
  std::vector<T> out(values.size());
  for (size_t i = 0; i < values.size(); ++i) store_f32(&out[i], values[i]);
  return out;
}

// The first n elements widened to fp32.
template <class T>
std::vector<float> widen(const std::vector<T>& x, size_t n) {
  std::vector<float> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = to_f32(x[i]);
  return out;
}

// values, then kGuard copies of guard.
template <class T>
std::vector<T> with_guard(std::vector<T> values, T guard) {
  values.insert(values.end(), kGuard, guard);
  return values;
}

// Elements [from, end) of x that differ (bitwise) from guard.
template <class T>
int64_t guard_changed(const std::vector<T>& x, size_t from, T guard) {
  int64_t changed = 0;
  for (size_t i = from; i < x.size(); ++i) changed += std::memcmp(&x[i], &guard, sizeof(T)) != 0;
  return changed;
}

template <class T>
void expect_guard(const std::string& name, const std::vector<T>& x, size_t from, T guard) {
  EXPECT_EQ(guard_changed(x, from, guard), 0) << name << ": elements past the end written";
}

// Elements of got outside |got − want| <= rel·|want| + floor·max|want| (NaN counts as outside);
// the worst in detail.
inline int64_t count_outside(const std::vector<float>& got, const std::vector<float>& want,
                             double rel, double floor, std::string& detail) {
  if (got.size() != want.size()) {
    detail = std::to_string(got.size()) + " values, expected " + std::to_string(want.size());
    return static_cast<int64_t>(std::max(got.size(), want.size()));
  }
  double max_want = 0.0;
  for (float w : want) max_want = std::max(max_want, std::fabs(static_cast<double>(w)));
  int64_t bad = 0;
  double worst = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double diff = std::fabs(static_cast<double>(got[i]) - static_cast<double>(want[i]));
    const double bound = rel * std::fabs(static_cast<double>(want[i])) + floor * max_want;
    const double ratio = bound > 0.0 ? diff / bound : (diff > 0.0 ? INFINITY : 0.0);
    if (!(ratio <= 1.0)) ++bad;
    if (!(ratio <= worst)) {
      worst = ratio;
      detail = "worst at " + std::to_string(i) + ": got " + std::to_string(got[i]) + " want " +
               std::to_string(want[i]) + " (" + std::to_string(ratio) + " of the bound)";
    }
  }
  return bad;
}

inline void expect_within(const std::string& name, const std::vector<float>& got,
                          const std::vector<float>& want, double rel, double floor) {
  std::string detail;
  EXPECT_EQ(count_outside(got, want, rel, floor, detail), 0) << name << ": " << detail;
}

// The CUDA tests' bounds (tests/cuda/cuda_test_util.h Tol): fp32 and bf16 storage.
struct Tol {
  double rel;
  double floor;
};
constexpr Tol kF32Tol{1e-5, 1e-5};
constexpr Tol kBf16Tol{1e-2, 1e-3};
inline Tol tol_of(DType dtype) { return dtype == DType::BF16 ? kBf16Tol : kF32Tol; }

inline void expect_within(const std::string& name, const std::vector<float>& got,
                          const std::vector<float>& want, Tol tol) {
  expect_within(name, got, want, tol.rel, tol.floor);
}

}  // namespace flatpeak::exec::emu_check
