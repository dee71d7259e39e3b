// Ring-DTP on ranks sharing one GPU (DeviceThreadsCommunicator) against the CPU schedule on
// thread ranks with the same config: per rank, every phase's name and tracked vocab bytes equal
// (the CUDA twin allocates the CPU's buffers in the CPU's order), the per-token loss and the mean
// within fp32 tolerance, dX and the W shard's dW within fp32 relative error plus a bf16 floor (their
// addends are bf16-rounded dz: an fp32-level difference in a logit may round one dz the other way);
// gradients in forward bitwise the recompute backward on the GPU (the same kernels in the same
// order); the peak estimate equal to the tracked high-water. Rings of 4 (sendrecv_shift), two
// rings of 2 in 4 ranks (all-to-allv hops) and a ring of one rank (device copies); weights and
// activations rotating; T, V and the shards not multiples of their blocks, the last shard short.
// A host communicator and a device one on another stream than the cuBLAS context's are refused
// with their exact messages. Exit 77 (skipped) without a CUDA device.
#include <algorithm>
#include <cstdio>
#include <exception>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda_test_util.h"
#include "executor/comm/threads_comm.h"
#include "executor/cuda/cublas_context.h"
#include "executor/cuda/device_threads_comm.h"
#include "executor/cuda/ring_dtp_schedule_cuda.h"
#include "executor/memory/tracking_allocator.h"
#include "executor/schedules/ring_dtp_schedule.h"

using namespace flatpeak;
using namespace flatpeak::exec;
using namespace flatpeak::cuda;
using namespace flatpeak::cuda::test;

namespace {

constexpr int64_t kAlign = 256;

// Each phase's name and its vocab bytes at the phase's peak, device space.
std::vector<std::pair<std::string, int64_t>> vocab_by_phase(const std::vector<PhaseRecord>& records) {
  std::vector<std::pair<std::string, int64_t>> out;
  for (const PhaseRecord& r : records)
    if (r.space == MemorySpace::Device && !r.phase.empty())
      out.emplace_back(r.phase, r.category_peak_bytes[static_cast<size_t>(Category::Vocab)]);
  return out;
}

// "n phases" when equal, else the first phase where they differ.
std::string first_difference(const std::vector<std::pair<std::string, int64_t>>& got,
                             const std::vector<std::pair<std::string, int64_t>>& want) {
  for (size_t i = 0; i < std::min(got.size(), want.size()); ++i)
    if (got[i] != want[i])
      return got[i].first + " " + std::to_string(got[i].second) + " B, cpu " + want[i].first + " " +
             std::to_string(want[i].second) + " B";
  if (got.size() != want.size())
    return std::to_string(got.size()) + " phases, cpu " + std::to_string(want.size());
  return std::to_string(got.size()) + " phases";
}

struct RankOutcome {
  std::vector<std::pair<std::string, int64_t>> phases;
  std::vector<float> loss, d_x, d_w;
  double mean_loss = 0.0;
  int64_t high_water_less_workspace = 0;
};

std::vector<RankOutcome> run_cpu(int ranks, const RingDtpConfig& c) {
  std::vector<RankOutcome> out(static_cast<size_t>(ranks));
  const RunResult run = run_ranks(ranks, [&](int rank, Communicator& comm) {
    TrackingAllocator alloc({kAlign});
    const RingDtpResult r = run_ring_dtp_schedule(comm, alloc, c);
    RankOutcome& o = out[static_cast<size_t>(rank)];
    o.phases = vocab_by_phase(alloc.phase_records());
    o.loss = r.loss;
    o.d_x = r.d_x;
    o.d_w = r.d_w;
    o.mean_loss = r.mean_loss;
  });
  if (!run.ok()) throw std::runtime_error("cpu ring: " + run.message);
  return out;
}

std::vector<RankOutcome> run_gpu(int ranks, const RingDtpConfig& c) {
  std::vector<RankOutcome> out(static_cast<size_t>(ranks));
  const RunResult run = run_ranks_on_device(ranks, 0, [&](int rank, Communicator& base) {
    auto& comm = static_cast<DeviceThreadsCommunicator&>(base);
    DeviceAllocator& alloc = comm.allocator();
    const CublasContext blas(alloc, comm.stream());
    const int64_t workspace = alloc.live_bytes();
    alloc.reset_records();
    const RingDtpCudaResult r = run_ring_dtp_schedule_cuda(comm, alloc, blas, c, /*copy_results=*/true);
    RankOutcome& o = out[static_cast<size_t>(rank)];
    o.phases = vocab_by_phase(alloc.phase_records());
    o.loss = r.loss;
    o.d_x = r.d_x;
    o.d_w = r.d_w;
    o.mean_loss = r.mean_loss;
    o.high_water_less_workspace = alloc.high_water_bytes() - workspace;
  }, ThreadsOptions{});
  if (!run.ok()) throw std::runtime_error("gpu ring: " + run.message);
  return out;
}

void check_ring(const std::string& name, int ranks, int64_t ring_size, RingRotation rotation) {
  RingDtpConfig c;
  c.tokens = 96;  // not a multiple of the token block
  c.hidden = 32;
  c.vocab = 1001;  // shards of ceil(V/R) rows, the last one short
  c.ring_size = ring_size;
  c.token_block_rows = 64;
  c.vocab_block_rows = 100;  // not a divisor of the shard
  c.rotation = rotation;
  c.seed = 5;
  std::vector<RankOutcome> gpu_by_backward[2];
  for (int gif = 0; gif < 2; ++gif) {
    c.gradients_in_forward = gif == 1;
    const std::string n = name + (gif ? "/in-forward" : "/recompute");
    const std::vector<RankOutcome> cpu = run_cpu(ranks, c);
    const std::vector<RankOutcome> gpu = run_gpu(ranks, c);
    for (int rank = 0; rank < ranks; ++rank) {
      const RankOutcome& want = cpu[static_cast<size_t>(rank)];
      const RankOutcome& got = gpu[static_cast<size_t>(rank)];
      const std::string r = n + "/rank" + std::to_string(rank);
      expect_true(r + "/vocab_bytes_by_phase", got.phases == want.phases, first_difference(got.phases, want.phases));
      expect_close(r + "/loss", got.loss, want.loss, Tol::f32());
      expect_close(r + "/mean_loss", {static_cast<float>(got.mean_loss)}, {static_cast<float>(want.mean_loss)}, Tol{1e-5, 0.0});
      const Tol grads{Tol::f32().rel, Tol::bf16().floor};
      expect_close(r + "/d_x", got.d_x, want.d_x, grads);
      expect_close(r + "/d_w", got.d_w, want.d_w, grads);
      expect_equal(r + "/peak_bytes_estimate", std::vector<int64_t>{got.high_water_less_workspace},
                   std::vector<int64_t>{ring_dtp_schedule_cuda_peak_bytes(c, kAlign)});
    }
    gpu_by_backward[gif] = gpu;
  }
  for (int rank = 0; rank < ranks; ++rank) {
    const std::string r = name + "/rank" + std::to_string(rank);
    expect_equal(r + "/in_forward_bitwise_recompute/d_x", gpu_by_backward[1][static_cast<size_t>(rank)].d_x,
                 gpu_by_backward[0][static_cast<size_t>(rank)].d_x);
    expect_equal(r + "/in_forward_bitwise_recompute/d_w", gpu_by_backward[1][static_cast<size_t>(rank)].d_w,
                 gpu_by_backward[0][static_cast<size_t>(rank)].d_w);
  }
}

// A host communicator (threads) and a device communicator whose stream is not the cuBLAS
// context's are refused before anything is queued: nothing would order the schedule's copies and
// kernels with the collectives.
void check_refusals() {
  RingDtpConfig c;
  c.tokens = 16;
  c.hidden = 8;
  c.vocab = 64;
  c.ring_size = 1;
  c.token_block_rows = 16;
  c.vocab_block_rows = 32;
  std::string host_error, stream_error, want_stream_error;
  const RunResult host_run = run_ranks(1, [&](int, Communicator& comm) {
    DeviceAllocator alloc;
    const CublasContext blas(alloc, nullptr);
    try {
      (void)run_ring_dtp_schedule_cuda(comm, alloc, blas, c);
    } catch (const std::invalid_argument& e) {
      host_error = e.what();
    }
  });
  expect_true("refused/host_communicator", host_run.ok() && host_error ==
              "ring-dtp schedule: the communicator must move device buffers (cuda-threads or nccl), got threads",
              host_run.ok() ? host_error : host_run.message);
  const RunResult device_run = run_ranks_on_device(1, 0, [&](int, Communicator& base) {
    auto& comm = static_cast<DeviceThreadsCommunicator&>(base);
    const CublasContext blas(comm.allocator(), nullptr);  // the legacy stream, not comm.stream()
    std::ostringstream want;
    want << "ring-dtp schedule: the cuBLAS context must run on the communicator's stream (the cuda-threads "
            "communicator's collectives are ordered on stream " << static_cast<const void*>(comm.stream())
         << ", the cuBLAS context's stream is " << static_cast<const void*>(nullptr) << ")";
    want_stream_error = want.str();
    try {
      (void)run_ring_dtp_schedule_cuda(comm, comm.allocator(), blas, c);
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
    check_ring("ring4/weights", 4, 4, RingRotation::Weights);
    check_ring("ring4/activations", 4, 4, RingRotation::Activations);
    check_ring("two_rings_of_2/weights", 4, 2, RingRotation::Weights);
    check_ring("two_rings_of_2/activations", 4, 2, RingRotation::Activations);
    check_ring("ring1/weights", 1, 1, RingRotation::Weights);
    check_refusals();
  } catch (const std::exception& e) {
    std::printf("FAIL: %s\n", e.what());
    return 1;
  }
  return finish();
}
