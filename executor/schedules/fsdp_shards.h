// FSDP-style sharding of a rank's model state: each unit's sharded part (dense weights, and the
// experts when every rank holds every expert) is split over the N ranks; its local part (this
// rank's experts at EP > 1) is split over the ranks of a second group that hold the same experts
// (the N/EP replicas, when 1 < EP < N), or stays whole on the rank (EP = N). A unit is
// all-gathered into a bf16 compute copy before use and its unsharded gradient reduce-scattered
// into the rank's gradient shard after its backward; the optimizer then steps each shard alone.
//   std::vector<FsdpUnitShape> units = {{"embedding", V * H, 0}, {"L0", attn, experts}, ...};
//   FsdpShards state(alloc, comm, units, ShardPrecision::Fp32Master);   // comm: nullptr on one rank
//   FsdpShards ep(alloc, comm, units, precision, GradShards::Caller, &replicas);  // experts over the replicas
//   Tensor w = state.gather(1);                 // [U] bf16, category fsdp
//   ...backward of unit 1 into g [U] bf16...
//   state.reduce_scatter(1, g);                 // grad shard += Σ_ranks g (rank order, fp32)
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "executor/comm/communicator.h"
#include "executor/memory/tensor.h"
#include "executor/memory/tracking_allocator.h"

namespace flatpeak::exec {

// One FSDP unit as one rank sees it: U = sharded_params + local_params.
struct FsdpUnitShape {
  std::string name;
  int64_t sharded_params = 0;  // split over all N ranks: rank r holds [r·S, min((r+1)·S, sharded)), S = ceil(sharded / N)
  int64_t local_params = 0;    // this rank's experts: split over the local group's R ranks the same way
                               // (R = 1, or no local group: held whole)
};

// The shards' storage, as the planner lays out model state (planner/memory_terms_state.cpp):
// optimizer on the device keeps fp32 master param shards and fp32 grad shards; with the optimizer
// offloaded the device keeps bf16 param and grad shards (master, m and v live on the host).
enum class ShardPrecision { Fp32Master, Bf16 };

// Who holds the grad shards: FsdpShards as one [P] buffer (reduce_scatter accumulates into it), or
// the caller, one buffer per unit allocated when the unit's reduce-scatter lands (the step, as
// FSDP2 does and the planner lays out: reduce_scatter_input + reduce_scatter_into).
enum class GradShards { Whole, Caller };

class FsdpShards {
 public:
  // Allocates the rank's param shard [P] and grad shard [P] (categories params and grads, zeroed)
  // where P = Σ over units of (its slice of the sharded part + its slice of the local part). `comm`
  // may be nullptr for one rank; `local_group` (the ranks that hold this rank's experts, this rank
  // among them) nullptr for a local part held whole. Throws std::invalid_argument for a negative
  // size. With GradShards::Caller no grad shard is allocated (grads() is empty).
  FsdpShards(TrackingAllocator& alloc, Communicator* comm, std::vector<FsdpUnitShape> units, ShardPrecision precision,
             GradShards grads = GradShards::Whole, Communicator* local_group = nullptr);

  int ranks() const { return ranks_; }
  int rank() const { return rank_; }
  size_t units() const { return units_.size(); }
  const FsdpUnitShape& unit(size_t i) const { return units_.at(i); }
  int64_t gathered_params(size_t i) const { return units_.at(i).sharded_params + units_.at(i).local_params; }
  // S: the slice size of unit i's sharded part (every rank's slice is S long but the last ones' may be short).
  int64_t slice_stride(size_t i) const;
  // Elements of unit i's sharded part that rank r holds.
  int64_t slice_length(size_t i, int r) const;
  // The same for the local part over the local group (R = 1: the whole local part).
  int64_t local_stride(size_t i) const;
  int64_t local_length(size_t i, int r) const;
  int64_t local_begin(size_t i) const;  // this rank's slice of the local part, from the local part's start
  int64_t local_ranks() const { return local_ranks_; }
  int local_rank() const { return local_rank_; }
  // This rank's elements of unit i in the shard vectors, and where they start.
  int64_t shard_length(size_t i) const { return slice_length(i, rank_) + local_length(i, local_rank_); }
  // S + S_l: a caller's fp32 grad shard this long (the short slices of an uneven split padded, as
  // FSDP2 pads its shards) receives the reduce-scatter in place.
  int64_t shard_capacity(size_t i) const { return slice_stride(i) + local_stride(i); }
  int64_t shard_offset(size_t i) const { return offsets_.at(i); }
  int64_t shard_params() const { return params_.numel(); }  // P
  // Where this rank's slice of unit i's sharded part starts in the gathered unit.
  int64_t slice_begin(size_t i) const;
  // N·S + R·S_l: the fp32 reduce-scatter input of unit i (each part zero padded to its slices).
  int64_t reduce_scatter_input_params(size_t i) const;

  // [P] fp32 (Fp32Master) or bf16: unit i's slice at shard_offset(i), its local slice after it.
  Tensor& params() { return params_; }
  Tensor& grads() { return grads_; }
  const Tensor& params() const { return params_; }
  const Tensor& grads() const { return grads_; }

  // Unit i's parameters, whole, as a bf16 compute copy [U] (category fsdp): the sharded part in
  // rank order, then this rank's local part (gathered over the local group the same way). One
  // all-to-allv a part with exact counts, so the buffer is U
  // long, not N·S. The rank's own slice is rounded (or copied) into its place in that buffer and
  // sent from there, as FSDP2's all-gather copies in: no staging buffer (the all-to-allv sends
  // nothing to the rank itself, so the regions sent and received never overlap).
  Tensor gather(size_t i);

  // Adds unit i's gradient summed over the ranks into this rank's grad shard. `unsharded_grad` is
  // [U] bf16 (this rank's contribution, laid out as gather() lays out params). The sharded part is
  // widened into an fp32 reduce-scatter input [N·S] (category fsdp, zero padded) and summed in rank
  // order (the Communicator contract), the local part likewise over the local group (held whole: added
  // as is); the shard then adds the sum in
  // fp32 (rounded once to bf16 for Bf16 shards). Transients are freed before returning.
  void reduce_scatter(size_t i, const Tensor& unsharded_grad);

  // The same in two steps, the input kept by the caller in between (the step keeps it in flight
  // through the next unit's backward): the fp32 input [reduce_scatter_input_params(i)] (category
  // fsdp) widened from the [U] bf16 gradient, then its rank-order sum written (not added) into
  // `shard`, the rank's grad shard of unit i (shard_length(i) elements, fp32 or bf16: rounded
  // once). The sums land in place when the shard is fp32 and holds shard_capacity(i) (or its slices
  // are full); otherwise through an fp32 [S + S_l] buffer: for bf16 shards the unit's reduce-scatter
  // output (category fsdp, as the planner counts it: planner/memory_model.h,
  // add_reduce_scatter_output), for an unpadded fp32 shard with a short slice an artefact (comm);
  // freed here. An input made by the caller (the blocked
  // loss's fp32 dW accumulator) must have the same layout.
  Tensor reduce_scatter_input(size_t i, const Tensor& unsharded_grad);
  void reduce_scatter_into(size_t i, const Tensor& input, Tensor& shard);
  // The same sums added into `shard`, which holds the unit's earlier ones (a unit reduced more
  // than once in a step: the LM head under MTP, once per loss): always through this rank's fp32
  // [S (+ S_l)] reduce-scatter output (category fsdp), freed here; a bf16 shard is rounded once
  // per addition. A step on one rank adds its input itself (no output: planner/memory_model.h).
  void reduce_scatter_add(size_t i, const Tensor& input, Tensor& shard);

 private:
  TrackingAllocator& alloc_;
  Communicator* comm_;
  Communicator* local_group_;
  std::vector<FsdpUnitShape> units_;
  ShardPrecision precision_;
  int ranks_ = 1;
  int rank_ = 0;
  int local_ranks_ = 1;
  int local_rank_ = 0;
  // This rank's sums of each part that is reduced, back to back in `sums` (summed_params(i) of
  // them: S for the sharded part over N > 1 ranks, S_l for a local part split over R > 1);
  // part_sums: where each part's sums then are (a part not reduced: the input itself).
  const float* sum_parts(size_t i, const Tensor& input, float* sums);
  int64_t summed_params(size_t i) const;
  // The shard's dtype; throws for an input or shard reduce_scatter_into and _add cannot take.
  DType check_reduce_scatter(const char* what, size_t i, const Tensor& input, const Tensor& shard) const;
  std::pair<const float*, const float*> part_sums(size_t i, const Tensor& input, const float* sums) const;

  std::vector<int64_t> offsets_;  // [units] start of each unit in the shard vectors
  Tensor params_;                 // [P]
  Tensor grads_;                  // [P]
};

}  // namespace flatpeak::exec
