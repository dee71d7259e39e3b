// The subcommand table of `flatpeak` (one entry per subcommand, ninja-style). Each subcommand
// lives in cmd_<name>.cpp and provides make_<name>_command(): it declares its options on the
// CLI11 subcommand it is given and returns the function that runs it and returns an exit code.
//   Command make_models_command();   // { "models", "List ...", setup }
#pragma once

#include <CLI/CLI.hpp>

#include <functional>
#include <string>
#include <vector>

#include "spec/errors.h"

namespace flatpeak::cli {

using RunFunction = std::function<int()>;

struct Command {
  const char* name;
  const char* help;
  // Adds options to `sub` (bound to state the returned RunFunction owns) and returns the runner.
  std::function<RunFunction(CLI::App& sub)> setup;
};

// Output format shared by subcommands: --format table|json (|csv where supported).
enum class OutputFormat { Table, Json, Csv };
void add_format_option(CLI::App& sub, OutputFormat& format, bool allow_csv = false);

Command make_models_command();
Command make_inspect_command();
Command make_plan_command();
Command make_reach_command();
Command make_sweep_command();
Command make_compare_command();
Command make_verify_command();
Command make_trace_command();

// "flatpeak: error: ..." (and "flatpeak: hint: ...") on stderr, one line each per diagnostic.
void print_input_error(const InputError& error);

}  // namespace flatpeak::cli
