// verify --component vocab on more than one rank: Ring-DTP across a ring of R ranks (every rank
// runs it with its own TrackingAllocator), each rank's measured vocab column against the planner's
// for the same configuration at R ranks. Without Ring-DTP, or with rings of one rank (R = 1 is the
// blocked loss), every rank runs the one-rank component. Exactness: the materialised schedule on
// the ring's R·T tokens (rank 0), each rank comparing its own dX and dW shard with its slice of it
// (every ring, all holding the same data) and rank 0 the mean loss.
//   run_component_on_ranks(verify_vocab_ring, in, scaled, nullptr, 4, nullptr);   // verify_ranks.h
#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

#include "executor/comm/communicator.h"
#include "executor/memory/tracking_allocator.h"
#include "executor/schedules/ring_dtp_schedule.h"
#include "executor/schedules/vocab_schedule.h"
#include "spec/errors.h"
#include "verify_common.h"

namespace flatpeak::cli {

namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

exec::RingRotation rotation_of(const VerifyInputs& in) {
  const auto knob = in.knob_values.find("ring_rotate");
  const std::string value = knob != in.knob_values.end() && knob->is_string() ? knob->get<std::string>() : "";
  if (value == "activations") return exec::RingRotation::Activations;
  if (value == "weights") return exec::RingRotation::Weights;
  throw InputError({Diagnostic{in.file, "/knobs/ring_rotate/value",
                               "must be activations or weights (got " + (knob != in.knob_values.end() ? knob->dump() : std::string("nothing")) + ")",
                               "re-create the plan with 'flatpeak plan --format json'"}});
}

// The reference's values of this rank's results: the materialised schedule on the ring's R·T
// tokens (every ring holds the same data, ring_dtp_schedule.h), run on rank 0 alone, cut into what
// each ring position holds (its tokens' dX rows [T, H], its shard's dW rows) and sent to every
// rank (all_to_allv straight out of the reference's results: transport only); rank 0 keeps the
// reference's mean loss. Rank 0's whole reference is freed before the ring runs.
struct ReferenceSlice {
  std::vector<float> d_x;  // [T, H]
  std::vector<float> d_w;  // [rows of this rank's shard, H]
  double mean_loss = 0.0;  // rank 0 only
};

ReferenceSlice reference_slice(exec::Communicator& comm, const VerifyInputs& in, const exec::RingDtpConfig& c) {
  const int64_t R = c.ring_size, T = c.tokens, H = c.hidden, shard = ceil_div(c.vocab, R);
  const int n = comm.size();
  auto rows_of = [&](int64_t position) { return std::max<int64_t>(0, std::min(shard, c.vocab - position * shard)); };
  ReferenceSlice mine;
  mine.d_x.resize(static_cast<size_t>(T * H));
  mine.d_w.resize(static_cast<size_t>(rows_of(comm.rank() % R) * H));
  exec::VocabScheduleResult ref;
  if (comm.rank() == 0) {
    exec::TrackingAllocator alloc({in.alignment_bytes, -1, -1});
    exec::VocabScheduleConfig naive;
    naive.tokens = R * T;
    naive.hidden = H;
    naive.vocab = c.vocab;
    naive.mode = exec::VocabScheduleMode::Materialized;
    naive.seed = c.seed;
    ref = exec::run_vocab_schedule(alloc, naive);
    mine.mean_loss = ref.mean_loss;
  }
  // Rank 0 sends rank p the rows of ring position p mod R; every rank receives from rank 0 only.
  auto scatter = [&](const std::vector<float>& whole, std::vector<float>& slice, auto first_row, auto rows) {
    std::vector<int64_t> send_counts(static_cast<size_t>(n), 0), send_displs(static_cast<size_t>(n), 0);
    std::vector<int64_t> recv_counts(static_cast<size_t>(n), 0), recv_displs(static_cast<size_t>(n), 0);
    if (comm.rank() == 0)
      for (int p = 0; p < n; ++p) {
        send_counts[static_cast<size_t>(p)] = rows(p % R) * H;
        send_displs[static_cast<size_t>(p)] = first_row(p % R) * H;
      }
    recv_counts[0] = static_cast<int64_t>(slice.size());
    comm.all_to_allv(whole.data(), send_counts.data(), send_displs.data(), slice.data(), recv_counts.data(), recv_displs.data(),
                     exec::DType::F32);
  };
  scatter(ref.d_x, mine.d_x, [&](int64_t position) { return position * T; }, [&](int64_t) { return T; });
  scatter(ref.d_w, mine.d_w, [&](int64_t position) { return position * shard; }, rows_of);
  return mine;
}

// The largest |dX|, |dW| difference of the ring against the reference, value by value as the ring
// hands its results over (RingDtpConfig::result_sink).
exec::RingDtpResultSink comparing_sink(const ReferenceSlice& want, VerifyReport& report) {
  return [&want, &report](exec::RingDtpResultPart part, int64_t offset, const float* values, int64_t count) {
    const std::vector<float>& ref = part == exec::RingDtpResultPart::Dx ? want.d_x : want.d_w;
    if (offset + count > static_cast<int64_t>(ref.size()))
      throw std::logic_error("verify vocab: ring results beyond the rank's slice");
    for (int64_t i = 0; i < count; ++i)
      report.max_abs_dgrad = std::max(report.max_abs_dgrad,
                                      static_cast<double>(std::fabs(values[i] - ref[static_cast<size_t>(offset + i)])));
  };
}

}  // namespace

RingVerifySetup ring_verify_setup(const VerifyContext& ctx, int64_t ranks) {
  const VerifyInputs& in = ctx.in;
  const ScaledConfig& s = ctx.scaled;
  // The ring keeps the plan's R when the scaled ranks hold whole rings, else the largest ring that
  // divides both.
  const int64_t R = std::gcd(in.ring_size, ranks);
  // Vocabulary blocks per shard are kept (scale_config keeps them per V, the shard of R = 1).
  const int64_t blocks_per_shard = ceil_div(ceil_div(in.vocab, in.ring_size), in.vocab_block);
  const int64_t vocab_block = std::max<int64_t>(1, ceil_div(ceil_div(s.vocab, R), blocks_per_shard));
  const exec::RingRotation rotation = rotation_of(in);
  const std::string rotation_name = rotation == exec::RingRotation::Weights ? "weights" : "activations";

  RingVerifySetup setup;
  setup.predicted = predicted_timeline(ctx, {kWithoutMtp,
                                             {"--gpus", std::to_string(ranks)},
                                             {"--gpus-per-node", std::to_string(ranks)},
                                             {"--ring-size", std::to_string(R)},
                                             {"--ring-rotate", rotation_name},
                                             {"--vocab-block", std::to_string(vocab_block)}});
  exec::RingDtpConfig& c = setup.config;
  c.tokens = s.tokens;
  c.hidden = s.hidden;
  c.vocab = s.vocab;
  c.ring_size = R;
  c.token_block_rows = s.token_block;
  c.vocab_block_rows = vocab_block;
  c.rotation = rotation;
  c.gradients_in_forward = in.vocab_backward == "in-forward";
  setup.note = "vocab: Ring-DTP on rings of R = " + std::to_string(R) + " of the " + std::to_string(ranks) + " ranks, rotating " +
               rotation_name + ", V_blk = " + std::to_string(vocab_block) + " (" + std::to_string(blocks_per_shard) +
               " per shard of ceil(V/R) = " + std::to_string(ceil_div(s.vocab, R)) + ")";
  return setup;
}

void verify_vocab_ring(const VerifyContext& ctx, VerifyReport& report) {
  if (ctx.comm == nullptr) throw std::logic_error("verify_vocab_ring runs on every rank of a communicator");
  exec::Communicator& comm = *ctx.comm;
  const VerifyInputs& in = ctx.in;
  if (in.vocab_mode != "ring-dtp" || std::gcd(in.ring_size, comm.size()) == 1) {
    // Materialised, blocked, or Ring-DTP on rings of one rank (which is the blocked loss, as the
    // planner predicts it; also when the scaled ranks hold no whole ring of the plan's, e.g. R = 2
    // on 3 ranks): the loss needs no other rank; each rank runs it on its own tokens.
    if (in.vocab_mode == "ring-dtp" && in.ring_size > 1 && comm.rank() == 0)
      report.notes.push_back("vocab: no ring of R = " + std::to_string(in.ring_size) + " within " + std::to_string(comm.size()) +
                             " ranks: each rank ran the blocked loss (R = 1); use --max-ranks with a multiple of R to run the ring");
    const VerifyContext one_rank{ctx.in, ctx.scaled, ctx.adjust, nullptr};
    const size_t first = report.rows.size();
    verify_vocab(one_rank, report);
    for (size_t i = first; i < report.rows.size(); ++i) report.rows[i].rank = comm.rank();
    return;
  }
  const RingVerifySetup setup = ring_verify_setup(ctx, comm.size());
  exec::TrackingAllocator alloc({in.alignment_bytes, -1, -1});
  exec::RingDtpConfig c = setup.config;
  // The reference first, so that the ring hands its dX and dW straight to the comparison while its
  // buffers hold them: a rank keeps only the reference's values of its own slice.
  const ReferenceSlice want = reference_slice(comm, in, c);
  c.result_sink = comparing_sink(want, report);
  const exec::RingDtpResult got = exec::run_ring_dtp_schedule(comm, alloc, c);
  if (comm.rank() == 0) report.max_abs_dloss = std::max(report.max_abs_dloss, std::fabs(got.mean_loss - want.mean_loss));

  const size_t first = report.rows.size();
  compare_category("vocab", "vocab", exec::MemorySpace::Device, setup.predicted, alloc,
                   [](const std::string& name) { return name.rfind("loss/fwd", 0) == 0 || name.rfind("loss/bwd", 0) == 0; },
                   report);
  for (size_t i = first; i < report.rows.size(); ++i) report.rows[i].rank = comm.rank();
  if (comm.rank() == 0) {
    report.notes.push_back(setup.note);
    report.measured_trace = measured_trace(alloc);
  }
}

}  // namespace flatpeak::cli
