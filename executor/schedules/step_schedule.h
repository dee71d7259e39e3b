// One training step of a small MoE transformer on one rank (N = 1 under FSDP2) or on each of the N
// ranks of a Communicator (FSDP across them: at EP = 1 every rank holds a 1/N slice of every unit,
// the experts included; at EP = N a 1/N slice of every dense weight and its own E/N experts whole,
// each MoE layer's dispatch then crossing the ranks; every rank runs its own sequence, or at CP > 1
// the T tokens of its place in its CP group's, attention a ring within the group; the token ids
// are drawn per rank either way), every buffer from
// the TrackingAllocator with its traces/ category and the shared phase names: fwd/embed, each
// layer's no-grad forward keeping its checkpoint boundary (on the device, or offloaded to the host
// as the knobs say), the loss (materialised or blocked), loss backward, each layer from the last
// with its recompute and backward, bwd/embed, and the AdamW step in the plan's placement.
//   StepScheduleConfig c; c.model = scaled_model; c.tokens = 512;          // MoE and dense layers, GQA
//   c.loss.mode = VocabScheduleMode::Blocked; c.loss.token_block_rows = 64; c.loss.vocab_block_rows = 2374;
//   c.offloaded = {true, false, false, false}; c.prefetch = 1;
//   c.optimizer.placement = OptimizerPlacement::Stream; c.optimizer.bucket_params = 4096;
//   TrackingAllocator alloc({512});  StepScheduleResult r = run_step_schedule(alloc, c);
//   run_ranks(4, [&](int, Communicator& comm) { TrackingAllocator a({512}); run_step_schedule(comm, a, c); });
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "executor/comm/communicator.h"
#include "executor/memory/tracking_allocator.h"
#include "executor/schedules/decoder_layer.h"
#include "executor/schedules/fsdp_shards.h"
#include "executor/schedules/optimizer_schedule.h"
#include "executor/schedules/vocab_schedule.h"
#include "spec/model_spec.h"

namespace flatpeak::exec {

// What a StepScheduleConfig::result_sink receives: the reduced grad shards before the optimizer
// step, or the fp32 master after it.
enum class StepResultPart { Grads, Params };
using StepResultSink = std::function<void(StepResultPart part, int64_t offset, const float* values, int64_t count)>;

struct StepScheduleConfig {
  // The model: GQA attention, MoE layers (num_experts = E, all of them; at ep = 1 the rank computes
  // every one; top_k ≤ num_experts) and dense FFN layers (dense_ffn_width), an untied LM head, MTP modules with `mtp`. Its parameters are counted by
  // the spec library (count_params): parts the executor does not apply (QK norms, attention sinks
  // and biases, router and expert biases) are held, reduced and updated with zero gradient.
  ModelSpec model;
  // Run the model's MTP modules (model.mtp_layers, DeepSeek-V3's sequential multi-token
  // prediction; RMSNorm models): module j reads the previous module's output (h_L for j = 0) and
  // x_0 shifted by j + 1 rows (the rank's own rows at CP > 1; the last j + 1 rows zero), each
  // through its norm, both halves through eh_proj [H, 2H] into one decoder layer (MoE), whose
  // output goes through the module's head norm to the shared LM head and a loss of its own
  // (targets shifted by j + 2, weight 1). Every loss's backward waits for the modules after it.
  bool mtp = false;
  int64_t tokens = 0;  // T, one sequence
  // EP ranks each layer's experts are split over: 1, or the size of the Communicator (EP = N: rank
  // r computes and holds whole experts [r·E/N, (r+1)·E/N); the dense weights are sharded over the
  // N ranks). 1 < EP < N is not built.
  int64_t ep = 1;
  // CP ranks each sequence is split over (ring attention in every layer): groups of cp consecutive
  // ranks of the Communicator, rank r of a group holding the r-th T tokens; the one-rank step
  // takes its ring as a CP group. Every other part of the step is per token, as at CP = 1.
  int64_t cp = 1;
  // The naive reference: no checkpointing (every layer's saved set kept from one forward with
  // grad), materialised loss, optimizer on the device, boundaries kept; `loss.mode`,
  // `offloaded`, `prefetch` and `optimizer.placement` are ignored.
  bool naive = false;
  // Checkpoint boundaries: per layer (size L, or empty for none) whether its input goes to the
  // host (synchronous offload of every layer or SCO's set); SCO's prefetch depth in backward.
  std::vector<bool> offloaded;
  int64_t prefetch = 0;
  // The loss: mode, token and vocabulary blocks, gradients in forward (tokens, hidden, vocab and
  // seed are the step's).
  VocabScheduleConfig loss;
  // The optimizer: placement, bucket_params, bucket_depth, cpu_threads and the AdamW
  // hyperparameters (params are the step's P; the step is the run's first: m = v = 0, t = 1).
  OptimizerScheduleConfig optimizer;
  uint64_t seed = 1;          // parameters, token ids and targets: a pure function of the seed
  uint64_t data_seed = 0;     // token ids and targets instead (0: seed); rank r > 0 derives its own (step_data_seed)
  bool keep_results = true;   // copy grads and updated params out (tests, exactness); off: only the loss
  // Set: the grads and params go here instead of into the result (keep_results is then ignored),
  // as values [offset, offset + count) of the [P] vector in fp32, in order and in chunks, while the
  // tracked buffers hold them: verify compares them with the naive step's without a second copy.
  StepResultSink result_sink;
};

// Parameters of this rank's FSDP units in execution order: the embedding [V·H], each layer, with
// `mtp` each MTP module (enorm [H], hnorm [H], eh_proj [H, 2H], its head norm [H], then its decoder
// layer), the head (final norm [H] then the LM head [V, H]): rank_shard_units(model, 1, 1, mtp).
// These are the gathered units at any N (EP = 1); rank r holds [r·S, min((r+1)·S, U)) of each,
// S = ceil(U/N).
std::vector<int64_t> step_unit_params(const ModelSpec& model, bool mtp = false);
// The units as FsdpShards holds them at config.ep: at EP = 1 every unit sharded whole; at EP > 1 a
// layer's dense part (attention, norms, router, shared experts: sharded over the ranks) and its
// E/EP experts (local), laid out [dense weights | dense parts not applied | w_gate_up [E/EP, 2F, H]
// | w_down [E/EP, H, F] | b_expert [E/EP, 2F + H] with expert biases | expert parts not applied].
// Every rank's are the same size.
std::vector<FsdpUnitShape> step_unit_shapes(const StepScheduleConfig& config);

// A run of elements of the reference's [P]: the whole model's units (step_unit_params of the
// model with every expert) back to back, as the naive step at EP = 1 lays them out.
struct ParamPiece {
  int64_t begin = 0, count = 0;
};
// Rank `rank` of `ranks`' grad and param shard (its slice of each unit's sharded part, then its
// local part, unit by unit) as pieces of the reference's [P], in shard order. EP = 1: one piece a unit.
std::vector<ParamPiece> step_rank_pieces(const StepScheduleConfig& config, int ranks, int rank);

// The seed of rank `rank`'s token ids and targets: rank 0 keeps the config's (so one rank is the
// single-rank step), the others draw their own sequences (data parallel).
uint64_t step_data_seed(const StepScheduleConfig& config, int rank);

// The fp32 initial values of unit `unit`'s elements [begin, begin + count) as EP rank `ep_rank`
// gathers it (step_unit_shapes; at EP = 1 the same on every rank). A value depends on the weight
// and its index in the whole model's tensor, not on where a layout puts it.
void step_initial_params(const StepScheduleConfig& config, int64_t unit, int64_t begin, int64_t count, float* dst, int64_t ep_rank = 0);

struct StepScheduleResult {
  double loss = 0.0;                  // mean cross-entropy over the T tokens (fp64 sum)
  std::vector<double> mtp_losses;     // per MTP module, the same
  std::vector<int64_t> unit_params;   // step_unit_params (gathered)
  std::vector<int64_t> shard_begin;   // per unit: the first element of the unit this rank holds (0 at N = 1)
  std::vector<int64_t> shard_params;  // per unit: how many (unit_params at N = 1; at EP > 1 with the local part)
  std::vector<ParamPiece> reference_pieces;  // step_rank_pieces: where grads and params lie in the reference's [P]
  std::vector<std::vector<int64_t>> expert_counts;  // [MoE layers][E] this rank's token copies per expert (the forward's routing)
  std::vector<float> grads;           // [P] the reduced grad shards before the optimizer step (widened), unit by unit
  std::vector<float> params;          // [P] the fp32 master after the step (device fp32 params or the host master)
  std::vector<std::string> phases;    // every phase entered, in order (the allocator's records)
};

// Runs the step; every buffer is released on return. Phases (L layers, l = L-1 .. 0 in backward):
//   fwd/embed, fwd/Ll/{attn, moe/route, moe/dispatch, moe/experts, moe/combine},
//   loss/fwd[/blkI], loss/bwd[/blkI], bwd/Ll/recompute/{attn, moe/dispatch, moe/experts,
//   moe/combine}, bwd/Ll/moe/{combine, experts, dispatch}, bwd/Ll/attn, bwd/embed, then
//   opt/step | opt/d2h, opt/cpu_step, opt/h2d | opt/bucketI.
// With MTP (M modules) between loss/fwd and loss/bwd: fwd/MTPj/... and loss/mtpj/fwd... for j =
// 0 .. M-1, then loss/mtpj/bwd... and bwd/MTPj/... for j = M-1 .. 0 (planner/README.md
// "Multi-token prediction"): module j is gathered as its forward starts (the head prefetched),
// its input (eh_proj's output) stays on the device until its backward ends, h^j until its loss's
// backward; a loss's backward gathers the head (or takes the module's prefetch) and prefetches
// the module before it; each loss's backward reduce-scatters the head, every landing after the
// first added into its shard (N > 1 with fp32 shards: through an fp32 [S] output); the modules'
// gradient of x_0 waits in one [T, H] buffer for bwd/embed.
// FSDP (category fsdp; FsdpShards): a unit is all-gathered into one bf16 [U] buffer before it runs (the
// next unit prefetched while one runs: the embedding and L0 in fwd/embed, L(l+1) or the head in
// fwd/Ll, L(L-1) from the loss's backward, L(l-1) or the embedding in bwd/Ll) and freed after its
// forward and after its backward; its unsharded grads are one bf16 [U] buffer from the start of
// its backward; at its end they become the fp32 reduce-scatter input [N·S] ([U] at N = 1), which
// stays in flight through the next unit's backward, whose start runs the reduce-scatter and lands
// the rank's grad shard [S] (category grads: fp32 with the optimizer on the device, bf16 with
// offload, whose fp32 sum passes through an [S] buffer of category fsdp at N > 1: the unit's
// reduce-scatter output, live while the shard lands). The head's gathered buffer is the loss's W
// (retagged vocab at the loss); the blocked loss accumulates dW in the head's fp32 grad buffer
// [N·S] (final-norm grad first), which is reduced in place; the materialised dW is the head's bf16
// grads. The embedding's reduce-scatter runs at the end of bwd/embed. The optimizer steps the
// rank's shard only.
// Throws std::invalid_argument for a model or knobs the step cannot run. config.cp > 1: `cp_group`
// (config.cp ranks, this one among them) is the layers' attention ring; nothing else crosses ranks.
StepScheduleResult run_step_schedule(TrackingAllocator& alloc, const StepScheduleConfig& config, Communicator* cp_group = nullptr);
// The same on every rank of `comm` (each rank calls it with the same config and its own allocator):
// rank r runs the sequence of step_data_seed(config, r); the gathers and reduce-scatters are the
// communicator's, the grads summed over the ranks in rank order.
StepScheduleResult run_step_schedule(Communicator& comm, TrackingAllocator& alloc, const StepScheduleConfig& config);

// The single-rank reference of the step on `ranks` ranks: the naive step of each rank's sequence
// at EP = 1 (own allocators), the grads summed in rank order in fp32 (the Communicator's reduce order) and,
// with the optimizer offloaded (bf16 grad shards), rounded once to bf16, then one AdamW step
// (m = v = 0, t = 1, the config's hyperparameters) of the whole [P] vector. At CP > 1 each CP
// group's naive steps run together as thread ranks (their attention is a ring).
struct StepReference {
  std::vector<int64_t> unit_params;  // step_unit_params
  std::vector<double> losses;        // per rank
  std::vector<float> grads;          // [P] summed over the ranks
  std::vector<float> params;         // [P] after AdamW
};
StepReference step_reference(const StepScheduleConfig& config, int ranks, int64_t alignment_bytes = 512);
// The AdamW part alone: the initial params stepped once with `grads`, of the whole model ([P], no
// pieces given) or of the pieces of the reference's [P] (step_rank_pieces), concatenated.
std::vector<float> step_reference_update(const StepScheduleConfig& config, const std::vector<float>& grads,
                                         const std::vector<ParamPiece>& pieces = {});

}  // namespace flatpeak::exec
