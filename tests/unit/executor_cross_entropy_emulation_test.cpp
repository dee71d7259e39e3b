// The cross-entropy kernels (executor/cuda/cross_entropy_kernels.cuh) run on the host through
// cuda_emulation.h, by the launch sequences cross_entropy_cuda.cu itself runs (the header's: the
// same grids, kThreads and kernel order; gemm_cpu stands in for its cuBLAS GEMMs, with the same
// operands, shapes and accumulation), against the CPU op: the block-per-row reductions, the
// online fold across vocab blocks, target columns at block edges, ignored targets, and tails in
// T and V (a vocab block wider than the 256 threads and one narrower). Bounds as
// tests/cuda/cross_entropy_cuda_test.cu: lse, loss within rel 1e-5 (+ 1e-5 of the largest
// magnitude); d_x rel 1e-5 in f32, 1e-2 (+ 1e-3) in bf16; d_w rel 1e-5 with a 1e-3 floor in bf16;
// gradients in forward equal to forward + backward bitwise. The materialised kernels: lse, loss,
// log_probs and d_logits (fp32) within the fp32 bound; d_x and d_w within the storage's bound
// (the CUDA GEMMs take the compute-dtype dz, the CPU's the fp32 d_logits). Every input carries
// NaN past its end (logits a huge value: fmaxf drops a NaN) and every output a sentinel: a read
// past the end shows as NaN or ±inf, a write as a changed sentinel. Each workspace region is its
// own guarded buffer sized to the block.
#include "cuda_emulation.h"
// The emulation header first: it defines what the kernels' source expects from CUDA.
#include "executor/cuda/cross_entropy_kernels.cuh"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "emulation_check.h"
#include "executor/cpu/gemm_cpu.h"
#include "executor/ops/cross_entropy.h"

namespace flatpeak::exec {
namespace {

namespace cd = cuda_detail;
using namespace emu_check;

constexpr int32_t kTargetGuard = 0x7fffffff;  // past T in targets: out of every vocab range

struct Shape {
  int64_t tokens, vocab, hidden, token_block_rows, vocab_block_rows;
};

std::string name_of(const Shape& s, DType dtype) {
  return std::string(dtype_name(dtype)) + " T" + std::to_string(s.tokens) + " V" +
         std::to_string(s.vocab) + " H" + std::to_string(s.hidden) + " Tb" +
         std::to_string(s.token_block_rows) + " Vb" + std::to_string(s.vocab_block_rows);
}

// [T] in 0..V-1 or -1 (ignored): token 0 the last vocab row, token 1 ignored, token 2 the first
// column of the second vocab block; then random, every fifth ignored.
std::vector<int32_t> make_targets(std::mt19937& rng, const Shape& s) {
  std::uniform_int_distribution<int32_t> dist(0, static_cast<int32_t>(s.vocab - 1));
  std::vector<int32_t> y(static_cast<size_t>(s.tokens));
  for (int64_t t = 0; t < s.tokens; ++t) y[static_cast<size_t>(t)] = t % 5 == 1 ? -1 : dist(rng);
  const int32_t firsts[] = {static_cast<int32_t>(s.vocab - 1), -1,
                            static_cast<int32_t>(s.vocab_block_rows % s.vocab)};
  for (int64_t t = 0; t < std::min<int64_t>(3, s.tokens); ++t) y[static_cast<size_t>(t)] = firsts[t];
  return y;
}

// ---- blocked: the launcher's run() (cross_entropy_cuda.cu) ----

enum class Pass { Forward, Backward, Fused };

template <class T>
bool same_bits(const std::vector<T>& x, const std::vector<T>& y) {
  return x.size() == y.size() && std::memcmp(x.data(), y.data(), x.size() * sizeof(T)) == 0;
}

// Host buffers for the launcher's arguments; the guards sit past T (inputs NaN, outputs sentinel).
template <class T>
struct BlockedIo {
  const Shape& s;
  const std::vector<T>& x;              // [T, H] + NaN
  const std::vector<T>& w;              // [V, H] + NaN
  const std::vector<int32_t>& targets;  // [T] + kTargetGuard
  float grad_scale;
  std::vector<float> lse, loss;         // [T] + sentinel (forward writes)
  std::vector<float> lse_in;            // [T] + NaN: lse as the backward reads it
  std::vector<T> d_x;                   // [T, H] + sentinel
  std::vector<float> d_w;               // [V, H] + sentinel, accumulated
};

// The launcher's cuBLAS logits GEMM into logits [tb, Vb] + guard: [tb, vb] fp32 = x[t0 : t0 + tb] ·
// w[v0 : v0 + vb]ᵀ, the rest huge (the kernels take a max over it, which a NaN would pass unseen).
template <class T>
void logits_block(const BlockedIo<T>& io, std::vector<float>& logits, int64_t t0, int64_t tb,
                  int64_t v0, int64_t vb) {
  const int64_t H = io.s.hidden;
  std::fill(logits.begin() + tb * vb, logits.end(), huge_of<float>());
  gemm_cpu(false, true, tb, vb, H, 1.0f, io.x.data() + t0 * H, H, io.w.data() + v0 * H, H, false,
           logits.data(), vb);
}

// The launcher's forward_block: the header's sequence, gemm_cpu for its GEMM.
template <class T>
void forward_block(BlockedIo<T>& io, int64_t t0, int64_t tb, const std::string& name) {
  const Shape& s = io.s;
  const float sentinel = sentinel_of<float>();
  std::vector<float> logits(static_cast<size_t>(tb * s.vocab_block_rows) + kGuard);  // [tb, Vb]
  std::vector<float> row_max(static_cast<size_t>(tb) + kGuard, sentinel);       // [tb]
  std::vector<float> row_sum(row_max.size(), sentinel), target_logit(row_max.size(), sentinel);
  cd::blocked_forward_block(logits.data(), row_max.data(), row_sum.data(), target_logit.data(),
                            io.targets.data() + t0, io.lse.data() + t0, io.loss.data() + t0, tb,
                            s.vocab, s.vocab_block_rows, nullptr, [&](int64_t v0, int64_t vb) {
                              logits_block(io, logits, t0, tb, v0, vb);
                            });
  expect_guard(name + " row_max", row_max, static_cast<size_t>(tb), sentinel);
  expect_guard(name + " row_sum", row_sum, static_cast<size_t>(tb), sentinel);
  expect_guard(name + " target_logit", target_logit, static_cast<size_t>(tb), sentinel);
}

// The launcher's backward_block: the header's sequence, gemm_cpu for its three GEMMs.
template <class T>
void backward_block(BlockedIo<T>& io, int64_t t0, int64_t tb, const std::string& name) {
  const Shape& s = io.s;
  const int64_t H = s.hidden;
  std::vector<float> dx_acc(static_cast<size_t>(tb * H) + kGuard, nan_of<float>());  // [tb, H]
  std::fill(dx_acc.begin(), dx_acc.begin() + tb * H, 0.0f);  // the launcher's cudaMemsetAsync
  std::vector<float> logits(static_cast<size_t>(tb * s.vocab_block_rows) + kGuard);  // [tb, Vb]
  std::vector<T> dz(logits.size(), sentinel_of<T>());                                  // [tb, Vb]
  const T* x_blk = io.x.data() + t0 * H;
  cd::blocked_backward_block(
      logits.data(), dz.data(), dx_acc.data(), io.d_x.data() + t0 * H, io.targets.data() + t0,
      io.lse_in.data() + t0, io.grad_scale, tb, H, s.vocab, s.vocab_block_rows, nullptr,
      [&](int64_t v0, int64_t vb) { logits_block(io, logits, t0, tb, v0, vb); },
      [&](int64_t v0, int64_t vb) {
        expect_guard(name + " dlogits", dz, static_cast<size_t>(tb * vb), sentinel_of<T>());
        // dX_blk += dz · W_blk;  dW_blk += dzᵀ · X_blk, as the launcher's two GEMMs.
        const T* w_blk = io.w.data() + v0 * H;
        gemm_cpu(false, false, tb, H, vb, 1.0f, dz.data(), vb, w_blk, H, true, dx_acc.data(), H);
        gemm_cpu(true, false, vb, H, tb, 1.0f, dz.data(), vb, x_blk, H, true,
                 io.d_w.data() + v0 * H, H);
        std::fill(dz.begin(), dz.end(), sentinel_of<T>());  // a stale dz would hide a short write
      });
}

template <class T>
void run_blocked(BlockedIo<T>& io, Pass pass, const std::string& name) {
  const Shape& s = io.s;
  for (int64_t t0 = 0; t0 < s.tokens; t0 += s.token_block_rows) {
    const int64_t tb = std::min(s.token_block_rows, s.tokens - t0);
    if (pass != Pass::Backward) forward_block(io, t0, tb, name);
    if (pass == Pass::Fused) {  // the backward reads the lse the forward just wrote
      std::copy(io.lse.begin() + t0, io.lse.begin() + t0 + tb, io.lse_in.begin() + t0);
    }
    if (pass != Pass::Forward) backward_block(io, t0, tb, name);
  }
}

// with_fused: also gradients in forward, which must equal forward + backward bit for bit.
template <class T>
void blocked_case(const Shape& s, DType dtype, bool with_fused) {
  const std::string name = "blocked " + name_of(s, dtype);
  const int64_t T_ = s.tokens, V = s.vocab, H = s.hidden;
  std::mt19937 rng(31);
  const std::vector<T> x = to_storage<T>(uniform(rng, T_ * H));  // [T, H]
  const std::vector<T> w = to_storage<T>(uniform(rng, V * H));   // [V, H]
  const std::vector<int32_t> targets = make_targets(rng, s);     // [T]
  std::vector<float> d_w0 = uniform(rng, V * H);                 // [V, H] accumulated into
  for (float& e : d_w0) e *= 0.01f;

  // The CPU op: forward, then backward from the saved lse.
  CrossEntropyArgs a;
  a.dtype = dtype;
  a.tokens = T_;
  a.vocab = V;
  a.hidden = H;
  a.grad_scale = 1.0f / static_cast<float>(T_);
  a.token_block_rows = s.token_block_rows;
  a.vocab_block_rows = s.vocab_block_rows;
  std::vector<float> lse(static_cast<size_t>(T_)), loss(lse.size()), d_w = d_w0;
  std::vector<T> d_x(static_cast<size_t>(T_ * H));
  std::vector<float> workspace(static_cast<size_t>(blocked_cross_entropy_workspace_bytes(a) / 4));
  a.x = x.data();
  a.w = w.data();
  a.targets = targets.data();
  a.lse = lse.data();
  a.loss = loss.data();
  a.d_x = d_x.data();
  a.d_w = d_w.data();
  a.workspace = workspace.data();
  blocked_cross_entropy_forward_cpu(a);
  blocked_cross_entropy_backward_cpu(a);

  // The kernels: forward then backward, and gradients in forward.
  const std::vector<T> gx = with_guard(x, nan_of<T>()), gw = with_guard(w, nan_of<T>());
  const std::vector<int32_t> gy = with_guard(targets, kTargetGuard);
  const float fs = sentinel_of<float>();
  auto make_io = [&] {
    return BlockedIo<T>{s,
                        gx,
                        gw,
                        gy,
                        a.grad_scale,
                        std::vector<float>(static_cast<size_t>(T_) + kGuard, fs),
                        std::vector<float>(static_cast<size_t>(T_) + kGuard, fs),
                        std::vector<float>(static_cast<size_t>(T_) + kGuard, nan_of<float>()),
                        std::vector<T>(static_cast<size_t>(T_ * H) + kGuard, sentinel_of<T>()),
                        with_guard(d_w0, fs)};
  };
  BlockedIo<T> two = make_io(), fused = make_io();
  run_blocked(two, Pass::Forward, name);
  std::copy(two.lse.begin(), two.lse.begin() + T_, two.lse_in.begin());  // the saved lse
  run_blocked(two, Pass::Backward, name);
  if (with_fused) run_blocked(fused, Pass::Fused, name + " fused");

  const size_t n_t = static_cast<size_t>(T_), n_x = static_cast<size_t>(T_ * H);
  const size_t n_w = static_cast<size_t>(V * H);
  expect_within(name + " lse", widen(two.lse, n_t), lse, kF32Tol);
  expect_within(name + " loss", widen(two.loss, n_t), loss, kF32Tol);
  expect_within(name + " d_x", widen(two.d_x, n_x), widen(d_x, n_x), tol_of(dtype));
  // d_w in bf16: a one-ulp difference in a logit may round a bf16 dz the other way (the CUDA
  // test's reason for the same floor).
  expect_within(name + " d_w", widen(two.d_w, n_w), d_w,
                dtype == DType::BF16 ? Tol{kF32Tol.rel, kBf16Tol.floor} : kF32Tol);
  expect_guard(name + " lse", two.lse, n_t, fs);
  expect_guard(name + " loss", two.loss, n_t, fs);
  expect_guard(name + " d_x", two.d_x, n_x, sentinel_of<T>());
  expect_guard(name + " d_w", two.d_w, n_w, fs);
  if (!with_fused) return;
  // Gradients in forward: the same kernels in the same order, so the same bits.
  EXPECT_TRUE(same_bits(fused.lse, two.lse)) << name << " fused lse";
  EXPECT_TRUE(same_bits(fused.loss, two.loss)) << name << " fused loss";
  EXPECT_TRUE(same_bits(fused.d_x, two.d_x)) << name << " fused d_x";
  EXPECT_TRUE(same_bits(fused.d_w, two.d_w)) << name << " fused d_w";
}

// ---- materialised: materialized_cross_entropy_{forward,backward}_cuda ----

template <class T>
void materialized_case(const Shape& s, DType dtype) {
  const std::string name = "materialised " + name_of(s, dtype);
  const int64_t T_ = s.tokens, V = s.vocab, H = s.hidden;
  std::mt19937 rng(37);
  const std::vector<T> x = to_storage<T>(uniform(rng, T_ * H));  // [T, H]
  const std::vector<T> w = to_storage<T>(uniform(rng, V * H));   // [V, H]
  const std::vector<int32_t> targets = make_targets(rng, s);     // [T]
  const float g = 1.0f / static_cast<float>(T_);
  const size_t n_t = static_cast<size_t>(T_), n_tv = static_cast<size_t>(T_ * V);
  const size_t n_x = static_cast<size_t>(T_ * H), n_w = static_cast<size_t>(V * H);

  MaterializedCrossEntropyArgs a;
  a.dtype = dtype;
  a.tokens = T_;
  a.vocab = V;
  a.hidden = H;
  a.grad_scale = g;
  std::vector<T> logits(n_tv), d_x(n_x), d_w(n_w);
  std::vector<float> log_probs(n_tv), d_logits(n_tv), lse(n_t), loss(n_t);
  a.x = x.data();
  a.w = w.data();
  a.targets = targets.data();
  a.logits = logits.data();
  a.log_probs = log_probs.data();
  a.d_logits = d_logits.data();
  a.lse = lse.data();
  a.loss = loss.data();
  a.d_x = d_x.data();
  a.d_w = d_w.data();
  materialized_cross_entropy_forward_cpu(a);
  materialized_cross_entropy_backward_cpu(a);

  // Forward: the launcher's GEMM into the compute-dtype logits, then one block per token.
  const std::vector<T> gx = with_guard(x, nan_of<T>()), gw = with_guard(w, nan_of<T>());
  const std::vector<int32_t> gy = with_guard(targets, kTargetGuard);
  const float fs = sentinel_of<float>();
  std::vector<T> e_logits(n_tv + kGuard, huge_of<T>());  // [T, V] + huge (a max is taken over it)
  gemm_cpu(false, true, T_, V, H, 1.0f, gx.data(), H, gw.data(), H, false, e_logits.data(), V);
  std::vector<float> e_log_probs(n_tv + kGuard, fs), e_lse(n_t + kGuard, fs), e_loss(e_lse);
  cd::materialized_log_softmax(e_logits.data(), e_log_probs.data(), gy.data(), e_lse.data(),
                               e_loss.data(), T_, V, nullptr);
  expect_within(name + " lse", widen(e_lse, n_t), lse, kF32Tol);
  expect_within(name + " loss", widen(e_loss, n_t), loss, kF32Tol);
  expect_within(name + " log_probs", widen(e_log_probs, n_tv), log_probs, kF32Tol);
  expect_guard(name + " log_probs", e_log_probs, n_tv, fs);
  expect_guard(name + " lse", e_lse, n_t, fs);
  expect_guard(name + " loss", e_loss, n_t, fs);

  // Backward: dz over the logits buffer (the launcher's operand), then its two GEMMs.
  const std::vector<float> lp_in = with_guard(widen(e_log_probs, n_tv), nan_of<float>());
  std::fill(e_logits.begin() + static_cast<std::ptrdiff_t>(n_tv), e_logits.end(), sentinel_of<T>());
  std::vector<float> e_d_logits(n_tv + kGuard, fs);  // [T, V]
  cd::materialized_dlogits(lp_in.data(), e_d_logits.data(), e_logits.data(), gy.data(), T_, V, g,
                           nullptr);
  expect_guard(name + " d_logits", e_d_logits, n_tv, fs);
  expect_guard(name + " dz", e_logits, n_tv, sentinel_of<T>());
  std::vector<T> e_dx(n_x + kGuard, sentinel_of<T>()), e_dw(n_w + kGuard, sentinel_of<T>());
  gemm_cpu(false, false, T_, H, V, 1.0f, e_logits.data(), V, gw.data(), H, false, e_dx.data(), H);
  gemm_cpu(true, false, V, H, T_, 1.0f, e_logits.data(), V, gx.data(), H, false, e_dw.data(), H);
  expect_within(name + " d_logits", widen(e_d_logits, n_tv), d_logits, kF32Tol);
  expect_within(name + " d_x", widen(e_dx, n_x), widen(d_x, n_x), tol_of(dtype));
  expect_within(name + " d_w", widen(e_dw, n_w), widen(d_w, n_w), tol_of(dtype));
}

// The emulation runs a std::thread per CUDA thread (256 per block, a block per logits row), so
// the shapes are tiny. V = 300 in vocab blocks of 288 (wider than the 256 threads, then a tail of
// 12) or of 128 (two full blocks, then 44); T = 3 in token blocks of 2 (a tail of 1), T = 2 in one
// block of 4.
TEST(CrossEntropyEmulation, BlockedF32WithGradientsInForward) {
  blocked_case<float>({3, 300, 16, 2, 288}, DType::F32, true);
}

TEST(CrossEntropyEmulation, BlockedBf16) { blocked_case<Bf16>({2, 300, 16, 4, 128}, DType::BF16, false); }

// 2 tokens over V = 300 (wider than the 256 threads) in f32; one token over V = 77 in bf16.
TEST(CrossEntropyEmulation, Materialized) {
  materialized_case<float>({2, 300, 16, 0, 0}, DType::F32);
  materialized_case<Bf16>({1, 77, 16, 0, 0}, DType::BF16);
}

// The LM head bias kernels: broadcast into a logits buffer (the GEMM then adds into it), and its
// gradient as column sums of dz over the rows in order: bitwise the CPU op's loops. 300 columns:
// wider than a block of 256 threads, with a tail.
TEST(CrossEntropyEmulation, HeadBiasKernels) {
  const int64_t rows = 5, cols = 300;
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> dist(-2.0f, 2.0f);
  std::vector<Bf16> bias(static_cast<size_t>(cols)), dz(static_cast<size_t>(rows * cols));
  for (auto& b : bias) b = f32_to_bf16(dist(rng));
  for (auto& d : dz) d = f32_to_bf16(dist(rng));
  std::vector<float> out(static_cast<size_t>(rows * cols), -1.0f);
  cd::launch_broadcast_bias(bias.data(), out.data(), rows, cols, nullptr);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) ASSERT_EQ(out[static_cast<size_t>(r * cols + c)], to_f32(bias[static_cast<size_t>(c)]));
  std::vector<float> acc(static_cast<size_t>(cols)), want(static_cast<size_t>(cols));
  std::vector<Bf16> once(static_cast<size_t>(cols));
  for (int64_t c = 0; c < cols; ++c) acc[static_cast<size_t>(c)] = dist(rng);
  for (int64_t c = 0; c < cols; ++c) {
    float sum = 0.0f;
    for (int64_t r = 0; r < rows; ++r) sum += to_f32(dz[static_cast<size_t>(r * cols + c)]);
    want[static_cast<size_t>(c)] = acc[static_cast<size_t>(c)] + sum;
    once[static_cast<size_t>(c)] = f32_to_bf16(sum);
  }
  cd::launch_bias_grad(dz.data(), rows, cols, acc.data(), true, nullptr);  // blocked: fp32 +=
  std::vector<Bf16> stored(static_cast<size_t>(cols));
  cd::launch_bias_grad(dz.data(), rows, cols, stored.data(), false, nullptr);  // materialised: written once
  for (int64_t c = 0; c < cols; ++c) {
    EXPECT_EQ(acc[static_cast<size_t>(c)], want[static_cast<size_t>(c)]) << c;
    EXPECT_EQ(stored[static_cast<size_t>(c)].bits, once[static_cast<size_t>(c)].bits) << c;
  }
}

}  // namespace
}  // namespace flatpeak::exec
