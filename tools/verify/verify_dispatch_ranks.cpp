// verify --component dispatch on EP ranks: one MoE layer's recompute + backward across the ranks
// with executor/dispatch (uncapped EP for baseline and practice; LLEP or PipelinedLLEP for
// flatpeak, with the plan's knobs, cap and m scaled with T), routed by the plan's routing model,
// against the planner's dispatch column predicted on the realised routing (the EP × E count
// matrix the executor ran, an in-memory routing file), and, for PipelinedLLEP, against the bound
// the planner states for the plan's own routing model (row phase "bound": passes when measured ≤
// predicted). Run by verify_ranks.h on every rank; each rank's row is its own measurement.
//   VerifyReport r = run_component_on_ranks(verify_dispatch_ranks, in, scaled, nullptr, 4, nullptr);
#include <algorithm>
#include <cmath>
#include <memory>
#include <string>

#include <fmt/format.h>

#include "executor/dispatch/ep_dispatch.h"
#include "executor/memory/tensor.h"
#include "executor/memory/tracking_allocator.h"
#include "plan.h"
#include "run_spec.h"
#include "spec/errors.h"
#include "spec/hardware_loader.h"
#include "spec/model_loader.h"
#include "spec/routing.h"
#include "verify_common.h"
#include "verify_ranks.h"

namespace flatpeak::cli {

namespace {

using nlohmann::ordered_json;

// The plan's dispatch knobs as verify runs them, scaled with T (DESIGN.md "Verify").
struct DispatchKnobs {
  bool llep = false;
  int64_t chunk_cap_rows = 0;  // scaled C (0: no cap)
  int64_t min_rows = 0;        // scaled m
  double alpha = 1.1, lambda = 1.3;
  bool striping = true;
  std::string mode = "recompute";
  int64_t depth = 2;
};

const nlohmann::json* knob(const VerifyInputs& in, const char* name) {
  return in.knob_values.contains(name) ? &in.knob_values[name] : nullptr;
}

// The LLEP switch, C, m, mode and depth as scale_config checked and scaled them
// (scale_dispatch_knobs); α, λ and striping as the plan wrote them (InputError names the knob).
DispatchKnobs read_knobs(const VerifyInputs& in, const ScaledConfig& s) {
  DispatchKnobs k;
  k.llep = s.llep;
  k.chunk_cap_rows = s.llep ? s.chunk_cap_rows : 0;
  k.min_rows = s.llep_min_rows;
  k.mode = s.dispatch_store ? "store" : "recompute";
  k.depth = s.dispatch_depth;
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
  return k;
}

// Uniform in [-1, 1), a pure function of (rank, stream, index) (splitmix64): each rank makes only
// its own slice, so no rank holds the others' data.
float uniform(int64_t rank, uint64_t stream, int64_t index) {
  uint64_t v = static_cast<uint64_t>(rank + 1) * 0x9e3779b97f4a7c15ull + stream * 0xd1b54a32d192ed03ull + static_cast<uint64_t>(index);
  v = (v ^ (v >> 30)) * 0xbf58476d1ce4e5b9ull;
  v = (v ^ (v >> 27)) * 0x94d049bb133111ebull;
  v ^= v >> 31;
  return static_cast<float>(static_cast<double>(v >> 40) / static_cast<double>(1ull << 23) - 1.0);
}

void fill(exec::Tensor& t, int64_t rank, uint64_t stream, float scale) {
  float* p = static_cast<float*>(t.raw());
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = scale * uniform(rank, stream, i);
}

// The planner's plan of the scaled configuration on the EP ranks, routed by `routing`.
planner::Plan predict(const VerifyInputs& in, const ScaledConfig& s, const DispatchKnobs& k, const RoutingModel& routing) {
  ModelSpec model = load_model(in.model_name);
  const int64_t ffn = s.expert_ffn;
  model.hidden_size = s.hidden;
  model.vocab_size = s.vocab;
  model.num_layers = s.layers;
  model.layers.resize(static_cast<size_t>(s.layers));
  model.num_experts = s.num_experts;
  model.expert_ffn_width = ffn;
  const HardwareSpec hardware = load_hardware(in.hardware_name);
  std::vector<std::pair<std::string, std::string>> flags{
      {"--gpus", std::to_string(s.ranks)},          {"--ep", std::to_string(s.ep)},
      {"--context", std::to_string(s.tokens)},      {"--schedule", in.schedule},
      {"--gpus-per-node", std::to_string(s.ranks)}, {"--micro-batch", "1"}};
  if (in.schedule == "flatpeak") {
    flags.emplace_back("--llep", k.llep ? "on" : "off");
    if (k.llep) {
      flags.emplace_back("--chunk-cap-rows", std::to_string(k.chunk_cap_rows));
      flags.emplace_back("--llep-alpha", fmt::format("{}", k.alpha));
      flags.emplace_back("--llep-lambda", fmt::format("{}", k.lambda));
      flags.emplace_back("--llep-min-rows", std::to_string(std::max<int64_t>(1, k.min_rows)));
      if (k.chunk_cap_rows > 0) {
        flags.emplace_back("--striping", k.striping ? "on" : "off");
        flags.emplace_back("--dispatch-mode", k.mode);
        flags.emplace_back("--dispatch-depth", std::to_string(k.depth));
      }
    }
  }
  InputErrors errs;
  const planner::RunSpec spec = planner::parse_run_flags(flags, errs);
  errs.throw_if_any();
  planner::ResolvedRun run = planner::resolve_run(model, hardware, spec, errs);
  errs.throw_if_any();
  run.imbalance = routing;
  validate_routing_model(routing, RoutingShape{s.ep, s.num_experts, model.top_k}, 0);
  return planner::make_plan_resolved(model, hardware, run);
}

// The largest dispatch column over the MoE block's recompute + backward phases, and its phase.
std::pair<std::string, int64_t> backward_dispatch_peak(const ordered_json& timeline) {
  std::pair<std::string, int64_t> best{"", -1};
  for (const auto& phase : timeline["phases"]) {
    const std::string name = phase["name"].get<std::string>();
    if (name.rfind("bwd/", 0) != 0 || name.find("/moe/") == std::string::npos) continue;
    const int64_t bytes = phase["device"]["dispatch"].get<int64_t>();
    if (bytes > best.second) best = {name, bytes};
  }
  if (best.second < 0) throw std::logic_error("verify: the planner's timeline has no bwd/*/moe/* phase");
  return best;
}

}  // namespace

void verify_dispatch_ranks(const VerifyContext& ctx, VerifyReport& report) {
  const VerifyInputs& in = ctx.in;
  const ScaledConfig& s = ctx.scaled;
  exec::Communicator& comm = *ctx.comm;
  if (in.num_experts == 0) {
    if (comm.rank() == 0) report.notes.push_back("dispatch: a dense model has no expert dispatch; nothing to run");
    return;
  }
  if (s.ranks != s.ep) {
    // One EP group per N/EP replica would need a communicator per group (not built).
    if (comm.rank() == 0)
      report.notes.push_back(fmt::format("dispatch: N/EP = {} > 1 needs one communicator per EP group, not built yet; not run",
                                         s.ranks / s.ep));
    return;
  }
  const DispatchKnobs knobs = read_knobs(in, s);
  const RoutingModel plan_routing = parse_routing_model(in.imbalance);
  const ModelSpec model = load_model(in.model_name);
  exec::MoeDims dims{s.tokens, s.hidden, s.expert_ffn, s.num_experts, in.top_k};
  const RoutingShape shape{s.ep, s.num_experts, in.top_k};
  validate_routing_model(plan_routing, shape, 0);

  // The realised routing: every source rank's ids are a pure function of (model, seed, rank), so
  // each rank counts all of them, one rank's [T, k] ids at a time.
  constexpr uint64_t kSeed = 1;
  CountMatrix realised_counts;
  for (int64_t r = 0; r < s.ep; ++r)
    realised_counts.push_back(count_routing(generate_routing(plan_routing, shape, s.tokens, kSeed, r, r, 0), shape));
  auto realised_file = std::make_shared<RoutingFile>();
  realised_file->path = "(the routing verify ran)";
  realised_file->ep_ranks = s.ep;
  realised_file->num_experts = s.num_experts;
  realised_file->layers = {realised_counts};
  RoutingModel realised;
  realised.kind = RoutingKind::File;
  realised.file_path = realised_file->path;
  realised.file = realised_file;

  ordered_json predicted = planner::timeline_to_json(predict(in, s, knobs, realised).timeline);
  if (ctx.adjust) ctx.adjust(predicted);
  const auto [phase, predicted_bytes] = backward_dispatch_peak(predicted);

  exec::EpDispatchConfig config;
  config.schedule = !knobs.llep ? exec::EpSchedule::Uncapped
                    : knobs.chunk_cap_rows > 0 ? exec::EpSchedule::PipelinedLlep
                                               : exec::EpSchedule::Llep;
  config.lla.llep_alpha = knobs.alpha;
  config.lla.imbalance_trigger = knobs.lambda;
  config.lla.min_rows_per_gemm = knobs.min_rows;
  config.chunk_cap_rows = knobs.chunk_cap_rows;
  config.phase_prefix = phase.substr(0, phase.find("/moe/") + 4);  // "bwd/L3/moe"
  // This rank's tensors come from its allocator too (activations, params, grads; not dispatch),
  // so verify holds no untracked copy of the layer.
  const int rank = comm.rank();
  const int64_t T = dims.tokens, H = dims.hidden, F = dims.ffn, k = dims.top_k, L = dims.experts / s.ep;
  exec::TrackingAllocator alloc({in.alignment_bytes, -1, -1});
  using exec::Category;
  using exec::DType;
  alloc.set_phase("init");
  exec::Tensor x(alloc, DType::F32, {T, H}, Category::Activations);         // [T, H]
  exec::Tensor d_out(alloc, DType::F32, {T, H}, Category::Activations);     // [T, H]
  exec::Tensor ids(alloc, DType::I32, {T, k}, Category::Activations);       // [T, k]
  exec::Tensor weights(alloc, DType::F32, {T, k}, Category::Activations);   // [T, k]
  exec::Tensor w_gate_up(alloc, DType::F32, {L, 2 * F, H}, Category::Params);  // [L, 2F, H]
  exec::Tensor w_down(alloc, DType::F32, {L, H, F}, Category::Params);         // [L, H, F]
  exec::Tensor out(alloc, DType::F32, {T, H}, Category::Activations);       // [T, H]
  exec::Tensor d_x(alloc, DType::F32, {T, H}, Category::Activations);       // [T, H]
  exec::Tensor d_weights(alloc, DType::F32, {T, k}, Category::Activations); // [T, k]
  exec::Tensor d_w_gate_up(alloc, DType::F32, {L, 2 * F, H}, Category::Grads);
  exec::Tensor d_w_down(alloc, DType::F32, {L, H, F}, Category::Grads);
  fill(x, rank, 1, 1.0f);
  fill(d_out, rank, 2, 1.0f);
  fill(w_gate_up, rank, 4, 1.0f / std::sqrt(static_cast<float>(H)));
  fill(w_down, rank, 5, 1.0f / std::sqrt(static_cast<float>(F)));
  {
    const std::vector<int32_t> my_ids = generate_routing(plan_routing, shape, T, kSeed, rank, rank, 0);
    std::copy(my_ids.begin(), my_ids.end(), static_cast<int32_t*>(ids.raw()));
  }
  float* w = static_cast<float*>(weights.raw());
  for (int64_t t = 0; t < T; ++t) {  // positive router weights, each token's k summing to 1
    float sum = 0.0f;
    for (int64_t j = 0; j < k; ++j) sum += (w[t * k + j] = 0.55f + 0.45f * uniform(rank, 3, t * k + j));
    for (int64_t j = 0; j < k; ++j) w[t * k + j] /= sum;
  }
  std::fill_n(static_cast<float*>(d_w_gate_up.raw()), d_w_gate_up.numel(), 0.0f);
  std::fill_n(static_cast<float*>(d_w_down.raw()), d_w_down.numel(), 0.0f);
  exec::MoeRankTensors io{static_cast<const float*>(x.raw()),     static_cast<const int32_t*>(ids.raw()),
                          static_cast<const float*>(weights.raw()), static_cast<const float*>(d_out.raw()),
                          static_cast<const float*>(w_gate_up.raw()), static_cast<const float*>(w_down.raw()),
                          static_cast<float*>(out.raw()),          static_cast<float*>(d_x.raw()),
                          static_cast<float*>(d_weights.raw()),    static_cast<float*>(d_w_gate_up.raw()),
                          static_cast<float*>(d_w_down.raw())};
  const exec::EpDispatchStats stats = exec::moe_dispatch_backward(comm, alloc, dims, config, io);
  const int64_t measured = stats.dispatch_peak_bytes;
  report.rows.push_back({"dispatch", "device", phase, predicted_bytes, measured, relative_error(measured, predicted_bytes), rank});
  if (config.schedule == exec::EpSchedule::PipelinedLlep) {
    // The planner's statement for the plan as written: its routing model's expected loads.
    ordered_json stated = planner::timeline_to_json(predict(in, s, knobs, plan_routing).timeline);
    if (ctx.adjust) ctx.adjust(stated);
    const int64_t bound = backward_dispatch_peak(stated).second;
    report.rows.push_back({"dispatch", "device", "bound", bound, measured, relative_error(measured, bound), rank});
  }
  report.measured_trace = measured_trace(alloc);
  if (rank == 0) {
    const std::vector<int64_t> rows = received_rows_per_rank(realised_counts, shape);
    report.notes.push_back(fmt::format("dispatch: {} on {} ranks, routing {} realised rho = {:.3f} (seed {}), F = {} -> {}, C = {}, m = {}",
                                       exec::ep_schedule_name(config.schedule), s.ep, in.imbalance, imbalance_rho(rows), kSeed,
                                       model.expert_ffn_width, dims.ffn, knobs.chunk_cap_rows, knobs.min_rows));
  }
}

}  // namespace flatpeak::cli
