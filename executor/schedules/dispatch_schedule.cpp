// The dispatch component run (dispatch_schedule.h), on one rank or on EP ranks. One design with
// planner/README.md ("Dispatch"): probabilities are applied to the activation (act*prob), so the
// combine is an unweighted sum and its backward needs no expert outputs; the router's weight
// gradient comes from the experts' backward (d prob = Σ_f d(act*prob)·act).
//
// Layouts. A source sends its copies in send order: destination-major, experts ascending within
// a destination, each expert's copies in token order (LLEP: the source's range for that
// destination). A destination receives source-major blocks and computes in expert order: its
// local experts (native, then borrowed ones by id), each expert's rows by source, then token
// order. At one rank both orders are the expert order, so the receive buffer becomes the expert
// input and the experts read the rank's own permuted probs. At EP > 1 the received rows are
// regrouped into the expert input (a copy of the receive buffer, Megatron's sort by local
// expert), and the received probs stay beside them until the backward has used them, because the
// probs belong to other ranks' tokens; d prob goes back to its source by the reversed all-to-all.
// Buffers the backward no longer needs hold its small gradients in place: d prob goes into the
// router scores [T, E] (scattered at the chosen experts) and the router's d logits into the router
// logits [T, E]; both are dead once the routing has been recomputed.
//
// This file holds the entry points: validation, the routing and its all-gathered counts, the row
// plan, the layer's inputs and the launch-time sizes; the passes and their parts live in the
// files dispatch_internal.h lists.
#include "executor/schedules/dispatch_schedule.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <utility>
#include <stdexcept>
#include <string>
#include <vector>

#include "executor/ops/dtype.h"
#include "executor/schedules/dispatch_internal.h"
#include "executor/schedules/schedule_util.h"
#include "spec/errors.h"

namespace flatpeak::exec {

using namespace dispatch_detail;

namespace dispatch_detail {

void validate_config(const DispatchScheduleConfig& c, int64_t ep) {
  if (c.tokens <= 0 || c.hidden <= 0 || c.experts <= 0 || c.ffn <= 0 || c.top_k <= 0 || c.top_k > c.experts)
    throw std::invalid_argument("dispatch schedule: need tokens, hidden, experts, ffn > 0 and 1 <= top_k <= experts");
  if (c.chunk_cap_rows < 0 || c.depth < 1)
    throw std::invalid_argument("dispatch schedule: chunk_cap_rows must be >= 0 and depth >= 1");
  if (c.experts % ep != 0) throw std::invalid_argument("dispatch schedule: the experts must divide over the EP ranks");
  if (c.topk_ids && static_cast<int64_t>(c.topk_ids->size()) != c.tokens * c.top_k)
    throw std::invalid_argument("dispatch schedule: topk_ids must hold tokens x top_k ids");
  {
    InputErrors errors;
    if (c.llep) validate_lla_knobs(c.lla, errors);
    errors.throw_if_any();
  }
}

RowPlan plan_rows(const DispatchScheduleConfig& c, const Dims& d, CountMatrix copies) {
  // PipelinedLLEP: LLA lends no rank more experts than the launch-time foreign-weight pool holds.
  LlaKnobs knobs = c.lla;
  if (c.chunk_cap_rows > 0 && c.llep) knobs.max_foreign_experts = dispatch_foreign_pool(c, d.ep);
  return make_row_plan(d, std::move(copies), c.llep, knobs);
}

}  // namespace dispatch_detail

namespace {

// At one rank the all-to-alls are copies: a communicator of one.
class SelfComm final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  const char* backend_name() const override { return "self"; }
  void all_to_allv(const void* send, const int64_t* send_counts, const int64_t* send_displs, void* recv,
                   const int64_t* recv_counts, const int64_t* recv_displs, DType dtype) override {
    if (send_counts[0] != recv_counts[0]) throw CommError(0, "all_to_allv", "send and receive counts differ");
    copy(static_cast<const char*>(send) + send_displs[0] * dtype_bytes(dtype),
         static_cast<char*>(recv) + recv_displs[0] * dtype_bytes(dtype), send_counts[0], dtype);
  }
  void sendrecv_shift(const void* send, void* recv, int64_t count, DType dtype, int) override { copy(send, recv, count, dtype); }
  void all_gather(const void* send, void* recv, int64_t count, DType dtype) override { copy(send, recv, count, dtype); }
  void reduce_scatter(const void* send, void* recv, int64_t count, DType dtype) override { copy(send, recv, count, dtype); }
  void all_reduce(const void* send, void* recv, int64_t count, DType dtype, ReduceOp) override {
    if (send != recv) copy(send, recv, count, dtype);
  }
  void barrier() override {}
  std::unique_ptr<Communicator> split(int, int) override { return std::make_unique<SelfComm>(); }
  void check_status(int exit_code, const std::string& message) override {
    if (exit_code != 0) throw RankFailed(0, exit_code, message);
  }
  void abort(int exit_code, const std::string& message) override { throw RankFailed(0, exit_code, message); }

 private:
  static void copy(const void* send, void* recv, int64_t count, DType dtype) {
    if (count > 0) std::memcpy(recv, send, z(count * dtype_bytes(dtype)));
  }
};

// Seeds of the inputs (one stream each).
uint64_t seed_of(const DispatchScheduleConfig& c, uint64_t stream) { return c.seed * 8 + stream; }

// This rank's slices of the single-rank run's inputs over EP·T tokens and E experts.
void fill_inputs(const DispatchScheduleConfig& c, const Dims& d, Bf16* x, Bf16* d_out, Bf16* w_router, Bf16* w_gate_up,
                 Bf16* w_down, Bf16* b_expert) {
  const int64_t global = c.replica * d.ep + d.me;  // this rank's tokens among every group's
  fill_bf16(x, d.T * d.H, seed_of(c, 1), 1.0f, global * d.T * d.H);
  fill_bf16(d_out, d.T * d.H, seed_of(c, 2), 1.0f, global * d.T * d.H);
  fill_bf16(w_router, d.E * d.H, seed_of(c, 3), 1.0f / std::sqrt(static_cast<float>(d.H)));
  fill_bf16(w_gate_up, d.L * 2 * d.F * d.H, seed_of(c, 4), 2.0f / std::sqrt(static_cast<float>(d.H)), d.me * d.L * 2 * d.F * d.H);
  fill_bf16(w_down, d.L * d.H * d.F, seed_of(c, 5), 2.0f / std::sqrt(static_cast<float>(d.F)), d.me * d.L * d.H * d.F);
  if (d.Pb > 0) fill_bf16(b_expert, d.L * d.Pb, seed_of(c, 7), 0.5f, d.me * d.L * d.Pb);
}

DispatchScheduleResult run_on(Communicator& comm, TrackingAllocator& alloc, const DispatchScheduleConfig& c) {
  const int64_t ep = comm.size();
  validate_config(c, ep);
  const Dims d = dims_of(c, ep, comm.rank());
  DispatchScheduleResult res;
  const std::vector<int32_t> ids = c.topk_ids ? *c.topk_ids : draw_dispatch_routing(c, ep, d.me);
  const RoutingShape shape{ep, d.E, d.k};
  res.expert_counts = count_routing(ids, shape);
  // Every rank learns the [EP][E] count matrix (O(EP·E) bookkeeping).
  std::vector<int64_t> gathered(z(ep * d.E));
  comm.all_gather(res.expert_counts.data(), gathered.data(), d.E, DType::I64);
  for (int64_t s = 0; s < ep; ++s) res.source_counts.emplace_back(gathered.begin() + s * d.E, gathered.begin() + (s + 1) * d.E);
  const RowPlan p = plan_rows(c, d, res.source_counts);
  res.received_rows = p.received();
  res.foreign_experts = static_cast<int64_t>(p.foreign.size());
  res.lent_weights = p.lla_ran ? p.lent : 0;
  res.lla_triggered = p.lla_ran;
  res.rho = imbalance_rho(p.rank_rows);
  LayerData L(alloc, d);
  fill_inputs(c, d, L.x.data<Bf16>(), L.d_out.data<Bf16>(), L.w_router.data<Bf16>(), L.w_gate_up.data<Bf16>(), L.w_down.data<Bf16>(),
              L.b_expert.empty() ? nullptr : L.b_expert.data<Bf16>());
  for (Tensor* t : {&L.dw_router, &L.dw_gate_up, &L.dw_down, &L.db_expert}) zero_f32(*t);
  if (c.chunk_cap_rows == 0) run_uncapped(comm, alloc, d, L, p, ids, c, res);
  else run_capped(comm, alloc, d, L, p, ids, c, res);
  if (!c.outputs) {
    for (std::vector<float>* v : {&res.out, &res.d_x, &res.topk_weights}) std::vector<float>().swap(*v);
    return res;
  }
  res.d_w_router.assign(L.dw_router.data<float>(), L.dw_router.data<float>() + L.dw_router.numel());
  res.d_w_gate_up.assign(L.dw_gate_up.data<float>(), L.dw_gate_up.data<float>() + L.dw_gate_up.numel());
  res.d_w_down.assign(L.dw_down.data<float>(), L.dw_down.data<float>() + L.dw_down.numel());
  if (!L.db_expert.empty()) res.d_b_expert.assign(L.db_expert.data<float>(), L.db_expert.data<float>() + L.db_expert.numel());
  return res;
}

}  // namespace

const char* dispatch_schedule_name(const DispatchScheduleConfig& c) {
  if (c.chunk_cap_rows > 0) return "pipelined_llep";
  return c.llep ? "llep" : "uncapped";
}

std::vector<int32_t> draw_dispatch_routing(const DispatchScheduleConfig& c, int64_t ep, int64_t rank) {
  const RoutingShape shape{ep, c.experts, c.top_k};
  return generate_routing(c.routing, shape, c.tokens, seed_of(c, 6), c.replica * ep + rank, rank, c.moe_layer);
}

namespace {

// ρ the capped run's launch-time buffers are sized for: rho_bound, or the LLA bound
// (reference/dispatch.md §2.7), or plain EP's ρ_max.
double launch_rho(const DispatchScheduleConfig& c, int64_t ep) {
  if (c.rho_bound > 0.0) return c.rho_bound;
  if (c.llep) return pipelined_rho_bound(c.lla, ep, c.tokens * c.top_k);
  return rho_max(RoutingShape{ep, c.experts, c.top_k});
}

int64_t most_received_rows(const DispatchScheduleConfig& c, int64_t ep) {  // every copy a rank can receive
  return ep * c.tokens * std::min(c.top_k, c.experts / ep);
}

}  // namespace

int64_t dispatch_round_buffer_rows(const DispatchScheduleConfig& c, int64_t ep) {
  const int64_t N = c.tokens * c.top_k;
  const int64_t C = std::min(c.chunk_cap_rows, N);
  if (ep == 1) return C;
  if (!c.striping) return ep * C;
  return std::min(round_receive_bound_rows(C, ep, launch_rho(c, ep)), most_received_rows(c, ep));
}

int64_t dispatch_foreign_pool(const DispatchScheduleConfig& c, int64_t ep) {
  if (c.chunk_cap_rows <= 0 || !c.llep) return 0;
  return pipelined_foreign_pool(dispatch_round_buffer_rows(c, ep), ep, c.experts, c.lla);
}

int64_t dispatch_store_rows(const DispatchScheduleConfig& c, int64_t ep) {
  if (c.chunk_cap_rows <= 0) return 0;
  return pipelined_store_rows(dispatch_round_buffer_rows(c, ep), ep, c.tokens * c.top_k, most_received_rows(c, ep),
                              launch_rho(c, ep));
}

DispatchInputs make_dispatch_inputs(const DispatchScheduleConfig& c) {
  const Dims d = dims_of(c, 1, 0);
  std::vector<Bf16> x(z(d.T * d.H)), dout(z(d.T * d.H)), wr(z(d.E * d.H)), wgu(z(d.E * 2 * d.F * d.H)), wd(z(d.E * d.H * d.F));
  std::vector<Bf16> b(z(d.E * d.Pb));
  fill_inputs(c, d, x.data(), dout.data(), wr.data(), wgu.data(), wd.data(), b.data());
  auto widen = [](const std::vector<Bf16>& v) {
    std::vector<float> out(v.size());
    for (size_t i = 0; i < v.size(); ++i) out[i] = to_f32(v[i]);
    return out;
  };
  return DispatchInputs{widen(x), widen(dout), widen(wr), widen(wgu), widen(wd), widen(b),
                        c.topk_ids ? *c.topk_ids : draw_dispatch_routing(c, 1, 0)};
}

DispatchScheduleResult run_dispatch_schedule(TrackingAllocator& alloc, const DispatchScheduleConfig& config) {
  SelfComm self;
  return run_on(self, alloc, config);
}

DispatchScheduleResult run_dispatch_schedule(Communicator& comm, TrackingAllocator& alloc, const DispatchScheduleConfig& config) {
  return run_on(comm, alloc, config);
}

}  // namespace flatpeak::exec
