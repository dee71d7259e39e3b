// The whole step on 4 thread ranks (step_schedule.h with a Communicator, FSDP at EP = 1): each rank
// runs its own sequence; with the materialised loss every rank's loss is the naive step's of its
// sequence and its reduced grad shard and updated params are bitwise the matching slice of the
// single-rank reference (naive steps of the 4 sequences, grads summed in rank order, one AdamW),
// for each optimizer placement and offloaded set; with the blocked loss within the one-rank
// bounds; the FSDP, grad-shard and param bytes of chosen phases are the hand-derived N-rank sums.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <numeric>
#include <string>
#include <vector>

#include "executor/comm/threads_comm.h"
#include "executor/memory/tracking_allocator.h"
#include "executor/schedules/step_schedule.h"
#include "spec/model_loader.h"

namespace flatpeak::exec {
namespace {

constexpr int kRanks = 4;

// The one-rank test's shape (executor_schedule_step_test.cpp): Qwen3-30B-A3B's layout at H = 32,
// V = 300, L = 3, E = 6 (every rank holds every expert: EP = 1), k = 2, F = 16.
StepScheduleConfig config(uint64_t seed = 1) {
  StepScheduleConfig c;
  c.model = load_model("Qwen3-30B-A3B");
  c.model.hidden_size = 32;
  c.model.vocab_size = 300;
  c.model.num_layers = 3;
  c.model.layers.resize(3);
  c.model.num_heads = 4;
  c.model.num_kv_heads = 2;
  c.model.head_dim = 8;
  c.model.v_head_dim = 8;
  c.model.num_experts = 6;
  c.model.top_k = 2;
  c.model.expert_ffn_width = 16;
  c.tokens = 48;
  c.seed = seed;
  c.loss.mode = VocabScheduleMode::Materialized;
  c.optimizer.placement = OptimizerPlacement::Device;
  return c;
}

bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0; }

// Every rank's result (and allocator records when asked), run on 4 thread ranks.
std::vector<StepScheduleResult> run_on_ranks(const StepScheduleConfig& c, std::vector<std::vector<PhaseRecord>>* records = nullptr,
                                             int64_t alignment = 512) {
  std::vector<StepScheduleResult> out(kRanks);
  if (records) records->assign(kRanks, {});
  const RunResult r = run_ranks(kRanks, [&](int rank, Communicator& comm) {
    TrackingAllocator alloc({alignment, -1, -1});
    out[static_cast<size_t>(rank)] = run_step_schedule(comm, alloc, c);
    EXPECT_EQ(alloc.live_allocations(), 0) << "rank " << rank;
    if (records) (*records)[static_cast<size_t>(rank)] = alloc.phase_records();
  });
  EXPECT_TRUE(r.ok()) << r.message;
  return out;
}

// The rank's shard against the reference's slice of each unit: the largest |difference| of the
// grads and of the params (0 and `bitwise` checked when asked).
struct SliceDiff {
  double grad = 0.0, param = 0.0;
  bool bitwise = true;
};
// `only` (when set) picks the reference elements compared.
template <class Pick = bool (*)(int64_t)>
SliceDiff compare_slices(const StepScheduleResult& got, const StepReference& ref, Pick only = [](int64_t) { return true; }) {
  SliceDiff d;
  size_t i = 0;
  for (const ParamPiece& piece : got.reference_pieces)
    for (int64_t e = 0; e < piece.count; ++e, ++i) {
      const int64_t j = piece.begin + e;
      if (!only(j)) continue;
      const size_t k = static_cast<size_t>(j);
      d.grad = std::max(d.grad, std::fabs(double(got.grads[i]) - ref.grads[k]));
      d.param = std::max(d.param, std::fabs(double(got.params[i]) - ref.params[k]));
      d.bitwise = d.bitwise && same_bits(got.grads[i], ref.grads[k]) && same_bits(got.params[i], ref.params[k]);
    }
  EXPECT_EQ(i, got.grads.size());
  return d;
}

TEST(ExecutorStepRanks, EachRankHoldsItsSliceOfEveryUnit) {
  const StepScheduleConfig c = config();
  const std::vector<StepScheduleResult> got = run_on_ranks(c);
  const std::vector<int64_t> units = step_unit_params(c.model);  // 9600, 12560 (x3), 9632
  for (int r = 0; r < kRanks; ++r) {
    const StepScheduleResult& g = got[static_cast<size_t>(r)];
    ASSERT_EQ(g.unit_params, units);
    for (size_t u = 0; u < units.size(); ++u) {
      const int64_t S = (units[u] + kRanks - 1) / kRanks;
      EXPECT_EQ(g.shard_begin[u], std::min<int64_t>(units[u], r * S)) << "rank " << r << " unit " << u;
      EXPECT_EQ(g.shard_params[u], std::min<int64_t>(units[u], (r + 1) * S) - g.shard_begin[u]);
    }
    const int64_t P = std::accumulate(g.shard_params.begin(), g.shard_params.end(), int64_t{0});
    EXPECT_EQ(static_cast<int64_t>(g.grads.size()), P);
    EXPECT_EQ(static_cast<int64_t>(g.params.size()), P);
  }
  // Different sequences: different losses.
  EXPECT_NE(got[0].loss, got[1].loss);
  EXPECT_NE(got[2].loss, got[3].loss);
}

// Materialised loss: the same ops on the same values in the same order on every rank as in its
// naive step, and the reduce-scatter sums the widened bf16 grads in rank order as the reference
// does, so loss, grad shards and updated params are bitwise.
TEST(ExecutorStepRanks, BitwiseTheSingleRankReference) {
  struct Case {
    std::vector<bool> offloaded;
    int64_t prefetch;
    OptimizerPlacement placement;
  };
  const Case cases[] = {{{}, 0, OptimizerPlacement::Device},
                        {{true, false, true}, 1, OptimizerPlacement::Serial},
                        {{true, true, true}, 2, OptimizerPlacement::Stream}};
  for (const Case& k : cases) {
    StepScheduleConfig c = config();
    c.offloaded = k.offloaded;
    c.prefetch = k.prefetch;
    c.optimizer.placement = k.placement;
    c.optimizer.bucket_params = 3000;
    const StepReference ref = step_reference(c, kRanks);  // offloaded: the sums rounded to bf16 grad shards
    ASSERT_EQ(ref.losses.size(), static_cast<size_t>(kRanks));
    const std::vector<StepScheduleResult> got = run_on_ranks(c);
    for (int r = 0; r < kRanks; ++r) {
      const std::string what = "placement " + std::to_string(static_cast<int>(k.placement)) + " rank " + std::to_string(r);
      const StepScheduleResult& g = got[static_cast<size_t>(r)];
      EXPECT_EQ(g.loss, ref.losses[static_cast<size_t>(r)]) << what;
      const SliceDiff d = compare_slices(g, ref);
      EXPECT_TRUE(d.bitwise) << what << ": max |dgrad| " << d.grad << ", max |dparam| " << d.param;
    }
  }
  // The reference is not one rank's step: the summed grads differ from rank 0's own.
  const StepReference ref = step_reference(config(), kRanks), one = step_reference(config(), 1);
  double differ = 0.0;
  for (size_t i = 0; i < one.grads.size(); ++i) differ = std::max(differ, std::fabs(double(one.grads[i]) - ref.grads[i]));
  EXPECT_GT(differ, 0.0);
}

// Blocked loss (fp32 dW accumulator reduced in place as an [N·S] input): the one-rank bounds
// (executor_schedule_step_test.cpp, BlockedLossWithinStatedBounds) per rank, the grad bound
// doubled for the sum of 4 ranks' differences (measured well inside).
TEST(ExecutorStepRanks, BlockedLossWithinStatedBounds) {
  StepScheduleConfig c = config(3);
  c.loss.mode = VocabScheduleMode::Blocked;
  c.loss.token_block_rows = 16;
  c.loss.vocab_block_rows = 128;
  c.offloaded = {false, true, false};
  c.prefetch = 1;
  c.optimizer.placement = OptimizerPlacement::Stream;
  c.optimizer.bucket_params = 5000;
  const StepReference ref = step_reference(c, kRanks);
  const std::vector<StepScheduleResult> got = run_on_ranks(c);
  double largest_grad = 0.0, largest_param = 0.0;
  for (float g : ref.grads) largest_grad = std::max(largest_grad, std::fabs(double(g)));
  for (float p : ref.params) largest_param = std::max(largest_param, std::fabs(double(p)));
  for (int r = 0; r < kRanks; ++r) {
    const StepScheduleResult& g = got[static_cast<size_t>(r)];
    EXPECT_LE(std::fabs(g.loss - ref.losses[static_cast<size_t>(r)]), 2.0 * 1.1 * std::sqrt(32.0) * std::ldexp(1.0, -9)) << r;
    const SliceDiff d = compare_slices(g, ref);
    EXPECT_LE(d.grad, std::ldexp(largest_grad, -4)) << r;
    EXPECT_LE(d.param, 2.0 * c.optimizer.lr * (1.0 + c.optimizer.weight_decay * largest_param) + 1e-6) << r;
  }
}

// Alignment 1. U: embedding 9600, layer 12560, head 9632; S = U/4 (each divides by 4): 2400, 3140,
// 2408. Gathered buffers stay [U]; reduce-scatter inputs are [4·S] fp32 = [U]; grad shards [S].
TEST(ExecutorStepRanks, FsdpGradAndParamBytesAreHandDerived) {
  StepScheduleConfig c = config();
  std::vector<std::vector<PhaseRecord>> records;
  run_on_ranks(c, &records, 1);
  const int64_t Ue = 9600, Ul = 12560, Uh = 9632, Se = Ue / 4, Sl = Ul / 4, Sh = Uh / 4;
  for (int r = 0; r < kRanks; ++r) {
    auto col = [&](const std::string& phase, Category cat) {
      for (const auto& rec : records[static_cast<size_t>(r)])
        if (rec.phase == phase && rec.space == MemorySpace::Device) return rec.bytes_at_peak[static_cast<size_t>(cat)];
      return int64_t{-1};
    };
    const std::string what = "rank " + std::to_string(r);
    EXPECT_EQ(col("fwd/embed", Category::Fsdp), 2 * Ue + 2 * Ul) << what;
    EXPECT_EQ(col("fwd/L2/moe/combine", Category::Fsdp), 2 * Ul + 2 * Uh) << what;
    // L1, L0 prefetched, L1's unsharded grads, L2's fp32 input in flight; the head's and L2's shards.
    EXPECT_EQ(col("bwd/L1/moe/experts", Category::Fsdp), 3 * 2 * Ul + 4 * Ul) << what;
    EXPECT_EQ(col("bwd/L1/moe/experts", Category::Grads), 4 * (Sh + Sl)) << what;
    EXPECT_EQ(col("bwd/L1/moe/experts", Category::Comm), 0) << what;  // fp32 shards land in place
    const int64_t P = Se + 3 * Sl + Sh;
    EXPECT_EQ(col("opt/step", Category::Grads), 4 * P) << what;
    EXPECT_EQ(col("opt/step", Category::Params) + col("opt/step", Category::Optimizer), 12 * P) << what;
  }
}

// EP = 4 on 4 ranks (E = 8: two experts a rank, held whole; the dense weights sharded), and EP = 2
// (two EP groups of 2 ranks; each rank's 4 experts sharded over the 2 replicas that hold them):
// every MoE layer's dispatch and combine cross the ranks of its EP group. Against the reference (each rank's naive step with
// all 8 experts): the loss and every grad but the experts' are bitwise (each row's arithmetic is
// the one-rank layer's); an expert's weight grads sum every source's rows in one GEMM, rounded to
// bf16 once instead of once per rank, so they differ by bf16 rounding of the partial sums: within
// 2^-6 of the largest expert grad (the sum of 4 ranks' roundings, each ≤ 2^-9 relative, with room);
// params within 2·lr (AdamW's first step moves by lr·g/(|g| + eps)). The last case adds a gated
// shared expert (Qwen2-MoE): its part of d norm-2 output is summed first on every path, so the
// dense grads stay bitwise at EP > 1 too. One case gives the experts biases (gpt-oss): each
// rank's b_expert [E/EP, 2F + H] is part of its experts, held to the same bounds.
TEST(ExecutorStepRanks, ExpertsSplitOverTheRanks) {
  struct Case {
    int64_t ep;
    OptimizerPlacement placement;
    bool gated_shared = false;
    bool expert_bias = false;
  };
  for (const Case k : {Case{kRanks, OptimizerPlacement::Device}, Case{kRanks, OptimizerPlacement::Stream}, Case{2, OptimizerPlacement::Device},
                       Case{2, OptimizerPlacement::Serial}, Case{kRanks, OptimizerPlacement::Device, true},
                       Case{kRanks, OptimizerPlacement::Device, false, true}}) {
    const OptimizerPlacement placement = k.placement;
    StepScheduleConfig c = config(5);
    if (k.gated_shared) {
      c.model.num_shared_experts = 1;
      c.model.shared_expert_ffn_width = 12;
      c.model.shared_expert_gate = true;
    }
    c.model.num_experts = 8;
    c.model.expert_bias = k.expert_bias;
    c.ep = k.ep;
    c.offloaded = {true, false, false};
    c.prefetch = 1;
    c.optimizer.placement = placement;
    c.optimizer.bucket_params = 3000;
    const StepReference ref = step_reference(c, kRanks);
    const std::vector<StepScheduleResult> got = run_on_ranks(c);
    // Where the experts' weights lie in the reference's [P]: each layer unit's w_gate_up, w_down.
    LayerScheduleConfig lc;
    lc.hidden = 32, lc.q_heads = 4, lc.kv_heads = 2, lc.head_dim = 8, lc.experts = 8, lc.expert_ffn = 16;
    lc.expert_bias = k.expert_bias;  // b_expert after w_down
    std::vector<std::pair<int64_t, int64_t>> expert_ranges;
    const std::vector<int64_t> units = step_unit_params(c.model);
    int64_t unit_at = units[0];
    for (int64_t l = 0; l < 3; ++l) {
      int64_t at = unit_at;
      for (const LayerWeightShape& w : layer_weight_shapes(lc)) {
        if (is_expert_weight(w.name)) expert_ranges.emplace_back(at, at + w.numel());
        at += w.numel();
      }
      unit_at += units[static_cast<size_t>(l + 1)];
    }
    auto is_expert = [&](int64_t j) {
      for (const auto& [lo, hi] : expert_ranges)
        if (j >= lo && j < hi) return true;
      return false;
    };
    double largest_expert_grad = 0.0;
    for (const auto& [lo, hi] : expert_ranges)
      for (int64_t j = lo; j < hi; ++j) largest_expert_grad = std::max(largest_expert_grad, std::fabs(double(ref.grads[static_cast<size_t>(j)])));
    int64_t held = 0;
    double largest_seen = 0.0;
    for (int r = 0; r < kRanks; ++r) {
      const std::string what = "EP " + std::to_string(k.ep) + " placement " + std::to_string(static_cast<int>(placement)) +
                               (k.gated_shared ? " gated shared expert" : "") + (k.expert_bias ? " expert biases" : "") +
                               " rank " + std::to_string(r);
      const StepScheduleResult& g = got[static_cast<size_t>(r)];
      EXPECT_EQ(g.loss, ref.losses[static_cast<size_t>(r)]) << what;
      const SliceDiff dense = compare_slices(g, ref, [&](int64_t j) { return !is_expert(j); });
      EXPECT_TRUE(dense.bitwise) << what << ": max |dgrad| " << dense.grad << ", max |dparam| " << dense.param;
      const SliceDiff experts = compare_slices(g, ref, is_expert);
      EXPECT_LE(experts.grad, std::ldexp(largest_expert_grad, -6)) << what;
      EXPECT_LE(experts.param, 2.0 * c.optimizer.lr + 1e-6) << what;
      largest_seen = std::max(largest_seen, experts.grad);
      ASSERT_EQ(g.expert_counts.size(), 3u);
      for (const auto& layer : g.expert_counts)  // T·k copies over all 8 experts
        EXPECT_EQ(std::accumulate(layer.begin(), layer.end(), int64_t{0}), c.tokens * c.model.top_k) << what;
      held += static_cast<int64_t>(g.grads.size());
    }
    // The ranks' shards cover the reference's [P] once; the experts' grads really are summed
    // differently (one GEMM over every source's rows).
    EXPECT_EQ(held, static_cast<int64_t>(ref.grads.size()));
    EXPECT_GT(largest_seen, 0.0);
    std::printf("EP = %d, placement %d: max |expert dgrad| %.3g (largest expert grad %.3g)\n", static_cast<int>(k.ep),
                static_cast<int>(placement), largest_seen, largest_expert_grad);
  }
}

// CP > 1: every layer's attention a ring within CP groups of consecutive ranks (the reference's
// naive steps of a group run together on a ring of their own). Materialised loss at EP = 1: the
// loss, grad shards and updated params bitwise the reference's on every rank, at CP = 2 and 4, with
// one sliding-window layer (its halo from the previous rank) and one chunked layer (Llama 4's;
// chunks of 20 over T = 48: halos of 8 rows at CP = 2, 16 at CP = 4);
// ring attention really couples the ranks (a later rank's loss differs from its CP = 1 one, the
// first rank's of each group does not: it attends to its own chunk alone).
TEST(ExecutorStepRanks, RingAttentionWithinCpGroups) {
  StepScheduleConfig windowed = config();
  windowed.model.layers[1].window = AttentionWindow::Sliding;  // gpt-oss's local layers: a halo, not the ring
  windowed.model.layers[1].attention_window_tokens = 10;
  windowed.model.layers[2].window = AttentionWindow::Chunked;
  windowed.model.layers[2].attention_window_tokens = 20;
  const StepReference flat = step_reference(windowed, kRanks);
  for (int64_t cp : {2, 4}) {
    StepScheduleConfig c = windowed;
    c.cp = cp;
    c.offloaded = {true, false, true};
    c.prefetch = 1;
    c.optimizer.placement = OptimizerPlacement::Serial;
    const StepReference ref = step_reference(c, kRanks);
    const std::vector<StepScheduleResult> got = run_on_ranks(c);
    for (int r = 0; r < kRanks; ++r) {
      const std::string what = "CP " + std::to_string(cp) + " rank " + std::to_string(r);
      const StepScheduleResult& g = got[static_cast<size_t>(r)];
      EXPECT_EQ(g.loss, ref.losses[static_cast<size_t>(r)]) << what;
      const SliceDiff d = compare_slices(g, ref);
      EXPECT_TRUE(d.bitwise) << what << ": max |dgrad| " << d.grad << ", max |dparam| " << d.param;
      if (r % cp == 0) EXPECT_EQ(ref.losses[static_cast<size_t>(r)], flat.losses[static_cast<size_t>(r)]) << what;
      else EXPECT_NE(ref.losses[static_cast<size_t>(r)], flat.losses[static_cast<size_t>(r)]) << what;
    }
  }
}

// The ring beside EP = N (the dispatch crossing every rank, attention within CP pairs): each rank's
// loss is the reference's; grads within the experts' rounding bound of ExpertsSplitOverTheRanks,
// here over every element (2^-6 of the largest grad).
TEST(ExecutorStepRanks, RingAttentionBesideExpertParallelism) {
  StepScheduleConfig c = config(3);
  c.model.num_experts = 8;
  c.ep = kRanks;
  c.cp = 2;
  const StepReference ref = step_reference(c, kRanks);
  const std::vector<StepScheduleResult> got = run_on_ranks(c);
  double largest = 0.0;
  for (float g : ref.grads) largest = std::max(largest, std::fabs(double(g)));
  for (int r = 0; r < kRanks; ++r) {
    const StepScheduleResult& g = got[static_cast<size_t>(r)];
    EXPECT_EQ(g.loss, ref.losses[static_cast<size_t>(r)]) << "rank " << r;
    const SliceDiff d = compare_slices(g, ref);
    EXPECT_LE(d.grad, std::ldexp(largest, -6)) << "rank " << r;
    EXPECT_LE(d.param, 2.0 * c.optimizer.lr + 1e-6) << "rank " << r;
  }
}

// The reference's layout and a rank's meet: the pieces of the 4 ranks tile [P] exactly.
TEST(ExecutorStepRanks, RankPiecesTileTheReference) {
  StepScheduleConfig c = config();
  c.model.num_experts = 8;
  for (const int64_t ep : {int64_t{1}, int64_t{2}, int64_t{kRanks}}) {
    c.ep = ep;
    const std::vector<int64_t> units = step_unit_params(c.model);
    std::vector<int> covered(static_cast<size_t>(std::accumulate(units.begin(), units.end(), int64_t{0})));
    for (int r = 0; r < kRanks; ++r)
      for (const ParamPiece& p : step_rank_pieces(c, kRanks, r))
        for (int64_t j = p.begin; j < p.begin + p.count; ++j) ++covered[static_cast<size_t>(j)];
    EXPECT_TRUE(std::all_of(covered.begin(), covered.end(), [](int n) { return n == 1; })) << "ep " << ep;
  }
  c.ep = 3;  // EP must divide N
  EXPECT_THROW(step_rank_pieces(c, kRanks, 0), std::invalid_argument);
}

}  // namespace
}  // namespace flatpeak::exec
