// LLEP's Least-Loaded Assignment (reference/dispatch.md §2) and PipelinedLLEP rounds (§5).
//   LlaResult lla = least_loaded_assignment(expert_loads(x.copies), /*ep_ranks=*/4, LlaKnobs{});
//   CountMatrix send = lla_send_rows(lla, x.copies);                 // [EP][EP] rows, src × dst
//   PipelinedRounds r = pipelined_rounds(send, /*chunk_cap_rows=*/8192);  // r.max_round_received_rows
#pragma once

#include <cstdint>
#include <vector>

#include "spec/errors.h"
#include "spec/routing.h"

namespace flatpeak {

// LLEP knobs. Defaults: α and m as the reference code (1.1, 1024); λ = 1.3 as the reference's
// README and the paper (the reference code leaves λ unset, i.e. LLA always runs: use 0).
struct LlaKnobs {
  double llep_alpha = 1.1;           // α: per-rank capacity cap = max(1, floor(α·floor(Σl/EP)))
  int64_t min_rows_per_gemm = 1024;  // m: a helper is skipped when its partial chunk would be < m
  double imbalance_trigger = 1.3;    // λ: LLA runs only when max/mean native rank load ≥ λ;
                                     //    λ = 0 runs it always
  // Most distinct experts a rank may borrow (a helper that holds this many takes no rows of
  // another expert; rows no helper may take stay on their native rank, beyond the cap). −1: no
  // limit (the reference). PipelinedLLEP sets its launch-time pool (pipelined_foreign_pool).
  int64_t max_foreign_experts = -1;
};

// Adds a Diagnostic per bad knob, pointers named after the flags: --llep-alpha (finite, ≥ 1),
// --llep-min-rows (≥ 0), --llep-lambda (finite, ≥ 0).
void validate_lla_knobs(const LlaKnobs& knobs, InputErrors& errors);

// Rows [start_row, start_row + rows) of one expert's global copies, computed on `rank`.
// Global copy order of an expert is source-rank-major (all of source 0's copies, then source
// 1's, ...), so the native rank keeps the low-numbered sources and helpers take the tail.
struct LlaRange {
  int64_t rank = 0;
  int64_t start_row = 0;
  int64_t rows = 0;
};

// Expert weights lent by their native rank to a helper for rows [start_row, start_row + rows).
struct LlaWeightTransfer {
  int64_t expert = 0;
  int64_t from_rank = 0;  // native rank
  int64_t to_rank = 0;    // helper rank
  int64_t start_row = 0;
  int64_t rows = 0;
};

struct LlaResult {
  bool triggered = false;          // LLA ran; false = λ fall-back to plain EP (no weight moves)
  double native_imbalance = 1.0;   // max/mean per-rank native load: what λ is compared with
  int64_t capacity_rows = 0;       // cap (0 when not triggered)
  std::vector<std::vector<LlaRange>> assignment;  // [E]: the native rank's range first (when it
                                                  // keeps any), then helpers in plan order; empty
                                                  // when the expert has no rows. A forced
                                                  // placement may give a helper a second range.
                                                  // Ranges tile [0, l_e) in order.
  std::vector<int64_t> rank_rows;  // [EP] R_p: rows each rank computes (its receive total)
  std::vector<LlaWeightTransfer> weight_transfers;  // every helper range, in plan order
  std::vector<int64_t> foreign_experts_per_rank;    // [EP] S_p: distinct experts a rank borrows
  std::vector<int64_t> lent_weights_per_rank;       // [EP] S_sent: distinct (expert, helper)
                                                    // pairs a rank lends
  int64_t forced_rows = 0;         // rows placed by the forced fall-back (no helper accepted
                                   // them; they may exceed the cap)
  double rho_l = 1.0;              // ρ_L = max rank_rows / mean (1.0 when all zero)
};

// The LLA as the reference implements it (compute_llep_lpt_plan + the λ test of its entry point):
//   λ test: r = max/mean of per-rank native loads; λ > 0 and r < λ → plain EP plan.
//   cap = max(1, floor(α·floor(Σl/EP))); pending[g] = native load not yet planned;
//   eff(g) = assigned[g] + pending[g]. Experts in descending load order (ties: lower id first):
//   remove l_e from pending of its native g; room = cap − eff(g);
//   room ≥ l_e: all native.  0 < room < l_e: native takes room, the rest spills repeatedly: each
//   time, helpers sorted by eff ascending (ties: lower rank), the first with avail = cap − eff > 0
//   whose chunk c = min(rest, avail) is not (c < m and rest > c) takes c; if none qualifies, all
//   the rest is forced onto the least-loaded helper.  room ≤ 0: one pass over the helpers sorted
//   once, same accept rule; the leftover is forced onto the first helper of that (stale) sort.
//   EP = 1: everything stays native.
// Deltas from the paper (§2.6): the λ test uses per-rank native loads, not per-expert loads; an
// excess below m is still spilled when it is the final remainder; case room ≤ 0 is one pass.
// expert_loads.size() must be a multiple of ep_ranks (experts split E/EP per rank).
LlaResult least_loaded_assignment(const std::vector<int64_t>& expert_loads, int64_t ep_ranks,
                                  const LlaKnobs& knobs);

// The load bound §2.7 derives for LLA paths: R_p ≤ cap + δ with
// δ = max(0, (EP−1)·m + (α+1)·EP − (α−1)·EP·N), N = rows per source rank (T·k); rounded up.
// A derivation, not a proof for every path: the tests check it on 2000 random skewed load
// vectors (EP 2..16), where it held. For a plan, use the LLA result's own rank_rows / rho_l.
int64_t lla_slack_rows(const LlaKnobs& knobs, int64_t ep_ranks, int64_t rows_per_rank);

// How one source's copies split over computing ranks: [E] ranges over the source's own copies
// of expert e (start_row counts within this source's copies of e), from the plan and the
// [EP][E] copies matrix the plan was made from. The executor sends each range to its rank.
std::vector<std::vector<LlaRange>> lla_source_ranges(const LlaResult& plan,
                                                     const CountMatrix& copies,
                                                     int64_t source_rank);
// [EP][EP] rows each source sends to each destination under the plan (row s sums to source s's
// copies; column d sums to rank_rows[d]).
CountMatrix lla_send_rows(const LlaResult& plan, const CountMatrix& copies);

// PipelinedLLEP rounds (§5, proportional striping O2). Source s with n_sd rows for destination d
// (N_s = Σ_d n_sd) gives its i-th copy for d the key (i + ½)/n_sd, orders its copies by key
// (ties: lower destination first) and cuts that order into rounds of exactly C = chunk_cap_rows
// (the last one shorter). All sources run n = max_s ceil(N_s/C) rounds (ranks that are done send
// nothing). Per round and destination:  B_jd ≤ Σ_s min(n_sd, C, floor(n_sd·(C + P_s)/N_s) + 1),
// P_s = destinations s sends to (the count of keys in a window of C consecutive keys).
struct PipelinedRounds {
  int64_t chunk_cap_rows = 0;            // C
  int64_t rounds = 0;                    // n (0 when nothing is sent)
  std::vector<CountMatrix> send_rows;    // [n][EP][EP]: rows source s sends to d in round j
  CountMatrix received_rows;             // [n][EP]: B_jd, rows destination d receives in round j
  std::vector<int64_t> max_received_rows;  // [EP]: max over rounds
  int64_t max_round_received_rows = 0;   // max over rounds and destinations
  int64_t received_bound_rows = 0;       // max_d of the bound above (≥ max_round_received_rows)
};
// Exact, with no copy materialised; cost O(EP³·n·log EP): meant for the executor and tests. The
// planner only needs round_receive_bound_rows (O(EP²)).
PipelinedRounds pipelined_rounds(const CountMatrix& send_rows, int64_t chunk_cap_rows);

// Position (0-based) of source's copy `index` (0 ≤ index < rows_per_destination[destination])
// for `destination` in that source's striped send order; its round is position / C.
int64_t striped_position(const std::vector<int64_t>& rows_per_destination, int64_t destination,
                         int64_t index);

// The bound for known loads: max_d Σ_s min(n_sd, C, floor(n_sd·(C + P_s)/N_s) + 1).
int64_t round_receive_bound_rows(const CountMatrix& send_rows, int64_t chunk_cap_rows);

// The bound the planner states for one round's receive buffer, sized at launch before loads are
// known, when every source sends N rows and every rank receives at most ρ_bound·N (ρ_bound ≥ 1,
// e.g. ρ_L of the plan's LLA, or max(λ, α) + δ/N):
//   min(EP·C, ceil((C + EP)·ρ_bound) + EP) rows per destination.
// Derivation: a destination takes ≤ C rows from each source (EP·C); with striping it takes
// ≤ n_sd·(C + EP)/N + 1 from source s, and Σ_s n_sd = R_d ≤ ρ_bound·N.
int64_t round_receive_bound_rows(int64_t chunk_cap_rows, int64_t ep_ranks, double rho_bound);

// The cap to use for known loads so that buffers of `buffer_rows` rows per destination (sized
// at launch, e.g. by the function above) are never overflowed: the largest C' ≤ chunk_cap_rows
// with round_receive_bound_rows(send_rows, C') ≤ buffer_rows (more rounds, same memory).
// Returns chunk_cap_rows when the loads already fit; at least 1 whenever buffer_rows ≥ EP.
// Returns 0 when not even C' = 1 fits (buffer_rows < the destinations' source count).
int64_t shrink_chunk_cap(const CountMatrix& send_rows, int64_t chunk_cap_rows,
                         int64_t buffer_rows);

// PipelinedLLEP's launch-time sizes (§5.5), from the knobs alone, before any routing is known; the
// planner and the executor size the same buffers with them.
// ρ_B = max(1, λ, α) + δ/N: the LLA bound on rows a rank computes over the mean N (§2.7).
double pipelined_rho_bound(const LlaKnobs& knobs, int64_t ep_ranks, int64_t rows_per_rank);
// S_cap, the foreign-weight pool of every rank (§5.5 steps 3 and 4): a round's `round_rows`
// received rows spread over the rank's E/EP native experts and S_cap borrowed ones should give
// each GEMM about m rows (floor(round_rows/m) − E/EP; m = 0: no limit from it), and the pool
// holds no more experts than the rank's own E/EP (its weights at most double); then kept in
// [1, E − E/EP] (at least one, so LLA can always spill the hottest expert). 0 at one rank.
int64_t pipelined_foreign_pool(int64_t round_rows, int64_t ep_ranks, int64_t experts, const LlaKnobs& knobs);
// Rows of the store mode's saved expert activations, allocated once: all N at one rank; at
// EP > 1 min(most_rows, max(round_rows, ceil(ρ_B·N))). Rounds whose rows would not fit on some
// rank are not stored but recomputed in backward into the store, then free (round_rows ≤ it).
int64_t pipelined_store_rows(int64_t round_rows, int64_t ep_ranks, int64_t rows_per_rank, int64_t most_rows,
                             double rho_bound);

// Adds a Diagnostic when chunk_cap_rows < 1 (pointer --chunk-cap-rows).
void validate_chunk_cap(int64_t chunk_cap_rows, InputErrors& errors);

}  // namespace flatpeak
