// Shared by `plan` (the time and knob lines of its table) and the capacity subcommands `reach`,
// `sweep` and `compare`: the run flags they accept, their parsing into a planner::Query, lists
// and context ranges for sweeps, and table helpers.
//   CapacityFlags f;  f.add_to(sub, {"--gpus", "--cp", "--imbalance"});
//   planner::Query q = f.query(sub, errs);   // every bad flag added to errs
#pragma once

#include <map>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "knob_search.h"
#include "plan.h"
#include "reach.h"
#include "spec/errors.h"

namespace flatpeak::cli {

std::string efficiency_help();

// The time, searched-knob and diagnosis lines printed under `plan`'s table.
std::string format_plan_time(const planner::Plan& plan);

// Run flags of the capacity subcommands, registered on a CLI11 subcommand by name.
class CapacityFlags {
 public:
  // `names`: run flags (planner::run_flags() names) this subcommand accepts; --efficiency is
  // always added.
  void add_to(CLI::App& sub, const std::vector<std::string>& names);
  // Parses the given flags into a Query (base.context_tokens stays 0 unless --context is given).
  // --gpus is required unless `gpus_required` is false.
  planner::Query query(const CLI::App& sub, InputErrors& errs, bool gpus_required = true) const;
  bool given(const CLI::App& sub, const std::string& name) const { return sub.count(name) > 0; }
  const std::string& text(const std::string& name) const { return values_.at(name); }

 private:
  std::vector<std::string> names_;
  std::map<std::string, std::string> values_;
  std::string efficiency_;
};

// "a,b,c" -> items; an empty list or item is an error naming `flag`.
std::vector<std::string> split_list(const std::string& text, const std::string& flag, InputErrors& errs);
// Contexts: "32K,64K", "32K:1M" (doubling from a to b) or both mixed; errors name --context.
std::vector<int64_t> parse_contexts(const std::string& text, InputErrors& errs);
// Positive integers up to max_value: "8,16,32"; errors name `flag`.
std::vector<int64_t> parse_counts(const std::string& text, const std::string& flag, InputErrors& errs,
                                  int64_t max_value = planner::kMaxGpus);

// "1M" / "1.5M"-free token spelling and byte sizes for tables.
std::string tokens_text(int64_t tokens);

}  // namespace flatpeak::cli
