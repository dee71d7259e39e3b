// The CUDA checkpoint schedule (SCO on the GPU) against its CPU twin at small shapes (T = 128,
// H = 64, L = 4, layers 0, 1 and 3 offloaded, prefetch 1):
//  - every phase's boundary bytes (at the phase's peak and the category's own peak), device and
//    host, equal to run_checkpoint_schedule's on a TrackingAllocator of the same alignment, for
//    SCO on copy streams and for the copies in line;
//  - offloading moves bytes and the recompute reruns the same kernels, so SCO, in-line offload,
//    kept boundaries and the naive stack (no checkpointing) give the same bits on the GPU;
//  - against the CPU: the loss within 1e-2 relative and every gradient within 5e-2 of the largest
//    (four layers of bf16 outputs rounded on both sides after sums in different orders: a few bf16
//    steps of 2^-8; the ops themselves are checked tightly by the op tests).
// Exit 77 (skipped) without a CUDA device.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <exception>
#include <map>
#include <string>
#include <vector>

#include "cuda_test_util.h"
#include "executor/cuda/checkpoint_schedule_cuda.h"
#include "executor/cuda/cublas_context.h"
#include "executor/memory/tracking_allocator.h"
#include "executor/schedules/checkpoint_schedule.h"

using namespace flatpeak;
using namespace flatpeak::exec;
using namespace flatpeak::cuda;
using namespace flatpeak::cuda::test;

namespace {

constexpr int64_t kAlign = 512;
constexpr auto kBoundaries = static_cast<size_t>(Category::Boundaries);

CheckpointScheduleConfig config() {
  CheckpointScheduleConfig c;
  c.tokens = 128;
  c.hidden = 64;
  c.layers = 4;
  c.offloaded = {true, true, false, true};
  c.prefetch = 1;
  c.seed = 3;
  return c;
}

// Phase → (boundary bytes at the phase's peak, the boundaries' own peak in the phase).
std::map<std::string, std::pair<int64_t, int64_t>> boundary_bytes(const std::vector<PhaseRecord>& records, MemorySpace space) {
  std::map<std::string, std::pair<int64_t, int64_t>> out;
  for (const PhaseRecord& r : records)
    if (r.space == space && !r.phase.empty() && r.phase != "init")
      out[r.phase] = {r.bytes_at_peak[kBoundaries], r.category_peak_bytes[kBoundaries]};
  return out;
}

std::vector<float> widened(const std::vector<uint16_t>& bits) {
  std::vector<float> out(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) out[i] = bf16_value(bits[i]);
  return out;
}

struct CudaRun {
  CheckpointScheduleCudaResult result;
  std::vector<PhaseRecord> records;
};

CudaRun run_cuda(const CheckpointScheduleConfig& c, bool copy_streams) {
  cudaStream_t s = nullptr;
  FLATPEAK_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  CudaRun run;
  {
    DeviceAllocator alloc({kAlign});
    CublasContext blas(alloc, s);
    run.result = run_checkpoint_schedule_cuda(alloc, blas, c, {copy_streams, false});
    run.records = alloc.phase_records();
  }
  FLATPEAK_CUDA_CHECK(cudaStreamDestroy(s));
  return run;
}

void check_bytes(const std::string& name, const CudaRun& got, const TrackingAllocator& want_alloc) {
  const auto want = boundary_bytes(want_alloc.phase_records(), MemorySpace::Device);
  const auto have = boundary_bytes(got.records, MemorySpace::Device);
  int compared = 0, differing = 0;
  for (const auto& [phase, bytes] : want) {
    const auto it = have.find(phase);
    ++compared;
    if (it == have.end() || it->second != bytes) {
      ++differing;
      std::printf("  %s: phase %s boundaries %lld/%lld on the CPU, %s on the GPU\n", name.c_str(), phase.c_str(),
                  static_cast<long long>(bytes.first), static_cast<long long>(bytes.second),
                  it == have.end() ? "missing"
                                   : (std::to_string(it->second.first) + "/" + std::to_string(it->second.second)).c_str());
    }
  }
  expect_true(name + "/device-boundaries", differing == 0 && compared > 0 && have.size() == want.size(),
              std::to_string(compared) + " phases compared, " + std::to_string(differing) + " differ");
  int64_t host_want = 0;
  for (const auto& [phase, bytes] : boundary_bytes(want_alloc.phase_records(), MemorySpace::Host)) host_want = std::max(host_want, bytes.first);
  expect_equal(name + "/host-boundaries", std::vector<int64_t>{got.result.host_boundary_bytes}, std::vector<int64_t>{host_want});
}

}  // namespace

int main() {
  if (const int rc = skip_unless_device(); rc != 0) return rc;
  try {
    const CheckpointScheduleConfig c = config();
    TrackingAllocator cpu_alloc({kAlign});
    const CheckpointScheduleResult cpu = run_checkpoint_schedule(cpu_alloc, c);

    const CudaRun sco = run_cuda(c, true);
    const CudaRun inline_copies = run_cuda(c, false);
    std::printf("  SCO %.3f ms (fwd %.3f, bwd %.3f), pinned %s\n", 1e3 * sco.result.seconds, 1e3 * sco.result.forward_s,
                1e3 * sco.result.backward_s, sco.result.host_pinned ? "yes" : sco.result.fallback_reason.c_str());
    check_bytes("sco", sco, cpu_alloc);
    check_bytes("inline", inline_copies, cpu_alloc);

    CheckpointScheduleConfig kept = c;
    kept.offloaded.clear();
    kept.prefetch = 0;
    CheckpointScheduleConfig naive = kept;
    naive.checkpoint = false;
    const CudaRun kept_run = run_cuda(kept, true), naive_run = run_cuda(naive, true);
    for (const auto& [name, other] : {std::pair<const char*, const CudaRun*>{"inline", &inline_copies}, {"kept", &kept_run},
                                      {"naive", &naive_run}}) {
      expect_equal(std::string("bitwise/sco-vs-") + name + "/d_input", sco.result.values.d_input, other->result.values.d_input);
      expect_equal(std::string("bitwise/sco-vs-") + name + "/d_weights", sco.result.values.d_weights, other->result.values.d_weights);
      expect_equal(std::string("bitwise/sco-vs-") + name + "/loss", std::vector<double>{sco.result.values.loss},
                   std::vector<double>{other->result.values.loss});
    }

    expect_close("cpu/loss", {static_cast<float>(sco.result.values.loss)}, {static_cast<float>(cpu.loss)}, Tol{1e-2, 0.0});
    expect_close("cpu/d_input", widened(sco.result.values.d_input), widened(cpu.d_input), Tol{0.0, 5e-2});
    expect_close("cpu/d_weights", widened(sco.result.values.d_weights), widened(cpu.d_weights), Tol{0.0, 5e-2});
  } catch (const std::exception& e) {
    std::printf("FAIL exception: %s\n", e.what());
    ++g_failures;
  }
  return finish();
}
