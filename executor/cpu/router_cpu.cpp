#include <algorithm>
#include <cmath>

#include "executor/cpu/op_util.h"
#include "executor/ops/router.h"

namespace flatpeak::exec {
namespace {

void check(const RouterArgs& a) {
  require(a.tokens >= 0 && a.experts > 0 && a.top_k > 0 && a.top_k <= a.experts, "router",
          "need tokens >= 0 and 1 <= top_k <= experts");
  require(a.logits && a.topk_ids && a.topk_weights, "router",
          "needs logits, topk_ids and topk_weights");
}

}  // namespace

void router_forward_cpu(const RouterArgs& a) {
  check(a);
  const int64_t E = a.experts;
  const int64_t k = a.top_k;
  for (int64_t t = 0; t < a.tokens; ++t) {
    const float* z = a.logits + t * E;
    int32_t* ids = a.topk_ids + t * k;
    float* w = a.topk_weights + t * k;
    float max_z = -INFINITY;
    for (int64_t e = 0; e < E; ++e) max_z = std::max(max_z, z[e]);
    float sum = 0.0f;
    for (int64_t e = 0; e < E; ++e) sum += std::exp(z[e] - max_z);
    // k passes of selection: the best expert not yet taken (strict > keeps the lower index).
    float kept_sum = 0.0f;
    for (int64_t s = 0; s < k; ++s) {
      int64_t best = -1;
      for (int64_t e = 0; e < E; ++e) {
        bool taken = false;
        for (int64_t p = 0; p < s; ++p) taken = taken || ids[p] == e;
        if (!taken && (best < 0 || z[e] > z[best])) best = e;
      }
      ids[s] = static_cast<int32_t>(best);
      w[s] = std::exp(z[best] - max_z) / sum;  // the softmax probability
      kept_sum += w[s];
    }
    for (int64_t s = 0; s < k; ++s) w[s] /= kept_sum;
  }
}

void router_backward_cpu(const RouterArgs& a) {
  check(a);
  require(a.d_topk_weights && a.d_logits, "router", "backward needs d_topk_weights and d_logits");
  const int64_t E = a.experts;
  const int64_t k = a.top_k;
  for (int64_t t = 0; t < a.tokens; ++t) {
    const int32_t* ids = a.topk_ids + t * k;
    const float* w = a.topk_weights + t * k;
    const float* dw = a.d_topk_weights + t * k;
    float* dz = a.d_logits + t * E;
    std::fill(dz, dz + E, 0.0f);
    float weighted = 0.0f;
    for (int64_t s = 0; s < k; ++s) weighted += w[s] * dw[s];
    for (int64_t s = 0; s < k; ++s) dz[ids[s]] = w[s] * (dw[s] - weighted);
  }
}

}  // namespace flatpeak::exec
