// Checks shared by the kernel emulation tests (tests/unit/*_emulation_test.cpp over
// cuda_emulation.h): random non-zero inputs as the CUDA tests draw them, guard regions past the end
// of buffers, and the CUDA tests' comparison |got − want| <= rel·|want| + floor·max|want|.
//   std::vector<Bf16> x = with_guard(to_storage<Bf16>(uniform(rng, n)), nan_of<Bf16>());
//   Guarded<float> y = output_of<float>(n);  ... launch ...
//   expect_guard_intact("y", y);  expect_within("y", widen(y), want, kF32Tol);
// An input read past its end brings a NaN into the result; an output written past its end (or an
// element left unwritten, where outputs start as sentinels) leaves a sentinel changed (or in place).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "cuda_emulation.h"
// The emulation header first: it defines what kernel_util.cuh expects from CUDA.
#include "executor/cuda/kernel_util.cuh"
#include "executor/ops/dtype.h"

namespace flatpeak::exec::emu_check {

// grid_for (kernel_util.cuh) under a cap that a test lowers (emu::grid_cap) to run the grid-stride
// loops more than once per thread, as grid_for's own cap (2^20 blocks) does past 2^28 elements.
using cuda_detail::grid_for;
struct BlockCap {
  explicit BlockCap(unsigned cap) { emu::grid_cap() = cap; }
  ~BlockCap() { emu::grid_cap() = ~0u; }
  BlockCap(const BlockCap&) = delete;
  BlockCap& operator=(const BlockCap&) = delete;
};
// While it lives, launches run only the blocks whose x is in xs (emu::block_x_subset).
struct BlockRows {
  explicit BlockRows(const std::vector<unsigned>& xs) { emu::block_x_subset() = &xs; }
  ~BlockRows() { emu::block_x_subset() = nullptr; }
  BlockRows(const BlockRows&) = delete;
  BlockRows& operator=(const BlockRows&) = delete;
};

// Elements past the end of every guarded buffer (>= any row in these tests).
constexpr size_t kGuard = 512;

template <class T>
constexpr DType dtype_of() {
  return std::is_same_v<T, Bf16> ? DType::BF16 : DType::F32;
}

template <class T>
std::string tag(const char* op) {  // "rmsnorm/bf16"
  return std::string(op) + "/" + dtype_name(dtype_of<T>());
}

// ±[lo, hi], as the CUDA tests' Rng::uniform: never zero.
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

template <class T>
T nan_of() {
  T out{};
  store_f32(&out, std::numeric_limits<float>::quiet_NaN());
  return out;
}

// Values no kernel writes in these tests: for float and bf16 about 2.1e36, exact in bf16 (bits
// 0x7bcd0000), far above any value the kernels compute from inputs in ±[0.05, 1].
template <class T>
T sentinel_of() {
  if constexpr (std::is_same_v<T, int32_t>) {
    return 0x5a5a5a5a;
  } else if constexpr (std::is_same_v<T, uint8_t>) {
    return uint8_t{0x5a};
  } else if constexpr (std::is_same_v<T, int64_t>) {
    return int64_t{0x5a5a5a5a5a5a5a5a};
  } else {
    T out{};
    store_f32(&out, f32_from_bits(0x7bcd0000u));
    return out;
  }
}

// For inputs a kernel takes a maximum over: fmaxf drops a NaN, but this huge value becomes the
// maximum and sends a log-sum-exp (and any e^(z − lse)) to ±inf.
template <class T>
T huge_of() {
  return sentinel_of<T>();
}

inline size_t z(int64_t n) {  // a size or index as the vectors take it
  return static_cast<size_t>(n);
}

template <class T>
bool same_bits(const T& a, const T& b) {
  return std::memcmp(&a, &b, sizeof(T)) == 0;
}
// The first n elements of x and y bitwise equal (copies, in-order sums).
template <class T>
bool same_bits(const T* x, const T* y, size_t n) {
  return std::memcmp(x, y, n * sizeof(T)) == 0;
}
template <class T>
bool same_bits(const std::vector<T>& x, const std::vector<T>& y, size_t n) {
  return same_bits(x.data(), y.data(), n);
}

template <class T>
std::vector<T> to_storage(const std::vector<float>& values) {  // rounded to T's storage
  std::vector<T> out(values.size());
  for (size_t i = 0; i < values.size(); ++i) store_f32(&out[i], values[i]);
  return out;
}

// The first n elements (all by default) widened to fp32.
template <class T>
std::vector<float> widen(const std::vector<T>& x, size_t n) {
  std::vector<float> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = to_f32(x[i]);
  return out;
}
template <class T>
std::vector<float> widen(const std::vector<T>& x) {
  return widen(x, x.size());
}

// values, then `count` copies of guard (kGuard elements, or kGuard rows of a row-major tensor).
template <class T>
std::vector<T> with_guard(std::vector<T> values, T guard, size_t count = kGuard) {
  values.insert(values.end(), count, guard);
  return values;
}

// Elements [from, end) of x that differ (bitwise) from guard.
template <class T>
int64_t guard_changed(const std::vector<T>& x, size_t from, T guard) {
  int64_t changed = 0;
  for (size_t i = from; i < x.size(); ++i) changed += same_bits(x[i], guard) ? 0 : 1;
  return changed;
}

template <class T>
void expect_guard(const std::string& name, const std::vector<T>& x, size_t from, T guard) {
  EXPECT_EQ(guard_changed(x, from, guard), 0) << name << ": elements past the end written";
}

// A guarded buffer that remembers its length and guard: [n + kGuard], n elements, then kGuard
// copies of `guard`.
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
Guarded<T> guarded(const std::vector<T>& values, T guard) {
  return Guarded<T>{with_guard(values, guard), static_cast<int64_t>(values.size()), guard};
}

template <class T>
Guarded<T> input_of(const std::vector<float>& values) {  // NaN past the end
  return guarded(to_storage<T>(values), nan_of<T>());
}

template <class T>
Guarded<T> inout_of(const std::vector<float>& values) {  // read and written: sentinel past the end
  return guarded(to_storage<T>(values), sentinel_of<T>());
}

template <class T>
Guarded<T> output_of(int64_t n) {  // overwritten: sentinel everywhere, so a skipped element shows
  return guarded(std::vector<T>(static_cast<size_t>(n), sentinel_of<T>()), sentinel_of<T>());
}

template <class T>
std::vector<float> widen(const Guarded<T>& x) {
  return widen(x.data, static_cast<size_t>(x.n));
}

// Nothing past the end written (for an input: nothing written there either).
template <class T>
void expect_guard_intact(const std::string& name, const Guarded<T>& g) {
  expect_guard(name, g.data, static_cast<size_t>(g.n), g.guard);
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

}  // namespace flatpeak::exec::emu_check
