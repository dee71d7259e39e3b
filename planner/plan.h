// A plan: the resolved inputs and knobs, the predicted timeline, the five peaks, whether the GPU
// and the host fit, and the same summary for the baseline schedule. One JSON document.
//   Plan p = make_plan(model, hardware, spec);      // InputError lists every bad flag
//   nlohmann::ordered_json j = plan_to_json(p);      // schema_version 1, stable key order
//   int exit_code = p.summary.fits() ? 0 : 3;
#pragma once

#include <array>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "run_spec.h"
#include "step_time.h"
#include "timeline.h"
#include "workload.h"

namespace flatpeak::planner {

inline constexpr int kPlanSchemaVersion = 1;

enum class PeakKind { Dispatch, Vocab, Checkpoint, Optimizer, Layer };
inline constexpr int kPeakCount = 5;
const char* to_string(PeakKind kind);

struct Peak {
  PeakKind kind = PeakKind::Layer;
  int64_t bytes = 0;            // total tracked device memory at `phase`
  int64_t component_bytes = 0;  // this peak's own terms at `phase`
  std::string phase;            // "" when the step has no such phase (dispatch of a dense model)
  std::vector<Term> terms;      // the component's terms at `phase`
};

// The summary of one schedule: five peaks, the GPU and the host against their budgets.
struct PlanSummary {
  std::array<Peak, kPeakCount> peaks;
  int64_t gpu_peak_bytes = 0;
  std::string gpu_peak_phase;
  int64_t overhead_bytes = 0;
  int64_t fragmentation_bytes = 0;
  int64_t required_bytes = 0;  // peak + overhead + fragmentation × peak
  int64_t budget_bytes = 0;    // the device's reported memory
  bool gpu_fits = false;
  PeakKind binding = PeakKind::Layer;
  int64_t host_per_gpu_bytes = 0;
  int64_t host_fixed_bytes = 0;
  int64_t host_peak_bytes = 0;    // per node: gpus_per_node × per GPU + fixed
  int64_t host_budget_bytes = 0;  // per node: host DRAM × usable fraction
  bool host_fits = false;
  bool fits() const { return gpu_fits && host_fits; }
  const Peak& peak(PeakKind kind) const { return peaks[static_cast<size_t>(kind)]; }
};

struct Plan {
  ModelSpec model;
  HardwareSpec hardware;
  ResolvedRun run;
  Workload work;
  Timeline timeline;
  PlanSummary summary;
  PlanSummary baseline;
  std::vector<std::string> warnings;
  StepTime time;                     // step_time.h, at default efficiencies unless the search set them
  nlohmann::ordered_json diagnosis;  // knob_search.h: when no knob set fits (null otherwise)
};

// The peaks and budgets of a computed timeline.
PlanSummary summarize(const Timeline& timeline, const ResolvedRun& run, const HardwareSpec& hardware);

// Resolves, builds the timeline and summarises it; --cp auto tries CP = 1, 2, 4, ... (powers of
// two dividing N and S) and keeps the first that fits (the largest tried when none does).
Plan make_plan(const ModelSpec& model, const HardwareSpec& hardware, const RunSpec& spec);

// Resolved run -> plan without the CP search and without the baseline summary.
Plan make_plan_resolved(const ModelSpec& model, const HardwareSpec& hardware, const ResolvedRun& run);

nlohmann::ordered_json plan_to_json(const Plan& plan);
nlohmann::ordered_json timeline_to_json(const Timeline& timeline);

// The keys plan_to_json writes in the objects that describe a plan's inputs (the top level,
// /inputs, its model, hardware, run and params, /inputs/run/overhead_terms) with the JSON kind of
// each, and the names of the knobs under /knobs: one list for the writer and for readers of plans
// (verify), which reject any other key. tests/unit/verify_plan_fields_test.cpp checks that every
// plan written passes and that every key listed is written.
enum class PlanFieldKind { Integer, Number, Bool, String, Object, Array };
struct PlanField {
  const char* key;
  PlanFieldKind kind;
};
struct PlanObject {
  const char* pointer;  // "" (the top level), "/inputs/model", ...
  std::vector<PlanField> fields;
};
const std::vector<PlanObject>& plan_json_objects();
// Every knob name a plan can carry under /knobs (run_spec.cpp's knobs, cp and micro_batch when
// searched); each knob is {"value": ..., "reason": "..."}.
const std::vector<std::string>& plan_knob_names();

}  // namespace flatpeak::planner
