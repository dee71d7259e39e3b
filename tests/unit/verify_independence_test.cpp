// Verify's independence of prediction and measurement (DESIGN.md "Independence of prediction and
// measurement"): (a) a plan stripped of its predictions verifies identically; (b) one predicted
// term raised by 2 % fails the verdict; (c) the memory verify uses outside the TrackingAllocator
// (untracked heap) stays under 1 MiB + 1 % of the measured peak, so measured peaks miss nothing.
//
// Untracked heap, how it is measured: this binary replaces the global operator new/delete. The
// TrackingAllocator takes every buffer with the aligned `operator new(size, align_val_t)`; the
// replacement counts the bytes those blocks hold (malloc_usable_size) as "tracked live". Heap in
// use is glibc's mallinfo2() uordblks + hblkhd (all arenas, every malloc user: std containers,
// Eigen, JSON, the planner), sampled at every aligned allocation (the executor allocates at its
// phase changes, where its live set peaks) and by a sampling thread every 100 µs. Untracked heap
// = heap in use − tracked live − heap in use before the run; the test reports its high-water.
// mallinfo2 counts blocks a thread freed into its tcache as in use and sums the arenas one by one,
// so ctest runs this binary with GLIBC_TUNABLES=glibc.malloc.tcache_count=0:glibc.malloc.arena_max=1
// (tests/CMakeLists.txt); run by hand without them, the figures include the threads' caches (a few
// MB on 8 ranks) and the test says so.
// Not built under ASan (its allocator replaces malloc and new); (a) and (b) run there.
#include <gtest/gtest.h>
#include <malloc.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <numeric>
#include <new>
#include <string>
#include <thread>
#include <vector>

#include "executor/schedules/checkpoint_schedule.h"
#include "executor/schedules/layer_schedule.h"
#include "executor/schedules/step_schedule.h"
#include "plan.h"
#include "run_spec.h"
#include "spec/errors.h"
#include "spec/hardware_loader.h"
#include "spec/model_loader.h"
#include "verify_common.h"
#include "verify_config.h"
#include "verify_ranks.h"
#include "verify_run.h"

// Under ASan its own operator new/delete stay in place (replacing them trips its alloc-dealloc
// checks) and mallinfo2 does not see its heap: the untracked-heap test is not built there.
#if !defined(__SANITIZE_ADDRESS__)
namespace {

std::atomic<int64_t> g_tracked_live{0};     // bytes held by aligned operator new blocks
std::atomic<bool> g_metering{false};
std::atomic<int64_t> g_untracked_high{0};   // high-water of (heap in use − tracked live)

int64_t heap_in_use() {
  const struct mallinfo2 mi = mallinfo2();
  return static_cast<int64_t>(mi.uordblks + mi.hblkhd);
}

// Held while a tracked block is allocated or freed and its bytes counted, and while sampling, so a
// sample never sees a block in the heap but not yet (or no longer) in g_tracked_live.
std::mutex g_heap_mutex;

void sample_locked() {
  const int64_t untracked = heap_in_use() - g_tracked_live.load();
  if (untracked > g_untracked_high.load()) g_untracked_high = untracked;
}

void sample() {
  std::lock_guard<std::mutex> lock(g_heap_mutex);
  sample_locked();
}

// Out of line, so that g++ does not pair the replaced operator delete's free() with a new-expression.
__attribute__((noinline)) void heap_free(void* p) { std::free(p); }

void* aligned_new(std::size_t size, std::align_val_t align) {
  void* p = nullptr;
  const std::size_t a = std::max(static_cast<std::size_t>(align), sizeof(void*));
  std::lock_guard<std::mutex> lock(g_heap_mutex);
  if (posix_memalign(&p, a, size == 0 ? 1 : size) != 0) throw std::bad_alloc();
  g_tracked_live += static_cast<int64_t>(malloc_usable_size(p));
  if (g_metering.load(std::memory_order_relaxed)) sample_locked();
  return p;
}

void aligned_delete(void* p) {
  if (p == nullptr) return;
  std::lock_guard<std::mutex> lock(g_heap_mutex);
  g_tracked_live -= static_cast<int64_t>(malloc_usable_size(p));
  heap_free(p);
}

}  // namespace

// Plain new/delete go to malloc (as glibc's own do); aligned ones are the TrackingAllocator's.
void* operator new(std::size_t size) {
  void* p = std::malloc(size == 0 ? 1 : size);
  if (p == nullptr) throw std::bad_alloc();
  return p;
}
void* operator new[](std::size_t size) { return operator new(size); }
void operator delete(void* p) noexcept { heap_free(p); }
void operator delete[](void* p) noexcept { heap_free(p); }
void operator delete(void* p, std::size_t) noexcept { heap_free(p); }
void operator delete[](void* p, std::size_t) noexcept { heap_free(p); }
void* operator new(std::size_t size, std::align_val_t align) { return aligned_new(size, align); }
void* operator new[](std::size_t size, std::align_val_t align) { return aligned_new(size, align); }
void operator delete(void* p, std::align_val_t) noexcept { aligned_delete(p); }
void operator delete[](void* p, std::align_val_t) noexcept { aligned_delete(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { aligned_delete(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { aligned_delete(p); }
#endif  // !__SANITIZE_ADDRESS__

namespace flatpeak::cli {
namespace {

using Flags = std::vector<std::pair<std::string, std::string>>;

nlohmann::json make_plan_json(const Flags& flags) {
  const ModelSpec model = load_model("Qwen3-30B-A3B");
  const HardwareSpec hardware = load_hardware("H200");
  InputErrors errs;
  const planner::RunSpec spec = planner::parse_run_flags(flags, errs);
  errs.throw_if_any();
  return nlohmann::json::parse(planner::plan_to_json(planner::make_plan(model, hardware, spec)).dump());
}

nlohmann::json stripped(nlohmann::json plan) {
  for (const char* key : {"peaks", "timeline", "time", "baseline", "diagnosis", "gpu", "host", "routing"}) plan.erase(key);
  return plan;
}

// Everything a report says, as text (rows with their ranks, dloss, dgrad, notes, trace).
std::string report_text(const VerifyReport& r) {
  return report_rows_to_text(r) + r.measured_trace.dump() + nlohmann::json(r.notes).dump() + (r.pass ? "pass" : "fail");
}

// (a) holds at any scale: it runs at --scale 512 (T = 128, H = 8), about a tenth of --scale
// auto's time, so that it stays well under a minute under ASan (auto took 226 s there). (b) needs
// the honest vocab prediction within 1 %, which the 512 B alignment spoils at H = 8: it runs at
// --scale auto on one rank (--max-ranks 1) instead of 8 (71 s under ASan). (c) measures at
// --scale auto, the scale its limit is stated for.
constexpr double kFastScale = 512.0;

const std::vector<Flags> kPlans = {
    {{"--gpus", "8"}, {"--context", "64K"}, {"--schedule", "baseline"}},
    {{"--gpus", "8"}, {"--context", "64K"}, {"--schedule", "practice"}},
    {{"--gpus", "8"}, {"--context", "64K"}, {"--schedule", "flatpeak"}},
};

// The components to run on plan i: vocab on every schedule, every implemented one on flatpeak
// (the last plan), to keep the test short.
std::vector<std::string> components_for(size_t plan_index) {
  if (plan_index + 1 == kPlans.size()) return verify_components();
  return {"vocab"};
}

TEST(VerifyIndependence, StrippedPlanVerifiesIdentically) {
  ASSERT_FALSE(verify_components().empty());
  for (size_t i = 0; i < kPlans.size(); ++i) {
    const nlohmann::json full = make_plan_json(kPlans[i]);
    ASSERT_TRUE(full.contains("timeline") && full.contains("peaks"));
    const VerifyInputs in_full = read_plan_inputs(full, "plan.json");
    const VerifyInputs in_bare = read_plan_inputs(stripped(full), "plan.json");
    const ScaledConfig s_full = scale_config(in_full, kFastScale, 8);
    const ScaledConfig s_bare = scale_config(in_bare, kFastScale, 8);
    for (const auto& component : components_for(i)) {
      const VerifyReport a = run_verification(in_full, s_full, {component}, 0.01);
      const VerifyReport b = run_verification(in_bare, s_bare, {component}, 0.01);
      ASSERT_FALSE(a.rows.empty()) << component;
      EXPECT_EQ(report_text(a), report_text(b)) << component << " " << kPlans[i][2].second;
    }
  }
}

TEST(VerifyIndependence, StrippedPlanVerifiesIdenticallyOnFourDispatchRanks) {
  const nlohmann::json full = make_plan_json({{"--gpus", "4"}, {"--ep", "4"}, {"--context", "64K"}, {"--schedule", "flatpeak"}, {"--imbalance", "rho=2.5"}});
  const VerifyInputs in_full = read_plan_inputs(full, "plan.json");
  const VerifyInputs in_bare = read_plan_inputs(stripped(full), "plan.json");
  const ScaledConfig s = scale_config(in_full, std::nullopt, 8);
  const VerifyReport a = run_component_on_ranks(verify_dispatch_ranks, in_full, s, nullptr, 4, nullptr);
  const VerifyReport b = run_component_on_ranks(verify_dispatch_ranks, in_bare, scale_config(in_bare, std::nullopt, 8), nullptr, 4, nullptr);
  ASSERT_FALSE(a.rows.empty());
  EXPECT_EQ(report_text(a), report_text(b));
}

// Raises the column `category` of the phase where it peaks by 2 %.
PredictionAdjust raise_peak_term(const std::string& category, double factor) {
  return [category, factor](nlohmann::ordered_json& timeline) {
    nlohmann::ordered_json* worst = nullptr;
    for (auto& phase : timeline["phases"])
      if (phase.contains("device") && phase["device"].contains(category) &&
          (worst == nullptr || phase["device"][category].get<int64_t>() > (*worst)["device"][category].get<int64_t>()))
        worst = &phase;
    ASSERT_NE(worst, nullptr);
    const int64_t bytes = (*worst)["device"][category].get<int64_t>();
    (*worst)["device"][category] = static_cast<int64_t>(static_cast<double>(bytes) * factor);
  };
}

TEST(VerifyIndependence, OnePredictedTermRaisedTwoPercentFails) {
  for (const auto& flags : kPlans) {
    const VerifyInputs in = read_plan_inputs(make_plan_json(flags), "plan.json");
    const ScaledConfig s = scale_config(in, std::nullopt, 1);
    const VerifyReport honest = run_verification(in, s, {"vocab"}, 0.01);
    ASSERT_TRUE(honest.pass) << flags[2].second;  // the unadjusted prediction passes ...
    const VerifyReport raised = run_verification(in, s, {"vocab"}, 0.01, raise_peak_term("vocab", 1.02));
    EXPECT_FALSE(raised.pass) << flags[2].second;  // ... and 2 % more on one term does not
    double worst = 0.0;
    for (const auto& row : raised.rows) worst = std::max(worst, std::fabs(row.relative_error));
    EXPECT_GT(worst, 0.015);
  }
}

#if !defined(__SANITIZE_ADDRESS__)  // the heap meter (above) exists only without ASan
struct HeapMeter {
  int64_t before = 0;
  std::atomic<bool> stop{false};
  std::thread sampler;
  HeapMeter() {
    before = heap_in_use() - g_tracked_live.load();
    g_untracked_high = before;
    g_metering = true;
    sampler = std::thread([this] {
      while (!stop.load()) {
        sample();
        std::this_thread::sleep_for(std::chrono::microseconds(100));
      }
    });
  }
  int64_t high_water_above_start() {
    stop = true;
    sampler.join();
    g_metering = false;
    sample();
    return g_untracked_high.load() - before;
  }
};

int64_t measured_peak(const VerifyReport& r) {
  int64_t peak = 0;
  for (const auto& row : r.rows) peak = std::max(peak, row.measured_bytes);
  return peak;
}

// The copies of the outputs verify keeps to compare a technique with its naive reference are
// verify's own data, not the schedule's working memory; they are allowed on top of the limit, and
// printed. Per component, from the scaled configuration, on each of the `ranks` that ran it:
//   vocab (blocked, or Ring-DTP on rings of one rank): VocabScheduleResult d_x [T, H] and d_w
//     [V, H] fp32, of both runs, per rank;
//   vocab (Ring-DTP on rings of R > 1 ranks): the reference's values of each rank's slice, d_x
//     [T, H] and d_w [ceil(V/R), H] fp32, per rank, and the whole reference (d_x [R·T, H], d_w
//     [V, H] fp32) on rank 0 while it is cut into them (the ring hands its own results to the
//     comparison through RingDtpConfig::result_sink, no copy);
//   checkpoint: CheckpointScheduleResult d_input [T, H] and every weight gradient as bf16 bits, of
//     both runs;
//   layer: LayerScheduleResult grads (x [T, H] and every weight) as bf16 bits, of both runs (the
//     inputs are drawn into the tracked buffers, no copy);
//   step: the reference's reduced grads and updated params of the rank's shard, [P] fp32 each (P:
//     rank 0's, the largest; the measured step hands its own to the comparison through
//     StepScheduleConfig::result_sink, no copy; on N ranks the naive grads are exchanged a chunk
//     at a time, no [P] of the whole model is kept).
const PredictionAdjust kNoAdjust;

int64_t comparison_copies_bytes_per_rank(const std::string& component, const VerifyInputs& in, const ScaledConfig& s, int64_t ranks) {
  if (component == "checkpoint") {
    exec::CheckpointScheduleConfig c;
    c.hidden = s.hidden;
    c.layers = s.layers;
    return 2 * 2 * (s.tokens * s.hidden + exec::checkpoint_weight_gradient_elements(c));
  }
  if (component == "step") return 2 * 4 * step_setup(VerifyContext{in, s, kNoAdjust}, ranks).params;
  if (component == "layer")
    return 2 * 2 * exec::layer_gradient_elements(layer_schedule_config(in, s));
  if (component != "vocab" || in.vocab_mode == "materialized") return 0;
  return 2 * 4 * (s.tokens * s.hidden + s.vocab * s.hidden);
}

int64_t comparison_copies_bytes(const std::string& component, const VerifyInputs& in, const ScaledConfig& s, int64_t ranks) {
  const int64_t R = std::gcd(in.ring_size, ranks);  // verify_vocab_ring.cpp's ring
  if (component == "vocab" && in.vocab_mode == "ring-dtp" && ranks > 1 && in.ring_size > 1 && R > 1) {
    const int64_t shard = (s.vocab + R - 1) / R;
    return ranks * 4 * (s.tokens * s.hidden + shard * s.hidden) + 4 * (R * s.tokens * s.hidden + s.vocab * s.hidden);
  }
  return ranks * comparison_copies_bytes_per_rank(component, in, s, ranks);  // each rank keeps its own
}

// Thread ranks share this process's heap: the limit holds per rank, so a component that ran on
// every rank is allowed ranks × (1 MiB + 1 % of the peak). One that ran on rank 0 alone says so in
// a note (verify_run.cpp).
int64_t ranks_in_process(const VerifyReport& r, const std::string& component) {
  for (const auto& note : r.notes)
    if (note.rfind(component + ": no multi-rank run", 0) == 0) return 1;
  return r.ranks;
}

// The components whose untracked heap is checked: every one. (layer and step were not until their
// inputs were drawn into tracked buffers and their results kept as above; executor/README.md
// lists the figures.)
bool heap_checked(const std::string& component) {
  return component == "vocab" || component == "dispatch" || component == "optimizer" || component == "checkpoint" ||
         component == "layer" || component == "step";
}

TEST(VerifyIndependence, UntrackedHeapStaysSmall) {
  const char* tunables = std::getenv("GLIBC_TUNABLES");
  if (tunables == nullptr || std::string(tunables).find("glibc.malloc.tcache_count=0") == std::string::npos)
    std::printf("note: GLIBC_TUNABLES lacks glibc.malloc.tcache_count=0: the figures include the threads' tcaches\n");
  for (size_t i = 0; i < kPlans.size(); ++i) {
    const VerifyInputs in = read_plan_inputs(make_plan_json(kPlans[i]), "plan.json");
    const ScaledConfig s = scale_config(in, std::nullopt, 8);
    for (const auto& component : components_for(i)) {
      HeapMeter meter;
      const VerifyReport r = run_verification(in, s, {component}, 0.01);
      const int64_t untracked = meter.high_water_above_start();
      const int64_t peak = measured_peak(r);
      const int64_t ranks = ranks_in_process(r, component);
      const int64_t copies = comparison_copies_bytes(component, in, s, ranks);
      const int64_t limit = ranks * ((int64_t{1} << 20) + peak / 100);
      std::printf("%s %s: untracked heap high-water %lld B on %lld rank(s), measured peak %lld B, limit %lld B (+ %lld B of output copies)%s\n",
                  kPlans[i][2].second.c_str(), component.c_str(), static_cast<long long>(untracked), static_cast<long long>(ranks),
                  static_cast<long long>(peak), static_cast<long long>(limit), static_cast<long long>(copies),
                  heap_checked(component) ? "" : " (not checked)");
      if (heap_checked(component)) {
        EXPECT_LE(untracked, limit + copies) << component << " " << kPlans[i][2].second;
      }
    }
  }
}

#endif  // !__SANITIZE_ADDRESS__
}  // namespace
}  // namespace flatpeak::cli
