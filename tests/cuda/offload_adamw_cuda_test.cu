// OffloadStreamAdamW and serial offload on CUDA against one full-vector CPU AdamW step: host
// master, m, v and the bf16 params written back to the device must be bitwise equal (the CPU
// does the math in every variant; the device only moves bytes), for a size not divisible by the
// bucket, depths 1-3, with and without grads_ready events. Also: the step's refusals (two events
// in serial offload, a null or overlapping buffer), the pinned arena is pinned, and a too-large
// arena is refused with a clear error (or falls back when allowed).
// Exit 77 (skipped) without a CUDA device.
#include <cstdio>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda_test_util.h"
#include "executor/cuda/offload_adamw_cuda.h"
#include "executor/cuda/pinned_arena.h"

using namespace flatpeak;
using namespace flatpeak::exec;
using namespace flatpeak::cuda;
using namespace flatpeak::cuda::test;

namespace {

constexpr int64_t kElems = 1000003;

void run_variant(DeviceAllocator& alloc, bool stream, int64_t bucket, int depth, bool with_events) {
  Rng rng(5);
  const std::vector<float> master0 = rng.uniform(kElems), m0 = rng.uniform(kElems, 0.001f, 0.01f);
  const std::vector<float> v0 = rng.uniform(kElems, 0.001f, 0.01f);
  std::vector<float> v_pos(v0);
  for (float& x : v_pos) x = x < 0 ? -x : x;  // second moments are >= 0
  const HostTensor grads = HostTensor::from(rng.uniform(kElems), DType::BF16);

  OffloadAdamWConfig c;
  c.hyper.lr = 1e-3f;
  c.hyper.weight_decay = 0.01f;
  c.hyper.step = 3;
  c.elems = kElems;
  c.bucket_elems = bucket;
  c.depth = depth;
  c.stream = stream;
  c.cpu_threads = 2;

  // Reference: one CPU step over the whole vector.
  std::vector<float> want_master(master0), want_m(m0), want_v(v_pos);
  std::vector<Bf16> want_params(static_cast<size_t>(kElems));
  AdamWArgs a = c.hyper;
  a.master = want_master.data();
  a.m = want_m.data();
  a.v = want_v.data();
  a.grad = grads.bytes.data();
  a.grad_dtype = DType::BF16;
  a.param_out = want_params.data();
  a.elems = kElems;
  adamw_step_cpu(a);

  PinnedArena arena({offload_adamw_host_bytes(c), false, 256});
  const OffloadAdamWHost host = carve_offload_adamw_host(arena, c);
  std::memcpy(host.master, master0.data(), master0.size() * 4);
  std::memcpy(host.m, m0.data(), m0.size() * 4);
  std::memcpy(host.v, v_pos.data(), v_pos.size() * 4);
  DeviceBuffer d_grads = upload(alloc, grads, Category::Grads);
  DeviceBuffer d_params(alloc, kElems * 2, Category::Params);  // [n] bf16, written by the H2D copies
  // d_params' stream-ordered allocation is queued on the legacy stream, and the non-blocking
  // copy streams below do not wait for it: let it complete before the step writes the block
  // (upload() already waited for d_grads' allocation and bytes).
  FLATPEAK_CUDA_CHECK(cudaStreamSynchronize(nullptr));
  cudaStream_t d2h = nullptr, h2d = nullptr;
  FLATPEAK_CUDA_CHECK(cudaStreamCreateWithFlags(&d2h, cudaStreamNonBlocking));
  FLATPEAK_CUDA_CHECK(cudaStreamCreateWithFlags(&h2d, cudaStreamNonBlocking));
  std::vector<cudaEvent_t> ready;
  if (with_events) {
    const int64_t n = stream ? (kElems + bucket - 1) / bucket : 1;
    ready.resize(static_cast<size_t>(n));
    for (auto& e : ready) {
      FLATPEAK_CUDA_CHECK(cudaEventCreate(&e));
      FLATPEAK_CUDA_CHECK(cudaEventRecord(e, nullptr));  // "backward" done on the default stream
    }
  }
  const OffloadAdamWTimes t = offload_adamw_step_cuda(c, d_grads.as<Bf16>(), d_params.as<Bf16>(), host, d2h, h2d,
                                                      with_events ? &ready : nullptr);
  const std::string name = std::string(stream ? "stream" : "serial") + "/bucket" + std::to_string(bucket) +
                           "/depth" + std::to_string(depth) + (with_events ? "/events" : "");
  expect_equal(name + "/master", std::vector<float>(host.master, host.master + kElems), want_master);
  expect_equal(name + "/m", std::vector<float>(host.m, host.m + kElems), want_m);
  expect_equal(name + "/v", std::vector<float>(host.v, host.v + kElems), want_v);
  const std::vector<uint16_t> got_params = download<uint16_t>(d_params, kElems);
  std::vector<uint16_t> want_bits(static_cast<size_t>(kElems));
  std::memcpy(want_bits.data(), want_params.data(), want_bits.size() * 2);
  expect_equal(name + "/params", got_params, want_bits);
  std::printf("ok   %s: %lld buckets, total %.4f s (d2h %.4f, cpu %.4f, h2d %.4f), pinned %d\n", name.c_str(),
              static_cast<long long>(t.buckets), t.total_s, t.d2h_s, t.cpu_s, t.h2d_s, arena.pinned() ? 1 : 0);
  for (auto& e : ready) FLATPEAK_CUDA_CHECK(cudaEventDestroy(e));
  FLATPEAK_CUDA_CHECK(cudaStreamDestroy(d2h));
  FLATPEAK_CUDA_CHECK(cudaStreamDestroy(h2d));
}

// What the step checks before queuing anything: exactly one event in serial offload, non-null
// device buffers, and d_grads and d_params apart (exact messages).
void check_step_refusals(DeviceAllocator& alloc) {
  OffloadAdamWConfig c;
  c.elems = 1000;
  c.bucket_elems = 256;
  PinnedArena arena({offload_adamw_host_bytes(c), false, 256});
  const OffloadAdamWHost host = carve_offload_adamw_host(arena, c);
  DeviceBuffer grads(alloc, c.elems * 2, Category::Grads), params(alloc, c.elems * 2, Category::Params);  // [n] bf16
  FLATPEAK_CUDA_CHECK(cudaStreamSynchronize(nullptr));
  auto error_of = [&](const OffloadAdamWConfig& config, const Bf16* g, Bf16* p, const std::vector<cudaEvent_t>* ready) {
    try {
      (void)offload_adamw_step_cuda(config, g, p, host, nullptr, nullptr, ready);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  std::vector<cudaEvent_t> two(2);
  for (auto& e : two) FLATPEAK_CUDA_CHECK(cudaEventCreate(&e));
  OffloadAdamWConfig serial = c;
  serial.stream = false;
  const std::string got_events = error_of(serial, grads.as<Bf16>(), params.as<Bf16>(), &two);
  expect_true("refused/serial_two_events", got_events == "offload_adamw: serial offload waits for one grads_ready event (got 2)",
              got_events);
  const std::string got_null = error_of(c, nullptr, params.as<Bf16>(), nullptr);
  expect_true("refused/null_grads",
              got_null == "offload_adamw: d_grads and d_params must be device buffers of 1000 bf16 elements (got a null pointer)",
              got_null);
  const std::string got_overlap = error_of(c, grads.as<Bf16>() + 500, grads.as<Bf16>(), nullptr);
  expect_true("refused/overlap",
              got_overlap == "offload_adamw: d_grads and d_params overlap (each [1000] bf16); the parameter uploads would "
                             "overwrite gradients not yet copied down",
              got_overlap);
  for (auto& e : two) FLATPEAK_CUDA_CHECK(cudaEventDestroy(e));
}

void check_arena_refusal() {
  const HostMemoryLimits limits = read_host_memory_limits();
  if (limits.mem_available_bytes < 0) return;
  const int64_t too_much = limits.mem_available_bytes * 2;
  bool refused = false;
  try {
    PinnedArena arena({too_much, false, 256});
  } catch (const BackendError& e) {
    refused = std::string(e.what()).find("available") != std::string::npos;
  }
  expect_equal("arena/refused_too_large", std::vector<int>{refused ? 1 : 0}, std::vector<int>{1});
}

}  // namespace

int main() {
  if (const int rc = skip_unless_device(); rc != 0) return rc;
  try {
    DeviceAllocator alloc;
    run_variant(alloc, false, 0, 1, false);
    run_variant(alloc, true, 65536, 1, false);
    run_variant(alloc, true, 65536, 2, true);
    run_variant(alloc, true, 100000, 3, false);
    check_step_refusals(alloc);
    check_arena_refusal();
  } catch (const std::exception& e) {
    std::printf("FAIL: %s\n", e.what());
    return 1;
  }
  return finish();
}
