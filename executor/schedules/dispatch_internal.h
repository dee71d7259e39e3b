// Internals of the dispatch schedule (dispatch_schedule.h), shared by its source files and by
// nothing else (namespace dispatch_detail); the host-side plan over counts and raw pointers is
// dispatch_plan.h, shared with the CUDA twin (executor/cuda/dispatch_ep_cuda.h):
//   dispatch_schedule.cpp  entry points, validation, inputs, launch-time sizes, the one-rank comm;
//   dispatch_plan.cpp      where every copy goes (RowPlan), receive grouping, all-to-allv helper;
//   dispatch_experts.cpp   router forward/backward and the grouped SwiGLU experts' GEMMs;
//   dispatch_lending.cpp   LLEP: borrowed-expert weights lent, their fp32 gradients returned;
//   dispatch_uncapped.cpp  one uncapped dispatch/combine per pass (standard EP, LLEP);
//   dispatch_rounds.cpp    PipelinedLLEP's rounds: counts, launch-time plan, round buffers, traffic;
//   dispatch_capped.cpp    the capped passes (forward, store or recompute, backward).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "executor/comm/communicator.h"
#include "executor/memory/tensor.h"
#include "executor/memory/tracking_allocator.h"
#include "executor/ops/dtype.h"
#include "executor/schedules/dispatch_plan.h"
#include "executor/schedules/dispatch_schedule.h"
#include "spec/least_loaded.h"

namespace flatpeak::exec::dispatch_detail {

inline constexpr Category kDsp = Category::Dispatch;
// What lives through the whole layer and is not the dispatch's own: the layer input and the
// upstream gradient (activations), the gathered weights of the rank's native experts and the
// router, and their fp32 gradient accumulators (fsdp).
struct LayerData {
  Tensor x, d_out, w_router, w_gate_up, w_down, dw_router, dw_gate_up, dw_down, b_expert, db_expert;
  LayerData(TrackingAllocator& alloc, const Dims& d)
      : x(alloc, DType::BF16, {d.T, d.H}, Category::Activations),               // [T, H] bf16
        d_out(alloc, DType::BF16, {d.T, d.H}, Category::Activations),           // [T, H] bf16
        w_router(alloc, DType::BF16, {d.E, d.H}, Category::Fsdp),               // [E, H] bf16
        w_gate_up(alloc, DType::BF16, {d.L, 2 * d.F, d.H}, Category::Fsdp),     // [E/EP, 2F, H] bf16
        w_down(alloc, DType::BF16, {d.L, d.H, d.F}, Category::Fsdp),            // [E/EP, H, F] bf16
        dw_router(alloc, DType::F32, {d.E, d.H}, Category::Fsdp),               // [E, H] fp32 +=
        dw_gate_up(alloc, DType::F32, {d.L, 2 * d.F, d.H}, Category::Fsdp),     // [E/EP, 2F, H] fp32 +=
        dw_down(alloc, DType::F32, {d.L, d.H, d.F}, Category::Fsdp),            // [E/EP, H, F] fp32 +=
        b_expert(alloc, DType::BF16, {d.L, d.Pb}, Category::Fsdp),              // [E/EP, 2F + H] bf16 (or empty)
        db_expert(alloc, DType::F32, {d.L, d.Pb}, Category::Fsdp) {}            // [E/EP, 2F + H] fp32 += (or empty)
};

// The routing of one pass: router logits, softmax scores, scattered probs, routing map, the
// renormalised top-k weights over the drawn ids (softmax over the kept logits), and the ids.
struct Routing {
  Tensor logits, scores, scattered, map, topk_w, topk_ids;
  Routing(TrackingAllocator& alloc, const Dims& d)
      : logits(alloc, DType::F32, {d.T, d.E}, kDsp),     // [T, E] fp32
        scores(alloc, DType::F32, {d.T, d.E}, kDsp),     // [T, E] fp32
        scattered(alloc, DType::F32, {d.T, d.E}, kDsp),  // [T, E] fp32
        // [T, E] bool, 1 B each: held as ceil(T·E/2) two-byte cells (there is no 1-byte dtype)
        map(alloc, DType::BF16, {(d.T * d.E + 1) / 2}, kDsp),
        topk_w(alloc, DType::F32, {d.T, d.k}, kDsp),     // [T, k] fp32
        topk_ids(alloc, DType::I64, {d.T, d.k}, kDsp) {}  // [T, k] int64
};

// The routing of one pass from this rank's drawn ids (router GEMM, softmax, top-k weights).
void compute_routing(const Dims& d, const LayerData& L, const std::vector<int32_t>& ids, Routing& r);

// Source-major rows (width W) into expert order, and back.
template <class V>
void regroup(const Grouping& g, const V* src, V* dst, int64_t W) {
  for (const auto& ch : g.chunks) std::memcpy(dst + ch.exp_row * W, src + ch.recv_row * W, z(ch.rows * W) * sizeof(V));
}
template <class V>
void ungroup(const Grouping& g, const V* src, V* dst, int64_t W) {
  for (const auto& ch : g.chunks) std::memcpy(dst + ch.recv_row * W, src + ch.exp_row * W, z(ch.rows * W) * sizeof(V));
}

inline void copy_rows(const Bf16* src, Bf16* dst, int64_t rows, int64_t H) {
  if (rows > 0) std::memcpy(dst, src, z(rows * H) * sizeof(Bf16));
}

// An fp32 accumulator set to zero before its += passes.
inline void zero_f32(Tensor& t) { std::fill(t.data<float>(), t.data<float>() + t.numel(), 0.0f); }

// ---- the experts a destination computes

// Weights and fp32 gradient accumulators of local expert l: native ones are the layer's,
// borrowed ones a slot of the foreign buffers. A borrowed expert's gradient is an accumulator
// like the native one it is added into (across rounds, then into the native rank's): fp32, so
// where LLA places an expert's rows does not change its gradient beyond fp32 re-association.
struct ExpertSlot {
  const Bf16 *gu, *down;
  const Bf16* bias;    // gate/up [2F] then down [H]; null without expert biases
  float *dgu, *ddown;  // null: no gradient in this pass
  float* dbias;        // [2F + H]; null without biases or gradient
};

std::vector<ExpertSlot> expert_slots(const Dims& d, const RowPlan& p, LayerData& L, const Tensor* foreign_w, Tensor* foreign_dw);

// prob of expert-order row i: from the receive-order probs (by_recv) or indexed by i.
struct Probs {
  float* p;
  bool by_recv;
};

// Expert forward over the grouped rows: fc1 = in·W_guᵀ (+ b_gu), act*prob = silu(gate)·up·prob,
// and (when fc2 is given) fc2 = (act*prob)·W_downᵀ (+ b_down). A bias is written into the output
// rows (bf16) before the GEMM accumulates onto them, so they are rounded once.
void experts_forward(const Dims& d, const std::vector<ExpertSlot>& w, const Grouping& g, const Probs& pr, const Bf16* in,
                     Bf16* fc1, Bf16* act, Bf16* fc2);
// fc2 of the grouped rows (the forward's second GEMM on its own).
void experts_fc2(const Dims& d, const std::vector<ExpertSlot>& w, const Grouping& g, const Bf16* act, Bf16* fc2);
// Expert backward, first half: d act = d fc2·W_down, dW_down += d fc2ᵀ·act (d b_down += Σ rows
// d fc2), d fc1 from d act, and d prob per row, written over its prob (each row reads its prob
// first).
void experts_backward_fc(const Dims& d, const std::vector<ExpertSlot>& w, const Grouping& g, const Probs& pr, const Bf16* fc1,
                         const Bf16* act, const Bf16* d_fc2, Bf16* d_act, Bf16* d_fc1);
// Expert backward, second half: dW_gate_up += d fc1ᵀ·in (d b_gu += Σ rows d fc1) and d in = d fc1·W_gate_up.
void experts_backward_in(const Dims& d, const std::vector<ExpertSlot>& w, const Grouping& g, const Bf16* in, const Bf16* d_fc1,
                         Bf16* d_in);
// The router's backward once every d prob is in r.scores ([t, e] at the chosen experts); adds
// into d_x and the router's fp32 weight gradient.
void router_backward(const Dims& d, LayerData& L, Routing& r, float* d_x);

// ---- LLEP lending (dispatch_lending.cpp)

// The borrowed weights of one pass: [S, P] bf16 with S = `slots` (the realised S_p uncapped, the
// launch-time pool S_cap ≥ S_p capped; empty without LLEP or helpers), filled from the native ranks.
Tensor borrow_weights(Communicator& comm, TrackingAllocator& alloc, const Dims& d, const RowPlan& p, const LayerData& L,
                      int64_t slots);
// The helpers' fp32 gradients of every lent expert back to its native rank, added to its
// accumulators in helper-rank order: uncapped through [S_sent, P] slots (lent_dw), capped one
// (expert, helper) pair at a time through a [1, P] staging slot (the same sums in the same order).
void return_weight_grads(Communicator& comm, const Dims& d, const RowPlan& p, LayerData& L, const Tensor& foreign_dw, Tensor& lent_dw);
void return_weight_grads_staged(Communicator& comm, const Dims& d, const RowPlan& p, LayerData& L, const Tensor& foreign_dw,
                                Tensor& staging);

// ---- capped rounds (PipelinedLLEP; dispatch_rounds.cpp)

// The round buffers of one pass, allocated once at its launch: send [D, C, H], receive [D, B, H],
// combine send [D, B, H], combine receive [D, C, H] (bf16), probs and indices [D, 2(B+C)] (fp32,
// int64), destination/sort/unsort indices [3, T·k] (int64) and the combine accumulator [T, H]
// (fp32). Per slot the probs hold [C sent | B received | B in expert order (then d prob) | C d
// prob home], the indices [C expert ids sent | B received | B unused | C slots of the sent rows].
struct RoundSet {
  int64_t C, B, D;
  Tensor send, recv, comb_send, comb_recv, probs, index, dsu, comb_acc;
  RoundSet(TrackingAllocator& alloc, const Dims& d, int64_t cap, int64_t buffer_rows, int64_t depth, const RowPlan& p,
           const int64_t* ids)
      : C(cap), B(buffer_rows), D(depth),
        send(alloc, DType::BF16, {D, C, d.H}, kDsp),
        recv(alloc, DType::BF16, {D, B, d.H}, kDsp),
        comb_send(alloc, DType::BF16, {D, B, d.H}, kDsp),
        comb_recv(alloc, DType::BF16, {D, C, d.H}, kDsp),
        probs(alloc, DType::F32, {D, 2 * (B + C)}, kDsp),
        index(alloc, DType::I64, {D, 2 * (B + C)}, kDsp),
        dsu(alloc, DType::I64, {3, d.N}, kDsp),
        comb_acc(alloc, DType::F32, {d.T, d.H}, kDsp) {
    int64_t* q = dsu.data<int64_t>();
    fill_send_order(p, d, ids, q + d.N, q + 2 * d.N, q);
    zero_f32(comb_acc);
  }
  const int64_t* sort() const { return dsu.data<int64_t>() + dsu.dim(1); }
  int64_t slot_of(int64_t j) const { return j % D; }
  float* prob_part(int64_t j, int64_t part) { return probs.data<float>() + slot_of(j) * 2 * (B + C) + part; }
  int64_t* index_part(int64_t j, int64_t part) { return index.data<int64_t>() + slot_of(j) * 2 * (B + C) + part; }
  Bf16* send_rows(int64_t j) { return send.data<Bf16>() + slot_of(j) * C * send.dim(2); }
  Bf16* recv_rows(int64_t j) { return recv.data<Bf16>() + slot_of(j) * B * recv.dim(2); }
};

// Round j at the source: its rows (x, or d_out for `grads`) into the send buffer `rows`, their
// probs and expert ids, and the slot of each row kept for the way home.
void pack_round(const Dims& d, const RowPlan& p, const Routing& r, RoundSet& rs, const Round& rd, int64_t j, const Bf16* src, Bf16* rows);
// Round j's probs to the destination and into expert order ([C+B, C+2B)), checking the expert
// ids that came with them against the plan.
void send_round_probs(Communicator& comm, const RowPlan& p, RoundSet& rs, const Round& rd, int64_t j);
// Round j's forward up to act*prob: the source sends its rows with their probs and ids, the
// destination regroups them by expert into `in` and runs fc1 and act*prob.
void round_dispatch(Communicator& comm, const Dims& d, const LayerData& L, const RowPlan& p, const Routing& r, RoundSet& rs,
                    const Round& rd, int64_t j, const std::vector<ExpertSlot>& w, Bf16* in, Bf16* fc1, Bf16* act);
// Round j's fc2 and combine: fc2 rows back to source-major order, sent home and added to the
// accumulator (one rank: in increasing expert order within and across rounds).
void round_combine(Communicator& comm, const Dims& d, const std::vector<ExpertSlot>& w, RoundSet& rs, const Round& rd, int64_t j,
                   const Bf16* act, Bf16* fc2, Bf16* unperm);

// ---- the passes: no-grad forward, recompute, backward of one layer, results into `res`

void run_uncapped(Communicator& comm, TrackingAllocator& alloc, const Dims& d, LayerData& L, const RowPlan& p,
                  const std::vector<int32_t>& ids, const DispatchScheduleConfig& c, DispatchScheduleResult& res);
void run_capped(Communicator& comm, TrackingAllocator& alloc, const Dims& d, LayerData& L, const RowPlan& p,
                const std::vector<int32_t>& ids, const DispatchScheduleConfig& c, DispatchScheduleResult& res);

}  // namespace flatpeak::exec::dispatch_detail
