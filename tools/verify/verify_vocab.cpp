// verify --component vocab: the vocabulary projection and loss (materialised, blocked, Ring-DTP at
// R = 1) against the planner's `vocab` column of the loss phases.
#include <algorithm>
#include <cmath>

#include "executor/memory/tracking_allocator.h"
#include "executor/schedules/vocab_schedule.h"
#include "spec/param_count.h"
#include "verify_common.h"

namespace flatpeak::cli {

bool main_loss_phase(const std::string& phase) { return phase.rfind("loss/fwd", 0) == 0 || phase.rfind("loss/bwd", 0) == 0; }

exec::VocabScheduleConfig vocab_schedule_config(const VerifyInputs& in, const ScaledConfig& s) {
  exec::VocabScheduleConfig c;
  c.tokens = s.tokens;
  c.hidden = s.hidden;
  c.vocab = s.vocab;
  c.token_block_rows = s.token_block;
  c.vocab_block_rows = s.vocab_block;
  c.mode = in.vocab_mode == "materialized" ? exec::VocabScheduleMode::Materialized : exec::VocabScheduleMode::Blocked;
  c.gradients_in_forward = in.vocab_backward == "in-forward";
  // W is read from the gathered LM head unit, as in a step and as the planner counts it: the final
  // norm before W, the head's bias after it. A tied head reads the embedding table as W, with the
  // head unit (the final norm, any bias) gathered beside it: one term in the planner, one buffer here.
  const ModelSpec model = scaled_model(in, s);
  const ParamCounts pc = count_params(model);
  c.head_unit_before_w = pc.final_norm;
  c.head_unit_after_w = model.tie_word_embeddings ? pc.lm_head : pc.lm_head - s.vocab * s.hidden;
  c.head_bias = model.lm_head_bias;
  return c;
}

void verify_vocab(const VerifyContext& ctx, VerifyReport& report) {
  const VerifyInputs& in = ctx.in;
  const ScaledConfig& s = ctx.scaled;
  const nlohmann::ordered_json predicted = predicted_timeline(ctx, {kWithoutMtp});
  exec::TrackingAllocator alloc({in.alignment_bytes, -1, -1});
  const exec::VocabScheduleConfig c = vocab_schedule_config(in, s);
  const exec::VocabScheduleResult got = exec::run_vocab_schedule(alloc, c);
  if (c.mode != exec::VocabScheduleMode::Materialized) {
    exec::TrackingAllocator naive_alloc({in.alignment_bytes, -1, -1});
    exec::VocabScheduleConfig n = c;
    n.mode = exec::VocabScheduleMode::Materialized;
    const exec::VocabScheduleResult ref = exec::run_vocab_schedule(naive_alloc, n);
    report.max_abs_dloss = std::max(report.max_abs_dloss, std::fabs(got.mean_loss - ref.mean_loss));
    for (size_t i = 0; i < got.d_x.size(); ++i)
      report.max_abs_dgrad = std::max(report.max_abs_dgrad, static_cast<double>(std::fabs(got.d_x[i] - ref.d_x[i])));
    for (size_t i = 0; i < got.d_w.size(); ++i)
      report.max_abs_dgrad = std::max(report.max_abs_dgrad, static_cast<double>(std::fabs(got.d_w[i] - ref.d_w[i])));
    for (size_t i = 0; i < got.d_bias.size(); ++i)
      report.max_abs_dgrad = std::max(report.max_abs_dgrad, static_cast<double>(std::fabs(got.d_bias[i] - ref.d_bias[i])));
  }
  // The main loss only: the MTP losses (loss/mtpJ/...) are not run by this component yet.
  compare_category("vocab", "vocab", exec::MemorySpace::Device, predicted, alloc, main_loss_phase, report);
  report.measured_trace = measured_trace(alloc);
}

}  // namespace flatpeak::cli
