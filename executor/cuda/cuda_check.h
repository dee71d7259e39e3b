// The one funnel for CUDA runtime and cuBLAS status codes: a failure throws BackendError with the
// statement, file:line and the library's error name and string. Libraries never print or exit.
//   FLATPEAK_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream));
//   FLATPEAK_CUBLAS_CHECK(cublasSetWorkspace(handle, ptr, bytes));
//   FLATPEAK_CUDA_CHECK_LAUNCH();  // after a <<<...>>> launch: reports a bad configuration at once
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <string>

#include "executor/cuda/backend_error.h"

namespace flatpeak::cuda {

[[noreturn]] inline void throw_backend_error(const char* statement, const char* file, int line,
                                             const char* error_name, const char* error_string) {
  throw BackendError(statement, std::string(file) + ":" + std::to_string(line),
                     std::string(error_name) + ": " + error_string);
}

}  // namespace flatpeak::cuda

#define FLATPEAK_CUDA_CHECK(statement)                                                          \
  do {                                                                                          \
    const cudaError_t flatpeak_cuda_status_ = (statement);                                      \
    if (flatpeak_cuda_status_ != cudaSuccess) {                                                 \
      ::flatpeak::cuda::throw_backend_error(#statement, __FILE__, __LINE__,                     \
                                            cudaGetErrorName(flatpeak_cuda_status_),            \
                                            cudaGetErrorString(flatpeak_cuda_status_));         \
    }                                                                                           \
  } while (0)

#define FLATPEAK_CUBLAS_CHECK(statement)                                                        \
  do {                                                                                          \
    const cublasStatus_t flatpeak_cublas_status_ = (statement);                                 \
    if (flatpeak_cublas_status_ != CUBLAS_STATUS_SUCCESS) {                                     \
      ::flatpeak::cuda::throw_backend_error(#statement, __FILE__, __LINE__,                     \
                                            cublasGetStatusName(flatpeak_cublas_status_),       \
                                            cublasGetStatusString(flatpeak_cublas_status_));    \
    }                                                                                           \
  } while (0)

// Launch errors (bad grid, missing kernel image for this device) surface at the launch itself.
#define FLATPEAK_CUDA_CHECK_LAUNCH() FLATPEAK_CUDA_CHECK(cudaGetLastError())
