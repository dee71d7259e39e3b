// Step-time model: FLOP counts of a tiny model by hand, attended keys with windows, MLA weights,
// the terms summing to the step, the overlap rules in the direction they state, --efficiency
// parsing with exact messages.
// Tiny MoE (planner_test_util.h): H=8, V=32, L=2 MoE layers, E=4, k=2, F=4, a=2, g=1, d=dv=4;
// N=2, S=16 (T=16), EP=2, balanced: the worst rank receives R = 32 rows per MoE layer.
#include <gtest/gtest.h>

#include <cmath>

#include "knob_search.h"
#include "planner_test_util.h"
#include "step_time.h"

namespace flatpeak::planner::test {
namespace {

const std::vector<std::pair<std::string, std::string>> kBase = {{"--gpus", "2"}, {"--context", "16"}};

// tiny_gpu() with speeds (the time tests need them; a card without a figure makes its terms free).
HardwareSpec timed_gpu() {
  HardwareSpec h = tiny_gpu();
  h.bf16_dense_flops = 1e12;
  h.hbm_bandwidth_bytes_per_s = 1e11;
  h.scale_up_bandwidth_bytes_per_s = 1e9;
  h.inter_node_bandwidth_bytes_per_s = 1e8;
  h.host_link_bandwidth_bytes_per_s = 1e6;  // a slow host link: transfers show
  h.host_memory_bandwidth_bytes_per_s = 1e7;
  return h;
}


TEST(PlannerStepTime, MatmulParamsOfTheTinyModel) {
  const MatmulParams p = matmul_params(tiny_moe());
  EXPECT_EQ(p.attention, 8 * 8 + 8 * 4 + 8 * 4 + 8 * 8);  // q [H -> a*d], k, v [H -> g*d], o [a*d -> H]
  EXPECT_EQ(p.moe_common, 8 * 4);                         // router; no shared experts
  EXPECT_EQ(p.expert, 3 * 8 * 4);                         // gate, up, down
  EXPECT_EQ(p.head, 8 * 32);
  EXPECT_EQ(p.dense_ffn, 0);
}

TEST(PlannerStepTime, MlaMatmulParamsByHand) {
  ModelSpec m = tiny_moe();
  m.attention = AttentionKind::Mla;
  m.num_heads = 2;
  m.num_kv_heads = 2;
  m.q_lora_rank = 6;
  m.kv_lora_rank = 5;
  m.qk_nope_head_dim = 3;
  m.qk_rope_head_dim = 2;
  m.head_dim = 5;
  m.v_head_dim = 4;
  // q: H*q_lora + q_lora*a*(nope+rope) = 48 + 60; kv: H*(kv_lora+rope) + kv_lora*a*(nope+dv) = 56 + 70;
  // o: a*dv*H = 64.
  EXPECT_EQ(matmul_params(m).attention, 48 + 60 + 56 + 70 + 64);
  m.q_lora_rank = 0;  // q projected directly: H*a*(nope+rope) = 80
  EXPECT_EQ(matmul_params(m).attention, 80 + 56 + 70 + 64);
}

TEST(PlannerStepTime, AttendedKeysCausalAndWindowed) {
  LayerSpec full;
  EXPECT_DOUBLE_EQ(mean_attended_keys(full, 16), 8.5);  // (S+1)/2
  LayerSpec sliding;
  sliding.window = AttentionWindow::Sliding;
  sliding.attention_window_tokens = 4;
  EXPECT_DOUBLE_EQ(mean_attended_keys(sliding, 16), (4.0 * 5 / 2 + 12 * 4) / 16);  // ramp, then w
  sliding.attention_window_tokens = 64;                                           // w >= S: causal
  EXPECT_DOUBLE_EQ(mean_attended_keys(sliding, 16), 8.5);
  LayerSpec chunked;
  chunked.window = AttentionWindow::Chunked;
  chunked.attention_window_tokens = 4;
  EXPECT_DOUBLE_EQ(mean_attended_keys(chunked, 16), 4 * 10.0 / 16);  // 4 chunks of 1+2+3+4
  chunked.attention_window_tokens = 6;                               // 2 chunks of 6 + one of 4
  EXPECT_DOUBLE_EQ(mean_attended_keys(chunked, 16), (2 * 21.0 + 10) / 16);
  // a·d, not H: 2·a·(d_qk + d_v) per key.
  EXPECT_DOUBLE_EQ(attention_forward_flops_per_token(tiny_moe(), full, 16), 2.0 * 2 * 8 * 8.5);
}

TEST(PlannerStepTime, FlopsOfTheTinyModelByHand) {
  const Plan p = plan_of(tiny_moe(), tiny_gpu(), kBase);  // baseline: materialized loss
  // Model FLOPs per token: 6 x (2 layers x (attention 192 + router 32 + k=2 experts x 96) + head
  // 256) = 6 x 1088 = 6528; attention 3 x 2 layers x 2*a*(d+dv)*8.5 = 3 x 2 x 272 = 1632.
  EXPECT_DOUBLE_EQ(p.time.model_flops_per_gpu, 16 * (6528.0 + 1632));
  // Hardware FLOPs on the worst rank, with full recompute (forward counted twice): dense 8 x 16 x
  // 224 x 2 = 57344; experts 8 x R=32 rows x 96 x 2 = 49152; attention 4.5 x 272 x 16 x 2 = 39168;
  // materialized head 3 passes x 2 x 16 x 256 = 24576.
  EXPECT_DOUBLE_EQ(p.time.hardware_flops_per_gpu, 57344.0 + 49152 + 39168 + 24576);
  // The blocked/ring backward recomputes the logits: a 4th head pass.
  const Plan q = plan_of(tiny_moe(), tiny_gpu(), {{"--gpus", "2"}, {"--context", "16"}, {"--schedule", "flatpeak"},
                                                  {"--vocab-backward", "recompute"}, {"--sco-layers", "all"}});
  EXPECT_DOUBLE_EQ(q.time.hardware_flops_per_gpu - p.time.hardware_flops_per_gpu, 2.0 * 16 * 256);
  EXPECT_DOUBLE_EQ(q.time.model_flops_per_gpu, p.time.model_flops_per_gpu);
}

// Ring-DTP bytes per step by hand (tiny: T = 16, H = 8, V = 32, R = 2, one loss): each pass goes R
// hops around the ring as the executor runs it (ring_dtp_schedule.cpp), the last hop of rotating
// activations carrying only the state home (forward) or the finished dX (backward).
TEST(PlannerStepTime, RingDtpHopsAsTheExecutorRunsThem) {
  const Plan p = plan_of(tiny_moe(), timed_gpu(), {{"--gpus", "2"}, {"--context", "16"}, {"--schedule", "flatpeak"},
                                                   {"--ring-dtp", "on"}, {"--ring-size", "2"}, {"--vocab-backward", "recompute"}});
  const TimeModel model(p.model, p.hardware, p.run, p.work, Efficiency{});
  // Activations, forward: X 16·8·2 + targets 16·4 + state 3·16·4 = 512 on the first hop, the
  // state (192) on the last; backward: X 256 + targets 64 + lse 64 + dX 16·8·4 = 896, then dX 512.
  EXPECT_DOUBLE_EQ(model.vocab(2, RingRotate::Activations, 16, 16).ring_bytes, (512.0 + 192) + (896.0 + 512));
  // Weights: a [16, 8] bf16 shard per hop, R = 2 hops forward; with its fp32 dW in backward.
  EXPECT_DOUBLE_EQ(model.vocab(2, RingRotate::Weights, 16, 16).ring_bytes, 2 * 128.0 * 2 + 2 * 128.0 * 6);
  // Gradients in forward: the gradient pass is a second trip round the ring, the same hops.
  const Plan in_forward = plan_of(tiny_moe(), timed_gpu(), {{"--gpus", "2"}, {"--context", "16"}, {"--schedule", "flatpeak"},
                                                            {"--ring-dtp", "on"}, {"--ring-size", "2"}, {"--vocab-backward", "in-forward"}});
  const TimeModel gif(in_forward.model, in_forward.hardware, in_forward.run, in_forward.work, Efficiency{});
  EXPECT_DOUBLE_EQ(gif.vocab(2, RingRotate::Activations, 16, 16).ring_bytes, (512.0 + 192) + (896.0 + 512));
  EXPECT_DOUBLE_EQ(gif.vocab(2, RingRotate::Weights, 16, 16).ring_bytes, 2 * 128.0 * 2 + 2 * 128.0 * 6);
}

// Gradients in forward visit the logits twice when V has several blocks (every row's lse before
// any dz): 4 GEMMs a block, as the executor's fused pass runs them; with one vocab block the
// backward reads the forward's logits block: 3. With a 1 s kernel latency the launches dominate:
// V = 32 in two blocks of 16 costs 2·(1 + 3) launches, in one block 1·3, 5 s apart (3 s if the
// first counted 3 GEMMs a block). The hardware FLOPs count the 4th pass in the first case only.
TEST(PlannerStepTime, GradientsInForwardVisitTheLogitsTwiceUnlessOneVocabBlock) {
  const Plan p = plan_of(tiny_moe(), timed_gpu(), {{"--gpus", "2"}, {"--context", "16"}, {"--schedule", "flatpeak"},
                                                   {"--ring-dtp", "on"}, {"--ring-size", "1"}, {"--vocab-backward", "in-forward"}});
  Efficiency slow_launches;
  slow_launches.kernel_latency_s = 1.0;
  const TimeModel model(p.model, p.hardware, p.run, p.work, slow_launches);
  const double two_blocks = model.vocab(1, RingRotate::Activations, 16, 16).head_extra_s;
  const double one_block = model.vocab(1, RingRotate::Activations, 16, 32).head_extra_s;
  EXPECT_NEAR(two_blocks - one_block, 5.0, 1e-3);
  ResolvedRun run = p.run;
  run.token_block = 16;
  run.vocab_block = 32;
  const double flops_once = model.full(run, p.work).hardware_flops_per_gpu;
  run.vocab_block = 16;
  const double flops_twice = model.full(run, p.work).hardware_flops_per_gpu;
  EXPECT_DOUBLE_EQ(flops_twice - flops_once, 2.0 * 16 * 8 * 32);  // one pass 2·T·H·V, one loss
}

TEST(PlannerStepTime, MtpAddsItsLayerAndHead) {
  ModelSpec m = tiny_moe();
  m.mtp_layers = 1;
  const Plan off = plan_of(m, tiny_gpu(), {{"--gpus", "2"}, {"--context", "16"}, {"--mtp", "off"}});
  const Plan on = plan_of(m, tiny_gpu(), {{"--gpus", "2"}, {"--context", "16"}, {"--mtp", "on"}});
  // One more MoE layer (224 + 2 x 96), eh_proj 2H*H = 128 and a second head pass set (256), per
  // token x 6; its attention 3 x 272.
  EXPECT_DOUBLE_EQ(on.time.model_flops_per_gpu - off.time.model_flops_per_gpu, 16 * (6.0 * (416 + 128 + 256) + 3 * 272));
}

TEST(PlannerStepTime, TermsSumToTheStepAndThroughputFollows) {
  for (const char* schedule : {"baseline", "practice", "flatpeak"}) {
    const Plan p = plan_of(tiny_moe(), timed_gpu(),
                           {{"--gpus", "2"}, {"--context", "64"}, {"--schedule", schedule}, {"--global-batch", "4"}});
    double sum = 0;
    for (const TimeTerm& t : p.time.terms) sum += t.seconds;
    EXPECT_NEAR(sum, p.time.step_seconds, 1e-12 * p.time.step_seconds) << schedule;
    EXPECT_EQ(p.time.micro_batches, 2) << schedule;  // 4 sequences / (b=1 x DP=2)
    EXPECT_DOUBLE_EQ(p.time.tokens_per_second, 4.0 * 64 / p.time.step_seconds) << schedule;
    EXPECT_DOUBLE_EQ(p.time.mfu, p.time.model_flops_per_gpu / (p.time.step_seconds * p.hardware.bf16_dense_flops)) << schedule;
    double largest = -1;
    std::string bound;
    for (const TimeTerm& t : p.time.terms)
      if (t.seconds > largest) largest = t.seconds, bound = t.name;
    EXPECT_EQ(p.time.bound_by, bound) << schedule;
  }
}

TEST(PlannerStepTime, ComputeScalesWithEfficiency) {
  const Plan p = plan_of(tiny_moe(), timed_gpu(), kBase);
  Efficiency half;
  half.gemm = 0.375;
  half.attention = 0.25;
  const StepTime slow = estimate_step_time(p.model, p.hardware, p.run, p.work, half);
  auto seconds = [](const StepTime& t, const char* name) {
    for (const auto& term : t.terms)
      if (term.name == name) return term.seconds;
    return -1.0;
  };
  EXPECT_DOUBLE_EQ(seconds(slow, "attention"), 2 * seconds(p.time, "attention"));
  EXPECT_DOUBLE_EQ(seconds(slow, "gemm"), 2 * seconds(p.time, "gemm"));
}

double term(const Plan& p, const char* name) {
  for (const auto& t : p.time.terms)
    if (t.name == name) return t.seconds;
  return -1;
}

TEST(PlannerStepTime, OverlapRulesPointTheRightWay) {
  const HardwareSpec h = timed_gpu();
  auto plan = [&](std::vector<std::pair<std::string, std::string>> extra) {
    auto flags = std::vector<std::pair<std::string, std::string>>{{"--gpus", "2"}, {"--context", "256"}};
    flags.insert(flags.end(), extra.begin(), extra.end());
    return plan_of(tiny_moe(4), h, flags);
  };
  // Boundaries: synchronous offload (practice) waits for every copy; SCO hides them behind the
  // neighbouring layers, more so with prefetch.
  const Plan sync = plan({{"--schedule", "practice"}});
  const Plan sco0 = plan({{"--sco", "on"}, {"--sco-layers", "all"}, {"--sco-prefetch", "0"}});
  const Plan sco2 = plan({{"--sco", "on"}, {"--sco-layers", "all"}, {"--sco-prefetch", "2"}});
  EXPECT_GT(term(sync, "host_link_boundaries"), term(sco0, "host_link_boundaries"));
  EXPECT_GE(term(sco0, "host_link_boundaries"), term(sco2, "host_link_boundaries"));
  // Offloaded optimizer: the bucket pipeline hides behind backward, the serial step does not.
  const Plan serial = plan({{"--optimizer", "serial"}});
  const Plan stream = plan({{"--optimizer", "stream"}, {"--bucket-params", "256"}});
  EXPECT_GT(term(serial, "optimizer"), term(stream, "optimizer"));
  // PipelinedLLEP: double buffering overlaps a round's transfers with the previous round's GEMMs.
  const Plan d1 = plan({{"--llep", "on"}, {"--chunk-cap-rows", "64"}, {"--dispatch-depth", "1"}});
  const Plan d2 = plan({{"--llep", "on"}, {"--chunk-cap-rows", "64"}, {"--dispatch-depth", "2"}});
  EXPECT_GT(term(d1, "ep_all_to_all"), term(d2, "ep_all_to_all"));
  // CP: K,V hops appear only with CP > 1.
  EXPECT_EQ(term(plan({}), "cp_ring"), 0);
  EXPECT_GT(term(plan({{"--cp", "2"}}), "cp_ring"), 0);
}

TEST(PlannerStepTime, SmallCapsCostRoundsAndGemmEfficiency) {
  const HardwareSpec h = timed_gpu();
  auto plan = [&](const char* cap) {
    return plan_of(tiny_moe(), h, {{"--gpus", "2"}, {"--context", "1024"}, {"--llep", "on"}, {"--chunk-cap-rows", cap}});
  };
  const Plan small = plan("64"), large = plan("2048");
  EXPECT_GT(small.work.moe_loads[0].rounds, large.work.moe_loads[0].rounds);
  EXPECT_GT(term(small, "expert_small_gemms") + term(small, "ep_all_to_all"),
            term(large, "expert_small_gemms") + term(large, "ep_all_to_all"));
}

TEST(PlannerStepTime, EfficiencyFlagParsing) {
  InputErrors errs;
  const Efficiency e = parse_efficiency("gemm=0.6,attention=0.4,round-latency-us=30", errs);
  EXPECT_TRUE(errs.empty());
  EXPECT_DOUBLE_EQ(e.gemm, 0.6);
  EXPECT_DOUBLE_EQ(e.attention, 0.4);
  EXPECT_DOUBLE_EQ(e.round_latency_s, 30e-6);
  EXPECT_DOUBLE_EQ(e.hbm, Efficiency{}.hbm);
  InputErrors bad;
  parse_efficiency("gem=0.6,network=1.5,hop-latency-us=-1", bad);
  ASSERT_EQ(bad.size(), 3u);
  EXPECT_EQ(bad.diagnostics()[0].to_string(), "--efficiency: unknown key 'gem'");
  EXPECT_EQ(bad.diagnostics()[0].hint, "did you mean 'gemm'?");
  EXPECT_EQ(bad.diagnostics()[1].to_string(), "--efficiency: network must be a fraction in [0.01, 1] (got '1.5')");
  EXPECT_EQ(bad.diagnostics()[2].to_string(), "--efficiency: hop-latency-us must be a number of microseconds in [0, 1e6] (got '-1')");
}

// Past these bounds a step time overflows to inf (written as null in the JSON) or means nothing;
// a key given twice would silently keep one of its values.
TEST(PlannerStepTime, EfficiencyFlagBoundsAndRepeats) {
  InputErrors edges;
  const Efficiency e = parse_efficiency("gemm=0.01,hbm=1,kernel-latency-us=1e6,round-latency-us=0", edges);
  EXPECT_TRUE(edges.empty());
  EXPECT_DOUBLE_EQ(e.gemm, 0.01);
  EXPECT_DOUBLE_EQ(e.kernel_latency_s, 1.0);
  InputErrors bad;
  parse_efficiency("gemm=1e-300,attention=0.0099,bucket-latency-us=1e300,gemm=0.5", bad);
  ASSERT_EQ(bad.size(), 4u);
  EXPECT_EQ(bad.diagnostics()[0].to_string(), "--efficiency: gemm must be a fraction in [0.01, 1] (got '1e-300')");
  EXPECT_EQ(bad.diagnostics()[1].to_string(), "--efficiency: attention must be a fraction in [0.01, 1] (got '0.0099')");
  EXPECT_EQ(bad.diagnostics()[2].to_string(),
            "--efficiency: bucket-latency-us must be a number of microseconds in [0, 1e6] (got '1e300')");
  EXPECT_EQ(bad.diagnostics()[3].to_string(),
            "--efficiency: gemm given twice (in 'gemm=1e-300,attention=0.0099,bucket-latency-us=1e300,gemm=0.5')");
}

TEST(PlannerStepTime, SearchTimeEqualsThePlanTimeBitForBit) {
  // The search combines the same group terms as the plan's step time: equal, not just close.
  for (const char* schedule : {"baseline", "practice", "flatpeak"}) {
    const RunSpec spec = spec_of({{"--gpus", "2"}, {"--context", "256"}, {"--schedule", schedule}});
    const SearchResult r = search_knobs(tiny_moe(3), timed_gpu(), spec, Efficiency{});
    ASSERT_TRUE(r.found) << schedule;
    const Plan p = make_plan(tiny_moe(3), timed_gpu(), r.spec);
    const StepTime t = estimate_step_time(p.model, p.hardware, p.run, p.work, Efficiency{});
    EXPECT_EQ(t.step_seconds, r.time.step_seconds) << schedule;
    EXPECT_EQ(t.tokens_per_second, r.time.tokens_per_second) << schedule;
  }
}

}  // namespace
}  // namespace flatpeak::planner::test
