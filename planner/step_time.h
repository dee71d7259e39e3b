// The step-time model: FLOPs, communication volumes and host traffic of one training step on the
// worst GPU, with per-kernel efficiencies as inputs and stated overlap rules (planner/README.md,
// "Step time"). The step is a sum of terms, each the seconds it adds to the step:
//   TimeModel tm(model, hardware, run, work, Efficiency{});       // knob-independent part
//   StepTime t = tm.full(run, work);   // t.step_seconds, t.tokens_per_second, t.mfu, t.bound_by
// The knob search calls the group functions (dispatch, vocab, boundaries, optimizer) directly and
// combines them with combine(): the same code path, so its times equal the plan's bit for bit.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "run_spec.h"
#include "workload.h"

namespace flatpeak::planner {

// Efficiencies (fractions of the hardware card's peak figures) and latencies. Defaults are
// documented in planner/README.md with their sources (reference/peers.md §4.3); none is
// calibrated yet. Overridden with --efficiency key=value,... (keys: efficiency_keys()).
struct Efficiency {
  double gemm = 0.75;         // large bf16 GEMMs, of bf16_dense_flops
  double attention = 0.50;    // flash attention (forward and backward), of bf16_dense_flops
  double hbm = 0.80;          // device memory bandwidth: memory-bound GEMMs, logits, GPU AdamW
  double nvlink = 0.75;       // scale-up (NVLink/xGMI) per GPU, one direction
  double network = 0.80;      // inter-node per GPU, one direction
  double host_link = 0.80;    // PCIe/C2C per GPU, one direction
  double host_memory = 0.50;  // host DRAM bandwidth per node, for the CPU AdamW
  double round_latency_s = 20e-6;     // per all-to-all (EP dispatch/combine) round
  double hop_latency_s = 10e-6;       // per ring hop (CP ring attention, Ring-DTP)
  double bucket_latency_s = 50e-6;    // per OffloadStreamAdamW bucket (or serial step stage)
  double transfer_latency_s = 10e-6;  // per boundary copy to or from the host (event wait)
  double kernel_latency_s = 5e-6;     // per launch: expert GEMM round, logits block
};

struct EfficiencyKey {
  const char* name;  // "gemm", "round-latency-us"
  const char* help;
};
const std::vector<EfficiencyKey>& efficiency_keys();
// "gemm=0.7,attention=0.45,round-latency-us=30": fractions in [0.01, 1], latencies in µs in [0, 1e6], each key once.
// Problems (unknown key with did-you-mean, bad value) go to errs under --efficiency.
Efficiency parse_efficiency(const std::string& text, InputErrors& errs);
nlohmann::ordered_json efficiency_to_json(const Efficiency& e);

// One term of the step: `seconds` is what it adds to the step (the terms sum to step_seconds);
// `busy_seconds` is how long the activity runs in all (hidden or not); `amount` in `unit`.
struct TimeTerm {
  std::string name;
  double seconds = 0;
  double busy_seconds = 0;
  double amount = 0;
  std::string unit;    // "flop", "bytes"
  std::string detail;  // how it was counted and what hides it
};

struct StepTime {
  double step_seconds = 0;
  double tokens_per_second = 0;  // global batch × S / step, the whole cluster
  double mfu = 0;                // model FLOPs / (step × N × peak)
  double model_flops_per_gpu = 0;     // per step: 6 × active matmul params × tokens + attention
  double hardware_flops_per_gpu = 0;  // per step on the worst rank, with recompute
  int64_t micro_batches = 1;
  std::vector<TimeTerm> terms;
  std::string bound_by;  // the term with the largest contribution
  Efficiency efficiency;  // the inputs used
};

// The dispatch group (PipelinedLLEP knobs): expert GEMMs below full efficiency and the EP
// all-to-all exposed beyond them, per micro-batch.
struct DispatchTime {
  double small_gemm_s = 0;   // expert GEMMs at their rows-per-GEMM efficiency, beyond the reference
  double exposed_s = 0;      // all-to-all time not hidden behind expert GEMMs, with round latencies
  double busy_s = 0;         // all-to-all transfer time in all
  double bytes = 0;          // all-to-all bytes sent by the worst rank
  double rows_per_gemm = 0;  // mean rows per expert GEMM (per round)
  double total() const { return small_gemm_s + exposed_s; }
};

// The vocabulary group (Ring-DTP knobs), per micro-batch: the LM head beyond its reference GEMM
// time (logits traffic, block launches), ring hops not hidden, and the FSDP exposure (the head
// unit's gather shrinks with the ring size).
struct VocabTime {
  double head_extra_s = 0;
  double ring_exposed_s = 0;
  double ring_busy_s = 0;
  double ring_bytes = 0;
  double fsdp_exposed_s = 0;
  double fsdp_busy_s = 0;
  double fsdp_bytes = 0;
  double total() const { return head_extra_s + ring_exposed_s + fsdp_exposed_s; }
};

struct BoundaryTime {
  double exposed_s = 0;  // per micro-batch
  double busy_s = 0;
  double bytes = 0;
};

struct OptimizerTime {
  double exposed_s = 0;  // per step
  double busy_s = 0;
  double bytes = 0;  // host-link bytes (offload) or HBM bytes (on the GPU)
};

class TimeModel {
 public:
  // `run` fixes the structure (N, b, CP, EP, techniques, modes); knobs are passed to the groups.
  TimeModel(const ModelSpec& model, const HardwareSpec& hardware, const ResolvedRun& run, const Workload& work,
            const Efficiency& efficiency);

  // `loads`: the workload's MoE loads with the cap in effect (chunk_cap_rows, round_recv_rows, rounds).
  DispatchTime dispatch(const std::vector<MoeLoad>& loads) const;
  VocabTime vocab(int64_t ring_size, RingRotate rotate, int64_t token_block, int64_t vocab_block) const;
  BoundaryTime boundaries(const std::vector<bool>& offloaded, int64_t prefetch) const;
  // The same for the first `layers` layers offloaded (no allocation; equal to boundaries()).
  BoundaryTime boundaries_first(int64_t layers, int64_t prefetch) const;
  OptimizerTime optimizer(int64_t bucket_params, int64_t bucket_depth) const;
  // Step seconds from the group totals (the fixed order the search and full() share).
  double combine(double dispatch_s, double vocab_s, double boundaries_s, double optimizer_s) const {
    const double micro = (((compute_ref_s_ + cp_exposed_s_) + dispatch_s) + vocab_s) + boundaries_s;
    return static_cast<double>(accumulation_) * micro + optimizer_s;
  }
  // Tokens processed by one step (global batch × S): the search's per-token objective.
  double tokens_per_step() const { return tokens_per_step_; }

  StepTime full(const ResolvedRun& run, const Workload& work) const;

  // Per micro-batch, at reference efficiency (no knob moves them).
  double compute_ref_seconds() const { return compute_ref_s_; }

 private:
  struct LayerTime {
    double forward_s = 0;   // no-grad forward at reference efficiency
    double backward_s = 0;  // recompute + backward
  };
  template <class Offloaded>
  BoundaryTime boundaries_of(const Offloaded& offloaded, int64_t prefetch) const;  // prefetch <= 6
  template <class Offloaded>
  double forward_wait(const Offloaded& offloaded, double copy_seconds) const;
  double link_seconds(double bytes, int64_t group, bool contiguous) const;
  double gemm_seconds(double flops, double bytes) const;
  // Whether the blocked/ring loss visits the logits once (gradients in forward on one rank with
  // one vocab block, vocab_block >= V): 3 GEMMs a block, else 4.
  bool logits_visited_once(int64_t ring_size, int64_t vocab_block) const;
  double head_pass_seconds(int64_t rows, int64_t cols, int64_t gemms, int64_t token_block, int64_t vocab_block,
                           int64_t blocks, bool materialized) const;

  const ModelSpec& model_;
  const HardwareSpec& hw_;
  Efficiency eff_;
  // FLOP/s and bytes/s after efficiencies (infinite where the card has no figure).
  double gemm_rate_ = 0, attn_rate_ = 0, hbm_rate_ = 0, nvlink_rate_ = 0, network_rate_ = 0;
  double host_link_rate_ = 0, cpu_rate_ = 0;
  int64_t N_ = 1, gpn_ = 1, cp_ = 1, ep_ = 1, T_ = 0, S_ = 0, accumulation_ = 1;
  bool llep_ = false, pipelined_ = false, store_ = true;
  int64_t depth_ = 2;
  VocabMode vocab_mode_ = VocabMode::Materialized;
  VocabBackward vocab_backward_ = VocabBackward::Recompute;
  BoundaryMode boundary_mode_ = BoundaryMode::Device;
  OptimizerPlacement placement_ = OptimizerPlacement::Gpu;
  int64_t losses_ = 1;               // main loss + MTP heads
  int64_t shard_params_ = 0;
  double tokens_per_step_ = 0;
  // Per micro-batch, reference efficiency.
  double attention_s_ = 0, gemm_dense_s_ = 0, gemm_experts_s_ = 0, head_ref_s_ = 0;
  double compute_ref_s_ = 0, cp_exposed_s_ = 0, cp_busy_s_ = 0, cp_bytes_ = 0;
  double loss_backward_s_ = 0, mtp_backward_s_ = 0;
  double backward_window_s_ = 0;    // the last micro-batch's backward: OffloadStreamAdamW hides here
  int64_t head_passes_ = 3;         // LM head GEMM passes per loss (the reference)
  double head_pass_flops_ = 0;      // one LM head GEMM pass of one loss, per micro-batch
  double fsdp_rest_bytes_ = 0;      // gather + reduce-scatter bytes, all units but the head
  int64_t fsdp_head_params_ = 0;    // the head unit's gathered params (the ring divides them)
  double model_flops_mb_ = 0;     // per micro-batch, mean rank (MFU)
  double hw_flops_dense_mb_ = 0;  // per micro-batch, worst rank, with recompute
  std::vector<LayerTime> layers_;   // decoder layers (the SCO simulation runs over them)
  std::vector<int64_t> moe_layer_loads_;  // per MoE layer (decoder then MTP): index into loads
};

// The plan's step time at its own knobs.
StepTime estimate_step_time(const ModelSpec& model, const HardwareSpec& hardware, const ResolvedRun& run,
                            const Workload& work, const Efficiency& efficiency);

nlohmann::ordered_json step_time_to_json(const StepTime& t);
// v rounded to `digits` significant digits (JSON output of times).
double round_significant(double v, int digits);

// Matmul weights per token (the FLOP counts' "active matmul params"), by part.
struct MatmulParams {
  int64_t attention = 0;    // per decoder layer: q, k, v, o projections (MLA: latents too)
  int64_t dense_ffn = 0;    // per dense layer
  int64_t moe_common = 0;   // per MoE layer: router + shared experts
  int64_t expert = 0;       // one routed expert (3·H·F)
  int64_t head = 0;         // LM head H·V (also with tied embeddings)
  int64_t mtp_extra = 0;    // per MTP module: eh_proj 2H·H
};
MatmulParams matmul_params(const ModelSpec& model);
// Mean keys a query attends to in a sequence of S tokens (causal; windows limit it).
double mean_attended_keys(const LayerSpec& layer, int64_t context_tokens);
// Forward attention-core FLOPs per token of one layer: 2·a·(d_qk + d_v)·keys.
double attention_forward_flops_per_token(const ModelSpec& model, const LayerSpec& layer, int64_t context_tokens);

}  // namespace flatpeak::planner
