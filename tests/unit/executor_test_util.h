// Helpers shared by the executor op tests: int64-indexed buffers, deterministic random inputs,
// fp64 central finite differences and scale-relative comparison.
//   Buf<double> x = random_buf(n, /*seed=*/1);   // fp32-representable values in [-1, 1]
//   Buf<double> g = finite_diff(loss_of_x, x);    // dL/dx by central differences
//   expect_close(got, want, 1e-5, "dx");          // max |got - want| <= 1e-5 · max |want|
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <random>
#include <vector>

#include "executor/ops/dtype.h"

namespace flatpeak::exec::testing {

// A std::vector indexed and sized by int64_t, so test arithmetic stays in int64 like the code.
template <class T>
class Buf {
 public:
  Buf() = default;
  explicit Buf(int64_t n, T value = T{}) : v_(static_cast<size_t>(n), value) {}
  Buf(std::initializer_list<T> init) : v_(init) {}
  template <class I>
  T& operator[](I i) { return v_[static_cast<size_t>(i)]; }
  template <class I>
  const T& operator[](I i) const { return v_[static_cast<size_t>(i)]; }
  int64_t n() const { return static_cast<int64_t>(v_.size()); }
  T* data() { return v_.data(); }
  const T* data() const { return v_.data(); }
  auto begin() { return v_.begin(); }
  auto end() { return v_.end(); }
  auto begin() const { return v_.begin(); }
  auto end() const { return v_.end(); }
  bool operator==(const Buf& o) const { return v_ == o.v_; }

 private:
  std::vector<T> v_;
};
using Vec = Buf<double>;

inline Vec random_buf(int64_t n, uint32_t seed, double scale = 1.0) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<double> dist(-scale, scale);
  Vec v(n);
  for (double& x : v) x = static_cast<double>(static_cast<float>(dist(gen)));  // fp32-exact
  return v;
}
// The same values rounded to bf16 (so bf16 and f32 runs see identical inputs).
inline Vec bf16_exact(const Vec& v) {
  Vec out(v.n());
  for (int64_t i = 0; i < v.n(); ++i) out[i] = to_f32(f32_to_bf16(static_cast<float>(v[i])));
  return out;
}
inline Buf<float> to_f32_buf(const Vec& v) {
  Buf<float> out(v.n());
  for (int64_t i = 0; i < v.n(); ++i) out[i] = static_cast<float>(v[i]);
  return out;
}
inline Buf<Bf16> to_bf16_buf(const Vec& v) {
  Buf<Bf16> out(v.n());
  for (int64_t i = 0; i < v.n(); ++i) out[i] = f32_to_bf16(static_cast<float>(v[i]));
  return out;
}
inline Vec to_f64(const Buf<float>& v) {
  Vec out(v.n());
  for (int64_t i = 0; i < v.n(); ++i) out[i] = v[i];
  return out;
}
inline Vec to_f64(const Buf<Bf16>& v) {
  Vec out(v.n());
  for (int64_t i = 0; i < v.n(); ++i) out[i] = to_f32(v[i]);
  return out;
}
inline double dot(const Vec& a, const Vec& b) {
  double s = 0;
  for (int64_t i = 0; i < a.n(); ++i) s += a[i] * b[i];
  return s;
}
// Central differences of f at x, step h (fp64 throughout).
inline Vec finite_diff(const std::function<double(const Vec&)>& f, Vec x, double h = 1e-6) {
  Vec g(x.n());
  for (int64_t i = 0; i < x.n(); ++i) {
    const double x0 = x[i];
    x[i] = x0 + h;
    const double fp = f(x);
    x[i] = x0 - h;
    const double fm = f(x);
    x[i] = x0;
    g[i] = (fp - fm) / (2 * h);
  }
  return g;
}
// max |got - want| <= rel · max |want|: the error measured against the reference's scale.
inline void expect_close(const Vec& got, const Vec& want, double rel, const char* what) {
  ASSERT_EQ(got.n(), want.n()) << what;
  double max_ref = 0;
  for (double w : want) max_ref = std::max(max_ref, std::abs(w));
  double max_err = 0;
  for (int64_t i = 0; i < got.n(); ++i) max_err = std::max(max_err, std::abs(got[i] - want[i]));
  EXPECT_LE(max_err, rel * (max_ref + 1e-12))
      << what << ": max abs err " << max_err << " vs max |ref| " << max_ref;
}

}  // namespace flatpeak::exec::testing
