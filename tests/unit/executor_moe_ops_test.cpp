// MoE ops: router, routing plan + permute/unpermute, SwiGLU expert FFN (grouped) and combine,
// against naive fp64 references and fp64 finite differences; and the whole block composed.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "executor/ops/combine.h"
#include "executor/ops/expert_ffn.h"
#include "executor/ops/permute.h"
#include "executor/ops/router.h"
#include "executor_test_util.h"

namespace flatpeak::exec {
namespace {

using namespace flatpeak::exec::testing;  // NOLINT

// ---------------------------------------------------------------------------------- router
// fp64 reference of the kept weights given the selection (softmax, then renormalise).
Vec router_weights_ref(const Vec& z, const Buf<int32_t>& ids, int64_t T, int64_t E, int64_t k) {
  Vec w(T * k);
  for (int64_t t = 0; t < T; ++t) {
    double mx = -1e300, sum = 0, kept = 0;
    for (int64_t e = 0; e < E; ++e) mx = std::max(mx, z[t * E + e]);
    for (int64_t e = 0; e < E; ++e) sum += std::exp(z[t * E + e] - mx);
    for (int64_t s = 0; s < k; ++s) kept += std::exp(z[t * E + ids[t * k + s]] - mx) / sum;
    for (int64_t s = 0; s < k; ++s) w[t * k + s] = std::exp(z[t * E + ids[t * k + s]] - mx) / sum / kept;
  }
  return w;
}

TEST(ExecutorRouter, TopKRenormalisedAndGradient) {
  const int64_t T = 7, E = 6, k = 3;
  const Vec z = random_buf(T * E, 21, 3.0), r = random_buf(T * k, 22);
  Buf<float> zf = to_f32_buf(z), w(T * k), rf = to_f32_buf(r), dz(T * E);
  Buf<int32_t> ids(T * k);
  RouterArgs a;
  a.logits = zf.data(); a.topk_ids = ids.data(); a.topk_weights = w.data();
  a.d_topk_weights = rf.data(); a.d_logits = dz.data(); a.tokens = T; a.experts = E; a.top_k = k;
  router_forward_cpu(a);
  for (int64_t t = 0; t < T; ++t) {
    // Selection: decreasing logits, and nothing left out beats the last kept.
    for (int64_t s = 1; s < k; ++s) EXPECT_GE(zf[t * E + ids[t * k + s - 1]], zf[t * E + ids[t * k + s]]);
    for (int64_t e = 0; e < E; ++e) {
      bool kept = false;
      for (int64_t s = 0; s < k; ++s) kept = kept || ids[t * k + s] == e;
      if (!kept) {
        EXPECT_LE(zf[t * E + e], zf[t * E + ids[t * k + k - 1]]);
      }
    }
  }
  expect_close(to_f64(w), router_weights_ref(z, ids, T, E, k), 1e-6, "weights");
  router_backward_cpu(a);
  const Vec dz_fd = finite_diff(
      [&](const Vec& zz) { return dot(router_weights_ref(zz, ids, T, E, k), r); }, z);
  expect_close(to_f64(dz), dz_fd, 1e-5, "d_logits");
}

TEST(ExecutorRouter, TiesKeepTheLowerExpert) {
  Buf<float> z = {1.0f, 2.0f, 2.0f, 0.5f};
  Buf<int32_t> ids(2);
  Buf<float> w(2);
  RouterArgs a;
  a.logits = z.data(); a.topk_ids = ids.data(); a.topk_weights = w.data();
  a.tokens = 1; a.experts = 4; a.top_k = 2;
  router_forward_cpu(a);
  EXPECT_EQ(ids[0], 1);
  EXPECT_EQ(ids[1], 2);
  EXPECT_EQ(w[0], 0.5f);
  EXPECT_EQ(w[1], 0.5f);
}

// ---------------------------------------------------------------------------------- permute
TEST(ExecutorPermute, GroupsByExpertStablyAndInverts) {
  const int64_t T = 4, k = 2, E = 3, H = 2;
  Buf<int32_t> ids = {2, 0, 0, 1, 2, 1, 0, 2};  // copies (t, s) in order
  Buf<int64_t> counts(E);
  Buf<int32_t> s2r(T * k), r2s(T * k);
  PermuteArgs a;
  a.topk_ids = ids.data(); a.expert_counts = counts.data(); a.slot_to_row = s2r.data();
  a.row_to_slot = r2s.data(); a.tokens = T; a.top_k = k; a.experts = E; a.hidden = H;
  moe_route_cpu(a);
  EXPECT_EQ(counts, (Buf<int64_t>{3, 2, 3}));
  // Expert 0 gets slots 1, 2, 6; expert 1 slots 3, 5; expert 2 slots 0, 4, 7.
  EXPECT_EQ(r2s, (Buf<int32_t>{1, 2, 6, 3, 5, 0, 4, 7}));
  for (int64_t i = 0; i < T * k; ++i) EXPECT_EQ(r2s[s2r[i]], i);

  Buf<float> x = {0, 1, 10, 11, 20, 21, 30, 31}, xp(T * k * H);
  a.x = x.data(); a.x_perm = xp.data();
  permute_forward_cpu(a);
  EXPECT_EQ(xp, (Buf<float>{0, 1, 10, 11, 30, 31, 10, 11, 20, 21, 0, 1, 20, 21, 30, 31}));
  // Backward sums the k copies of each token; unpermute and its backward are exact gathers.
  Buf<float> dxp(T * k * H), dx(T * H);
  for (int64_t i = 0; i < dxp.n(); ++i) dxp[i] = static_cast<float>(i);
  a.d_x_perm = dxp.data(); a.d_x = dx.data();
  permute_backward_cpu(a);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h)
      EXPECT_EQ(dx[t * H + h], dxp[s2r[t * k] * H + h] + dxp[s2r[t * k + 1] * H + h]);
  Buf<float> ys(T * k * H), back(T * k * H);
  a.y_perm = xp.data(); a.y_slots = ys.data();
  unpermute_forward_cpu(a);
  for (int64_t i = 0; i < T * k; ++i)
    for (int64_t h = 0; h < H; ++h) EXPECT_EQ(ys[i * H + h], x[(i / k) * H + h]);
  a.d_y_slots = ys.data(); a.d_y_perm = back.data();
  unpermute_backward_cpu(a);
  EXPECT_EQ(back, xp);
  ids[3] = 3;
  EXPECT_THROW(moe_route_cpu(a), std::invalid_argument);
}

// ---------------------------------------------------------------------------------- expert FFN
struct FfnShape {
  int64_t E, H, F;
  Buf<int64_t> counts;
  int64_t rows() const {
    int64_t r = 0;
    for (int64_t c : counts) r += c;
    return r;
  }
};

double silu(double x) { return x / (1 + std::exp(-x)); }

Vec ffn_ref(const Vec& x, const Vec& wgu, const Vec& wd, const FfnShape& s) {
  Vec out(s.rows() * s.H, 0.0);
  int64_t row = 0;
  for (int64_t e = 0; e < s.E; ++e) {
    for (int64_t i = 0; i < s.counts[e]; ++i, ++row) {
      Vec h(s.F);
      for (int64_t f = 0; f < s.F; ++f) {
        double g = 0, u = 0;
        for (int64_t j = 0; j < s.H; ++j) {
          g += x[row * s.H + j] * wgu[(e * 2 * s.F + f) * s.H + j];
          u += x[row * s.H + j] * wgu[(e * 2 * s.F + s.F + f) * s.H + j];
        }
        h[f] = silu(g) * u;
      }
      for (int64_t j = 0; j < s.H; ++j)
        for (int64_t f = 0; f < s.F; ++f) out[row * s.H + j] += h[f] * wd[(e * s.H + j) * s.F + f];
    }
  }
  return out;
}

TEST(ExecutorExpertFfn, MatchesFp64AndFiniteDifferences) {
  const FfnShape s{3, 6, 5, {2, 0, 3}};  // an expert with no rows must be skipped cleanly
  const int64_t R = s.rows();
  const Vec x = random_buf(R * s.H, 31), wgu = random_buf(s.E * 2 * s.F * s.H, 32),
            wd = random_buf(s.E * s.H * s.F, 33), r = random_buf(R * s.H, 34);
  Buf<float> xf = to_f32_buf(x), wguf = to_f32_buf(wgu), wdf = to_f32_buf(wd), rf = to_f32_buf(r);
  Buf<float> gu(R * 2 * s.F), out(R * s.H), dx(R * s.H), dwgu(wgu.n(), 0.0f), dwd(wd.n(), 0.0f);
  ExpertFfnArgs a;
  a.x = xf.data(); a.expert_counts = s.counts.data(); a.w_gate_up = wguf.data(); a.w_down = wdf.data();
  a.gate_up = gu.data(); a.out = out.data(); a.d_out = rf.data(); a.d_x = dx.data();
  a.d_w_gate_up = dwgu.data(); a.d_w_down = dwd.data();
  a.rows = R; a.experts = s.E; a.hidden = s.H; a.ffn = s.F;
  EXPECT_EQ(expert_ffn_workspace_bytes(a), 3 * 3 * s.F * 4);
  Buf<float> ws(expert_ffn_workspace_bytes(a) / 4);
  a.workspace = ws.data();
  expert_ffn_forward_cpu(a);
  expect_close(to_f64(out), ffn_ref(x, wgu, wd, s), 1e-6, "out");
  expert_ffn_backward_cpu(a);
  expect_close(to_f64(dx), finite_diff([&](const Vec& v) { return dot(ffn_ref(v, wgu, wd, s), r); }, x),
               1e-5, "dx");
  expect_close(to_f64(dwgu),
               finite_diff([&](const Vec& v) { return dot(ffn_ref(x, v, wd, s), r); }, wgu), 1e-5,
               "dw_gate_up");
  expect_close(to_f64(dwd), finite_diff([&](const Vec& v) { return dot(ffn_ref(x, wgu, v, s), r); }, wd),
               1e-5, "dw_down");
}

// dW across dispatch rounds: each expert's rows split over two backward calls. d_x rows are
// bitwise those of one call (each row depends only on its own inputs). dW differs from the
// one-call sum only by the rounding of the two partial sums before they are added:
// |Δ| <= 3 · 2^-24 · Σ|terms| per element; asserted as <= 1e-6 of the largest |dW|. And dW is
// bitwise (0 + round0) + round1 computed separately: each call adds to dW exactly once.
TEST(ExecutorExpertFfn, WeightGradientsAcrossRoundsWithinBound) {
  const int64_t E = 2, H = 16, F = 12;
  const Buf<int64_t> counts = {70, 9}, c0 = {40, 5}, c1 = {30, 4};  // 70 rows cross a 64-block
  const int64_t R = 79;
  const Vec x = random_buf(R * H, 35), wgu = random_buf(E * 2 * F * H, 36),
            wd = random_buf(E * H * F, 37), r = random_buf(R * H, 38);
  Buf<float> xf = to_f32_buf(x), wguf = to_f32_buf(wgu), wdf = to_f32_buf(wd), rf = to_f32_buf(r);
  auto rows_of = [&](const Buf<float>& src, int64_t width, bool second) {
    Buf<float> out((second ? 34 : 45) * width);
    int64_t dst = 0, base = 0;
    for (int64_t e = 0; e < E; ++e) {
      const int64_t begin = second ? c0[e] : 0, n = second ? c1[e] : c0[e];
      for (int64_t i = 0; i < n; ++i, ++dst)
        for (int64_t j = 0; j < width; ++j) out[dst * width + j] = src[(base + begin + i) * width + j];
      base += counts[e];
    }
    return out;
  };
  auto run = [&](const Buf<float>& xs, const Buf<float>& dys, const Buf<int64_t>& c, Buf<float>& dx,
                 Buf<float>& dwgu, Buf<float>& dwd) {
    int64_t rows = 0;
    for (int64_t v : c) rows += v;
    Buf<float> gu(rows * 2 * F), out(rows * H);
    dx = Buf<float>(rows * H);
    ExpertFfnArgs a;
    a.x = xs.data(); a.expert_counts = c.data(); a.w_gate_up = wguf.data(); a.w_down = wdf.data();
    a.gate_up = gu.data(); a.out = out.data(); a.d_out = dys.data(); a.d_x = dx.data();
    a.d_w_gate_up = dwgu.data(); a.d_w_down = dwd.data(); a.rows = rows; a.experts = E;
    a.hidden = H; a.ffn = F;
    Buf<float> ws(expert_ffn_workspace_bytes(a) / 4);
    a.workspace = ws.data();
    expert_ffn_forward_cpu(a);
    expert_ffn_backward_cpu(a);
  };
  Buf<float> dx1, dwgu1(wgu.n(), 0.0f), dwd1(wd.n(), 0.0f);
  run(xf, rf, counts, dx1, dwgu1, dwd1);
  const Buf<float> x0 = rows_of(xf, H, false), x1 = rows_of(xf, H, true);
  const Buf<float> r0 = rows_of(rf, H, false), r1 = rows_of(rf, H, true);
  Buf<float> dx_a, dx_b, dwgu2(wgu.n(), 0.0f), dwd2(wd.n(), 0.0f);
  run(x0, r0, c0, dx_a, dwgu2, dwd2);
  run(x1, r1, c1, dx_b, dwgu2, dwd2);
  EXPECT_TRUE(rows_of(dx1, H, false) == dx_a);
  EXPECT_TRUE(rows_of(dx1, H, true) == dx_b);
  expect_close(to_f64(dwgu2), to_f64(dwgu1), 1e-6, "dW_gate_up two rounds vs one");
  expect_close(to_f64(dwd2), to_f64(dwd1), 1e-6, "dW_down two rounds vs one");
  Buf<float> dx_tmp, pa(wgu.n(), 0.0f), pb(wgu.n(), 0.0f), qa(wd.n(), 0.0f), qb(wd.n(), 0.0f);
  run(x0, r0, c0, dx_tmp, pa, qa);
  run(x1, r1, c1, dx_tmp, pb, qb);
  for (int64_t i = 0; i < wgu.n(); ++i) ASSERT_EQ(dwgu2[i], (0.0f + pa[i]) + pb[i]) << i;
  for (int64_t i = 0; i < wd.n(); ++i) ASSERT_EQ(dwd2[i], (0.0f + qa[i]) + qb[i]) << i;
}

// ---------------------------------------------------------------------------------- combine
Vec combine_ref(const Vec& y, const Vec& w, int64_t T, int64_t k, int64_t H) {
  Vec out(T * H, 0.0);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t s = 0; s < k; ++s)
      for (int64_t h = 0; h < H; ++h) out[t * H + h] += w[t * k + s] * y[(t * k + s) * H + h];
  return out;
}

TEST(ExecutorCombine, MatchesFp64AndFiniteDifferences) {
  const int64_t T = 5, k = 3, H = 4;
  const Vec y = random_buf(T * k * H, 41), w = random_buf(T * k, 42), r = random_buf(T * H, 43);
  Buf<float> yf = to_f32_buf(y), wf = to_f32_buf(w), rf = to_f32_buf(r), out(T * H),
             dy(T * k * H), dw(T * k);
  CombineArgs a;
  a.y = yf.data(); a.weights = wf.data(); a.out = out.data(); a.d_out = rf.data();
  a.d_y = dy.data(); a.d_weights = dw.data(); a.tokens = T; a.top_k = k; a.hidden = H;
  combine_forward_cpu(a);
  expect_close(to_f64(out), combine_ref(y, w, T, k, H), 1e-6, "out");
  combine_backward_cpu(a);
  expect_close(to_f64(dy), finite_diff([&](const Vec& v) { return dot(combine_ref(v, w, T, k, H), r); }, y),
               1e-6, "dy");
  expect_close(to_f64(dw), finite_diff([&](const Vec& v) { return dot(combine_ref(y, v, T, k, H), r); }, w),
               1e-6, "dw");
}

// ---------------------------------------------------------------------------------- MoE block
// Route -> permute -> expert FFN -> combine, against Σ_s w[t,s] · FFN_{e(t,s)}(x_t) in fp64, and
// the fused unpermute (combine reading permuted rows) bitwise equal to unpermute + combine.
// The expert FFN run in two rounds (each expert's rows split between them) gives bitwise the
// same outputs: every output row depends only on its own input row and the fixed-order sums.
TEST(ExecutorMoeBlock, ComposesAndIsIndependentOfRounds) {
  const int64_t T = 11, E = 4, k = 2, H = 8, F = 6;
  const Vec x = random_buf(T * H, 51), z = random_buf(T * E, 52, 2.0),
            wgu = random_buf(E * 2 * F * H, 53), wd = random_buf(E * H * F, 54);
  Buf<float> xf = to_f32_buf(x), zf = to_f32_buf(z), wguf = to_f32_buf(wgu), wdf = to_f32_buf(wd);
  Buf<int32_t> ids(T * k), s2r(T * k), r2s(T * k);
  Buf<float> w(T * k);
  RouterArgs ra;
  ra.logits = zf.data(); ra.topk_ids = ids.data(); ra.topk_weights = w.data();
  ra.tokens = T; ra.experts = E; ra.top_k = k;
  router_forward_cpu(ra);
  Buf<int64_t> counts(E);
  PermuteArgs pa;
  pa.topk_ids = ids.data(); pa.expert_counts = counts.data(); pa.slot_to_row = s2r.data();
  pa.row_to_slot = r2s.data(); pa.tokens = T; pa.top_k = k; pa.experts = E; pa.hidden = H;
  moe_route_cpu(pa);
  Buf<float> xp(T * k * H), gu(T * k * 2 * F), yp(T * k * H), ys(T * k * H);
  pa.x = xf.data(); pa.x_perm = xp.data();
  permute_forward_cpu(pa);
  ExpertFfnArgs fa;
  fa.x = xp.data(); fa.expert_counts = counts.data(); fa.w_gate_up = wguf.data();
  fa.w_down = wdf.data(); fa.gate_up = gu.data(); fa.out = yp.data();
  fa.rows = T * k; fa.experts = E; fa.hidden = H; fa.ffn = F;
  Buf<float> ws(expert_ffn_workspace_bytes(fa) / 4);
  fa.workspace = ws.data();
  expert_ffn_forward_cpu(fa);
  pa.y_perm = yp.data(); pa.y_slots = ys.data();
  unpermute_forward_cpu(pa);
  Buf<float> out(T * H), out_fused(T * H);
  CombineArgs ca;
  ca.y = ys.data(); ca.weights = w.data(); ca.out = out.data(); ca.tokens = T; ca.top_k = k; ca.hidden = H;
  combine_forward_cpu(ca);
  ca.y = yp.data(); ca.slot_to_row = s2r.data(); ca.out = out_fused.data();
  combine_forward_cpu(ca);
  EXPECT_EQ(std::memcmp(out.data(), out_fused.data(), sizeof(float) * T * H), 0);

  Vec want(T * H, 0.0);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t s = 0; s < k; ++s) {
      const int64_t e = ids[t * k + s];
      FfnShape one{1, H, F, {1}};
      Vec xt(H), wgu_e(2 * F * H), wd_e(H * F);
      for (int64_t j = 0; j < H; ++j) xt[j] = x[t * H + j];
      for (int64_t j = 0; j < 2 * F * H; ++j) wgu_e[j] = wgu[e * 2 * F * H + j];
      for (int64_t j = 0; j < H * F; ++j) wd_e[j] = wd[e * H * F + j];
      const Vec y1 = ffn_ref(xt, wgu_e, wd_e, one);
      for (int64_t j = 0; j < H; ++j) want[t * H + j] += static_cast<double>(w[t * k + s]) * y1[j];
    }
  expect_close(to_f64(out), want, 1e-6, "moe block");

  // Two rounds: round 0 takes the first half (rounded up) of each expert's rows, round 1 the rest.
  Buf<int64_t> c0(E), c1(E);
  for (int64_t e = 0; e < E; ++e) { c0[e] = (counts[e] + 1) / 2; c1[e] = counts[e] - c0[e]; }
  Buf<float> x0, x1, g0, g1, y0, y1;
  auto run_round = [&](const Buf<int64_t>& c, bool first, Buf<float>& xr, Buf<float>& gr, Buf<float>& yr) {
    int64_t rows = 0;
    for (int64_t v : c) rows += v;
    xr = Buf<float>(rows * H); gr = Buf<float>(rows * 2 * F); yr = Buf<float>(rows * H);
    int64_t src = 0, dst = 0;
    for (int64_t e = 0; e < E; ++e) {
      const int64_t skip = first ? 0 : c0[e];
      for (int64_t i = 0; i < c[e]; ++i, ++dst)
        for (int64_t j = 0; j < H; ++j) xr[dst * H + j] = xp[(src + skip + i) * H + j];
      src += counts[e];
    }
    ExpertFfnArgs r = fa;
    r.x = xr.data(); r.expert_counts = c.data(); r.gate_up = gr.data(); r.out = yr.data(); r.rows = rows;
    expert_ffn_forward_cpu(r);
  };
  run_round(c0, true, x0, g0, y0);
  run_round(c1, false, x1, g1, y1);
  int64_t src = 0, r0 = 0, r1 = 0;
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t i = 0; i < counts[e]; ++i) {
      const bool first = i < c0[e];
      const float* got = first ? &y0[(r0 + i) * H] : &y1[(r1 + i - c0[e]) * H];
      EXPECT_EQ(std::memcmp(got, &yp[(src + i) * H], sizeof(float) * H), 0) << "expert " << e << " row " << i;
    }
    src += counts[e]; r0 += c0[e]; r1 += c1[e];
  }
}

}  // namespace
}  // namespace flatpeak::exec
