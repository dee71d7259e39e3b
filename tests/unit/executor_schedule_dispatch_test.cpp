// The dispatch schedule (executor/schedules/dispatch_schedule.h): capped rounds against one
// uncapped dispatch (forward output, d_x and the router's dW bitwise; expert dW within a stated
// bound), everything against a naive fp64 reference, and the phases and buffers it records.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "executor/memory/tracking_allocator.h"
#include "executor/schedules/dispatch_schedule.h"

namespace flatpeak::exec {
namespace {

size_t z(int64_t i) { return static_cast<size_t>(i); }

struct Shape {
  int64_t T, H, E, k, F;
};

DispatchScheduleConfig config_of(const Shape& s, uint64_t seed, int64_t cap, bool store) {
  DispatchScheduleConfig c;
  c.tokens = s.T;
  c.hidden = s.H;
  c.experts = s.E;
  c.top_k = s.k;
  c.ffn = s.F;
  c.seed = seed;
  c.chunk_cap_rows = cap;
  c.store = store;
  return c;
}

DispatchScheduleResult run(const DispatchScheduleConfig& c) {
  TrackingAllocator alloc({512, -1, -1});
  DispatchScheduleResult r = run_dispatch_schedule(alloc, c);
  EXPECT_EQ(alloc.live_allocations(), 0);
  return r;
}

float max_abs(const std::vector<float>& v) {
  float m = 0.0f;
  for (float x : v) m = std::max(m, std::fabs(x));
  return m;
}

// The naive reference in fp64 over the same bf16 inputs and drawn ids: router softmax and
// renormalised top-k weights, per copy SwiGLU expert with the weight on the activation, an
// unweighted sum over the k copies; backward by hand. With expert biases, b_gu is added to the
// gate and up pre-activations and b_down to the expert's output (after the prob, as the schedule
// applies it).
struct Reference {
  std::vector<double> out, d_x, d_w_router, d_w_gate_up, d_w_down, d_b_expert;
};

Reference reference(const DispatchScheduleConfig& c) {
  const DispatchInputs in = make_dispatch_inputs(c);
  const int64_t T = c.tokens, H = c.hidden, E = c.experts, k = c.top_k, F = c.ffn;
  Reference r;
  r.out.assign(z(T * H), 0.0);
  r.d_x.assign(z(T * H), 0.0);
  r.d_w_router.assign(z(E * H), 0.0);
  r.d_w_gate_up.assign(z(E * 2 * F * H), 0.0);
  r.d_w_down.assign(z(E * H * F), 0.0);
  const int64_t Pb = c.expert_bias ? 2 * F + H : 0;
  r.d_b_expert.assign(z(E * Pb), 0.0);
  auto bias = [&](int64_t e, int64_t i) { return Pb == 0 ? 0.0 : double(in.b_expert[z(e * Pb + i)]); };
  auto sig = [](double v) { return 1.0 / (1.0 + std::exp(-v)); };
  for (int64_t t = 0; t < T; ++t) {
    std::vector<double> logit(z(E)), p(z(E));
    double mx = -1e300;
    for (int64_t e = 0; e < E; ++e) {
      double acc = 0.0;
      for (int64_t h = 0; h < H; ++h) acc += double(in.x[z(t * H + h)]) * double(in.w_router[z(e * H + h)]);
      logit[z(e)] = acc;
      mx = std::max(mx, acc);
    }
    double sum = 0.0;
    for (int64_t e = 0; e < E; ++e) sum += (p[z(e)] = std::exp(logit[z(e)] - mx));
    double kept = 0.0;
    for (int64_t s = 0; s < k; ++s) kept += p[z(in.topk_ids[z(t * k + s)])];
    std::vector<double> w(z(k)), dw(z(k));
    for (int64_t s = 0; s < k; ++s) w[z(s)] = p[z(in.topk_ids[z(t * k + s)])] / kept;
    for (int64_t s = 0; s < k; ++s) {
      const int64_t e = in.topk_ids[z(t * k + s)];
      std::vector<double> g(z(F)), u(z(F)), a(z(F)), hvec(z(F)), dh(z(F));
      for (int64_t f = 0; f < F; ++f) {
        double gg = bias(e, f), uu = bias(e, F + f);
        for (int64_t h = 0; h < H; ++h) {
          gg += double(in.w_gate_up[z((e * 2 * F + f) * H + h)]) * double(in.x[z(t * H + h)]);
          uu += double(in.w_gate_up[z((e * 2 * F + F + f) * H + h)]) * double(in.x[z(t * H + h)]);
        }
        g[z(f)] = gg;
        u[z(f)] = uu;
        a[z(f)] = gg * sig(gg) * uu;
        hvec[z(f)] = a[z(f)] * w[z(s)];
      }
      for (int64_t h = 0; h < H; ++h) {
        double y = bias(e, 2 * F + h);
        for (int64_t f = 0; f < F; ++f) y += double(in.w_down[z((e * H + h) * F + f)]) * hvec[z(f)];
        if (Pb > 0) r.d_b_expert[z(e * Pb + 2 * F + h)] += in.d_out[z(t * H + h)];
        r.out[z(t * H + h)] += y;
      }
      // Backward of this copy: d y = d_out[t].
      for (int64_t f = 0; f < F; ++f) {
        double acc = 0.0;
        for (int64_t h = 0; h < H; ++h) {
          const double dy = in.d_out[z(t * H + h)];
          acc += double(in.w_down[z((e * H + h) * F + f)]) * dy;
          r.d_w_down[z((e * H + h) * F + f)] += dy * hvec[z(f)];
        }
        dh[z(f)] = acc;
      }
      double dws = 0.0;
      for (int64_t f = 0; f < F; ++f) dws += dh[z(f)] * a[z(f)];
      dw[z(s)] = dws;
      for (int64_t f = 0; f < F; ++f) {
        const double da = dh[z(f)] * w[z(s)], sg = sig(g[z(f)]);
        const double dg = da * u[z(f)] * sg * (1.0 + g[z(f)] * (1.0 - sg)), du = da * g[z(f)] * sg;
        if (Pb > 0) {
          r.d_b_expert[z(e * Pb + f)] += dg;
          r.d_b_expert[z(e * Pb + F + f)] += du;
        }
        for (int64_t h = 0; h < H; ++h) {
          r.d_w_gate_up[z((e * 2 * F + f) * H + h)] += dg * double(in.x[z(t * H + h)]);
          r.d_w_gate_up[z((e * 2 * F + F + f) * H + h)] += du * double(in.x[z(t * H + h)]);
          r.d_x[z(t * H + h)] += dg * double(in.w_gate_up[z((e * 2 * F + f) * H + h)]) +
                                 du * double(in.w_gate_up[z((e * 2 * F + F + f) * H + h)]);
        }
      }
    }
    double dot = 0.0;
    for (int64_t s = 0; s < k; ++s) dot += w[z(s)] * dw[z(s)];
    for (int64_t s = 0; s < k; ++s) {
      const int64_t e = in.topk_ids[z(t * k + s)];
      const double dz = w[z(s)] * (dw[z(s)] - dot);
      for (int64_t h = 0; h < H; ++h) {
        r.d_x[z(t * H + h)] += dz * double(in.w_router[z(e * H + h)]);
        r.d_w_router[z(e * H + h)] += dz * double(in.x[z(t * H + h)]);
      }
    }
  }
  return r;
}

// |got − ref| ≤ rel · max|ref| everywhere (bf16 storage of fc1, act*prob, fc2 and the grads between
// the GEMMs: a few bf16 roundings of 2^-9 each, relative to the largest value).
void expect_close(const std::vector<float>& got, const std::vector<double>& ref, double rel, const char* what) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  double scale = 0.0, worst = 0.0;
  for (double v : ref) scale = std::max(scale, std::fabs(v));
  for (size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::fabs(double(got[i]) - ref[i]));
  EXPECT_GT(scale, 0.0) << what;
  EXPECT_LE(worst, rel * scale) << what << ": max abs error " << worst << " of max |ref| " << scale;
}

// Every output against the fp64 reference (the expert biases' gradients when there are any).
void expect_matches_reference(const DispatchScheduleResult& r, const Reference& ref) {
  expect_close(r.out, ref.out, 0.02, "out");
  expect_close(r.d_x, ref.d_x, 0.02, "d_x");
  expect_close(r.d_w_router, ref.d_w_router, 0.03, "dW router");
  expect_close(r.d_w_gate_up, ref.d_w_gate_up, 0.02, "dW gate_up");
  expect_close(r.d_w_down, ref.d_w_down, 0.02, "dW down");
  if (!ref.d_b_expert.empty()) expect_close(r.d_b_expert, ref.d_b_expert, 0.02, "d biases");
}

// Expert dW: each round's GEMM sums its rows in fp32 and adds once, so splitting an expert's rows
// over rounds reorders an fp32 sum: |Δ| ≤ 1e-5 · max|dW| (n·2^-24 · Σ|terms| with n ≤ a few hundred).
void expect_within_fp32_reorder(const std::vector<float>& a, const std::vector<float>& b, const char* what) {
  ASSERT_EQ(a.size(), b.size());
  const float scale = std::max(max_abs(a), max_abs(b));
  float worst = 0.0f;
  for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::fabs(a[i] - b[i]));
  EXPECT_LE(worst, 1e-5f * scale) << what;
}

const Shape kShapes[] = {{64, 32, 8, 2, 16}, {48, 16, 6, 3, 8}, {40, 24, 12, 4, 20}};

TEST(DispatchSchedule, CappedRoundsEqualOneUncappedDispatch) {
  for (const Shape& s : kShapes) {
    for (uint64_t seed : {1u, 2u, 3u}) {
      const DispatchScheduleResult full = run(config_of(s, seed, 0, false));
      EXPECT_EQ(full.rounds, 1);
      for (int64_t cap : {int64_t{7}, int64_t{24}, s.T * s.k}) {
        for (bool store : {false, true}) {
          SCOPED_TRACE("T=" + std::to_string(s.T) + " k=" + std::to_string(s.k) + " seed=" + std::to_string(seed) +
                       " cap=" + std::to_string(cap) + (store ? " store" : " recompute"));
          const DispatchScheduleResult r = run(config_of(s, seed, cap, store));
          EXPECT_EQ(r.rounds, (s.T * s.k + cap - 1) / cap);
          EXPECT_EQ(r.out, full.out);  // bitwise: the same fp32 sums in the same order
          EXPECT_EQ(r.d_x, full.d_x);
          EXPECT_EQ(r.d_w_router, full.d_w_router);
          expect_within_fp32_reorder(r.d_w_gate_up, full.d_w_gate_up, "dW gate_up");
          expect_within_fp32_reorder(r.d_w_down, full.d_w_down, "dW down");
          if (cap == s.T * s.k) {  // one round: the same GEMMs over the same rows
            EXPECT_EQ(r.d_w_gate_up, full.d_w_gate_up);
            EXPECT_EQ(r.d_w_down, full.d_w_down);
          }
        }
      }
    }
  }
}

TEST(DispatchSchedule, MatchesFp64Reference) {
  for (const Shape& s : kShapes) {
    for (uint64_t seed : {4u, 5u}) {
      for (int64_t cap : {int64_t{0}, int64_t{16}}) {
        const DispatchScheduleConfig c = config_of(s, seed, cap, true);
        SCOPED_TRACE("seed=" + std::to_string(seed) + " cap=" + std::to_string(cap));
        expect_matches_reference(run(c), reference(c));
      }
    }
  }
}

// gpt-oss's experts carry biases (gate/up and down): every schedule against the fp64 reference,
// and the capped rounds against one uncapped dispatch as without biases.
TEST(DispatchSchedule, ExpertBiasesMatchFp64Reference) {
  for (const Shape& s : kShapes) {
    DispatchScheduleConfig full_c = config_of(s, 6, 0, false);
    full_c.expert_bias = true;
    const DispatchScheduleResult full = run(full_c);
    ASSERT_EQ(full.d_b_expert.size(), z(s.E * (2 * s.F + s.H)));
    expect_matches_reference(full, reference(full_c));
    // The biases change the function: without them the output differs.
    EXPECT_NE(full.out, run(config_of(s, 6, 0, false)).out);
    for (bool store : {false, true}) {
      DispatchScheduleConfig c = config_of(s, 6, 16, store);
      c.expert_bias = true;
      SCOPED_TRACE(store ? "store" : "recompute");
      const DispatchScheduleResult r = run(c);
      EXPECT_EQ(r.out, full.out);
      EXPECT_EQ(r.d_x, full.d_x);
      EXPECT_EQ(r.d_w_router, full.d_w_router);
      expect_within_fp32_reorder(r.d_b_expert, full.d_b_expert, "d biases");
      expect_within_fp32_reorder(r.d_w_gate_up, full.d_w_gate_up, "dW gate_up");
    }
  }
}

TEST(DispatchSchedule, RoutingModelShapesTheCounts) {
  DispatchScheduleConfig c = config_of({256, 16, 8, 2, 8}, 9, 0, false);
  c.routing = parse_routing_model("hot-expert=0.5,1");
  const DispatchScheduleResult r = run(c);
  int64_t total = 0;
  for (int64_t n : r.expert_counts) total += n;
  EXPECT_EQ(total, 256 * 2);
  // Expert 0 takes half the copies in expectation (one per token at most): 256 ± sampling.
  EXPECT_GT(r.expert_counts[0], 200);
  EXPECT_LE(r.expert_counts[0], 256);
}

// Phase names, and the dispatch bytes of a few phases derived by hand (alignment 512).
TEST(DispatchSchedule, PhasesAndBytes) {
  const Shape s{64, 32, 8, 2, 16};  // N = 128 copies
  TrackingAllocator alloc({512, -1, -1});
  DispatchScheduleConfig c = config_of(s, 1, 32, false);
  c.layer = "L3";
  run_dispatch_schedule(alloc, c);
  std::vector<std::string> names;
  int64_t fwd_round = 0, bwd_round = 0;
  for (const PhaseRecord& p : alloc.phase_records()) {
    if (p.space != MemorySpace::Device || p.phase == "init") continue;  // "init": the inputs being made
    names.push_back(p.phase);
    const int64_t dsp = p.bytes_at_peak[static_cast<size_t>(Category::Dispatch)];
    if (p.phase == "fwd/L3/moe/dispatch/r0") fwd_round = dsp;
    if (p.phase == "bwd/L3/moe/dispatch/r0") bwd_round = dsp;
  }
  const std::vector<std::string> want = {"fwd/L3/moe/route", "fwd/L3/moe/dispatch/r0", "fwd/L3/moe/dispatch/r1",
                                         "fwd/L3/moe/dispatch/r2", "fwd/L3/moe/dispatch/r3", "bwd/L3/recompute/moe/route",
                                         "bwd/L3/moe/dispatch/r0", "bwd/L3/moe/dispatch/r1", "bwd/L3/moe/dispatch/r2",
                                         "bwd/L3/moe/dispatch/r3"};
  EXPECT_EQ(names, want);
  auto a = [](int64_t b) { return (b + 511) / 512 * 512; };
  const int64_t T = 64, H = 32, E = 8, k = 2, F = 16, N = 128, C = 32, B = 32, D = 2;
  const int64_t route = 3 * a(T * E * 4) + a(T * E) + a(T * k * 4) + a(T * k * 8);
  const int64_t rounds = 2 * a(D * C * H * 2) + 2 * a(D * B * H * 2) + a(D * 2 * (B + C) * 4) + a(D * 2 * (B + C) * 8) +
                         a(3 * N * 8) + a(T * H * 4);
  const int64_t expert_b = a(B * H * 2) + a(B * 2 * F * 2) + a(B * F * 2);
  EXPECT_EQ(fwd_round, route + rounds + expert_b + 2 * a(B * H * 2));
  EXPECT_EQ(bwd_round, route + rounds + expert_b + a(D * 2 * (B + C) * H * 2) + a(B * H * 2) + a(B * F * 2) +
                           a(B * 2 * F * 2) + a(T * H * 4));
}

TEST(DispatchSchedule, CappedPeakIsBelowUncapped) {
  auto peak = [](int64_t cap, bool store) {
    TrackingAllocator alloc({512, -1, -1});
    DispatchScheduleConfig c = config_of({512, 64, 16, 4, 64}, 1, cap, store);
    run_dispatch_schedule(alloc, c);
    int64_t m = 0;
    for (const PhaseRecord& p : alloc.phase_records())
      m = std::max(m, p.category_peak_bytes[static_cast<size_t>(Category::Dispatch)]);
    return m;
  };
  const int64_t uncapped = peak(0, false), recompute = peak(128, false), store = peak(128, true);
  EXPECT_LT(recompute, uncapped / 2);
  EXPECT_LT(store, uncapped);
}

TEST(DispatchSchedule, RejectsBadDims) {
  TrackingAllocator alloc;
  DispatchScheduleConfig c = config_of({8, 8, 4, 5, 8}, 1, 0, false);
  EXPECT_THROW(run_dispatch_schedule(alloc, c), std::invalid_argument);
}

}  // namespace
}  // namespace flatpeak::exec
