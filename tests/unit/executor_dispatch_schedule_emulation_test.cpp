// The dispatch schedule's kernels (executor/cuda/dispatch_schedule_kernels.cuh) run on the host
// through cuda_emulation.h, by the launch functions dispatch_schedule_cuda.cu itself calls (its
// grids, kThreads, one block per round row for the combine backward), in its sequence (kept softmax;
// per round gather, then combine into an fp32 accumulator; fp32 → bf16; per round the combine
// backward and the scatter-add, the forward's gathered prob standing in for the recompute's),
// against the CPU ops over all T·k copies: the router's renormalised weights (router_forward_cpu,
// or a softmax over the kept logits in double for ids the router would not pick),
// permute_forward_cpu for the gathered rows (bitwise), combine_forward_cpu (fp32 and bf16) for the
// accumulator and output, combine_backward_cpu for d_y (bitwise) and d prob, permute_backward_cpu
// for d_x. Random rows stand in for the expert FFN's outputs y and input gradients d_in. Rounds
// are capped slices of the sorted rows (an expert's rows spanning two rounds, a short last round)
// or one uncapped round; H below and above the 256 threads. Every input carries NaN past its end
// (row maps: an index whose token is past T) and every output a sentinel. Bounds as the CUDA
// tests': fp32 rel 1e-5 (+ 1e-5 of the largest magnitude), bf16 1e-2 (+ 1e-3); the fp32 atomics
// may sum a token's rows in any order.
#include "cuda_emulation.h"
// The emulation header first: it defines what the kernels' source expects from CUDA.
#include "executor/cuda/dispatch_schedule_kernels.cuh"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "emulation_check.h"
#include "executor/ops/combine.h"
#include "executor/ops/permute.h"
#include "executor/ops/router.h"

namespace flatpeak::exec {
namespace {

namespace cd = cuda_detail;
using namespace emu_check;

struct Shape {
  int64_t T, E, k, H, C;  // C: rows per round, 0 for one uncapped round of T·k
  bool router_ids;        // ids from router_forward_cpu, else k random distinct experts per token
};

std::string name_of(const Shape& s) {
  return "T" + std::to_string(s.T) + " E" + std::to_string(s.E) + " k" + std::to_string(s.k) + " H" +
         std::to_string(s.H) + " C" + std::to_string(s.C) + (s.router_ids ? " router ids" : " random ids");
}

// Rows [r0, r0 + n) of a [rows, H] buffer, with NaN past them (a round's slice of the sorted rows).
std::vector<Bf16> rows_of(const std::vector<Bf16>& x, int64_t r0, int64_t n, int64_t H) {
  std::vector<Bf16> out(x.begin() + r0 * H, x.begin() + (r0 + n) * H);
  return with_guard(out, nan_of<Bf16>());
}

void run_case(const Shape& s, uint32_t seed) {
  SCOPED_TRACE(name_of(s));
  const int64_t T = s.T, E = s.E, k = s.k, H = s.H, N = T * k;
  const int64_t C = s.C == 0 ? N : std::min(s.C, N);
  const int64_t rounds = (N + C - 1) / C;
  std::mt19937 rng(seed);

  // ---- routing: ids and the kept softmax
  std::vector<float> logits = uniform(rng, T * E);  // [T, E] fp32
  for (float& v : logits) v *= 4.0f;
  std::vector<int32_t> ids(z(N));   // [T, k] i32
  std::vector<float> want_w(z(N));  // [T, k] fp32
  if (s.router_ids) {
    RouterArgs r;
    r.logits = logits.data();
    r.topk_ids = ids.data();
    r.topk_weights = want_w.data();
    r.tokens = T;
    r.experts = E;
    r.top_k = k;
    router_forward_cpu(r);
  } else {
    std::vector<int32_t> experts(z(E));
    std::iota(experts.begin(), experts.end(), 0);
    for (int64_t t = 0; t < T; ++t) {
      std::shuffle(experts.begin(), experts.end(), rng);
      double sum = 0.0;
      for (int64_t j = 0; j < k; ++j) {
        ids[z(t * k + j)] = experts[z(j)];
        sum += std::exp(static_cast<double>(logits[z(t * E + experts[z(j)])]));
      }
      for (int64_t j = 0; j < k; ++j)
        want_w[z(t * k + j)] =
            static_cast<float>(std::exp(static_cast<double>(logits[z(t * E + ids[z(t * k + j)])])) / sum);
    }
  }
  const std::vector<float> logits_in = with_guard(logits, nan_of<float>());  // [T, E] + NaN
  const std::vector<int32_t> ids_in =
      with_guard(ids, static_cast<int32_t>(E));                    // [T, k] + an id past the row
  std::vector<float> topk_w(z(N) + kGuard, sentinel_of<float>());  // [T, k] fp32 + sentinel
  cd::launch_kept_softmax(logits_in.data(), ids_in.data(), topk_w.data(), T, E, k, nullptr);
  expect_guard("topk_w", topk_w, z(N), sentinel_of<float>());
  expect_within("topk_w", widen(topk_w, z(N)), want_w, kF32Tol);

  std::vector<int64_t> counts(z(E));                          // [E]
  std::vector<int32_t> slot_to_row(z(N)), row_to_slot(z(N));  // [T·k] i32
  PermuteArgs p;
  p.dtype = DType::BF16;
  p.topk_ids = ids.data();
  p.expert_counts = counts.data();
  p.slot_to_row = slot_to_row.data();
  p.row_to_slot = row_to_slot.data();
  p.tokens = T;
  p.top_k = k;
  p.experts = E;
  p.hidden = H;
  moe_route_cpu(p);
  if (C < N) {  // the capped cases hold an expert whose rows span two rounds
    bool spans = false;
    int64_t start = 0;
    for (int64_t e = 0; e < E; ++e) {
      spans = spans || (start / C != (start + counts[z(e)] - 1) / C && counts[z(e)] > 0);
      start += counts[z(e)];
    }
    EXPECT_TRUE(spans);
  }
  // Past T·k: slot T·k, whose token T indexes the NaN rows past x and d_out.
  const std::vector<int32_t> row_to_slot_in = with_guard(row_to_slot, static_cast<int32_t>(N));
  const std::vector<float> topk_w_in =
      with_guard(std::vector<float>(topk_w.begin(), topk_w.begin() + N), nan_of<float>());  // [T, k] + NaN

  const std::vector<Bf16> x_host = to_storage<Bf16>(uniform(rng, T * H));  // [T, H] bf16
  const std::vector<Bf16> y_perm = to_storage<Bf16>(uniform(rng, N * H));  // [T·k, H] bf16 expert outputs
  const std::vector<Bf16> d_out_host = to_storage<Bf16>(uniform(rng, T * H));        // [T, H] bf16
  const std::vector<Bf16> d_in_perm = to_storage<Bf16>(uniform(rng, N * H));         // [T·k, H] bf16 FFN d_x
  const std::vector<Bf16> x = with_guard(x_host, nan_of<Bf16>(), z(H) + kGuard);     // + NaN rows
  const std::vector<Bf16> d_out = with_guard(d_out_host, nan_of<Bf16>(), z(H) + kGuard);

  std::vector<Bf16> want_x_perm(z(N * H));  // [T·k, H] bf16
  p.x = x_host.data();
  p.x_perm = want_x_perm.data();
  permute_forward_cpu(p);

  // The round's gather, as forward_round launches it: in [n, H] bf16, prob [n] fp32.
  auto gather = [&](int64_t r0, int64_t n, std::vector<Bf16>& in, std::vector<float>& prob) {
    in.assign(z(n * H) + kGuard, sentinel_of<Bf16>());
    prob.assign(z(n) + kGuard, sentinel_of<float>());
    cd::launch_gather_round(x.data(), topk_w_in.data(), row_to_slot_in.data(), r0, n, H, k, in.data(),
                            prob.data(), nullptr);
    expect_guard("in", in, z(n * H), sentinel_of<Bf16>());
    expect_guard("prob", prob, z(n), sentinel_of<float>());
    EXPECT_TRUE(same_bits(in.data(), want_x_perm.data() + r0 * H, z(n * H))) << "in of rows " << r0;
    for (int64_t r = 0; r < n; ++r)
      EXPECT_EQ(prob[z(r)], topk_w[z(row_to_slot[z(r0 + r)])]) << "prob of row " << r0 + r;
  };

  // ---- no-grad forward: the rounds into the fp32 accumulator, then bf16
  std::vector<float> acc = with_guard(std::vector<float>(z(T * H), 0.0f), sentinel_of<float>());
  std::vector<std::vector<float>> probs(z(rounds));  // [n] fp32 + sentinel per round
  for (int64_t j = 0; j < rounds; ++j) {
    const int64_t r0 = j * C, n = std::min(C, N - r0);
    std::vector<Bf16> in;
    std::vector<float>& prob = probs[z(j)];
    gather(r0, n, in, prob);
    const std::vector<Bf16> y = rows_of(y_perm, r0, n, H);  // [n, H] bf16 + NaN
    cd::launch_combine_round(y.data(), prob.data(), row_to_slot_in.data(), r0, n, H, k, acc.data(),
                             nullptr);
  }
  std::vector<Bf16> out(z(T * H) + kGuard, sentinel_of<Bf16>());  // [T, H] bf16
  cd::launch_f32_to_bf16(acc.data(), out.data(), T * H, nullptr);
  expect_guard("acc", acc, z(T * H), sentinel_of<float>());
  expect_guard("out", out, z(T * H), sentinel_of<Bf16>());
  for (int64_t i = 0; i < T * H; ++i) ASSERT_EQ(out[z(i)].bits, f32_to_bf16(acc[z(i)]).bits) << "out " << i;

  CombineArgs c;
  c.weights = topk_w.data();
  c.slot_to_row = slot_to_row.data();
  c.tokens = T;
  c.top_k = k;
  c.hidden = H;
  {
    const std::vector<float> y_f32 = widen(y_perm, z(N * H));
    std::vector<float> want_acc(z(T * H));  // [T, H] fp32
    c.dtype = DType::F32;
    c.y = y_f32.data();
    c.out = want_acc.data();
    combine_forward_cpu(c);
    expect_within("acc", widen(acc, z(T * H)), want_acc, kF32Tol);
    std::vector<Bf16> want_out(z(T * H));  // [T, H] bf16
    c.dtype = DType::BF16;
    c.y = y_perm.data();
    c.out = want_out.data();
    combine_forward_cpu(c);
    expect_within("out", widen(out, z(T * H)), widen(want_out, z(T * H)), kBf16Tol);
  }

  // ---- backward: per round the recompute's gather, the combine backward, the scatter-add
  std::vector<Bf16> want_d_y(z(N * H));  // [T·k, H] bf16 (permuted rows)
  std::vector<float> want_d_w(z(N));     // [T, k] fp32
  c.dtype = DType::BF16;
  c.y = y_perm.data();
  c.d_out = d_out_host.data();
  c.d_y = want_d_y.data();
  c.d_weights = want_d_w.data();
  combine_backward_cpu(c);
  std::vector<float> d_topk_w(z(N) + kGuard, sentinel_of<float>());  // [T, k] fp32
  std::vector<float> d_x = with_guard(std::vector<float>(z(T * H), 0.0f), sentinel_of<float>());
  for (int64_t j = 0; j < rounds; ++j) {
    const int64_t r0 = j * C, n = std::min(C, N - r0);
    // The recompute's gather is the forward's (same kernel and inputs): its prob is reused.
    const std::vector<float>& prob = probs[z(j)];
    const std::vector<Bf16> y = rows_of(y_perm, r0, n, H);          // the recompute's y
    std::vector<Bf16> d_y(z(n * H) + kGuard, sentinel_of<Bf16>());  // [n, H] bf16
    cd::launch_combine_backward_round(d_out.data(), y.data(), prob.data(), row_to_slot_in.data(), r0, n,
                                      H, k, d_y.data(), d_topk_w.data(), nullptr);
    expect_guard("d_y", d_y, z(n * H), sentinel_of<Bf16>());
    EXPECT_TRUE(same_bits(d_y.data(), want_d_y.data() + r0 * H, z(n * H))) << "d_y of rows " << r0;
    const std::vector<Bf16> d_in = rows_of(d_in_perm, r0, n, H);  // [n, H] bf16 + NaN
    cd::launch_scatter_add_round(d_in.data(), row_to_slot_in.data(), r0, n, H, k, d_x.data(), nullptr);
  }
  expect_guard("d_topk_w", d_topk_w, z(N), sentinel_of<float>());
  expect_within("d_topk_w", widen(d_topk_w, z(N)), want_d_w, kF32Tol);
  expect_guard("d_x", d_x, z(T * H), sentinel_of<float>());
  std::vector<float> want_d_x(z(T * H));  // [T, H] fp32
  const std::vector<float> d_in_f32 = widen(d_in_perm, z(N * H));
  p.dtype = DType::F32;
  p.d_x_perm = d_in_f32.data();
  p.d_x = want_d_x.data();
  permute_backward_cpu(p);
  expect_within("d_x", widen(d_x, z(T * H)), want_d_x, kF32Tol);
}

// Capped: 12 rows in rounds of 5 (an expert's rows span two rounds; the last round holds 2).
TEST(DispatchScheduleEmulation, CappedRounds) {
  run_case({6, 4, 2, 24, 5, true}, 1);
}
// One uncapped round; H = 264 > 256 threads (the combine backward's row loop wraps).
TEST(DispatchScheduleEmulation, UncappedWideRows) {
  run_case({2, 5, 2, 264, 0, false}, 2);
}
// k = E (every expert per token), rounds of 4 rows, ids the router would not pick.
TEST(DispatchScheduleEmulation, EveryExpertSmallRounds) {
  run_case({3, 3, 3, 20, 4, false}, 3);
}

}  // namespace
}  // namespace flatpeak::exec
