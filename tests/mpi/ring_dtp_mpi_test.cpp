// Under mpirun -np 4: Ring-DTP over the mpi communicator, both rotations and both backward
// variants, on a shape whose V is not a multiple of R·V_blk and whose T is not a multiple of
// T_blk. Each rank checks its own loss, dX and dW shard: bitwise equal to the same ring run as 4
// thread ranks inside this process (same code, same order: the communicator moves bytes only),
// and within the bounds of executor_ring_dtp_test of the single-rank blocked schedule on the same
// global data. The error count is agreed through check_status, so every rank exits alike.
//   mpirun -np 4 ./tests/mpi_ring_dtp_mpi_test
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "executor/comm/mpi_comm.h"
#include "executor/comm/threads_comm.h"
#include "executor/ops/dtype.h"
#include "executor/schedules/ring_dtp_schedule.h"
#include "executor/schedules/vocab_schedule.h"

using namespace flatpeak::exec;

namespace {

int errors = 0;
void expect(bool ok, const std::string& what, int rank) {
  if (!ok) {
    ++errors;
    std::fprintf(stderr, "rank %d: FAILED: %s\n", rank, what.c_str());
  }
}

RingDtpConfig config(RingRotation rotation, bool in_forward) {
  RingDtpConfig c;
  c.tokens = 48; c.hidden = 16; c.vocab = 203; c.ring_size = 4;  // shards of 51 rows, the last 50
  c.token_block_rows = 20; c.vocab_block_rows = 16;
  c.rotation = rotation; c.gradients_in_forward = in_forward; c.seed = 11;
  return c;
}

void check_case(Communicator& comm, RingRotation rotation, bool in_forward) {
  const int rank = comm.rank();
  const RingDtpConfig c = config(rotation, in_forward);
  const std::string name = std::string(rotation == RingRotation::Weights ? "weights" : "activations") +
                           (in_forward ? " in-forward" : " recompute");
  TrackingAllocator alloc({512});
  const RingDtpResult mpi = run_ring_dtp_schedule(comm, alloc, c);

  // The same ring as threads in this process: this rank's part must be bitwise the same.
  RingDtpResult threads;
  const RunResult tr = run_ranks(4, [&](int r, Communicator& tc) {
    TrackingAllocator a({512});
    RingDtpResult got = run_ring_dtp_schedule(tc, a, c);
    if (r == rank) threads = std::move(got);
  });
  expect(tr.ok(), name + ": threads run: " + tr.message, rank);
  expect(mpi.mean_loss == threads.mean_loss, name + ": mean loss differs from threads", rank);
  expect(mpi.loss == threads.loss, name + ": per-token loss differs from threads", rank);
  expect(mpi.d_x == threads.d_x, name + ": dX differs from threads", rank);
  expect(mpi.d_w == threads.d_w, name + ": dW shard differs from threads", rank);

  // The single-rank blocked schedule on the ring's 4·T tokens.
  VocabScheduleConfig ref_config;
  ref_config.tokens = 4 * c.tokens; ref_config.hidden = c.hidden; ref_config.vocab = c.vocab;
  ref_config.token_block_rows = c.token_block_rows; ref_config.vocab_block_rows = c.vocab_block_rows;
  ref_config.mode = VocabScheduleMode::Blocked; ref_config.seed = c.seed;
  TrackingAllocator ref_alloc;
  const VocabScheduleResult ref = run_vocab_schedule(ref_alloc, ref_config);
  expect(std::fabs(mpi.mean_loss - ref.mean_loss) <= 1e-6, name + ": loss beyond 1e-6 of the single-rank schedule", rank);
  double dx_err = 0, dx_scale = 0, dw_err = 0, dw_scale = 0;
  for (int64_t i = 0; i < c.tokens * c.hidden; ++i) {
    const double want = ref.d_x[static_cast<size_t>(rank * c.tokens * c.hidden + i)];
    dx_err = std::max(dx_err, std::fabs(double(to_f32(f32_to_bf16(mpi.d_x[static_cast<size_t>(i)]))) - want));
    dx_scale = std::max(dx_scale, std::fabs(want));
  }
  for (int64_t i = 0; i < mpi.shard_rows * c.hidden; ++i) {
    const double want = ref.d_w[static_cast<size_t>(mpi.shard_first_row * c.hidden + i)];
    dw_err = std::max(dw_err, std::fabs(double(mpi.d_w[static_cast<size_t>(i)]) - want));
    dw_scale = std::max(dw_scale, std::fabs(want));
  }
  expect(dx_scale > 0 && dx_err <= std::ldexp(dx_scale, -8), name + ": dX beyond one bf16 step of the single-rank schedule", rank);
  expect(dw_scale > 0 && dw_err <= 1e-5 * dw_scale, name + ": dW shard beyond 1e-5 of the single-rank schedule", rank);
}

}  // namespace

int main() {
  MpiCommunicator comm(MpiOptions{20.0});
  const RankStatus status = run_mpi_rank(comm, [&](int rank, Communicator& c) {
    for (RingRotation rotation : {RingRotation::Activations, RingRotation::Weights})
      for (bool in_forward : {false, true}) check_case(c, rotation, in_forward);
    int64_t total = errors;
    c.all_reduce(&total, &total, 1, DType::I64, ReduceOp::Sum);
    if (rank == 0) std::printf("ring_dtp_mpi_test: %d ranks, %lld failed checks\n", c.size(), static_cast<long long>(total));
    c.check_status(errors > 0 ? 1 : 0, std::to_string(errors) + " failed checks");
  });
  return status.exit_code;
}
