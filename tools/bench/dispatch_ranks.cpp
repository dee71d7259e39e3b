// Predicted and measured per-rank dispatch peak of uncapped EP, LLEP and PipelinedLLEP at EP = 4
// (thread ranks), per routing model: for each, the plan `flatpeak plan` makes (Qwen3-30B-A3B on
// 4 × H200, --ep 4, 64K context by default) verified as `flatpeak verify PLAN --scale auto
// --component dispatch` does it (tools/verify/verify_dispatch_ranks.cpp): one MoE layer's
// forward, recompute and backward on 4 ranks, the merged peak row (the rank that measured the
// most), the planner's prediction on the realised routing, and PipelinedLLEP's stated bound.
//   dispatch_ranks                                   # the executor/README.md table
//   dispatch_ranks --model gpt-oss-120b --context 128K
#include <cstdio>
#include <stdexcept>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "plan.h"
#include "run_spec.h"
#include "spec/errors.h"
#include "spec/hardware_loader.h"
#include "spec/model_loader.h"
#include "verify_common.h"
#include "verify_config.h"
#include "verify_ranks.h"
#include "verify_run.h"

using namespace flatpeak;
using namespace flatpeak::cli;

namespace {

using Flags = std::vector<std::pair<std::string, std::string>>;

VerifyInputs plan_inputs(const std::string& model_name, const Flags& flags) {
  const ModelSpec model = load_model(model_name);
  const HardwareSpec hardware = load_hardware("H200");
  InputErrors errs;
  const planner::RunSpec spec = planner::parse_run_flags(flags, errs);
  errs.throw_if_any();
  const nlohmann::json plan = nlohmann::json::parse(planner::plan_to_json(planner::make_plan(model, hardware, spec)).dump());
  return read_plan_inputs(plan, "plan.json");
}

const VerifyRow* find_row(const VerifyReport& r, const std::string& phase) {
  for (const auto& x : r.rows)
    if (x.phase == phase) return &x;
  return nullptr;
}

double mib(int64_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0); }

// A number that follows `key` in one of the report's notes (0 when none).
double note_value(const VerifyReport& r, const std::string& key) {
  for (const auto& note : r.notes) {
    const size_t at = note.find(key);
    if (at != std::string::npos) return std::stod(note.substr(at + key.size()));
  }
  return 0.0;
}

struct Measured {
  int64_t predicted = 0, measured = 0, bound = 0;
  int rank = 0;
  double rho = 0.0, rho_after = 0.0;
};

}  // namespace

int main(int argc, char** argv) {
  std::string model = "Qwen3-30B-A3B", context = "64K";
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--model") == 0) model = argv[i + 1];
    else if (std::strcmp(argv[i], "--context") == 0) context = argv[i + 1];
    else {
      std::fprintf(stderr, "dispatch_ranks: unknown flag %s (--model M, --context S)\n", argv[i]);
      return 2;
    }
  }
  struct Schedule {
    const char* name;
    Flags flags;
  };
  const std::vector<Schedule> schedules{{"uncapped EP", {{"--schedule", "baseline"}}},
                                        {"LLEP", {{"--schedule", "flatpeak"}, {"--chunk-cap-rows", "0"}}},
                                        {"PipelinedLLEP", {{"--schedule", "flatpeak"}}}};
  std::string shape;
  std::vector<std::pair<std::string, std::vector<Measured>>> table;
  for (const char* routing : {"rho=1", "rho=2.5", "rho=4", "hot-expert=0.5,1"}) {
    std::vector<Measured> row;
    for (const Schedule& sched : schedules) {
      Flags flags{{"--gpus", "4"}, {"--ep", "4"}, {"--context", context}, {"--imbalance", routing}};
      flags.insert(flags.end(), sched.flags.begin(), sched.flags.end());
      try {
        const VerifyInputs in = plan_inputs(model, flags);
        const ScaledConfig s = scale_config(in, std::nullopt, 8);
        const VerifyReport r = run_component_on_ranks(verify_dispatch_ranks, in, s, nullptr, static_cast<int>(s.ranks), nullptr);
        const VerifyRow* peak = find_row(r, "peak");
        const VerifyRow* bound = find_row(r, "bound");
        if (!peak) throw std::runtime_error("no peak row");
        Measured m{peak->predicted_bytes, peak->measured_bytes, bound ? bound->predicted_bytes : 0, peak->rank,
                   note_value(r, "realised rho = "), note_value(r, "): rho ")};
        row.push_back(m);
        if (sched.name == std::string("PipelinedLLEP") && shape.empty()) {
          shape = fmt::format("T = {}, H = {}, F = {}, E = {}, k = {}", s.tokens, s.hidden, s.expert_ffn, s.num_experts, in.top_k);
          for (const auto& v : s.values)
            if (v.name.rfind("C ", 0) == 0 || v.name.rfind("m ", 0) == 0) shape += fmt::format(", {} {} -> {}", v.name, v.original, v.scaled);
        }
        for (const auto& note : r.notes) std::fprintf(stderr, "  %s / %s: %s\n", routing, sched.name, note.c_str());
      } catch (const std::exception& e) {
        std::fprintf(stderr, "dispatch_ranks: %s / %s: %s\n", routing, sched.name, e.what());
        return 4;
      }
    }
    table.emplace_back(routing, std::move(row));
  }
  std::printf("%s, 4 x H200, --ep 4, --context %s; verify --scale auto on 4 thread ranks: %s; alignment 512 B\n\n", model.c_str(),
              context.c_str(), shape.c_str());
  std::printf("| routing | realised rho (after LLA) | uncapped EP predicted / measured B (rank) | LLEP predicted / measured B (rank) "
              "| PipelinedLLEP predicted / measured B (rank) | PipelinedLLEP stated bound B | per-rank peak MiB: EP / LLEP / PipelinedLLEP |\n");
  std::printf("|---|---|---:|---:|---:|---:|---:|\n");
  for (const auto& [routing, m] : table) {
    auto cell = [](const Measured& x) {
      return fmt::format("{} / {} ({}){}", x.predicted, x.measured, x.rank,
                         x.predicted == x.measured ? "" : fmt::format(" {:+.2f}%", 100.0 * (static_cast<double>(x.measured) / static_cast<double>(x.predicted) - 1.0)));
    };
    std::printf("| %s | %.3f (%.3f) | %s | %s | %s | %lld | %.3f / %.3f / %.3f |\n", routing.c_str(), m[0].rho, m[1].rho_after,
                cell(m[0]).c_str(), cell(m[1]).c_str(), cell(m[2]).c_str(), static_cast<long long>(m[2].bound), mib(m[0].measured),
                mib(m[1].measured), mib(m[2].measured));
  }
  return 0;
}
