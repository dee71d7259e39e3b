// The whole step on one rank (step_schedule.h): with the materialised loss, the checkpointed step
// (no-grad forward, recompute, any offloaded boundary set and prefetch, every optimizer placement)
// gives the naive step's loss, reduced grads and updated params bit for bit; with the blocked loss
// (online log-sum-exp) they stay within the stated bounds over several seeds; the units are the
// rank's shard; the phases follow traces/README.md's order; FSDP, grad-shard and boundary bytes
// of chosen phases are the hand-derived sums of their buffers; result_sink gets what keep_results
// copies; what the step does not run is refused.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "executor/memory/tracking_allocator.h"
#include "executor/schedules/decoder_layer.h"
#include "executor/schedules/step_schedule.h"
#include "spec/model_loader.h"

namespace flatpeak::exec {
namespace {

// Qwen3-30B-A3B's layout (per-head QK norms: parameters held but not applied) at a tiny shape:
// H = 32, V = 300, L = 3, a = 4, g = 2, d = 8, E = 6 local experts, k = 2, F = 16.
ModelSpec small_model() {
  ModelSpec m = load_model("Qwen3-30B-A3B");
  m.hidden_size = 32;
  m.vocab_size = 300;
  m.num_layers = 3;
  m.layers.resize(3);
  m.num_heads = 4;
  m.num_kv_heads = 2;
  m.head_dim = 8;
  m.v_head_dim = 8;
  m.num_experts = 6;
  m.top_k = 2;
  m.expert_ffn_width = 16;
  return m;
}

StepScheduleConfig config(uint64_t seed = 1) {
  StepScheduleConfig c;
  c.model = small_model();
  c.tokens = 48;
  c.seed = seed;
  c.loss.mode = VocabScheduleMode::Materialized;
  c.optimizer.placement = OptimizerPlacement::Device;
  return c;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

StepScheduleResult run(const StepScheduleConfig& c, int64_t alignment = 512) {
  TrackingAllocator alloc({alignment, -1, -1});
  StepScheduleResult r = run_step_schedule(alloc, c);
  EXPECT_EQ(alloc.live_allocations(), 0);
  EXPECT_EQ(alloc.live_bytes(MemorySpace::Device), 0);
  EXPECT_EQ(alloc.live_bytes(MemorySpace::Host), 0);
  return r;
}

StepScheduleResult naive_of(StepScheduleConfig c) {
  c.naive = true;
  return run(c);
}

// c's step with layers 0 and 2 offloaded (prefetch 1), which must be the naive step bit for bit
// (loss, grads, updated params); c is left with that offload set.
StepScheduleResult run_offloaded_as_naive(StepScheduleConfig& c) {
  const StepScheduleResult ref = naive_of(c);
  c.offloaded = {true, false, true};
  c.prefetch = 1;
  StepScheduleResult got = run(c);
  EXPECT_EQ(got.loss, ref.loss);
  EXPECT_TRUE(same_bits(got.grads, ref.grads));
  EXPECT_TRUE(same_bits(got.params, ref.params));
  return got;
}

TEST(ExecutorScheduleStep, UnitsAreTheRanksShard) {
  const ModelSpec m = small_model();
  const std::vector<int64_t> u = step_unit_params(m);
  ASSERT_EQ(u.size(), 5u);  // embedding, L0-L2, head
  // Layer: q 32*32 + k, v 32*16 each + o 32*32 + QK norms 2*8 = 3088; norms 64; router 6*32;
  // experts 6 * 3*32*16 = 9216.
  EXPECT_EQ(u[0], 300 * 32);
  EXPECT_EQ(u[1], 3088 + 64 + 192 + 9216);
  EXPECT_EQ(u[4], 32 + 300 * 32);
  EXPECT_EQ(std::accumulate(u.begin(), u.end(), int64_t{0}), rank_shard_params(m, 1, 1, false));
}

// Materialised loss: the same ops on the same values in the same order, whatever is recomputed,
// offloaded or where the optimizer runs (AdamW is element-wise; an offloaded grad shard is the
// bf16 reduce-scatter input it was widened from, so rounding it back is exact).
TEST(ExecutorScheduleStep, CheckpointedStepIsBitwiseTheNaiveStep) {
  struct Case {
    std::vector<bool> offloaded;
    int64_t prefetch;
    OptimizerPlacement placement;
  };
  const Case cases[] = {{{}, 0, OptimizerPlacement::Device},
                        {{true, false, true}, 1, OptimizerPlacement::Serial},
                        {{true, true, true}, 2, OptimizerPlacement::Stream}};
  for (uint64_t seed : {1u, 2u}) {
    const StepScheduleResult ref = naive_of(config(seed));
    for (const Case& k : cases) {
      StepScheduleConfig c = config(seed);
      c.offloaded = k.offloaded;
      c.prefetch = k.prefetch;
      c.optimizer.placement = k.placement;
      c.optimizer.bucket_params = 7000;
      c.optimizer.bucket_depth = 2;
      const StepScheduleResult got = run(c);
      const std::string what = "seed " + std::to_string(seed) + " placement " + std::to_string(static_cast<int>(k.placement));
      EXPECT_EQ(got.loss, ref.loss) << what;
      EXPECT_TRUE(same_bits(got.grads, ref.grads)) << what;
      EXPECT_TRUE(same_bits(got.params, ref.params)) << what;
      EXPECT_GT(got.loss, 0.0);
      // Every unit got a gradient (the held-but-unapplied QK norms aside).
      size_t at = 0;
      for (int64_t n : got.unit_params) {
        double norm = 0.0;
        for (int64_t i = 0; i < n; ++i) norm += std::fabs(got.grads[at + static_cast<size_t>(i)]);
        EXPECT_GT(norm, 0.0) << what;
        at += static_cast<size_t>(n);
      }
    }
  }
}

// Blocked loss (online log-sum-exp, fp32 dW accumulator) against the naive materialised one.
// Bounds: the loss moves by at most the rounding of a logit to bf16 in the naive run (2^-9
// relative; |logit| ≤ |x|·|w| ≤ 1.1·√H·√H·max|w| = 1.1·√H with the final norm's weight ≤ 1.1 and
// W ≤ 1/√H: 2 · 1.1·√32 · 2^-9 = 0.024); a gradient by at most 2^-5 of its unit's largest
// (measured ≤ 2^-7.6: bf16 rounding flips in dX propagate through every layer's bf16 backward); an
// updated parameter by at most 2·lr·(1 + wd·max|p|): the first Adam step moves each parameter by
// lr·(g/(|g| + ε) + wd·p), whichever the gradient.
TEST(ExecutorScheduleStep, BlockedLossWithinStatedBounds) {
  for (bool in_forward : {false, true})
    for (uint64_t seed : {1u, 2u, 3u}) {
      StepScheduleConfig c = config(seed);
      c.loss.mode = VocabScheduleMode::Blocked;
      c.loss.token_block_rows = 16;
      c.loss.vocab_block_rows = 128;
      c.loss.gradients_in_forward = in_forward;
      c.offloaded = {false, true, false};
      c.prefetch = 1;
      c.optimizer.placement = OptimizerPlacement::Stream;
      c.optimizer.bucket_params = 10000;
      const StepScheduleResult got = run(c);
      const StepScheduleResult ref = naive_of(c);
      const std::string what = std::string(in_forward ? "in-forward" : "recompute") + " seed " + std::to_string(seed);
      EXPECT_LE(std::fabs(got.loss - ref.loss), 2.0 * 1.1 * std::sqrt(32.0) * std::ldexp(1.0, -9)) << what;
      size_t at = 0;
      for (int64_t n : got.unit_params) {
        double diff = 0.0, largest = 0.0;
        for (int64_t i = 0; i < n; ++i) {
          const size_t j = at + static_cast<size_t>(i);
          diff = std::max(diff, std::fabs(double(got.grads[j]) - ref.grads[j]));
          largest = std::max(largest, std::fabs(double(ref.grads[j])));
        }
        EXPECT_LE(diff, std::ldexp(largest, -5)) << what << " unit at " << at;
        at += static_cast<size_t>(n);
      }
      double dparam = 0.0, largest_param = 0.0;
      for (size_t i = 0; i < got.params.size(); ++i) {
        dparam = std::max(dparam, std::fabs(double(got.params[i]) - ref.params[i]));
        largest_param = std::max(largest_param, std::fabs(double(ref.params[i])));
      }
      EXPECT_LE(dparam, 2.0 * c.optimizer.lr * (1.0 + c.optimizer.weight_decay * largest_param) + 1e-6) << what;
    }
}

TEST(ExecutorScheduleStep, PhasesFollowTheOrderOfOneStep) {
  StepScheduleConfig c = config();
  c.loss.mode = VocabScheduleMode::Blocked;
  c.loss.token_block_rows = 24;  // two token blocks
  c.loss.vocab_block_rows = 300;
  c.optimizer.placement = OptimizerPlacement::Stream;
  c.optimizer.bucket_params = 20000;  // three buckets
  const StepScheduleResult r = run(c);
  std::vector<std::string> want = {"fwd/embed"};
  for (int l = 0; l < 3; ++l)
    for (const char* p : {"attn", "moe/route", "moe/dispatch", "moe/experts", "moe/combine"})
      want.push_back("fwd/L" + std::to_string(l) + "/" + p);
  for (const char* p : {"loss/fwd/blk0", "loss/fwd/blk1", "loss/bwd/blk0", "loss/bwd/blk1"}) want.emplace_back(p);
  for (int l = 2; l >= 0; --l) {
    const std::string b = "bwd/L" + std::to_string(l) + "/";
    for (const char* p : {"recompute/attn", "recompute/moe/dispatch", "recompute/moe/experts", "recompute/moe/combine", "moe/combine",
                          "moe/experts", "moe/dispatch", "attn"})
      want.push_back(b + p);
  }
  for (const char* p : {"bwd/embed", "opt/bucket0", "opt/bucket1", "opt/bucket2"}) want.emplace_back(p);
  EXPECT_EQ(r.phases, want);
}

// Alignment 1, bf16 unless said. U: embedding 9600, layer 12560, head 9632 (UnitsAreTheRanksShard).
TEST(ExecutorScheduleStep, FsdpGradAndBoundaryBytesAreHandDerived) {
  StepScheduleConfig c = config();
  c.offloaded = {true, false, true};
  c.prefetch = 1;
  TrackingAllocator alloc({1, -1, -1});
  run_step_schedule(alloc, c);
  const int64_t Ue = 9600, Ul = 12560, Uh = 9632, T = 48, H = 32, xb = T * H * 2;
  auto col = [&](const std::string& phase, Category cat, MemorySpace space = MemorySpace::Device) {
    for (const auto& r : alloc.phase_records())
      if (r.phase == phase && r.space == space) return r.bytes_at_peak[static_cast<size_t>(cat)];
    return int64_t{-1};
  };
  // fwd/embed: the gathered embedding and L0 (prefetched); token ids [T] i64 and x_0.
  EXPECT_EQ(col("fwd/embed", Category::Fsdp), 2 * Ue + 2 * Ul);
  EXPECT_EQ(col("fwd/embed", Category::Activations), T * 8 + xb);
  // fwd/L2/attn: L2 and the prefetched head; boundaries x_1 (kept) and x_2 (offloaded, in flight).
  EXPECT_EQ(col("fwd/L2/moe/combine", Category::Fsdp), 2 * Ul + 2 * Uh);
  EXPECT_EQ(col("fwd/L2/moe/combine", Category::Boundaries), 2 * xb);
  // loss: x_1 and h_L; no FSDP buffer in the forward (W is vocab), L2 prefetched in the backward.
  EXPECT_EQ(col("loss/fwd", Category::Boundaries), 2 * xb);
  EXPECT_EQ(col("loss/fwd", Category::Fsdp), 0);
  EXPECT_EQ(col("loss/bwd", Category::Fsdp), 2 * Ul);
  // bwd/L1/moe/experts: L1, L0 prefetched, L1's unsharded grads, L2's fp32 reduce-scatter input in
  // flight; the head's and L2's fp32 grad shards; boundaries x_1 and the prefetched x_0.
  EXPECT_EQ(col("bwd/L1/moe/experts", Category::Fsdp), 3 * 2 * Ul + 4 * Ul);
  EXPECT_EQ(col("bwd/L1/moe/experts", Category::Grads), 4 * (Uh + Ul));
  EXPECT_EQ(col("bwd/L1/moe/experts", Category::Boundaries), 2 * xb);
  // bwd/L2/recompute/attn: the head's reduce-scatter input; x_1 kept and x_2 fetched.
  EXPECT_EQ(col("bwd/L2/recompute/attn", Category::Fsdp), 2 * Ul + 2 * Ul + 4 * Uh);
  EXPECT_EQ(col("bwd/L2/recompute/attn", Category::Boundaries), 2 * xb);
  // opt/step: every fp32 grad shard, the fp32 params, m and v.
  const int64_t P = Ue + 3 * Ul + Uh;
  EXPECT_EQ(col("opt/step", Category::Grads), 4 * P);
  EXPECT_EQ(col("opt/step", Category::Params) + col("opt/step", Category::Optimizer), 12 * P);
  EXPECT_EQ(col("opt/step", Category::Fsdp), 0);
  // Host: the pinned arena of the two offloaded boundaries, for the whole step.
  EXPECT_EQ(col("fwd/embed", Category::Boundaries, MemorySpace::Host), 2 * xb);
  EXPECT_EQ(col("opt/step", Category::Boundaries, MemorySpace::Host), 2 * xb);
}

// result_sink receives, in order and in chunks, exactly the grads and params keep_results copies
// (fp32 shards on the device; bf16 shards with offload, widened a chunk at a time), and the
// result's vectors stay empty.
TEST(ExecutorScheduleStep, ResultSinkGetsWhatKeepResultsCopies) {
  for (OptimizerPlacement placement : {OptimizerPlacement::Device, OptimizerPlacement::Stream}) {
    StepScheduleConfig c = config();
    c.optimizer.placement = placement;
    c.optimizer.bucket_params = 4096;
    const StepScheduleResult kept = run(c);
    std::vector<float> grads, params;
    c.result_sink = [&](StepResultPart part, int64_t offset, const float* values, int64_t count) {
      std::vector<float>& to = part == StepResultPart::Grads ? grads : params;
      EXPECT_EQ(offset, static_cast<int64_t>(to.size()));  // in order, no gap
      to.insert(to.end(), values, values + count);
    };
    const StepScheduleResult sunk = run(c);
    EXPECT_EQ(sunk.loss, kept.loss);
    EXPECT_TRUE(sunk.grads.empty() && sunk.params.empty());
    EXPECT_TRUE(same_bits(grads, kept.grads));
    EXPECT_TRUE(same_bits(params, kept.params));
    EXPECT_GT(grads.size(), 1024u);  // more than one chunk
  }
}

// LayerNorm norms (Phi-3.5-MoE: the layers' and the final norm, with biases) and an LM head bias.
// The head unit is [norm weight H | norm bias H | W V·H | head bias V]: the checkpointed step is
// the naive one bit for bit (materialised loss), and every part of the head unit gets its own
// gradient: the head bias's sums to zero over the vocabulary (Σ_j dz[t, j] = g · (Σ softmax − 1)
// = 0 for every token), which a bias gradient read from the wrong place (W's, the norm's) would
// not; the blocked loss's fp32 accumulation of it the same within rounding.
TEST(ExecutorScheduleStep, LayerNormAndHeadBias) {
  StepScheduleConfig c = config();
  c.model.norm_bias = true;
  c.model.lm_head_bias = true;
  const StepScheduleResult got = run_offloaded_as_naive(c);
  c.loss.mode = VocabScheduleMode::Blocked;
  c.loss.token_block_rows = 16;
  c.loss.vocab_block_rows = 128;
  const StepScheduleResult blocked = run(c);
  const int64_t H = c.model.hidden_size, V = c.model.vocab_size;
  ASSERT_EQ(got.unit_params.back(), 2 * H + V * H + V);
  for (const StepScheduleResult* r : {&got, &blocked}) {
    const size_t head = got.grads.size() - static_cast<size_t>(got.unit_params.back());
    auto part = [&](int64_t begin, int64_t count) {
      double sum = 0.0, magnitude = 0.0;
      for (int64_t i = begin; i < begin + count; ++i) {
        sum += r->grads[head + static_cast<size_t>(i)];
        magnitude += std::fabs(r->grads[head + static_cast<size_t>(i)]);
      }
      return std::make_pair(sum, magnitude);
    };
    EXPECT_GT(part(0, H).second, 0.0);          // the final norm's weight
    EXPECT_GT(part(H, H).second, 0.0);          // its bias
    EXPECT_GT(part(2 * H, V * H).second, 0.0);  // W
    const auto bias = part(2 * H + V * H, V);
    EXPECT_GT(bias.second, 0.0);
    EXPECT_LE(std::fabs(bias.first), 1e-2 * bias.second);
  }
}

// gpt-oss's expert biases run in every MoE layer (b_expert [E, 2F + H] after w_down in the
// layer's unit): the step is bitwise the naive one and every layer's biases get a gradient.
TEST(ExecutorScheduleStep, ExpertBiases) {
  StepScheduleConfig c = config();
  c.model.expert_bias = true;
  const StepScheduleResult got = run_offloaded_as_naive(c);
  const ModelSpec& m = c.model;
  LayerScheduleConfig layer;
  layer.tokens = c.tokens, layer.hidden = m.hidden_size, layer.q_heads = m.num_heads, layer.kv_heads = m.num_kv_heads;
  layer.head_dim = m.head_dim, layer.experts = m.num_experts, layer.top_k = m.top_k, layer.expert_ffn = m.expert_ffn_width;
  layer.expert_bias = true;
  int64_t bias_at = 0, bias_count = 0;
  for (const LayerWeightShape& w : layer_weight_shapes(layer)) {
    if (w.name == "b_expert") bias_count = w.numel();
    else if (bias_count == 0) bias_at += w.numel();
  }
  ASSERT_EQ(bias_count, m.num_experts * (2 * m.expert_ffn_width + m.hidden_size));
  int64_t unit_at = got.unit_params[0];
  for (int64_t l = 0; l < m.num_layers; ++l) {
    double magnitude = 0.0;
    for (int64_t i = 0; i < bias_count; ++i) magnitude += std::fabs(got.grads[static_cast<size_t>(unit_at + bias_at + i)]);
    EXPECT_GT(magnitude, 0.0) << "layer " << l;
    unit_at += got.unit_params[static_cast<size_t>(l + 1)];
  }
}

TEST(ExecutorScheduleStep, RefusesWhatItDoesNotRun) {
  StepScheduleConfig dense = config();
  dense.model.layers[0].ffn = FfnKind::Dense;
  EXPECT_THROW(run_step_schedule(*std::make_unique<TrackingAllocator>(), dense), std::invalid_argument);
  StepScheduleConfig tied = config();
  tied.model.tie_word_embeddings = true;
  EXPECT_THROW(run_step_schedule(*std::make_unique<TrackingAllocator>(), tied), std::invalid_argument);
  StepScheduleConfig mla = config();
  mla.model.attention = AttentionKind::Mla;
  EXPECT_THROW(run_step_schedule(*std::make_unique<TrackingAllocator>(), mla), std::invalid_argument);
  StepScheduleConfig sets = config();
  sets.offloaded = {true};
  EXPECT_THROW(run_step_schedule(*std::make_unique<TrackingAllocator>(), sets), std::invalid_argument);
}

}  // namespace
}  // namespace flatpeak::exec
