// The per-phase memory terms of one GPU, by component. Each function adds the terms of one part
// of the step; timeline.cpp composes them into phases (persistent state + that phase's live set).
//   Context ctx{model, run, workload};
//   TermList t(ctx.run.alignment_bytes);  add_attention_saved(ctx, 12, t);
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "run_spec.h"
#include "terms.h"
#include "workload.h"

namespace flatpeak::planner {

struct Context {
  const ModelSpec& model;
  const ResolvedRun& run;
  const Workload& work;
  TermList list() const { return TermList(run.alignment_bytes); }
  bool is_mtp(int64_t layer) const { return layer >= model.num_layers; }
  // Layer spec of a decoder layer; MTP modules use full attention and the model's FFN kind.
  LayerSpec layer_spec(int64_t layer) const;
};

// A phase's own transient terms, with the phase-name suffix they belong to.
struct PhaseTerms {
  std::string suffix;  // "moe/dispatch", "moe/dispatch/r0", "fwd/blk0"
  std::string folds;   // phases this one stands for ("r0-r15"); empty when none
  TermList terms;
};

// ---- layer working set (memory_terms_layer.cpp): attention, norms, dense FFN, residual grads.
// No-grad forward of attention (checkpointed forward): the transients at the flash kernel (MLA:
// or at its projections, whichever holds more).
void add_attention_forward(const Context& c, int64_t layer, TermList& t);
// What the recomputed attention keeps for its backward (norm-1 output, Q/K/V/O, lse, residual;
// MLA: its latents).
void add_attention_saved(const Context& c, int64_t layer, TermList& t, bool with_residual);
// The recompute's attention phase: the saved set as it is made, the ring's buffers and the
// gradient stream (MLA: at the flash kernel or at its projections, whichever holds more).
void add_attention_recompute(const Context& c, int64_t layer, TermList& t);
// Attention backward: the saved set plus the gradients and the flash fp32 accumulators (MLA: or
// the projections' backward after them, whichever holds more).
void add_attention_backward(const Context& c, int64_t layer, TermList& t);
// Ring attention (CP > 1): received KV chunks (and travelling dK/dV in backward); sliding-window
// layers need only a halo of window tokens from the previous rank.
void add_ring_attention(const Context& c, int64_t layer, bool backward, TermList& t);
// FFN part shared by dense layers and shared experts: no-grad forward, saved, backward.
void add_ffn_forward(const Context& c, const char* prefix, int64_t width, TermList& t);
void add_ffn_saved(const Context& c, const char* prefix, int64_t width, TermList& t);
void add_ffn_backward_grads(const Context& c, const char* prefix, int64_t width, TermList& t);
// A gated shared expert (ModelSpec::shared_expert_gate): its backward needs the ungated output
// [T, H] and the gate [T], saved beside the shared expert's own set while its layer's MoE block
// is recomputed and back-propagated.
void add_shared_gate_saved(const Context& c, TermList& t);
// The residual stream around the FFN block: h1 = x + attn(x), and the norm-2 output.
void add_ffn_block_inputs(const Context& c, TermList& t);
// Gradients flowing through a layer's backward: dy [T, H] and the fp32 residual accumulator.
void add_layer_grad_stream(const Context& c, TermList& t);

// ---- MoE dispatch (memory_terms_dispatch.cpp), worst rank, one MoE layer.
std::vector<PhaseTerms> moe_forward_phases(const Context& c, int64_t layer);    // no-grad forward
std::vector<PhaseTerms> moe_recompute_phases(const Context& c, int64_t layer);  // backward's recompute
std::vector<PhaseTerms> moe_backward_phases(const Context& c, int64_t layer);

// ---- vocabulary projection and loss (memory_terms_vocab.cpp).
// Phases of one loss (main or an MTP head): forward, then backward (empty for in-forward).
std::vector<PhaseTerms> loss_forward_phases(const Context& c);
std::vector<PhaseTerms> loss_backward_phases(const Context& c);
// What one loss keeps between its forward and its backward (for the MTP losses that precede it).
void add_loss_saved(const Context& c, const std::string& prefix, TermList& t);

// ---- model state, FSDP, boundaries, host (memory_terms_state.cpp).
// Parameter, gradient and optimizer shards; grad_shard_params of the gradients live now.
void add_model_state(const Context& c, int64_t grad_shard_params, TermList& t);
// Bytes of the grad shards of the units backward reduces first (MTP modules from the last, the
// head, layers L-1 down to 0, the embedding) whose params add up to `params` (0 or such a
// prefix; std::logic_error otherwise): one tensor per unit, each aligned to `alignment`.
int64_t reduced_grad_bytes(const Workload& w, int64_t mtp_modules, int64_t params, int64_t bytes_per_param, int64_t alignment);
// FSDP: units gathered (bf16), one prefetched, an unsharded grad being produced (bf16), and a
// reduce-scatter input in flight (fp32). -1 = none.
struct FsdpLive {
  int64_t gathered = -1, prefetch = -1, grad = -1, reduce_scatter = -1;
};
void add_fsdp(const Context& c, const FsdpLive& live, TermList& t);
// Whether a unit's grad shard lands through an fp32 reduce-scatter output: with the optimizer
// offloaded (bf16 grad shards) on N > 1 GPUs, the rank-order fp32 sum of the unit, [S] (S: this
// GPU's shard of the unit), is received into its own buffer, rounded into the new bf16 shard and
// freed (FSDP2 with reduce_dtype fp32 and bf16 sharded grads; the executor's FsdpShards::
// reduce_scatter_into). fp32 shards (optimizer on the GPU) receive the sum in place.
bool reduce_scatter_output_staged(const Context& c);
// That output for `unit` (fsdp, fp32 [S]: its reduced_shard_params, the experts at EP = N are not
// reduced) when it is staged; nothing otherwise.
void add_reduce_scatter_output(const Context& c, int64_t unit, TermList& t);
// With MTP every loss's backward reduce-scatters the LM head's grads into its one shard: all but
// the first land in a shard that exists. fp32 shards (optimizer on the GPU) on N > 1 GPUs then
// receive the sum into an fp32 output [S] that is added to the shard and freed (FSDP2 accumulating
// a sharded grad); bf16 shards stage it anyway (above), one GPU adds in place.
bool head_reduced_through_an_output(const Context& c);
void add_head_accumulate_output(const Context& c, TermList& t);
// Checkpoint boundaries resident on the device: `resident` layer inputs, `in_flight` offloaded
// boundaries being copied or prefetched, and the final hidden state when `final_hidden`.
void add_boundaries(const Context& c, int64_t resident, int64_t in_flight, bool final_hidden, TermList& t);
// Host memory of one GPU's process: pinned optimizer state and staging, offloaded boundaries.
TermList host_terms_per_gpu(const Context& c);
// Optimizer-step phases: (suffix, device transient terms).
std::vector<PhaseTerms> optimizer_phases(const Context& c);

}  // namespace flatpeak::planner
