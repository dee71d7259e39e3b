// Tracking allocator, tensors and bf16 storage: bytes counted per category and space, alignment,
// high-water marks, phase records, capacity errors, round-to-nearest-even.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <utility>

#include "executor/memory/tensor.h"
#include "executor/memory/tracking_allocator.h"

namespace flatpeak::exec {
namespace {

TEST(ExecutorBf16, RoundsToNearestEven) {
  EXPECT_EQ(f32_to_bf16(1.0f).bits, 0x3f80);
  // 1 + 2^-8 lies exactly halfway between 1 and 1 + 2^-7: ties go to the even mantissa (1.0).
  EXPECT_EQ(f32_to_bf16(1.0f + 0x1p-8f).bits, 0x3f80);
  // 1 + 3·2^-8 is halfway between 1 + 2^-7 (odd) and 1 + 2^-6 (even): rounds up.
  EXPECT_EQ(f32_to_bf16(1.0f + 3 * 0x1p-8f).bits, 0x3f82);
  // Just above halfway rounds up.
  EXPECT_EQ(f32_to_bf16(1.0f + 0x1p-8f + 0x1p-20f).bits, 0x3f81);
  EXPECT_EQ(f32_to_bf16(-2.5f).bits, 0xc020);
  EXPECT_EQ(to_f32(f32_to_bf16(3.140625f)), 3.140625f);  // exactly representable
  EXPECT_TRUE(std::isnan(to_f32(f32_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_EQ(to_f32(f32_to_bf16(std::numeric_limits<float>::infinity())),
            std::numeric_limits<float>::infinity());
  // The largest finite float rounds to infinity in bf16 (overflow of the 8-bit mantissa).
  EXPECT_EQ(f32_to_bf16(std::numeric_limits<float>::max()).bits, 0x7f80);
}

TEST(ExecutorAllocator, CountsAlignedBytesPerCategoryAndSpace) {
  TrackingAllocator alloc({/*alignment_bytes=*/256, -1, -1});
  Tensor x(alloc, DType::BF16, {3, 5}, Category::Boundaries, MemorySpace::Host);  // [3, 5] bf16
  EXPECT_EQ(x.bytes(), 30);
  EXPECT_EQ(x.tracked_bytes(), 256);
  Tensor w(alloc, DType::F32, {100}, Category::Params);  // [100] f32 = 400 bytes -> 512
  EXPECT_EQ(alloc.live_bytes(MemorySpace::Host), 256);
  EXPECT_EQ(alloc.live_bytes(MemorySpace::Host, Category::Boundaries), 256);
  EXPECT_EQ(alloc.live_bytes(MemorySpace::Device), 512);
  EXPECT_EQ(alloc.live_bytes(MemorySpace::Device, Category::Params), 512);
  EXPECT_EQ(alloc.live_bytes(MemorySpace::Device, Category::Boundaries), 0);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(w.raw()) % 256, 0u);
  x.reset();
  EXPECT_EQ(alloc.live_bytes(MemorySpace::Host), 0);
  EXPECT_EQ(alloc.high_water_bytes(MemorySpace::Host), 256);
  EXPECT_EQ(alloc.live_allocations(), 1);
}

TEST(ExecutorAllocator, AlignmentOneTracksExactBytes) {
  TrackingAllocator alloc({1, -1, -1});
  Tensor x(alloc, DType::BF16, {7}, Category::Activations);
  EXPECT_EQ(alloc.live_bytes(MemorySpace::Device), 14);
  EXPECT_THROW(TrackingAllocator({24, -1, -1}), std::invalid_argument);
}

TEST(ExecutorAllocator, EmptyTensorHoldsNullAndCountsNothing) {
  TrackingAllocator alloc;
  Tensor x(alloc, DType::F32, {0, 8}, Category::Dispatch);
  EXPECT_TRUE(x.empty());
  EXPECT_EQ(alloc.live_bytes(MemorySpace::Device), 0);
  EXPECT_THROW(Tensor(alloc, DType::F32, {-1}, Category::Dispatch), std::invalid_argument);
}

TEST(ExecutorAllocator, MoveTransfersOwnershipOnce) {
  TrackingAllocator alloc({1, -1, -1});
  Tensor a(alloc, DType::I32, {4}, Category::Dispatch);
  Tensor b = std::move(a);
  EXPECT_TRUE(a.empty());
  EXPECT_EQ(b.data<int32_t>() != nullptr, true);
  EXPECT_THROW(b.data<float>(), std::logic_error);
  Tensor c(alloc, DType::I32, {2}, Category::Dispatch);
  c = std::move(b);  // c's old 8 bytes are released, b's 16 move over
  EXPECT_EQ(alloc.live_bytes(MemorySpace::Device), 16);
  EXPECT_EQ(alloc.live_allocations(), 1);
}

TEST(ExecutorAllocator, HighWaterNamesThePhaseAndSplitsByCategory) {
  TrackingAllocator alloc({1, -1, -1});
  Tensor p(alloc, DType::F32, {10}, Category::Params);  // 40 bytes, phase "init"
  alloc.set_phase("fwd/L0/attn");
  {
    Tensor a(alloc, DType::F32, {25}, Category::Activations);  // 100
    Tensor ws(alloc, DType::F32, {5}, Category::Workspace);    // 20 -> total 160
  }
  alloc.set_phase("fwd/L0/moe");
  Tensor d(alloc, DType::F32, {30}, Category::Dispatch);  // 120 -> total 160 (ties keep the first)
  Tensor d2(alloc, DType::F32, {1}, Category::Dispatch);  // 124 -> total 164
  d.reset();
  EXPECT_EQ(alloc.high_water_bytes(MemorySpace::Device), 164);
  EXPECT_EQ(alloc.high_water_phase(MemorySpace::Device), "fwd/L0/moe");
  const CategoryBytes split = alloc.bytes_at_high_water(MemorySpace::Device);
  EXPECT_EQ(split[static_cast<size_t>(Category::Params)], 40);
  EXPECT_EQ(split[static_cast<size_t>(Category::Dispatch)], 124);

  const std::vector<PhaseRecord> records = alloc.phase_records();
  ASSERT_EQ(records.size(), 6u);  // init, attn, moe x device, host
  EXPECT_EQ(records[0].phase, "init");
  EXPECT_EQ(records[0].peak_bytes, 40);
  EXPECT_EQ(records[2].phase, "fwd/L0/attn");
  EXPECT_EQ(records[2].space, MemorySpace::Device);
  EXPECT_EQ(records[2].peak_bytes, 160);
  EXPECT_EQ(records[2].bytes_at_peak[static_cast<size_t>(Category::Workspace)], 20);
  EXPECT_EQ(records[3].space, MemorySpace::Host);
  EXPECT_EQ(records[3].peak_bytes, 0);
  // The moe phase starts with 40 live; its peak is 164 with dispatch at 124 (its own max too).
  EXPECT_EQ(records[4].peak_bytes, 164);
  EXPECT_EQ(records[4].category_peak_bytes[static_cast<size_t>(Category::Dispatch)], 124);
  EXPECT_EQ(records[4].category_peak_bytes[static_cast<size_t>(Category::Activations)], 0);
}

TEST(ExecutorAllocator, CategoryPeakCanDifferFromSplitAtPeak) {
  TrackingAllocator alloc({1, -1, -1});
  alloc.set_phase("loss/fwd/blk0");
  Tensor a(alloc, DType::F32, {100}, Category::Vocab);  // 400
  a.reset();
  Tensor b(alloc, DType::F32, {50}, Category::Workspace);  // 200
  Tensor c(alloc, DType::F32, {76}, Category::Workspace);  // 504 total
  const PhaseRecord r = alloc.phase_records()[2];
  EXPECT_EQ(r.peak_bytes, 504);
  EXPECT_EQ(r.bytes_at_peak[static_cast<size_t>(Category::Vocab)], 0);
  EXPECT_EQ(r.category_peak_bytes[static_cast<size_t>(Category::Vocab)], 400);
}

TEST(ExecutorAllocator, CapacityIsEnforcedPerSpace) {
  TrackingAllocator alloc({256, /*device_capacity_bytes=*/1024, /*host_capacity_bytes=*/-1});
  Tensor a(alloc, DType::F32, {200}, Category::Params);  // 800 -> 1024 tracked
  try {
    Tensor b(alloc, DType::F32, {1}, Category::Grads);
    FAIL() << "expected OutOfMemory";
  } catch (const OutOfMemory& e) {
    EXPECT_EQ(e.space, MemorySpace::Device);
    EXPECT_EQ(e.requested_bytes, 256);
    EXPECT_EQ(e.live_bytes, 1024);
    EXPECT_STREQ(e.what(), "out of device memory: requested 256 bytes with 1024 live of 1024");
  }
  Tensor h(alloc, DType::F32, {1000}, Category::Optimizer, MemorySpace::Host);  // host unbounded
  EXPECT_EQ(alloc.live_bytes(MemorySpace::Device), 1024);
}

TEST(ExecutorAllocator, ResetRecordsRestartsFromLiveBytes) {
  TrackingAllocator alloc({1, -1, -1});
  Tensor a(alloc, DType::F32, {10}, Category::Params);
  { Tensor b(alloc, DType::F32, {100}, Category::Workspace); }
  alloc.reset_records();
  EXPECT_EQ(alloc.high_water_bytes(MemorySpace::Device), 40);
  EXPECT_EQ(alloc.phase_records().size(), 2u);
}

TEST(ExecutorAllocator, RetagMovesLiveBytesToAnotherCategory) {
  TrackingAllocator alloc({512, -1, -1});
  alloc.set_phase("fwd/embed");
  Tensor x(alloc, DType::BF16, {10, 20}, Category::Activations);  // 400 B -> 512
  Tensor w(alloc, DType::F32, {300}, Category::Fsdp);             // 1200 B -> 1536
  x.set_category(Category::Boundaries);
  EXPECT_EQ(x.category(), Category::Boundaries);
  EXPECT_EQ(alloc.live_bytes(MemorySpace::Device, Category::Activations), 0);
  EXPECT_EQ(alloc.live_bytes(MemorySpace::Device, Category::Boundaries), 512);
  EXPECT_EQ(alloc.live_bytes(MemorySpace::Device), 2048);
  alloc.set_phase("loss/fwd");
  w.set_category(Category::Vocab);
  const auto r = alloc.phase_records();
  // The phase's peak was reached at entry, before the retag: its split stays as it was then.
  EXPECT_EQ(r.back().phase, "loss/fwd");
  EXPECT_EQ(r[r.size() - 2].bytes_at_peak[static_cast<size_t>(Category::Fsdp)], 1536);
  EXPECT_EQ(r[r.size() - 2].category_peak_bytes[static_cast<size_t>(Category::Vocab)], 1536);
  w.reset();
  x.reset();
  EXPECT_EQ(alloc.live_bytes(MemorySpace::Device, Category::Boundaries), 0);
  EXPECT_EQ(alloc.live_bytes(MemorySpace::Device, Category::Vocab), 0);
  EXPECT_EQ(alloc.live_allocations(), 0);
}

TEST(ExecutorAllocator, CategoryNamesRoundTrip) {
  for (int i = 0; i < kCategoryCount; ++i) {
    const auto c = static_cast<Category>(i);
    EXPECT_EQ(category_from_name(category_name(c)), c);
  }
  EXPECT_EQ(category_from_name("param"), std::nullopt);
  EXPECT_STREQ(memory_space_name(MemorySpace::Host), "host");
}

}  // namespace
}  // namespace flatpeak::exec
