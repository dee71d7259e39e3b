// CPU vs CUDA for the MoE data movement: the routing plan (counts, slot_to_row, row_to_slot)
// exactly, in one block and over chunks; permute / unpermute forward (pure copies) bitwise; the
// k-slot sums (permute backward, combine forward) and combine's d_weights within rel 1e-5 (+ 1e-5
// of the largest magnitude) in f32 and rel 1e-2 (+ 1e-3) in bf16 storage; combine with and without
// the fused unpermute. Random non-zero inputs from a fixed seed; exit 77 (skipped) without a CUDA
// device.
#include <algorithm>
#include <cstdio>
#include <exception>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "cuda_test_util.h"
#include "executor/cuda/ops_cuda.h"

using namespace flatpeak;
using namespace flatpeak::exec;
using namespace flatpeak::cuda;
using namespace flatpeak::cuda::test;

namespace {

constexpr int64_t kTokens = 211, kTopK = 3, kExperts = 13, kHidden = 64;

std::string tag(const char* op, DType dtype) { return std::string(op) + "/" + dtype_name(dtype); }

// k distinct experts per token, skewed towards the low ids so the counts are uneven.
std::vector<int32_t> topk_ids(Rng& rng) {
  std::vector<int32_t> ids;
  std::vector<int32_t> experts(kExperts);
  std::iota(experts.begin(), experts.end(), 0);
  for (int64_t t = 0; t < kTokens; ++t) {
    std::shuffle(experts.begin(), experts.end(), rng.engine());
    if (t % 3 == 0) std::sort(experts.begin(), experts.begin() + kTopK + 2);
    ids.insert(ids.end(), experts.begin(), experts.begin() + kTopK);
  }
  return ids;
}

struct Plan {
  std::vector<int32_t> ids;
  std::vector<int64_t> counts = std::vector<int64_t>(kExperts);
  std::vector<int32_t> slot_to_row = std::vector<int32_t>(kTokens * kTopK);
  std::vector<int32_t> row_to_slot = std::vector<int32_t>(kTokens * kTopK);
  DeviceBuffer g_ids, g_counts, g_s2r, g_r2s;
};

PermuteArgs base_args(DType dtype) {
  PermuteArgs a;
  a.dtype = dtype;
  a.tokens = kTokens;
  a.top_k = kTopK;
  a.experts = kExperts;
  a.hidden = kHidden;
  return a;
}

void test_route(DeviceAllocator& alloc, Plan& plan) {
  Rng rng(21);
  plan.ids = topk_ids(rng);
  plan.g_ids = upload(alloc, plan.ids, Category::Dispatch);
  plan.g_counts = DeviceBuffer(alloc, kExperts * 8, Category::Dispatch);
  plan.g_s2r = DeviceBuffer(alloc, kTokens * kTopK * 4, Category::Dispatch);
  plan.g_r2s = DeviceBuffer(alloc, kTokens * kTopK * 4, Category::Dispatch);
  PermuteArgs a = base_args(DType::F32);
  a.topk_ids = plan.ids.data();
  a.expert_counts = plan.counts.data();
  a.slot_to_row = plan.slot_to_row.data();
  a.row_to_slot = plan.row_to_slot.data();
  moe_route_cpu(a);
  a.topk_ids = plan.g_ids.as<int32_t>();
  a.expert_counts = plan.g_counts.as<int64_t>();
  a.slot_to_row = plan.g_s2r.as<int32_t>();
  a.row_to_slot = plan.g_r2s.as<int32_t>();
  moe_route_cuda(a, nullptr);
  expect_equal("route/expert_counts", download<int64_t>(plan.g_counts, kExperts), plan.counts);
  expect_equal("route/slot_to_row", download<int32_t>(plan.g_s2r, kTokens * kTopK), plan.slot_to_row);
  expect_equal("route/row_to_slot", download<int32_t>(plan.g_r2s, kTokens * kTopK), plan.row_to_slot);
}

// The routing plan at sizes that run the four-launch sort over chunks (moe_kernels.cuh): many
// chunks at gpt-oss-120b's and DeepSeek-V3's experts, and the single block past
// kRouteMaxExperts. Each token's k experts drawn without repeats, skewed to the low ids.
void test_route_shape(DeviceAllocator& alloc, int64_t tokens, int64_t top_k, int64_t experts,
                      uint32_t seed) {
  const int64_t rows = tokens * top_k;
  std::mt19937 engine(seed);
  std::uniform_int_distribution<int64_t> pick(0, experts - 1);
  std::vector<int32_t> ids;
  ids.reserve(static_cast<size_t>(rows));
  for (int64_t t = 0; t < tokens; ++t) {
    const size_t first = ids.size();
    while (static_cast<int64_t>(ids.size() - first) < top_k) {
      int64_t e = pick(engine);
      if (t % 3 == 0) e = e % std::min<int64_t>(experts, 2 * top_k);  // a third on a few experts
      if (std::find(ids.begin() + first, ids.end(), e) == ids.end()) ids.push_back(static_cast<int32_t>(e));
    }
  }
  std::vector<int64_t> counts(static_cast<size_t>(experts));
  std::vector<int32_t> s2r(static_cast<size_t>(rows)), r2s(static_cast<size_t>(rows));
  PermuteArgs a = base_args(DType::F32);
  a.tokens = tokens;
  a.top_k = top_k;
  a.experts = experts;
  a.topk_ids = ids.data();
  a.expert_counts = counts.data();
  a.slot_to_row = s2r.data();
  a.row_to_slot = r2s.data();
  moe_route_cpu(a);
  DeviceBuffer g_ids = upload(alloc, ids, Category::Dispatch);
  DeviceBuffer g_counts(alloc, experts * 8, Category::Dispatch);
  DeviceBuffer g_s2r(alloc, rows * 4, Category::Dispatch), g_r2s(alloc, rows * 4, Category::Dispatch);
  a.topk_ids = g_ids.as<int32_t>();
  a.expert_counts = g_counts.as<int64_t>();
  a.slot_to_row = g_s2r.as<int32_t>();
  a.row_to_slot = g_r2s.as<int32_t>();
  moe_route_cuda(a, nullptr);
  const std::string name = "route_T" + std::to_string(tokens) + "_k" + std::to_string(top_k) + "_E" +
                           std::to_string(experts);
  expect_equal(name + "/expert_counts", download<int64_t>(g_counts, experts), counts);
  expect_equal(name + "/slot_to_row", download<int32_t>(g_s2r, rows), s2r);
  expect_equal(name + "/row_to_slot", download<int32_t>(g_r2s, rows), r2s);
}

void test_permute(DeviceAllocator& alloc, Plan& plan, DType dtype) {
  const int64_t rows = kTokens * kTopK;
  const int64_t eb = dtype_bytes(dtype);
  Rng rng(22);
  HostTensor x = HostTensor::from(rng.uniform(kTokens * kHidden), dtype);
  HostTensor d_x_perm = HostTensor::from(rng.uniform(rows * kHidden), dtype);
  HostTensor y_perm = HostTensor::from(rng.uniform(rows * kHidden), dtype);
  HostTensor d_y_slots = HostTensor::from(rng.uniform(rows * kHidden), dtype);
  HostTensor x_perm = HostTensor::from(std::vector<float>(static_cast<size_t>(rows * kHidden)), dtype);
  HostTensor y_slots = x_perm, d_y_perm = x_perm;
  HostTensor d_x = HostTensor::from(std::vector<float>(static_cast<size_t>(kTokens * kHidden)), dtype);
  DeviceBuffer g_x = upload(alloc, x), g_dxp = upload(alloc, d_x_perm);
  DeviceBuffer g_yp = upload(alloc, y_perm), g_dys = upload(alloc, d_y_slots);
  DeviceBuffer g_xp(alloc, rows * kHidden * eb, Category::Dispatch);
  DeviceBuffer g_ys(alloc, rows * kHidden * eb, Category::Dispatch);
  DeviceBuffer g_dyp(alloc, rows * kHidden * eb, Category::Dispatch);
  DeviceBuffer g_dx(alloc, kTokens * kHidden * eb, Category::Dispatch);
  PermuteArgs a = base_args(dtype);
  a.slot_to_row = plan.slot_to_row.data();
  a.row_to_slot = plan.row_to_slot.data();
  a.x = x.data();
  a.x_perm = x_perm.data();
  a.d_x_perm = d_x_perm.data();
  a.d_x = d_x.data();
  a.y_perm = y_perm.data();
  a.y_slots = y_slots.data();
  a.d_y_slots = d_y_slots.data();
  a.d_y_perm = d_y_perm.data();
  permute_forward_cpu(a);
  permute_backward_cpu(a);
  unpermute_forward_cpu(a);
  unpermute_backward_cpu(a);
  a.slot_to_row = plan.g_s2r.as<int32_t>();
  a.row_to_slot = plan.g_r2s.as<int32_t>();
  a.x = g_x.raw();
  a.x_perm = g_xp.raw();
  a.d_x_perm = g_dxp.raw();
  a.d_x = g_dx.raw();
  a.y_perm = g_yp.raw();
  a.y_slots = g_ys.raw();
  a.d_y_slots = g_dys.raw();
  a.d_y_perm = g_dyp.raw();
  permute_forward_cuda(a, nullptr);
  permute_backward_cuda(a, nullptr);
  unpermute_forward_cuda(a, nullptr);
  unpermute_backward_cuda(a, nullptr);
  expect_equal(tag("permute", dtype) + "/x_perm", download(g_xp, dtype).bytes, x_perm.bytes);
  expect_close(tag("permute", dtype) + "/d_x", download(g_dx, dtype).values(), d_x.values(),
               Tol::of(dtype));
  expect_equal(tag("unpermute", dtype) + "/y_slots", download(g_ys, dtype).bytes, y_slots.bytes);
  expect_equal(tag("unpermute", dtype) + "/d_y_perm", download(g_dyp, dtype).bytes, d_y_perm.bytes);
}

void test_combine(DeviceAllocator& alloc, Plan& plan, DType dtype, bool fused_unpermute) {
  const int64_t rows = kTokens * kTopK;
  const int64_t eb = dtype_bytes(dtype);
  Rng rng(23);
  HostTensor y = HostTensor::from(rng.uniform(rows * kHidden), dtype);
  std::vector<float> weights = rng.uniform(rows, 0.05f, 1.0f);
  HostTensor d_out = HostTensor::from(rng.uniform(kTokens * kHidden), dtype);
  HostTensor out = HostTensor::from(std::vector<float>(static_cast<size_t>(kTokens * kHidden)), dtype);
  HostTensor d_y = HostTensor::from(std::vector<float>(static_cast<size_t>(rows * kHidden)), dtype);
  std::vector<float> d_weights(static_cast<size_t>(rows));
  DeviceBuffer g_y = upload(alloc, y, Category::Dispatch);
  DeviceBuffer g_w = upload(alloc, weights, Category::Dispatch);
  DeviceBuffer g_dout = upload(alloc, d_out);
  DeviceBuffer g_out(alloc, kTokens * kHidden * eb, Category::Activations);
  DeviceBuffer g_dy(alloc, rows * kHidden * eb, Category::Dispatch);
  DeviceBuffer g_dw(alloc, rows * 4, Category::Dispatch);
  CombineArgs a;
  a.dtype = dtype;
  a.tokens = kTokens;
  a.top_k = kTopK;
  a.hidden = kHidden;
  a.y = y.data();
  a.weights = weights.data();
  a.slot_to_row = fused_unpermute ? plan.slot_to_row.data() : nullptr;
  a.out = out.data();
  a.d_out = d_out.data();
  a.d_y = d_y.data();
  a.d_weights = d_weights.data();
  combine_forward_cpu(a);
  combine_backward_cpu(a);
  a.y = g_y.raw();
  a.weights = g_w.as<float>();
  a.slot_to_row = fused_unpermute ? plan.g_s2r.as<int32_t>() : nullptr;
  a.out = g_out.raw();
  a.d_out = g_dout.raw();
  a.d_y = g_dy.raw();
  a.d_weights = g_dw.as<float>();
  combine_forward_cuda(a, nullptr);
  combine_backward_cuda(a, nullptr);
  const std::string name = tag(fused_unpermute ? "combine_fused" : "combine", dtype);
  expect_close(name + "/out", download(g_out, dtype).values(), out.values(), Tol::of(dtype));
  expect_close(name + "/d_y", download(g_dy, dtype).values(), d_y.values(), Tol::of(dtype));
  expect_close(name + "/d_weights", download<float>(g_dw, rows), d_weights, Tol::f32());
}

}  // namespace

int main() {
  if (const int rc = skip_unless_device(); rc != 0) return rc;
  try {
    DeviceAllocator alloc;
    Plan plan;
    test_route(alloc, plan);
    test_route_shape(alloc, 65536, 4, 128, 41);  // 64 chunks of 4096
    test_route_shape(alloc, 16384, 8, 256, 42);  // 32 chunks
    test_route_shape(alloc, 4097, 1, 7, 43);     // two chunks, the second of one copy
    test_route_shape(alloc, 8192, 4, 3000, 45);  // chunks of 6000 copies: tiles end inside them
    test_route_shape(alloc, 8192, 4, 8192, 46);  // kRouteMaxExperts: 33 KiB of shared memory
    test_route_shape(alloc, 10000, 2, 9000, 44);  // past kRouteMaxExperts: the single block
    for (DType dtype : {DType::F32, DType::BF16}) {
      test_permute(alloc, plan, dtype);
      test_combine(alloc, plan, dtype, false);
      test_combine(alloc, plan, dtype, true);
    }
  } catch (const std::exception& e) {
    std::printf("FAIL: %s\n", e.what());
    return 1;
  }
  return finish();
}
