// OffloadStreamAdamW and serial offload on CUDA (offload_adamw_cuda.h).
#include "executor/cuda/offload_adamw_cuda.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "executor/cuda/cuda_check.h"

namespace flatpeak::cuda {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

int64_t aligned(int64_t bytes, int64_t a) { return (bytes + a - 1) / a * a; }

int64_t staging_elems(const OffloadAdamWConfig& c) {
  return c.stream ? static_cast<int64_t>(c.depth) * c.bucket_elems : c.elems;
}

void check_config(const OffloadAdamWConfig& c) {
  if (c.elems < 0) throw std::invalid_argument("offload_adamw: elems must be >= 0");
  if (c.stream && (c.bucket_elems <= 0 || c.depth < 1))
    throw std::invalid_argument("offload_adamw: stream needs bucket_elems > 0 and depth >= 1 (got " +
                                std::to_string(c.bucket_elems) + ", " + std::to_string(c.depth) + ")");
  if (c.cpu_threads < 1) throw std::invalid_argument("offload_adamw: cpu_threads must be >= 1");
}

// The checks the call can make on its buffers (offload_adamw_cuda.h). The H2D copies write
// d_params bucket by bucket while later buckets of d_grads are still to come down: the two
// ranges must not overlap.
void check_buffers(const OffloadAdamWConfig& c, const exec::Bf16* d_grads, const exec::Bf16* d_params,
                   const OffloadAdamWHost& h) {
  if (d_grads == nullptr || d_params == nullptr)
    throw std::invalid_argument("offload_adamw: d_grads and d_params must be device buffers of " + std::to_string(c.elems) +
                                " bf16 elements (got a null pointer)");
  if (h.master == nullptr || h.m == nullptr || h.v == nullptr || h.grad_staging == nullptr || h.param_staging == nullptr)
    throw std::invalid_argument("offload_adamw: the host buffers must be carved (carve_offload_adamw_host)");
  const auto begin_of = [](const exec::Bf16* p) { return reinterpret_cast<uintptr_t>(p); };
  const uintptr_t bytes = static_cast<uintptr_t>(c.elems) * 2;
  if (begin_of(d_grads) < begin_of(d_params) + bytes && begin_of(d_params) < begin_of(d_grads) + bytes)
    throw std::invalid_argument("offload_adamw: d_grads and d_params overlap (each [" + std::to_string(c.elems) +
                                "] bf16); the parameter uploads would overwrite gradients not yet copied down");
}

// The CPU step of elements [begin, begin + count) of the shard, reading grads from `grads`.
void cpu_step(const OffloadAdamWConfig& c, const OffloadAdamWHost& h, int64_t begin, int64_t count,
              const exec::Bf16* grads, exec::Bf16* params_out) {
  exec::AdamWArgs a = c.hyper;
  a.master = h.master + begin;
  a.m = h.m + begin;
  a.v = h.v + begin;
  a.grad = grads;
  a.grad_dtype = exec::DType::BF16;
  a.param_out = params_out;
  a.elems = count;
  exec::adamw_step_cpu_threaded(a, c.cpu_threads);
}

// An event pair around one copy, for its time.
struct TimedCopy {
  cudaEvent_t start = nullptr, done = nullptr;
  TimedCopy() {
    FLATPEAK_CUDA_CHECK(cudaEventCreate(&start));
    FLATPEAK_CUDA_CHECK(cudaEventCreate(&done));
  }
  ~TimedCopy() {
    (void)cudaEventDestroy(start);
    (void)cudaEventDestroy(done);
  }
  TimedCopy(const TimedCopy&) = delete;
  TimedCopy& operator=(const TimedCopy&) = delete;
  double seconds() const {
    float ms = 0.0f;
    FLATPEAK_CUDA_CHECK(cudaEventElapsedTime(&ms, start, done));
    return ms / 1000.0;
  }
};

}  // namespace

int64_t offload_adamw_host_bytes(const OffloadAdamWConfig& c, int64_t alignment_bytes) {
  check_config(c);
  return 3 * aligned(c.elems * 4, alignment_bytes) + 2 * aligned(staging_elems(c) * 2, alignment_bytes);
}

OffloadAdamWHost carve_offload_adamw_host(PinnedArena& arena, const OffloadAdamWConfig& c) {
  check_config(c);
  OffloadAdamWHost h;
  h.master = arena.carve<float>(c.elems, exec::Category::Optimizer);
  h.m = arena.carve<float>(c.elems, exec::Category::Optimizer);
  h.v = arena.carve<float>(c.elems, exec::Category::Optimizer);
  h.grad_staging = arena.carve<exec::Bf16>(staging_elems(c), exec::Category::Optimizer);
  h.param_staging = arena.carve<exec::Bf16>(staging_elems(c), exec::Category::Optimizer);
  return h;
}

OffloadAdamWTimes offload_adamw_step_cuda(const OffloadAdamWConfig& c, const exec::Bf16* d_grads,
                                          exec::Bf16* d_params, const OffloadAdamWHost& h,
                                          cudaStream_t d2h, cudaStream_t h2d,
                                          const std::vector<cudaEvent_t>* grads_ready) {
  check_config(c);
  OffloadAdamWTimes t;
  const Clock::time_point t0 = Clock::now();
  if (c.elems == 0) return t;
  check_buffers(c, d_grads, d_params, h);

  if (!c.stream) {  // serial: every grad down, one CPU step, every param up
    // One event for the whole vector: with more, the D2H would wait for the first alone.
    if (grads_ready && grads_ready->size() != 1)
      throw std::invalid_argument("offload_adamw: serial offload waits for one grads_ready event (got " +
                                  std::to_string(grads_ready->size()) + ")");
    if (grads_ready) FLATPEAK_CUDA_CHECK(cudaStreamWaitEvent(d2h, grads_ready->front(), 0));
    TimedCopy down, up;
    FLATPEAK_CUDA_CHECK(cudaEventRecord(down.start, d2h));
    FLATPEAK_CUDA_CHECK(cudaMemcpyAsync(h.grad_staging, d_grads, static_cast<size_t>(c.elems) * 2, cudaMemcpyDeviceToHost, d2h));
    FLATPEAK_CUDA_CHECK(cudaEventRecord(down.done, d2h));
    FLATPEAK_CUDA_CHECK(cudaEventSynchronize(down.done));
    const Clock::time_point cpu0 = Clock::now();
    cpu_step(c, h, 0, c.elems, h.grad_staging, h.param_staging);
    t.cpu_s = seconds_since(cpu0);
    FLATPEAK_CUDA_CHECK(cudaEventRecord(up.start, h2d));
    FLATPEAK_CUDA_CHECK(cudaMemcpyAsync(d_params, h.param_staging, static_cast<size_t>(c.elems) * 2, cudaMemcpyHostToDevice, h2d));
    FLATPEAK_CUDA_CHECK(cudaEventRecord(up.done, h2d));
    FLATPEAK_CUDA_CHECK(cudaEventSynchronize(up.done));
    t.d2h_s = down.seconds();
    t.h2d_s = up.seconds();
    t.buckets = 1;
    t.total_s = seconds_since(t0);
    return t;
  }

  const int64_t buckets = (c.elems + c.bucket_elems - 1) / c.bucket_elems;
  if (grads_ready && static_cast<int64_t>(grads_ready->size()) != buckets)
    throw std::invalid_argument("offload_adamw: grads_ready needs one event per bucket (" + std::to_string(buckets) + ")");
  const int slots = c.depth;
  std::vector<TimedCopy> down(static_cast<size_t>(buckets)), up(static_cast<size_t>(buckets));
  auto bucket_begin = [&](int64_t b) { return b * c.bucket_elems; };
  auto bucket_count = [&](int64_t b) { return std::min(c.bucket_elems, c.elems - bucket_begin(b)); };
  auto slot_of = [&](int64_t b) { return static_cast<int64_t>(b % slots) * c.bucket_elems; };
  auto enqueue_down = [&](int64_t b) {
    if (grads_ready) FLATPEAK_CUDA_CHECK(cudaStreamWaitEvent(d2h, (*grads_ready)[static_cast<size_t>(b)], 0));
    TimedCopy& e = down[static_cast<size_t>(b)];
    FLATPEAK_CUDA_CHECK(cudaEventRecord(e.start, d2h));
    FLATPEAK_CUDA_CHECK(cudaMemcpyAsync(h.grad_staging + slot_of(b), d_grads + bucket_begin(b),
                                        static_cast<size_t>(bucket_count(b)) * 2, cudaMemcpyDeviceToHost, d2h));
    FLATPEAK_CUDA_CHECK(cudaEventRecord(e.done, d2h));
  };
  for (int64_t b = 0; b < std::min<int64_t>(slots, buckets); ++b) enqueue_down(b);
  for (int64_t b = 0; b < buckets; ++b) {
    FLATPEAK_CUDA_CHECK(cudaEventSynchronize(down[static_cast<size_t>(b)].done));
    // The params slot is free once the H2D of the bucket that used it last has completed.
    if (b >= slots) FLATPEAK_CUDA_CHECK(cudaEventSynchronize(up[static_cast<size_t>(b - slots)].done));
    const Clock::time_point cpu0 = Clock::now();
    cpu_step(c, h, bucket_begin(b), bucket_count(b), h.grad_staging + slot_of(b), h.param_staging + slot_of(b));
    t.cpu_s += seconds_since(cpu0);
    TimedCopy& e = up[static_cast<size_t>(b)];
    FLATPEAK_CUDA_CHECK(cudaEventRecord(e.start, h2d));
    FLATPEAK_CUDA_CHECK(cudaMemcpyAsync(d_params + bucket_begin(b), h.param_staging + slot_of(b),
                                        static_cast<size_t>(bucket_count(b)) * 2, cudaMemcpyHostToDevice, h2d));
    FLATPEAK_CUDA_CHECK(cudaEventRecord(e.done, h2d));
    // The grads slot was read by the step above: the next bucket for it may come down now.
    if (b + slots < buckets) enqueue_down(b + slots);
  }
  FLATPEAK_CUDA_CHECK(cudaEventSynchronize(up[static_cast<size_t>(buckets - 1)].done));
  for (int64_t b = 0; b < buckets; ++b) {
    t.d2h_s += down[static_cast<size_t>(b)].seconds();
    t.h2d_s += up[static_cast<size_t>(b)].seconds();
  }
  t.buckets = buckets;
  t.total_s = seconds_since(t0);
  return t;
}

}  // namespace flatpeak::cuda
