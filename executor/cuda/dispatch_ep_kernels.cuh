// The kernels of the CUDA dispatch at EP >= 1 (internal to executor/cuda): routing, the experts'
// activation and its backward, the expert biases' rows and gradients, the router's backward, the uncapped pass's gathers, per-token sums
// and scatters, and the capped rounds' packing and per-token adds; each the device form of a loop
// of the CPU schedule (executor/schedules/dispatch_*.cpp). dispatch_ep_cuda_ops.cu calls the
// launch functions at the end; tests/unit/executor_dispatch_ep_emulation_test.cpp runs the same
// ones on the host (FLATPEAK_CUDA_EMULATION, tests/unit/cuda_emulation.h) against those loops,
// without a GPU.
//   #include "executor/cuda/dispatch_ep_kernels.cuh"
//   launch_act_backward(fc1, d_act, prob, d_fc1, i0, j0, n, F, stream);  // row_blocks(n) blocks
#pragma once

#include <algorithm>
#include <cstdint>

#include "executor/cuda/dispatch_ep_limits.h"
#include "executor/cuda/kernel_util.cuh"
#include "executor/ops/dtype.h"
#include "executor/ops/expert_ffn.h"

// One translation unit per binary includes this header (the kernels have internal linkage).
namespace flatpeak::cuda::dispatch_ep_detail {
namespace {

using exec::Bf16;
using exec::cuda_detail::block_sum;
using exec::cuda_detail::global_thread;
using exec::cuda_detail::grid_for;
using exec::cuda_detail::grid_threads;
using exec::cuda_detail::kThreads;
using exec::f32_to_bf16;
using exec::to_f32;

// Blocks for a kernel that takes one row per block (grid-stride over rows).
inline unsigned row_blocks(int64_t rows) { return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(rows, int64_t{1} << 20))); }

// ---- routing (the CPU's compute_routing, one thread per token)

__global__ void routing_kernel(const float* logits, const int64_t* ids, float* scores, float* scattered, uint8_t* map, float* w,
                               int64_t T, int64_t E, int64_t k) {
  for (int64_t t = global_thread(); t < T; t += grid_threads()) {
    const float* zt = logits + t * E;
    float* sc = scores + t * E;
    float mx = zt[0];
    for (int64_t e = 1; e < E; ++e) mx = fmaxf(mx, zt[e]);
    float sum = 0.0f;
    for (int64_t e = 0; e < E; ++e) sum += (sc[e] = expf(zt[e] - mx));
    for (int64_t e = 0; e < E; ++e) sc[e] /= sum;
    float kept = 0.0f;
    for (int64_t s = 0; s < k; ++s) kept += sc[ids[t * k + s]];
    for (int64_t e = 0; e < E; ++e) scattered[t * E + e] = 0.0f;
    for (int64_t s = 0; s < k; ++s) {
      const int64_t e = ids[t * k + s];
      w[t * k + s] = sc[e] / kept;
      scattered[t * E + e] = w[t * k + s];
      map[t * E + e] = 1;
    }
  }
}

// ---- experts

// act[i] = silu(gate)·up·prob over rows [i0, i0 + n), prob index j0 + (i − i0).
__global__ void act_kernel(const Bf16* fc1, const float* prob, Bf16* act, int64_t i0, int64_t j0, int64_t n, int64_t F) {
  for (int64_t idx = global_thread(); idx < n * F; idx += grid_threads()) {
    const int64_t r = idx / F, f = idx % F, i = i0 + r;
    const float g = to_f32(fc1[i * 2 * F + f]), u = to_f32(fc1[i * 2 * F + F + f]);
    act[i * F + f] = f32_to_bf16(exec::silu_f32(g) * u * prob[j0 + r]);
  }
}

// Per row (a block each): d fc1 from d act, and d prob = Σ_f d act·silu(gate)·up written over
// the row's prob once every thread has read it.
__global__ void act_backward_kernel(const Bf16* fc1, const Bf16* d_act, float* prob, Bf16* d_fc1, int64_t i0, int64_t j0,
                                    int64_t n, int64_t F) {
  __shared__ float scratch[32];
  for (int64_t r = blockIdx.x; r < n; r += gridDim.x) {
    const int64_t i = i0 + r, j = j0 + r;
    const float p = prob[j];
    float dp = 0.0f;
    for (int64_t f = threadIdx.x; f < F; f += blockDim.x) {
      const float g = to_f32(fc1[i * 2 * F + f]), u = to_f32(fc1[i * 2 * F + F + f]);
      const float dh = to_f32(d_act[i * F + f]);
      dp += dh * exec::silu_f32(g) * u;
      const float da = dh * p;
      d_fc1[i * 2 * F + f] = f32_to_bf16(da * u * exec::silu_grad_f32(g));
      d_fc1[i * 2 * F + F + f] = f32_to_bf16(da * exec::silu_f32(g));
    }
    dp = block_sum(dp, scratch);  // synchronises: every thread has read p
    if (threadIdx.x == 0) prob[j] = dp;
  }
}

// ---- router backward

// dz[t, e] = w_e·(dw_e − Σ_j w_j dw_j) at the kept experts, 0 elsewhere (one thread per token).
__global__ void router_dz_kernel(const float* dw, const float* w, const int64_t* ids, float* dz, int64_t T, int64_t E, int64_t k) {
  for (int64_t t = global_thread(); t < T; t += grid_threads()) {
    float dot = 0.0f;
    for (int64_t s = 0; s < k; ++s) dot += w[t * k + s] * dw[t * E + ids[t * k + s]];
    for (int64_t e = 0; e < E; ++e) dz[t * E + e] = 0.0f;
    for (int64_t s = 0; s < k; ++s) {
      const int64_t e = ids[t * k + s];
      dz[t * E + e] = w[t * k + s] * (dw[t * E + e] - dot);
    }
  }
}

// The token's k kept experts in increasing order (k ≤ kMaxTopK).
__device__ inline void sorted_experts(const int64_t* ids, int64_t t, int64_t k, int64_t* e) {
  for (int64_t s = 0; s < k; ++s) {
    const int64_t v = ids[t * k + s];
    int64_t m = s;
    for (; m > 0 && e[m - 1] > v; --m) e[m] = e[m - 1];
    e[m] = v;
  }
}

// d_x[t, h] += Σ_e dz[t, e]·W[e, h] over the kept experts, increasing e (the other terms are 0).
__global__ void router_dx_kernel(const float* dz, const Bf16* w_router, const int64_t* ids, float* d_x, int64_t T, int64_t H,
                                 int64_t E, int64_t k) {
  for (int64_t idx = global_thread(); idx < T * H; idx += grid_threads()) {
    const int64_t t = idx / H, h = idx % H;
    int64_t e[kMaxTopK];
    sorted_experts(ids, t, k, e);
    float sum = 0.0f;
    for (int64_t s = 0; s < k; ++s) sum += dz[t * E + e[s]] * to_f32(w_router[e[s] * H + h]);
    d_x[idx] += sum;
  }
}

// dW_router[e, h] += Σ_t dz[t, e]·x[t, h], tokens in order (zero d logits skipped: they add 0).
__global__ void router_dw_kernel(const float* dz, const Bf16* x, float* dw, int64_t T, int64_t H, int64_t E) {
  for (int64_t idx = global_thread(); idx < E * H; idx += grid_threads()) {
    const int64_t e = idx / H, h = idx % H;
    float sum = 0.0f;
    for (int64_t t = 0; t < T; ++t) {
      const float v = dz[t * E + e];
      if (v != 0.0f) sum += v * to_f32(x[t * H + h]);
    }
    dw[idx] += sum;
  }
}

// ---- uncapped pass

__global__ void gather_probs_kernel(const int32_t* sort32, const float* topk_w, float* pprobs, int64_t N) {
  for (int64_t i = global_thread(); i < N; i += grid_threads()) pprobs[i] = topk_w[sort32[i]];
}

__global__ void gather_rows_kernel(const int32_t* sort32, const Bf16* src, bool per_copy, Bf16* rows, int64_t N, int64_t H,
                                   int64_t k) {
  for (int64_t idx = global_thread(); idx < N * H; idx += grid_threads()) {
    const int64_t i = idx / H, h = idx % H;
    const int64_t slot = sort32[i];
    rows[idx] = src[(per_copy ? slot : slot / k) * H + h];
  }
}

__global__ void repeat_kernel(const Bf16* x, Bf16* repeated, int64_t N, int64_t H, int64_t k) {
  for (int64_t idx = global_thread(); idx < N * H; idx += grid_threads()) {
    const int64_t i = idx / H, h = idx % H;
    repeated[idx] = x[(i / k) * H + h];
  }
}

// A token's k rows (send positions unsort32[slot]) in increasing expert order, fp32 from zero
// (out) or added one by one to acc (the CPU's d_x loop).
__global__ void sum_token_rows_kernel(const int64_t* ids, const int32_t* unsort32, const Bf16* rows, Bf16* out, float* acc,
                                      int64_t T, int64_t H, int64_t k) {
  for (int64_t idx = global_thread(); idx < T * H; idx += grid_threads()) {
    const int64_t t = idx / H, h = idx % H;
    int64_t e[kMaxTopK], pos[kMaxTopK];
    for (int64_t s = 0; s < k; ++s) {  // insertion by expert id
      const int64_t v = ids[t * k + s], ps = unsort32[t * k + s];
      int64_t m = s;
      for (; m > 0 && e[m - 1] > v; --m) {
        e[m] = e[m - 1];
        pos[m] = pos[m - 1];
      }
      e[m] = v;
      pos[m] = ps;
    }
    float sum = acc ? acc[idx] : 0.0f;
    for (int64_t s = 0; s < k; ++s) sum += to_f32(rows[pos[s] * H + h]);
    if (acc) acc[idx] = sum;
    else out[idx] = f32_to_bf16(sum);
  }
}

__global__ void scatter_dprobs_kernel(const int32_t* sort32, const int64_t* ids, const float* pprobs, float* scores, int64_t N,
                                      int64_t E, int64_t k) {
  for (int64_t i = global_thread(); i < N; i += grid_threads()) {
    const int64_t slot = sort32[i];
    scores[(slot / k) * E + ids[slot]] = pprobs[i];
  }
}

// ---- capped rounds

__global__ void pack_round_kernel(const int64_t* sort, const float* topk_w, const int64_t* topk_ids, const Bf16* src, Bf16* rows,
                                  float* p_send, int64_t* i_send, int64_t* i_home, int64_t lo, int64_t q0, int64_t n, int64_t H,
                                  int64_t k) {
  for (int64_t idx = global_thread(); idx < n * H; idx += grid_threads()) {
    const int64_t i = idx / H, h = idx % H, q = q0 + i;
    const int64_t slot = sort[lo + i];
    rows[q * H + h] = src[(slot / k) * H + h];
    if (h == 0) {
      p_send[q] = topk_w[slot];
      i_send[q] = topk_ids[slot];
      i_home[q] = slot;
    }
  }
}

// A token's rows of this round in send order (ascending q), added one by one to acc.
__global__ void add_round_rows_kernel(RoundRanges rr, const int64_t* dest, const int64_t* unsort, const Bf16* rows, float* acc,
                                      int64_t T, int64_t H, int64_t k) {
  for (int64_t idx = global_thread(); idx < T * H; idx += grid_threads()) {
    const int64_t t = idx / H, h = idx % H;
    int64_t q[kMaxTopK];
    int64_t m = 0;
    for (int64_t s = 0; s < k; ++s) {
      const int64_t slot = t * k + s, dd = dest[slot], off = unsort[slot] - rr.lo[dd];
      if (off < 0 || off >= rr.n[dd]) continue;  // not in this round
      const int64_t v = rr.q0[dd] + off;
      int64_t a = m++;
      for (; a > 0 && q[a - 1] > v; --a) q[a] = q[a - 1];
      q[a] = v;
    }
    if (m == 0) continue;
    float sum = acc[idx];
    for (int64_t a = 0; a < m; ++a) sum += to_f32(rows[q[a] * H + h]);
    acc[idx] = sum;
  }
}

__global__ void scatter_round_dprobs_kernel(const int64_t* i_home, const int64_t* ids, const float* dprob, float* scores, int64_t n,
                                            int64_t E, int64_t k) {
  for (int64_t q = global_thread(); q < n; q += grid_threads()) {
    const int64_t slot = i_home[q];
    scores[(slot / k) * E + ids[slot]] = dprob[q];
  }
}

// ---- small

__global__ void add_f32_kernel(const float* src, float* dst, int64_t n) {
  for (int64_t i = global_thread(); i < n; i += grid_threads()) dst[i] += src[i];
}

// ---- expert biases (the CPU's experts_forward / experts_fc2 bias rows and add_row_sums)

// out[r, c] = row[c] for m rows of width n: a bias the GEMM then accumulates onto (beta = 1).
__global__ void broadcast_row_kernel(const Bf16* row, Bf16* out, int64_t m, int64_t n) {
  for (int64_t i = global_thread(); i < m * n; i += grid_threads()) out[i] = row[i % n];
}

// acc[c] += Σ_r rows[r, c], one thread a column summing its m rows in fp32 in row order and
// adding once: the CPU's add_row_sums bit for bit.
__global__ void add_row_sums_kernel(const Bf16* rows, int64_t m, int64_t n, float* acc) {
  for (int64_t c = global_thread(); c < n; c += grid_threads()) {
    float sum = 0.0f;
    for (int64_t r = 0; r < m; ++r) sum += to_f32(rows[r * n + c]);
    acc[c] += sum;
  }
}

// ---- launches (dispatch_ep_cuda_ops.cu's) ----

inline void launch_routing(const float* logits, const int64_t* ids, float* scores, float* scattered, uint8_t* map, float* w,
                           int64_t T, int64_t E, int64_t k, cudaStream_t s) {
  FLATPEAK_LAUNCH(routing_kernel, grid_for(T), kThreads, 0, s, logits, ids, scores, scattered, map, w, T, E, k);
}
inline void launch_act(const Bf16* fc1, const float* prob, Bf16* act, int64_t i0, int64_t j0, int64_t n, int64_t F,
                       cudaStream_t s) {
  FLATPEAK_LAUNCH(act_kernel, grid_for(n * F), kThreads, 0, s, fc1, prob, act, i0, j0, n, F);
}
inline void launch_act_backward(const Bf16* fc1, const Bf16* d_act, float* prob, Bf16* d_fc1, int64_t i0, int64_t j0,
                                int64_t n, int64_t F, cudaStream_t s) {
  FLATPEAK_LAUNCH(act_backward_kernel, row_blocks(n), kThreads, 0, s, fc1, d_act, prob, d_fc1, i0, j0, n, F);
}
// dz [T, E] (over scores), then d_x [T, H] and dW_router [E, H] from it.
inline void launch_router_backward(const float* scores, const float* topk_w, const int64_t* ids, float* dz,
                                   const Bf16* w_router, const Bf16* x, float* d_x, float* dw_router, int64_t T,
                                   int64_t H, int64_t E, int64_t k, cudaStream_t s) {
  FLATPEAK_LAUNCH(router_dz_kernel, grid_for(T), kThreads, 0, s, scores, topk_w, ids, dz, T, E, k);
  FLATPEAK_LAUNCH(router_dx_kernel, grid_for(T * H), kThreads, 0, s, dz, w_router, ids, d_x, T, H, E, k);
  FLATPEAK_LAUNCH(router_dw_kernel, grid_for(E * H), kThreads, 0, s, dz, x, dw_router, T, H, E);
}
inline void launch_gather_probs(const int32_t* sort32, const float* topk_w, float* pprobs, int64_t N, cudaStream_t s) {
  FLATPEAK_LAUNCH(gather_probs_kernel, grid_for(N), kThreads, 0, s, sort32, topk_w, pprobs, N);
}
inline void launch_gather_rows(const int32_t* sort32, const Bf16* src, bool per_copy, Bf16* rows, int64_t N, int64_t H,
                               int64_t k, cudaStream_t s) {
  FLATPEAK_LAUNCH(gather_rows_kernel, grid_for(N * H), kThreads, 0, s, sort32, src, per_copy, rows, N, H, k);
}
inline void launch_repeat(const Bf16* x, Bf16* repeated, int64_t N, int64_t H, int64_t k, cudaStream_t s) {
  FLATPEAK_LAUNCH(repeat_kernel, grid_for(N * H), kThreads, 0, s, x, repeated, N, H, k);
}
inline void launch_sum_token_rows(const int64_t* ids, const int32_t* unsort32, const Bf16* rows, Bf16* out, float* acc,
                                  int64_t T, int64_t H, int64_t k, cudaStream_t s) {
  FLATPEAK_LAUNCH(sum_token_rows_kernel, grid_for(T * H), kThreads, 0, s, ids, unsort32, rows, out, acc, T, H, k);
}
inline void launch_scatter_dprobs(const int32_t* sort32, const int64_t* ids, const float* pprobs, float* scores, int64_t N,
                                  int64_t E, int64_t k, cudaStream_t s) {
  FLATPEAK_LAUNCH(scatter_dprobs_kernel, grid_for(N), kThreads, 0, s, sort32, ids, pprobs, scores, N, E, k);
}
// One launch per destination with rows in the round.
inline void launch_pack_round(const RoundRanges& rr, const int64_t* sort, const float* topk_w, const int64_t* topk_ids,
                              const Bf16* src, Bf16* rows, float* p_send, int64_t* i_send, int64_t* i_home, int64_t H,
                              int64_t k, cudaStream_t s) {
  for (int t = 0; t < rr.ep; ++t) {
    if (rr.n[t] <= 0) continue;
    FLATPEAK_LAUNCH(pack_round_kernel, grid_for(rr.n[t] * H), kThreads, 0, s, sort, topk_w, topk_ids, src, rows, p_send,
                    i_send, i_home, rr.lo[t], rr.q0[t], rr.n[t], H, k);
  }
}
inline void launch_add_round_rows(const RoundRanges& rr, const int64_t* dest, const int64_t* unsort, const Bf16* rows,
                                  float* acc, int64_t T, int64_t H, int64_t k, cudaStream_t s) {
  FLATPEAK_LAUNCH(add_round_rows_kernel, grid_for(T * H), kThreads, 0, s, rr, dest, unsort, rows, acc, T, H, k);
}
inline void launch_scatter_round_dprobs(const int64_t* i_home, const int64_t* ids, const float* dprob, float* scores,
                                        int64_t sent, int64_t E, int64_t k, cudaStream_t s) {
  if (sent <= 0) return;
  FLATPEAK_LAUNCH(scatter_round_dprobs_kernel, grid_for(sent), kThreads, 0, s, i_home, ids, dprob, scores, sent, E, k);
}
inline void launch_add_f32(const float* src, float* dst, int64_t n, cudaStream_t s) {
  FLATPEAK_LAUNCH(add_f32_kernel, grid_for(n), kThreads, 0, s, src, dst, n);
}
inline void launch_broadcast_row(const Bf16* row, Bf16* out, int64_t m, int64_t n, cudaStream_t s) {
  if (m <= 0 || n <= 0) return;
  FLATPEAK_LAUNCH(broadcast_row_kernel, grid_for(m * n), kThreads, 0, s, row, out, m, n);
}
inline void launch_add_row_sums(const Bf16* rows, int64_t m, int64_t n, float* acc, cudaStream_t s) {
  if (m <= 0 || n <= 0) return;
  FLATPEAK_LAUNCH(add_row_sums_kernel, grid_for(n), kThreads, 0, s, rows, m, n, acc);
}

}  // namespace
}  // namespace flatpeak::cuda::dispatch_ep_detail
