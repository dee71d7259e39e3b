// The kernels of the CUDA dispatch at EP >= 1 (executor/cuda/dispatch_ep_kernels.cuh) run on the
// host through cuda_emulation.h, by the launch functions dispatch_ep_cuda_ops.cu itself calls (its
// grids, blocks and per-destination launch loop; the per-run loops replayed), against the loops of the CPU schedule they mirror
// (executor/schedules/dispatch_experts.cpp: compute_routing, experts_forward's act,
// experts_backward_fc's d fc1 and d prob, router_backward; dispatch_uncapped.cpp and
// dispatch_rounds.cpp: the gathers, per-token sums and scatters, pack_round and the per-token
// adds of a round), written out here over plain arrays. Integer outputs, copies and the map
// exactly, and the per-token sums whose order the kernels keep (a token's rows by expert, a round's
// rows in send order) bitwise; other fp32 values within rel 1e-5 (+ 1e-5 of the largest), bf16
// within rel 1e-2 (+ 1e-3).
// Inputs carry NaN past their end (index arrays: an index into that NaN), outputs sentinels.
#include "cuda_emulation.h"
// The emulation header first: it defines what the kernels' source expects from CUDA.
#include "executor/cuda/dispatch_ep_kernels.cuh"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "emulation_check.h"
#include "executor/ops/expert_ffn.h"

namespace flatpeak::exec {
namespace {

namespace de = cuda::dispatch_ep_detail;
using namespace emu_check;

// T tokens with k distinct experts of E each; N = T·k copies (slot t·k + s).
struct Routed {
  int64_t T = 5, E = 6, k = 3, H = 40, F = 270, N = 15;
  std::vector<int64_t> ids;     // [T, k] int64
  std::vector<float> topk_w;    // [T, k] fp32
  std::vector<int32_t> sort32;  // [N] send position → slot (by expert, then slot)
  std::vector<int32_t> unsort32;  // [N] slot → send position
};

Routed make_routed(std::mt19937& rng) {
  Routed s;
  std::vector<int64_t> all(static_cast<size_t>(s.E));
  std::iota(all.begin(), all.end(), 0);
  for (int64_t t = 0; t < s.T; ++t) {
    std::shuffle(all.begin(), all.end(), rng);
    s.ids.insert(s.ids.end(), all.begin(), all.begin() + s.k);
  }
  s.topk_w = positive(rng, s.N, 0.05f, 1.0f);
  s.sort32.resize(static_cast<size_t>(s.N));
  std::iota(s.sort32.begin(), s.sort32.end(), 0);
  std::stable_sort(s.sort32.begin(), s.sort32.end(),
                   [&](int32_t a, int32_t b) { return s.ids[static_cast<size_t>(a)] < s.ids[static_cast<size_t>(b)]; });
  s.unsort32.resize(s.sort32.size());
  for (int64_t i = 0; i < s.N; ++i) s.unsort32[static_cast<size_t>(s.sort32[static_cast<size_t>(i)])] = static_cast<int32_t>(i);
  return s;
}

// Row r scaled by 8^(r mod 5): sums of such rows round differently in another order, so the
// bitwise checks of the per-token sums see the order of the additions.
std::vector<float> spread_rows(std::vector<float> values, int64_t row_elems) {
  for (size_t i = 0; i < values.size(); ++i) {
    values[i] *= static_cast<float>(int64_t{1} << (3 * ((static_cast<int64_t>(i) / row_elems) % 5)));
  }
  return values;
}

template <class I>
Guarded<I> index_guarded(const std::vector<I>& v, I past_end) {  // past the end: an index into NaN
  return guarded(v, past_end);
}

TEST(DispatchEpEmulation, Routing) {
  std::mt19937 rng(31);
  const Routed s = make_routed(rng);
  const std::vector<float> logits = uniform(rng, s.T * s.E, 0.05f, 3.0f);  // [T, E]
  // The CPU's compute_routing after its GEMM.
  std::vector<float> scores(static_cast<size_t>(s.T * s.E)), scattered(scores.size()), w(static_cast<size_t>(s.N));
  std::vector<uint8_t> map(scores.size(), 0);
  for (int64_t t = 0; t < s.T; ++t) {
    const float* zt = logits.data() + t * s.E;
    float mx = zt[0];
    for (int64_t e = 1; e < s.E; ++e) mx = std::max(mx, zt[e]);
    float sum = 0.0f;
    for (int64_t e = 0; e < s.E; ++e) sum += (scores[static_cast<size_t>(t * s.E + e)] = std::exp(zt[e] - mx));
    for (int64_t e = 0; e < s.E; ++e) scores[static_cast<size_t>(t * s.E + e)] /= sum;
    float kept = 0.0f;
    for (int64_t j = 0; j < s.k; ++j) kept += scores[static_cast<size_t>(t * s.E + s.ids[static_cast<size_t>(t * s.k + j)])];
    for (int64_t j = 0; j < s.k; ++j) {
      const int64_t e = s.ids[static_cast<size_t>(t * s.k + j)];
      w[static_cast<size_t>(t * s.k + j)] = scores[static_cast<size_t>(t * s.E + e)] / kept;
      scattered[static_cast<size_t>(t * s.E + e)] = w[static_cast<size_t>(t * s.k + j)];
      map[static_cast<size_t>(t * s.E + e)] = 1;
    }
  }
  const Guarded<float> g_logits = guarded(logits, nan_of<float>());
  const Guarded<int64_t> g_ids = index_guarded(s.ids, s.E);
  Guarded<float> e_scores = output_of<float>(s.T * s.E), e_scat = output_of<float>(s.T * s.E);
  Guarded<float> e_w = output_of<float>(s.N);
  // compute_routing zeroes the map (cudaMemsetAsync) before the kernel.
  Guarded<uint8_t> e_map = guarded(std::vector<uint8_t>(map.size(), 0), sentinel_of<uint8_t>());
  de::launch_routing(g_logits.ptr(), g_ids.ptr(), e_scores.ptr(), e_scat.ptr(), e_map.ptr(), e_w.ptr(), s.T, s.E, s.k,
                     nullptr);
  expect_within("routing/scores", e_scores.head(), scores, kF32Tol);
  expect_within("routing/scattered", e_scat.head(), scattered, kF32Tol);
  expect_within("routing/topk_w", e_w.head(), w, kF32Tol);
  expect_same("routing/map", e_map, map);
  expect_guard_intact("routing/scores", e_scores);
  expect_guard_intact("routing/scattered", e_scat);
  expect_guard_intact("routing/topk_w", e_w);
  expect_guard_intact("routing/map", e_map);
}

// The experts' activation and its backward over two chunks whose probs are in receive order
// (for_each_prob_run with by_recv): expert rows [0, 2) read probs [3, 5), rows [2, 5) probs [0, 3).
// F past one block of 256 (act_backward's block-stride loop).
TEST(DispatchEpEmulation, ActivationAndBackward) {
  std::mt19937 rng(32);
  const Routed s = make_routed(rng);
  const int64_t R = 5, F = s.F;
  struct Run {
    int64_t i0, j0, n;
  };
  const std::vector<Run> runs = {{0, 3, 2}, {2, 0, 3}};
  const std::vector<Bf16> fc1 = to_storage<Bf16>(uniform(rng, R * 2 * F));  // [R, 2F] bf16
  const std::vector<Bf16> d_act = to_storage<Bf16>(uniform(rng, R * F));    // [R, F] bf16
  const std::vector<float> prob = positive(rng, R, 0.05f, 1.0f);         // [R] fp32
  std::vector<Bf16> act(static_cast<size_t>(R * F)), d_fc1(static_cast<size_t>(R * 2 * F));
  std::vector<float> d_prob = prob;  // d prob written over prob
  for (const Run& r : runs) {
    for (int64_t x = 0; x < r.n; ++x) {
      const int64_t i = r.i0 + x, j = r.j0 + x;
      float dp = 0.0f;
      for (int64_t f = 0; f < F; ++f) {
        const float g = to_f32(fc1[static_cast<size_t>(i * 2 * F + f)]), u = to_f32(fc1[static_cast<size_t>(i * 2 * F + F + f)]);
        act[static_cast<size_t>(i * F + f)] = f32_to_bf16(silu_f32(g) * u * prob[static_cast<size_t>(j)]);
        const float dh = to_f32(d_act[static_cast<size_t>(i * F + f)]);
        dp += dh * silu_f32(g) * u;
        const float da = dh * prob[static_cast<size_t>(j)];
        d_fc1[static_cast<size_t>(i * 2 * F + f)] = f32_to_bf16(da * u * silu_grad_f32(g));
        d_fc1[static_cast<size_t>(i * 2 * F + F + f)] = f32_to_bf16(da * silu_f32(g));
      }
      d_prob[static_cast<size_t>(j)] = dp;
    }
  }
  const Guarded<Bf16> g_fc1 = guarded(fc1, nan_of<Bf16>()), g_dact = guarded(d_act, nan_of<Bf16>());
  const Guarded<float> g_prob = guarded(prob, nan_of<float>());
  Guarded<Bf16> e_act = output_of<Bf16>(R * F), e_dfc1 = output_of<Bf16>(R * 2 * F);
  Guarded<float> e_prob = inout_of<float>(prob);
  for (const Run& r : runs) {
    de::launch_act(g_fc1.ptr(), g_prob.ptr(), e_act.ptr(), r.i0, r.j0, r.n, F, nullptr);
  }
  for (const Run& r : runs) {
    de::launch_act_backward(g_fc1.ptr(), g_dact.ptr(), e_prob.ptr(), e_dfc1.ptr(), r.i0, r.j0, r.n, F, nullptr);
  }
  expect_within("act", widen(e_act), widen(act), kBf16Tol);
  expect_within("act_backward/d_fc1", widen(e_dfc1), widen(d_fc1), kBf16Tol);
  expect_within("act_backward/d_prob", e_prob.head(), d_prob, kF32Tol);
  expect_guard_intact("act", e_act);
  expect_guard_intact("act_backward/d_fc1", e_dfc1);
  expect_guard_intact("act_backward/d_prob", e_prob);
}

// router_backward: dz, then d_x += dz·W_router and dW_router += dzᵀ·x (the CPU's two GEMMs,
// written as sums over every expert / token in increasing order; the other terms are 0).
TEST(DispatchEpEmulation, RouterBackward) {
  std::mt19937 rng(33);
  const Routed s = make_routed(rng);
  const int64_t T = s.T, E = s.E, k = s.k, H = s.H;
  const std::vector<float> dw = uniform(rng, T * E);                      // [T, E] d probs (scores)
  const std::vector<Bf16> w_router = to_storage<Bf16>(uniform(rng, E * H));               // [E, H] bf16
  const std::vector<Bf16> x = to_storage<Bf16>(uniform(rng, T * H));                      // [T, H] bf16
  const std::vector<float> d_x0 = uniform(rng, T * H), dw_router0 = uniform(rng, E * H);  // accumulated into
  std::vector<float> dz(static_cast<size_t>(T * E), 0.0f);
  for (int64_t t = 0; t < T; ++t) {
    float dot = 0.0f;
    for (int64_t j = 0; j < k; ++j) dot += s.topk_w[static_cast<size_t>(t * k + j)] * dw[static_cast<size_t>(t * E + s.ids[static_cast<size_t>(t * k + j)])];
    for (int64_t j = 0; j < k; ++j) {
      const int64_t e = s.ids[static_cast<size_t>(t * k + j)];
      dz[static_cast<size_t>(t * E + e)] = s.topk_w[static_cast<size_t>(t * k + j)] * (dw[static_cast<size_t>(t * E + e)] - dot);
    }
  }
  std::vector<float> d_x = d_x0, dw_router = dw_router0;
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < H; ++h) {
      float sum = 0.0f;
      for (int64_t e = 0; e < E; ++e) sum += dz[static_cast<size_t>(t * E + e)] * to_f32(w_router[static_cast<size_t>(e * H + h)]);
      d_x[static_cast<size_t>(t * H + h)] += sum;
    }
  }
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t h = 0; h < H; ++h) {
      float sum = 0.0f;
      for (int64_t t = 0; t < T; ++t) sum += dz[static_cast<size_t>(t * E + e)] * to_f32(x[static_cast<size_t>(t * H + h)]);
      dw_router[static_cast<size_t>(e * H + h)] += sum;
    }
  }
  const Guarded<float> g_dw = guarded(dw, nan_of<float>()), g_w = guarded(s.topk_w, nan_of<float>());
  const Guarded<int64_t> g_ids = index_guarded(s.ids, E);
  const Guarded<Bf16> g_wr = guarded(w_router, nan_of<Bf16>()), g_x = guarded(x, nan_of<Bf16>());
  Guarded<float> e_dz = output_of<float>(T * E), e_dx = inout_of<float>(d_x0), e_dwr = inout_of<float>(dw_router0);
  // dx and dW read the dz kernel's output (a sentinel past its end, far above any dz).
  de::launch_router_backward(g_dw.ptr(), g_w.ptr(), g_ids.ptr(), e_dz.ptr(), g_wr.ptr(), g_x.ptr(), e_dx.ptr(), e_dwr.ptr(), T,
                             H, E, k, nullptr);
  expect_within("router/dz", e_dz.head(), dz, kF32Tol);
  expect_within("router/d_x", e_dx.head(), d_x, kF32Tol);
  expect_within("router/dw_router", e_dwr.head(), dw_router, kF32Tol);
  expect_guard_intact("router/dz", e_dz);
  expect_guard_intact("router/d_x", e_dx);
  expect_guard_intact("router/dw_router", e_dwr);
}

// The uncapped pass: probs and rows gathered into send order, the reference's repeat, per-token
// sums of a token's rows in increasing expert order (into bf16 from zero, or added to fp32),
// and d probs scattered home.
TEST(DispatchEpEmulation, UncappedGathersAndSums) {
  std::mt19937 rng(34);
  const Routed s = make_routed(rng);
  const int64_t T = s.T, E = s.E, k = s.k, H = s.H, N = s.N;
  const std::vector<Bf16> x = to_storage<Bf16>(uniform(rng, T * H));         // [T, H] bf16
  const std::vector<Bf16> per_copy = to_storage<Bf16>(uniform(rng, N * H));  // [N, H] bf16, slot order
  const std::vector<Bf16> rows =
      to_storage<Bf16>(spread_rows(uniform(rng, N * H), H));             // [N, H] bf16, send order
  const std::vector<float> acc0 = uniform(rng, T * H);                   // [T, H] fp32 +=
  const std::vector<float> pprobs = uniform(rng, N);                     // [N] fp32, send order
  const std::vector<float> scores0 = uniform(rng, T * E);                // [T, E] fp32
  std::vector<float> gathered_p(static_cast<size_t>(N));
  std::vector<Bf16> gathered_x(static_cast<size_t>(N * H)), gathered_c(gathered_x.size()), repeated(gathered_x.size());
  for (int64_t i = 0; i < N; ++i) {
    const int64_t slot = s.sort32[static_cast<size_t>(i)];
    gathered_p[static_cast<size_t>(i)] = s.topk_w[static_cast<size_t>(slot)];
    for (int64_t h = 0; h < H; ++h) {
      gathered_x[static_cast<size_t>(i * H + h)] = x[static_cast<size_t>((slot / k) * H + h)];
      gathered_c[static_cast<size_t>(i * H + h)] = per_copy[static_cast<size_t>(slot * H + h)];
      repeated[static_cast<size_t>(i * H + h)] = x[static_cast<size_t>((i / k) * H + h)];
    }
  }
  std::vector<Bf16> summed(static_cast<size_t>(T * H));
  std::vector<float> acc = acc0, scores = scores0;
  for (int64_t t = 0; t < T; ++t) {
    std::vector<int64_t> slots(static_cast<size_t>(k));
    std::iota(slots.begin(), slots.end(), t * k);
    std::sort(slots.begin(), slots.end(), [&](int64_t a, int64_t b) { return s.ids[static_cast<size_t>(a)] < s.ids[static_cast<size_t>(b)]; });
    for (int64_t h = 0; h < H; ++h) {
      float sum = 0.0f, added = acc[static_cast<size_t>(t * H + h)];
      for (int64_t slot : slots) {
        const float v = to_f32(rows[static_cast<size_t>(s.unsort32[static_cast<size_t>(slot)] * H + h)]);
        sum += v;
        added += v;
      }
      summed[static_cast<size_t>(t * H + h)] = f32_to_bf16(sum);
      acc[static_cast<size_t>(t * H + h)] = added;
    }
  }
  for (int64_t i = 0; i < N; ++i) {
    const int64_t slot = s.sort32[static_cast<size_t>(i)];
    scores[static_cast<size_t>((slot / k) * E + s.ids[static_cast<size_t>(slot)])] = pprobs[static_cast<size_t>(i)];
  }

  const Guarded<int32_t> g_sort = index_guarded(s.sort32, static_cast<int32_t>(N));
  const Guarded<int32_t> g_unsort = index_guarded(s.unsort32, static_cast<int32_t>(N));
  const Guarded<int64_t> g_ids = index_guarded(s.ids, E);
  // topk_w and per_copy past N, x past T (slot N / k = T): NaN.
  const Guarded<float> g_topk_w = guarded(s.topk_w, nan_of<float>()),
                       g_pprobs = guarded(pprobs, nan_of<float>());
  const Guarded<Bf16> g_x = guarded(x, nan_of<Bf16>()), g_pc = guarded(per_copy, nan_of<Bf16>());
  const Guarded<Bf16> g_rows = guarded(rows, nan_of<Bf16>());
  Guarded<float> e_p = output_of<float>(N), e_acc = inout_of<float>(acc0), e_scores = inout_of<float>(scores0);
  Guarded<Bf16> e_gx = output_of<Bf16>(N * H), e_gc = output_of<Bf16>(N * H), e_rep = output_of<Bf16>(N * H);
  Guarded<Bf16> e_sum = output_of<Bf16>(T * H);
  de::launch_gather_probs(g_sort.ptr(), g_topk_w.ptr(), e_p.ptr(), N, nullptr);
  de::launch_gather_rows(g_sort.ptr(), g_x.ptr(), false, e_gx.ptr(), N, H, k, nullptr);
  de::launch_gather_rows(g_sort.ptr(), g_pc.ptr(), true, e_gc.ptr(), N, H, k, nullptr);
  de::launch_repeat(g_x.ptr(), e_rep.ptr(), N, H, k, nullptr);
  de::launch_sum_token_rows(g_ids.ptr(), g_unsort.ptr(), g_rows.ptr(), e_sum.ptr(), nullptr, T, H, k, nullptr);
  de::launch_sum_token_rows(g_ids.ptr(), g_unsort.ptr(), g_rows.ptr(), nullptr, e_acc.ptr(), T, H, k, nullptr);
  de::launch_scatter_dprobs(g_sort.ptr(), g_ids.ptr(), g_pprobs.ptr(), e_scores.ptr(), N, E, k, nullptr);
  expect_same("gather_probs", e_p, gathered_p);
  expect_same("gather_rows", e_gx, gathered_x);
  expect_same("gather_rows/per_copy", e_gc, gathered_c);
  expect_same("repeat", e_rep, repeated);
  // The same fp32 additions in the same (expert) order: bitwise.
  expect_same("sum_token_rows/out", e_sum, summed);
  expect_same("sum_token_rows/acc", e_acc, acc);
  expect_same("scatter_dprobs", e_scores, scores);
  expect_guard_intact("gather_probs", e_p);
  for (const Guarded<Bf16>* g : {&e_gx, &e_gc, &e_rep, &e_sum}) expect_guard_intact("uncapped rows", *g);
  expect_guard_intact("sum_token_rows/acc", e_acc);
  expect_guard_intact("scatter_dprobs", e_scores);
}

// One capped round over 4 destinations: copies sent in destination order (sort), the round
// takes a sub-range of each destination's copies (none of destination 3's); pack_round launches
// once per destination with rows, add_round_rows adds a token's rows of the round in send order
// (at least one token has 3 of them, not in slot order).
TEST(DispatchEpEmulation, CappedRound) {
  std::mt19937 rng(35);
  const Routed s = make_routed(rng);
  const int64_t T = s.T, E = s.E, k = s.k, H = s.H, N = s.N, ep = 4;
  std::vector<int64_t> dest(static_cast<size_t>(N));  // [N] slot → destination rank (expert's owner)
  for (int64_t slot = 0; slot < N; ++slot) dest[static_cast<size_t>(slot)] = s.ids[static_cast<size_t>(slot)] % ep;
  std::vector<int64_t> sort(static_cast<size_t>(N)), unsort(sort.size());  // int64 send order and inverse
  std::iota(sort.begin(), sort.end(), 0);
  std::stable_sort(sort.begin(), sort.end(), [&](int64_t a, int64_t b) { return dest[static_cast<size_t>(a)] < dest[static_cast<size_t>(b)]; });
  for (int64_t i = 0; i < N; ++i) unsort[static_cast<size_t>(sort[static_cast<size_t>(i)])] = i;
  std::vector<int64_t> dest_begin(static_cast<size_t>(ep + 1), 0);
  for (int64_t slot = 0; slot < N; ++slot) ++dest_begin[static_cast<size_t>(dest[static_cast<size_t>(slot)] + 1)];
  for (int64_t t = 0; t < ep; ++t) dest_begin[static_cast<size_t>(t + 1)] += dest_begin[static_cast<size_t>(t)];
  de::RoundRanges rr{};
  rr.ep = static_cast<int>(ep);
  int64_t sent = 0;
  for (int64_t t = 0; t < ep; ++t) {
    const int64_t have = dest_begin[static_cast<size_t>(t + 1)] - dest_begin[static_cast<size_t>(t)];
    const int64_t first = have > 1 ? 1 : 0;  // the round starts past the first copy
    rr.lo[t] = dest_begin[static_cast<size_t>(t)] + first;
    rr.n[t] = t == 3 ? 0 : have - first;
    rr.q0[t] = sent;
    sent += rr.n[t];
  }
  ASSERT_GT(sent, 0);
  const std::vector<Bf16> src = to_storage<Bf16>(uniform(rng, T * H));  // [T, H] bf16
  const std::vector<float> acc0 = uniform(rng, T * H);               // [T, H] fp32 +=
  const std::vector<float> dprob = uniform(rng, sent);               // [sent] fp32
  const std::vector<float> scores0 = uniform(rng, T * E);            // [T, E] fp32
  std::vector<Bf16> rows(static_cast<size_t>(sent * H));
  std::vector<float> p_send(static_cast<size_t>(sent));
  std::vector<int64_t> i_send(static_cast<size_t>(sent)), i_home(i_send.size());
  for (int64_t t = 0; t < ep; ++t) {
    for (int64_t i = 0; i < rr.n[t]; ++i) {
      const int64_t q = rr.q0[t] + i, slot = sort[static_cast<size_t>(rr.lo[t] + i)];
      for (int64_t h = 0; h < H; ++h) rows[static_cast<size_t>(q * H + h)] = src[static_cast<size_t>((slot / k) * H + h)];
      p_send[static_cast<size_t>(q)] = s.topk_w[static_cast<size_t>(slot)];
      i_send[static_cast<size_t>(q)] = s.ids[static_cast<size_t>(slot)];
      i_home[static_cast<size_t>(q)] = slot;
    }
  }
  // The round's rows as they come back (the experts' outputs), added per token.
  const std::vector<Bf16> returned =
      to_storage<Bf16>(spread_rows(uniform(rng, sent * H), H));  // [sent, H] bf16
  std::vector<float> acc = acc0, scores = scores0;
  int64_t most_rows = 0;  // of one token in the round
  for (int64_t t = 0; t < T; ++t) {
    std::vector<int64_t> qs;
    for (int64_t j = 0; j < k; ++j) {
      const int64_t slot = t * k + j, dd = dest[static_cast<size_t>(slot)], off = unsort[static_cast<size_t>(slot)] - rr.lo[dd];
      if (off >= 0 && off < rr.n[dd]) qs.push_back(rr.q0[dd] + off);
    }
    std::sort(qs.begin(), qs.end());
    most_rows = std::max(most_rows, static_cast<int64_t>(qs.size()));
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t q : qs) acc[static_cast<size_t>(t * H + h)] += to_f32(returned[static_cast<size_t>(q * H + h)]);
    }
  }
  ASSERT_EQ(most_rows, k) << "no token with all its rows in the round: the add order is untested";
  for (int64_t q = 0; q < sent; ++q) {
    const int64_t slot = i_home[static_cast<size_t>(q)];
    scores[static_cast<size_t>((slot / k) * E + s.ids[static_cast<size_t>(slot)])] = dprob[static_cast<size_t>(q)];
  }

  const Guarded<int64_t> g_sort = index_guarded(sort, N), g_unsort = index_guarded(unsort, N);
  const Guarded<int64_t> g_dest = index_guarded(dest, int64_t{0}), g_ids = index_guarded(s.ids, E);
  const Guarded<float> g_topk_w = guarded(s.topk_w, nan_of<float>()),
                       g_dprob = guarded(dprob, nan_of<float>());
  const Guarded<Bf16> g_src = guarded(src, nan_of<Bf16>()), g_ret = guarded(returned, nan_of<Bf16>());
  const Guarded<int64_t> g_home = index_guarded(i_home, N);
  Guarded<Bf16> e_rows = output_of<Bf16>(sent * H);
  Guarded<float> e_p = output_of<float>(sent), e_acc = inout_of<float>(acc0), e_scores = inout_of<float>(scores0);
  Guarded<int64_t> e_isend = output_of<int64_t>(sent), e_ihome = output_of<int64_t>(sent);
  de::launch_pack_round(rr, g_sort.ptr(), g_topk_w.ptr(), g_ids.ptr(), g_src.ptr(), e_rows.ptr(), e_p.ptr(), e_isend.ptr(),
                        e_ihome.ptr(), H, k, nullptr);
  de::launch_add_round_rows(rr, g_dest.ptr(), g_unsort.ptr(), g_ret.ptr(), e_acc.ptr(), T, H, k, nullptr);
  de::launch_scatter_round_dprobs(g_home.ptr(), g_ids.ptr(), g_dprob.ptr(), e_scores.ptr(), sent, E, k, nullptr);
  expect_same("pack_round/rows", e_rows, rows);
  expect_same("pack_round/p_send", e_p, p_send);
  expect_same("pack_round/i_send", e_isend, i_send);
  expect_same("pack_round/i_home", e_ihome, i_home);
  expect_same("add_round_rows", e_acc, acc);  // the same additions in the same (send) order
  expect_same("scatter_round_dprobs", e_scores, scores);
  expect_guard_intact("pack_round/rows", e_rows);
  expect_guard_intact("pack_round/p_send", e_p);
  expect_guard_intact("pack_round/i_send", e_isend);
  expect_guard_intact("pack_round/i_home", e_ihome);
  expect_guard_intact("add_round_rows", e_acc);
  expect_guard_intact("scatter_round_dprobs", e_scores);
}

// add_returned_grads' add, over a count not a multiple of 256.
TEST(DispatchEpEmulation, AddF32) {
  std::mt19937 rng(36);
  const int64_t n = 300;
  const std::vector<float> src = uniform(rng, n), dst0 = uniform(rng, n);
  std::vector<float> want = dst0;
  for (int64_t i = 0; i < n; ++i) want[static_cast<size_t>(i)] += src[static_cast<size_t>(i)];
  const Guarded<float> g_src = guarded(src, nan_of<float>());
  Guarded<float> e_dst = inout_of<float>(dst0);
  de::launch_add_f32(g_src.ptr(), e_dst.ptr(), n, nullptr);
  expect_same("add_f32", e_dst, want);
  expect_guard_intact("add_f32", e_dst);
}

// Expert biases (experts_forward / experts_fc2's bias rows, the bias gradients' add_row_sums):
// a bias row copied into m rows, and each column of m rows summed in row order in fp32 and added
// once, bitwise the CPU's loops; widths past one block of threads.
TEST(DispatchEpEmulation, ExpertBiasRowsAndSums) {
  std::mt19937 rng(37);
  const int64_t m = 9, n = 300;
  const std::vector<Bf16> row = to_storage<Bf16>(uniform(rng, n));
  std::vector<Bf16> want_rows;
  for (int64_t r = 0; r < m; ++r) want_rows.insert(want_rows.end(), row.begin(), row.end());
  const Guarded<Bf16> g_row = guarded(row, nan_of<Bf16>());
  Guarded<Bf16> e_rows = output_of<Bf16>(m * n);
  de::launch_broadcast_row(g_row.ptr(), e_rows.ptr(), m, n, nullptr);
  expect_same("broadcast_row", e_rows, want_rows);
  expect_guard_intact("broadcast_row", e_rows);

  const std::vector<Bf16> rows = to_storage<Bf16>(spread_rows(uniform(rng, m * n), n));
  const std::vector<float> acc0 = uniform(rng, n);
  std::vector<float> want = acc0;
  for (int64_t c = 0; c < n; ++c) {
    float sum = 0.0f;
    for (int64_t r = 0; r < m; ++r) sum += to_f32(rows[z(r * n + c)]);
    want[z(c)] += sum;
  }
  const Guarded<Bf16> g_sum_rows = guarded(rows, nan_of<Bf16>());
  Guarded<float> e_acc = inout_of<float>(acc0);
  de::launch_add_row_sums(g_sum_rows.ptr(), m, n, e_acc.ptr(), nullptr);
  expect_same("add_row_sums", e_acc, want);
  expect_guard_intact("add_row_sums", e_acc);
}

}  // namespace
}  // namespace flatpeak::exec
