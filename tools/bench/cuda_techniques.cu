// The technique figures of issue 7 on one GPU, from the CUDA schedules and the backend allocator:
//   vocab     gpt-oss-120b's H and V at 64K tokens: materialised logits vs blocked (Ring-DTP R = 1)
//             cross-entropy with both backwards: the vocab component's tracked peak, time, the
//             reduction and the time ratios; the device's own view (pool attributes, cudaMemGetInfo,
//             NVML's per-process figure when the driver library answers) beside the tracked peak; the
//             same at 64K with one vocab block per token block (T_blk = --row-t-blk, V_blk = V); the
//             blocked version alone at 256K and 1M tokens (skipped, naming the bytes, when the
//             device has too little free memory).
//   dispatch  one MoE layer at EP = 1 (gpt-oss-120b dims, T = 32K): capped rounds vs one uncapped
//             round, throughput ratio and tracked peaks.
//   dispatch-ep one MoE layer at EP = 4 with the 4 ranks sharing the GPU (DeviceThreadsCommunicator,
//             gpt-oss-120b's H, F, E, k; T = 32K per rank), routing rho=2.5: uncapped standard EP
//             vs PipelinedLLEP (striped capped rounds, LLA): the largest per-rank tracked peak of
//             each, their ratio against issue 7's 0.41, the dispatch category's, and times.
//   attention causal GQA attention at gpt-oss-120b's a = 64, g = 8, d = 64, bf16: the tensor-core
//             kernels against the reference ones at T = 8192 (forward and backward time, TFLOP/s,
//             speed-up, max difference of their outputs), then the tensor-core ones alone at 64K.
//   checkpoint an 8-layer checkpointed stack (T = 4096, H = 2048): boundaries kept, offloaded by
//             SCO (copy streams, prefetch 1) and offloaded in line on the compute stream: step
//             time ratios against kept, the device boundary peaks, and SCO's bits against kept.
//   offload   OffloadStreamAdamW for a 1B-parameter shard: pipeline time vs its slowest stage +
//             one bucket fill, serial offload, the optimizer time left exposed after a simulated
//             backward (stream vs serial), CPU AdamW GB/s vs a STREAM copy on this machine.
// Every figure is measured here; lines "summary|check|result|detail" feed tools/gpu-check.sh.
// Exit: 0 done, 77 no CUDA device, 2 bad arguments, 1 a CUDA/cuBLAS or other runtime error.
//   cuda_techniques [--only vocab,dispatch,dispatch-ep,attention,checkpoint,offload] [--vocab-tokens 65536] [--big 262144,1048576]
//                   [--t-blk 8192] [--v-blk 16384] [--row-t-blk 4096] [--dispatch-tokens 32768] [--cap 16384] [--ep-tokens 32768] [--ep-cap 8192]
//                   [--ep-min-rows 1024] [--attn-tokens 8192] [--attn-big 65536]
//                   [--ckpt-tokens 4096] [--offload-params 1000000000] [--bucket 33554432] [--depth 2] [--threads N]
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <exception>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "executor/cuda/checkpoint_schedule_cuda.h"
#include "executor/cuda/cublas_context.h"
#include "executor/cuda/cuda_check.h"
#include "executor/cuda/device_allocator.h"
#include "executor/cuda/device_threads_comm.h"
#include "executor/cuda/dispatch_ep_cuda.h"
#include "executor/cuda/dispatch_schedule_cuda.h"
#include "executor/cuda/kernel_util.cuh"
#include "executor/cuda/offload_adamw_cuda.h"
#include "executor/cuda/ops_cuda.h"
#include "executor/cuda/pinned_arena.h"
#include "executor/cuda/schedule_util_cuda.cuh"
#include "executor/cuda/vocab_schedule_cuda.h"

namespace {

using flatpeak::cuda::CublasContext;
using flatpeak::cuda::DeviceAllocator;
using flatpeak::cuda::DeviceBuffer;
using flatpeak::exec::Bf16;
using flatpeak::exec::Category;
using flatpeak::exec::cuda_detail::ScopedEvent;
using flatpeak::exec::cuda_detail::ScopedStream;
using flatpeak::exec::cuda_detail::event_seconds;

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
constexpr int64_t kAlign = 256;
// Kept free beyond a run's own bytes: the CUDA context's later growth, cuBLAS internals.
constexpr int64_t kMarginBytes = int64_t{1} << 30;

struct Options {
  std::vector<std::string> only{"vocab", "dispatch", "dispatch-ep", "attention", "checkpoint", "offload"};
  int64_t vocab_tokens = 65536;
  std::vector<int64_t> big{262144, 1048576};
  int64_t hidden = 2880;      // gpt-oss-120b hidden_size (models/gpt-oss-120b.json)
  int64_t vocab = 201088;     // gpt-oss-120b vocab_size
  int64_t experts = 128;      // n_routed_experts
  int64_t top_k = 4;          // num_experts_per_tok
  int64_t ffn = 2880;         // moe_intermediate_size
  int64_t t_blk = 8192;
  int64_t v_blk = 16384;
  // The second blocking at 64K: one vocab block of all V per token block (the fused pass then
  // reads the forward's logits instead of recomputing them: 3 GEMMs a block, as materialised).
  int64_t row_t_blk = 4096;
  int64_t dispatch_tokens = 32768;
  int64_t cap = 16384;
  // dispatch-ep: tokens per rank and PipelinedLLEP's cap C (at rho=2.5 with m 1024 it shrinks to
  // 4716 to fit the launch-time B = 10659 rows: 28 rounds).
  int64_t ep_tokens = 32768;
  int64_t ep_cap = 8192;
  int64_t ep_min_rows = 1024;  // LLA's m: with B ≈ 10.7K rows the launch-time pool is 1 expert
  // attention: the reference kernels are timed at attn_tokens only (T², seconds at 8192); the
  // tensor-core ones also at attn_big.
  int64_t attn_tokens = 8192;
  int64_t attn_big = 65536;
  // The stack's attention (bf16, head dim 128) now runs the tensor-core kernels; T = 4096 is kept
  // so that the figures compare with runs made when it ran the reference kernels, whose T² made
  // 8192 too slow for the 150 s gpu-check.sh gives the whole benchmark (--ckpt-tokens raises it).
  int64_t ckpt_tokens = 4096;
  int64_t offload_params = 1000000000;
  int64_t bucket = int64_t{32} << 20;
  int depth = 2;
  int threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
};

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream in(s);
  std::string item;
  while (std::getline(in, item, ',')) if (!item.empty()) out.push_back(item);
  return out;
}

int64_t parse_int(const std::string& flag, const std::string& v) {
  char* end = nullptr;
  const long long x = std::strtoll(v.c_str(), &end, 10);
  if (v.empty() || *end != '\0' || x <= 0)
    throw std::invalid_argument(flag + ": expected a positive integer, got '" + v + "'");
  return static_cast<int64_t>(x);
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (i + 1 >= argc) throw std::invalid_argument(flag + ": missing value");
    const std::string v = argv[++i];
    if (flag == "--only") {
      o.only = split(v);
      for (const std::string& s : o.only)
        if (s != "vocab" && s != "dispatch" && s != "dispatch-ep" && s != "attention" && s != "checkpoint" && s != "offload")
          throw std::invalid_argument("--only: unknown section '" + s + "' (vocab, dispatch, dispatch-ep, attention, checkpoint, offload)");
    } else if (flag == "--big") {
      o.big.clear();
      for (const std::string& s : split(v)) o.big.push_back(parse_int(flag, s));
    } else if (flag == "--vocab-tokens") o.vocab_tokens = parse_int(flag, v);
    else if (flag == "--t-blk") o.t_blk = parse_int(flag, v);
    else if (flag == "--v-blk") o.v_blk = parse_int(flag, v);
    else if (flag == "--row-t-blk") o.row_t_blk = parse_int(flag, v);
    else if (flag == "--dispatch-tokens") o.dispatch_tokens = parse_int(flag, v);
    else if (flag == "--cap") o.cap = parse_int(flag, v);
    else if (flag == "--ep-tokens") o.ep_tokens = parse_int(flag, v);
    else if (flag == "--ep-cap") o.ep_cap = parse_int(flag, v);
    else if (flag == "--ep-min-rows") o.ep_min_rows = parse_int(flag, v);
    else if (flag == "--attn-tokens") o.attn_tokens = parse_int(flag, v);
    else if (flag == "--attn-big") o.attn_big = parse_int(flag, v);
    else if (flag == "--ckpt-tokens") o.ckpt_tokens = parse_int(flag, v);
    else if (flag == "--offload-params") o.offload_params = parse_int(flag, v);
    else if (flag == "--bucket") o.bucket = parse_int(flag, v);
    else if (flag == "--depth") o.depth = static_cast<int>(std::min<int64_t>(parse_int(flag, v), 64));
    else if (flag == "--threads") o.threads = static_cast<int>(std::min<int64_t>(parse_int(flag, v), 1024));
    else throw std::invalid_argument("unknown flag '" + flag + "'");
  }
  return o;
}

bool wanted(const Options& o, const char* section) {
  return std::find(o.only.begin(), o.only.end(), section) != o.only.end();
}

std::string gib(int64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f GiB", static_cast<double>(bytes) / kGiB);
  return buf;
}

// One row for tools/gpu-check.sh's table: '|' and line breaks in the text would split it.
void summary(const std::string& check, const std::string& result, std::string detail) {
  for (char& ch : detail)
    if (ch == '|' || ch == '\n' || ch == '\r') ch = ch == '|' ? '/' : ' ';
  std::printf("summary|%s|%s|%s\n", check.c_str(), result.c_str(), detail.c_str());
  std::fflush(stdout);
}

int64_t free_device_bytes() {
  size_t free_b = 0, total_b = 0;
  FLATPEAK_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  return static_cast<int64_t>(free_b);
}

// Returns the pool's unused reserve to the device, so that the free figure and the pool's
// reserved high-water describe the next run alone.
void trim(DeviceAllocator& alloc, cudaStream_t s) {
  FLATPEAK_CUDA_CHECK(cudaStreamSynchronize(s));
  FLATPEAK_CUDA_CHECK(cudaMemPoolTrimTo(alloc.pool(), 0));
}

// The largest bytes one category held at once over the recorded phases.
int64_t category_peak(const DeviceAllocator& alloc, Category c) {
  int64_t peak = 0;
  for (const flatpeak::exec::PhaseRecord& r : alloc.phase_records())
    if (r.space == flatpeak::exec::MemorySpace::Device)
      peak = std::max(peak, r.category_peak_bytes[static_cast<size_t>(c)]);
  return peak;
}

// ---- vocab -----------------------------------------------------------------------------------

struct VocabRun {
  bool ran = false;
  std::string skipped;  // why not, when !ran
  double seconds = 0, forward_s = 0, backward_s = 0, loss = 0;
  int64_t vocab_peak = 0, tracked_high = 0;
  flatpeak::cuda::DeviceMemoryView view;
  int64_t device_used_after = 0;  // cudaMemGetInfo total − free after the run (pool kept reserved)
};

VocabRun run_vocab(DeviceAllocator& alloc, const CublasContext& blas, const flatpeak::exec::VocabScheduleConfig& c,
                   bool warmup) {
  VocabRun out;
  trim(alloc, blas.stream());
  const int64_t need = flatpeak::cuda::vocab_schedule_cuda_peak_bytes(c, kAlign);
  const int64_t free_b = free_device_bytes();
  if (need + kMarginBytes > free_b) {
    out.skipped = "skipped: needs " + gib(need) + " (+ " + gib(kMarginBytes) + " margin), " + gib(free_b) + " free";
    return out;
  }
  if (warmup) (void)flatpeak::cuda::run_vocab_schedule_cuda(alloc, blas, c);  // pool growth, cuBLAS heuristics
  alloc.reset_records();
  const flatpeak::cuda::VocabScheduleCudaResult r = flatpeak::cuda::run_vocab_schedule_cuda(alloc, blas, c);
  out.ran = true;
  out.seconds = r.seconds;
  out.forward_s = r.forward_s;
  out.backward_s = r.backward_s;
  out.loss = r.mean_loss;
  out.vocab_peak = category_peak(alloc, Category::Vocab);
  out.tracked_high = alloc.high_water_bytes();
  out.view = alloc.device_view();
  out.device_used_after = out.view.device_total_bytes - out.view.device_free_bytes;
  return out;
}

void print_vocab(const char* name, const flatpeak::exec::VocabScheduleConfig& c, const VocabRun& r) {
  if (!r.ran) {
    std::printf("vocab %-22s T=%lld: %s\n", name, static_cast<long long>(c.tokens), r.skipped.c_str());
    return;
  }
  std::printf("vocab %-22s T=%lld: %.4f s (fwd %.4f, bwd %.4f), vocab peak %s, tracked high-water %s, "
              "mean loss %.6f\n",
              name, static_cast<long long>(c.tokens), r.seconds, r.forward_s, r.backward_s,
              gib(r.vocab_peak).c_str(), gib(r.tracked_high).c_str(), r.loss);
  // NVML's figure is current, not a high mark: taken after the run, with the pool's reserve kept.
  const std::string nvml = r.view.nvml_available
                               ? "NVML this process " + gib(r.view.nvml_process_used_bytes) +
                                     " after the run (context, cuBLAS and the kept pool reserve included)"
                               : "NVML not available: " + r.view.nvml_reason;
  std::printf("      device view: pool used high %s, pool reserved high %s, cudaMemGetInfo used %s of %s "
              "(context and every process included); %s\n",
              gib(r.view.pool_used_high_bytes).c_str(), gib(r.view.pool_reserved_high_bytes).c_str(),
              gib(r.device_used_after).c_str(), gib(r.view.device_total_bytes).c_str(), nvml.c_str());
}

// The blocked schedule `c` with gradients in forward, then with the recompute backward (one
// warm-up run each), each printed as "<label> grads-in-fwd" / "<label> recompute".
std::pair<VocabRun, VocabRun> run_both_backwards(DeviceAllocator& alloc, const CublasContext& blas,
                                                 flatpeak::exec::VocabScheduleConfig c, const std::string& label) {
  c.gradients_in_forward = true;
  const VocabRun gif = run_vocab(alloc, blas, c, true);
  print_vocab((label + " grads-in-fwd").c_str(), c, gif);
  c.gradients_in_forward = false;
  const VocabRun rec = run_vocab(alloc, blas, c, true);
  print_vocab((label + " recompute").c_str(), c, rec);
  return {gif, rec};
}

// How much less vocab memory `run` held than the materialised run, in percent.
double peak_reduction_percent(const VocabRun& run, const VocabRun& materialised) {
  return 100.0 * (1.0 - static_cast<double>(run.vocab_peak) / static_cast<double>(materialised.vocab_peak));
}

void vocab_section(const Options& o) {
  const ScopedStream stream;
  const cudaStream_t s = stream.get();
  DeviceAllocator alloc;
  CublasContext blas(alloc, s);
  flatpeak::exec::VocabScheduleConfig c;
  c.tokens = o.vocab_tokens;
  c.hidden = o.hidden;
  c.vocab = o.vocab;
  c.token_block_rows = o.t_blk;
  c.vocab_block_rows = o.v_blk;
  std::printf("== vocab: H=%lld V=%lld T=%lld, blocks T_blk=%lld V_blk=%lld, bf16, one warm-up run each\n",
              static_cast<long long>(c.hidden), static_cast<long long>(c.vocab),
              static_cast<long long>(c.tokens), static_cast<long long>(c.token_block_rows),
              static_cast<long long>(c.vocab_block_rows));
  c.mode = flatpeak::exec::VocabScheduleMode::Materialized;
  const VocabRun mat = run_vocab(alloc, blas, c, true);
  print_vocab("materialised", c, mat);
  c.mode = flatpeak::exec::VocabScheduleMode::Blocked;
  const auto [gif, rec] = run_both_backwards(alloc, blas, c, "blocked");
  char detail[512];
  if (mat.ran && gif.ran && rec.ran) {
    const double red_gif = peak_reduction_percent(gif, mat), red_rec = peak_reduction_percent(rec, mat);
    std::printf("vocab T=%lld: peak reduction %.2f%% (grads-in-fwd), %.2f%% (recompute) [issue: >= 86.6%%]; "
                "time ratio %.3fx (grads-in-fwd) [<= 1.05x], %.3fx (recompute) [<= 1.40x]\n",
                static_cast<long long>(c.tokens), red_gif, red_rec, gif.seconds / mat.seconds,
                rec.seconds / mat.seconds);
    std::snprintf(detail, sizeof detail,
                  "T=%lld: vocab peak %s -> %s (-%.1f%%) / %s (-%.1f%%) [>= 86.6%%]; time %.3fx gif [<= 1.05x], %.3fx recompute [<= 1.40x]",
                  static_cast<long long>(c.tokens), gib(mat.vocab_peak).c_str(), gib(gif.vocab_peak).c_str(),
                  red_gif, gib(rec.vocab_peak).c_str(), red_rec, gif.seconds / mat.seconds,
                  rec.seconds / mat.seconds);
    summary("vocab T=" + std::to_string(c.tokens) + " Ring-DTP R=1", "measured", detail);
    std::snprintf(detail, sizeof detail,
                  "materialised: tracked %s, pool used high %s, reserved high %s; blocked gif: tracked %s, pool used high %s",
                  gib(mat.tracked_high).c_str(), gib(mat.view.pool_used_high_bytes).c_str(),
                  gib(mat.view.pool_reserved_high_bytes).c_str(), gib(gif.tracked_high).c_str(),
                  gib(gif.view.pool_used_high_bytes).c_str());
    summary("vocab T=" + std::to_string(c.tokens) + " device view", "measured", detail);
  } else {
    summary("vocab T=" + std::to_string(c.tokens) + " Ring-DTP R=1", "skipped",
            (mat.ran ? std::string() : "materialised " + mat.skipped + "; ") +
                (gif.ran ? std::string() : "blocked " + gif.skipped));
  }
  // One vocab block per token block: the fused pass's backward reuses the forward's logits.
  {
    flatpeak::exec::VocabScheduleConfig r = c;
    r.token_block_rows = o.row_t_blk;
    r.vocab_block_rows = r.vocab;
    const auto [gif1, rec1] = run_both_backwards(alloc, blas, r, "one-V-block");
    const std::string name = "vocab T=" + std::to_string(c.tokens) + " T_blk=" + std::to_string(o.row_t_blk) + " V_blk=V";
    if (mat.ran && gif1.ran && rec1.ran) {
      const double red_gif = peak_reduction_percent(gif1, mat), red_rec = peak_reduction_percent(rec1, mat);
      std::snprintf(detail, sizeof detail,
                    "vocab peak %s -> %s (-%.1f%%) / %s (-%.1f%%) [>= 86.6%%]; time %.3fx gif [<= 1.05x], %.3fx recompute [<= 1.40x]; "
                    "loss %.6f vs materialised %.6f",
                    gib(mat.vocab_peak).c_str(), gib(gif1.vocab_peak).c_str(), red_gif, gib(rec1.vocab_peak).c_str(), red_rec,
                    gif1.seconds / mat.seconds, rec1.seconds / mat.seconds, gif1.loss, mat.loss);
      std::printf("%s: %s\n", name.c_str(), detail);
      summary(name, "measured", detail);
    } else {
      summary(name, "skipped", (mat.ran ? std::string() : "materialised " + mat.skipped + "; ") +
                                   (gif1.ran ? std::string() : "grads-in-fwd " + gif1.skipped + "; ") +
                                   (rec1.ran ? std::string() : "recompute " + rec1.skipped));
    }
  }
  for (int64_t tokens : o.big) {
    c.tokens = tokens;
    std::string line;
    bool any_ran = false;
    for (bool g : {true, false}) {
      c.gradients_in_forward = g;
      const VocabRun r = run_vocab(alloc, blas, c, false);
      any_ran = any_ran || r.ran;
      print_vocab(g ? "blocked grads-in-fwd" : "blocked recompute", c, r);
      char secs[32];
      std::snprintf(secs, sizeof secs, "%.3f s", r.seconds);
      line += std::string(line.empty() ? "" : "; ") + (g ? "gif: " : "recompute: ") +
              (r.ran ? gib(r.vocab_peak) + " vocab peak, " + secs : r.skipped);
    }
    summary("vocab blocked T=" + std::to_string(tokens), any_ran ? "measured" : "skipped", line);
  }
}

// ---- dispatch --------------------------------------------------------------------------------

void dispatch_section(const Options& o) {
  const ScopedStream stream;
  const cudaStream_t s = stream.get();
  DeviceAllocator alloc;
  CublasContext blas(alloc, s);
  flatpeak::exec::DispatchScheduleConfig c;
  c.tokens = o.dispatch_tokens;
  c.hidden = o.hidden;
  c.experts = o.experts;
  c.top_k = o.top_k;
  c.ffn = o.ffn;
  const std::vector<int32_t> ids = flatpeak::cuda::balanced_topk_ids(c.tokens, c.experts, c.top_k, c.seed);
  std::printf("== dispatch: EP=1, T=%lld H=%lld E=%lld k=%lld F=%lld, balanced routing, cap C=%lld, one warm-up run each\n",
              static_cast<long long>(c.tokens), static_cast<long long>(c.hidden), static_cast<long long>(c.experts),
              static_cast<long long>(c.top_k), static_cast<long long>(c.ffn), static_cast<long long>(o.cap));
  struct Run { flatpeak::cuda::DispatchScheduleCudaResult r; int64_t high = 0, dispatch_peak = 0; bool ran = false; std::string skipped; };
  auto run = [&](int64_t cap) {
    Run out;
    c.chunk_cap_rows = cap;
    trim(alloc, s);
    const int64_t need = flatpeak::cuda::dispatch_schedule_cuda_peak_bytes(c, kAlign);
    if (need + kMarginBytes > free_device_bytes()) {
      out.skipped = "skipped: needs " + gib(need) + ", " + gib(free_device_bytes()) + " free";
      return out;
    }
    (void)flatpeak::cuda::run_dispatch_schedule_cuda(alloc, blas, c, ids);
    alloc.reset_records();
    out.r = flatpeak::cuda::run_dispatch_schedule_cuda(alloc, blas, c, ids);
    out.high = alloc.high_water_bytes();
    out.dispatch_peak = category_peak(alloc, Category::Dispatch);
    out.ran = true;
    std::printf("dispatch %-9s rounds=%lld C=%lld: %.4f s (fwd %.4f, bwd %.4f), %.0f tokens/s, tracked high-water %s, "
                "dispatch peak %s, output sum %.6e\n",
                cap == 0 ? "uncapped" : "capped", static_cast<long long>(out.r.rounds),
                static_cast<long long>(out.r.chunk_cap_rows), out.r.seconds, out.r.forward_s, out.r.backward_s,
                static_cast<double>(c.tokens) / out.r.seconds, gib(out.high).c_str(), gib(out.dispatch_peak).c_str(),
                out.r.out_sum);
    return out;
  };
  const Run unc = run(0);
  const Run cap = run(o.cap);
  char detail[512];
  if (unc.ran && cap.ran) {
    const double ratio = unc.r.seconds / cap.r.seconds;
    std::printf("dispatch: capped/uncapped throughput %.3fx [issue: >= 0.95x]; dispatch peak %s -> %s (%.3fx)\n", ratio,
                gib(unc.dispatch_peak).c_str(), gib(cap.dispatch_peak).c_str(),
                static_cast<double>(cap.dispatch_peak) / static_cast<double>(unc.dispatch_peak));
    std::snprintf(detail, sizeof detail, "T=%lld, %lld rounds of C=%lld: throughput %.3fx uncapped [>= 0.95x]; dispatch peak %s -> %s; high-water %s -> %s",
                  static_cast<long long>(c.tokens), static_cast<long long>(cap.r.rounds),
                  static_cast<long long>(cap.r.chunk_cap_rows), ratio, gib(unc.dispatch_peak).c_str(),
                  gib(cap.dispatch_peak).c_str(), gib(unc.high).c_str(), gib(cap.high).c_str());
    summary("dispatch EP=1 capped", "measured", detail);
  } else {
    summary("dispatch EP=1 capped", "skipped", unc.ran ? cap.skipped : unc.skipped);
  }
}

// ---- dispatch-ep -----------------------------------------------------------------------------

constexpr int kEpRanks = 4;

// A rank's device bytes for one run, estimated from its routing (for the fit check only): the
// layer (x, d_out, native weights bf16 + fp32 gradients, router), the routing [T, E] tensors, and
// uncapped: the backward's expert buffers over R rows plus two [T·k, H] rows; capped: the round
// buffers, the foreign pool's weights and gradients and the round expert buffers; 32 MiB cuBLAS.
int64_t dispatch_ep_bytes(const flatpeak::exec::DispatchScheduleConfig& c, int64_t received_rows) {
  const int64_t T = c.tokens, H = c.hidden, F = c.ffn, E = c.experts, N = c.tokens * c.top_k, L = E / kEpRanks, P = 3 * H * F;
  const int64_t layer = 2 * T * H * 2 + E * H * 6 + L * P * 6 + T * H * 4, routing = T * E * 13 + N * 12;
  int64_t work = 0;
  if (c.chunk_cap_rows == 0) {
    work = received_rows * (4 * H + 12 * F + 4) + 2 * N * H * 2 + N * 8;
  } else {
    const int64_t C = std::min(c.chunk_cap_rows, N), B = flatpeak::exec::dispatch_round_buffer_rows(c, kEpRanks);
    work = 2 * c.depth * 2 * (B + C) * H * 2 + c.depth * 2 * (B + C) * 12 + 3 * N * 8 + flatpeak::exec::dispatch_foreign_pool(c, kEpRanks) * P * 6 +
           B * (6 * H + 12 * F) + T * H * 4;
  }
  return layer + routing + work + (int64_t{32} << 20);
}

struct EpRun {
  bool ran = false;
  std::string why;  // skipped or failed
  int64_t high = 0, dispatch_peak = 0;  // the largest over the ranks
  int high_rank = 0;
  double seconds = 0, forward_s = 0, backward_s = 0;  // the slowest rank's
  flatpeak::exec::DispatchScheduleResult plan;      // rank 0's
  double rho = 0;
};

EpRun run_dispatch_ep(const flatpeak::exec::DispatchScheduleConfig& c) {
  EpRun out;
  std::vector<std::vector<int32_t>> ids;
  std::vector<int64_t> native(kEpRanks, 0);  // copies whose expert is native on each rank
  for (int r = 0; r < kEpRanks; ++r) {
    ids.push_back(flatpeak::exec::draw_dispatch_routing(c, kEpRanks, r));
    for (int32_t e : ids.back()) ++native[static_cast<size_t>(e / (c.experts / kEpRanks))];
  }
  int64_t need = 0;
  for (int64_t rows : native) need += dispatch_ep_bytes(c, rows);
  const int64_t free_b = free_device_bytes();
  if (need + kMarginBytes > free_b) {
    out.why = "skipped: 4 ranks need about " + gib(need) + " (+ " + gib(kMarginBytes) + " margin), " + gib(free_b) + " free";
    return out;
  }
  std::vector<flatpeak::cuda::DispatchEpCudaResult> res(kEpRanks);
  std::vector<int64_t> high(kEpRanks), dsp(kEpRanks);
  const flatpeak::exec::RunResult run =
      flatpeak::cuda::run_ranks_on_device(kEpRanks, 0, [&](int rank, flatpeak::exec::Communicator& base) {
        auto& comm = static_cast<flatpeak::cuda::DeviceThreadsCommunicator&>(base);
        DeviceAllocator& alloc = comm.allocator();
        const CublasContext blas(alloc, comm.stream());
        const std::vector<int32_t>& mine = ids[static_cast<size_t>(rank)];
        (void)flatpeak::cuda::run_dispatch_ep_cuda(comm, alloc, blas, c, mine);  // warm-up: pool, cuBLAS
        alloc.reset_records();
        res[static_cast<size_t>(rank)] = flatpeak::cuda::run_dispatch_ep_cuda(comm, alloc, blas, c, mine);
        high[static_cast<size_t>(rank)] = alloc.high_water_bytes();
        dsp[static_cast<size_t>(rank)] = category_peak(alloc, Category::Dispatch);
      });
  if (!run.ok()) {
    out.why = "failed: " + run.message;
    return out;
  }
  out.ran = true;
  for (int r = 0; r < kEpRanks; ++r) {
    const size_t i = static_cast<size_t>(r);
    if (high[i] > out.high) {
      out.high = high[i];
      out.high_rank = r;
    }
    out.dispatch_peak = std::max(out.dispatch_peak, dsp[i]);
    if (res[i].seconds > out.seconds) {
      out.seconds = res[i].seconds;
      out.forward_s = res[i].forward_s;
      out.backward_s = res[i].backward_s;
    }
  }
  out.plan = res[0].plan;
  return out;
}

void dispatch_ep_section(const Options& o) {
  flatpeak::exec::DispatchScheduleConfig c;
  c.tokens = o.ep_tokens;
  c.hidden = o.hidden;
  c.experts = o.experts;
  c.top_k = o.top_k;
  c.ffn = o.ffn;
  c.routing = flatpeak::parse_routing_model("rho=2.5");
  c.lla.min_rows_per_gemm = o.ep_min_rows;
  c.outputs = false;  // memory and time only
  std::printf("== dispatch-ep: EP=4 ranks sharing the GPU, T=%lld per rank, H=%lld E=%lld k=%lld F=%lld, routing rho=2.5; "
              "uncapped standard EP vs PipelinedLLEP (C=%lld, striping, LLA: alpha %.2f, m %lld, lambda %.2f), one warm-up run each\n",
              static_cast<long long>(c.tokens), static_cast<long long>(c.hidden), static_cast<long long>(c.experts),
              static_cast<long long>(c.top_k), static_cast<long long>(c.ffn), static_cast<long long>(o.ep_cap), c.lla.llep_alpha,
              static_cast<long long>(c.lla.min_rows_per_gemm), c.lla.imbalance_trigger);
  const EpRun unc = run_dispatch_ep(c);
  c.chunk_cap_rows = o.ep_cap;
  c.llep = true;
  const EpRun cap = run_dispatch_ep(c);
  const std::pair<const char*, const EpRun*> runs[] = {{"uncapped EP", &unc}, {"PipelinedLLEP", &cap}};
  for (const auto& [name, rp] : runs) {
    const EpRun& r = *rp;
    if (!r.ran) {
      std::printf("dispatch-ep %-13s %s\n", name, r.why.c_str());
      continue;
    }
    std::printf("dispatch-ep %-13s per-rank tracked peak %s (rank %d), dispatch peak %s; slowest rank %.4f s (fwd %.4f, "
                "bwd %.4f); rank 0: R=%lld rows, rho %.3f, rounds %lld, C %lld, B %lld, pool %lld, S_p %lld, LLA %s\n",
                name, gib(r.high).c_str(), r.high_rank, gib(r.dispatch_peak).c_str(), r.seconds, r.forward_s, r.backward_s,
                static_cast<long long>(r.plan.received_rows), r.plan.rho, static_cast<long long>(r.plan.rounds),
                static_cast<long long>(r.plan.chunk_cap_rows), static_cast<long long>(r.plan.round_buffer_rows),
                static_cast<long long>(r.plan.foreign_pool), static_cast<long long>(r.plan.foreign_experts),
                r.plan.lla_triggered ? "ran" : "not triggered");
  }
  if (!unc.ran || !cap.ran) {
    const bool failed = unc.why.rfind("failed", 0) == 0 || cap.why.rfind("failed", 0) == 0;
    summary("dispatch EP=4 shared GPU rho=2.5", failed ? "FAIL" : "skipped", unc.ran ? cap.why : unc.why);
    return;
  }
  const double ratio = static_cast<double>(cap.high) / static_cast<double>(unc.high);
  const double dratio = static_cast<double>(cap.dispatch_peak) / static_cast<double>(unc.dispatch_peak);
  std::printf("dispatch-ep: PipelinedLLEP/uncapped per-rank peak %.3fx [issue 7: <= 0.41x], dispatch category %.3fx, "
              "time %.3fx\n", ratio, dratio, cap.seconds / unc.seconds);
  char detail[512];
  std::snprintf(detail, sizeof detail,
                "T=%lld/rank H=%lld F=%lld E=%lld k=%lld: per-rank peak %s -> %s = %.3fx [<= 0.41x]; dispatch %s -> %s; "
                "time %.3f s -> %.3f s (%lld rounds of C=%lld)",
                static_cast<long long>(c.tokens), static_cast<long long>(c.hidden), static_cast<long long>(c.ffn),
                static_cast<long long>(c.experts), static_cast<long long>(c.top_k), gib(unc.high).c_str(), gib(cap.high).c_str(),
                ratio, gib(unc.dispatch_peak).c_str(), gib(cap.dispatch_peak).c_str(), unc.seconds, cap.seconds,
                static_cast<long long>(cap.plan.rounds), static_cast<long long>(cap.plan.chunk_cap_rows));
  summary("dispatch EP=4 shared GPU rho=2.5", ratio <= 0.41 ? "PASS" : "FAIL", detail);
}

// ---- attention -------------------------------------------------------------------------------

// Uniform in ±[0.05, 1] from a hash of (seed, index), as the tests' Rng draws: inputs written on
// the device, no host copy of the 512 MiB tensors at 64K.
__global__ void fill_uniform_bf16_kernel(Bf16* x, int64_t n, uint32_t seed) {
  for (int64_t i = flatpeak::exec::cuda_detail::global_thread(); i < n;
       i += flatpeak::exec::cuda_detail::grid_threads()) {
    uint32_t h = static_cast<uint32_t>(i) ^ (static_cast<uint32_t>(i >> 32) * 0x9e3779b9u) ^ (seed * 0x85ebca6bu);
    h ^= h >> 16;
    h *= 0x7feb352du;
    h ^= h >> 15;
    h *= 0x846ca68bu;
    h ^= h >> 16;
    const float magnitude = 0.05f + 0.95f * static_cast<float>(h & 0xffffffu) / 16777216.0f;
    x[i] = flatpeak::exec::f32_to_bf16((h >> 31) != 0u ? -magnitude : magnitude);
  }
}

// q, k, v, d_out filled; out, lse, d_q, d_k, d_v and the backward workspace allocated.
struct AttentionBuffers {
  DeviceBuffer q, k, v, out, lse, d_out, d_q, d_k, d_v, ws;
  flatpeak::exec::AttentionArgs args;

  static int64_t bytes(int64_t tokens, int64_t a, int64_t g, int64_t d) {
    return 4 * tokens * a * d * 2 + 4 * tokens * g * d * 2 + 2 * a * tokens * 4;  // + lse, D [a, T]
  }
  AttentionBuffers(DeviceAllocator& alloc, cudaStream_t s, int64_t tokens, int64_t a, int64_t g, int64_t d) {
    args.dtype = flatpeak::exec::DType::BF16;
    args.tokens = tokens;
    args.q_heads = a;
    args.kv_heads = g;
    args.head_dim = d;
    const int64_t qo = tokens * a * d, kv = tokens * g * d;  // elements
    q = DeviceBuffer(alloc, qo * 2, Category::Activations, s);       // [T, a, d] bf16
    k = DeviceBuffer(alloc, kv * 2, Category::Activations, s);       // [T, g, d] bf16
    v = DeviceBuffer(alloc, kv * 2, Category::Activations, s);       // [T, g, d] bf16
    out = DeviceBuffer(alloc, qo * 2, Category::Activations, s);     // [T, a, d] bf16
    lse = DeviceBuffer(alloc, a * tokens * 4, Category::Activations, s);  // [a, T] fp32
    d_out = DeviceBuffer(alloc, qo * 2, Category::Activations, s);   // [T, a, d] bf16
    d_q = DeviceBuffer(alloc, qo * 2, Category::Activations, s);     // [T, a, d] bf16
    d_k = DeviceBuffer(alloc, kv * 2, Category::Activations, s);     // [T, g, d] bf16
    d_v = DeviceBuffer(alloc, kv * 2, Category::Activations, s);     // [T, g, d] bf16
    ws = DeviceBuffer(alloc, flatpeak::exec::attention_backward_workspace_bytes_cuda(args), Category::Activations, s);
    const std::pair<DeviceBuffer*, int64_t> inputs[] = {{&q, qo}, {&k, kv}, {&v, kv}, {&d_out, qo}};
    uint32_t seed = 71;
    for (const auto& [buffer, n] : inputs) {
      fill_uniform_bf16_kernel<<<flatpeak::exec::cuda_detail::grid_for(n), flatpeak::exec::cuda_detail::kThreads, 0, s>>>(
          static_cast<Bf16*>(buffer->raw()), n, seed++);
      FLATPEAK_CUDA_CHECK_LAUNCH();
    }
    args.q = q.raw();
    args.k = k.raw();
    args.v = v.raw();
    args.out = out.raw();
    args.lse = lse.as<float>();
    args.d_out = d_out.raw();
    args.d_q = d_q.raw();
    args.d_k = d_k.raw();
    args.d_v = d_v.raw();
    args.workspace = ws.as<float>();
  }
};

struct AttentionTimes {
  double forward_s = 0, backward_s = 0;
};

// Mean over `reps` runs of forward then backward on `s`, each timed by CUDA events.
AttentionTimes time_attention(const flatpeak::exec::AttentionArgs& a, flatpeak::exec::AttentionKernel kernel,
                              cudaStream_t s, int reps) {
  ScopedEvent t0, t1, t2;
  AttentionTimes out;
  for (int r = 0; r < reps; ++r) {
    t0.record(s);
    flatpeak::exec::attention_forward_cuda(a, s, kernel);
    t1.record(s);
    flatpeak::exec::attention_backward_cuda(a, s, kernel);
    t2.record(s);
    FLATPEAK_CUDA_CHECK(cudaEventSynchronize(t2.get()));
    out.forward_s += event_seconds(t0.get(), t1.get()) / reps;
    out.backward_s += event_seconds(t1.get(), t2.get()) / reps;
  }
  return out;
}

std::vector<float> download_bf16(const DeviceBuffer& b, cudaStream_t s) {
  FLATPEAK_CUDA_CHECK(cudaStreamSynchronize(s));
  std::vector<Bf16> raw(static_cast<size_t>(b.bytes() / 2));
  FLATPEAK_CUDA_CHECK(cudaMemcpy(raw.data(), b.raw(), static_cast<size_t>(b.bytes()), cudaMemcpyDeviceToHost));
  std::vector<float> out(raw.size());
  for (size_t i = 0; i < raw.size(); ++i) out[i] = flatpeak::exec::to_f32(raw[i]);
  return out;
}

// max |got − want| / max |want| (NaN when got has a NaN).
double max_rel_diff(const std::vector<float>& got, const std::vector<float>& want) {
  double diff = 0, scale = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double dv = std::fabs(static_cast<double>(got[i]) - static_cast<double>(want[i]));
    diff = std::isnan(dv) ? dv : std::max(diff, dv);
    scale = std::max(scale, std::fabs(static_cast<double>(want[i])));
    if (std::isnan(diff)) break;
  }
  return scale > 0 ? diff / scale : diff;
}

// FLOPs counted: forward 4·(T²/2)·a·d (Q·Kᵀ and P·V over the causal half); backward 2.5× that
// (the usual convention: Q·Kᵀ recomputed, dO·Vᵀ, dV, dK, dQ; the kernels here do more, as the dQ
// pass recomputes Q·Kᵀ and dO·Vᵀ, so the backward figure understates the work done).
double attention_forward_flops(int64_t tokens, int64_t a, int64_t d) {
  return 4.0 * 0.5 * static_cast<double>(tokens) * static_cast<double>(tokens) * static_cast<double>(a * d);
}

// Time on an H200 (2026-12-04): the reference kernels at T = 8192 0.62 s forward, 2.26 s
// backward; the tensor-core ones 15 + 50 ms there and 0.88 + 2.75 s at 64K (about 40 and 32
// TFLOP/s counted): about 7 s of kernels (the fills, downloads, comparison and the finite check
// of the 64K outputs, 1.1 G bf16 values scanned on the host, were not timed apart).
void attention_section(const Options& o) {
  using flatpeak::exec::AttentionKernel;
  const int64_t a = 64, g = 8, d = 64;  // gpt-oss-120b: num_attention_heads, num_key_value_heads, head_dim
  ScopedStream stream;
  DeviceAllocator alloc({kAlign});
  const cudaStream_t s = stream.get();
  {  // warm-up at a small T: module loads and the shared-memory opt-in, outside the timings
    AttentionBuffers small(alloc, s, 256, a, g, d);
    (void)time_attention(small.args, AttentionKernel::TensorCore, s, 1);
    (void)time_attention(small.args, AttentionKernel::Reference, s, 1);
  }
  const auto fits = [&](int64_t tokens, std::string& why) {
    const int64_t need = AttentionBuffers::bytes(tokens, a, g, d);
    const int64_t free_b = free_device_bytes();
    if (need + kMarginBytes <= free_b) return true;
    why = "skipped: needs " + gib(need) + " (+ " + gib(kMarginBytes) + " margin), " + gib(free_b) + " free";
    return false;
  };
  const std::string dims = "a=64 g=8 d=64 bf16";
  char detail[768];
  std::string why;
  const int64_t t1 = o.attn_tokens;
  if (!fits(t1, why)) {
    std::printf("attention T=%lld: %s\n", static_cast<long long>(t1), why.c_str());
    summary("attention T=" + std::to_string(t1) + " tensor-core vs reference", "skipped", why);
  } else {
    AttentionBuffers b(alloc, s, t1, a, g, d);
    (void)time_attention(b.args, AttentionKernel::TensorCore, s, 1);
    const AttentionTimes tc = time_attention(b.args, AttentionKernel::TensorCore, s, 3);
    const std::vector<float> tc_out = download_bf16(b.out, s), tc_dq = download_bf16(b.d_q, s);
    const std::vector<float> tc_dk = download_bf16(b.d_k, s), tc_dv = download_bf16(b.d_v, s);
    const AttentionTimes ref = time_attention(b.args, AttentionKernel::Reference, s, 1);
    const double diff_out = max_rel_diff(tc_out, download_bf16(b.out, s));
    const double diff_dq = max_rel_diff(tc_dq, download_bf16(b.d_q, s));
    const double diff_dk = max_rel_diff(tc_dk, download_bf16(b.d_k, s));
    const double diff_dv = max_rel_diff(tc_dv, download_bf16(b.d_v, s));
    // Each checked on its own: std::max drops a NaN that is not its first argument.
    bool close = true;
    for (const double diff : {diff_out, diff_dq, diff_dk, diff_dv}) close = close && diff <= 0.05;
    const double f = attention_forward_flops(t1, a, d);
    std::snprintf(detail, sizeof detail,
                  "T=%lld %s: forward tensor-core %.2f ms (%.1f TFLOP/s) vs reference %.1f ms (%.2f TFLOP/s), %.1fx; "
                  "backward tensor-core %.2f ms (%.1f TFLOP/s) vs reference %.1f ms (%.2f TFLOP/s), %.1fx; "
                  "max |tc - ref| / max |ref|: out %.2g, d_q %.2g, d_k %.2g, d_v %.2g",
                  static_cast<long long>(t1), dims.c_str(), 1e3 * tc.forward_s, f / tc.forward_s / 1e12,
                  1e3 * ref.forward_s, f / ref.forward_s / 1e12, ref.forward_s / tc.forward_s, 1e3 * tc.backward_s,
                  2.5 * f / tc.backward_s / 1e12, 1e3 * ref.backward_s, 2.5 * f / ref.backward_s / 1e12,
                  ref.backward_s / tc.backward_s, diff_out, diff_dq, diff_dk, diff_dv);
    std::printf("attention: %s\n", detail);
    // bf16 outputs of two fp32-accumulating kernel sets: a few bf16 ulps apart, not 5 %.
    summary("attention T=" + std::to_string(t1) + " tensor-core vs reference", close ? "measured" : "FAIL", detail);
  }
  const int64_t t2 = o.attn_big;
  if (!fits(t2, why)) {
    std::printf("attention T=%lld: %s\n", static_cast<long long>(t2), why.c_str());
    summary("attention T=" + std::to_string(t2) + " tensor-core", "skipped", why);
    return;
  }
  AttentionBuffers b(alloc, s, t2, a, g, d);
  const AttentionTimes tc = time_attention(b.args, AttentionKernel::TensorCore, s, 1);
  // No reference at this T: the outputs are only checked finite (an index or tail that goes wrong
  // only at long T shows as NaN or garbage infinities), after the timings.
  int64_t non_finite = 0;
  for (const DeviceBuffer* result : {&b.out, &b.d_q, &b.d_k, &b.d_v})
    for (const float x : download_bf16(*result, s)) non_finite += std::isfinite(x) ? 0 : 1;
  const double f = attention_forward_flops(t2, a, d);
  std::snprintf(detail, sizeof detail,
                "T=%lld %s: forward %.1f ms (%.1f TFLOP/s), backward %.1f ms (%.1f TFLOP/s counted as 2.5x forward); "
                "%lld non-finite values in out, d_q, d_k, d_v; reference not run (T^2)",
                static_cast<long long>(t2), dims.c_str(), 1e3 * tc.forward_s, f / tc.forward_s / 1e12,
                1e3 * tc.backward_s, 2.5 * f / tc.backward_s / 1e12, static_cast<long long>(non_finite));
  std::printf("attention: %s\n", detail);
  summary("attention T=" + std::to_string(t2) + " tensor-core", non_finite == 0 ? "measured" : "FAIL", detail);
}

// ---- checkpoint ------------------------------------------------------------------------------

struct CheckpointRun {
  flatpeak::cuda::CheckpointScheduleCudaResult r;
  int64_t boundary_peak = 0;  // device boundaries, the largest over the phases
};

CheckpointRun run_checkpoint(const flatpeak::exec::CheckpointScheduleConfig& c, bool copy_streams) {
  ScopedStream stream;
  DeviceAllocator alloc({kAlign});
  const CublasContext blas(alloc, stream.get());
  (void)flatpeak::cuda::run_checkpoint_schedule_cuda(alloc, blas, c, {copy_streams, false});  // warm-up: pool, cuBLAS, pinning
  alloc.reset_records();
  CheckpointRun out;
  out.r = flatpeak::cuda::run_checkpoint_schedule_cuda(alloc, blas, c, {copy_streams, false});
  out.boundary_peak = category_peak(alloc, Category::Boundaries);
  return out;
}

void checkpoint_section(const Options& o) {
  flatpeak::exec::CheckpointScheduleConfig kept;
  kept.tokens = o.ckpt_tokens;
  kept.hidden = 2048;
  kept.layers = 8;
  kept.heads = 16;  // head dim 128
  flatpeak::exec::CheckpointScheduleConfig offloaded = kept;
  // A new vector, not assign(): g++ 13 warns (-Warray-bounds) inside vector<bool>::assign's
  // inlined copy, a false positive of its own headers (seen building on the H200 machine).
  offloaded.offloaded = std::vector<bool>(static_cast<size_t>(kept.layers), true);
  offloaded.prefetch = 1;
  const CheckpointRun k = run_checkpoint(kept, true);
  const CheckpointRun sco = run_checkpoint(offloaded, true);
  offloaded.prefetch = 0;
  const CheckpointRun in_line = run_checkpoint(offloaded, false);
  const bool same_bits = sco.r.values.d_input == k.r.values.d_input && sco.r.values.d_weights == k.r.values.d_weights;
  char detail[512];
  std::snprintf(detail, sizeof detail,
                "T=%lld H=2048 L=8: kept %.1f ms; SCO %.3fx kept; in-line offload %.3fx kept; device boundaries %s -> %s (SCO), host %s%s; "
                "SCO bits %s kept's",
                static_cast<long long>(kept.tokens), 1e3 * k.r.seconds, sco.r.seconds / k.r.seconds, in_line.r.seconds / k.r.seconds,
                gib(k.boundary_peak).c_str(), gib(sco.boundary_peak).c_str(), gib(sco.r.host_boundary_bytes).c_str(),
                sco.r.host_pinned ? " pinned" : " PAGEABLE", same_bits ? "equal to" : "DIFFER from");
  std::printf("checkpoint: %s\n", detail);
  summary("checkpoint SCO", same_bits ? "measured" : "FAIL", detail);
}

// ---- offload ---------------------------------------------------------------------------------

// Spins one thread for `ns` nanoseconds of the device's global timer: a stand-in for a slice of
// backward that keeps the compute stream busy without touching the copy engines.
__global__ void spin_kernel(uint64_t ns) {
  uint64_t t0 = 0, t = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < ns);
}

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// STREAM copy over two arrays of `elems` floats split over `threads` (best of 3), in GB/s
// (8 bytes per element: read + write, no write-allocate counted).
double stream_copy_gbps(int64_t elems, int threads) {
  std::vector<float> a(static_cast<size_t>(elems), 1.0f), b(static_cast<size_t>(elems), 0.0f);
  const int64_t chunk = (elems + threads - 1) / threads;
  double best = 1e30;
  for (int rep = 0; rep < 3; ++rep) {
    const double t0 = now_s();
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t) {
      const int64_t begin = std::min(elems, t * chunk), len = std::min(elems, begin + chunk) - begin;
      pool.emplace_back([&, begin, len] { std::memcpy(b.data() + begin, a.data() + begin, static_cast<size_t>(len) * 4); });
    }
    for (std::thread& th : pool) th.join();
    best = std::min(best, now_s() - t0);
  }
  if (b[static_cast<size_t>(elems / 2)] != 1.0f) throw std::runtime_error("stream copy: wrong result");
  return 8.0 * static_cast<double>(elems) / best / 1e9;
}

struct OffloadRun {
  flatpeak::cuda::OffloadAdamWTimes t;
  double exposed_s = 0;  // last param H2D done − simulated backward done
  double backward_s = 0;
};

// One step with a simulated backward of `backward_s` on `compute` (0: none), its per-bucket
// grads_ready events recorded before the step is called (a wait on an unrecorded event is a no-op).
OffloadRun offload_step(const flatpeak::cuda::OffloadAdamWConfig& cfg, const Bf16* grads, Bf16* params,
                        const flatpeak::cuda::OffloadAdamWHost& host, cudaStream_t compute, cudaStream_t d2h,
                        cudaStream_t h2d, double backward_s) {
  OffloadRun out;
  const int64_t buckets = cfg.stream ? (cfg.elems + cfg.bucket_elems - 1) / cfg.bucket_elems : 1;
  std::vector<std::unique_ptr<ScopedEvent>> ready;
  std::vector<cudaEvent_t> ready_raw;
  ScopedEvent bwd_start, bwd_end, done;
  if (backward_s > 0) {
    bwd_start.record(compute);
    const uint64_t ns = static_cast<uint64_t>(backward_s * 1e9 / static_cast<double>(buckets));
    for (int64_t b = 0; b < buckets; ++b) {
      spin_kernel<<<1, 1, 0, compute>>>(ns);
      FLATPEAK_CUDA_CHECK_LAUNCH();
      ready.push_back(std::make_unique<ScopedEvent>());
      ready.back()->record(compute);
      ready_raw.push_back(ready.back()->get());
    }
    bwd_end.record(compute);
  }
  out.t = flatpeak::cuda::offload_adamw_step_cuda(cfg, grads, params, host, d2h, h2d,
                                                   backward_s > 0 ? &ready_raw : nullptr);
  if (backward_s > 0) {
    done.record(h2d);  // after every H2D of the step (the call returned once they completed)
    FLATPEAK_CUDA_CHECK(cudaEventSynchronize(done.get()));
    FLATPEAK_CUDA_CHECK(cudaEventSynchronize(bwd_end.get()));
    out.backward_s = event_seconds(bwd_start.get(), bwd_end.get());
    out.exposed_s = std::max(0.0, event_seconds(bwd_end.get(), done.get()));
  }
  return out;
}

void offload_section(const Options& o) {
  const ScopedStream compute_stream, d2h_stream, h2d_stream;
  const cudaStream_t compute = compute_stream.get(), d2h = d2h_stream.get(), h2d = h2d_stream.get();
  const int64_t n = o.offload_params;
  DeviceAllocator alloc;
  DeviceBuffer grads(alloc, n * 2, Category::Grads, compute);    // [n] bf16
  DeviceBuffer params(alloc, n * 2, Category::Params, compute);  // [n] bf16
  flatpeak::exec::cuda_detail::fill_bf16_cuda(grads.as<Bf16>(), n, 11, 1e-3f, compute);
  flatpeak::exec::cuda_detail::fill_bf16_cuda(params.as<Bf16>(), n, 12, 0.5f, compute);
  FLATPEAK_CUDA_CHECK(cudaStreamSynchronize(compute));
  flatpeak::cuda::OffloadAdamWConfig cfg;
  cfg.hyper.lr = 1e-4f;
  cfg.hyper.weight_decay = 0.01f;
  cfg.elems = n;
  cfg.bucket_elems = std::min(o.bucket, n);
  cfg.depth = o.depth;
  cfg.cpu_threads = o.threads;
  std::printf("== offload: %lld parameters (bf16 on the device, fp32 master/m/v pinned on the host), "
              "bucket %lld, depth %d, %d CPU threads\n",
              static_cast<long long>(n), static_cast<long long>(cfg.bucket_elems), cfg.depth, cfg.cpu_threads);
  auto arena_for = [&](bool stream) {
    cfg.stream = stream;
    flatpeak::cuda::PinnedArenaOptions ao;
    ao.bytes = flatpeak::cuda::offload_adamw_host_bytes(cfg);
    auto arena = std::make_unique<flatpeak::cuda::PinnedArena>(ao);
    flatpeak::cuda::OffloadAdamWHost host = flatpeak::cuda::carve_offload_adamw_host(*arena, cfg);
    std::fill(host.master, host.master + n, 0.5f);
    std::memset(host.m, 0, static_cast<size_t>(n) * 4);
    std::memset(host.v, 0, static_cast<size_t>(n) * 4);
    return std::make_pair(std::move(arena), host);
  };
  OffloadRun stream_alone, stream_bwd, serial_alone, serial_bwd;
  {
    auto [arena, host] = arena_for(true);
    cfg.hyper.step = 1;
    (void)offload_step(cfg, grads.as<Bf16>(), params.as<Bf16>(), host, compute, d2h, h2d, 0);  // warm-up
    cfg.hyper.step = 2;
    stream_alone = offload_step(cfg, grads.as<Bf16>(), params.as<Bf16>(), host, compute, d2h, h2d, 0);
    cfg.hyper.step = 3;
    stream_bwd = offload_step(cfg, grads.as<Bf16>(), params.as<Bf16>(), host, compute, d2h, h2d,
                              stream_alone.t.total_s);
  }
  {
    auto [arena, host] = arena_for(false);
    cfg.hyper.step = 2;
    serial_alone = offload_step(cfg, grads.as<Bf16>(), params.as<Bf16>(), host, compute, d2h, h2d, 0);
    cfg.hyper.step = 3;
    serial_bwd = offload_step(cfg, grads.as<Bf16>(), params.as<Bf16>(), host, compute, d2h, h2d,
                              stream_alone.t.total_s);
  }
  const flatpeak::cuda::OffloadAdamWTimes& t = stream_alone.t;
  const double slowest = std::max({t.d2h_s, t.cpu_s, t.h2d_s});
  const double fill = (t.d2h_s + t.cpu_s + t.h2d_s - slowest) / static_cast<double>(std::max<int64_t>(1, t.buckets));
  std::printf("offload stream: %.4f s over %lld buckets (D2H %.4f, CPU %.4f, H2D %.4f summed); slowest stage + one "
              "bucket fill %.4f s; ratio %.3f [issue: <= 1.1 x slowest + fill: %.4f s]\n",
              t.total_s, static_cast<long long>(t.buckets), t.d2h_s, t.cpu_s, t.h2d_s, slowest + fill,
              t.total_s / (slowest + fill), 1.1 * slowest + fill);
  std::printf("offload serial: %.4f s (D2H %.4f, CPU %.4f, H2D %.4f)\n", serial_alone.t.total_s,
              serial_alone.t.d2h_s, serial_alone.t.cpu_s, serial_alone.t.h2d_s);
  const double ratio = stream_bwd.exposed_s > 0 ? serial_bwd.exposed_s / stream_bwd.exposed_s : 0.0;
  std::printf("offload exposed after a simulated %.4f s backward: stream %.4f s, serial %.4f s, serial/stream %.2fx "
              "(paper: 2.05x)\n",
              stream_bwd.backward_s, stream_bwd.exposed_s, serial_bwd.exposed_s, ratio);
  // Bytes per parameter of the CPU step (adamw_bench's count): master, m, v read and written
  // (24), bf16 grad read (2), bf16 param written (2).
  const double adamw_gbps = 28.0 * static_cast<double>(n) / serial_alone.t.cpu_s / 1e9;
  const double bucket_gbps = 28.0 * static_cast<double>(n) / t.cpu_s / 1e9;
  const double stream_gbps = stream_copy_gbps(int64_t{256} << 20, o.threads);
  std::printf("CPU AdamW: %.1f GB/s full vector, %.1f GB/s per bucket in the pipeline; STREAM copy %.1f GB/s "
              "(%d threads); %.1f%% [issue: >= 70%%]\n",
              adamw_gbps, bucket_gbps, stream_gbps, o.threads, 100.0 * adamw_gbps / stream_gbps);
  char detail[512];
  std::snprintf(detail, sizeof detail, "%lld params: stream %.3f s [<= 1.1 x slowest %.3f + fill %.3f = %.3f s], serial %.3f s; "
                "exposed after bwd: stream %.3f s, serial %.3f s (%.2fx, paper 2.05x)",
                static_cast<long long>(n), t.total_s, slowest, fill, 1.1 * slowest + fill, serial_alone.t.total_s,
                stream_bwd.exposed_s, serial_bwd.exposed_s, ratio);
  summary("OffloadStreamAdamW " + std::to_string(n), "measured", detail);
  std::snprintf(detail, sizeof detail, "%.1f GB/s vs STREAM copy %.1f GB/s (%.1f%%) [>= 70%%], %d threads", adamw_gbps,
                stream_gbps, 100.0 * adamw_gbps / stream_gbps, o.threads);
  summary("CPU AdamW vs STREAM", "measured", detail);
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  try {
    o = parse(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cuda_techniques: error: %s\n", e.what());
    return 2;
  }
  int device_count = 0;
  const cudaError_t status = cudaGetDeviceCount(&device_count);
  if (status != cudaSuccess || device_count == 0) {
    std::printf("skipped: no CUDA device (%s: %s)\n", cudaGetErrorName(status), cudaGetErrorString(status));
    return 77;
  }
  try {
    cudaDeviceProp prop{};
    FLATPEAK_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    const std::time_t now = std::time(nullptr);
    char date[32];
    std::strftime(date, sizeof date, "%Y-%m-%d %H:%M UTC", std::gmtime(&now));
    std::printf("cuda_techniques on %s (sm_%d%d, %s), %s\n", prop.name, prop.major, prop.minor,
                gib(static_cast<int64_t>(prop.totalGlobalMem)).c_str(), date);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cuda_techniques: error: %s\n", e.what());
    return 1;
  }
  // A failing section is reported and the next one still runs (a sticky CUDA error will fail
  // them too, each with its own message).
  int failed = 0;
  const std::pair<const char*, void (*)(const Options&)> sections[] = {
      // attention after the sections that were there before it: if its estimate is off, the time
      // limit gpu-check.sh sets cuts it, not them.
      {"vocab", vocab_section}, {"dispatch", dispatch_section}, {"checkpoint", checkpoint_section},
      {"offload", offload_section}, {"attention", attention_section},
      {"dispatch-ep", dispatch_ep_section}};
  for (const auto& [name, run] : sections) {
    if (!wanted(o, name)) continue;
    try {
      run(o);
    } catch (const std::exception& e) {
      ++failed;
      std::fprintf(stderr, "cuda_techniques: error in %s: %s\n", name, e.what());
      std::fflush(stderr);
      summary(std::string(name) + " section", "FAIL", e.what());
    }
  }
  return failed == 0 ? 0 : 1;
}
