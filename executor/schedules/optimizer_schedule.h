// One AdamW optimizer step over a rank's parameter shard, as a component run, in the three
// placements of DESIGN.md ("Optimizer state"): on the device, serial offload, or
// OffloadStreamAdamW (buckets flowing D2H -> CPU AdamW -> H2D on three threads, `depth` in flight).
//   TrackingAllocator alloc({512});
//   OptimizerScheduleConfig c; c.params = rank_shard_params(model, 1, 1, false);
//   c.placement = OptimizerPlacement::Stream; c.bucket_params = 1 << 20; c.bucket_depth = 2;
//   OptimizerScheduleResult r = run_optimizer_schedule(alloc, c);   // phases opt/bucketI
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "executor/memory/tensor.h"
#include "executor/memory/tracking_allocator.h"
#include "executor/ops/dtype.h"
#include "spec/model_spec.h"

namespace flatpeak::exec {

enum class OptimizerPlacement { Device, Serial, Stream };

// Parameters one rank holds under FSDP with expert parallelism: per unit (embedding, each decoder
// layer, each MTP module when trained, final norm + LM head), ceil(dense / N) plus
// ceil(local experts / (N / EP)), where a rank's local experts are E / EP of each MoE layer.
int64_t rank_shard_params(const ModelSpec& model, int64_t gpus, int64_t ep, bool mtp);
// The same per unit, in execution order: the embedding, each decoder layer, each MTP module, the
// head (final norm + LM head); their sum is rank_shard_params.
std::vector<int64_t> rank_shard_units(const ModelSpec& model, int64_t gpus, int64_t ep, bool mtp);

struct OptimizerScheduleConfig {
  int64_t params = 0;  // P: parameters of this rank's shard
  // The grad shard of each FSDP unit (summing to P), each its own device buffer, as a step's
  // reduce-scatters land them (rank_shard_units); empty: one [P] buffer.
  std::vector<int64_t> grad_units;
  OptimizerPlacement placement = OptimizerPlacement::Stream;
  int64_t bucket_params = 0;  // stream: parameters per bucket (the last bucket may be shorter)
  int64_t bucket_depth = 2;   // stream: buckets in flight (host staging slots)
  int cpu_threads = 1;        // threads of the CPU (or device-placement) AdamW kernel
  uint64_t seed = 1;          // master, grads, m and v are a pure function of the seed
  int64_t step = 5;           // Adam step t (m and v start as if from earlier steps)
  float lr = 1e-3f, beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, weight_decay = 0.1f;
  bool keep_results = true;   // copy master, m, v and the bf16 params out (tests); off in benchmarks
};

// Copied out of the tracked buffers before they are released (when keep_results).
struct OptimizerScheduleResult {
  std::vector<float> master;   // [P] fp32 master after the step (device fp32 params, or host master)
  std::vector<float> m, v;     // [P] fp32 Adam moments after the step
  std::vector<Bf16> params;    // [P] bf16 device params after the step (offload placements only)
  double seconds = 0.0;        // wall time of the step (the opt/ phases)
  double d2h_busy_seconds = 0.0, cpu_busy_seconds = 0.0, h2d_busy_seconds = 0.0;  // offload stages
  int64_t buckets = 0;         // stream: number of buckets
};

// Initial values (identical across placements, so their results compare bitwise):
//   master[i] = uniform(seed, i); grad[i] = bf16(0.01 · uniform(seed + 1, i)) (exactly
//   representable in bf16, so the fp32 device grads equal the widened bf16 offload grads);
//   m[i] = 0.001 · uniform(seed + 2, i); v[i] = 1e-5 · |uniform(seed + 3, i)|.
// Buffers (categories and spaces as the planner lays them out, planner/README.md; grads one
// buffer per entry of grad_units when given):
//   Device:  params [P] fp32 (master) — params; grads [P] fp32 — grads; m, v [P] fp32 — optimizer.
//            Phase opt/step: fused AdamW, no transients.
//   Serial:  device params [P] bf16 — params, grads [P] bf16 — grads; host (optimizer): master, m, v,
//            fp32 grad staging [P] fp32, grad D2H landing [P] bf16, param H2D staging [P] bf16.
//            Phases opt/d2h, opt/cpu_step, opt/h2d.
//   Stream:  device as Serial; host (optimizer): master, m, v, fp32 grad staging [P] fp32 and
//            `depth` slots of (grad in [bucket] bf16, param out [bucket] bf16), allocated once at
//            launch. Phase opt/bucketI is entered when the CPU stage starts bucket I.
// Every buffer is allocated in phase "init" (persistent state and staging, live all step).
OptimizerScheduleResult run_optimizer_schedule(TrackingAllocator& alloc, const OptimizerScheduleConfig& config);

// The same step on a caller's buffers (the whole step, step_schedule.h). The device side as views:
struct OptimizerDeviceView {
  void* params = nullptr;  // [P]: the fp32 master (Device) or the bf16 params (Serial, Stream)
  // The grad shards in parameter order, {pointer, elements} summing to P: fp32 (Device) or bf16.
  std::vector<std::pair<void*, int64_t>> grads;
  float* m = nullptr;  // [P] fp32 Adam moments (Device only)
  float* v = nullptr;
};

// The host side of an offload placement (category optimizer, host space), allocated and made
// resident at construction (the launch): fp32 master, m, v and grad staging [P]; Serial adds the
// bf16 grad landing and param staging [P]; Stream `bucket_depth` slots of bf16 grad in and param
// out [min(bucket_params, P)].
class OptimizerHostState {
 public:
  OptimizerHostState(TrackingAllocator& alloc, const OptimizerScheduleConfig& config);
  Tensor master, m, v, grad_staging;
  Tensor grad_landing, param_staging;      // Serial
  std::vector<Tensor> grad_in, param_out;  // Stream
};

// Runs the opt/ phases on the caller's buffers; `host` is required by Serial and Stream. With
// keep_results, master, m, v (and the bf16 params of an offload placement) are copied out.
OptimizerScheduleResult run_optimizer_step(TrackingAllocator& alloc, const OptimizerScheduleConfig& config,
                                           const OptimizerDeviceView& device, OptimizerHostState* host);

}  // namespace flatpeak::exec
