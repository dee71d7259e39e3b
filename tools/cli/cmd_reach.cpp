// `flatpeak reach --model M --gpu G --gpus N [--cp N|auto] [--target-context S] [--format table|json]`:
// the largest context that fits for baseline (tuned), practice and flatpeak at the same N, EP,
// routing and allowed CP set (bisection over multiples of 1024; the largest power of two too),
// or with --target-context the smallest N (a power of two) and CP at which each fits S.
// Exit 0 whenever an answer was computed (also when nothing fits), 2 on bad input.
#include <iostream>
#include <memory>
#include <string>

#include <fmt/format.h>

#include "capacity_common.h"
#include "commands.h"
#include "exit_codes.h"
#include "reach.h"
#include "spec/hardware_loader.h"
#include "spec/model_loader.h"
#include "spec/sizes.h"

namespace flatpeak::cli {

namespace {

using ojson = nlohmann::ordered_json;

struct ReachOptions {
  std::string model, gpu, target_context, max_gpus;
  OutputFormat format = OutputFormat::Table;
  CapacityFlags flags;
};

const std::vector<std::string> kReachFlags = {"--gpus",     "--cp",       "--ep",       "--gpus-per-node", "--host-memory",
                                              "--mtp",      "--imbalance", "--overhead", "--fragmentation"};

std::string cp_text(const planner::RunSpec& base) {
  return base.cp_auto ? "auto" : std::to_string(base.cp.value_or(1));
}

int64_t resolved_ep(const ModelSpec& m, const planner::RunSpec& base, const HardwareSpec& hw) {
  if (base.ep) return *base.ep;
  // As resolve_run: a model whose layers are all dense runs at EP = 1 whatever its expert count.
  if (m.num_experts <= 0 || m.count_layers(FfnKind::Moe) == 0) return 1;
  const int64_t gpn = std::min(base.gpus_per_node.value_or(hw.gpus_per_node > 0 ? hw.gpus_per_node : base.gpus), base.gpus);
  return planner::default_ep(base.gpus, m.num_experts, gpn);
}

int run_reach_query(const ModelSpec& model, const HardwareSpec& hw, const planner::Query& q, OutputFormat format) {
  const std::vector<planner::Reach> r = planner::reach(model, hw, q);
  const planner::Reach& base = r[0];
  const planner::Reach& flat = r[2];
  ojson ratio = nullptr, ratio_reason = nullptr;
  if (base.max_context_tokens > 0)
    ratio = planner::round_significant(static_cast<double>(flat.max_context_tokens) / static_cast<double>(base.max_context_tokens), 6);
  else
    ratio_reason = fmt::format("the baseline fits no context (not even {} tokens): its binding peak is {}",
                               std::max<int64_t>(1024, base.at_max.search.choice.cp), base.binding);
  if (format == OutputFormat::Json) {
    ojson j;
    j["model"] = model.name;
    j["gpu"] = hw.name;
    j["gpus"] = q.base.gpus;
    j["ep"] = resolved_ep(model, q.base, hw);
    j["cp"] = cp_text(q.base);
    j["imbalance"] = q.base.imbalance.value_or("balanced");
    j["limit_tokens"] = q.limit_tokens;
    for (const planner::Reach& s : r) {
      ojson sj;
      sj["max_context_tokens"] = s.max_context_tokens;
      sj["max_power_of_two_tokens"] = s.max_power_of_two_tokens;
      sj["at_limit"] = s.at_limit;
      sj["cp"] = s.max_context_tokens > 0 ? ojson(s.cp) : ojson(nullptr);
      sj["binding"] = s.binding;
      sj["at_max"] = planner::schedule_run_json(s.at_max, model);
      j[s.schedule] = std::move(sj);
    }
    j["reach_ratio"] = ratio;
    j["reach_ratio_reason"] = ratio_reason;
    std::cout << j.dump(2) << "\n";
    return kExitOk;
  }
  std::cout << fmt::format("reach: {} on {} x {}, EP = {}, CP {}, routing {}\n\n", model.name, q.base.gpus, hw.name,
                           resolved_ep(model, q.base, hw), cp_text(q.base), q.base.imbalance.value_or("balanced"));
  std::cout << fmt::format("{:<10} {:>12} {:>12} {:>5}  {:<11} {:<9} {:>22} {:>14}\n", "schedule", "max context",
                           "power of 2", "CP", "binding", "optimizer", "GPU required / budget", "host per node");
  for (const planner::Reach& s : r) {
    const auto& sum = s.at_max.search.summary;
    std::cout << fmt::format("{:<10} {:>12} {:>12} {:>5}  {:<11} {:<9} {:>22} {:>14}\n", s.schedule,
                             tokens_text(s.max_context_tokens) + (s.at_limit ? "+" : ""), tokens_text(s.max_power_of_two_tokens),
                             s.max_context_tokens > 0 ? std::to_string(s.cp) : "-", s.binding, to_string(s.at_max.optimizer),
                             format_bytes(sum.required_bytes) + " / " + format_bytes(sum.budget_bytes),
                             format_bytes(sum.host_peak_bytes));
  }
  if (ratio.is_null()) std::cout << "\nreach ratio (flatpeak / baseline): n/a: " << ratio_reason.get<std::string>() << "\n";
  else std::cout << fmt::format("\nreach ratio (flatpeak / baseline): {:.3g}x\n", ratio.get<double>());
  std::cout << "binding: the peak that does not fit 1024 tokens beyond the largest context (\"host\": host memory).\n";
  return kExitOk;
}

int run_target_query(const ModelSpec& model, const HardwareSpec& hw, const planner::Query& q, int64_t context,
                     int64_t max_gpus, OutputFormat format) {
  std::vector<planner::TargetFit> r;
  try {
    r = planner::reach_target(model, hw, q, context, max_gpus);
  } catch (const InputError& e) {
    // The search plans at the target context: its errors about the context are the target's.
    std::vector<Diagnostic> out = e.diagnostics();
    for (Diagnostic& d : out)
      if (d.pointer == "--context") d.pointer = "--target-context";
    throw InputError(out);
  }
  if (format == OutputFormat::Json) {
    ojson j;
    j["model"] = model.name;
    j["gpu"] = hw.name;
    j["context_tokens"] = context;
    j["cp"] = cp_text(q.base);
    j["max_gpus"] = max_gpus;
    for (const planner::TargetFit& t : r) {
      ojson sj;
      sj["gpus"] = t.gpus > 0 ? ojson(t.gpus) : ojson(nullptr);
      sj["cp"] = t.gpus > 0 ? ojson(t.cp) : ojson(nullptr);
      sj["binding"] = t.at.binding();
      sj["at"] = planner::schedule_run_json(t.at, model);
      j[t.schedule] = std::move(sj);
    }
    std::cout << j.dump(2) << "\n";
    return kExitOk;
  }
  std::cout << fmt::format("reach: smallest N (a power of two) and CP at which {} fits S = {} on {}, CP {}\n\n", model.name,
                           tokens_text(context), hw.name, cp_text(q.base));
  std::cout << fmt::format("{:<10} {:>8} {:>5}  {:<11} {:>22}\n", "schedule", "GPUs", "CP", "binding", "GPU required / budget");
  for (const planner::TargetFit& t : r) {
    const auto& sum = t.at.search.summary;
    std::cout << fmt::format("{:<10} {:>8} {:>5}  {:<11} {:>22}\n", t.schedule,
                             t.gpus > 0 ? std::to_string(t.gpus) : "> " + std::to_string(max_gpus),
                             t.gpus > 0 ? std::to_string(t.cp) : "-", t.at.binding(),
                             format_bytes(sum.required_bytes) + " / " + format_bytes(sum.budget_bytes));
  }
  return kExitOk;
}

int run_reach(const CLI::App& sub, const ReachOptions& o) {
  InputErrors errs;
  planner::Query q = o.flags.query(sub, errs, sub.count("--target-context") == 0);
  std::optional<int64_t> target, max_gpus;
  if (sub.count("--target-context") > 0) {
    target = parse_tokens(o.target_context);
    if (!target && tokens_beyond_int64(o.target_context))
      errs.add(Diagnostic{"", "--target-context", fmt::format("is too large: must be below 2^63 (got '{}')", o.target_context),
                          "valid: a token count such as 1M"});
    else if (!target)
      errs.add(Diagnostic{"", "--target-context", fmt::format("must be a positive token count (got '{}')", o.target_context),
                          "valid: a token count such as 1M"});
  }
  if (sub.count("--target-context") > 0 && sub.count("--gpus") > 0)
    errs.add(Diagnostic{"", "--gpus", "is not used with --target-context, which searches the GPU count (got " +
                                          sub.get_option("--gpus")->as<std::string>() + ")",
                        "drop --gpus; --max-gpus bounds the search"});
  if (sub.count("--max-gpus") > 0) {
    max_gpus = parse_tokens(o.max_gpus);
    if (!max_gpus && !tokens_beyond_int64(o.max_gpus))
      errs.add(Diagnostic{"", "--max-gpus", fmt::format("must be a positive integer (got '{}')", o.max_gpus), ""});
    else if (!max_gpus || *max_gpus > planner::kMaxGpus)
      errs.add(Diagnostic{"", "--max-gpus", fmt::format("must be at most 2^24 = {} (got '{}')", planner::kMaxGpus, o.max_gpus), ""});
  }
  std::unique_ptr<ModelSpec> model;
  std::unique_ptr<HardwareSpec> hw;
  try {
    model = std::make_unique<ModelSpec>(load_model(o.model));
  } catch (const InputError& e) {
    for (const auto& d : e.diagnostics()) errs.add(d);
  }
  try {
    hw = std::make_unique<HardwareSpec>(load_hardware(o.gpu));
  } catch (const InputError& e) {
    for (const auto& d : e.diagnostics()) errs.add(d);
  }
  if (model && hw && errs.empty()) {
    // The flags' cross-field rules (EP divides N and E, ...) at the smallest context.
    InputErrors resolve_errs;
    planner::RunSpec probe = q.base;
    probe.context_tokens = std::max<int64_t>(1024, probe.cp.value_or(1));
    if (target) probe.context_tokens = *target;
    planner::resolve_run(*model, *hw, probe, resolve_errs, q.base.cp_auto ? std::optional<int64_t>(1) : std::nullopt);
    for (const auto& d : resolve_errs.diagnostics())
      if (!target || d.pointer != "--cp") errs.add(d);
  }
  errs.throw_if_any();
  if (target) return run_target_query(*model, *hw, q, *target, max_gpus.value_or(65536), o.format);
  return run_reach_query(*model, *hw, q, o.format);
}

}  // namespace

Command make_reach_command() {
  return Command{
      "reach",
      "Largest context that fits for baseline, practice and flatpeak (or, with --target-context, the smallest N)",
      [](CLI::App& sub) -> RunFunction {
        auto options = std::make_shared<ReachOptions>();
        sub.add_option("--model", options->model, "Model card name or alias, or a path to a card or config.json")->required();
        sub.add_option("--gpu", options->gpu, "Hardware card name or alias (H100-80GB, H200, ...), or a path")->required();
        options->flags.add_to(sub, kReachFlags);
        sub.add_option("--target-context", options->target_context,
                       "Instead of the largest context: the smallest N (a power of two) and CP at which each schedule fits this context");
        sub.add_option("--max-gpus", options->max_gpus, "--target-context: the largest N tried (default 65536)");
        add_format_option(sub, options->format);
        return [options, &sub]() { return run_reach(sub, *options); };
      }};
}

}  // namespace flatpeak::cli
