// The layer component run (with and without shared experts): the checkpointed schedule (no-grad forward, recompute + backward) gives
// the same loss, output and every gradient, bit for bit, as the naive run that keeps every
// activation; the gradients agree with central finite differences of the loss proxy (fp32
// storage, the loss summed in fp64) on a tiny shape; the measured bytes of a phase are the
// hand-derived sum of its buffers; the inputs drawn into the buffers are the listed ones.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "executor/memory/tracking_allocator.h"
#include "executor/schedules/layer_schedule.h"

namespace flatpeak::exec {
namespace {

LayerScheduleConfig small(DType dtype) {
  LayerScheduleConfig c;
  c.tokens = 64; c.hidden = 32; c.q_heads = 4; c.kv_heads = 2; c.head_dim = 8;
  c.experts = 6; c.top_k = 2; c.expert_ffn = 16; c.dtype = dtype; c.seed = 7;
  return c;
}

// Multi-head latent attention (DeepSeek-V3's shape, scaled): per-head K of d = nope 6 + rope 2 and V
// of dv = 6 from a kv latent of 12, q from a q latent of 16 (q_lora 0: straight from H).
LayerScheduleConfig small_mla(DType dtype, int64_t q_lora) {
  LayerScheduleConfig c = small(dtype);
  c.kv_heads = c.q_heads;
  c.v_head_dim = 6;
  c.q_lora = q_lora;
  c.kv_lora = 12;
  c.rope_dim = 2;
  return c;
}

TEST(ExecutorScheduleLayer, MlaRecomputeIsBitwiseTheNaiveRun) {
  for (DType dtype : {DType::BF16, DType::F32})
    for (int64_t q_lora : {16, 0}) {
      SCOPED_TRACE("q_lora " + std::to_string(q_lora));
      LayerScheduleConfig c = small_mla(dtype, q_lora);
      TrackingAllocator a1({512}), a2({512});
      const LayerScheduleResult ckpt = run_layer_schedule(a1, c, {});
      c.checkpointed = false;
      const LayerScheduleResult naive = run_layer_schedule(a2, c, {});
      EXPECT_EQ(ckpt.loss, naive.loss);
      EXPECT_TRUE(ckpt.y == naive.y);
      // norm1, [wq_a, q_norm, wq_b | wq], wkv_a, kv_norm, wkv_b, wo, norm2, router, w_gate_up, w_down, and x
      ASSERT_EQ(ckpt.grads.size(), q_lora > 0 ? 13u : 11u);
      for (const auto& [name, g] : ckpt.grads) {
        EXPECT_TRUE(g == naive.grads.at(name)) << name;
        double norm = 0.0;
        for (int64_t i = 0; i < g.size(); ++i) norm += std::fabs(g[i]);
        EXPECT_GT(norm, 0.0) << name << " has no gradient";
      }
      EXPECT_EQ(a1.live_allocations(), 0);
      EXPECT_EQ(a2.live_allocations(), 0);
    }
}

TEST(ExecutorScheduleLayer, MlaRefusesWhatItCannotRun) {
  LayerScheduleConfig c = small_mla(DType::F32, 16);
  c.kv_heads = 2;
  EXPECT_THROW(check_layer_config(c), std::invalid_argument);
  c = small_mla(DType::F32, 16);
  c.rope_dim = c.head_dim;
  EXPECT_THROW(check_layer_config(c), std::invalid_argument);
  c = small_mla(DType::F32, 16);
  c.kv_lora = 0;  // q_lora and rope_dim without a kv latent
  EXPECT_THROW(check_layer_config(c), std::invalid_argument);
  c = small_mla(DType::F32, 16);
  c.layer_norm = true;
  EXPECT_THROW(check_layer_config(c), std::invalid_argument);
  EXPECT_NO_THROW(check_layer_config(small_mla(DType::F32, 0)));
}

TEST(ExecutorScheduleLayer, RecomputeIsBitwiseTheNaiveRun) {
  for (DType dtype : {DType::BF16, DType::F32})
  for (int64_t shared : {0, 12, -12}) {  // -12: 12, gated (Qwen2-MoE)
  for (bool layer_norm : {false, true})
  for (bool expert_bias : {false, true}) {  // gpt-oss's biases inside the routed experts
    LayerScheduleConfig c = small(dtype);
    c.shared_ffn = std::abs(shared);
    c.shared_gate = shared < 0;
    c.layer_norm = layer_norm;
    c.expert_bias = expert_bias;
    TrackingAllocator a1({512}), a2({512});
    const LayerScheduleResult ckpt = run_layer_schedule(a1, c, {});
    c.checkpointed = false;
    const LayerScheduleResult naive = run_layer_schedule(a2, c, {});
    EXPECT_EQ(ckpt.loss, naive.loss);
    EXPECT_EQ(ckpt.y.size(), c.tokens * c.hidden);
    EXPECT_EQ(ckpt.y.dtype, dtype);
    EXPECT_TRUE(ckpt.y == naive.y);
    ASSERT_EQ(ckpt.grads.size(), (shared > 0 ? 12u : shared < 0 ? 13u : 10u) + (layer_norm ? 2u : 0u) + (expert_bias ? 1u : 0u));
    int64_t elements = 0;
    for (const auto& [name, g] : ckpt.grads) {
      EXPECT_TRUE(g == naive.grads.at(name)) << name;
      double norm = 0.0;
      for (int64_t i = 0; i < g.size(); ++i) norm += std::fabs(g[i]);
      EXPECT_GT(norm, 0.0) << name << " has no gradient";
      elements += g.size();
    }
    EXPECT_EQ(elements, layer_gradient_elements(c));
    EXPECT_EQ(a1.live_allocations(), 0);
    EXPECT_EQ(a2.live_allocations(), 0);
  }
  }
}

// LayerNorm saves each norm's mean [T] fp32 beside its rstd: [2, T] more activations (512 B at
// T = 64, fp32, aligned to 512) in every phase that holds the saved set (the recompute and the
// backward), and nothing more anywhere (the no-grad forward's [T] temporaries are freed within a
// phase, before its peak).
TEST(ExecutorScheduleLayer, LayerNormSavesItsMeanBesideTheRstd) {
  LayerScheduleConfig c = small(DType::BF16);
  LayerScheduleConfig ln = c;
  ln.layer_norm = true;
  TrackingAllocator a({512}), b({512});
  run_layer_schedule(a, c, {}, false);
  run_layer_schedule(b, ln, {}, false);
  std::map<std::string, int64_t> rms;
  for (const auto& r : a.phase_records())
    if (r.space == MemorySpace::Device) rms[r.phase] = r.bytes_at_peak[static_cast<size_t>(Category::Activations)];
  int saved_phases = 0;
  for (const auto& r : b.phase_records()) {
    if (r.space != MemorySpace::Device || r.phase == "init") continue;
    const bool saved = r.phase.rfind("bwd/", 0) == 0;
    EXPECT_EQ(r.bytes_at_peak[static_cast<size_t>(Category::Activations)] - rms.at(r.phase), saved ? 2 * 64 * 4 : 0) << r.phase;
    saved_phases += saved ? 1 : 0;
  }
  EXPECT_EQ(saved_phases, 8);  // recompute attn, dispatch, experts, combine; backward combine, experts, dispatch, attn
}

// The inputs drawn straight into the tracked buffers are make_layer_inputs' values.
TEST(ExecutorScheduleLayer, DrawnInputsAreTheGivenOnes) {
  const LayerScheduleConfig c = small(DType::BF16);
  TrackingAllocator a1({512}), a2({512});
  const LayerScheduleResult drawn = run_layer_schedule(a1, c, {}, false);
  const LayerScheduleResult given = run_layer_schedule(a2, c, make_layer_inputs(c));
  EXPECT_EQ(drawn.loss, given.loss);
  EXPECT_EQ(drawn.y.size(), 0);  // keep_output off
  ASSERT_EQ(drawn.grads.size(), given.grads.size());
  for (const auto& [name, g] : drawn.grads) EXPECT_TRUE(g == given.grads.at(name)) << name;
}

double loss_of(const LayerScheduleConfig& c, const LayerInputs& in) {
  TrackingAllocator a({1});
  return run_layer_schedule(a, c, in).loss;
}

TEST(ExecutorScheduleLayer, GradientsMatchFiniteDifferences) {
  // shared expert; gated; LayerNorm norms with biases (Phi-3.5-MoE); biases in the experts (gpt-oss);
  // MLA with a q latent (DeepSeek-V3) and without (DeepSeek-V2-Lite)
  for (int variant : {0, 1, 2, 3, 4, 5}) {
  const bool gated = variant == 1;
  const char* names[] = {"shared expert", "gated shared expert", "LayerNorm", "expert biases", "MLA", "MLA without q latent"};
  SCOPED_TRACE(names[variant]);
  LayerScheduleConfig c;
  c.tokens = 7; c.hidden = 8; c.q_heads = 4; c.kv_heads = 2; c.head_dim = 3;
  c.experts = 4; c.top_k = 2; c.expert_ffn = 5; c.shared_ffn = 3; c.dtype = DType::F32; c.seed = 3;
  c.shared_gate = gated;
  c.layer_norm = variant == 2;
  c.expert_bias = variant == 3;
  if (variant >= 4) {
    c.q_heads = c.kv_heads = 3;
    c.head_dim = 4;
    c.rope_dim = 1;
    c.v_head_dim = 2;
    c.kv_lora = 5;
    c.q_lora = variant == 4 ? 6 : 0;
    c.seed = 4;  // seed 3's MLA inputs put a token's top-k within eps of a tie: a routing flip breaks the difference
  }
  const LayerInputs in = make_layer_inputs(c);
  TrackingAllocator a({1});
  const LayerScheduleResult got = run_layer_schedule(a, c, in);
  const double eps = 1e-2;
  int checked = 0;
  for (const auto& [name, g] : got.grads) {
    const size_t n = static_cast<size_t>(g.size());
    const size_t stride = std::max<size_t>(1, n / 3);  // 3 or 4 entries of every tensor, and its last
    std::vector<size_t> at;
    for (size_t i = 0; i < n; i += stride) at.push_back(i);
    if (at.back() != n - 1) at.push_back(n - 1);  // MLA: wkv_a's k_rope row, wq_b's last rope column
    for (size_t i : at) {
      LayerInputs plus = in, minus = in;
      plus.values[name][i] += static_cast<float>(eps);
      minus.values[name][i] -= static_cast<float>(eps);
      const double dplus = static_cast<double>(plus.values[name][i]) - static_cast<double>(in.values.at(name)[i]);
      const double dminus = static_cast<double>(in.values.at(name)[i]) - static_cast<double>(minus.values[name][i]);
      const double fd = (loss_of(c, plus) - loss_of(c, minus)) / (dplus + dminus);
      EXPECT_NEAR(g[static_cast<int64_t>(i)], fd, 2e-3 + 2e-2 * std::fabs(fd)) << name << "[" << i << "]";
      ++checked;
    }
  }
  EXPECT_GE(checked, 30);
  }
}

// The gate's saved ungated output [T, H] and gate [T] are live in every MoE phase of the
// recompute and the backward (the planner's add_shared_gate_saved), and only there.
TEST(ExecutorScheduleLayer, GatedSharedExpertKeepsItsOutputAndGateThroughTheMoeBackward) {
  LayerScheduleConfig c = small(DType::BF16);
  c.shared_ffn = 12;
  LayerScheduleConfig gated = c;
  gated.shared_gate = true;
  TrackingAllocator a({512}), b({512});
  run_layer_schedule(a, c, {}, false);
  run_layer_schedule(b, gated, {}, false);
  std::map<std::string, int64_t> plain;
  for (const auto& r : a.phase_records())
    if (r.space == MemorySpace::Device) plain[r.phase] = r.bytes_at_peak[static_cast<size_t>(Category::Activations)];
  int moe_phases = 0;
  for (const auto& r : b.phase_records()) {
    if (r.space != MemorySpace::Device || r.phase == "init") continue;
    const bool saved = r.phase.rfind("bwd/", 0) == 0 && r.phase.find("/moe/") != std::string::npos;
    const int64_t extra = r.bytes_at_peak[static_cast<size_t>(Category::Activations)] - plain.at(r.phase);
    EXPECT_EQ(extra, saved ? 64 * 32 * 2 + 512 : 0) << r.phase;  // [T, H] bf16 4096, [T] bf16 128 aligned to 512
    moe_phases += saved ? 1 : 0;
  }
  EXPECT_EQ(moe_phases, 6);  // recompute dispatch, experts, combine; backward combine, experts, dispatch
}

// bwd/L0/attn with T = 64, H = 32, a = 4, g = 2, d = 8 (bf16, fp32 where stated), alignment 512:
// norm-1 output 4096, rstd [2, T] 512, q 4096, k 2048, v 2048, o 4096, lse [a, T] 1024,
// dy 4096, residual accumulator [T, H] fp32 8192, d o 4096, dq 4096, dk 2048, dv 2048,
// dq accumulator [T, a·d] fp32 8192, delta [a, T] fp32 1024, d norm-1 output 4096.
// bwd/L0/moe/experts (E = 6, k = 2, R = T·k = 128, F = 16): routing: logits, scores, scattered
// probs [T, E] fp32 1536 each, routing map 512, top-k weights 512, ids [T, k] i64 1024; sort
// indices 1024, permuted probs 512; saved expert input [R, H] 8192, fc1 [R, 2F] 8192, act·prob
// [R, F] 4096; d fc2 8192, d act 4096, d fc1 8192.
TEST(ExecutorScheduleLayer, PhaseBytesAreTheSumOfTheirBuffers) {
  TrackingAllocator a({512});
  run_layer_schedule(a, small(DType::BF16), make_layer_inputs(small(DType::BF16)));
  const auto col = [&](const std::string& phase, Category cat) {
    for (const auto& r : a.phase_records())
      if (r.phase == phase && r.space == MemorySpace::Device) return r.bytes_at_peak[static_cast<size_t>(cat)];
    return int64_t{-1};
  };
  EXPECT_EQ(col("bwd/L0/attn", Category::Activations),
            4096 + 512 + 4096 + 2048 + 2048 + 4096 + 1024 + 4096 + 8192 + 4096 + 4096 + 2048 + 2048 + 8192 + 1024 + 4096);
  EXPECT_EQ(col("bwd/L0/moe/experts", Category::Dispatch),
            3 * 1536 + 512 + 512 + 1024 + 1024 + 512 + 8192 + 8192 + 4096 + 8192 + 4096 + 8192);
  EXPECT_EQ(col("fwd/L0/attn", Category::Activations), 4096 + 4096 + 2048 + 2048 + 4096 + 1024);
}

}  // namespace
}  // namespace flatpeak::exec
