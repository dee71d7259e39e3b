// One decoder layer (GQA attention + MoE with top-k routing and optional shared experts) on one rank, as a component run
// (the layer itself: decoder_layer.h, which the whole step runs too):
// the no-grad forward from the layer's boundary, then the backward with full recompute
// (recompute attention and MoE keeping what backward needs, then back-propagate), every buffer
// from the TrackingAllocator under the traces/ categories and the shared phase names.
//   LayerScheduleConfig c; c.tokens = 512; c.hidden = 64; c.q_heads = 8; c.kv_heads = 1; c.head_dim = 12;
//   c.experts = 16; c.top_k = 4; c.expert_ffn = 64;
//   LayerScheduleResult r = run_layer_schedule(alloc, c, {});            // inputs drawn from c.seed
//   LayerInputs in = make_layer_inputs(c);  in.values["x"][0] += 1e-2f;  r = run_layer_schedule(alloc, c, in);
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "executor/memory/tracking_allocator.h"
#include "executor/ops/dtype.h"
#include "executor/schedules/decoder_layer.h"

namespace flatpeak::exec {

// The layer's inputs: the boundary x, the weights, and r, the output gradient of the loss proxy
// Σ y ⊙ r. Each is a pure function of config.seed, drawn straight into its tracked buffer (rounded
// to the storage dtype) unless `values` holds it: plain fp32 values that replace the drawn ones
// (tests perturb them for finite differences). An empty LayerInputs runs on the drawn inputs with
// no copy of them beside the run.
struct LayerInputs {
  std::map<std::string, std::vector<float>> values;  // "x" [T, H], "r" [T, H], weights by name
};

// Every drawn input as values. Weights: norm1 [H], wq [a·d, H], wk [g·d, H], wv [g·d, H], wo
// [H, a·d], norm2 [H], router [E, H], w_gate_up [E, 2F, H], w_down [E, H, F]; with shared experts
// shared_gate_up [2F_s, H], shared_down [H, F_s] (and their gate shared_gate [1, H]); with
// LayerNorm norm1_bias, norm2_bias [H]; with expert biases b_expert [E, 2F + H].
LayerInputs make_layer_inputs(const LayerScheduleConfig& config);

// A result copied out of its tracked buffer as the buffer held it (bf16 bits or fp32): exact, and
// with bf16 storage half the untracked heap of a widened copy (verify keeps two runs' results).
struct StoredValues {
  DType dtype = DType::F32;          // BF16 or F32
  std::vector<unsigned char> bytes;  // size() elements of dtype
  int64_t size() const;
  float operator[](int64_t i) const;  // widened to fp32
  bool operator==(const StoredValues& other) const { return dtype == other.dtype && bytes == other.bytes; }  // bitwise
};

struct LayerScheduleResult {
  double loss = 0.0;                            // Σ y ⊙ r in fp64 over the stored output
  StoredValues y;                               // [T, H] the layer output (forward pass); empty without keep_output
  std::map<std::string, StoredValues> grads;    // "x" [T, H] and every weight's gradient
};

// Elements of LayerScheduleResult::grads: x [T, H] and every weight.
int64_t layer_gradient_elements(const LayerScheduleConfig& config);

// Phases (l = layer_index), in order: fwd/Ll/attn, fwd/Ll/moe/{route,dispatch,experts,combine},
// bwd/Ll/recompute/attn, bwd/Ll/recompute/moe/{dispatch,experts,combine},
// bwd/Ll/moe/{combine,experts,dispatch}, bwd/Ll/attn. Categories: the boundary x and the output y
// — boundaries; gathered weights and their unsharded grads — fsdp; attention, norms, residual
// stream and gradient stream — activations; routing, dispatch/combine buffers, expert
// activations and their grads — dispatch; op tiles (on-chip memory on a GPU) — workspace.
// Throws std::invalid_argument for a shape the layer cannot run.
// keep_output: copy y into the result (verify compares the loss and the gradients only).
// config.cp > 1: every rank of `cp_group` (config.cp ranks) runs it; rank r draws x and r as the
// r-th T tokens of the sequence of cp·T tokens the one-rank run on cp·T tokens draws (given
// values are this rank's), so the ranks' dx are that run's in order and their weight grads sum
// to its; the loss is this rank's part.
LayerScheduleResult run_layer_schedule(TrackingAllocator& alloc, const LayerScheduleConfig& config,
                                       const LayerInputs& inputs, bool keep_output = true, Communicator* cp_group = nullptr);

}  // namespace flatpeak::exec
