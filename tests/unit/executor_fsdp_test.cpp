// FSDP shards across 4 thread ranks (and one rank): the slice layout, the all-gather of the bf16
// compute copy (bitwise the rounded masters, in rank order, local parts after), the reduce-scatter
// of bf16 gradients (bitwise the fp32 sum in rank order, accumulating over micro-batches), AdamW on
// each shard equal to AdamW on the whole vector, and the tracked bytes of each buffer.
// Values are a pure function of (unit, global index) or (rank, unit, index), so each rank checks
// its own result.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "executor/comm/threads_comm.h"
#include "executor/ops/adamw.h"
#include "executor/schedules/fsdp_shards.h"

namespace flatpeak::exec {
namespace {

// Distinct, non-zero values whose bf16 roundings differ from their fp32 values.
float master_value(size_t unit, int64_t index) { return 0.37f + 0.01f * static_cast<float>(unit) + 1e-3f * std::sin(0.7f * static_cast<float>(index) + 0.1f); }
float local_value(int rank, size_t unit, int64_t index) { return -0.5f + 0.1f * static_cast<float>(rank) + 1e-3f * static_cast<float>(unit) + 1e-4f * static_cast<float>(index); }
float grad_value(int rank, int micro, size_t unit, int64_t index) {
  return to_f32(f32_to_bf16(0.01f * std::cos(0.3f * static_cast<float>(index) + static_cast<float>(rank) + 0.5f * static_cast<float>(micro)) +
                     1e-3f * static_cast<float>(unit)));
}
bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0; }

// Units of different shapes: a slice length that does not divide (10 over 4), fewer elements than
// ranks (2 over 4: ranks 2 and 3 hold nothing of it), a local part, a purely local unit.
std::vector<FsdpUnitShape> shapes() { return {{"embedding", 10, 0}, {"L0", 2, 5}, {"L1", 37, 12}, {"head", 0, 3}}; }

// Fills a rank's master shard with master_value of the global index (sharded part) and
// local_value (local part).
void fill_masters(FsdpShards& s) {
  for (size_t i = 0; i < s.units(); ++i) {
    const int64_t begin = std::min<int64_t>(s.unit(i).sharded_params, static_cast<int64_t>(s.rank()) * s.slice_stride(i));
    float* p = s.params().data<float>() + s.shard_offset(i);
    const int64_t mine = s.slice_length(i, s.rank());
    for (int64_t e = 0; e < mine; ++e) p[e] = master_value(i, begin + e);
    for (int64_t e = 0; e < s.unit(i).local_params; ++e) p[mine + e] = local_value(s.rank(), i, e);
  }
}

TEST(ExecutorFsdp, SliceLayout) {
  const RunResult r = run_ranks(4, [&](int, Communicator& comm) {
    TrackingAllocator alloc({256});
    FsdpShards s(alloc, &comm, shapes(), ShardPrecision::Fp32Master);
    EXPECT_EQ(s.slice_stride(0), 3);
    EXPECT_EQ(s.slice_length(0, 0), 3);
    EXPECT_EQ(s.slice_length(0, 3), 1);  // 10 = 3 + 3 + 3 + 1
    EXPECT_EQ(s.slice_length(1, 1), 1);
    EXPECT_EQ(s.slice_length(1, 2), 0);  // 2 elements over 4 ranks
    EXPECT_EQ(s.slice_length(3, 0), 0);
    const int64_t expected = s.slice_length(0, s.rank()) + s.slice_length(1, s.rank()) + 5 + s.slice_length(2, s.rank()) + 12 + 3;
    EXPECT_EQ(s.shard_params(), expected);
    // Model state as the planner lays it out with the optimizer on the device: fp32 shards.
    EXPECT_EQ(alloc.live_bytes(MemorySpace::Device, Category::Params), alloc.tracked_bytes_for(4 * expected));
    EXPECT_EQ(alloc.live_bytes(MemorySpace::Device, Category::Grads), alloc.tracked_bytes_for(4 * expected));
  });
  EXPECT_TRUE(r.ok()) << r.message;
}

TEST(ExecutorFsdp, GatherIsTheRoundedMastersInRankOrder) {
  const RunResult r = run_ranks(4, [&](int rank, Communicator& comm) {
    TrackingAllocator alloc({256});
    FsdpShards s(alloc, &comm, shapes(), ShardPrecision::Fp32Master);
    fill_masters(s);
    for (size_t i = 0; i < s.units(); ++i) {
      const int64_t fsdp_before = alloc.live_bytes(MemorySpace::Device, Category::Fsdp);
      Tensor w = s.gather(i);
      ASSERT_EQ(w.numel(), s.gathered_params(i));  // exactly U, no padding
      EXPECT_EQ(alloc.live_bytes(MemorySpace::Device, Category::Fsdp) - fsdp_before, alloc.tracked_bytes_for(2 * s.gathered_params(i)));
      EXPECT_EQ(alloc.live_bytes(MemorySpace::Device, Category::Comm), 0);  // sent from its place in the output: no send copy
      const Bf16* g = w.data<Bf16>();
      for (int64_t e = 0; e < s.unit(i).sharded_params; ++e)
        ASSERT_EQ(g[e].bits, f32_to_bf16(master_value(i, e)).bits) << "rank " << rank << " unit " << i << " element " << e;
      for (int64_t e = 0; e < s.unit(i).local_params; ++e)
        ASSERT_EQ(g[s.unit(i).sharded_params + e].bits, f32_to_bf16(local_value(rank, i, e)).bits) << "rank " << rank << " unit " << i;
    }
  });
  EXPECT_TRUE(r.ok()) << r.message;
}

TEST(ExecutorFsdp, ReduceScatterSumsInRankOrderAndAccumulates) {
  for (ShardPrecision precision : {ShardPrecision::Fp32Master, ShardPrecision::Bf16}) {
    const RunResult r = run_ranks(4, [&](int rank, Communicator& comm) {
      TrackingAllocator alloc({256});
      FsdpShards s(alloc, &comm, shapes(), precision);
      for (int micro = 0; micro < 2; ++micro) {
        for (size_t i = 0; i < s.units(); ++i) {
          Tensor g(alloc, DType::BF16, {s.gathered_params(i)}, Category::Fsdp);  // [U] bf16, this rank's grad
          for (int64_t e = 0; e < s.gathered_params(i); ++e) g.data<Bf16>()[e] = f32_to_bf16(grad_value(rank, micro, i, e));
          s.reduce_scatter(i, g);
          EXPECT_EQ(alloc.live_bytes(MemorySpace::Device, Category::Comm), 0);
        }
      }
      EXPECT_EQ(alloc.live_bytes(MemorySpace::Device, Category::Fsdp), 0);
      // Reference: micro-batch sums over the ranks in rank order (fp32), added to the shard in turn.
      for (size_t i = 0; i < s.units(); ++i) {
        const int64_t begin = std::min<int64_t>(s.unit(i).sharded_params, static_cast<int64_t>(rank) * s.slice_stride(i));
        const int64_t mine = s.slice_length(i, rank);
        for (int64_t e = 0; e < s.shard_length(i); ++e) {
          const bool local = e >= mine;
          float acc = 0.0f;
          for (int micro = 0; micro < 2; ++micro) {
            float sum = 0.0f;
            if (local) {
              sum = grad_value(rank, micro, i, s.unit(i).sharded_params + (e - mine));
            } else {
              for (int p = 0; p < 4; ++p) sum += grad_value(p, micro, i, begin + e);
            }
            acc = precision == ShardPrecision::Bf16 ? to_f32(f32_to_bf16(acc + sum)) : acc + sum;
          }
          const float got = precision == ShardPrecision::Bf16 ? to_f32(s.grads().data<Bf16>()[s.shard_offset(i) + e])
                                                              : s.grads().data<float>()[s.shard_offset(i) + e];
          ASSERT_TRUE(same_bits(got, acc)) << "rank " << rank << " unit " << i << " element " << e << ": " << got << " vs " << acc;
        }
      }
    });
    EXPECT_TRUE(r.ok()) << r.message;
  }
}

// The split reduce-scatter into caller-held shards (the step's): the input [N·S + local] fp32, then
// the rank-order sum written into a fresh shard of the unit, bitwise the sum; no [P] grad buffer.
TEST(ExecutorFsdp, ReduceScatterIntoCallerShards) {
  for (ShardPrecision precision : {ShardPrecision::Fp32Master, ShardPrecision::Bf16}) {
    const RunResult r = run_ranks(4, [&](int rank, Communicator& comm) {
      TrackingAllocator alloc({1});
      FsdpShards s(alloc, &comm, shapes(), precision, GradShards::Caller);
      EXPECT_TRUE(s.grads().empty());
      EXPECT_EQ(alloc.live_bytes(MemorySpace::Device, Category::Grads), 0);
      const DType dtype = precision == ShardPrecision::Bf16 ? DType::BF16 : DType::F32;
      for (size_t i = 0; i < s.units(); ++i) {
        Tensor g(alloc, DType::BF16, {s.gathered_params(i)}, Category::Fsdp);
        for (int64_t e = 0; e < s.gathered_params(i); ++e) g.data<Bf16>()[e] = f32_to_bf16(grad_value(rank, 0, i, e));
        Tensor in = s.reduce_scatter_input(i, g);
        EXPECT_EQ(in.numel(), 4 * s.slice_stride(i) + s.unit(i).local_params);
        Tensor shard(alloc, dtype, {s.shard_length(i)}, Category::Grads);
        s.reduce_scatter_into(i, in, shard);
        EXPECT_EQ(alloc.live_bytes(MemorySpace::Device, Category::Comm), 0);  // the [S] staging is freed
        const int64_t begin = s.slice_begin(i), mine = s.slice_length(i, rank);
        for (int64_t e = 0; e < s.shard_length(i); ++e) {
          float sum = 0.0f;
          if (e >= mine) sum = grad_value(rank, 0, i, s.unit(i).sharded_params + (e - mine));
          else
            for (int p = 0; p < 4; ++p) sum += grad_value(p, 0, i, begin + e);
          const float want = dtype == DType::BF16 ? to_f32(f32_to_bf16(sum)) : sum;
          const float got = dtype == DType::BF16 ? to_f32(shard.data<Bf16>()[e]) : shard.data<float>()[e];
          ASSERT_TRUE(same_bits(got, want)) << "rank " << rank << " unit " << i << " element " << e;
        }
      }
      Tensor g(alloc, DType::BF16, {s.gathered_params(0)}, Category::Fsdp);
      EXPECT_THROW(s.reduce_scatter(0, g), std::invalid_argument);  // no whole [P] grad shard to add to
    });
    EXPECT_TRUE(r.ok()) << r.message;
  }
}

// AdamW is element-wise: stepping each rank's shard and gathering the result gives bitwise the
// step of the whole vector on the summed gradients.
TEST(ExecutorFsdp, AdamWPerShardEqualsTheWholeVector) {
  const std::vector<FsdpUnitShape> units = {{"L0", 41, 0}, {"L1", 7, 0}};
  std::vector<std::vector<float>> whole(units.size());  // [U] reference masters after the step
  for (size_t i = 0; i < units.size(); ++i) {
    const int64_t n = units[i].sharded_params;
    std::vector<float> p(static_cast<size_t>(n)), g(static_cast<size_t>(n)), m(static_cast<size_t>(n), 0.0f), v(static_cast<size_t>(n), 0.0f);
    for (int64_t e = 0; e < n; ++e) {
      p[static_cast<size_t>(e)] = master_value(i, e);
      for (int r = 0; r < 4; ++r) g[static_cast<size_t>(e)] += grad_value(r, 0, i, e);
    }
    AdamWArgs a;
    a.master = p.data(); a.grad = g.data(); a.grad_dtype = DType::F32; a.m = m.data(); a.v = v.data();
    a.elems = n; a.step = 3; a.lr = 1e-2f; a.weight_decay = 0.1f;
    adamw_step_cpu(a);
    whole[i] = p;
  }
  const RunResult r = run_ranks(4, [&](int rank, Communicator& comm) {
    TrackingAllocator alloc({256});
    FsdpShards s(alloc, &comm, units, ShardPrecision::Fp32Master);
    fill_masters(s);
    for (size_t i = 0; i < s.units(); ++i) {
      Tensor g(alloc, DType::BF16, {s.gathered_params(i)}, Category::Fsdp);
      for (int64_t e = 0; e < s.gathered_params(i); ++e) g.data<Bf16>()[e] = f32_to_bf16(grad_value(rank, 0, i, e));
      s.reduce_scatter(i, g);
    }
    std::vector<float> m(static_cast<size_t>(s.shard_params()), 0.0f), v(m);
    AdamWArgs a;
    a.master = s.params().data<float>(); a.grad = s.grads().data<float>(); a.grad_dtype = DType::F32;
    a.m = m.data(); a.v = v.data(); a.elems = s.shard_params(); a.step = 3; a.lr = 1e-2f; a.weight_decay = 0.1f;
    adamw_step_cpu(a);
    for (size_t i = 0; i < s.units(); ++i) {
      const int64_t begin = std::min<int64_t>(s.unit(i).sharded_params, static_cast<int64_t>(rank) * s.slice_stride(i));
      for (int64_t e = 0; e < s.slice_length(i, rank); ++e)
        ASSERT_TRUE(same_bits(s.params().data<float>()[s.shard_offset(i) + e], whole[i][static_cast<size_t>(begin + e)]))
            << "rank " << rank << " unit " << i << " element " << begin + e;
    }
  });
  EXPECT_TRUE(r.ok()) << r.message;
}

TEST(ExecutorFsdp, OneRankHoldsEverything) {
  TrackingAllocator alloc({256});
  FsdpShards s(alloc, nullptr, shapes(), ShardPrecision::Bf16);
  EXPECT_EQ(s.shard_params(), 10 + 7 + 49 + 3);
  for (int64_t e = 0; e < s.shard_params(); ++e) s.params().data<Bf16>()[e] = f32_to_bf16(0.25f * static_cast<float>(e));
  Tensor w = s.gather(2);
  for (int64_t e = 0; e < s.gathered_params(2); ++e) ASSERT_EQ(w.data<Bf16>()[e].bits, s.params().data<Bf16>()[s.shard_offset(2) + e].bits);
  Tensor g(alloc, DType::BF16, {s.gathered_params(2)}, Category::Fsdp);
  for (int64_t e = 0; e < s.gathered_params(2); ++e) g.data<Bf16>()[e] = f32_to_bf16(1.0f);
  s.reduce_scatter(2, g);
  EXPECT_EQ(to_f32(s.grads().data<Bf16>()[s.shard_offset(2)]), 1.0f);
  Tensor wrong(alloc, DType::BF16, {3}, Category::Fsdp);
  EXPECT_THROW(s.reduce_scatter(2, wrong), std::invalid_argument);
}

// A local part split over a second group (the step at 1 < EP < N: a rank's experts over the
// replicas that hold them): 4 ranks, replicas {0, 2} and {1, 3} (split by rank % 2). The gather
// gives every replica the whole local part of its EP rank; the reduce-scatter sums the local part
// over the replicas in their order (and the sharded part over all 4), bitwise, into unpadded and
// padded fp32 shards (in place: no buffer of category comm) and bf16 shards.
TEST(ExecutorFsdp, LocalPartShardedOverTheReplicas) {
  struct Case {
    ShardPrecision precision;
    bool padded;
  };
  for (const Case k : {Case{ShardPrecision::Fp32Master, false}, Case{ShardPrecision::Fp32Master, true}, Case{ShardPrecision::Bf16, false}}) {
    const RunResult r = run_ranks(4, [&](int rank, Communicator& comm) {
      std::unique_ptr<Communicator> replicas = comm.split(rank % 2, rank / 2);
      TrackingAllocator alloc({1});
      FsdpShards s(alloc, &comm, shapes(), k.precision, GradShards::Caller, replicas.get());
      const int ep_rank = rank % 2;
      EXPECT_EQ(s.local_ranks(), 2);
      EXPECT_EQ(s.local_rank(), rank / 2);
      EXPECT_EQ(s.local_stride(2), 6);  // 12 over 2
      EXPECT_EQ(s.local_length(3, 1), 1);  // 3 = 2 + 1
      for (size_t i = 0; i < s.units(); ++i) {
        const int64_t mine = s.slice_length(i, rank), lb = s.local_begin(i), ll = s.local_length(i, s.local_rank());
        for (int64_t e = 0; e < mine; ++e) {
          const float v = master_value(i, s.slice_begin(i) + e);
          if (k.precision == ShardPrecision::Fp32Master) s.params().data<float>()[s.shard_offset(i) + e] = v;
          else s.params().data<Bf16>()[s.shard_offset(i) + e] = f32_to_bf16(v);
        }
        for (int64_t e = 0; e < ll; ++e) {
          const float v = local_value(ep_rank, i, lb + e);
          if (k.precision == ShardPrecision::Fp32Master) s.params().data<float>()[s.shard_offset(i) + mine + e] = v;
          else s.params().data<Bf16>()[s.shard_offset(i) + mine + e] = f32_to_bf16(v);
        }
      }
      for (size_t i = 0; i < s.units(); ++i) {
        const FsdpUnitShape& u = s.unit(i);
        {
          Tensor w = s.gather(i);
          for (int64_t e = 0; e < u.sharded_params; ++e) ASSERT_EQ(w.data<Bf16>()[e].bits, f32_to_bf16(master_value(i, e)).bits) << rank;
          for (int64_t e = 0; e < u.local_params; ++e)
            ASSERT_EQ(w.data<Bf16>()[u.sharded_params + e].bits, f32_to_bf16(local_value(ep_rank, i, e)).bits) << "rank " << rank << " unit " << i;
        }
        Tensor g(alloc, DType::BF16, {s.gathered_params(i)}, Category::Fsdp);
        for (int64_t e = 0; e < s.gathered_params(i); ++e) g.data<Bf16>()[e] = f32_to_bf16(grad_value(rank, 0, i, e));
        const Tensor in = s.reduce_scatter_input(i, g);
        EXPECT_EQ(in.numel(), 4 * s.slice_stride(i) + 2 * s.local_stride(i));
        const DType dtype = k.precision == ShardPrecision::Fp32Master ? DType::F32 : DType::BF16;
        Tensor shard(alloc, dtype, {k.padded ? s.shard_capacity(i) : s.shard_length(i)}, Category::Grads);
        alloc.set_phase("reduce unit " + std::to_string(i));
        s.reduce_scatter_into(i, in, shard);
        const auto records = alloc.phase_records();
        const PhaseRecord& device = records[records.size() - kMemorySpaceCount];  // device first
        if (k.padded) {
          EXPECT_EQ(device.category_peak_bytes[static_cast<size_t>(Category::Comm)], 0) << "padded fp32 shards land in place, unit " << i;
        }
        const int64_t mine = s.slice_length(i, rank), lb = s.local_begin(i);
        for (int64_t e = 0; e < s.shard_length(i); ++e) {
          float sum = 0.0f;
          if (e < mine) {
            for (int p = 0; p < 4; ++p) sum += grad_value(p, 0, i, s.slice_begin(i) + e);
          } else {
            for (int p = ep_rank; p < 4; p += 2) sum += grad_value(p, 0, i, u.sharded_params + lb + (e - mine));
          }
          const float want = dtype == DType::BF16 ? to_f32(f32_to_bf16(sum)) : sum;
          const float got = dtype == DType::BF16 ? to_f32(shard.data<Bf16>()[e]) : shard.data<float>()[e];
          ASSERT_TRUE(same_bits(got, want)) << "rank " << rank << " unit " << i << " element " << e << ": " << got << " vs " << want;
        }
      }
    });
    EXPECT_TRUE(r.ok()) << r.message;
  }
}

}  // namespace
}  // namespace flatpeak::exec
