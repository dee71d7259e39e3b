// `flatpeak verify PLAN.json [--scale auto|FACTOR] [--max-ranks 8] [--component C] [--tolerance X]
// [--backend cpu|cuda] [--trace OUT.json] [--perturb FACTOR] [--format table|json]`: runs the plan's schedule at a
// scale this machine holds (CPU backend: the plan's N ranks, at most --max-ranks, as threads or,
// under mpirun/srun, as the job's processes; CUDA backend: the components with a CUDA twin on one
// GPU), plans that same scaled configuration, and compares the measured bytes with the predicted
// ones phase by phase and at the component's peak. Reads only the plan's inputs and knobs. Exit 0
// when every |relative error| <= tolerance, 5 beyond it, 2 on bad input, 4 when the backend fails
// (no GPU, device memory), a failing rank's code (2 input, 4 runtime) naming the rank; under MPI
// only rank 0 prints.
#include <algorithm>
#include <cmath>
#include <iostream>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "commands.h"
#include "executor/comm/communicator.h"
#include "executor/memory/tracking_allocator.h"
#ifdef FLATPEAK_HAVE_MPI
#include "executor/comm/mpi_comm.h"
#endif
#include "exit_codes.h"
#include "numeric_flags.h"
#include "run_spec.h"
#ifdef FLATPEAK_HAVE_CUDA_BACKEND
#include "cuda/verify_cuda.h"
#include "executor/cuda/backend_error.h"
#endif
#include "spec/errors.h"
#include "spec/json_util.h"
#include "spec/output_file.h"
#include "spec/sizes.h"
#include "verify_config.h"
#include "verify_run.h"

namespace flatpeak::cli {

namespace {

struct VerifyOptions {
  std::string plan_path;
  std::string scale = "auto";
  int64_t max_ranks = 8;
  std::string component;
  double tolerance = 0.01;
  bool tolerance_given = false;  // else 1 % on the cpu backend, 3 % on cuda (DESIGN.md)
  bool component_given = false;
  std::string backend = "cpu";
  std::string trace_path;
  std::string perturb;  // every predicted byte is multiplied by it (a self-test), when given
  bool perturb_given = false;
  OutputFormat format = OutputFormat::Table;
};

// The plan file, read and parsed like every other input (folders, endless files and syntax errors
// are input errors naming the file, the latter with line:column).
nlohmann::json read_json_file(const std::string& path) { return parse_json_text(read_text_file(path), path); }

std::optional<double> parse_scale(const std::string& text) {
  if (text == "auto") return std::nullopt;
  const std::optional<double> v = parse_decimal(text);  // no hex: 0x10 is a typo, not 16
  if (!v || !(*v >= 1.0))
    throw InputError({Diagnostic{"", "--scale", "must be auto or a decimal number >= 1 (got '" + text + "')", ""}});
  return v;
}

// --perturb: a decimal factor in (0, 10], not hex (as --scale).
double parse_perturb(const std::string& text) {
  const std::optional<double> v = parse_decimal(text);
  if (!v || !(*v > 0.0 && *v <= 10.0))
    throw InputError({Diagnostic{"", "--perturb", "must be a decimal factor above 0 and at most 10 (got '" + text + "')",
                                 "1.02 raises every prediction by 2 %"}});
  return *v;
}

// Every predicted figure of every phase (each category and the total, device and host) times
// `factor`, rounded to a byte: a planner wrong by that factor everywhere, which verify must catch.
PredictionAdjust perturbation(double factor) {
  return [factor](nlohmann::ordered_json& timeline) {
    for (auto& phase : timeline["phases"])
      for (const char* space : {"device", "host"}) {
        if (!phase.contains(space)) continue;
        for (auto& figure : phase[space])
          if (figure.is_number()) figure = static_cast<int64_t>(std::llround(figure.get<double>() * factor));
      }
  };
}

// "unresolved": nothing failed, but some rows could not be judged at this scale (exit 2).
const char* verdict(const VerifyReport& r) { return !r.pass ? "fail" : r.unresolved_rows > 0 ? "unresolved" : "pass"; }

std::string signed_percent(double e) { return fmt::format("{:+.3f}%", 100.0 * e); }

void print_table(const VerifyReport& r, const ScaledConfig& s) {
  const std::string ranks = r.ranks == 1 ? "1 rank" : fmt::format("{} ranks as {}", r.ranks, r.launcher == "mpi" ? "MPI processes" : "threads");
  const std::string where = r.backend == "cuda" ? fmt::format("CUDA backend, {}", r.device) : "CPU backend, " + ranks;
  std::cout << fmt::format("flatpeak verify: {} at scale {:.4g} ({})\n", r.plan_file, s.factor, where);
  // A factor that does not divide T: T/factor was rounded up, so the scale run is not the one asked.
  if (s.asked_factor && *s.asked_factor != s.factor)
    std::cout << fmt::format("(--scale {:g} asked: T, H and V are divided by it and rounded up, so T scales by {:.6g})\n",
                             *s.asked_factor, s.factor);
  std::cout << "scaled values:\n";
  size_t name_width = 20;  // columns as wide as their longest entry
  for (const auto& v : s.values) name_width = std::max(name_width, v.name.size());
  for (const auto& v : s.values) std::cout << fmt::format("  {:<{}} {:>12} -> {}\n", v.name, name_width, v.original, v.scaled);
  for (const auto& note : r.notes) std::cout << "note: " << note << "\n";
  size_t component_width = 10, phase_width = 18;
  for (const auto& row : r.rows) {
    component_width = std::max(component_width, row.component.size());
    phase_width = std::max(phase_width, row.phase.size());
  }
  std::cout << fmt::format("\n{:<{}} {:<7} {:<{}} {:>4} {:>14} {:>14} {:>10}\n", "component", component_width, "space", "phase",
                           phase_width, "rank", "predicted", "measured", "rel.error");
  for (const auto& row : r.rows)
    std::cout << fmt::format("{:<{}} {:<7} {:<{}} {:>4} {:>14} {:>14} {:>10}{}\n", row.component, component_width, row.space,
                             row.phase, phase_width, row.rank, row.predicted_bytes, row.measured_bytes,
                             signed_percent(row.relative_error),
                             row.below_resolution ? "  (not judged: one unit off, under 100 units)" : row.judged ? "" : "  (not judged)");
  std::cout << fmt::format("\nmax |dloss| vs naive: {:.3g}   max |dgrad| vs naive: {:.3g}\n", r.max_abs_dloss, r.max_abs_dgrad);
  std::cout << fmt::format("verdict: {} (tolerance {:.3g}%)\n", verdict(r), 100.0 * r.tolerance);
}

nlohmann::ordered_json report_json(const VerifyReport& r, const ScaledConfig& s) {
  nlohmann::ordered_json j;
  j["plan"] = r.plan_file;
  j["backend"] = r.backend;
  if (!r.device.empty()) j["device"] = r.device;
  j["ranks"] = r.ranks;
  j["launcher"] = r.launcher;
  j["scale"] = s.factor;
  if (s.asked_factor) j["scale_asked"] = *s.asked_factor;
  nlohmann::ordered_json scaled = nlohmann::ordered_json::array();
  for (const auto& v : s.values) scaled.push_back({{"name", v.name}, {"original", v.original}, {"scaled", v.scaled}});
  j["scaled_values"] = scaled;
  nlohmann::ordered_json rows = nlohmann::ordered_json::array();
  for (const auto& row : r.rows) {
    nlohmann::ordered_json j_row{{"component", row.component}, {"space", row.space}, {"phase", row.phase}, {"rank", row.rank},
                                 {"predicted_bytes", row.predicted_bytes}, {"measured_bytes", row.measured_bytes},
                                 {"relative_error", row.relative_error}};
    if (!row.judged) j_row["judged"] = false;  // reported, not part of the verdict
    if (row.below_resolution) j_row["below_resolution"] = true;
    rows.push_back(j_row);
  }
  j["results"] = rows;
  j["max_abs_dloss"] = r.max_abs_dloss;
  j["max_abs_dgrad"] = r.max_abs_dgrad;
  j["tolerance"] = r.tolerance;
  j["verdict"] = verdict(r);
  j["notes"] = r.notes;
  return j;
}

// The cuda backend's report; BackendFailure when this build has no CUDA backend, there is no
// device, or the device fails (exit 4).
struct BackendFailure : std::runtime_error {
  using std::runtime_error::runtime_error;
};

VerifyReport run_on_cuda(const VerifyInputs& in, const ScaledConfig& scaled, const std::vector<std::string>& components,
                         double tolerance) {
#ifdef FLATPEAK_HAVE_CUDA_BACKEND
  try {
    return run_verification_cuda(in, scaled, components, tolerance);
  } catch (const cuda::BackendError& e) {
    throw BackendFailure(e.what());
  } catch (const exec::OutOfMemory& e) {
    throw BackendFailure(e.what());
  }
#else
  (void)in, (void)scaled, (void)components, (void)tolerance;
  throw BackendFailure("this flatpeak was built without the CUDA backend (nvcc was not found when it was built; see README.md)");
#endif
}

int run_verify_on(const VerifyOptions& o, exec::Communicator* world) {
  InputErrors errs;  // --max-ranks and --tolerance are decimals in range already (numeric_flags.h)
  const double tolerance = o.tolerance_given ? o.tolerance : o.backend == "cuda" ? 0.03 : 0.01;
  if (!(tolerance > 0.0) || !std::isfinite(tolerance))
    errs.add(Diagnostic{"", "--tolerance", fmt::format("must be a positive fraction (got {})", tolerance), "1% is --tolerance 0.01"});
  if (o.backend != "cpu" && o.backend != "cuda")
    errs.add(Diagnostic{"", "--backend", "must be cpu or cuda (got '" + o.backend + "')", ""});
  if (o.backend == "cuda" && world != nullptr)
    errs.add(Diagnostic{"", "--backend", "cuda runs on one GPU without a launcher (got cuda under mpirun/srun)",
                        "run it without mpirun/srun"});
  const std::vector<std::string> components = verify_components();
  if ((o.component_given || !o.component.empty()) &&
      std::find(components.begin(), components.end(), o.component) == components.end()) {
    std::string list;
    for (const auto& c : components) list += (list.empty() ? "" : ", ") + c;
    const std::string guess = did_you_mean(o.component, components);
    errs.add(Diagnostic{"", "--component", "unknown or not yet implemented component '" + o.component + "' (implemented: " + list + ")",
                        guess.empty() ? "" : "did you mean '" + guess + "'?"});
  }
  std::optional<double> factor, perturb;
  try {
    factor = parse_scale(o.scale);
  } catch (const InputError& e) {
    for (const auto& d : e.diagnostics()) errs.add(d);
  }
  try {
    if (o.perturb_given) perturb = parse_perturb(o.perturb);
  } catch (const InputError& e) {
    for (const auto& d : e.diagnostics()) errs.add(d);
  }
  if (perturb && o.backend == "cuda")
    errs.add(Diagnostic{"", "--perturb", "is a self-test of the cpu backend's verify (got --backend cuda)", "drop --perturb or --backend cuda"});
  errs.throw_if_any();

  // An unwritable --trace fails before the run rather than after it, without touching the file
  // (an old trace survives a run that fails). Under MPI rank 0 writes it, so rank 0 checks and
  // every rank learns the outcome at one agreed checkpoint (no rank runs on while another stops).
  if (!o.trace_path.empty()) {
    std::string problem;
    if (world == nullptr || world->rank() == 0) {
      try {
        check_output_file(o.trace_path, "the trace");
      } catch (const InputError& e) {
        if (world == nullptr) throw;
        problem = e.diagnostics().front().to_string();
      }
    }
    if (world != nullptr) world->check_status(problem.empty() ? 0 : kExitInput, problem);
  }
  const nlohmann::json plan = read_json_file(o.plan_path);
  const VerifyInputs in = read_plan_inputs(plan, o.plan_path);
  const ScaledConfig scaled = scale_config(in, factor, o.max_ranks);
  const std::vector<std::string> asked = o.component.empty() ? components : std::vector<std::string>{o.component};
  VerifyReport report = o.backend == "cuda" ? run_on_cuda(in, scaled, asked, tolerance)
                                            : run_verification(in, scaled, asked, tolerance,
                                                               perturb ? perturbation(*perturb) : PredictionAdjust{}, world);
  if (perturb)
    report.notes.insert(report.notes.begin(), fmt::format("--perturb {}: every predicted byte was multiplied by {:g} before the "
                                                          "comparison (a self-test: the verdict says whether verify caught it)",
                                                          o.perturb, *perturb));
  // Rows a one-unit rounding decides at this scale leave the run unjudged: the --scale asked
  // for is the input at fault (verify_run.h, set_aside_unresolved_rows).
  const int code = !report.pass ? kExitVerifyMismatch : report.unresolved_rows > 0 ? kExitInput : kExitOk;
  if (world != nullptr && world->rank() != 0) return code;  // rank 0 prints
  if (o.format == OutputFormat::Json) std::cout << report_json(report, scaled).dump(2) << "\n";
  else print_table(report, scaled);
  // Out before MPI_Finalize (the communicator's destructor): what a process writes after it may
  // never reach mpirun's output forwarding, which made rank 0's report go missing now and then.
  std::cout.flush();
  if (!o.trace_path.empty()) {
    // After the report, so that a failing write (a full disk) loses only the trace, and through
    // a temporary renamed onto the path, so that it leaves any old trace whole.
    try {
      write_output_file(o.trace_path, report.measured_trace.dump(2) + "\n", "the trace");
    } catch (const InputError& e) {
      print_input_error(e);
      return kExitInput;
    }
  }
  if (code == kExitInput)
    std::cerr << "flatpeak: error: --scale " << o.scale << ": " << report.unresolved_note << "\n";
  return code;
}

// A failed rank ends verify with its code; the message names it (executor/comm/README.md).
int run_verify_reporting_ranks(const VerifyOptions& o, exec::Communicator* world) {
  const bool prints = world == nullptr || world->rank() == 0;
  try {
    return run_verify_on(o, world);
  } catch (const exec::RankFailed& e) {
    if (prints) std::cerr << "flatpeak: error: rank " << e.failing_rank << ": " << e.reason << "\n";
    return e.exit_code;
  } catch (const BackendFailure& e) {
    if (prints) std::cerr << "flatpeak: error: --backend " << o.backend << ": " << e.what() << "\n";
    return kExitBackend;
  } catch (const InputError& e) {
    if (world == nullptr) throw;
    // Every process read the same input and fails alike here (a rank's failure inside a component
    // is agreed or aborts the job before this); rank 0 reports it, and the others wait for that at
    // a barrier: one exiting first with a non-zero code lets mpirun kill rank 0 before it has
    // written (the message went missing under load), and nothing written after MPI_Finalize is sure
    // to be forwarded.
    if (prints) {
      print_input_error(e);
      std::cerr.flush();
    }
    world->barrier();
    return kExitInput;
  }
}

int run_verify(const VerifyOptions& o) {
  if (exec::detect_launcher() != "mpi") return run_verify_reporting_ranks(o, nullptr);
#ifdef FLATPEAK_HAVE_MPI
  exec::MpiCommunicator world;
  const int code = run_verify_reporting_ranks(o, &world);
  std::cout.flush();  // everything written so far leaves before MPI_Finalize (above)
  std::cerr.flush();
  return code;
#else
  std::cerr << "flatpeak: error: started by an MPI launcher, but this flatpeak was built without MPI; run it without mpirun/srun (ranks as threads)\n";
  return kExitBackend;
#endif
}

}  // namespace

Command make_verify_command() {
  return Command{
      "verify",
      "Run a plan's schedule at a reduced scale on the CPU (or a GPU) and compare measured with predicted memory",
      [](CLI::App& sub) -> RunFunction {
        auto o = std::make_shared<VerifyOptions>();
        sub.add_option("plan", o->plan_path, "A plan written by 'flatpeak plan --format json'")->required();
        sub.add_option("--scale", o->scale, "auto, or a factor >= 1 dividing T, H and V")->default_str("auto");
        sub.add_option("--max-ranks", o->max_ranks, "Most ranks to run; above it N and EP shrink keeping E/EP, k and N/EP")
            ->check(decimal_integer(1, planner::kMaxGpus))
            ->default_str("8");
        sub.add_option("--component", o->component, "One component (default: every implemented component)");
        CLI::Option* tolerance = sub.add_option("--tolerance", o->tolerance, "Largest |relative error| that passes (fraction; default 0.01 on cpu, 0.03 on cuda)")
                                     ->check(decimal_number());
        sub.add_option("--backend", o->backend, "cpu (every component, N ranks) or cuda (the vocab, checkpoint and dispatch components on one GPU)")->default_str("cpu");
        sub.add_option("--trace", o->trace_path, "Write the measured timeline (traces/README.md format) here")
            ->check([](const std::string& path) { return path.empty() ? std::string("must name a file (got '')") : std::string(); });
        sub.add_option("--perturb", o->perturb,
                       "Self-test: multiply every predicted byte by this factor before comparing (1.02 must fail at 1 %)");
        add_format_option(sub, o->format);
        return [o, tolerance, &sub]() {
          o->tolerance_given = tolerance->count() > 0;
          o->component_given = sub.count("--component") > 0;  // --component '' is not "every component"
          o->perturb_given = sub.count("--perturb") > 0;
          return run_verify(*o);
        };
      }};
}

}  // namespace flatpeak::cli
