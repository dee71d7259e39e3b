// The kernel launchers of the CUDA dispatch at EP ≥ 1 (dispatch_ep_cuda_internal.cuh); the kernels
// (dispatch_ep_kernels.cuh) are each the device form of a loop of the CPU schedule
// (executor/schedules/dispatch_*.cpp), in the same order of fp32 operations where a sum's order is
// the CPU's (a token's rows; the router's kept experts).
// Every launch is on the rank's stream; grid-stride loops over 64-bit element counts. The launches
// themselves (grids, order, a check after each) are dispatch_ep_kernels.cuh's launch functions.
#include "executor/cuda/dispatch_ep_cuda_internal.cuh"
#include "executor/cuda/dispatch_ep_kernels.cuh"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "executor/cuda/cuda_check.h"
#include "executor/cuda/kernel_util.cuh"
#include "executor/cuda/schedule_util_cuda.cuh"

namespace flatpeak::cuda::dispatch_ep_detail {

namespace {

using exec::f32_to_bf16;
using exec::to_f32;

// Calls fn(l, i0, m) for every local expert with m > 0 rows from expert-order row i0.
template <class Fn>
void for_each_expert(const Grouping& g, Fn fn) {
  for (size_t l = 0; l + 1 < g.begin.size(); ++l) {
    const int64_t i0 = g.begin[l], m = g.begin[l + 1] - i0;
    if (m > 0) fn(l, i0, m);
  }
}

// Calls fn(i0, j0, n) for runs of expert-order rows and their prob index: per chunk when the
// probs are in receive order, else once over every row.
template <class Fn>
void for_each_prob_run(const Grouping& g, const ProbsDev& pr, Fn fn) {
  if (!pr.by_recv) {
    if (g.rows > 0) fn(int64_t{0}, int64_t{0}, g.rows);
    return;
  }
  for (const auto& ch : g.chunks)
    if (ch.rows > 0) fn(ch.exp_row, ch.recv_row, ch.rows);
}

void copy_chunks(const Grouping& g, const void* src, void* dst, int64_t W, int64_t eb, bool to_expert_order, cudaStream_t s) {
  for (const auto& ch : g.chunks) {
    if (ch.rows <= 0) continue;
    const int64_t from = to_expert_order ? ch.recv_row : ch.exp_row, to = to_expert_order ? ch.exp_row : ch.recv_row;
    FLATPEAK_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(dst) + to * W * eb, static_cast<const char*>(src) + from * W * eb,
                                        static_cast<size_t>(ch.rows * W * eb), cudaMemcpyDeviceToDevice, s));
  }
}

}  // namespace

void fill_layer(const exec::DispatchScheduleConfig& c, const Dims& d, LayerDev& L, cudaStream_t s) {
  using exec::cuda_detail::fill_bf16_cuda;
  const int64_t global = c.replica * d.ep + d.me;  // this rank's tokens among every group's
  const uint64_t seed = c.seed * 8;                // the CPU's seed_of(c, stream) = seed·8 + stream
  fill_bf16_cuda(L.x.as<Bf16>(), d.T * d.H, seed + 1, 1.0f, s, global * d.T * d.H);
  fill_bf16_cuda(L.d_out.as<Bf16>(), d.T * d.H, seed + 2, 1.0f, s, global * d.T * d.H);
  fill_bf16_cuda(L.w_router.as<Bf16>(), d.E * d.H, seed + 3, 1.0f / std::sqrt(static_cast<float>(d.H)), s);
  fill_bf16_cuda(L.w_gate_up.as<Bf16>(), d.L * 2 * d.F * d.H, seed + 4, 2.0f / std::sqrt(static_cast<float>(d.H)), s,
                 d.me * d.L * 2 * d.F * d.H);
  fill_bf16_cuda(L.w_down.as<Bf16>(), d.L * d.H * d.F, seed + 5, 2.0f / std::sqrt(static_cast<float>(d.F)), s,
                 d.me * d.L * d.H * d.F);
  if (d.Pb > 0) fill_bf16_cuda(L.b_expert.as<Bf16>(), d.L * d.Pb, seed + 7, 0.5f, s, d.me * d.L * d.Pb);
  for (DeviceBuffer* b : {&L.dw_router, &L.dw_gate_up, &L.dw_down, &L.db_expert}) zero(*b, s);
}

void compute_routing(const CublasContext& blas, const Dims& d, const LayerDev& L, const std::vector<int64_t>& ids, RoutingDev& r) {
  cudaStream_t s = blas.stream();
  FLATPEAK_CUDA_CHECK(cudaMemcpyAsync(r.topk_ids.raw(), ids.data(), static_cast<size_t>(d.N) * 8, cudaMemcpyHostToDevice, s));
  gemm_cuda(blas, false, true, d.T, d.E, d.H, 1.0f, DType::BF16, L.x.raw(), d.H, DType::BF16, L.w_router.raw(), d.H, false,
            DType::F32, r.logits.raw(), d.E);
  FLATPEAK_CUDA_CHECK(cudaMemsetAsync(r.map.raw(), 0, static_cast<size_t>(d.T * d.E), s));
  launch_routing(r.logits.as<float>(), r.topk_ids.as<int64_t>(), r.scores.as<float>(), r.scattered.as<float>(),
                 r.map.as<uint8_t>(), r.topk_w.as<float>(), d.T, d.E, d.k, s);
}

std::vector<ExpertSlotDev> expert_slots(const Dims& d, const RowPlan& p, LayerDev& L, const DeviceBuffer* foreign_w,
                                        DeviceBuffer* foreign_dw) {
  std::vector<ExpertSlotDev> out;
  for (int64_t l = 0; l < p.locals(); ++l) {
    ExpertSlotDev s{};
    if (l < d.L) {
      s.gu = L.w_gate_up.as<Bf16>() + l * 2 * d.F * d.H;
      s.down = L.w_down.as<Bf16>() + l * d.H * d.F;
      s.dgu = L.dw_gate_up.as<float>() + l * 2 * d.F * d.H;
      s.ddown = L.dw_down.as<float>() + l * d.H * d.F;
      if (d.Pb > 0) {
        s.bias = L.b_expert.as<Bf16>() + l * d.Pb;
        s.dbias = L.db_expert.as<float>() + l * d.Pb;
      }
    } else {
      const int64_t off = (l - d.L) * d.P;
      s.gu = foreign_w->as<Bf16>() + off;
      s.down = s.gu + 2 * d.F * d.H;
      if (d.Pb > 0) s.bias = s.gu + 3 * d.F * d.H;
      if (foreign_dw && foreign_dw->raw() != nullptr) {
        s.dgu = foreign_dw->as<float>() + off;
        s.ddown = s.dgu + 2 * d.F * d.H;
        if (d.Pb > 0) s.dbias = s.dgu + 3 * d.F * d.H;
      }
    }
    out.push_back(s);
  }
  return out;
}

void regroup(const Grouping& g, const void* src, void* dst, int64_t W, int64_t eb, cudaStream_t s) {
  copy_chunks(g, src, dst, W, eb, true, s);
}
void ungroup(const Grouping& g, const void* src, void* dst, int64_t W, int64_t eb, cudaStream_t s) {
  copy_chunks(g, src, dst, W, eb, false, s);
}

void experts_fc2(const CublasContext& blas, const Dims& d, const std::vector<ExpertSlotDev>& w, const Grouping& g, const Bf16* act,
                 Bf16* fc2) {
  const bool bias = d.Pb > 0;
  for_each_expert(g, [&](size_t l, int64_t i0, int64_t m) {
    if (bias) launch_broadcast_row(w[l].bias + 2 * d.F, fc2 + i0 * d.H, m, d.H, blas.stream());  // b_down, then += the GEMM
    gemm_cuda(blas, false, true, m, d.H, d.F, 1.0f, DType::BF16, act + i0 * d.F, d.F, DType::BF16, w[l].down, d.F, bias, DType::BF16,
              fc2 + i0 * d.H, d.H);
  });
}

void experts_forward(const CublasContext& blas, const Dims& d, const std::vector<ExpertSlotDev>& w, const Grouping& g,
                     const ProbsDev& pr, const Bf16* in, Bf16* fc1, Bf16* act, Bf16* fc2) {
  cudaStream_t s = blas.stream();
  const bool bias = d.Pb > 0;
  for_each_expert(g, [&](size_t l, int64_t i0, int64_t m) {
    if (bias) launch_broadcast_row(w[l].bias, fc1 + i0 * 2 * d.F, m, 2 * d.F, s);  // b_gu, then += the GEMM
    gemm_cuda(blas, false, true, m, 2 * d.F, d.H, 1.0f, DType::BF16, in + i0 * d.H, d.H, DType::BF16, w[l].gu, d.H, bias,
              DType::BF16, fc1 + i0 * 2 * d.F, 2 * d.F);
  });
  for_each_prob_run(g, pr, [&](int64_t i0, int64_t j0, int64_t n) {
    launch_act(fc1, pr.p, act, i0, j0, n, d.F, s);
  });
  if (fc2) experts_fc2(blas, d, w, g, act, fc2);
}

void experts_backward_fc(const CublasContext& blas, const Dims& d, const std::vector<ExpertSlotDev>& w, const Grouping& g,
                         const ProbsDev& pr, const Bf16* fc1, const Bf16* act, const Bf16* d_fc2, Bf16* d_act, Bf16* d_fc1) {
  cudaStream_t s = blas.stream();
  for_each_expert(g, [&](size_t l, int64_t i0, int64_t m) {
    gemm_cuda(blas, false, false, m, d.F, d.H, 1.0f, DType::BF16, d_fc2 + i0 * d.H, d.H, DType::BF16, w[l].down, d.F, false,
              DType::BF16, d_act + i0 * d.F, d.F);
    if (w[l].ddown == nullptr) throw std::logic_error("dispatch schedule: an expert without a gradient accumulator in backward");
    gemm_cuda(blas, true, false, d.H, d.F, m, 1.0f, DType::BF16, d_fc2 + i0 * d.H, d.H, DType::BF16, act + i0 * d.F, d.F, true,
              DType::F32, w[l].ddown, d.F);
    if (w[l].dbias) launch_add_row_sums(d_fc2 + i0 * d.H, m, d.H, w[l].dbias + 2 * d.F, s);  // d b_down
  });
  for_each_prob_run(g, pr, [&](int64_t i0, int64_t j0, int64_t n) {
    launch_act_backward(fc1, d_act, pr.p, d_fc1, i0, j0, n, d.F, s);
  });
}

void experts_backward_in(const CublasContext& blas, const Dims& d, const std::vector<ExpertSlotDev>& w, const Grouping& g,
                         const Bf16* in, const Bf16* d_fc1, Bf16* d_in) {
  for_each_expert(g, [&](size_t l, int64_t i0, int64_t m) {
    gemm_cuda(blas, true, false, 2 * d.F, d.H, m, 1.0f, DType::BF16, d_fc1 + i0 * 2 * d.F, 2 * d.F, DType::BF16, in + i0 * d.H, d.H,
              true, DType::F32, w[l].dgu, d.H);
    if (w[l].dbias) launch_add_row_sums(d_fc1 + i0 * 2 * d.F, m, 2 * d.F, w[l].dbias, blas.stream());  // d b_gu
    gemm_cuda(blas, false, false, m, d.H, 2 * d.F, 1.0f, DType::BF16, d_fc1 + i0 * 2 * d.F, 2 * d.F, DType::BF16, w[l].gu, d.H,
              false, DType::BF16, d_in + i0 * d.H, d.H);
  });
}

void router_backward(cudaStream_t s, const Dims& d, LayerDev& L, RoutingDev& r, float* d_x) {
  float* dz = r.logits.as<float>();
  const int64_t* ids = r.topk_ids.as<int64_t>();
  launch_router_backward(r.scores.as<float>(), r.topk_w.as<float>(), ids, dz, L.w_router.as<Bf16>(), L.x.as<Bf16>(), d_x,
                         L.dw_router.as<float>(), d.T, d.H, d.E, d.k, s);
}

void gather_probs(cudaStream_t s, const Dims& d, const int32_t* sort32, const float* topk_w, float* pprobs) {
  launch_gather_probs(sort32, topk_w, pprobs, d.N, s);
}

void gather_send_rows(cudaStream_t s, const Dims& d, const int32_t* sort32, const Bf16* src, bool per_copy, Bf16* rows) {
  launch_gather_rows(sort32, src, per_copy, rows, d.N, d.H, d.k, s);
}

void repeat_tokens(cudaStream_t s, const Dims& d, const Bf16* x, Bf16* repeated) {
  launch_repeat(x, repeated, d.N, d.H, d.k, s);
}

void sum_token_rows(cudaStream_t s, const Dims& d, const int64_t* ids, const int32_t* unsort32, const Bf16* rows, Bf16* out,
                    float* acc) {
  launch_sum_token_rows(ids, unsort32, rows, out, acc, d.T, d.H, d.k, s);
}

void scatter_dprobs(cudaStream_t s, const Dims& d, const int32_t* sort32, const int64_t* ids, const float* pprobs, float* scores) {
  launch_scatter_dprobs(sort32, ids, pprobs, scores, d.N, d.E, d.k, s);
}

RoundRanges round_ranges(const RowPlan& p, const Round& rd) {
  RoundRanges rr{};
  rr.ep = static_cast<int>(p.ep);
  for (int64_t t = 0; t < p.ep; ++t) {
    rr.lo[t] = p.dest_begin[z(t)] + rd.first_out[z(t)];
    rr.n[t] = rd.out[z(t)];
    rr.q0[t] = rd.out_begin[z(t)];
  }
  return rr;
}

void pack_round(cudaStream_t s, const Dims& d, const RoundRanges& rr, const int64_t* sort, const float* topk_w,
                const int64_t* topk_ids, const Bf16* src, Bf16* rows, float* p_send, int64_t* i_send, int64_t* i_home) {
  launch_pack_round(rr, sort, topk_w, topk_ids, src, rows, p_send, i_send, i_home, d.H, d.k, s);
}

void add_round_rows(cudaStream_t s, const Dims& d, const RoundRanges& rr, const int64_t* dest, const int64_t* unsort,
                    const Bf16* rows, float* acc) {
  launch_add_round_rows(rr, dest, unsort, rows, acc, d.T, d.H, d.k, s);
}

void scatter_round_dprobs(cudaStream_t s, const Dims& d, int64_t sent, const int64_t* i_home, const int64_t* ids, const float* dprob,
                          float* scores) {
  launch_scatter_round_dprobs(i_home, ids, dprob, scores, sent, d.E, d.k, s);
}

void add_returned_grads(cudaStream_t s, const Dims& d, LayerDev& L, int64_t e, const float* g) {
  const int64_t l = e - d.me * d.L, gu = 2 * d.F * d.H, dn = d.H * d.F;
  launch_add_f32(g, L.dw_gate_up.as<float>() + l * gu, gu, s);
  launch_add_f32(g + gu, L.dw_down.as<float>() + l * dn, dn, s);
  if (d.Pb > 0) launch_add_f32(g + gu + dn, L.db_expert.as<float>() + l * d.Pb, d.Pb, s);
}

void zero(DeviceBuffer& b, cudaStream_t s) {
  if (b.raw() != nullptr) FLATPEAK_CUDA_CHECK(cudaMemsetAsync(b.raw(), 0, static_cast<size_t>(b.bytes()), s));
}

void f32_to_host(const float* src, int64_t n, std::vector<float>& out, cudaStream_t s) {
  out.assign(z(n), 0.0f);
  if (n > 0) FLATPEAK_CUDA_CHECK(cudaMemcpyAsync(out.data(), src, static_cast<size_t>(n) * 4, cudaMemcpyDeviceToHost, s));
  FLATPEAK_CUDA_CHECK(cudaStreamSynchronize(s));
}

void bf16_to_host(const Bf16* src, int64_t n, std::vector<float>& out, cudaStream_t s) {
  std::vector<Bf16> raw(z(n));
  if (n > 0) FLATPEAK_CUDA_CHECK(cudaMemcpyAsync(raw.data(), src, static_cast<size_t>(n) * sizeof(Bf16), cudaMemcpyDeviceToHost, s));
  FLATPEAK_CUDA_CHECK(cudaStreamSynchronize(s));
  out.resize(z(n));
  for (size_t i = 0; i < raw.size(); ++i) out[i] = to_f32(raw[i]);
}

void f32_round_bf16_to_host(const float* src, int64_t n, std::vector<float>& out, cudaStream_t s) {
  out.assign(z(n), 0.0f);
  if (n <= 0) return;
  // Rounded on the host after the copy (no device scratch beyond the CPU's buffers).
  f32_to_host(src, n, out, s);
  for (float& v : out) v = to_f32(f32_to_bf16(v));
}

}  // namespace flatpeak::cuda::dispatch_ep_detail
