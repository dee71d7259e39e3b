// The vocab component run: gradients-in-forward is bitwise equal to forward + recompute backward,
// splitting the loss into per-token-block calls changes no bit, the blocked schedule matches the
// materialised one within the bf16 rounding of the naive logits, and the measured vocab bytes of
// each phase are the hand-derived sum of its buffers.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "executor/memory/tracking_allocator.h"
#include "executor/schedules/vocab_schedule.h"

namespace flatpeak::exec {
namespace {

struct Shape {
  int64_t T, H, V, Tb, Vb;
};
// V never a multiple of V_blk; T not a multiple of T_blk in the last two.
const Shape kShapes[] = {{64, 16, 300, 16, 128}, {96, 32, 517, 40, 100}, {50, 8, 1001, 7, 333}};

VocabScheduleConfig config(const Shape& s, VocabScheduleMode mode, bool in_forward, uint64_t seed) {
  VocabScheduleConfig c;
  c.tokens = s.T; c.hidden = s.H; c.vocab = s.V; c.token_block_rows = s.Tb; c.vocab_block_rows = s.Vb;
  c.mode = mode; c.gradients_in_forward = in_forward; c.seed = seed;
  return c;
}

TEST(ExecutorScheduleVocab, InForwardIsBitwiseRecompute) {
  for (const Shape& s : kShapes)
    for (uint64_t seed : {1u, 2u, 3u}) {
      TrackingAllocator a1, a2;
      const VocabScheduleResult r = run_vocab_schedule(a1, config(s, VocabScheduleMode::Blocked, false, seed));
      const VocabScheduleResult f = run_vocab_schedule(a2, config(s, VocabScheduleMode::Blocked, true, seed));
      EXPECT_EQ(r.mean_loss, f.mean_loss);
      EXPECT_EQ(r.d_x, f.d_x);
      EXPECT_EQ(r.d_w, f.d_w);
    }
}

TEST(ExecutorScheduleVocab, TokenBlockSplitIsBitwise) {
  // One token block covering all of T (one op call) vs the schedule's per-block calls.
  for (const Shape& s : kShapes) {
    TrackingAllocator a1, a2;
    Shape whole = s;
    whole.Tb = s.T;
    const VocabScheduleResult split = run_vocab_schedule(a1, config(s, VocabScheduleMode::Blocked, false, 7));
    const VocabScheduleResult one = run_vocab_schedule(a2, config(whole, VocabScheduleMode::Blocked, false, 7));
    // dW sums over tokens in order in both; dX rows are independent of the split.
    EXPECT_EQ(split.d_x, one.d_x);
    EXPECT_EQ(split.mean_loss, one.mean_loss);
    double max_dw = 0.0;
    for (size_t i = 0; i < one.d_w.size(); ++i) max_dw = std::max(max_dw, std::fabs(double(split.d_w[i]) - one.d_w[i]));
    EXPECT_LE(max_dw, 1e-6) << "T=" << s.T;
  }
}

// Bound: the naive schedule rounds each logit to bf16 (relative 2^-9) before its fp32 log-softmax;
// the loss moves by at most the largest rounding of a logit, |z| ≤ H · max|x| · max|w| = H / 2.
TEST(ExecutorScheduleVocab, BlockedMatchesMaterialisedWithinBf16LogitRounding) {
  for (const Shape& s : kShapes)
    for (uint64_t seed : {1u, 5u}) {
      TrackingAllocator a1, a2;
      const VocabScheduleResult b = run_vocab_schedule(a1, config(s, VocabScheduleMode::Blocked, false, seed));
      const VocabScheduleResult m = run_vocab_schedule(a2, config(s, VocabScheduleMode::Materialized, false, seed));
      const double logit_bound = static_cast<double>(s.H) * 0.5;
      EXPECT_LE(std::fabs(b.mean_loss - m.mean_loss), 2.0 * logit_bound * std::ldexp(1.0, -9));
      EXPECT_GT(b.mean_loss, 0.0);
      double max_dw = 0.0, ref = 0.0;
      for (size_t i = 0; i < b.d_w.size(); ++i) {
        max_dw = std::max(max_dw, std::fabs(double(b.d_w[i]) - m.d_w[i]));
        ref = std::max(ref, std::fabs(double(m.d_w[i])));
      }
      EXPECT_GT(ref, 0.0);
      EXPECT_LE(max_dw, 0.05 * ref) << "T=" << s.T << " V=" << s.V;
    }
}

// W inside a head unit [final norm H | W | head bias V] with the bias applied: W's values and the
// loss without the bias do not depend on the unit around it; with it the loss changes, the blocked
// and materialised runs agree, and the bias's gradient (copied out from after dW) sums to zero
// over V for every token (Σ_j softmax − 1 = 0), so a gradient read from W's or the norm's place
// would show.
TEST(ExecutorScheduleVocab, HeadUnitAndHeadBias) {
  const Shape& s = kShapes[1];
  TrackingAllocator a0, a1, a2, a3;
  const VocabScheduleResult plain = run_vocab_schedule(a0, config(s, VocabScheduleMode::Blocked, false, 1));
  VocabScheduleConfig unit = config(s, VocabScheduleMode::Blocked, false, 1);
  unit.head_unit_before_w = s.H;
  unit.head_unit_after_w = s.V;
  const VocabScheduleResult around = run_vocab_schedule(a1, unit);
  EXPECT_EQ(around.mean_loss, plain.mean_loss);
  EXPECT_EQ(around.d_w, plain.d_w);
  EXPECT_TRUE(around.d_bias.empty());
  unit.head_bias = true;
  const VocabScheduleResult blocked = run_vocab_schedule(a2, unit);
  unit.mode = VocabScheduleMode::Materialized;
  const VocabScheduleResult materialised = run_vocab_schedule(a3, unit);
  EXPECT_NE(blocked.mean_loss, plain.mean_loss);
  EXPECT_NEAR(blocked.mean_loss, materialised.mean_loss, 1e-3);
  ASSERT_EQ(blocked.d_bias.size(), static_cast<size_t>(s.V));
  ASSERT_EQ(materialised.d_bias.size(), static_cast<size_t>(s.V));
  for (const VocabScheduleResult* r : {&blocked, &materialised}) {
    double sum = 0.0, magnitude = 0.0;
    for (float g : r->d_bias) sum += g, magnitude += std::fabs(g);
    EXPECT_GT(magnitude, 0.0);
    EXPECT_LE(std::fabs(sum), 1e-2 * magnitude);
  }
  for (size_t j = 0; j < blocked.d_bias.size(); ++j) EXPECT_NEAR(blocked.d_bias[j], materialised.d_bias[j], 1e-3) << j;
  VocabScheduleConfig short_unit = unit;
  short_unit.head_unit_after_w = s.V - 1;  // no room for the bias
  EXPECT_THROW(run_vocab_schedule(a3, short_unit), std::invalid_argument);
}

TEST(ExecutorScheduleVocab, PhaseBytesAreHandDerived) {
  const Shape s{64, 16, 300, 16, 128};
  TrackingAllocator alloc({1, -1, -1});
  run_vocab_schedule(alloc, config(s, VocabScheduleMode::Blocked, false, 1));
  const int64_t x = 64 * 16 * 2, w = 300 * 16 * 2, lse = 64 * 4, loss = 64 * 4;
  // The forward holds the fp32 logits block and row state; the backward the fp32 logits block,
  // the fp32 dX rows of the token block and the bf16 dlogits block that the dX and dW GEMMs read,
  // but not the row state (it reads the saved lse).
  const int64_t ws_fwd = (16 * 128 + 3 * 16) * 4;
  const int64_t ws = 16 * 128 * 4 + 16 * 16 * 4 + 16 * 128 * 2;
  const int64_t dx = 64 * 16 * 2, dw = 300 * 16 * 4;
  const int64_t dw_naive = 300 * 16 * 2;  // materialised: one GEMM over T, bf16 output
  int64_t fwd = 0, bwd = 0;
  for (const PhaseRecord& r : alloc.phase_records()) {
    if (r.space != MemorySpace::Device) continue;
    const int64_t v = r.bytes_at_peak[static_cast<size_t>(Category::Vocab)];
    if (r.phase.rfind("loss/fwd/blk", 0) == 0) fwd = std::max(fwd, v);
    if (r.phase.rfind("loss/bwd/blk", 0) == 0) bwd = std::max(bwd, v);
  }
  EXPECT_EQ(fwd, x + w + lse + loss + ws_fwd);
  EXPECT_EQ(bwd, x + w + lse + loss + dx + dw + ws);
  EXPECT_EQ(alloc.live_bytes(MemorySpace::Device), 0);

  TrackingAllocator naive({1, -1, -1});
  run_vocab_schedule(naive, config(s, VocabScheduleMode::Materialized, false, 1));
  const int64_t tv = 64 * 300;
  EXPECT_EQ(naive.high_water_bytes(MemorySpace::Device), x + w + 64 * 4 /*targets*/ + lse + loss + tv * 10 + dx + dw_naive);
}

}  // namespace
}  // namespace flatpeak::exec
