// verify --component layer: one decoder layer (GQA attention + MoE: no-grad forward, recompute and
// backward) on one rank, against the planner's `activations` and `dispatch` device columns of
// every decoder-layer phase; at CP > 1 on a ring of CP' ranks (layer_ring_size; ring attention,
// or a window's halo, each rank T tokens of one sequence), every rank against the
// planner's prediction at CP = CP', once for each attention kind the layers hold. The whole step
// (--component step): verify_step_full.cpp.
// Scaling: H shrinks by f = H / H_scaled; the kv heads by the same factor (at least one), the
// query heads keep their number per kv head, and the head dim is chosen so that a·d shrinks by f
// too (rounded up); the expert FFN width F scales with H (scale_dispatch_knobs); the local
// experts E/EP and k are kept.
//   flatpeak plan --model Qwen3-30B-A3B --gpu H200 --gpus 8 --context 64K --format json > p.json
//   flatpeak verify p.json --component layer        # rows layer.activations, layer.dispatch
#include <algorithm>
#include <cmath>
#include <functional>
#include <stdexcept>

#include "executor/comm/communicator.h"
#include "executor/memory/tracking_allocator.h"
#include "executor/schedules/layer_schedule.h"
#include "spec/errors.h"
#include "spec/model_loader.h"
#include "verify_common.h"
#include "verify_ranks.h"

namespace flatpeak::cli {

namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// A width scaled with H (rounded up; 0 stays 0).
int64_t scaled_with_h(const VerifyInputs& in, const ScaledConfig& s, int64_t width) {
  return width > 0 ? std::max<int64_t>(1, ceil_div(width * s.hidden, in.hidden)) : 0;
}

// A layer's attention window: its kind and tokens (full causal: {Full, 0}). The planner groups
// layers by it at CP > 1, and the executor runs it as the layer config's window or chunk.
struct LayerWindow {
  AttentionWindow kind = AttentionWindow::Full;
  int64_t tokens = 0;
  bool operator==(const LayerWindow& o) const { return kind == o.kind && tokens == o.tokens; }
  void apply_to(exec::LayerScheduleConfig& c) const {
    c.attention_window = kind == AttentionWindow::Sliding ? tokens : 0;
    c.attention_chunk = kind == AttentionWindow::Chunked ? tokens : 0;
  }
};
LayerWindow window_of(const ModelSpec& card, int64_t layer) {
  if (layer >= static_cast<int64_t>(card.layers.size())) return {};
  const LayerSpec& spec = card.layers[static_cast<size_t>(layer)];
  if (spec.window == AttentionWindow::Full || spec.attention_window_tokens <= 0) return {};
  return {spec.window, spec.attention_window_tokens};
}

// How a window reaches across `cp` ranks of T tokens, in words.
std::string reach_text(const CpKeyReach& reach) {
  if (reach.ring) return "the ring masked to the window";
  if (reach.halo_rows == 0) return "no keys from another rank";
  return "a halo of the previous rank's last " + std::to_string(reach.halo_rows) + " keys";
}

// How the layer component runs a window on a ring of `ring` ranks of the scaled T tokens, for its
// note; and, when the plan's own T and CP reach differently (the window is not scaled), that too.
std::string attention_text(const LayerWindow& w, const VerifyInputs& in, int64_t T, int64_t ring) {
  if (w.kind == AttentionWindow::Full) return "ring attention,";
  const CpKeyReach here = cp_key_reach(w.kind, w.tokens, T, ring);
  const CpKeyReach plan = cp_key_reach(w.kind, w.tokens, in.tokens_per_gpu, in.cp);
  std::string text = std::string(w.kind == AttentionWindow::Sliding ? "a sliding window of " : "chunks of ") + std::to_string(w.tokens) +
                     " tokens, " + reach_text(here);
  if (plan.ring != here.ring || plan.halo_rows != here.halo_rows)
    text += " (at the plan's T = " + std::to_string(in.tokens_per_gpu) + " and CP = " + std::to_string(in.cp) + ": " + reach_text(plan) +
            ", not run here)";
  return text + ",";
}

// The MoE layer's phases; dense-FFN layers' FFN phases (fwd/Ll/ffn, ...) are not run.
bool is_layer_phase(const std::string& name) {
  return (name.rfind("fwd/L", 0) == 0 || name.rfind("bwd/L", 0) == 0) && name.find("/ffn") == std::string::npos;
}

// The executor runs one layer, the first MoE one. The attention phases of a dense layer before it
// (its FFN phases are not compared) hold what that layer's attention holds, so an unfolded one
// (a single dense layer: ERNIE 4.5's layer 0) is compared with the run layer's attention phases,
// as a folded group of dense layers is (phase_matches); marked so here. Returns how many.
int match_dense_attention_to_the_run_layer(nlohmann::ordered_json& predicted, const ModelSpec& model,
                                           int64_t run_layer) {
  int marked = 0;
  for (auto& phase : predicted["phases"]) {
    const std::string name = phase["name"].get<std::string>();
    if (phase.contains("folds") || !is_layer_phase(name) || name.size() < 5 ||
        name.compare(name.size() - 5, 5, "/attn") != 0)
      continue;
    const size_t at = name.find("/L") + 2;
    const size_t end = name.find('/', at);
    const int64_t layer = std::stoll(name.substr(at, end - at));
    if (layer == run_layer || layer >= static_cast<int64_t>(model.layers.size()) ||
        model.layers[static_cast<size_t>(layer)].ffn != FfnKind::Dense)
      continue;
    phase["folds"] = "L" + std::to_string(layer);
    ++marked;
  }
  return marked;
}

}  // namespace

// The layer component runs what the executor has: GQA attention over one sequence, full causal or
// windowed (at CP > 1 the ring, or a window's halo), a routed MoE block (with shared experts where
// the card has them). Anything else is refused before anything runs.
void check_layer_supported(const VerifyInputs& in, const ScaledConfig& s, const std::string& component) {
  InputErrors errs;
  layer_support_errors(in, s, component, errs);
  if (!errs.empty()) throw UnsupportedPlan(errs.diagnostics());
}

void layer_support_errors(const VerifyInputs& in, const ScaledConfig& s, const std::string& component, InputErrors& errs,
                          bool routes_over_every_expert) {
  const std::string the = "the " + component + " component";
  if (in.num_experts <= 0 || in.top_k <= 0)
    errs.add(Diagnostic{in.file, "/inputs/model/num_experts", the + " runs a MoE layer (got a dense model)", ""});
  const int64_t local_experts = s.num_experts / std::max<int64_t>(1, s.ep);
  if (in.num_experts > 0 && routes_over_every_expert && in.top_k > s.num_experts)
    errs.add(Diagnostic{in.file, "/inputs/model/top_k",
                        the + " routes each token to top_k = " + std::to_string(in.top_k) + " of the scaled model's " +
                            std::to_string(s.num_experts) + " experts (got EP = " + std::to_string(in.ep) + ")",
                        "plan with fewer GPUs or a smaller --ep"});
  if (in.num_experts > 0 && !routes_over_every_expert && in.top_k > local_experts)
    errs.add(Diagnostic{in.file, "/inputs/run/ep",
                        the + " runs one rank's E/EP = " + std::to_string(local_experts) + " experts, fewer than top_k = " +
                            std::to_string(in.top_k) + " (got EP = " + std::to_string(in.ep) + ")",
                        "plan with fewer GPUs or a smaller --ep"});
  if (s.q_heads <= 0)
    errs.add(Diagnostic{in.file, "/inputs/model/num_heads", the + " needs num_heads, num_kv_heads and head_dim", ""});
}

ModelSpec layer_model(const VerifyContext& ctx) {
  const VerifyInputs& in = ctx.in;
  const ScaledConfig& s = ctx.scaled;
  ModelSpec model = scaled_model(in, s);  // H, V, L, the GQA heads and the expert FFN width
  model.num_experts = s.num_experts / std::max<int64_t>(1, s.ep);  // this rank's E/EP
  model.shared_expert_ffn_width = scaled_with_h(in, s, in.shared_expert_ffn);
  model.dense_ffn_width = scaled_with_h(in, s, model.dense_ffn_width);
  return model;
}

namespace {

// MLA: a = g heads shrunk with H (at least 2), d and dv so that a·d and a·dv shrink with H, d split
// into nope and rope in the card's ratio (each at least 1), and the latents shrunk with H (at
// least 1; no q latent stays none).
void scale_mla_dims(const VerifyInputs& in, double f, ScaledConfig& s) {
  const ModelSpec card = load_plan_model(in);
  const auto per_head = [&](int64_t width, int64_t heads) {
    return std::max<int64_t>(1, static_cast<int64_t>(std::ceil(static_cast<double>(width) / f / static_cast<double>(heads) - 1e-9)));
  };
  // At least two heads where the card has them: the per-head k_nope and v projections and the
  // k_rope every head shares then run as they do at scale.
  s.q_heads = s.kv_heads = std::max<int64_t>(std::min<int64_t>(2, in.num_heads),
                                             static_cast<int64_t>(std::floor(static_cast<double>(in.num_heads) / f)));
  s.head_dim = std::max<int64_t>(2, per_head(in.num_heads * in.head_dim, s.q_heads));
  const double rope_share = static_cast<double>(card.qk_rope_head_dim) / static_cast<double>(card.head_dim);
  s.rope_dim = std::clamp<int64_t>(std::llround(rope_share * static_cast<double>(s.head_dim)), 1, s.head_dim - 1);
  s.v_head_dim = per_head(in.num_heads * card.v_head_dim, s.q_heads);
  s.q_lora = card.q_lora_rank > 0 ? per_head(card.q_lora_rank, 1) : 0;
  s.kv_lora = per_head(card.kv_lora_rank, 1);
  s.values.push_back({"a = g (heads, MLA)", in.num_heads, s.q_heads});
  s.values.push_back({"d (q/k head dim, nope + rope)", in.head_dim, s.head_dim});
  s.values.push_back({"rope (of d)", card.qk_rope_head_dim, s.rope_dim});
  s.values.push_back({"dv (value head dim)", card.v_head_dim, s.v_head_dim});
  if (card.q_lora_rank > 0) s.values.push_back({"q_lora (q latent)", card.q_lora_rank, s.q_lora});
  s.values.push_back({"kv_lora (kv latent)", card.kv_lora_rank, s.kv_lora});
}

}  // namespace

void scale_layer_dims(const VerifyInputs& in, ScaledConfig& s) {
  if (in.num_heads <= 0 || in.num_kv_heads <= 0 || in.head_dim <= 0 || in.num_heads % in.num_kv_heads != 0) return;
  const double f = static_cast<double>(in.hidden) / static_cast<double>(s.hidden);
  if (in.attention == "mla") {
    scale_mla_dims(in, f, s);
  } else {
    const int64_t group = in.num_heads / in.num_kv_heads;
    s.kv_heads = std::max<int64_t>(1, static_cast<int64_t>(std::floor(static_cast<double>(in.num_kv_heads) / f)));
    s.q_heads = s.kv_heads * group;
    const double width = static_cast<double>(in.num_heads * in.head_dim) / f;
    s.head_dim = std::max<int64_t>(1, static_cast<int64_t>(std::ceil(width / static_cast<double>(s.q_heads) - 1e-9)));
    s.values.push_back({"a (query heads)", in.num_heads, s.q_heads});
    s.values.push_back({"g (kv heads)", in.num_kv_heads, s.kv_heads});
    s.values.push_back({"d (head dim)", in.head_dim, s.head_dim});
  }
  if (in.shared_expert_ffn > 0) s.values.push_back({"F_s (shared expert width)", in.shared_expert_ffn, scaled_with_h(in, s, in.shared_expert_ffn)});
}

exec::LayerScheduleConfig layer_schedule_config(const VerifyInputs& in, const ScaledConfig& s) {
  // The measured layer takes the index of the scaled model's first MoE layer, so that an unfolded
  // prediction (a single MoE layer after dense ones, GLM-4.5) names the same phases.
  const ModelSpec card = load_plan_model(in);
  int64_t moe_layer = 0;
  while (moe_layer + 1 < s.layers && moe_layer < static_cast<int64_t>(card.layers.size()) &&
         card.layers[static_cast<size_t>(moe_layer)].ffn != FfnKind::Moe)
    ++moe_layer;
  exec::LayerScheduleConfig c;
  c.layer_index = moe_layer;
  window_of(card, moe_layer).apply_to(c);
  c.tokens = s.tokens;
  c.hidden = s.hidden;
  c.q_heads = s.q_heads;
  c.kv_heads = s.kv_heads;
  c.head_dim = s.head_dim;
  c.v_head_dim = s.v_head_dim;  // MLA's widths (0 for GQA: the config's defaults)
  c.q_lora = s.q_lora;
  c.kv_lora = s.kv_lora;
  c.rope_dim = s.rope_dim;
  c.experts = s.num_experts / std::max<int64_t>(1, s.ep);  // this rank's E/EP
  c.top_k = in.top_k;
  c.expert_ffn = s.expert_ffn > 0 ? s.expert_ffn : scaled_with_h(in, s, in.expert_ffn_width);
  c.shared_ffn = scaled_with_h(in, s, in.shared_expert_ffn);
  c.shared_gate = card.shared_expert_gate && c.shared_ffn > 0;
  c.layer_norm = card.norm_bias;
  c.expert_bias = card.expert_bias;
  return c;
}

std::string no_ring_text(const VerifyInputs& in, const ScaledConfig& s) {
  return "no ring of 2 or more ranks divides both CP = " + std::to_string(in.cp) + " and the " + std::to_string(s.ranks) +
         " scaled ranks";
}

Diagnostic no_ring_diagnostic(const VerifyInputs& in, const ScaledConfig& s, const std::string& component) {
  const std::string runs = "the " + component + " component runs CP = " + std::to_string(in.cp) + " on rings of ranks, ";
  if (s.ranks == 1) return Diagnostic{in.file, "/inputs/run/cp", runs + "and one rank runs here", "verify with --max-ranks 2 or more"};
  return Diagnostic{in.file, "/inputs/run/cp", runs + "and " + no_ring_text(in, s), ""};
}

// The ring's terms do not depend on its size, so the largest that fits stands for the plan's.
int64_t layer_ring_size(const VerifyInputs& in, const ScaledConfig& s) {
  for (int64_t r = std::min(in.cp, s.ranks); r > 1; --r)
    if (in.cp % r == 0 && s.ranks % r == 0) return r;
  return 1;
}

bool layer_runs_on_ranks(const VerifyContext& ctx, std::string& why_not) {
  check_layer_supported(ctx.in, ctx.scaled, "layer");
  if (ctx.in.cp == 1) {
    why_not = "one rank runs it at CP = 1";
    return false;
  }
  if (layer_ring_size(ctx.in, ctx.scaled) < 2) {
    why_not = no_ring_text(ctx.in, ctx.scaled);
    return false;
  }
  return true;
}

namespace {

// The layer on `ring` ranks (1: one rank, CP = 1) against `predicted`: rows layer.activations and
// layer.dispatch, and the checkpointed run's loss and grads against the naive reference's.
// `run_layer` >= 0 (CP > 1): the layer run in place of the first MoE layer, and only the phases of
// the layers whose window is its own compared (a window's halo and the ring hold different
// buffers, and the planner's groups split by window at CP > 1).
// `name_peaks`: its peak rows are named "peak L<run layer>" (two runs, one per attention kind,
// would otherwise share the merged report's "peak" rows).
void run_layer_against(const VerifyContext& ctx, nlohmann::ordered_json& predicted, int64_t ring, exec::Communicator* cp_group,
                       VerifyReport& report, int64_t run_layer = -1, bool name_peaks = false) {
  const VerifyInputs& in = ctx.in;
  const ModelSpec card = load_plan_model(in);
  exec::LayerScheduleConfig c = layer_schedule_config(in, ctx.scaled);
  if (run_layer >= 0) c.layer_index = run_layer, window_of(card, run_layer).apply_to(c);
  c.cp = ring;
  const std::function<bool(const std::string&)> same_window = [&card, run_layer](const std::string& name) {
    if (run_layer < 0 || !is_layer_phase(name)) return is_layer_phase(name);
    const size_t at = name.find("/L") + 2;
    return window_of(card, std::stoll(name.substr(at, name.find('/', at) - at))) == window_of(card, run_layer);
  };
  const bool lead = cp_group == nullptr || cp_group->rank() == 0;
  if (match_dense_attention_to_the_run_layer(predicted, layer_model(ctx), c.layer_index) > 0 && lead)
    report.notes.push_back("layer: the dense layers' attention phases are compared with those of the run MoE layer L" +
                           std::to_string(c.layer_index));
  // Both runs draw their inputs from the seed into their tracked buffers; their results are the
  // grads as bf16 bits (verify_independence_test counts them as comparison copies).
  exec::TrackingAllocator alloc({in.alignment_bytes, -1, -1});
  const exec::LayerScheduleResult got = exec::run_layer_schedule(alloc, c, {}, false, cp_group);
  // The naive reference (every activation kept from one forward) on the same data.
  exec::LayerScheduleConfig n = c;
  n.checkpointed = false;
  exec::TrackingAllocator naive_alloc({in.alignment_bytes, -1, -1});
  const exec::LayerScheduleResult ref = exec::run_layer_schedule(naive_alloc, n, {}, false, cp_group);
  report.max_abs_dloss = std::max(report.max_abs_dloss, std::fabs(got.loss - ref.loss));  // this rank's part
  for (const auto& [name, g] : got.grads) {
    const exec::StoredValues& r = ref.grads.at(name);
    for (int64_t i = 0; i < g.size(); ++i) report.max_abs_dgrad = std::max(report.max_abs_dgrad, static_cast<double>(std::fabs(g[i] - r[i])));
  }
  const size_t first_row = report.rows.size();
  compare_category("layer.activations", "activations", exec::MemorySpace::Device, predicted, alloc, same_window, report);
  compare_category("layer.dispatch", "dispatch", exec::MemorySpace::Device, predicted, alloc,
                   [&](const std::string& name) { return same_window(name) && name.find("/moe/") != std::string::npos; }, report);
  if (name_peaks)
    for (size_t i = first_row; i < report.rows.size(); ++i)
      if (report.rows[i].phase == "peak") report.rows[i].phase = "peak L" + std::to_string(c.layer_index);
  if (report.measured_trace.is_null()) report.measured_trace = measured_trace(alloc);  // the first run's
}

}  // namespace

void verify_layer(const VerifyContext& ctx, VerifyReport& report) {
  const VerifyInputs& in = ctx.in;
  check_layer_supported(in, ctx.scaled, "layer");
  if (in.cp != 1) throw UnsupportedPlan({no_ring_diagnostic(in, ctx.scaled, "layer")});
  // The planner on the scaled layer shape, one rank (EP = 1 with the rank's E/EP experts).
  nlohmann::ordered_json predicted = predicted_timeline_for(ctx, layer_model(ctx), {kWithoutMtp});
  run_layer_against(ctx, predicted, 1, nullptr, report);
}

void verify_layer_ranks(const VerifyContext& ctx, VerifyReport& report) {
  const VerifyInputs& in = ctx.in;
  const ScaledConfig& s = ctx.scaled;
  const int64_t ring = layer_ring_size(in, s);
  // The first `ring` ranks run it; the others have nothing to add (every ring would measure the same).
  const std::unique_ptr<exec::Communicator> cp_group = ctx.comm->split(ctx.comm->rank() < ring ? 0 : 1, ctx.comm->rank());
  if (ctx.comm->rank() >= ring) return;
  // The planner on the ring: CP = ring GPUs, each T tokens of a sequence of ring·T, EP = 1 with
  // the rank's E/EP experts (the dispatch as on one rank); its ring terms do not depend on CP.
  // Ring-DTP on one ring of one rank, as the one-rank prediction's vocabulary blocks are (the loss
  // is not compared here).
  const std::string r = std::to_string(ring);
  FlagList flags{kWithoutMtp, {"--gpus", r}, {"--gpus-per-node", r}, {"--cp", r}, {"--ep", "1"},
                 {"--context", std::to_string(ring * s.tokens)}};
  if (in.vocab_mode == "ring-dtp") flags.emplace_back("--ring-size", "1");
  // One run for each attention the scaled layers hold: full causal (the ring) and each window
  // (sliding or chunked: a halo, nothing, or the masked ring, as its reach needs), each the first MoE
  // layer of its kind.
  const ModelSpec card = load_plan_model(in);
  const int64_t first = layer_schedule_config(in, s).layer_index;
  std::vector<int64_t> run_layers{first};
  for (int64_t l = first + 1; l < std::min<int64_t>(s.layers, static_cast<int64_t>(card.layers.size())); ++l) {
    const bool seen = std::any_of(run_layers.begin(), run_layers.end(),
                                  [&](int64_t run) { return window_of(card, run) == window_of(card, l); });
    if (!seen && card.layers[static_cast<size_t>(l)].ffn == FfnKind::Moe) run_layers.push_back(l);
  }
  // One prediction for every run (each run marks its copy's dense attention phases).
  const nlohmann::ordered_json prediction = predicted_timeline_for(ctx, layer_model(ctx), flags);
  for (int64_t l : run_layers) {
    nlohmann::ordered_json predicted = prediction;
    if (cp_group->rank() == 0) {
      report.notes.push_back("layer: L" + std::to_string(l) + ", " + attention_text(window_of(card, l), in, s.tokens, ring) +
                             " on CP = " + r + " ranks (the plan's CP = " + std::to_string(in.cp) + "), each T = " +
                             std::to_string(s.tokens) + " tokens of one sequence; the planner on CP = " + r);
    }
    run_layer_against(ctx, predicted, ring, cp_group.get(), report, l, run_layers.size() > 1);
  }
}

}  // namespace flatpeak::cli
