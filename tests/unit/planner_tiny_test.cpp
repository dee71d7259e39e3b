// Hand-derived bytes for the tiny MoE of planner_test_util.h, phase by phase and peak by peak,
// for the baseline, practice, flatpeak and each technique alone.
// Tiny MoE: H=8, V=32, L=2, E=4, k=2, F=4, a=2, g=1, d=dv=4; N=2, S=16 (T=16), EP=2.
// Parameters (hand count): attention 8*8 (q) + 8*4 (k) + 8*4 (v) + 8*8 (o) = 192; norms 16;
// router 8*4 = 32; one expert 3*8*4 = 96; MoE layer 192+16+32+4*96 = 624; embedding 256,
// LM head 256, final norm 8: total 1768.
// FSDP units per GPU: embedding shard 128; layer: dense part 240 -> shard 120, local experts
// 2*96 = 192 over N/EP = 1 -> 192; layer shard 312, gathered 240 + 192 = 432; head 264 -> 132.
// Shard P/N = 128 + 2*312 + 132 = 884.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>

#include "planner_test_util.h"

namespace flatpeak::planner::test {
namespace {

bool has_term(const Phase& ph, const std::string& name) {
  for (const auto& t : ph.terms.terms())
    if (t.name == name) return true;
  return false;
}

constexpr int64_t kShard = 884;
const std::vector<std::pair<std::string, std::string>> kBase = {{"--gpus", "2"}, {"--context", "16"}};

std::vector<std::pair<std::string, std::string>> with(std::vector<std::pair<std::string, std::string>> extra) {
  auto f = kBase;
  f.insert(f.end(), extra.begin(), extra.end());
  return f;
}

TEST(PlannerTiny, ParamCountsAndFsdpUnits) {
  const Plan p = plan_of(tiny_moe(), tiny_gpu(), kBase);
  EXPECT_EQ(p.work.counts.total, 1768);
  EXPECT_EQ(p.run.ep, 2);  // largest divisor of N = 2 and E = 4 that is <= 2 GPUs per node
  EXPECT_EQ(p.work.tokens, 16);
  ASSERT_EQ(p.work.units.size(), 4u);
  EXPECT_EQ(p.work.units[0].shard_params, 128);
  EXPECT_EQ(p.work.units[1].gathered_params, 432);
  EXPECT_EQ(p.work.units[1].shard_params, 312);
  EXPECT_EQ(p.work.units[3].shard_params, 132);
  EXPECT_EQ(p.work.shard_params, kShard);
  // Balanced routing: each source sends T*k = 32 copies, each rank receives 2 experts * 8 * 2.
  EXPECT_EQ(p.work.moe_loads[0].send_rows, 32);
  EXPECT_EQ(p.work.moe_loads[0].recv_rows_ep, 32);
}

TEST(PlannerTiny, BaselinePhasesAndPeaks) {
  const Plan p = plan_of(tiny_moe(), tiny_gpu(), kBase);
  // Persistent state before any reduce-scatter: fp32 params 884*4 + m + v = 3 * 3536 = 10608.
  const int64_t state = 3 * kShard * 4;
  // fwd/embed: state + gathered embedding 256*2 + prefetched L0 432*2 + ids 16*8 + output 16*8*2.
  EXPECT_EQ(phase(p, "fwd/embed").device_bytes(), state + 512 + 864 + 128 + 256);
  // fwd/L1/attn: gathered L1 + prefetched head (264*2); boundaries x0, x1 (2*256); attention
  // transients: norm-1 out 256, q 16*8*2 = 256, k 128, v 128, o 256, lse 2*16*4 = 128.
  EXPECT_EQ(phase(p, "fwd/L1/attn").device_bytes(), state + 864 + 528 + 512 + (256 + 256 + 128 + 128 + 256 + 128));
  // fwd/L1/moe/dispatch: h1 + norm-2 out (512); routing: logits, scores, scattered probs
  // 3*16*4*4 = 768, map 64, top-k weights 128, ids 256 (1216); sort idx 32*8 = 256, permuted probs
  // 128; send 32*8*2 = 512, receive R=32: 512 + probs 128.
  const int64_t route = 768 + 64 + 128 + 256;
  EXPECT_EQ(phase(p, "fwd/L1/moe/dispatch").device_bytes(),
            state + 864 + 528 + 512 + 512 + route + 384 + 512 + 512 + 128);

  // Loss (materialized): boundaries x0, x1 + final hidden (768).
  // loss/fwd vocab: X 256 + W, read from the gathered head unit (final norm 8, then 32*8):
  // 264*2 = 528 + lse and per-token loss [16] fp32, 64 each + logits 16*32*2 = 1024 + log-softmax
  // 2048 = 3984.
  EXPECT_EQ(phase(p, "loss/fwd").device_bytes(), state + 768 + 3984);
  // loss/bwd vocab: + dlogits 2048 + dX 256 + dW into the unit's grads 528 (bf16, one GEMM) = 6816;
  // FSDP prefetch of L1 (864).
  const Peak& vocab = p.summary.peak(PeakKind::Vocab);
  EXPECT_EQ(vocab.phase, "loss/bwd");
  EXPECT_EQ(vocab.component_bytes, 6816);
  EXPECT_EQ(vocab.bytes, state + 768 + 6816 + 864);

  // Backward: of the folded layers L0-L1, L0 is the worst instance (one boundary fewer than L1,
  // 256 B, but L1's grad shard reduced, 312*4 = 1248 B, and its reduce-scatter input in flight).
  // At bwd/L0: grad shards of head + L1 (444*4 = 1776); gathered L0 864, prefetched embedding
  // 512, L1 reduce-scatter input 432*4 = 1728; boundary x0 (256); attention saved 1280 (norm-1
  // out 256, rstd 2*64, q 256, k 128, v 128, o 256, lse 128); h1 + norm-2 out 512; dy 256 + fp32
  // residual grad 512.
  const int64_t bwd_state = state + 1776;
  const int64_t rec_base = bwd_state + 864 + 512 + 1728 + 256;
  const int64_t block = 1280 + 512 + 768;
  // recompute/moe/combine: route + meta 384 + saved expert input 512, fc1 32*8*2 = 512, act*prob
  // 256 + received probs 32*4 = 128 (EP = 2: the experts' probs came from the other rank's tokens
  // too, and their backward reads them) + fc2 out 512 + unpermuted 512 + combine receive 512 + MoE
  // output 256.
  const int64_t combine = route + 384 + 1280 + 128 + 512 + 512 + 512 + 256;
  EXPECT_EQ(phase(p, "bwd/L0/recompute/moe/combine").device_bytes(), rec_base + block + combine);
  // bwd/L0/moe/experts adds unsharded L1 grads 864: route + meta + saved 1280 + received probs 128
  // + grads 1280.
  EXPECT_EQ(phase(p, "bwd/L0/moe/experts").device_bytes(), rec_base + 864 + block + route + 384 + 1280 + 128 + 1280);
  // At EP = 2 the dispatch phase's two moments tie (send 512 + receive 512, then receive 512 +
  // expert input 512): the first is kept.
  EXPECT_NE(term_bytes(phase(p, "fwd/L1/moe/dispatch"), "dispatch send buffer"), 0);
  const Peak& dispatch = p.summary.peak(PeakKind::Dispatch);
  EXPECT_EQ(dispatch.phase, "bwd/L0/recompute/moe/combine");
  EXPECT_EQ(dispatch.component_bytes, combine);
  // bwd/L0/attn: saved 1280 + dy, residual grad 768 + d o 256, dq 256, dk 128, dv 128, dq accum
  // 16*8*4 = 512, delta 128, d norm-1 out 256.
  const int64_t attn_bwd = 1280 + 768 + 256 + 256 + 128 + 128 + 512 + 128 + 256;
  EXPECT_EQ(phase(p, "bwd/L0/attn").device_bytes(), rec_base + 864 + attn_bwd);
  const Peak& layer = p.summary.peak(PeakKind::Layer);
  EXPECT_EQ(layer.phase, "bwd/L0/attn");
  EXPECT_EQ(layer.component_bytes, attn_bwd);
  const Peak& ckpt = p.summary.peak(PeakKind::Checkpoint);
  EXPECT_EQ(ckpt.component_bytes, 512);
  // Optimizer: fp32 param + grad + m + v shards, 16 B per shard parameter.
  const Peak& opt = p.summary.peak(PeakKind::Optimizer);
  EXPECT_EQ(opt.phase, "opt/step");
  EXPECT_EQ(opt.component_bytes, 16 * kShard);
  EXPECT_EQ(opt.bytes, 16 * kShard);
  // GPU: the expert backward of L1 is the largest phase here (its dispatch share 4160 is the
  // largest component there), although the dispatch component peaks at the recompute combine.
  const int64_t top = rec_base + 864 + block + route + 384 + 1280 + 128 + 1280;
  EXPECT_EQ(p.summary.gpu_peak_bytes, top);
  EXPECT_EQ(p.summary.gpu_peak_phase, "bwd/L0/moe/experts");
  EXPECT_EQ(p.summary.binding, PeakKind::Dispatch);
  // Checkpoint: 2 boundaries resident in L1's forward and backward (the folded group keeps L1,
  // the instance with most boundaries, beside L0, the worst); the largest total with 2 is
  // bwd/L1/moe/experts: only the head's grads reduced (528), gathered L1 864, prefetched L0 864,
  // head reduce-scatter 1056, boundaries 512, L1 unsharded grads 864, block, routing, meta,
  // saved experts 1280, received probs 128 and their grads 1280.
  EXPECT_EQ(ckpt.phase, "bwd/L1/moe/experts");
  EXPECT_EQ(ckpt.bytes, state + 528 + 864 + 864 + 1056 + 512 + 864 + block + route + 384 + 1280 + 128 + 1280);
  EXPECT_EQ(p.summary.required_bytes, top + 1000 + (top * 5 + 99) / 100);
  EXPECT_TRUE(p.summary.fits());
  // Host: only the fixed per-node term.
  EXPECT_EQ(p.summary.host_peak_bytes, kHostFixedBytesPerNode);
}

// One layer, E = 2, top-1: every phase of the baseline step by hand.
// Params: attention 192, norms 16, router 8*2 = 16, expert 96. Layer: dense 224 -> shard 112, local
// expert 96 over N/EP = 1 -> 96; shard 208, gathered 320 (640 B bf16, 1280 B fp32). Embedding
// shard 128, gathered 512 B; head 264 -> shard 132, 528 B bf16, 1056 B fp32. P/N = 468.
// Balanced top-1 on EP = 2: T*k = 16 rows sent; rank 0 receives expert 0 from both sources, R = 16.
TEST(PlannerTiny, BaselineEveryPhaseOneLayerTop1) {
  ModelSpec m = tiny_moe(1);
  m.num_experts = 2;
  m.top_k = 1;
  const Plan p = plan_of(m, tiny_gpu(), kBase);
  ASSERT_EQ(p.work.shard_params, 468);
  const int64_t state = 3 * 468 * 4;  // fp32 params, m, v: 5616
  const int64_t route = 3 * 16 * 2 * 4 + 16 * 2 + 16 * 4 + 16 * 8;  // 608
  const int64_t meta = 16 * 8 + 16 * 4;                              // 192
  const int64_t fwd_base = state + 640 + 528 + 256;                  // gathered L0, prefetched head, x0
  const int64_t bwd_state = state + 132 * 4;                         // head grads reduced
  const int64_t rec_base = bwd_state + 640 + 512 + 1056 + 256;       // L0, prefetched embedding, head RS, x0
  const int64_t bwd_base = rec_base + 640;                           // + unsharded L0 grads
  const int64_t attn_saved = 256 + 128 + 256 + 128 + 128 + 256 + 128;  // 1280
  const int64_t block = attn_saved + 512 + 768;                      // + h1, norm-2 out, dy, fp32 residual
  const int64_t saved_experts = 256 + 256 + 128;                     // input, fc1, act*prob (R = 16)
  const int64_t probs = 64;  // received probs [R = 16] fp32: EP = 2, held from the dispatch through the experts' backward
  const std::vector<std::pair<std::string, int64_t>> expected = {
      {"fwd/embed", state + 512 + 640 + 128 + 256},
      {"fwd/L0/attn", fwd_base + (256 + 256 + 128 + 128 + 256 + 128)},
      {"fwd/L0/moe/route", fwd_base + 512 + route},
      {"fwd/L0/moe/dispatch", fwd_base + 512 + route + meta + 256 + 256 + 64},
      {"fwd/L0/moe/experts", fwd_base + 512 + route + meta + saved_experts + probs},
      {"fwd/L0/moe/combine", fwd_base + 512 + route + meta + 4 * 256},
      {"loss/fwd", state + 512 + 3984},  // with lse and per-token loss (64 B each); W from the head unit (528)
      {"loss/bwd", state + 512 + 640 + 6816},
      {"bwd/L0/recompute/attn", rec_base + attn_saved + 768},
      {"bwd/L0/recompute/moe/dispatch", rec_base + block + route + meta + 256 + 256 + 64},
      {"bwd/L0/recompute/moe/experts", rec_base + block + route + meta + saved_experts + 256 + probs},
      {"bwd/L0/recompute/moe/combine", rec_base + block + route + meta + saved_experts + probs + 4 * 256},
      {"bwd/L0/moe/combine", bwd_base + block + route + meta + saved_experts + probs + 256 + 256},
      {"bwd/L0/moe/experts", bwd_base + block + route + meta + saved_experts + probs + (256 + 128 + 256)},
      {"bwd/L0/moe/dispatch", bwd_base + block + route + meta + 256 + 256 + 512},
      {"bwd/L0/attn", bwd_base + attn_saved + 768 + 256 + 256 + 128 + 128 + 512 + 128 + 256},
      {"bwd/embed", state + (132 + 208) * 4 + 512 + 512 + 1280 + 256},
      {"opt/step", 16 * 468},
  };
  ASSERT_EQ(p.timeline.phases.size(), expected.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    EXPECT_EQ(p.timeline.phases[i].name, expected[i].first);
    EXPECT_EQ(p.timeline.phases[i].device_bytes(), expected[i].second) << expected[i].first;
  }
  EXPECT_EQ(p.summary.peak(PeakKind::Dispatch).phase, "bwd/L0/recompute/moe/combine");
  EXPECT_EQ(p.summary.peak(PeakKind::Dispatch).component_bytes, route + meta + saved_experts + probs + 4 * 256);
  EXPECT_EQ(p.summary.peak(PeakKind::Vocab).bytes, state + 512 + 640 + 6816);
  EXPECT_EQ(p.summary.peak(PeakKind::Checkpoint).phase, "bwd/L0/moe/experts");
  EXPECT_EQ(p.summary.peak(PeakKind::Checkpoint).component_bytes, 256);
  EXPECT_EQ(p.summary.peak(PeakKind::Layer).phase, "bwd/L0/attn");
  EXPECT_EQ(p.summary.peak(PeakKind::Optimizer).bytes, 16 * 468);
  EXPECT_EQ(p.summary.gpu_peak_phase, "bwd/L0/moe/experts");
  EXPECT_EQ(p.summary.gpu_peak_bytes, 13888 + probs);
  EXPECT_EQ(p.summary.binding, PeakKind::Dispatch);
}

// bwd/embed is the largest of three moments (a tie keeps the earlier): the embedding's backward,
// its unsharded grads copied into the fp32 reduce-scatter input, the new grad shard beside that
// input. On one GPU with V = 512 (embedding 512*8 = 4096 params, P = 4096 + 2*624 + 8 + 4096 =
// 9448), fp32 shards: beside the fp32 params, m and v, the backward holds the grads of the head
// and both layers ((4104 + 1248)*4 = 21408), the gathered table and its unsharded grads (8192
// each), L0's reduce-scatter input (624*4 = 2496) and d embedding output (256): 40544; the copy
// 21408 + 8192 + 4096*4 = 45984; the shard every grad shard (9448*4 = 37792) + the input 16384 =
// 54176. With bf16 shards (serial offload) the copy (5352*2 + 8192 + 16384 = 35280) ties the
// shard (9448*2 + 16384) and, earlier, is the one. With V = 32 the backward holds the most.
TEST(PlannerTiny, EmbeddingReduceScatterIsBwdEmbedWhenLarger) {
  ModelSpec m = tiny_moe();
  m.vocab_size = 512;
  const Plan one = plan_of(m, tiny_gpu(), {{"--gpus", "1"}, {"--context", "16"}});
  ASSERT_EQ(one.work.shard_params, 9448);
  const Phase& embed = phase(one, "bwd/embed");
  EXPECT_EQ(embed.terms.bytes(Category::Grads), 9448 * 4);
  EXPECT_EQ(embed.terms.bytes(Category::Fsdp), 4096 * 4);
  EXPECT_EQ(embed.terms.bytes(Category::Activations), 0);
  EXPECT_EQ(embed.device_bytes(), 3 * 9448 * 4 + 54176);
  const Plan serial = plan_of(m, tiny_gpu(), {{"--gpus", "1"}, {"--context", "16"}, {"--optimizer", "serial"}});
  const Phase& embed_serial = phase(serial, "bwd/embed");
  EXPECT_EQ(embed_serial.terms.bytes(Category::Grads), 5352 * 2);
  EXPECT_EQ(embed_serial.terms.bytes(Category::Fsdp), 8192 + 16384);
  EXPECT_EQ(embed_serial.device_bytes(), 9448 * 2 + 35280);
  const Plan small = plan_of(tiny_moe(), tiny_gpu(), {{"--gpus", "1"}, {"--context", "16"}});
  const Phase& embed_small = phase(small, "bwd/embed");
  EXPECT_EQ(embed_small.terms.bytes(Category::Activations), 16 * 8 * 2);
  EXPECT_EQ(embed_small.terms.bytes(Category::Grads), (small.work.shard_params - 256) * 4);
}

// The last moment of a layer's backward: its grads copied into the fp32 reduce-scatter input once
// the gathered layer and the previous unit's input are gone (what the executor's step measures).
// One GPU, E = 32 experts all local (EP = 1): layer unit U = 192 + 16 + 8 * 32 (router) + 32 * 96 =
// 3536, head 264. In bwd/L1/attn (the first layer in backward; the head's input 4 * 264 in flight)
// the copy-in holds prefetched L0 2U + grads 2U + input 4U and d x_1 [16, 8] bf16, more than the
// attention backward (gathered L1 2U + prefetched L0 2U + grads 2U + 1056 + its activations); in
// bwd/L0/attn L1's input 4U is in flight, so the attention backward holds more and stays.
TEST(PlannerTiny, LayerGradCopyInIsBwdAttnWhenLarger) {
  ModelSpec m = tiny_moe();
  m.num_experts = 32;
  const Plan p = plan_of(m, tiny_gpu(), {{"--gpus", "1"}, {"--context", "16"}});
  const int64_t U = 3536;
  ASSERT_EQ(p.work.units[1].gathered_params, U);
  const Phase& first = phase(p, "bwd/L1/attn");
  EXPECT_EQ(first.terms.bytes(Category::Fsdp), 8 * U);
  EXPECT_EQ(first.terms.bytes(Category::Activations), 16 * 8 * 2);
  EXPECT_TRUE(has_term(first, "d layer input (to the next layer's backward)"));
  const Phase& last = phase(p, "bwd/L0/attn");
  EXPECT_EQ(last.terms.bytes(Category::Fsdp), 2 * U + 512 + 2 * U + 4 * U);
  EXPECT_GT(last.terms.bytes(Category::Activations), 16 * 8 * 2);
  // With the tiny model's 4 experts the attention backward holds more in every layer.
  const Plan small = plan_of(tiny_moe(), tiny_gpu(), {{"--gpus", "1"}, {"--context", "16"}});
  EXPECT_FALSE(has_term(phase(small, "bwd/L1/attn"), "d layer input (to the next layer's backward)"));
}

// Four GPUs at EP = 1 with E = 32: layer unit U = 3536 (dense 464 + experts 3072), shard S =
// ceil(464/4) + ceil(3072/4) = 884; embedding 256 (shard 64), head 264 (shard 66). With the
// optimizer offloaded the grad shards are bf16 and each lands through its unit's fp32
// reduce-scatter output [S]. bwd/embed starts with L0's landing: gathered embedding 2 * 256, L0's
// input 4U, its output 4S and d embedding output [16, 8] bf16, more than the backward (whose
// embedding grads 2 * 256 are smaller than 4S). bwd/L0/recompute/attn starts with L1's landing:
// gathered L0 2U, L1's input 4U, its output 4S, dy and x_0, more than the recompute (prefetched
// embedding 512 and the attention's saved set instead of 4S); in bwd/L1 the head's output 4 * 66
// is smaller than prefetched L0, so the recompute stays. With the optimizer on the GPU the fp32
// shards receive the sum in place: no output term anywhere; on one GPU nothing is reduce-scattered.
TEST(PlannerTiny, OffloadedGradShardsLandThroughAnFp32ReduceScatterOutput) {
  ModelSpec m = tiny_moe();
  m.num_experts = 32;
  const int64_t U = 3536, S = 884;
  const std::string L0_out = "reduce-scatter output L0 (fp32, rounded into its bf16 grad shard)";
  const std::string L1_out = "reduce-scatter output L1 (fp32, rounded into its bf16 grad shard)";
  for (const char* optimizer : {"serial", "stream"}) {
    const Plan p = plan_of(m, tiny_gpu(), {{"--gpus", "4"}, {"--ep", "1"}, {"--context", "16"}, {"--optimizer", optimizer}});
    ASSERT_EQ(p.work.units[1].gathered_params, U) << optimizer;
    ASSERT_EQ(p.work.units[1].shard_params, S) << optimizer;
    const Phase& embed = phase(p, "bwd/embed");
    EXPECT_EQ(term_bytes(embed, L0_out), 4 * S) << optimizer;
    EXPECT_EQ(embed.terms.bytes(Category::Fsdp), 2 * 256 + 4 * U + 4 * S) << optimizer;
    EXPECT_EQ(embed.terms.bytes(Category::Activations), 16 * 8 * 2) << optimizer;
    const Phase& first = phase(p, "bwd/L0/recompute/attn");
    EXPECT_EQ(term_bytes(first, L1_out), 4 * S) << optimizer;
    EXPECT_EQ(first.terms.bytes(Category::Fsdp), 2 * U + 4 * U + 4 * S) << optimizer;
    EXPECT_EQ(first.terms.bytes(Category::Activations), 16 * 8 * 2) << optimizer;
    EXPECT_EQ(first.terms.bytes(Category::Boundaries), 16 * 8 * 2) << optimizer;
    EXPECT_EQ(first.terms.bytes(Category::Grads), 2 * (66 + S)) << optimizer;  // the head's and L1's bf16 shards
    const Phase& last = phase(p, "bwd/L1/recompute/attn");
    EXPECT_FALSE(has_term(last, "reduce-scatter output head (fp32, rounded into its bf16 grad shard)")) << optimizer;
    EXPECT_TRUE(has_term(last, "prefetched params L0")) << optimizer;
  }
  for (const auto& flags : std::vector<std::vector<std::pair<std::string, std::string>>>{
           {{"--gpus", "4"}, {"--ep", "1"}, {"--context", "16"}, {"--optimizer", "gpu"}},
           {{"--gpus", "1"}, {"--context", "16"}, {"--optimizer", "serial"}}}) {
    const Plan p = plan_of(m, tiny_gpu(), flags);
    for (const auto& ph : p.timeline.phases)
      for (const auto& t : ph.terms.terms())
        EXPECT_EQ(t.name.rfind("reduce-scatter output", 0), std::string::npos) << ph.name << " " << t.name;
    EXPECT_TRUE(has_term(phase(p, "bwd/L0/recompute/attn"), "prefetched params embedding"));
  }
}

TEST(PlannerTiny, PracticeBlockedLossAndSyncOffload) {
  const Plan p = plan_of(tiny_moe(), tiny_gpu(), with({{"--schedule", "practice"}}));
  EXPECT_EQ(p.run.vocab, VocabMode::Blocked);
  // Liger heuristic: ceil(V/H) = 4, next_pow2(ceil(16/4)) = 4 tokens per block; V_blk = V.
  EXPECT_EQ(p.run.token_block, 4);
  EXPECT_EQ(p.run.vocab_block, 32);
  // Gradients in forward: X 256, W from the head unit (8 + 32*8)*2 = 528, logits block 4*32*4 = 512, online state of the token block
  // 3*4*4 = 48, lse 64, per-token loss 64, dlogits block 4*32*2 = 256, dX acc of the token block
  // 4*8*4 = 128 written into dX 16*8*2 = 256 (R = 1, token-block outer), dW acc: the head unit's
  // grads (8 + 32*8)*4 = 1056.
  const Peak& vocab = p.summary.peak(PeakKind::Vocab);
  EXPECT_EQ(vocab.phase, "loss/fwd/blk0");
  EXPECT_EQ(vocab.component_bytes, 256 + 528 + 512 + 48 + 64 + 64 + 256 + 128 + 256 + 1056);
  // The backward holds what the forward computed: dX bf16 256, the fp32 dW accumulator 1056 and
  // the per-token loss 64.
  EXPECT_EQ(phase(p, "loss/bwd").terms.bytes(Category::Vocab), 256 + 1056 + 64);
  // Synchronous offload: only the boundary in use is on the device; host holds both.
  EXPECT_EQ(phase(p, "fwd/L1/attn").terms.bytes(Category::Boundaries), 256);
  EXPECT_EQ(phase(p, "loss/fwd/blk0").terms.bytes(Category::Boundaries), 256);  // final hidden only
  EXPECT_EQ(phase(p, "bwd/L0/attn").terms.bytes(Category::Boundaries), 256);
  EXPECT_EQ(p.summary.host_per_gpu_bytes, 2 * 256);
  EXPECT_EQ(p.summary.host_peak_bytes, 2 * 512 + kHostFixedBytesPerNode);
}

TEST(PlannerTiny, RingDtpAlone) {
  const Plan p = plan_of(tiny_moe(), tiny_gpu(), with({{"--ring-dtp", "on"}}));
  EXPECT_EQ(p.run.ring_size, 2);
  EXPECT_EQ(p.run.ring_rotate, RingRotate::Weights);  // [V/R=16, H] <= [T=16, H] per hop
  // fwd block: X 256, W shard 16*8*2 = 256, logits block 16*16*4 = 1024, state 192, lse 64,
  // W shard in flight 256.
  EXPECT_EQ(phase(p, "loss/fwd/blk0").terms.bytes(Category::Vocab), 256 + 256 + 1024 + 192 + 64 + 64 + 256);  // + loss
  // bwd block (recompute): X, W shard, lse, logits block, dlogits 16*16*2 = 512, W in flight,
  // dX acc 512, dW shard accumulators travelling 2*16*8*4 = 1024.
  const Peak& vocab = p.summary.peak(PeakKind::Vocab);
  EXPECT_EQ(vocab.phase, "loss/bwd/blk0");
  EXPECT_EQ(vocab.component_bytes, 256 + 256 + 64 + 64 + 1024 + 512 + 256 + 512 + 1024);  // + loss
  // Rotating activations instead: X blocks in flight 2*16*8*2 = 512, lse blocks in flight
  // 2*16*4 = 128 (the backward's blocks carry lse, not the forward's state), dX blocks
  // 2*16*8*4 = 1024; dW shard accumulator 16*8*4 = 512.
  const Plan a = plan_of(tiny_moe(), tiny_gpu(), with({{"--ring-dtp", "on"}, {"--ring-rotate", "activations"}}));
  EXPECT_EQ(a.summary.peak(PeakKind::Vocab).component_bytes,
            256 + 256 + 64 + 64 + 1024 + 512 + 512 + 128 + 1024 + 512 + 512);  // + loss
  // Its forward keeps no [3, T] state: each token block's state travels with it, 2*3*16*4 = 384.
  EXPECT_EQ(phase(a, "loss/fwd/blk0").terms.bytes(Category::Vocab), 256 + 256 + 1024 + 64 + 64 + 512 + 384);
  // Gradients in forward with weights rotating: after the last hop one dW shard is left, 512.
  const Plan f = plan_of(tiny_moe(), tiny_gpu(), with({{"--ring-dtp", "on"}, {"--vocab-backward", "in-forward"}}));
  EXPECT_EQ(phase(f, "loss/bwd").terms.bytes(Category::Vocab), 512 + 512 + 64);  // dX fp32, dW, loss
  // The dispatch peak is the baseline's (at bwd/L0 the head's reduce-scatter is done).
  EXPECT_EQ(p.summary.peak(PeakKind::Dispatch).component_bytes, p.baseline.peak(PeakKind::Dispatch).component_bytes);
  EXPECT_EQ(p.summary.peak(PeakKind::Dispatch).bytes, p.baseline.peak(PeakKind::Dispatch).bytes);
}

TEST(PlannerTiny, ScoAlone) {
  const Plan p = plan_of(tiny_moe(3), tiny_gpu(), with({{"--sco", "on"}, {"--sco-layers", "all"}, {"--global-batch", "4"}}));
  // With accumulation every grad shard is live throughout, so each folded group's worst instance
  // is its last layer (most boundaries) and L2 represents L0-L2 in backward too.
  // fwd/L2: only x2 (being copied) on the device; baseline holds x0..x2.
  EXPECT_EQ(phase(p, "fwd/L2/attn").terms.bytes(Category::Boundaries), 256);
  EXPECT_EQ(phase(plan_of(tiny_moe(3), tiny_gpu(), kBase), "fwd/L2/attn").terms.bytes(Category::Boundaries), 3 * 256);
  // bwd/L2: x2 fetched + x1 prefetched.
  EXPECT_EQ(phase(p, "bwd/L2/attn").terms.bytes(Category::Boundaries), 512);
  EXPECT_EQ(p.summary.host_per_gpu_bytes, 3 * 256);
  // Offload only the first layer's boundary ("1" = a count): x1, x2 stay on the device, and the
  // prefetch window of bwd/L2 (x1) is resident already.
  const Plan one = plan_of(tiny_moe(3), tiny_gpu(), with({{"--sco", "on"}, {"--sco-layers", "1"}, {"--global-batch", "4"}}));
  EXPECT_EQ(phase(one, "bwd/L2/attn").terms.bytes(Category::Boundaries), 2 * 256);
  const Plan set = plan_of(tiny_moe(3), tiny_gpu(), with({{"--sco", "on"}, {"--sco-layers", "1-2"}, {"--global-batch", "4"}}));
  EXPECT_EQ(phase(set, "bwd/L2/attn").terms.bytes(Category::Boundaries), 3 * 256);  // x0, x2 fetched, x1 prefetched
  EXPECT_EQ(one.summary.host_per_gpu_bytes, 256);
}

TEST(PlannerTiny, ScoAutoOffloadsTheFewestLayersThatFit) {
  const auto flags = std::vector<std::pair<std::string, std::string>>{{"--gpus", "2"}, {"--context", "4K"}, {"--sco", "on"}};
  auto count = [&](const std::string& n, int64_t budget) {
    HardwareSpec h = tiny_gpu();
    h.device_memory_bytes = budget;
    auto f = flags;
    f.push_back({"--sco-layers", n});
    return plan_of(tiny_moe(6), h, f);
  };
  // A budget between what 2 and 3 offloaded layers need: auto must pick exactly 3.
  const int64_t need3 = count("3", int64_t{1} << 40).summary.required_bytes;
  const int64_t need2 = count("2", int64_t{1} << 40).summary.required_bytes;
  ASSERT_LT(need3, need2);
  const Plan a = count("auto", need3);
  EXPECT_TRUE(a.summary.gpu_fits);
  EXPECT_EQ(std::count(a.run.sco_offloaded.begin(), a.run.sco_offloaded.end(), true), 3);
  EXPECT_EQ(a.summary.host_per_gpu_bytes, 3 * 4096 * 8 * 2);
  // Nothing fits: all layers are offloaded.
  const Plan none = count("auto", 1);
  EXPECT_EQ(std::count(none.run.sco_offloaded.begin(), none.run.sco_offloaded.end(), true), 6);
}

TEST(PlannerTiny, OptimizerOffloadSerialAndStream) {
  const Plan s = plan_of(tiny_moe(), tiny_gpu(), with({{"--optimizer", "serial"}}));
  // GPU: bf16 param + grad shards (4 B per shard parameter).
  EXPECT_EQ(s.summary.peak(PeakKind::Optimizer).component_bytes, 4 * kShard);
  EXPECT_EQ(s.summary.peak(PeakKind::Optimizer).phase, "opt/d2h");
  // Host: master, m, v, fp32 grad staging (16 B) + bf16 landing and staging (4 B) per parameter.
  EXPECT_EQ(s.summary.host_per_gpu_bytes, 20 * kShard);
  // The baseline summary honours --optimizer serial (DESIGN.md), not OffloadStreamAdamW.
  EXPECT_EQ(s.baseline.peak(PeakKind::Optimizer).component_bytes, 4 * kShard);
  const Plan b = plan_of(tiny_moe(), tiny_gpu(), with({{"--optimizer", "stream"}, {"--bucket-params", "100"}, {"--bucket-depth", "3"}}));
  EXPECT_EQ(b.baseline.peak(PeakKind::Optimizer).component_bytes, 16 * kShard);
  EXPECT_EQ(b.summary.peak(PeakKind::Optimizer).component_bytes, 4 * kShard);
  EXPECT_EQ(b.summary.peak(PeakKind::Optimizer).phase, "opt/bucket0");
  // Host: 16 B per parameter + 2 directions * depth 3 * 100 params * 2 B.
  EXPECT_EQ(b.summary.host_per_gpu_bytes, 16 * kShard + 2 * 3 * 100 * 2);
  EXPECT_EQ(b.timeline.phases.back().folds, "bucket0-bucket8");  // ceil(884/100) = 9 buckets
}

TEST(PlannerTiny, PipelinedLlepAlone) {
  const Plan p = plan_of(tiny_moe(), tiny_gpu(), with({{"--llep", "on"}, {"--chunk-cap-rows", "8"}}));
  const MoeLoad& load = p.work.moe_loads[0];
  // Balanced: native imbalance 1.0 < λ = 1.3, LLA falls back to plain EP: R = 32, no weights.
  EXPECT_FALSE(load.lla_ran);
  EXPECT_EQ(load.recv_rows_llep, 32);
  // Round buffer, sized at launch for the LLA bound ρ_B = max(1, λ, α) + δ/N: with m = 1024 far
  // above N = 32, δ = (EP−1)·m + (α+1)·EP − (α−1)·EP·N = 1022 rows (rounded up) and the bound is
  // min(EP*C = 16, ceil((C + EP) * ρ_B) + EP) = 16 rows; 32/8 = 4 rounds.
  EXPECT_EQ(load.round_recv_rows, 16);
  EXPECT_EQ(load.rounds, 4);
  EXPECT_EQ(p.run.dispatch_mode, DispatchMode::Recompute);
  // Backward round (recompute mode), dispatch terms: routing 1216; buffers: send 2*8*8*2 = 256,
  // receive 2*16*8*2 = 512, combine send 512, combine receive 256, probs 2*48*4 = 384, indices
  // 2*48*8 = 768, dest/sort/unsort 3*32*8 = 768, combine acc 16*8*4 = 512 (3968); round expert
  // input 16*8*2 = 256, fc1 256, act 128; grad buffers 2*48*8*2 = 1536; d fc2 256, d act 128,
  // d fc1 256; d norm-2 acc 512; launch-time LLEP buffers whatever LLA does (here it does not
  // run): the foreign-weight pool S_cap = 1 (floor(B/m) − E/EP < 1, kept at one) of p_e = 3*8*4
  // = 96 parameters, bf16 192 and its fp32 gradients 384, and the lent-gradient staging slot
  // [1, p_e] fp32 384 (960).
  const Phase& r0 = phase(p, "bwd/L0/moe/dispatch/r0");
  EXPECT_EQ(r0.folds, "L0-L1 x r0-r3");
  EXPECT_EQ(load.foreign_pool, 1);
  EXPECT_EQ(r0.terms.bytes(Category::Dispatch), 1216 + 3968 + 640 + 1536 + 640 + 512 + 960);
  // Recompute mode recomputes only the routing before the backward rounds (and borrows into the
  // pool, 192).
  EXPECT_EQ(phase(p, "bwd/L0/recompute/moe/route").terms.bytes(Category::Dispatch), 1216 + 192);
  // Store mode keeps every round's expert activations in a store sized at launch: ceil(ρ_B*N)
  // above every copy a rank can receive, so EP*T*min(k, E/EP) = 64 rows of 8*2 + 8*2 + 4*2 B (2560).
  const Plan st = plan_of(tiny_moe(), tiny_gpu(), with({{"--llep", "on"}, {"--chunk-cap-rows", "8"}, {"--dispatch-mode", "store"}}));
  EXPECT_EQ(st.work.moe_loads[0].store_rows, 64);
  EXPECT_EQ(phase(st, "bwd/L0/moe/dispatch/r3").terms.bytes(Category::Dispatch), 1216 + 3968 + 2560 + 1536 + 640 + 512 + 960);
  // Without striping the receive buffer is EP*C = 16 rows.
  const Plan o1 = plan_of(tiny_moe(), tiny_gpu(), with({{"--llep", "on"}, {"--chunk-cap-rows", "8"}, {"--striping", "off"}}));
  EXPECT_EQ(o1.work.moe_loads[0].round_recv_rows, 16);
}

TEST(PlannerTiny, LlepUnderImbalanceUsesTheLeastLoadedAssignment) {
  // rho=2 on EP=2: rank 0 receives all 64 copies (2*T*k/2... = 2x the mean 32).
  const auto flags = with({{"--imbalance", "rho=2"}});
  const Plan ep = plan_of(tiny_moe(), tiny_gpu(), flags);
  EXPECT_EQ(ep.work.moe_loads[0].recv_rows_ep, 64);
  EXPECT_DOUBLE_EQ(ep.work.moe_loads[0].rho_ep, 2.0);
  auto llep_flags = flags;
  llep_flags.push_back({"--llep", "on"});
  llep_flags.push_back({"--chunk-cap-rows", "0"});
  llep_flags.push_back({"--llep-min-rows", "1"});
  llep_flags.push_back({"--llep-alpha", "1"});
  const Plan ll = plan_of(tiny_moe(), tiny_gpu(), llep_flags);
  const MoeLoad& load = ll.work.moe_loads[0];
  EXPECT_TRUE(load.lla_ran);
  EXPECT_EQ(load.recv_rows_llep, 32);  // cap = α * mean = 32 rows per rank
  EXPECT_GE(load.foreign_experts, 1);
  // Foreign expert weights (S_p * 96 params * 2 B) appear in the dispatch terms.
  EXPECT_EQ(term_bytes(phase(ll, "fwd/L1/moe/dispatch"), "LLEP foreign expert weights"), load.foreign_experts * 96 * 2);
  EXPECT_LT(ll.summary.peak(PeakKind::Dispatch).component_bytes, ep.summary.peak(PeakKind::Dispatch).component_bytes);
}

// EP > 1 (executor/schedules/dispatch_uncapped.cpp does the same): the received rows arrive
// source-major and are copied into expert order, so the dispatch phase holds the larger of its
// two moments (send + receive, then receive + expert input), and the probs as received [R] fp32
// stay beside the experts until their backward has used them (they are other ranks' tokens'
// probs: at one rank the experts read the rank's own permuted probs). rho=2 on EP=2: rank 0
// receives all 64 copies, N = 32.
TEST(PlannerTiny, EpAboveOneRegroupsTheReceivedRowsAndKeepsTheirProbs) {
  const Plan p = plan_of(tiny_moe(), tiny_gpu(), with({{"--imbalance", "rho=2"}}));
  const MoeLoad& load = p.work.moe_loads[0];
  ASSERT_EQ(load.ranks.size(), 1u);  // rank 1 receives nothing: dominated
  EXPECT_EQ(load.ranks[0].recv_rows, 64);
  const int64_t route = 1216, meta = 384, rows64 = 64 * 8 * 2, probs = 64 * 4;
  // Dispatch: the regroup (receive 1024 + probs 256 + expert input 1024) beats the all-to-all
  // (send 512 + receive 1024 + probs 256).
  const Phase& dispatch = phase(p, "fwd/L1/moe/dispatch");
  EXPECT_EQ(dispatch.terms.bytes(Category::Dispatch), route + meta + rows64 + probs + rows64);
  EXPECT_FALSE(has_term(dispatch, "dispatch send buffer"));
  EXPECT_EQ(term_bytes(dispatch, "expert input"), rows64);
  // Experts (no-grad forward): expert input, fc1 64*8*2, act*prob 64*4*2, and the probs.
  EXPECT_EQ(phase(p, "fwd/L1/moe/experts").terms.bytes(Category::Dispatch), route + meta + rows64 + 1024 + 512 + probs);
  // Backward combine: the reversed rows regrouped into d fc2 (1024 + 1024) beat d combine rows
  // 512 + received 1024; the saved set (2560) and the probs beside them.
  const Phase& comb = phase(p, "bwd/L0/moe/combine");
  EXPECT_EQ(comb.terms.bytes(Category::Dispatch), route + meta + 2560 + probs + rows64 + rows64);
  EXPECT_EQ(term_bytes(comb, "d expert fc2 out"), rows64);
  EXPECT_EQ(term_bytes(phase(p, "bwd/L0/moe/experts"), "received probs"), probs);
  // Backward dispatch: d expert input and its send-order copy (2048) tie with the send-order copy
  // + d dispatch rows 512 + fp32 accumulator 16*8*4 = 512: the first is kept.
  const Phase& back = phase(p, "bwd/L0/moe/dispatch");
  EXPECT_EQ(back.terms.bytes(Category::Dispatch), route + meta + 2 * rows64);
  EXPECT_EQ(term_bytes(back, "d expert input (send order)"), rows64);
  // At one GPU nothing is regrouped: no received probs beside the experts.
  const Plan one = plan_of(tiny_moe(), tiny_gpu(), {{"--gpus", "1"}, {"--context", "16"}});
  EXPECT_FALSE(has_term(phase(one, "fwd/L1/moe/experts"), "received probs"));
  EXPECT_NE(term_bytes(phase(one, "fwd/L1/moe/dispatch"), "dispatch send buffer"), 0);
}

// LLEP: the rank that receives the most lends and borrows nothing, its helper the other way
// round; each phase is the larger of the two ranks' live sets, not the sum of every maximum.
// rho=2, α = 1, m = 1 on EP = 2: rank 0 keeps expert 1 (32 rows) and lends expert 0 to rank 1.
TEST(PlannerTiny, LlepPhasesAreTheWorstRanksNotASumOfMaxima) {
  const Plan ll = plan_of(tiny_moe(), tiny_gpu(),
                          with({{"--imbalance", "rho=2"}, {"--llep", "on"}, {"--chunk-cap-rows", "0"}, {"--llep-min-rows", "1"}, {"--llep-alpha", "1"}}));
  const MoeLoad& load = ll.work.moe_loads[0];
  ASSERT_EQ(load.ranks.size(), 2u);
  EXPECT_EQ(load.ranks[0].recv_rows, 32);
  EXPECT_EQ(load.ranks[0].foreign_experts, 0);
  EXPECT_EQ(load.ranks[0].lent_experts, 1);
  EXPECT_EQ(load.ranks[1].recv_rows, 32);
  EXPECT_EQ(load.ranks[1].foreign_experts, 1);
  EXPECT_EQ(load.ranks[1].lent_experts, 0);
  EXPECT_EQ(load.foreign_experts, 1);  // the maxima are still reported
  EXPECT_EQ(load.lent_experts, 1);
  // Backward experts: rank 1 holds the borrowed weights (96 x 2 B) and their fp32 gradient
  // accumulator (96 x 4 B); rank 0 only the fp32 lent grads it gets back (384). Rank 1's set is
  // the larger; the sum of maxima would have held all three.
  const Phase& experts = phase(ll, "bwd/L0/moe/experts");
  EXPECT_EQ(term_bytes(experts, "LLEP foreign expert weights"), 192);
  EXPECT_EQ(term_bytes(experts, "LLEP foreign weight grads"), 384);
  EXPECT_FALSE(has_term(experts, "LLEP lent weight grads received"));  // a zero-size term is left out
}

// PipelinedLLEP's round buffers are sized at launch, before any routing is known: B depends on
// C, EP and the LLA bound only. m = 1: δ = 0, ρ_B = max(1, λ, α) = 1.3, B = ceil(10·1.3) + 2 = 15
// rows under any routing model (the cap shrinks where known loads would overflow them).
TEST(PlannerTiny, PipelinedRoundBuffersDoNotDependOnTheRouting) {
  for (const char* routing : {"balanced", "rho=1.5", "rho=2", "hot-expert=0.9,1"}) {
    const Plan p = plan_of(tiny_moe(), tiny_gpu(),
                           with({{"--imbalance", routing}, {"--llep", "on"}, {"--chunk-cap-rows", "8"}, {"--llep-min-rows", "1"}}));
    const MoeLoad& load = p.work.moe_loads[0];
    EXPECT_EQ(load.round_recv_rows, 15) << routing;
    EXPECT_EQ(load.launch_chunk_cap_rows, 8) << routing;
    EXPECT_LE(load.chunk_cap_rows, 8) << routing;
    // The round buffers' terms use the launch cap: send 2*8*8*2 whatever the cap in effect.
    EXPECT_EQ(term_bytes(phase(p, "bwd/L0/moe/dispatch/r0"), "round send buffers"), 256) << routing;
  }
}

TEST(PlannerTiny, RoutingFilePerLayerSeparatesLayers) {
  // Layer 0 balanced, layer 1: both sources send everything to rank 0's experts (0, 1).
  const std::string path = ::testing::TempDir() + "planner_routing.json";
  {
    std::FILE* f = std::fopen(path.c_str(), "w");
    ASSERT_NE(f, nullptr);
    std::fputs(R"({"flatpeak_routing": 1, "ep_ranks": 2, "num_experts": 4,
                 "layers": [[[1, 1, 1, 1], [1, 1, 1, 1]], [[1, 1, 0, 0], [1, 1, 0, 0]]]})", f);
    std::fclose(f);
  }
  const Plan p = plan_of(tiny_moe(), tiny_gpu(), with({{"--imbalance", "file=" + path}}));
  ASSERT_EQ(p.work.moe_loads.size(), 2u);
  EXPECT_EQ(p.work.moe_loads[0].recv_rows_ep, 32);
  EXPECT_EQ(p.work.moe_loads[1].recv_rows_ep, 64);  // top-2 of {0, 1}: every copy lands on rank 0
  // The layers no longer fold together: both appear, and the dispatch peak is layer 1's.
  EXPECT_TRUE(has_phase(p, "fwd/L0/moe/dispatch"));
  EXPECT_TRUE(has_phase(p, "fwd/L1/moe/dispatch"));
  EXPECT_EQ(term_bytes(phase(p, "fwd/L1/moe/dispatch"), "dispatch receive buffer"), 64 * 8 * 2);
  EXPECT_EQ(term_bytes(phase(p, "fwd/L0/moe/dispatch"), "dispatch receive buffer"), 32 * 8 * 2);
  EXPECT_EQ(p.summary.peak(PeakKind::Dispatch).phase.rfind("bwd/L1/", 0), 0u);
}

TEST(PlannerTiny, AccumulationKeepsGradsInForward) {
  const Plan one = plan_of(tiny_moe(), tiny_gpu(), kBase);
  const Plan acc = plan_of(tiny_moe(), tiny_gpu(), with({{"--global-batch", "4"}}));  // b*DP = 2 -> 2 steps
  EXPECT_EQ(acc.run.accumulation_steps(), 2);
  EXPECT_EQ(phase(one, "fwd/L1/attn").terms.bytes(Category::Grads), 0);
  EXPECT_EQ(phase(acc, "fwd/L1/attn").terms.bytes(Category::Grads), kShard * 4);
  EXPECT_EQ(phase(acc, "fwd/L1/attn").device_bytes(), phase(one, "fwd/L1/attn").device_bytes() + kShard * 4);
}

TEST(PlannerTiny, ContextParallelRingAttentionBuffers) {
  const Plan p = plan_of(tiny_moe(), tiny_gpu(), with({{"--cp", "2"}}));
  EXPECT_EQ(p.work.tokens, 8);
  // fwd ring: KV chunks 2 * 8 * 1*(4+4) * 2 = 256, output acc 8*8*4 = 256, lse acc 2*8*4 = 64.
  EXPECT_EQ(term_bytes(phase(p, "fwd/L1/attn"), "ring K,V chunks in flight"), 256);
  EXPECT_EQ(term_bytes(phase(p, "fwd/L1/attn"), "ring output accumulator"), 256);
  // bwd ring: travelling dK,dV 2 * 8 * 8 * 4 = 512.
  EXPECT_EQ(term_bytes(phase(p, "bwd/L0/attn"), "ring dK,dV travelling with the chunk"), 512);
  // A sliding window of 4 needs the previous rank's last 3 keys (its reach: the query's own key is the 4th).
  ModelSpec m = tiny_moe();
  m.layers[0].window = AttentionWindow::Sliding;
  m.layers[0].attention_window_tokens = 4;
  const Plan w = plan_of(m, tiny_gpu(), with({{"--cp", "2"}}));
  EXPECT_EQ(term_bytes(phase(w, "fwd/L0/attn"), "ring halo K,V (sliding window)"), 3 * 8 * 2);
  // Backward: the halo's dK,dV and the next rank's, received (fp32 each).
  EXPECT_EQ(term_bytes(phase(w, "bwd/L0/attn"), "ring halo dK,dV"), 3 * 8 * 4);
  EXPECT_EQ(term_bytes(phase(w, "bwd/L0/attn"), "ring halo dK,dV received (this rank's last keys)"), 3 * 8 * 4);
}

// What a window reaches across CP ranks (cp_key_reach): T = 8 tokens a rank at CP = 2, g·(d+dv) = 8.
TEST(PlannerTiny, ContextParallelWindowsReachWhatTheyNeed) {
  const auto plan_with = [](AttentionWindow kind, int64_t tokens, const char* cp) {
    ModelSpec m = tiny_moe();
    m.layers[0].window = kind;
    m.layers[0].attention_window_tokens = tokens;
    return plan_of(m, tiny_gpu(), with({{"--gpus", cp}, {"--cp", cp}}));
  };
  // A sliding window of 12 at CP = 4 (T = 4) reaches 11 keys back, past the previous rank: the
  // ring's buffers (K,V chunks 2 * 4 * 8 * 2), no halo. At CP = 2 the previous rank is all there is
  // before: a halo of its 8 rows.
  const Plan longer = plan_with(AttentionWindow::Sliding, 12, "4");
  EXPECT_EQ(term_bytes(phase(longer, "fwd/L0/attn"), "ring K,V chunks in flight"), 128);
  EXPECT_EQ(term_bytes(phase(plan_with(AttentionWindow::Sliding, 12, "2"), "fwd/L0/attn"), "ring halo K,V (sliding window)"), 8 * 8 * 2);
  EXPECT_THROW(term_bytes(phase(longer, "fwd/L0/attn"), "ring halo K,V (sliding window)"), std::runtime_error);
  // Chunks of 4 divide T: no keys move, no ring or halo term.
  const Plan aligned = plan_with(AttentionWindow::Chunked, 4, "2");
  for (const char* name : {"fwd/L0/attn", "bwd/L0/attn"})
    for (const auto& t : phase(aligned, name).terms.terms()) EXPECT_EQ(t.name.find("ring"), std::string::npos) << name << " " << t.name;
  // Chunks of 3: rank 1 starts 8 mod 3 = 2 tokens into its chunk, a halo of 2 rows.
  const Plan straddling = plan_with(AttentionWindow::Chunked, 3, "2");
  EXPECT_EQ(term_bytes(phase(straddling, "fwd/L0/attn"), "ring halo K,V (chunked window)"), 2 * 8 * 2);
  EXPECT_EQ(term_bytes(phase(straddling, "bwd/L0/attn"), "ring halo dK,dV"), 2 * 8 * 4);
  // Chunks of 16 > T at CP = 2: rank 1 starts 8 tokens in, the whole previous rank (a halo of T rows).
  EXPECT_EQ(term_bytes(phase(plan_with(AttentionWindow::Chunked, 16, "2"), "fwd/L0/attn"), "ring halo K,V (chunked window)"), 8 * 8 * 2);
  // Chunks of 24 at CP = 4 (T = 4): ranks start 4, 8 and 12 tokens in, past the previous rank: the
  // ring, its travelling dK,dV 2 * 4 * 8 * 4.
  EXPECT_EQ(term_bytes(phase(plan_with(AttentionWindow::Chunked, 24, "4"), "bwd/L0/attn"), "ring dK,dV travelling with the chunk"), 256);
}

TEST(CpKeyReach, FollowsWhereWindowsAndChunksFall) {
  EXPECT_TRUE(cp_key_reach(AttentionWindow::Full, 0, 64, 4).ring);
  EXPECT_TRUE(cp_key_reach(AttentionWindow::Sliding, 66, 64, 4).ring);   // reaches 65 keys back
  EXPECT_EQ(cp_key_reach(AttentionWindow::Sliding, 65, 64, 4).halo_rows, 64);
  EXPECT_FALSE(cp_key_reach(AttentionWindow::Sliding, 65, 64, 4).ring);
  EXPECT_EQ(cp_key_reach(AttentionWindow::Sliding, 128, 64, 1).halo_rows, 0);  // one rank: nothing to reach
  EXPECT_TRUE(cp_key_reach(AttentionWindow::Chunked, 192, 64, 3).ring);   // ranks start 64 and 128 in
  EXPECT_EQ(cp_key_reach(AttentionWindow::Chunked, 128, 64, 3).halo_rows, 64);  // 64, then 0
  EXPECT_EQ(cp_key_reach(AttentionWindow::Chunked, 192, 64, 2).halo_rows, 64);
  EXPECT_TRUE(cp_key_reach(AttentionWindow::Chunked, 131072, 512, 2048).ring);  // gcd 512: 130560 at most
  EXPECT_EQ(cp_key_reach(AttentionWindow::Chunked, 16, 64, 4).halo_rows, 0);
  EXPECT_EQ(cp_key_reach(AttentionWindow::Chunked, 20, 64, 2).halo_rows, 4);   // 64 mod 20
  EXPECT_EQ(cp_key_reach(AttentionWindow::Chunked, 20, 64, 3).halo_rows, 8);   // 128 mod 20
  EXPECT_EQ(cp_key_reach(AttentionWindow::Chunked, 20, 64, 64).halo_rows, 16);  // 64 r mod 20 for r = 1..4: 4, 8, 12, 16
  // Against the reach counted query by query: the most keys a rank's first query needs from before it.
  for (int64_t T = 1; T <= 12; ++T)
    for (int64_t w = 1; w <= 40; ++w)
      for (int64_t cp = 2; cp <= 9; ++cp) {
        int64_t sliding = 0, chunked = 0;
        for (int64_t r = 1; r < cp; ++r) {
          sliding = std::max(sliding, r * T - std::max<int64_t>(0, r * T - w + 1));
          chunked = std::max(chunked, r * T - r * T / w * w);
        }
        const CpKeyReach s = cp_key_reach(AttentionWindow::Sliding, w, T, cp), c = cp_key_reach(AttentionWindow::Chunked, w, T, cp);
        EXPECT_EQ(s.ring, sliding > T) << T << " " << w << " " << cp;
        EXPECT_EQ(c.ring, chunked > T) << T << " " << w << " " << cp;
        if (!s.ring) {
          EXPECT_EQ(s.halo_rows, sliding) << T << " " << w << " " << cp;
        }
        if (!c.ring) {
          EXPECT_EQ(c.halo_rows, chunked) << T << " " << w << " " << cp;
        }
      }
  // Llama 4's chunks of 8192 at 1M tokens on 8 ranks (T = 131072): aligned, nothing moves.
  EXPECT_EQ(cp_key_reach(AttentionWindow::Chunked, 8192, 131072, 8).halo_rows, 0);
  EXPECT_FALSE(cp_key_reach(AttentionWindow::Chunked, 8192, 131072, 8).ring);
}

TEST(PlannerTiny, MtpLayerWithItsOwnLoss) {
  ModelSpec m = tiny_moe();
  m.mtp_layers = 1;
  const Plan p = plan_of(m, tiny_gpu(), kBase);
  EXPECT_TRUE(p.run.mtp);
  EXPECT_TRUE(has_phase(p, "fwd/MTP0/attn"));
  EXPECT_TRUE(has_phase(p, "loss/mtp0/bwd"));
  // While the MTP loss runs backward (6816 with its lse and loss), the main loss keeps X, logits,
  // log-softmax, lse and loss (256+1024+2048+64+64).
  EXPECT_EQ(phase(p, "loss/mtp0/bwd").terms.bytes(Category::Vocab), 6816 + 3456);
  EXPECT_EQ(p.summary.peak(PeakKind::Vocab).phase, "loss/mtp0/bwd");
  const Plan off = plan_of(m, tiny_gpu(), with({{"--mtp", "off"}}));
  EXPECT_FALSE(has_phase(off, "loss/mtp0/bwd"));
}

// What the MTP schedule holds (planner/README.md "Multi-token prediction"), [T, H] bf16 = 16 x 8 x 2
// = 256 bytes: the module's backward keeps h_L (its hnorm's input) and receives the head's fp32
// reduce-scatter input [8 + 32 x 8] x 4 from its loss; eh_proj's input [T, 2H] lasts to the
// module's attn phase; the module's gradient of the shifted embedding waits for bwd/embed beside
// every decoder layer's backward, and d h_L waits for the main loss's backward.
TEST(PlannerTiny, MtpModuleHoldsWhatItsBackwardNeeds) {
  ModelSpec m = tiny_moe();
  m.mtp_layers = 1;
  const Plan p = plan_of(m, tiny_gpu(), kBase);
  const int64_t th = 16 * 8 * 2;
  for (const char* name : {"bwd/MTP0/recompute/attn", "bwd/MTP0/moe/experts", "bwd/MTP0/attn"})
    EXPECT_EQ(term_bytes(phase(p, name), "final hidden h_L"), th) << name;
  EXPECT_EQ(term_bytes(phase(p, "bwd/MTP0/moe/experts"), "reduce-scatter input head"), (8 + 32 * 8) * 4);
  EXPECT_EQ(term_bytes(phase(p, "bwd/MTP0/attn"), "MTP eh_proj input"), 2 * th);
  // The last module's backward makes the shifted embedding's gradient after eh_proj's backward,
  // so its attention moment does not hold it; its loss's head-norm gradient [H] waits through
  // the recompute for the module's grads.
  EXPECT_THROW(term_bytes(phase(p, "bwd/MTP0/attn"), "MTP d shifted embedding (for bwd/embed)"), std::runtime_error);
  EXPECT_EQ(term_bytes(phase(p, "bwd/MTP0/recompute/attn"), "MTP0 head norm grad (held for the module's grads)"), 8 * 2);
  EXPECT_THROW(term_bytes(phase(p, "bwd/MTP0/moe/experts"), "MTP0 head norm grad (held for the module's grads)"), std::runtime_error);
  EXPECT_EQ(term_bytes(phase(p, "loss/bwd"), "d loss input from the next MTP module"), th);
  for (const char* name : {"loss/bwd", "bwd/L1/recompute/attn", "bwd/L0/moe/experts", "bwd/L0/attn"})
    EXPECT_EQ(term_bytes(phase(p, name), "MTP d shifted embedding (for bwd/embed)"), th) << name;
  // The main loss's input comes from the last decoder layer: the head is prefetched there.
  EXPECT_EQ(term_bytes(phase(p, "fwd/L1/attn"), "prefetched params head"), (8 + 32 * 8) * 2);
}

// Every loss reduces the head's grads; with fp32 shards (optimizer on the GPU) on 2 GPUs the main
// loss's lands in the shard MTP0's loss made, through an fp32 output [ceil((8 + V x 8) / 2)] beside
// L1's gathered unit as its backward starts (V = 4096: that moment outweighs the recompute).
TEST(PlannerTiny, MtpHeadLandsAgainThroughAnOutput) {
  ModelSpec m = tiny_moe();
  m.vocab_size = 4096;
  m.mtp_layers = 1;
  const Plan p = plan_of(m, tiny_gpu(), with({{"--optimizer", "gpu"}}));
  EXPECT_EQ(term_bytes(phase(p, "bwd/L1/recompute/attn"), "reduce-scatter output head (fp32, added into its grad shard)"),
            (8 + 4096 * 8) / 2 * 4);
  const Plan off = plan_of(m, tiny_gpu(), with({{"--optimizer", "gpu"}, {"--mtp", "off"}}));
  EXPECT_THROW(term_bytes(phase(off, "bwd/L1/recompute/attn"), "reduce-scatter output head (fp32, added into its grad shard)"),
               std::runtime_error);
}

// With three modules a loss's saved state and its module's output h^j wait for the modules after
// it: module 2 runs beside the main loss's and MTP losses 0 and 1's saved sets and h^0, h^1.
TEST(PlannerTiny, MtpLossesWaitForTheModulesAfterThem) {
  ModelSpec m = tiny_moe();
  m.mtp_layers = 3;
  const Plan p = plan_of(m, tiny_gpu(), kBase);
  const int64_t th = 16 * 8 * 2;
  for (const char* name : {"fwd/MTP2/attn", "bwd/MTP2/attn"}) {
    EXPECT_EQ(term_bytes(phase(p, name), "MTP module outputs h^j (for later modules and their losses)"), 2 * th) << name;
    EXPECT_EQ(term_bytes(phase(p, name), "MTP1 loss lse (saved)"), 16 * 4) << name;
    EXPECT_EQ(term_bytes(phase(p, name), "main loss lse (saved)"), 16 * 4) << name;
    EXPECT_THROW(term_bytes(phase(p, name), "MTP2 loss lse (saved)"), std::runtime_error) << name;
  }
  // Loss 0's backward: h^0 and d h^0 from module 1, beside the main loss's saved set.
  EXPECT_EQ(term_bytes(phase(p, "loss/mtp0/bwd"), "MTP module outputs h^j (for later modules and their losses)"), th);
  EXPECT_EQ(term_bytes(phase(p, "loss/mtp0/bwd"), "d loss input from the next MTP module"), th);
  EXPECT_THROW(term_bytes(phase(p, "loss/mtp2/bwd"), "d loss input from the next MTP module"), std::runtime_error);
}

TEST(PlannerTiny, AllTechniquesTogetherLowerEveryComponentAtLength) {
  const auto flags = std::vector<std::pair<std::string, std::string>>{{"--gpus", "2"}, {"--context", "64K"}};
  const Plan base = plan_of(tiny_moe(4), tiny_gpu(), flags);
  auto fp_flags = flags;
  fp_flags.push_back({"--schedule", "flatpeak"});
  fp_flags.push_back({"--chunk-cap-rows", "4096"});
  fp_flags.push_back({"--sco-layers", "all"});
  const Plan fp = plan_of(tiny_moe(4), tiny_gpu(), fp_flags);
  for (PeakKind k : {PeakKind::Dispatch, PeakKind::Vocab, PeakKind::Checkpoint, PeakKind::Optimizer})
    EXPECT_LT(fp.summary.peak(k).component_bytes, base.summary.peak(k).component_bytes) << to_string(k);
  EXPECT_EQ(fp.baseline.gpu_peak_bytes, base.summary.gpu_peak_bytes);
}

TEST(PlannerTiny, FlatpeakScheduleByHand) {
  const Plan p = plan_of(tiny_moe(), tiny_gpu(),
                         with({{"--schedule", "flatpeak"}, {"--chunk-cap-rows", "8"}, {"--sco-layers", "all"}}));
  // OffloadStreamAdamW: bf16 param shards 884*2 on the GPU; grads bf16.
  EXPECT_EQ(phase(p, "opt/bucket0").device_bytes(), 884 * 2 + 884 * 2);
  // Ring-DTP (R = 2, rotate weights) backward block: bf16 params 1768, no grads reduced yet, final
  // hidden 256 (every boundary is on the host), prefetched L1 864, vocab 3968 (see RingDtpAlone).
  EXPECT_EQ(phase(p, "loss/bwd/blk0").device_bytes(), 1768 + 256 + 864 + 3968);
  // PipelinedLLEP forward round in the no-grad forward: bf16 params, L1 gathered 864, head
  // prefetched 264 (Ring-DTP gathers only the V/R shard: 528/2), x1 being copied 256; h1, norm-2 out 512; routing 1216 + round buffers 3968 +
  // round expert input, fc1, act 640 + round fc2 out, unpermuted 2*16*8*2 = 512 (B = 16, PipelinedLlepAlone)
  // + the foreign-weight pool 192.
  EXPECT_EQ(phase(p, "fwd/L1/moe/dispatch/r0").device_bytes(), 1768 + 864 + 264 + 256 + 512 + 1216 + 3968 + 640 + 512 + 192);
  // Host per GPU: 16 B per shard param + bucket staging 2*2*884*2 (bucket = min(64Mi, 884)) + 2
  // offloaded boundaries.
  EXPECT_EQ(p.summary.host_per_gpu_bytes, 16 * 884 + 2 * 2 * 884 * 2 + 2 * 256);
}

TEST(PlannerTiny, AlignmentRoundsEveryTensor) {
  HardwareSpec h = tiny_gpu();
  h.allocation_alignment_bytes = 512;
  const Plan p = plan_of(tiny_moe(), h, kBase);
  // lse [2, 16] fp32 = 128 B rounds to 512; rstd of both norms, one [2, 16] fp32 buffer (as the
  // executor's layer holds it), 128 B -> 512.
  EXPECT_EQ(term_bytes(phase(p, "bwd/L0/attn"), "saved lse"), 512);
  EXPECT_EQ(term_bytes(phase(p, "bwd/L0/attn"), "norm rstd (saved)"), 512);
}

}  // namespace
}  // namespace flatpeak::planner::test

namespace flatpeak::planner::test {

// A gated shared expert (Qwen2-MoE) keeps its ungated output [T, H] and its gate [T] for its
// backward: in every MoE recompute and backward phase, nowhere in the forward, and nothing else
// changes.
TEST(PlannerTiny, GatedSharedExpertSavesItsOutputAndGateForBackward) {
  ModelSpec plain = tiny_moe(2);
  plain.num_shared_experts = 1;
  plain.shared_expert_ffn_width = 8;
  ModelSpec gated = plain;
  gated.shared_expert_gate = true;
  const std::vector<std::pair<std::string, std::string>> flags{{"--gpus", "1"}, {"--context", "64"},
                                                               {"--schedule", "practice"}};
  const Plan a = plan_of(plain, tiny_gpu(), flags), b = plan_of(gated, tiny_gpu(), flags);
  ASSERT_EQ(a.timeline.phases.size(), b.timeline.phases.size());
  const int64_t saved = 64 * 8 * 2 + 64 * 2;  // bf16 [T, H] and [T]
  int64_t with_gate = 0;
  for (size_t i = 0; i < a.timeline.phases.size(); ++i) {
    const Phase &x = a.timeline.phases[i], &y = b.timeline.phases[i];
    ASSERT_EQ(x.name, y.name);
    const bool moe_backward = x.name.rfind("bwd/L", 0) == 0 && x.name.find("/moe/") != std::string::npos;
    const int64_t param_delta = y.terms.bytes(Space::Device) - x.terms.bytes(Space::Device) -
                                (moe_backward ? saved : 0);
    // The gate's H parameters a layer: params, grads and Adam state grow by a few bytes only.
    EXPECT_GE(param_delta, 0) << x.name;
    EXPECT_LT(param_delta, 2 * 8 * 64) << x.name;
    if (moe_backward) {
      EXPECT_EQ(term_bytes(y, "shared expert output, ungated (saved for its gate)"), 64 * 8 * 2) << y.name;
      EXPECT_EQ(term_bytes(y, "shared expert gate (saved)"), 64 * 2) << y.name;
      ++with_gate;
    }
  }
  EXPECT_GE(with_gate, 4);  // recompute and backward phases of the MoE block
}

}  // namespace flatpeak::planner::test
