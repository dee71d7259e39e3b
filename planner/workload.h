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

namespace flatpeak::planner {

// One FSDP unit: the parameters gathered together. Dense parts are sharded over N; each rank's
// E/EP local experts are sharded over the N/EP ranks holding the same experts.
struct FsdpUnit {
  std::string name;             // "embedding", "L12", "MTP0", "head"
  int64_t params = 0;           // all parameters of the unit (the whole model's copy)
  int64_t gathered_params = 0;  // unsharded on one GPU during its compute (local experts only)
  int64_t shard_params = 0;     // this GPU's shard
};

// Expected dispatch loads of one MoE layer on the worst (most loaded) rank.
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
  // PipelinedLLEP (cap > 0): the cap in effect, rows per round's receive buffer B, rounds n.
  int64_t chunk_cap_rows = 0;
  int64_t round_recv_rows = 0;
  int64_t rounds = 1;
  std::string clamp_note;         // routing model clamped (see routing.h)
};

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

}  // namespace flatpeak::planner
