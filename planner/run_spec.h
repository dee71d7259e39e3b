// Run settings of one `plan`: the command-line flags as given (RunSpec, every value optional), and
// the settings resolved against a model and a hardware card (ResolvedRun: every knob has a value
// and the reason for it). Validation reports every problem in one pass.
//   InputErrors errs;
//   RunSpec spec = parse_run_flags({{"--gpus", "8"}, {"--context", "1M"}}, errs);
//   ResolvedRun run = resolve_run(model, hardware, spec, errs);  errs.throw_if_any();
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "spec/errors.h"
#include "spec/hardware_spec.h"
#include "spec/model_spec.h"
#include "spec/routing.h"

namespace flatpeak::planner {

enum class Schedule { Baseline, Practice, Flatpeak };
enum class OptimizerPlacement { Gpu, Serial, Stream };   // stream = OffloadStreamAdamW
enum class VocabMode { Materialized, Blocked, RingDtp }; // blocked = R = 1 chunked cross-entropy
enum class BoundaryMode { Device, SyncOffload, Sco };
enum class DispatchMode { Store, Recompute };
enum class RingRotate { Activations, Weights };
enum class VocabBackward { Recompute, InForward };

const char* to_string(Schedule v);
const char* to_string(OptimizerPlacement v);
const char* to_string(VocabMode v);
const char* to_string(BoundaryMode v);
const char* to_string(DispatchMode v);
const char* to_string(RingRotate v);
const char* to_string(VocabBackward v);

// One `plan` flag: its name, the text shown in --help, and the valid values for messages.
struct FlagInfo {
  const char* name;   // "--chunk-cap-rows"
  const char* help;
  const char* valid;  // "a positive integer (token copies)"
};
// Every run flag `plan` accepts besides --model, --gpu and --format, in --help order.
const std::vector<FlagInfo>& run_flags();

// The flags as given. Unset optionals take their defaults in resolve_run.
struct RunSpec {
  int64_t gpus = 0;            // N
  int64_t context_tokens = 0;  // S
  std::optional<int64_t> micro_batch;   // b
  std::optional<int64_t> global_batch;  // sequences per step
  std::optional<int64_t> cp;            // CP; unset with cp_auto = false means 1
  bool cp_auto = false;
  std::optional<int64_t> ep;
  std::optional<int64_t> gpus_per_node;
  std::optional<int64_t> host_memory_bytes_per_node;
  std::optional<bool> mtp;
  Schedule schedule = Schedule::Baseline;
  std::optional<OptimizerPlacement> optimizer;
  std::optional<std::string> imbalance;
  std::optional<int64_t> overhead_bytes;
  std::optional<double> fragmentation;

  // Technique switches (unset: the schedule decides).
  std::optional<bool> llep;
  std::optional<bool> ring_dtp;
  std::optional<bool> sco;

  // PipelinedLLEP knobs.
  std::optional<int64_t> chunk_cap_rows;  // 0 = no cap (plain LLEP)
  std::optional<DispatchMode> dispatch_mode;
  std::optional<double> llep_alpha;
  std::optional<double> llep_lambda;
  std::optional<int64_t> llep_min_rows;
  std::optional<bool> striping;
  std::optional<int64_t> dispatch_depth;

  // Ring-DTP knobs.
  std::optional<int64_t> ring_size;
  std::optional<RingRotate> ring_rotate;  // unset = auto (bytes per hop)
  std::optional<VocabBackward> vocab_backward;
  std::optional<int64_t> token_block;
  std::optional<int64_t> vocab_block;

  // SCO knobs.
  std::optional<std::string> sco_layers;  // "all", a count "12", or a set "0,1,5-9"
  std::optional<int64_t> sco_prefetch;

  // OffloadStreamAdamW knobs.
  std::optional<int64_t> bucket_params;
  std::optional<int64_t> bucket_depth;
};

// Parses flag values given as text ("--context" -> "1M"); unknown flags and bad values are added
// to errs (each naming the flag, the rule with the value, and the valid values).
RunSpec parse_run_flags(const std::vector<std::pair<std::string, std::string>>& flags, InputErrors& errs);

// A knob or input setting and why it has its value.
struct Knob {
  std::string name;
  nlohmann::ordered_json value;
  std::string reason;  // "given", "default", "schedule practice", "default: <rule>"
};

// Everything a plan needs, resolved. Technique flags say what is on; knobs of a technique that
// is off keep their defaults but are not listed.
struct ResolvedRun {
  int64_t gpus = 0;            // N
  int64_t context_tokens = 0;  // S
  int64_t micro_batch = 1;     // b
  int64_t global_batch = 0;
  int64_t cp = 1;
  bool cp_auto = false;
  int64_t ep = 1;
  int64_t gpus_per_node = 1;
  int64_t host_memory_bytes_per_node = 0;
  double host_usable_fraction = 0.85;
  int64_t host_fixed_bytes_per_node = 0;
  bool mtp = false;
  Schedule schedule = Schedule::Baseline;
  OptimizerPlacement optimizer = OptimizerPlacement::Gpu;
  RoutingModel imbalance;
  int64_t overhead_bytes = 0;
  bool overhead_calibrated = false;  // overhead_bytes is the card's measured figure (not a default or --overhead)
  OverheadTerms overhead_terms;      // its parts, when the card gives them (and no --overhead)
  double fragmentation = 0.05;
  int64_t alignment_bytes = 1;

  bool llep = false;
  int64_t chunk_cap_rows = 0;  // 0: no cap
  DispatchMode dispatch_mode = DispatchMode::Store;
  double llep_alpha = 1.1;
  double llep_lambda = 1.3;
  int64_t llep_min_rows = 1024;
  bool striping = true;
  int64_t dispatch_depth = 2;

  VocabMode vocab = VocabMode::Materialized;
  int64_t ring_size = 1;
  RingRotate ring_rotate = RingRotate::Weights;
  VocabBackward vocab_backward = VocabBackward::Recompute;
  int64_t token_block = 0;  // tokens per block of logits
  int64_t vocab_block = 0;  // vocabulary entries per block of logits

  BoundaryMode boundaries = BoundaryMode::Device;
  std::vector<bool> sco_offloaded;  // per decoder layer: boundary offloaded to host
  std::string sco_layers_text;
  int64_t sco_prefetch = 1;

  int64_t bucket_params = 0;
  int64_t bucket_depth = 2;

  std::vector<Knob> knobs;
  std::vector<std::string> warnings;

  int64_t dp() const { return gpus / cp; }
  int64_t tokens_per_gpu() const { return micro_batch * context_tokens / cp; }  // T
  int64_t accumulation_steps() const { return global_batch / (micro_batch * dp()); }
};

// Defaults documented in planner/README.md.
inline constexpr int64_t kDefaultOverheadBytes = int64_t{3} << 30;  // 3 GiB
inline constexpr double kDefaultFragmentation = 0.05;
inline constexpr double kHostUsableFraction = 0.85;
inline constexpr int64_t kHostFixedBytesPerNode = int64_t{16} << 30;  // 16 GiB
inline constexpr int64_t kDefaultBucketParams = int64_t{64} << 20;    // 64 Mi params
inline constexpr int64_t kDefaultTokenBlock = 8192;
// Input bounds far above any real cluster, so that N x 64 (the diagnosis tries up to 64N GPUs),
// N x tokens and peak + overhead stay inside 64 bits.
inline constexpr int64_t kMaxGpus = int64_t{1} << 24;           // 16Mi GPUs
inline constexpr int64_t kMaxOverheadBytes = int64_t{1} << 50;  // 1 PiB per GPU
inline constexpr int64_t kMaxTokensPerGpu = int64_t{1} << 32;   // b x S / CP: the routing model's range

// Resolves the flags against a model and hardware card: defaults, schedule presets, and every
// cross-field rule (EP divides N and E, CP divides N and S, ring size divides N, knob ranges,
// contradictory switches). Problems are added to errs; the result is meaningful only when errs
// stays empty. `cp_override` replaces the CP (used by --cp auto's search).
ResolvedRun resolve_run(const ModelSpec& model, const HardwareSpec& hardware, const RunSpec& spec,
                        InputErrors& errs, std::optional<int64_t> cp_override = std::nullopt);

// The default EP: the largest divisor of both N and E that is ≤ gpus_per_node (1 for dense models).
int64_t default_ep(int64_t gpus, int64_t experts, int64_t gpus_per_node);

}  // namespace flatpeak::planner
