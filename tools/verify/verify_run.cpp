// `flatpeak verify`: the components and their order (verify_run.h). Each component plans the
// scaled configuration, runs it with the executor and appends its rows (verify_<component>.cpp);
// on more than one rank, its multi-rank function runs on every rank (verify_ranks.h).
#include "verify_run.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <exception>

#include <fmt/format.h>

#include "executor/comm/communicator.h"
#include "verify_common.h"
#include "verify_ranks.h"

namespace flatpeak::cli {

namespace {

using ComponentRun = void (*)(const VerifyContext&, VerifyReport&);
// Whether run_multi_rank runs this plan (else `why_not` says why, and rank 0 runs `run` alone);
// throws UnsupportedPlan for a plan the component does not run at all. Same answer on every rank.
using MultiRankCheck = bool (*)(const VerifyContext&, std::string& why_not);

struct Component {
  const char* name;
  ComponentRun run;              // one rank
  ComponentRun run_multi_rank;   // every rank of a multi-rank configuration; nullptr: one rank only
  MultiRankCheck runs_on_ranks;  // nullptr: run_multi_rank runs every multi-rank plan
  bool implemented;              // false: refused by --component, skipped by default
};

// Report order: the techniques' components first, then the layer and the whole step.
const Component kComponents[] = {
    {"dispatch", verify_dispatch, verify_dispatch_ranks, nullptr, true},
    {"vocab", verify_vocab, verify_vocab_ring, nullptr, true},
    {"checkpoint", verify_checkpoint, nullptr, nullptr, true},
    {"optimizer", verify_optimizer, nullptr, nullptr, true},
    {"layer", verify_layer, verify_layer_ranks, layer_runs_on_ranks, true},
    {"step", verify_step, verify_step_ranks, step_runs_on_ranks, true},
};

// Runs a single-rank component on this process. When several components run (the default), one
// that refuses the plan's shape (UnsupportedPlan: a model or layout the executor does not run) is
// skipped with a note in place of whatever it noted; asked for alone, the refusal is the input
// error it is (exit 2).
void run_single(const Component& c, const VerifyContext& ctx, VerifyReport& report, bool skippable, size_t notes_before) {
  if (!skippable) {
    c.run(ctx, report);
    return;
  }
  try {
    c.run(ctx, report);
  } catch (const UnsupportedPlan& e) {
    std::string why;
    for (const auto& d : e.diagnostics()) why += (why.empty() ? "" : "; ") + d.pointer + ": " + d.message;
    report.notes.resize(notes_before);
    report.notes.push_back(std::string(c.name) + ": not run (" + why + ")");
  }
}

}  // namespace

bool row_passes(const VerifyRow& row, double tolerance) {
  if (!row.judged) return true;
  // A "bound" row states an upper bound: it passes when the measurement stays at or under it.
  if (row.phase == "bound") return row.measured_bytes <= row.predicted_bytes;
  const double allowed = row.tolerance >= 0.0 ? row.tolerance : tolerance;
  if (row.slack_bytes > 0)
    return std::fabs(static_cast<double>(row.measured_bytes - row.predicted_bytes)) <=
           allowed * static_cast<double>(row.predicted_bytes) + static_cast<double>(row.slack_bytes);
  return std::fabs(row.relative_error) <= allowed;
}

void set_aside_unresolved_rows(VerifyReport& report, double tolerance, int64_t unit_bytes, double factor) {
  const int64_t resolved_bytes = kMinResolvedUnits * unit_bytes;
  int64_t smallest = 0;  // the smallest predicted size set aside
  for (auto& row : report.rows) {
    if (!row.judged || row.phase == "bound" || row.slack_bytes > 0 || row.predicted_bytes <= 0) continue;
    const int64_t miss = std::abs(row.measured_bytes - row.predicted_bytes);
    if (row_passes(row, tolerance) || row.predicted_bytes >= resolved_bytes || miss > unit_bytes) continue;
    row.judged = false;
    row.below_resolution = true;
    ++report.unresolved_rows;
    if (smallest == 0 || row.predicted_bytes < smallest) smallest = row.predicted_bytes;
  }
  if (report.unresolved_rows == 0) return;
  // Sizes grow at least linearly as the factor falls: at this one the smallest row holds 100 units.
  report.resolving_scale = std::floor(factor * static_cast<double>(smallest) / static_cast<double>(resolved_bytes));
  report.unresolved_note = fmt::format(
      "{} row{} not judged: off by one {}-byte allocation unit at a size ({} B) under {} units, where one unit is more than 1%; {}",
      report.unresolved_rows, report.unresolved_rows == 1 ? "" : "s", unit_bytes, smallest, kMinResolvedUnits,
      report.resolving_scale >= 1.0 ? fmt::format("--scale {:.0f} or smaller judges {}", report.resolving_scale,
                                                  report.unresolved_rows == 1 ? "it" : "them")
                                    : std::string("the plan itself is this small: a larger --tolerance judges it"));
  report.notes.push_back(report.unresolved_note);
}

std::vector<std::string> verify_components() {
  std::vector<std::string> names;
  for (const auto& c : kComponents)
    if (c.implemented) names.emplace_back(c.name);
  return names;
}

VerifyReport run_verification(const VerifyInputs& in, const ScaledConfig& scaled,
                              const std::vector<std::string>& components, double tolerance,
                              const PredictionAdjust& adjust, exec::Communicator* world) {
  VerifyReport report;
  report.plan_file = in.file;
  report.tolerance = tolerance;
  report.ranks = static_cast<int>(scaled.ranks);
  report.launcher = world != nullptr ? world->backend_name() : "threads";
  const bool multi_rank = scaled.ranks > 1;
  const int my_rank = world != nullptr ? world->rank() : 0;
  const VerifyContext ctx{in, scaled, adjust};
  size_t requested = 0;
  for (const auto& c : kComponents)
    if (c.implemented && std::find(components.begin(), components.end(), c.name) != components.end()) ++requested;
  const bool skippable = requested > 1;
  for (const auto& c : kComponents) {
    if (!c.implemented || std::find(components.begin(), components.end(), c.name) == components.end()) continue;
    std::string why_not;  // why a multi-rank component runs on rank 0 alone
    bool on_ranks = multi_rank && c.run_multi_rank != nullptr;
    if (on_ranks && c.runs_on_ranks != nullptr) {
      try {
        on_ranks = c.runs_on_ranks(ctx, why_not);
      } catch (const UnsupportedPlan& e) {
        if (!skippable) throw;
        std::string why;
        for (const auto& d : e.diagnostics()) why += (why.empty() ? "" : "; ") + d.pointer + ": " + d.message;
        report.notes.push_back(std::string(c.name) + ": not run (" + why + ")");
        continue;
      }
    }
    if (on_ranks) {
      VerifyReport part = run_component_on_ranks(c.run_multi_rank, in, scaled, adjust, static_cast<int>(scaled.ranks), world);
      report.rows.insert(report.rows.end(), part.rows.begin(), part.rows.end());
      report.max_abs_dloss = std::max(report.max_abs_dloss, part.max_abs_dloss);
      report.max_abs_dgrad = std::max(report.max_abs_dgrad, part.max_abs_dgrad);
      report.notes.insert(report.notes.end(), part.notes.begin(), part.notes.end());
      if (!part.measured_trace.is_null()) report.measured_trace = part.measured_trace;
      continue;
    }
    const size_t notes_before = report.notes.size();
    if (multi_rank)
      report.notes.push_back(std::string(c.name) + ": " + (why_not.empty() ? "no multi-rank run yet" : why_not) +
                             "; ran on rank 0 alone, with one rank's prediction");
    if (world == nullptr) {
      run_single(c, ctx, report, skippable, notes_before);
      continue;
    }
    // Under MPI only rank 0 runs it; its failure is agreed at once so no peer waits for it.
    int code = 0;
    std::string message;
    if (my_rank == 0) {
      try {
        run_single(c, ctx, report, skippable, notes_before);
      } catch (const std::exception& e) {
        code = exec::exit_code_for_current_exception();
        message = e.what();
      }
    }
    world->check_status(code, message);
  }
  set_aside_unresolved_rows(report, tolerance, in.alignment_bytes, scaled.factor);
  for (const auto& row : report.rows)
    if (!row_passes(row, tolerance)) report.pass = false;
  if (world != nullptr) {
    // Every process exits with the same code: rank 0's verdict is the job's (2: unresolved).
    int64_t verdict = my_rank != 0 ? 0 : !report.pass ? 2 : report.unresolved_rows > 0 ? 1 : 0;
    world->all_reduce(&verdict, &verdict, 1, exec::DType::I64, exec::ReduceOp::Max);
    report.pass = verdict != 2;
    if (my_rank != 0 && verdict == 1) report.unresolved_rows = 1;  // rank 0's rows say which
  }
  return report;
}

}  // namespace flatpeak::cli
