// flatpeak_calibrate: measures, on the GPU it runs on, the device memory a training process holds
// outside its own tensors — the CUDA context, cuBLAS (handle, loaded kernels, the explicit
// workspace) and NCCL (communicator buffers) — and prints them as JSON, with the sum as the
// hardware card's `runtime_overhead_bytes` and `overhead_calibrated: true`. Each figure is the
// growth of the device's used memory (cudaMemGetInfo: total − free) across one stage, so run it
// alone on the device. tools/gpu-check.sh runs it and writes a calibrated copy of the card.
//   flatpeak_calibrate [--workspace-bytes N]  > calibration.json
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <exception>
#include <string>

#include "executor/cuda/cublas_context.h"
#include "executor/cuda/cuda_check.h"
#include "executor/cuda/device_allocator.h"
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

}  // namespace

int main(int argc, char** argv) {
  int64_t workspace_bytes = 32LL << 20;  // CublasContext's default, the Hopper recommendation
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--workspace-bytes" && i + 1 < argc) {
      workspace_bytes = std::strtoll(argv[++i], nullptr, 10);
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
    const int64_t context = device_used_bytes();

    DeviceAllocator alloc;
    int64_t cublas = 0;
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
      cublas = device_used_bytes() - context - alloc.device_view().pool_reserved_bytes;
    }
    int64_t nccl = -1;
#ifdef FLATPEAK_HAVE_NCCL
    {
      const int64_t before = device_used_bytes();
      int64_t grown = 0;
      const exec::RunResult r = exec::run_ranks(1, [&](int, exec::Communicator& host) {
        cudaStream_t stream = nullptr;
        FLATPEAK_CUDA_CHECK(cudaStreamCreate(&stream));
        {
          NcclCommunicator comm(host, stream);
          DeviceBuffer x(alloc, 1 << 20, exec::Category::Comm);
          comm.all_reduce(x.raw(), x.raw(), (1 << 20) / 4, exec::DType::F32, exec::ReduceOp::Sum);
          FLATPEAK_CUDA_CHECK(cudaStreamSynchronize(stream));
          grown = device_used_bytes() - before - (1 << 20);
        }
        FLATPEAK_CUDA_CHECK(cudaStreamDestroy(stream));
      });
      if (!r.ok()) throw std::runtime_error(r.message);
      nccl = grown;
    }
#endif
    const int64_t total = context + cublas + workspace_bytes + (nccl > 0 ? nccl : 0);
    char date[32];
    const std::time_t now = std::time(nullptr);
    std::strftime(date, sizeof date, "%Y-%m-%d", std::gmtime(&now));
    std::printf("{\n  \"device\": \"%s\",\n  \"date\": \"%s\",\n", prop.name, date);
    std::printf("  \"cuda_context_bytes\": %lld,\n  \"cublas_bytes\": %lld,\n  \"cublas_workspace_bytes\": %lld,\n",
                static_cast<long long>(context), static_cast<long long>(cublas), static_cast<long long>(workspace_bytes));
    if (nccl >= 0) std::printf("  \"nccl_bytes\": %lld,\n", static_cast<long long>(nccl));
    else std::printf("  \"nccl_bytes\": null,\n");
    std::printf("  \"runtime_overhead_bytes\": %lld,\n  \"overhead_calibrated\": true\n}\n", static_cast<long long>(total));
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "flatpeak_calibrate: error: %s\n", e.what());
    return 4;
  }
}
