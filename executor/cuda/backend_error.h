// The error every backend failure becomes (CUDA, cuBLAS; later NCCL): the failed statement, its
// file:line and the library's own error name and text. tools/ maps it to exit 4.
//   try { FLATPEAK_CUDA_CHECK(cudaMalloc(&p, n)); } catch (const flatpeak::cuda::BackendError& e) {
//     e.what();  // "cudaMalloc(&p, n) failed at executor/cuda/x.cpp:12: cudaErrorMemoryAllocation: out of memory"
//   }
#pragma once

#include <stdexcept>
#include <string>

namespace flatpeak::cuda {

class BackendError : public std::runtime_error {
 public:
  BackendError(std::string statement_, std::string location_, std::string error_)
      : std::runtime_error(statement_ + " failed at " + location_ + ": " + error_),
        statement(std::move(statement_)),
        location(std::move(location_)),
        error(std::move(error_)) {}
  std::string statement;  // the source text of the call, as written
  std::string location;   // "file:line"
  std::string error;      // "<error name>: <error string>" from the library
};

}  // namespace flatpeak::cuda
