// Reading and scaling a plan for `flatpeak verify` (verify_config.h).
#include "verify_config.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <string>
#include <system_error>

#include "run_spec.h"
#include "spec/errors.h"
#include "spec/hardware_loader.h"
#include "spec/model_loader.h"
#include "spec/routing.h"

namespace flatpeak::cli {

namespace {

using nlohmann::json;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Bounds of the plan's numbers: those of model cards (planner/spec/model_loader.cpp) and run
// flags (planner/run_spec.h); every plan `flatpeak plan` writes lies within them.
constexpr int64_t kMaxPlanValue = int64_t{1} << 50;
constexpr int64_t kMaxDim = kMaxCardDim;
constexpr int64_t kMaxLayers = kMaxCardLayers;
constexpr int64_t kMaxExperts = kMaxCardExperts;
using planner::kMaxGpus;
using planner::kMaxTokensPerGpu;

struct Reader {
  const json& root;
  const std::string& file;
  InputErrors errs;

  const json* at(const std::string& pointer) {
    const json::json_pointer p(pointer);
    if (!root.contains(p)) {
      errs.add(Diagnostic{file, pointer, "required field is missing", "verify reads a plan written by 'flatpeak plan --format json'"});
      return nullptr;
    }
    return &root.at(p);
  }
  // `max_value`: the bound the planner's inputs have (cards, run flags), so that a plan edited
  // by hand cannot overflow the scaling or ask the executor for absurd buffers.
  int64_t integer(const std::string& pointer, int64_t min_value, int64_t max_value = kMaxPlanValue) {
    const json* v = at(pointer);
    if (!v) return min_value;
    if (!v->is_number_integer() || v->get<int64_t>() < min_value || v->get<int64_t>() > max_value) {
      errs.add(Diagnostic{file, pointer,
                          "must be an integer in " + std::to_string(min_value) + ".." + std::to_string(max_value) + " (got " + v->dump() + ")", ""});
      return min_value;
    }
    return v->get<int64_t>();
  }
  std::string text(const std::string& pointer) {
    const json* v = at(pointer);
    if (!v) return "";
    if (!v->is_string()) {
      errs.add(Diagnostic{file, pointer, "must be a string (got " + v->dump() + ")", ""});
      return "";
    }
    return v->get<std::string>();
  }
  bool has(const std::string& pointer) const { return root.contains(json::json_pointer(pointer)); }
};

}  // namespace

VerifyInputs read_plan_inputs(const json& plan, const std::string& file) {
  Reader r{plan, file, {}};
  VerifyInputs in;
  in.file = file;
  if (!plan.is_object()) {
    r.errs.add(Diagnostic{file, "", "a plan must be a JSON object", ""});
    r.errs.throw_if_any();
  }
  if (const json* v = r.at("/schema_version"); v && !(v->is_number_integer() && v->get<int64_t>() == 1))
    r.errs.add(Diagnostic{file, "/schema_version", "must be 1 (got " + v->dump() + ")",
                          "re-create the plan with this flatpeak's 'plan --format json'"});
  in.model_name = r.text("/inputs/model/name");
  in.hardware_name = r.text("/inputs/hardware/name");
  in.model_source = r.text("/inputs/model/source");
  in.hardware_source = r.text("/inputs/hardware/source");
  in.alignment_bytes = r.integer("/inputs/hardware/allocation_alignment_bytes", 1, int64_t{1} << 30);
  in.hidden = r.integer("/inputs/model/hidden_size", 1, kMaxDim);
  in.vocab = r.integer("/inputs/model/vocab_size", 1, kMaxDim);
  in.layers = r.integer("/inputs/model/num_layers", 1, kMaxLayers);
  in.num_experts = r.integer("/inputs/model/num_experts", 0, kMaxExperts);
  in.top_k = r.integer("/inputs/model/top_k", 0, kMaxExperts);
  if (r.has("/inputs/model/attention")) in.attention = r.text("/inputs/model/attention");
  if (r.has("/inputs/model/num_heads")) in.num_heads = r.integer("/inputs/model/num_heads", 1, kMaxDim);
  if (r.has("/inputs/model/num_kv_heads")) in.num_kv_heads = r.integer("/inputs/model/num_kv_heads", 1, kMaxDim);
  if (r.has("/inputs/model/head_dim")) in.head_dim = r.integer("/inputs/model/head_dim", 1, kMaxDim);
  if (r.has("/inputs/model/shared_expert_ffn_width")) {
    in.shared_expert_ffn = r.integer("/inputs/model/shared_expert_ffn_width", 0, kMaxDim);
    in.has_shared_expert_ffn = true;
  }
  if (r.has("/inputs/model/shared_expert_gate")) {
    const json& v = plan.at(json::json_pointer("/inputs/model/shared_expert_gate"));
    if (v.is_boolean()) in.shared_expert_gate = v.get<bool>();
    else r.errs.add(Diagnostic{file, "/inputs/model/shared_expert_gate", "must be true or false (got " + v.dump() + ")", ""});
  }
  in.expert_ffn_width = r.integer("/inputs/model/expert_ffn_width", 0, kMaxDim);
  in.gpus = r.integer("/inputs/run/gpus", 1, kMaxGpus);
  in.ep = r.integer("/inputs/run/ep", 1, kMaxGpus);
  in.cp = r.integer("/inputs/run/cp", 1, kMaxGpus);
  in.micro_batch = r.integer("/inputs/run/micro_batch", 1);
  in.tokens_per_gpu = r.integer("/inputs/run/tokens_per_gpu", 1, kMaxTokensPerGpu);
  in.schedule = r.text("/inputs/run/schedule");
  if (r.has("/inputs/run/mtp")) {
    const json& v = plan.at(json::json_pointer("/inputs/run/mtp"));
    if (v.is_boolean()) in.mtp = v.get<bool>();
    else r.errs.add(Diagnostic{file, "/inputs/run/mtp", "must be true or false (got " + v.dump() + ")", ""});
  }
  if (r.has("/inputs/run/accumulation_steps")) in.accumulation_steps = r.integer("/inputs/run/accumulation_steps", 1);
  if (r.has("/inputs/run/overhead_bytes")) in.overhead_bytes = r.integer("/inputs/run/overhead_bytes", 0);
  if (r.has("/inputs/run/overhead_calibrated")) {
    const json& v = plan.at(json::json_pointer("/inputs/run/overhead_calibrated"));
    if (v.is_boolean()) in.overhead_calibrated = v.get<bool>();
    else r.errs.add(Diagnostic{file, "/inputs/run/overhead_calibrated", "must be true or false (got " + v.dump() + ")", ""});
  }
  if (r.has("/inputs/run/overhead_terms/nccl_bytes")) in.overhead_nccl_bytes = r.integer("/inputs/run/overhead_terms/nccl_bytes", 0);
  if (r.has("/inputs/run/imbalance")) in.imbalance = r.text("/inputs/run/imbalance");
  if (const json* knobs = r.at("/knobs"); !knobs) {
    r.errs.throw_if_any();
  } else if (!knobs->is_object()) {
    r.errs.add(Diagnostic{file, "/knobs", "must be an object of {\"value\": ...} entries (got " + knobs->dump() + ")", ""});
    r.errs.throw_if_any();
  } else {
    for (const auto& [name, knob] : knobs->items())
      if (knob.is_object() && knob.contains("value")) in.knob_values[name] = knob["value"];
  }
  // Every plan writes /knobs/vocab (run_spec.cpp); one without it was edited, and a default here
  // would verify another schedule than the plan's.
  const size_t errors_before_vocab = r.errs.size();
  in.vocab_mode = r.text("/knobs/vocab/value");
  if (r.errs.size() > errors_before_vocab) {
    in.vocab_mode = "materialized";  // missing or not a string: reported
  } else if (in.vocab_mode != "materialized" && in.vocab_mode != "blocked" && in.vocab_mode != "ring-dtp") {
    r.errs.add(Diagnostic{file, "/knobs/vocab/value", "must be materialized, blocked or ring-dtp (got '" + in.vocab_mode + "')", ""});
  } else if (in.vocab_mode != "ring-dtp" && (in.schedule == "practice") != (in.vocab_mode == "blocked")) {
    // The schedule's loss without Ring-DTP (run_spec.cpp): blocked under practice, materialised
    // under baseline and flatpeak.
    r.errs.add(Diagnostic{file, "/knobs/vocab/value",
                          "must be ring-dtp or " + std::string(in.schedule == "practice" ? "blocked" : "materialized") +
                              " under schedule " + in.schedule + " (got '" + in.vocab_mode + "')",
                          ""});
  }
  if (in.vocab_mode != "materialized") {
    in.token_block = r.integer("/knobs/token_block/value", 1);
    in.vocab_block = r.integer("/knobs/vocab_block/value", 1);
    if (r.has("/knobs/vocab_backward")) in.vocab_backward = r.text("/knobs/vocab_backward/value");
    if (in.vocab_backward != "recompute" && in.vocab_backward != "in-forward")
      r.errs.add(Diagnostic{file, "/knobs/vocab_backward/value", "must be recompute or in-forward (got '" + in.vocab_backward + "')", ""});
  }
  if (in.vocab_mode == "ring-dtp") in.ring_size = r.integer("/knobs/ring_size/value", 1, kMaxGpus);
  // Read only by a ring of more than one rank; checked whatever the ring size ("x" passed at R = 1).
  if (r.has("/knobs/ring_rotate/value")) {
    const json& v = plan.at(json::json_pointer("/knobs/ring_rotate/value"));
    if (!v.is_string() || (v != "activations" && v != "weights"))
      r.errs.add(Diagnostic{file, "/knobs/ring_rotate/value", "must be activations or weights (got " + v.dump() + ")", ""});
  }
  // Knobs against the inputs (the planner's own rules, re-checked on the file as written).
  if (r.errs.empty()) {
    if (in.gpus % in.ring_size != 0)
      r.errs.add(Diagnostic{file, "/knobs/ring_size/value",
                            "must divide /inputs/run/gpus = " + std::to_string(in.gpus) + " (got " + std::to_string(in.ring_size) + ")", ""});
    if (in.token_block > in.tokens_per_gpu)
      r.errs.add(Diagnostic{file, "/knobs/token_block/value",
                            "must lie in 1..T = " + std::to_string(in.tokens_per_gpu) + " (got " + std::to_string(in.token_block) + ")", ""});
    if (in.vocab_block > ceil_div(in.vocab, in.ring_size))
      r.errs.add(Diagnostic{file, "/knobs/vocab_block/value",
                            "must lie in 1..V/R = " + std::to_string(ceil_div(in.vocab, in.ring_size)) + " (got " + std::to_string(in.vocab_block) + ")", ""});
    if (in.top_k > in.num_experts)
      r.errs.add(Diagnostic{file, "/inputs/model/top_k",
                            "must be at most /inputs/model/num_experts = " + std::to_string(in.num_experts) + " (got " + std::to_string(in.top_k) + ")", ""});
    if (in.gpus % in.ep != 0)
      r.errs.add(Diagnostic{file, "/inputs/run/ep", "must divide /inputs/run/gpus = " + std::to_string(in.gpus) + " (got " + std::to_string(in.ep) + ")", ""});
    if (in.schedule != "baseline" && in.schedule != "practice" && in.schedule != "flatpeak")
      r.errs.add(Diagnostic{file, "/inputs/run/schedule", "must be baseline, practice or flatpeak (got '" + in.schedule + "')", ""});
    // The routing model at the plan's own EP (a component at one rank runs it balanced, so it
    // would otherwise pass unchecked). A routing file is not re-read: the plan keeps its path only.
    if (in.num_experts > 0 && in.top_k >= 1 && in.top_k <= in.num_experts && in.num_experts % in.ep == 0) {
      try {
        const RoutingModel routing = parse_routing_model(in.imbalance);
        if (routing.kind != RoutingKind::File) validate_routing_model(routing, RoutingShape{in.ep, in.num_experts, in.top_k}, 0);
      } catch (const InputError& e) {
        // A routing file's own errors name that file and their place in it; the model's rules
        // (named --imbalance) become the plan field's.
        for (const auto& d : e.diagnostics())
          r.errs.add(d.file.empty() ? Diagnostic{file, "/inputs/run/imbalance", d.message, d.hint} : d);
      }
    }
  }
  check_plan_fields(plan, file, r.errs);
  r.errs.throw_if_any();
  // The model and hardware are read here, once, so that a file gone or changed since the plan was
  // made is an input error before anything runs (every rank under MPI reads the plan alike).
  in.model = std::make_shared<const ModelSpec>(load_plan_model(in));
  in.hardware = std::make_shared<const HardwareSpec>(load_plan_hardware(in));
  return in;
}

namespace {

bool is_embedded(const std::string& source) { return source.rfind("embedded:", 0) == 0; }

// Where a plan's relative source path is read: from where verify runs, as the planner read it
// from where it ran; when nothing is there, beside the plan file (a plan written next to its
// config and verified from elsewhere). The loaders below compare the dims the plan records
// (layers, H, V, experts, k, F, heads, head dim, the shared experts' width and gate) with the file's.
std::string resolve_plan_source(const VerifyInputs& in, const std::string& source) {
  namespace fs = std::filesystem;
  const fs::path path(source);
  std::error_code ec;
  if (path.is_absolute() || fs::exists(path, ec)) return source;
  const fs::path beside = fs::path(in.file).parent_path() / path;
  if (!fs::path(in.file).parent_path().empty() && fs::exists(beside, ec)) return beside.string();
  return source;
}

// Loads `source` (a file) with `load`, turning its InputError into one that names the plan's
// source field: the reason, and what to do about it.
template <class Spec, class Load>
Spec load_plan_source(const VerifyInputs& in, const std::string& pointer, const std::string& source,
                      Load load) {
  try {
    return load(resolve_plan_source(in, source));
  } catch (const InputError& e) {
    std::string reason;
    for (const Diagnostic& d : e.diagnostics()) reason += (reason.empty() ? "" : "; ") + d.to_string();
    const bool relative = !std::filesystem::path(source).is_absolute();
    throw InputError(Diagnostic{
        in.file, pointer,
        "names '" + source + "', which cannot be read as it was when the plan was made: " + reason,
        relative ? "run verify from the folder the plan was made in (a relative path is also looked for beside "
                   "the plan), or plan again with the file's absolute path"
                 : "restore the file, or plan again from where it is now"});
  }
}

// What a plan's value disagreeing with its card means: a card file changed since the plan was
// made; a built-in card (which cannot change) means the plan was edited or made by another build.
struct CardOrigin {
  std::string text;  // "'models/x.json' now gives", "the built-in card 'X' gives"
  std::string reason, hint;
};

CardOrigin card_origin(const std::string& source, const std::string& name) {
  if (is_embedded(source) || source.empty())
    return {"the built-in card '" + name + "' gives", "the plan was edited or made by another version of flatpeak",
            "plan again"};
  return {"'" + source + "' now gives", "the file changed since the plan was made", "plan again from the file as it is"};
}

// A built-in card by the plan's name; an unknown name is an error of the plan's field (the
// loader's own names the --model or --gpu flag, which verify was not given).
template <typename Spec, typename Load>
Spec load_builtin(const VerifyInputs& in, const std::string& pointer, const std::string& name, Load load) {
  try {
    return load(name);
  } catch (const InputError& e) {
    std::vector<Diagnostic> out;
    for (const auto& d : e.diagnostics())
      out.push_back(Diagnostic{in.file, pointer, "names no built-in card: " + d.message, d.hint});
    throw InputError(out);
  }
}

void expect_same(InputErrors& errs, const VerifyInputs& in, const std::string& field, const CardOrigin& origin,
                 int64_t in_plan, int64_t in_card) {
  if (in_plan == in_card) return;
  errs.add(Diagnostic{in.file, field,
                      "is " + std::to_string(in_plan) + ", but " + origin.text + " " + std::to_string(in_card) + ": " +
                          origin.reason,
                      origin.hint});
}

}  // namespace

ModelSpec load_plan_model(const VerifyInputs& in) {
  if (in.model) return *in.model;
  const bool embedded = in.model_source.empty() || is_embedded(in.model_source);
  const ModelSpec model = embedded ? load_builtin<ModelSpec>(in, "/inputs/model/name", in.model_name, load_model)
                                   : load_plan_source<ModelSpec>(in, "/inputs/model/source", in.model_source,
                                                                 [](const std::string& path) { return load_model(path); });
  InputErrors errs;
  const CardOrigin src = card_origin(in.model_source, in.model_name);
  expect_same(errs, in, "/inputs/model/num_layers", src, in.layers, model.num_layers);
  expect_same(errs, in, "/inputs/model/hidden_size", src, in.hidden, model.hidden_size);
  expect_same(errs, in, "/inputs/model/vocab_size", src, in.vocab, model.vocab_size);
  expect_same(errs, in, "/inputs/model/num_experts", src, in.num_experts, model.num_experts);
  expect_same(errs, in, "/inputs/model/top_k", src, in.top_k, model.top_k);
  expect_same(errs, in, "/inputs/model/expert_ffn_width", src, in.expert_ffn_width, model.expert_ffn_width);
  if (in.num_heads > 0) expect_same(errs, in, "/inputs/model/num_heads", src, in.num_heads, model.num_heads);
  if (in.num_kv_heads > 0)
    expect_same(errs, in, "/inputs/model/num_kv_heads", src, in.num_kv_heads, model.num_kv_heads);
  if (in.head_dim > 0) expect_same(errs, in, "/inputs/model/head_dim", src, in.head_dim, model.head_dim);
  if (in.has_shared_expert_ffn)
    expect_same(errs, in, "/inputs/model/shared_expert_ffn_width", src, in.shared_expert_ffn, model.shared_expert_ffn_width);
  if (in.shared_expert_gate && *in.shared_expert_gate != model.shared_expert_gate) {
    errs.add(Diagnostic{in.file, "/inputs/model/shared_expert_gate",
                        std::string("is ") + (*in.shared_expert_gate ? "true" : "false") + ", but " + src.text + " " +
                            (model.shared_expert_gate ? "true" : "false") + ": " + src.reason,
                        src.hint});
  }
  errs.throw_if_any();
  return model;
}

HardwareSpec load_plan_hardware(const VerifyInputs& in) {
  if (in.hardware) return *in.hardware;
  const bool embedded = in.hardware_source.empty() || is_embedded(in.hardware_source);
  const HardwareSpec hardware =
      embedded ? load_builtin<HardwareSpec>(in, "/inputs/hardware/name", in.hardware_name, load_hardware)
               : load_plan_source<HardwareSpec>(in, "/inputs/hardware/source", in.hardware_source,
                                                [](const std::string& path) { return load_hardware(path); });
  InputErrors errs;
  expect_same(errs, in, "/inputs/hardware/allocation_alignment_bytes", card_origin(in.hardware_source, in.hardware_name),
              in.alignment_bytes, hardware.allocation_alignment_bytes);
  errs.throw_if_any();
  return hardware;
}

ScaledConfig scale_config(const VerifyInputs& in, std::optional<double> factor, int64_t max_ranks) {
  ScaledConfig s;
  // Ranks: N/EP (the FSDP replicas of each expert group) is kept; EP shrinks to fit max_ranks.
  const int64_t replicas = in.gpus / in.ep;
  if (max_ranks < 1 || replicas > max_ranks)
    throw InputError({Diagnostic{"", "--max-ranks",
                                 "must be at least N/EP = " + std::to_string(replicas) + " (" + in.file + ": N = " +
                                     std::to_string(in.gpus) + ", EP = " + std::to_string(in.ep) +
                                     "), which verify keeps (got " + std::to_string(max_ranks) + ")",
                                 ""}});
  s.ep = std::min(in.ep, max_ranks / replicas);
  s.ranks = s.ep * replicas;
  s.num_experts = in.num_experts / in.ep * s.ep;
  // Fewer ranks keep E/EP experts each, which can leave fewer experts than top_k (Mixtral, 8
  // experts top-2 at EP = 8, verified on one rank: E = 1): no token could pick k distinct
  // experts. Each rank then holds ceil(k / EP') experts, the fewest that route (printed as E).
  if (in.top_k > 0 && s.num_experts < in.top_k) s.num_experts = ceil_div(in.top_k, s.ep) * s.ep;
  const int64_t T = in.tokens_per_gpu;
  if (factor) {
    s.tokens = std::max<int64_t>(1, static_cast<int64_t>(std::ceil(static_cast<double>(T) / *factor)));
    s.hidden = std::max<int64_t>(8, static_cast<int64_t>(std::ceil(static_cast<double>(in.hidden) / *factor)));
    s.vocab = std::max<int64_t>(2, static_cast<int64_t>(std::ceil(static_cast<double>(in.vocab) / *factor)));
  } else {
    s.tokens = std::min<int64_t>(T, 512);
    s.hidden = std::min<int64_t>(in.hidden, 64);
    s.vocab = std::min<int64_t>(in.vocab, std::max<int64_t>(1000, in.vocab / 64));
  }
  s.layers = std::min<int64_t>(in.layers, 4);
  s.factor = static_cast<double>(T) / static_cast<double>(s.tokens);
  s.asked_factor = factor;
  if (in.vocab_mode != "materialized") {
    // Keep the number of token blocks and of vocabulary blocks per shard (the shard is V at R = 1).
    const int64_t token_blocks = ceil_div(T, in.token_block);
    s.token_block = std::max<int64_t>(1, ceil_div(s.tokens, token_blocks));
    const int64_t vocab_blocks = ceil_div(ceil_div(in.vocab, in.ring_size), in.vocab_block);
    s.vocab_block = std::max<int64_t>(1, ceil_div(s.vocab, vocab_blocks));
  }
  s.values = {{"N (gpus)", in.gpus, s.ranks},    {"EP", in.ep, s.ep},
              {"T (tokens per GPU)", T, s.tokens}, {"H", in.hidden, s.hidden},
              {"V", in.vocab, s.vocab},          {"L", in.layers, s.layers},
              {"R (ring size)", in.ring_size, 1}};
  if (s.num_experts != in.num_experts) s.values.push_back({"E (experts)", in.num_experts, s.num_experts});
  scale_dispatch_knobs(in, s);
  if (in.vocab_mode != "materialized") {
    s.values.push_back({"T_blk", in.token_block, s.token_block});
    s.values.push_back({"V_blk", in.vocab_block, s.vocab_block});
  }
  scale_checkpoint_knobs(in, s);
  scale_layer_dims(in, s);
  scale_optimizer_knobs(in, s);
  return s;
}

}  // namespace flatpeak::cli
