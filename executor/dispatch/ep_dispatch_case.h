// Deterministic inputs for one MoE layer over EP ranks, a pure function of (seed, rank, index),
// and the per-rank run of a schedule: shared by the dispatch tests (threads and MPI) and
// tools/bench/dispatch_ranks.
//   EpCase c = make_ep_case(dims, /*ep=*/4, parse_routing_model("rho=2.5"), /*seed=*/7);
//   EpRankResult r = run_ep_rank(comm, alloc, c, config);   // r.out, r.d_w_gate_up, r.stats
//   EpRankResult ref = run_ep_reference(c);                  // all EP·T tokens on one rank
#pragma once

#include <cstdint>
#include <vector>

#include "executor/dispatch/ep_dispatch.h"
#include "spec/routing.h"

namespace flatpeak::exec {

struct EpCase {
  MoeDims dims;  // tokens = T per rank
  int64_t ep = 1;
  uint64_t seed = 0;
  // Global tensors; rank r owns tokens [r·T, (r+1)·T) and experts [r·L, (r+1)·L).
  std::vector<float> x;             // [EP·T, H]
  std::vector<int32_t> topk_ids;    // [EP·T, k] generate_routing per rank (rank = ep_rank = r)
  std::vector<float> topk_weights;  // [EP·T, k] positive, each token's k sum to 1
  std::vector<float> d_out;         // [EP·T, H]
  std::vector<float> w_gate_up;     // [E, 2F, H]
  std::vector<float> w_down;        // [E, H, F]
};
EpCase make_ep_case(const MoeDims& dims, int64_t ep, const RoutingModel& routing, uint64_t seed);

struct EpRankResult {
  std::vector<float> out;          // [T, H] (reference: [EP·T, H])
  std::vector<float> d_x;          // [T, H]
  std::vector<float> d_weights;    // [T, k]
  std::vector<float> d_w_gate_up;  // [L, 2F, H] (reference: [E, 2F, H])
  std::vector<float> d_w_down;     // [L, H, F]
  EpDispatchStats stats;
};
// This rank's slice of the case through moe_dispatch_backward (grads start at zero).
EpRankResult run_ep_rank(Communicator& comm, TrackingAllocator& alloc, const EpCase& c,
                         const EpDispatchConfig& config);
// The whole case on one rank with the ops alone.
EpRankResult run_ep_reference(const EpCase& c);

}  // namespace flatpeak::exec
