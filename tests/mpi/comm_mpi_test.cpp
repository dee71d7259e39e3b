// Under mpirun -np 4: every collective of the mpi communicator with inputs a pure function of
// (seed, rank, index), each rank checking its own result; then each EP dispatch schedule against
// the single-rank reference (the same exactness rules as executor_dispatch_ranks_test). The error
// count is agreed through check_status, so every rank exits with the same status.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "executor/comm/mpi_comm.h"
#include "executor/schedules/dispatch_schedule.h"

using namespace flatpeak;
using namespace flatpeak::exec;

namespace {

int64_t value(int rank, int64_t index) {
  uint64_t v = 12345u + static_cast<uint64_t>(rank) * 1000003u + static_cast<uint64_t>(index);
  v = (v ^ (v >> 30)) * 0xbf58476d1ce4e5b9ull;
  v = (v ^ (v >> 27)) * 0x94d049bb133111ebull;
  return static_cast<int64_t>((v ^ (v >> 31)) % 201u) - 100;
}

int errors = 0;
void expect(bool ok, const std::string& what, int rank) {
  if (!ok) {
    ++errors;
    std::fprintf(stderr, "rank %d: FAILED: %s\n", rank, what.c_str());
  }
}

void check_collectives(Communicator& comm) {
  const int n = comm.size(), rank = comm.rank();
  std::vector<int64_t> sc(static_cast<size_t>(n)), sd(sc), rc(sc), rd(sc);
  int64_t st = 0, rt = 0;
  for (int p = 0; p < n; ++p) {
    sc[static_cast<size_t>(p)] = rank + p + 1; sd[static_cast<size_t>(p)] = st; st += rank + p + 1;
    rc[static_cast<size_t>(p)] = p + rank + 1; rd[static_cast<size_t>(p)] = rt; rt += p + rank + 1;
  }
  std::vector<float> send(static_cast<size_t>(st)), recv(static_cast<size_t>(rt));
  for (int p = 0; p < n; ++p) {
    for (int64_t i = 0; i < sc[static_cast<size_t>(p)]; ++i) {
      send[static_cast<size_t>(sd[static_cast<size_t>(p)] + i)] = static_cast<float>(value(rank, 1000 * p + i));
    }
  }
  comm.all_to_allv(send.data(), sc.data(), sd.data(), recv.data(), rc.data(), rd.data(), DType::F32);
  for (int p = 0; p < n; ++p) {
    for (int64_t i = 0; i < rc[static_cast<size_t>(p)]; ++i) {
      expect(recv[static_cast<size_t>(rd[static_cast<size_t>(p)] + i)] == static_cast<float>(value(p, 1000 * rank + i)),
             "all_to_allv", rank);
    }
  }
  std::vector<int64_t> mine(7), got(7);
  for (int64_t i = 0; i < 7; ++i) mine[static_cast<size_t>(i)] = value(rank, i);
  comm.sendrecv_shift(mine.data(), got.data(), 7, DType::I64, -1);
  for (int64_t i = 0; i < 7; ++i) expect(got[static_cast<size_t>(i)] == value((rank + 1) % n, i), "sendrecv_shift", rank);
  std::vector<int64_t> all(static_cast<size_t>(7 * n));
  comm.all_gather(mine.data(), all.data(), 7, DType::I64);
  for (int p = 0; p < n; ++p) {
    for (int64_t i = 0; i < 7; ++i) expect(all[static_cast<size_t>(7 * p + i)] == value(p, i), "all_gather", rank);
  }
  std::vector<float> blocks(static_cast<size_t>(3 * n)), reduced(3);
  for (int64_t j = 0; j < 3 * n; ++j) blocks[static_cast<size_t>(j)] = static_cast<float>(value(rank, j));
  comm.reduce_scatter(blocks.data(), reduced.data(), 3, DType::F32);
  for (int64_t i = 0; i < 3; ++i) {
    int64_t want = 0;
    for (int p = 0; p < n; ++p) want += value(p, 3 * rank + i);
    expect(reduced[static_cast<size_t>(i)] == static_cast<float>(want), "reduce_scatter", rank);
  }
  // Rank-order fp32 sum: 1e8 + 1 − 1e8 + 1 = 1 exactly as the threads communicator gives.
  const float c4[4] = {1e8f, 1.0f, -1e8f, 1.0f};
  float x = n == 4 ? c4[rank] : 1.0f;
  comm.all_reduce(&x, &x, 1, DType::F32, ReduceOp::Sum);
  expect(x == (n == 4 ? 1.0f : static_cast<float>(n)), "all_reduce(sum) rank order", rank);
  float m = static_cast<float>(value(rank, 50)), mx = 0.0f;
  comm.all_reduce(&m, &mx, 1, DType::F32, ReduceOp::Max);
  int64_t want = value(0, 50);
  for (int p = 1; p < n; ++p) want = std::max(want, value(p, 50));
  expect(mx == static_cast<float>(want), "all_reduce(max)", rank);
  comm.barrier();
}

float max_diff(const std::vector<float>& got, const std::vector<float>& ref, size_t offset) {
  float w = 0.0f;
  for (size_t i = 0; i < got.size(); ++i) w = std::max(w, std::fabs(got[i] - ref[offset + i]));
  return w;
}

// The dispatch schedule on the job's ranks against the single-rank run over all ranks' tokens
// (every rank computes it): uncapped EP and LLEP bitwise for out and d_x (k = 4), uncapped EP's
// expert dW bitwise, LLEP's and PipelinedLLEP's within 1e-5 of the largest value (fp32 parts from
// helpers and rounds), PipelinedLLEP's out within one bf16 step and d_x within 1e-6.
void check_dispatch(Communicator& comm) {
  const int64_t ep = comm.size(), r = comm.rank();
  DispatchScheduleConfig c;
  c.tokens = 64;
  c.hidden = 32;
  c.ffn = 16;
  c.experts = 16;
  c.top_k = 4;
  c.seed = 11;
  c.routing = parse_routing_model("rho=2.5");
  c.lla.llep_alpha = 1.0;
  c.lla.min_rows_per_gemm = 4;
  c.lla.imbalance_trigger = 0.0;
  std::vector<int32_t> ids;
  for (int64_t p = 0; p < ep; ++p) {
    const std::vector<int32_t> mine = draw_dispatch_routing(c, ep, p);
    ids.insert(ids.end(), mine.begin(), mine.end());
  }
  DispatchScheduleConfig whole = c;
  whole.tokens *= ep;
  whole.topk_ids = &ids;
  TrackingAllocator ref_alloc;
  const DispatchScheduleResult ref = run_dispatch_schedule(ref_alloc, whole);
  float out_scale = 0.0f, dx_scale = 0.0f, dw_scale = 0.0f;
  for (float v : ref.out) out_scale = std::max(out_scale, std::fabs(v));
  for (float v : ref.d_x) dx_scale = std::max(dx_scale, std::fabs(v));
  for (float v : ref.d_w_gate_up) dw_scale = std::max(dw_scale, std::fabs(v));
  const int64_t L = c.experts / ep;
  for (int kind = 0; kind < 3; ++kind) {
    DispatchScheduleConfig k = c;
    k.llep = kind > 0;
    k.chunk_cap_rows = kind == 2 ? 48 : 0;
    TrackingAllocator alloc;
    const DispatchScheduleResult got = run_dispatch_schedule(comm, alloc, k);
    const std::string name = dispatch_schedule_name(k);
    const size_t tok = static_cast<size_t>(r * c.tokens * c.hidden);
    const float d_out = max_diff(got.out, ref.out, tok), d_dx = max_diff(got.d_x, ref.d_x, tok);
    const float dw = max_diff(got.d_w_gate_up, ref.d_w_gate_up, static_cast<size_t>(r * L * 2 * c.ffn * c.hidden));
    if (kind < 2) {
      expect(d_out == 0.0f, name + " out bitwise", static_cast<int>(r));
      expect(d_dx == 0.0f, name + " d_x bitwise", static_cast<int>(r));
    } else {
      expect(d_out <= 0x1.0p-8f * out_scale, name + " out", static_cast<int>(r));
      expect(d_dx <= 1e-6f * dx_scale, name + " d_x", static_cast<int>(r));
    }
    expect(kind == 0 ? dw == 0.0f : dw <= 1e-5f * dw_scale, name + " dW", static_cast<int>(r));
    expect(alloc.live_allocations() == 0, name + " frees every buffer", static_cast<int>(r));
  }
}

// split(rank / 2, rank % 2): EP groups of two consecutive ranks, each an MPI communicator of its
// own (MPI_Comm_split): its ranks, an all_gather and a rank-order all_reduce over the group only,
// a key-ordered split, and the parent unchanged after.
void check_split(Communicator& comm) {
  const int r = comm.rank();
  const std::unique_ptr<Communicator> group = comm.split(r / 2, r % 2);
  expect(group->size() == 2 && group->rank() == r % 2, "split: group rank and size", r);
  const int64_t me = r;
  std::vector<int64_t> all(2, -1);
  group->all_gather(&me, all.data(), 1, DType::I64);
  expect(all[0] == r / 2 * 2 && all[1] == r / 2 * 2 + 1, "split: all_gather sees the group only", r);
  float x = 0.1f * static_cast<float>(r + 1), sum = 0.0f;
  group->all_reduce(&x, &sum, 1, DType::F32, ReduceOp::Sum);
  const float a = 0.1f * static_cast<float>(r / 2 * 2 + 1), b = 0.1f * static_cast<float>(r / 2 * 2 + 2);
  expect(sum == a + b, "split: all_reduce over the group in rank order", r);
  const std::unique_ptr<Communicator> reversed = comm.split(0, -r);
  expect(reversed->rank() == comm.size() - 1 - r, "split: ranked by key", r);
  int64_t total = 1;
  comm.all_reduce(&total, &total, 1, DType::I64, ReduceOp::Sum);
  expect(total == comm.size(), "split: the parent unchanged", r);
}

// PipelinedLLEP's buffers do not depend on the routing: under two hot experts of rank 0 with a
// one-expert foreign-weight pool (m = 16; the store overflows and its last rounds are recomputed
// in backward) each rank's dispatch peak equals its peak under a balanced routing, and the results
// keep PipelinedLLEP's bounds against the single-rank run (executor_dispatch_ranks_test, threads).
int64_t dispatch_peak(const TrackingAllocator& alloc) {
  int64_t peak = 0;
  for (const auto& rec : alloc.phase_records())
    if (rec.space == MemorySpace::Device) peak = std::max(peak, rec.bytes_at_peak[static_cast<size_t>(Category::Dispatch)]);
  return peak;
}

void check_pipelined_bound(Communicator& comm) {
  const int64_t ep = comm.size(), r = comm.rank();
  for (bool store : {false, true}) {
    DispatchScheduleConfig c;
    c.tokens = 64;
    c.hidden = 32;
    c.ffn = 16;
    c.experts = 16;
    c.top_k = 4;
    c.seed = 11;
    c.llep = true;
    c.chunk_cap_rows = 48;
    c.store = store;
    c.lla.llep_alpha = 1.0;
    c.lla.min_rows_per_gemm = 16;
    c.lla.imbalance_trigger = 0.0;
    const std::string name = std::string("pipelined_llep ") + (store ? "store" : "recompute");
    c.routing = parse_routing_model("balanced");
    TrackingAllocator balanced_alloc;
    run_dispatch_schedule(comm, balanced_alloc, c);
    c.routing = parse_routing_model("hot-expert=0.9,2");
    std::vector<int32_t> ids;
    for (int64_t p = 0; p < ep; ++p) {
      const std::vector<int32_t> mine = draw_dispatch_routing(c, ep, p);
      ids.insert(ids.end(), mine.begin(), mine.end());
    }
    DispatchScheduleConfig whole = c;
    whole.tokens *= ep;
    whole.topk_ids = &ids;
    whole.llep = false;
    whole.chunk_cap_rows = 0;
    TrackingAllocator ref_alloc;
    const DispatchScheduleResult ref = run_dispatch_schedule(ref_alloc, whole);
    TrackingAllocator alloc;
    const DispatchScheduleResult got = run_dispatch_schedule(comm, alloc, c);
    float out_scale = 0.0f, dx_scale = 0.0f, dw_scale = 0.0f;
    for (float v : ref.out) out_scale = std::max(out_scale, std::fabs(v));
    for (float v : ref.d_x) dx_scale = std::max(dx_scale, std::fabs(v));
    for (float v : ref.d_w_gate_up) dw_scale = std::max(dw_scale, std::fabs(v));
    const size_t tok = static_cast<size_t>(r * c.tokens * c.hidden);
    const int64_t L = c.experts / ep;
    expect(dispatch_peak(alloc) == dispatch_peak(balanced_alloc), name + " peak independent of the routing", static_cast<int>(r));
    expect(got.foreign_experts <= got.foreign_pool && got.foreign_pool == 1, name + " foreign pool", static_cast<int>(r));
    expect(!store || got.stored_rounds < got.rounds, name + " recomputes the rounds the store does not hold", static_cast<int>(r));
    expect(max_diff(got.out, ref.out, tok) <= 0x1.0p-8f * out_scale, name + " out", static_cast<int>(r));
    expect(max_diff(got.d_x, ref.d_x, tok) <= 1e-6f * dx_scale, name + " d_x", static_cast<int>(r));
    expect(max_diff(got.d_w_gate_up, ref.d_w_gate_up, static_cast<size_t>(r * L * 2 * c.ffn * c.hidden)) <= 1e-5f * dw_scale,
           name + " dW", static_cast<int>(r));
  }
}

}  // namespace

int main() {
  MpiCommunicator comm(MpiOptions{20.0});
  const RankStatus status = run_mpi_rank(comm, [&](int rank, Communicator& c) {
    check_collectives(c);
    check_dispatch(c);
    check_pipelined_bound(c);
    check_split(c);
    int64_t total = errors;
    c.all_reduce(&total, &total, 1, DType::I64, ReduceOp::Sum);
    if (rank == 0) std::printf("comm_mpi_test: %d ranks, %lld failed checks\n", c.size(), static_cast<long long>(total));
    c.check_status(errors > 0 ? 1 : 0, std::to_string(errors) + " failed checks");
  });
  return status.exit_code;
}
