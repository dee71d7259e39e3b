// The plan's fields beyond those verify uses (verify_config.h, check_plan_fields): every key is
// one plan_to_json writes, of the kind it writes, and the fields verify does not read agree with
// those it does wherever the planner derives one from others (run_spec.h, workload.cpp,
// plan_json.cpp), so that a plan edited by hand cannot pass with a value verify ignores.
#include <algorithm>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "plan.h"
#include "spec/json_util.h"
#include "verify_config.h"

namespace flatpeak::cli {

namespace {

using nlohmann::json;
using planner::PlanFieldKind;

// Integers of a plan lie in 0..2^60 (bytes, tokens, parameters: far above any real run), so that
// the cross-checks' sums of four stay inside int64; products are checked for overflow.
constexpr int64_t kMaxPlanInteger = int64_t{1} << 60;

bool plan_integer(const json& v) {
  if (v.is_number_unsigned()) return v.get<uint64_t>() <= static_cast<uint64_t>(kMaxPlanInteger);
  return v.is_number_integer() && v.get<int64_t>() >= 0 && v.get<int64_t>() <= kMaxPlanInteger;
}

const char* kind_text(PlanFieldKind kind) {
  switch (kind) {
    case PlanFieldKind::Integer:
      return "an integer in 0..2^60";
    case PlanFieldKind::Number:
      return "a non-negative number";
    case PlanFieldKind::Bool:
      return "true or false";
    case PlanFieldKind::String:
      return "a string";
    case PlanFieldKind::Object:
      return "an object";
    case PlanFieldKind::Array:
      return "an array";
  }
  return "";
}

bool has_kind(const json& v, PlanFieldKind kind) {
  switch (kind) {
    case PlanFieldKind::Integer:
      return plan_integer(v);
    case PlanFieldKind::Number:
      return v.is_number() && v.get<double>() >= 0.0;
    case PlanFieldKind::Bool:
      return v.is_boolean();
    case PlanFieldKind::String:
      return v.is_string();
    case PlanFieldKind::Object:
      return v.is_object();
    case PlanFieldKind::Array:
      return v.is_array();
  }
  return false;
}

struct Checker {
  const json& plan;
  const std::string& file;
  InputErrors& errs;
  std::set<std::string> reported;  // pointers with a problem already: no second message for them

  Checker(const json& p, const std::string& f, InputErrors& e) : plan(p), file(f), errs(e) {
    for (const auto& d : errs.diagnostics()) reported.insert(d.pointer);
  }
  void add(const std::string& pointer, const std::string& message, const std::string& hint = "") {
    errs.add(Diagnostic{file, pointer, message, hint});
    reported.insert(pointer);
  }
  // The value at `pointer`, or null where it or any object on the way is missing or not an
  // object (reported by whoever reads it; the pointers here name object keys only).
  const json* find(const std::string& pointer) const {
    const json::json_pointer p(pointer);
    return plan.contains(p) ? &plan.at(p) : nullptr;
  }
  // A value for cross-checks: present, not reported, an integer in 0..2^60 (else reported by
  // keys_and_kinds or by read_plan_inputs).
  std::optional<int64_t> integer(const std::string& pointer) const {
    const json* v = find(pointer);
    if (!v || reported.count(pointer) || !plan_integer(*v)) return std::nullopt;
    return v->get<int64_t>();
  }
  std::optional<std::string> text(const std::string& pointer) const {
    const json* v = find(pointer);
    if (!v || reported.count(pointer) || !v->is_string()) return std::nullopt;
    return v->get<std::string>();
  }
  std::optional<bool> boolean(const std::string& pointer) const {
    const json* v = find(pointer);
    if (!v || reported.count(pointer) || !v->is_boolean()) return std::nullopt;
    return v->get<bool>();
  }

  void keys_and_kinds() {
    for (const planner::PlanObject& object : planner::plan_json_objects()) {
      const json* o = find(object.pointer);
      if (!o || reported.count(object.pointer)) continue;
      if (!o->is_object()) {
        add(object.pointer, "must be an object (got " + describe_json_value(*o) + ")");
        continue;
      }
      std::vector<std::string> names;
      for (const auto& f : object.fields) names.emplace_back(f.key);
      for (const auto& [key, value] : o->items()) {
        const std::string pointer = child_pointer(object.pointer, key);
        const auto field = std::find_if(object.fields.begin(), object.fields.end(),
                                        [&](const auto& f) { return key == f.key; });
        if (field == object.fields.end()) {
          const std::string guess = did_you_mean(key, names);
          add(pointer,
              "unknown key: 'flatpeak plan --format json' writes no such key (got " +
                  describe_json_value(value) + ")",
              guess.empty() ? "" : "did you mean '" + guess + "'?");
        } else if (!reported.count(pointer) && !has_kind(value, field->kind)) {
          add(pointer,
              std::string("must be ") + kind_text(field->kind) + " (got " + describe_json_value(value) + ")");
        }
      }
    }
    const json* knobs = find("/knobs");
    if (!knobs || !knobs->is_object()) return;
    const std::vector<std::string>& knob_names = planner::plan_knob_names();
    for (const auto& [name, knob] : knobs->items()) {
      const std::string pointer = child_pointer("/knobs", name);
      if (std::find(knob_names.begin(), knob_names.end(), name) == knob_names.end()) {
        const std::string guess = did_you_mean(name, knob_names);
        add(pointer,
            "unknown knob: 'flatpeak plan --format json' writes no such knob (got " +
                describe_json_value(knob) + ")",
            guess.empty() ? "" : "did you mean '" + guess + "'?");
        continue;
      }
      if (!knob.is_object() || !knob.contains("value")) {
        add(pointer, "must be an object {\"value\": ..., \"reason\": \"...\"} (got " +
                         describe_json_value(knob) + ")");
        continue;
      }
      for (const auto& [key, value] : knob.items()) {
        if (key == "value") continue;
        if (key != "reason") {
          const std::string guess = did_you_mean(key, {"value", "reason"});
          add(child_pointer(pointer, key),
              "unknown key: a knob holds value and reason only (got " + describe_json_value(value) + ")",
              guess.empty() ? "" : "did you mean '" + guess + "'?");
        } else if (!value.is_string()) {
          add(child_pointer(pointer, key), "must be a string (got " + describe_json_value(value) + ")");
        }
      }
    }
  }

  // `pointer` must equal `expected`, which `how` derives ("/a x /b = 2 x 3 = 6").
  void must_equal(const std::string& pointer, int64_t got, int64_t expected, const std::string& how) {
    if (got != expected) add(pointer, fmt::format("must equal {} (got {})", how, got));
  }

  void model() {
    const std::string m = "/inputs/model/";
    const auto layers = integer(m + "num_layers");
    const auto pattern = text(m + "layers");
    const auto window = integer(m + "attention_window_tokens");
    if (pattern) {
      if (pattern->find_first_not_of("DMdm") != std::string::npos) {
        add(m + "layers", "must hold one letter per layer, D, M, d or m (got '" + *pattern + "')");
      } else {
        if (layers && static_cast<int64_t>(pattern->size()) != *layers)
          add(m + "layers",
              fmt::format("must have one letter per layer: /inputs/model/num_layers = {} (got {} letters)",
                          *layers, pattern->size()));
        const auto experts = integer(m + "num_experts");
        if (experts && *experts == 0 && pattern->find_first_of("Mm") != std::string::npos)
          add(m + "num_experts",
              fmt::format("must be at least 1: /inputs/model/layers = '{}' has MoE layers (got 0)",
                          *pattern));
        const bool windowed = pattern->find_first_of("dm") != std::string::npos;
        if (window && windowed && *window == 0)
          add(m + "attention_window_tokens",
              fmt::format("must be at least 1: /inputs/model/layers = '{}' has windowed layers (got 0)",
                          *pattern));
        if (window && !windowed && *window != 0)
          add(m + "attention_window_tokens",
              fmt::format("must be 0: /inputs/model/layers = '{}' has no windowed layer (got {})", *pattern,
                          *window));
      }
    }
    const auto attention = text(m + "attention");
    if (attention && *attention != "gqa" && *attention != "mla") {
      add(m + "attention", "must be gqa or mla (got '" + *attention + "')");
      return;
    }
    const auto heads = integer(m + "num_heads"), kv_heads = integer(m + "num_kv_heads");
    const auto head_dim = integer(m + "head_dim"), v_head_dim = integer(m + "v_head_dim");
    const auto nope = integer(m + "qk_nope_head_dim"), rope = integer(m + "qk_rope_head_dim");
    if (attention && *attention == "mla") {
      // MLA as training materialises it (model_spec.h): per-head q/k width nope + rope, g = a.
      if (head_dim && nope && rope)
        must_equal(m + "head_dim", *head_dim, *nope + *rope,
                   fmt::format("/inputs/model/qk_nope_head_dim + /inputs/model/qk_rope_head_dim = {} + {} = "
                               "{} with attention mla",
                               *nope, *rope, *nope + *rope));
      if (heads && kv_heads)
        must_equal(m + "num_kv_heads", *kv_heads, *heads,
                   fmt::format("/inputs/model/num_heads = {} with attention mla", *heads));
      for (const char* key : {"kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"})
        if (const auto v = integer(m + key); v && *v == 0)
          add(m + key, "must be at least 1 with attention mla (got 0)");
    } else if (attention) {
      if (head_dim && v_head_dim)
        must_equal(m + "v_head_dim", *v_head_dim, *head_dim,
                   fmt::format("/inputs/model/head_dim = {} with attention gqa", *head_dim));
      for (const char* key : {"q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim"})
        if (const auto v = integer(m + key); v && *v != 0)
          add(m + key, fmt::format("must be 0 with attention gqa (got {})", *v));
    }
    const auto mtp = boolean("/inputs/run/mtp");
    const auto mtp_layers = integer(m + "mtp_layers");
    if (mtp && *mtp && mtp_layers && *mtp_layers == 0)
      add("/inputs/run/mtp", "must be false: /inputs/model/mtp_layers = 0 (got true)");
  }

  void run() {
    const std::string r = "/inputs/run/";
    const auto gpus = integer(r + "gpus"), context = integer(r + "context_tokens"),
               b = integer(r + "micro_batch");
    const auto cp = integer(r + "cp"), dp = integer(r + "dp"), tokens = integer(r + "tokens_per_gpu");
    const auto global_batch = integer(r + "global_batch"), accumulation = integer(r + "accumulation_steps");
    const auto ep = integer(r + "ep"), experts_per_rank = integer(r + "experts_per_rank");
    const auto experts = integer("/inputs/model/num_experts");
    // CP divides N and S (resolve_run); DP = N / CP; T = b x S / CP (workload.cpp).
    bool cp_ok = cp && *cp >= 1;
    if (cp_ok && gpus && *gpus % *cp != 0) {
      add(r + "cp", fmt::format("must divide /inputs/run/gpus = {} (got {})", *gpus, *cp));
      cp_ok = false;
    }
    if (cp_ok && context && *context % *cp != 0) {
      add(r + "cp", fmt::format("must divide /inputs/run/context_tokens = {} (got {})", *context, *cp));
      cp_ok = false;
    }
    if (cp_ok && gpus && dp)
      must_equal(r + "dp", *dp, *gpus / *cp,
                 fmt::format("/inputs/run/gpus / /inputs/run/cp = {} / {} = {}", *gpus, *cp, *gpus / *cp));
    if (cp_ok && b && context && tokens) {
      int64_t bS = 0;
      const bool overflow = __builtin_mul_overflow(*b, *context, &bS);
      if (overflow || bS / *cp != *tokens)
        add(r + "tokens_per_gpu",
            fmt::format("must equal /inputs/run/micro_batch x /inputs/run/context_tokens / /inputs/run/cp = "
                        "{} x {} / {}{} (got {})",
                        *b, *context, *cp, overflow ? "" : fmt::format(" = {}", bS / *cp), *tokens));
    }
    // The global batch is whole micro-batches on every replica: a multiple of b x DP, and the
    // accumulation steps are the quotient (run_spec.h).
    if (cp_ok && gpus && b && global_batch && *b >= 1) {
      const int64_t replicas = *gpus / *cp;
      int64_t per_step = 0;
      if (__builtin_mul_overflow(*b, replicas, &per_step) || *global_batch % per_step != 0) {
        add(r + "global_batch", fmt::format("must be a multiple of /inputs/run/micro_batch x DP = {} x {} "
                                            "(DP = /inputs/run/gpus / /inputs/run/cp) (got {})",
                                            *b, replicas, *global_batch));
      } else if (accumulation) {
        const int64_t expected = *global_batch / per_step;
        must_equal(
            r + "accumulation_steps", *accumulation, expected,
            fmt::format("/inputs/run/global_batch / (/inputs/run/micro_batch x DP) = {} / ({} x {}) = {}",
                        *global_batch, *b, replicas, expected));
      }
    }
    // E/EP experts per rank; EP divides E; a dense model runs at EP = 1 (resolve_run, workload.cpp).
    if (ep && *ep >= 1 && experts) {
      if (*experts == 0 && *ep != 1)
        add(r + "ep", fmt::format("must be 1: /inputs/model/num_experts = 0 (got {})", *ep));
      else if (*experts > 0 && *experts % *ep != 0)
        add(r + "ep", fmt::format("must divide /inputs/model/num_experts = {} (got {})", *experts, *ep));
      else if (experts_per_rank)
        must_equal(r + "experts_per_rank", *experts_per_rank, *experts / *ep,
                   fmt::format("/inputs/model/num_experts / /inputs/run/ep = {} / {} = {}", *experts, *ep,
                               *experts / *ep));
    }
    if (const auto per_node = integer(r + "gpus_per_node");
        per_node && gpus && (*per_node < 1 || *per_node > *gpus))
      add(r + "gpus_per_node",
          fmt::format("must lie in 1../inputs/run/gpus = {} (got {})", *gpus, *per_node));
    if (const auto host = integer(r + "host_memory_bytes_per_node"); host && *host == 0)
      add(r + "host_memory_bytes_per_node", "must be positive (got 0)");
    if (const auto align = integer(r + "allocation_alignment_bytes"),
        hw_align = integer("/inputs/hardware/allocation_alignment_bytes");
        align && hw_align)
      must_equal(r + "allocation_alignment_bytes", *align, *hw_align,
                 fmt::format("/inputs/hardware/allocation_alignment_bytes = {}", *hw_align));
    // The card's overhead terms add up to its overhead (hardware_loader.cpp); they are written
    // only with the card's overhead.
    if (const auto overhead = integer(r + "overhead_bytes"); overhead && find(r + "overhead_terms")) {
      int64_t sum = 0;
      bool all = true;
      for (const char* key : {"cuda_context_bytes", "cublas_bytes", "cublas_workspace_bytes", "nccl_bytes"}) {
        const auto v = integer(r + "overhead_terms/" + key);
        if (v)
          sum += *v;
        else
          all = false;
      }
      if (all)
        must_equal(r + "overhead_bytes", *overhead, sum,
                   fmt::format("the sum of /inputs/run/overhead_terms = {}", sum));
    }
    for (const char* key : {"fragmentation", "host_usable_fraction"}) {
      const json* v = find(r + key);
      if (!v || reported.count(r + key) || !v->is_number()) continue;
      const double f = v->get<double>();
      const bool ok = std::string(key) == "fragmentation" ? f >= 0.0 && f < 1.0 : f > 0.0 && f <= 1.0;
      if (!ok)
        add(r + key, fmt::format("must lie in {} (got {})",
                                 std::string(key) == "fragmentation" ? "[0, 1)" : "(0, 1]", v->dump()));
    }
    // Searched knobs repeat the run's value (knob_search.cpp).
    for (const char* name : {"cp", "micro_batch"}) {
      const std::string pointer = fmt::format("/knobs/{}/value", name);
      const json* v = find(pointer);
      const auto run_value = integer(r + name);
      if (v && run_value && !(v->is_number_integer() && v->get<int64_t>() == *run_value))
        add(pointer, fmt::format("must equal /inputs/run/{} = {} (got {})", name, *run_value,
                                 describe_json_value(*v)));
    }
  }
};

}  // namespace

void check_plan_fields(const json& plan, const std::string& file, InputErrors& errs) {
  if (!plan.is_object()) return;
  Checker c(plan, file, errs);
  c.keys_and_kinds();
  c.model();
  c.run();
}

}  // namespace flatpeak::cli
