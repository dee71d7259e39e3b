// verify --component dispatch on EP ranks: one MoE layer's forward, recompute and backward across
// the ranks with executor/schedules/dispatch_schedule.h (uncapped EP for baseline and practice;
// LLEP or PipelinedLLEP for flatpeak, with the plan's knobs, cap and m scaled with T), routed by
// the plan's routing model, against the planner's `dispatch` column of every MoE phase, predicted
// on the realised routing (the EP × E count matrix the ranks drew, an in-memory routing file).
// Every rank compares its own measurement with the prediction (the planner's worst rank); the
// merge keeps, per phase, the rank that measured the most (results[].rank). For PipelinedLLEP a
// row "bound" compares the rank's measured peak with the bound the planner states for the plan's
// own routing model (passes when measured ≤ predicted). With 1 < EP < N every EP group of EP
// consecutive ranks runs on its own sub-communicator (Communicator::split) with its own tokens
// and routing draw. Run by verify_ranks.h on every rank.
//   VerifyReport r = run_component_on_ranks(verify_dispatch_ranks, in, scaled, nullptr, 4, nullptr);
#include <memory>
#include <string>

#include <fmt/format.h>

#include "executor/memory/tracking_allocator.h"
#include "executor/schedules/dispatch_schedule.h"
#include "spec/errors.h"
#include "spec/routing.h"
#include "verify_common.h"
#include "verify_ranks.h"

namespace flatpeak::cli {

DispatchRanksSetup dispatch_ranks_setup(const VerifyContext& ctx, int64_t replica) {
  const VerifyInputs& in = ctx.in;
  const ScaledConfig& s = ctx.scaled;
  DispatchRanksSetup setup;
  if (in.num_experts == 0) {
    setup.note = "dispatch: a dense model has no expert dispatch; nothing to run";
    return setup;
  }
  const int64_t layer = first_moe_layer(in, s);
  if (layer < 0) {
    setup.note = fmt::format("dispatch: the first {} layers of {} are dense; no MoE layer to run", s.layers, in.model_name);
    return setup;
  }
  setup.knobs = dispatch_knobs(in, s);
  setup.plan_routing = parse_routing_model(in.imbalance);
  if (s.ep > 1) {
    validate_routing_model(setup.plan_routing, RoutingShape{s.ep, s.num_experts, in.top_k}, 0);
  } else {
    // One rank (the cuda backend's EP = 1): rank-level models (rho, hot-rank) have no meaning
    // there; balanced, as the one-rank component runs it.
    try {
      validate_routing_model(setup.plan_routing, RoutingShape{1, s.num_experts, in.top_k}, 0);
    } catch (const InputError&) {
      setup.note = "dispatch: routing " + in.imbalance + " has no meaning on one rank; ran balanced";
      setup.plan_routing = RoutingModel{};
    }
  }
  setup.config = dispatch_config(ctx, setup.knobs, layer, setup.plan_routing);
  setup.config.outputs = false;  // memory only: the exactness across ranks is executor_dispatch_ranks_test's
  setup.config.replica = replica;
  setup.runs = true;
  return setup;
}

void dispatch_rank_report(const VerifyContext& ctx, const DispatchRanksSetup& setup, const exec::DispatchScheduleResult& got,
                          const std::vector<exec::PhaseRecord>& records, bool lead, VerifyReport& report) {
  const VerifyInputs& in = ctx.in;
  const ScaledConfig& s = ctx.scaled;
  const exec::DispatchScheduleConfig& c = setup.config;
  // Routing is data: the planner predicts on the count matrix the ranks drew (every rank has it).
  RoutingModel realised;
  const auto file = realised_routing(got.source_counts, s.ep, s.num_experts, realised);
  const auto [predicted_peak, measured_peak] = compare_dispatch(predict_dispatch(ctx, setup.knobs, realised), records, report);
  const int64_t expected_peak = dispatch_peak(predict_dispatch(ctx, setup.knobs, setup.plan_routing));
  if (c.chunk_cap_rows > 0 && s.ep > 1)  // the planner's statement for the plan as written
    report.rows.push_back({"dispatch", "device", "bound", expected_peak, measured_peak, relative_error(measured_peak, expected_peak)});
  report.measured_trace = measured_trace(records);
  if (!lead) return;
  if (!setup.note.empty()) report.notes.push_back(setup.note);
  const double rho_ep = imbalance_rho(received_rows_per_rank(got.source_counts, RoutingShape{s.ep, s.num_experts, in.top_k}));
  report.notes.push_back(fmt::format("dispatch: {} on {} ranks, routing {} realised rho = {:.3f} (seed {}), F = {} -> {}, C = {}, m = {}",
                                     exec::dispatch_schedule_name(c), s.ep, in.imbalance, rho_ep, c.seed, in.expert_ffn_width,
                                     c.ffn, c.chunk_cap_rows, c.llep ? c.lla.min_rows_per_gemm : 0));
  if (c.llep)
    report.notes.push_back(fmt::format("dispatch: LLA {} on the realised counts (alpha = {}, lambda = {}): rho {:.3f}",
                                       got.lla_triggered ? "ran" : "fell back to plain EP", c.lla.llep_alpha, c.lla.imbalance_trigger,
                                       got.rho));
  if (c.chunk_cap_rows > 0)
    report.notes.push_back(fmt::format("dispatch: {} rounds of C = {} (launch C = {}), round receive buffers of B = {} rows ({})",
                                       got.rounds, got.chunk_cap_rows, got.launch_chunk_cap_rows, got.round_buffer_rows,
                                       c.store ? "store" : "recompute"));
  report.notes.push_back(fmt::format("dispatch: routing sampling error (prediction on {} minus on the realised counts) {:+} B at the peak",
                                     to_string(setup.plan_routing),
                                     routing_sampling_error(ctx, setup.knobs, setup.plan_routing, realised, expected_peak - predicted_peak)));
}

void verify_dispatch_ranks(const VerifyContext& ctx, VerifyReport& report) {
  const VerifyInputs& in = ctx.in;
  const ScaledConfig& s = ctx.scaled;
  exec::Communicator& comm = *ctx.comm;
  const bool lead = comm.rank() == 0;
  if (in.num_experts == 0) {
    if (lead) report.notes.push_back("dispatch: a dense model has no expert dispatch; nothing to run");
    return;
  }
  if (s.ep == 1) {
    // EP = 1: every rank holds every expert, so its dispatch needs no other rank; each rank runs
    // the one-rank component on its own allocator (as the vocab component does for rings of one).
    const VerifyContext one_rank{ctx.in, ctx.scaled, ctx.adjust, nullptr};
    const size_t first = report.rows.size();
    verify_dispatch(one_rank, report);
    for (size_t i = first; i < report.rows.size(); ++i) report.rows[i].rank = comm.rank();
    return;
  }
  // 1 < EP < N: N/EP EP groups of consecutive ranks {g·EP .. g·EP+EP−1}, each on its own
  // sub-communicator with its own tokens and routing draw (the planner's EP group stands for
  // every one); each rank compares with its group's prediction on its group's realised routing.
  std::unique_ptr<exec::Communicator> group;
  if (s.ranks != s.ep) group = comm.split(static_cast<int>(comm.rank() / s.ep), static_cast<int>(comm.rank() % s.ep));
  exec::Communicator& ep_comm = group ? *group : comm;
  const DispatchRanksSetup setup = dispatch_ranks_setup(ctx, comm.rank() / s.ep);
  if (!setup.runs) {
    if (lead) report.notes.push_back(setup.note);
    return;
  }
  exec::TrackingAllocator alloc({in.alignment_bytes, -1, -1});
  const exec::DispatchScheduleResult got = exec::run_dispatch_schedule(ep_comm, alloc, setup.config);
  if (lead && group)
    report.notes.push_back(fmt::format("dispatch: {} EP groups of {} ranks (sub-communicators of consecutive ranks), each "
                                       "its own tokens and routing draw; notes below are group 0's",
                                       s.ranks / s.ep, s.ep));
  dispatch_rank_report(ctx, setup, got, alloc.phase_records(), lead, report);
}

}  // namespace flatpeak::cli
