// Ring attention in the decoder layer (CP > 1): CP ranks, each holding T consecutive tokens of one
// sequence, give the one-rank layer's results on the whole sequence of CP·T tokens (fp32 storage:
// the ring folds the softmax chunk by chunk, so agreement is to rounding, not bitwise); the
// checkpointed run is bitwise the naive one on the ranks; the ring adds exactly its buffers to the
// attention phases (two K,V chunks in flight and the fp32 output and lse accumulators forward;
// two chunks and two fp32 dK,dV accumulators backward) and nothing to any other phase. Sliding
// windows: a window as long as the sequence is full causal attention; CP ranks exchanging a halo
// (or running the masked ring, for a window longer than T) give the one-rank windowed layer's
// results; the halo's buffers are what the attention phases add. Chunked attention likewise, its
// reach (nothing, a halo or the ring) by where the chunks fall.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "executor/comm/threads_comm.h"
#include "executor/memory/tracking_allocator.h"
#include "executor/schedules/decoder_layer_parts.h"
#include "executor/schedules/layer_schedule.h"

namespace flatpeak::exec {
namespace {

LayerScheduleConfig small(DType dtype, int64_t tokens) {
  LayerScheduleConfig c;
  c.tokens = tokens; c.hidden = 32; c.q_heads = 4; c.kv_heads = 2; c.head_dim = 8;
  c.experts = 6; c.top_k = 2; c.expert_ffn = 16; c.shared_ffn = 12; c.dtype = dtype; c.seed = 11;
  return c;
}

// Every rank's result of the layer on `cp` ranks (rank order).
std::vector<LayerScheduleResult> run_on_ring(const LayerScheduleConfig& c, std::vector<std::vector<PhaseRecord>>* records = nullptr) {
  std::vector<LayerScheduleResult> out(static_cast<size_t>(c.cp));
  if (records != nullptr) records->assign(static_cast<size_t>(c.cp), {});
  const RunResult run = run_ranks(static_cast<int>(c.cp), [&](int rank, Communicator& comm) {
    TrackingAllocator alloc({512});
    out[static_cast<size_t>(rank)] = run_layer_schedule(alloc, c, {}, true, &comm);
    EXPECT_EQ(alloc.live_allocations(), 0);
    if (records != nullptr) (*records)[static_cast<size_t>(rank)] = alloc.phase_records();
  });
  EXPECT_TRUE(run.ok()) << run.message;
  return out;
}

// The largest |difference| of y, dx (rank slices of the whole) and of each weight grad (summed
// over the ranks), relative to the whole run's largest grad of that weight for the weights.
void expect_ranks_are_the_whole(const std::vector<LayerScheduleResult>& got, const LayerScheduleResult& ref, int64_t T, int64_t H,
                                const std::string& what) {
  double worst_y = 0.0, worst_dx = 0.0, loss = 0.0;
  for (size_t r = 0; r < got.size(); ++r) {
    loss += got[r].loss;
    for (int64_t i = 0; i < T * H; ++i) {
      const int64_t at = static_cast<int64_t>(r) * T * H + i;
      worst_y = std::max(worst_y, static_cast<double>(std::fabs(got[r].y[i] - ref.y[at])));
      worst_dx = std::max(worst_dx, static_cast<double>(std::fabs(got[r].grads.at("x")[i] - ref.grads.at("x")[at])));
    }
  }
  EXPECT_NEAR(loss, ref.loss, 1e-4 * std::fabs(ref.loss) + 1e-4) << what;
  EXPECT_LT(worst_y, 2e-5) << what;
  EXPECT_LT(worst_dx, 2e-5) << what;
  for (const auto& [name, full] : ref.grads) {
    if (name == "x") continue;
    double worst = 0.0, scale = 0.0;
    for (int64_t i = 0; i < full.size(); ++i) {
      float sum = 0.0f;
      for (const auto& g : got) sum += g.grads.at(name)[i];
      worst = std::max(worst, static_cast<double>(std::fabs(sum - full[i])));
      scale = std::max(scale, static_cast<double>(std::fabs(full[i])));
    }
    EXPECT_LT(worst, 1e-4 * scale + 1e-6) << what << " " << name;
  }
}

TEST(RingAttention, CpRanksAreTheOneRankRunOnTheWholeSequence) {
  for (int64_t cp : {2, 4}) {
    const int64_t T = 24;  // not a multiple of the CPU attention's 32-row tiles
    TrackingAllocator alloc({512});
    const LayerScheduleResult ref = run_layer_schedule(alloc, small(DType::F32, cp * T), {});
    LayerScheduleConfig c = small(DType::F32, T);
    c.cp = cp;
    expect_ranks_are_the_whole(run_on_ring(c), ref, T, c.hidden, "cp " + std::to_string(cp));
  }
}

// MLA (per-head K of d = 8 over V of dv = 6): the ring's chunks carry K and V of their own widths,
// and the halo of a sliding window too.
LayerScheduleConfig small_mla(int64_t tokens) {
  LayerScheduleConfig c = small(DType::F32, tokens);
  c.kv_heads = c.q_heads;
  c.v_head_dim = 6;
  c.q_lora = 16;
  c.kv_lora = 12;
  c.rope_dim = 2;
  return c;
}

TEST(RingAttention, MlaCpRanksAreTheOneRankRunOnTheWholeSequence) {
  for (int64_t cp : {2, 3}) {
    for (int64_t window : {0, 10}) {
      const int64_t T = 24;
      TrackingAllocator alloc({512});
      LayerScheduleConfig whole = small_mla(cp * T);
      whole.attention_window = window;
      const LayerScheduleResult ref = run_layer_schedule(alloc, whole, {});
      LayerScheduleConfig c = small_mla(T);
      c.attention_window = window;
      c.cp = cp;
      expect_ranks_are_the_whole(run_on_ring(c), ref, T, c.hidden, "cp " + std::to_string(cp) + " window " + std::to_string(window));
    }
  }
}

TEST(RingAttention, RecomputeIsBitwiseTheNaiveRunOnTheRanks) {
  for (DType dtype : {DType::BF16, DType::F32}) {
    LayerScheduleConfig c = small(dtype, 32);
    c.cp = 3;
    const std::vector<LayerScheduleResult> ckpt = run_on_ring(c);
    c.checkpointed = false;
    const std::vector<LayerScheduleResult> naive = run_on_ring(c);
    for (size_t r = 0; r < ckpt.size(); ++r) {
      EXPECT_EQ(ckpt[r].loss, naive[r].loss);
      EXPECT_TRUE(ckpt[r].y == naive[r].y);
      for (const auto& [name, g] : ckpt[r].grads) EXPECT_TRUE(g == naive[r].grads.at(name)) << name << " rank " << r;
    }
  }
}

// Every rank's activations at each device phase minus the one-rank run's: `added` bytes in the
// phases it names, nothing in any other.
void expect_added_activations(const TrackingAllocator& alone, const std::vector<std::vector<PhaseRecord>>& records,
                              const std::map<std::string, int64_t>& added) {
  std::map<std::string, int64_t> base;
  for (const auto& r : alone.phase_records())
    if (r.space == MemorySpace::Device) base[r.phase] = r.bytes_at_peak[static_cast<size_t>(Category::Activations)];
  for (const auto& rank : records) {
    std::map<std::string, int64_t> phases;
    for (const auto& r : rank) {
      if (r.space != MemorySpace::Device) continue;
      const auto extra = added.find(r.phase);
      EXPECT_EQ(r.bytes_at_peak[static_cast<size_t>(Category::Activations)] - base.at(r.phase), extra == added.end() ? 0 : extra->second)
          << r.phase;
      phases[r.phase] = 1;
    }
    EXPECT_EQ(phases.size(), base.size());
  }
}

// T = 64, a = 4, g = 2, d = 8, bf16, alignment 512. Forward (fwd/L0/attn, and the recompute's
// attention): two K,V chunks [2, T, g·d] bf16 of 4096 B, the output accumulator [T, a·d] fp32
// 8192 and the lse accumulator [a, T] fp32 1024. Backward (bwd/L0/attn): two chunks 4096 and two
// dK,dV accumulators [2, T, g·d] fp32 8192.
TEST(RingAttention, AddsItsBuffersToTheAttentionPhasesAlone) {
  LayerScheduleConfig c = small(DType::BF16, 64);
  TrackingAllocator alone({512});
  run_layer_schedule(alone, c, {}, false);
  c.cp = 2;
  std::vector<std::vector<PhaseRecord>> records;
  run_on_ring(c, &records);
  expect_added_activations(alone, records,
                           {{"fwd/L0/attn", 2 * 4096 + 8192 + 1024}, {"bwd/L0/recompute/attn", 2 * 4096 + 8192 + 1024},
                            {"bwd/L0/attn", 2 * 4096 + 2 * 8192}});
}

TEST(SlidingWindow, AsLongAsTheSequenceIsFullCausalAttention) {
  LayerScheduleConfig full = small(DType::F32, 40);
  LayerScheduleConfig windowed = full;
  windowed.attention_window = 40;
  TrackingAllocator a({512}), b({512});
  const LayerScheduleResult want = run_layer_schedule(a, full, {});
  const LayerScheduleResult got = run_layer_schedule(b, windowed, {});
  expect_ranks_are_the_whole({got}, want, 40, full.hidden, "window 40 of 40");
  // A shorter window really is one: the output changes.
  windowed.attention_window = 6;
  TrackingAllocator c({512});
  const LayerScheduleResult shorter = run_layer_schedule(c, windowed, {});
  double moved = 0.0;
  for (int64_t i = 0; i < shorter.y.size(); ++i) moved = std::max(moved, static_cast<double>(std::fabs(shorter.y[i] - want.y[i])));
  EXPECT_GT(moved, 1e-3);
}

// The window masks against a plain fp64 softmax over the keys j with i − window < j ≤ i (sliding)
// or ⌊i / chunk⌋·chunk ≤ j ≤ i (chunked), forward (o, lse) and backward (dq, dk, dv from
// dP = dO·Vᵀ, dS = P ⊙ (dP − Σ dO ⊙ O)), on one rank: an off-by-one shared by the forward and
// backward kernels would pass the CP tests, not this.
TEST(SlidingWindow, KernelsAreTheMaskedSoftmax) {
  const int64_t T = 13, A = 2, G = 1, D = 4, Dv = 3;  // a value width apart from d, as MLA's
  struct Case {
    int64_t window, chunk;
  };
  for (const Case mask : {Case{1, 0}, Case{5, 0}, Case{13, 0}, Case{0, 1}, Case{0, 4}, Case{0, 13}}) {
    const std::string what = "window " + std::to_string(mask.window) + " chunk " + std::to_string(mask.chunk);
    std::vector<float> q(T * A * D), k(T * G * D), v(T * G * Dv), d_o(T * A * Dv);
    uint64_t state = 17;
    auto draw = [&]() {
      state = state * 6364136223846793005ULL + 1442695040888963407ULL;
      return static_cast<float>(static_cast<int64_t>(state >> 40) % 2001 - 1000) / 1000.0f;
    };
    for (auto* vec : {&q, &k, &v, &d_o})
      for (float& x : *vec) x = draw();
    std::vector<float> o(T * A * Dv), lse(A * T), row(Dv), delta(A * T), dq_acc(T * A * D, 0.0f), regs(D + Dv), dq(T * A * D),
        dk(T * G * D), dv(T * G * Dv);
    const layer_detail::HeadDims dims{D, Dv};
    const layer_detail::KeyWindow key_window{mask.window, mask.chunk};
    layer_detail::windowed_attention_forward<float>(q.data(), k.data(), v.data(), nullptr, 0, o.data(), lse.data(), row.data(), T, A, G,
                                                    dims, key_window, 0);
    layer_detail::attention_row_delta<float>(d_o.data(), o.data(), delta.data(), T, A, Dv);
    layer_detail::windowed_attention_backward_local<float>(q.data(), k.data(), v.data(), d_o.data(), lse.data(), delta.data(), nullptr,
                                                           0, regs.data(), dq_acc.data(), dk.data(), dv.data(), T, A, G, dims, key_window, 0);
    std::vector<double> want_dk(T * G * D, 0.0), want_dv(T * G * Dv, 0.0);
    double *WANT_DK_ = want_dk.data(), *WANT_DV_ = want_dv.data();
    // Plain pointers: the reference indexes with int64 products.
    const float *Q_ = q.data(), *K_ = k.data(), *V_ = v.data(), *D_O_ = d_o.data(), *O_ = o.data(), *LSE_ = lse.data();
    const float *DQ_ACC_ = dq_acc.data(), *DK_ = dk.data(), *DV_ = dv.data();
    const double scale = 1.0 / std::sqrt(static_cast<double>(D));
    for (int64_t h = 0; h < A; ++h)
      for (int64_t i = 0; i < T; ++i) {
        const int64_t lo = mask.window > 0 ? std::max<int64_t>(0, i - mask.window + 1) : i - i % mask.chunk;
        std::vector<double> p(static_cast<size_t>(i + 1), 0.0);
        double mx = -1e300, sum = 0.0;
        for (int64_t j = lo; j <= i; ++j) {
          double sc = 0.0;
          for (int64_t x = 0; x < D; ++x) sc += double(Q_[(i * A + h) * D + x]) * K_[j * D + x];
          p[static_cast<size_t>(j)] = sc * scale;
          mx = std::max(mx, sc * scale);
        }
        for (int64_t j = lo; j <= i; ++j) sum += std::exp(p[static_cast<size_t>(j)] - mx);
        EXPECT_NEAR(LSE_[h * T + i], mx + std::log(sum), 1e-5) << what;
        double dsum = 0.0;  // Σ dO ⊙ O of the fp64 output
        std::vector<double> out(static_cast<size_t>(Dv), 0.0), dp(static_cast<size_t>(i + 1), 0.0);
        double* OUT_ = out.data();
        for (int64_t j = lo; j <= i; ++j) {
          p[static_cast<size_t>(j)] = std::exp(p[static_cast<size_t>(j)] - mx) / sum;
          for (int64_t x = 0; x < Dv; ++x) OUT_[x] += p[static_cast<size_t>(j)] * V_[j * Dv + x];
        }
        for (int64_t x = 0; x < Dv; ++x) {
          EXPECT_NEAR(O_[(i * A + h) * Dv + x], OUT_[x], 1e-5) << what;
          dsum += double(D_O_[(i * A + h) * Dv + x]) * OUT_[x];
        }
        std::vector<double> dqi(static_cast<size_t>(D), 0.0);
        double* DQI_ = dqi.data();
        for (int64_t j = lo; j <= i; ++j) {
          for (int64_t x = 0; x < Dv; ++x) dp[static_cast<size_t>(j)] += double(D_O_[(i * A + h) * Dv + x]) * V_[j * Dv + x];
          const double ds = p[static_cast<size_t>(j)] * (dp[static_cast<size_t>(j)] - dsum);
          for (int64_t x = 0; x < D; ++x) {
            DQI_[x] += ds * scale * K_[j * D + x];
            WANT_DK_[j * D + x] += ds * scale * Q_[(i * A + h) * D + x];
          }
          for (int64_t x = 0; x < Dv; ++x) WANT_DV_[j * Dv + x] += p[static_cast<size_t>(j)] * D_O_[(i * A + h) * Dv + x];
        }
        for (int64_t x = 0; x < D; ++x) EXPECT_NEAR(DQ_ACC_[(i * A + h) * D + x], DQI_[x], 1e-5) << what;
      }
    for (int64_t e = 0; e < T * G * D; ++e) EXPECT_NEAR(DK_[e], WANT_DK_[e], 1e-5) << what;
    for (int64_t e = 0; e < T * G * Dv; ++e) EXPECT_NEAR(DV_[e], WANT_DV_[e], 1e-5) << what;
  }
}

// A windowed layer (a sliding `window` or `chunk`s) on `cp` ranks of T = 24 tokens against the
// one-rank windowed layer on the whole sequence.
void expect_windowed_ranks_are_the_whole(int64_t cp, int64_t window, int64_t chunk) {
  const int64_t T = 24;
  LayerScheduleConfig whole = small(DType::F32, cp * T);
  whole.attention_window = window;
  whole.attention_chunk = chunk;
  TrackingAllocator alloc({512});
  const LayerScheduleResult ref = run_layer_schedule(alloc, whole, {});
  LayerScheduleConfig c = small(DType::F32, T);
  c.attention_window = window;
  c.attention_chunk = chunk;
  c.cp = cp;
  expect_ranks_are_the_whole(run_on_ring(c), ref, T, c.hidden,
                             "cp " + std::to_string(cp) + " window " + std::to_string(window) + " chunk " + std::to_string(chunk));
}

TEST(SlidingWindow, CpRanksExchangingAHaloAreTheOneRankRun) {
  for (int64_t cp : {2, 4})
    for (int64_t window : {5, 24, 25}) expect_windowed_ranks_are_the_whole(cp, window, 0);  // 25: the whole previous rank
}

// T = 64, g = 2, d = 8, bf16, window 20 (the halo: the 19 keys before a rank's first query),
// alignment 512. Forward and recompute: the halo K,V [2, 19, g·d] bf16 = 1216 → 1536 B; backward:
// it, and two dK,dV [2, 19, g·d] fp32 of 2432 → 2560 B (the halo's, sent back, and the next rank's,
// received).
TEST(SlidingWindow, AddsTheHalosBuffersToTheAttentionPhasesAlone) {
  LayerScheduleConfig c = small(DType::BF16, 64);
  c.attention_window = 20;
  TrackingAllocator alone({512});
  run_layer_schedule(alone, c, {}, false);
  c.cp = 3;
  std::vector<std::vector<PhaseRecord>> records;
  run_on_ring(c, &records);
  expect_added_activations(alone, records, {{"fwd/L0/attn", 1536}, {"bwd/L0/recompute/attn", 1536}, {"bwd/L0/attn", 1536 + 2 * 2560}});
}

// A sliding window reaching more than a rank's T keys back (w − 1 > T) runs the ring, masked, and
// gives the one-rank windowed run.
TEST(SlidingWindow, LongerThanARankRunsTheMaskedRing) {
  for (int64_t cp : {2, 4})
    for (int64_t window : {26, 30, 60, 200}) expect_windowed_ranks_are_the_whole(cp, window, 0);
}

// Chunked attention (Llama 4's local layers) on CP ranks against the one-rank chunked layer, for
// chunks that divide T (no keys move), chunks that straddle rank boundaries (a halo: 5, 16; and 40
// and 48, longer than T, at CP = 2) and chunks that start further into a rank than T (the masked
// ring: 40, 96 at CP = 4).
TEST(ChunkedAttention, CpRanksAreTheOneRankRun) {
  for (int64_t cp : {2, 4})
    for (int64_t chunk : {8, 24, 5, 16, 40, 48, 96}) expect_windowed_ranks_are_the_whole(cp, 0, chunk);
  // Chunks are a real mask: the output differs from full causal attention.
  TrackingAllocator a({512}), b({512});
  LayerScheduleConfig chunked = small(DType::F32, 40);
  chunked.attention_chunk = 8;
  const LayerScheduleResult full = run_layer_schedule(a, small(DType::F32, 40), {});
  const LayerScheduleResult got = run_layer_schedule(b, chunked, {});
  double moved = 0.0;
  for (int64_t i = 0; i < got.y.size(); ++i) moved = std::max(moved, static_cast<double>(std::fabs(got.y[i] - full.y[i])));
  EXPECT_GT(moved, 1e-3);
}

// T = 64, a = 4, g = 2, d = 8, bf16, alignment 512, CP = 3, what each window adds to the
// attention phases of the one-rank run:
// - chunks of 16 divide T: nothing (no keys move);
// - chunks of 20: rank 1 starts 64 mod 20 = 4 tokens into its chunk, rank 2 128 mod 20 = 8, so a
//   halo of 8 rows: K,V [2, 8, g·d] bf16 = 512 B forward and in the recompute; backward it and two
//   dK,dV [2, 8, g·d] fp32 of 1024 B;
// - chunks of 192 (ranks start 64 and 128 tokens in) and a sliding window of 66 (65 keys back)
//   reach past the previous rank: the ring's buffers (RingAttention.AddsItsBuffersToTheAttentionPhasesAlone).
TEST(ChunkedAttention, AddsWhatItsReachNeedsToTheAttentionPhasesAlone) {
  struct Case {
    int64_t window, chunk, forward, backward;
  };
  const int64_t ring_forward = 2 * 4096 + 8192 + 1024, ring_backward = 2 * 4096 + 2 * 8192;
  for (const Case w : {Case{0, 16, 0, 0}, Case{0, 20, 512, 512 + 2 * 1024}, Case{0, 192, ring_forward, ring_backward},
                       Case{66, 0, ring_forward, ring_backward}}) {
    LayerScheduleConfig c = small(DType::BF16, 64);
    c.attention_window = w.window;
    c.attention_chunk = w.chunk;
    TrackingAllocator alone({512});
    run_layer_schedule(alone, c, {}, false);
    c.cp = 3;
    std::vector<std::vector<PhaseRecord>> records;
    run_on_ring(c, &records);
    SCOPED_TRACE("window " + std::to_string(w.window) + " chunk " + std::to_string(w.chunk));
    std::map<std::string, int64_t> added;
    if (w.forward > 0) added = {{"fwd/L0/attn", w.forward}, {"bwd/L0/recompute/attn", w.forward}, {"bwd/L0/attn", w.backward}};
    expect_added_activations(alone, records, added);
  }
}

TEST(RingAttention, RefusesAMissingOrMismatchedGroup) {
  LayerScheduleConfig c = small(DType::F32, 16);
  c.cp = 2;
  TrackingAllocator alloc({512});
  EXPECT_THROW(run_layer_schedule(alloc, c, {}, false), std::invalid_argument);
  c.cp = 0;
  EXPECT_THROW(run_layer_schedule(alloc, c, {}, false), std::invalid_argument);
  c.cp = 3;
  const RunResult run = run_ranks(2, [&](int, Communicator& comm) {
    TrackingAllocator a({512});
    EXPECT_THROW(run_layer_schedule(a, c, {}, false, &comm), std::invalid_argument);
  });
  EXPECT_TRUE(run.ok());
}

}  // namespace
}  // namespace flatpeak::exec
