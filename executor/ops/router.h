// MoE router: softmax over experts, top-k, and renormalisation of the k kept probabilities.
//   RouterArgs a; a.logits = z; a.topk_ids = ids; a.topk_weights = w;
//   a.tokens = T; a.experts = E; a.top_k = k;  router_forward_cpu(a);
//   a.d_topk_weights = dw; a.d_logits = dz;     router_backward_cpu(a);
#pragma once

#include <cstdint>

#include "executor/ops/dtype.h"

namespace flatpeak::exec {

struct RouterArgs {
  const float* logits = nullptr;          // [T, E] fp32 router scores
  int32_t* topk_ids = nullptr;            // [T, k] by decreasing score; ties: lower expert first
  float* topk_weights = nullptr;          // [T, k] fp32 p_e / Σ_kept p, p = softmax(logits)
  const float* d_topk_weights = nullptr;  // [T, k]
  float* d_logits = nullptr;              // [T, E] overwritten (0 for experts not kept)
  int64_t tokens = 0;
  int64_t experts = 0;
  int64_t top_k = 0;
};

void router_forward_cpu(const RouterArgs& args);
// Renormalised weights equal a softmax over the kept logits alone (the full normaliser cancels),
// so dz_i = w_i · (dw_i − Σ_j w_j dw_j) for kept i and 0 elsewhere; the selection itself is
// piecewise constant.
void router_backward_cpu(const RouterArgs& args);

}  // namespace flatpeak::exec
