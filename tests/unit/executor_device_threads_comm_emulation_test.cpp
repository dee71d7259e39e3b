// DeviceThreadsCommunicator's reduction kernels (executor/cuda/device_threads_comm_kernels.cuh)
// run on the host through cuda_emulation.h, by the launch function reduce_staged itself calls
// (grid_for(count) blocks of kThreads, the kernel and accumulator type per dtype), against the
// CPU's reduce_in_rank_order (executor/comm/communicator.h) bitwise: f32, bf16 (fp32 accumulator,
// rounded once), i32 (int64 accumulator: sums past 2^31 wrap once, at the store) and i64; sum and
// max; 1, 2 and 3 ranks; count 300 (two blocks, the second partly idle). The staged buffer holds
// rank p's contribution at p·count, NaN (or an extreme integer) past the last; the output has a
// sentinel past count.
#include "cuda_emulation.h"
// The emulation header first: it defines what the kernels' source expects from CUDA.
#include "executor/cuda/device_threads_comm_kernels.cuh"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "emulation_check.h"
#include "executor/comm/communicator.h"

namespace flatpeak::exec {
namespace {

namespace cd = cuda_detail;
using namespace emu_check;

// [ranks, count] contributions: floats ±[0.05, 1] scaled by up to 1000 (so sums round), integers
// up to ±2^30 (three i32 ranks can pass 2^31), i64 up to ±2^42.
template <class T>
std::vector<T> staged_values(std::mt19937& rng, int ranks, int64_t count) {
  std::vector<T> out(z(ranks * count));
  if constexpr (std::is_integral_v<T>) {
    std::uniform_int_distribution<int64_t> dist(-(int64_t{1} << 30), int64_t{1} << 30);
    for (T& v : out) v = static_cast<T>(dist(rng) * (std::is_same_v<T, int64_t> ? 4099 : 1));
  } else {
    std::uniform_real_distribution<float> scale(1.0f, 1000.0f);
    const std::vector<float> u = uniform(rng, ranks * count);
    for (size_t i = 0; i < out.size(); ++i) store_f32(&out[i], u[i] * scale(rng));
  }
  return out;
}

template <class T>
T input_guard() {
  if constexpr (std::is_integral_v<T>)
    return std::numeric_limits<T>::max();
  else
    return nan_of<T>();
}

template <class T>
void run_case(DType dtype) {
  const int64_t count = 300;
  for (int ranks : {1, 2, 3}) {
    for (bool sum : {true, false}) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + " ranks " + std::to_string(ranks) +
                   (sum ? " sum" : " max"));
      std::mt19937 rng(static_cast<uint32_t>(ranks * 2 + sum));
      const std::vector<T> staged = with_guard(staged_values<T>(rng, ranks, count), input_guard<T>());
      std::vector<T> out(z(count) + kGuard, sentinel_of<T>());  // [count]
      cd::launch_reduce_rank_order(staged.data(), out.data(), count, dtype, ranks, sum, nullptr);
      expect_guard("out", out, z(count), sentinel_of<T>());
      std::vector<const void*> parts;
      for (int p = 0; p < ranks; ++p) parts.push_back(staged.data() + p * count);
      std::vector<T> want(z(count));
      reduce_in_rank_order(parts, want.data(), count, dtype, sum ? ReduceOp::Sum : ReduceOp::Max);
      EXPECT_EQ(std::memcmp(out.data(), want.data(), z(count) * sizeof(T)), 0);
    }
  }
}

TEST(DeviceThreadsCommEmulation, F32) {
  run_case<float>(DType::F32);
}
TEST(DeviceThreadsCommEmulation, Bf16) {
  run_case<Bf16>(DType::BF16);
}
TEST(DeviceThreadsCommEmulation, I32) {
  run_case<int32_t>(DType::I32);
}
TEST(DeviceThreadsCommEmulation, I64) {
  run_case<int64_t>(DType::I64);
}

}  // namespace
}  // namespace flatpeak::exec
