// EP dispatch across ranks for one MoE layer (reference/dispatch.md §2, §5): the standard
// uncapped all-to-allv (baseline), LLEP (least-loaded assignment, expert weights lent to helper
// ranks, their gradients returned) and PipelinedLLEP (rounds, per-source cap, striping).
//   EpDispatchConfig cfg; cfg.schedule = EpSchedule::PipelinedLlep; cfg.chunk_cap_rows = 256;
//   MoeRankTensors io{x, ids, w, d_out, w_gu, w_down, out, d_x, d_w, d_w_gu, d_w_down};
//   EpDispatchStats s = moe_dispatch_backward(comm, alloc, dims, cfg, io);  // s.dispatch_peak_bytes
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "executor/comm/communicator.h"
#include "executor/memory/tracking_allocator.h"
#include "spec/least_loaded.h"

namespace flatpeak::exec {

enum class EpSchedule : uint8_t { Uncapped, Llep, PipelinedLlep };
const char* ep_schedule_name(EpSchedule schedule);  // "uncapped" | "llep" | "pipelined_llep"

struct MoeDims {
  int64_t tokens = 0;   // T per rank
  int64_t hidden = 0;   // H
  int64_t ffn = 0;      // F
  int64_t experts = 0;  // E (E % EP == 0)
  int64_t top_k = 0;    // k
};

struct EpDispatchConfig {
  EpSchedule schedule = EpSchedule::Uncapped;
  LlaKnobs lla;                   // Llep, PipelinedLlep
  int64_t chunk_cap_rows = 0;     // PipelinedLlep: C, token copies a source sends per round
  // PipelinedLlep: ρ bound the per-round receive buffers are sized for at launch (before any
  // routing is known); 0 = max(λ, α) + δ/N with δ = lla_slack_rows (reference/dispatch.md §2.7).
  double rho_bound = 0.0;
  std::string phase_prefix = "bwd/L0/moe";  // phases: <prefix>/dispatch/r<j>
};

// One rank's tensors (fp32 storage). Inputs are read; outputs overwritten; grads accumulated.
struct MoeRankTensors {
  const float* x = nullptr;             // [T, H] layer input (the MoE block's)
  const int32_t* topk_ids = nullptr;    // [T, k] distinct experts per token
  const float* topk_weights = nullptr;  // [T, k] router weights
  const float* d_out = nullptr;         // [T, H] upstream gradient
  const float* w_gate_up = nullptr;     // [L, 2F, H] this rank's native experts
  const float* w_down = nullptr;        // [L, H, F]
  float* out = nullptr;                 // [T, H] overwritten: Σ_s w·y in slot order per round
  float* d_x = nullptr;                 // [T, H] overwritten
  float* d_weights = nullptr;           // [T, k] overwritten: dot(d_out[t], y[t,s])
  float* d_w_gate_up = nullptr;         // [L, 2F, H] accumulated (+=), helpers' parts included
  float* d_w_down = nullptr;            // [L, H, F] accumulated (+=)
};

struct EpDispatchStats {
  int64_t rounds = 0;
  int64_t chunk_cap_rows = 0;           // the cap used (PipelinedLlep: after shrinking)
  int64_t launch_chunk_cap_rows = 0;    // the configured cap
  int64_t round_buffer_rows = 0;        // receive rows per round the buffers hold
  int64_t received_rows = 0;            // R_p over all rounds
  int64_t max_round_received_rows = 0;  // max over rounds on this rank
  int64_t foreign_experts = 0;          // S_p
  int64_t lent_weights = 0;             // S_sent
  bool lla_triggered = false;
  double rho = 1.0;                     // max/mean rows computed per rank after the plan
  int64_t dispatch_peak_bytes = 0;      // max live Dispatch-category bytes during the call
};

// The MoE block's recompute + backward for one layer on this rank (full activation
// checkpointing: the dispatch peak of a step is here). Per round: the source sends [x | d_y]
// rows (d_y = w·d_out), the destination sorts them by expert, runs the expert FFN forward and
// backward (ops/expert_ffn.h), and returns [y | d_x] rows; the source folds them into out,
// d_weights and d_x. Collective: every rank of comm calls it with the same dims and config.
// All Dispatch-category buffers come from `alloc`; round buffers are allocated once before
// the first round. Throws InputError for bad knobs, CommError / RankFailed from comm.
EpDispatchStats moe_dispatch_backward(Communicator& comm, TrackingAllocator& alloc,
                                      const MoeDims& dims, const EpDispatchConfig& config,
                                      const MoeRankTensors& io);

// The single-rank reference with the ops alone (route, permute, expert FFN, combine and their
// backwards) over `tokens` tokens and all E experts: what every schedule must reproduce.
void moe_reference_backward(const MoeDims& dims, const MoeRankTensors& io);

}  // namespace flatpeak::exec
