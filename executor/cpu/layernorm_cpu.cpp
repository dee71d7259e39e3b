#include "executor/cpu/op_util.h"
#include "executor/ops/layernorm.h"

namespace flatpeak::exec {
namespace {

void check(const LayerNormArgs& a) {
  require(a.tokens >= 0 && a.hidden > 0, "layernorm", "tokens must be >= 0 and hidden > 0");
  require(a.x && a.weight && a.mean && a.rstd, "layernorm", "needs x, weight, mean and rstd");
}

}  // namespace

int64_t layernorm_workspace_bytes(const LayerNormArgs& a) { return 2 * a.hidden * 4; }

void layernorm_forward_cpu(const LayerNormArgs& a) {
  check(a);
  require(a.out && a.bias, "layernorm", "forward needs out and bias");
  dispatch_compute(a.dtype, "layernorm", [&](auto tag) {
    using T = decltype(tag);
    const T* x = static_cast<const T*>(a.x);
    const T* w = static_cast<const T*>(a.weight);
    const T* b = static_cast<const T*>(a.bias);
    T* out = static_cast<T*>(a.out);
    for (int64_t t = 0; t < a.tokens; ++t) {
      const T* xr = x + t * a.hidden;
      float mean = 0.0f, rstd = 0.0f;
      layernorm_row_stats(xr, a.hidden, a.eps, mean, rstd);
      a.mean[t] = mean;
      a.rstd[t] = rstd;
      for (int64_t h = 0; h < a.hidden; ++h)
        store_f32(&out[t * a.hidden + h], (to_f32(xr[h]) - mean) * rstd * to_f32(w[h]) + to_f32(b[h]));
    }
  });
}

// dx = rstd · (g − mean_h(g) − x̂ · mean_h(g ⊙ x̂)), g = w ⊙ dy;  dw += Σ_t dy ⊙ x̂;  db += Σ_t dy.
void layernorm_backward_cpu(const LayerNormArgs& a) {
  check(a);
  require(a.d_out && a.d_x && a.d_weight && a.d_bias, "layernorm", "backward needs d_out, d_x, d_weight and d_bias");
  require(a.workspace != nullptr, "layernorm", "backward needs a workspace of [2, H] fp32");
  dispatch_compute(a.dtype, "layernorm", [&](auto tag) {
    using T = decltype(tag);
    const T* x = static_cast<const T*>(a.x);
    const T* w = static_cast<const T*>(a.weight);
    const T* dy = static_cast<const T*>(a.d_out);
    T* dx = static_cast<T*>(a.d_x);
    float* dw_sum = a.workspace;             // [H] fp32
    float* db_sum = a.workspace + a.hidden;  // [H] fp32
    for (int64_t h = 0; h < a.hidden; ++h) dw_sum[h] = db_sum[h] = 0.0f;
    const float inv_h = 1.0f / static_cast<float>(a.hidden);
    for (int64_t t = 0; t < a.tokens; ++t) {
      const int64_t row = t * a.hidden;
      const float mean = a.mean[t], rstd = a.rstd[t];
      float sum_g = 0.0f, sum_g_xhat = 0.0f;
      for (int64_t h = 0; h < a.hidden; ++h) {
        const float xhat = (to_f32(x[row + h]) - mean) * rstd;
        const float g = to_f32(w[h]) * to_f32(dy[row + h]);
        sum_g += g;
        sum_g_xhat += g * xhat;
        dw_sum[h] += to_f32(dy[row + h]) * xhat;
        db_sum[h] += to_f32(dy[row + h]);
      }
      const float mean_g = sum_g * inv_h, mean_g_xhat = sum_g_xhat * inv_h;
      for (int64_t h = 0; h < a.hidden; ++h) {
        const float xhat = (to_f32(x[row + h]) - mean) * rstd;
        store_f32(&dx[row + h], layernorm_dx(to_f32(w[h]) * to_f32(dy[row + h]), xhat, rstd, mean_g, mean_g_xhat));
      }
    }
    T* dw = static_cast<T*>(a.d_weight);
    T* db = static_cast<T*>(a.d_bias);
    for (int64_t h = 0; h < a.hidden; ++h) {
      store_f32(&dw[h], to_f32(dw[h]) + dw_sum[h]);
      store_f32(&db[h], to_f32(db[h]) + db_sum[h]);
    }
  });
}

}  // namespace flatpeak::exec
