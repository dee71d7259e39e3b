// Knob search: the knobs that minimise the step time (per token of the global batch) subject to
// every GPU peak fitting the device and the host peak fitting the host budget, over a fixed grid
// per knob (planner/README.md, "Knob search"). Knobs given on the command line are kept.
//   SearchResult r = search_knobs(model, hardware, spec, Efficiency{});
//   if (r.found) Plan p = make_plan(model, hardware, r.spec);   // the chosen knobs, exactly
//   Plan q = make_searched_plan(model, hardware, spec, Efficiency{});  // both, with reasons and time
// Ties break on step time, then GPU peak, then host peak, then the knob values in the order of
// SearchChoice (smaller first), so the answer is byte-identical across runs.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "fast_peaks.h"
#include "plan.h"
#include "step_time.h"

namespace flatpeak::planner {

// One searched knob: its value and why it has it.
struct KnobReason {
  std::string name;  // as in the plan's knobs: "chunk_cap_rows", "sco_layers", "cp", ...
  nlohmann::ordered_json value;
  std::string reason;
};

// What no knob can fix, by how much, and what would.
struct Diagnosis {
  std::string peak;         // the binding peak at the knobs shown, or "host"
  int64_t over_bytes = 0;   // required - budget there (GPU), or host peak - host budget
  std::string at;           // which knobs: the lowest GPU peak, or (host) the fastest that fit the GPU
  std::vector<std::string> remedies;
};

// The chosen knob values, in the fixed tie-break order.
struct SearchChoice {
  int64_t cp = 1, micro_batch = 1;
  int64_t chunk_cap_rows = 0;
  int64_t ring_size = 1, token_block = 0, vocab_block = 0;
  RingRotate ring_rotate = RingRotate::Weights;
  int64_t sco_layers = -1;  // first n offloaded; -1: the given set
  int64_t sco_prefetch = 0;
  int64_t bucket_params = 0, bucket_depth = 0;
};

struct SearchResult {
  bool found = false;       // some knob set fits GPU and host
  RunSpec spec;             // the input with every searched knob set to its choice
  SearchChoice choice;
  ResolvedRun run;          // the run at the choice's CP and micro-batch (knobs at their defaults)
  FastSummary summary;      // peaks at the choice (the unfolded timeline's)
  StepTime time;            // step time at the choice
  std::vector<KnobReason> reasons;  // searched knobs only
  std::optional<Diagnosis> diagnosis;  // when nothing fits
  int64_t candidates = 0;   // knob sets whose peaks were evaluated
};

struct SearchOptions {
  bool explain = true;     // knob reasons and the diagnosis (off for bulk queries)
  bool first_fit = false;  // stop at the first knob set that fits (a yes/no question: not the best)
};

// Searches the knobs `spec` leaves unset (technique knobs of techniques that are on; CP with
// --cp auto; the micro-batch when --global-batch allows more than one). Throws InputError for
// bad input (as make_plan). `cache` shares expected loads between calls (may be null).
SearchResult search_knobs(const ModelSpec& model, const HardwareSpec& hardware, const RunSpec& spec,
                          const Efficiency& efficiency, LoadCache* cache = nullptr,
                          const SearchOptions& options = SearchOptions{});

nlohmann::ordered_json diagnosis_to_json(const Diagnosis& d);

// `plan` with knob search: the real plan at the chosen knobs, with time, reasons and diagnosis.
Plan make_searched_plan(const ModelSpec& model, const HardwareSpec& hardware, const RunSpec& spec,
                        const Efficiency& efficiency);

// The knobs the search varies for this spec (empty: nothing to search).
std::vector<std::string> searchable_knobs(const ModelSpec& model, const RunSpec& spec);

// The grids (exposed for the brute-force tests).
std::vector<int64_t> chunk_cap_grid(int64_t rows);                    // T·k rows
std::vector<int64_t> token_block_grid(int64_t tokens);
std::vector<int64_t> vocab_block_grid(int64_t shard);
std::vector<int64_t> bucket_grid(int64_t shard_params);
std::vector<int64_t> ring_size_grid(int64_t gpus, int64_t gpus_per_node);

}  // namespace flatpeak::planner
