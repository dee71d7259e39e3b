// verify on the CUDA backend (verify_cuda.h): the vocab, checkpoint and dispatch components on one
// GPU (a Ring-DTP ring of R ranks, or one EP group's EP ranks, sharing it).
#include "verify_cuda.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <exception>
#include <functional>
#include <memory>
#include <numeric>
#include <stdexcept>

#include <fmt/format.h>

#include "executor/cuda/backend_error.h"
#include "executor/cuda/checkpoint_schedule_cuda.h"
#include "executor/cuda/cublas_context.h"
#include "executor/cuda/cuda_check.h"
#include "executor/cuda/cuda_raii.h"
#include "executor/cuda/device_allocator.h"
#include "executor/cuda/device_threads_comm.h"
#include "executor/cuda/dispatch_ep_cuda.h"
#include "executor/cuda/ring_dtp_schedule_cuda.h"
#include "executor/cuda/vocab_schedule_cuda.h"
#include "executor/schedules/dispatch_plan.h"
#include "verify_common.h"
#include "verify_ranks.h"

namespace flatpeak::cli {

namespace {

double gib(int64_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0 * 1024.0); }
// Room left free beside a run's own peak: the CUDA context's later growth and cuBLAS's kernels.
constexpr int64_t kFreeMarginBytes = int64_t{1} << 30;

using Stream = exec::cuda_detail::ScopedStream;

int64_t free_device_bytes() {
  size_t free_bytes = 0, total_bytes = 0;
  FLATPEAK_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  return static_cast<int64_t>(free_bytes);
}

// Whether a run holding `needed_bytes` at its peak fits the device's free memory with the margin.
bool fits_free(int64_t needed_bytes) { return needed_bytes + kFreeMarginBytes <= free_device_bytes(); }

// A run that would not fit is refused before it starts, naming what it needs.
void require_free(const std::string& what, int64_t needed_bytes) {
  const int64_t free_bytes = free_device_bytes();
  if (!fits_free(needed_bytes))
    throw cuda::BackendError(what, "device 0",
                             fmt::format("needs {:.2f} GiB of device memory and {:.2f} GiB are free (a larger --scale runs a smaller "
                                         "configuration)",
                                         gib(needed_bytes + kFreeMarginBytes), gib(free_bytes)));
}

// The device's own view beside the tracked figures, as a row of `component`. Expected: every
// tracked byte at the high-water mark less the cuBLAS workspace, plus the plan's runtime overhead
// (CUDA context, cuBLAS and its workspace). The pool keeps what it reserved (release threshold:
// never), so what the device holds now is what it held at the peak: the allocator trims its
// unused reserve only just before growing past it, so the reserve after is larger than before.
// Measured: the process's own figure where NVML gives one; else the whole device's used memory
// (run alone then).
void add_device_view_row(const std::string& component, const cuda::DeviceAllocator& alloc, const cuda::CublasContext& blas,
                         const VerifyInputs& in, VerifyReport& report) {
  const cuda::DeviceMemoryView view = alloc.device_view();
  const int64_t device_used = view.nvml_available ? view.nvml_process_used_bytes : view.device_total_bytes - view.device_free_bytes;
  // NCCL's buffers are part of the calibrated overhead, but a one-GPU run creates no communicator.
  const int64_t expected = alloc.high_water_bytes() - blas.workspace_bytes() + in.overhead_bytes - in.overhead_nccl_bytes;
  VerifyRow row{component, "device", "device view", expected, device_used, relative_error(device_used, expected)};
  row.tolerance = kDeviceViewTolerance;
  row.slack_bytes = kDeviceViewSlackBytes;
  row.judged = in.overhead_calibrated;
  report.rows.push_back(row);
  report.notes.push_back(fmt::format(
      "{}: device view = {} against the tracked high-water {} B (in {}) less the cuBLAS workspace plus /inputs/run/overhead_bytes "
      "({} B) less its NCCL part ({} B); pool used high {} B, reserved high {} B; passes within {:.0f}% + {} MiB{}",
      component,
      view.nvml_available ? "this process's device memory (NVML)"
                          : "the whole device's used memory (cudaMemGetInfo; NVML: " + view.nvml_reason + ")",
      alloc.high_water_bytes(), alloc.high_water_phase(), in.overhead_bytes, in.overhead_nccl_bytes, view.pool_used_high_bytes, view.pool_reserved_high_bytes,
      100.0 * kDeviceViewTolerance, kDeviceViewSlackBytes >> 20,
      in.overhead_calibrated ? "" : "; not judged: the plan's overhead is not a calibrated card's (tools/gpu-check.sh calibrates one)"));
}

// The allocator of a component run: the plan's alignment, and a capacity of the device's free
// memory less a margin, so a run too large for the GPU stops with exec::OutOfMemory (exit 4)
// before the device itself refuses.
cuda::DeviceAllocator::Options allocator_options(const VerifyInputs& in) {
  cuda::DeviceAllocator::Options options;
  options.alignment_bytes = std::max<int64_t>(1, in.alignment_bytes);
  options.capacity_bytes = std::max<int64_t>(0, free_device_bytes() - kFreeMarginBytes);
  return options;
}

// Runs `rank_run` on `ranks` ranks sharing device 0 (a DeviceThreadsCommunicator each: its own
// stream, and an allocator with the plan's alignment and an equal share of the free memory), each
// rank filling its own report; the reports merged as the CPU's ranks are (per phase the rank that
// holds most, rows tagged with their rank) go into `report`. A rank out of device memory or failed
// by the device is rethrown as itself (exit 4, as on one rank); any other failure as
// exec::RankFailed naming the rank.
using SharedDeviceRankRun = std::function<void(int rank, cuda::DeviceThreadsCommunicator& comm, VerifyReport& mine)>;
void run_ranks_sharing_device(const VerifyInputs& in, int64_t ranks, const SharedDeviceRankRun& rank_run, VerifyReport& report) {
  cuda::DeviceAllocator::Options options = allocator_options(in);
  options.capacity_bytes /= ranks;
  exec::ThreadsOptions threads;
  threads.peer_timeout_s = kVerifyPeerTimeoutSeconds;  // a collective waits for every rank's kernels on the shared GPU
  std::vector<VerifyReport> per_rank(static_cast<size_t>(ranks));
  std::vector<std::exception_ptr> backend_failure(static_cast<size_t>(ranks));
  const exec::RunResult run = cuda::run_ranks_on_device(
      static_cast<int>(ranks), 0,
      [&](int rank, exec::Communicator& base) {
        VerifyReport& mine = per_rank[static_cast<size_t>(rank)];
        try {
          rank_run(rank, static_cast<cuda::DeviceThreadsCommunicator&>(base), mine);
        } catch (const exec::OutOfMemory&) {
          backend_failure[static_cast<size_t>(rank)] = std::current_exception();
          throw;
        } catch (const cuda::BackendError&) {
          backend_failure[static_cast<size_t>(rank)] = std::current_exception();
          throw;
        }
        for (auto& row : mine.rows) row.rank = rank;
      },
      threads, options);
  if (!run.ok()) {
    if (const std::exception_ptr& e = backend_failure[static_cast<size_t>(run.failing_rank)]) std::rethrow_exception(e);
    throw exec::RankFailed(run.failing_rank, run.exit_code, run.ranks[static_cast<size_t>(run.failing_rank)].message);
  }
  const VerifyReport merged = merge_rank_reports(per_rank);
  report.rows.insert(report.rows.end(), merged.rows.begin(), merged.rows.end());
  report.measured_trace = merged.measured_trace;
  report.notes.insert(report.notes.end(), merged.notes.begin(), merged.notes.end());
  report.ranks = std::max<int>(report.ranks, static_cast<int>(ranks));
}

// The vocab component with Ring-DTP on a ring of R > 1 ranks, sharing device 0 (a
// DeviceThreadsCommunicator each: its own stream and allocator, hops by device-to-device copies),
// each rank's tracked vocab bytes against the planner's prediction for that ring, merged as the
// CPU's ranks are (per phase the rank that holds most); the mean loss against the materialised
// schedule on the ring's R·T tokens when that fits. No device-view row: R pools share the device,
// and the card's overhead is one process's on one GPU.
void verify_vocab_ring_cuda(const VerifyContext& ctx, int64_t R, VerifyReport& report) {
  const VerifyInputs& in = ctx.in;
  // The cpu backend's setup for the scaled ranks (its ring and its prediction, made at that many
  // GPUs), so both backends judge a plan against the same timeline; one ring of it runs here.
  const RingVerifySetup setup = ring_verify_setup(ctx, std::max<int64_t>(1, ctx.scaled.ranks));
  const exec::RingDtpConfig& config = setup.config;
  if (config.ring_size != R)
    throw std::logic_error(fmt::format("verify vocab: a ring of {} ranks, the cpu backend's setup has {}", R, config.ring_size));
  const int64_t per_rank_bytes =
      cuda::ring_dtp_schedule_cuda_peak_bytes(config, in.alignment_bytes) + cuda::CublasContext::kDefaultWorkspaceBytes;
  require_free(fmt::format("the vocab component's ring of {} ranks on one GPU", R), R * per_rank_bytes);

  std::vector<double> seconds(static_cast<size_t>(R), 0.0);
  double mean_loss = 0.0;
  run_ranks_sharing_device(
      in, R,
      [&](int rank, cuda::DeviceThreadsCommunicator& comm, VerifyReport& mine) {
        const cuda::CublasContext blas(comm.allocator(), comm.stream());
        const cuda::RingDtpCudaResult got = cuda::run_ring_dtp_schedule_cuda(comm, comm.allocator(), blas, config);
        const std::vector<exec::PhaseRecord> records = comm.allocator().phase_records();
        compare_category("vocab", "vocab", exec::MemorySpace::Device, setup.predicted, records, main_loss_phase, mine);
        if (rank == 0) {
          mean_loss = got.mean_loss;
          mine.measured_trace = measured_trace(records);
        }
        seconds[static_cast<size_t>(rank)] = got.seconds;
      },
      report);
  report.notes.push_back(setup.note + fmt::format(", one ring run: its {} ranks sharing one GPU (rank 0's trace)", R));
  report.notes.push_back(fmt::format("vocab: {:.3f} s on the GPU (the slowest rank; the ranks share the device's time)",
                                     *std::max_element(seconds.begin(), seconds.end())));
  report.notes.push_back("vocab: no device-view row (R ranks' pools share one device; the card's overhead is one process's)");

  // The materialised schedule on the ring's R·T tokens (the same data): the mean loss.
  exec::VocabScheduleConfig naive;
  naive.tokens = R * config.tokens;
  naive.hidden = config.hidden;
  naive.vocab = config.vocab;
  naive.mode = exec::VocabScheduleMode::Materialized;
  naive.seed = config.seed;
  const int64_t naive_bytes = cuda::vocab_schedule_cuda_peak_bytes(naive, in.alignment_bytes) + cuda::CublasContext::kDefaultWorkspaceBytes;
  if (!fits_free(naive_bytes)) {
    report.notes.push_back(fmt::format("vocab: the materialised reference on R·T = {} tokens was not run (needs {:.2f} GiB); |dloss| "
                                       "not measured",
                                       naive.tokens, gib(naive_bytes + kFreeMarginBytes)));
    return;
  }
  cuda::DeviceAllocator alloc(allocator_options(in));
  Stream stream;
  const cuda::CublasContext blas(alloc, stream.get());
  const cuda::VocabScheduleCudaResult ref = cuda::run_vocab_schedule_cuda(alloc, blas, naive);
  report.max_abs_dloss = std::max(report.max_abs_dloss, std::fabs(mean_loss - ref.mean_loss));
  report.notes.push_back("vocab: the ring's dX and dW are checked against the CPU ring, element by element, by "
                         "tests/cuda/ring_dtp_cuda_test.cu; here the mean loss only");
}

// The vocab component: the plan's vocab schedule (R = 1) on the GPU, its tracked `vocab` bytes
// against the planner's vocab column of the loss phases, then the device's own view.
void verify_vocab_cuda(const VerifyContext& ctx, VerifyReport& report) {
  const VerifyInputs& in = ctx.in;
  // The ring the CPU backend would run (the plan's R when the scaled ranks hold whole rings, else
  // the largest that divides both), once: every ring holds the same data.
  const int64_t ring = in.vocab_mode == "ring-dtp" ? std::gcd(in.ring_size, std::max<int64_t>(1, ctx.scaled.ranks)) : 1;
  if (ring > 1) {
    verify_vocab_ring_cuda(ctx, ring, report);
    return;
  }
  const exec::VocabScheduleConfig config = vocab_schedule_config(in, ctx.scaled);
  const nlohmann::ordered_json predicted = predicted_timeline(ctx, {kWithoutMtp});
  require_free("the vocab component", cuda::vocab_schedule_cuda_peak_bytes(config, in.alignment_bytes) +
                                          cuda::CublasContext::kDefaultWorkspaceBytes);

  const cuda::DeviceAllocator::Options options = allocator_options(in);
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

    add_device_view_row("vocab", alloc, blas, in, report);
    report.notes.push_back(fmt::format("vocab: {:.3f} s on the GPU (fwd {:.3f} s, bwd {:.3f} s)", got.seconds, got.forward_s, got.backward_s));
  }

  // Blocked against the materialised schedule on the same data: the mean loss. The gradients of
  // each op are checked against the CPU backend by tests/cuda.
  if (config.mode == exec::VocabScheduleMode::Materialized) return;
  exec::VocabScheduleConfig naive = config;
  naive.mode = exec::VocabScheduleMode::Materialized;
  const int64_t naive_bytes = cuda::vocab_schedule_cuda_peak_bytes(naive, in.alignment_bytes) + cuda::CublasContext::kDefaultWorkspaceBytes;
  if (!fits_free(naive_bytes)) {
    report.notes.push_back(fmt::format("vocab: the materialised reference was not run (needs {:.2f} GiB); |dloss| not measured",
                                       gib(naive_bytes + kFreeMarginBytes)));
    return;
  }
  cuda::DeviceAllocator alloc(allocator_options(in));
  Stream stream;
  const cuda::CublasContext blas(alloc, stream.get());
  const cuda::VocabScheduleCudaResult ref = cuda::run_vocab_schedule_cuda(alloc, blas, naive);
  report.max_abs_dloss = std::max(report.max_abs_dloss, std::fabs(mean_loss - ref.mean_loss));
}

// The checkpoint component: the L-layer stack with the plan's boundaries (kept; synchronous offload
// as copies in line on the compute stream; SCO on copy streams with its prefetch) on the GPU, its
// tracked boundary bytes, device and host, against the planner's boundaries column, then the
// device's own view and the naive stack (no checkpointing) on the same data when it fits.
void verify_checkpoint_cuda(const VerifyContext& ctx, VerifyReport& report) {
  const VerifyInputs& in = ctx.in;
  const ScaledConfig& s = ctx.scaled;
  const nlohmann::ordered_json predicted = predicted_timeline(ctx, checkpoint_prediction_flags(s, report));
  const exec::CheckpointScheduleConfig config = checkpoint_schedule_config(s);
  // The stack's attention kernel (attention_cuda.cu) takes head dims up to 512: refused here by
  // name rather than failing inside the op.
  const exec::CheckpointDims dims = exec::checkpoint_dims(config);
  constexpr int64_t kMaxHeadDim = 512;
  if (dims.hidden / dims.heads > kMaxHeadDim)
    throw UnsupportedPlan({Diagnostic{"", "--scale",
                                      fmt::format("the cuda checkpoint stack's attention takes head dims up to {} (got H = {} over {} "
                                                  "heads = {} at scale {:.4g})",
                                                  kMaxHeadDim, dims.hidden, dims.heads, dims.hidden / dims.heads, s.factor),
                                      "use --scale auto, or a larger --scale"}});
  cuda::CheckpointCudaOptions options;
  options.copy_streams = s.boundaries == "sco";
  exec::CheckpointScheduleResult got;
  {
    cuda::DeviceAllocator alloc(allocator_options(in));
    Stream stream;
    const cuda::CublasContext blas(alloc, stream.get());
    const cuda::CheckpointScheduleCudaResult run = cuda::run_checkpoint_schedule_cuda(alloc, blas, config, options);
    got = run.values;
    std::vector<exec::PhaseRecord> records = alloc.phase_records();
    compare_boundaries(exec::MemorySpace::Device, predicted, records, report);
    // The host arena is pinned once before the first phase and held to the end: every phase holds it.
    std::vector<exec::PhaseRecord> host;
    for (const auto& r : records) {
      exec::PhaseRecord h;
      h.phase = r.phase;
      h.space = exec::MemorySpace::Host;
      h.bytes_at_peak[static_cast<size_t>(exec::Category::Boundaries)] = run.host_boundary_bytes;
      h.category_peak_bytes[static_cast<size_t>(exec::Category::Boundaries)] = run.host_boundary_bytes;
      h.peak_bytes = run.host_boundary_bytes;
      host.push_back(h);
    }
    compare_boundaries(exec::MemorySpace::Host, predicted, host, report);
    report.measured_trace = measured_trace(records);
    add_device_view_row("checkpoint", alloc, blas, in, report);
    report.notes.push_back(fmt::format("checkpoint: {:.3f} s on the GPU (fwd {:.3f} s, bwd {:.3f} s), boundaries {}{}", run.seconds,
                                       run.forward_s, run.backward_s,
                                       s.boundaries == "sco" ? "by SCO on copy streams" : s.boundaries == "device" ? "kept" : "copied in line",
                                       run.host_pinned ? "" : "; host arena pageable: " + run.fallback_reason));
  }

  // Against the naive stack (no checkpointing, nothing offloaded) on the same data: the offload
  // moves bytes and the recompute reruns the same kernels, so the bits are expected equal.
  exec::CheckpointScheduleConfig naive = config;
  naive.offloaded.clear();
  naive.prefetch = 0;
  naive.checkpoint = false;
  try {
    cuda::DeviceAllocator alloc(allocator_options(in));
    Stream stream;
    const cuda::CublasContext blas(alloc, stream.get());
    const exec::CheckpointScheduleResult ref = cuda::run_checkpoint_schedule_cuda(alloc, blas, naive).values;
    report.max_abs_dloss = std::max(report.max_abs_dloss, std::fabs(got.loss - ref.loss));
    auto dgrad = [&](const std::vector<uint16_t>& a, const std::vector<uint16_t>& b) {
      for (size_t i = 0; i < a.size() && i < b.size(); ++i)
        report.max_abs_dgrad =
            std::max(report.max_abs_dgrad, static_cast<double>(std::fabs(exec::bf16_value(a[i]) - exec::bf16_value(b[i]))));
    };
    dgrad(got.d_input, ref.d_input);
    dgrad(got.d_weights, ref.d_weights);
  } catch (const exec::OutOfMemory&) {
    report.notes.push_back("checkpoint: the naive stack (every activation kept) does not fit the device; |dloss| and |dgrad| not measured");
  }
}

// The dispatch component: one MoE layer's forward, recompute and backward (standard EP, LLEP or
// PipelinedLLEP, as the plan says) on the EP ranks of one EP group sharing device 0 (a
// DeviceThreadsCommunicator each: its own stream and allocator), with the cpu backend's
// configuration, routing draw and prediction: each rank's tracked `dispatch` bytes per MoE phase
// against the planner's on the realised routing, merged as the CPU's ranks are (per phase the
// rank that holds most), and PipelinedLLEP's "bound" row. Memory only (config.outputs off): the
// values are checked against the CPU schedule by tests/cuda/dispatch_ep_cuda_test.cu. No
// device-view row: EP pools share the device.
void verify_dispatch_cuda(const VerifyContext& ctx, VerifyReport& report) {
  const VerifyInputs& in = ctx.in;
  const ScaledConfig& s = ctx.scaled;
  const int64_t ep = std::max<int64_t>(1, s.ep);
  // EP group 0 (replica 0), as the cpu backend's first group: every group runs the same layer on
  // its own tokens and routing draw.
  const DispatchRanksSetup setup = dispatch_ranks_setup(ctx, 0);
  if (!setup.runs) {
    report.notes.push_back(setup.note);
    return;
  }
  const exec::DispatchScheduleConfig& config = setup.config;

  // A rough per-rank lower bound, so a run far too large is refused by name before it starts: the
  // predicted dispatch peak on the plan's routing, the native experts' bf16 weights [E/EP, P]
  // (3FH and any biases) and fp32 gradients, the router's [E, H] likewise, the layer input and upstream gradient
  // [T, H] bf16, the cuBLAS workspace. A run that still does not fit stops at its rank's share of
  // the free memory with exec::OutOfMemory (exit 4).
  const int64_t local_experts = config.experts / ep;
  const int64_t per_rank_bytes = dispatch_peak(predict_dispatch(ctx, setup.knobs, setup.plan_routing)) +
                                 local_experts * exec::dispatch_detail::dims_of(config, ep, 0).P * (2 + 4) +
                                 config.experts * config.hidden * (2 + 4) +
                                 2 * config.tokens * config.hidden * 2 + cuda::CublasContext::kDefaultWorkspaceBytes;
  require_free(fmt::format("the dispatch component's {} EP ranks on one GPU", ep), ep * per_rank_bytes);

  std::vector<double> seconds(static_cast<size_t>(ep), 0.0);
  run_ranks_sharing_device(
      in, ep,
      [&](int rank, cuda::DeviceThreadsCommunicator& comm, VerifyReport& mine) {
        const cuda::CublasContext blas(comm.allocator(), comm.stream());
        const std::vector<int32_t> ids = exec::draw_dispatch_routing(config, ep, rank);  // [T, k]
        const cuda::DispatchEpCudaResult got = cuda::run_dispatch_ep_cuda(comm, comm.allocator(), blas, config, ids);
        dispatch_rank_report(ctx, setup, got.plan, comm.allocator().phase_records(), rank == 0, mine);
        seconds[static_cast<size_t>(rank)] = got.seconds;
      },
      report);
  if (s.ranks > ep)
    report.notes.push_back(fmt::format("dispatch: {} EP groups of {} ranks; one group run (group 0's tokens and routing draw), its {} "
                                       "ranks sharing one GPU (rank 0's trace)",
                                       s.ranks / ep, ep, ep));
  else
    report.notes.push_back(fmt::format("dispatch: {} EP rank{} sharing one GPU (rank 0's trace)", ep, ep == 1 ? "" : "s"));
  report.notes.push_back(fmt::format("dispatch: {:.3f} s on the GPU (the slowest rank; the ranks share the device's time)",
                                     *std::max_element(seconds.begin(), seconds.end())));
  report.notes.push_back("dispatch: memory only; the values (output, d_x, the weight gradients) are checked against the CPU schedule "
                         "by tests/cuda/dispatch_ep_cuda_test.cu");
  report.notes.push_back("dispatch: no device-view row (EP ranks' pools share one device; the card's overhead is one process's)");
}

using ComponentRun = void (*)(const VerifyContext&, VerifyReport&);
struct CudaComponent {
  const char* name;
  ComponentRun run;
};
const CudaComponent kCudaComponents[] = {
    {"vocab", verify_vocab_cuda}, {"checkpoint", verify_checkpoint_cuda}, {"dispatch", verify_dispatch_cuda}};

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
    std::string list;
    for (const auto& c : kCudaComponents) list += (list.empty() ? "" : ", ") + std::string(c.name);
    const std::string message = "the " + name + " component has no CUDA run yet (cuda runs: " + list + "); the cpu backend runs it";
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
    report.notes.push_back(fmt::format("ran one rank of {} on one GPU (every rank's vocab component is the same at R = 1, and a Ring-DTP "
                                       "ring runs its R ranks sharing the GPU; the checkpoint stack is one rank's; the dispatch runs one "
                                       "EP group's ranks sharing the GPU)",
                                       scaled.ranks));

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
  set_aside_unresolved_rows(report, tolerance, in.alignment_bytes, scaled.factor);
  for (const auto& row : report.rows)
    if (!row_passes(row, tolerance)) report.pass = false;
  return report;
}

}  // namespace flatpeak::cli
