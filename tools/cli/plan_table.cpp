#include "plan_table.h"

#include <fmt/format.h>

#include "spec/sizes.h"

namespace flatpeak::cli {

std::string format_plan_table(const planner::Plan& p) {
  using namespace planner;
  const ResolvedRun& r = p.run;
  std::string out;
  out += fmt::format("plan: {} on {} x {}, S = {}, b = {}, CP = {}{}, EP = {}, schedule {}\n", p.model.name, r.gpus,
                     p.hardware.name, format_tokens(r.context_tokens), r.micro_batch, r.cp, r.cp_auto ? " (auto)" : "",
                     r.ep, to_string(r.schedule));
  out += fmt::format("tokens per GPU T = {}, accumulation steps {}, optimizer {}, vocab {}, boundaries {}{}\n\n",
                     format_tokens(p.work.tokens), r.accumulation_steps(), to_string(r.optimizer), to_string(r.vocab),
                     to_string(r.boundaries), r.llep ? ", PipelinedLLEP" : "");
  out += fmt::format("{:<12} {:>12} {:>12}  {:<36} {:>12}\n", "peak", "bytes", "component", "phase", "baseline");
  for (const Peak& peak : p.summary.peaks) {
    const Peak& base = p.baseline.peak(peak.kind);
    out += fmt::format("{:<12} {:>12} {:>12}  {:<36} {:>12}\n", to_string(peak.kind), format_bytes(peak.bytes),
                       format_bytes(peak.component_bytes), peak.phase.empty() ? "-" : peak.phase, format_bytes(base.bytes));
  }
  const PlanSummary& s = p.summary;
  out += fmt::format("\nGPU   peak {} at {}; required {} (+ overhead {} + fragmentation {}) of {}: {}; binding {}\n",
                     format_bytes(s.gpu_peak_bytes), s.gpu_peak_phase, format_bytes(s.required_bytes),
                     format_bytes(s.overhead_bytes), format_bytes(s.fragmentation_bytes), format_bytes(s.budget_bytes),
                     s.gpu_fits ? "fits" : "DOES NOT FIT", to_string(s.binding));
  out += fmt::format("host  per node {} ({} GPUs x {} + {}) of {}: {}\n", format_bytes(s.host_peak_bytes), r.gpus_per_node,
                     format_bytes(s.host_per_gpu_bytes), format_bytes(s.host_fixed_bytes), format_bytes(s.host_budget_bytes),
                     s.host_fits ? "fits" : "DOES NOT FIT");
  const PlanSummary& b = p.baseline;
  out += fmt::format("baseline  GPU required {} ({}), binding {}; host {} ({})\n", format_bytes(b.required_bytes),
                     b.gpu_fits ? "fits" : "does not fit", to_string(b.binding), format_bytes(b.host_peak_bytes),
                     b.host_fits ? "fits" : "does not fit");
  for (const auto& w : p.warnings) out += "warning: " + w + "\n";
  return out;
}

}  // namespace flatpeak::cli
