// Optimizer offload on the CPU backend: OffloadStreamAdamW (D2H, CPU AdamW and H2D on three
// threads, `depth` buckets in flight) against serial offload (each stage over all parameters, one
// after the other) for the same parameter count, and each stage alone.
//   cmake --build build/opt --target offload_bench && ./build/opt/tools/offload_bench
//   FLATPEAK_BENCH_PARAMS=16777216 ./build/opt/tools/offload_bench   # parameters (default 64Mi)
// Each stage alone is the serial schedule's own stage (it runs them one at a time over all P).
// Counters: d2h_s, cpu_s, h2d_s (stage busy seconds), slowest_stage_s; for the stream, also
// pipeline_over_slowest = step time / slowest stage alone (1.0 = perfect overlap) and
// speedup_vs_serial = serial step time / stream step time, both from runs in the same benchmark.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>

#include "executor/memory/tracking_allocator.h"
#include "executor/schedules/optimizer_schedule.h"

namespace {

using flatpeak::exec::OptimizerPlacement;
using flatpeak::exec::OptimizerScheduleConfig;
using flatpeak::exec::OptimizerScheduleResult;

int64_t bench_params() {
  int64_t p = int64_t{64} << 20;
  if (const char* env = std::getenv("FLATPEAK_BENCH_PARAMS")) p = std::max<int64_t>(1, std::atoll(env));
  return p;
}

OptimizerScheduleResult run_once(OptimizerPlacement placement, int cpu_threads, int64_t bucket_params, int64_t depth) {
  flatpeak::exec::TrackingAllocator alloc;
  OptimizerScheduleConfig c;
  c.params = bench_params();
  c.placement = placement;
  c.cpu_threads = cpu_threads;
  c.bucket_params = bucket_params;
  c.bucket_depth = depth;
  c.keep_results = false;
  return run_optimizer_schedule(alloc, c);
}

double slowest_stage(const OptimizerScheduleResult& r) {
  return std::max({r.d2h_busy_seconds, r.cpu_busy_seconds, r.h2d_busy_seconds});
}

void stage_counters(benchmark::State& state, double d2h, double cpu, double h2d, double runs) {
  state.counters["d2h_s"] = d2h / runs;
  state.counters["cpu_s"] = cpu / runs;
  state.counters["h2d_s"] = h2d / runs;
  state.counters["slowest_stage_s"] = std::max({d2h, cpu, h2d}) / runs;
}

// Serial offload: all grads D2H, the whole CPU AdamW, all params H2D. Arg: CPU AdamW threads.
void BM_SerialOffload(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  double d2h = 0, cpu = 0, h2d = 0, runs = 0;
  for (auto _ : state) {
    const OptimizerScheduleResult r = run_once(OptimizerPlacement::Serial, threads, 0, 0);
    state.SetIterationTime(r.seconds);
    d2h += r.d2h_busy_seconds, cpu += r.cpu_busy_seconds, h2d += r.h2d_busy_seconds, runs += 1;
  }
  stage_counters(state, d2h, cpu, h2d, runs);
  state.counters["params"] = static_cast<double>(bench_params());
}

// OffloadStreamAdamW. Args: CPU AdamW threads, bucket parameters, depth. Each iteration also runs
// the serial schedule, whose stages are the stages alone.
void BM_StreamOffload(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  const int64_t bucket = state.range(1), depth = state.range(2);
  double d2h = 0, cpu = 0, h2d = 0, runs = 0, stream_s = 0, serial_s = 0, alone_slowest_s = 0;
  for (auto _ : state) {
    state.PauseTiming();
    const OptimizerScheduleResult serial = run_once(OptimizerPlacement::Serial, threads, 0, 0);
    state.ResumeTiming();
    const OptimizerScheduleResult r = run_once(OptimizerPlacement::Stream, threads, bucket, depth);
    state.SetIterationTime(r.seconds);
    d2h += r.d2h_busy_seconds, cpu += r.cpu_busy_seconds, h2d += r.h2d_busy_seconds, runs += 1;
    stream_s += r.seconds;
    serial_s += serial.seconds;
    alone_slowest_s += slowest_stage(serial);
  }
  stage_counters(state, d2h, cpu, h2d, runs);
  state.counters["params"] = static_cast<double>(bench_params());
  state.counters["serial_s"] = serial_s / runs;
  state.counters["slowest_alone_s"] = alone_slowest_s / runs;
  state.counters["pipeline_over_slowest"] = stream_s / alone_slowest_s;
  state.counters["speedup_vs_serial"] = serial_s / stream_s;
}

void serial_args(benchmark::internal::Benchmark* b) {
  b->Arg(2)->ArgName("threads")->UseManualTime()->Unit(benchmark::kMillisecond)->Iterations(2);
}
void stream_args(benchmark::internal::Benchmark* b) {
  b->Args({2, int64_t{4} << 20, 2})->Args({2, int64_t{1} << 20, 4})->Args({2, int64_t{16} << 20, 2});
  b->ArgNames({"threads", "bucket", "depth"})->UseManualTime()->Unit(benchmark::kMillisecond)->Iterations(2);
}

BENCHMARK(BM_SerialOffload)->Apply(serial_args);
BENCHMARK(BM_StreamOffload)->Apply(stream_args);

}  // namespace

BENCHMARK_MAIN();
