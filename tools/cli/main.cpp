// flatpeak: the command-line entry point. Parses the subcommand from the table in commands.h,
// runs it, and maps every error to the documented exit code. Diagnostics go to stderr as
// "flatpeak: error: ...", results to stdout.
#include <cstdio>
#include <exception>
#include <iostream>
#include <map>
#include <new>
#include <string>
#include <vector>

#include "commands.h"
#include "exit_codes.h"
#include "spec/errors.h"

namespace flatpeak::cli {

void add_format_option(CLI::App& sub, OutputFormat& format, bool allow_csv) {
  std::map<std::string, OutputFormat> names{{"table", OutputFormat::Table}, {"json", OutputFormat::Json}};
  std::vector<std::string> keys{"table", "json"};
  if (allow_csv) {
    names.emplace("csv", OutputFormat::Csv);
    keys.emplace_back("csv");
  }
  // The names only: CheckedTransformer alone also took the enum's numbers ("--format 1" gave json).
  // A later transform runs first.
  sub.add_option("--format", format, allow_csv ? "Output format: table, json or csv" : "Output format: table or json")
      ->transform(CLI::CheckedTransformer(names).description(""))
      ->transform(CLI::IsMember(keys).description(""))
      ->type_name(allow_csv ? "table|json|csv" : "table|json")
      ->default_str("table");
}

void print_input_error(const InputError& error) {
  for (const auto& diagnostic : error.diagnostics()) {
    std::cerr << "flatpeak: error: " << diagnostic.to_string() << "\n";
    if (!diagnostic.hint.empty()) std::cerr << "flatpeak: hint: " << diagnostic.hint << "\n";
  }
}

namespace {

std::vector<Command> command_table() {
  return {
      make_models_command(),
      make_inspect_command(),
      make_plan_command(),
      make_reach_command(),
      make_sweep_command(),
      make_compare_command(),
      make_verify_command(),
      make_trace_command(),
  };
}

int run(int argc, char** argv) {
  CLI::App app{"flatpeak: will one training step of an MoE model at this context fit on these GPUs, "
               "which memory peak runs out first, and with which schedule does it fit at the best speed?"};
  app.set_version_flag("--version", std::string("flatpeak ") + FLATPEAK_VERSION);
  app.require_subcommand(1);
  app.fallthrough(false);

  const std::vector<Command> table = command_table();
  std::vector<std::pair<CLI::App*, RunFunction>> runners;
  for (const auto& command : table) {
    CLI::App* sub = app.add_subcommand(command.name, command.help);
    runners.emplace_back(sub, command.setup(*sub));
  }

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::string message = e.what();
    // An unknown subcommand arrives as an extra positional; suggest the nearest name.
    if (argc > 1 && app.get_subcommands().empty()) {
      std::vector<std::string> names;
      for (const auto& command : table) names.emplace_back(command.name);
      const std::string guess = did_you_mean(argv[1], names);
      std::cerr << "flatpeak: error: unknown subcommand '" << argv[1] << "'\n";
      if (!guess.empty()) std::cerr << "flatpeak: hint: did you mean '" << guess << "'?\n";
      std::cerr << "flatpeak: hint: run 'flatpeak --help' for the list of subcommands\n";
      return kExitInput;
    }
    std::cerr << "flatpeak: error: " << message << "\n";
    return kExitInput;
  }

  for (auto& [sub, runner] : runners) {
    if (sub->parsed()) return runner();
  }
  return kExitInternal;
}

}  // namespace
}  // namespace flatpeak::cli

int main(int argc, char** argv) {
  using namespace flatpeak::cli;
  try {
    const int code = run(argc, argv);
    std::cout.flush();
    // A full disk or a closed pipe is the machine's failure, not a bug: the runtime code.
    if (!std::cout) {
      std::cerr << "flatpeak: error: could not write the result to standard output\n";
      return kExitBackend;
    }
    return code;
  } catch (const flatpeak::InputError& e) {
    print_input_error(e);
    return kExitInput;
  } catch (const std::bad_alloc&) {
    std::cerr << "flatpeak: error: out of host memory\n";
    return kExitBackend;
  } catch (const std::exception& e) {
    std::cerr << "flatpeak: error: internal error: " << e.what() << "\n";
    return kExitInternal;
  }
}
