// Parameter counts of a ModelSpec, by part, with the conventions of models/README.md:
// `total` excludes MTP modules and vision towers; `active` excludes the input embedding (a lookup,
// not a matmul) and includes the lm head; `active_with_embedding` adds the embedding.
//   ParamCounts p = count_params(load_model("DeepSeek-V3"));   // p.total == 671026419200
#pragma once

#include <cstdint>

#include "spec/model_spec.h"

namespace flatpeak {

struct ParamCounts {
  int64_t total = 0;
  int64_t active = 0;
  int64_t active_with_embedding = 0;
  int64_t embedding = 0;
  int64_t lm_head = 0;                 // 0 when tied to the embedding
  int64_t final_norm = 0;
  int64_t mtp = 0;                     // all MTP modules (not in total)

  int64_t attention_per_layer = 0;     // projections, biases, norms inside attention, sinks
  int64_t layer_norms_per_layer = 0;   // the two RMSNorms around attention and FFN
  int64_t dense_ffn_per_layer = 0;     // one dense layer's FFN
  int64_t router_per_layer = 0;        // router weights, bias and correction bias
  int64_t expert_params = 0;           // one routed expert
  int64_t shared_experts_per_layer = 0;  // their MLP and, where the model has one, their gate
  int64_t dense_layer_total = 0;       // attention + norms + dense FFN (0 when no layer is dense)
  int64_t moe_layer_total = 0;         // attention + norms + router + all experts + shared
  int64_t moe_layer_active = 0;        // attention + norms + router + top-k experts + shared
};

ParamCounts count_params(const ModelSpec& model);

}  // namespace flatpeak
