// Compatibility modes: peers' own accounting, reproduced on our ModelSpec and parameter counts by
// switching how model-state bytes are counted (reference/peers.md §2.1, §2.3, §6), and the
// Korthikanti activation formula itemised tensor by tensor (peers.md §1).
//   ModelStateBytes z = model_state_bytes(llama, 8, 8, deepspeed_zero3(ZeroOffload::None));
//   int64_t w = model_state_bytes(mixtral, 64, 8, megatron_distributed_optimizer(8)).gpu_bytes;
#pragma once

#include <cstdint>
#include <string>

#include "spec/model_spec.h"

namespace flatpeak::planner {

// How one accounting counts model states (bytes per parameter and where they live).
struct StateAccounting {
  std::string name;
  double gpu_sharded_bytes_per_param = 0;     // divided over the sharding group
  double gpu_replicated_bytes_per_param = 0;  // whole on every GPU
  int64_t expert_parallel = 1;                // experts: params / EP, sharded over N / EP (1: plain)
  double gpu_largest_module_bytes_per_param = 0;  // the largest module gathered (ZeRO-3: 4)
  double cpu_bytes_per_param_per_node = 0;        // all params, divided over the nodes
  double cpu_largest_module_bytes_per_gpu = 0;    // per GPU of a node (ZeRO-3 zero_init: 4)
  double cpu_buffer_factor = 1.0;                 // DeepSpeed's additional_buffer_factor (1.5)
};

enum class ZeroOffload { None, Optimizer, ParamsAndOptimizer };

// DeepSpeed estimate_zero3_model_states_mem_needs (zero_init), peers.md §2.3.
StateAccounting deepspeed_zero3(ZeroOffload offload);
// Megatron theoretical_memory_usage with the distributed optimizer, TP = PP = 1: 6 B per param
// (bf16 param + fp32 grad) whole, 12 B (fp32 main param + Adam) over DP; experts over EDP.
StateAccounting megatron_distributed_optimizer(int64_t expert_parallel);
// flatpeak's baseline (FSDP2): 16 B per parameter over the shard (fp32 master, grad, m, v).
StateAccounting flatpeak_fsdp2();

struct ModelStateBytes {
  int64_t gpu_bytes = 0;           // per GPU
  int64_t cpu_bytes_per_node = 0;  // per node
  int64_t largest_module_params = 0;
};
// `model`'s parameters (count_params: total, no MTP) under an accounting on N GPUs.
ModelStateBytes model_state_bytes(const ModelSpec& model, int64_t gpus, int64_t gpus_per_node,
                                  const StateAccounting& accounting);

// Korthikanti et al. per-layer activations (GPT block: LayerNorm, GeLU MLP of width f, dropout),
// 16-bit activations, 1-byte dropout masks, tensor parallel t without sequence parallelism:
// attention: QKV input 2sbh, Q,K 4sbh, scores 2as²b, softmax-dropout mask as²b, its output
// 2as²b, V 2sbh, out-proj input 2sbh, dropout mask sbh; MLP: fc1 input 2sbh, GeLU input 2sbf,
// GeLU output 2sbf, dropout mask sbh; 2 LayerNorm inputs 4sbh. Parts inside the TP region are
// divided by t. With f = 4h and t = 1 this is sbh(34 + 5as/h).
int64_t korthikanti_layer_activation_bytes(int64_t s, int64_t b, int64_t h, int64_t a, int64_t f, int64_t t);

}  // namespace flatpeak::planner
