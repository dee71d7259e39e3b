// The optimizer schedule (executor/schedules/optimizer_schedule.h): serial offload and
// OffloadStreamAdamW give master, m, v and bf16 params bitwise equal to one full-vector AdamW step
// for any bucket size, depth and thread count; buffers and phases as the planner lays them out;
// the rank's parameter count from the spec library.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "executor/ops/adamw.h"
#include "executor/schedules/optimizer_schedule.h"
#include "executor/schedules/schedule_util.h"
#include "spec/model_loader.h"
#include "spec/param_count.h"

namespace flatpeak::exec {
namespace {

struct Reference {
  std::vector<float> master, m, v;
};

// One full-vector AdamW step on plain vectors, from the initial values optimizer_schedule.h documents.
Reference reference_step(const OptimizerScheduleConfig& c) {
  const int64_t n = c.params;
  Reference r{std::vector<float>(static_cast<size_t>(n)), std::vector<float>(static_cast<size_t>(n)),
              std::vector<float>(static_cast<size_t>(n))};
  std::vector<float> g(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const auto u = static_cast<uint64_t>(i);
    r.master[static_cast<size_t>(i)] = uniform_pm1(c.seed, u);
    g[static_cast<size_t>(i)] = to_f32(f32_to_bf16(0.01f * uniform_pm1(c.seed + 1, u)));
    r.m[static_cast<size_t>(i)] = 1e-3f * uniform_pm1(c.seed + 2, u);
    r.v[static_cast<size_t>(i)] = 1e-5f * std::fabs(uniform_pm1(c.seed + 3, u));
  }
  AdamWArgs a;
  a.master = r.master.data();
  a.grad = g.data();
  a.grad_dtype = DType::F32;
  a.m = r.m.data();
  a.v = r.v.data();
  a.elems = n;
  a.step = c.step;
  a.lr = c.lr;
  a.beta1 = c.beta1;
  a.beta2 = c.beta2;
  a.eps = c.eps;
  a.weight_decay = c.weight_decay;
  adamw_step_cpu(a);
  return r;
}

// Bitwise: memcmp, so -0 vs +0 or NaN payloads would also be caught.
void expect_bitwise(const std::vector<float>& got, const std::vector<float>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)), 0) << what;
}

void expect_matches_reference(const OptimizerScheduleConfig& c, const std::string& label) {
  TrackingAllocator alloc({256, -1, -1});
  const OptimizerScheduleResult got = run_optimizer_schedule(alloc, c);
  const Reference want = reference_step(c);
  expect_bitwise(got.master, want.master, label + " master");
  expect_bitwise(got.m, want.m, label + " m");
  expect_bitwise(got.v, want.v, label + " v");
  if (c.placement != OptimizerPlacement::Device) {
    ASSERT_EQ(got.params.size(), want.master.size()) << label;
    size_t mismatches = 0;
    for (size_t i = 0; i < got.params.size(); ++i) mismatches += got.params[i].bits != f32_to_bf16(want.master[i]).bits;
    EXPECT_EQ(mismatches, 0u) << label << " bf16 params";
  }
  EXPECT_EQ(alloc.live_bytes(MemorySpace::Device), 0) << label;
  EXPECT_EQ(alloc.live_bytes(MemorySpace::Host), 0) << label;
}

TEST(ExecutorScheduleOptimizer, DevicePlacementIsOneFullVectorStep) {
  for (const int64_t params : {1, 1000, 40003}) {
    OptimizerScheduleConfig c;
    c.params = params;
    c.placement = OptimizerPlacement::Device;
    c.cpu_threads = 3;
    c.seed = 11;
    expect_matches_reference(c, "device P=" + std::to_string(params));
  }
}

TEST(ExecutorScheduleOptimizer, SerialOffloadBitwiseEqualToDeviceStep) {
  for (const uint64_t seed : {3u, 17u}) {
    for (const int threads : {1, 2}) {
      OptimizerScheduleConfig c;
      c.params = 30011;
      c.placement = OptimizerPlacement::Serial;
      c.cpu_threads = threads;
      c.seed = seed;
      c.step = static_cast<int64_t>(seed);
      expect_matches_reference(c, "serial seed=" + std::to_string(seed) + " threads=" + std::to_string(threads));
    }
  }
}

TEST(ExecutorScheduleOptimizer, StreamBitwiseEqualForAnyBucketDepthAndThreads) {
  struct Case {
    int64_t params, bucket, depth;
    int threads;
    uint64_t seed;
  };
  // Buckets that divide P, that do not (a short last bucket), of one element, and larger than P.
  const Case cases[] = {{1000, 250, 2, 1, 1},  {1000, 333, 2, 1, 2},   {1000, 1, 3, 1, 3},
                        {1000, 5000, 1, 2, 4}, {40003, 4096, 1, 1, 5}, {40003, 4096, 8, 3, 6},
                        {40003, 777, 4, 2, 7}, {7, 2, 2, 1, 8}};
  for (const Case& k : cases) {
    OptimizerScheduleConfig c;
    c.params = k.params;
    c.placement = OptimizerPlacement::Stream;
    c.bucket_params = k.bucket;
    c.bucket_depth = k.depth;
    c.cpu_threads = k.threads;
    c.seed = k.seed;
    expect_matches_reference(c, "stream P=" + std::to_string(k.params) + " bucket=" + std::to_string(k.bucket) +
                                    " depth=" + std::to_string(k.depth) + " threads=" + std::to_string(k.threads));
  }
}

// Grad shards one buffer per unit (as a step's reduce-scatters land them): the same bits, the
// D2H and the buckets reading across the shards' ends; each shard aligned on its own.
TEST(ExecutorScheduleOptimizer, GradShardsPerUnitAreBitwiseOneBuffer) {
  for (OptimizerPlacement placement : {OptimizerPlacement::Device, OptimizerPlacement::Serial, OptimizerPlacement::Stream}) {
    OptimizerScheduleConfig c;
    c.params = 40003;
    c.grad_units = {1, 9999, 20000, 3, 10000};
    c.placement = placement;
    c.bucket_params = 4096;
    c.bucket_depth = 2;
    expect_matches_reference(c, "units, placement " + std::to_string(static_cast<int>(placement)));
    TrackingAllocator alloc({512});
    run_optimizer_schedule(alloc, c);
    const int64_t b = placement == OptimizerPlacement::Device ? 4 : 2;
    int64_t grads = 0;
    for (int64_t u : c.grad_units) grads += (u * b + 511) / 512 * 512;
    EXPECT_EQ(alloc.high_water_bytes(MemorySpace::Device) - alloc.bytes_at_high_water(MemorySpace::Device)[static_cast<size_t>(Category::Params)] -
                  alloc.bytes_at_high_water(MemorySpace::Device)[static_cast<size_t>(Category::Optimizer)],
              grads);
  }
  OptimizerScheduleConfig bad;
  bad.params = 10;
  bad.grad_units = {3, 3};
  TrackingAllocator alloc;
  EXPECT_THROW(run_optimizer_schedule(alloc, bad), std::invalid_argument);
}

// Hand-derived bytes (alignment 1, so every buffer counts its exact size) and the phase names.
TEST(ExecutorScheduleOptimizer, BuffersAndPhasesAsThePlannerLaysThemOut) {
  const int64_t P = 1000;
  auto run = [&](OptimizerPlacement placement, TrackingAllocator& alloc) {
    OptimizerScheduleConfig c;
    c.params = P;
    c.placement = placement;
    c.bucket_params = 300;
    c.bucket_depth = 3;
    c.keep_results = false;
    run_optimizer_schedule(alloc, c);
  };
  auto device_bytes = [](const TrackingAllocator& alloc, Category cat) {
    for (const auto& r : alloc.phase_records())
      if (r.space == MemorySpace::Device && r.phase.rfind("opt/", 0) == 0) return r.bytes_at_peak[static_cast<size_t>(cat)];
    return int64_t{-1};
  };
  auto phases = [](const TrackingAllocator& alloc) {
    std::vector<std::string> names;
    for (const auto& r : alloc.phase_records())
      if (r.space == MemorySpace::Device) names.push_back(r.phase);
    return names;
  };
  {
    TrackingAllocator alloc({1, -1, -1});
    run(OptimizerPlacement::Device, alloc);
    EXPECT_EQ(device_bytes(alloc, Category::Params), 4 * P);
    EXPECT_EQ(device_bytes(alloc, Category::Grads), 4 * P);
    EXPECT_EQ(device_bytes(alloc, Category::Optimizer), 8 * P);
    EXPECT_EQ(alloc.high_water_bytes(MemorySpace::Host), 0);
    EXPECT_EQ(phases(alloc), (std::vector<std::string>{"init", "opt/step"}));
  }
  {
    TrackingAllocator alloc({1, -1, -1});
    run(OptimizerPlacement::Serial, alloc);
    EXPECT_EQ(device_bytes(alloc, Category::Params), 2 * P);
    EXPECT_EQ(device_bytes(alloc, Category::Grads), 2 * P);
    EXPECT_EQ(device_bytes(alloc, Category::Optimizer), 0);
    EXPECT_EQ(alloc.high_water_bytes(MemorySpace::Host), 16 * P + 2 * P + 2 * P);
    EXPECT_EQ(phases(alloc), (std::vector<std::string>{"init", "opt/d2h", "opt/cpu_step", "opt/h2d"}));
  }
  {
    TrackingAllocator alloc({1, -1, -1});
    run(OptimizerPlacement::Stream, alloc);
    EXPECT_EQ(device_bytes(alloc, Category::Params), 2 * P);
    EXPECT_EQ(device_bytes(alloc, Category::Grads), 2 * P);
    // master, m, v, fp32 grad staging + depth × (grad in, param out) bf16 buckets.
    EXPECT_EQ(alloc.high_water_bytes(MemorySpace::Host), 16 * P + 3 * 2 * 300 * 2);
    EXPECT_EQ(phases(alloc), (std::vector<std::string>{"init", "opt/bucket0", "opt/bucket1", "opt/bucket2", "opt/bucket3"}));
  }
}

TEST(ExecutorScheduleOptimizer, RejectsBadConfig) {
  TrackingAllocator alloc;
  OptimizerScheduleConfig c;
  c.params = 10;
  c.placement = OptimizerPlacement::Stream;
  c.bucket_params = 0;
  EXPECT_THROW(run_optimizer_schedule(alloc, c), std::invalid_argument);
  c.bucket_params = 4;
  c.bucket_depth = 0;
  EXPECT_THROW(run_optimizer_schedule(alloc, c), std::invalid_argument);
  c.params = 0;
  c.placement = OptimizerPlacement::Device;
  EXPECT_THROW(run_optimizer_schedule(alloc, c), std::invalid_argument);
}

// On one rank the shard is the whole model: the published count (models/README.md convention)
// plus the MTP modules when they are trained; on N ranks it is split by FSDP and EP.
TEST(ExecutorScheduleOptimizer, RankShardParamsFromTheSpecLibrary) {
  const ModelSpec dsv3 = load_model("DeepSeek-V3");
  const ParamCounts pc = count_params(dsv3);
  EXPECT_EQ(rank_shard_params(dsv3, 1, 1, false), 671026419200);
  EXPECT_EQ(rank_shard_params(dsv3, 1, 1, true), pc.total + pc.mtp);
  // 8 ranks, EP = 8: each rank holds 1/8 of the dense parts and 32 whole experts per MoE layer.
  const int64_t shard = rank_shard_params(dsv3, 8, 8, false);
  const std::vector<int64_t> units = rank_shard_units(dsv3, 8, 8, false);
  ASSERT_EQ(units.size(), static_cast<size_t>(dsv3.num_layers) + 2);  // embedding, layers, head
  int64_t sum = 0;
  for (int64_t u : units) sum += u;
  EXPECT_EQ(sum, shard);
  EXPECT_GE(shard, pc.total / 8);
  EXPECT_LE(shard, pc.total / 8 + 64);
  EXPECT_THROW(rank_shard_params(dsv3, 8, 3, false), std::invalid_argument);
}

}  // namespace
}  // namespace flatpeak::exec
