// CPU AdamW kernel throughput in GB/s beside this machine's memory bandwidth, measured by the
// same binary with a STREAM-style copy over arrays far larger than the caches.
//   cmake --build build/dev --target adamw_bench && ./build/dev/tools/adamw_bench
//   ./build/dev/tools/adamw_bench --benchmark_filter=AdamW   # FLATPEAK_BENCH_MIB sets the size
// Bytes counted per parameter (STREAM convention: bytes the kernel reads plus bytes it writes,
// no write-allocate): master 4+4, m 4+4, v 4+4, grad 2 (bf16) or 4 (fp32), bf16 param out 2.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "executor/ops/adamw.h"

namespace {

using flatpeak::exec::AdamWArgs;
using flatpeak::exec::Bf16;
using flatpeak::exec::DType;

// Elements per fp32 array: FLATPEAK_BENCH_MIB (default 128 MiB) / 4 bytes.
int64_t array_elems() {
  int64_t mib = 128;
  if (const char* env = std::getenv("FLATPEAK_BENCH_MIB")) mib = std::max<int64_t>(1, std::atoll(env));
  return mib * 1024 * 1024 / 4;
}

// Fills with a first touch by the calling thread, so pages exist before timing.
std::vector<float> filled(int64_t n, float value) {
  return std::vector<float>(static_cast<size_t>(n), value);
}

// Runs body() per iteration, timed by hand so that GB/s can be derived in the counters.
template <class Body>
double timed_loop(benchmark::State& state, Body body) {
  double seconds = 0;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    body();
    const auto t1 = std::chrono::steady_clock::now();
    const double dt = std::chrono::duration<double>(t1 - t0).count();
    state.SetIterationTime(dt);
    seconds += dt;
  }
  return seconds;
}

void set_bandwidth(benchmark::State& state, double bytes_per_iter, double seconds) {
  const double gbps = bytes_per_iter * static_cast<double>(state.iterations()) / seconds / 1e9;
  state.counters["GB/s"] = gbps;
  state.SetBytesProcessed(static_cast<int64_t>(bytes_per_iter) * state.iterations());
}

// STREAM copy: b[i] = a[i], split over `threads` contiguous parts. 8 bytes per element.
void BM_StreamCopy(benchmark::State& state) {
  const int64_t n = array_elems();
  const int threads = static_cast<int>(state.range(0));
  std::vector<float> a = filled(n, 1.0f), b = filled(n, 0.0f);
  const int64_t chunk = (n + threads - 1) / threads;
  const double seconds = timed_loop(state, [&] {
    std::vector<std::thread> pool;
    for (int t = 1; t < threads; ++t) {
      const int64_t begin = std::min(n, t * chunk), len = std::min(n, begin + chunk) - begin;
      pool.emplace_back([&, begin, len] {
        std::memcpy(b.data() + begin, a.data() + begin, static_cast<size_t>(len) * 4);
      });
    }
    std::memcpy(b.data(), a.data(), static_cast<size_t>(std::min(n, chunk)) * 4);
    for (std::thread& th : pool) th.join();
    benchmark::DoNotOptimize(b.data());
    benchmark::ClobberMemory();
  });
  set_bandwidth(state, 8.0 * static_cast<double>(n), seconds);
}

// AdamW over n parameters with fp32 master, m, v, a bf16 or fp32 gradient and a bf16 copy out.
void BM_AdamW(benchmark::State& state, DType grad_dtype) {
  const int64_t n = array_elems();
  const int threads = static_cast<int>(state.range(0));
  std::vector<float> master = filled(n, 0.5f), m = filled(n, 0.0f), v = filled(n, 0.0f);
  std::vector<float> grad32 = filled(grad_dtype == DType::F32 ? n : 0, 1e-3f);
  std::vector<Bf16> grad16(grad_dtype == DType::BF16 ? static_cast<size_t>(n) : 0,
                           flatpeak::exec::f32_to_bf16(1e-3f));
  std::vector<Bf16> param_out(static_cast<size_t>(n));
  AdamWArgs a;
  a.master = master.data(); a.m = m.data(); a.v = v.data(); a.param_out = param_out.data();
  a.grad = grad_dtype == DType::F32 ? static_cast<const void*>(grad32.data()) : grad16.data();
  a.grad_dtype = grad_dtype; a.elems = n; a.weight_decay = 0.01f;
  int64_t step = 0;
  const double seconds = timed_loop(state, [&] {
    a.step = ++step;
    flatpeak::exec::adamw_step_cpu_threaded(a, threads);
    benchmark::ClobberMemory();
  });
  const double bytes_per_param = 24.0 + (grad_dtype == DType::F32 ? 4.0 : 2.0) + 2.0;
  set_bandwidth(state, bytes_per_param * static_cast<double>(n), seconds);
  state.counters["Gparams/s"] =
      static_cast<double>(n) * static_cast<double>(state.iterations()) / seconds / 1e9;
}

void thread_args(benchmark::internal::Benchmark* b) {
  const int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  b->Arg(1);
  if (hw > 1) b->Arg(hw);
  b->ArgName("threads")->UseManualTime()->Unit(benchmark::kMillisecond)->MinTime(0.5);
}

BENCHMARK(BM_StreamCopy)->Apply(thread_args);
BENCHMARK_CAPTURE(BM_AdamW, bf16_grad, DType::BF16)->Apply(thread_args);
BENCHMARK_CAPTURE(BM_AdamW, f32_grad, DType::F32)->Apply(thread_args);

}  // namespace

BENCHMARK_MAIN();
