// AdamW with the optimizer state on the host, for a GPU's parameter shard: OffloadStreamAdamW
// (buckets pipelined over two copy streams and the host: D2H of bucket b+depth, CPU AdamW of
// bucket b, H2D of bucket b−1 at once) and serial offload (all grads D2H, one CPU step, all params
// H2D) for comparison. Host master, m, v and the staging slots come from a PinnedArena sized once;
// the loop synchronises only on per-slot events, never on the device. With `grads_ready` events
// (one per bucket, recorded by backward when that bucket's grads are final) the D2H of a bucket
// starts during backward. The CPU AdamW is the CPU backend's (executor/cpu/adamw_cpu.cpp), so the
// result is bitwise that of one on-device-order full-vector CPU step.
//   PinnedArena arena({offload_adamw_host_bytes(cfg)});
//   OffloadAdamWHost host = carve_offload_adamw_host(arena, cfg);   // fill master, m, v
//   OffloadAdamWTimes t = offload_adamw_step_cuda(cfg, d_grads, d_params, host, d2h, h2d);
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "executor/cuda/pinned_arena.h"
#include "executor/ops/adamw.h"

namespace flatpeak::cuda {

struct OffloadAdamWConfig {
  exec::AdamWArgs hyper;      // lr, betas, eps, weight_decay, step, grad_scale (pointers unused)
  int64_t elems = 0;          // parameters of the shard
  int64_t bucket_elems = 0;   // stream: parameters per bucket (the last may be shorter)
  int depth = 2;              // stream: buckets in flight (staging slots)
  bool stream = true;         // false: serial offload
  int cpu_threads = 1;        // adamw_step_cpu_threaded
};

// Host buffers, all in one PinnedArena: master, m, v [n] fp32 (category optimizer), and staging:
// stream: grads and params slots [depth, bucket] bf16; serial: grads and params [n] bf16.
struct OffloadAdamWHost {
  float* master = nullptr;
  float* m = nullptr;
  float* v = nullptr;
  exec::Bf16* grad_staging = nullptr;
  exec::Bf16* param_staging = nullptr;
};

int64_t offload_adamw_host_bytes(const OffloadAdamWConfig& config, int64_t alignment_bytes = 256);
OffloadAdamWHost carve_offload_adamw_host(PinnedArena& arena, const OffloadAdamWConfig& config);

// Seconds, from host clocks around the loop and CUDA events around each copy.
struct OffloadAdamWTimes {
  double total_s = 0.0;
  double d2h_s = 0.0;   // sum over buckets of the D2H copies
  double cpu_s = 0.0;   // sum over buckets of the CPU AdamW
  double h2d_s = 0.0;   // sum over buckets of the H2D copies
  int64_t buckets = 0;
};

// d_grads [n] bf16 and d_params [n] bf16 on the device; updates host master, m, v and writes the
// new bf16 params to d_params. Returns when every copy has completed: then any stream may use
// d_grads, d_params and the host buffers. grads_ready: null, or one event per bucket (stream) /
// exactly one event (serial) that the D2H waits for on the device.
//
// Ordering contract (the call cannot see the streams that ran backward, so the caller keeps it):
//  - With grads_ready, event b must have been recorded (cudaEventRecord, before this call: a wait
//    on an event never recorded returns at once) after every access of this step to bucket b's
//    range of d_grads AND of d_params: its gradients final, and every read of its parameters done.
//    Bucket b's H2D starts once its D2H has passed the event, while backward may still run, so
//    from the record until this call returns nothing may read or write that range of d_params or
//    d_grads. A parameter read after its gradient is final in the flat order (a weight tied to
//    one read later, or held in two ranges whose gradients are summed into one) breaks this: its
//    bucket's event must be recorded after that last read, or grads_ready not be passed.
//  - Without grads_ready nothing is waited for on the device: every earlier write of d_grads and
//    every earlier read or write of d_params (and their stream-ordered allocation) must have
//    completed, e.g. by cudaStreamSynchronize of the streams that ran them. Work queued on `d2h`
//    before the call is ordered before the D2H copies (d_grads only); nothing orders `h2d`.
// Checked: the pointers are non-null and the two ranges do not overlap (an H2D would overwrite
// gradients not yet copied down), and the number of events; std::invalid_argument otherwise.
OffloadAdamWTimes offload_adamw_step_cuda(const OffloadAdamWConfig& config,
                                          const exec::Bf16* d_grads, exec::Bf16* d_params,
                                          const OffloadAdamWHost& host, cudaStream_t d2h,
                                          cudaStream_t h2d,
                                          const std::vector<cudaEvent_t>* grads_ready = nullptr);

}  // namespace flatpeak::cuda
