// verify on the CUDA backend (verify_cuda.h): the vocab component on one GPU.
#include "verify_cuda.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <stdexcept>

#include <fmt/format.h>

#include "executor/cuda/backend_error.h"
#include "executor/cuda/cublas_context.h"
#include "executor/cuda/cuda_check.h"
#include "executor/cuda/device_allocator.h"
#include "executor/cuda/vocab_schedule_cuda.h"
#include "verify_common.h"

namespace flatpeak::cli {

namespace {

double gib(int64_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0 * 1024.0); }
// Room left free beside a run's own peak: the CUDA context's later growth and cuBLAS's kernels.
constexpr int64_t kFreeMarginBytes = int64_t{1} << 30;

// A non-blocking stream owned by this scope.
class Stream {
 public:
  Stream() { FLATPEAK_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking)); }
  ~Stream() { (void)cudaStreamDestroy(stream_); }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  cudaStream_t get() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

int64_t free_device_bytes() {
  size_t free_bytes = 0, total_bytes = 0;
  FLATPEAK_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  return static_cast<int64_t>(free_bytes);
}

// A run that would not fit is refused before it starts, naming what it needs.
void require_free(const std::string& what, int64_t needed_bytes) {
  const int64_t free_bytes = free_device_bytes();
  if (needed_bytes + kFreeMarginBytes > free_bytes)
    throw cuda::BackendError(what, "device 0",
                             fmt::format("needs {:.2f} GiB of device memory and {:.2f} GiB are free (a larger --scale runs a smaller "
                                         "configuration)",
                                         gib(needed_bytes + kFreeMarginBytes), gib(free_bytes)));
}

// The vocab component: the plan's vocab schedule (R = 1) on the GPU, its tracked `vocab` bytes
// against the planner's vocab column of the loss phases, then the device's own view.
void verify_vocab_cuda(const VerifyContext& ctx, VerifyReport& report) {
  const VerifyInputs& in = ctx.in;
  if (in.vocab_mode == "ring-dtp" && in.ring_size > 1)
    throw UnsupportedPlan({Diagnostic{in.file, "/knobs/ring_size/value",
                                      fmt::format("the cuda backend runs the vocab component at R = 1 only (got R = {}); the cpu "
                                                  "backend runs the ring",
                                                  in.ring_size),
                                      ""}});
  const exec::VocabScheduleConfig config = vocab_schedule_config(in, ctx.scaled);
  const nlohmann::ordered_json predicted = predicted_timeline(ctx, {});
  require_free("the vocab component", cuda::vocab_schedule_cuda_peak_bytes(config, in.alignment_bytes) +
                                          cuda::CublasContext::kDefaultWorkspaceBytes);

  cuda::DeviceAllocator::Options options;
  options.alignment_bytes = std::max<int64_t>(1, in.alignment_bytes);
  double mean_loss = 0.0;
  {
    cuda::DeviceAllocator alloc(options);
    Stream stream;
    const cuda::CublasContext blas(alloc, stream.get());
    const cuda::VocabScheduleCudaResult got = cuda::run_vocab_schedule_cuda(alloc, blas, config);
    mean_loss = got.mean_loss;
    const std::vector<exec::PhaseRecord> records = alloc.phase_records();
    compare_category("vocab", "vocab", exec::MemorySpace::Device, predicted, records, main_loss_phase, report);
    report.measured_trace = measured_trace(records);

    // The device's own view beside the tracked figures. Expected: every tracked byte at the
    // high-water mark less the cuBLAS workspace, plus the plan's runtime overhead (CUDA context,
    // cuBLAS and its workspace). The pool keeps what it reserved (release threshold: never), so
    // the device's used memory now is what it was at the peak.
    // The process's own figure where NVML gives one; else the whole device's (run alone then).
    const cuda::DeviceMemoryView view = alloc.device_view();
    const int64_t device_used = view.nvml_available ? view.nvml_process_used_bytes : view.device_total_bytes - view.device_free_bytes;
    const int64_t expected = alloc.high_water_bytes() - blas.workspace_bytes() + in.overhead_bytes;
    VerifyRow row{"vocab", "device", "device view", expected, device_used, relative_error(device_used, expected)};
    row.tolerance = kDeviceViewTolerance;
    row.slack_bytes = kDeviceViewSlackBytes;
    row.judged = in.overhead_calibrated;
    report.rows.push_back(row);
    report.notes.push_back(fmt::format(
        "vocab: {:.3f} s on the GPU (fwd {:.3f} s, bwd {:.3f} s); tracked high-water {} B in {}; pool used high {} B, reserved high {} B",
        got.seconds, got.forward_s, got.backward_s, alloc.high_water_bytes(), alloc.high_water_phase(), view.pool_used_high_bytes,
        view.pool_reserved_high_bytes));
    report.notes.push_back(fmt::format(
        "device view: {} against the tracked high-water less the cuBLAS workspace plus /inputs/run/overhead_bytes ({} B); passes "
        "within {:.0f}% + {} MiB{}",
        view.nvml_available ? "this process's device memory (NVML)"
                            : "the whole device's used memory (cudaMemGetInfo; NVML: " + view.nvml_reason + ")",
        in.overhead_bytes, 100.0 * kDeviceViewTolerance, kDeviceViewSlackBytes >> 20,
        in.overhead_calibrated ? "" : "; not judged: the plan's overhead is not a calibrated card's (tools/gpu-check.sh calibrates one)"));
  }

  // Blocked against the materialised schedule on the same data: the mean loss. The gradients of
  // each op are checked against the CPU backend by tests/cuda.
  if (config.mode == exec::VocabScheduleMode::Materialized) return;
  exec::VocabScheduleConfig naive = config;
  naive.mode = exec::VocabScheduleMode::Materialized;
  const int64_t naive_bytes = cuda::vocab_schedule_cuda_peak_bytes(naive, in.alignment_bytes) + cuda::CublasContext::kDefaultWorkspaceBytes;
  if (naive_bytes + kFreeMarginBytes > free_device_bytes()) {
    report.notes.push_back(fmt::format("vocab: the materialised reference was not run (needs {:.2f} GiB); |dloss| not measured",
                                       gib(naive_bytes + kFreeMarginBytes)));
    return;
  }
  cuda::DeviceAllocator alloc(options);
  Stream stream;
  const cuda::CublasContext blas(alloc, stream.get());
  const cuda::VocabScheduleCudaResult ref = cuda::run_vocab_schedule_cuda(alloc, blas, naive);
  report.max_abs_dloss = std::max(report.max_abs_dloss, std::fabs(mean_loss - ref.mean_loss));
}

using ComponentRun = void (*)(const VerifyContext&, VerifyReport&);
struct CudaComponent {
  const char* name;
  ComponentRun run;
};
const CudaComponent kCudaComponents[] = {{"vocab", verify_vocab_cuda}};

std::string why(const InputError& e) {
  std::string text;
  for (const auto& d : e.diagnostics()) text += (text.empty() ? "" : "; ") + d.pointer + ": " + d.message;
  return text;
}

}  // namespace

std::vector<std::string> cuda_verify_components() {
  std::vector<std::string> names;
  for (const auto& c : kCudaComponents) names.emplace_back(c.name);
  return names;
}

VerifyReport run_verification_cuda(const VerifyInputs& in, const ScaledConfig& scaled, const std::vector<std::string>& components,
                                   double tolerance, const PredictionAdjust& adjust) {
  const bool alone = components.size() == 1;
  VerifyReport report;
  report.plan_file = in.file;
  report.tolerance = tolerance;
  report.backend = "cuda";
  report.ranks = 1;
  for (const auto& name : components) {
    const bool has_twin = std::any_of(std::begin(kCudaComponents), std::end(kCudaComponents),
                                      [&](const CudaComponent& c) { return name == c.name; });
    if (has_twin) continue;
    const std::string message = "the " + name + " component has no CUDA run yet (cuda runs: vocab); the cpu backend runs it";
    if (alone) throw UnsupportedPlan({Diagnostic{"", "--component", message, "run it with --backend cpu"}});
    report.notes.push_back(name + ": not run (" + message + ")");
  }

  int devices = 0;
  const cudaError_t status = cudaGetDeviceCount(&devices);
  if (status != cudaSuccess || devices == 0)
    throw cuda::BackendError("cudaGetDeviceCount(&devices)", "verify --backend cuda",
                             status != cudaSuccess ? std::string(cudaGetErrorName(status)) + ": " + cudaGetErrorString(status)
                                                   : "no CUDA device");
  FLATPEAK_CUDA_CHECK(cudaSetDevice(0));
  cudaDeviceProp prop{};
  FLATPEAK_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  report.device = prop.name;
  if (scaled.ranks > 1)
    report.notes.push_back(fmt::format("ran one rank of {} on one GPU (at R = 1 every rank's vocab component is the same)", scaled.ranks));

  const VerifyContext ctx{in, scaled, adjust};
  for (const auto& c : kCudaComponents) {
    if (std::find(components.begin(), components.end(), c.name) == components.end()) continue;
    const size_t notes_before = report.notes.size();
    try {
      c.run(ctx, report);
    } catch (const UnsupportedPlan& e) {
      if (alone) throw;
      report.notes.resize(notes_before);
      report.notes.push_back(std::string(c.name) + ": not run (" + why(e) + ")");
    }
  }
  for (const auto& row : report.rows)
    if (!row_passes(row, tolerance)) report.pass = false;
  return report;
}

}  // namespace flatpeak::cli
