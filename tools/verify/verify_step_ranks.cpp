// verify --component step on N ranks (any EP dividing N): the whole training step of the scaled
// model on every rank with FSDP across them (executor/schedules/step_schedule.h with a
// Communicator: every unit all-gathered before it runs, its unsharded grads reduce-scattered into
// the rank's shard, the optimizer stepping the rank's shard; at EP > 1 each rank holds its E/EP
// experts, whole at EP = N, else sharded over the N/EP replicas that hold them, and every MoE
// layer's dispatch and combine cross the ranks of its EP group), each rank running its own
// sequence, against the planner's timeline of one rank of the N-GPU plan (--gpus N --ep EP; at EP
// > 1 on the routing its EP group realised: every layer's [EP][E] token copies, gathered after the
// run), every column of every phase as the one-rank component compares them
// (verify_step_full.cpp). Every rank compares its own measurement; the merge keeps, per row, the
// rank that measured the most (results[].rank).
// Exactness against the single-rank reference: every rank's naive step of its own sequence (no
// checkpointing, materialised loss, every expert), those grads exchanged chunk by chunk with
// all-to-allvs (each rank gets every rank's values of its own shard: transport only) and summed here in rank order in fp32
// (rounded once to bf16 when the optimizer is offloaded: bf16 grad shards), then AdamW on the
// rank's slice: max_abs_dloss (each rank's loss against its naive step), max_abs_dgrad over the
// rank's grad shard, and a note with the largest updated-parameter difference over the ranks; all
// three 0 (bitwise) when the plan's loss is materialised at EP = 1. At CP > 1 the layers'
// attention is a ring within CP groups of consecutive ranks, in the naive steps too. At EP > 1 the experts' weight
// grads sum every source's rows in one GEMM (one bf16 rounding, not one per rank), so they and
// the params they update differ within rounding; with MTP modules the LM head, reduced once per
// loss (its shard sums over the ranks loss by loss, the reference each rank's whole gradient),
// differs within fp32 rounding; everything else stays bitwise. The reference is built first and the
// measured step hands its grads and params to the comparison while its buffers hold them
// (StepScheduleConfig::result_sink), so verify keeps only the reference's [P/N] grads and params.
//   flatpeak verify p.json --component step        (p.json: --gpus 4 --ep 1; threads or mpirun -np 4)
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
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

// The reference's summed grads on this rank's shard, in shard order, built while the ranks' naive
// steps hand out their grads ([P] in order, through their result sinks): each chunk of [P] is cut
// into the pieces each rank holds (step_rank_pieces) and exchanged at once, and the values are
// summed here in rank order. Every rank's sink sees the same chunks in the same order (the same
// model), so the exchanges match; only one chunk is in flight, never a rank's whole [P].
class ReferenceGradShard {
 public:
  ReferenceGradShard(exec::Communicator& comm, const exec::StepScheduleConfig& c, bool bf16_shards)
      : comm_(comm), bf16_shards_(bf16_shards) {
    for (int p = 0; p < comm.size(); ++p) pieces_.push_back(exec::step_rank_pieces(c, comm.size(), p));
    int64_t mine = 0;
    for (const exec::ParamPiece& piece : pieces_[static_cast<size_t>(comm.rank())]) mine += piece.count;
    sum_.resize(static_cast<size_t>(mine));
  }

  // Elements [offset, offset + count) of this rank's naive grads (collective).
  void add(int64_t offset, const float* values, int64_t count) {
    constexpr int64_t kChunk = 1 << 16;
    for (int64_t at = 0; at < count; at += kChunk) exchange(offset + at, values + at, std::min(kChunk, count - at));
  }
  std::vector<float> take() { return std::move(sum_); }

 private:
  // f(shard position, reference begin, count) for rank p's elements within [begin, end), in p's shard order.
  template <class Fn>
  void for_each_held(int p, int64_t begin, int64_t end, Fn f) const {
    int64_t shard_at = 0;
    for (const exec::ParamPiece& piece : pieces_[static_cast<size_t>(p)]) {
      const int64_t lo = std::max(begin, piece.begin), hi = std::min(end, piece.begin + piece.count);
      if (hi > lo) f(shard_at + lo - piece.begin, lo, hi - lo);
      shard_at += piece.count;
    }
  }

  void exchange(int64_t begin, const float* values, int64_t count) {
    const int n = comm_.size(), me = comm_.rank();
    const int64_t end = begin + count;
    std::vector<float> send;
    send.reserve(static_cast<size_t>(count));
    std::vector<int64_t> send_counts(static_cast<size_t>(n)), send_displs(static_cast<size_t>(n));
    for (int p = 0; p < n; ++p) {
      send_displs[static_cast<size_t>(p)] = static_cast<int64_t>(send.size());
      for_each_held(p, begin, end, [&](int64_t, int64_t from, int64_t k) {
        send.insert(send.end(), values + (from - begin), values + (from - begin) + k);
      });
      send_counts[static_cast<size_t>(p)] = static_cast<int64_t>(send.size()) - send_displs[static_cast<size_t>(p)];
    }
    const int64_t mine = send_counts[static_cast<size_t>(me)];
    std::vector<float> received(static_cast<size_t>(mine * n));  // [n][mine]: rank p's values of my elements
    std::vector<int64_t> recv_counts(static_cast<size_t>(n), mine), recv_displs(static_cast<size_t>(n));
    for (int p = 0; p < n; ++p) recv_displs[static_cast<size_t>(p)] = p * mine;
    comm_.all_to_allv(send.data(), send_counts.data(), send_displs.data(), received.data(), recv_counts.data(), recv_displs.data(),
                      exec::DType::F32);
    int64_t i = 0;
    for_each_held(me, begin, end, [&](int64_t shard_at, int64_t, int64_t k) {
      for (int64_t j = 0; j < k; ++j, ++i) {
        float total = received[static_cast<size_t>(i)];
        for (int p = 1; p < n; ++p) total += received[static_cast<size_t>(p * mine + i)];
        sum_[static_cast<size_t>(shard_at + j)] = bf16_shards_ ? exec::to_f32(exec::f32_to_bf16(total)) : total;
      }
    });
  }

  exec::Communicator& comm_;
  bool bf16_shards_;
  std::vector<std::vector<exec::ParamPiece>> pieces_;  // every rank's
  std::vector<float> sum_;
};

// Every rank of the EP group's token copies per expert of every layer ([L][E] each): the realised
// routing the planner predicts the group's step on ([L][EP][E], one count matrix a MoE layer).
std::shared_ptr<RoutingFile> gathered_routing(exec::Communicator& comm, const std::vector<std::vector<int64_t>>& counts, int64_t experts,
                                              RoutingModel& model) {
  const int n = comm.size();
  std::vector<int64_t> mine;
  for (const auto& layer : counts) mine.insert(mine.end(), layer.begin(), layer.end());
  std::vector<int64_t> all(mine.size() * static_cast<size_t>(n));
  comm.all_gather(mine.data(), all.data(), static_cast<int64_t>(mine.size()), exec::DType::I64);
  const auto file = realised_routing({}, n, experts, model);
  file->layers.assign(counts.size(), CountMatrix(static_cast<size_t>(n), std::vector<int64_t>(static_cast<size_t>(experts))));
  for (int p = 0; p < n; ++p)
    for (size_t l = 0; l < counts.size(); ++l)
      for (int64_t e = 0; e < experts; ++e)
        file->layers[l][static_cast<size_t>(p)][static_cast<size_t>(e)] = all[static_cast<size_t>(p) * mine.size() + l * static_cast<size_t>(experts) + static_cast<size_t>(e)];
  return file;
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
  double naive_loss = 0.0;
  std::vector<double> naive_mtp_losses;  // per MTP module
  std::vector<float> ref_grads, ref_params;
  {
    exec::StepScheduleConfig naive = c;
    naive.naive = true;
    naive.ep = 1;  // every expert on the rank
    naive.data_seed = exec::step_data_seed(c, comm.rank());
    ReferenceGradShard shard(comm, c, c.optimizer.placement != exec::OptimizerPlacement::Device);
    naive.result_sink = [&](exec::StepResultPart part, int64_t offset, const float* values, int64_t count) {
      if (part == exec::StepResultPart::Grads) shard.add(offset, values, count);
    };
    // At CP > 1 the naive steps of a CP group run their attention as a ring of their own.
    const std::unique_ptr<exec::Communicator> ring =
        c.cp > 1 ? comm.split(comm.rank() / static_cast<int>(c.cp), comm.rank() % static_cast<int>(c.cp)) : nullptr;
    exec::TrackingAllocator naive_alloc({in.alignment_bytes, -1, -1});
    const exec::StepScheduleResult naive_run = exec::run_step_schedule(naive_alloc, naive, ring.get());
    naive_loss = naive_run.loss;
    naive_mtp_losses = naive_run.mtp_losses;
    ref_grads = shard.take();
    ref_params = exec::step_reference_update(c, ref_grads, exec::step_rank_pieces(c, n, comm.rank()));
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
  for (size_t j = 0; j < got.mtp_losses.size() && j < naive_mtp_losses.size(); ++j)
    report.max_abs_dloss = std::max(report.max_abs_dloss, std::fabs(got.mtp_losses[j] - naive_mtp_losses[j]));
  if (c.ep > 1) {  // the prediction on the routing the layers of this rank's EP group realised
    const int ep = static_cast<int>(c.ep);
    const std::unique_ptr<exec::Communicator> group = ep < n ? comm.split(comm.rank() / ep, comm.rank() % ep) : nullptr;
    RoutingModel realised;
    const auto file = gathered_routing(group ? *group : comm, got.expert_counts, c.model.num_experts, realised);
    compare_step_columns(step_setup(ctx, n, &realised).predicted, alloc, report);
  } else {
    compare_step_columns(setup.predicted, alloc, report);
  }
  report.measured_trace = measured_trace(alloc);

  dparam = max_over_ranks(comm, dparam);
  if (comm.rank() == 0) {
    if (c.ep > 1)
      report.notes.push_back(fmt::format("step: {} ranks, FSDP with EP = {} (every rank holds 1/{} of every dense weight and its {} "
                                         "experts, {}, and runs its own sequence; each MoE layer's dispatch crosses the ranks of "
                                         "its EP group); predicted on the routing each EP group realised in every layer; {}",
                                         n, c.ep, n, c.model.num_experts / c.ep,
                                         c.ep == n ? std::string("whole") : fmt::format("sharded over the {} ranks holding them", n / c.ep),
                                         setup.note));
    else
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
