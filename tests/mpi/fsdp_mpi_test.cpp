// Under mpirun -np 4: FsdpShards over the mpi communicator — the all-gather of each unit's bf16
// compute copy and the reduce-scatter of bf16 gradients, each rank checking its own result against
// values that are a pure function of (rank, unit, index); bitwise, as with thread ranks
// (tests/unit/executor_fsdp_test.cpp). The error count is agreed through check_status.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "executor/comm/mpi_comm.h"
#include "executor/schedules/fsdp_shards.h"

using namespace flatpeak::exec;

namespace {

float master_value(size_t unit, int64_t index) { return 0.37f + 0.01f * static_cast<float>(unit) + 1e-3f * std::sin(0.7f * static_cast<float>(index)); }
float grad_value(int rank, size_t unit, int64_t index) {
  return to_f32(f32_to_bf16(0.01f * std::cos(0.3f * static_cast<float>(index) + static_cast<float>(rank)) + 1e-3f * static_cast<float>(unit)));
}

int errors = 0;
void expect(bool ok, const std::string& what, int rank) {
  if (!ok && ++errors <= 10) std::fprintf(stderr, "rank %d: FAILED: %s\n", rank, what.c_str());
}

}  // namespace

int main() {
  MpiCommunicator comm(MpiOptions{20.0});  // a peer silent for 20 s fails the job
  const int rank = comm.rank(), n = comm.size();
  TrackingAllocator alloc({256});
  // A slice length that does not divide, fewer elements than ranks, a local part.
  FsdpShards s(alloc, &comm, {{"embedding", 10, 0}, {"L0", 2, 5}, {"L1", 37, 12}}, ShardPrecision::Fp32Master);
  for (size_t i = 0; i < s.units(); ++i) {
    const int64_t begin = std::min<int64_t>(s.unit(i).sharded_params, static_cast<int64_t>(rank) * s.slice_stride(i));
    const int64_t mine = s.slice_length(i, rank);
    float* p = s.params().data<float>() + s.shard_offset(i);
    for (int64_t e = 0; e < mine; ++e) p[e] = master_value(i, begin + e);
    for (int64_t e = 0; e < s.unit(i).local_params; ++e) p[mine + e] = static_cast<float>(rank) + 0.5f;
  }
  for (size_t i = 0; i < s.units(); ++i) {
    Tensor w = s.gather(i);
    for (int64_t e = 0; e < s.unit(i).sharded_params; ++e)
      expect(w.data<Bf16>()[e].bits == f32_to_bf16(master_value(i, e)).bits, "gather unit " + std::to_string(i) + " element " + std::to_string(e), rank);
    Tensor g(alloc, DType::BF16, {s.gathered_params(i)}, Category::Fsdp);
    for (int64_t e = 0; e < s.gathered_params(i); ++e) g.data<Bf16>()[e] = f32_to_bf16(grad_value(rank, i, e));
    s.reduce_scatter(i, g);
    const int64_t begin = std::min<int64_t>(s.unit(i).sharded_params, static_cast<int64_t>(rank) * s.slice_stride(i));
    for (int64_t e = 0; e < s.slice_length(i, rank); ++e) {
      float sum = 0.0f;
      for (int p = 0; p < n; ++p) sum += grad_value(p, i, begin + e);
      expect(s.grads().data<float>()[s.shard_offset(i) + e] == sum,
             "reduce-scatter unit " + std::to_string(i) + " element " + std::to_string(begin + e), rank);
    }
  }
  try {
    comm.check_status(errors == 0 ? 0 : 1, std::to_string(errors) + " mismatches");
  } catch (const RankFailed& f) {
    if (rank == 0) std::fprintf(stderr, "fsdp_mpi_test: rank %d failed: %s\n", f.failing_rank, f.reason.c_str());
    return 1;
  }
  if (rank == 0) std::printf("fsdp_mpi_test: %d ranks, gather and reduce-scatter bitwise\n", n);
  return 0;
}
