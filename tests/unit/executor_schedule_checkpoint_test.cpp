// The checkpoint component run: offloading any set of boundaries with any prefetch depth is
// bitwise equal to keeping them on the device, and the checkpointed stack (recompute in
// backward) is bitwise equal to the naive one that saves everything; the measured boundary bytes
// of each phase, device and host, are the hand-derived count of [T, H] bf16 tensors it holds.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "executor/memory/tracking_allocator.h"
#include "executor/schedules/checkpoint_schedule.h"

namespace flatpeak::exec {
namespace {

struct Shape {
  int64_t T, H, L;
};
// T not a multiple of the attention tile (32) in the last two; H = 8 gives two-wide heads. Small,
// so that the test stays short under ASan (Debug Eigen): the proofs do not depend on the size.
const Shape kShapes[] = {{64, 16, 3}, {48, 32, 4}, {50, 8, 4}};

CheckpointScheduleConfig config(const Shape& s, std::vector<bool> offloaded, int64_t prefetch, uint64_t seed) {
  CheckpointScheduleConfig c;
  c.tokens = s.T;
  c.hidden = s.H;
  c.layers = s.L;
  c.offloaded = std::move(offloaded);
  c.prefetch = prefetch;
  c.seed = seed;
  return c;
}

struct OffloadCase {
  std::vector<bool> set;
  int64_t prefetch;
};

// Every subset of the layers (as per-layer flags), each with one prefetch depth of 0, 1 and 4 in
// turn, and the all-offloaded set with each of them: every set and every depth (beyond the
// stack, too), without the cross product.
std::vector<OffloadCase> offload_cases(int64_t L) {
  const int64_t depths[] = {0, 1, 4};
  std::vector<OffloadCase> out;
  for (int64_t mask = 0; mask < (int64_t{1} << L); ++mask) {
    std::vector<bool> set(static_cast<size_t>(L));
    for (int64_t l = 0; l < L; ++l) set[static_cast<size_t>(l)] = ((mask >> l) & 1) != 0;
    out.push_back({set, depths[mask % 3]});
  }
  for (int64_t prefetch : depths)
    if (prefetch != depths[((int64_t{1} << L) - 1) % 3]) out.push_back({std::vector<bool>(static_cast<size_t>(L), true), prefetch});
  return out;
}

TEST(ExecutorScheduleCheckpoint, OffloadIsBitwiseKept) {
  for (const Shape& s : kShapes)
    for (uint64_t seed : {1u, 2u}) {
      if (seed == 2 && s.L > 3) continue;  // a second seed on the smallest stack keeps the test short
      TrackingAllocator a0;
      const CheckpointScheduleResult kept = run_checkpoint_schedule(a0, config(s, {}, 0, seed));
      ASSERT_FALSE(kept.d_input.empty());
      for (const auto& [set, prefetch] : offload_cases(s.L)) {
        TrackingAllocator a;
        const CheckpointScheduleResult r = run_checkpoint_schedule(a, config(s, set, prefetch, seed));
        EXPECT_EQ(r.loss, kept.loss);
        EXPECT_EQ(r.d_input, kept.d_input);
        EXPECT_EQ(r.d_weights, kept.d_weights);
        EXPECT_EQ(a.live_allocations(), 0);
      }
    }
}

TEST(ExecutorScheduleCheckpoint, RecomputeIsBitwiseNaive) {
  for (const Shape& s : kShapes)
    for (uint64_t seed : {1u, 2u, 3u}) {
      TrackingAllocator a1, a2;
      const CheckpointScheduleResult ckpt = run_checkpoint_schedule(a1, config(s, {}, 0, seed));
      CheckpointScheduleConfig naive = config(s, {}, 0, seed);
      naive.checkpoint = false;
      const CheckpointScheduleResult ref = run_checkpoint_schedule(a2, naive);
      EXPECT_EQ(ckpt.loss, ref.loss);
      EXPECT_EQ(ckpt.d_input, ref.d_input);
      EXPECT_EQ(ckpt.d_weights, ref.d_weights);
      EXPECT_EQ(static_cast<int64_t>(ckpt.d_weights.size()), checkpoint_weight_gradient_elements(naive));
      // The data is not degenerate: gradients are non-zero and differ by seed.
      float largest = 0.0f;
      for (uint16_t bits : ckpt.d_input) largest = std::max(largest, bf16_value(bits));
      EXPECT_GT(largest, 0.0f);
    }
  TrackingAllocator a1, a2;
  EXPECT_NE(run_checkpoint_schedule(a1, config(kShapes[0], {}, 0, 1)).d_weights,
            run_checkpoint_schedule(a2, config(kShapes[0], {}, 0, 2)).d_weights);
}

// Boundaries ([T, H] bf16 each) a phase holds on the device, by the lifetimes the schedule
// promises: inputs 0..l not offloaded; an offloaded x_l through its layer's forward; in backward,
// x_l and the offloaded ones among the `prefetch` layers below; h_L in the loss phases.
int64_t expected_device_count(const std::string& phase, const std::vector<bool>& off, int64_t prefetch) {
  const auto L = static_cast<int64_t>(off.size());
  auto kept_upto = [&](int64_t l) {
    int64_t n = 0;
    for (int64_t i = 0; i <= l; ++i) n += off[static_cast<size_t>(i)] ? 0 : 1;
    return n;
  };
  if (phase.rfind("loss/", 0) == 0) return kept_upto(L - 1) + 1;
  const int64_t l = std::stoll(phase.substr(phase.find("/L") + 2));
  if (phase.rfind("fwd/", 0) == 0) return kept_upto(l) + (off[static_cast<size_t>(l)] ? 1 : 0);
  int64_t n = kept_upto(l) + (off[static_cast<size_t>(l)] ? 1 : 0);
  for (int64_t i = std::max<int64_t>(0, l - prefetch); i < l; ++i) n += off[static_cast<size_t>(i)] ? 1 : 0;
  return n;
}

TEST(ExecutorScheduleCheckpoint, BoundaryBytesPerPhase) {
  const Shape s{64, 32, 4};
  const int64_t one = s.T * s.H * 2;  // a multiple of the 512-byte alignment
  const std::vector<std::vector<bool>> sets = {{false, false, false, false}, {true, true, true, true},
                                               {true, true, false, false}, {false, true, false, true}};
  for (const auto& set : sets)
    for (int64_t prefetch : {0, 1, 2}) {
      TrackingAllocator alloc({512, -1, -1});
      run_checkpoint_schedule(alloc, config(s, set, prefetch, 1));
      const auto offloaded = std::count(set.begin(), set.end(), true);
      int phases = 0;
      for (const PhaseRecord& r : alloc.phase_records()) {
        if (r.phase == "init" || r.phase.empty()) continue;
        const int64_t got = r.bytes_at_peak[static_cast<size_t>(Category::Boundaries)];
        if (r.space == MemorySpace::Host) {
          EXPECT_EQ(got, offloaded * one) << r.phase;
          continue;
        }
        ++phases;
        EXPECT_EQ(got, expected_device_count(r.phase, set, prefetch) * one) << r.phase << " prefetch " << prefetch;
        // Boundary bytes at the phase's peak are the most the phase holds but for x_{l+1},
        // which appears at the end of the forward FFN phase once the working set is gone.
        if (r.phase.find("fwd/") == 0 && r.phase.find("/ffn") != std::string::npos)
          EXPECT_EQ(r.category_peak_bytes[static_cast<size_t>(Category::Boundaries)], got + one) << r.phase;
        else
          EXPECT_EQ(r.category_peak_bytes[static_cast<size_t>(Category::Boundaries)], got) << r.phase;
      }
      EXPECT_EQ(phases, 4 * 2 + 2 + 4 * 4);  // fwd attn+ffn, loss fwd+bwd, bwd 4 phases per layer
    }
}

TEST(ExecutorScheduleCheckpoint, OffloadLowersTheDevicePeakOfBoundaries) {
  const Shape s{64, 32, 4};
  auto peak = [&](std::vector<bool> set, int64_t prefetch) {
    TrackingAllocator alloc({512, -1, -1});
    run_checkpoint_schedule(alloc, config(s, std::move(set), prefetch, 1));
    int64_t m = 0;
    for (const PhaseRecord& r : alloc.phase_records())
      if (r.space == MemorySpace::Device) m = std::max(m, r.bytes_at_peak[static_cast<size_t>(Category::Boundaries)]);
    return m;
  };
  const int64_t one = s.T * s.H * 2;
  EXPECT_EQ(peak({}, 0), 5 * one);                            // x_0..x_3 and h_L at the loss
  EXPECT_EQ(peak({true, true, true, true}, 1), 2 * one);      // x_l and x_{l-1} prefetched
  EXPECT_EQ(peak({true, true, true, true}, 0), 1 * one);      // synchronous: the one in use
  EXPECT_EQ(peak({true, true, false, false}, 1), 3 * one);    // x_2, x_3, h_L at the loss
}

TEST(ExecutorScheduleCheckpoint, RejectsBadConfig) {
  TrackingAllocator alloc;
  EXPECT_THROW(run_checkpoint_schedule(alloc, config({64, 16, 3}, {true, false}, 0, 1)), std::invalid_argument);
  EXPECT_THROW(run_checkpoint_schedule(alloc, config({64, 16, 3}, {}, -1, 1)), std::invalid_argument);
  CheckpointScheduleConfig naive = config({64, 16, 3}, {true, false, false}, 0, 1);
  naive.checkpoint = false;
  EXPECT_THROW(run_checkpoint_schedule(alloc, naive), std::invalid_argument);
}

}  // namespace
}  // namespace flatpeak::exec
