// One MoE layer's dispatch on one rank on the GPU (EP = 1), uncapped or in capped rounds
// (PipelinedLLEP at EP = 1): the CUDA counterpart of run_dispatch_schedule
// (executor/schedules/dispatch_schedule.h) with its config struct and its capped phase names,
// built from the CUDA ops (moe_route, expert FFN) for throughput and tracked-peak figures.
//   DispatchScheduleConfig c; c.tokens = 32768; c.hidden = 2880; c.experts = 128; c.top_k = 4;
//   c.ffn = 2880; c.chunk_cap_rows = 16384;   // 0: one uncapped round
//   auto ids = balanced_topk_ids(c.tokens, c.experts, c.top_k, c.seed);
//   DispatchScheduleCudaResult r = run_dispatch_schedule_cuda(alloc, blas, c, ids);
#pragma once

#include <cstdint>
#include <vector>

#include "executor/cuda/cublas_context.h"
#include "executor/cuda/device_allocator.h"
#include "executor/schedules/dispatch_schedule.h"

namespace flatpeak::cuda {

// What differs from the CPU schedule (so the figures are read for what they are):
//  - both modes run the capped recompute structure: a no-grad forward over the rounds, then per
//    round a recompute of the experts and their backward; uncapped is one round of C = T·k (the
//    same work as the CPU's forward, recompute pass and backward);
//  - the router weights come from the router GEMM and a softmax over the kept logits as on the
//    CPU, but the router's backward is not run (d prob is computed and left in place);
//  - the combine applies the weight to the expert output (the op's CombineArgs convention) and
//    sums a token's rows with fp32 atomics, so the output's last bits depend on the order;
//  - expert weight gradients accumulate in bf16 storage (the expert FFN op has one dtype);
//  - config.store, config.depth and config.routing are not used: the caller gives the ids, and
//    one stream runs the rounds one after another.
struct DispatchScheduleCudaResult {
  int64_t rounds = 1;
  int64_t chunk_cap_rows = 0;  // C in effect
  double seconds = 0.0;        // CUDA events: routing to the last gradient, both passes
  double forward_s = 0.0;      // the no-grad forward
  double backward_s = 0.0;     // the recompute and backward
  double out_sum = 0.0;        // Σ of the forward output (bf16 values): capped vs uncapped check
};

// [T, k] ids, k distinct experts per token, uniform over experts (balanced in expectation), a
// pure function of the seed.
std::vector<int32_t> balanced_topk_ids(int64_t tokens, int64_t experts, int64_t top_k, uint64_t seed);

// Device bytes the run holds at its peak, at `alignment_bytes` (routing and expert counts
// assumed balanced: the expert FFN workspace is sized for 2× the mean rows per expert).
int64_t dispatch_schedule_cuda_peak_bytes(const exec::DispatchScheduleConfig& config, int64_t alignment_bytes);

// Throws std::invalid_argument for bad dims or ids, exec::OutOfMemory and BackendError.
DispatchScheduleCudaResult run_dispatch_schedule_cuda(DeviceAllocator& alloc, const CublasContext& blas,
                                                      const exec::DispatchScheduleConfig& config,
                                                      const std::vector<int32_t>& topk_ids);

}  // namespace flatpeak::cuda
