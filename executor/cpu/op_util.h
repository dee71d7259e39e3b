// Argument checks and dtype dispatch shared by the CPU ops (internal to executor/cpu).
//   require(args.hidden > 0, "rmsnorm", "hidden must be > 0");
//   dispatch_compute(args.dtype, "rmsnorm", [&](auto tag) { using T = decltype(tag); run<T>(); });
#pragma once

#include <stdexcept>
#include <string>

#include "executor/ops/dtype.h"

namespace flatpeak::exec {

[[noreturn]] inline void fail(const char* op, const std::string& what) {
  throw std::invalid_argument(std::string(op) + ": " + what);
}

// Takes a plain C string so that a passing check builds no std::string (ops stay off the heap);
// messages with values are built only on failure: `if (!ok) fail(op, "..." + ...)`.
inline void require(bool ok, const char* op, const char* what) {
  if (!ok) fail(op, what);
}

// Calls f(T{}) with T = float for F32 and Bf16 for BF16; other dtypes are an argument error.
template <class F>
void dispatch_compute(DType dtype, const char* op, F&& f) {
  if (dtype == DType::F32) {
    f(float{});
  } else if (dtype == DType::BF16) {
    f(Bf16{});
  } else {
    fail(op, std::string("compute dtype must be f32 or bf16 (got ") + dtype_name(dtype) + ")");
  }
}

}  // namespace flatpeak::exec
