// One MoE layer's dispatch as a component run: router → permute → grouped SwiGLU experts →
// combine, then (full activation checkpointing) the recompute and the backward through them, on
// one rank or on the EP ranks of a Communicator (EP = comm.size()):
//  - standard EP: one uncapped all-to-allv dispatch and combine (baseline);
//  - LLEP (`llep`, no cap): the least-loaded assignment over the all-gathered counts; expert
//    weights lent to helper ranks and their gradients returned (reference/dispatch.md §2);
//  - PipelinedLLEP (`chunk_cap_rows` C > 0): rounds in which every source sends at most C copies
//    (proportional striping over destinations), round buffers allocated once per pass, sized at
//    launch for C, EP and the LLA bound; when the known loads would overflow them the cap shrinks
//    (more rounds) instead (§5). At one rank: capped rounds of at most C copies.
//   TrackingAllocator alloc({512});
//   DispatchScheduleConfig c; c.tokens = 512; c.hidden = 64; c.experts = 16; c.top_k = 4; c.ffn = 64;
//   c.chunk_cap_rows = 128;  DispatchScheduleResult r = run_dispatch_schedule(alloc, c);
//   run_ranks(4, [&](int rank, Communicator& comm) {          // 4 EP ranks, T tokens each
//     TrackingAllocator a({512});  c.llep = true;  results[rank] = run_dispatch_schedule(comm, a, c); });
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "executor/comm/communicator.h"
#include "executor/memory/tracking_allocator.h"
#include "spec/least_loaded.h"
#include "spec/routing.h"

namespace flatpeak::exec {

struct DispatchScheduleConfig {
  int64_t tokens = 0;   // T per rank
  int64_t hidden = 0;   // H
  int64_t experts = 0;  // E, all experts (E/EP native on each rank; E % EP == 0)
  int64_t top_k = 0;    // k ≤ E
  int64_t ffn = 0;      // F, expert FFN width
  // Biases inside each expert (gpt-oss): gate/up [2F] added to fc1, down [H] added to fc2. The
  // prob rides on the activation (act*prob), so the down bias is not scaled by it, where gpt-oss
  // scales the whole expert output; the bias's storage, lending and gradients are the same.
  // Stored after the weights in one expert's [P] elements: P = 3·H·F + 2F + H.
  bool expert_bias = false;
  // 0: one uncapped dispatch. C > 0: rounds of at most C copies per source (capped at T·k).
  int64_t chunk_cap_rows = 0;
  bool store = false;        // capped only: keep every round's expert activations (store) or
                             // re-dispatch and recompute each round in backward (recompute)
  int64_t depth = 2;         // capped only: D, rounds in flight (round buffers are [D, ·, H])
  // EP > 1: the least-loaded assignment with these knobs places the rows (λ fall-back: standard
  // EP). Off: every row goes to its expert's native rank.
  bool llep = false;
  LlaKnobs lla;
  bool striping = true;      // capped, EP > 1: proportional striping (O2); off: destination-major
                             // cut into rounds (O1) and receive buffers of EP·C rows
  double rho_bound = 0.0;    // capped, EP > 1: ρ the receive buffers are sized for at launch;
                             // 0 = max(1, λ, α) + δ/N (the LLA bound, reference/dispatch.md §2.7)
  std::string layer = "L0";  // phase names fwd/<layer>/moe/..., bwd/<layer>/[recompute/]moe/...
  RoutingModel routing;      // the routing model the top-k ids are drawn from (routing.h)
  int64_t moe_layer = 0;     // MoE layer index the routing is drawn for
  uint64_t seed = 1;         // inputs, weights, routing: a pure function of the seed
  // The EP group (data-parallel replica) this communicator is, when EP < N: its ranks hold the
  // tokens (and draw the routing streams) of global ranks replica·EP + r; weights are the same
  // in every group. 0: the first group (and the single-rank reference's numbering).
  int64_t replica = 0;
  // When set, this rank's [T, k] ids instead of drawing them (a single-rank reference over the
  // EP ranks' tokens gives the concatenation of every rank's draw_dispatch_routing).
  const std::vector<int32_t>* topk_ids = nullptr;
  // Copy the forward output, d_x and the weight gradients into the result (off: counts and
  // statistics only, e.g. a run that only measures memory).
  bool outputs = true;
};

// "uncapped" | "llep" | "pipelined_llep" (capped; at one rank the rounds alone).
const char* dispatch_schedule_name(const DispatchScheduleConfig& config);

// Rank `rank` of `ep`'s [T, k] ids as the schedule draws them (generate_routing with the shape
// {ep, E, k}, rank = config.replica·ep + rank, ep_rank = rank).
std::vector<int32_t> draw_dispatch_routing(const DispatchScheduleConfig& config, int64_t ep, int64_t rank);

// Launch-time receive rows per round of a capped run on `ep` ranks (before any routing is
// known): C at one rank; with striping min(EP·C, ceil((C + EP)·ρ_B) + EP, EP·T·min(k, E/EP)),
// ρ_B = rho_bound or max(1, λ, α) + δ/N; without striping EP·C. C = min(chunk_cap_rows, T·k).
int64_t dispatch_round_buffer_rows(const DispatchScheduleConfig& config, int64_t ep);
// The other launch-time sizes of a capped run (spec/least_loaded.h): S_cap, the foreign-weight
// pool every rank holds with LLEP at EP > 1 (LLA then lends no rank more experts; 0 otherwise),
// and the store mode's saved rows (rounds that do not fit on every rank are recomputed in
// backward). With these and a [1, P] staging slot for the lent weights' gradients, a capped
// run's buffers do not depend on the routing.
int64_t dispatch_foreign_pool(const DispatchScheduleConfig& config, int64_t ep);
int64_t dispatch_store_rows(const DispatchScheduleConfig& config, int64_t ep);

// The inputs of a one-rank run as values (bf16 inputs widened exactly), for references.
struct DispatchInputs {
  std::vector<float> x;             // [T, H] MoE block input (norm-2 output)
  std::vector<float> d_out;         // [T, H] upstream gradient of the MoE output
  std::vector<float> w_router;      // [E, H]
  std::vector<float> w_gate_up;     // [E, 2F, H] gate rows 0..F-1, up rows F..2F-1
  std::vector<float> w_down;        // [E, H, F]
  std::vector<float> b_expert;      // [E, 2F + H] gate/up then down biases (empty without expert_bias)
  std::vector<int32_t> topk_ids;    // [T, k] drawn from the routing model (distinct per token)
};
DispatchInputs make_dispatch_inputs(const DispatchScheduleConfig& config);

// Results copied out of the tracked buffers (this rank's).
struct DispatchScheduleResult {
  std::vector<int64_t> expert_counts;  // [E] realised token copies per expert of this rank's tokens
  CountMatrix source_counts;           // [EP][E] every rank's (the routing data; [1][E] at one rank)
  int64_t rounds = 1;
  int64_t chunk_cap_rows = 0;          // C in effect (0: uncapped; capped: after any shrinking)
  int64_t launch_chunk_cap_rows = 0;   // C the round buffers were sized for (0: uncapped)
  int64_t round_buffer_rows = 0;       // B, receive rows per round the buffers hold (0: uncapped)
  int64_t max_round_received_rows = 0; // most rows this rank received in one round
  int64_t foreign_pool = 0;            // capped: S_cap, borrowed-expert slots held (≥ foreign_experts)
  int64_t store_rows = 0;              // capped, store: rows of the saved activations
  int64_t stored_rounds = 0;           // capped, store: rounds kept (the rest recomputed in backward)
  int64_t received_rows = 0;           // R_p: rows this rank computed
  int64_t foreign_experts = 0;         // S_p: experts whose weights this rank borrowed
  int64_t lent_weights = 0;            // S_sent: (expert, helper) pairs this rank lent
  bool lla_triggered = false;          // LLA ran (false: λ fall-back or LLEP off)
  double rho = 1.0;                    // max / mean rows computed per rank
  std::vector<float> topk_weights;     // [T, k] renormalised router weights
  std::vector<float> out;              // [T, H] MoE output, bf16 values (the forward pass's)
  std::vector<float> d_x;              // [T, H] fp32 gradient of the MoE input (router included)
  std::vector<float> d_w_router;       // [E, H] fp32, this rank's tokens' part
  std::vector<float> d_w_gate_up;      // [E/EP, 2F, H] fp32, native experts (helpers' parts added)
  std::vector<float> d_w_down;         // [E/EP, H, F] fp32
  std::vector<float> d_b_expert;       // [E/EP, 2F + H] fp32 (empty without expert_bias)
};

// Runs the no-grad forward, the recompute and the backward of one MoE layer with every buffer
// from `alloc`. Category `dispatch`: routing [T, E] ×3 fp32 + [T, E] bool + top-k weights [T, k]
// fp32 and ids [T, k] int64, and every dispatch/combine buffer, expert activation or gradient,
// borrowed expert weight and its gradient; the layer input, the upstream gradient and the native
// expert/router weights and their fp32 gradient accumulators are `activations` and `fsdp`,
// allocated before the first phase.
// Phases (P = fwd/<layer>/moe/, Q = bwd/<layer>/recompute/moe/, G = bwd/<layer>/moe/):
//   uncapped: P{route,dispatch,experts,combine}, Q{dispatch,experts,combine}, G{combine,experts,dispatch};
//   capped:   P route, P dispatch/rJ; Q dispatch/rJ (store) or Q route (recompute); G dispatch/rJ.
// A token's k expert outputs are summed in increasing expert order in fp32 in uncapped runs and
// in capped runs at one rank, so the forward output and d_x are bitwise equal to the single-rank
// uncapped run on the same tokens; capped runs at EP > 1 add a token's rows in round order
// (fp32 re-association; see executor/README.md for the bounds).
// Throws std::invalid_argument for bad dims, InputError for bad knobs or routing.
DispatchScheduleResult run_dispatch_schedule(TrackingAllocator& alloc, const DispatchScheduleConfig& config);
// The same on every rank of `comm` (collective: every rank calls it with the same config).
// Rank r holds tokens [r·T, (r+1)·T) and experts [r·E/EP, (r+1)·E/EP) of the single-rank run
// over EP·T tokens with the same seed (inputs are a pure function of the seed and the global
// index), so that run with config.topk_ids = the ranks' ids concatenated is the reference.
DispatchScheduleResult run_dispatch_schedule(Communicator& comm, TrackingAllocator& alloc,
                                             const DispatchScheduleConfig& config);

}  // namespace flatpeak::exec
