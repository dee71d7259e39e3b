// verify --component step: one whole training step of the scaled model on one rank
// (executor/schedules/step_schedule.h) against the planner's timeline of the same step, phase by
// phase and at each peak, every column: on the device params, grads, optimizer, fsdp, boundaries,
// activations, dispatch, vocab and their total; on the host optimizer, boundaries and total. Rows
// step.<column>; a phase row where both sides are 0 is left out, every column has its peak row.
//
// The scaled step: the layer component's model (H, V, L, heads, F and F_s scaled, this rank's E/EP
// experts, EP = 1), the plan's boundaries (kept, synchronous offload of all, or SCO's scaled set
// and prefetch), its loss (materialised, or blocked with the scaled blocks and its backward) and
// its optimizer placement (the stream's number of buckets kept: bucket_params = ceil(P / buckets)
// of this step's P). Predicted with the same flags on the same model (--llep off: at one rank each
// layer runs one uncapped dispatch; PipelinedLLEP's rounds are the dispatch component's).
// Phase matching: a decoder-layer entry is compared with the layer it names (boundaries, grad
// shards and FSDP units differ from layer to layer; the fold's other members are covered by the
// peak rows, which take every measured phase), a folded loss block or optimizer bucket with the
// maximum over the measured ones. Measured bytes are taken where the phase's timeline columns
// peak together and totals are their sum (op scratch, category workspace, has no column: on-chip
// on a GPU; the token ids the embedding's backward re-reads are input data there). Peak rows: a
// column's largest over the phases the prediction lists, the total's over every measured phase.
// Against the naive step (no checkpointing, materialised loss, optimizer on the device, same data):
// max_abs_dloss, max_abs_dgrad over every reduced grad shard, and a note with the largest
// difference of an updated parameter; all three 0 (bitwise) when the plan's loss is materialised
// (with MTP and the optimizer offloaded, the head's bf16 shard rounds once per loss: within that).
// MTP modules run when the plan trains them (StepScheduleConfig::mtp, --mtp on in the prediction).
// On N > 1 ranks step_setup predicts one rank of the N-GPU plan and every rank runs the step
// (verify_step_ranks.cpp).
//   flatpeak verify p.json --component step --max-ranks 1
#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "executor/memory/tracking_allocator.h"
#include "executor/schedules/step_schedule.h"
#include "spec/errors.h"
#include "spec/model_loader.h"
#include "verify_common.h"

namespace flatpeak::cli {

namespace {

const std::vector<std::string> kDeviceColumns = {"params", "grads", "optimizer", "fsdp", "boundaries", "activations", "dispatch", "vocab"};
const std::vector<std::string> kHostColumns = {"optimizer", "boundaries"};

std::string layer_set_text(const std::vector<bool>& offloaded) {
  std::string out;
  for (size_t i = 0; i < offloaded.size(); ++i)
    if (offloaded[i]) out += (out.empty() ? "" : ",") + std::to_string(i) + "-" + std::to_string(i);
  return out.empty() ? "0" : out;
}

// What the step runs beyond the decoder layer: MoE and dense FFN layers, MTP modules (RMSNorm
// models), an untied head.
void check_step_supported(const VerifyInputs& in, const ScaledConfig& s, const ModelSpec& model) {
  InputErrors errs;
  // Its EP ranks route over all E; at CP > 1 its layers' attention is a ring of ranks.
  layer_support_errors(in, s, "step", errs, /*routes_over_every_expert=*/true);
  if (in.mtp && model.mtp_layers > 0 && model.norm_bias)
    errs.add(Diagnostic{in.file, "/inputs/run/mtp", "the step component runs MTP modules of RMSNorm models only (got LayerNorm norms)",
                        "plan with --mtp off"});
  if (model.tie_word_embeddings)
    errs.add(Diagnostic{in.file, "/inputs/model/tie_word_embeddings", "the step component runs an untied LM head (got true)", ""});
  for (const Diagnostic& d : s.optimizer_refusal) errs.add(d);
  if (!errs.empty()) throw UnsupportedPlan(errs.diagnostics());
}

// The column's bytes when the record's timeline columns peaked (op scratch, workspace, has no
// column); "total": the sum of the space's columns then.
int64_t column_bytes(const exec::PhaseRecord& r, const std::string& column, const std::vector<std::string>& columns) {
  if (column != "total") return r.bytes_at_column_peak[static_cast<size_t>(*exec::category_from_name(column))];
  int64_t sum = 0;
  for (const auto& c : columns) sum += r.bytes_at_column_peak[static_cast<size_t>(*exec::category_from_name(c))];
  return sum;
}

// The measured phases a predicted one stands for: a decoder-layer phase is the layer it names;
// otherwise itself or, folded, the maximum over its fold (loss blocks, optimizer buckets).
bool stands_for(const std::string& predicted, bool folded, const std::string& measured) {
  if (predicted.rfind("fwd/L", 0) == 0 || predicted.rfind("bwd/L", 0) == 0) return measured == predicted;
  return phase_matches(predicted, folded, measured);
}

void compare_step(exec::MemorySpace space, const std::vector<std::string>& columns, const nlohmann::ordered_json& predicted,
                  const exec::TrackingAllocator& alloc, VerifyReport& report) {
  const std::string space_name = exec::memory_space_name(space);
  const auto records = alloc.phase_records();
  std::vector<std::string> all = columns;
  all.emplace_back("total");
  for (const auto& column : all) {
    const std::string component = "step." + column;
    int64_t predicted_peak = 0, measured_peak = 0;
    // The total's peak over every measured phase: the folding's claim that the listed instances
    // hold the largest total. A column's peak over the phases the prediction lists (folding keeps
    // the instances with the largest totals, not each column's largest: FSDP buffers can be
    // larger in a layer between the listed ones).
    if (column == "total")
      for (const auto& r : records)
        if (r.space == space && r.phase != "init" && !r.phase.empty()) measured_peak = std::max(measured_peak, column_bytes(r, column, columns));
    for (const auto& phase : predicted["phases"]) {
      const std::string name = phase["name"].get<std::string>();
      if (!phase.contains(space_name)) continue;
      const int64_t predicted_bytes = phase[space_name][column].get<int64_t>();
      int64_t measured_bytes = 0;
      for (const auto& r : records)
        if (r.space == space && stands_for(name, phase.contains("folds"), r.phase))
          measured_bytes = std::max(measured_bytes, column_bytes(r, column, columns));
      predicted_peak = std::max(predicted_peak, predicted_bytes);
      if (column != "total") measured_peak = std::max(measured_peak, measured_bytes);
      if (predicted_bytes == 0 && measured_bytes == 0) continue;
      report.rows.push_back({component, space_name, name, predicted_bytes, measured_bytes, relative_error(measured_bytes, predicted_bytes)});
    }
    report.rows.push_back({component, space_name, "peak", predicted_peak, measured_peak, relative_error(measured_peak, predicted_peak)});
  }
}

}  // namespace

void compare_step_columns(const nlohmann::ordered_json& predicted, const exec::TrackingAllocator& alloc, VerifyReport& report) {
  compare_step(exec::MemorySpace::Device, kDeviceColumns, predicted, alloc, report);
  compare_step(exec::MemorySpace::Host, kHostColumns, predicted, alloc, report);
}

bool step_runs_on_ranks(const VerifyContext& ctx, std::string& why_not) {
  check_step_supported(ctx.in, ctx.scaled, layer_model(ctx));
  if (ctx.in.cp > 1 && layer_ring_size(ctx.in, ctx.scaled) < 2) {
    why_not = "no multi-rank run: " + no_ring_text(ctx.in, ctx.scaled);
    return false;
  }
  if (ctx.scaled.ranks % ctx.scaled.ep == 0) return true;
  why_not = "no multi-rank run: EP = " + std::to_string(ctx.scaled.ep) + " does not divide N = " + std::to_string(ctx.scaled.ranks);
  return false;
}

StepSetup step_setup(const VerifyContext& ctx, int64_t ranks, const RoutingModel* routing) {
  const VerifyInputs& in = ctx.in;
  const ScaledConfig& s = ctx.scaled;
  ModelSpec model = layer_model(ctx);
  check_step_supported(in, s, model);
  // EP > 1 across the ranks: every expert in the model, E/EP computed on each rank, the dispatch
  // crossing the ranks of each EP group (on one rank: that rank's E/EP experts at EP = 1).
  const int64_t ep = ranks > 1 ? s.ep : 1;
  if (ep > 1) model.num_experts = s.num_experts;
  if (in.cp > 1 && (ranks == 1 || layer_ring_size(in, s) < 2)) throw UnsupportedPlan({no_ring_diagnostic(in, s, "step")});
  // CP > 1: rings of `cp` consecutive ranks (layer_ring_size), each rank T tokens of its ring's sequence.
  const int64_t cp = in.cp > 1 ? layer_ring_size(in, s) : 1;

  exec::StepScheduleConfig c;
  c.model = model;
  c.mtp = in.mtp && model.mtp_layers > 0;  // the plan's MTP modules, trained
  c.ep = ep;
  c.cp = cp;
  c.tokens = s.tokens;
  if (s.boundaries != "device") c.offloaded = s.sco_offloaded;  // sync-offload: every layer
  c.prefetch = s.boundaries == "sco" ? s.sco_prefetch : 0;
  c.loss.mode = in.vocab_mode == "materialized" ? exec::VocabScheduleMode::Materialized : exec::VocabScheduleMode::Blocked;
  c.loss.token_block_rows = s.token_block;
  c.loss.vocab_block_rows = s.vocab_block;
  c.loss.gradients_in_forward = in.vocab_backward == "in-forward";
  c.optimizer.placement = s.optimizer == "gpu"      ? exec::OptimizerPlacement::Device
                          : s.optimizer == "serial" ? exec::OptimizerPlacement::Serial
                                                    : exec::OptimizerPlacement::Stream;
  c.optimizer.cpu_threads = ranks > 1 ? 1 : 2;  // thread ranks share the machine's cores
  // The rank's P: rank 0's slices of every unit (the largest, ceil(U / N) each) and of its experts
  // (over the N/EP replicas that hold them).
  int64_t params = 0;
  const int64_t replicas = ranks / ep;
  for (const exec::FsdpUnitShape& u : exec::step_unit_shapes(c))
    params += (u.sharded_params + ranks - 1) / ranks + (u.local_params + replicas - 1) / replicas;

  FlagList flags;
  if (s.boundaries == "sco")
    flags = {{"--sco", "on"}, {"--sco-layers", layer_set_text(s.sco_offloaded)}, {"--sco-prefetch", std::to_string(s.sco_prefetch)}};
  else
    flags = {{"--sco", "off"}};  // practice: synchronous offload of every layer; otherwise kept
  flags.emplace_back("--optimizer", s.optimizer);
  if (model.mtp_layers > 0) flags.emplace_back("--mtp", c.mtp ? "on" : "off");
  if (s.optimizer == "stream") {
    c.optimizer.bucket_params = std::max<int64_t>(1, (params + s.bucket_count - 1) / std::max<int64_t>(1, s.bucket_count));
    c.optimizer.bucket_depth = s.bucket_depth;
    flags.emplace_back("--bucket-params", std::to_string(c.optimizer.bucket_params));
    flags.emplace_back("--bucket-depth", std::to_string(s.bucket_depth));
  }
  if (ranks > 1) {  // FSDP over N ranks (any EP dividing N): one rank's share of the N-GPU plan
    flags.insert(flags.end(), {{"--gpus", std::to_string(ranks)}, {"--gpus-per-node", std::to_string(ranks)}, {"--ep", std::to_string(ep)},
                               {"--micro-batch", "1"}});
    // Ring-DTP's ring is the vocab component's; the step's loss is a ring of one (scale_config's R).
    if (in.vocab_mode == "ring-dtp") flags.emplace_back("--ring-size", "1");
    // The step's MoE layers run one uncapped dispatch each (LLEP and PipelinedLLEP's rounds are the
    // dispatch component's).
    if (ep > 1) flags.emplace_back("--llep", "off");
    if (cp > 1) flags.insert(flags.end(), {{"--cp", std::to_string(cp)}, {"--context", std::to_string(cp * s.tokens)}});
  }
  StepSetup out{c, params, predicted_timeline_for(ctx, model, flags, routing), ""};
  out.note = "P = " + std::to_string(params) + " params on " + (ranks > 1 ? "rank 0" : "the rank") + " (" +
             std::to_string(model.num_experts / ep) + " experts a layer" + (ep > 1 ? " of " + std::to_string(model.num_experts) + ", EP = " + std::to_string(ep) : "") +
             ")" + (cp > 1 ? ", ring attention in CP groups of " + std::to_string(cp) + " ranks (the plan's CP = " + std::to_string(in.cp) + ")" : "") +
             ", boundaries " + s.boundaries + ", optimizer " + s.optimizer;
  if (s.optimizer == "stream")
    out.note += " (" + std::to_string(s.bucket_count) + " buckets of " + std::to_string(c.optimizer.bucket_params) + ", depth " +
                std::to_string(s.bucket_depth) + ")";
  return out;
}

void verify_step(const VerifyContext& ctx, VerifyReport& report) {
  const VerifyInputs& in = ctx.in;
  const StepSetup setup = step_setup(ctx, 1);
  const exec::StepScheduleConfig& c = setup.config;
  const nlohmann::ordered_json& predicted = setup.predicted;

  // The naive step first, its grads and updated params kept ([P] fp32 each); the plan's step hands
  // its own to the comparison while its buffers hold them (result_sink), so no second copy is kept.
  exec::StepScheduleConfig n = c;
  n.naive = true;
  exec::TrackingAllocator naive_alloc({in.alignment_bytes, -1, -1});
  const exec::StepScheduleResult ref = exec::run_step_schedule(naive_alloc, n);
  double dparam = 0.0;
  int64_t compared = 0;
  exec::StepScheduleConfig measured = c;
  measured.result_sink = [&](exec::StepResultPart part, int64_t offset, const float* values, int64_t count) {
    const std::vector<float>& naive = part == exec::StepResultPart::Grads ? ref.grads : ref.params;
    double& worst = part == exec::StepResultPart::Grads ? report.max_abs_dgrad : dparam;
    if (offset + count > static_cast<int64_t>(naive.size())) throw std::logic_error("verify step: results beyond the naive step's [P]");
    for (int64_t i = 0; i < count; ++i) worst = std::max(worst, static_cast<double>(std::fabs(values[i] - naive[static_cast<size_t>(offset + i)])));
    compared += count;
  };
  exec::TrackingAllocator alloc({in.alignment_bytes, -1, -1});
  const exec::StepScheduleResult got = exec::run_step_schedule(alloc, measured);
  if (compared != static_cast<int64_t>(ref.grads.size() + ref.params.size()))
    throw std::logic_error("verify step: compared " + std::to_string(compared) + " of the naive step's grads and params");
  report.max_abs_dloss = std::max(report.max_abs_dloss, std::fabs(got.loss - ref.loss));
  for (size_t j = 0; j < got.mtp_losses.size() && j < ref.mtp_losses.size(); ++j)  // each MTP module's loss too
    report.max_abs_dloss = std::max(report.max_abs_dloss, std::fabs(got.mtp_losses[j] - ref.mtp_losses[j]));

  compare_step_columns(predicted, alloc, report);
  report.measured_trace = measured_trace(alloc);

  report.notes.push_back("step: " + setup.note);
  char buffer[64];
  std::snprintf(buffer, sizeof buffer, "%.3g", dparam);
  report.notes.push_back(std::string("step: max |updated param - naive| = ") + buffer);
  if (in.accumulation_steps > 1)
    report.notes.push_back("step: one micro-batch without gradient accumulation (the plan accumulates " +
                           std::to_string(in.accumulation_steps) + ")");
}

}  // namespace flatpeak::cli
