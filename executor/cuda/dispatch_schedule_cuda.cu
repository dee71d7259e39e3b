// The dispatch component on the GPU (dispatch_schedule_cuda.h). Rounds are slices of the
// expert-sorted token copies, as in the CPU schedule's capped mode: round j holds sorted rows
// [j·C, min((j+1)·C, T·k)), so an expert's rows may span two rounds; each round's per-expert
// counts are the overlap of the expert's range with the slice (read on the host: they decide the
// GEMM shapes). Round buffers [C, ·] are allocated once per pass.
#include "executor/cuda/dispatch_schedule_cuda.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "executor/cuda/cuda_check.h"
#include "executor/cuda/dispatch_schedule_kernels.cuh"
#include "executor/cuda/ops_cuda.h"
#include "executor/cuda/schedule_util_cuda.cuh"

namespace flatpeak::cuda {

namespace {

using exec::Bf16;
using exec::Category;
using exec::DType;
using exec::DispatchScheduleConfig;
using exec::cuda_detail::ScopedEvent;
using exec::cuda_detail::event_seconds;
// The launches (dispatch_schedule_kernels.cuh).
using exec::cuda_detail::launch_combine_backward_round;
using exec::cuda_detail::launch_combine_round;
using exec::cuda_detail::launch_f32_to_bf16;
using exec::cuda_detail::launch_gather_round;
using exec::cuda_detail::launch_kept_softmax;
using exec::cuda_detail::launch_scatter_add_round;

constexpr Category kDsp = Category::Dispatch;

struct Dims {
  int64_t T, H, E, k, F, N;
};

Dims dims_of(const DispatchScheduleConfig& c) {
  if (c.tokens <= 0 || c.hidden <= 0 || c.experts <= 0 || c.ffn <= 0 || c.top_k <= 0 || c.top_k > c.experts)
    throw std::invalid_argument("dispatch schedule: need tokens, hidden, experts, ffn > 0 and 0 < top_k <= experts");
  if (c.chunk_cap_rows < 0) throw std::invalid_argument("dispatch schedule: chunk_cap_rows must be >= 0");
  if (c.expert_bias) throw std::invalid_argument("dispatch schedule (cuda, one GPU): expert biases are not in this schedule (run_dispatch_ep_cuda has them)");
  if (c.tokens * c.top_k > 0x7fffffff)
    throw std::invalid_argument("dispatch schedule: T·k must be < 2^31 (int32 row maps)");
  return {c.tokens, c.hidden, c.experts, c.top_k, c.ffn, c.tokens * c.top_k};
}

int64_t aligned(int64_t bytes, int64_t a) { return (bytes + a - 1) / a * a; }


// The layer input and upstream gradient (activations); gathered weights and their gradient
// accumulators (fsdp), filled from the seed like the CPU schedule's.
struct LayerData {
  DeviceBuffer x, d_out, w_router, w_gate_up, w_down, dw_gate_up, dw_down;
  LayerData(DeviceAllocator& a, const Dims& d, uint64_t seed, cudaStream_t s)
      : x(a, d.T * d.H * 2, Category::Activations, s),               // [T, H] bf16
        d_out(a, d.T * d.H * 2, Category::Activations, s),           // [T, H] bf16
        w_router(a, d.E * d.H * 2, Category::Fsdp, s),               // [E, H] bf16
        w_gate_up(a, d.E * 2 * d.F * d.H * 2, Category::Fsdp, s),    // [E, 2F, H] bf16
        w_down(a, d.E * d.H * d.F * 2, Category::Fsdp, s),           // [E, H, F] bf16
        dw_gate_up(a, d.E * 2 * d.F * d.H * 2, Category::Fsdp, s),   // [E, 2F, H] bf16 +=
        dw_down(a, d.E * d.H * d.F * 2, Category::Fsdp, s) {         // [E, H, F] bf16 +=
    using exec::cuda_detail::fill_bf16_cuda;
    const float sh = 1.0f / std::sqrt(static_cast<float>(d.H));
    fill_bf16_cuda(x.as<Bf16>(), d.T * d.H, seed * 8 + 1, 1.0f, s);
    fill_bf16_cuda(d_out.as<Bf16>(), d.T * d.H, seed * 8 + 2, 1.0f, s);
    fill_bf16_cuda(w_router.as<Bf16>(), d.E * d.H, seed * 8 + 3, sh, s);
    fill_bf16_cuda(w_gate_up.as<Bf16>(), d.E * 2 * d.F * d.H, seed * 8 + 4, 2.0f * sh, s);
    fill_bf16_cuda(w_down.as<Bf16>(), d.E * d.H * d.F, seed * 8 + 5, 2.0f / std::sqrt(static_cast<float>(d.F)), s);
    FLATPEAK_CUDA_CHECK(cudaMemsetAsync(dw_gate_up.raw(), 0, static_cast<size_t>(d.E * 2 * d.F * d.H) * 2, s));
    FLATPEAK_CUDA_CHECK(cudaMemsetAsync(dw_down.raw(), 0, static_cast<size_t>(d.E * d.H * d.F) * 2, s));
  }
};

// One pass's routing: ids, renormalised weights, the expert-sorted row maps and the counts (host).
struct Routing {
  DeviceBuffer ids, topk_w, counts, slot_to_row, row_to_slot;
  std::vector<int64_t> host_counts;  // [E]
};

Routing route(DeviceAllocator& a, const CublasContext& blas, const Dims& d, const LayerData& L,
              const std::vector<int32_t>& host_ids) {
  cudaStream_t s = blas.stream();
  Routing r;
  r.ids = DeviceBuffer(a, d.N * 4, kDsp, s);          // [T, k] i32
  r.topk_w = DeviceBuffer(a, d.N * 4, kDsp, s);       // [T, k] fp32
  r.counts = DeviceBuffer(a, d.E * 8, kDsp, s);       // [E] i64
  r.slot_to_row = DeviceBuffer(a, d.N * 4, kDsp, s);  // [T·k] i32
  r.row_to_slot = DeviceBuffer(a, d.N * 4, kDsp, s);  // [T·k] i32
  FLATPEAK_CUDA_CHECK(cudaMemcpyAsync(r.ids.raw(), host_ids.data(), static_cast<size_t>(d.N) * 4,
                                      cudaMemcpyHostToDevice, s));
  {
    DeviceBuffer logits(a, d.T * d.E * 4, kDsp, s);  // [T, E] fp32 router logits
    gemm_cuda(blas, false, true, d.T, d.E, d.H, 1.0f, DType::BF16, L.x.raw(), d.H, DType::BF16,
              L.w_router.raw(), d.H, false, DType::F32, logits.raw(), d.E);
    launch_kept_softmax(logits.as<float>(), r.ids.as<int32_t>(), r.topk_w.as<float>(), d.T, d.E,
                        d.k, s);
  }
  exec::PermuteArgs p;
  p.dtype = DType::BF16;
  p.topk_ids = r.ids.as<int32_t>();
  p.expert_counts = r.counts.as<int64_t>();
  p.slot_to_row = r.slot_to_row.as<int32_t>();
  p.row_to_slot = r.row_to_slot.as<int32_t>();
  p.tokens = d.T;
  p.top_k = d.k;
  p.experts = d.E;
  p.hidden = d.H;
  exec::moe_route_cuda(p, s);
  r.host_counts.assign(static_cast<size_t>(d.E), 0);
  FLATPEAK_CUDA_CHECK(cudaMemcpyAsync(r.host_counts.data(), r.counts.raw(), static_cast<size_t>(d.E) * 8,
                                      cudaMemcpyDeviceToHost, s));
  FLATPEAK_CUDA_CHECK(cudaStreamSynchronize(s));  // the counts decide the GEMM shapes
  int64_t total = 0;
  for (int64_t c : r.host_counts) total += c;
  if (total != d.N)  // the ids were checked: a short count is a device-side failure
    throw std::runtime_error("dispatch schedule: the routing plan counted " + std::to_string(total) + " of " +
                             std::to_string(d.N) + " copies");
  return r;
}

// Per-expert rows of sorted slice [r0, r0 + n).
std::vector<int64_t> round_counts(const std::vector<int64_t>& counts, int64_t r0, int64_t n) {
  std::vector<int64_t> out(counts.size(), 0);
  int64_t start = 0;
  for (size_t e = 0; e < counts.size(); ++e) {
    const int64_t lo = std::max(start, r0), hi = std::min(start + counts[e], r0 + n);
    out[e] = std::max<int64_t>(0, hi - lo);
    start += counts[e];
  }
  return out;
}

exec::ExpertFfnArgs ffn_args(const Dims& d, const LayerData& L, const std::vector<int64_t>& counts, int64_t n) {
  exec::ExpertFfnArgs f;
  f.dtype = DType::BF16;
  f.expert_counts = counts.data();
  f.w_gate_up = L.w_gate_up.raw();
  f.w_down = L.w_down.raw();
  f.rows = n;
  f.experts = d.E;
  f.hidden = d.H;
  f.ffn = d.F;
  return f;
}

// The largest expert FFN workspace over the rounds (sized once per pass).
int64_t max_ffn_workspace(const Dims& d, const LayerData& L, const Routing& r, int64_t C, int64_t rounds) {
  int64_t bytes = 0;
  for (int64_t j = 0; j < rounds; ++j) {
    const int64_t n = std::min(C, d.N - j * C);
    const std::vector<int64_t> counts = round_counts(r.host_counts, j * C, n);
    bytes = std::max(bytes, exec::expert_ffn_workspace_bytes_cuda(ffn_args(d, L, counts, n)));
  }
  return bytes;
}

// The buffers one round uses in both passes, sized for the cap C and allocated once per pass.
struct RoundBuffers {
  DeviceBuffer in, gate_up, y, prob, ws;  // [C, H], [C, 2F], [C, H] bf16; [C] fp32; FFN workspace
  RoundBuffers(DeviceAllocator& alloc, const Dims& d, const LayerData& L, const Routing& r, int64_t C, int64_t rounds,
               cudaStream_t s)
      : in(alloc, C * d.H * 2, kDsp, s),
        gate_up(alloc, C * 2 * d.F * 2, kDsp, s),
        y(alloc, C * d.H * 2, kDsp, s),
        prob(alloc, C * 4, kDsp, s),
        ws(alloc, max_ffn_workspace(d, L, r, C, rounds), kDsp, s) {}
};

// Round j's rows [r0, r0 + n) (n = min(C, N − r0)) gathered by expert and run through the experts:
// fills in, prob, gate_up and y; returns the FFN arguments the backward reuses. Their
// expert_counts point into `counts` (round_counts of the round), which the caller keeps alive.
exec::ExpertFfnArgs forward_round(const CublasContext& blas, const Dims& d, const LayerData& L, const Routing& r,
                                  RoundBuffers& b, int64_t r0, int64_t n, const std::vector<int64_t>& counts,
                                  cudaStream_t s) {
  launch_gather_round(L.x.as<Bf16>(), r.topk_w.as<float>(), r.row_to_slot.as<int32_t>(), r0, n,
                      d.H, d.k, b.in.as<Bf16>(), b.prob.as<float>(), s);
  exec::ExpertFfnArgs f = ffn_args(d, L, counts, n);
  f.x = b.in.raw();
  f.gate_up = b.gate_up.raw();
  f.out = b.y.raw();
  f.workspace = b.ws.as<float>();
  exec::expert_ffn_forward_cuda(f, blas);
  return f;
}

}  // namespace

std::vector<int32_t> balanced_topk_ids(int64_t tokens, int64_t experts, int64_t top_k, uint64_t seed) {
  if (tokens < 0 || experts <= 0 || top_k <= 0 || top_k > experts)
    throw std::invalid_argument("balanced_topk_ids: need tokens >= 0 and 0 < top_k <= experts");
  std::vector<int32_t> ids(static_cast<size_t>(tokens * top_k));
  uint64_t state = seed * 0x9E3779B97F4A7C15ULL + 1;
  auto next = [&state]() {  // SplitMix64
    uint64_t z = (state += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
  };
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t s = 0; s < top_k; ++s) {
      int32_t e;
      bool taken;
      do {  // k distinct experts per token
        e = static_cast<int32_t>(next() % static_cast<uint64_t>(experts));
        taken = std::find(ids.begin() + t * top_k, ids.begin() + t * top_k + s, e) != ids.begin() + t * top_k + s;
      } while (taken);
      ids[static_cast<size_t>(t * top_k + s)] = e;
    }
  }
  return ids;
}

int64_t dispatch_schedule_cuda_peak_bytes(const DispatchScheduleConfig& c, int64_t al) {
  const Dims d = dims_of(c);
  const int64_t C = c.chunk_cap_rows == 0 ? d.N : std::min(c.chunk_cap_rows, d.N);
  // x, d_out and the forward's output [T, H] bf16 (held through the backward), weights, grads.
  const int64_t layer = 3 * aligned(d.T * d.H * 2, al) + aligned(d.E * d.H * 2, al) +
                        2 * aligned(d.E * 2 * d.F * d.H * 2, al) + 2 * aligned(d.E * d.H * d.F * 2, al);
  const int64_t routing = 4 * aligned(d.N * 4, al) + aligned(d.E * 8, al) + aligned(d.T * d.E * 4, al);
  // Backward round buffers (the larger pass): in, out, d_y, d_in [C, H], gate_up [C, 2F] bf16,
  // prob [C]; d_x [T, H] fp32, d_topk_w [T, k] fp32; the FFN workspace for 2× the mean rows.
  const int64_t rounds_bytes = 4 * aligned(C * d.H * 2, al) + aligned(C * 2 * d.F * 2, al) + aligned(C * 4, al) +
                               aligned(d.T * d.H * 4, al) + aligned(d.N * 4, al);
  const int64_t n_max = std::min(C, 2 * (d.N + d.E - 1) / d.E);
  const int64_t ws = exec::expert_ffn_workspace_bytes_cuda(n_max, d.H, d.F);
  return layer + routing + rounds_bytes + aligned(ws, al);
}

DispatchScheduleCudaResult run_dispatch_schedule_cuda(DeviceAllocator& alloc, const CublasContext& blas,
                                                      const DispatchScheduleConfig& c,
                                                      const std::vector<int32_t>& topk_ids) {
  const Dims d = dims_of(c);
  if (static_cast<int64_t>(topk_ids.size()) != d.N)
    throw std::invalid_argument("dispatch schedule: topk_ids needs T·k = " + std::to_string(d.N) + " ids");
  for (size_t i = 0; i < topk_ids.size(); ++i)  // the kernels index [T, E] rows with them
    if (topk_ids[i] < 0 || topk_ids[i] >= d.E)
      throw std::invalid_argument("dispatch schedule: topk_ids[" + std::to_string(i) + "] = " +
                                  std::to_string(topk_ids[i]) + " is outside 0.." + std::to_string(d.E - 1));
  cudaStream_t s = blas.stream();
  const int64_t C = c.chunk_cap_rows == 0 ? d.N : std::min(c.chunk_cap_rows, d.N);
  const int64_t rounds = (d.N + C - 1) / C;
  const std::string p = "fwd/" + c.layer + "/moe/", q = "bwd/" + c.layer + "/recompute/moe/",
                    g = "bwd/" + c.layer + "/moe/";
  auto round_phase = [](const std::string& prefix, int64_t j) { return prefix + "dispatch/r" + std::to_string(j); };
  DispatchScheduleCudaResult res;
  res.rounds = rounds;
  res.chunk_cap_rows = C;
  LayerData L(alloc, d, c.seed, s);
  ScopedEvent start, mid, stop;
  start.record(s);

  // ---- no-grad forward: routing, then the rounds into an fp32 combine accumulator
  DeviceBuffer out;  // [T, H] bf16 layer output
  {
    alloc.set_phase(p + "route");
    Routing r = route(alloc, blas, d, L, topk_ids);
    RoundBuffers b(alloc, d, L, r, C, rounds, s);
    DeviceBuffer acc(alloc, d.T * d.H * 4, kDsp, s);  // [T, H] fp32 combine accumulator
    FLATPEAK_CUDA_CHECK(cudaMemsetAsync(acc.raw(), 0, static_cast<size_t>(d.T * d.H) * 4, s));
    for (int64_t j = 0; j < rounds; ++j) {
      alloc.set_phase(round_phase(p, j));
      const int64_t r0 = j * C, n = std::min(C, d.N - r0);
      const std::vector<int64_t> counts = round_counts(r.host_counts, r0, n);
      forward_round(blas, d, L, r, b, r0, n, counts, s);
      launch_combine_round(b.y.as<Bf16>(), b.prob.as<float>(), r.row_to_slot.as<int32_t>(), r0, n,
                           d.H, d.k, acc.as<float>(), s);
    }
    out = DeviceBuffer(alloc, d.T * d.H * 2, kDsp, s);
    launch_f32_to_bf16(acc.as<float>(), out.as<Bf16>(), d.T * d.H, s);
  }
  mid.record(s);

  // ---- backward: the routing again, then per round the recompute and the backward
  {
    alloc.set_phase(q + "route");
    Routing r = route(alloc, blas, d, L, topk_ids);
    RoundBuffers b(alloc, d, L, r, C, rounds, s);
    DeviceBuffer d_y(alloc, C * d.H * 2, kDsp, s);     // [C, H] bf16
    DeviceBuffer d_in(alloc, C * d.H * 2, kDsp, s);    // [C, H] bf16
    DeviceBuffer d_x(alloc, d.T * d.H * 4, kDsp, s);   // [T, H] fp32
    DeviceBuffer d_topk_w(alloc, d.N * 4, kDsp, s);    // [T, k] fp32 d prob
    FLATPEAK_CUDA_CHECK(cudaMemsetAsync(d_x.raw(), 0, static_cast<size_t>(d.T * d.H) * 4, s));
    for (int64_t j = 0; j < rounds; ++j) {
      alloc.set_phase(round_phase(g, j));
      const int64_t r0 = j * C, n = std::min(C, d.N - r0);
      const std::vector<int64_t> counts = round_counts(r.host_counts, r0, n);  // read by the backward too
      exec::ExpertFfnArgs f = forward_round(blas, d, L, r, b, r0, n, counts, s);  // recompute: gate_up and y of this round
      launch_combine_backward_round(L.d_out.as<Bf16>(), b.y.as<Bf16>(), b.prob.as<float>(),
                                    r.row_to_slot.as<int32_t>(), r0, n, d.H, d.k, d_y.as<Bf16>(),
                                    d_topk_w.as<float>(), s);
      f.d_out = d_y.raw();
      f.d_x = d_in.raw();
      f.d_w_gate_up = L.dw_gate_up.raw();
      f.d_w_down = L.dw_down.raw();
      exec::expert_ffn_backward_cuda(f, blas);
      launch_scatter_add_round(d_in.as<Bf16>(), r.row_to_slot.as<int32_t>(), r0, n, d.H, d.k,
                               d_x.as<float>(), s);
    }
  }
  stop.record(s);
  FLATPEAK_CUDA_CHECK(cudaEventSynchronize(stop.get()));
  res.seconds = event_seconds(start.get(), stop.get());
  res.forward_s = event_seconds(start.get(), mid.get());
  res.backward_s = event_seconds(mid.get(), stop.get());
  std::vector<Bf16> host(static_cast<size_t>(d.T * d.H));
  FLATPEAK_CUDA_CHECK(cudaMemcpyAsync(host.data(), out.raw(), host.size() * sizeof(Bf16), cudaMemcpyDeviceToHost, s));
  FLATPEAK_CUDA_CHECK(cudaStreamSynchronize(s));
  for (const Bf16& v : host) res.out_sum += static_cast<double>(exec::to_f32(v));
  return res;
}

}  // namespace flatpeak::cuda
