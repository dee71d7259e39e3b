// The whole step with MTP modules on one rank (step_schedule.h, StepScheduleConfig::mtp): with
// the materialised loss the checkpointed step gives the naive step's losses, reduced grads and
// updated params bit for bit, x_0 offloaded or not, every optimizer placement; every module's
// parameters get a gradient; the phases follow planner/README.md's MTP order; what the step does
// not run with MTP is refused.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "executor/comm/threads_comm.h"
#include "executor/memory/tracking_allocator.h"
#include "executor/schedules/step_schedule.h"
#include "spec/model_loader.h"

namespace flatpeak::exec {
namespace {

// Qwen3-30B-A3B's layout at a tiny shape (H = 32, V = 300, L = 3, a = 4, g = 2, d = 8, E = 6,
// k = 2, F = 16) with `modules` MTP modules.
ModelSpec small_model(int64_t modules) {
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
  m.mtp_layers = modules;
  return m;
}

StepScheduleConfig config(int64_t modules, uint64_t seed = 1) {
  StepScheduleConfig c;
  c.model = small_model(modules);
  c.mtp = true;
  c.tokens = 40;
  c.seed = seed;
  c.loss.mode = VocabScheduleMode::Materialized;
  c.optimizer.placement = OptimizerPlacement::Device;
  return c;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

StepScheduleResult run(const StepScheduleConfig& c) {
  TrackingAllocator alloc({512, -1, -1});
  StepScheduleResult r = run_step_schedule(alloc, c);
  EXPECT_EQ(alloc.live_allocations(), 0);
  EXPECT_EQ(alloc.live_bytes(MemorySpace::Device), 0);
  EXPECT_EQ(alloc.live_bytes(MemorySpace::Host), 0);
  return r;
}

TEST(ExecutorStepMtp, UnitsHoldTheModules) {
  const ModelSpec m = small_model(2);
  const std::vector<int64_t> without = step_unit_params(m, false), with = step_unit_params(m, true);
  ASSERT_EQ(without.size(), 5u);
  ASSERT_EQ(with.size(), 7u);  // embedding, L0-L2, MTP0, MTP1, head
  // A module: its decoder layer (a MoE layer) + enorm, hnorm, eh_proj [32, 64], head norm.
  EXPECT_EQ(with[4], without[1] + 3 * 32 + 2 * 32 * 32);
  EXPECT_EQ(with[5], with[4]);
  EXPECT_EQ(with[6], without[4]);
  EXPECT_EQ(std::accumulate(with.begin(), with.end(), int64_t{0}), rank_shard_params(m, 1, 1, true));
}

// The same ops on the same values in the same order, whatever is recomputed or offloaded (x_0
// among them: each module fetches a copy for its shifted embedding input) and wherever the
// optimizer runs.
TEST(ExecutorStepMtp, CheckpointedStepIsBitwiseTheNaiveStep) {
  struct Case {
    std::vector<bool> offloaded;
    int64_t prefetch;
    OptimizerPlacement placement;
  };
  const Case cases[] = {{{}, 0, OptimizerPlacement::Device},
                        {{true, false, true}, 1, OptimizerPlacement::Serial},
                        {{true, true, true}, 2, OptimizerPlacement::Stream}};
  for (int64_t modules : {1, 2}) {
    StepScheduleConfig n = config(modules);
    n.naive = true;
    const StepScheduleResult ref = run(n);
    ASSERT_EQ(ref.mtp_losses.size(), static_cast<size_t>(modules));
    for (const Case& k : cases) {
      StepScheduleConfig c = config(modules);
      c.offloaded = k.offloaded;
      c.prefetch = k.prefetch;
      c.optimizer.placement = k.placement;
      c.optimizer.bucket_params = 9000;
      c.optimizer.bucket_depth = 2;
      const StepScheduleResult got = run(c);
      const std::string what = std::to_string(modules) + " modules, placement " + std::to_string(static_cast<int>(k.placement));
      EXPECT_EQ(got.loss, ref.loss) << what;
      EXPECT_EQ(got.mtp_losses, ref.mtp_losses) << what;
      // With the optimizer offloaded the grad shards are bf16 and the head's, reduced once per
      // loss, is rounded at each addition (the naive step's fp32 shard once, at the end): the head
      // is within that rounding, every other unit bitwise; on the device all of it bitwise.
      const size_t head_at = got.grads.size() - static_cast<size_t>(got.unit_params.back());
      if (k.placement == OptimizerPlacement::Device) {
        EXPECT_TRUE(same_bits(got.grads, ref.grads)) << what;
        EXPECT_TRUE(same_bits(got.params, ref.params)) << what;
      } else {
        const std::vector<float> body(got.grads.begin(), got.grads.begin() + static_cast<long>(head_at));
        EXPECT_TRUE(same_bits(body, std::vector<float>(ref.grads.begin(), ref.grads.begin() + static_cast<long>(head_at)))) << what;
        // M additions, each rounding a partial sum by at most 2^-9 of it (a partial sum may
        // exceed the final value where the losses' gradients cancel: bounded by the unit's largest).
        double largest = 0.0, worst = 0.0;
        int64_t rounded = 0;
        for (size_t i = head_at; i < got.grads.size(); ++i) {
          largest = std::max(largest, std::fabs(double(ref.grads[i])));
          worst = std::max(worst, std::fabs(double(got.grads[i]) - ref.grads[i]));
          rounded += got.grads[i] != ref.grads[i];
        }
        EXPECT_LE(worst, static_cast<double>(modules) * std::ldexp(largest, -8)) << what;
        EXPECT_GT(rounded, 0) << what;  // the additions do round
      }
      for (double l : got.mtp_losses) EXPECT_GT(l, 0.0) << what;
      // Every unit got a gradient; a module's own weights (its norms and eh_proj) too.
      size_t at = 0;
      for (size_t u = 0; u < got.unit_params.size(); ++u) {
        const int64_t n_u = got.unit_params[u];
        double norm = 0.0;
        for (int64_t i = 0; i < n_u; ++i) norm += std::fabs(got.grads[at + static_cast<size_t>(i)]);
        EXPECT_GT(norm, 0.0) << what << " unit " << u;
        if (u >= 4 && u < 4 + static_cast<size_t>(modules)) {
          const int64_t H = 32;
          for (int64_t part : {int64_t{0}, H, 2 * H, 2 * H + 2 * H * H}) {  // enorm, hnorm, eh_proj, head norm
            double p = 0.0;
            for (int64_t i = 0; i < H; ++i) p += std::fabs(got.grads[at + static_cast<size_t>(part + i)]);
            EXPECT_GT(p, 0.0) << what << " unit " << u << " part at " << part;
          }
        }
        at += static_cast<size_t>(n_u);
      }
    }
  }
}

// The blocked loss (online log-sum-exp, fp32 dW accumulator; W released after each deferred
// loss's forward and gathered again for its backward, or not read again with gradients in
// forward) against the naive materialised step, within the one-rank step's bounds
// (executor_schedule_step_test.cpp): every loss within twice the bf16 rounding of the largest
// logit, each unit's grads within 2^-5 of its largest.
TEST(ExecutorStepMtp, BlockedLossWithinStatedBounds) {
  for (bool in_forward : {false, true}) {
    StepScheduleConfig c = config(2);
    c.loss.mode = VocabScheduleMode::Blocked;
    c.loss.token_block_rows = 16;
    c.loss.vocab_block_rows = 128;
    c.loss.gradients_in_forward = in_forward;
    c.offloaded = {true, false, true};
    c.prefetch = 1;
    const StepScheduleResult got = run(c);
    StepScheduleConfig n = c;
    n.naive = true;
    const StepScheduleResult ref = run(n);
    const std::string what = in_forward ? "in-forward" : "recompute";
    const double loss_bound = 2.0 * 1.1 * std::sqrt(32.0) * std::ldexp(1.0, -9);
    EXPECT_LE(std::fabs(got.loss - ref.loss), loss_bound) << what;
    ASSERT_EQ(got.mtp_losses.size(), 2u);
    for (size_t j = 0; j < 2; ++j) EXPECT_LE(std::fabs(got.mtp_losses[j] - ref.mtp_losses[j]), loss_bound) << what << " module " << j;
    size_t at = 0;
    for (int64_t n_u : got.unit_params) {
      double diff = 0.0, largest = 0.0;
      for (int64_t i = 0; i < n_u; ++i) {
        const size_t k = at + static_cast<size_t>(i);
        diff = std::max(diff, std::fabs(double(got.grads[k]) - ref.grads[k]));
        largest = std::max(largest, std::fabs(double(ref.grads[k])));
      }
      EXPECT_LE(diff, std::ldexp(largest, -5)) << what << " unit at " << at;
      at += static_cast<size_t>(n_u);
    }
  }
}

TEST(ExecutorStepMtp, PhasesFollowTheMtpOrder) {
  StepScheduleConfig c = config(2);
  c.loss.mode = VocabScheduleMode::Blocked;
  c.loss.token_block_rows = 40;
  c.loss.vocab_block_rows = 300;
  const StepScheduleResult r = run(c);
  const std::vector<std::string> fwd_layer = {"attn", "moe/route", "moe/dispatch", "moe/experts", "moe/combine"};
  const std::vector<std::string> bwd_layer = {"recompute/attn", "recompute/moe/dispatch", "recompute/moe/experts",
                                              "recompute/moe/combine", "moe/combine", "moe/experts", "moe/dispatch", "attn"};
  std::vector<std::string> want = {"fwd/embed"};
  for (int l = 0; l < 3; ++l)
    for (const auto& p : fwd_layer) want.push_back("fwd/L" + std::to_string(l) + "/" + p);
  want.emplace_back("loss/fwd/blk0");
  for (int j = 0; j < 2; ++j) {
    want.push_back("fwd/MTP" + std::to_string(j) + "/attn");  // eh_proj, then the layer enters it again
    for (const auto& p : fwd_layer) want.push_back("fwd/MTP" + std::to_string(j) + "/" + p);
    want.push_back("loss/mtp" + std::to_string(j) + "/fwd/blk0");
  }
  for (int j = 1; j >= 0; --j) {
    want.push_back("loss/mtp" + std::to_string(j) + "/bwd/blk0");
    for (const auto& p : bwd_layer) want.push_back("bwd/MTP" + std::to_string(j) + "/" + p);
  }
  want.emplace_back("loss/bwd/blk0");
  for (int l = 2; l >= 0; --l)
    for (const auto& p : bwd_layer) want.push_back("bwd/L" + std::to_string(l) + "/" + p);
  want.emplace_back("bwd/embed");
  want.emplace_back("opt/step");
  EXPECT_EQ(r.phases, want);
}

// On 4 thread ranks (FSDP at EP = 1, every rank its own sequence) against the single-rank
// reference (the ranks' naive steps, grads summed in rank order, one AdamW): every rank's losses
// are its naive step's and every unit but the LM head is bitwise the reference's slice. The head
// is reduced once per loss, so its shard sums over the ranks loss by loss where the reference sums
// each rank's whole gradient: fp32 reassociation on the device (relative 2^-20 of the unit's
// largest), and with the optimizer offloaded (bf16 shards) a rounding per addition.
TEST(ExecutorStepMtp, RanksAreTheSingleRankReferenceTheHeadWithinRounding) {
  constexpr int kRanks = 4;
  for (OptimizerPlacement placement : {OptimizerPlacement::Device, OptimizerPlacement::Stream}) {
    StepScheduleConfig c = config(2);
    c.optimizer.placement = placement;
    c.optimizer.bucket_params = 5000;
    c.offloaded = {true, false, false};
    const StepReference ref = step_reference(c, kRanks);
    std::vector<StepScheduleResult> got(kRanks);
    const RunResult run = run_ranks(kRanks, [&](int rank, Communicator& comm) {
      TrackingAllocator alloc({512, -1, -1});
      got[static_cast<size_t>(rank)] = run_step_schedule(comm, alloc, c);
      EXPECT_EQ(alloc.live_allocations(), 0) << "rank " << rank;
    });
    ASSERT_TRUE(run.ok()) << run.message;
    const int64_t P = static_cast<int64_t>(ref.grads.size()), head_begin = P - ref.unit_params.back();
    double head_largest = 0.0;
    for (int64_t j = head_begin; j < P; ++j) head_largest = std::max(head_largest, std::fabs(double(ref.grads[static_cast<size_t>(j)])));
    const double head_bound = placement == OptimizerPlacement::Device ? std::ldexp(head_largest, -20) : 2.0 * std::ldexp(head_largest, -8);
    const std::string what = placement == OptimizerPlacement::Device ? "device" : "stream";
    for (int r = 0; r < kRanks; ++r) {
      const StepScheduleResult& g = got[static_cast<size_t>(r)];
      EXPECT_EQ(g.loss, ref.losses[static_cast<size_t>(r)]) << what << " rank " << r;
      ASSERT_EQ(g.mtp_losses.size(), 2u);
      size_t i = 0;
      double head_worst = 0.0;
      for (const ParamPiece& piece : g.reference_pieces)
        for (int64_t e = 0; e < piece.count; ++e, ++i) {
          const int64_t j = piece.begin + e;
          const float want = ref.grads[static_cast<size_t>(j)];
          if (j >= head_begin) head_worst = std::max(head_worst, std::fabs(double(g.grads[i]) - want));
          else EXPECT_EQ(std::memcmp(&g.grads[i], &want, sizeof want), 0) << what << " rank " << r << " element " << j;
        }
      EXPECT_LE(head_worst, head_bound) << what << " rank " << r;
    }
  }
}

TEST(ExecutorStepMtp, RefusesWhatItCannotRun) {
  TrackingAllocator alloc({512, -1, -1});
  StepScheduleConfig none = config(1);
  none.model.mtp_layers = 0;
  EXPECT_THROW(run_step_schedule(alloc, none), std::invalid_argument);
  StepScheduleConfig layer_norm = config(1);
  layer_norm.model.norm_bias = true;
  EXPECT_THROW(run_step_schedule(alloc, layer_norm), std::invalid_argument);
}

}  // namespace
}  // namespace flatpeak::exec
