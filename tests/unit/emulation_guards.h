// Guarded host buffers and the CUDA tests' comparisons, for the tests that run kernel source on
// the host (tests/unit/*_emulation_test.cpp over cuda_emulation.h):
//   Guarded<Bf16> x = input_of<Bf16>(values);   // the values, then kGuard NaN elements
//   Guarded<float> out = output_of<float>(n);   // n + kGuard sentinel elements
//   expect_close("rmsnorm/out", widen(out), want, Tol::of(dtype));  expect_guard_intact("out", out);
// An input read past its end brings a NaN into the result; an output written past its end (or an
// element left unwritten) leaves a sentinel changed (or in place). Tolerances as the CUDA tests'
// (tests/cuda/cuda_test_util.h): fp32 rel 1e-5 + 1e-5 of the largest magnitude, bf16 storage rel
// 1e-2 + 1e-3.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "executor/ops/dtype.h"

namespace flatpeak::exec::emu_test {

constexpr int64_t kGuard = 512;  // elements past the end of every buffer (>= any row here)

template <class T>
constexpr DType dtype_of() {
  return std::is_same_v<T, Bf16> ? DType::BF16 : DType::F32;
}

// Bit patterns no kernel writes in these tests.
template <class T>
T sentinel() {
  if constexpr (std::is_same_v<T, Bf16>) {
    return Bf16{0x7bcd};  // ≈ 2.1e36
  } else if constexpr (std::is_same_v<T, float>) {
    return f32_from_bits(0x7149f2cau);  // ≈ 1e30
  } else if constexpr (std::is_same_v<T, int32_t>) {
    return 0x5a5a5a5a;
  } else if constexpr (std::is_same_v<T, uint8_t>) {
    return uint8_t{0x5a};
  } else {
    return int64_t{0x5a5a5a5a5a5a5a5a};
  }
}

template <class T>
std::string tag(const char* op) {  // "rmsnorm/bf16"
  return std::string(op) + "/" + dtype_name(dtype_of<T>());
}

template <class T>
T quiet_nan() {
  if constexpr (std::is_same_v<T, Bf16>) {
    return f32_to_bf16(std::numeric_limits<float>::quiet_NaN());
  } else {
    return std::numeric_limits<float>::quiet_NaN();
  }
}

template <class T>
bool same_bits(const T& a, const T& b) {
  return std::memcmp(&a, &b, sizeof(T)) == 0;
}

// [n + kGuard]: n elements, then kGuard copies of `guard`.
template <class T>
struct Guarded {
  std::vector<T> data;
  int64_t n = 0;
  T guard{};
  T* ptr() { return data.data(); }
  const T* ptr() const { return data.data(); }
  std::vector<T> head() const { return std::vector<T>(data.begin(), data.begin() + n); }
};

template <class T>
Guarded<T> with_guard(const std::vector<T>& values, T guard) {
  Guarded<T> g;
  g.n = static_cast<int64_t>(values.size());
  g.guard = guard;
  g.data = values;
  g.data.resize(values.size() + static_cast<size_t>(kGuard), guard);
  return g;
}

template <class T>
std::vector<T> stored(const std::vector<float>& values) {  // rounded to T's storage
  std::vector<T> out(values.size());
  for (size_t i = 0; i < values.size(); ++i) store_f32(&out[i], values[i]);
  return out;
}

template <class T>
Guarded<T> input_of(const std::vector<float>& values) {  // NaN past the end
  return with_guard(stored<T>(values), quiet_nan<T>());
}

template <class T>
Guarded<T> inout_of(const std::vector<float>& values) {  // read and written: sentinel past the end
  return with_guard(stored<T>(values), sentinel<T>());
}

template <class T>
Guarded<T> output_of(int64_t n) {  // overwritten: sentinel everywhere, so a skipped element shows
  return with_guard(std::vector<T>(static_cast<size_t>(n), sentinel<T>()), sentinel<T>());
}

template <class T>
std::vector<float> widen(const std::vector<T>& x) {
  std::vector<float> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) out[i] = to_f32(x[i]);
  return out;
}
template <class T>
std::vector<float> widen(const Guarded<T>& x) {
  return widen(x.head());
}

// ±[lo, hi], never zero (as the CUDA tests' Rng::uniform).
inline std::vector<float> uniform(std::mt19937& rng, int64_t n, float lo = 0.05f, float hi = 1.0f) {
  std::uniform_real_distribution<float> magnitude(lo, hi);
  std::bernoulli_distribution negative(0.5);
  std::vector<float> out(static_cast<size_t>(n));
  for (float& x : out) x = negative(rng) ? -magnitude(rng) : magnitude(rng);
  return out;
}

inline std::vector<float> positive(std::mt19937& rng, int64_t n, float lo, float hi) {
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> out(static_cast<size_t>(n));
  for (float& x : out) x = dist(rng);
  return out;
}

struct Tol {
  double rel;
  double floor;
  static Tol f32() { return {1e-5, 1e-5}; }
  static Tol bf16() { return {1e-2, 1e-3}; }
  static Tol of(DType dtype) { return dtype == DType::BF16 ? bf16() : f32(); }
};

// |got − want| <= rel·|want| + floor·max|want| everywhere (NaN fails); the worst element named.
inline void expect_close(const std::string& name, const std::vector<float>& got,
                         const std::vector<float>& want, Tol tol) {
  ASSERT_EQ(got.size(), want.size()) << name;
  double max_want = 0.0;
  for (float w : want) max_want = std::fmax(max_want, std::fabs(static_cast<double>(w)));
  int64_t bad = 0;
  double worst = 0.0;
  std::string detail;
  for (size_t i = 0; i < got.size(); ++i) {
    const double diff = std::fabs(static_cast<double>(got[i]) - static_cast<double>(want[i]));
    const double bound = tol.rel * std::fabs(static_cast<double>(want[i])) + tol.floor * max_want;
    const double ratio = bound > 0.0 ? diff / bound : (diff > 0.0 ? INFINITY : 0.0);
    if (!(ratio <= 1.0)) ++bad;
    if (!(ratio <= worst)) {
      worst = ratio;
      detail = "worst at " + std::to_string(i) + ": got " + std::to_string(got[i]) + " want " +
               std::to_string(want[i]);
    }
  }
  EXPECT_EQ(bad, 0) << name << ": " << detail;
}

// Bitwise equality of the first n elements (copies, integer outputs, in-order sums).
template <class T>
void expect_same(const std::string& name, const Guarded<T>& got, const std::vector<T>& want) {
  ASSERT_EQ(static_cast<size_t>(got.n), want.size()) << name;
  int64_t bad = 0;
  int64_t first = -1;
  for (size_t i = 0; i < want.size(); ++i) {
    if (!same_bits(got.data[i], want[i])) {
      ++bad;
      if (first < 0) first = static_cast<int64_t>(i);
    }
  }
  EXPECT_EQ(bad, 0) << name << ": first difference at " << first;
}

// Nothing past the end written (for an input: nothing written there either).
template <class T>
void expect_guard_intact(const std::string& name, const Guarded<T>& g) {
  int64_t changed = 0;
  for (size_t i = static_cast<size_t>(g.n); i < g.data.size(); ++i) {
    changed += same_bits(g.data[i], g.guard) ? 0 : 1;
  }
  EXPECT_EQ(changed, 0) << name << ": elements past the end written";
}

}  // namespace flatpeak::exec::emu_test
