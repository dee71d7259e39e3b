// `flatpeak plan --model M --gpu G --gpus N --context S [run flags] [--format table|json]`:
// the per-GPU memory timeline of one training step, its five peaks, and whether GPU and host
// fit. Exit 0 when it fits, 3 when it does not (the plan is still printed), 2 on bad input.
#include <iostream>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "capacity_common.h"
#include "commands.h"
#include "exit_codes.h"
#include "knob_search.h"
#include "plan.h"
#include "plan_table.h"
#include "spec/hardware_loader.h"
#include "spec/model_loader.h"

namespace flatpeak::cli {

namespace {

struct PlanOptions {
  std::string model;
  std::string gpu;
  OutputFormat format = OutputFormat::Table;
  std::map<std::string, std::string> values;  // run flag -> text as given
  std::string efficiency;                     // --efficiency key=value,... (step time)
};

int run_plan(const CLI::App& sub, const PlanOptions& o) {
  InputErrors errs;
  std::vector<std::pair<std::string, std::string>> flags;
  for (const auto& f : planner::run_flags())
    if (sub.count(f.name) > 0) flags.emplace_back(f.name, o.values.at(f.name));
  // Unknown flags reach the library, which names them with a did-you-mean.
  const std::vector<std::string> extras = sub.remaining();
  for (size_t i = 0; i < extras.size(); ++i) {
    const std::string& word = extras[i];
    const bool has_value = i + 1 < extras.size() && extras[i + 1].rfind("--", 0) != 0;
    flags.emplace_back(word, has_value ? extras[i + 1] : "");
    if (has_value) ++i;
  }
  const planner::RunSpec spec = planner::parse_run_flags(flags, errs);
  const planner::Efficiency efficiency =
      sub.count("--efficiency") > 0 ? planner::parse_efficiency(o.efficiency, errs) : planner::Efficiency{};
  std::unique_ptr<ModelSpec> model;
  std::unique_ptr<HardwareSpec> hardware;
  try {
    model = std::make_unique<ModelSpec>(load_model(o.model));
  } catch (const InputError& e) {
    for (const auto& d : e.diagnostics()) errs.add(d);
  }
  try {
    hardware = std::make_unique<HardwareSpec>(load_hardware(o.gpu));
  } catch (const InputError& e) {
    for (const auto& d : e.diagnostics()) errs.add(d);
  }
  if (model && hardware && errs.empty()) {
    // Cross-field rules need the model and the hardware; report them with the flag errors.
    InputErrors resolve_errs;
    planner::resolve_run(*model, *hardware, spec, resolve_errs, spec.cp_auto ? std::optional<int64_t>(1) : std::nullopt);
    for (const auto& d : resolve_errs.diagnostics()) errs.add(d);
  }
  errs.throw_if_any();

  // Knobs not given are searched (knob_search.h); the plan carries its step time and reasons.
  const planner::Plan plan = planner::make_searched_plan(*model, *hardware, spec, efficiency);
  if (o.format == OutputFormat::Json) std::cout << planner::plan_to_json(plan).dump(2) << "\n";
  else std::cout << format_plan_table(plan) << format_plan_time(plan);
  return plan.summary.fits() ? kExitOk : kExitDoesNotFit;
}

}  // namespace

Command make_plan_command() {
  return Command{
      "plan",
      "Per-GPU memory timeline of one training step: the five peaks, GPU and host fit",
      [](CLI::App& sub) -> RunFunction {
        auto options = std::make_shared<PlanOptions>();
        sub.add_option("--model", options->model, "Model card name or alias, or a path to a card or config.json")->required();
        sub.add_option("--gpu", options->gpu, "Hardware card name or alias (H100-80GB, H200, ...), or a path")->required();
        for (const auto& f : planner::run_flags()) sub.add_option(f.name, options->values[f.name], f.help);
        sub.add_option("--efficiency", options->efficiency, efficiency_help());
        add_format_option(sub, options->format);
        sub.allow_extras();
        return [options, &sub]() { return run_plan(sub, *options); };
      }};
}

}  // namespace flatpeak::cli
