// The CUDA schedules against their CPU twins at small shapes. Vocab (materialised, blocked with
// gradients in forward, blocked with recompute): the same phase names and the same tracked vocab
// peak bytes as run_vocab_schedule on a TrackingAllocator of the same alignment, the mean loss
// within fp32 (blocked) or bf16-logits (materialised) tolerance, and the device's tracked
// high-water less the cuBLAS workspace equal to vocab_schedule_cuda_peak_bytes (the figure the
// benchmark checks free memory against). Dispatch: capped rounds and one uncapped round give the
// same forward output (sum, fp32-atomics order aside), the capped run holds fewer dispatch bytes,
// and dispatch_schedule_cuda_peak_bytes covers the tracked high-water.
// Exit 77 (skipped) without a CUDA device.
#include <algorithm>
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "cuda_test_util.h"
#include "executor/cuda/cublas_context.h"
#include "executor/cuda/dispatch_schedule_cuda.h"
#include "executor/cuda/vocab_schedule_cuda.h"
#include "executor/memory/tracking_allocator.h"
#include "executor/schedules/vocab_schedule.h"

using namespace flatpeak;
using namespace flatpeak::exec;
using namespace flatpeak::cuda;
using namespace flatpeak::cuda::test;

namespace {

constexpr int64_t kAlign = 256;

int64_t vocab_peak(const std::vector<PhaseRecord>& records) {
  int64_t peak = 0;
  for (const PhaseRecord& r : records)
    if (r.space == MemorySpace::Device)
      peak = std::max(peak, r.category_peak_bytes[static_cast<size_t>(Category::Vocab)]);
  return peak;
}

std::string phase_names(const std::vector<PhaseRecord>& records) {
  std::string out;
  for (const PhaseRecord& r : records)
    if (r.space == MemorySpace::Device && !r.phase.empty()) out += r.phase + ",";
  return out;
}

void check_vocab(const char* name, VocabScheduleMode mode, bool gif) {
  VocabScheduleConfig c;
  c.tokens = 300;  // not a multiple of the token block
  c.hidden = 64;
  c.vocab = 1000;  // not a multiple of the vocab block
  c.token_block_rows = 64;
  c.vocab_block_rows = 256;
  c.mode = mode;
  c.gradients_in_forward = gif;
  // W inside a head unit as a step gathers it: the final norm's [H] before it, a head bias [V] after.
  c.head_unit_before_w = c.hidden;
  c.head_unit_after_w = c.vocab;
  c.head_bias = true;  // and the logits use it
  TrackingAllocator host_alloc({kAlign});
  const VocabScheduleResult want = run_vocab_schedule(host_alloc, c);

  cudaStream_t s = nullptr;
  FLATPEAK_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  {
    DeviceAllocator alloc({kAlign});
    CublasContext blas(alloc, s);
    const int64_t workspace = alloc.live_bytes();  // the cuBLAS workspace
    alloc.reset_records();
    const VocabScheduleCudaResult got = run_vocab_schedule_cuda(alloc, blas, c);
    const std::string n(name);
    expect_close(n + "/mean_loss", {static_cast<float>(got.mean_loss)}, {static_cast<float>(want.mean_loss)},
                 mode == VocabScheduleMode::Blocked ? Tol{1e-5, 0.0} : Tol{2e-3, 0.0});
    expect_equal(n + "/vocab_peak_bytes", std::vector<int64_t>{vocab_peak(alloc.phase_records())},
                 std::vector<int64_t>{vocab_peak(host_alloc.phase_records())});
    const std::string got_phases = phase_names(alloc.phase_records()), want_phases = phase_names(host_alloc.phase_records());
    std::printf("  %s phases: %s\n", name, got_phases.c_str());
    expect_equal(n + "/phase_names", std::vector<int>{got_phases == want_phases ? 1 : 0}, std::vector<int>{1});
    expect_equal(n + "/peak_bytes_estimate", std::vector<int64_t>{alloc.high_water_bytes() - workspace},
                 std::vector<int64_t>{vocab_schedule_cuda_peak_bytes(c, kAlign)});
    const bool timed = got.seconds > 0.0 && got.forward_s > 0.0 && got.backward_s >= 0.0;
    expect_equal(n + "/timed", std::vector<int>{timed ? 1 : 0}, std::vector<int>{1});
  }
  FLATPEAK_CUDA_CHECK(cudaStreamDestroy(s));
}

void check_dispatch() {
  DispatchScheduleConfig c;
  c.tokens = 256;
  c.hidden = 64;
  c.experts = 8;
  c.top_k = 2;
  c.ffn = 32;
  const std::vector<int32_t> ids = balanced_topk_ids(c.tokens, c.experts, c.top_k, c.seed);
  cudaStream_t s = nullptr;
  FLATPEAK_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  {
    DeviceAllocator alloc({kAlign});
    CublasContext blas(alloc, s);
    const int64_t workspace = alloc.live_bytes();
    auto run = [&](int64_t cap, int64_t& dispatch_peak, int64_t& high) {
      c.chunk_cap_rows = cap;
      alloc.reset_records();
      const DispatchScheduleCudaResult r = run_dispatch_schedule_cuda(alloc, blas, c, ids);
      dispatch_peak = 0;
      for (const PhaseRecord& rec : alloc.phase_records())
        dispatch_peak = std::max(dispatch_peak, rec.category_peak_bytes[static_cast<size_t>(Category::Dispatch)]);
      high = alloc.high_water_bytes() - workspace;
      return r;
    };
    int64_t unc_peak = 0, unc_high = 0, cap_peak = 0, cap_high = 0;
    const DispatchScheduleCudaResult unc = run(0, unc_peak, unc_high);
    const DispatchScheduleCudaResult cap = run(100, cap_peak, cap_high);
    expect_equal("dispatch/rounds", std::vector<int64_t>{unc.rounds, cap.rounds},
                 std::vector<int64_t>{1, (c.tokens * c.top_k + 99) / 100});
    expect_close("dispatch/out_sum capped vs uncapped", {static_cast<float>(cap.out_sum)},
                 {static_cast<float>(unc.out_sum)}, Tol{1e-3, 0.0});
    expect_equal("dispatch/capped holds fewer dispatch bytes", std::vector<int>{cap_peak < unc_peak ? 1 : 0},
                 std::vector<int>{1});
    c.chunk_cap_rows = 0;
    const int64_t est_unc = dispatch_schedule_cuda_peak_bytes(c, kAlign);
    c.chunk_cap_rows = 100;
    const int64_t est_cap = dispatch_schedule_cuda_peak_bytes(c, kAlign);
    std::printf("  dispatch high-water %lld / %lld bytes, estimates %lld / %lld (uncapped / capped)\n",
                static_cast<long long>(unc_high), static_cast<long long>(cap_high), static_cast<long long>(est_unc),
                static_cast<long long>(est_cap));
    expect_equal("dispatch/estimate covers the high-water",
                 std::vector<int>{est_unc >= unc_high && est_cap >= cap_high ? 1 : 0}, std::vector<int>{1});
  }
  FLATPEAK_CUDA_CHECK(cudaStreamDestroy(s));
}

}  // namespace

int main() {
  if (const int rc = skip_unless_device(); rc != 0) return rc;
  try {
    check_vocab("vocab/materialised", VocabScheduleMode::Materialized, false);
    check_vocab("vocab/blocked_gif", VocabScheduleMode::Blocked, true);
    check_vocab("vocab/blocked_recompute", VocabScheduleMode::Blocked, false);
    check_dispatch();
  } catch (const std::exception& e) {
    std::printf("FAIL: %s\n", e.what());
    return 1;
  }
  return finish();
}
