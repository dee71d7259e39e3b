// Internals of the CUDA dispatch at EP ≥ 1 (dispatch_ep_cuda.h), shared by its two files only:
//   dispatch_ep_cuda_ops.cu  the launchers of the kernels (dispatch_ep_kernels.cuh): inputs, routing,
//                            regrouping, packing, the per-token sums, the experts' GEMMs, the
//                            router's backward;
//   dispatch_ep_cuda.cu      the entry point and the passes (uncapped, capped rounds).
// The buffers mirror the CPU's (executor/schedules/dispatch_internal.h) one for one.
//   LayerDev L(alloc, d, s);  fill_layer(c, d, L, s);  RoutingDev r(alloc, d, s);  compute_routing(blas, d, L, ids, r);
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "executor/cuda/cublas_context.h"
#include "executor/cuda/device_allocator.h"
#include "executor/cuda/dispatch_ep_limits.h"
#include "executor/schedules/dispatch_plan.h"

namespace flatpeak::cuda::dispatch_ep_detail {

using exec::Bf16;
using exec::Category;
using exec::DType;
using exec::dispatch_detail::Dims;
using exec::dispatch_detail::Grouping;
using exec::dispatch_detail::Round;
using exec::dispatch_detail::RowPlan;
using exec::dispatch_detail::z;

constexpr Category kDsp = Category::Dispatch;

// A buffer of n elements of `dtype` (the CPU's Tensor of that numel: the same tracked bytes).
inline DeviceBuffer make_buf(DeviceAllocator& a, DType dtype, int64_t n, cudaStream_t s, Category c = kDsp) {
  return DeviceBuffer(a, n * exec::dtype_bytes(dtype), c, s);
}

// The CPU's LayerData: layer input and upstream gradient (activations), gathered native weights
// and their fp32 gradient accumulators (fsdp), in the same order.
struct LayerDev {
  DeviceBuffer x, d_out, w_router, w_gate_up, w_down, dw_router, dw_gate_up, dw_down, b_expert, db_expert;
  LayerDev(DeviceAllocator& a, const Dims& d, cudaStream_t s)
      : x(make_buf(a, DType::BF16, d.T * d.H, s, Category::Activations)),               // [T, H] bf16
        d_out(make_buf(a, DType::BF16, d.T * d.H, s, Category::Activations)),           // [T, H] bf16
        w_router(make_buf(a, DType::BF16, d.E * d.H, s, Category::Fsdp)),               // [E, H] bf16
        w_gate_up(make_buf(a, DType::BF16, d.L * 2 * d.F * d.H, s, Category::Fsdp)),    // [E/EP, 2F, H] bf16
        w_down(make_buf(a, DType::BF16, d.L * d.H * d.F, s, Category::Fsdp)),           // [E/EP, H, F] bf16
        dw_router(make_buf(a, DType::F32, d.E * d.H, s, Category::Fsdp)),               // [E, H] fp32 +=
        dw_gate_up(make_buf(a, DType::F32, d.L * 2 * d.F * d.H, s, Category::Fsdp)),    // [E/EP, 2F, H] fp32 +=
        dw_down(make_buf(a, DType::F32, d.L * d.H * d.F, s, Category::Fsdp)),           // [E/EP, H, F] fp32 +=
        b_expert(make_buf(a, DType::BF16, d.L * d.Pb, s, Category::Fsdp)),             // [E/EP, 2F + H] bf16 (or empty)
        db_expert(make_buf(a, DType::F32, d.L * d.Pb, s, Category::Fsdp)) {}           // [E/EP, 2F + H] fp32 += (or empty)
};

// The CPU's fill_inputs on the device (this rank's slices of the one-rank run's inputs), the
// gradient accumulators zeroed.
void fill_layer(const exec::DispatchScheduleConfig& c, const Dims& d, LayerDev& L, cudaStream_t s);

// The CPU's Routing: router logits, softmax scores, scattered probs, routing map, renormalised
// top-k weights and the ids.
struct RoutingDev {
  DeviceBuffer logits, scores, scattered, map, topk_w, topk_ids;
  RoutingDev(DeviceAllocator& a, const Dims& d, cudaStream_t s)
      : logits(make_buf(a, DType::F32, d.T * d.E, s)),             // [T, E] fp32
        scores(make_buf(a, DType::F32, d.T * d.E, s)),             // [T, E] fp32
        scattered(make_buf(a, DType::F32, d.T * d.E, s)),          // [T, E] fp32
        map(make_buf(a, DType::BF16, (d.T * d.E + 1) / 2, s)),     // [T, E] bool in ceil(T·E/2) two-byte cells
        topk_w(make_buf(a, DType::F32, d.T * d.k, s)),             // [T, k] fp32
        topk_ids(make_buf(a, DType::I64, d.T * d.k, s)) {}         // [T, k] int64
};

// Uploads the ids (host [T, k] int64, kept alive by the caller until the stream has run) and
// runs the router: logits GEMM, softmax, top-k weights renormalised over the kept experts.
void compute_routing(const CublasContext& blas, const Dims& d, const LayerDev& L, const std::vector<int64_t>& ids, RoutingDev& r);

// Weights and fp32 gradient accumulators of one local expert (native, or a foreign slot).
struct ExpertSlotDev {
  const Bf16 *gu, *down;
  const Bf16* bias;    // gate/up [2F] then down [H]; null without expert biases
  float *dgu, *ddown;  // null: no gradient in this pass
  float* dbias;        // [2F + H]; null without biases or gradient
};
std::vector<ExpertSlotDev> expert_slots(const Dims& d, const RowPlan& p, LayerDev& L, const DeviceBuffer* foreign_w,
                                        DeviceBuffer* foreign_dw);

// Row i of an expert-order layout reads its prob at recv_row (by_recv) or at i.
struct ProbsDev {
  float* p;
  bool by_recv;
};

// The CPU's regroup/ungroup: chunk copies (elem_bytes per element, W elements per row).
void regroup(const Grouping& g, const void* src, void* dst, int64_t W, int64_t elem_bytes, cudaStream_t s);
void ungroup(const Grouping& g, const void* src, void* dst, int64_t W, int64_t elem_bytes, cudaStream_t s);

// Experts over grouped rows: the CPU's experts_forward / experts_fc2 / experts_backward_fc /
// experts_backward_in (act*prob; d prob written over its prob; expert biases broadcast into the
// GEMMs' outputs, which accumulate onto them, and their gradients as the rows' sums).
void experts_forward(const CublasContext& blas, const Dims& d, const std::vector<ExpertSlotDev>& w, const Grouping& g,
                     const ProbsDev& pr, const Bf16* in, Bf16* fc1, Bf16* act, Bf16* fc2);
void experts_fc2(const CublasContext& blas, const Dims& d, const std::vector<ExpertSlotDev>& w, const Grouping& g, const Bf16* act,
                 Bf16* fc2);
void experts_backward_fc(const CublasContext& blas, const Dims& d, const std::vector<ExpertSlotDev>& w, const Grouping& g,
                         const ProbsDev& pr, const Bf16* fc1, const Bf16* act, const Bf16* d_fc2, Bf16* d_act, Bf16* d_fc1);
void experts_backward_in(const CublasContext& blas, const Dims& d, const std::vector<ExpertSlotDev>& w, const Grouping& g,
                         const Bf16* in, const Bf16* d_fc1, Bf16* d_in);

// The router's backward once every d prob is in r.scores ([t, e] at the kept experts): d logits
// into r.logits, d_x += dz·W_router, dW_router += dzᵀ·x.
void router_backward(cudaStream_t s, const Dims& d, LayerDev& L, RoutingDev& r, float* d_x);

// ---- uncapped pass helpers (sort32/unsort32: the two int32 maps of the [T·k] int64 send order)

// pprobs[i] = topk_w[sort32[i]].
void gather_probs(cudaStream_t s, const Dims& d, const int32_t* sort32, const float* topk_w, float* pprobs);
// rows[i] = src[sort32[i] / k] (per_copy: src[sort32[i]]), i < T·k.
void gather_send_rows(cudaStream_t s, const Dims& d, const int32_t* sort32, const Bf16* src, bool per_copy, Bf16* rows);
// repeated[i] = x[i / k]: the reference's repeated tokens, slot order.
void repeat_tokens(cudaStream_t s, const Dims& d, const Bf16* x, Bf16* repeated);
// Per token, its k rows (send order, unsort32) in increasing expert order summed in fp32 from
// zero: into out (bf16) or added to acc (fp32).
void sum_token_rows(cudaStream_t s, const Dims& d, const int64_t* ids, const int32_t* unsort32, const Bf16* rows, Bf16* out,
                    float* acc);
// scores[t, ids[slot]] = pprobs[i] with slot = sort32[i].
void scatter_dprobs(cudaStream_t s, const Dims& d, const int32_t* sort32, const int64_t* ids, const float* pprobs, float* scores);

// ---- capped rounds

// One round's RoundRanges (dispatch_ep_limits.h).
RoundRanges round_ranges(const RowPlan& p, const Round& rd);
// The CPU's pack_round: for each destination's rows, send row q gets src[slot / k], its prob,
// its expert id and its slot (i_home). sort = the send order [T·k] (position → slot), int64.
void pack_round(cudaStream_t s, const Dims& d, const RoundRanges& rr, const int64_t* sort, const float* topk_w,
                const int64_t* topk_ids, const Bf16* src, Bf16* rows, float* p_send, int64_t* i_send, int64_t* i_home);
// Per token, its rows of this round (send position from unsort, destination from dest) in send
// order added to acc [T, H] fp32.
void add_round_rows(cudaStream_t s, const Dims& d, const RoundRanges& rr, const int64_t* dest, const int64_t* unsort,
                    const Bf16* rows, float* acc);
// scores[t, ids[slot]] = dprob[q] for the round's sent rows q (slot = i_home[q]).
void scatter_round_dprobs(cudaStream_t s, const Dims& d, int64_t sent, const int64_t* i_home, const int64_t* ids, const float* dprob,
                          float* scores);

// ---- lending

// dW[e] += g ([P] fp32: gate/up, down, then any biases) for expert e native on this rank.
void add_returned_grads(cudaStream_t s, const Dims& d, LayerDev& L, int64_t e, const float* g);

// Small helpers.
void zero(DeviceBuffer& b, cudaStream_t s);
void f32_to_host(const float* src, int64_t n, std::vector<float>& out, cudaStream_t s);    // synchronises
void bf16_to_host(const Bf16* src, int64_t n, std::vector<float>& out, cudaStream_t s);    // widened; synchronises
void f32_round_bf16_to_host(const float* src, int64_t n, std::vector<float>& out, cudaStream_t s);  // bf16 values

}  // namespace flatpeak::cuda::dispatch_ep_detail
