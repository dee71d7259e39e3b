// The tensor-core attention kernels (executor/cuda/attention_tc_kernels.cuh) run on the host
// through cuda_emulation.h, against the CPU op: the tiling, the causal and tail masks, the online
// softmax, the GQA head mapping, the shared-memory carving and the barriers, without a GPU (the
// device itself is checked by tests/cuda/attention_cuda_test.cu). Bounds as there: out, d_q, d_k,
// d_v within rel 1e-2 + 5e-3 of the largest magnitude (P and dS are rounded to bf16 as GEMM
// operands, so the error scales with Σ|p·v|, not with the cancelling result); lse within rel 1e-4
// + 1e-5; at T = 1, d_q and d_k (zero exactly) within 1e-3. Inputs carry 64 NaN rows past T and
// outputs 64 sentinel rows: a read past T turns outputs into NaN, a write past T changes a sentinel.
#include "cuda_emulation.h"
// The emulation header first: it defines what the kernels' source expects from CUDA.
#include "executor/cuda/attention_tc_kernels.cuh"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "executor/ops/attention.h"

namespace flatpeak::exec {
namespace {

namespace tc = cuda_detail;

constexpr int64_t kGuardRows = 64;  // past T in every buffer
constexpr uint16_t kSentinel = 0x7bcd;  // a bf16 bit pattern no kernel writes here (≈ 2.1e36)

struct Shape {
  int64_t tokens, q_heads, kv_heads, head_dim;
  bool vec16;  // the kernels' 16-byte load path, else element by element
};

std::vector<float> uniform(std::mt19937& rng, int64_t n) {  // ±[0.05, 1], as the CUDA tests
  std::uniform_real_distribution<float> magnitude(0.05f, 1.0f);
  std::bernoulli_distribution negative(0.5);
  std::vector<float> out(static_cast<size_t>(n));
  for (float& x : out) x = negative(rng) ? -magnitude(rng) : magnitude(rng);
  return out;
}

// [T + guard, heads, d] bf16: the values, then NaN rows.
std::vector<Bf16> with_nan_guard(const std::vector<float>& values, int64_t row_elems) {
  std::vector<Bf16> out(values.size() + static_cast<size_t>(kGuardRows * row_elems),
                        f32_to_bf16(std::numeric_limits<float>::quiet_NaN()));
  for (size_t i = 0; i < values.size(); ++i) out[i] = f32_to_bf16(values[i]);
  return out;
}

std::vector<float> widen(const std::vector<Bf16>& x, size_t n) {
  std::vector<float> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = to_f32(x[i]);
  return out;
}

// Elements of `got` outside |got − want| <= rel·|want| + floor·max|want|; the worst in `detail`.
int64_t count_outside(const std::vector<float>& got, const std::vector<float>& want, double rel,
                      double floor, std::string& detail) {
  double max_want = 0.0;
  for (float w : want) max_want = std::max(max_want, std::fabs(static_cast<double>(w)));
  int64_t bad = 0;
  double worst = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double diff = std::fabs(static_cast<double>(got[i]) - static_cast<double>(want[i]));
    const double ratio = diff / (rel * std::fabs(static_cast<double>(want[i])) + floor * max_want);
    if (!(ratio <= 1.0)) ++bad;
    if (!(ratio <= worst)) {
      worst = ratio;
      detail = "worst at " + std::to_string(i) + ": got " + std::to_string(got[i]) + " want " +
               std::to_string(want[i]) + " (" + std::to_string(ratio) + " of the bound)";
    }
  }
  return bad;
}

void expect_within(const std::string& name, const std::vector<float>& got,
                   const std::vector<float>& want, double rel, double floor) {
  std::string detail;
  EXPECT_EQ(count_outside(got, want, rel, floor, detail), 0) << name << ": " << detail;
}

void expect_sentinels(const std::string& name, const std::vector<Bf16>& x, size_t written) {
  int64_t changed = 0;
  for (size_t i = written; i < x.size(); ++i) changed += x[i].bits != kSentinel;
  EXPECT_EQ(changed, 0) << name << ": elements past T written";
}

void run_case(const Shape& s) {
  const int64_t T = s.tokens, a = s.q_heads, g = s.kv_heads, d = s.head_dim;
  std::mt19937 rng(51);
  const std::vector<float> q_f = uniform(rng, T * a * d), k_f = uniform(rng, T * g * d);
  const std::vector<float> v_f = uniform(rng, T * g * d), do_f = uniform(rng, T * a * d);
  const std::vector<Bf16> q = with_nan_guard(q_f, a * d);      // [T + 64, a, d]
  const std::vector<Bf16> k = with_nan_guard(k_f, g * d);      // [T + 64, g, d]
  const std::vector<Bf16> v = with_nan_guard(v_f, g * d);      // [T + 64, g, d]
  const std::vector<Bf16> d_out = with_nan_guard(do_f, a * d);  // [T + 64, a, d]

  // The CPU op on the same bf16 values.
  AttentionArgs args;
  args.dtype = DType::BF16;
  args.tokens = T;
  args.q_heads = a;
  args.kv_heads = g;
  args.head_dim = d;
  args.tile_rows = 64;
  std::vector<Bf16> out(static_cast<size_t>(T * a * d)), d_q(out.size());
  std::vector<Bf16> d_k(static_cast<size_t>(T * g * d)), d_v(d_k.size());
  std::vector<float> lse(static_cast<size_t>(a * T));  // [a, T]
  std::vector<float> workspace(static_cast<size_t>(attention_workspace_bytes(args) / 4));
  args.q = q.data();
  args.k = k.data();
  args.v = v.data();
  args.out = out.data();
  args.lse = lse.data();
  args.workspace = workspace.data();
  args.d_out = d_out.data();
  args.d_q = d_q.data();
  args.d_k = d_k.data();
  args.d_v = d_v.data();
  attention_forward_cpu(args);
  attention_backward_cpu(args);

  // The kernels, outputs with sentinel rows past T.
  const Bf16 sentinel{kSentinel};
  std::vector<Bf16> e_out(static_cast<size_t>((T + kGuardRows) * a * d), sentinel);  // [T + 64, a, d]
  std::vector<Bf16> e_dq(e_out.size(), sentinel);                                  // [T + 64, a, d]
  std::vector<Bf16> e_dk(static_cast<size_t>((T + kGuardRows) * g * d), sentinel);  // [T + 64, g, d]
  std::vector<Bf16> e_dv(e_dk.size(), sentinel);                                   // [T + 64, g, d]
  std::vector<float> e_lse(static_cast<size_t>(a * T), std::numeric_limits<float>::quiet_NaN());
  std::vector<float> delta(static_cast<size_t>(a * T));  // [a, T] D = rowsum(dO ⊙ O), as the delta kernel
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const unsigned tiles = static_cast<unsigned>((T + tc::kTile - 1) / tc::kTile);
  const unsigned threads = static_cast<unsigned>(tc::kTcThreads);
  const int64_t violations_before = emu::violations();
  emu::launch(tiles, static_cast<unsigned>(a), threads, tc::ForwardSmem(d).bytes, [&] {
    tc::attention_forward_tc_kernel(q.data(), k.data(), v.data(), e_out.data(), e_lse.data(), T, a,
                                    g, d, scale, s.vec16);
  });
  for (int64_t i = 0; i < T; ++i) {
    for (int64_t h = 0; h < a; ++h) {
      float dot = 0.0f;
      for (int64_t c = 0; c < d; ++c) {
        const size_t at = static_cast<size_t>((i * a + h) * d + c);
        dot += to_f32(d_out[at]) * to_f32(e_out[at]);
      }
      delta[static_cast<size_t>(h * T + i)] = dot;
    }
  }
  emu::launch(tiles, static_cast<unsigned>(g), threads, tc::DkvSmem(d).bytes, [&] {
    tc::attention_dkv_tc_kernel(q.data(), k.data(), v.data(), d_out.data(), e_lse.data(),
                                delta.data(), e_dk.data(), e_dv.data(), T, a, g, d, scale, s.vec16);
  });
  emu::launch(tiles, static_cast<unsigned>(a), threads, tc::DqSmem(d).bytes, [&] {
    tc::attention_dq_tc_kernel(q.data(), k.data(), v.data(), d_out.data(), e_lse.data(),
                               delta.data(), e_dq.data(), T, a, g, d, scale, s.vec16);
  });
  EXPECT_EQ(emu::violations(), violations_before) << "misaligned WMMA pointer or leading dimension";

  const std::string name = "T" + std::to_string(T) + " a" + std::to_string(a) + " g" +
                           std::to_string(g) + " d" + std::to_string(d);
  expect_within(name + " out", widen(e_out, out.size()), widen(out, out.size()), 1e-2, 5e-3);
  expect_within(name + " lse", e_lse, lse, 1e-4, 1e-5);
  if (T == 1) {  // the one key has probability 1: dS = dP − D = 0, rounding noise only
    for (float x : widen(e_dq, d_q.size())) EXPECT_LE(std::fabs(x), 1e-3f) << name << " d_q";
    for (float x : widen(e_dk, d_k.size())) EXPECT_LE(std::fabs(x), 1e-3f) << name << " d_k";
  } else {
    expect_within(name + " d_q", widen(e_dq, d_q.size()), widen(d_q, d_q.size()), 1e-2, 5e-3);
    expect_within(name + " d_k", widen(e_dk, d_k.size()), widen(d_k, d_k.size()), 1e-2, 5e-3);
  }
  expect_within(name + " d_v", widen(e_dv, d_v.size()), widen(d_v, d_v.size()), 1e-2, 5e-3);
  expect_sentinels(name + " out", e_out, out.size());
  expect_sentinels(name + " d_q", e_dq, d_q.size());
  expect_sentinels(name + " d_k", e_dk, d_k.size());
  expect_sentinels(name + " d_v", e_dv, d_v.size());
}

TEST(AttentionTcEmulation, SharedMemoryPerKernel) {
  // Hand-derived: bf16 tiles [64, d+8], fp32 score tiles [64, 68], bf16 P/dS tiles [64, 72],
  // fp32 accumulators [64, d+4], fp32 rows [64] rounded up to 128 bytes.
  EXPECT_EQ(tc::ForwardSmem(64).bytes, 3 * 9216 + 17408 + 9216 + 17408);
  EXPECT_EQ(tc::DkvSmem(64).bytes, 4 * 9216 + 17408 + 2 * 9216 + 2 * 17408 + 2 * 256);
  EXPECT_EQ(tc::DqSmem(64).bytes, 4 * 9216 + 2 * 17408 + 9216 + 17408);
  EXPECT_EQ(tc::ForwardSmem(128).bytes, 3 * 17408 + 17408 + 9216 + 33792);
  EXPECT_EQ(tc::DkvSmem(128).bytes, 4 * 17408 + 17408 + 2 * 9216 + 2 * 33792 + 2 * 256);
  EXPECT_EQ(tc::DqSmem(128).bytes, 4 * 17408 + 2 * 17408 + 9216 + 33792);
  EXPECT_LE(tc::DkvSmem(128).bytes, 227 * 1024);  // H100/H200's per-block opt-in
}

// gpt-oss-like GQA (8 query heads over 2), T below one fragment, below one tile, past two tiles,
// and exactly two tiles (no tail: the last key tile is the diagonal one, full).
TEST(AttentionTcEmulation, HeadDim64) {
  run_case({1, 8, 2, 64, false});
  run_case({15, 8, 2, 64, true});
  run_case({130, 8, 2, 64, true});
  run_case({128, 4, 2, 64, true});
}

TEST(AttentionTcEmulation, HeadDim128) { run_case({70, 4, 2, 128, false}); }

// Group of one (the checkpoint stack's heads) and of four; the element-by-element load path.
TEST(AttentionTcEmulation, SmallHeadDims) {
  run_case({65, 4, 4, 16, false});
  run_case({100, 4, 1, 32, true});
}

}  // namespace
}  // namespace flatpeak::exec
