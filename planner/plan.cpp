// Assembling a plan: timeline -> five peaks -> GPU and host verdicts; --cp auto; JSON.
#include "plan.h"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "spec/sizes.h"

namespace flatpeak::planner {

const char* to_string(PeakKind kind) {
  switch (kind) {
    case PeakKind::Dispatch: return "dispatch";
    case PeakKind::Vocab: return "vocab";
    case PeakKind::Checkpoint: return "checkpoint";
    case PeakKind::Optimizer: return "optimizer";
    case PeakKind::Layer: break;
  }
  return "layer";
}

namespace {

bool starts_with(const std::string& s, const char* prefix) { return s.rfind(prefix, 0) == 0; }

// The phases where a peak can sit ("home" phases) and the categories of its own terms.
bool is_home(PeakKind kind, const std::string& phase) {
  const bool moe = phase.find("/moe/") != std::string::npos;
  const bool layer_phase = starts_with(phase, "fwd/L") || starts_with(phase, "bwd/L") ||
                           starts_with(phase, "fwd/MTP") || starts_with(phase, "bwd/MTP");
  switch (kind) {
    case PeakKind::Dispatch: return moe;
    case PeakKind::Vocab: return starts_with(phase, "loss/");
    case PeakKind::Checkpoint: return layer_phase;
    case PeakKind::Optimizer: return starts_with(phase, "opt/");
    case PeakKind::Layer: return (starts_with(phase, "fwd/") || starts_with(phase, "bwd/")) && !moe;
  }
  return false;
}

bool in_component(PeakKind kind, Category category) {
  switch (kind) {
    case PeakKind::Dispatch: return category == Category::Dispatch;
    case PeakKind::Vocab: return category == Category::Vocab;
    case PeakKind::Checkpoint: return category == Category::Boundaries;
    case PeakKind::Optimizer:
      return category == Category::Params || category == Category::Grads || category == Category::Optimizer;
    case PeakKind::Layer: return category == Category::Activations;
  }
  return false;
}

int64_t component_of(PeakKind kind, const TermList& terms) {
  int64_t sum = 0;
  for (const auto& t : terms.terms())
    if (t.space == Space::Device && in_component(kind, t.category)) sum += t.bytes;
  return sum;
}

}  // namespace

PlanSummary summarize(const Timeline& timeline, const ResolvedRun& run, const HardwareSpec& hardware) {
  PlanSummary s;
  for (int k = 0; k < kPeakCount; ++k) {
    const auto kind = static_cast<PeakKind>(k);
    Peak& peak = s.peaks[static_cast<size_t>(k)];
    peak.kind = kind;
    const Phase* best = nullptr;
    int64_t best_component = -1, best_total = -1;
    for (const Phase& p : timeline.phases) {
      if (!is_home(kind, p.name)) continue;
      const int64_t comp = component_of(kind, p.terms);
      const int64_t total = p.device_bytes();
      // The phase where the component is largest; ties go to the larger total, then the earlier.
      if (comp > best_component || (comp == best_component && total > best_total)) {
        best = &p;
        best_component = comp;
        best_total = total;
      }
    }
    if (!best) continue;
    peak.bytes = best_total;
    peak.component_bytes = best_component;
    peak.phase = best->name;
    for (const auto& t : best->terms.terms())
      if (t.space == Space::Device && in_component(kind, t.category)) peak.terms.push_back(t);
  }
  for (const Phase& p : timeline.phases) {
    if (p.device_bytes() > s.gpu_peak_bytes) {
      s.gpu_peak_bytes = p.device_bytes();
      s.gpu_peak_phase = p.name;
    }
  }
  // Binding: at the GPU's peak phase, the peak (of those whose home that phase is) whose own
  // component is largest there; e.g. the dispatch block running with many boundaries resident.
  const Phase* top = nullptr;
  for (const Phase& p : timeline.phases)
    if (p.name == s.gpu_peak_phase) top = &p;
  int64_t best_share = -1;
  for (int k = 0; top && k < kPeakCount; ++k) {
    const auto kind = static_cast<PeakKind>(k);
    if (!is_home(kind, top->name)) continue;
    const int64_t share = component_of(kind, top->terms);
    if (share > best_share) {
      best_share = share;
      s.binding = kind;
    }
  }
  // The model state (params + grads + optimizer on the device, the optimizer peak's component)
  // does not shrink with the context: when it alone needs more than the GPU, it is what runs out
  // first, whatever is largest at the peak phase.
  const int64_t state = s.peak(PeakKind::Optimizer).component_bytes;
  if (state > 0 && checked_add(checked_add(state, run.overhead_bytes),
                               static_cast<int64_t>(std::ceil(run.fragmentation * static_cast<double>(state)))) > hardware.device_memory_bytes)
    s.binding = PeakKind::Optimizer;
  s.overhead_bytes = run.overhead_bytes;
  s.fragmentation_bytes = static_cast<int64_t>(std::ceil(run.fragmentation * static_cast<double>(s.gpu_peak_bytes)));
  s.required_bytes = checked_add(checked_add(s.gpu_peak_bytes, s.overhead_bytes), s.fragmentation_bytes);
  s.budget_bytes = hardware.device_memory_bytes;
  s.gpu_fits = s.required_bytes <= s.budget_bytes;

  s.host_per_gpu_bytes = timeline.host_per_gpu.bytes(Space::Host);
  s.host_fixed_bytes = run.host_fixed_bytes_per_node;
  s.host_peak_bytes = checked_add(checked_mul(run.gpus_per_node, s.host_per_gpu_bytes), s.host_fixed_bytes);
  s.host_budget_bytes = static_cast<int64_t>(std::floor(run.host_usable_fraction * static_cast<double>(run.host_memory_bytes_per_node)));
  s.host_fits = s.host_peak_bytes <= s.host_budget_bytes;
  return s;
}

namespace {

Plan make_plan_fixed(const ModelSpec& model, const HardwareSpec& hardware, const ResolvedRun& run);

// SCO's "auto" layer set: the fewest first layers whose boundaries go to the host such that the
// GPU fits (the GPU requirement only falls as more layers are offloaded); all when none fits.
ResolvedRun choose_sco_layers(const ModelSpec& model, const HardwareSpec& hardware, ResolvedRun run) {
  const auto L = static_cast<int64_t>(run.sco_offloaded.size());
  auto with_first = [&](int64_t n) {
    ResolvedRun r = run;
    for (int64_t i = 0; i < L; ++i) r.sco_offloaded[static_cast<size_t>(i)] = i < n;
    return r;
  };
  int64_t lo = 0, hi = L;  // smallest n in [lo, hi] that fits; hi when none does
  if (!make_plan_fixed(model, hardware, with_first(L)).summary.gpu_fits) return with_first(L);
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (make_plan_fixed(model, hardware, with_first(mid)).summary.gpu_fits) hi = mid;
    else lo = mid + 1;
  }
  ResolvedRun r = with_first(lo);
  for (auto& k : r.knobs)
    if (k.name == "sco_layers") k.value = std::to_string(lo);
  return r;
}

}  // namespace

Plan make_plan_resolved(const ModelSpec& model, const HardwareSpec& hardware, const ResolvedRun& run) {
  if (run.boundaries == BoundaryMode::Sco && run.sco_layers_text == "auto")
    return make_plan_fixed(model, hardware, choose_sco_layers(model, hardware, run));
  return make_plan_fixed(model, hardware, run);
}

namespace {

Plan make_plan_fixed(const ModelSpec& model, const HardwareSpec& hardware, const ResolvedRun& run) {
  Plan p;
  p.model = model;
  p.hardware = hardware;
  p.run = run;
  p.work = make_workload(p.model, p.run);
  p.timeline = build_timeline(Context{p.model, p.run, p.work});
  p.summary = summarize(p.timeline, p.run, p.hardware);
  p.time = estimate_step_time(p.model, p.hardware, p.run, p.work, Efficiency{});
  p.warnings = run.warnings;
  for (const auto& load : p.work.moe_loads)
    if (!load.clamp_note.empty()) {
      p.warnings.push_back(load.clamp_note);
      break;
    }
  if (p.run.llep && !p.work.moe_loads.empty()) {
    // reference/dispatch.md §2.7 and §5.5: where LLA's bound and the cap's GEMM sizes degrade.
    const MoeLoad& load = p.work.moe_loads.front();
    const int64_t m = p.run.llep_min_rows;
    if (load.send_rows < 4 * p.run.ep * m)
      p.warnings.push_back(fmt::format("LLEP: T x k = {} rows per rank is below 4 x EP x m = {}: the least-loaded "
                                       "assignment may overflow its capacity by up to (EP-1) x m rows",
                                       load.send_rows, 4 * p.run.ep * m));
    if (p.run.chunk_cap_rows > 0) {
      const double want = static_cast<double>(m) * static_cast<double>(p.work.experts_per_rank + load.foreign_experts) /
                          std::max(1.0, load.rho_llep);
      if (static_cast<double>(load.chunk_cap_rows) < want && load.rounds > 1)
        p.warnings.push_back(fmt::format("PipelinedLLEP: cap C = {} is below m x (E/EP + S_p) / rho_L = {:.0f}: expert "
                                         "GEMMs get fewer than m = {} rows per round",
                                         load.chunk_cap_rows, want, m));
    }
  }
  if (p.model.tie_word_embeddings) {
    // planner/README.md "Tied embeddings": the head's W and dW are counted at the loss as for an
    // untied head, but the reduction of that dW into the embedding's shard is not (and the step
    // component, which refuses a tied head, cannot measure it). 4·V·H bytes: FSDP2's root unit
    // keeping the tied table (bf16) and its unsharded gradient (bf16) through the backward, or
    // an fp32 reduce-scatter input of the table beside the last layer's backward. V, H < 2^30.
    const int64_t extra = 4 * p.model.vocab_size * p.model.hidden_size;
    p.warnings.push_back(fmt::format("tie_word_embeddings: this plan does not reduce the LM head's gradient into the "
                                     "tied embedding's shard; expect up to 4 x V x H bytes = {} more per GPU in the "
                                     "backward (planner/README.md, \"Tied embeddings\")",
                                     format_bytes(extra)));
  }
  return p;
}

}  // namespace

namespace {

RunSpec baseline_spec(const RunSpec& spec) {
  RunSpec b;
  b.gpus = spec.gpus;
  b.context_tokens = spec.context_tokens;
  b.micro_batch = spec.micro_batch;
  b.global_batch = spec.global_batch;
  b.ep = spec.ep;
  b.gpus_per_node = spec.gpus_per_node;
  b.host_memory_bytes_per_node = spec.host_memory_bytes_per_node;
  b.mtp = spec.mtp;
  b.imbalance = spec.imbalance;
  b.overhead_bytes = spec.overhead_bytes;
  b.fragmentation = spec.fragmentation;
  b.schedule = Schedule::Baseline;
  // DESIGN.md: the baseline keeps the optimizer on the GPU unless --optimizer serial is given.
  if (spec.optimizer == OptimizerPlacement::Serial) b.optimizer = OptimizerPlacement::Serial;
  return b;
}

}  // namespace

Plan make_plan(const ModelSpec& model, const HardwareSpec& hardware, const RunSpec& spec) {
  Plan plan;
  if (!spec.cp_auto) {
    InputErrors errs;
    const ResolvedRun run = resolve_run(model, hardware, spec, errs);
    errs.throw_if_any();
    plan = make_plan_resolved(model, hardware, run);
  } else {
    bool have = false;
    int64_t tried = 0;
    for (int64_t cp = 1; cp <= spec.gpus; cp *= 2) {
      if (spec.gpus % cp != 0 || spec.context_tokens % cp != 0) continue;
      InputErrors errs;
      const ResolvedRun run = resolve_run(model, hardware, spec, errs, cp);
      if (!errs.empty()) {
        if (!have) errs.throw_if_any();
        break;  // a knob that held at smaller CP no longer does: keep the last valid plan
      }
      plan = make_plan_resolved(model, hardware, run);
      have = true;
      tried = cp;
      if (plan.summary.fits()) break;
    }
    if (!plan.summary.fits())
      plan.warnings.push_back(fmt::format("--cp auto: no power-of-two CP up to {} fits; showing CP = {}", tried, tried));
  }
  // The baseline schedule at the same placement (N, CP, EP, batch, routing).
  RunSpec base = baseline_spec(spec);
  InputErrors errs;
  const ResolvedRun base_run = resolve_run(model, hardware, base, errs, plan.run.cp);
  if (errs.empty()) plan.baseline = make_plan_resolved(model, hardware, base_run).summary;
  else plan.baseline = plan.summary;
  return plan;
}

}  // namespace flatpeak::planner
