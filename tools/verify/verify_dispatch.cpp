// verify --component dispatch on one rank: one MoE layer's forward, recompute and backward
// (executor/schedules/dispatch_schedule.h), uncapped for baseline and practice, in capped rounds for
// flatpeak's PipelinedLLEP (cap C and m scaled with T; at EP = 1 LLEP has nothing to balance, so
// what remains is the rounds), against the planner's `dispatch` column of every MoE phase. The
// planner predicts on the realised routing (the count matrix of the ids the executor drew, an
// in-memory routing file); the prediction on the plan's routing model alone is compared with it
// and the difference noted as the routing sampling error. The verify tests check the reductions.
// Also what the multi-rank run (verify_dispatch_ranks.cpp) shares: the prediction, the phase
// rows and the executor's configuration.
//   ScaledConfig s = scale_config(in, std::nullopt, /*max_ranks=*/1);   // one rank
//   VerifyReport r = run_verification(in, s, {"dispatch"}, 0.01);
#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <regex>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "executor/memory/tracking_allocator.h"
#include "executor/schedules/dispatch_schedule.h"
#include "plan.h"
#include "run_spec.h"
#include "spec/errors.h"
#include "spec/hardware_loader.h"
#include "spec/model_loader.h"
#include "spec/routing.h"
#include "verify_common.h"

namespace flatpeak::cli {

namespace {

using nlohmann::ordered_json;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The layer index of MoE phases ("fwd/L3/moe/experts" → "fwd/L*/moe/experts"), so the one layer
// the component runs stands for every MoE layer of the prediction (the same routing in each).
const std::regex kMoePhase(R"(^(fwd|bwd)/L[0-9]+/((recompute/)?moe/.*)$)");

std::string any_layer(const std::string& phase) {
  std::smatch m;
  return std::regex_match(phase, m, kMoePhase) ? m[1].str() + "/L*/" + m[2].str() : "";
}

const nlohmann::json* knob(const VerifyInputs& in, const char* name) {
  return in.knob_values.contains(name) ? &in.knob_values[name] : nullptr;
}

}  // namespace

DispatchKnobs dispatch_knobs(const VerifyInputs& in, const ScaledConfig& s) {
  DispatchKnobs k;
  InputErrors errs;
  auto number = [&](const char* name, double& out) {
    const nlohmann::json* v = knob(in, name);
    if (!v) return;
    if (!v->is_number() || !(v->get<double>() >= 0.0)) {
      errs.add(Diagnostic{in.file, std::string("/knobs/") + name + "/value", "must be a number >= 0 (got " + v->dump() + ")", ""});
      return;
    }
    out = v->get<double>();
  };
  number("llep_alpha", k.alpha);
  number("llep_lambda", k.lambda);
  if (const nlohmann::json* v = knob(in, "striping")) {
    if (!v->is_boolean()) errs.add(Diagnostic{in.file, "/knobs/striping/value", "must be true or false (got " + v->dump() + ")", ""});
    else k.striping = v->get<bool>();
  }
  errs.throw_if_any();
  if (s.ep == 1) {
    // One rank: LLEP's α and λ must lie in [1, EP] and [0, EP] = [1, 1] and [0, 1]; neither
    // changes anything when every expert is local. Plain LLEP (no cap) at one rank is plain EP.
    k.llep = in.schedule == "flatpeak" && s.llep && s.chunk_cap_rows > 0;
    k.alpha = 1.0;
    k.lambda = 0.0;
  } else {
    k.llep = s.llep;
  }
  k.chunk_cap_rows = k.llep ? s.chunk_cap_rows : 0;
  return k;
}

exec::DispatchScheduleConfig dispatch_config(const VerifyContext& ctx, const DispatchKnobs& k, int64_t layer,
                                             const RoutingModel& routing) {
  const VerifyInputs& in = ctx.in;
  const ScaledConfig& s = ctx.scaled;
  exec::DispatchScheduleConfig c;
  c.tokens = s.tokens;
  c.hidden = s.hidden;
  c.experts = s.num_experts;
  c.top_k = in.top_k;
  c.ffn = s.expert_ffn;
  c.expert_bias = load_plan_model(in).expert_bias;  // in each expert's P, as the planner's p_e counts them
  c.chunk_cap_rows = k.chunk_cap_rows;
  c.store = s.dispatch_store;
  c.depth = s.dispatch_depth;
  c.llep = s.ep > 1 && k.llep;
  c.lla.llep_alpha = k.alpha;
  c.lla.imbalance_trigger = k.lambda;
  c.lla.min_rows_per_gemm = std::max<int64_t>(1, s.llep_min_rows);
  c.striping = k.striping;
  c.layer = "L" + std::to_string(layer);
  c.routing = routing;
  return c;
}

int64_t routing_sampling_error(const VerifyContext& ctx, const DispatchKnobs& k, const RoutingModel& plan_routing,
                               const RoutingModel& realised, int64_t compared) {
  if (!ctx.adjust) return compared;
  // Under --perturb the compared predictions are scaled; the note is about the routing alone.
  const PredictionAdjust none;
  const VerifyContext plain{ctx.in, ctx.scaled, none, ctx.comm};
  return dispatch_peak(predict_dispatch(plain, k, plan_routing)) - dispatch_peak(predict_dispatch(plain, k, realised));
}

ordered_json predict_dispatch(const VerifyContext& ctx, const DispatchKnobs& k, const RoutingModel& routing) {
  const VerifyInputs& in = ctx.in;
  const ScaledConfig& s = ctx.scaled;
  ModelSpec model = load_plan_model(in);
  model.hidden_size = s.hidden;
  model.vocab_size = s.vocab;
  model.num_layers = s.layers;
  model.layers.resize(static_cast<size_t>(s.layers));
  model.num_experts = s.num_experts;
  model.expert_ffn_width = s.expert_ffn;
  // The dispatch schedule runs the routed experts alone: the shared experts (their activations,
  // and the d norm-2 accumulator their backward begins at EP > 1) are the layer's and the step's.
  model.num_shared_experts = 0;
  model.shared_expert_ffn_width = 0;
  model.shared_expert_gate = false;
  const HardwareSpec hardware = load_plan_hardware(in);
  FlagList flags{{"--gpus", std::to_string(s.ep)},          {"--context", std::to_string(s.tokens)},
                 {"--schedule", in.schedule},               {"--gpus-per-node", std::to_string(s.ep)}};
  if (s.ep > 1) {
    flags.emplace_back("--ep", std::to_string(s.ep));
    flags.emplace_back("--micro-batch", "1");
  }
  if (s.ep > 1 || in.schedule == "flatpeak") {
    flags.emplace_back("--llep", k.llep ? "on" : "off");
    if (k.llep) {
      flags.emplace_back("--llep-alpha", fmt::format("{}", k.alpha));
      flags.emplace_back("--llep-lambda", fmt::format("{}", k.lambda));
      flags.emplace_back("--llep-min-rows", std::to_string(std::max<int64_t>(1, s.llep_min_rows)));
      flags.emplace_back("--chunk-cap-rows", std::to_string(k.chunk_cap_rows));
      if (k.chunk_cap_rows > 0) {
        if (s.ep > 1) flags.emplace_back("--striping", k.striping ? "on" : "off");
        flags.emplace_back("--dispatch-mode", s.dispatch_store ? "store" : "recompute");
        flags.emplace_back("--dispatch-depth", std::to_string(s.dispatch_depth));
      }
    }
  }
  InputErrors errs;
  const planner::RunSpec spec = planner::parse_run_flags(flags, errs);
  errs.throw_if_any();
  planner::ResolvedRun run = planner::resolve_run(model, hardware, spec, errs);
  errs.throw_if_any();
  run.imbalance = routing;  // the in-memory routing (realised counts, or the plan's model)
  ordered_json timeline = planner::timeline_to_json(planner::make_plan_resolved(model, hardware, run).timeline);
  if (ctx.adjust) ctx.adjust(timeline);
  return timeline;
}

// The largest dispatch column over the MoE phases of a predicted timeline.
int64_t dispatch_peak(const ordered_json& timeline) {
  int64_t peak = 0;
  for (const auto& phase : timeline["phases"])
    if (!any_layer(phase["name"].get<std::string>()).empty()) peak = std::max(peak, phase["device"]["dispatch"].get<int64_t>());
  return peak;
}

std::pair<int64_t, int64_t> compare_dispatch(const ordered_json& predicted, const exec::TrackingAllocator& alloc, VerifyReport& report) {
  return compare_dispatch(predicted, alloc.phase_records(), report);
}

std::pair<int64_t, int64_t> compare_dispatch(const ordered_json& predicted, const std::vector<exec::PhaseRecord>& records,
                                             VerifyReport& report) {
  // One row per MoE phase of the prediction (the layer index folded: every MoE layer has the
  // same routing), against the largest measured phase it stands for.
  std::map<std::string, bool> seen;
  int64_t predicted_peak = 0, measured_peak = 0;
  for (const auto& phase : predicted["phases"]) {
    const std::string name = phase["name"].get<std::string>();
    const std::string key = any_layer(name);
    if (key.empty() || seen[key]) continue;
    seen[key] = true;
    const int64_t predicted_bytes = phase["device"]["dispatch"].get<int64_t>();
    int64_t measured_bytes = 0;
    for (const auto& r : records)
      if (r.space == exec::MemorySpace::Device && phase_matches(key, phase.contains("folds"), any_layer(r.phase)))
        measured_bytes = std::max(measured_bytes, r.bytes_at_peak[static_cast<size_t>(exec::Category::Dispatch)]);
    report.rows.push_back({"dispatch", "device", name, predicted_bytes, measured_bytes, relative_error(measured_bytes, predicted_bytes)});
    predicted_peak = std::max(predicted_peak, predicted_bytes);
    measured_peak = std::max(measured_peak, measured_bytes);
  }
  report.rows.push_back({"dispatch", "device", "peak", predicted_peak, measured_peak, relative_error(measured_peak, predicted_peak)});
  return {predicted_peak, measured_peak};
}

int64_t first_moe_layer(const VerifyInputs& in, const ScaledConfig& s) {
  const ModelSpec card = load_plan_model(in);
  for (int64_t l = 0; l < s.layers; ++l)
    if (card.layers[static_cast<size_t>(l)].ffn == FfnKind::Moe) return l;
  return -1;
}

std::shared_ptr<RoutingFile> realised_routing(const CountMatrix& counts, int64_t ep, int64_t experts, RoutingModel& model) {
  auto file = std::make_shared<RoutingFile>();
  file->path = "(the routing verify ran)";
  file->ep_ranks = ep;
  file->num_experts = experts;
  file->layers = {counts};
  model = RoutingModel{};
  model.kind = RoutingKind::File;
  model.file_path = file->path;
  model.file = file;
  return file;
}

void scale_dispatch_knobs(const VerifyInputs& in, ScaledConfig& s) {
  if (in.num_experts == 0) return;
  InputErrors errs;
  auto bad = [&](const char* name, const std::string& rule, const nlohmann::json& v) {
    errs.add(Diagnostic{in.file, std::string("/knobs/") + name + "/value", rule + " (got " + v.dump() + ")", ""});
  };
  // The planner's ranges (run_spec.cpp), checked here against the plan's own N, EP and T, so that
  // an edited knob is named by its plan pointer at any --max-ranks (a depth of 1e6 ran out of
  // memory, and 9 was reported as a --dispatch-depth flag of one rank).
  auto integer = [&](const char* name, int64_t min_value, int64_t max_value, int64_t& out) {
    const nlohmann::json* v = knob(in, name);
    if (!v) return;
    if (!v->is_number_integer() || v->get<int64_t>() < min_value || v->get<int64_t>() > max_value)
      return bad(name, fmt::format("must be an integer in {}..{}", min_value, max_value), *v);
    out = v->get<int64_t>();
  };
  auto number = [&](const char* name, double min_value, double max_value, const std::string& range) {
    const nlohmann::json* v = knob(in, name);
    if (v && (!v->is_number() || !(v->get<double>() >= min_value && v->get<double>() <= max_value))) bad(name, "must lie in " + range, *v);
  };
  if (const nlohmann::json* v = knob(in, "llep")) {
    if (!v->is_boolean()) bad("llep", "must be true or false", *v);
    else s.llep = v->get<bool>();
  }
  if (const nlohmann::json* v = knob(in, "dispatch_mode")) {
    if (!v->is_string() || (*v != "store" && *v != "recompute")) bad("dispatch_mode", "must be \"store\" or \"recompute\"", *v);
    else s.dispatch_store = *v == "store";
  }
  int64_t cap = 0, m = 0;
  const int64_t rows = in.tokens_per_gpu * std::max<int64_t>(1, in.top_k);  // both bounded by the plan reader
  integer("chunk_cap_rows", 0, rows, cap);
  integer("llep_min_rows", 1, planner::kMaxTokensPerGpu, m);
  integer("dispatch_depth", 1, 4, s.dispatch_depth);
  const double ep = static_cast<double>(in.ep);
  number("llep_alpha", 1.0, ep, fmt::format("[1, EP = {}]", in.ep));
  number("llep_lambda", 0.0, ep, fmt::format("[0, EP = {}]", in.ep));
  errs.throw_if_any();
  // The expert's shape scales with H; C and m with T (the same number of rounds, the same share
  // of a rank's rows per GEMM).
  const int64_t T = in.tokens_per_gpu;
  s.expert_ffn = std::max<int64_t>(1, ceil_div(in.expert_ffn_width * s.hidden, in.hidden));
  if (cap > 0) s.chunk_cap_rows = std::min(std::max<int64_t>(1, ceil_div(cap * s.tokens, T)), s.tokens * in.top_k);
  if (m > 0) s.llep_min_rows = std::max<int64_t>(1, ceil_div(m * s.tokens, T));
  s.values.push_back({"F (expert FFN width)", in.expert_ffn_width, s.expert_ffn});
  if (s.llep && cap > 0) {
    s.values.push_back({"C (chunk_cap_rows)", cap, s.chunk_cap_rows});
    s.values.push_back({"m (llep_min_rows)", m, s.llep_min_rows});
  }
}

void verify_dispatch(const VerifyContext& ctx, VerifyReport& report) {
  const VerifyInputs& in = ctx.in;
  const ScaledConfig& s = ctx.scaled;
  if (in.num_experts == 0) {
    report.notes.push_back("dispatch: a dense model has no expert dispatch; nothing to run");
    return;
  }
  // The first MoE layer of the scaled model names the phases (DeepSeek-V3's first layers are dense).
  const int64_t layer = first_moe_layer(in, s);
  if (layer < 0) {
    report.notes.push_back(fmt::format("dispatch: the first {} layers of {} are dense; no MoE layer to run", s.layers, in.model_name));
    return;
  }
  // The plan's routing model at one rank; rank-level models (rho, hot-rank) have no meaning there.
  const RoutingShape shape{1, s.num_experts, in.top_k};
  RoutingModel plan_routing = parse_routing_model(in.imbalance);
  try {
    validate_routing_model(plan_routing, shape, 0);
  } catch (const InputError&) {
    report.notes.push_back("dispatch: routing " + in.imbalance + " has no meaning on one rank; ran balanced");
    plan_routing = RoutingModel{};
  }

  const DispatchKnobs knobs = dispatch_knobs(in, s);
  const exec::DispatchScheduleConfig c = dispatch_config(ctx, knobs, layer, plan_routing);
  exec::TrackingAllocator alloc({in.alignment_bytes, -1, -1});
  const exec::DispatchScheduleResult got = exec::run_dispatch_schedule(alloc, c);

  // Routing is data: the planner predicts on the count matrix the executor drew.
  RoutingModel realised;
  const auto file = realised_routing(got.source_counts, 1, s.num_experts, realised);
  const int64_t predicted_peak = compare_dispatch(predict_dispatch(ctx, knobs, realised), alloc, report).first;

  // The distribution-only prediction (the plan's routing model's expected loads).
  const int64_t expected_peak = dispatch_peak(predict_dispatch(ctx, knobs, plan_routing));
  report.notes.push_back(fmt::format("dispatch: routing sampling error (prediction on {} minus on the realised counts) {:+} B at the peak",
                                     to_string(plan_routing), routing_sampling_error(ctx, knobs, plan_routing, realised,
                                                                                     expected_peak - predicted_peak)));
  if (c.chunk_cap_rows > 0) {
    // The technique against the naive schedule (one uncapped dispatch) on the same data.
    exec::DispatchScheduleConfig naive = c;
    naive.chunk_cap_rows = 0;
    exec::TrackingAllocator naive_alloc({in.alignment_bytes, -1, -1});
    const exec::DispatchScheduleResult ref = exec::run_dispatch_schedule(naive_alloc, naive);
    auto diff = [&](const std::vector<float>& a, const std::vector<float>& b) {
      for (size_t i = 0; i < a.size(); ++i) report.max_abs_dgrad = std::max(report.max_abs_dgrad, static_cast<double>(std::fabs(a[i] - b[i])));
    };
    diff(got.d_x, ref.d_x);
    diff(got.d_w_router, ref.d_w_router);
    diff(got.d_w_gate_up, ref.d_w_gate_up);
    diff(got.d_w_down, ref.d_w_down);
    diff(got.d_b_expert, ref.d_b_expert);
    double max_dout = 0.0;
    for (size_t i = 0; i < got.out.size(); ++i) max_dout = std::max(max_dout, static_cast<double>(std::fabs(got.out[i] - ref.out[i])));
    report.notes.push_back(fmt::format("dispatch: {} rounds of C = {} ({}); max |d output| against one uncapped dispatch {:g}",
                                       got.rounds, got.chunk_cap_rows, c.store ? "store" : "recompute", max_dout));
  }
  report.measured_trace = measured_trace(alloc);
}

}  // namespace flatpeak::cli
