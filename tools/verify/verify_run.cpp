// `flatpeak verify`: the components and their order (verify_run.h). Each component plans the
// scaled configuration, runs it with the executor and appends its rows (verify_<component>.cpp).
#include "verify_run.h"

#include <cmath>

#include "verify_common.h"

namespace flatpeak::cli {

namespace {

using ComponentRun = void (*)(const VerifyContext&, VerifyReport&);

struct Component {
  const char* name;
  ComponentRun run;              // one rank
  ComponentRun run_multi_rank;   // every rank of a multi-rank configuration; nullptr: one rank only
  bool implemented;              // false: refused by --component, skipped by default
};

// Report order: the techniques' components first, then the layer and the whole step.
const Component kComponents[] = {
    {"dispatch", verify_dispatch, nullptr, false},
    {"vocab", verify_vocab, nullptr, true},
    {"checkpoint", verify_checkpoint, nullptr, false},
    {"optimizer", verify_optimizer, nullptr, false},
    {"layer", verify_layer, nullptr, false},
    {"step", verify_step, nullptr, false},
};

}  // namespace

std::vector<std::string> verify_components() {
  std::vector<std::string> names;
  for (const auto& c : kComponents)
    if (c.implemented) names.emplace_back(c.name);
  return names;
}

VerifyReport run_verification(const VerifyInputs& in, const ScaledConfig& scaled,
                              const std::vector<std::string>& components, double tolerance,
                              const PredictionAdjust& adjust) {
  VerifyReport report;
  report.plan_file = in.file;
  report.tolerance = tolerance;
  const VerifyContext ctx{in, scaled, adjust};
  for (const auto& c : kComponents)
    for (const auto& wanted : components)
      if (c.implemented && wanted == c.name) c.run(ctx, report);
  for (const auto& row : report.rows)
    if (!(std::fabs(row.relative_error) <= tolerance)) report.pass = false;
  return report;
}

}  // namespace flatpeak::cli
