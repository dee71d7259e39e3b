// One MoE layer's dispatch on one rank, as a component run: router → permute → grouped SwiGLU
// experts → combine, then (full activation checkpointing) the recompute and the backward through
// them, either as one uncapped dispatch (standard EP buffers) or in capped rounds (PipelinedLLEP
// at EP = 1: at most C token copies per round, round buffers allocated once per pass).
//   TrackingAllocator alloc({512});
//   DispatchScheduleConfig c; c.tokens = 512; c.hidden = 64; c.experts = 16; c.top_k = 4; c.ffn = 64;
//   c.chunk_cap_rows = 128;  DispatchScheduleResult r = run_dispatch_schedule(alloc, c);
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "executor/memory/tracking_allocator.h"
#include "spec/routing.h"

namespace flatpeak::exec {

struct DispatchScheduleConfig {
  int64_t tokens = 0;   // T
  int64_t hidden = 0;   // H
  int64_t experts = 0;  // E (all on this rank: E/EP with EP = 1)
  int64_t top_k = 0;    // k ≤ E
  int64_t ffn = 0;      // F, expert FFN width
  // 0: one uncapped dispatch. C > 0: rounds of at most C copies (capped at T·k).
  int64_t chunk_cap_rows = 0;
  bool store = false;        // capped only: keep every round's expert activations (store) or
                             // re-dispatch and recompute each round in backward (recompute)
  int64_t depth = 2;         // capped only: D, rounds in flight (round buffers are [D, ·, H])
  std::string layer = "L0";  // phase names fwd/<layer>/moe/..., bwd/<layer>/[recompute/]moe/...
  RoutingModel routing;      // the routing model the top-k ids are drawn from (routing.h)
  int64_t moe_layer = 0;     // MoE layer index the routing is drawn for
  uint64_t seed = 1;         // inputs, weights, routing: a pure function of the seed
};

// The inputs of a run as values (bf16 inputs widened exactly), for references.
struct DispatchInputs {
  std::vector<float> x;             // [T, H] MoE block input (norm-2 output)
  std::vector<float> d_out;         // [T, H] upstream gradient of the MoE output
  std::vector<float> w_router;      // [E, H]
  std::vector<float> w_gate_up;     // [E, 2F, H] gate rows 0..F-1, up rows F..2F-1
  std::vector<float> w_down;        // [E, H, F]
  std::vector<int32_t> topk_ids;    // [T, k] drawn from the routing model (distinct per token)
};
DispatchInputs make_dispatch_inputs(const DispatchScheduleConfig& config);

// Results copied out of the tracked buffers.
struct DispatchScheduleResult {
  std::vector<int64_t> expert_counts;  // [E] realised token copies per expert (the routing data)
  int64_t rounds = 1;
  int64_t chunk_cap_rows = 0;          // C in effect (0: uncapped)
  std::vector<float> topk_weights;     // [T, k] renormalised router weights
  std::vector<float> out;              // [T, H] MoE output, bf16 values (the forward pass's)
  std::vector<float> d_x;              // [T, H] fp32 gradient of the MoE input (router included)
  std::vector<float> d_w_router;       // [E, H] fp32
  std::vector<float> d_w_gate_up;      // [E, 2F, H] fp32
  std::vector<float> d_w_down;         // [E, H, F] fp32
};

// Runs the no-grad forward, the recompute and the backward of one MoE layer with every buffer
// from `alloc`. Category `dispatch`: routing [T, E] ×3 fp32 + [T, E] bool + top-k weights [T, k]
// fp32 and ids [T, k] int64, and every dispatch/combine buffer and expert activation or gradient;
// the layer input, the upstream gradient and the expert/router weights and their fp32 gradient
// accumulators are `activations` and `fsdp`, allocated before the first phase.
// Phases (P = fwd/<layer>/moe/, Q = bwd/<layer>/recompute/moe/, G = bwd/<layer>/moe/):
//   uncapped: P{route,dispatch,experts,combine}, Q{dispatch,experts,combine}, G{combine,experts,dispatch};
//   capped:   P route, P dispatch/rJ; Q dispatch/rJ (store) or Q route (recompute); G dispatch/rJ.
// A token's k expert outputs are summed in increasing expert order in fp32 whatever the split,
// so the forward output and d_x are bitwise equal between capped and uncapped runs.
// Throws std::invalid_argument for bad dims.
DispatchScheduleResult run_dispatch_schedule(TrackingAllocator& alloc, const DispatchScheduleConfig& config);

}  // namespace flatpeak::exec
