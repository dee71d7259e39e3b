// `flatpeak sweep --model A,B --gpu G1,G2 --gpus 8,16,32 --context 32K:1M [--schedule LIST]
// [--cp N|auto] [--format csv|json|table]`: one knob-searched plan per point of the grid models ×
// hardware × GPU counts × contexts × schedules (lists by comma; a:b doubles from a to b), one row
// each: peaks, binding, fits, CP, knobs, step time, tokens/s. Progress on stderr for long sweeps.
// Exit 0 whenever the rows were computed (fitting or not), 2 on bad input.
#include <chrono>
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

struct SweepOptions {
  std::string models, gpus_cards, gpu_counts, contexts, schedules = "flatpeak";
  OutputFormat format = OutputFormat::Table;
  CapacityFlags flags;
};

const std::vector<std::string> kSweepFlags = {"--cp", "--ep", "--gpus-per-node", "--host-memory", "--mtp",
                                              "--imbalance", "--overhead", "--fragmentation"};

const char* kColumns[] = {"model", "gpu", "gpus", "context_tokens", "schedule", "cp", "ep", "micro_batch",
                          "accumulation_steps", "fits", "gpu_fits", "host_fits", "binding", "gpu_peak_bytes",
                          "required_bytes", "budget_bytes", "dispatch_bytes", "vocab_bytes", "checkpoint_bytes",
                          "optimizer_bytes", "layer_bytes", "host_peak_bytes", "host_budget_bytes", "step_seconds",
                          "tokens_per_second", "mfu", "bound_by", "chunk_cap_rows", "ring_size", "token_block",
                          "vocab_block", "sco_layers", "sco_prefetch", "bucket_params", "bucket_depth", "error"};

ojson row_json(const ModelSpec& m, const HardwareSpec& hw, int64_t gpus, int64_t context, const planner::ScheduleRun& r,
               const std::string& error) {
  ojson j;
  const auto& s = r.search.summary;
  const bool ok = error.empty();
  j["model"] = m.name;
  j["gpu"] = hw.name;
  j["gpus"] = gpus;
  j["context_tokens"] = context;
  j["schedule"] = r.name;
  j["cp"] = ok ? ojson(r.search.choice.cp) : ojson(nullptr);
  j["ep"] = ok ? ojson(r.search.run.ep) : ojson(nullptr);
  j["micro_batch"] = ok ? ojson(r.search.choice.micro_batch) : ojson(nullptr);
  j["accumulation_steps"] = ok ? ojson(r.search.time.micro_batches) : ojson(nullptr);
  j["fits"] = r.fits;
  j["gpu_fits"] = ok && s.gpu_fits;
  j["host_fits"] = ok && s.host_fits;
  j["binding"] = ok ? ojson(r.binding()) : ojson(nullptr);
  j["gpu_peak_bytes"] = s.gpu_peak_bytes;
  j["required_bytes"] = s.required_bytes;
  j["budget_bytes"] = s.budget_bytes;
  for (int k = 0; k < planner::kPeakCount; ++k)
    j[std::string(planner::to_string(static_cast<planner::PeakKind>(k))) + "_bytes"] = s.peak_bytes[static_cast<size_t>(k)];
  j["host_peak_bytes"] = s.host_peak_bytes;
  j["host_budget_bytes"] = s.host_budget_bytes;
  j["step_seconds"] = planner::round_significant(r.search.time.step_seconds, 6);
  j["tokens_per_second"] = planner::round_significant(r.search.time.tokens_per_second, 6);
  j["mfu"] = planner::round_significant(r.search.time.mfu, 6);
  j["bound_by"] = r.search.time.bound_by;
  const ojson knobs = ok ? planner::schedule_run_json(r, m)["knobs"] : ojson::object();
  for (const char* k : {"chunk_cap_rows", "ring_size", "token_block", "vocab_block", "sco_layers", "sco_prefetch",
                        "bucket_params", "bucket_depth"})
    j[k] = knobs.contains(k) ? knobs[k] : ojson(nullptr);
  j["error"] = ok ? ojson(nullptr) : ojson(error);
  return j;
}

std::string csv_cell(const ojson& v) {
  if (v.is_null()) return "";
  if (v.is_boolean()) return v.get<bool>() ? "true" : "false";
  if (v.is_string()) {
    std::string s = v.get<std::string>();
    if (s.find_first_of(",\"\n") == std::string::npos) return s;
    std::string q = "\"";
    for (char c : s) q += c == '"' ? std::string("\"\"") : std::string(1, c);
    return q + "\"";
  }
  return v.dump();
}

int run_sweep(const CLI::App& sub, const SweepOptions& o) {
  InputErrors errs;
  const planner::Query q = o.flags.query(sub, errs, false);
  const std::vector<std::string> model_names = split_list(o.models, "--model", errs);
  const std::vector<std::string> gpu_names = split_list(o.gpus_cards, "--gpu", errs);
  const std::vector<int64_t> counts = parse_counts(o.gpu_counts, "--gpus", errs);
  const std::vector<int64_t> contexts = parse_contexts(o.contexts, errs);
  std::vector<planner::Schedule> schedules;
  for (const std::string& s : split_list(o.schedules, "--schedule", errs)) {
    if (s == "baseline") schedules.push_back(planner::Schedule::Baseline);
    else if (s == "practice") schedules.push_back(planner::Schedule::Practice);
    else if (s == "flatpeak") schedules.push_back(planner::Schedule::Flatpeak);
    else errs.add(Diagnostic{"", "--schedule", fmt::format("unknown schedule (got '{}')", s), "valid: baseline, practice, flatpeak"});
  }
  std::vector<ModelSpec> models;
  std::vector<HardwareSpec> cards;
  for (const auto& name : model_names) {
    try {
      models.push_back(load_model(name));
    } catch (const InputError& e) {
      for (const auto& d : e.diagnostics()) errs.add(d);
    }
  }
  for (const auto& name : gpu_names) {
    try {
      cards.push_back(load_hardware(name));
    } catch (const InputError& e) {
      for (const auto& d : e.diagnostics()) errs.add(d);
    }
  }
  // A grid entry given twice (also as another spelling: an alias, "08", "32768" and "32K") would
  // repeat its rows: most likely a typo for another value, so it is refused.
  const auto once = [&errs](const char* flag, const std::vector<std::string>& keys, const std::vector<std::string>& given) {
    for (size_t i = 0; i < keys.size(); ++i)
      for (size_t j = 0; j < i; ++j)
        if (keys[i] == keys[j]) {
          const std::string spelled = given[i] == keys[i] && given[j] == keys[j] ? "" : fmt::format(" ('{}' and '{}')", given[j], given[i]);
          errs.add(Diagnostic{"", flag, fmt::format("lists {} twice{}: each grid entry once", keys[i], spelled), ""});
          break;
        }
  };
  if (errs.empty()) {
    std::vector<std::string> model_keys, card_keys, count_keys, context_keys, schedule_keys;
    // A card is its name and where it was read from: two files may hold cards of one name.
    for (const auto& m : models) model_keys.push_back(m.source.rfind("embedded:", 0) == 0 ? m.name : m.name + " (" + m.source + ")");
    for (const auto& c : cards) card_keys.push_back(c.source.rfind("embedded:", 0) == 0 ? c.name : c.name + " (" + c.source + ")");
    for (int64_t n : counts) count_keys.push_back(std::to_string(n));
    for (int64_t ctx : contexts) context_keys.push_back(tokens_text(ctx));
    for (planner::Schedule sch : schedules) schedule_keys.push_back(planner::to_string(sch));
    once("--model", model_keys, model_names);
    once("--gpu", card_keys, gpu_names);
    once("--gpus", count_keys, count_keys);
    once("--context", context_keys, context_keys);
    once("--schedule", schedule_keys, schedule_keys);
  }
  errs.throw_if_any();

  const size_t total = models.size() * cards.size() * counts.size() * contexts.size() * schedules.size();
  const bool progress = total >= 2000;
  const auto start = std::chrono::steady_clock::now();
  size_t done = 0, next_report = total / 10;
  if (o.format == OutputFormat::Csv) {
    std::string header;
    for (const char* c : kColumns) header += (header.empty() ? "" : ",") + std::string(c);
    std::cout << header << "\n";
  } else if (o.format == OutputFormat::Json) {
    std::cout << "{\n  \"rows\": [";
  } else {
    std::cout << fmt::format("{:<16} {:<10} {:>5} {:>7} {:<9} {:<4} {:>4} {:<11} {:>22} {:>12} {:>11}  {}\n", "model", "gpu", "N",
                             "S", "schedule", "fits", "CP", "binding", "GPU required / budget", "step s", "tokens/s", "knobs");
  }
  planner::LoadCache cache;
  bool first = true;
  for (const ModelSpec& model : models)
    for (const HardwareSpec& hw : cards)
      for (int64_t n : counts)
        for (int64_t context : contexts)
          for (planner::Schedule schedule : schedules) {
            planner::RunSpec spec = q.base;
            spec.gpus = n;
            spec.context_tokens = context;
            spec.schedule = schedule;
            planner::ScheduleRun r;
            r.name = planner::to_string(schedule);
            std::string error;
            try {
              r.search = planner::search_knobs(model, hw, spec, q.efficiency, &cache, planner::SearchOptions{false});
              r.fits = r.search.found;
              r.optimizer = r.search.run.optimizer;
            } catch (const InputError& e) {
              error = e.diagnostics().front().to_string();  // a grid point the flags do not allow (e.g. EP)
            }
            const ojson row = row_json(model, hw, n, context, r, error);
            if (o.format == OutputFormat::Csv) {
              std::string line;
              for (const char* c : kColumns) line += (line.empty() ? "" : ",") + csv_cell(row[c]);
              std::cout << line << "\n";
            } else if (o.format == OutputFormat::Json) {
              std::cout << (first ? "\n    " : ",\n    ") << row.dump();
            } else {
              std::string knobs;
              for (const char* k : {"chunk_cap_rows", "ring_size", "sco_layers", "bucket_params"})
                if (!row[k].is_null()) knobs += fmt::format("{}{}={}", knobs.empty() ? "" : " ", k, csv_cell(row[k]));
              std::cout << fmt::format("{:<16} {:<10} {:>5} {:>7} {:<9} {:<4} {:>4} {:<11} {:>22} {:>12.4g} {:>11.0f}  {}\n",
                                       model.name, hw.name, n, tokens_text(context), r.name, r.fits ? "yes" : "no",
                                       row["cp"].is_null() ? "-" : row["cp"].dump(), error.empty() ? r.binding() : "error",
                                       format_bytes(r.search.summary.required_bytes) + " / " +
                                           format_bytes(r.search.summary.budget_bytes),
                                       r.search.time.step_seconds, r.search.time.tokens_per_second,
                                       error.empty() ? knobs : error);
            }
            first = false;
            ++done;
            if (progress && done >= next_report) {
              const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
              std::cerr << fmt::format("flatpeak: sweep: {}/{} rows ({:.0f} rows/s)\n", done, total, s > 0 ? static_cast<double>(done) / s : 0.0);
              next_report += total / 10;
            }
          }
  if (o.format == OutputFormat::Json) std::cout << "\n  ]\n}\n";
  return kExitOk;
}

}  // namespace

Command make_sweep_command() {
  return Command{"sweep",
                 "A grid over models x hardware x GPU counts x contexts: one knob-searched plan per row (CSV or JSON)",
                 [](CLI::App& sub) -> RunFunction {
                   auto options = std::make_shared<SweepOptions>();
                   sub.add_option("--model", options->models, "Models, by comma")->required();
                   sub.add_option("--gpu", options->gpus_cards, "Hardware cards, by comma")->required();
                   sub.add_option("--gpus", options->gpu_counts, "GPU counts N, by comma")->required();
                   sub.add_option("--context", options->contexts,
                                  "Contexts, by comma; a:b doubles from a to b (e.g. 32K:1M)")->required();
                   sub.add_option("--schedule", options->schedules, "Schedules, by comma (default flatpeak)");
                   options->flags.add_to(sub, kSweepFlags);
                   add_format_option(sub, options->format, true);
                   return [options, &sub]() { return run_sweep(sub, *options); };
                 }};
}

}  // namespace flatpeak::cli
