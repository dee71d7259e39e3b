// Planner speed: one knob-searched plan with its baseline, one reach query, sweep rows per
// second, and (for reference) the full plan with its named timeline as `flatpeak plan` prints it.
//   cmake --build build/dev --target planner_bench
//   taskset -c 0 ./build/dev/tools/planner_bench        # one core, as the targets are stated
// Targets (issue 4, one core of a 2-core CI-class machine): a knob-searched plan with its
// baseline <= 0.2 ms; a reach query <= 20 ms; a sweep >= 5,000 knob-searched rows/s. The figures
// are printed by Google Benchmark; planner/README.md ("Speed") keeps the latest.
#include <benchmark/benchmark.h>

#include <string>
#include <vector>

#include "knob_search.h"
#include "reach.h"
#include "spec/hardware_loader.h"
#include "spec/model_loader.h"

namespace {

using namespace flatpeak;
using namespace flatpeak::planner;

const char* const kModels[] = {"gpt-oss-120b", "Qwen3-235B-A22B", "GLM-4.5", "DeepSeek-V3"};

RunSpec spec_of(int64_t gpus, int64_t context, Schedule schedule) {
  RunSpec s;
  s.gpus = gpus;
  s.context_tokens = context;
  s.schedule = schedule;
  return s;
}

// The knob-searched flatpeak plan and its baseline at S = 1M on 64 H200: knobs, peaks and step
// time of both, from a cold cache (expected loads and LLA computed every iteration).
// range(1) = 0: at CP = 1, where only gpt-oss-120b fits (the others add the diagnosis: searches
// at 2..64 x N, --cp auto and unlimited host memory); 1: at the smallest CP at which each fits.
const int64_t kFittingCp[] = {1, 4, 8, 16};

void BM_SearchedPlanWithBaseline(benchmark::State& state) {
  const ModelSpec model = load_model(kModels[state.range(0)]);
  const HardwareSpec hw = load_hardware("H200");
  RunSpec flat = spec_of(64, int64_t{1} << 20, Schedule::Flatpeak);
  RunSpec base = spec_of(64, int64_t{1} << 20, Schedule::Baseline);
  if (state.range(1) == 1) flat.cp = base.cp = kFittingCp[state.range(0)];
  bool fits = false;
  for (auto _ : state) {
    LoadCache cache;
    SearchResult f = search_knobs(model, hw, flat, Efficiency{}, &cache);
    SearchResult b = search_knobs(model, hw, base, Efficiency{}, &cache, SearchOptions{false});
    fits = f.found;
    benchmark::DoNotOptimize(f.time.step_seconds);
    benchmark::DoNotOptimize(b.summary.gpu_peak_bytes);
  }
  state.SetLabel(std::string(kModels[state.range(0)]) + ", CP " + std::to_string(flat.cp.value_or(1)) +
                 (fits ? ", fits" : ", fits nowhere: with its diagnosis"));
}
BENCHMARK(BM_SearchedPlanWithBaseline)->ArgsProduct({{0, 1, 2, 3}, {0, 1}})->Unit(benchmark::kMicrosecond);

// What `flatpeak plan --schedule flatpeak` computes: the search, then the real plan (named
// terms, folded timeline, its baseline) at the chosen knobs.
void BM_MaterializedPlan(benchmark::State& state) {
  const ModelSpec model = load_model(kModels[state.range(0)]);
  const HardwareSpec hw = load_hardware("H200");
  const RunSpec flat = spec_of(64, int64_t{1} << 20, Schedule::Flatpeak);
  for (auto _ : state) {
    Plan p = make_searched_plan(model, hw, flat, Efficiency{});
    benchmark::DoNotOptimize(p.summary.gpu_peak_bytes);
  }
  state.SetLabel(kModels[state.range(0)]);
}
BENCHMARK(BM_MaterializedPlan)->DenseRange(0, 3)->Unit(benchmark::kMicrosecond);

// reach on 64 H200 for baseline (tuned), practice and flatpeak; range(1): 0 = CP 1, 1 = --cp auto.
void BM_Reach(benchmark::State& state) {
  const ModelSpec model = load_model(kModels[state.range(0)]);
  const HardwareSpec hw = load_hardware("H200");
  Query q;
  q.base.gpus = 64;
  q.base.cp_auto = state.range(1) == 1;
  for (auto _ : state) {
    std::vector<Reach> r = reach(model, hw, q);
    benchmark::DoNotOptimize(r[2].max_context_tokens);
  }
  state.SetLabel(std::string(kModels[state.range(0)]) + (q.base.cp_auto ? ", cp auto" : ", cp 1"));
}
BENCHMARK(BM_Reach)->ArgsProduct({{0, 1, 2, 3}, {0, 1}})->Unit(benchmark::kMillisecond);

// sweep rows as `flatpeak sweep` makes them (one LoadCache for the whole grid): the four models
// x H100, H200 x N in {8, 16, 32, 64} x S in {32K, ..., 1M} x flatpeak = 192 rows per iteration.
void BM_SweepRows(benchmark::State& state) {
  std::vector<ModelSpec> models;
  for (const char* m : kModels) models.push_back(load_model(m));
  const HardwareSpec cards[] = {load_hardware("H100-80GB"), load_hardware("H200")};
  int64_t rows = 0;
  for (auto _ : state) {
    LoadCache cache;
    for (const ModelSpec& m : models)
      for (const HardwareSpec& hw : cards)
        for (int64_t n : {8, 16, 32, 64})
          for (int64_t s = 32768; s <= (int64_t{1} << 20); s *= 2) {
            SearchResult r = search_knobs(m, hw, spec_of(n, s, Schedule::Flatpeak), Efficiency{}, &cache, SearchOptions{false});
            benchmark::DoNotOptimize(r.time.step_seconds);
            ++rows;
          }
  }
  state.SetItemsProcessed(rows);
  state.counters["rows/s"] = benchmark::Counter(static_cast<double>(rows), benchmark::Counter::kIsRate);
}
BENCHMARK(BM_SweepRows)->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
