// Ring-DTP on 4 thread ranks against the single-rank blocked schedule on the same global data
// (vocab_schedule.h on R·T tokens): loss, every rank's dX and every W shard's gradient, for both
// rotations and both backward variants, with V not a multiple of R·V_blk and T not a multiple of
// T_blk; gradients-in-forward bitwise equal to the recompute backward; R = 1 bitwise equal to the
// blocked schedule; the measured vocab bytes at the peak equal to the hand-derived buffers; and a
// result sink receiving dX and dW in place of the result.
//   ctest -R executor_ring_dtp
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "executor/comm/threads_comm.h"
#include "executor/ops/dtype.h"
#include "executor/schedules/ring_dtp_schedule.h"
#include "executor/schedules/vocab_schedule.h"

namespace flatpeak::exec {
namespace {

struct Shape {
  int64_t T, H, V, Tb, Vb;
};
// Per rank T; R = 4. V = 203: shards of 51 rows (the last 50), V_blk 16 leaves a 3-row block in
// every shard; T = 48 with T_blk 20 leaves an 8-row last block. The second shape: one token block
// and one vocabulary block per shard (the planner's defaults), V = 1001 (shard 251, last 248).
const Shape kShapes[] = {{48, 16, 203, 20, 16}, {32, 8, 1001, 32, 251}};

RingDtpConfig ring_config(const Shape& s, int64_t R, RingRotation rotation, bool in_forward, uint64_t seed) {
  RingDtpConfig c;
  c.tokens = s.T; c.hidden = s.H; c.vocab = s.V; c.ring_size = R;
  c.token_block_rows = s.Tb; c.vocab_block_rows = s.Vb;
  c.rotation = rotation; c.gradients_in_forward = in_forward; c.seed = seed;
  return c;
}

struct RankRun {
  RingDtpResult result;
  int64_t vocab_peak_bytes = 0;  // the rank's largest live vocab bytes over its phases
};

std::vector<RankRun> run_ring(const RingDtpConfig& c, int ranks, int64_t alignment = 1) {
  std::vector<RankRun> out(static_cast<size_t>(ranks));
  const RunResult r = run_ranks(ranks, [&](int rank, Communicator& comm) {
    TrackingAllocator alloc({alignment});
    RankRun run;
    run.result = run_ring_dtp_schedule(comm, alloc, c);
    for (const auto& rec : alloc.phase_records())
      if (rec.space == MemorySpace::Device)
        run.vocab_peak_bytes = std::max(run.vocab_peak_bytes, rec.category_peak_bytes[static_cast<size_t>(Category::Vocab)]);
    out[static_cast<size_t>(rank)] = std::move(run);
  });
  EXPECT_TRUE(r.ok()) << r.message;
  return out;
}

VocabScheduleResult reference(const Shape& s, int64_t R, uint64_t seed) {
  VocabScheduleConfig c;
  c.tokens = R * s.T; c.hidden = s.H; c.vocab = s.V; c.token_block_rows = s.Tb; c.vocab_block_rows = s.Vb;
  c.mode = VocabScheduleMode::Blocked; c.seed = seed;
  TrackingAllocator alloc;
  return run_vocab_schedule(alloc, c);
}

float bf16_round(float x) { return to_f32(f32_to_bf16(x)); }

struct Errors {
  double loss = 0, dx = 0, dw = 0;      // largest |ring − reference|
  double dx_scale = 0, dw_scale = 0;    // largest |reference|
};

// dX: the ring's fp32 dX rounded to bf16 (the reference's dX dtype); dW: fp32 on both sides.
Errors compare(const std::vector<RankRun>& ring, const VocabScheduleResult& ref, const Shape& s) {
  Errors e;
  e.loss = std::fabs(ring[0].result.mean_loss - ref.mean_loss);
  for (size_t p = 0; p < ring.size(); ++p) {
    const RingDtpResult& r = ring[p].result;
    EXPECT_EQ(r.mean_loss, ring[0].result.mean_loss) << "every rank reports the ring's mean";
    for (int64_t i = 0; i < s.T * s.H; ++i) {
      const double want = ref.d_x[static_cast<size_t>(static_cast<int64_t>(p) * s.T * s.H + i)];
      e.dx = std::max(e.dx, std::fabs(double(bf16_round(r.d_x[static_cast<size_t>(i)])) - want));
      e.dx_scale = std::max(e.dx_scale, std::fabs(want));
    }
    EXPECT_EQ(r.shard_first_row, static_cast<int64_t>(p) * ((s.V + 3) / 4));
    for (int64_t i = 0; i < r.shard_rows * s.H; ++i) {
      const double want = ref.d_w[static_cast<size_t>(r.shard_first_row * s.H + i)];
      e.dw = std::max(e.dw, std::fabs(double(r.d_w[static_cast<size_t>(i)]) - want));
      e.dw_scale = std::max(e.dw_scale, std::fabs(want));
    }
  }
  int64_t rows = 0;
  for (const auto& r : ring) rows += r.result.shard_rows;
  EXPECT_EQ(rows, s.V) << "the shards cover the vocabulary";
  return e;
}

// Bounds. The ring folds a token's shards in ring order (its own rank's first) and blocks each
// shard on its own, where the reference folds V in one sequence of V_blk blocks; dX sums the
// shards' parts in ring order; a shard's dW sums the ranks' tokens starting at the shard's own
// (weights) or the rank's own block (activations). Each is an fp32 re-association over ≤ 4
// partial sums of a few hundred terms: the loss moves by a few fp32 ulps of lse (lse ≈ 5.3, ulp
// 4.8e-7; bound 1e-6); dX by at most one bf16 rounding step of the largest value (2^-8 relative)
// where the fp32 sum sits next to a rounding boundary; dW by a few fp32 ulps of its largest value
// (bound 1e-5 relative). Measured on these shapes: |Δloss| ≤ 2.8e-8, dX (rounded to bf16)
// bitwise equal, |ΔdW| ≤ 2.0e-6 of the largest dW.
TEST(ExecutorRingDtp, MatchesSingleRankForBothRotationsAndBackwards) {
  for (const Shape& s : kShapes)
    for (RingRotation rot : {RingRotation::Activations, RingRotation::Weights})
      for (bool in_forward : {false, true}) {
        const auto ring = run_ring(ring_config(s, 4, rot, in_forward, 5), 4);
        const VocabScheduleResult ref = reference(s, 4, 5);
        const Errors e = compare(ring, ref, s);
        SCOPED_TRACE(::testing::Message() << "V=" << s.V << " rotation=" << (rot == RingRotation::Weights ? "weights" : "activations")
                                          << " in_forward=" << in_forward);
        EXPECT_LE(e.loss, 1e-6);
        EXPECT_LE(e.dx, std::ldexp(e.dx_scale, -8));
        EXPECT_LE(e.dw, 1e-5 * e.dw_scale);
        EXPECT_GT(e.dx_scale, 0.0);
        EXPECT_GT(e.dw_scale, 0.0);
      }
}

TEST(ExecutorRingDtp, GradientsInForwardAreBitwiseTheRecomputeBackward) {
  for (const Shape& s : kShapes)
    for (RingRotation rot : {RingRotation::Activations, RingRotation::Weights}) {
      const auto rec = run_ring(ring_config(s, 4, rot, false, 9), 4);
      const auto fwd = run_ring(ring_config(s, 4, rot, true, 9), 4);
      for (size_t p = 0; p < 4; ++p) {
        EXPECT_EQ(rec[p].result.loss, fwd[p].result.loss);
        EXPECT_EQ(rec[p].result.d_x, fwd[p].result.d_x);
        EXPECT_EQ(rec[p].result.d_w, fwd[p].result.d_w);
      }
    }
}

// One rank: the ring is the blocked schedule, block for block in the same order.
TEST(ExecutorRingDtp, OneRankIsBitwiseTheBlockedSchedule) {
  for (const Shape& s : kShapes)
    for (RingRotation rot : {RingRotation::Activations, RingRotation::Weights}) {
      const auto ring = run_ring(ring_config(s, 1, rot, false, 3), 1);
      const VocabScheduleResult ref = reference(s, 1, 3);
      const RingDtpResult& r = ring[0].result;
      EXPECT_EQ(r.mean_loss, ref.mean_loss);
      ASSERT_EQ(r.d_x.size(), ref.d_x.size());
      for (size_t i = 0; i < r.d_x.size(); ++i) ASSERT_EQ(bf16_round(r.d_x[i]), ref.d_x[i]) << i;
      EXPECT_EQ(r.d_w, ref.d_w);
    }
}

// Two rings of 2 in a 4-rank communicator: each ring is the single-rank schedule on its own data.
TEST(ExecutorRingDtp, TwoRingsOfTwo) {
  const Shape s = kShapes[0];
  const auto runs = run_ring(ring_config(s, 2, RingRotation::Weights, false, 4), 4);
  const auto one_ring = run_ring(ring_config(s, 2, RingRotation::Weights, false, 4), 2);
  for (size_t p = 0; p < 4; ++p) {
    EXPECT_EQ(runs[p].result.loss, one_ring[p % 2].result.loss);
    EXPECT_EQ(runs[p].result.d_x, one_ring[p % 2].result.d_x);
    EXPECT_EQ(runs[p].result.d_w, one_ring[p % 2].result.d_w);
  }
}

// The vocab peak of every rank, byte for byte (alignment 1), for the shape whose token block is
// T_blk = 20 of T = 48 and V_blk = 16 of a 51-row shard. fp32 = 4, bf16 = 2 bytes.
TEST(ExecutorRingDtp, VocabPeakIsTheHandDerivedBuffers) {
  const Shape s = kShapes[0];
  const int64_t T = s.T, H = s.H, shard = 51, Tb = s.Tb, Vb = s.Vb;
  const int64_t common = T * H * 2 + shard * H * 2 + 2 * T * 4  // X, W shard, lse + loss
                         + Tb * Vb * 4 + Tb * Vb * 2             // logits block, dlogits block
                         + T * H * 4;                            // dX [T, H] fp32
  // Weights (recompute backward): + W shard in flight, dW accumulators at home and arriving.
  const int64_t weights = common + shard * H * 2 + 2 * shard * H * 4;
  // Activations: + X blocks, lse blocks, dX blocks in flight, the dW shard (it stays home).
  const int64_t activations = common + 2 * Tb * H * 2 + 2 * Tb * 4 + 2 * Tb * H * 4 + shard * H * 4;
  const auto w = run_ring(ring_config(s, 4, RingRotation::Weights, false, 1), 4);
  const auto a = run_ring(ring_config(s, 4, RingRotation::Activations, false, 1), 4);
  for (size_t p = 0; p < 4; ++p) {
    EXPECT_EQ(w[p].vocab_peak_bytes, weights) << "rank " << p;
    EXPECT_EQ(a[p].vocab_peak_bytes, activations) << "rank " << p;
  }
}

// With a result sink each rank hands over its dX and its shard's dW (the last shard short) from
// the tracked buffers, bitwise the values the result would hold, and the result keeps neither.
TEST(ExecutorRingDtp, ResultSinkReceivesDxAndDwInsteadOfTheResult) {
  const Shape s = kShapes[0];
  for (RingRotation rot : {RingRotation::Activations, RingRotation::Weights}) {
    const RingDtpConfig plain = ring_config(s, 4, rot, false, 5);
    const auto kept = run_ring(plain, 4);
    std::vector<std::vector<float>> d_x(4), d_w(4);
    std::vector<RingDtpResult> sunk(4);
    const RunResult r = run_ranks(4, [&](int rank, Communicator& comm) {
      RingDtpConfig c = plain;
      c.result_sink = [&](RingDtpResultPart part, int64_t offset, const float* values, int64_t count) {
        std::vector<float>& to = part == RingDtpResultPart::Dx ? d_x[static_cast<size_t>(rank)] : d_w[static_cast<size_t>(rank)];
        ASSERT_EQ(offset, static_cast<int64_t>(to.size()));  // in order
        to.insert(to.end(), values, values + count);
      };
      TrackingAllocator alloc;
      sunk[static_cast<size_t>(rank)] = run_ring_dtp_schedule(comm, alloc, c);
    });
    ASSERT_TRUE(r.ok()) << r.message;
    for (size_t p = 0; p < 4; ++p) {
      EXPECT_EQ(d_x[p], kept[p].result.d_x) << p;
      EXPECT_EQ(d_w[p], kept[p].result.d_w) << p;
      EXPECT_EQ(d_w[p].size(), static_cast<size_t>((p == 3 ? 50 : 51) * s.H)) << p;
      EXPECT_TRUE(sunk[p].d_x.empty() && sunk[p].d_w.empty()) << p;
      EXPECT_EQ(sunk[p].mean_loss, kept[p].result.mean_loss) << p;
      EXPECT_EQ(sunk[p].loss, kept[p].result.loss) << p;
    }
  }
}

TEST(ExecutorRingDtp, RejectsARingThatDoesNotDivideTheRanksAndEmptyShards) {
  const Shape s = kShapes[0];
  RunResult r = run_ranks(4, [&](int, Communicator& comm) {
    TrackingAllocator alloc;
    run_ring_dtp_schedule(comm, alloc, ring_config(s, 3, RingRotation::Weights, false, 1));
  });
  EXPECT_FALSE(r.ok());
  EXPECT_NE(r.message.find("must divide the communicator's 4 ranks"), std::string::npos) << r.message;
  Shape tiny = s;
  tiny.V = 9;  // shards of 3 rows: the fourth would be empty
  r = run_ranks(4, [&](int, Communicator& comm) {
    TrackingAllocator alloc;
    run_ring_dtp_schedule(comm, alloc, ring_config(tiny, 4, RingRotation::Weights, false, 1));
  });
  EXPECT_FALSE(r.ok());
  EXPECT_NE(r.message.find("leaves the last of 4 shards"), std::string::npos) << r.message;
}

}  // namespace
}  // namespace flatpeak::exec
