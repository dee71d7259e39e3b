#include "executor/cpu/gemm_cpu.h"
#include "executor/cpu/op_util.h"
#include "executor/ops/linear.h"

namespace flatpeak::exec {
namespace {

void check(const LinearArgs& a) {
  require(a.tokens >= 0 && a.in_features > 0 && a.out_features > 0, "linear",
          "tokens must be >= 0 and features > 0");
}

}  // namespace

void linear_forward_cpu(const LinearArgs& a) {
  check(a);
  require(a.x && a.w && a.y, "linear", "forward needs x, w and y");
  dispatch_compute(a.dtype, "linear", [&](auto tag) {
    using T = decltype(tag);
    gemm_cpu(false, true, a.tokens, a.out_features, a.in_features, 1.0f,
             static_cast<const T*>(a.x), a.in_features, static_cast<const T*>(a.w),
             a.in_features, false, static_cast<T*>(a.y), a.out_features);
  });
}

void linear_backward_cpu(const LinearArgs& a) {
  check(a);
  require(a.d_y != nullptr, "linear", "backward needs d_y");
  dispatch_compute(a.dtype, "linear", [&](auto tag) {
    using T = decltype(tag);
    const T* dy = static_cast<const T*>(a.d_y);
    if (a.d_x != nullptr) {
      require(a.w != nullptr, "linear", "d_x needs w");
      gemm_cpu(false, false, a.tokens, a.in_features, a.out_features, 1.0f, dy, a.out_features,
               static_cast<const T*>(a.w), a.in_features, false, static_cast<T*>(a.d_x),
               a.in_features);
    }
    if (a.d_w != nullptr) {
      require(a.x != nullptr, "linear", "d_w needs x");
      gemm_cpu(true, false, a.out_features, a.in_features, a.tokens, 1.0f, dy, a.out_features,
               static_cast<const T*>(a.x), a.in_features, true, static_cast<T*>(a.d_w),
               a.in_features);
    }
  });
}

}  // namespace flatpeak::exec
