// flatpeak_calibrate: measures, on the GPU it runs on, the device memory a training process holds
// outside its own tensors — the CUDA context, cuBLAS (handle, loaded kernels, the explicit
// workspace) and NCCL (communicator buffers) — and prints them as JSON, with the sum as the
// hardware card's `runtime_overhead_bytes` and `overhead_calibrated: true`. Each figure is the
// growth of a used-memory figure across one stage, from two sources taken together: NVML's count
// of this process's memory (nvml_view.h; the process's own, so other processes on the device do
// not leak in) and cudaMemGetInfo's total − free (the whole device). Both sets are printed; the
// top-level figures use NVML's when it answered at every stage (`overhead_source`), else
// cudaMemGetInfo's, so then run it alone on the device. tools/gpu-check.sh runs it and writes a
// calibrated copy of the card.
//   flatpeak_calibrate [--workspace-bytes N]  > calibration.json   # N >= 16384 (cuBLAS's minimum)
#include <cuda_runtime.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <exception>
#include <string>
#include <vector>

#include "executor/cuda/cublas_context.h"
#include "executor/cuda/cuda_check.h"
#include "executor/cuda/device_allocator.h"
#include "executor/cuda/nvml_view.h"
#ifdef FLATPEAK_HAVE_NCCL
#include "executor/comm/threads_comm.h"
#include "executor/cuda/nccl/nccl_comm.h"
#endif

using namespace flatpeak;
using namespace flatpeak::cuda;

namespace {

int64_t device_used_bytes() {
  size_t free_bytes = 0, total_bytes = 0;
  FLATPEAK_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  return static_cast<int64_t>(total_bytes) - static_cast<int64_t>(free_bytes);
}

// Used memory by both sources at one moment.
struct Used {
  int64_t mem_get_info = 0;  // the whole device: total − free
  NvmlMemory nvml;           // this process, when nvml.available
};

Used used_now() {
  Used u;
  u.mem_get_info = device_used_bytes();
  u.nvml = nvml_process_memory(0);
  return u;
}

// The overhead terms by one source.
struct Figures {
  int64_t context = 0, cublas = 0, nccl = -1;  // nccl -1: not measured (no NCCL)
  int64_t total(int64_t workspace_bytes) const { return context + cublas + workspace_bytes + (nccl > 0 ? nccl : 0); }
};

void print_figures(const char* key, const Figures& f, int64_t workspace_bytes) {
  std::printf("  \"%s\": {\"cuda_context_bytes\": %lld, \"cublas_bytes\": %lld, ", key,
              static_cast<long long>(f.context), static_cast<long long>(f.cublas));
  if (f.nccl >= 0) std::printf("\"nccl_bytes\": %lld, ", static_cast<long long>(f.nccl));
  else std::printf("\"nccl_bytes\": null, ");
  std::printf("\"total_bytes\": %lld},\n", static_cast<long long>(f.total(workspace_bytes)));
}

std::string json_string(const std::string& text) {
  std::string out = "\"";
  for (const char ch : text) {
    if (ch == '"' || ch == '\\') out += '\\';
    if (static_cast<unsigned char>(ch) < 0x20) continue;  // no control characters in a JSON string
    out += ch;
  }
  return out + "\"";
}

}  // namespace

int main(int argc, char** argv) {
  int64_t workspace_bytes = 32LL << 20;  // CublasContext's default, the Hopper recommendation
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--workspace-bytes" && i + 1 < argc) {
      const char* text = argv[++i];
      char* end = nullptr;
      errno = 0;
      workspace_bytes = std::strtoll(text, &end, 10);
      // cuBLAS may fail GEMMs with a workspace under 16 KiB (CublasContext refuses it).
      if (end == text || *end != '\0' || errno != 0 || workspace_bytes < CublasContext::kMinWorkspaceBytes) {
        std::fprintf(stderr, "flatpeak_calibrate: error: --workspace-bytes must be an integer >= %lld (16 KiB, cuBLAS's minimum), got '%s'\n",
                     static_cast<long long>(CublasContext::kMinWorkspaceBytes), text);
        return 2;
      }
    } else {
      std::fprintf(stderr, "flatpeak_calibrate: error: unknown argument '%s' (usage: flatpeak_calibrate [--workspace-bytes N])\n", arg.c_str());
      return 2;
    }
  }
  try {
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
      std::fprintf(stderr, "flatpeak_calibrate: error: no CUDA device\n");
      return 4;
    }
    FLATPEAK_CUDA_CHECK(cudaSetDevice(0));
    FLATPEAK_CUDA_CHECK(cudaFree(nullptr));  // creates the context
    cudaDeviceProp prop{};
    FLATPEAK_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    const Used context = used_now();  // NVML: the process's context alone; cudaMemGetInfo: the device's use
    // NVML's figures are used only when it answered at every stage (a reason otherwise).
    std::string nvml_reason = context.nvml.available ? "" : context.nvml.reason;
    auto note_nvml = [&nvml_reason](const Used& u) {
      if (!u.nvml.available && nvml_reason.empty()) nvml_reason = u.nvml.reason;
    };
    Figures by_mem_get_info, by_nvml;
    by_mem_get_info.context = context.mem_get_info;
    by_nvml.context = context.nvml.process_used_bytes;

    DeviceAllocator alloc;
    {
      CublasContext blas(alloc, nullptr, workspace_bytes);
      // One GEMM of each kind the backend runs loads cuBLAS's kernels.
      const int64_t n = 1024;
      DeviceBuffer a(alloc, n * n * 2, exec::Category::Workspace), c(alloc, n * n * 4, exec::Category::Workspace);
      FLATPEAK_CUDA_CHECK(cudaMemset(a.raw(), 0, static_cast<size_t>(n * n * 2)));
      gemm_cuda(blas, false, true, n, n, n, 1.0f, exec::DType::BF16, a.raw(), n, exec::DType::BF16, a.raw(), n,
                false, exec::DType::F32, c.raw(), n);
      FLATPEAK_CUDA_CHECK(cudaDeviceSynchronize());
      // What grew beyond the context, less this process's own pool blocks (the GEMM's operands);
      // the explicit workspace is a pool block too, so it is added back by name below.
      const Used after = used_now();
      note_nvml(after);
      const int64_t pool_reserved = alloc.device_view().pool_reserved_bytes;
      by_mem_get_info.cublas = after.mem_get_info - context.mem_get_info - pool_reserved;
      by_nvml.cublas = after.nvml.process_used_bytes - context.nvml.process_used_bytes - pool_reserved;
    }
#ifdef FLATPEAK_HAVE_NCCL
    {
      const Used before = used_now();
      note_nvml(before);
      const int64_t pool_before = alloc.device_view().pool_reserved_bytes;
      const exec::RunResult r = exec::run_ranks(1, [&](int, exec::Communicator& host) {
        cudaStream_t stream = nullptr;
        FLATPEAK_CUDA_CHECK(cudaStreamCreate(&stream));
        {
          NcclCommunicator comm(host, stream);
          DeviceBuffer x(alloc, 1 << 20, exec::Category::Comm);
          comm.all_reduce(x.raw(), x.raw(), (1 << 20) / 4, exec::DType::F32, exec::ReduceOp::Sum);
          FLATPEAK_CUDA_CHECK(cudaStreamSynchronize(stream));
          // Less what the pool grew by for the 1 MiB buffer (nothing when its reserve covered it).
          const Used after = used_now();
          note_nvml(after);
          const int64_t pool_grown = alloc.device_view().pool_reserved_bytes - pool_before;
          by_mem_get_info.nccl = after.mem_get_info - before.mem_get_info - pool_grown;
          by_nvml.nccl = after.nvml.process_used_bytes - before.nvml.process_used_bytes - pool_grown;
        }
        FLATPEAK_CUDA_CHECK(cudaStreamDestroy(stream));
      });
      if (!r.ok()) throw std::runtime_error(r.message);
    }
#endif
    const bool use_nvml = nvml_reason.empty();
    const Figures& chosen = use_nvml ? by_nvml : by_mem_get_info;
    char date[32];
    const std::time_t now = std::time(nullptr);
    std::strftime(date, sizeof date, "%Y-%m-%d", std::gmtime(&now));
    std::printf("{\n  \"device\": \"%s\",\n  \"date\": \"%s\",\n", prop.name, date);
    std::printf("  \"cuda_context_bytes\": %lld,\n  \"cublas_bytes\": %lld,\n  \"cublas_workspace_bytes\": %lld,\n",
                static_cast<long long>(chosen.context), static_cast<long long>(chosen.cublas),
                static_cast<long long>(workspace_bytes));
    if (chosen.nccl >= 0) std::printf("  \"nccl_bytes\": %lld,\n", static_cast<long long>(chosen.nccl));
    else std::printf("  \"nccl_bytes\": null,\n");
    std::printf("  \"overhead_source\": \"%s\",\n", use_nvml ? "nvml_process" : "cudaMemGetInfo");
    std::printf("  \"nvml_reason\": %s,\n", use_nvml ? "null" : json_string(nvml_reason).c_str());
    print_figures("by_mem_get_info", by_mem_get_info, workspace_bytes);
    if (use_nvml) print_figures("by_nvml_process", by_nvml, workspace_bytes);
    else std::printf("  \"by_nvml_process\": null,\n");
    std::printf("  \"runtime_overhead_bytes\": %lld,\n  \"overhead_calibrated\": true\n}\n",
                static_cast<long long>(chosen.total(workspace_bytes)));
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "flatpeak_calibrate: error: %s\n", e.what());
    return 4;
  }
}
