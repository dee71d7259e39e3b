// Ring-DTP across R ranks on the GPU: the CUDA twin of run_ring_dtp_schedule
// (executor/schedules/ring_dtp_schedule.h), with its config, data, buffers, categories, phases and
// order of allocations, so each rank's tracked vocab bytes are the CPU rank's phase by phase.
//   run_ranks_on_device(4, 0, [&](int, exec::Communicator& c) {          // 4 ranks sharing GPU 0
//     auto& comm = static_cast<DeviceThreadsCommunicator&>(c);  CublasContext blas(comm.allocator(), comm.stream());
//     RingDtpCudaResult r = run_ring_dtp_schedule_cuda(comm, comm.allocator(), blas, config); });
#pragma once

#include <cstdint>
#include <vector>

#include "executor/comm/communicator.h"
#include "executor/cuda/cublas_context.h"
#include "executor/cuda/device_allocator.h"
#include "executor/schedules/ring_dtp_schedule.h"

namespace flatpeak::cuda {

struct RingDtpCudaResult {
  double mean_loss = 0.0;       // over the ring's R·T tokens, summed in global token order (fp64)
  double seconds = 0.0;         // CUDA events: first phase to the last gradient written (ring waits included)
  double forward_s = 0.0;       // the forward ring (with gradients in forward: both rings)
  double backward_s = 0.0;      // the gradients ring (0 with gradients in forward)
  std::vector<float> loss;      // [T] fp32, this rank's tokens
  std::vector<float> d_x;       // [T, H] fp32 (copy_results only; grad scale 1 / (R·T))
  std::vector<float> d_w;       // [shard_rows, H] fp32, this rank's W shard (copy_results only)
  int64_t shard_first_row = 0;  // first vocabulary row of this rank's shard
  int64_t shard_rows = 0;       // rows of the shard that exist (the last one may be short)
};

// Device bytes one rank holds at its peak (tracked sizes at `alignment_bytes`), from the same
// buffer list as the run: what to check against free memory before starting. Excludes the cuBLAS
// workspace (already allocated by the context).
int64_t ring_dtp_schedule_cuda_peak_bytes(const exec::RingDtpConfig& config, int64_t alignment_bytes);

// Runs the forward and the gradients rings on this rank; every rank of `comm` calls it with the
// same config. `comm` moves device buffers in the order of `blas.stream()` (a DeviceCommunicator
// on that stream: a DeviceThreadsCommunicator or NCCL's; checked); a ring of one rank needs no peer.
// Inputs are filled on the device with the CPU schedule's values and are not timed.
// config.result_sink is not used: copy_results copies dX and dW into the result instead.
// Throws std::invalid_argument for a bad config (as the CPU schedule), a host communicator
// (threads, mpi: they cannot move device buffers) or one on another stream, exec::OutOfMemory past the
// allocator's capacity and BackendError for CUDA/cuBLAS failures.
RingDtpCudaResult run_ring_dtp_schedule_cuda(exec::Communicator& comm, DeviceAllocator& alloc, const CublasContext& blas,
                                             const exec::RingDtpConfig& config, bool copy_results = false);

}  // namespace flatpeak::cuda
