// verify --component optimizer: one AdamW step over the scaled rank's parameters, on the device,
// with serial offload or with OffloadStreamAdamW (knob `optimizer`), against the planner's opt/
// phases: device params, grads and optimizer columns, and the host optimizer column.
//   flatpeak verify plan.json --component optimizer
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "executor/memory/tracking_allocator.h"
#include "executor/schedules/optimizer_schedule.h"
#include "spec/errors.h"
#include "spec/model_loader.h"
#include "verify_common.h"

namespace flatpeak::cli {

namespace {

// MTP modules are trained when the plan trained them (/inputs/run/mtp) and the model has them.
bool trains_mtp(const VerifyInputs& in, const ModelSpec& model) { return in.mtp && model.mtp_layers > 0; }

// One row per predicted opt/ phase of `space`: the sum of `categories` (the optimizer component's
// own terms, as in the plan's peaks.optimizer.component_bytes) against the maximum of the
// measured phases the predicted one folds, then a "peak" row.
void compare_opt_phases(exec::MemorySpace space, const std::vector<exec::Category>& categories,
                        const nlohmann::ordered_json& predicted, const exec::TrackingAllocator& alloc, VerifyReport& report) {
  const std::string space_name = exec::memory_space_name(space);
  const auto records = alloc.phase_records();
  int64_t predicted_peak = 0, measured_peak = 0;
  for (const auto& phase : predicted["phases"]) {
    const std::string name = phase["name"].get<std::string>();
    if (name.rfind("opt/", 0) != 0 || !phase.contains(space_name)) continue;
    int64_t predicted_bytes = 0;
    for (exec::Category c : categories) predicted_bytes += phase[space_name][exec::category_name(c)].get<int64_t>();
    int64_t measured_bytes = 0;
    for (const auto& r : records) {
      if (r.space != space || !phase_matches(name, phase.contains("folds"), r.phase)) continue;
      int64_t bytes = 0;
      for (exec::Category c : categories) bytes += r.bytes_at_peak[static_cast<size_t>(c)];
      measured_bytes = std::max(measured_bytes, bytes);
    }
    report.rows.push_back({"optimizer", space_name, name, predicted_bytes, measured_bytes, relative_error(measured_bytes, predicted_bytes)});
    predicted_peak = std::max(predicted_peak, predicted_bytes);
    measured_peak = std::max(measured_peak, measured_bytes);
  }
  report.rows.push_back({"optimizer", space_name, "peak", predicted_peak, measured_peak, relative_error(measured_peak, predicted_peak)});
}

}  // namespace

void scale_optimizer_knobs(const VerifyInputs& in, ScaledConfig& s) {
  InputErrors errs;
  const nlohmann::json& knobs = in.knob_values;
  if (knobs.contains("optimizer")) {
    const nlohmann::json& v = knobs["optimizer"];
    if (v.is_string() && (v == "gpu" || v == "serial" || v == "stream"))
      s.optimizer = v.get<std::string>();
    else
      errs.add(Diagnostic{in.file, "/knobs/optimizer/value", "must be gpu, serial or stream (got " + v.dump() + ")", ""});
  }
  int64_t plan_bucket_params = 0;
  if (s.optimizer == "stream") {
    // hi = 0: no upper bound.
    auto integer = [&](const char* name, int64_t lo, int64_t hi, int64_t& out) {
      const std::string pointer = std::string("/knobs/") + name + "/value";
      if (!knobs.contains(name)) {
        errs.add(Diagnostic{in.file, pointer, "required field is missing", "the stream optimizer needs it"});
        return;
      }
      const nlohmann::json& v = knobs[name];
      if (!v.is_number_integer() || v.get<int64_t>() < lo || (hi > 0 && v.get<int64_t>() > hi)) {
        const std::string range = hi > 0 ? "in " + std::to_string(lo) + ".." + std::to_string(hi) : ">= " + std::to_string(lo);
        errs.add(Diagnostic{in.file, pointer, "must be an integer " + range + " (got " + v.dump() + ")", ""});
        return;
      }
      out = v.get<int64_t>();
    };
    integer("bucket_params", 1, 0, plan_bucket_params);
    integer("bucket_depth", 1, 8, s.bucket_depth);
  }
  errs.throw_if_any();
  if (s.optimizer != "stream") return;
  // Keep the number of buckets: the plan's rank holds rank_shard_params(N, EP) parameters, the
  // scaled one rank_shard_params of the scaled model on one rank.
  const ModelSpec plan_model = load_plan_model(in);
  const int64_t plan_params = exec::rank_shard_params(plan_model, in.gpus, in.ep, trains_mtp(in, plan_model));
  const ModelSpec model = scaled_model(in, s);
  const int64_t params = exec::rank_shard_params(model, 1, 1, trains_mtp(in, model));
  // ceil(P / bucket) without P + bucket - 1, which overflowed for a bucket near 2^63.
  const int64_t buckets = std::max<int64_t>(1, plan_params / plan_bucket_params + (plan_params % plan_bucket_params != 0 ? 1 : 0));
  // Each bucket is a phase of the run and of the prediction: a plan's 3.5e9 one-parameter buckets
  // ran for minutes at any scale. The default (64Mi parameters) makes tens of buckets; DeepSeek-V3
  // and Kimi-K2 at 8 GPUs make thousands (16384 take about 2 s here, 11 s in the step).
  constexpr int64_t kMaxVerifiedBuckets = 16384;
  if (buckets > kMaxVerifiedBuckets) {
    const int64_t smallest = plan_params / kMaxVerifiedBuckets + (plan_params % kMaxVerifiedBuckets != 0 ? 1 : 0);
    // Only the optimizer and the step run the buckets: the other components still run.
    s.optimizer_refusal.push_back(Diagnostic{in.file, "/knobs/bucket_params/value",
                                             fmt::format("makes {} buckets of the rank's {} parameters; verify keeps the bucket "
                                                         "count and runs at most {} (got {})",
                                                         buckets, plan_params, kMaxVerifiedBuckets, plan_bucket_params),
                                             fmt::format("plan again with --bucket-params {} or more", smallest)});
    return;
  }
  s.bucket_count = buckets;
  s.bucket_params = std::max<int64_t>(1, (params + buckets - 1) / buckets);
  s.values.push_back({"P (params per rank)", plan_params, params});
  s.values.push_back({"bucket_params", plan_bucket_params, s.bucket_params});
  s.values.push_back({"bucket_depth", s.bucket_depth, s.bucket_depth});
}

void verify_optimizer(const VerifyContext& ctx, VerifyReport& report) {
  const VerifyInputs& in = ctx.in;
  const ScaledConfig& s = ctx.scaled;
  if (!s.optimizer_refusal.empty()) throw UnsupportedPlan(s.optimizer_refusal);
  const ModelSpec model = scaled_model(in, s);
  const int64_t params = exec::rank_shard_params(model, 1, 1, trains_mtp(in, model));
  FlagList flags{{"--optimizer", s.optimizer}, {"--mtp", trains_mtp(in, model) ? "on" : "off"}};
  if (s.optimizer == "stream") {
    flags.emplace_back("--bucket-params", std::to_string(s.bucket_params));
    flags.emplace_back("--bucket-depth", std::to_string(s.bucket_depth));
  }
  const nlohmann::ordered_json predicted = predicted_timeline(ctx, flags);

  exec::TrackingAllocator alloc({in.alignment_bytes, -1, -1});
  exec::OptimizerScheduleConfig c;
  c.params = params;
  c.grad_units = exec::rank_shard_units(model, 1, 1, trains_mtp(in, model));  // one grad shard per unit
  c.placement = s.optimizer == "gpu"      ? exec::OptimizerPlacement::Device
                : s.optimizer == "serial" ? exec::OptimizerPlacement::Serial
                                          : exec::OptimizerPlacement::Stream;
  c.bucket_params = s.bucket_params;
  c.bucket_depth = s.bucket_depth;
  c.cpu_threads = 2;
  c.keep_results = false;  // exactness is the unit tests' job (bitwise against one full-vector step)
  exec::run_optimizer_schedule(alloc, c);

  compare_opt_phases(exec::MemorySpace::Device, {exec::Category::Params, exec::Category::Grads, exec::Category::Optimizer},
                     predicted, alloc, report);
  compare_opt_phases(exec::MemorySpace::Host, {exec::Category::Optimizer}, predicted, alloc, report);
  report.measured_trace = measured_trace(alloc);
}

}  // namespace flatpeak::cli
