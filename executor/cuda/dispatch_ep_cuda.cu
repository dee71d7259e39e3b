// The CUDA dispatch at EP ≥ 1 (dispatch_ep_cuda.h): the entry point and the passes, each a
// line-for-line twin of executor/schedules/dispatch_uncapped.cpp and dispatch_capped.cpp with
// device buffers (same shapes, categories, phases and allocation order) and the kernels of
// dispatch_ep_cuda_ops.cu. The plan (rows, LLA, rounds, launch-time sizes) and the exchanges
// are the CPU's own code (dispatch_plan.h) on device pointers.
//
// Stream discipline: every kernel, copy and GEMM of this rank is on s = blas.stream(), the
// stream the communicator synchronises at the start and end of each collective, so a
// collective's send buffer is written when peers read it, and peers are done reading it when
// the collective returns; a DeviceBuffer freed after a collective is freed on s (stream
// ordered) with no peer still reading it. The host reads device data only after a synchronising
// copy (the gathered counts, the outputs); an upload from a host vector freed at once (the send
// maps) is waited for before the vector goes.
#include "executor/cuda/dispatch_ep_cuda.h"

#include <algorithm>
#include <climits>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "executor/cuda/cuda_check.h"
#include "executor/cuda/device_communicator.h"
#include "executor/cuda/dispatch_ep_cuda_internal.cuh"
#include "executor/cuda/schedule_util_cuda.cuh"
#include "spec/routing.h"

namespace flatpeak::cuda {

namespace {

using namespace dispatch_ep_detail;
using exec::DispatchScheduleConfig;
using exec::DispatchScheduleResult;
using exec::dispatch_detail::CappedPlan;
using exec::dispatch_detail::column_of;
using exec::dispatch_detail::exchange;
using exec::dispatch_detail::row_of;

// What every part of a pass reads.
struct Ctx {
  exec::Communicator& comm;
  DeviceAllocator& alloc;
  const CublasContext& blas;
  cudaStream_t s;
  const Dims& d;
  LayerDev& L;
  const RowPlan& p;
  const std::vector<int64_t>& ids;  // host [T, k] int64 (the values r.topk_ids holds)
  const DispatchScheduleConfig& c;
  DispatchScheduleResult& res;
};

// The borrowed weights of one pass, [S, P] bf16 (the CPU's borrow_weights).
DeviceBuffer borrow_weights(Ctx& x, int64_t slots) {
  if (static_cast<int64_t>(x.p.foreign.size()) > slots)
    throw std::logic_error("dispatch schedule: more borrowed experts than weight slots");
  DeviceBuffer w = make_buf(x.alloc, DType::BF16, slots * x.d.P, x.s);  // [S, P] bf16
  if (x.p.lla_ran) exec::dispatch_detail::lend_weights(x.comm, x.d, x.p, x.L.w_gate_up.raw(), x.L.w_down.raw(), x.L.b_expert.raw(), w.raw());
  return w;
}

// ---- uncapped (dispatch_uncapped.cpp)

// The send order and the permuted probs. The CPU's [T·k] int64 send order holds, in its bytes,
// the two int32 maps: send position → slot (sort32), slot → send position (unsort32).
struct MetaDev {
  DeviceBuffer sort, pprobs;
  const int32_t* sort32() const { return sort.as<int32_t>(); }
  const int32_t* unsort32(const Dims& d) const { return sort.as<int32_t>() + d.N; }
};

MetaDev make_meta(Ctx& x, const RoutingDev& r) {
  const Dims& d = x.d;
  MetaDev m{make_buf(x.alloc, DType::I64, d.N, x.s),    // [T·k] int64 bytes: sort32 [T·k] | unsort32 [T·k]
            make_buf(x.alloc, DType::F32, d.N, x.s)};   // [T·k] fp32 permuted probs (send order)
  std::vector<int64_t> sort(z(d.N)), unsort(z(d.N));
  exec::dispatch_detail::fill_send_order(x.p, d, x.ids.data(), sort.data(), unsort.data(), nullptr);
  std::vector<int32_t> maps(z(2 * d.N));
  for (int64_t i = 0; i < d.N; ++i) {
    maps[z(i)] = static_cast<int32_t>(sort[z(i)]);
    maps[z(d.N + i)] = static_cast<int32_t>(unsort[z(i)]);
  }
  // Pageable source that dies on return: cudaMemcpyAsync "might be synchronous" with the host for
  // pageable memory, which CUDA does not promise, so wait for the copy before `maps` is freed.
  FLATPEAK_CUDA_CHECK(cudaMemcpyAsync(m.sort.raw(), maps.data(), maps.size() * 4, cudaMemcpyHostToDevice, x.s));
  FLATPEAK_CUDA_CHECK(cudaStreamSynchronize(x.s));
  gather_probs(x.s, d, m.sort32(), r.topk_w.as<float>(), m.pprobs.as<float>());
  return m;
}

struct DispatchedDev {
  DeviceBuffer in, recv_probs;
};

DispatchedDev uncapped_dispatch(Ctx& x, const Grouping& g, const MetaDev& m, bool repeated_tokens) {
  const Dims& d = x.d;
  const int64_t R = x.p.received();
  DeviceBuffer repeated;
  if (repeated_tokens) {
    repeated = make_buf(x.alloc, DType::BF16, d.N * d.H, x.s);  // [T·k, H] bf16, slot order
    repeat_tokens(x.s, d, x.L.x.as<Bf16>(), repeated.as<Bf16>());
  }
  DeviceBuffer send = make_buf(x.alloc, DType::BF16, d.N * d.H, x.s);  // [T·k, H] bf16
  DeviceBuffer recv = make_buf(x.alloc, DType::BF16, R * d.H, x.s);    // [R, H] bf16
  DeviceBuffer recv_probs = make_buf(x.alloc, DType::F32, R, x.s);     // [R] fp32
  gather_send_rows(x.s, d, m.sort32(), repeated_tokens ? repeated.as<Bf16>() : x.L.x.as<Bf16>(), repeated_tokens, send.as<Bf16>());
  const std::vector<int64_t> out = row_of(x.p.send_rows, d.me), in = column_of(x.p.send_rows, d.me);
  exchange(x.comm, send.raw(), out, x.p.dest_begin, recv.raw(), in, x.p.recv_begin, d.H, DType::BF16);
  exchange(x.comm, m.pprobs.raw(), out, x.p.dest_begin, recv_probs.raw(), in, x.p.recv_begin, 1, DType::F32);
  send.reset();
  repeated.reset();
  if (d.ep == 1) return DispatchedDev{std::move(recv), DeviceBuffer()};
  DeviceBuffer input = make_buf(x.alloc, DType::BF16, R * d.H, x.s);  // [R, H] bf16, expert order
  regroup(g, recv.raw(), input.raw(), d.H, 2, x.s);
  return DispatchedDev{std::move(input), std::move(recv_probs)};
}

void uncapped_combine(Ctx& x, const Grouping& g, const MetaDev& m, const RoutingDev& r, const DeviceBuffer& fc2,
                      std::vector<float>* out_values) {
  const Dims& d = x.d;
  const int64_t R = x.p.received();
  DeviceBuffer unperm = make_buf(x.alloc, DType::BF16, R * d.H, x.s);       // [R, H] bf16, source-major
  DeviceBuffer comb_recv = make_buf(x.alloc, DType::BF16, d.N * d.H, x.s);  // [T·k, H] bf16, send order
  DeviceBuffer out = make_buf(x.alloc, DType::BF16, d.T * d.H, x.s);        // [T, H] bf16
  ungroup(g, fc2.raw(), unperm.raw(), d.H, 2, x.s);
  exchange(x.comm, unperm.raw(), column_of(x.p.send_rows, d.me), x.p.recv_begin, comb_recv.raw(), row_of(x.p.send_rows, d.me),
           x.p.dest_begin, d.H, DType::BF16);
  sum_token_rows(x.s, d, r.topk_ids.as<int64_t>(), m.unsort32(d), comb_recv.as<Bf16>(), out.as<Bf16>(), nullptr);
  if (out_values) bf16_to_host(out.as<Bf16>(), d.T * d.H, *out_values, x.s);
}

Grouping uncapped_grouping(const RowPlan& p) {
  std::vector<int64_t> first(z(p.ep), 0), count;
  for (int64_t s = 0; s < p.ep; ++s) count.push_back(p.send_rows[z(s)][z(p.me)]);
  return exec::dispatch_detail::make_grouping(p, first, count);
}

void run_uncapped(Ctx& x, cudaEvent_t mid) {
  const Dims& d = x.d;
  const RowPlan& p = x.p;
  DeviceAllocator& alloc = x.alloc;
  const cudaStream_t s = x.s;
  const bool llep = x.c.llep;
  const Grouping g = uncapped_grouping(p);
  const int64_t R = p.received();
  {  // no-grad forward
    const std::string pre = "fwd/" + x.c.layer + "/moe/";
    alloc.set_phase(pre + "route");
    RoutingDev r(alloc, d, s);
    compute_routing(x.blas, d, x.L, x.ids, r);
    alloc.set_phase(pre + "dispatch");
    DeviceBuffer foreign = borrow_weights(x, static_cast<int64_t>(p.foreign.size()));
    const std::vector<ExpertSlotDev> w = expert_slots(d, p, x.L, &foreign, nullptr);
    MetaDev m = make_meta(x, r);
    DispatchedDev in = uncapped_dispatch(x, g, m, llep);
    alloc.set_phase(pre + "experts");
    DeviceBuffer fc1 = make_buf(alloc, DType::BF16, R * 2 * d.F, s);  // [R, 2F] bf16
    DeviceBuffer act = make_buf(alloc, DType::BF16, R * d.F, s);      // [R, F] bf16
    const ProbsDev pr = d.ep == 1 ? ProbsDev{m.pprobs.as<float>(), false} : ProbsDev{in.recv_probs.as<float>(), true};
    experts_forward(x.blas, d, w, g, pr, in.in.as<Bf16>(), fc1.as<Bf16>(), act.as<Bf16>(), nullptr);
    in.recv_probs.reset();
    in.in.reset();
    fc1.reset();
    DeviceBuffer fc2 = make_buf(alloc, DType::BF16, R * d.H, s);  // [R, H] bf16
    experts_fc2(x.blas, d, w, g, act.as<Bf16>(), fc2.as<Bf16>());
    act.reset();
    alloc.set_phase(pre + "combine");
    uncapped_combine(x, g, m, r, fc2, x.c.outputs ? &x.res.out : nullptr);
    if (x.c.outputs) f32_to_host(r.topk_w.as<float>(), d.N, x.res.topk_weights, s);
  }
  FLATPEAK_CUDA_CHECK(cudaEventRecord(mid, s));
  // Recompute: the same forward, keeping expert input, fc1 and act*prob (and the received probs).
  const std::string q = "bwd/" + x.c.layer + "/recompute/moe/";
  alloc.set_phase(q + "dispatch");
  RoutingDev r(alloc, d, s);
  compute_routing(x.blas, d, x.L, x.ids, r);
  DeviceBuffer foreign = borrow_weights(x, static_cast<int64_t>(p.foreign.size()));
  MetaDev m = make_meta(x, r);
  const int64_t* eid = r.topk_ids.as<int64_t>();
  DispatchedDev in = uncapped_dispatch(x, g, m, llep);
  const ProbsDev pr = d.ep == 1 ? ProbsDev{m.pprobs.as<float>(), false} : ProbsDev{in.recv_probs.as<float>(), true};
  alloc.set_phase(q + "experts");
  DeviceBuffer fc1 = make_buf(alloc, DType::BF16, R * 2 * d.F, s);  // [R, 2F] bf16, saved
  DeviceBuffer act = make_buf(alloc, DType::BF16, R * d.F, s);      // [R, F] bf16, saved
  DeviceBuffer fc2 = make_buf(alloc, DType::BF16, R * d.H, s);      // [R, H] bf16
  {
    const std::vector<ExpertSlotDev> w = expert_slots(d, p, x.L, &foreign, nullptr);
    experts_forward(x.blas, d, w, g, pr, in.in.as<Bf16>(), fc1.as<Bf16>(), act.as<Bf16>(), fc2.as<Bf16>());
  }
  alloc.set_phase(q + "combine");
  uncapped_combine(x, g, m, r, fc2, nullptr);
  fc2.reset();

  // Backward. Combine: each copy's gradient is d_out of its token, gathered in send order.
  const std::string gp = "bwd/" + x.c.layer + "/moe/";
  alloc.set_phase(gp + "combine");
  DeviceBuffer d_fc2;
  {
    DeviceBuffer d_comb = make_buf(alloc, DType::BF16, d.N * d.H, s);  // [T·k, H] bf16, send order
    DeviceBuffer d_recv = make_buf(alloc, DType::BF16, R * d.H, s);    // [R, H] bf16, source-major
    gather_send_rows(s, d, m.sort32(), x.L.d_out.as<Bf16>(), false, d_comb.as<Bf16>());
    exchange(x.comm, d_comb.raw(), row_of(p.send_rows, d.me), p.dest_begin, d_recv.raw(), column_of(p.send_rows, d.me), p.recv_begin,
             d.H, DType::BF16);
    d_comb.reset();
    if (d.ep == 1) {
      d_fc2 = std::move(d_recv);
    } else {
      d_fc2 = make_buf(alloc, DType::BF16, R * d.H, s);  // [R, H] bf16, expert order
      regroup(g, d_recv.raw(), d_fc2.raw(), d.H, 2, s);
    }
  }
  alloc.set_phase(gp + "experts");
  // LLEP: the borrowed experts' fp32 gradients [S_p, P] and the lent ones coming back [S_sent, P].
  DeviceBuffer foreign_dw = make_buf(alloc, DType::F32, static_cast<int64_t>(p.foreign.size()) * d.P, s);
  DeviceBuffer lent_dw = make_buf(alloc, DType::F32, (p.lla_ran ? p.lent : 0) * d.P, s);
  zero(foreign_dw, s);
  const std::vector<ExpertSlotDev> w = expert_slots(d, p, x.L, &foreign, &foreign_dw);
  DeviceBuffer d_in;
  {
    DeviceBuffer d_act = make_buf(alloc, DType::BF16, R * d.F, s);      // [R, F] bf16
    DeviceBuffer d_fc1 = make_buf(alloc, DType::BF16, R * 2 * d.F, s);  // [R, 2F] bf16
    experts_backward_fc(x.blas, d, w, g, pr, fc1.as<Bf16>(), act.as<Bf16>(), d_fc2.as<Bf16>(), d_act.as<Bf16>(), d_fc1.as<Bf16>());
    if (d.ep > 1) {  // d prob home into the permuted probs
      exchange(x.comm, in.recv_probs.raw(), column_of(p.send_rows, d.me), p.recv_begin, m.pprobs.raw(), row_of(p.send_rows, d.me),
               p.dest_begin, 1, DType::F32);
      in.recv_probs.reset();
    }
    scatter_dprobs(s, d, m.sort32(), eid, m.pprobs.as<float>(), r.scores.as<float>());
    d_fc2.reset();
    d_act.reset();
    act.reset();
    fc1.reset();
    d_in = make_buf(alloc, DType::BF16, R * d.H, s);  // [R, H] bf16, expert order
    experts_backward_in(x.blas, d, w, g, in.in.as<Bf16>(), d_fc1.as<Bf16>(), d_in.as<Bf16>());
    in.in.reset();
  }
  // Dispatch: d in back to its sources, each token's k rows summed in increasing expert order.
  alloc.set_phase(gp + "dispatch");
  DeviceBuffer d_src;
  if (d.ep > 1) {
    d_src = make_buf(alloc, DType::BF16, R * d.H, s);  // [R, H] bf16, source-major
    ungroup(g, d_in.raw(), d_src.raw(), d.H, 2, s);
    d_in.reset();
  }
  DeviceBuffer d_rows = make_buf(alloc, DType::BF16, d.N * d.H, s);  // [T·k, H] bf16, send order
  DeviceBuffer d_x = make_buf(alloc, DType::F32, d.T * d.H, s);      // [T, H] fp32 d norm-2 output accumulator
  exchange(x.comm, d.ep > 1 ? d_src.raw() : d_in.raw(), column_of(p.send_rows, d.me), p.recv_begin, d_rows.raw(),
           row_of(p.send_rows, d.me), p.dest_begin, d.H, DType::BF16);
  d_src.reset();
  zero(d_x, s);
  sum_token_rows(s, d, eid, m.unsort32(d), d_rows.as<Bf16>(), nullptr, d_x.as<float>());
  router_backward(s, d, x.L, r, d_x.as<float>());
  if (x.c.outputs) f32_to_host(d_x.as<float>(), d.T * d.H, x.res.d_x, s);
  if (p.lla_ran) {
    exec::dispatch_detail::send_lent_grads(x.comm, d, p, foreign_dw.raw(), lent_dw.raw());
    for (int64_t e = d.me * d.L; e < (d.me + 1) * d.L; ++e)
      for (int64_t slot : p.lent_slot[z(e)]) add_returned_grads(s, d, x.L, e, lent_dw.as<float>() + slot * d.P);
  }
}

// ---- capped (dispatch_capped.cpp, dispatch_rounds.cpp)

// The CPU's RoundSet: round buffers allocated once per pass, sized at launch.
struct RoundSetDev {
  int64_t C, B, D, N;
  DeviceBuffer send, recv, comb_send, comb_recv, probs, index, dsu, comb_acc;
  RoundSetDev(Ctx& x, int64_t cap, int64_t buffer_rows, int64_t depth)
      : C(cap), B(buffer_rows), D(depth), N(x.d.N),
        send(make_buf(x.alloc, DType::BF16, D * C * x.d.H, x.s)),         // [D, C, H] bf16
        recv(make_buf(x.alloc, DType::BF16, D * B * x.d.H, x.s)),         // [D, B, H] bf16
        comb_send(make_buf(x.alloc, DType::BF16, D * B * x.d.H, x.s)),    // [D, B, H] bf16
        comb_recv(make_buf(x.alloc, DType::BF16, D * C * x.d.H, x.s)),    // [D, C, H] bf16
        probs(make_buf(x.alloc, DType::F32, D * 2 * (B + C), x.s)),       // [D, 2(B+C)] fp32
        index(make_buf(x.alloc, DType::I64, D * 2 * (B + C), x.s)),       // [D, 2(B+C)] int64
        dsu(make_buf(x.alloc, DType::I64, 3 * x.d.N, x.s)),               // [3, T·k] int64 dest | sort | unsort
        comb_acc(make_buf(x.alloc, DType::F32, x.d.T * x.d.H, x.s)) {     // [T, H] fp32
    std::vector<int64_t> h(z(3 * N));
    exec::dispatch_detail::fill_send_order(x.p, x.d, x.ids.data(), h.data() + N, h.data() + 2 * N, h.data());
    FLATPEAK_CUDA_CHECK(cudaMemcpyAsync(dsu.raw(), h.data(), h.size() * 8, cudaMemcpyHostToDevice, x.s));
    FLATPEAK_CUDA_CHECK(cudaStreamSynchronize(x.s));  // `h` (pageable) is freed on return: the copy must be done
    zero(comb_acc, x.s);
  }
  const int64_t* dest() const { return dsu.as<int64_t>(); }
  const int64_t* sort() const { return dsu.as<int64_t>() + N; }
  const int64_t* unsort() const { return dsu.as<int64_t>() + 2 * N; }
  int64_t slot_of(int64_t j) const { return j % D; }
  float* prob_part(int64_t j, int64_t part) const { return probs.as<float>() + slot_of(j) * 2 * (B + C) + part; }
  int64_t* index_part(int64_t j, int64_t part) const { return index.as<int64_t>() + slot_of(j) * 2 * (B + C) + part; }
  Bf16* send_rows(int64_t j, int64_t H) const { return send.as<Bf16>() + slot_of(j) * C * H; }
  Bf16* recv_rows(int64_t j, int64_t H) const { return recv.as<Bf16>() + slot_of(j) * B * H; }
};

void pack(Ctx& x, const RoutingDev& r, const RoundSetDev& rs, const RoundRanges& rr, int64_t j, const Bf16* src, Bf16* rows) {
  pack_round(x.s, x.d, rr, rs.sort(), r.topk_w.as<float>(), r.topk_ids.as<int64_t>(), src, rows, rs.prob_part(j, 0),
             rs.index_part(j, 0), rs.index_part(j, rs.C + 2 * rs.B));
}

void send_round_probs(Ctx& x, const RoundSetDev& rs, const Round& rd, int64_t j) {
  exchange(x.comm, rs.prob_part(j, 0), rd.out, rd.out_begin, rs.prob_part(j, rs.C), rd.in, rd.in_begin, 1, DType::F32);
  exchange(x.comm, rs.index_part(j, 0), rd.out, rd.out_begin, rs.index_part(j, rs.C), rd.in, rd.in_begin, 1, DType::I64);
  // The expert ids that came with the rows against the plan, on the host (as the CPU checks).
  std::vector<int64_t> got(z(rd.received));
  if (rd.received > 0)
    FLATPEAK_CUDA_CHECK(cudaMemcpyAsync(got.data(), rs.index_part(j, rs.C), got.size() * 8, cudaMemcpyDeviceToHost, x.s));
  FLATPEAK_CUDA_CHECK(cudaStreamSynchronize(x.s));
  for (const auto& ch : rd.g.chunks)
    for (int64_t i = 0; i < ch.rows; ++i) {
      const int64_t e = got[z(ch.recv_row + i)];
      if (e < 0 || e >= x.d.E || x.p.local_of[z(e)] != ch.local)
        throw std::logic_error("dispatch schedule: a round's rows disagree with the plan (round " + std::to_string(j) + ", expert " +
                               std::to_string(e) + ")");
    }
  regroup(rd.g, rs.prob_part(j, rs.C), rs.prob_part(j, rs.C + rs.B), 1, 4, x.s);
}

void round_dispatch(Ctx& x, const RoutingDev& r, const RoundSetDev& rs, const Round& rd, int64_t j, const std::vector<ExpertSlotDev>& w,
                    Bf16* in, Bf16* fc1, Bf16* act) {
  const Dims& d = x.d;
  pack(x, r, rs, round_ranges(x.p, rd), j, x.L.x.as<Bf16>(), rs.send_rows(j, d.H));
  exchange(x.comm, rs.send_rows(j, d.H), rd.out, rd.out_begin, rs.recv_rows(j, d.H), rd.in, rd.in_begin, d.H, DType::BF16);
  send_round_probs(x, rs, rd, j);
  regroup(rd.g, rs.recv_rows(j, d.H), in, d.H, 2, x.s);
  experts_forward(x.blas, d, w, rd.g, ProbsDev{rs.prob_part(j, rs.C + rs.B), false}, in, fc1, act, nullptr);
}

void round_combine(Ctx& x, const std::vector<ExpertSlotDev>& w, const RoundSetDev& rs, const Round& rd, int64_t j, const Bf16* act,
                   Bf16* fc2, Bf16* unperm) {
  const Dims& d = x.d;
  experts_fc2(x.blas, d, w, rd.g, act, fc2);
  ungroup(rd.g, fc2, unperm, d.H, 2, x.s);
  Bf16* comb_send = rs.comb_send.as<Bf16>() + rs.slot_of(j) * rs.B * d.H;
  Bf16* comb_recv = rs.comb_recv.as<Bf16>() + rs.slot_of(j) * rs.C * d.H;
  if (rd.received > 0)
    FLATPEAK_CUDA_CHECK(cudaMemcpyAsync(comb_send, unperm, static_cast<size_t>(rd.received * d.H) * sizeof(Bf16),
                                        cudaMemcpyDeviceToDevice, x.s));
  exchange(x.comm, comb_send, rd.in, rd.in_begin, comb_recv, rd.out, rd.out_begin, d.H, DType::BF16);
  add_round_rows(x.s, d, round_ranges(x.p, rd), rs.dest(), rs.unsort(), comb_recv, rs.comb_acc.as<float>());
}

void run_capped(Ctx& x, cudaEvent_t mid) {
  const Dims& d = x.d;
  const RowPlan& p = x.p;
  DeviceAllocator& alloc = x.alloc;
  const cudaStream_t s = x.s;
  const DispatchScheduleConfig& c = x.c;
  DispatchScheduleResult& res = x.res;
  const CappedPlan cp = exec::dispatch_detail::plan_capped(c, d, p);
  const int64_t C = cp.C, B = cp.B, D = c.depth, pool = cp.pool, store_rows = cp.store_rows, n = cp.n(), stored = cp.stored;
  const std::vector<Round>& rounds = cp.rounds;
  res.rounds = n;
  res.chunk_cap_rows = cp.cap;
  res.launch_chunk_cap_rows = C;
  res.round_buffer_rows = B;
  res.foreign_pool = pool;
  res.store_rows = store_rows;
  res.stored_rounds = stored;
  res.max_round_received_rows = cp.max_received;
  auto round = [&](const std::string& prefix, int64_t j) { return prefix + "dispatch/r" + std::to_string(j); };
  {  // no-grad forward: one set of round expert buffers [B, ·], reused by every round
    const std::string pre = "fwd/" + c.layer + "/moe/";
    alloc.set_phase(pre + "route");
    RoutingDev r(alloc, d, s);
    compute_routing(x.blas, d, x.L, x.ids, r);
    alloc.set_phase(round(pre, 0));
    RoundSetDev rs(x, C, B, D);
    DeviceBuffer in = make_buf(alloc, DType::BF16, B * d.H, s);        // [B, H] bf16
    DeviceBuffer fc1 = make_buf(alloc, DType::BF16, B * 2 * d.F, s);   // [B, 2F] bf16
    DeviceBuffer act = make_buf(alloc, DType::BF16, B * d.F, s);       // [B, F] bf16
    DeviceBuffer fc2 = make_buf(alloc, DType::BF16, B * d.H, s);       // [B, H] bf16
    DeviceBuffer unperm = make_buf(alloc, DType::BF16, B * d.H, s);    // [B, H] bf16
    DeviceBuffer foreign = borrow_weights(x, pool);
    const std::vector<ExpertSlotDev> w = expert_slots(d, p, x.L, &foreign, nullptr);
    for (int64_t j = 0; j < n; ++j) {
      if (j > 0) alloc.set_phase(round(pre, j));
      round_dispatch(x, r, rs, rounds[z(j)], j, w, in.as<Bf16>(), fc1.as<Bf16>(), act.as<Bf16>());
      round_combine(x, w, rs, rounds[z(j)], j, act.as<Bf16>(), fc2.as<Bf16>(), unperm.as<Bf16>());
    }
    if (c.outputs) {
      f32_round_bf16_to_host(rs.comb_acc.as<float>(), d.T * d.H, res.out, s);
      f32_to_host(r.topk_w.as<float>(), d.N, res.topk_weights, s);
    }
  }
  FLATPEAK_CUDA_CHECK(cudaEventRecord(mid, s));
  // Recompute: store mode keeps the rounds that fit on every rank; recompute mode only routes.
  const std::vector<int64_t>& store_row = cp.store_row;
  const std::string q = "bwd/" + c.layer + "/recompute/moe/";
  DeviceBuffer saved_in, saved_fc1, saved_act;  // store: [R_store, H], [R_store, 2F], [R_store, F] bf16
  if (!c.store) alloc.set_phase(q + "route");
  else alloc.set_phase(round(q, 0));
  RoutingDev r(alloc, d, s);
  compute_routing(x.blas, d, x.L, x.ids, r);
  const int64_t* eid = r.topk_ids.as<int64_t>();
  DeviceBuffer foreign = borrow_weights(x, pool);
  if (c.store) {
    RoundSetDev rs(x, C, B, D);
    DeviceBuffer fc2 = make_buf(alloc, DType::BF16, B * d.H, s);     // [B, H] bf16
    DeviceBuffer unperm = make_buf(alloc, DType::BF16, B * d.H, s);  // [B, H] bf16
    saved_in = make_buf(alloc, DType::BF16, store_rows * d.H, s);
    saved_fc1 = make_buf(alloc, DType::BF16, store_rows * 2 * d.F, s);
    saved_act = make_buf(alloc, DType::BF16, store_rows * d.F, s);
    const std::vector<ExpertSlotDev> w = expert_slots(d, p, x.L, &foreign, nullptr);
    for (int64_t j = 0; j < stored; ++j) {
      if (j > 0) alloc.set_phase(round(q, j));
      const int64_t s0 = store_row[z(j)];
      Bf16* act = saved_act.as<Bf16>() + s0 * d.F;
      round_dispatch(x, r, rs, rounds[z(j)], j, w, saved_in.as<Bf16>() + s0 * d.H, saved_fc1.as<Bf16>() + s0 * 2 * d.F, act);
      round_combine(x, w, rs, rounds[z(j)], j, act, fc2.as<Bf16>(), unperm.as<Bf16>());
    }
  }
  // Backward, rounds in forward order: d_out rows to the experts, d in and d prob home.
  const std::string gp = "bwd/" + c.layer + "/moe/";
  alloc.set_phase(round(gp, 0));
  RoundSetDev rs(x, C, B, D);
  DeviceBuffer grads = make_buf(alloc, DType::BF16, D * 2 * (B + C) * d.H, s);  // [D, 2(B+C), H] bf16
  DeviceBuffer d_fc2 = make_buf(alloc, DType::BF16, B * d.H, s);                // [B, H] bf16 (then d in)
  DeviceBuffer d_act = make_buf(alloc, DType::BF16, B * d.F, s);                // [B, F] bf16
  DeviceBuffer d_fc1 = make_buf(alloc, DType::BF16, B * 2 * d.F, s);            // [B, 2F] bf16
  DeviceBuffer d_x = make_buf(alloc, DType::F32, d.T * d.H, s);                 // [T, H] fp32 d norm-2 output accumulator
  zero(d_x, s);
  DeviceBuffer in, fc1, act;  // recompute mode: the round's recomputed expert input, fc1, act*prob [B, ·]
  if (!c.store) {
    in = make_buf(alloc, DType::BF16, B * d.H, s);
    fc1 = make_buf(alloc, DType::BF16, B * 2 * d.F, s);
    act = make_buf(alloc, DType::BF16, B * d.F, s);
  }
  DeviceBuffer foreign_dw = make_buf(alloc, DType::F32, pool * d.P, s);                             // [S_cap, P] fp32
  DeviceBuffer lent_staging = make_buf(alloc, DType::F32, (d.ep > 1 && c.llep ? 1 : 0) * d.P, s);  // [1, P] fp32
  zero(foreign_dw, s);
  const std::vector<ExpertSlotDev> w = expert_slots(d, p, x.L, &foreign, &foreign_dw);
  for (int64_t j = 0; j < n; ++j) {
    if (j > 0) alloc.set_phase(round(gp, j));
    const Round& rd = rounds[z(j)];
    Bf16 *rin = nullptr, *rfc1 = nullptr, *ract = nullptr;
    if (c.store && j < stored) {
      const int64_t s0 = store_row[z(j)];
      rin = saved_in.as<Bf16>() + s0 * d.H;
      rfc1 = saved_fc1.as<Bf16>() + s0 * 2 * d.F;
      ract = saved_act.as<Bf16>() + s0 * d.F;
    } else if (c.store) {  // not stored: recomputed into the store, whose rounds are done
      rin = saved_in.as<Bf16>();
      rfc1 = saved_fc1.as<Bf16>();
      ract = saved_act.as<Bf16>();
      round_dispatch(x, r, rs, rd, j, w, rin, rfc1, ract);
    } else {
      rin = in.as<Bf16>();
      rfc1 = fc1.as<Bf16>();
      ract = act.as<Bf16>();
      round_dispatch(x, r, rs, rd, j, w, rin, rfc1, ract);
    }
    Bf16* g_send = grads.as<Bf16>() + rs.slot_of(j) * 2 * (B + C) * d.H;  // [C, H] d combine rows
    Bf16* g_recv = g_send + C * d.H;                                       // [B, H] received
    Bf16* g_back = g_recv + B * d.H;                                       // [B, H] d expert input
    Bf16* g_home = g_back + B * d.H;                                       // [C, H] d dispatch rows
    const RoundRanges rr = round_ranges(p, rd);
    pack(x, r, rs, rr, j, x.L.d_out.as<Bf16>(), g_send);
    if (c.store && j < stored) send_round_probs(x, rs, rd, j);  // the stored rounds' went with the recompute
    exchange(x.comm, g_send, rd.out, rd.out_begin, g_recv, rd.in, rd.in_begin, d.H, DType::BF16);
    regroup(rd.g, g_recv, d_fc2.raw(), d.H, 2, s);
    const ProbsDev pr{rs.prob_part(j, C + B), false};
    experts_backward_fc(x.blas, d, w, rd.g, pr, rfc1, ract, d_fc2.as<Bf16>(), d_act.as<Bf16>(), d_fc1.as<Bf16>());
    experts_backward_in(x.blas, d, w, rd.g, rin, d_fc1.as<Bf16>(), d_fc2.as<Bf16>());
    ungroup(rd.g, d_fc2.raw(), g_back, d.H, 2, s);
    ungroup(rd.g, rs.prob_part(j, C + B), rs.prob_part(j, C), 1, 4, s);
    exchange(x.comm, g_back, rd.in, rd.in_begin, g_home, rd.out, rd.out_begin, d.H, DType::BF16);
    exchange(x.comm, rs.prob_part(j, C), rd.in, rd.in_begin, rs.prob_part(j, 2 * B + C), rd.out, rd.out_begin, 1, DType::F32);
    scatter_round_dprobs(s, d, rd.sent, rs.index_part(j, C + 2 * B), eid, rs.prob_part(j, 2 * B + C), r.scores.as<float>());
    add_round_rows(s, d, rr, rs.dest(), rs.unsort(), g_home, d_x.as<float>());
  }
  router_backward(s, d, x.L, r, d_x.as<float>());
  if (c.outputs) f32_to_host(d_x.as<float>(), d.T * d.H, res.d_x, s);
  if (p.lla_ran)
    exec::dispatch_detail::send_lent_grads_staged(x.comm, d, p, foreign_dw.raw(), lent_staging.raw(), [&](int64_t e) {
      add_returned_grads(s, d, x.L, e, lent_staging.as<float>());
    });
}

void check_args(exec::Communicator& comm, const CublasContext& blas, const DispatchScheduleConfig& c, const std::vector<int32_t>& ids) {
  const int64_t ep = comm.size();
  exec::dispatch_detail::validate_config(c, ep);
  if (ep > kMaxEp) throw std::invalid_argument("dispatch schedule (cuda): at most " + std::to_string(kMaxEp) + " EP ranks");
  if (c.top_k > kMaxTopK) throw std::invalid_argument("dispatch schedule (cuda): top_k must be <= " + std::to_string(kMaxTopK));
  if (c.tokens * c.top_k > INT32_MAX) throw std::invalid_argument("dispatch schedule (cuda): T·k must be < 2^31 (int32 send maps)");
  if (static_cast<int64_t>(ids.size()) != c.tokens * c.top_k)
    throw std::invalid_argument("dispatch schedule (cuda): topk_ids must hold tokens x top_k ids");
  for (size_t i = 0; i < ids.size(); ++i)  // the kernels index [T, E] rows with them
    if (ids[i] < 0 || ids[i] >= c.experts)
      throw std::invalid_argument("dispatch schedule (cuda): topk_ids[" + std::to_string(i) + "] = " + std::to_string(ids[i]) +
                                  " is outside 0.." + std::to_string(c.experts - 1));
  // The count upload, every exchange and the copies back are queued on blas.stream(): the
  // collectives must be ordered on it too (NCCL's queued there, cuda-threads synchronising it).
  require_device_communicator(comm, blas.stream(), "dispatch schedule (cuda)");
}

}  // namespace

DispatchEpCudaResult run_dispatch_ep_cuda(exec::Communicator& comm, DeviceAllocator& alloc, const CublasContext& blas,
                                          const DispatchScheduleConfig& c, const std::vector<int32_t>& topk_ids) {
  check_args(comm, blas, c, topk_ids);
  const int64_t ep = comm.size();
  const cudaStream_t s = blas.stream();
  const Dims d = exec::dispatch_detail::dims_of(c, ep, comm.rank());
  DispatchEpCudaResult out;
  DispatchScheduleResult& res = out.plan;
  res.expert_counts = count_routing(topk_ids, RoutingShape{ep, d.E, d.k});
  {  // every rank learns the [EP][E] count matrix, through device buffers (category comm)
    DeviceBuffer mine = make_buf(alloc, DType::I64, d.E, s, Category::Comm);       // [E] int64
    DeviceBuffer all = make_buf(alloc, DType::I64, ep * d.E, s, Category::Comm);   // [EP, E] int64
    FLATPEAK_CUDA_CHECK(cudaMemcpyAsync(mine.raw(), res.expert_counts.data(), z(d.E) * 8, cudaMemcpyHostToDevice, s));
    comm.all_gather(mine.raw(), all.raw(), d.E, DType::I64);
    std::vector<int64_t> gathered(z(ep * d.E));
    FLATPEAK_CUDA_CHECK(cudaMemcpyAsync(gathered.data(), all.raw(), gathered.size() * 8, cudaMemcpyDeviceToHost, s));
    FLATPEAK_CUDA_CHECK(cudaStreamSynchronize(s));
    for (int64_t r = 0; r < ep; ++r)
      res.source_counts.emplace_back(gathered.begin() + r * d.E, gathered.begin() + (r + 1) * d.E);
  }
  const RowPlan p = exec::dispatch_detail::plan_rows(c, d, res.source_counts);
  res.received_rows = p.received();
  res.foreign_experts = static_cast<int64_t>(p.foreign.size());
  res.lent_weights = p.lla_ran ? p.lent : 0;
  res.lla_triggered = p.lla_ran;
  res.rho = imbalance_rho(p.rank_rows);
  LayerDev L(alloc, d, s);
  fill_layer(c, d, L, s);
  const std::vector<int64_t> ids(topk_ids.begin(), topk_ids.end());
  exec::cuda_detail::ScopedEvent start, mid, stop;
  start.record(s);
  Ctx x{comm, alloc, blas, s, d, L, p, ids, c, res};
  if (c.chunk_cap_rows == 0) run_uncapped(x, mid.get());
  else run_capped(x, mid.get());
  stop.record(s);
  FLATPEAK_CUDA_CHECK(cudaEventSynchronize(stop.get()));
  out.seconds = exec::cuda_detail::event_seconds(start.get(), stop.get());
  out.forward_s = exec::cuda_detail::event_seconds(start.get(), mid.get());
  out.backward_s = exec::cuda_detail::event_seconds(mid.get(), stop.get());
  if (c.outputs) {
    f32_to_host(L.dw_router.as<float>(), d.E * d.H, res.d_w_router, s);
    f32_to_host(L.dw_gate_up.as<float>(), d.L * 2 * d.F * d.H, res.d_w_gate_up, s);
    f32_to_host(L.dw_down.as<float>(), d.L * d.H * d.F, res.d_w_down, s);
    if (d.Pb > 0) f32_to_host(L.db_expert.as<float>(), d.L * d.Pb, res.d_b_expert, s);
  }
  return out;
}

}  // namespace flatpeak::cuda
