// verify --component vocab on more than one rank: Ring-DTP across a ring of R ranks (every rank
// runs it with its own TrackingAllocator), each rank's measured vocab column against the planner's
// for the same configuration at R ranks. Without Ring-DTP, or with rings of one rank (R = 1 is the
// blocked loss), every rank runs the one-rank component.
//   run_component_on_ranks(verify_vocab_ring, in, scaled, nullptr, 4, nullptr);   // verify_ranks.h
#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>
#include <string>

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

// The largest |loss|, |dX|, |dW| difference of the ring against the materialised schedule on the
// ring's R·T tokens (the same global data: ring_dtp_schedule.h), computed on the ring's first rank
// from every rank's results.
void compare_with_materialised(exec::Communicator& comm, const VerifyInputs& in, const exec::RingDtpConfig& c,
                               const exec::RingDtpResult& got, VerifyReport& report) {
  const int64_t R = c.ring_size, T = c.tokens, H = c.hidden, shard = ceil_div(c.vocab, R);
  const int64_t n = comm.size();
  std::vector<float> d_x(static_cast<size_t>(n * T * H)), d_w(static_cast<size_t>(n * shard * H), 0.0f);
  std::vector<float> mine_w(static_cast<size_t>(shard * H), 0.0f);
  std::copy(got.d_w.begin(), got.d_w.end(), mine_w.begin());
  comm.all_gather(got.d_x.data(), d_x.data(), T * H, exec::DType::F32);
  comm.all_gather(mine_w.data(), d_w.data(), shard * H, exec::DType::F32);
  if (comm.rank() != 0) return;  // ring 0's ranks are 0..R-1
  exec::TrackingAllocator alloc({in.alignment_bytes, -1, -1});
  exec::VocabScheduleConfig naive;
  naive.tokens = R * T;
  naive.hidden = H;
  naive.vocab = c.vocab;
  naive.mode = exec::VocabScheduleMode::Materialized;
  naive.seed = c.seed;
  const exec::VocabScheduleResult ref = exec::run_vocab_schedule(alloc, naive);
  report.max_abs_dloss = std::max(report.max_abs_dloss, std::fabs(got.mean_loss - ref.mean_loss));
  for (int64_t i = 0; i < R * T * H; ++i)
    report.max_abs_dgrad = std::max(report.max_abs_dgrad,
                                    static_cast<double>(std::fabs(d_x[static_cast<size_t>(i)] - ref.d_x[static_cast<size_t>(i)])));
  for (int64_t v = 0; v < c.vocab; ++v)
    for (int64_t h = 0; h < H; ++h) {
      const float ring = d_w[static_cast<size_t>((v / shard) * shard * H + (v % shard) * H + h)];
      report.max_abs_dgrad =
          std::max(report.max_abs_dgrad, static_cast<double>(std::fabs(ring - ref.d_w[static_cast<size_t>(v * H + h)])));
    }
}

}  // namespace

void verify_vocab_ring(const VerifyContext& ctx, VerifyReport& report) {
  if (ctx.comm == nullptr) throw std::logic_error("verify_vocab_ring runs on every rank of a communicator");
  exec::Communicator& comm = *ctx.comm;
  const VerifyInputs& in = ctx.in;
  const ScaledConfig& s = ctx.scaled;
  if (in.vocab_mode != "ring-dtp" || in.ring_size == 1) {
    // Materialised, blocked, or Ring-DTP on rings of one rank (which is the blocked loss): the
    // loss needs no other rank; each rank runs it on its own tokens.
    const VerifyContext one_rank{ctx.in, ctx.scaled, ctx.adjust, nullptr};
    const size_t first = report.rows.size();
    verify_vocab(one_rank, report);
    for (size_t i = first; i < report.rows.size(); ++i) report.rows[i].rank = comm.rank();
    return;
  }
  const int64_t ranks = comm.size();
  // The ring keeps the plan's R when the scaled ranks hold whole rings, else the largest ring that
  // divides both.
  const int64_t R = std::gcd(in.ring_size, ranks);
  // Vocabulary blocks per shard are kept (scale_config keeps them per V, the shard of R = 1).
  const int64_t blocks_per_shard = ceil_div(ceil_div(in.vocab, in.ring_size), in.vocab_block);
  const int64_t vocab_block = std::max<int64_t>(1, ceil_div(ceil_div(s.vocab, R), blocks_per_shard));
  const exec::RingRotation rotation = rotation_of(in);
  const std::string rotation_name = rotation == exec::RingRotation::Weights ? "weights" : "activations";

  const nlohmann::ordered_json predicted =
      predicted_timeline(ctx, {{"--gpus", std::to_string(ranks)},
                               {"--gpus-per-node", std::to_string(ranks)},
                               {"--ring-size", std::to_string(R)},
                               {"--ring-rotate", rotation_name},
                               {"--vocab-block", std::to_string(vocab_block)}});
  exec::TrackingAllocator alloc({in.alignment_bytes, -1, -1});
  exec::RingDtpConfig c;
  c.tokens = s.tokens;
  c.hidden = s.hidden;
  c.vocab = s.vocab;
  c.ring_size = R;
  c.token_block_rows = s.token_block;
  c.vocab_block_rows = vocab_block;
  c.rotation = rotation;
  c.gradients_in_forward = in.vocab_backward == "in-forward";
  const exec::RingDtpResult got = exec::run_ring_dtp_schedule(comm, alloc, c);
  compare_with_materialised(comm, in, c, got, report);

  const size_t first = report.rows.size();
  compare_category("vocab", "vocab", exec::MemorySpace::Device, predicted, alloc,
                   [](const std::string& name) { return name.rfind("loss/fwd", 0) == 0 || name.rfind("loss/bwd", 0) == 0; },
                   report);
  for (size_t i = first; i < report.rows.size(); ++i) report.rows[i].rank = comm.rank();
  if (comm.rank() == 0) {
    report.notes.push_back("vocab: Ring-DTP on rings of R = " + std::to_string(R) + " of the " + std::to_string(ranks) +
                           " ranks, rotating " + rotation_name + ", V_blk = " + std::to_string(vocab_block) + " (" +
                           std::to_string(blocks_per_shard) + " per shard of ceil(V/R) = " + std::to_string(ceil_div(s.vocab, R)) + ")");
    report.measured_trace = measured_trace(alloc);
  }
}

}  // namespace flatpeak::cli
