// Linear, embedding, RMSNorm and attention CPU ops against naive fp64 references (forward) and
// fp64 central finite differences of those references (backward). Loss for gradient checks:
// L = Σ out ⊙ R with a fixed random R, so dL/dout = R is what each backward receives.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "executor/cpu/gemm_cpu.h"
#include "executor/ops/attention.h"
#include "executor/ops/embedding.h"
#include "executor/ops/layernorm.h"
#include "executor/ops/linear.h"
#include "executor/ops/rmsnorm.h"
#include "executor_test_util.h"

namespace flatpeak::exec {
namespace {

using namespace flatpeak::exec::testing;  // NOLINT

// ---------------------------------------------------------------------------------- linear
Vec linear_ref(const Vec& x, const Vec& w, int64_t T, int64_t in, int64_t out) {
  Vec y(T * out);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t o = 0; o < out; ++o) {
      double s = 0;
      for (int64_t i = 0; i < in; ++i) s += x[t * in + i] * w[o * in + i];
      y[t * out + o] = s;
    }
  return y;
}

TEST(ExecutorLinear, MatchesFp64AndFiniteDifferences) {
  // 70 and 130 cross the GEMM's 64-blocks, so partial blocks are exercised.
  const int64_t T = 70, in = 130, out = 67;
  const Vec x = random_buf(T * in, 1), w = random_buf(out * in, 2), r = random_buf(T * out, 3);
  Buf<float> xf = to_f32_buf(x), wf = to_f32_buf(w), rf = to_f32_buf(r);
  Buf<float> y(T * out), dx(T * in), dw(out * in, 0.5f);
  LinearArgs a{DType::F32, xf.data(), wf.data(), y.data(), rf.data(), dx.data(), dw.data(),
               T, in, out};
  linear_forward_cpu(a);
  expect_close(to_f64(y), linear_ref(x, w, T, in, out), 1e-6, "y");
  linear_backward_cpu(a);
  // dL/dx = R W, dL/dW = Rᵀ x: exact in fp64 by hand (L is bilinear, so FD adds nothing).
  Vec dx_ref(T * in, 0.0), dw_ref(out * in, 0.5);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t o = 0; o < out; ++o)
      for (int64_t i = 0; i < in; ++i) {
        dx_ref[t * in + i] += r[t * out + o] * w[o * in + i];
        dw_ref[o * in + i] += r[t * out + o] * x[t * in + i];
      }
  expect_close(to_f64(dx), dx_ref, 1e-6, "dx");
  expect_close(to_f64(dw), dw_ref, 1e-6, "dw (accumulated onto 0.5)");
}

TEST(ExecutorLinear, Bf16StorageWithinBf16Rounding) {
  const int64_t T = 9, in = 40, out = 11;
  const Vec x = bf16_exact((random_buf(T * in, 4))), w = bf16_exact((random_buf(out * in, 5)));
  Buf<Bf16> xb = to_bf16_buf(x), wb = to_bf16_buf(w), y(T * out);
  LinearArgs a{DType::BF16, xb.data(), wb.data(), y.data(), nullptr, nullptr, nullptr, T, in, out};
  linear_forward_cpu(a);
  // One rounding of an fp32-accumulated value: relative error <= 2^-8 of the largest output.
  expect_close(to_f64(y), linear_ref(x, w, T, in, out), 1.0 / 256, "y bf16");
}

// The GEMM promises each output element the same fp32 sum whatever block of C it is computed
// in: C computed whole equals, bit for bit, C assembled from calls on odd row and column ranges.
TEST(ExecutorGemm, OutputIndependentOfTiling) {
  const int64_t M = 77, N = 70, K = 150;
  const Buf<float> a = to_f32_buf(random_buf(M * K, 18)), b = to_f32_buf(random_buf(N * K, 19));
  Buf<float> whole(M * N), pieces(M * N);
  gemm_cpu(false, true, M, N, K, 1.0f, a.data(), K, b.data(), K, false, whole.data(), N);
  const int64_t row_cuts[] = {0, 5, 69, 77}, col_cuts[] = {0, 3, 66, 70};
  for (int i = 0; i < 3; ++i)
    for (int j = 0; j < 3; ++j) {
      const int64_t r0 = row_cuts[i], c0 = col_cuts[j];
      gemm_cpu(false, true, row_cuts[i + 1] - r0, col_cuts[j + 1] - c0, K, 1.0f, a.data() + r0 * K,
               K, b.data() + c0 * K, K, false, pieces.data() + r0 * N + c0, N);
    }
  EXPECT_EQ(std::memcmp(whole.data(), pieces.data(), sizeof(float) * static_cast<size_t>(M * N)), 0);
}

// ---------------------------------------------------------------------------------- embedding
TEST(ExecutorEmbedding, GathersRowsAndScatterAddsGradientsInOrder) {
  const int64_t T = 6, V = 5, H = 3;
  const Buf<int32_t> ids = {4, 0, 4, 2, 4, 1};
  const Vec table = random_buf(V * H, 6), r = random_buf(T * H, 7);
  Buf<float> tf = to_f32_buf(table), rf = to_f32_buf(r), out(T * H), dt(V * H, 1.0f);
  EmbeddingArgs a;
  a.token_ids = ids.data(); a.table = tf.data(); a.out = out.data(); a.d_out = rf.data();
  a.d_table = dt.data(); a.tokens = T; a.vocab = V; a.hidden = H;
  embedding_forward_cpu(a);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) EXPECT_EQ(out[t * H + h], tf[ids[t] * H + h]);
  embedding_backward_cpu(a);
  for (int64_t h = 0; h < H; ++h) {
    // Row 4 gets tokens 0, 2, 4 added in that order onto 1.0; row 3 is untouched.
    const float want4 = ((1.0f + rf[0 * H + h]) + rf[2 * H + h]) + rf[4 * H + h];
    EXPECT_EQ(dt[4 * H + h], want4);
    EXPECT_EQ(dt[3 * H + h], 1.0f);
    EXPECT_EQ(dt[0 * H + h], 1.0f + rf[1 * H + h]);
  }
  Buf<int32_t> bad = {0, 5};
  a.token_ids = bad.data(); a.tokens = 2;
  try {
    embedding_forward_cpu(a);
    FAIL() << "expected invalid_argument";
  } catch (const std::invalid_argument& e) {
    EXPECT_STREQ(e.what(), "embedding: token_ids[1] = 5 not in 0..4");
  }
}

// ---------------------------------------------------------------------------------- rmsnorm
Vec rmsnorm_ref(const Vec& x, const Vec& w, int64_t T, int64_t H, double eps) {
  Vec y(x.n());
  for (int64_t t = 0; t < T; ++t) {
    double ss = 0;
    for (int64_t h = 0; h < H; ++h) ss += x[t * H + h] * x[t * H + h];
    const double rstd = 1.0 / std::sqrt(ss / static_cast<double>(H) + eps);
    for (int64_t h = 0; h < H; ++h) y[t * H + h] = x[t * H + h] * rstd * w[h];
  }
  return y;
}

TEST(ExecutorRmsNorm, MatchesFp64AndFiniteDifferences) {
  const int64_t T = 5, H = 24;
  const double eps = 1e-5;
  const Vec x = random_buf(T * H, 8, 2.0), w = random_buf(H, 9), r = random_buf(T * H, 10);
  Buf<float> xf = to_f32_buf(x), wf = to_f32_buf(w), rf = to_f32_buf(r), y(T * H),
                     rstd(T), dx(T * H), dw(H, 0.25f), ws(H);
  RmsNormArgs a;
  a.x = xf.data(); a.weight = wf.data(); a.out = y.data(); a.rstd = rstd.data();
  a.d_out = rf.data(); a.d_x = dx.data(); a.d_weight = dw.data(); a.workspace = ws.data();
  a.tokens = T; a.hidden = H; a.eps = static_cast<float>(eps);
  ASSERT_EQ(rmsnorm_workspace_bytes(a), H * 4);
  rmsnorm_forward_cpu(a);
  expect_close(to_f64(y), rmsnorm_ref(x, w, T, H, eps), 1e-6, "y");
  rmsnorm_backward_cpu(a);
  const Vec dx_fd = finite_diff([&](const Vec& xx) { return dot(rmsnorm_ref(xx, w, T, H, eps), r); }, x);
  Vec dw_fd = finite_diff([&](const Vec& ww) { return dot(rmsnorm_ref(x, ww, T, H, eps), r); }, w);
  for (double& g : dw_fd) g += 0.25;
  expect_close(to_f64(dx), dx_fd, 1e-5, "dx");
  expect_close(to_f64(dw), dw_fd, 1e-5, "dw");
}

// ---------------------------------------------------------------------------------- layernorm
Vec layernorm_ref(const Vec& x, const Vec& w, const Vec& b, int64_t T, int64_t H, double eps) {
  Vec y(x.n());
  for (int64_t t = 0; t < T; ++t) {
    double sum = 0, ss = 0;
    for (int64_t h = 0; h < H; ++h) sum += x[t * H + h];
    const double mean = sum / static_cast<double>(H);
    for (int64_t h = 0; h < H; ++h) ss += (x[t * H + h] - mean) * (x[t * H + h] - mean);
    const double rstd = 1.0 / std::sqrt(ss / static_cast<double>(H) + eps);
    for (int64_t h = 0; h < H; ++h) y[t * H + h] = (x[t * H + h] - mean) * rstd * w[h] + b[h];
  }
  return y;
}

// Rows with a large common offset (|mean| ≫ std) as well: a one-pass E[x²] − mean² would lose
// the variance there; the two-pass forward keeps it.
TEST(ExecutorLayerNorm, MatchesFp64AndFiniteDifferences) {
  const int64_t T = 5, H = 24;
  const double eps = 1e-5;
  Vec x = random_buf(T * H, 18, 2.0);
  for (int64_t h = 0; h < H; ++h) x[4 * H + h] += 300.0;
  const Vec w = random_buf(H, 19), b = random_buf(H, 20), r = random_buf(T * H, 21);
  Buf<float> xf = to_f32_buf(x), wf = to_f32_buf(w), bf = to_f32_buf(b), rf = to_f32_buf(r), y(T * H), mean(T),
             rstd(T), dx(T * H), dw(H, 0.25f), db(H, -0.5f), ws(2 * H);
  LayerNormArgs a;
  a.x = xf.data(); a.weight = wf.data(); a.bias = bf.data(); a.out = y.data(); a.mean = mean.data();
  a.rstd = rstd.data(); a.d_out = rf.data(); a.d_x = dx.data(); a.d_weight = dw.data(); a.d_bias = db.data();
  a.workspace = ws.data(); a.tokens = T; a.hidden = H; a.eps = static_cast<float>(eps);
  ASSERT_EQ(layernorm_workspace_bytes(a), 2 * H * 4);
  layernorm_forward_cpu(a);
  expect_close(to_f64(y), layernorm_ref(x, w, b, T, H, eps), 2e-5, "y");
  layernorm_backward_cpu(a);
  const Vec dx_fd = finite_diff([&](const Vec& xx) { return dot(layernorm_ref(xx, w, b, T, H, eps), r); }, x);
  Vec dw_fd = finite_diff([&](const Vec& ww) { return dot(layernorm_ref(x, ww, b, T, H, eps), r); }, w);
  Vec db_fd = finite_diff([&](const Vec& bb) { return dot(layernorm_ref(x, w, bb, T, H, eps), r); }, b);
  for (double& g : dw_fd) g += 0.25;
  for (double& g : db_fd) g -= 0.5;
  // The offset row's x in fp32 is off the fp64 x by up to 300 · 2^-24 ≈ 2e-5, and x̂ with it.
  expect_close(to_f64(dx), dx_fd, 1e-4, "dx");
  expect_close(to_f64(dw), dw_fd, 5e-5, "dw");
  expect_close(to_f64(db), db_fd, 1e-5, "db");
}

// ---------------------------------------------------------------------------------- attention
struct AttnShape {
  int64_t T, a, g, d, tile;
  int64_t dv = 0;  // the value width (0: d)
  int64_t vd() const { return dv > 0 ? dv : d; }
};
void PrintTo(const AttnShape& s, std::ostream* os) {
  *os << "T=" << s.T << " a=" << s.a << " g=" << s.g << " d=" << s.d << " tile=" << s.tile << " dv=" << s.vd();
}

// Naive causal GQA with the full [T, T] score matrix, in fp64.
Vec attention_ref(const Vec& q, const Vec& k, const Vec& v, const AttnShape& s, Vec* lse = nullptr) {
  Vec out(s.T * s.a * s.vd(), 0.0);
  if (lse) *lse = Vec(s.a * s.T, 0.0);
  const double scale = 1.0 / std::sqrt(static_cast<double>(s.d));
  for (int64_t h = 0; h < s.a; ++h) {
    const int64_t kh = h / (s.a / s.g);
    for (int64_t i = 0; i < s.T; ++i) {
      Vec sc(i + 1);
      double mx = -1e300;
      for (int64_t j = 0; j <= i; ++j) {
        double acc = 0;
        for (int64_t e = 0; e < s.d; ++e) acc += q[(i * s.a + h) * s.d + e] * k[(j * s.g + kh) * s.d + e];
        sc[j] = acc * scale;
        mx = std::max(mx, sc[j]);
      }
      double z = 0;
      for (double& x : sc) z += std::exp(x - mx);
      if (lse) (*lse)[h * s.T + i] = mx + std::log(z);
      for (int64_t j = 0; j <= i; ++j) {
        const double p = std::exp(sc[j] - mx) / z;
        for (int64_t e = 0; e < s.vd(); ++e) out[(i * s.a + h) * s.vd() + e] += p * v[(j * s.g + kh) * s.vd() + e];
      }
    }
  }
  return out;
}

class ExecutorAttention : public ::testing::TestWithParam<AttnShape> {};

TEST_P(ExecutorAttention, MatchesFp64AndFiniteDifferences) {
  const AttnShape s = GetParam();
  const Vec q = random_buf(s.T * s.a * s.d, 11, 1.5), k = random_buf(s.T * s.g * s.d, 12, 1.5),
            v = random_buf(s.T * s.g * s.vd(), 13), r = random_buf(s.T * s.a * s.vd(), 14);
  Buf<float> qf = to_f32_buf(q), kf = to_f32_buf(k), vf = to_f32_buf(v), rf = to_f32_buf(r);
  Buf<float> out(r.n()), lse(s.a * s.T), dq(q.n()), dk(k.n()), dv(v.n());
  AttentionArgs a;
  a.q = qf.data(); a.k = kf.data(); a.v = vf.data(); a.out = out.data(); a.lse = lse.data();
  a.d_out = rf.data(); a.d_q = dq.data(); a.d_k = dk.data(); a.d_v = dv.data();
  a.tokens = s.T; a.q_heads = s.a; a.kv_heads = s.g; a.head_dim = s.d; a.tile_rows = s.tile; a.v_head_dim = s.dv;
  Buf<float> ws(attention_workspace_bytes(a) / 4);
  a.workspace = ws.data();
  attention_forward_cpu(a);
  Vec lse_ref;
  expect_close(to_f64(out), attention_ref(q, k, v, s, &lse_ref), 1e-5, "out");
  expect_close(to_f64(lse), lse_ref, 1e-6, "lse");
  attention_backward_cpu(a);
  const Vec dq_fd = finite_diff([&](const Vec& x) { return dot(attention_ref(x, k, v, s), r); }, q);
  const Vec dk_fd = finite_diff([&](const Vec& x) { return dot(attention_ref(q, x, v, s), r); }, k);
  const Vec dv_fd = finite_diff([&](const Vec& x) { return dot(attention_ref(q, k, x, s), r); }, v);
  expect_close(to_f64(dq), dq_fd, 1e-4, "dq");
  expect_close(to_f64(dk), dk_fd, 1e-4, "dk");
  expect_close(to_f64(dv), dv_fd, 1e-4, "dv");
}

// T not a multiple of the tile, one tile, tile of 1, MHA (g = a) and MQA (g = 1); value widths
// narrower and wider than d (MLA: d = nope + rope over dv).
INSTANTIATE_TEST_SUITE_P(Shapes, ExecutorAttention,
                         ::testing::Values(AttnShape{13, 4, 2, 8, 4}, AttnShape{9, 2, 2, 4, 16},
                                           AttnShape{6, 3, 1, 5, 1}, AttnShape{17, 4, 4, 6, 8},
                                           AttnShape{13, 3, 3, 6, 4, 4}, AttnShape{10, 2, 1, 3, 4, 7}));

TEST(ExecutorAttentionBf16, WithinBf16Rounding) {
  const AttnShape s{20, 4, 2, 16, 8};
  const Vec q = bf16_exact((random_buf(s.T * s.a * s.d, 15))),
            k = bf16_exact((random_buf(s.T * s.g * s.d, 16))),
            v = bf16_exact((random_buf(s.T * s.g * s.d, 17)));
  Buf<Bf16> qb = to_bf16_buf(q), kb = to_bf16_buf(k), vb = to_bf16_buf(v), out(q.n());
  Buf<float> lse(s.a * s.T);
  AttentionArgs a;
  a.dtype = DType::BF16;
  a.q = qb.data(); a.k = kb.data(); a.v = vb.data(); a.out = out.data(); a.lse = lse.data();
  a.tokens = s.T; a.q_heads = s.a; a.kv_heads = s.g; a.head_dim = s.d; a.tile_rows = s.tile;
  Buf<float> ws(attention_workspace_bytes(a) / 4);
  a.workspace = ws.data();
  attention_forward_cpu(a);
  expect_close(to_f64(out), attention_ref(q, k, v, s), 1.0 / 128, "out bf16");
  // Backward through bf16 storage: inputs, O and dO are bf16, so gradients carry a few bf16
  // roundings; 2^-6 of the largest gradient bounds them (a wrong formula is off by O(1)).
  const Vec r = bf16_exact(random_buf(s.T * s.a * s.d, 18));
  Buf<Bf16> rb = to_bf16_buf(r), dq(q.n()), dk(k.n()), dv(v.n());
  a.d_out = rb.data(); a.d_q = dq.data(); a.d_k = dk.data(); a.d_v = dv.data();
  attention_backward_cpu(a);
  expect_close(to_f64(dq), finite_diff([&](const Vec& x) { return dot(attention_ref(x, k, v, s), r); }, q),
               1.0 / 64, "dq bf16");
  expect_close(to_f64(dk), finite_diff([&](const Vec& x) { return dot(attention_ref(q, x, v, s), r); }, k),
               1.0 / 64, "dk bf16");
  expect_close(to_f64(dv), finite_diff([&](const Vec& x) { return dot(attention_ref(q, k, x, s), r); }, v),
               1.0 / 64, "dv bf16");
}

}  // namespace
}  // namespace flatpeak::exec
