// The checkpoint component on the GPU: the CUDA twin of run_checkpoint_schedule
// (executor/schedules/checkpoint_schedule.h), with its config, its order of allocations, releases
// and phases, and the same (seed, index) inputs, every buffer from a DeviceAllocator and every op
// on the cuBLAS context's stream. An offloaded boundary goes to one pinned host arena sized at
// launch (PinnedArena) and comes back for its layer's backward:
//  - SCO (copy_streams): the D2H copy runs on its own stream from the start of the layer's forward,
//    and the compute stream waits for it (an event) only where the layer's forward ends and the
//    device copy is released; the H2D fetch of the layer and of the `prefetch` layers below it
//    runs on another stream, each waited for (an event) just before its layer's recompute reads it;
//  - synchronous offload (!copy_streams): the same copies on the compute stream, in line.
// No device-wide synchronisation inside the step.
//   DeviceAllocator alloc;  CublasContext blas(alloc, stream);
//   CheckpointScheduleConfig c; c.tokens = 4096; c.hidden = 1024; c.layers = 8; c.offloaded = {...}; c.prefetch = 1;
//   CheckpointScheduleCudaResult r = run_checkpoint_schedule_cuda(alloc, blas, c);   // r.values.loss, alloc.phase_records()
#pragma once

#include <cstdint>
#include <string>

#include "executor/cuda/cublas_context.h"
#include "executor/cuda/device_allocator.h"
#include "executor/schedules/checkpoint_schedule.h"

namespace flatpeak::cuda {

struct CheckpointCudaOptions {
  bool copy_streams = true;              // SCO's side streams; false: copies in line on the compute stream
  bool allow_pageable_fallback = false;  // PinnedArena: pageable host memory when pinning fails
};

struct CheckpointScheduleCudaResult {
  exec::CheckpointScheduleResult values;  // loss, d_input and d_weights (bf16 bits), read back after the run
  // The host boundaries as the CPU schedule's TrackingAllocator counts them: [offloaded layers,
  // T, H] bf16 rounded up to the allocator's alignment, held from before the first phase to the
  // end (0 when nothing is offloaded).
  int64_t host_boundary_bytes = 0;
  bool host_pinned = true;     // false: the pageable fallback was used (fallback_reason says why)
  std::string fallback_reason;
  double seconds = 0.0;        // CUDA events: first layer's forward to the last gradient
  double forward_s = 0.0;      // fwd/... and loss/fwd
  double backward_s = 0.0;     // loss/bwd and bwd/...
};

// Throws std::invalid_argument for a bad config (the CPU schedule's rules), exec::OutOfMemory past
// the allocator's capacity, BackendError for CUDA/cuBLAS failures and when the host arena cannot
// be pinned (without the fallback).
CheckpointScheduleCudaResult run_checkpoint_schedule_cuda(DeviceAllocator& alloc, const CublasContext& blas,
                                                          const exec::CheckpointScheduleConfig& config,
                                                          const CheckpointCudaOptions& options = {});

}  // namespace flatpeak::cuda
