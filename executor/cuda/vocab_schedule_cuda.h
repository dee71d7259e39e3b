// The vocab component run on the GPU: the CUDA twin of run_vocab_schedule
// (executor/schedules/vocab_schedule.h), with the same config, buffers, categories and phase
// names, every buffer from a DeviceAllocator and every op on the cuBLAS context's stream: the
// materialised schedule (bf16 logits [T, V], fp32 log-softmax and dlogits) or the blocked one
// (Ring-DTP at R = 1), with gradients in forward or the recompute backward.
//   DeviceAllocator alloc;  CublasContext blas(alloc, stream);
//   VocabScheduleConfig c; c.tokens = 65536; c.hidden = 2880; c.vocab = 201088;
//   c.token_block_rows = 8192; c.vocab_block_rows = 16384;
//   VocabScheduleCudaResult r = run_vocab_schedule_cuda(alloc, blas, c);   // r.seconds, alloc.phase_records()
#pragma once

#include <cstdint>

#include "executor/cuda/cublas_context.h"
#include "executor/cuda/device_allocator.h"
#include "executor/schedules/vocab_schedule.h"

namespace flatpeak::cuda {

struct VocabScheduleCudaResult {
  double mean_loss = 0.0;   // over the per-token losses, read back after the run
  double seconds = 0.0;     // CUDA events: first phase to the last gradient written
  double forward_s = 0.0;   // loss/fwd[/blkI] phases (with gradients in forward: the whole work)
  double backward_s = 0.0;  // loss/bwd[/blkI] phases
};

// Device bytes the run holds at its peak (tracked sizes at `alignment_bytes`), from the same
// buffer list as the run: what to check against free memory before starting. Excludes the cuBLAS
// workspace (already allocated by the context).
int64_t vocab_schedule_cuda_peak_bytes(const exec::VocabScheduleConfig& config, int64_t alignment_bytes);

// Inputs are filled on the device from config.seed (schedule_util.h's values) before the first
// phase and are not timed. Returns after the stream has finished the run. Throws
// std::invalid_argument for bad dims, exec::OutOfMemory past the allocator's capacity and
// BackendError for CUDA/cuBLAS failures.
VocabScheduleCudaResult run_vocab_schedule_cuda(DeviceAllocator& alloc, const CublasContext& blas,
                                                const exec::VocabScheduleConfig& config);

}  // namespace flatpeak::cuda
