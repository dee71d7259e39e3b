#include "executor/cpu/op_util.h"
#include "executor/ops/combine.h"

namespace flatpeak::exec {
namespace {

void check(const CombineArgs& a) {
  require(a.tokens >= 0 && a.top_k > 0 && a.hidden > 0, "combine",
          "need tokens >= 0 and top_k, hidden > 0");
  require(a.y && a.weights, "combine", "needs y and weights");
}

int64_t row_of(const CombineArgs& a, int64_t t, int64_t s) {
  const int64_t slot = t * a.top_k + s;
  return a.slot_to_row != nullptr ? a.slot_to_row[slot] : slot;
}

}  // namespace

void combine_forward_cpu(const CombineArgs& a) {
  check(a);
  require(a.out != nullptr, "combine", "forward needs out");
  dispatch_compute(a.dtype, "combine", [&](auto tag) {
    using T = decltype(tag);
    const T* y = static_cast<const T*>(a.y);
    T* out = static_cast<T*>(a.out);
    for (int64_t t = 0; t < a.tokens; ++t) {
      for (int64_t h = 0; h < a.hidden; ++h) {
        float sum = 0.0f;
        for (int64_t s = 0; s < a.top_k; ++s) {
          sum += a.weights[t * a.top_k + s] * to_f32(y[row_of(a, t, s) * a.hidden + h]);
        }
        store_f32(&out[t * a.hidden + h], sum);
      }
    }
  });
}

void combine_backward_cpu(const CombineArgs& a) {
  check(a);
  require(a.d_out && a.d_y && a.d_weights, "combine", "backward needs d_out, d_y and d_weights");
  dispatch_compute(a.dtype, "combine", [&](auto tag) {
    using T = decltype(tag);
    const T* y = static_cast<const T*>(a.y);
    const T* d_out = static_cast<const T*>(a.d_out);
    T* d_y = static_cast<T*>(a.d_y);
    for (int64_t t = 0; t < a.tokens; ++t) {
      for (int64_t s = 0; s < a.top_k; ++s) {
        const int64_t row = row_of(a, t, s);
        const float w = a.weights[t * a.top_k + s];
        float dw = 0.0f;
        for (int64_t h = 0; h < a.hidden; ++h) {
          const float g = to_f32(d_out[t * a.hidden + h]);
          dw += g * to_f32(y[row * a.hidden + h]);
          store_f32(&d_y[row * a.hidden + h], w * g);
        }
        a.d_weights[t * a.top_k + s] = dw;
      }
    }
  });
}

}  // namespace flatpeak::exec
