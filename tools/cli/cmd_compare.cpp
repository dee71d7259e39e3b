// `flatpeak compare --model M --gpu G --gpus N --context S [--global-batch B] [--format table|json]`:
// baseline (tuned), practice and flatpeak side by side at one configuration and equal global batch
// (default 8·N/CP sequences; each schedule picks its own micro-batch and accumulation): peaks,
// step time, tokens/s, throughput ratios, and an attribution (each technique alone on the
// baseline, flatpeak without each), then the same at --imbalance rho=2.5.
// Exit 0 whenever an answer was computed, 2 on bad input.
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
#include "spec/routing.h"
#include "spec/sizes.h"

namespace flatpeak::cli {

namespace {

using ojson = nlohmann::ordered_json;

constexpr const char* kImbalanced = "rho=2.5";

struct CompareOptions {
  std::string model, gpu;
  OutputFormat format = OutputFormat::Table;
  CapacityFlags flags;
};

const std::vector<std::string> kCompareFlags = {"--gpus", "--context", "--cp", "--ep", "--gpus-per-node", "--host-memory",
                                                "--mtp", "--imbalance", "--global-batch", "--overhead", "--fragmentation"};

// tokens/s of `a` over `b`, or null with the reason.
std::pair<ojson, ojson> ratio(const planner::ScheduleRun& a, const planner::ScheduleRun& b) {
  if (!b.fits) return {nullptr, fmt::format("{} does not fit (binding: {})", b.name, b.binding())};
  if (!a.fits) return {nullptr, fmt::format("{} does not fit (binding: {})", a.name, a.binding())};
  const double r = a.search.time.tokens_per_second / b.search.time.tokens_per_second;
  return {planner::round_significant(r, 6), nullptr};
}

ojson comparison_json(const planner::Comparison& c, const ModelSpec& model) {
  ojson j;
  j["imbalance"] = c.imbalance;
  j["global_batch"] = c.global_batch;
  for (const auto& s : c.schedules) j[s.name] = planner::schedule_run_json(s, model);
  const auto [r, reason] = ratio(c.schedules[2], c.schedules[0]);
  j["throughput_ratio"] = r;
  j["throughput_ratio_reason"] = reason;
  const auto [pr, preason] = ratio(c.schedules[1], c.schedules[0]);
  j["practice_throughput_ratio"] = pr;
  j["practice_throughput_ratio_reason"] = preason;
  ojson attribution;
  for (const auto* list : {&c.alone, &c.all_but_one}) {
    ojson part;
    for (const auto& t : *list) {
      ojson tj = planner::schedule_run_json(t.run, model);
      const auto [tr, treason] = ratio(t.run, c.schedules[0]);
      tj["throughput_ratio"] = tr;
      tj["throughput_ratio_reason"] = treason;
      part[t.name] = std::move(tj);
    }
    attribution[list == &c.alone ? "alone" : "all_but_one"] = std::move(part);
  }
  j["attribution"] = std::move(attribution);
  return j;
}

std::string run_line(const std::string& name, const planner::ScheduleRun& r, const planner::ScheduleRun& base) {
  const auto& s = r.search.summary;
  const auto [x, reason] = ratio(r, base);
  return fmt::format("{:<24} {:<4} {:>4} {:>7} {:>11.4g} {:>11.0f} {:>6.1f}  {:<11} {:<11} {:>22} {:>10}\n", name,
                     r.fits ? "yes" : "no", r.search.choice.cp,
                     fmt::format("{}x{}", r.search.choice.micro_batch, r.search.time.micro_batches), r.search.time.step_seconds,
                     r.search.time.tokens_per_second, 100 * r.search.time.mfu, r.binding(), r.search.time.bound_by,
                     format_bytes(s.required_bytes) + " / " + format_bytes(s.budget_bytes),
                     x.is_null() ? "-" : fmt::format("{:.3g}x", x.get<double>()));
}

std::string comparison_table(const planner::Comparison& c) {
  std::string out = fmt::format("routing {}, global batch {} sequences\n", c.imbalance, c.global_batch);
  out += fmt::format("{:<24} {:<4} {:>4} {:>7} {:>11} {:>11} {:>6}  {:<11} {:<11} {:>22} {:>10}\n", "schedule", "fits", "CP",
                     "b x acc", "step s", "tokens/s", "MFU %", "binding", "bound by", "GPU required / budget", "vs base");
  for (const auto& s : c.schedules) out += run_line(s.name, s, c.schedules[0]);
  out += "baseline + one technique:\n";
  for (const auto& t : c.alone) out += run_line("  + " + t.name, t.run, c.schedules[0]);
  out += "flatpeak without one technique:\n";
  for (const auto& t : c.all_but_one) out += run_line("  - " + t.name, t.run, c.schedules[0]);
  return out;
}

int run_compare(const CLI::App& sub, const CompareOptions& o) {
  InputErrors errs;
  planner::Query q = o.flags.query(sub, errs);
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
    InputErrors resolve_errs;
    planner::resolve_run(*model, *hw, q.base, resolve_errs, q.base.cp_auto ? std::optional<int64_t>(1) : std::nullopt);
    for (const auto& d : resolve_errs.diagnostics()) errs.add(d);
  }
  errs.throw_if_any();
  const int64_t S = q.base.context_tokens;
  const planner::Comparison main = planner::compare(*model, *hw, q, S);
  const bool moe = model->num_experts > 0 && model->count_layers(FfnKind::Moe) > 0;
  std::optional<planner::Comparison> skewed;
  std::string skewed_reason;
  if (!moe) {
    skewed_reason = "the model has no routed experts";
  } else {
    planner::Query qi = q;
    qi.base.imbalance = kImbalanced;
    // rho = 2.5 needs EP·min(k, E/EP)/k >= 2.5: checked here, since the search treats a
    // configuration it cannot resolve as not fitting and would print a table of zeros.
    InputErrors skew_errs;
    planner::resolve_run(*model, *hw, qi.base, skew_errs, qi.base.cp_auto ? std::optional<int64_t>(1) : std::nullopt);
    if (!skew_errs.empty()) {
      skewed_reason = skew_errs.diagnostics().front().message;
    } else {
      try {
        skewed = planner::compare(*model, *hw, qi, S);
      } catch (const InputError& e) {
        skewed_reason = e.diagnostics().front().to_string();
      }
    }
  }
  const std::string cp = q.base.cp_auto ? "auto" : std::to_string(q.base.cp.value_or(1));
  if (o.format == OutputFormat::Json) {
    ojson j;
    j["model"] = model->name;
    j["gpu"] = hw->name;
    j["gpus"] = q.base.gpus;
    j["context_tokens"] = S;
    j["cp"] = cp;
    ojson m = comparison_json(main, *model);
    for (auto& [key, value] : m.items()) j[key] = value;
    j["imbalanced"] = skewed ? comparison_json(*skewed, *model) : ojson(nullptr);
    if (!skewed) j["imbalanced_reason"] = skewed_reason;
    std::cout << j.dump(2) << "\n";
    return kExitOk;
  }
  std::cout << fmt::format("compare: {} on {} x {}, S = {}, CP {}\n", model->name, q.base.gpus, hw->name, tokens_text(S), cp);
  std::cout << comparison_table(main);
  if (skewed) std::cout << "\nat --imbalance " << kImbalanced << ": " << comparison_table(*skewed);
  else std::cout << "\nat --imbalance " << kImbalanced << ": not computed: " << skewed_reason << "\n";
  return kExitOk;
}

}  // namespace

Command make_compare_command() {
  return Command{"compare",
                 "Baseline, practice and flatpeak side by side at one configuration: peaks, step time, throughput, "
                 "attribution per technique",
                 [](CLI::App& sub) -> RunFunction {
                   auto options = std::make_shared<CompareOptions>();
                   sub.add_option("--model", options->model, "Model card name or alias, or a path")->required();
                   sub.add_option("--gpu", options->gpu, "Hardware card name or alias, or a path")->required();
                   options->flags.add_to(sub, kCompareFlags);
                   add_format_option(sub, options->format);
                   return [options, &sub]() { return run_compare(sub, *options); };
                 }};
}

}  // namespace flatpeak::cli
