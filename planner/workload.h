// The per-GPU workload of one plan: tokens per GPU, parallel degrees, the FSDP units with their
// gathered and sharded sizes, and the expected MoE loads (standard EP and least-loaded).
//   Workload w = make_workload(model, run);
//   int64_t T = w.tokens;   w.units[w.layer_unit(12)].gathered_params;
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "run_spec.h"
#include "spec/model_spec.h"
#include "spec/param_count.h"
#include "spec/least_loaded.h"
#include "spec/routing.h"

namespace flatpeak::planner {

// One FSDP unit: the parameters gathered together. Dense parts are sharded over N; each rank's
// E/EP local experts are sharded over the N/EP ranks holding the same experts.
struct FsdpUnit {
  std::string name;             // "embedding", "L12", "MTP0", "head"
  int64_t params = 0;           // all parameters of the unit (the whole model's copy)
  int64_t gathered_params = 0;  // unsharded on one GPU during its compute (local experts only)
  int64_t shard_params = 0;     // this GPU's shard
  // The part of that shard a reduce-scatter lands: all of it, less the experts at EP = N (no other
  // GPU holds them, so their grads are not reduced: the executor's FsdpShards local part).
  int64_t reduced_shard_params = 0;
};

// What one rank holds of a MoE layer's dispatch: the rows it computes (R_p), the experts whose
// weights it borrows (S_p) and the (expert, helper) pairs it lends (S_sent).
struct RankLoad {
  int64_t recv_rows = 0;
  int64_t foreign_experts = 0;
  int64_t lent_experts = 0;
};

// The ranks whose dispatch working set can be the largest in some phase: every rank's load not
// dominated by another's (≤ in all three, ties: the lowest rank kept), in rank order. Every
// dispatch term grows with R_p, S_p or S_sent, so a dominated rank never holds the most; the
// worst rank of a phase is one of these (memory_terms_dispatch.cpp takes each phase's maximum).
std::vector<RankLoad> candidate_ranks(const std::vector<RankLoad>& per_rank);

// Expected dispatch loads of one MoE layer: the worst (most loaded) rank's, and the candidates.
struct MoeLoad {
  int64_t send_rows = 0;          // T·k token copies this rank sends
  int64_t recv_rows_ep = 0;       // rows received under standard EP (max over ranks)
  double rho_ep = 1.0;            // ρ = max / mean rows
  // Least-loaded assignment (valid when LLEP is on):
  bool lla_ran = false;           // false: the λ fall-back kept plain EP
  int64_t recv_rows_llep = 0;     // max over ranks of LLA's gpu_loads
  double rho_llep = 1.0;          // ρ_L = recv_rows_llep / mean
  int64_t foreign_experts = 0;    // S_p: experts whose weights this rank receives
  int64_t lent_experts = 0;       // S_sent: weight copies this rank sends to helpers
  std::vector<RankLoad> ranks;    // candidate_ranks of every rank's (R_p, S_p, S_sent): LLA's
                                  // when it ran, else standard EP's received rows and no weights
  // PipelinedLLEP (cap > 0): the cap the round buffers are sized for at launch (min(C, T·k)), the
  // cap in effect (smaller when the loads would overflow the buffers), rows per round's receive
  // buffer B, rounds n.
  int64_t launch_chunk_cap_rows = 0;
  int64_t chunk_cap_rows = 0;
  int64_t round_recv_rows = 0;
  int64_t rounds = 1;
  // PipelinedLLEP's other launch-time buffers: the foreign-weight pool S_cap every rank holds (LLA
  // then lends no rank more experts) and the store mode's saved rows (spec/least_loaded.h).
  int64_t foreign_pool = 0;
  int64_t store_rows = 0;
  std::string clamp_note;         // routing model clamped (see routing.h)
};

// LLEP's knobs of a run (the foreign-expert limit off).
LlaKnobs lla_knobs_of(const ResolvedRun& run);
// The least-loaded assignment of `copies` ([EP][E]) into load's LLA fields and candidate ranks
// (left as they are when the λ fall-back keeps plain EP); returns the [EP][EP] send rows.
CountMatrix apply_lla(MoeLoad& load, const ResolvedRun& run, const CountMatrix& copies, const RoutingShape& shape,
                      const LlaKnobs& knobs);

// PipelinedLLEP's rounds for a cap (workload.cpp and the knob search's fast path): B sized at
// launch, before any routing is known, from C = min(cap, T·k), EP and the LLA bound
// ρ_B = max(1, λ, α) + δ/N (reference/dispatch.md §2.7, δ = lla_slack_rows):
// B = min(ceil((C + EP)·ρ_B) + EP, EP·C, EP·T·min(k, E/EP)) with striping, EP·C without; the
// foreign-weight pool and the store rows from B (spec/least_loaded.h); when the LLA of `copies`
// lent a rank more experts than the pool holds, LLA again within it; then the cap shrinks while
// the known loads (`send`, [EP][EP] rows) would overflow B (§5.5).
void apply_chunk_cap(MoeLoad& load, const ModelSpec& model, const ResolvedRun& run, const CountMatrix& copies, CountMatrix send,
                     int64_t chunk_cap_rows);

struct Workload {
  int64_t gpus = 0, cp = 1, dp = 1, ep = 1;
  int64_t tokens = 0;             // T = b·S/CP
  int64_t accumulation_steps = 1;
  int64_t experts_per_rank = 0;   // E/EP
  ParamCounts counts;
  int64_t trained_params = 0;     // total (+ MTP when on)
  int64_t shard_params = 0;       // Σ over units of this GPU's shard
  int64_t expert_params_each = 0; // p_e, one routed expert

  std::vector<FsdpUnit> units;    // embedding, L0..L{L-1}, MTP modules, head (in forward order)
  int64_t head_unit = 0;          // index of the final norm + LM head unit
  int64_t layer_unit(int64_t layer) const { return 1 + layer; }  // MTP j: layer = L + j

  // Per decoder layer (then per MTP module): MoE layer number (counting MoE layers) or -1.
  std::vector<int64_t> moe_index;
  std::vector<MoeLoad> moe_loads;  // one per distinct routing (1, or one per MoE layer for files)
  const MoeLoad& load_of(int64_t moe_layer) const {
    return moe_loads[static_cast<size_t>(moe_layer) % moe_loads.size()];
  }
};

// Builds the workload; assumes `run` was resolved without errors.
Workload make_workload(const ModelSpec& model, const ResolvedRun& run);

// The workload without its MoE loads: counts, FSDP units and the MoE layer numbering. Unit names
// are left empty when `unit_names` is false (the knob search builds many and never reads them).
Workload workload_units(const ModelSpec& model, const ResolvedRun& run, bool unit_names);
// The MoE loads a workload holds: one per MoE layer for a routing file of several layers, else
// one; 0 without MoE layers.
int64_t distinct_moe_routings(const ResolvedRun& run, const Workload& w);

// Params of the buffer the loss reads W from (R = 1): the gathered final norm + LM head unit (the
// norm first, W after it). With a tied head W is the gathered embedding table [V, H] and the head
// unit (the final norm) is gathered beside it: both, counted as one term.
int64_t loss_weight_params(const ModelSpec& model, const Workload& w);

}  // namespace flatpeak::planner
