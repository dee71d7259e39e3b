#include "executor/cpu/op_util.h"
#include "executor/ops/rmsnorm.h"

namespace flatpeak::exec {
namespace {

void check(const RmsNormArgs& a) {
  require(a.tokens >= 0 && a.hidden > 0, "rmsnorm", "tokens must be >= 0 and hidden > 0");
  require(a.x && a.weight && a.rstd, "rmsnorm", "needs x, weight and rstd");
}

}  // namespace

int64_t rmsnorm_workspace_bytes(const RmsNormArgs& a) { return a.hidden * 4; }

void rmsnorm_forward_cpu(const RmsNormArgs& a) {
  check(a);
  require(a.out != nullptr, "rmsnorm", "forward needs out");
  dispatch_compute(a.dtype, "rmsnorm", [&](auto tag) {
    using T = decltype(tag);
    const T* x = static_cast<const T*>(a.x);
    const T* w = static_cast<const T*>(a.weight);
    T* out = static_cast<T*>(a.out);
    for (int64_t t = 0; t < a.tokens; ++t) {
      const T* xr = x + t * a.hidden;
      float sum_squares = 0.0f;
      for (int64_t h = 0; h < a.hidden; ++h) sum_squares += to_f32(xr[h]) * to_f32(xr[h]);
      const float rstd = rmsnorm_rstd(sum_squares, a.hidden, a.eps);
      a.rstd[t] = rstd;
      for (int64_t h = 0; h < a.hidden; ++h) {
        store_f32(&out[t * a.hidden + h], to_f32(xr[h]) * rstd * to_f32(w[h]));
      }
    }
  });
}

// dx = rstd · (w ⊙ dy) − x · rstd³ / H · Σ_h (w ⊙ dy ⊙ x);  dw = Σ_t dy ⊙ x · rstd.
void rmsnorm_backward_cpu(const RmsNormArgs& a) {
  check(a);
  require(a.d_out && a.d_x && a.d_weight, "rmsnorm", "backward needs d_out, d_x and d_weight");
  require(a.workspace != nullptr, "rmsnorm", "backward needs a workspace of [H] fp32");
  dispatch_compute(a.dtype, "rmsnorm", [&](auto tag) {
    using T = decltype(tag);
    const T* x = static_cast<const T*>(a.x);
    const T* w = static_cast<const T*>(a.weight);
    const T* dy = static_cast<const T*>(a.d_out);
    T* dx = static_cast<T*>(a.d_x);
    float* dw_sum = a.workspace;  // [H] fp32
    for (int64_t h = 0; h < a.hidden; ++h) dw_sum[h] = 0.0f;
    const float inv_h = 1.0f / static_cast<float>(a.hidden);
    for (int64_t t = 0; t < a.tokens; ++t) {
      const int64_t row = t * a.hidden;
      const float rstd = a.rstd[t];
      float dot = 0.0f;  // Σ_h w·dy·x
      for (int64_t h = 0; h < a.hidden; ++h) {
        dot += to_f32(w[h]) * to_f32(dy[row + h]) * to_f32(x[row + h]);
        dw_sum[h] += to_f32(dy[row + h]) * to_f32(x[row + h]) * rstd;
      }
      const float coef = dot * rstd * rstd * rstd * inv_h;
      for (int64_t h = 0; h < a.hidden; ++h) {
        store_f32(&dx[row + h],
                  rstd * to_f32(w[h]) * to_f32(dy[row + h]) - coef * to_f32(x[row + h]));
      }
    }
    T* dw = static_cast<T*>(a.d_weight);
    for (int64_t h = 0; h < a.hidden; ++h) store_f32(&dw[h], to_f32(dw[h]) + dw_sum[h]);
  });
}

}  // namespace flatpeak::exec
