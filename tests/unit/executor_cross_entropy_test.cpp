// Blocked cross-entropy (online log-sum-exp over vocab blocks) against a naive fp64 reference
// and fp64 finite differences; against the materialised schedule within a stated bound; and the
// gradients-in-forward variant bitwise against forward + recompute backward.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>

#include "executor/ops/cross_entropy.h"
#include "executor_test_util.h"

namespace flatpeak::exec {
namespace {

using namespace flatpeak::exec::testing;  // NOLINT

struct CeShape {
  int64_t T, V, H, t_blk, v_blk;
  uint32_t seed;
};
void PrintTo(const CeShape& s, std::ostream* os) {
  *os << "T=" << s.T << " V=" << s.V << " H=" << s.H << " T_blk=" << s.t_blk << " V_blk=" << s.v_blk;
}

// Per-token losses in fp64; `lse` optionally out. Ignored tokens (target < 0) have loss 0.
Vec ce_ref(const Vec& x, const Vec& w, const Buf<int32_t>& y, const CeShape& s, Vec* lse = nullptr, const Vec* bias = nullptr) {
  Vec loss(s.T, 0.0);
  if (lse) *lse = Vec(s.T, 0.0);
  for (int64_t t = 0; t < s.T; ++t) {
    Vec z(s.V);
    double mx = -1e300;
    for (int64_t j = 0; j < s.V; ++j) {
      double acc = bias ? (*bias)[j] : 0.0;
      for (int64_t h = 0; h < s.H; ++h) acc += x[t * s.H + h] * w[j * s.H + h];
      z[j] = acc;
      mx = std::max(mx, acc);
    }
    double sum = 0;
    for (int64_t j = 0; j < s.V; ++j) sum += std::exp(z[j] - mx);
    const double l = mx + std::log(sum);
    if (lse) (*lse)[t] = l;
    if (y[t] >= 0) loss[t] = l - z[y[t]];
  }
  return loss;
}

Buf<int32_t> targets_for(const CeShape& s) {
  Buf<int32_t> y(s.T);
  for (int64_t t = 0; t < s.T; ++t) y[t] = static_cast<int32_t>((t * 7 + s.seed) % static_cast<uint32_t>(s.V));
  y[s.T / 2] = -1;  // one ignored token
  return y;
}

class ExecutorCrossEntropy : public ::testing::TestWithParam<CeShape> {};

TEST_P(ExecutorCrossEntropy, BlockedMatchesFp64AndFiniteDifferences) {
  const CeShape s = GetParam();
  // Scale 2 makes logits of a few units, so the softmax is far from uniform.
  const Vec x = random_buf(s.T * s.H, s.seed, 2.0), w = random_buf(s.V * s.H, s.seed + 100, 2.0);
  const Buf<int32_t> y = targets_for(s);
  Buf<float> xf = to_f32_buf(x), wf = to_f32_buf(w), lse(s.T), loss(s.T), dx(s.T * s.H),
             dw(s.V * s.H, 0.0f);
  CrossEntropyArgs a;
  a.x = xf.data(); a.w = wf.data(); a.targets = y.data(); a.lse = lse.data(); a.loss = loss.data();
  a.d_x = dx.data(); a.d_w = dw.data(); a.tokens = s.T; a.vocab = s.V; a.hidden = s.H;
  a.token_block_rows = s.t_blk; a.vocab_block_rows = s.v_blk;
  a.grad_scale = 1.0f / static_cast<float>(s.T - 1);  // mean over the kept tokens
  // Each pass with a workspace of exactly its own size (under ASan a pass that reached past it
  // would fail): the forward's logits block and row state, the backward's without the row state.
  Buf<float> ws(blocked_cross_entropy_forward_workspace_bytes(a) / 4);
  a.workspace = ws.data();
  blocked_cross_entropy_forward_cpu(a);
  Buf<float> ws_backward(blocked_cross_entropy_backward_workspace_bytes(a) / 4);
  ASSERT_EQ(blocked_cross_entropy_workspace_bytes(a) - blocked_cross_entropy_backward_workspace_bytes(a), 3 * s.t_blk * 4);
  Vec lse_ref;
  const Vec loss_ref = ce_ref(x, w, y, s, &lse_ref);
  expect_close(to_f64(lse), lse_ref, 1e-6, "lse");
  expect_close(to_f64(loss), loss_ref, 1e-5, "loss");
  EXPECT_EQ(loss[s.T / 2], 0.0f);
  a.workspace = ws_backward.data();
  blocked_cross_entropy_backward_cpu(a);
  const double g = 1.0 / static_cast<double>(s.T - 1);
  Vec r(s.T, g);
  const Vec dx_fd = finite_diff([&](const Vec& v) { return dot(ce_ref(v, w, y, s), r); }, x);
  const Vec dw_fd = finite_diff([&](const Vec& v) { return dot(ce_ref(x, v, y, s), r); }, w);
  expect_close(to_f64(dx), dx_fd, 1e-5, "dx");
  expect_close(to_f64(dw), dw_fd, 1e-5, "dw");
  for (int64_t h = 0; h < s.H; ++h) EXPECT_EQ(dx[(s.T / 2) * s.H + h], 0.0f);  // ignored token
}

// Gradients in the forward pass run the same block code in the same order: bitwise equal.
TEST_P(ExecutorCrossEntropy, GradientsInForwardBitwiseEqualRecompute) {
  const CeShape s = GetParam();
  const Vec x = random_buf(s.T * s.H, s.seed + 1, 2.0), w = random_buf(s.V * s.H, s.seed + 2, 2.0);
  const Buf<int32_t> y = targets_for(s);
  for (DType dtype : {DType::F32, DType::BF16}) {
    Buf<float> xf = to_f32_buf(x), wf = to_f32_buf(w);
    Buf<Bf16> xb = to_bf16_buf(x), wb = to_bf16_buf(w);
    const bool bf = dtype == DType::BF16;
    const int64_t dx_bytes = s.T * s.H * (bf ? 2 : 4);
    Buf<float> lse1(s.T), loss1(s.T), dx1(s.T * s.H), dw1(s.V * s.H, 0.0f);
    Buf<float> lse2(s.T), loss2(s.T), dx2(s.T * s.H), dw2(s.V * s.H, 0.0f);
    CrossEntropyArgs a;
    a.dtype = dtype;
    a.x = bf ? static_cast<const void*>(xb.data()) : xf.data();
    a.w = bf ? static_cast<const void*>(wb.data()) : wf.data();
    a.targets = y.data(); a.tokens = s.T; a.vocab = s.V; a.hidden = s.H;
    a.token_block_rows = s.t_blk; a.vocab_block_rows = s.v_blk; a.grad_scale = 0.125f;
    Buf<float> ws(blocked_cross_entropy_workspace_bytes(a) / 4);
    a.workspace = ws.data();
    CrossEntropyArgs b = a;
    a.lse = lse1.data(); a.loss = loss1.data(); a.d_x = dx1.data(); a.d_w = dw1.data();
    b.lse = lse2.data(); b.loss = loss2.data(); b.d_x = dx2.data(); b.d_w = dw2.data();
    blocked_cross_entropy_forward_cpu(a);
    Buf<float> ws_backward(blocked_cross_entropy_backward_workspace_bytes(a) / 4);  // the backward's own, exactly
    a.workspace = ws_backward.data();
    blocked_cross_entropy_backward_cpu(a);
    blocked_cross_entropy_fused_cpu(b);
    EXPECT_EQ(std::memcmp(lse1.data(), lse2.data(), sizeof(float) * static_cast<size_t>(s.T)), 0);
    EXPECT_EQ(std::memcmp(loss1.data(), loss2.data(), sizeof(float) * static_cast<size_t>(s.T)), 0);
    EXPECT_EQ(std::memcmp(dx1.data(), dx2.data(), static_cast<size_t>(dx_bytes)), 0);
    EXPECT_EQ(std::memcmp(dw1.data(), dw2.data(), sizeof(float) * static_cast<size_t>(s.V * s.H)), 0);
  }
}

// Blocked vs materialised, both fp32 storage on the same inputs. They differ only in fp32
// summation order (blockwise merge vs one pass over V), so the bound is a few fp32 ulps of the
// quantities: |Δlse| and |Δloss| <= 1e-5 · max(1, |lse|) (≈ 80 ulps near 1), gradients
// <= 1e-5 of their largest magnitude.
TEST_P(ExecutorCrossEntropy, BlockedMatchesMaterialisedWithinBound) {
  const CeShape s = GetParam();
  const Vec x = random_buf(s.T * s.H, s.seed + 3, 2.0), w = random_buf(s.V * s.H, s.seed + 4, 2.0);
  const Buf<int32_t> y = targets_for(s);
  Buf<float> xf = to_f32_buf(x), wf = to_f32_buf(w);
  Buf<float> lse1(s.T), loss1(s.T), dx1(s.T * s.H), dw1(s.V * s.H, 0.0f);
  CrossEntropyArgs a;
  a.x = xf.data(); a.w = wf.data(); a.targets = y.data(); a.tokens = s.T; a.vocab = s.V;
  a.hidden = s.H; a.token_block_rows = s.t_blk; a.vocab_block_rows = s.v_blk; a.grad_scale = 0.5f;
  a.lse = lse1.data(); a.loss = loss1.data(); a.d_x = dx1.data(); a.d_w = dw1.data();
  Buf<float> ws(blocked_cross_entropy_workspace_bytes(a) / 4);
  a.workspace = ws.data();
  blocked_cross_entropy_fused_cpu(a);

  Buf<float> logits(s.T * s.V), logp(s.T * s.V), dlogits(s.T * s.V), lse2(s.T), loss2(s.T),
      dx2(s.T * s.H), dw2(s.V * s.H, 0.0f);
  MaterializedCrossEntropyArgs m;
  m.x = xf.data(); m.w = wf.data(); m.targets = y.data(); m.logits = logits.data();
  m.log_probs = logp.data(); m.d_logits = dlogits.data(); m.lse = lse2.data(); m.loss = loss2.data();
  m.grad_scale = 0.5f; m.d_x = dx2.data(); m.d_w = dw2.data(); m.tokens = s.T; m.vocab = s.V; m.hidden = s.H;
  materialized_cross_entropy_forward_cpu(m);
  materialized_cross_entropy_backward_cpu(m);
  for (int64_t t = 0; t < s.T; ++t) {
    const double bound = 1e-5 * std::max(1.0, std::abs(static_cast<double>(lse2[t])));
    EXPECT_LE(std::abs(lse1[t] - lse2[t]), bound) << "token " << t;
    EXPECT_LE(std::abs(loss1[t] - loss2[t]), bound) << "token " << t;
  }
  expect_close(to_f64(dx1), to_f64(dx2), 1e-5, "dx blocked vs materialised");
  expect_close(to_f64(dw1), to_f64(dw2), 1e-5, "dw blocked vs materialised");
  // And the materialised schedule itself against fp64.
  expect_close(to_f64(loss2), ce_ref(x, w, y, s), 1e-5, "materialised loss");
}

// V not divisible by the block (V = 50, 37, 97), T not divisible by the token block, one block
// covering everything, and blocks of a single row.
INSTANTIATE_TEST_SUITE_P(Shapes, ExecutorCrossEntropy,
                         ::testing::Values(CeShape{9, 50, 6, 4, 16, 1}, CeShape{7, 37, 5, 64, 256, 2},
                                           CeShape{12, 97, 8, 5, 10, 3}, CeShape{5, 23, 4, 1, 3, 4},
                                           CeShape{66, 70, 5, 64, 64, 5}));

TEST(ExecutorCrossEntropyBf16, Bf16StorageWithinBf16Rounding) {
  const CeShape s{10, 61, 16, 4, 16, 9};
  const Vec x = bf16_exact(random_buf(s.T * s.H, 61)), w = bf16_exact(random_buf(s.V * s.H, 62));
  const Buf<int32_t> y = targets_for(s);
  Buf<Bf16> xb = to_bf16_buf(x), wb = to_bf16_buf(w);
  Buf<float> lse(s.T), loss(s.T);
  CrossEntropyArgs a;
  a.dtype = DType::BF16;
  a.x = xb.data(); a.w = wb.data(); a.targets = y.data(); a.lse = lse.data(); a.loss = loss.data();
  a.tokens = s.T; a.vocab = s.V; a.hidden = s.H; a.token_block_rows = s.t_blk; a.vocab_block_rows = s.v_blk;
  Buf<float> ws(blocked_cross_entropy_workspace_bytes(a) / 4);
  a.workspace = ws.data();
  blocked_cross_entropy_forward_cpu(a);
  // bf16 inputs are exact in fp32 and logits stay fp32, so the fp32 bound still holds.
  expect_close(to_f64(loss), ce_ref(x, w, y, s), 1e-5, "loss bf16 storage");
}

// The LM head bias (Phi-3.5-MoE): logits x·Wᵀ + b. Blocked (recompute and fused) and materialised
// against fp64 and finite differences, d bias included; on V not a multiple of the block and T not
// a multiple of the token block, so the bias of every vocab block and every token block's share of
// d bias are used.
TEST(ExecutorCrossEntropyBias, MatchesFp64AndFiniteDifferences) {
  const CeShape s{9, 50, 6, 4, 16, 11};
  const Vec x = random_buf(s.T * s.H, 71, 2.0), w = random_buf(s.V * s.H, 72, 2.0), b = random_buf(s.V, 73, 2.0);
  const Buf<int32_t> y = targets_for(s);
  Buf<float> xf = to_f32_buf(x), wf = to_f32_buf(w), bf = to_f32_buf(b);
  const double g = 0.25;
  Vec r(s.T, g);
  Vec lse_ref;
  const Vec loss_ref = ce_ref(x, w, y, s, &lse_ref, &b);
  const Vec dx_fd = finite_diff([&](const Vec& v) { return dot(ce_ref(v, w, y, s, nullptr, &b), r); }, x);
  const Vec dw_fd = finite_diff([&](const Vec& v) { return dot(ce_ref(x, v, y, s, nullptr, &b), r); }, w);
  const Vec db_fd = finite_diff([&](const Vec& v) { return dot(ce_ref(x, w, y, s, nullptr, &v), r); }, b);
  // V_blk = V too: one vocab block, where the fused pass reads the forward's biased logits block.
  for (const int64_t v_blk : {s.v_blk, s.V})
  for (const bool fused : {false, true}) {
    Buf<float> lse(s.T), loss(s.T), dx(s.T * s.H), dw(s.V * s.H, 0.0f), db(s.V, 0.0f);
    CrossEntropyArgs a;
    a.x = xf.data(); a.w = wf.data(); a.bias = bf.data(); a.targets = y.data(); a.lse = lse.data();
    a.loss = loss.data(); a.d_x = dx.data(); a.d_w = dw.data(); a.d_bias = db.data(); a.tokens = s.T;
    a.vocab = s.V; a.hidden = s.H; a.token_block_rows = s.t_blk; a.vocab_block_rows = v_blk;
    a.grad_scale = static_cast<float>(g);
    Buf<float> ws(blocked_cross_entropy_workspace_bytes(a) / 4);
    a.workspace = ws.data();
    if (fused) {
      blocked_cross_entropy_fused_cpu(a);
    } else {
      blocked_cross_entropy_forward_cpu(a);
      blocked_cross_entropy_backward_cpu(a);
    }
    SCOPED_TRACE(std::string(fused ? "fused" : "recompute") + " v_blk " + std::to_string(v_blk));
    expect_close(to_f64(lse), lse_ref, 1e-6, "lse");
    expect_close(to_f64(loss), loss_ref, 1e-5, "loss");
    expect_close(to_f64(dx), dx_fd, 1e-5, "dx");
    expect_close(to_f64(dw), dw_fd, 1e-5, "dw");
    expect_close(to_f64(db), db_fd, 1e-5, "d bias");
  }
  Buf<float> logits(s.T * s.V), logp(s.T * s.V), dlogits(s.T * s.V), lse(s.T), loss(s.T), dx(s.T * s.H),
      dw(s.V * s.H), db(s.V);
  MaterializedCrossEntropyArgs m;
  m.x = xf.data(); m.w = wf.data(); m.bias = bf.data(); m.targets = y.data(); m.logits = logits.data();
  m.log_probs = logp.data(); m.d_logits = dlogits.data(); m.lse = lse.data(); m.loss = loss.data();
  m.grad_scale = static_cast<float>(g); m.d_x = dx.data(); m.d_w = dw.data(); m.d_bias = db.data();
  m.tokens = s.T; m.vocab = s.V; m.hidden = s.H;
  materialized_cross_entropy_forward_cpu(m);
  materialized_cross_entropy_backward_cpu(m);
  expect_close(to_f64(loss), loss_ref, 1e-5, "materialised loss");
  expect_close(to_f64(dx), dx_fd, 1e-5, "materialised dx");
  expect_close(to_f64(dw), dw_fd, 1e-5, "materialised dw");
  expect_close(to_f64(db), db_fd, 1e-5, "materialised d bias");
  // A backward without somewhere to put d bias is refused.
  m.d_bias = nullptr;
  EXPECT_THROW(materialized_cross_entropy_backward_cpu(m), std::invalid_argument);
}

TEST(ExecutorCrossEntropyArgs, RejectsTargetsOutOfRange) {
  Buf<float> x(4, 1.0f), w(8, 1.0f), lse(1), loss(1), ws(1024);
  Buf<int32_t> y = {4};
  CrossEntropyArgs a;
  a.x = x.data(); a.w = w.data(); a.targets = y.data(); a.lse = lse.data(); a.loss = loss.data();
  a.workspace = ws.data(); a.tokens = 1; a.vocab = 2; a.hidden = 4;
  EXPECT_THROW(blocked_cross_entropy_forward_cpu(a), std::invalid_argument);
}

}  // namespace
}  // namespace flatpeak::exec
