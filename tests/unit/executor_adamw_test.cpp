// AdamW: against an fp64 reference over several steps; bucketed and threaded runs bitwise equal
// to one full-vector step (the update is element-wise with per-step scalars computed once).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "executor/ops/adamw.h"
#include "executor_test_util.h"

namespace flatpeak::exec {
namespace {

using namespace flatpeak::exec::testing;  // NOLINT

struct AdamState {
  Buf<float> p, m, v;
  Buf<Bf16> p16;
};

AdamState fresh_state(int64_t n, uint32_t seed) {
  AdamState s{to_f32_buf(random_buf(n, seed)), Buf<float>(n, 0.0f), Buf<float>(n, 0.0f), Buf<Bf16>(n)};
  return s;
}

AdamWArgs args_for(AdamState& s, const void* grad, DType grad_dtype, int64_t step) {
  AdamWArgs a;
  a.master = s.p.data(); a.m = s.m.data(); a.v = s.v.data(); a.param_out = s.p16.data();
  a.grad = grad; a.grad_dtype = grad_dtype; a.elems = s.p.n(); a.step = step;
  a.lr = 1e-2f; a.beta1 = 0.9f; a.beta2 = 0.95f; a.eps = 1e-8f; a.weight_decay = 0.1f;
  a.grad_scale = 0.5f;
  return a;
}

TEST(ExecutorAdamW, MatchesFp64OverSteps) {
  const int64_t n = 1000;
  AdamState s = fresh_state(n, 71);
  Vec p(n), m(n, 0.0), v(n, 0.0);
  for (int64_t i = 0; i < n; ++i) p[i] = s.p[i];
  for (int64_t step = 1; step <= 5; ++step) {
    const Vec g = random_buf(n, 72 + static_cast<uint32_t>(step), 3.0);
    Buf<float> gf = to_f32_buf(g);
    adamw_step_cpu(args_for(s, gf.data(), DType::F32, step));
    const double lr = 1e-2, b1 = 0.9, b2 = 0.95, eps = 1e-8, wd = 0.1;
    for (int64_t i = 0; i < n; ++i) {
      const double gi = 0.5 * g[i];
      m[i] = b1 * m[i] + (1 - b1) * gi;
      v[i] = b2 * v[i] + (1 - b2) * gi * gi;
      const double mhat = m[i] / (1 - std::pow(b1, step)), vhat = v[i] / (1 - std::pow(b2, step));
      p[i] = p[i] * (1 - lr * wd) - lr * mhat / (std::sqrt(vhat) + eps);
    }
  }
  // fp32 rounding over 5 steps: the parameters move by ~lr per step, so a 1e-6 absolute error
  // (≈ 1e-4 of the step) is far above rounding and far below any formula mistake.
  Vec got(n);
  for (int64_t i = 0; i < n; ++i) got[i] = s.p[i];
  for (int64_t i = 0; i < n; ++i) ASSERT_NEAR(got[i], p[i], 1e-6) << i;
  for (int64_t i = 0; i < n; ++i) ASSERT_NEAR(s.m[i], m[i], 1e-6) << i;
  for (int64_t i = 0; i < n; ++i) ASSERT_NEAR(s.v[i], v[i], 1e-6) << i;
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(s.p16[i].bits, f32_to_bf16(s.p[i]).bits) << i;
}

// Buckets of random sizes (one element, 1000, the remainder) and a threaded run give the same
// bits as one full-vector step, for fp32 and bf16 gradients, over three steps.
TEST(ExecutorAdamW, BucketsAndThreadsBitwiseEqualFullVector) {
  const int64_t n = 4099;
  for (DType gd : {DType::F32, DType::BF16}) {
    AdamState full = fresh_state(n, 81), buckets = fresh_state(n, 81), threaded = fresh_state(n, 81);
    std::mt19937 gen(82);
    for (int64_t step = 1; step <= 3; ++step) {
      const Vec g = random_buf(n, 83 + static_cast<uint32_t>(step));
      Buf<float> gf = to_f32_buf(g);
      Buf<Bf16> gb = to_bf16_buf(g);
      const void* grad = gd == DType::F32 ? static_cast<const void*>(gf.data()) : gb.data();
      const int64_t gbytes = gd == DType::F32 ? 4 : 2;
      adamw_step_cpu(args_for(full, grad, gd, step));
      adamw_step_cpu_threaded(args_for(threaded, grad, gd, step), 3);
      int64_t begin = 0;
      while (begin < n) {
        const int64_t len = std::min<int64_t>(n - begin, 1 + static_cast<int64_t>(gen() % 1000));
        AdamWArgs a = args_for(buckets, static_cast<const char*>(grad) + begin * gbytes, gd, step);
        a.master += begin; a.m += begin; a.v += begin; a.param_out += begin; a.elems = len;
        adamw_step_cpu(a);
        begin += len;
      }
    }
    const size_t fbytes = sizeof(float) * static_cast<size_t>(n);
    for (const AdamState* other : {&buckets, &threaded}) {
      EXPECT_EQ(std::memcmp(full.p.data(), other->p.data(), fbytes), 0);
      EXPECT_EQ(std::memcmp(full.m.data(), other->m.data(), fbytes), 0);
      EXPECT_EQ(std::memcmp(full.v.data(), other->v.data(), fbytes), 0);
      EXPECT_EQ(std::memcmp(full.p16.data(), other->p16.data(), 2 * static_cast<size_t>(n)), 0);
    }
    // The run must actually have moved the parameters (a no-op would also compare equal).
    const AdamState start = fresh_state(n, 81);
    EXPECT_NE(std::memcmp(full.p.data(), start.p.data(), fbytes), 0);
  }
}

TEST(ExecutorAdamW, RejectsBadArguments) {
  AdamState s = fresh_state(4, 91);
  Buf<float> g(4, 0.0f);
  AdamWArgs a = args_for(s, g.data(), DType::F32, 0);
  EXPECT_THROW(adamw_step_cpu(a), std::invalid_argument);
  a.step = 1;
  a.grad_dtype = DType::I32;
  EXPECT_THROW(adamw_step_cpu(a), std::invalid_argument);
}

}  // namespace
}  // namespace flatpeak::exec
