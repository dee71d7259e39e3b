// The tensor-core attention kernels (executor/cuda/attention_tc_kernels.cuh) run on the host
// through cuda_emulation.h, by the launch functions attention_tc_cuda.cu itself calls (its grids
// and shared-memory sizes), against the CPU op: the tiling, the causal and tail masks, the online
// softmax, the GQA head mapping, the shared-memory carving and the barriers, without a GPU (the
// device itself is checked by tests/cuda/attention_cuda_test.cu). Bounds as there: out, d_q, d_k,
// d_v within rel 1e-2 + 5e-3 of the largest magnitude (P and dS are rounded to bf16 as GEMM
// operands, so the error scales with Σ|p·v|, not with the cancelling result); lse within rel 1e-4
// + 1e-5; at T = 1, d_q and d_k (zero exactly) within 1e-3. Inputs carry kGuard NaN rows past T and
// outputs kGuard sentinel rows: a read past T turns outputs into NaN, a write past T changes a sentinel.
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

#include "emulation_check.h"
#include "executor/ops/attention.h"

namespace flatpeak::exec {
namespace {

namespace tc = cuda_detail;
using namespace emu_check;

struct Shape {
  int64_t tokens, q_heads, kv_heads, head_dim;
  bool vec16;  // the kernels' 16-byte load path, else element by element
};

// [T + kGuard, heads, d] bf16: the values, then NaN rows.
std::vector<Bf16> with_nan_rows(const std::vector<float>& values, int64_t row_elems) {
  return with_guard(to_storage<Bf16>(values), nan_of<Bf16>(), kGuard * static_cast<size_t>(row_elems));
}

// The bound of the tensor-core kernels' bf16 outputs (see the top of the file).
constexpr Tol kTcTol{1e-2, 5e-3};

void run_case(const Shape& s) {
  const int64_t T = s.tokens, a = s.q_heads, g = s.kv_heads, d = s.head_dim;
  std::mt19937 rng(51);
  const std::vector<float> q_f = uniform(rng, T * a * d), k_f = uniform(rng, T * g * d);
  const std::vector<float> v_f = uniform(rng, T * g * d), do_f = uniform(rng, T * a * d);
  const std::vector<Bf16> q = with_nan_rows(q_f, a * d);       // [T + kGuard, a, d]
  const std::vector<Bf16> k = with_nan_rows(k_f, g * d);       // [T + kGuard, g, d]
  const std::vector<Bf16> v = with_nan_rows(v_f, g * d);       // [T + kGuard, g, d]
  const std::vector<Bf16> d_out = with_nan_rows(do_f, a * d);  // [T + kGuard, a, d]

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
  const Bf16 sentinel = sentinel_of<Bf16>();
  const size_t guard_qo = kGuard * static_cast<size_t>(a * d), guard_kv = kGuard * static_cast<size_t>(g * d);
  std::vector<Bf16> e_out(out.size() + guard_qo, sentinel);  // [T + kGuard, a, d]
  std::vector<Bf16> e_dq(e_out.size(), sentinel);            // [T + kGuard, a, d]
  std::vector<Bf16> e_dk(d_k.size() + guard_kv, sentinel);   // [T + kGuard, g, d]
  std::vector<Bf16> e_dv(e_dk.size(), sentinel);             // [T + kGuard, g, d]
  std::vector<float> e_lse(static_cast<size_t>(a * T), std::numeric_limits<float>::quiet_NaN());
  std::vector<float> delta(static_cast<size_t>(a * T));  // [a, T] D = rowsum(dO ⊙ O), as the delta kernel
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const int64_t violations_before = emu::violations();
  tc::launch_attention_forward_tc(q.data(), k.data(), v.data(), e_out.data(), e_lse.data(), T, a, g,
                                  d, scale, s.vec16, nullptr);
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
  tc::launch_attention_backward_tc(q.data(), k.data(), v.data(), d_out.data(), e_lse.data(),
                                   delta.data(), e_dq.data(), e_dk.data(), e_dv.data(), T, a, g, d,
                                   scale, s.vec16, nullptr);
  EXPECT_EQ(emu::violations(), violations_before) << "misaligned WMMA pointer or leading dimension";

  const std::string name = "T" + std::to_string(T) + " a" + std::to_string(a) + " g" +
                           std::to_string(g) + " d" + std::to_string(d);
  expect_within(name + " out", widen(e_out, out.size()), widen(out, out.size()), kTcTol);
  expect_within(name + " lse", e_lse, lse, 1e-4, 1e-5);
  if (T == 1) {  // the one key has probability 1: dS = dP − D = 0, rounding noise only
    for (float x : widen(e_dq, d_q.size())) EXPECT_LE(std::fabs(x), 1e-3f) << name << " d_q";
    for (float x : widen(e_dk, d_k.size())) EXPECT_LE(std::fabs(x), 1e-3f) << name << " d_k";
  } else {
    expect_within(name + " d_q", widen(e_dq, d_q.size()), widen(d_q, d_q.size()), kTcTol);
    expect_within(name + " d_k", widen(e_dk, d_k.size()), widen(d_k, d_k.size()), kTcTol);
  }
  expect_within(name + " d_v", widen(e_dv, d_v.size()), widen(d_v, d_v.size()), kTcTol);
  expect_guard(name + " out", e_out, out.size(), sentinel);
  expect_guard(name + " d_q", e_dq, d_q.size(), sentinel);
  expect_guard(name + " d_k", e_dk, d_k.size(), sentinel);
  expect_guard(name + " d_v", e_dv, d_v.size(), sentinel);
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
