// Run flags: parsing (text -> typed values) and resolution against a model and a hardware card.
#include "run_spec.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <set>

#include <fmt/format.h>

#include "spec/least_loaded.h"
#include "spec/sizes.h"
#include "terms.h"

namespace flatpeak::planner {

const char* to_string(Schedule v) {
  switch (v) {
    case Schedule::Practice: return "practice";
    case Schedule::Flatpeak: return "flatpeak";
    case Schedule::Baseline: break;
  }
  return "baseline";
}
const char* to_string(OptimizerPlacement v) {
  switch (v) {
    case OptimizerPlacement::Serial: return "serial";
    case OptimizerPlacement::Stream: return "stream";
    case OptimizerPlacement::Gpu: break;
  }
  return "gpu";
}
const char* to_string(VocabMode v) {
  switch (v) {
    case VocabMode::Blocked: return "blocked";
    case VocabMode::RingDtp: return "ring-dtp";
    case VocabMode::Materialized: break;
  }
  return "materialized";
}
const char* to_string(BoundaryMode v) {
  switch (v) {
    case BoundaryMode::SyncOffload: return "sync-offload";
    case BoundaryMode::Sco: return "sco";
    case BoundaryMode::Device: break;
  }
  return "device";
}
const char* to_string(DispatchMode v) { return v == DispatchMode::Recompute ? "recompute" : "store"; }
const char* to_string(RingRotate v) { return v == RingRotate::Activations ? "activations" : "weights"; }
const char* to_string(VocabBackward v) { return v == VocabBackward::InForward ? "in-forward" : "recompute"; }

const std::vector<FlagInfo>& run_flags() {
  static const std::vector<FlagInfo> flags = {
      {"--gpus", "N, number of GPUs", "a positive integer up to 16777216 (2^24)"},
      {"--context", "S, context length in tokens (K/M/G = powers of 1024)", "a positive token count such as 131072, 128K or 1M"},
      {"--micro-batch", "b, sequences per micro-batch (default 1)", "a positive integer"},
      {"--global-batch", "sequences per step (default b x DP); accumulation steps = global / (b x DP)", "a positive multiple of b x DP"},
      {"--cp", "context-parallel degree, or 'auto': the smallest power of two dividing N and S that fits; when knobs are searched (--schedule flatpeak), the one giving the fastest step that fits (default 1)", "a positive divisor of both N and S, or auto"},
      {"--ep", "expert-parallel degree (default: largest divisor of N and E that is <= gpus per node)", "a positive divisor of both N and E"},
      {"--gpus-per-node", "GPUs per node (default: the hardware card's, at most N)", "a positive integer"},
      {"--host-memory", "host DRAM per node (default: the hardware card's), e.g. 2TB, 1536GiB", "a byte size: an integer or decimal with KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024), e.g. 2TB or 1536GiB"},
      {"--mtp", "train the model's multi-token-prediction layers (default: the model's own)", "on or off"},
      {"--schedule", "baseline (tuned FSDP2), practice (+ blocked CE, sync boundary offload), flatpeak (all four techniques)", "baseline, practice or flatpeak"},
      {"--optimizer", "AdamW placement: gpu, serial (offload, serial CPU step) or stream (OffloadStreamAdamW)", "gpu, serial or stream"},
      {"--imbalance", "MoE routing model (default balanced)", "balanced, rho=X, hot-expert=f,h, hot-rank=f, zipf=s or file=PATH"},
      {"--overhead", "runtime overhead per GPU (default: the hardware card's, else 3GiB)", "a byte size: an integer or decimal with KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024), e.g. 3GiB"},
      {"--fragmentation", "allocator reserve as a fraction of the peak (default: the card's, else 0.05)", "a number in [0, 1)"},
      {"--llep", "PipelinedLLEP for the dispatch peak (default: on in flatpeak)", "on or off"},
      {"--chunk-cap-rows", "PipelinedLLEP: token copies each source sends per round (0 = no cap, plain LLEP)", "a non-negative token count"},
      {"--dispatch-mode", "PipelinedLLEP: keep expert activations (store) or recompute them per round in backward", "store or recompute"},
      {"--llep-alpha", "LLEP capacity factor alpha", "a number in [1, EP]"},
      {"--llep-lambda", "LLEP: imbalance ratio below which plain EP is used (0 = always run LLA)", "a number in [0, EP]"},
      {"--llep-min-rows", "LLEP: minimum rows spilled to a helper (m)", "a positive token count"},
      {"--striping", "PipelinedLLEP: proportional striping of each source's copies over rounds", "on or off"},
      {"--dispatch-depth", "PipelinedLLEP: rounds in flight (1 = no overlap, 2 = double buffering)", "an integer in 1..4"},
      {"--ring-dtp", "Ring-DTP for the vocabulary peak (default: on in flatpeak)", "on or off"},
      {"--ring-size", "Ring-DTP ranks in a ring, R (default: largest divisor of N <= gpus per node)", "a positive divisor of N"},
      {"--ring-rotate", "Ring-DTP: circulate activations or weights (default: the fewer bytes per hop)", "activations or weights"},
      {"--vocab-backward", "blocked/ring loss backward: recompute logits from lse, or gradients in forward", "recompute or in-forward"},
      {"--token-block", "tokens per block of logits (blocked CE, Ring-DTP)", "a token count in 1..T"},
      {"--vocab-block", "vocabulary entries per block of logits (blocked CE, Ring-DTP)", "an integer in 1..V/R"},
      {"--sco", "selective checkpoint offload of the boundaries (default: on in flatpeak)", "on or off"},
      {"--sco-layers", "SCO: the offloaded layers: auto (fewest first layers that fit), all, a count (the first n), or a set like 0,2,5-9", "auto, all, a count in 0..L, or layer indices in 0..L-1"},
      {"--sco-prefetch", "SCO: boundaries prefetched ahead in backward", "an integer in 0..4"},
      {"--bucket-params", "OffloadStreamAdamW: parameters per bucket (K/M/G = powers of 1024)", "a positive count such as 64M"},
      {"--bucket-depth", "OffloadStreamAdamW: buckets in flight", "an integer in 1..8"},
  };
  return flags;
}

namespace {

const FlagInfo* find_flag(const std::string& name) {
  for (const auto& f : run_flags())
    if (name == f.name) return &f;
  return nullptr;
}

std::string valid_of(const std::string& flag) {
  const FlagInfo* f = find_flag(flag);
  return f ? std::string("valid: ") + f->valid : "";
}

void bad(InputErrors& errs, const std::string& flag, const std::string& rule, const std::string& got) {
  errs.add(Diagnostic{"", flag, fmt::format("{} (got {})", rule, got), valid_of(flag)});
}

std::optional<int64_t> parse_count(const std::string& text) { return parse_tokens(text); }

// Plain decimals only: std::stod also took "0x10" (as 16) and leading blanks.
std::optional<double> parse_number(const std::string& text) { return parse_decimal(text); }

std::optional<bool> parse_on_off(const std::string& text) {
  if (text == "on") return true;
  if (text == "off") return false;
  return std::nullopt;
}

template <typename E>
std::optional<E> parse_enum(const std::string& text, std::initializer_list<std::pair<const char*, E>> names) {
  for (const auto& [name, value] : names)
    if (text == name) return value;
  return std::nullopt;
}

}  // namespace

RunSpec parse_run_flags(const std::vector<std::pair<std::string, std::string>>& flags, InputErrors& errs) {
  RunSpec s;
  bool have_gpus = false, have_context = false;
  for (const auto& item : flags) {
    const std::string& flag = item.first;  // named, not a structured binding: lambdas capture it
    const std::string& text = item.second;
    auto count = [&](std::optional<int64_t>& out, int64_t min) {
      auto v = parse_count(text);
      if (!v && min == 0 && text == "0") v = 0;
      if (!v && tokens_beyond_int64(text))
        return bad(errs, flag, flag == "--gpus" ? fmt::format("must be at most 2^24 = {}", kMaxGpus) : "is too large: must be below 2^63",
                   "'" + text + "'");
      if (!v || *v < min) {
        const bool tokens = flag == "--context" || flag == "--chunk-cap-rows" || flag == "--token-block" ||
                            flag == "--llep-min-rows" || flag == "--bucket-params";
        bad(errs, flag,
            std::string(min > 0 ? "must be a positive " : "must be a non-negative ") + (tokens ? "count (K/M/G = powers of 1024)" : "integer"),
            "'" + text + "'");
        return;
      }
      out = *v;
    };
    auto number = [&](std::optional<double>& out) {
      auto v = parse_number(text);
      if (!v) return bad(errs, flag, "must be a decimal number", "'" + text + "'");
      out = *v;
    };
    auto on_off = [&](std::optional<bool>& out) {
      auto v = parse_on_off(text);
      if (!v) return bad(errs, flag, "must be on or off", "'" + text + "'");
      out = *v;
    };
    if (flag == "--gpus") {
      std::optional<int64_t> v;
      count(v, 1);
      if (v && *v > kMaxGpus) {
        bad(errs, flag, fmt::format("must be at most 2^24 = {}", kMaxGpus), "'" + text + "'");
        v.reset();
      }
      if (v) s.gpus = *v;
      have_gpus = true;
    } else if (flag == "--context") {
      std::optional<int64_t> v;
      count(v, 1);
      if (v) s.context_tokens = *v;
      have_context = true;
    } else if (flag == "--micro-batch") {
      count(s.micro_batch, 1);
    } else if (flag == "--global-batch") {
      count(s.global_batch, 1);
    } else if (flag == "--cp") {
      if (text == "auto") s.cp_auto = true;
      else count(s.cp, 1);
    } else if (flag == "--ep") {
      count(s.ep, 1);
    } else if (flag == "--gpus-per-node") {
      count(s.gpus_per_node, 1);
    } else if (flag == "--host-memory" || flag == "--overhead") {
      auto v = parse_bytes(text);
      if (!v && bytes_beyond_int64(text)) {
        bad(errs, flag, flag == "--host-memory" ? "is too large: must be below 2^63 bytes" : "must be at most 1PiB (2^50 bytes)",
            "'" + text + "'");
        continue;
      }
      if (!v || (flag == "--host-memory" && *v <= 0)) {
        bad(errs, flag, flag == "--host-memory" ? "must be a positive byte size" : "must be a byte size", "'" + text + "'");
        continue;
      }
      if (flag == "--overhead" && *v > kMaxOverheadBytes) {
        bad(errs, flag, "must be at most 1PiB (2^50 bytes)", "'" + text + "'");
        continue;
      }
      (flag == "--host-memory" ? s.host_memory_bytes_per_node : s.overhead_bytes) = *v;
    } else if (flag == "--mtp") {
      on_off(s.mtp);
    } else if (flag == "--schedule") {
      auto v = parse_enum<Schedule>(text, {{"baseline", Schedule::Baseline}, {"practice", Schedule::Practice}, {"flatpeak", Schedule::Flatpeak}});
      if (!v) bad(errs, flag, "unknown schedule", "'" + text + "'");
      else s.schedule = *v;
    } else if (flag == "--optimizer") {
      s.optimizer = parse_enum<OptimizerPlacement>(text, {{"gpu", OptimizerPlacement::Gpu}, {"serial", OptimizerPlacement::Serial}, {"stream", OptimizerPlacement::Stream}});
      if (!s.optimizer) bad(errs, flag, "unknown optimizer placement", "'" + text + "'");
    } else if (flag == "--imbalance") {
      s.imbalance = text;
    } else if (flag == "--fragmentation") {
      number(s.fragmentation);
    } else if (flag == "--llep") {
      on_off(s.llep);
    } else if (flag == "--chunk-cap-rows") {
      count(s.chunk_cap_rows, 0);
    } else if (flag == "--dispatch-mode") {
      s.dispatch_mode = parse_enum<DispatchMode>(text, {{"store", DispatchMode::Store}, {"recompute", DispatchMode::Recompute}});
      if (!s.dispatch_mode) bad(errs, flag, "unknown dispatch mode", "'" + text + "'");
    } else if (flag == "--llep-alpha") {
      number(s.llep_alpha);
    } else if (flag == "--llep-lambda") {
      number(s.llep_lambda);
    } else if (flag == "--llep-min-rows") {
      count(s.llep_min_rows, 1);
    } else if (flag == "--striping") {
      on_off(s.striping);
    } else if (flag == "--dispatch-depth") {
      count(s.dispatch_depth, 1);
    } else if (flag == "--ring-dtp") {
      on_off(s.ring_dtp);
    } else if (flag == "--ring-size") {
      count(s.ring_size, 1);
    } else if (flag == "--ring-rotate") {
      s.ring_rotate = parse_enum<RingRotate>(text, {{"activations", RingRotate::Activations}, {"weights", RingRotate::Weights}});
      if (!s.ring_rotate) bad(errs, flag, "unknown rotation", "'" + text + "'");
    } else if (flag == "--vocab-backward") {
      s.vocab_backward = parse_enum<VocabBackward>(text, {{"recompute", VocabBackward::Recompute}, {"in-forward", VocabBackward::InForward}});
      if (!s.vocab_backward) bad(errs, flag, "unknown loss backward", "'" + text + "'");
    } else if (flag == "--token-block") {
      count(s.token_block, 1);
    } else if (flag == "--vocab-block") {
      count(s.vocab_block, 1);
    } else if (flag == "--sco") {
      on_off(s.sco);
    } else if (flag == "--sco-layers") {
      s.sco_layers = text;
    } else if (flag == "--sco-prefetch") {
      std::optional<int64_t> v;
      count(v, 0);
      s.sco_prefetch = v;
    } else if (flag == "--bucket-params") {
      count(s.bucket_params, 1);
    } else if (flag == "--bucket-depth") {
      count(s.bucket_depth, 1);
    } else {
      std::vector<std::string> names;
      for (const auto& f : run_flags()) names.emplace_back(f.name);
      const std::string guess = did_you_mean(flag, names);
      errs.add(Diagnostic{"", flag, "unknown flag", guess.empty() ? "" : "did you mean '" + guess + "'?"});
    }
  }
  if (!have_gpus) errs.add(Diagnostic{"", "--gpus", "is required", valid_of("--gpus")});
  if (!have_context) errs.add(Diagnostic{"", "--context", "is required", valid_of("--context")});
  return s;
}

int64_t default_ep(int64_t gpus, int64_t experts, int64_t gpus_per_node) {
  if (experts <= 0) return 1;
  int64_t best = 1;
  for (int64_t d = 1; d <= std::min({gpus, experts, gpus_per_node}); ++d)
    if (gpus % d == 0 && experts % d == 0) best = d;
  return best;
}

namespace {

std::string num(double v) { return fmt::format("{}", v); }

// "all" | count | set like "0,2,5-9" -> per-layer flags; problems go to errs.
std::vector<bool> parse_sco_layers(const std::string& text, int64_t layers, InputErrors& errs) {
  std::vector<bool> out(static_cast<size_t>(layers), false);
  if (text == "all" || text == "auto") {  // auto: make_plan narrows it to the fewest that fit
    std::fill(out.begin(), out.end(), true);
    return out;
  }
  const bool is_set = text.find_first_of(",-") != std::string::npos;
  if (!is_set) {
    auto n = parse_count(text);
    if (!n && !text.empty() && text.find_first_not_of('0') == std::string::npos) n = 0;  // "0", "00"
    if (!n || *n > layers) {
      bad(errs, "--sco-layers", fmt::format("must be all, auto, a count in 0..{} or a set of layer indices", layers), "'" + text + "'");
      return out;
    }
    for (int64_t i = 0; i < *n; ++i) out[static_cast<size_t>(i)] = true;
    return out;
  }
  size_t pos = 0;
  while (pos <= text.size()) {
    const size_t comma = text.find(',', pos);
    const std::string item = text.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    const size_t dash = item.find('-');
    auto index = [&](const std::string& t) -> std::optional<int64_t> {
      if (t == "0") return 0;
      auto v = parse_count(t);
      if (v && t.find_first_not_of("0123456789") == std::string::npos) return v;
      return std::nullopt;
    };
    auto lo = index(item.substr(0, dash));
    auto hi = dash == std::string::npos ? lo : index(item.substr(dash + 1));
    if (lo && hi && *lo > *hi && *lo < layers) {
      bad(errs, "--sco-layers", fmt::format("the range {} runs backwards (ranges are low-high)", item), "'" + text + "'");
      return out;
    }
    if (!lo || !hi || *hi >= layers) {
      bad(errs, "--sco-layers",
          fmt::format("layer indices must lie in 0..{} (ranges low-high){}", layers - 1,
                      item.empty() ? ", and no item may be empty" : item == text ? "" : " (in '" + item + "')"),
          "'" + text + "'");
      return out;
    }
    for (int64_t i = *lo; i <= *hi; ++i) out[static_cast<size_t>(i)] = true;
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return out;
}

std::string divisor_list(int64_t a, int64_t b) {
  std::string out;
  int count = 0;
  for (int64_t d = 1; d <= std::min(a, b); ++d) {
    if (a % d != 0 || b % d != 0) continue;
    if (count++ == 24) return out + ", ...";
    out += (out.empty() ? "" : ", ") + std::to_string(d);
  }
  return out;
}

int64_t next_pow2(int64_t v) {
  int64_t p = 1;
  while (p < v) p *= 2;
  return p;
}

}  // namespace

ResolvedRun resolve_run(const ModelSpec& model, const HardwareSpec& hw, const RunSpec& s, InputErrors& errs,
                        std::optional<int64_t> cp_override) {
  ResolvedRun r;
  auto knob = [&](const std::string& name, nlohmann::ordered_json value, bool given, const std::string& otherwise) {
    r.knobs.push_back(Knob{name, std::move(value), given ? "given" : otherwise});
  };
  const int64_t N = s.gpus;
  const int64_t S = s.context_tokens;
  const int64_t E = model.num_experts;
  const bool moe = E > 0 && model.count_layers(FfnKind::Moe) > 0;
  r.gpus = N;
  r.context_tokens = S;
  r.schedule = s.schedule;
  r.alignment_bytes = std::max<int64_t>(1, hw.allocation_alignment_bytes);
  if (N <= 0 || S <= 0) return r;  // already reported by parse_run_flags

  // Placement: nodes, EP, CP, batch.
  r.gpus_per_node = std::min(s.gpus_per_node.value_or(hw.gpus_per_node > 0 ? hw.gpus_per_node : N), N);
  r.micro_batch = s.micro_batch.value_or(1);
  // b tokens per GPU at least (S >= CP), so b <= 2^32 below; checked first, so that b x DP cannot
  // wrap (b = 2^62 at DP = 4 made it 0, and the --global-batch check divided by it).
  if (r.micro_batch > kMaxTokensPerGpu) {
    bad(errs, "--micro-batch", fmt::format("must be at most 2^32 = {}", kMaxTokensPerGpu), std::to_string(r.micro_batch));
    r.micro_batch = 1;
  }
  if (cp_override) {
    r.cp = *cp_override;
    r.cp_auto = true;
  } else {
    r.cp = s.cp.value_or(1);
  }
  if (N % r.cp != 0 || S % r.cp != 0) {
    errs.add(Diagnostic{"", "--cp", fmt::format("must divide both N = {} and S = {} (got {})", N, S, r.cp),
                        "valid: " + divisor_list(N, S) + ", or auto"});
    r.cp = 1;
  }
  if (moe) {
    r.ep = s.ep.value_or(default_ep(N, E, r.gpus_per_node));
    if (s.ep && (N % *s.ep != 0 || E % *s.ep != 0)) {
      errs.add(Diagnostic{"", "--ep", fmt::format("must divide both N = {} and E = {} (got {})", N, E, *s.ep),
                          "valid: " + divisor_list(N, E)});
      r.ep = default_ep(N, E, r.gpus_per_node);
    }
  } else {
    r.ep = 1;
    if (s.ep && *s.ep != 1) bad(errs, "--ep", "must be 1: the model has no routed experts", std::to_string(*s.ep));
  }
  const int64_t base_batch = r.micro_batch * r.dp();
  r.global_batch = s.global_batch.value_or(base_batch);
  if (s.global_batch && *s.global_batch % base_batch != 0) {
    bad(errs, "--global-batch", fmt::format("must be a multiple of b x DP = {} x {} = {}", r.micro_batch, r.dp(), base_batch),
        std::to_string(*s.global_batch));
    r.global_batch = base_batch;
  }
  r.host_memory_bytes_per_node = s.host_memory_bytes_per_node.value_or(hw.host_memory_bytes_per_node);
  if (r.host_memory_bytes_per_node <= 0)
    bad(errs, "--host-memory", "must be given: the hardware card has no host memory per node", "nothing");
  r.host_usable_fraction = kHostUsableFraction;
  r.host_fixed_bytes_per_node = kHostFixedBytesPerNode;
  r.overhead_bytes = s.overhead_bytes.value_or(hw.runtime_overhead_bytes > 0 ? hw.runtime_overhead_bytes : kDefaultOverheadBytes);
  r.overhead_calibrated = !s.overhead_bytes && hw.runtime_overhead_bytes > 0 && hw.overhead_calibrated;
  if (!s.overhead_bytes && hw.runtime_overhead_terms.present) r.overhead_terms = hw.runtime_overhead_terms;
  r.fragmentation = s.fragmentation.value_or(hw.fragmentation_fraction > 0 ? hw.fragmentation_fraction : kDefaultFragmentation);
  if (s.fragmentation && (*s.fragmentation < 0 || *s.fragmentation >= 1))
    bad(errs, "--fragmentation", "must lie in [0, 1)", num(*s.fragmentation));
  if (s.mtp && *s.mtp && model.mtp_layers == 0)
    errs.add(Diagnostic{"", "--mtp", fmt::format("cannot be on: {} has no multi-token-prediction layers (got on)", model.name),
                        "valid: off"});
  r.mtp = s.mtp.value_or(model.mtp_layers > 0) && model.mtp_layers > 0;
  if (S > model.max_position_embeddings && model.max_position_embeddings > 0)
    r.warnings.push_back(fmt::format("context S = {} exceeds the model's max_position_embeddings = {}", S,
                                     model.max_position_embeddings));

  // Routing model.
  if (moe) {
    try {
      r.imbalance = parse_routing_model(s.imbalance.value_or("balanced"));
      validate_routing_model(r.imbalance, RoutingShape{r.ep, E, model.top_k}, model.count_layers(FfnKind::Moe));
    } catch (const InputError& e) {
      for (const auto& d : e.diagnostics()) errs.add(d);
    }
  } else if (s.imbalance && *s.imbalance != "balanced") {
    bad(errs, "--imbalance", "applies to MoE models only", "'" + *s.imbalance + "'");
  }

  // Schedule presets and technique switches.
  const Schedule sch = s.schedule;
  const std::string preset = std::string("schedule ") + to_string(sch);
  r.llep = s.llep.value_or(sch == Schedule::Flatpeak) && moe;
  if (s.llep && *s.llep && !moe) bad(errs, "--llep", "cannot be on: the model has no routed experts", "on");
  const bool ring = s.ring_dtp.value_or(sch == Schedule::Flatpeak);
  r.vocab = ring ? VocabMode::RingDtp : (sch == Schedule::Practice ? VocabMode::Blocked : VocabMode::Materialized);
  const bool sco = s.sco.value_or(sch == Schedule::Flatpeak);
  r.boundaries = sco ? BoundaryMode::Sco : (sch == Schedule::Practice ? BoundaryMode::SyncOffload : BoundaryMode::Device);
  r.optimizer = s.optimizer.value_or(sch == Schedule::Flatpeak ? OptimizerPlacement::Stream : OptimizerPlacement::Gpu);

  auto technique_off = [&](bool given, const char* flag, const char* technique, const char* how) {
    if (given) errs.add(Diagnostic{"", flag, fmt::format("is a knob of {}, which is off in this plan", technique),
                                   fmt::format("turn it on with {} or --schedule flatpeak, or drop {}", how, flag)});
  };

  // Tokens per GPU: b·S/CP, at most 2^32 (the routing model's range).
  int64_t bS = 0;
  if (__builtin_mul_overflow(r.micro_batch, S, &bS) || bS / r.cp > kMaxTokensPerGpu) {
    errs.add(Diagnostic{"", "--context", fmt::format("tokens per GPU b x S / CP must be at most 2^32 (got {} x {} / {})",
                                                     r.micro_batch, S, r.cp),
                        "use a smaller --context or --micro-batch, or a larger --cp"});
    return r;
  }
  // PipelinedLLEP.
  const int64_t T = r.tokens_per_gpu();
  const int64_t experts_per_rank = moe ? E / std::max<int64_t>(1, r.ep) : 0;
  if (r.llep) {
    const int64_t rows = T * model.top_k;
    r.llep_min_rows = s.llep_min_rows.value_or(LlaKnobs{}.min_rows_per_gemm);
    // m · E/EP below must not overflow (2^62 was reported as a --context overflow); no GEMM has
    // more rows than T · k <= 2^32 · 2^16 anyway.
    if (r.llep_min_rows > kMaxTokensPerGpu) {
      bad(errs, "--llep-min-rows", fmt::format("must lie in 1..2^32 = {}", kMaxTokensPerGpu), std::to_string(r.llep_min_rows));
      r.llep_min_rows = LlaKnobs{}.min_rows_per_gemm;
    }
    const int64_t cap_default = std::min(rows, std::max<int64_t>(8192, r.llep_min_rows * experts_per_rank));
    r.chunk_cap_rows = s.chunk_cap_rows.value_or(cap_default);
    if (s.chunk_cap_rows && *s.chunk_cap_rows > rows) {
      bad(errs, "--chunk-cap-rows", fmt::format("must lie in 0..T x k = {}", rows), std::to_string(*s.chunk_cap_rows));
      r.chunk_cap_rows = cap_default;
    }
    r.dispatch_mode = s.dispatch_mode.value_or(r.chunk_cap_rows > 0 ? DispatchMode::Recompute : DispatchMode::Store);
    // The LLA defaults are clamped to EP (at EP = 1, alpha = lambda = 1: nothing to balance, the
    // rounds still cap the dispatch); a value given out of range is an error.
    r.llep_alpha = s.llep_alpha.value_or(std::min(LlaKnobs{}.llep_alpha, static_cast<double>(r.ep)));
    if (r.llep_alpha < 1.0 || r.llep_alpha > static_cast<double>(r.ep)) {
      bad(errs, "--llep-alpha", fmt::format("must lie in [1, EP = {}]", r.ep), num(r.llep_alpha));
      r.llep_alpha = LlaKnobs{}.llep_alpha;
    }
    r.llep_lambda = s.llep_lambda.value_or(std::min(LlaKnobs{}.imbalance_trigger, static_cast<double>(r.ep)));
    if (r.llep_lambda < 0 || r.llep_lambda > static_cast<double>(r.ep)) {
      bad(errs, "--llep-lambda", fmt::format("must lie in [0, EP = {}]", r.ep), num(r.llep_lambda));
      r.llep_lambda = 1.3;
    }
    r.striping = s.striping.value_or(true);
    r.dispatch_depth = s.dispatch_depth.value_or(2);
    if (r.dispatch_depth > 4) {
      bad(errs, "--dispatch-depth", "must lie in 1..4", std::to_string(r.dispatch_depth));
      r.dispatch_depth = 2;
    }
    knob("llep", true, s.llep.has_value(), preset);
    knob("chunk_cap_rows", r.chunk_cap_rows, s.chunk_cap_rows.has_value(), "default: max(8192, m x E/EP), at most T x k");
    knob("dispatch_mode", to_string(r.dispatch_mode), s.dispatch_mode.has_value(),
         "default: recompute with a cap, store without");
    knob("llep_alpha", r.llep_alpha, s.llep_alpha.has_value(), "default (LLEP reference code)");
    knob("llep_lambda", r.llep_lambda, s.llep_lambda.has_value(), "default (LLEP paper and README)");
    knob("llep_min_rows", r.llep_min_rows, s.llep_min_rows.has_value(), "default (LLEP paper m)");
    knob("striping", r.striping, s.striping.has_value(), "default");
    knob("dispatch_depth", r.dispatch_depth, s.dispatch_depth.has_value(), "default: double buffering");
  } else {
    if (moe) knob("llep", false, s.llep.has_value(), preset);
    const char* how = "--llep on";
    technique_off(s.chunk_cap_rows.has_value(), "--chunk-cap-rows", "PipelinedLLEP", how);
    technique_off(s.dispatch_mode.has_value(), "--dispatch-mode", "PipelinedLLEP", how);
    technique_off(s.llep_alpha.has_value(), "--llep-alpha", "PipelinedLLEP", how);
    technique_off(s.llep_lambda.has_value(), "--llep-lambda", "PipelinedLLEP", how);
    technique_off(s.llep_min_rows.has_value(), "--llep-min-rows", "PipelinedLLEP", how);
    technique_off(s.striping.has_value(), "--striping", "PipelinedLLEP", how);
    technique_off(s.dispatch_depth.has_value(), "--dispatch-depth", "PipelinedLLEP", how);
  }

  // Vocabulary: materialized, blocked (R = 1) or Ring-DTP.
  const int64_t V = model.vocab_size;
  const int64_t H = model.hidden_size;
  knob("vocab", to_string(r.vocab), s.ring_dtp.has_value(), preset);
  if (r.vocab == VocabMode::Materialized) {
    const char* how = "--ring-dtp on";
    technique_off(s.ring_size.has_value(), "--ring-size", "Ring-DTP", how);
    technique_off(s.ring_rotate.has_value(), "--ring-rotate", "Ring-DTP", how);
    technique_off(s.vocab_backward.has_value(), "--vocab-backward", "blocked cross-entropy or Ring-DTP", how);
    technique_off(s.token_block.has_value(), "--token-block", "blocked cross-entropy or Ring-DTP", how);
    technique_off(s.vocab_block.has_value(), "--vocab-block", "blocked cross-entropy or Ring-DTP", how);
  } else {
    if (r.vocab == VocabMode::RingDtp) {
      int64_t ring_default = 1;
      for (int64_t d = 1; d <= std::min(N, r.gpus_per_node); ++d)
        if (N % d == 0) ring_default = d;
      r.ring_size = s.ring_size.value_or(ring_default);
      if (s.ring_size && N % *s.ring_size != 0) {
        errs.add(Diagnostic{"", "--ring-size", fmt::format("must divide N = {} (got {})", N, *s.ring_size),
                            "valid: " + divisor_list(N, N)});
        r.ring_size = ring_default;
      }
      // Bytes per hop: an activation block [T, H] vs a weight shard [V/R, H].
      const RingRotate auto_rotate = ceil_div(V, r.ring_size) <= T ? RingRotate::Weights : RingRotate::Activations;
      r.ring_rotate = s.ring_rotate.value_or(auto_rotate);
      r.vocab_backward = s.vocab_backward.value_or(VocabBackward::Recompute);
      r.token_block = s.token_block.value_or(std::min(T, kDefaultTokenBlock));
      knob("ring_size", r.ring_size, s.ring_size.has_value(), "default: largest divisor of N <= gpus per node");
      knob("ring_rotate", to_string(r.ring_rotate), s.ring_rotate.has_value(),
           "default: fewer bytes per hop ([V/R, H] weights vs [T, H] activations)");
      knob("vocab_backward", to_string(r.vocab_backward), s.vocab_backward.has_value(), "default");
      knob("token_block", r.token_block, s.token_block.has_value(), "default: min(T, 8192)");
    } else {
      const char* how = "--ring-dtp on";
      technique_off(s.ring_size.has_value(), "--ring-size", "Ring-DTP", how);
      technique_off(s.ring_rotate.has_value(), "--ring-rotate", "Ring-DTP", how);
      r.ring_size = 1;
      r.ring_rotate = RingRotate::Activations;
      r.vocab_backward = s.vocab_backward.value_or(VocabBackward::InForward);
      // Liger's chunking heuristic: chunk = next_pow2(ceil(T / ceil(V / H))), at most T.
      r.token_block = s.token_block.value_or(std::min(T, next_pow2(ceil_div(T, ceil_div(V, H)))));
      knob("vocab_backward", to_string(r.vocab_backward), s.vocab_backward.has_value(), "schedule practice (Liger-style)");
      knob("token_block", r.token_block, s.token_block.has_value(), "default: Liger heuristic next_pow2(ceil(T / ceil(V/H)))");
    }
    const int64_t shard = ceil_div(V, r.ring_size);
    r.vocab_block = s.vocab_block.value_or(shard);
    knob("vocab_block", r.vocab_block, s.vocab_block.has_value(), "default: the whole vocabulary shard V/R");
    if (r.token_block < 1 || r.token_block > T) {
      bad(errs, "--token-block", fmt::format("must lie in 1..T = {}", T), std::to_string(r.token_block));
      r.token_block = std::min(T, kDefaultTokenBlock);
    }
    if (r.vocab_block > shard) {
      bad(errs, "--vocab-block", fmt::format("must lie in 1..V/R = {}", shard), std::to_string(r.vocab_block));
      r.vocab_block = shard;
    }
  }

  // Checkpoint boundaries.
  const int64_t L = model.num_layers;
  knob("boundaries", to_string(r.boundaries), s.sco.has_value(), preset);
  if (r.boundaries == BoundaryMode::Sco) {
    r.sco_layers_text = s.sco_layers.value_or("auto");
    r.sco_offloaded = parse_sco_layers(r.sco_layers_text, L, errs);
    r.sco_prefetch = s.sco_prefetch.value_or(1);
    if (r.sco_prefetch > 4) {
      bad(errs, "--sco-prefetch", "must lie in 0..4", std::to_string(r.sco_prefetch));
      r.sco_prefetch = 1;
    }
    knob("sco_layers", r.sco_layers_text, s.sco_layers.has_value(),
         "default auto: the fewest first layers whose offload makes the GPU fit (all when none does)");
    knob("sco_prefetch", r.sco_prefetch, s.sco_prefetch.has_value(), "default: boundary l-1 while layer l recomputes");
  } else {
    technique_off(s.sco_layers.has_value(), "--sco-layers", "SCO", "--sco on");
    technique_off(s.sco_prefetch.has_value(), "--sco-prefetch", "SCO", "--sco on");
    r.sco_offloaded.assign(static_cast<size_t>(L), r.boundaries == BoundaryMode::SyncOffload);
    r.sco_prefetch = 0;
  }

  // Optimizer placement.
  knob("optimizer", to_string(r.optimizer), s.optimizer.has_value(), preset);
  if (r.optimizer == OptimizerPlacement::Stream) {
    r.bucket_params = s.bucket_params.value_or(kDefaultBucketParams);
    r.bucket_depth = s.bucket_depth.value_or(2);
    if (r.bucket_depth > 8) {
      bad(errs, "--bucket-depth", "must lie in 1..8", std::to_string(r.bucket_depth));
      r.bucket_depth = 2;
    }
    knob("bucket_params", r.bucket_params, s.bucket_params.has_value(), "default: 64Mi parameters");
    knob("bucket_depth", r.bucket_depth, s.bucket_depth.has_value(), "default: two buckets in flight");
  } else {
    technique_off(s.bucket_params.has_value(), "--bucket-params", "OffloadStreamAdamW", "--optimizer stream");
    technique_off(s.bucket_depth.has_value(), "--bucket-depth", "OffloadStreamAdamW", "--optimizer stream");
  }
  return r;
}

}  // namespace flatpeak::planner
