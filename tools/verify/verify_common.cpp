// Shared pieces of the verify components (verify_common.h).
#include "verify_common.h"

#include <algorithm>
#include <cmath>

#include "plan.h"
#include "run_spec.h"
#include "spec/errors.h"
#include "spec/hardware_loader.h"
#include "spec/model_loader.h"

namespace flatpeak::cli {

using nlohmann::ordered_json;

ModelSpec scaled_model(const VerifyInputs& in, const ScaledConfig& s) {
  ModelSpec model = load_plan_model(in);
  model.hidden_size = s.hidden;
  model.vocab_size = s.vocab;
  model.num_layers = s.layers;
  model.layers.resize(static_cast<size_t>(s.layers));
  // The dims other components scale (scale_config): experts per rank, the expert FFN width, and
  // GQA heads; left as on the card where a component did not scale them (0).
  if (s.num_experts > 0) model.num_experts = s.num_experts;
  if (s.expert_ffn > 0) model.expert_ffn_width = s.expert_ffn;
  if (model.attention == AttentionKind::Gqa && s.q_heads > 0) {
    model.num_heads = s.q_heads;
    model.num_kv_heads = s.kv_heads;
    model.head_dim = s.head_dim;
    model.v_head_dim = s.head_dim;
  }
  if (model.attention == AttentionKind::Mla && s.q_heads > 0) {
    model.num_heads = model.num_kv_heads = s.q_heads;
    model.head_dim = s.head_dim;
    model.v_head_dim = s.v_head_dim;
    model.qk_rope_head_dim = s.rope_dim;
    model.qk_nope_head_dim = s.head_dim - s.rope_dim;
    model.q_lora_rank = s.q_lora;
    model.kv_lora_rank = s.kv_lora;
  }
  return model;
}

ordered_json predicted_timeline(const VerifyContext& ctx, const FlagList& extra) {
  return predicted_timeline_for(ctx, scaled_model(ctx.in, ctx.scaled), extra);
}

ordered_json predicted_timeline_for(const VerifyContext& ctx, const ModelSpec& model, const FlagList& extra,
                                    const RoutingModel* routing) {
  const VerifyInputs& in = ctx.in;
  const ScaledConfig& s = ctx.scaled;
  const HardwareSpec hardware = load_plan_hardware(in);
  FlagList flags{{"--gpus", "1"}, {"--context", std::to_string(s.tokens)}, {"--schedule", in.schedule}, {"--gpus-per-node", "1"}};
  // One rank: EP = 1, so there is nothing for LLEP to balance (its knobs need EP > 1).
  if (in.schedule == "flatpeak") flags.emplace_back("--llep", "off");
  if (in.vocab_mode == "materialized") {
    if (in.schedule != "baseline") flags.emplace_back("--ring-dtp", "off");
  } else {
    if (in.vocab_mode == "ring-dtp") flags.emplace_back("--ring-dtp", "on");
    flags.emplace_back("--token-block", std::to_string(s.token_block));
    flags.emplace_back("--vocab-block", std::to_string(s.vocab_block));
    flags.emplace_back("--vocab-backward", in.vocab_backward);
  }
  // A component's flag replaces the default set above.
  for (const auto& [flag, value] : extra) {
    auto same = std::find_if(flags.begin(), flags.end(), [&](const auto& f) { return f.first == flag; });
    if (same != flags.end()) same->second = value;
    else flags.emplace_back(flag, value);
  }
  InputErrors errs;
  const planner::RunSpec spec = planner::parse_run_flags(flags, errs);
  errs.throw_if_any();
  ordered_json timeline;
  if (routing != nullptr) {
    planner::ResolvedRun run = planner::resolve_run(model, hardware, spec, errs);
    errs.throw_if_any();
    run.imbalance = *routing;
    timeline = planner::timeline_to_json(planner::make_plan_resolved(model, hardware, run).timeline);
  } else {
    timeline = planner::timeline_to_json(planner::make_plan(model, hardware, spec).timeline);
  }
  if (ctx.adjust) ctx.adjust(timeline);
  return timeline;
}

bool phase_matches(const std::string& predicted, bool folded, const std::string& measured) {
  if (!folded) return measured == predicted;
  // The folded index is the last run of digits ("loss/fwd/blk0", "opt/bucket0", "fwd/L3/attn").
  size_t end = predicted.find_last_of("0123456789");
  if (end == std::string::npos) return measured == predicted;
  size_t begin = end;
  while (begin > 0 && std::isdigit(static_cast<unsigned char>(predicted[begin - 1]))) --begin;
  const std::string prefix = predicted.substr(0, begin), suffix = predicted.substr(end + 1);
  if (measured.size() <= prefix.size() + suffix.size()) return false;
  if (measured.compare(0, prefix.size(), prefix) != 0) return false;
  if (measured.compare(measured.size() - suffix.size(), suffix.size(), suffix) != 0) return false;
  const std::string index = measured.substr(prefix.size(), measured.size() - prefix.size() - suffix.size());
  return std::all_of(index.begin(), index.end(), [](char c) { return std::isdigit(static_cast<unsigned char>(c)) != 0; });
}

double relative_error(int64_t measured, int64_t predicted) {
  if (predicted == 0) return measured == 0 ? 0.0 : INFINITY;
  return static_cast<double>(measured - predicted) / static_cast<double>(predicted);
}

ordered_json measured_trace(const exec::TrackingAllocator& alloc) { return measured_trace(alloc.phase_records()); }

ordered_json measured_trace(const std::vector<exec::PhaseRecord>& records) {
  ordered_json phases = ordered_json::array();
  for (size_t i = 0; i < records.size(); i += exec::kMemorySpaceCount) {
    // Set-up before the first named phase (inputs being created) is not a phase of the grammar.
    if (records[i].phase == "init" || records[i].phase.empty()) continue;
    ordered_json p;
    p["name"] = records[i].phase;
    for (size_t s = i; s < std::min(records.size(), i + exec::kMemorySpaceCount); ++s) {
      ordered_json cols;
      const auto& r = records[s];
      if (r.space == exec::MemorySpace::Device) {
        for (int c = 0; c < exec::kCategoryCount; ++c)
          cols[exec::category_name(static_cast<exec::Category>(c))] = r.bytes_at_peak[static_cast<size_t>(c)];
      } else {
        cols["optimizer"] = r.bytes_at_peak[static_cast<size_t>(exec::Category::Optimizer)];
        cols["boundaries"] = r.bytes_at_peak[static_cast<size_t>(exec::Category::Boundaries)];
      }
      cols["total"] = r.peak_bytes;
      p[exec::memory_space_name(r.space)] = cols;
    }
    phases.push_back(p);
  }
  return ordered_json{{"format", "flatpeak-timeline"}, {"version", 1}, {"source", "measured"}, {"unit", "bytes"}, {"phases", phases}};
}

int compare_category(const std::string& component, const std::string& category, exec::MemorySpace space,
                     const ordered_json& predicted, const exec::TrackingAllocator& alloc,
                     const std::function<bool(const std::string& phase)>& phase_filter, VerifyReport& report) {
  return compare_category(component, category, space, predicted, alloc.phase_records(), phase_filter, report);
}

int compare_category(const std::string& component, const std::string& category, exec::MemorySpace space,
                     const ordered_json& predicted, const std::vector<exec::PhaseRecord>& records,
                     const std::function<bool(const std::string& phase)>& phase_filter, VerifyReport& report) {
  const std::string space_name = exec::memory_space_name(space);
  const auto measured_category = exec::category_from_name(category);
  const bool is_total = category == "total";
  if (!measured_category && !is_total) throw std::logic_error("verify: unknown category " + category);
  int64_t predicted_peak = 0, measured_peak = 0;
  int rows = 0;
  for (const auto& phase : predicted["phases"]) {
    const std::string name = phase["name"].get<std::string>();
    if (!phase_filter(name) || !phase.contains(space_name)) continue;
    const bool folded = phase.contains("folds");
    const int64_t predicted_bytes = phase[space_name][category].get<int64_t>();
    int64_t measured_bytes = 0;
    // The category's bytes when the phase's columns peaked (every category but workspace and comm,
    // which the planner leaves to the runtime overhead): the planner's columns split that peak. At the
    // peak of the whole total a kernel's scratch can tie with a later, larger activation and take
    // the moment (at --scale 256, a [2, d] fp32 register scratch beside the attention backward).
    for (const auto& r : records)
      if (r.space == space && phase_matches(name, folded, r.phase))
        measured_bytes = std::max(measured_bytes, is_total ? r.peak_bytes : r.bytes_at_column_peak[static_cast<size_t>(*measured_category)]);
    report.rows.push_back({component, space_name, name, predicted_bytes, measured_bytes, relative_error(measured_bytes, predicted_bytes)});
    predicted_peak = std::max(predicted_peak, predicted_bytes);
    measured_peak = std::max(measured_peak, measured_bytes);
    ++rows;
  }
  report.rows.push_back({component, space_name, "peak", predicted_peak, measured_peak, relative_error(measured_peak, predicted_peak)});
  return rows;
}

}  // namespace flatpeak::cli
