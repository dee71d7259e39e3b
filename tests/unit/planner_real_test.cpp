// Real models: gpt-oss-120b at S = 1,048,576, b = 1, CP = 1 — the baseline's vocab terms equal a
// hand computation of DESIGN.md's live set; plus sanity of real plans (speed, DeepSeek-V3 MLA).
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <map>

#include "planner_test_util.h"
#include "spec/hardware_loader.h"
#include "spec/model_loader.h"

namespace flatpeak::planner::test {
namespace {

TEST(PlannerReal, GptOss120bBaselineVocabLiveSet) {
  const ModelSpec m = load_model("gpt-oss-120b");
  const Plan p = plan_of(m, load_hardware("H200"), {{"--gpus", "8"}, {"--context", "1048576"}});
  const int64_t T = 1048576, H = 2880, V = 201088;
  // bf16 logits T*V*2 + fp32 log-softmax T*V*4 + fp32 dlogits T*V*4 + X T*H*2 + the gathered head
  // unit U*2 (U = H + V*H: the final norm, then W) + dX T*H*2 + dW U*2 (one GEMM, bf16 output, into
  // the unit's grads) + lse and per-token loss T*4 each. U*2 is the one term not a multiple of the
  // 512 B alignment: H*2 = 5760 B takes 12 units.
  const int64_t U = H + V * H, unit_bytes = (U * 2 + 511) / 512 * 512;
  ASSERT_EQ(unit_bytes, V * H * 2 + 12 * 512);
  const std::map<std::string, int64_t> hand = {
      {"logits", T * V * 2}, {"log-softmax", T * V * 4}, {"dlogits", T * V * 4},
      {"X (final norm output)", T * H * 2}, {"W (LM head unit, gathered: final norm, then W [V, H])", unit_bytes}, {"dX", T * H * 2}, {"dW", unit_bytes},
      {"lse", T * 4}, {"per-token loss", T * 4}};
  const Peak& vocab = p.summary.peak(PeakKind::Vocab);
  EXPECT_EQ(vocab.phase, "loss/bwd");
  ASSERT_EQ(vocab.terms.size(), hand.size());
  int64_t sum = 0;
  for (const auto& t : vocab.terms) {
    ASSERT_TRUE(hand.count(t.name)) << t.name;
    EXPECT_EQ(t.bytes, hand.at(t.name)) << t.name;
    sum += t.bytes;
  }
  EXPECT_EQ(vocab.component_bytes, sum);
  EXPECT_EQ(sum, T * V * 10 + 2 * T * H * 2 + 2 * unit_bytes + 2 * T * 4);
  EXPECT_FALSE(p.summary.fits());
  // On 8 GPUs the model state alone (234 GB a GPU) does not fit the H200 either, at any context:
  // it runs out first (BindingIsTheModelStateWhenItAloneOverflows).
  EXPECT_EQ(p.summary.binding, PeakKind::Optimizer);
  ASSERT_EQ(p.warnings.size(), 1u);  // S above max_position_embeddings (131072) is a warning
}

// `binding` names the peak that runs out first: the model state (params + grads + optimizer, the
// optimizer peak's component) when it alone needs more than the GPU, whichever phase is largest;
// otherwise the largest component at the GPU's peak phase.
TEST(PlannerReal, BindingIsTheModelStateWhenItAloneOverflows) {
  const ModelSpec m = load_model("gpt-oss-120b");
  const HardwareSpec h200 = load_hardware("H200");
  auto required = [&](const Plan& p, int64_t bytes) {
    return bytes + p.summary.overhead_bytes + static_cast<int64_t>(std::ceil(p.run.fragmentation * static_cast<double>(bytes)));
  };
  for (const char* context : {"4K", "1M"}) {
    const Plan p = plan_of(m, h200, {{"--gpus", "8"}, {"--context", context}});
    const int64_t state = p.summary.peak(PeakKind::Optimizer).component_bytes;
    EXPECT_GT(required(p, state), p.summary.budget_bytes) << context;
    EXPECT_NE(p.summary.gpu_peak_phase.rfind("opt/", 0), 0u) << context;  // the largest phase is another peak's home
    EXPECT_EQ(p.summary.binding, PeakKind::Optimizer) << context;
  }
  // Sharded over 64 GPUs the state fits (29 GB a GPU); the 1M-token loss does not.
  const Plan wide = plan_of(m, h200, {{"--gpus", "64"}, {"--context", "1M"}});
  EXPECT_LE(required(wide, wide.summary.peak(PeakKind::Optimizer).component_bytes), wide.summary.budget_bytes);
  EXPECT_FALSE(wide.summary.gpu_fits);
  EXPECT_EQ(wide.summary.binding, PeakKind::Vocab);
}

TEST(PlannerReal, FlatpeakFitsWhereTheBaselineDoesNot) {
  const Plan p = plan_of(load_model("gpt-oss-120b"), load_hardware("H200"),
                         {{"--gpus", "64"}, {"--context", "1M"}, {"--schedule", "flatpeak"}});
  EXPECT_TRUE(p.summary.gpu_fits);
  EXPECT_FALSE(p.baseline.gpu_fits);
  // Ring-DTP cuts the vocab component by far more than 10x at 1M tokens.
  EXPECT_LT(p.summary.peak(PeakKind::Vocab).component_bytes * 10, p.baseline.peak(PeakKind::Vocab).component_bytes);
}

TEST(PlannerReal, DeepSeekV3MlaAndMtpPlan) {
  const Plan p = plan_of(load_model("DeepSeek-V3"), load_hardware("H200"), {{"--gpus", "64"}, {"--context", "128K"}});
  EXPECT_TRUE(p.run.mtp);
  EXPECT_TRUE(has_phase(p, "loss/mtp0/bwd"));
  EXPECT_TRUE(has_phase(p, "bwd/L2/ffn"));  // dense layers 0-2 folded into L2
  // MLA as training materialises it: per-head K [T, 128*192] and V [T, 128*128].
  const int64_t T = 131072;
  EXPECT_EQ(term_bytes(phase(p, "bwd/L60/attn"), "saved k"), T * 128 * 192 * 2);
  EXPECT_EQ(term_bytes(phase(p, "bwd/L60/attn"), "saved v"), T * 128 * 128 * 2);
}

TEST(PlannerReal, PlansComputeQuickly) {
  const ModelSpec m = load_model("Qwen3-235B-A22B");
  const HardwareSpec h = load_hardware("H100-80GB");
  const RunSpec s = spec_of({{"--gpus", "64"}, {"--context", "1M"}, {"--schedule", "flatpeak"}});
  const auto start = std::chrono::steady_clock::now();
  const Plan p = make_plan(m, h, s);
  const auto us = std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - start).count();
  EXPECT_GT(p.summary.gpu_peak_bytes, 0);
  // Printed, not asserted (timing on shared machines is not a test): the timeline is folded.
  std::printf("flatpeak plan of Qwen3-235B-A22B, 64 x H100, 1M: %lld us, %zu phases\n", static_cast<long long>(us),
              p.timeline.phases.size());
  EXPECT_LT(p.timeline.phases.size(), 60u);
}

}  // namespace
}  // namespace flatpeak::planner::test
