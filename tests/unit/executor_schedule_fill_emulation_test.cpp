// The device fill kernels (executor/cuda/schedule_fill_kernels.cuh) run on the host through
// cuda_emulation.h through the launchers fill_bf16_cuda and fill_targets_cuda themselves
// (grid_for(n) blocks of kThreads), and also with the grid capped to one block so that the
// grid-stride loop wraps. They must equal executor/schedules/schedule_util.h bit for bit: the
// CUDA schedules generate on the device the X, W and targets their CPU twins generate on the
// host. Cases: several seeds (0, small, all ones), first_index 0, small and past 2^32 (a rank's
// slice), n not a multiple of 256, and the scales the schedules use. Every output carries a
// sentinel past n.
#include "cuda_emulation.h"
// The emulation header first: it defines what the kernels' source expects from CUDA.
#include "executor/cuda/schedule_fill_kernels.cuh"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "emulation_check.h"
#include "executor/schedules/schedule_util.h"

namespace flatpeak::exec {
namespace {

namespace cd = cuda_detail;
using namespace emu_check;

constexpr int32_t kTargetSentinel = 0x7bcd7bcd;

struct Case {
  int64_t n;
  uint64_t seed;
  uint64_t first_index;
};

std::string name_of(const Case& c, unsigned cap) {
  return "n " + std::to_string(c.n) + " seed " + std::to_string(c.seed) + " first " +
         std::to_string(c.first_index) + " block cap " + std::to_string(cap);
}

// The launcher's grid uncapped, then capped to one block (each thread covers several elements).
constexpr unsigned kCaps[] = {~0u, 1u};

const Case kCases[] = {
    {1, 0, 0},
    {257, 7, 0},
    {300, 0xFFFFFFFFFFFFFFFFull, 0},
    {511, 42, 300},
    {100, 12345, (uint64_t{1} << 32) + 17},
    {700, 3 * 5 + 1, 3 * 700},
};

TEST(ScheduleFillEmulation, Bf16MatchesCpuBitForBit) {
  const float scales[] = {1.0f, 0.5f, 1.0f / std::sqrt(96.0f)};
  int scale_at = 0;
  for (const Case& c : kCases) {
    const float scale = scales[scale_at++ % 3];
    std::vector<Bf16> want(static_cast<size_t>(c.n));  // [n] bf16
    fill_bf16(want.data(), c.n, c.seed, scale, static_cast<int64_t>(c.first_index));
    for (unsigned cap : kCaps) {
      SCOPED_TRACE(name_of(c, cap) + " scale " + std::to_string(scale));
      std::vector<Bf16> got(static_cast<size_t>(c.n) + kGuard, sentinel_of<Bf16>());  // [n] bf16 + guard
      const BlockCap capped(cap);
      cd::fill_bf16_cuda(got.data(), c.n, c.seed, scale, nullptr, c.first_index);
      EXPECT_EQ(std::memcmp(got.data(), want.data(), want.size() * sizeof(Bf16)), 0);
      expect_guard("p", got, static_cast<size_t>(c.n), sentinel_of<Bf16>());
    }
  }
}

// The values themselves, not only agreement: [-1, 1)·scale, not all equal, and first_index
// shifts the sequence (element i of a slice from f is element f + i of the whole).
TEST(ScheduleFillEmulation, Bf16SliceIsPartOfTheWhole) {
  const int64_t whole = 600, first = 333, n = whole - first;
  std::vector<Bf16> all(static_cast<size_t>(whole) + kGuard, sentinel_of<Bf16>());  // [whole] bf16
  std::vector<Bf16> part(static_cast<size_t>(n) + kGuard, sentinel_of<Bf16>());     // [n] bf16
  cd::fill_bf16_cuda(all.data(), whole, 9, 1.0f, nullptr);
  cd::fill_bf16_cuda(part.data(), n, 9, 1.0f, nullptr, static_cast<uint64_t>(first));
  EXPECT_EQ(std::memcmp(part.data(), all.data() + first, static_cast<size_t>(n) * sizeof(Bf16)), 0);
  int64_t distinct_from_first = 0;
  for (int64_t i = 0; i < whole; ++i) {
    const float v = to_f32(all[static_cast<size_t>(i)]);
    EXPECT_TRUE(v >= -1.0f && v <= 1.0f) << i << ": " << v;
    distinct_from_first += v != to_f32(all[0]);
  }
  EXPECT_GT(distinct_from_first, whole / 2);
}

TEST(ScheduleFillEmulation, TargetsMatchCpuBitForBit) {
  const int64_t vocabs[] = {1, 50, 32000, 151936};
  int vocab_at = 0;
  for (const Case& c : kCases) {
    const int64_t vocab = vocabs[vocab_at++ % 4];
    // schedule_util.h's fill_targets from index 0 where the slice is small (vocab_schedule.cpp),
    // ring_dtp_schedule.cpp's mix64(seed, offset + i) % V for any offset.
    std::vector<int32_t> want(static_cast<size_t>(c.n));  // [n] i32
    if (c.first_index < 4096) {
      std::vector<int32_t> whole(static_cast<size_t>(c.first_index) + want.size());
      fill_targets(whole.data(), static_cast<int64_t>(whole.size()), vocab, c.seed);
      std::memcpy(want.data(), whole.data() + c.first_index, want.size() * sizeof(int32_t));
    } else {
      for (int64_t i = 0; i < c.n; ++i)
        want[static_cast<size_t>(i)] = static_cast<int32_t>(
            mix64(c.seed, c.first_index + static_cast<uint64_t>(i)) % static_cast<uint64_t>(vocab));
    }
    for (unsigned cap : kCaps) {
      SCOPED_TRACE(name_of(c, cap) + " vocab " + std::to_string(vocab));
      std::vector<int32_t> got(static_cast<size_t>(c.n) + kGuard, kTargetSentinel);  // [n] i32 + guard
      const BlockCap capped(cap);
      cd::fill_targets_cuda(got.data(), c.n, vocab, c.seed, nullptr, c.first_index);
      EXPECT_EQ(std::memcmp(got.data(), want.data(), want.size() * sizeof(int32_t)), 0);
      expect_guard("p", got, static_cast<size_t>(c.n), kTargetSentinel);
      for (int64_t i = 0; i < c.n; ++i) {
        const int32_t t = got[static_cast<size_t>(i)];
        ASSERT_TRUE(t >= 0 && t < vocab) << i << ": " << t;
      }
    }
  }
}

}  // namespace
}  // namespace flatpeak::exec
