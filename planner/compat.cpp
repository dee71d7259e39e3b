#include "compat.h"

#include <algorithm>
#include <cmath>

#include "spec/param_count.h"
#include "terms.h"

namespace flatpeak::planner {

StateAccounting deepspeed_zero3(ZeroOffload offload) {
  StateAccounting a;
  a.gpu_largest_module_bytes_per_param = 4;  // bf16 params + grads of the largest module
  a.cpu_buffer_factor = 1.5;
  switch (offload) {
    case ZeroOffload::None:
      a.name = "deepspeed-zero3";
      a.gpu_sharded_bytes_per_param = 18;  // bf16 param 2 + fp32 grad 4 + fp32 param 4 + Adam 8
      a.cpu_largest_module_bytes_per_gpu = 4;
      break;
    case ZeroOffload::Optimizer:
      a.name = "deepspeed-zero3-offload-optimizer";
      a.gpu_sharded_bytes_per_param = 2;   // bf16 param shard
      a.cpu_bytes_per_param_per_node = 16;
      break;
    case ZeroOffload::ParamsAndOptimizer:
      a.name = "deepspeed-zero3-offload-params-optimizer";
      a.cpu_bytes_per_param_per_node = 18;
      break;
  }
  return a;
}

StateAccounting megatron_distributed_optimizer(int64_t expert_parallel) {
  StateAccounting a;
  a.name = "megatron-distributed-optimizer";
  a.gpu_replicated_bytes_per_param = 6;  // bf16 param 2 + fp32 main grad 4
  a.gpu_sharded_bytes_per_param = 12;    // fp32 main param 4 + Adam m, v 8
  a.expert_parallel = expert_parallel;
  return a;
}

StateAccounting flatpeak_fsdp2() {
  StateAccounting a;
  a.name = "flatpeak-fsdp2";
  a.gpu_sharded_bytes_per_param = 16;
  return a;
}

ModelStateBytes model_state_bytes(const ModelSpec& model, int64_t gpus, int64_t gpus_per_node,
                                  const StateAccounting& acc) {
  const ParamCounts pc = count_params(model);
  const int64_t experts = checked_mul(checked_mul(model.num_experts, pc.expert_params), model.count_layers(FfnKind::Moe));
  const int64_t ep = std::max<int64_t>(1, acc.expert_parallel);
  const int64_t dense = acc.expert_parallel > 1 ? pc.total - experts : pc.total;
  const int64_t expert_share = acc.expert_parallel > 1 ? experts / ep : 0;
  const int64_t expert_group = gpus / ep;
  // The largest single module: embedding, LM head, or one projection of a layer.
  const int64_t H = model.hidden_size;
  const int64_t largest = std::max({pc.embedding, pc.lm_head, H * model.num_heads * model.head_dim,
                                    H * model.dense_ffn_width, H * model.expert_ffn_width});
  const auto dense_d = static_cast<double>(dense);
  const auto expert_d = static_cast<double>(expert_share);
  double gpu = dense_d * (acc.gpu_replicated_bytes_per_param + acc.gpu_sharded_bytes_per_param / static_cast<double>(gpus));
  if (expert_share > 0)
    gpu += expert_d * (acc.gpu_replicated_bytes_per_param + acc.gpu_sharded_bytes_per_param / static_cast<double>(expert_group));
  gpu += acc.gpu_largest_module_bytes_per_param * static_cast<double>(largest);
  const double nodes = static_cast<double>(ceil_div(gpus, gpus_per_node));
  double cpu = acc.cpu_bytes_per_param_per_node * static_cast<double>(pc.total) / nodes +
               acc.cpu_largest_module_bytes_per_gpu * static_cast<double>(largest) * static_cast<double>(gpus_per_node);
  cpu *= acc.cpu_buffer_factor;
  return ModelStateBytes{static_cast<int64_t>(std::llround(gpu)), static_cast<int64_t>(std::llround(cpu)), largest};
}

int64_t korthikanti_layer_activation_bytes(int64_t s, int64_t b, int64_t h, int64_t a, int64_t f, int64_t t) {
  const int64_t sbh = checked_mul(checked_mul(s, b), h);
  const int64_t sbf = checked_mul(checked_mul(s, b), f);
  const int64_t as2b = checked_mul(checked_mul(checked_mul(a, s), s), b);
  // Outside the TP region (not divided): the two LayerNorm inputs (4sbh), the QKV input (2sbh),
  // the MLP's fc1 input (2sbh), both dropout masks (2sbh) = 10sbh.
  const int64_t outside = 4 * sbh + 2 * sbh + 2 * sbh + 2 * sbh;
  // Inside: Q, K (4sbh), V (2sbh), out-proj input (2sbh), scores 2as²b, mask as²b, softmax
  // dropout output 2as²b, GeLU input and output 2sbf each.
  const int64_t inside = 4 * sbh + 2 * sbh + 2 * sbh + 5 * as2b + 4 * sbf;
  return outside + inside / std::max<int64_t>(1, t);
}

}  // namespace flatpeak::planner
