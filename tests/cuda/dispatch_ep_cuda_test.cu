// The CUDA dispatch at EP = 4 with the ranks sharing one GPU (run_dispatch_ep_cuda on
// DeviceThreadsCommunicator) against the CPU schedule on 4 thread ranks with the same config and
// ids, T = 64 per rank, H = 32, E = 16, k = 4, F = 32, routing rho=2.5: standard EP, LLEP,
// PipelinedLLEP (recompute and store): (a) each rank's phases in order and their tracked
// `dispatch`, `activations` and `fsdp` peaks, equal to the CPU's (the same buffers at the same
// 256-byte alignment); (b) out, d_x and the expert and router dW within bf16 tolerance (cuBLAS
// sums in another order; the bound is stated at the check); (c) the capped per-rank peak below
// the uncapped one (CPU at 256 B: 303616 vs 432128 B on the busiest rank); (d) LLEP and
// PipelinedLLEP with expert biases (gpt-oss's: lent with the weights, their gradients returned),
// (a) and (b) again with the bias gradients. A host communicator and a
// device one on another stream than the cuBLAS context's are refused with their exact messages.
// Exit 77 (skipped) without a CUDA device.
#include <algorithm>
#include <cstdio>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda_test_util.h"
#include "executor/comm/threads_comm.h"
#include "executor/cuda/cublas_context.h"
#include "executor/cuda/device_threads_comm.h"
#include "executor/cuda/dispatch_ep_cuda.h"
#include "executor/schedules/dispatch_schedule.h"

using namespace flatpeak;
using namespace flatpeak::exec;
using namespace flatpeak::cuda;
using namespace flatpeak::cuda::test;

namespace {

constexpr int kRanks = 4;
constexpr int64_t kAlign = 256;  // DeviceAllocator's default, the device communicator's
size_t z(int64_t i) { return static_cast<size_t>(i); }

enum class Kind { Uncapped, Llep, Pipelined, PipelinedStore };
const char* kind_name(Kind k) {
  switch (k) {
    case Kind::Uncapped: return "uncapped";
    case Kind::Llep: return "llep";
    case Kind::Pipelined: return "pipelined_llep";
    case Kind::PipelinedStore: return "pipelined_llep/store";
  }
  return "?";
}

DispatchScheduleConfig config_for(Kind kind) {
  DispatchScheduleConfig c;
  c.tokens = 64;
  c.hidden = 32;
  c.ffn = 32;
  c.experts = 16;
  c.top_k = 4;
  c.seed = 11;
  c.routing = parse_routing_model("rho=2.5");
  c.llep = kind != Kind::Uncapped;
  c.lla.llep_alpha = 1.0;
  c.lla.min_rows_per_gemm = 4;
  c.lla.imbalance_trigger = 0.0;  // LLA always runs
  c.chunk_cap_rows = kind == Kind::Pipelined || kind == Kind::PipelinedStore ? 48 : 0;
  c.store = kind == Kind::PipelinedStore;
  return c;
}

struct RankRun {
  DispatchScheduleResult res;
  std::vector<PhaseRecord> records;
  int64_t high = 0;
  int64_t live_after = 0;
};

std::vector<RankRun> run_cpu(const DispatchScheduleConfig& c) {
  std::vector<RankRun> out(z(kRanks));
  const RunResult run = run_ranks(kRanks, [&](int rank, Communicator& comm) {
    TrackingAllocator alloc({kAlign, -1, -1});
    out[z(rank)].res = run_dispatch_schedule(comm, alloc, c);
    out[z(rank)].records = alloc.phase_records();
    out[z(rank)].high = alloc.high_water_bytes(MemorySpace::Device);
    out[z(rank)].live_after = alloc.live_allocations();
  });
  expect_true("cpu run", run.ok(), run.ok() ? "4 thread ranks" : run.message);
  return out;
}

std::vector<RankRun> run_gpu(const DispatchScheduleConfig& c) {
  std::vector<RankRun> out(z(kRanks));
  const RunResult run = run_ranks_on_device(kRanks, 0, [&](int rank, Communicator& base) {
    auto& comm = static_cast<DeviceThreadsCommunicator&>(base);
    DeviceAllocator& alloc = comm.allocator();
    const int64_t before = alloc.live_allocations();
    {
      const CublasContext blas(alloc, comm.stream(), int64_t{4} << 20);
      const std::vector<int32_t> ids = draw_dispatch_routing(c, kRanks, rank);
      out[z(rank)].res = run_dispatch_ep_cuda(comm, alloc, blas, c, ids).plan;
      FLATPEAK_CUDA_CHECK(cudaStreamSynchronize(comm.stream()));
      out[z(rank)].records = alloc.phase_records();
      out[z(rank)].high = alloc.high_water_bytes();
    }
    out[z(rank)].live_after = alloc.live_allocations() - before;
  });
  expect_true("gpu run", run.ok(), run.ok() ? "4 ranks on device 0" : run.message);
  return out;
}

// (a) The same phases in the same order, and per phase the same peak of each category the
// schedule owns or reads (dispatch; the layer's activations and fsdp).
void compare_phases(const std::string& tag, const std::vector<PhaseRecord>& gpu, const std::vector<PhaseRecord>& cpu) {
  std::vector<const PhaseRecord*> want;
  for (const PhaseRecord& r : cpu)
    if (r.space == MemorySpace::Device) want.push_back(&r);
  bool same = gpu.size() == want.size();
  std::string detail = std::to_string(gpu.size()) + " phases (cpu " + std::to_string(want.size()) + ")";
  for (size_t i = 0; same && i < gpu.size(); ++i) {
    const PhaseRecord& g = gpu[i];
    const PhaseRecord& w = *want[i];
    for (Category cat : {Category::Dispatch, Category::Activations, Category::Fsdp}) {
      const int64_t gb = g.category_peak_bytes[static_cast<size_t>(cat)], wb = w.category_peak_bytes[static_cast<size_t>(cat)];
      if (g.phase != w.phase || gb != wb) {
        same = false;
        detail += "; first difference at " + g.phase + " (cpu " + w.phase + ") " + category_name(cat) + " " + std::to_string(gb) +
                  " B vs cpu " + std::to_string(wb) + " B";
        break;
      }
    }
  }
  int64_t peak = 0;
  for (const PhaseRecord& g : gpu) peak = std::max(peak, g.category_peak_bytes[static_cast<size_t>(Category::Dispatch)]);
  if (same) detail += ", dispatch peak " + std::to_string(peak) + " B on both";
  expect_true(tag + "/phases", same, detail);
}

// Checks one kind; returns the largest per-rank tracked high-water on the GPU.
int64_t check_kind(Kind kind, bool expert_bias = false) {
  DispatchScheduleConfig c = config_for(kind);
  c.expert_bias = expert_bias;
  const std::vector<RankRun> cpu = run_cpu(c);
  const std::vector<RankRun> gpu = run_gpu(c);
  int64_t high = 0;
  for (int r = 0; r < kRanks; ++r) {
    const std::string tag = std::string(kind_name(kind)) + (expert_bias ? "/biases" : "") + "/rank" + std::to_string(r);
    const DispatchScheduleResult& g = gpu[z(r)].res;
    const DispatchScheduleResult& w = cpu[z(r)].res;
    high = std::max(high, gpu[z(r)].high);
    expect_true(tag + "/plan",
                g.received_rows == w.received_rows && g.rounds == w.rounds && g.chunk_cap_rows == w.chunk_cap_rows &&
                    g.round_buffer_rows == w.round_buffer_rows && g.foreign_experts == w.foreign_experts &&
                    g.lent_weights == w.lent_weights && g.lla_triggered == w.lla_triggered,
                "R " + std::to_string(g.received_rows) + ", rounds " + std::to_string(g.rounds) + ", B " +
                    std::to_string(g.round_buffer_rows) + ", S_p " + std::to_string(g.foreign_experts) + ", lent " +
                    std::to_string(g.lent_weights));
    expect_true(tag + "/freed", gpu[z(r)].live_after == 0 && cpu[z(r)].live_after == 0,
                "live blocks after the run: gpu " + std::to_string(gpu[z(r)].live_after) + ", cpu " +
                    std::to_string(cpu[z(r)].live_after));
    compare_phases(tag, gpu[z(r)].records, cpu[z(r)].records);
    // (b) Every bf16 intermediate (fc1, act*prob, fc2, d act, d fc1, d in) is cuBLAS's fp32 sum
    // rounded once, as on the CPU, but summed in another order: an element can round one bf16
    // step (2^-8 relative) the other way and carry that on, so a token's sum of k rows can be a
    // step of its largest row off where the rows cancel: rel 2e-2 plus 1e-2 of the largest value.
    // A row sent to the wrong rank, expert or token is off by O(the largest value).
    const Tol rows{2e-2, 1e-2};
    expect_close(tag + "/out", g.out, w.out, rows);
    expect_close(tag + "/d_x", g.d_x, w.d_x, rows);
    expect_close(tag + "/topk_weights", g.topk_weights, w.topk_weights, Tol{1e-5, 1e-6});  // fp32 logits, K = H
    expect_close(tag + "/d_w_gate_up", g.d_w_gate_up, w.d_w_gate_up, rows);
    expect_close(tag + "/d_w_down", g.d_w_down, w.d_w_down, rows);
    expect_close(tag + "/d_w_router", g.d_w_router, w.d_w_router, rows);
    if (expert_bias) {
      expect_true(tag + "/d_b_expert size", !w.d_b_expert.empty() && g.d_b_expert.size() == w.d_b_expert.size(),
                  std::to_string(g.d_b_expert.size()) + " vs cpu " + std::to_string(w.d_b_expert.size()));
      expect_close(tag + "/d_b_expert", g.d_b_expert, w.d_b_expert, rows);
    }
  }
  return high;
}

// A host communicator (threads) and a device communicator whose stream is not the cuBLAS
// context's are refused before anything is queued (one rank, EP = 1).
void check_refusals() {
  const DispatchScheduleConfig c = config_for(Kind::Uncapped);
  const std::vector<int32_t> ids = draw_dispatch_routing(c, 1, 0);
  std::string host_error, stream_error, want_stream_error;
  const RunResult host_run = run_ranks(1, [&](int, Communicator& comm) {
    DeviceAllocator alloc;
    const CublasContext blas(alloc, nullptr, int64_t{4} << 20);
    try {
      (void)run_dispatch_ep_cuda(comm, alloc, blas, c, ids);
    } catch (const std::invalid_argument& e) {
      host_error = e.what();
    }
  });
  expect_true("refused/host_communicator", host_run.ok() && host_error ==
              "dispatch schedule (cuda): the communicator must move device buffers (cuda-threads or nccl), got threads",
              host_run.ok() ? host_error : host_run.message);
  const RunResult device_run = run_ranks_on_device(1, 0, [&](int, Communicator& base) {
    auto& comm = static_cast<DeviceThreadsCommunicator&>(base);
    const CublasContext blas(comm.allocator(), nullptr, int64_t{4} << 20);  // the legacy stream
    std::ostringstream want;
    want << "dispatch schedule (cuda): the cuBLAS context must run on the communicator's stream (the cuda-threads "
            "communicator's collectives are ordered on stream " << static_cast<const void*>(comm.stream())
         << ", the cuBLAS context's stream is " << static_cast<const void*>(nullptr) << ")";
    want_stream_error = want.str();
    try {
      (void)run_dispatch_ep_cuda(comm, comm.allocator(), blas, c, ids);
    } catch (const std::invalid_argument& e) {
      stream_error = e.what();
    }
  });
  expect_true("refused/other_stream", device_run.ok() && stream_error == want_stream_error,
              device_run.ok() ? stream_error : device_run.message);
}

}  // namespace

int main() {
  if (const int rc = skip_unless_device(); rc != 0) return rc;
  try {
    const int64_t uncapped = check_kind(Kind::Uncapped);
    (void)check_kind(Kind::Llep);
    const int64_t capped = check_kind(Kind::Pipelined);
    (void)check_kind(Kind::PipelinedStore);
    (void)check_kind(Kind::Llep, true);
    (void)check_kind(Kind::Pipelined, true);
    check_refusals();
    // (c) The tracked high-water includes the same 4 MiB cuBLAS workspace on both.
    expect_true("capped peak < uncapped peak", capped < uncapped,
                "max per-rank tracked high-water: pipelined_llep " + std::to_string(capped) + " B, uncapped " +
                    std::to_string(uncapped) + " B");
  } catch (const std::exception& e) {
    std::printf("FAIL exception: %s\n", e.what());
    return 1;
  }
  return finish();
}
