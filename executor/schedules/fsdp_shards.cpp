// FSDP shards: layout, all-gather into the compute copy, reduce-scatter into the grad shard.
#include "executor/schedules/fsdp_shards.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <utility>

#include "executor/ops/dtype.h"

namespace flatpeak::exec {

namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

FsdpShards::FsdpShards(TrackingAllocator& alloc, Communicator* comm, std::vector<FsdpUnitShape> units,
                       ShardPrecision precision, GradShards grads)
    : alloc_(alloc), comm_(comm), units_(std::move(units)), precision_(precision) {
  ranks_ = comm_ ? comm_->size() : 1;
  rank_ = comm_ ? comm_->rank() : 0;
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

int64_t FsdpShards::slice_begin(size_t i) const {
  return std::min(units_.at(i).sharded_params, static_cast<int64_t>(rank_) * slice_stride(i));
}

int64_t FsdpShards::reduce_scatter_input_params(size_t i) const {
  return static_cast<int64_t>(ranks_) * slice_stride(i) + units_.at(i).local_params;
}

int64_t FsdpShards::slice_stride(size_t i) const { return ceil_div(units_.at(i).sharded_params, ranks_); }

int64_t FsdpShards::slice_length(size_t i, int r) const {
  const int64_t stride = slice_stride(i);
  const int64_t begin = std::min(units_.at(i).sharded_params, static_cast<int64_t>(r) * stride);
  return std::min(units_.at(i).sharded_params, begin + stride) - begin;
}

Tensor FsdpShards::gather(size_t i) {
  const FsdpUnitShape& u = units_.at(i);
  const int64_t stride = slice_stride(i), mine = slice_length(i, rank_);
  Tensor out(alloc_, DType::BF16, {gathered_params(i)}, Category::Fsdp);  // [U] bf16
  Bf16* dst = out.data<Bf16>();
  const int64_t offset = offsets_[i];
  // The rank's slice and local part as bf16 (a copy for fp32 masters, the shard itself otherwise).
  auto to_bf16 = [&](int64_t from, int64_t count, Bf16* to) {
    if (precision_ == ShardPrecision::Fp32Master) {
      const float* p = params_.data<float>() + offset + from;
      for (int64_t e = 0; e < count; ++e) to[e] = f32_to_bf16(p[e]);
    } else {
      std::memcpy(to, params_.data<Bf16>() + offset + from, static_cast<size_t>(count) * sizeof(Bf16));
    }
  };
  if (comm_ == nullptr || ranks_ == 1) {
    to_bf16(0, mine, dst);
  } else if (stride > 0) {
    // The own slice goes to its place in `out` first and is sent from there; nothing is sent to
    // or received from this rank itself.
    const int64_t begin = slice_begin(i);
    to_bf16(0, mine, dst + begin);
    std::vector<int64_t> send_counts(static_cast<size_t>(ranks_), mine), send_displs(static_cast<size_t>(ranks_), begin);
    std::vector<int64_t> recv_counts(static_cast<size_t>(ranks_)), recv_displs(static_cast<size_t>(ranks_));
    for (int p = 0; p < ranks_; ++p) {
      recv_counts[static_cast<size_t>(p)] = p == rank_ ? 0 : slice_length(i, p);
      recv_displs[static_cast<size_t>(p)] = std::min(u.sharded_params, static_cast<int64_t>(p) * stride);
    }
    send_counts[static_cast<size_t>(rank_)] = 0;
    comm_->all_to_allv(out.raw(), send_counts.data(), send_displs.data(), out.raw(), recv_counts.data(),
                       recv_displs.data(), DType::BF16);
  }
  to_bf16(mine, u.local_params, dst + u.sharded_params);
  return out;
}

void FsdpShards::reduce_scatter(size_t i, const Tensor& unsharded_grad) {
  const FsdpUnitShape& u = units_.at(i);
  if (grads_.empty())
    throw std::invalid_argument("FsdpShards::reduce_scatter: the grad shards are the caller's (GradShards::Caller); use "
                                "reduce_scatter_input and reduce_scatter_into");
  if (unsharded_grad.dtype() != DType::BF16 || unsharded_grad.numel() != gathered_params(i))
    throw std::invalid_argument("FsdpShards::reduce_scatter: unit '" + u.name + "' needs a [" +
                                std::to_string(gathered_params(i)) + "] bf16 gradient (got " +
                                std::to_string(unsharded_grad.numel()) + " elements)");
  const int64_t stride = slice_stride(i), mine = slice_length(i, rank_);
  const Bf16* g = unsharded_grad.data<Bf16>();
  const int64_t offset = offsets_[i];
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
  // The fp32 reduce-scatter input [N·S + local]: block p of the first N·S is rank p's slice of this
  // rank's contribution (zero padded), the local part follows.
  const int64_t sharded_span = static_cast<int64_t>(ranks_) * stride;
  Tensor input(alloc_, DType::F32, {sharded_span + u.local_params}, Category::Fsdp);
  float* in = input.data<float>();
  for (int64_t e = 0; e < u.sharded_params; ++e) in[e] = to_f32(g[e]);
  std::fill(in + u.sharded_params, in + sharded_span, 0.0f);
  for (int64_t e = 0; e < u.local_params; ++e) in[sharded_span + e] = to_f32(g[u.sharded_params + e]);
  if (comm_ != nullptr && ranks_ > 1 && stride > 0) {
    Tensor summed(alloc_, DType::F32, {stride}, Category::Fsdp);  // [S] fp32, this rank's block (the unit's reduce-scatter output)
    comm_->reduce_scatter(in, summed.raw(), stride, DType::F32);
    accumulate(0, mine, summed.data<float>());
  } else {
    accumulate(0, mine, in);
  }
  accumulate(mine, u.local_params, in + sharded_span);
}

Tensor FsdpShards::reduce_scatter_input(size_t i, const Tensor& unsharded_grad) {
  const FsdpUnitShape& u = units_.at(i);
  if (unsharded_grad.dtype() != DType::BF16 || unsharded_grad.numel() != gathered_params(i))
    throw std::invalid_argument("FsdpShards::reduce_scatter_input: unit '" + u.name + "' needs a [" +
                                std::to_string(gathered_params(i)) + "] bf16 gradient (got " +
                                std::to_string(unsharded_grad.numel()) + " elements)");
  const int64_t sharded_span = static_cast<int64_t>(ranks_) * slice_stride(i);
  Tensor input(alloc_, DType::F32, {reduce_scatter_input_params(i)}, Category::Fsdp);  // [N·S + local] fp32
  const Bf16* g = unsharded_grad.data<Bf16>();
  float* in = input.data<float>();
  for (int64_t e = 0; e < u.sharded_params; ++e) in[e] = to_f32(g[e]);
  std::fill(in + u.sharded_params, in + sharded_span, 0.0f);
  for (int64_t e = 0; e < u.local_params; ++e) in[sharded_span + e] = to_f32(g[u.sharded_params + e]);
  return input;
}

void FsdpShards::reduce_scatter_into(size_t i, const Tensor& input, Tensor& shard) {
  const FsdpUnitShape& u = units_.at(i);
  const DType want = precision_ == ShardPrecision::Fp32Master ? DType::F32 : DType::BF16;
  if (input.dtype() != DType::F32 || input.numel() != reduce_scatter_input_params(i) || shard.dtype() != want ||
      shard.numel() < shard_length(i))
    throw std::invalid_argument("FsdpShards::reduce_scatter_into: unit '" + u.name + "' needs an fp32 input of " +
                                std::to_string(reduce_scatter_input_params(i)) + " elements (got " +
                                std::to_string(input.numel()) + ") and a " + dtype_name(want) + " shard of at least " +
                                std::to_string(shard_length(i)) + " (got " + std::to_string(shard.numel()) + ")");
  const int64_t stride = slice_stride(i), mine = slice_length(i, rank_);
  const int64_t sharded_span = static_cast<int64_t>(ranks_) * stride;
  const float* in = input.data<float>();
  auto store = [&](int64_t at, int64_t count, const float* sum) {
    if (want == DType::F32) {
      float* dst = shard.data<float>() + at;
      if (dst != sum) std::memcpy(dst, sum, static_cast<size_t>(count) * sizeof(float));
    } else {
      Bf16* dst = shard.data<Bf16>() + at;
      for (int64_t e = 0; e < count; ++e) dst[e] = f32_to_bf16(sum[e]);
    }
  };
  if (comm_ != nullptr && ranks_ > 1 && stride > 0) {
    if (want == DType::F32 && mine == stride) {
      comm_->reduce_scatter(in, shard.raw(), stride, DType::F32);  // lands in the shard itself
    } else {
      // [S] fp32, this rank's block. For bf16 shards it is the unit's reduce-scatter output, as in
      // FSDP2 (fsdp, what the planner counts); for an fp32 shard it exists only because a short
      // slice (the last ranks of an uneven split) is not padded to S as FSDP2's shards are (comm).
      const Category staging = want == DType::BF16 ? Category::Fsdp : Category::Comm;
      Tensor summed(alloc_, DType::F32, {stride}, staging);
      comm_->reduce_scatter(in, summed.raw(), stride, DType::F32);
      store(0, mine, summed.data<float>());
    }
  } else {
    store(0, mine, in);
  }
  store(mine, u.local_params, in + sharded_span);
}

}  // namespace flatpeak::exec
