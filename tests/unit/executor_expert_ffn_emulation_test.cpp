// The expert FFN's elementwise kernels (executor/cuda/expert_ffn_kernels.cuh) run on the host
// through cuda_emulation.h, by the launch functions expert_ffn_cuda.cu itself calls (the header's:
// grid_for(count) blocks of kThreads), in bf16 and f32 storage: widen, store and add equal the CPU's to_f32 /
// store_f32 / "stored value + fp32 sum, rounded once" bitwise; swiglu and swiglu_backward equal
// expert_ffn_cpu.cpp's per-element expressions (silu_f32, silu_grad_f32, the same operand order)
// bitwise, and those expressions are checked against silu and its derivative in double (rel 1e-5
// + 1e-6 of the largest magnitude), with gate values up to |x| = 100 (e^-x overflows for x < -88:
// σ = 0, silu = −0). Rows of 40 (n·F over two blocks) and 7 (one block, F not a multiple of 32).
// NaN past every input, a sentinel past every output.
#include "cuda_emulation.h"
// The emulation header first: it defines what the kernels' source expects from CUDA.
#include "executor/cuda/expert_ffn_kernels.cuh"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "emulation_check.h"

namespace flatpeak::exec {
namespace {

namespace cd = cuda_detail;
using namespace emu_check;

// Gate values: random in ±8, with the large magnitudes and zero at fixed places.
std::vector<float> gate_values(std::mt19937& rng, int64_t n) {
  std::vector<float> out = uniform(rng, n);
  for (float& v : out) v *= 8.0f;
  const float specials[] = {-100.0f, -89.0f, -88.0f, -30.0f, -17.0f, 0.0f, 17.0f, 30.0f, 88.0f, 100.0f};
  for (size_t i = 0; i < sizeof specials / sizeof specials[0] && i < out.size(); ++i)
    out[i * 3 % out.size()] = specials[i];
  return out;
}

double sigmoid_double(double x) {
  return 1.0 / (1.0 + std::exp(-x));
}
double silu_double(double x) {
  return x * sigmoid_double(x);
}
double silu_grad_double(double x) {
  const double s = sigmoid_double(x);
  return s * (1.0 + x * (1.0 - s));
}

template <class T>
void run_elementwise(int64_t n, uint32_t seed) {
  SCOPED_TRACE(std::string(dtype_name(dtype_of<T>())) + " n " + std::to_string(n));
  std::mt19937 rng(seed);
  const std::vector<T> src = with_guard(to_storage<T>(uniform(rng, n)), nan_of<T>());  // [n] + NaN
  const std::vector<float> f32 = with_guard(uniform(rng, n), nan_of<float>());         // [n] fp32 + NaN

  std::vector<float> widened(z(n) + kGuard, sentinel_of<float>());  // [n] fp32
  cd::launch_widen(src.data(), widened.data(), n, nullptr);
  expect_guard("widen", widened, z(n), sentinel_of<float>());
  EXPECT_TRUE(same_bits(widened, widen(src, z(n)), z(n))) << "widen";

  std::vector<T> stored(z(n) + kGuard, sentinel_of<T>());  // [n] storage
  cd::launch_store(f32.data(), stored.data(), n, nullptr);
  expect_guard("store", stored, z(n), sentinel_of<T>());
  std::vector<T> want(z(n));
  for (int64_t i = 0; i < n; ++i) store_f32(&want[z(i)], f32[z(i)]);
  EXPECT_TRUE(same_bits(stored, want, z(n))) << "store";

  std::vector<T> acc = src;  // [n] storage +=, its NaN guard replaced by sentinels
  for (size_t i = z(n); i < acc.size(); ++i) acc[i] = sentinel_of<T>();
  cd::launch_add(f32.data(), acc.data(), n, nullptr);
  expect_guard("add", acc, z(n), sentinel_of<T>());
  for (int64_t i = 0; i < n; ++i) store_f32(&want[z(i)], to_f32(src[z(i)]) + f32[z(i)]);
  EXPECT_TRUE(same_bits(acc, want, z(n))) << "add";
}

TEST(ExpertFfnEmulation, ElementwiseBf16) {
  run_elementwise<Bf16>(300, 1);
}
TEST(ExpertFfnEmulation, ElementwiseF32) {
  run_elementwise<float>(300, 2);
}

template <class T>
void run_swiglu(int64_t n, int64_t F, uint32_t seed) {
  SCOPED_TRACE(std::string(dtype_name(dtype_of<T>())) + " n " + std::to_string(n) + " F " +
               std::to_string(F));
  std::mt19937 rng(seed);
  // gate_up [n, 2F]: row r holds gate [F] then up [F].
  const std::vector<float> gates = gate_values(rng, n * F);
  const std::vector<float> ups = uniform(rng, n * F);
  std::vector<float> gu_values(z(n * 2 * F));
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t f = 0; f < F; ++f) {
      gu_values[z(r * 2 * F + f)] = gates[z(r * F + f)];
      gu_values[z(r * 2 * F + F + f)] = ups[z(r * F + f)];
    }
  }
  const std::vector<T> gate_up = with_guard(to_storage<T>(gu_values), nan_of<T>());  // [n, 2F] + NaN
  const std::vector<float> gu = widen(gate_up, z(n * 2 * F));                        // as stored

  // Forward: h [n, F] fp32.
  std::vector<float> h(z(n * F) + kGuard, sentinel_of<float>());
  cd::launch_swiglu(gate_up.data(), h.data(), n, F, nullptr);
  expect_guard("h", h, z(n * F), sentinel_of<float>());
  std::vector<float> want_h(z(n * F));  // expert_ffn_cpu.cpp's swiglu
  std::vector<double> exact_h(z(n * F));
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t f = 0; f < F; ++f) {
      const float g = gu[z(r * 2 * F + f)], u = gu[z(r * 2 * F + F + f)];
      want_h[z(r * F + f)] = silu_f32(g) * u;
      exact_h[z(r * F + f)] = silu_double(g) * u;
    }
  }
  EXPECT_TRUE(same_bits(h, want_h, z(n * F))) << "h";
  std::vector<float> exact_h_f32(exact_h.begin(), exact_h.end());
  expect_within("h vs double", widen(h, z(n * F)), exact_h_f32, 1e-5, 1e-6);

  // Backward: dgu [n, 2F] fp32 holds dh in its gate half (the up half as the GEMM left it: garbage).
  const std::vector<float> dh = uniform(rng, n * F);
  std::vector<float> dgu(z(n * 2 * F) + kGuard, sentinel_of<float>());
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t f = 0; f < F; ++f) {
      dgu[z(r * 2 * F + f)] = dh[z(r * F + f)];
      dgu[z(r * 2 * F + F + f)] = std::numeric_limits<float>::quiet_NaN();
    }
  }
  cd::launch_swiglu_backward(gate_up.data(), dgu.data(), n, F, nullptr);
  expect_guard("dgu", dgu, z(n * 2 * F), sentinel_of<float>());
  std::vector<float> want_dgu(z(n * 2 * F));
  std::vector<float> exact_dgu(z(n * 2 * F));
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t f = 0; f < F; ++f) {
      const float g = gu[z(r * 2 * F + f)], u = gu[z(r * 2 * F + F + f)], d = dh[z(r * F + f)];
      want_dgu[z(r * 2 * F + f)] = d * u * silu_grad_f32(g);
      want_dgu[z(r * 2 * F + F + f)] = d * silu_f32(g);
      exact_dgu[z(r * 2 * F + f)] = static_cast<float>(static_cast<double>(d) * u * silu_grad_double(g));
      exact_dgu[z(r * 2 * F + F + f)] = static_cast<float>(static_cast<double>(d) * silu_double(g));
    }
  }
  EXPECT_TRUE(same_bits(dgu, want_dgu, z(n * 2 * F))) << "d[gate | up]";
  expect_within("d[gate | up] vs double", widen(dgu, z(n * 2 * F)), exact_dgu, 1e-5, 1e-6);
}

TEST(ExpertFfnEmulation, SwigluBf16) {
  run_swiglu<Bf16>(7, 40, 3);
}
TEST(ExpertFfnEmulation, SwigluF32) {
  run_swiglu<float>(7, 40, 4);
}
TEST(ExpertFfnEmulation, SwigluOneBlockOddF) {
  run_swiglu<Bf16>(3, 7, 5);
}

}  // namespace
}  // namespace flatpeak::exec
