// FSDP shards: layout, all-gather into the compute copy, reduce-scatter into the grad shard. A unit
// has two parts, each split the same way over its own group: the sharded part over the N ranks of
// `comm`, the local part (a rank's experts) over the local group (the replicas holding the same
// experts; none: held whole).
#include "executor/schedules/fsdp_shards.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <utility>

#include "executor/ops/dtype.h"

namespace flatpeak::exec {

namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// `size` elements split over `ranks`: rank r holds [min(size, r·S), min(size, (r+1)·S)), S = ceil(size / ranks).
struct Split {
  int64_t size;
  int ranks;
  int64_t stride() const { return ceil_div(size, ranks); }
  int64_t begin(int r) const { return std::min(size, static_cast<int64_t>(r) * stride()); }
  int64_t length(int r) const { return std::min(size, begin(r) + stride()) - begin(r); }
};

// Whether a part is summed over its group (else it is this rank's alone).
bool reduced(const Communicator* group, const Split& s) { return group != nullptr && s.ranks > 1 && s.stride() > 0; }

// All-gathers a part into `dst` (the part's place in the gathered unit): the own slice is written
// into its place first (own_slice) and sent from there; nothing goes to or comes from this rank.
template <class OwnSlice>
void gather_part(Communicator* group, const Split& s, int me, Bf16* dst, OwnSlice own_slice) {
  own_slice(dst + s.begin(me));
  if (!reduced(group, s)) return;
  const size_t n = static_cast<size_t>(s.ranks);
  std::vector<int64_t> send_counts(n, s.length(me)), send_displs(n, s.begin(me)), recv_counts(n), recv_displs(n);
  for (int p = 0; p < s.ranks; ++p) {
    recv_counts[static_cast<size_t>(p)] = p == me ? 0 : s.length(p);
    recv_displs[static_cast<size_t>(p)] = s.begin(p);
  }
  send_counts[static_cast<size_t>(me)] = 0;
  group->all_to_allv(dst, send_counts.data(), send_displs.data(), dst, recv_counts.data(), recv_displs.data(), DType::BF16);
}

}  // namespace

FsdpShards::FsdpShards(TrackingAllocator& alloc, Communicator* comm, std::vector<FsdpUnitShape> units,
                       ShardPrecision precision, GradShards grads, Communicator* local_group)
    : alloc_(alloc), comm_(comm), local_group_(local_group), units_(std::move(units)), precision_(precision) {
  ranks_ = comm_ ? comm_->size() : 1;
  rank_ = comm_ ? comm_->rank() : 0;
  local_ranks_ = local_group_ ? local_group_->size() : 1;
  local_rank_ = local_group_ ? local_group_->rank() : 0;
  int64_t total = 0;
  for (size_t i = 0; i < units_.size(); ++i) {
    const FsdpUnitShape& u = units_[i];
    if (u.sharded_params < 0 || u.local_params < 0)
      throw std::invalid_argument("FsdpShards: unit '" + u.name + "' has a negative size (sharded " +
                                  std::to_string(u.sharded_params) + ", local " + std::to_string(u.local_params) + ")");
    offsets_.push_back(total);
    total += shard_length(i);
  }
  const DType dtype = precision_ == ShardPrecision::Fp32Master ? DType::F32 : DType::BF16;
  params_ = Tensor(alloc_, dtype, {total}, Category::Params);  // [P] fp32 master or bf16
  if (grads == GradShards::Whole) grads_ = Tensor(alloc_, dtype, {total}, Category::Grads);  // [P] fp32 or bf16
  if (total > 0) {
    std::memset(params_.raw(), 0, static_cast<size_t>(params_.bytes()));
    if (!grads_.empty()) std::memset(grads_.raw(), 0, static_cast<size_t>(grads_.bytes()));
  }
}

int64_t FsdpShards::slice_stride(size_t i) const { return Split{units_.at(i).sharded_params, ranks_}.stride(); }
int64_t FsdpShards::slice_length(size_t i, int r) const { return Split{units_.at(i).sharded_params, ranks_}.length(r); }
int64_t FsdpShards::slice_begin(size_t i) const { return Split{units_.at(i).sharded_params, ranks_}.begin(rank_); }
int64_t FsdpShards::local_stride(size_t i) const { return Split{units_.at(i).local_params, local_ranks_}.stride(); }
int64_t FsdpShards::local_length(size_t i, int r) const { return Split{units_.at(i).local_params, local_ranks_}.length(r); }
int64_t FsdpShards::local_begin(size_t i) const { return Split{units_.at(i).local_params, local_ranks_}.begin(local_rank_); }

int64_t FsdpShards::reduce_scatter_input_params(size_t i) const {
  return static_cast<int64_t>(ranks_) * slice_stride(i) + static_cast<int64_t>(local_ranks_) * local_stride(i);
}

Tensor FsdpShards::gather(size_t i) {
  const FsdpUnitShape& u = units_.at(i);
  const int64_t mine = slice_length(i, rank_);
  Tensor out(alloc_, DType::BF16, {gathered_params(i)}, Category::Fsdp);  // [U] bf16
  Bf16* dst = out.data<Bf16>();
  const int64_t offset = offsets_[i];
  // The rank's slices as bf16 (a copy for fp32 masters, the shard itself otherwise).
  auto to_bf16 = [&](int64_t from, int64_t count, Bf16* to) {
    if (precision_ == ShardPrecision::Fp32Master) {
      const float* p = params_.data<float>() + offset + from;
      for (int64_t e = 0; e < count; ++e) to[e] = f32_to_bf16(p[e]);
    } else {
      std::memcpy(to, params_.data<Bf16>() + offset + from, static_cast<size_t>(count) * sizeof(Bf16));
    }
  };
  gather_part(comm_, Split{u.sharded_params, ranks_}, rank_, dst, [&](Bf16* at) { to_bf16(0, mine, at); });
  gather_part(local_group_, Split{u.local_params, local_ranks_}, local_rank_, dst + u.sharded_params,
              [&](Bf16* at) { to_bf16(mine, local_length(i, local_rank_), at); });
  return out;
}

Tensor FsdpShards::reduce_scatter_input(size_t i, const Tensor& unsharded_grad) {
  const FsdpUnitShape& u = units_.at(i);
  if (unsharded_grad.dtype() != DType::BF16 || unsharded_grad.numel() != gathered_params(i))
    throw std::invalid_argument("FsdpShards::reduce_scatter_input: unit '" + u.name + "' needs a [" +
                                std::to_string(gathered_params(i)) + "] bf16 gradient (got " +
                                std::to_string(unsharded_grad.numel()) + " elements)");
  // [N·S | R·S_l] fp32: block p of each part is rank p's slice of this rank's contribution, zero padded.
  const int64_t sharded_span = static_cast<int64_t>(ranks_) * slice_stride(i);
  Tensor input(alloc_, DType::F32, {reduce_scatter_input_params(i)}, Category::Fsdp);
  const Bf16* g = unsharded_grad.data<Bf16>();
  float* in = input.data<float>();
  for (int64_t e = 0; e < u.sharded_params; ++e) in[e] = to_f32(g[e]);
  std::fill(in + u.sharded_params, in + sharded_span, 0.0f);
  for (int64_t e = 0; e < u.local_params; ++e) in[sharded_span + e] = to_f32(g[u.sharded_params + e]);
  std::fill(in + sharded_span + u.local_params, in + input.numel(), 0.0f);
  return input;
}

const float* FsdpShards::sum_parts(size_t i, const Tensor& input, float* sums) {
  const FsdpUnitShape& u = units_.at(i);
  const Split d{u.sharded_params, ranks_}, l{u.local_params, local_ranks_};
  const float* in = input.data<float>();
  const bool reduce_d = reduced(comm_, d), reduce_l = reduced(local_group_, l);
  if (reduce_d) comm_->reduce_scatter(in, sums, d.stride(), DType::F32);
  if (reduce_l)
    local_group_->reduce_scatter(in + static_cast<int64_t>(ranks_) * d.stride(), sums + (reduce_d ? d.stride() : 0), l.stride(), DType::F32);
  return sums;
}

int64_t FsdpShards::summed_params(size_t i) const {
  const FsdpUnitShape& u = units_.at(i);
  const Split d{u.sharded_params, ranks_}, l{u.local_params, local_ranks_};
  return (reduced(comm_, d) ? d.stride() : 0) + (reduced(local_group_, l) ? l.stride() : 0);
}

// Where the rank's sums of each part are: in `sums` for a reduced part (the dense part's first),
// else the input itself (this rank's slice is the part: one rank, or a local part held whole).
std::pair<const float*, const float*> FsdpShards::part_sums(size_t i, const Tensor& input, const float* sums) const {
  const FsdpUnitShape& u = units_.at(i);
  const Split d{u.sharded_params, ranks_}, l{u.local_params, local_ranks_};
  const float* in = input.data<float>();
  const bool reduce_d = reduced(comm_, d), reduce_l = reduced(local_group_, l);
  const float* dense = reduce_d ? sums : in;
  const float* local = reduce_l ? sums + (reduce_d ? d.stride() : 0) : in + static_cast<int64_t>(ranks_) * d.stride();
  return {dense, local};
}

void FsdpShards::reduce_scatter(size_t i, const Tensor& unsharded_grad) {
  if (grads_.empty())
    throw std::invalid_argument("FsdpShards::reduce_scatter: the grad shards are the caller's (GradShards::Caller); use "
                                "reduce_scatter_input and reduce_scatter_into");
  const Tensor input = reduce_scatter_input(i, unsharded_grad);
  Tensor summed(alloc_, DType::F32, {summed_params(i)}, Category::Fsdp);  // this rank's blocks (the unit's reduce-scatter output)
  const auto [dense, local] = part_sums(i, input, sum_parts(i, input, summed.data<float>()));
  const int64_t offset = offsets_[i], mine = slice_length(i, rank_);
  // Adds fp32 sums into the shard at `from` (rounded once per element for bf16 shards).
  auto accumulate = [&](int64_t from, int64_t count, const float* sum) {
    if (precision_ == ShardPrecision::Fp32Master) {
      float* dst = grads_.data<float>() + offset + from;
      for (int64_t e = 0; e < count; ++e) dst[e] += sum[e];
    } else {
      Bf16* dst = grads_.data<Bf16>() + offset + from;
      for (int64_t e = 0; e < count; ++e) dst[e] = f32_to_bf16(to_f32(dst[e]) + sum[e]);
    }
  };
  accumulate(0, mine, dense);
  accumulate(mine, local_length(i, local_rank_), local);
}

DType FsdpShards::check_reduce_scatter(const char* what, size_t i, const Tensor& input, const Tensor& shard) const {
  const FsdpUnitShape& u = units_.at(i);
  const DType want = precision_ == ShardPrecision::Fp32Master ? DType::F32 : DType::BF16;
  if (input.dtype() != DType::F32 || input.numel() != reduce_scatter_input_params(i) || shard.dtype() != want ||
      shard.numel() < shard_length(i))
    throw std::invalid_argument(std::string("FsdpShards::") + what + ": unit '" + u.name + "' needs an fp32 input of " +
                                std::to_string(reduce_scatter_input_params(i)) + " elements (got " +
                                std::to_string(input.numel()) + ") and a " + dtype_name(want) + " shard of at least " +
                                std::to_string(shard_length(i)) + " (got " + std::to_string(shard.numel()) + ")");
  return want;
}

void FsdpShards::reduce_scatter_into(size_t i, const Tensor& input, Tensor& shard) {
  const DType want = check_reduce_scatter("reduce_scatter_into", i, input, shard);
  const int64_t mine = slice_length(i, rank_), local_mine = local_length(i, local_rank_);
  const int64_t summed = summed_params(i);
  // The sums land in the shard itself when it is fp32 and holds them (full slices, or padded);
  // otherwise in this rank's blocks [S (+ S_l)]: for bf16 shards the unit's reduce-scatter output
  // (fsdp, as FSDP2 and the planner have it), for an unpadded fp32 shard with a short slice an
  // artefact of the executor (comm).
  Tensor staging;
  float* sums = nullptr;
  if (want == DType::F32 && shard.numel() >= summed) {
    sums = shard.data<float>();
  } else if (summed > 0) {
    staging = Tensor(alloc_, DType::F32, {summed}, want == DType::BF16 ? Category::Fsdp : Category::Comm);
    sums = staging.data<float>();
  }
  const auto [dense, local] = part_sums(i, input, sum_parts(i, input, sums));
  auto store = [&](int64_t at, int64_t count, const float* sum) {
    if (want == DType::F32) {
      float* dst = shard.data<float>() + at;
      if (dst != sum && count > 0) std::memmove(dst, sum, static_cast<size_t>(count) * sizeof(float));  // may overlap in place
    } else {
      Bf16* dst = shard.data<Bf16>() + at;
      for (int64_t e = 0; e < count; ++e) dst[e] = f32_to_bf16(sum[e]);
    }
  };
  // The local part first: in place its sums sit after the dense part's full S, which may be past
  // where it goes (a short slice), and moving it only overwrites the dense part's padding.
  store(mine, local_mine, local);
  store(0, mine, dense);
}

void FsdpShards::reduce_scatter_add(size_t i, const Tensor& input, Tensor& shard) {
  const DType want = check_reduce_scatter("reduce_scatter_add", i, input, shard);
  const int64_t mine = slice_length(i, rank_), local_mine = local_length(i, local_rank_);
  const int64_t summed = summed_params(i);
  Tensor output;  // the reduce-scatter output [S (+ S_l)] fp32
  float* sums = nullptr;
  if (summed > 0) {
    output = Tensor(alloc_, DType::F32, {summed}, Category::Fsdp);
    sums = output.data<float>();
  }
  const auto [dense, local] = part_sums(i, input, sum_parts(i, input, sums));
  auto add = [&](int64_t at, int64_t count, const float* sum) {
    for (int64_t e = 0; e < count; ++e) {
      if (want == DType::F32) shard.data<float>()[at + e] += sum[e];
      else shard.data<Bf16>()[at + e] = f32_to_bf16(to_f32(shard.data<Bf16>()[at + e]) + sum[e]);
    }
  };
  add(0, mine, dense);
  add(mine, local_mine, local);
}

}  // namespace flatpeak::exec
