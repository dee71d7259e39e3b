// The checkpoint schedule's kernels (executor/cuda/checkpoint_schedule_kernels.cuh) run on the
// host through cuda_emulation.h, against checkpoint_schedule.cpp's loops, launched as
// checkpoint_schedule_cuda.cu launches them (grid_for(n) blocks of kThreads), bitwise: add2
// (residual and gradient sums), add3 ((a + b) + c, rounded once: inputs spread over 2^±12, and
// every fourth element a + b = 0 with c far smaller, so that another order rounds differently),
// fill_norm (1 + 0.1·uniform(seed, base + i), product and sum rounded separately) and
// loss_gradient ((x − target) / T), through the launch functions checkpoint_schedule_cuda.cu
// itself calls. squared_error's per-block fp64 partials bitwise against the same grid-stride sums
// and shared-memory tree replayed on the host, and their block-order sum against the CPU's
// Σ (x − target)² within 1e-12: on the launcher's kLossBlocks = 256 blocks (only the blocks that
// hold data and the last: 65 536 host threads would take seconds), and on grids of 2 and 3
// blocks, where a thread strides more than once. NaN past every input, a sentinel past every
// output.
#include "cuda_emulation.h"
// The emulation header first: it defines what the kernels' source expects from CUDA.
#include "executor/cuda/checkpoint_schedule_kernels.cuh"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "emulation_check.h"
#include "executor/schedules/schedule_util.h"

namespace flatpeak::exec {
namespace {

namespace cd = cuda_detail;
using namespace emu_check;

std::vector<Bf16> input(std::mt19937& rng, int64_t n) {  // [n] bf16 + NaN
  return with_guard(to_storage<Bf16>(uniform(rng, n)), nan_of<Bf16>());
}
// ±[0.05, 1] · 2^e, e in -12..12: sums of three such bf16 values are not exact in fp32, so the
// order of the additions shows in the rounded result.
std::vector<Bf16> wide_input(std::mt19937& rng, int64_t n) {  // [n] bf16 + NaN
  std::uniform_int_distribution<int> exponent(-12, 12);
  std::vector<float> values = uniform(rng, n);
  for (float& v : values) v = std::ldexp(v, exponent(rng));
  return with_guard(to_storage<Bf16>(values), nan_of<Bf16>());
}
std::vector<Bf16> output(int64_t n) {
  return std::vector<Bf16>(z(n) + kGuard, sentinel_of<Bf16>());
}

TEST(CheckpointScheduleEmulation, AddsAndLossGradient) {
  for (int64_t n : {int64_t{1}, int64_t{300}, int64_t{513}}) {
    SCOPED_TRACE("n " + std::to_string(n));
    std::mt19937 rng(static_cast<uint32_t>(n));
    std::vector<Bf16> a = wide_input(rng, n), b = wide_input(rng, n), c = wide_input(rng, n);
    for (int64_t i = 0; i < n; i += 4) {  // a + b = 0 exactly, c far below b's last bit: (a + b) + c = c
      a[z(i)] = f32_to_bf16(std::ldexp(to_f32(a[z(i)]), 12));
      b[z(i)] = f32_to_bf16(-to_f32(a[z(i)]));
      c[z(i)] = f32_to_bf16(std::ldexp(to_f32(c[z(i)]), -12));
    }
    std::vector<Bf16> want(z(n));

    std::vector<Bf16> sum2 = output(n);
    cd::launch_add2(a.data(), b.data(), sum2.data(), n, nullptr);
    expect_guard("add2", sum2, z(n), sentinel_of<Bf16>());
    for (int64_t i = 0; i < n; ++i) want[z(i)] = f32_to_bf16(to_f32(a[z(i)]) + to_f32(b[z(i)]));
    EXPECT_TRUE(same_bits(sum2, want, z(n))) << "add2";

    std::vector<Bf16> sum3 = output(n);
    cd::launch_add3(a.data(), b.data(), c.data(), sum3.data(), n, nullptr);
    expect_guard("add3", sum3, z(n), sentinel_of<Bf16>());
    for (int64_t i = 0; i < n; ++i)
      want[z(i)] = f32_to_bf16(to_f32(a[z(i)]) + to_f32(b[z(i)]) + to_f32(c[z(i)]));
    EXPECT_TRUE(same_bits(sum3, want, z(n))) << "add3";

    const float tokens = 7.0f;
    std::vector<Bf16> d = output(n);
    cd::launch_loss_gradient(a.data(), b.data(), d.data(), n, tokens, nullptr);
    expect_guard("loss_gradient", d, z(n), sentinel_of<Bf16>());
    for (int64_t i = 0; i < n; ++i) want[z(i)] = f32_to_bf16((to_f32(a[z(i)]) - to_f32(b[z(i)])) / tokens);
    EXPECT_TRUE(same_bits(d, want, z(n))) << "loss_gradient";
  }
}

// make_weights' norms (base = layer index · 1000003) and the final norm (base 0).
TEST(CheckpointScheduleEmulation, FillNormMatchesCpu) {
  struct Case {
    int64_t n;
    uint64_t seed, base;
  };
  for (const Case& c :
       {Case{300, 1009 * 3 + 2, 0}, Case{300, 1009 * 3 + 2, 3 * 1000003}, Case{37, 7 * 9 + 5, 0}}) {
    SCOPED_TRACE("n " + std::to_string(c.n) + " seed " + std::to_string(c.seed) + " base " +
                 std::to_string(c.base));
    std::vector<Bf16> got = output(c.n);
    cd::launch_fill_norm(got.data(), c.n, c.seed, c.base, nullptr);
    expect_guard("norm", got, z(c.n), sentinel_of<Bf16>());
    std::vector<Bf16> want(z(c.n));
    for (int64_t i = 0; i < c.n; ++i)
      want[z(i)] = f32_to_bf16(1.0f + 0.1f * uniform_pm1(c.seed, c.base + static_cast<uint64_t>(i)));
    EXPECT_TRUE(same_bits(got, want, z(c.n)));
  }
}

TEST(CheckpointScheduleEmulation, SquaredErrorPartials) {
  const int64_t T = 5, H = 120, n = T * H;
  std::mt19937 rng(11);
  const std::vector<Bf16> x = input(rng, n), target = input(rng, n);
  auto diff2 = [&](int64_t i) {
    const double diff = static_cast<double>(to_f32(x[z(i)])) - static_cast<double>(to_f32(target[z(i)]));
    return diff * diff;
  };
  double cpu_sum = 0.0;  // checkpoint_schedule.cpp's loss loop
  for (int64_t i = 0; i < n; ++i) cpu_sum += diff2(i);
  const double cpu_loss = 0.5 * cpu_sum / static_cast<double>(T);
  // The launcher's kLossBlocks grid (only its first 4 blocks, which hold all n = 600 elements,
  // and its last), then grids of 2 and 3 blocks, where threads stride more than once.
  const std::vector<unsigned> launcher_blocks{0, 1, 2, 3, cd::kLossBlocks - 1};
  for (unsigned grid : {static_cast<unsigned>(cd::kLossBlocks), 2u, 3u}) {
    SCOPED_TRACE("grid " + std::to_string(grid));
    const bool launcher = grid == static_cast<unsigned>(cd::kLossBlocks);
    const std::vector<unsigned> blocks = launcher ? launcher_blocks : std::vector<unsigned>{0, 1, 2};
    std::vector<double> partials(grid + kGuard, sentinel_of<float>());
    if (launcher) {
      const BlockRows only(launcher_blocks);
      cd::launch_squared_error(x.data(), target.data(), partials.data(), n, nullptr);
    } else {
      emu::launch(grid, 1, cd::kThreads, 0,
                  [&] { cd::squared_error_kernel(x.data(), target.data(), partials.data(), n); });
    }
    expect_guard("partials", partials, grid, static_cast<double>(sentinel_of<float>()));
    double sum = 0.0;
    for (unsigned b : blocks) {
      if (b >= grid) continue;
      std::vector<double> local(z(cd::kThreads), 0.0);
      for (int64_t t = 0; t < cd::kThreads; ++t)
        for (int64_t i = b * cd::kThreads + t; i < n; i += grid * cd::kThreads) local[z(t)] += diff2(i);
      for (int64_t stride = cd::kThreads / 2; stride > 0; stride /= 2)
        for (int64_t t = 0; t < stride; ++t) local[z(t)] += local[z(t + stride)];
      EXPECT_EQ(partials[b], local[0]) << "block " << b;
      sum += partials[b];  // the launcher's block order
    }
    const double loss = 0.5 * sum / static_cast<double>(T);
    EXPECT_NEAR(loss, cpu_loss, 1e-12 * cpu_loss);
    EXPECT_GT(loss, 0.0);
  }
}

}  // namespace
}  // namespace flatpeak::exec
