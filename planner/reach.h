// Capacity queries on top of the knob search: how far a cluster reaches (the largest context
// each schedule fits), the smallest cluster for a context, and a side-by-side comparison of the
// schedules at one configuration with an attribution per technique.
//   Query q;  q.base.gpus = 64;  q.base.cp_auto = true;
//   std::vector<Reach> r = reach(model, hardware, q);     // baseline, practice, flatpeak
//   Comparison c = compare(model, hardware, q, 1 << 20);  // at S = 1M
// The baseline is the tuned one (DESIGN.md): the better of the optimizer on the GPU and serial
// offload, and it says which; practice, built on it, likewise.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "knob_search.h"

namespace flatpeak::planner {

struct Query {
  RunSpec base;  // N, CP (or auto), EP, GPUs per node, host memory, MTP, routing, overheads, batch
  Efficiency efficiency;
  int64_t limit_tokens = int64_t{1} << 30;  // reach never reports beyond this context
};

// One schedule (or technique set) searched at one configuration.
struct ScheduleRun {
  std::string name;           // "baseline", "practice", "flatpeak", "pipelined_llep", ...
  bool fits = false;
  SearchResult search;        // knobs, peaks (summary), step time
  OptimizerPlacement optimizer = OptimizerPlacement::Gpu;
  std::string binding() const;  // the binding peak, or "host" when only the host does not fit
};

// Searches one schedule at context S. `tuned_baseline`: baseline and practice try the optimizer
// on the GPU and serial offload and keep the one that fits (both: the faster).
// `first_fit`: only whether it fits matters (the knobs are the first that fit, not the best).
ScheduleRun run_schedule(const ModelSpec& model, const HardwareSpec& hardware, const RunSpec& spec, const Efficiency& eff,
                         LoadCache& cache, bool tuned_baseline, bool first_fit = false);

struct Reach {
  std::string schedule;
  int64_t max_context_tokens = 0;       // largest multiple of 1024 that fits (0: none)
  int64_t max_power_of_two_tokens = 0;  // largest power of two that fits
  bool at_limit = false;                // fits at the query's limit: the reach is at least that
  int64_t cp = 0;                       // the smallest allowed CP that fits the largest context
  std::string binding;                  // what stops it: the binding peak just beyond, or "host"
  ScheduleRun at_max;                   // the plan at the largest context (or at 1024 when none)
};

// Largest context for baseline, practice and flatpeak: same N, EP, routing and allowed CP set.
// Bisection over multiples of 1024 (fits is monotone in S at every CP).
std::vector<Reach> reach(const ModelSpec& model, const HardwareSpec& hardware, const Query& query);

struct TargetFit {
  std::string schedule;
  int64_t gpus = 0;  // smallest power of two N at which it fits (0: none up to max_gpus)
  int64_t cp = 0;
  ScheduleRun at;
};
// Smallest N (a power of two) and CP at which each schedule fits `context_tokens`.
std::vector<TargetFit> reach_target(const ModelSpec& model, const HardwareSpec& hardware, const Query& query,
                                    int64_t context_tokens, int64_t max_gpus = 65536);

struct TechniqueSet {
  std::string name;  // "pipelined_llep", "ring_dtp", "sco", "offload_stream_adamw"
  ScheduleRun run;
};

struct Comparison {
  std::string imbalance;       // the routing model of this comparison
  int64_t global_batch = 0;    // sequences per step, equal for every schedule
  std::vector<ScheduleRun> schedules;  // baseline (tuned), practice, flatpeak
  std::vector<TechniqueSet> alone;     // baseline + one technique
  std::vector<TechniqueSet> all_but_one;  // flatpeak without one technique
};
// The schedules side by side at one context and equal global batch (default 8·N/CP sequences,
// 8·N with --cp auto); each picks its own micro-batch and accumulation.
Comparison compare(const ModelSpec& model, const HardwareSpec& hardware, const Query& query, int64_t context_tokens);

// JSON of a run: fits, CP, micro-batch, accumulation, optimizer, knobs, peaks, GPU, host, time.
nlohmann::ordered_json schedule_run_json(const ScheduleRun& run, const ModelSpec& model);

}  // namespace flatpeak::planner
