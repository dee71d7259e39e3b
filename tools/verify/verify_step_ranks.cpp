// verify --component step on N ranks (EP = 1): the whole training step of the scaled model on
// every rank with FSDP across them (executor/schedules/step_schedule.h with a Communicator: every
// unit all-gathered before it runs, its unsharded grads reduce-scattered into the rank's shard,
// the optimizer stepping the rank's shard), each rank running its own sequence, against the
// planner's timeline of one rank of the N-GPU plan (--gpus N --ep 1), every column of every phase
// as the one-rank component compares them (verify_step_full.cpp). Every rank compares its own
// measurement; the merge keeps, per row, the rank that measured the most (results[].rank).
// Exactness against the single-rank reference: every rank's naive step of its own sequence (no
// checkpointing, materialised loss), those grads exchanged with an all-to-allv (each rank gets
// every rank's values of its own slices: transport only) and summed here in rank order in fp32
// (rounded once to bf16 when the optimizer is offloaded: bf16 grad shards), then AdamW on the
// rank's slice: max_abs_dloss (each rank's loss against its naive step), max_abs_dgrad over the
// rank's grad shard, and a note with the largest updated-parameter difference over the ranks; all
// three 0 (bitwise) when the plan's loss is materialised. The reference is built first and the
// measured step hands its grads and params to the comparison while its buffers hold them
// (StepScheduleConfig::result_sink), so verify keeps only the reference's [P/N] grads and params.
// Plans with EP > 1 are not run here (verify_run.cpp runs the one-rank step on rank 0 with a note).
//   flatpeak verify p.json --component step        (p.json: --gpus 4 --ep 1; threads or mpirun -np 4)
#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "executor/memory/tracking_allocator.h"
#include "executor/schedules/step_schedule.h"
#include "verify_common.h"
#include "verify_ranks.h"

namespace flatpeak::cli {

namespace {

// Rank p's slice of each unit: [p·S, min((p+1)·S, U)), S = ceil(U / n) (FsdpShards' layout).
struct Slices {
  std::vector<int64_t> begin, length;
};
Slices slices_of(const std::vector<int64_t>& units, int n, int p) {
  Slices s;
  for (int64_t u : units) {
    const int64_t S = (u + n - 1) / n;
    s.begin.push_back(std::min(u, static_cast<int64_t>(p) * S));
    s.length.push_back(std::min(u, s.begin.back() + S) - s.begin.back());
  }
  return s;
}

// The reference's summed grads on this rank's slices, unit by unit (the order of its grad shards):
// every rank's naive grads [P] cut into the slices each rank holds and exchanged, then summed here
// in rank order. `naive_grads` is consumed (freed once sent).
std::vector<float> reference_grad_shard(exec::Communicator& comm, const std::vector<int64_t>& units, std::vector<float> naive_grads,
                                        bool bf16_shards) {
  const int n = comm.size();
  std::vector<int64_t> unit_offset(units.size(), 0);
  for (size_t u = 1; u < units.size(); ++u) unit_offset[u] = unit_offset[u - 1] + units[u - 1];
  std::vector<float> send;
  send.reserve(naive_grads.size());
  std::vector<int64_t> send_counts(static_cast<size_t>(n)), send_displs(static_cast<size_t>(n));
  for (int p = 0; p < n; ++p) {
    const Slices theirs = slices_of(units, n, p);
    send_displs[static_cast<size_t>(p)] = static_cast<int64_t>(send.size());
    for (size_t u = 0; u < units.size(); ++u) {
      const float* from = naive_grads.data() + unit_offset[u] + theirs.begin[u];
      send.insert(send.end(), from, from + theirs.length[u]);
    }
    send_counts[static_cast<size_t>(p)] = static_cast<int64_t>(send.size()) - send_displs[static_cast<size_t>(p)];
  }
  std::vector<float>().swap(naive_grads);
  const int64_t mine = send_counts[static_cast<size_t>(comm.rank())];
  std::vector<float> received(static_cast<size_t>(mine * n));  // [n][mine]: rank p's values of my slices
  std::vector<int64_t> recv_counts(static_cast<size_t>(n), mine), recv_displs(static_cast<size_t>(n));
  for (int p = 0; p < n; ++p) recv_displs[static_cast<size_t>(p)] = p * mine;
  comm.all_to_allv(send.data(), send_counts.data(), send_displs.data(), received.data(), recv_counts.data(), recv_displs.data(),
                   exec::DType::F32);
  std::vector<float>().swap(send);
  std::vector<float> sum(received.begin(), received.begin() + mine);
  for (int p = 1; p < n; ++p)
    for (int64_t i = 0; i < mine; ++i) sum[static_cast<size_t>(i)] += received[static_cast<size_t>(p * mine + i)];
  if (bf16_shards)
    for (float& g : sum) g = exec::to_f32(exec::f32_to_bf16(g));
  return sum;
}

// The largest of every rank's `value` (as int64 bit patterns: the communicator reduces integers
// and floats, not doubles).
double max_over_ranks(exec::Communicator& comm, double value) {
  int64_t bits = 0;
  std::memcpy(&bits, &value, sizeof bits);
  std::vector<int64_t> all(static_cast<size_t>(comm.size()));
  comm.all_gather(&bits, all.data(), 1, exec::DType::I64);
  double largest = 0.0;
  for (int64_t b : all) {
    double v = 0.0;
    std::memcpy(&v, &b, sizeof v);
    largest = std::max(largest, v);
  }
  return largest;
}

}  // namespace

void verify_step_ranks(const VerifyContext& ctx, VerifyReport& report) {
  const VerifyInputs& in = ctx.in;
  exec::Communicator& comm = *ctx.comm;
  const int n = comm.size();
  const StepSetup setup = step_setup(ctx, n);
  const exec::StepScheduleConfig& c = setup.config;

  // The reference first (each rank's naive step, the exchange, the rank-order sum, AdamW on the
  // rank's slices), so that the step hands its results straight to the comparison (result_sink)
  // while its buffers hold them: verify keeps only the reference's grads and params of the slices.
  const std::vector<int64_t> units = exec::step_unit_params(c.model);
  const Slices mine = slices_of(units, n, comm.rank());
  double naive_loss = 0.0;
  std::vector<float> ref_grads, ref_params;
  {
    exec::StepScheduleConfig naive = c;
    naive.naive = true;
    naive.data_seed = exec::step_data_seed(c, comm.rank());
    int64_t full = 0;
    for (int64_t u : units) full += u;
    std::vector<float> naive_grads(static_cast<size_t>(full));
    naive.result_sink = [&](exec::StepResultPart part, int64_t offset, const float* values, int64_t count) {
      if (part == exec::StepResultPart::Grads) std::copy(values, values + count, naive_grads.begin() + offset);
    };
    exec::TrackingAllocator naive_alloc({in.alignment_bytes, -1, -1});
    naive_loss = exec::run_step_schedule(naive_alloc, naive).loss;
    const bool bf16_shards = c.optimizer.placement != exec::OptimizerPlacement::Device;
    ref_grads = reference_grad_shard(comm, units, std::move(naive_grads), bf16_shards);
    ref_params = exec::step_reference_update(c, ref_grads, mine.begin, mine.length);
  }
  double dparam = 0.0;
  int64_t compared = 0;
  exec::StepScheduleConfig measured = c;
  measured.result_sink = [&](exec::StepResultPart part, int64_t offset, const float* values, int64_t count) {
    const std::vector<float>& want = part == exec::StepResultPart::Grads ? ref_grads : ref_params;
    double& worst = part == exec::StepResultPart::Grads ? report.max_abs_dgrad : dparam;
    if (offset + count > static_cast<int64_t>(want.size())) throw std::logic_error("verify step: results beyond the rank's shard");
    for (int64_t i = 0; i < count; ++i)
      worst = std::max(worst, static_cast<double>(std::fabs(values[i] - want[static_cast<size_t>(offset + i)])));
    compared += count;
  };
  exec::TrackingAllocator alloc({in.alignment_bytes, -1, -1});
  const exec::StepScheduleResult got = exec::run_step_schedule(comm, alloc, measured);
  if (compared != static_cast<int64_t>(ref_grads.size() + ref_params.size()))
    throw std::logic_error("verify step: compared " + std::to_string(compared) + " of the reference's grads and params");
  report.max_abs_dloss = std::max(report.max_abs_dloss, std::fabs(got.loss - naive_loss));
  compare_step_columns(setup.predicted, alloc, report);
  report.measured_trace = measured_trace(alloc);

  dparam = max_over_ranks(comm, dparam);
  if (comm.rank() == 0) {
    report.notes.push_back(fmt::format("step: {} ranks, FSDP at EP = 1 (every rank holds 1/{} of every unit, experts included, "
                                       "and runs its own sequence); {}",
                                       n, n, setup.note));
    report.notes.push_back(fmt::format("step: max |updated param - reference| over the ranks = {:.3g} (reference: every rank's "
                                       "naive step, grads summed in rank order, AdamW)",
                                       dparam));
    if (in.accumulation_steps > 1)
      report.notes.push_back(fmt::format("step: one micro-batch without gradient accumulation (the plan accumulates {})",
                                         in.accumulation_steps));
  }
}

}  // namespace flatpeak::cli
