// The host-side plan of the dispatch schedule (dispatch_schedule.h): where every copy goes, the
// receive grouping, the capped rounds and their launch-time sizes, and the exchanges that move
// rows, lent weights and their gradients, over counts and raw pointers only (no Tensor, no
// allocator), so that the CPU schedule (dispatch_internal.h) and its CUDA twin
// (executor/cuda/dispatch_ep_cuda.h, device pointers through a device communicator) share them.
//   const Dims d = dims_of(c, comm.size(), comm.rank());
//   const RowPlan p = plan_rows(c, d, gathered_counts);          // identical on every rank
//   const CappedPlan cp = plan_capped(c, d, p);  // C, B, pool, store rows, rounds
#pragma once

#include <cstdint>
#include <functional>
#include <stdexcept>
#include <vector>

#include "executor/comm/communicator.h"
#include "executor/ops/dtype.h"
#include "executor/schedules/dispatch_schedule.h"
#include "spec/least_loaded.h"

namespace flatpeak::exec::dispatch_detail {

inline size_t z(int64_t i) { return static_cast<size_t>(i); }

struct Dims {
  int64_t T, H, E, k, F, N;  // N = T·k token copies a rank sends
  int64_t ep, me, L;         // EP ranks, this rank, native experts per rank (E/EP)
  int64_t P;                 // elements of one expert's weights: [2F, H] gate/up, [H, F] down, then any biases
  int64_t Pb;                // of them the biases: gate/up [2F] then down [H] (0 without expert biases)
};

inline Dims dims_of(const DispatchScheduleConfig& c, int64_t ep, int64_t me) {
  const int64_t bias = c.expert_bias ? 2 * c.ffn + c.hidden : 0;
  return Dims{c.tokens, c.hidden, c.experts, c.top_k, c.ffn, c.tokens * c.top_k, ep, me, c.experts / ep, 3 * c.hidden * c.ffn + bias, bias};
}

// ---- where every copy goes: identical on every rank (made from the all-gathered counts)

struct RowPlan {
  struct Seg {
    int64_t start, rows, dest, pos;  // this source's copies [start, start+rows) of an expert → dest, at send position pos
  };
  int64_t ep = 1, me = 0, E = 0, L = 0;
  CountMatrix copies;                          // [EP][E] copies per source and expert
  std::vector<int64_t> c;                      // [EP][E][EP] rows of source s's copies of e computed on d
  bool lla_ran = false;
  CountMatrix send_rows;                       // [EP][EP] source × destination
  std::vector<int64_t> rank_rows;              // [EP] rows each rank computes
  std::vector<int64_t> foreign;                // experts this rank borrows, ascending
  std::vector<int64_t> local_of;               // [E] local index: native e − me·L, borrowed L + i; −1
  std::vector<std::vector<int64_t>> helpers;   // [E] ranks other than the native one computing rows of e
  std::vector<std::vector<int64_t>> lent_slot; // [E] native here: slot of (e, helpers[e][i]) in the lent grads
  int64_t lent = 0;                            // S_sent
  std::vector<std::vector<Seg>> segs;          // this rank as source: [E], in row order
  std::vector<int64_t> dest_begin;             // [EP + 1] send-order offset of each destination
  std::vector<int64_t> recv_begin;             // [EP + 1] receive offset of each source (uncapped)

  int64_t rows(int64_t s, int64_t e, int64_t d) const { return c[z((s * E + e) * ep + d)]; }
  int64_t locals() const { return L + static_cast<int64_t>(foreign.size()); }
  int64_t received() const { return rank_rows[z(me)]; }
  // Send position of this source's i-th copy (token order) of expert e.
  int64_t position(int64_t e, int64_t i) const {
    for (const Seg& s : segs[z(e)])
      if (i >= s.start && i < s.start + s.rows) return s.pos + i - s.start;
    throw std::logic_error("dispatch schedule: a copy outside its expert's ranges");
  }
  int64_t destination(int64_t e, int64_t i) const {
    for (const Seg& s : segs[z(e)])
      if (i >= s.start && i < s.start + s.rows) return s.dest;
    throw std::logic_error("dispatch schedule: a copy outside its expert's ranges");
  }
};

RowPlan make_row_plan(const Dims& d, CountMatrix copies, bool llep, const LlaKnobs& knobs);
// Fills the send order of this rank's copies: sort[pos] = slot; unsort[slot] = pos and
// dest[slot] = destination when given. At one rank: the stable sort of the copies by expert.
void fill_send_order(const RowPlan& p, const Dims& d, const int64_t* ids, int64_t* sort, int64_t* unsort, int64_t* dest);

// Rows a destination received (source-major), grouped in expert order: chunk = rows of one
// (source, expert), contiguous in both layouts; begin[l] = first expert-order row of local l.
struct Grouping {
  struct Chunk {
    int64_t local, source, exp_row, recv_row, rows;
  };
  std::vector<Chunk> chunks;    // sorted by exp_row
  std::vector<int64_t> begin;   // [locals + 1]
  int64_t rows = 0;
};

// Source s sent rows [first[s], first[s] + count[s]) of its list for this rank (experts
// ascending, plan rows each), placed source-major in the receive buffer.
Grouping make_grouping(const RowPlan& p, const std::vector<int64_t>& first, const std::vector<int64_t>& count);

// Throws std::invalid_argument for bad dims, InputError for bad LLA knobs (the checks every
// entry point makes before anything is allocated).
void validate_config(const DispatchScheduleConfig& c, int64_t ep);

// The row plan from the all-gathered [EP][E] counts; PipelinedLLEP's LLA lends no rank more
// experts than the launch-time foreign-weight pool holds.
RowPlan plan_rows(const DispatchScheduleConfig& c, const Dims& d, CountMatrix copies);

// One all-to-allv of rows of width W: this rank sends out[d] rows to d from send (at
// out_begin[d]) and receives in[s] rows from s into recv (at in_begin[s]).
void exchange(Communicator& comm, const void* send, const std::vector<int64_t>& out, const std::vector<int64_t>& out_begin,
              void* recv, const std::vector<int64_t>& in, const std::vector<int64_t>& in_begin, int64_t W, DType dtype);
// Per-destination counts and offsets of a matrix row / column.
std::vector<int64_t> row_of(const CountMatrix& m, int64_t s);
std::vector<int64_t> column_of(const CountMatrix& m, int64_t d);
std::vector<int64_t> offsets_of(const std::vector<int64_t>& counts);

// ---- capped rounds (dispatch_rounds.cpp)

// Rows every source sends every destination in each round: proportional striping (spec
// pipelined_rounds), or the send order cut into rounds of C (O1).
std::vector<CountMatrix> round_counts(const RowPlan& p, int64_t cap, bool striping);

// One round's traffic: rows this rank sends each destination and receives from each source,
// where they start in its lists, and the grouping of what it receives.
struct Round {
  std::vector<int64_t> out, out_begin, in, in_begin;  // [EP] (+1 for the begins)
  std::vector<int64_t> first_out;                     // [EP] start in this source's list for d
  int64_t sent = 0, received = 0;
  Grouping g;
};

std::vector<Round> make_rounds(const RowPlan& p, const std::vector<CountMatrix>& counts);

// A capped pass's launch-time sizes and rounds (every rank computes the same): C the cap the
// buffers were sized for, B the receive rows per round, the foreign-weight pool, the store's rows;
// the cap in effect (shrunk when known loads would overflow B), the rounds, and the rounds
// the store keeps. Throws std::logic_error when no cap fits (a broken invariant).
struct CappedPlan {
  int64_t C = 0, B = 0, pool = 0, store_rows = 0, cap = 0, stored = 0, max_received = 0;
  std::vector<CountMatrix> counts;  // [rounds][EP][EP]
  std::vector<Round> rounds;
  std::vector<int64_t> store_row;   // [rounds + 1] first store row of each round (this rank)
  int64_t n() const { return static_cast<int64_t>(rounds.size()); }
};
CappedPlan plan_capped(const DispatchScheduleConfig& c, const Dims& d, const RowPlan& p);

// ---- LLEP lending over raw pointers (host or device, as the communicator moves them)

// Every expert with helpers from its native rank to them, gate/up, down, then (d.Pb > 0) the
// biases, into the helpers' slots of `foreign` ([S, P] bf16; null when this rank borrows none):
// two or three collectives per lent expert, in expert order. w_gate_up [E/EP, 2F, H], w_down
// [E/EP, H, F] and b_expert [E/EP, 2F + H] bf16 (null without biases).
void lend_weights(Communicator& comm, const Dims& d, const RowPlan& p, const void* w_gate_up, const void* w_down,
                  const void* b_expert, void* foreign);
// The helpers' fp32 gradients ([S_p, P] foreign_dw) of every lent expert into the native rank's
// [S_sent, P] lent_dw slots (p.lent_slot), one collective per lent expert.
void send_lent_grads(Communicator& comm, const Dims& d, const RowPlan& p, const void* foreign_dw, void* lent_dw);
// The same one (expert, helper) pair at a time through a [1, P] fp32 staging slot on the native
// rank, which calls add(e) after each pair arrives (helper-rank order within an expert).
void send_lent_grads_staged(Communicator& comm, const Dims& d, const RowPlan& p, const void* foreign_dw, void* staging,
                            const std::function<void(int64_t e)>& add);

}  // namespace flatpeak::exec::dispatch_detail
