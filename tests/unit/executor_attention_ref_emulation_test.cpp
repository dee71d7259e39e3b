// The reference attention kernels (executor/cuda/attention_ref_kernels.cuh) run on the host
// through cuda_emulation.h, by the launch functions attention_cuda.cu itself calls (grids (T, a)
// and (T, g) of kAttentionThreads, their shared-memory sizes, forward then delta, dQ, dK/dV),
// against the CPU op: the key and query tiles (a second tile past 128 rows), the causal mask, the
// online softmax across tiles, the GQA head mapping (4 query heads over 2), head_dim past 128 (a thread's second
// dimension), T = 1, f32 and bf16 storage. Bounds as tests/cuda/attention_cuda_test.cu for these
// kernels: out, d_q, d_k, d_v within rel 1e-5 (+ 1e-5 of the largest magnitude) in f32 and rel
// 1e-2 (+ 1e-3) in bf16; lse within rel 1e-5 (+ 1e-5); at T = 1, d_q and d_k (zero exactly)
// within 1e-3. Inputs carry kGuard NaN rows past T, outputs kGuard sentinel rows: a read past T turns
// outputs into NaN, a write past T changes a sentinel. A std::thread runs each CUDA thread, so the
// T = 130 case runs only the blocks of a few rows around the tile edge (each block writes only its
// own row; the others are left as sentinels and not compared), with the CPU's out and lse as the
// backward's inputs.
#include "cuda_emulation.h"
// The emulation header first: it defines what the kernels' source expects from CUDA.
#include "executor/cuda/attention_ref_kernels.cuh"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "emulation_check.h"
#include "executor/ops/attention.h"

namespace flatpeak::exec {
namespace {

namespace cd = cuda_detail;
using namespace emu_check;

struct Shape {
  int64_t tokens, q_heads, kv_heads, head_dim;
  std::vector<unsigned> rows;  // the query (forward, dQ) and key (dK/dV) rows run; empty: all
  // >= 0: k[r, kv 0] = 2 · q[r, head 0] for r = boost_key, so that query row r's largest score
  // (head 0) is its own key: in a second key tile, the running max changes there.
  int64_t boost_key = -1;
};

// Rows `rows` of a [T, heads, d] tensor (row_elems = heads · d), widened.
template <class T>
std::vector<float> rows_of(const std::vector<T>& x, const std::vector<unsigned>& rows,
                           int64_t row_elems) {
  std::vector<float> out;
  for (unsigned r : rows) {
    for (int64_t e = 0; e < row_elems; ++e) out.push_back(to_f32(x[static_cast<size_t>(r * row_elems + e)]));
  }
  return out;
}

// lse [a, T] at the query rows `rows`.
std::vector<float> lse_at(const std::vector<float>& lse, const std::vector<unsigned>& rows,
                          int64_t heads, int64_t tokens) {
  std::vector<float> out;
  for (int64_t h = 0; h < heads; ++h)
    for (unsigned r : rows) out.push_back(lse[static_cast<size_t>(h * tokens + r)]);
  return out;
}

template <class T>
void run_case(const Shape& s, DType dtype) {
  const int64_t T_ = s.tokens, a = s.q_heads, g = s.kv_heads, d = s.head_dim;
  const bool all_rows = s.rows.empty();
  std::vector<unsigned> rows = s.rows;
  if (all_rows)
    for (int64_t i = 0; i < T_; ++i) rows.push_back(static_cast<unsigned>(i));
  const std::string name = std::string(dtype_name(dtype)) + " T" + std::to_string(T_) + " a" +
                           std::to_string(a) + " g" + std::to_string(g) + " d" + std::to_string(d);
  std::mt19937 rng(51);
  const std::vector<float> q_f = uniform(rng, T_ * a * d);
  std::vector<float> k_f = uniform(rng, T_ * g * d);
  for (int64_t c = 0; s.boost_key >= 0 && c < d; ++c) {
    k_f[static_cast<size_t>(s.boost_key * g * d + c)] = 2.0f * q_f[static_cast<size_t>(s.boost_key * a * d + c)];
  }
  const std::vector<T> q = to_storage<T>(q_f);                           // [T, a, d]
  const std::vector<T> k = to_storage<T>(k_f);                           // [T, g, d]
  const std::vector<T> v = to_storage<T>(uniform(rng, T_ * g * d));      // [T, g, d]
  const std::vector<T> d_out = to_storage<T>(uniform(rng, T_ * a * d));  // [T, a, d]

  // The CPU op (tile 16, as the CUDA test's reference cases) on the same stored values.
  AttentionArgs args;
  args.dtype = dtype;
  args.tokens = T_;
  args.q_heads = a;
  args.kv_heads = g;
  args.head_dim = d;
  args.tile_rows = 16;
  const size_t n_qo = static_cast<size_t>(T_ * a * d), n_kv = static_cast<size_t>(T_ * g * d);
  std::vector<T> out(n_qo), d_q(n_qo), d_k(n_kv), d_v(n_kv);
  std::vector<float> lse(static_cast<size_t>(a * T_));  // [a, T]
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

  // The kernels: inputs with NaN rows past T, outputs with sentinel rows past T.
  const size_t guard_qo = kGuard * static_cast<size_t>(a * d), guard_kv = kGuard * static_cast<size_t>(g * d);
  const T nan = nan_of<T>();
  const std::vector<T> gq = with_guard(q, nan, guard_qo);       // [T + kGuard, a, d]
  const std::vector<T> gk = with_guard(k, nan, guard_kv);       // [T + kGuard, g, d]
  const std::vector<T> gv = with_guard(v, nan, guard_kv);       // [T + kGuard, g, d]
  const std::vector<T> gdo = with_guard(d_out, nan, guard_qo);  // [T + kGuard, a, d]
  const T ts = sentinel_of<T>();
  const float fs = sentinel_of<float>();
  std::vector<T> e_out(n_qo + guard_qo, ts), e_dq(n_qo + guard_qo, ts);  // [T + kGuard, a, d]
  std::vector<T> e_dk(n_kv + guard_kv, ts), e_dv(n_kv + guard_kv, ts);   // [T + kGuard, g, d]
  std::vector<float> e_lse(static_cast<size_t>(a * T_) + kGuard, fs);    // [a, T] + sentinel
  std::vector<float> delta(static_cast<size_t>(a * T_) + kGuard, fs);    // [a, T] D + sentinel
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));  // softmax_scale 0, as the launcher

  // attention_forward_cuda: the blocks of the rows `rows` (each block writes only its own row).
  {
    const BlockRows only(rows);
    cd::launch_attention_ref_forward(gq.data(), gk.data(), gv.data(), e_out.data(), e_lse.data(),
                                     T_, a, g, d, scale, nullptr);
  }
  // attention_backward_cuda: delta over T·a, then dQ (T, a) and dK/dV (T, g). Its out and lse are
  // the forward's (the CPU's where the forward ran only some rows), NaN past T.
  std::vector<T> b_out = all_rows ? e_out : out;  // [T + kGuard, a, d]
  b_out.resize(n_qo);
  b_out = with_guard(b_out, nan, guard_qo);
  std::vector<float> b_lse = all_rows ? e_lse : lse;  // [a, T] + NaN
  b_lse.resize(static_cast<size_t>(a * T_));
  b_lse = with_guard(b_lse, nan_of<float>());
  cd::launch_attention_delta(b_out.data(), gdo.data(), delta.data(), T_, a, d, nullptr);
  {
    const BlockRows only(rows);
    cd::launch_attention_ref_backward(gq.data(), gk.data(), gv.data(), gdo.data(), b_lse.data(),
                                      delta.data(), e_dq.data(), e_dk.data(), e_dv.data(), T_, a, g,
                                      d, scale, nullptr);
  }

  const Tol tol = tol_of(dtype);
  expect_within(name + " out", rows_of(e_out, rows, a * d), rows_of(out, rows, a * d), tol);
  expect_within(name + " lse", lse_at(e_lse, rows, a, T_), lse_at(lse, rows, a, T_), kF32Tol);
  if (T_ == 1) {  // the one key has probability 1: dS = dP − D = 0, rounding noise only
    for (float x : rows_of(e_dq, rows, a * d)) EXPECT_LE(std::fabs(x), 1e-3f) << name << " d_q";
    for (float x : rows_of(e_dk, rows, g * d)) EXPECT_LE(std::fabs(x), 1e-3f) << name << " d_k";
  } else {
    expect_within(name + " d_q", rows_of(e_dq, rows, a * d), rows_of(d_q, rows, a * d), tol);
    expect_within(name + " d_k", rows_of(e_dk, rows, g * d), rows_of(d_k, rows, g * d), tol);
  }
  expect_within(name + " d_v", rows_of(e_dv, rows, g * d), rows_of(d_v, rows, g * d), tol);
  // D = rowsum(dO ⊙ O) in fp32 over the stored values, every (h, i).
  std::vector<float> want_delta(static_cast<size_t>(a * T_));
  for (int64_t i = 0; i < T_; ++i) {
    for (int64_t h = 0; h < a; ++h) {
      double dot = 0.0;
      for (int64_t c = 0; c < d; ++c) {
        const size_t at = static_cast<size_t>((i * a + h) * d + c);
        dot += static_cast<double>(to_f32(d_out[at])) * to_f32(b_out[at]);
      }
      want_delta[static_cast<size_t>(h * T_ + i)] = static_cast<float>(dot);
    }
  }
  expect_within(name + " delta", widen(delta, want_delta.size()), want_delta, kF32Tol);
  expect_guard(name + " out", e_out, n_qo, ts);
  expect_guard(name + " d_q", e_dq, n_qo, ts);
  expect_guard(name + " d_k", e_dk, n_kv, ts);
  expect_guard(name + " d_v", e_dv, n_kv, ts);
  expect_guard(name + " lse", e_lse, static_cast<size_t>(a * T_), fs);
  expect_guard(name + " delta", delta, static_cast<size_t>(a * T_), fs);
}

TEST(AttentionRefEmulation, SharedMemoryPerKernel) {
  // Hand-derived from the kernels' layouts: q row [d] + P [128]; q, dO rows [2d] + dS [128];
  // k, v rows [2d] + P, dS [2 · 128]; fp32.
  EXPECT_EQ(cd::attention_forward_shared_bytes(64), (64 + 128) * 4u);
  EXPECT_EQ(cd::attention_dq_shared_bytes(64), (128 + 128) * 4u);
  EXPECT_EQ(cd::attention_dkv_shared_bytes(64), (128 + 256) * 4u);
  EXPECT_EQ(cd::kAttentionThreads * cd::kDimsPerThread, 512);  // the launcher's head_dim limit
}

// GQA (4 query heads over 2, so h / group and h % g differ), T below one tile.
TEST(AttentionRefEmulation, F32Gqa) { run_case<float>({3, 4, 2, 16, {}}, DType::F32); }

// head_dim 136 > 128 threads: threads 0..7 own a second dimension.
TEST(AttentionRefEmulation, F32WideHead) { run_case<float>({3, 1, 1, 136, {}}, DType::F32); }

TEST(AttentionRefEmulation, Bf16OneToken) { run_case<Bf16>({1, 4, 2, 32, {}}, DType::BF16); }

// T = 130: query rows 128, 129 fold a second key tile (row 128's largest score in it, so the
// first tile's sum and output are rescaled), key rows 0, 1 a second query tile (of 2 and 1
// rows); rows 127 and 128 meet at the tile edge.
TEST(AttentionRefEmulation, Bf16SecondTile) {
  run_case<Bf16>({130, 2, 1, 32, {0, 1, 127, 128, 129}, 128}, DType::BF16);
}

}  // namespace
}  // namespace flatpeak::exec
