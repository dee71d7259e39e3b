// Planning and running the scaled configuration for `flatpeak verify` (verify_run.h). The
// predicted side is the planner's timeline of the scaled run; the measured side is the executor's
// tracking allocator. Only this file sees both libraries.
#include "verify_run.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "executor/memory/tracking_allocator.h"
#include "executor/schedules/vocab_schedule.h"
#include "plan.h"
#include "run_spec.h"
#include "spec/hardware_loader.h"
#include "spec/model_loader.h"

namespace flatpeak::cli {

namespace {

using nlohmann::ordered_json;

// The planner's timeline for the scaled configuration (one rank).
ordered_json predicted_timeline(const VerifyInputs& in, const ScaledConfig& s) {
  ModelSpec model = load_model(in.model_name);
  model.hidden_size = s.hidden;
  model.vocab_size = s.vocab;
  model.num_layers = s.layers;
  model.layers.resize(static_cast<size_t>(s.layers));
  const HardwareSpec hardware = load_hardware(in.hardware_name);
  InputErrors errs;
  std::vector<std::pair<std::string, std::string>> flags{
      {"--gpus", "1"}, {"--context", std::to_string(s.tokens)}, {"--schedule", in.schedule}, {"--gpus-per-node", "1"}};
  // One rank: EP = 1, so there is nothing for LLEP to balance (its knobs need EP > 1).
  if (in.schedule == "flatpeak") flags.emplace_back("--llep", "off");
  if (in.vocab_mode == "materialized") {
    if (in.schedule != "baseline") flags.emplace_back("--ring-dtp", "off");
  } else {
    if (in.vocab_mode == "ring-dtp") flags.emplace_back("--ring-dtp", "on");
    flags.emplace_back("--token-block", std::to_string(s.token_block));
    flags.emplace_back("--vocab-block", std::to_string(s.vocab_block));
    flags.emplace_back("--vocab-backward", in.vocab_backward);
  }
  const planner::RunSpec spec = planner::parse_run_flags(flags, errs);
  errs.throw_if_any();
  const planner::Plan plan = planner::make_plan(model, hardware, spec);
  return planner::timeline_to_json(plan.timeline);
}

// The measured record(s) a predicted phase stands for: itself, or, when folded over blocks
// ("loss/fwd/blk0" folds "blk0-blk3"), every measured "loss/fwd/blk*".
bool matches(const std::string& predicted, bool folded, const std::string& measured) {
  if (!folded) return measured == predicted;
  const size_t cut = predicted.rfind("blk");
  if (cut == std::string::npos) return measured == predicted;
  return measured.compare(0, cut + 3, predicted, 0, cut + 3) == 0;
}

double relative(int64_t measured, int64_t predicted) {
  if (predicted == 0) return measured == 0 ? 0.0 : INFINITY;
  return static_cast<double>(measured - predicted) / static_cast<double>(predicted);
}

ordered_json trace_of(const exec::TrackingAllocator& alloc) {
  ordered_json phases = ordered_json::array();
  const auto records = alloc.phase_records();
  for (size_t i = 0; i < records.size(); i += 2) {
    // Set-up before the first named phase (inputs being created) is not a phase of the grammar.
    if (records[i].phase == "init" || records[i].phase.empty()) continue;
    ordered_json p;
    p["name"] = records[i].phase;
    for (size_t s = i; s < std::min(records.size(), i + 2); ++s) {
      ordered_json cols;
      const auto& r = records[s];
      if (r.space == exec::MemorySpace::Device) {
        for (int c = 0; c < 8; ++c)
          cols[exec::category_name(static_cast<exec::Category>(c))] = r.bytes_at_peak[static_cast<size_t>(c)];
      } else {
        cols["optimizer"] = r.bytes_at_peak[static_cast<size_t>(exec::Category::Optimizer)];
        cols["boundaries"] = r.bytes_at_peak[static_cast<size_t>(exec::Category::Boundaries)];
      }
      cols["total"] = r.peak_bytes;
      p[exec::memory_space_name(r.space)] = cols;
    }
    phases.push_back(p);
  }
  return ordered_json{{"format", "flatpeak-timeline"}, {"version", 1}, {"source", "measured"}, {"unit", "bytes"}, {"phases", phases}};
}

void verify_vocab(const VerifyInputs& in, const ScaledConfig& s, const ordered_json& predicted, VerifyReport& report) {
  exec::TrackingAllocator alloc({in.alignment_bytes, -1, -1});
  exec::VocabScheduleConfig c;
  c.tokens = s.tokens;
  c.hidden = s.hidden;
  c.vocab = s.vocab;
  c.token_block_rows = s.token_block;
  c.vocab_block_rows = s.vocab_block;
  c.mode = in.vocab_mode == "materialized" ? exec::VocabScheduleMode::Materialized : exec::VocabScheduleMode::Blocked;
  c.gradients_in_forward = in.vocab_backward == "in-forward";
  const exec::VocabScheduleResult got = exec::run_vocab_schedule(alloc, c);
  if (c.mode != exec::VocabScheduleMode::Materialized) {
    exec::TrackingAllocator naive_alloc({in.alignment_bytes, -1, -1});
    exec::VocabScheduleConfig n = c;
    n.mode = exec::VocabScheduleMode::Materialized;
    const exec::VocabScheduleResult ref = exec::run_vocab_schedule(naive_alloc, n);
    report.max_abs_dloss = std::max(report.max_abs_dloss, std::fabs(got.mean_loss - ref.mean_loss));
    for (size_t i = 0; i < got.d_x.size(); ++i)
      report.max_abs_dgrad = std::max(report.max_abs_dgrad, static_cast<double>(std::fabs(got.d_x[i] - ref.d_x[i])));
    for (size_t i = 0; i < got.d_w.size(); ++i)
      report.max_abs_dgrad = std::max(report.max_abs_dgrad, static_cast<double>(std::fabs(got.d_w[i] - ref.d_w[i])));
  }
  const auto records = alloc.phase_records();
  int64_t predicted_peak = 0, measured_peak = 0;
  for (const auto& phase : predicted["phases"]) {
    const std::string name = phase["name"].get<std::string>();
    // The main loss only: the MTP losses (loss/mtpJ/...) are not run by this component yet.
    if (name.rfind("loss/fwd", 0) != 0 && name.rfind("loss/bwd", 0) != 0) continue;
    const bool folded = phase.contains("folds");
    const int64_t predicted_bytes = phase["device"]["vocab"].get<int64_t>();
    int64_t measured_bytes = 0;
    for (const auto& r : records)
      if (r.space == exec::MemorySpace::Device && matches(name, folded, r.phase))
        measured_bytes = std::max(measured_bytes, r.bytes_at_peak[static_cast<size_t>(exec::Category::Vocab)]);
    report.rows.push_back({"vocab", "device", name, predicted_bytes, measured_bytes, relative(measured_bytes, predicted_bytes)});
    predicted_peak = std::max(predicted_peak, predicted_bytes);
    measured_peak = std::max(measured_peak, measured_bytes);
  }
  report.rows.push_back({"vocab", "device", "peak", predicted_peak, measured_peak, relative(measured_peak, predicted_peak)});
  report.measured_trace = trace_of(alloc);
}

}  // namespace

std::vector<std::string> verify_components() { return {"vocab"}; }

VerifyReport run_verification(const VerifyInputs& in, const ScaledConfig& scaled,
                              const std::vector<std::string>& components, double tolerance) {
  VerifyReport report;
  report.plan_file = in.file;
  report.tolerance = tolerance;
  const ordered_json predicted = predicted_timeline(in, scaled);
  for (const auto& component : components)
    if (component == "vocab") verify_vocab(in, scaled, predicted, report);
  for (const auto& row : report.rows)
    if (!(std::fabs(row.relative_error) <= tolerance)) report.pass = false;
  return report;
}

}  // namespace flatpeak::cli
