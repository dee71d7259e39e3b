// `flatpeak verify`: reading a plan's inputs and knobs (never its predictions) and scaling them to
// a configuration one CPU rank runs in seconds, with every scaled value listed.
//   VerifyInputs in = read_plan_inputs(plan_json, "plan.json");   // InputError names the field
//   ScaledConfig s = scale_config(in, std::nullopt);                // --scale auto
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "spec/errors.h"
#include "spec/hardware_spec.h"
#include "spec/model_spec.h"

namespace flatpeak::cli {

// What verify reads from a plan: /inputs and /knobs only.
struct VerifyInputs {
  std::string file;
  std::string model_name;     // /inputs/model/name
  std::string hardware_name;  // /inputs/hardware/name
  // /inputs/model/source and /inputs/hardware/source: "embedded:..." for a built-in card, else
  // the file the planner read (a card or a Hugging Face config.json), which verify reads again.
  std::string model_source, hardware_source;
  // The model and hardware those name, read once by read_plan_inputs (load_plan_model).
  std::shared_ptr<const ModelSpec> model;
  std::shared_ptr<const HardwareSpec> hardware;
  int64_t alignment_bytes = 1;  // /inputs/hardware/allocation_alignment_bytes
  int64_t gpus = 0, ep = 1, cp = 1, tokens_per_gpu = 0, micro_batch = 1;
  int64_t hidden = 0, vocab = 0, layers = 0;
  int64_t num_experts = 0, top_k = 0;  // /inputs/model/num_experts, top_k (0: a dense model)
  // The layer's shape (/inputs/model/attention, num_heads, num_kv_heads, head_dim,
  // shared_expert_ffn_width); 0 where the plan does not say.
  std::string attention = "gqa";
  int64_t num_heads = 0, num_kv_heads = 0, head_dim = 0, shared_expert_ffn = 0;
  bool has_shared_expert_ffn = false;       // the plan records shared_expert_ffn_width
  std::optional<bool> shared_expert_gate;  // /inputs/model/shared_expert_gate, where the plan says
  int64_t expert_ffn_width = 0;        // /inputs/model/expert_ffn_width
  std::string schedule;  // baseline | practice | flatpeak
  bool mtp = false;                // /inputs/run/mtp (absent: false): MTP modules trained
  int64_t accumulation_steps = 1;  // /inputs/run/accumulation_steps (absent: 1)
  // /inputs/run/overhead_bytes and overhead_calibrated (absent: 0, false): what the device holds
  // beside the tensors (CUDA context, cuBLAS, NCCL); the cuda backend's device-view row uses them.
  int64_t overhead_bytes = 0;
  bool overhead_calibrated = false;
  int64_t overhead_nccl_bytes = 0;  // /inputs/run/overhead_terms/nccl_bytes (absent: 0)
  // Knobs (/knobs/<name>/value); absent ones are off.
  std::string vocab_mode = "materialized";   // materialized | blocked | ring-dtp
  std::string vocab_backward = "recompute";
  int64_t ring_size = 1, token_block = 0, vocab_block = 0;
  std::string imbalance = "balanced";  // /inputs/run/imbalance (routing model)
  // Every knob as written (/knobs/<name>/value), for the components that read their own knobs
  // (dispatch: chunk_cap_rows, dispatch_mode, ...; checkpoint: boundaries, sco_layers, ...;
  // optimizer: optimizer, bucket_params, bucket_depth). A component checks its knobs itself and
  // throws InputError naming /knobs/<name>/value.
  nlohmann::json knob_values = nlohmann::json::object();
};

// Throws InputError (exit 2) for another schema_version, a missing or mistyped field, knobs
// that contradict the inputs, and whatever check_plan_fields finds; every problem in one pass.
VerifyInputs read_plan_inputs(const nlohmann::json& plan, const std::string& file);

// The plan's model and hardware as the planner read them: the built-in card by name, or the file
// named by /inputs/{model,hardware}/source (relative to where verify runs, as the planner read
// it). read_plan_inputs reads them once; these return that copy. InputError (exit 2) naming the
// source field when it cannot be read any more, and naming the field when the file now gives
// other dims than the plan (it changed since the plan was made).
ModelSpec load_plan_model(const VerifyInputs& in);
HardwareSpec load_plan_hardware(const VerifyInputs& in);

// The fields verify does not use, checked so that no value in a plan is silently ignored: every
// key of the top level, /inputs, its model, hardware, run and params and of /knobs is one that
// plan_to_json writes (planner::plan_json_objects, plan_knob_names; else a did-you-mean), of
// the kind it writes, and the derived fields agree with their sources (T = b·S/CP, DP = N/CP,
// accumulation = global batch / (b·DP), E/EP per rank, MLA head dims, the layer pattern, ...).
// Adds one diagnostic per problem, naming both fields and their values; a pointer already in
// `errs` gets no second one (verify_plan_fields.cpp).
void check_plan_fields(const nlohmann::json& plan, const std::string& file, InputErrors& errs);

struct ScaledValue {
  std::string name;
  int64_t original = 0;
  int64_t scaled = 0;
};

// The configuration verify runs: one rank; T, H, V, L smaller; blocks scaled with T and V so the
// number of token blocks and of vocabulary blocks per shard are kept.
struct ScaledConfig {
  double factor = 1.0;  // T / T_scaled
  std::optional<double> asked_factor;  // --scale FACTOR as given (T, H, V divided by it, rounded up)
  // Ranks verify runs: min(N, max_ranks). Above max_ranks, N and EP shrink together keeping
  // E/EP, k and N/EP, so the experts become ep · E/EP.
  int64_t ranks = 1, ep = 1, num_experts = 0;
  int64_t tokens = 0, hidden = 0, vocab = 0, layers = 0, token_block = 0, vocab_block = 0;
  // Layer (scale_layer_dims): a, g and d shrunk with H, keeping the query heads per kv head;
  // MLA: a (= g), d and dv shrunk with H, d split into nope and rope in the card's ratio, and the
  // q and kv latents shrunk with H (q_lora 0 stays 0).
  int64_t q_heads = 0, kv_heads = 0, head_dim = 0;
  int64_t v_head_dim = 0, q_lora = 0, kv_lora = 0, rope_dim = 0;  // MLA only (0 for GQA)
  // Optimizer (scale_optimizer_knobs): the plan's placement gpu | serial | stream; for stream,
  // parameters per bucket scaled with the rank's parameters (the number of buckets is kept)
  // and buckets in flight.
  std::string optimizer = "gpu";
  int64_t bucket_params = 0, bucket_depth = 0;
  int64_t bucket_count = 0;  // stream: the plan's number of buckets, which the scaled runs keep
  // stream: why the optimizer and step components do not run the plan's buckets (more than verify
  // runs); the other components run. Empty: they run.
  std::vector<Diagnostic> optimizer_refusal;
  std::vector<ScaledValue> values;  // every scaled value, for printing
  // Dispatch (scale_dispatch_knobs): the expert FFN width scaled with H; the plan's LLEP switch,
  // PipelinedLLEP cap C and m scaled with T (0: none), store or recompute mode, rounds in flight.
  int64_t expert_ffn = 0, chunk_cap_rows = 0, llep_min_rows = 0, dispatch_depth = 2;
  bool llep = false, dispatch_store = false;
  // Checkpoint boundaries (scale_checkpoint_knobs): the plan's boundaries knob (device |
  // sync-offload | sco), per scaled layer whether its boundary goes to the host, SCO's prefetch.
  std::string boundaries = "device";
  std::vector<bool> sco_offloaded;
  int64_t sco_prefetch = 0;
};

// factor: --scale FACTOR (divides T, H, V); nullopt: auto (T ≤ 512, H ≤ 64, V ≤ max(1000, V/64)).
// max_ranks: --max-ranks (≥ 1); InputError naming --max-ranks when it is below N/EP (N/EP is kept).
ScaledConfig scale_config(const VerifyInputs& in, std::optional<double> factor, int64_t max_ranks = 1);

// Checks /knobs/optimizer, bucket_params and bucket_depth (InputError naming /knobs/<name>/value)
// and scales bucket_params to the scaled rank's parameters, keeping the number of buckets;
// appends the scaled values. scale_config calls it (verify_optimizer.cpp).
void scale_optimizer_knobs(const VerifyInputs& in, ScaledConfig& s);

// Scales the layer's head counts and head dim with H (verify_step.cpp says how); appends the
// scaled values. scale_config calls it. Leaves them 0 when the plan gives no head counts.
void scale_layer_dims(const VerifyInputs& in, ScaledConfig& s);

// Checks /knobs/llep, chunk_cap_rows, dispatch_mode, llep_min_rows and dispatch_depth (InputError
// naming /knobs/<name>/value), scales F with H and C, m with T; appends the scaled values.
// scale_config calls it (verify_dispatch.cpp).
void scale_dispatch_knobs(const VerifyInputs& in, ScaledConfig& s);

// Checks /knobs/boundaries, sco_layers and sco_prefetch (InputError naming /knobs/<name>/value)
// and scales the offloaded layer set to s.layers (verify_checkpoint_knobs.cpp says how); appends
// the scaled values. scale_config calls it.
void scale_checkpoint_knobs(const VerifyInputs& in, ScaledConfig& s);

}  // namespace flatpeak::cli
