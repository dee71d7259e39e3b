// Multi-rank verify with thread ranks: scaling to --max-ranks, the merge of per-rank reports,
// report transport, failure naming the rank, and the dispatch component on EP = 4 ranks (uncapped
// EP, LLEP and PipelinedLLEP under rho=1, 2.5, 4 and hot-expert routing) against the planner.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "executor/comm/threads_comm.h"
#include "plan.h"
#include "run_spec.h"
#include "spec/errors.h"
#include "spec/hardware_loader.h"
#include "spec/model_loader.h"
#include "verify_common.h"
#include "verify_config.h"
#include "verify_ranks.h"
#include "verify_run.h"

namespace flatpeak::cli {
namespace {

// A plan as `flatpeak plan --format json` writes it (library defaults for the knobs not given).
nlohmann::json make_plan_json(const std::vector<std::pair<std::string, std::string>>& flags) {
  const ModelSpec model = load_model("Qwen3-30B-A3B");
  const HardwareSpec hardware = load_hardware("H200");
  InputErrors errs;
  const planner::RunSpec spec = planner::parse_run_flags(flags, errs);
  errs.throw_if_any();
  return nlohmann::json::parse(planner::plan_to_json(planner::make_plan(model, hardware, spec)).dump());
}

VerifyInputs inputs_of(const std::vector<std::pair<std::string, std::string>>& flags) {
  return read_plan_inputs(make_plan_json(flags), "plan.json");
}

TEST(VerifyRanksScale, KeepsEPDividingRanksAndShrinksAboveMaxRanks) {
  const VerifyInputs in = inputs_of({{"--gpus", "16"}, {"--ep", "8"}, {"--context", "16K"}});
  ScaledConfig s = scale_config(in, std::nullopt, 8);
  // N/EP = 2 is kept: EP 8 -> 4, N 16 -> 8, E 128 -> 64 (E/EP = 16 kept).
  EXPECT_EQ(s.ranks, 8);
  EXPECT_EQ(s.ep, 4);
  EXPECT_EQ(s.num_experts, 64);
  s = scale_config(in, std::nullopt, 16);
  EXPECT_EQ(s.ranks, 16);
  EXPECT_EQ(s.ep, 8);
  EXPECT_EQ(s.num_experts, 128);
  s = scale_config(in, std::nullopt, 3);  // 3 / 2 = 1 EP rank, 2 ranks
  EXPECT_EQ(s.ranks, 2);
  EXPECT_EQ(s.ep, 1);
  EXPECT_EQ(s.num_experts, 16);
  try {
    scale_config(in, std::nullopt, 1);
    FAIL() << "N/EP = 2 does not fit one rank";
  } catch (const InputError& e) {
    ASSERT_EQ(e.diagnostics().size(), 1u);
    EXPECT_EQ(e.diagnostics()[0].pointer, "--max-ranks");
  }
}

TEST(VerifyRanksMerge, KeepsTheLargestMeasurementWithItsRankAndPrediction) {
  std::vector<VerifyReport> per_rank(3);
  per_rank[0].rows = {{"dispatch", "device", "bwd/L3/moe/dispatch/r0", 100, 90, -0.1, 0}, {"dispatch", "device", "peak", 100, 90, -0.1, 0}};
  per_rank[1].rows = {{"dispatch", "device", "bwd/L3/moe/dispatch/r0", 120, 130, 1.0 / 12, 1}, {"dispatch", "device", "peak", 120, 130, 1.0 / 12, 1}};
  per_rank[2].rows = {{"dispatch", "device", "bwd/L3/moe/dispatch/r0", 110, 130, 2.0 / 11, 2}, {"dispatch", "device", "peak", 110, 90, -2.0 / 11, 2}};
  per_rank[2].max_abs_dloss = 3e-6;
  per_rank[1].max_abs_dgrad = 2e-5;
  const VerifyReport m = merge_rank_reports(per_rank);
  ASSERT_EQ(m.rows.size(), 2u);
  EXPECT_EQ(m.rows[0].rank, 1);  // 130 on ranks 1 and 2: the lower rank keeps the tie
  EXPECT_EQ(m.rows[0].predicted_bytes, 120);
  EXPECT_EQ(m.rows[1].measured_bytes, 130);
  EXPECT_EQ(m.max_abs_dloss, 3e-6);
  EXPECT_EQ(m.max_abs_dgrad, 2e-5);
}

TEST(VerifyRanksTransport, GathersEveryRanksReportBitExact) {
  std::vector<std::vector<VerifyReport>> got(3);
  const exec::RunResult run = exec::run_ranks(3, [&](int rank, exec::Communicator& comm) {
    VerifyReport mine;
    for (int i = 0; i <= rank * 40; ++i)  // reports of different lengths
      mine.rows.push_back({"vocab", "device", "loss/fwd/blk" + std::to_string(i), 1000 + i, 1000 + rank, 0.0, rank});
    mine.max_abs_dloss = 0.1 * (rank + 1);
    got[static_cast<size_t>(rank)] = gather_reports(comm, mine);
  });
  ASSERT_TRUE(run.ok()) << run.message;
  for (const auto& all : got) {
    ASSERT_EQ(all.size(), 3u);
    for (int p = 0; p < 3; ++p) {
      ASSERT_EQ(all[static_cast<size_t>(p)].rows.size(), static_cast<size_t>(p * 40 + 1));
      EXPECT_EQ(all[static_cast<size_t>(p)].rows.back().measured_bytes, 1000 + p);
      EXPECT_EQ(all[static_cast<size_t>(p)].max_abs_dloss, 0.1 * (p + 1));
    }
  }
}

void failing_component(const VerifyContext& ctx, VerifyReport&) {
  if (ctx.comm->rank() == 2) throw InputError(Diagnostic{"plan.json", "/knobs/chunk_cap_rows/value", "bad on this rank", ""});
  ctx.comm->barrier();
}

TEST(VerifyRanksFailure, NamesTheFailingRankWithItsExitCode) {
  const VerifyInputs in = inputs_of({{"--gpus", "4"}, {"--ep", "4"}, {"--context", "16K"}});
  const ScaledConfig s = scale_config(in, std::nullopt, 8);
  try {
    run_component_on_ranks(failing_component, in, s, nullptr, 4, nullptr);
    FAIL() << "rank 2 failed";
  } catch (const exec::RankFailed& e) {
    EXPECT_EQ(e.failing_rank, 2);
    EXPECT_EQ(e.exit_code, 2);
    EXPECT_NE(e.reason.find("bad on this rank"), std::string::npos) << e.reason;
  }
}

struct DispatchCase {
  const char* schedule;  // "uncapped" (baseline), "llep" (flatpeak, no cap), "pipelined" (flatpeak)
  const char* imbalance;
};

class VerifyDispatchRanks : public ::testing::TestWithParam<DispatchCase> {};

// A Qwen3-30B-A3B plan on 4 × H200 with --ep 4 at 64K, verified as `flatpeak verify --scale auto
// --component dispatch` does (T = 512, H = 64, F = 24, E = 128, k = 8, C 32768 -> 256, m 8).
VerifyReport run_dispatch(const std::string& schedule, const char* imbalance) {
  std::vector<std::pair<std::string, std::string>> flags{
      {"--gpus", "4"}, {"--ep", "4"}, {"--context", "64K"}, {"--imbalance", imbalance},
      {"--schedule", schedule == "uncapped" ? "baseline" : "flatpeak"}};
  if (schedule == "llep") flags.emplace_back("--chunk-cap-rows", "0");
  const VerifyInputs in = inputs_of(flags);
  const ScaledConfig s = scale_config(in, std::nullopt, 8);
  EXPECT_EQ(s.ranks, 4);  // --scale auto runs the plan's 4 ranks
  EXPECT_EQ(s.ep, 4);
  VerifyReport r = run_component_on_ranks(verify_dispatch_ranks, in, s, nullptr, 4, nullptr);
  for (const auto& note : r.notes) std::printf("%s\n", note.c_str());
  for (const auto& row : r.rows)
    std::printf("%s %s rank %d predicted %lld measured %lld rel %+.4f\n", row.component.c_str(), row.phase.c_str(), row.rank,
                static_cast<long long>(row.predicted_bytes), static_cast<long long>(row.measured_bytes), row.relative_error);
  return r;
}

const VerifyRow& row_named(const VerifyReport& r, const std::string& phase) {
  for (const auto& row : r.rows)
    if (row.phase == phase) return row;
  static const VerifyRow none{};
  ADD_FAILURE() << "no row " << phase;
  return none;
}

// Every MoE phase's measured dispatch bytes, on the rank that measured the most, within 1 % of
// the planner's prediction for the realised routing (the worst rank's); PipelinedLLEP's peak at
// or under the bound the planner states for the plan's routing model.
TEST_P(VerifyDispatchRanks, EveryPhaseWithinOnePercentOfThePlan) {
  const DispatchCase& c = GetParam();
  const VerifyReport r = run_dispatch(c.schedule, c.imbalance);
  int phases = 0;
  for (const auto& row : r.rows) {
    EXPECT_GE(row.rank, 0);
    EXPECT_LT(row.rank, 4);
    EXPECT_GT(row.measured_bytes, 0) << row.phase;
    if (row.phase == "bound") {
      EXPECT_LE(row.measured_bytes, row.predicted_bytes);
      continue;
    }
    EXPECT_LE(std::fabs(row.relative_error), 0.01) << row.phase;
    if (row.phase != "peak") ++phases;
  }
  EXPECT_EQ(phases, std::string(c.schedule) == "pipelined" ? 4 : 10);
  EXPECT_TRUE(r.rows.size() > 0 && (std::string(c.schedule) != "pipelined" || row_named(r, "bound").measured_bytes ==
                                                                                    row_named(r, "peak").measured_bytes));
}

INSTANTIATE_TEST_SUITE_P(
    Schedules, VerifyDispatchRanks,
    ::testing::Values(DispatchCase{"uncapped", "rho=1"}, DispatchCase{"uncapped", "rho=2.5"}, DispatchCase{"uncapped", "rho=4"},
                      DispatchCase{"uncapped", "hot-expert=0.5,1"}, DispatchCase{"llep", "rho=1"}, DispatchCase{"llep", "rho=2.5"},
                      DispatchCase{"llep", "rho=4"}, DispatchCase{"llep", "hot-expert=0.5,1"}, DispatchCase{"pipelined", "rho=1"},
                      DispatchCase{"pipelined", "rho=2.5"}, DispatchCase{"pipelined", "rho=4"},
                      DispatchCase{"pipelined", "hot-expert=0.5,1"}));

// The effect: the uncapped peak grows with ρ (receive buffers and expert activations of R rows),
// LLEP brings it back near ρ_L = α, and PipelinedLLEP's rounds bound what remains.
TEST(VerifyDispatchRanksEffect, LlepAndRoundsBoundWhatRhoRaises) {
  const int64_t uncapped_1 = row_named(run_dispatch("uncapped", "rho=1"), "peak").measured_bytes;
  const int64_t uncapped_4 = row_named(run_dispatch("uncapped", "rho=4"), "peak").measured_bytes;
  const int64_t llep_4 = row_named(run_dispatch("llep", "rho=4"), "peak").measured_bytes;
  const int64_t pipelined_4 = row_named(run_dispatch("pipelined", "rho=4"), "peak").measured_bytes;
  EXPECT_GT(uncapped_4, 2 * uncapped_1);  // measured 10.26 MB against 3.77 MB
  EXPECT_LT(llep_4 * 2, uncapped_4);      // 3.94 MB
  EXPECT_LT(pipelined_4 * 3, llep_4 * 2);  // 2.30 MB, of which 0.90 MB are the [T, E] routing tensors
}

// A default verify (every component) of a 4-rank plan runs dispatch on the 4 ranks and passes
// (tests/mpi/verify_ranks_mpi.sh runs it under mpirun -np 4).
TEST(VerifyDispatchRanksDefault, DefaultVerifyRunsDispatchOnTheRanksAndPasses) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "every component of a verify: 33 s under ASan; the ci preset and mpi.verify_ranks run it";
#endif
  const VerifyInputs in = inputs_of({{"--gpus", "4"}, {"--ep", "4"}, {"--context", "64K"}, {"--schedule", "baseline"}});
  const ScaledConfig s = scale_config(in, std::nullopt, 8);
  const VerifyReport r = run_verification(in, s, verify_components(), 0.01);
  EXPECT_EQ(r.ranks, 4);
  for (const auto& row : r.rows) {
    if (row.component == "dispatch") {
      EXPECT_LE(std::fabs(row.relative_error), 0.01) << row.phase;
    }
  }
  EXPECT_TRUE(r.pass);
}

// EP = 1 on 4 ranks (N/EP = 4): every rank holds every expert, so each runs the one-rank dispatch
// component on its own allocator; every rank's rows within 1 % of the plan (here exact).
TEST(VerifyDispatchRanksEpOne, EveryRankRunsItsLocalDispatch) {
  const VerifyInputs in = inputs_of({{"--gpus", "4"}, {"--ep", "1"}, {"--context", "16K"}, {"--schedule", "flatpeak"}});
  const ScaledConfig s = scale_config(in, std::nullopt, 8);
  ASSERT_EQ(s.ranks, 4);
  ASSERT_EQ(s.ep, 1);
  std::vector<VerifyReport> reports(4);
  const exec::RunResult run = exec::run_ranks(4, [&](int rank, exec::Communicator& comm) {
    const VerifyContext ctx{in, s, nullptr, &comm};
    verify_dispatch_ranks(ctx, reports[static_cast<size_t>(rank)]);
  });
  ASSERT_TRUE(run.ok()) << run.message;
  for (int rank = 0; rank < 4; ++rank) {
    const VerifyReport& r = reports[static_cast<size_t>(rank)];
    ASSERT_FALSE(r.rows.empty()) << "rank " << rank;
    for (const auto& row : r.rows) {
      EXPECT_EQ(row.rank, rank);
      EXPECT_LE(std::fabs(row.relative_error), 0.01) << "rank " << rank << " " << row.phase;
    }
  }
}

// 1 < EP < N: a plan with --gpus 4 --ep 2 runs two EP groups {0, 1} and {2, 3}, each on its own
// sub-communicator with its own tokens and routing draw. The planner predicts one EP group's
// worst rank; so, per group, every phase's largest measurement over the group's ranks is within
// 1 % of that group's prediction on its realised routing (PipelinedLLEP's bound row at or over
// every rank's peak), and the merged report (verify's rows) passes: uncapped EP and PipelinedLLEP.
TEST(VerifyDispatchRanksEpGroups, EveryGroupWithinOnePercentOfThePlan) {
  for (const char* schedule : {"baseline", "flatpeak"}) {
    const VerifyInputs in = inputs_of({{"--gpus", "4"}, {"--ep", "2"}, {"--context", "64K"}, {"--schedule", schedule},
                                       {"--imbalance", "rho=1.8"}});
    const ScaledConfig s = scale_config(in, std::nullopt, 8);
    ASSERT_EQ(s.ranks, 4);
    ASSERT_EQ(s.ep, 2);
    std::vector<VerifyReport> reports(4);
    const exec::RunResult run = exec::run_ranks(4, [&](int rank, exec::Communicator& comm) {
      const VerifyContext ctx{in, s, nullptr, &comm};
      verify_dispatch_ranks(ctx, reports[static_cast<size_t>(rank)]);
    });
    ASSERT_TRUE(run.ok()) << run.message;
    for (const auto& note : reports[0].notes) std::printf("%s\n", note.c_str());
    for (int group = 0; group < 2; ++group) {
      const VerifyReport& a = reports[static_cast<size_t>(2 * group)];
      const VerifyReport& b = reports[static_cast<size_t>(2 * group + 1)];
      ASSERT_EQ(a.rows.size(), b.rows.size());
      ASSERT_FALSE(a.rows.empty());
      for (size_t i = 0; i < a.rows.size(); ++i) {
        ASSERT_EQ(a.rows[i].phase, b.rows[i].phase);
        EXPECT_EQ(a.rows[i].predicted_bytes, b.rows[i].predicted_bytes) << "one prediction per group";
        const VerifyRow& most = b.rows[i].measured_bytes > a.rows[i].measured_bytes ? b.rows[i] : a.rows[i];
        std::printf("%s group %d %s predicted %lld measured %lld (ranks %lld, %lld) rel %+.4f\n", schedule, group,
                    most.phase.c_str(), static_cast<long long>(most.predicted_bytes), static_cast<long long>(most.measured_bytes),
                    static_cast<long long>(a.rows[i].measured_bytes), static_cast<long long>(b.rows[i].measured_bytes),
                    most.relative_error);
        if (most.phase == "bound") {
          EXPECT_LE(a.rows[i].measured_bytes, a.rows[i].predicted_bytes) << schedule << " group " << group;
          EXPECT_LE(b.rows[i].measured_bytes, b.rows[i].predicted_bytes) << schedule << " group " << group;
        } else {
          EXPECT_LE(std::fabs(most.relative_error), 0.01) << schedule << " group " << group << " " << most.phase;
        }
      }
    }
    const VerifyReport merged = run_component_on_ranks(verify_dispatch_ranks, in, s, nullptr, 4, nullptr);
    for (const auto& row : merged.rows) {
      if (row.phase == "bound") EXPECT_LE(row.measured_bytes, row.predicted_bytes);
      else EXPECT_LE(std::fabs(row.relative_error), 0.01) << schedule << " merged " << row.phase;
    }
  }
}

}  // namespace
}  // namespace flatpeak::cli
