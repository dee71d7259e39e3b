// One MoE layer's dispatch on the EP ranks of a device communicator (EP = comm.size() ≥ 1):
// the CUDA twin of run_dispatch_schedule(comm, ...) (executor/schedules/dispatch_schedule.h):
// standard EP, LLEP and PipelinedLLEP with the CPU's host-side plan (dispatch_plan.h), buffers,
// categories, phase names and allocation order, every buffer a device buffer.
//   run_ranks_on_device(4, 0, [&](int rank, Communicator& c) {
//     auto& comm = static_cast<DeviceThreadsCommunicator&>(c);  CublasContext blas(comm.allocator(), comm.stream());
//     auto r = run_dispatch_ep_cuda(comm, comm.allocator(), blas, config, draw_dispatch_routing(config, 4, rank)); });
#pragma once

#include <cstdint>
#include <vector>

#include "executor/comm/communicator.h"
#include "executor/cuda/cublas_context.h"
#include "executor/cuda/device_allocator.h"
#include "executor/schedules/dispatch_schedule.h"

namespace flatpeak::cuda {

// The same as the CPU schedule: which rows go where (RowPlan, LLA on the all-gathered counts,
// the striped rounds, the cap shrinking), every buffer's shape, dtype, category and the order
// it is allocated and freed in, the phase names, the lent weights and their returned fp32
// gradients; so each rank's tracked `dispatch` bytes per phase equal the CPU's at the same
// alignment. What differs (read the figures for what they are):
//  - the counts are all-gathered through two [E] / [EP·E] int64 device buffers of category
//    `comm`, freed before the layer's buffers and the first phase (the CPU gathers host memory);
//  - the uncapped pass's send order [T·k] int64 holds two int32 maps in its 8·T·k bytes (send
//    position → slot, slot → send position): the combine kernel finds a token's rows from the
//    second where the CPU computes positions on the host (T·k < 2^31 is required);
//  - GEMMs are cuBLAS (fp32 accumulation, bf16 or fp32 outputs as on the CPU, another summation
//    order): outputs agree with the CPU's within bf16 rounding, not bitwise; the router's
//    backward GEMMs are kernels over each token's k kept experts (the CPU multiplies the
//    [T, E] d logits, zero elsewhere, with the same sums);
//  - a token's rows are summed per token in the CPU's order (increasing expert order uncapped,
//    round then send order capped), with no atomics, so results do not depend on scheduling;
//  - a round's arriving expert ids are checked against the plan on the host, as on the CPU,
//    after a copy to host memory and a stream synchronisation (one per round and pass);
//  - every rank's kernels, copies and GEMMs run on `blas.stream()`, which must be the stream the
//    communicator orders its collectives on (DeviceCommunicator::stream(): cuda-threads
//    synchronises it, NCCL queues on it; checked, std::invalid_argument for a host communicator
//    or another stream); config.topk_ids is not used: the caller gives this rank's ids.
struct DispatchEpCudaResult {
  exec::DispatchScheduleResult plan;  // counts, rounds, C, B, pool, R_p, S_p, ρ; and, when
                                      // config.outputs, out, d_x, topk_weights and the dW (fp32)
  double seconds = 0.0;               // CUDA events on this rank's stream, route to last gradient
  double forward_s = 0.0;             // the no-grad forward
  double backward_s = 0.0;            // the recompute and the backward (and the lent gradients)
};

// Collective: every rank of `comm` calls it with the same config and its own [T, k] ids
// (draw_dispatch_routing(config, EP, rank) gives the CPU schedule's). `alloc` is this rank's
// allocator (the one the communicator's stream is used with). Throws std::invalid_argument for
// bad dims or ids (EP ≤ 64, k ≤ 32 here), InputError for bad knobs, exec::OutOfMemory and
// BackendError.
DispatchEpCudaResult run_dispatch_ep_cuda(exec::Communicator& comm, DeviceAllocator& alloc, const CublasContext& blas,
                                          const exec::DispatchScheduleConfig& config, const std::vector<int32_t>& topk_ids);

}  // namespace flatpeak::cuda
