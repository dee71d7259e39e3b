// What every verify component shares (verify_<component>.cpp): the planner's timeline of the
// scaled configuration, the measured trace, and the comparison rows.
//   ordered_json predicted = predicted_timeline(ctx, {{"--sco", "on"}});
//   compare_category(ctx, "checkpoint", "boundaries", exec::MemorySpace::Host, predicted, alloc, filter, report);
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "executor/comm/communicator.h"
#include "executor/memory/tracking_allocator.h"
#include "executor/schedules/checkpoint_schedule.h"
#include "executor/schedules/decoder_layer.h"
#include "executor/schedules/dispatch_schedule.h"
#include "executor/schedules/ring_dtp_schedule.h"
#include "executor/schedules/step_schedule.h"
#include "executor/schedules/vocab_schedule.h"
#include "spec/errors.h"
#include "spec/model_spec.h"
#include "spec/routing.h"
#include "verify_config.h"
#include "verify_run.h"

namespace flatpeak::cli {

// One component's inputs: the plan as read, its scaled configuration, the test-only hook, and,
// when the scaled configuration has more than one rank, this rank's communicator (nullptr on one
// rank). A component's single-rank function never sees a communicator; its multi-rank function
// (verify_run.cpp's table) runs on every rank, each with its own TrackingAllocator.
struct VerifyContext {
  const VerifyInputs& in;
  const ScaledConfig& scaled;
  const PredictionAdjust& adjust;
  exec::Communicator* comm = nullptr;
};

using FlagList = std::vector<std::pair<std::string, std::string>>;

// The plan's model with the scaled dims (H, V, L, E, F, GQA heads): what the planner predicts and the
// executor sizes.
ModelSpec scaled_model(const VerifyInputs& in, const ScaledConfig& s);

// The flag of the predictions of the components that do not run MTP modules (every one but the
// optimizer's): the plan without them, since what the modules hold beside the decoder layers and
// the main loss (planner/README.md "Multi-token prediction") is the step's, not the component's.
inline const std::pair<std::string, std::string> kWithoutMtp{"--mtp", "off"};

// The planner's timeline (traces/README.md JSON) for the scaled configuration on one rank, with the
// plan's vocabulary knobs and `extra` flags (a component's own knobs) on top; `adjust` applied.
nlohmann::ordered_json predicted_timeline(const VerifyContext& ctx, const FlagList& extra);
// The same for `model` in place of scaled_model(ctx.in, ctx.scaled); `routing` (a realised
// routing in memory, e.g. realised_routing) replaces the plan's routing model when given.
nlohmann::ordered_json predicted_timeline_for(const VerifyContext& ctx, const ModelSpec& model, const FlagList& extra,
                                              const RoutingModel* routing = nullptr);

// The model one rank's decoder layers run (verify_step.cpp): scaled_model with this rank's E/EP
// experts and the shared and dense FFN widths scaled with H.
ModelSpec layer_model(const VerifyContext& ctx);
// The executor's configuration of the layer component (verify_step.cpp): layer_model's layer on
// the scaled tokens, named after the scaled model's first MoE layer.
exec::LayerScheduleConfig layer_schedule_config(const VerifyInputs& in, const ScaledConfig& s);
// A plan whose model or layout a component's executor does not run (MLA, MTP, a tied head,
// ...): an input error (exit 2) when the component is asked for alone; when every
// component runs (the default), that component is skipped with a note (verify_run.cpp).
class UnsupportedPlan : public InputError {
 public:
  using InputError::InputError;
};

// Refuses (UnsupportedPlan) what the executor's decoder layer does not run: MLA, a dense model,
// fewer local experts than top_k, a plan without head counts ("the <component> component runs ...").
void check_layer_supported(const VerifyInputs& in, const ScaledConfig& s, const std::string& component);
// The same problems added to `errs` (a component that checks more in the same pass). The layer
// component routes over one rank's E/EP experts (top_k must not exceed them); the step
// (routes_over_every_expert) runs the EP ranks, whose tokens route over all E.
void layer_support_errors(const VerifyInputs& in, const ScaledConfig& s, const std::string& component, InputErrors& errs,
                          bool routes_over_every_expert = false);
// The ring verify runs a plan's CP > 1 on: the largest that divides both the plan's CP and the
// scaled ranks (1: none of 2 or more).
int64_t layer_ring_size(const VerifyInputs& in, const ScaledConfig& s);
// Why a plan at CP > 1 cannot run on the scaled ranks (one rank, or no ring of 2 or more dividing
// both): the note's text and the refusal of `component` ("layer", "step").
std::string no_ring_text(const VerifyInputs& in, const ScaledConfig& s);
Diagnostic no_ring_diagnostic(const VerifyInputs& in, const ScaledConfig& s, const std::string& component);
// Whether the layer component runs on the ranks: at CP > 1, as a ring (else `why_not` says why);
// UnsupportedPlan for a plan it does not run at all.
bool layer_runs_on_ranks(const VerifyContext& ctx, std::string& why_not);

// The measured record(s) a predicted phase stands for: itself, or, when folded ("loss/fwd/blk0"
// with folds "blk0-blk3"), every measured phase that differs from it only in the last index.
bool phase_matches(const std::string& predicted, bool folded, const std::string& measured);

// (measured − predicted) / predicted; 0 when both are 0, infinite when only the prediction is 0.
double relative_error(int64_t measured, int64_t predicted);

// The measured timeline in the traces/ format, from an allocator's phase records.
nlohmann::ordered_json measured_trace(const exec::TrackingAllocator& alloc);
// The same from phase records (another backend's allocator, e.g. the CUDA DeviceAllocator's).
nlohmann::ordered_json measured_trace(const std::vector<exec::PhaseRecord>& records);

// Appends one row per predicted phase accepted by `phase_filter` (category `category` of `space`
// against the maximum of the measured phases it folds) and a "peak" row over them. Returns the
// number of phase rows.
int compare_category(const std::string& component, const std::string& category, exec::MemorySpace space,
                     const nlohmann::ordered_json& predicted, const exec::TrackingAllocator& alloc,
                     const std::function<bool(const std::string& phase)>& phase_filter, VerifyReport& report);
// The same against phase records (another backend's allocator).
int compare_category(const std::string& component, const std::string& category, exec::MemorySpace space,
                     const nlohmann::ordered_json& predicted, const std::vector<exec::PhaseRecord>& records,
                     const std::function<bool(const std::string& phase)>& phase_filter, VerifyReport& report);

// Dispatch (verify_dispatch.cpp), shared by its one-rank and multi-rank runs.
// The plan's dispatch knobs as verify runs them: the LLEP switch, C, m, mode and depth as
// scale_config scaled them; α, λ and striping as the plan wrote them (InputError names a bad
// one). At one rank LLEP runs only as capped rounds, with α = 1 and λ = 0.
struct DispatchKnobs {
  bool llep = false;
  int64_t chunk_cap_rows = 0;  // scaled C (0: no cap)
  double alpha = 1.1, lambda = 1.3;
  bool striping = true;
};
DispatchKnobs dispatch_knobs(const VerifyInputs& in, const ScaledConfig& s);
// The executor's configuration of the scaled layer on this rank (EP = s.ep).
exec::DispatchScheduleConfig dispatch_config(const VerifyContext& ctx, const DispatchKnobs& k, int64_t layer,
                                             const RoutingModel& routing);
// The planner's timeline of the scaled configuration on s.ep ranks (one EP group), routed by
// `routing`; ctx.adjust applied.
nlohmann::ordered_json predict_dispatch(const VerifyContext& ctx, const DispatchKnobs& k, const RoutingModel& routing);
// The dispatch peak predicted on the plan's routing model minus on the realised counts: `compared`
// (the same difference of the compared predictions), or, when ctx.adjust scales those
// (--perturb), the difference of unadjusted predictions.
int64_t routing_sampling_error(const VerifyContext& ctx, const DispatchKnobs& k, const RoutingModel& plan_routing,
                               const RoutingModel& realised, int64_t compared);
// The largest dispatch column over the MoE phases of a predicted timeline.
int64_t dispatch_peak(const nlohmann::ordered_json& timeline);
// One row per MoE phase of the prediction (layer index folded) against the largest measured
// phase it stands for, and a "peak" row; returns (predicted, measured) peaks.
std::pair<int64_t, int64_t> compare_dispatch(const nlohmann::ordered_json& predicted, const exec::TrackingAllocator& alloc,
                                             VerifyReport& report);
// The same against phase records (another backend's allocator).
std::pair<int64_t, int64_t> compare_dispatch(const nlohmann::ordered_json& predicted, const std::vector<exec::PhaseRecord>& records,
                                             VerifyReport& report);
// The first MoE layer of the scaled model (-1: none).
int64_t first_moe_layer(const VerifyInputs& in, const ScaledConfig& s);
// `model` becomes an in-memory routing file holding `counts` ([EP][E], one layer).
std::shared_ptr<RoutingFile> realised_routing(const CountMatrix& counts, int64_t ep, int64_t experts, RoutingModel& model);

// The multi-rank run's set-up and per-rank rows (verify_dispatch_ranks.cpp), shared with the
// cuda backend (one EP group's ranks on one GPU).
struct DispatchRanksSetup {
  bool runs = false;                    // false: nothing to run (a dense model or layers); `note` says why
  std::string note;                     // also: EP = 1 with a rank-level routing model, run balanced
  DispatchKnobs knobs;
  RoutingModel plan_routing;            // the plan's routing model, validated on {EP, E, k}
  exec::DispatchScheduleConfig config;  // the scaled layer on EP = s.ep ranks; outputs off; `replica` set
};
// The set-up of EP group `replica` (InputError for bad knobs, or a routing model invalid at EP).
DispatchRanksSetup dispatch_ranks_setup(const VerifyContext& ctx, int64_t replica);
// One EP rank's rows from its run (`got`, its allocator's `records`): every MoE phase against the
// prediction on the realised routing, a peak row, and (capped, EP > 1) a "bound" row against the
// prediction on the plan's routing model; the trace; on the `lead` rank the notes.
void dispatch_rank_report(const VerifyContext& ctx, const DispatchRanksSetup& setup, const exec::DispatchScheduleResult& got,
                          const std::vector<exec::PhaseRecord>& records, bool lead, VerifyReport& report);

// The step (verify_step_full.cpp), shared by its one-rank and multi-rank runs.
struct StepSetup {
  exec::StepScheduleConfig config;  // the scaled step as every rank runs it
  int64_t params = 0;               // P of rank 0 (the largest shard)
  nlohmann::ordered_json predicted; // the planner's timeline: one rank of `ranks` (FSDP at EP = 1)
  std::string note;                 // P, boundaries, optimizer (and buckets)
};
// The step's configuration and prediction on `ranks` ranks (1: the one-rank step); UnsupportedPlan
// for a plan the step does not run.
// At EP = N the prediction is made on `routing` (the realised one, after the run; without it, on
// the plan's routing model).
StepSetup step_setup(const VerifyContext& ctx, int64_t ranks, const RoutingModel* routing = nullptr);
// Rows step.<column> of every predicted phase and peak, device and host, against `alloc`'s records.
void compare_step_columns(const nlohmann::ordered_json& predicted, const exec::TrackingAllocator& alloc, VerifyReport& report);
// Whether the multi-rank step runs the plan (EP divides N; else `why_not` says why); UnsupportedPlan for
// a plan the step does not run at all.
bool step_runs_on_ranks(const VerifyContext& ctx, std::string& why_not);

// The main loss's phases (loss/fwd..., loss/bwd...): the vocab component's rows. The MTP losses
// (loss/mtpJ/...) are not run by that component yet.
bool main_loss_phase(const std::string& phase);
// The vocab component's executor configuration on one rank (R = 1): the scaled T, H, V, blocks,
// the plan's mode and backward.
exec::VocabScheduleConfig vocab_schedule_config(const VerifyInputs& in, const ScaledConfig& s);

// Ring-DTP's verify run on `ranks` ranks (verify_vocab_ring.cpp), shared with the cuda backend:
// the ring (the plan's R when the ranks hold whole rings, else the largest that divides both),
// the scaled blocks, the planner's timeline for that ring, and a note that says so.
struct RingVerifySetup {
  exec::RingDtpConfig config;
  nlohmann::ordered_json predicted;
  std::string note;
};
RingVerifySetup ring_verify_setup(const VerifyContext& ctx, int64_t ranks);

// The checkpoint component (verify_checkpoint.cpp), shared with the cuda backend.
// The planner flags of the plan's boundaries (SCO's scaled layer set and prefetch; a note says which).
FlagList checkpoint_prediction_flags(const ScaledConfig& s, VerifyReport& report);
// The executor's configuration: the scaled T, H, L, the offloaded layers and prefetch.
exec::CheckpointScheduleConfig checkpoint_schedule_config(const ScaledConfig& s);
// Rows checkpoint.<space> of every decoder-layer and main-loss phase the stack runs (boundaries
// column, the measured phase standing for each predicted one) and a "peak" row.
void compare_boundaries(exec::MemorySpace space, const nlohmann::ordered_json& predicted, const std::vector<exec::PhaseRecord>& records,
                        VerifyReport& report);

// One verify component per file.
void verify_vocab(const VerifyContext& ctx, VerifyReport& report);
void verify_vocab_ring(const VerifyContext& ctx, VerifyReport& report);  // every rank, ctx.comm set
void verify_dispatch(const VerifyContext& ctx, VerifyReport& report);
void verify_checkpoint(const VerifyContext& ctx, VerifyReport& report);
void verify_optimizer(const VerifyContext& ctx, VerifyReport& report);
void verify_layer(const VerifyContext& ctx, VerifyReport& report);
void verify_step(const VerifyContext& ctx, VerifyReport& report);

}  // namespace flatpeak::cli
