#include "capacity_common.h"

#include <fmt/format.h>

#include "spec/sizes.h"

namespace flatpeak::cli {

std::string efficiency_help() {
  std::string help = "Step-time efficiencies and latencies, key=value,... (";
  bool first = true;
  for (const auto& k : planner::efficiency_keys()) {
    help += (first ? "" : ", ") + std::string(k.name);
    first = false;
  }
  return help + "); defaults in planner/README.md";
}

std::string format_plan_time(const planner::Plan& p) {
  std::string out;
  const planner::StepTime& t = p.time;
  out += fmt::format("time  step {:.4g} s ({} micro-batch{}), {:.0f} tokens/s, MFU {:.1f} %, bound by {}\n", t.step_seconds,
                     t.micro_batches, t.micro_batches == 1 ? "" : "es", t.tokens_per_second, 100 * t.mfu, t.bound_by);
  std::string terms;
  for (const auto& term : t.terms)
    if (term.seconds > 0) terms += fmt::format("{}{} {:.3g} s", terms.empty() ? "" : ", ", term.name, term.seconds);
  out += "      " + terms + "\n";
  for (const auto& k : p.run.knobs)
    if (k.reason.rfind("searched", 0) == 0 || k.reason.rfind("nothing fits", 0) == 0)
      out += fmt::format("knob  {} = {}: {}\n", k.name, k.value.is_string() ? k.value.get<std::string>() : k.value.dump(),
                         k.reason);
  if (!p.diagnosis.is_null()) {
    out += fmt::format("nothing fits: the {} peak is {} over budget at {}\n", p.diagnosis["peak"].get<std::string>(),
                       format_bytes(p.diagnosis["over_bytes"].get<int64_t>()), p.diagnosis["at"].get<std::string>());
    for (const auto& r : p.diagnosis["remedies"]) out += "  - " + r.get<std::string>() + "\n";
  }
  return out;
}

void CapacityFlags::add_to(CLI::App& sub, const std::vector<std::string>& names) {
  names_ = names;
  for (const auto& f : planner::run_flags())
    for (const auto& n : names)
      if (n == f.name) sub.add_option(f.name, values_[f.name], f.help);
  sub.add_option("--efficiency", efficiency_, efficiency_help());
}

planner::Query CapacityFlags::query(const CLI::App& sub, InputErrors& errs, bool gpus_required) const {
  std::vector<std::pair<std::string, std::string>> flags;
  bool have_context = false;
  for (const auto& n : names_)
    if (sub.count(n) > 0) {
      flags.emplace_back(n, values_.at(n));
      have_context = have_context || n == "--context";
    }
  if (!have_context) flags.emplace_back("--context", "1024");  // placeholder: queries set their own
  InputErrors parse_errs;
  planner::Query q;
  q.base = planner::parse_run_flags(flags, parse_errs);
  for (const auto& d : parse_errs.diagnostics())
    if (gpus_required || d.pointer != "--gpus" || d.message != "is required") errs.add(d);
  if (!have_context) q.base.context_tokens = 0;
  if (sub.count("--efficiency") > 0) q.efficiency = planner::parse_efficiency(efficiency_, errs);
  return q;
}

std::vector<std::string> split_list(const std::string& text, const std::string& flag, InputErrors& errs) {
  std::vector<std::string> out;
  size_t pos = 0;
  bool empty_item = false;
  while (pos <= text.size()) {
    const size_t comma = text.find(',', pos);
    const std::string item = text.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    if (item.empty()) empty_item = true;
    else out.push_back(item);
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  if (out.empty()) errs.add(Diagnostic{"", flag, "the grid is empty (got '" + text + "')", "valid: a comma-separated list"});
  else if (empty_item) errs.add(Diagnostic{"", flag, "has an empty item (got '" + text + "')", "valid: a comma-separated list"});
  return out;
}

std::vector<int64_t> parse_contexts(const std::string& text, InputErrors& errs) {
  std::vector<int64_t> out;
  const std::string valid = "valid: token counts such as 32K,1M, or a range a:b (doubling from a up to b, a <= b)";
  for (const std::string& item : split_list(text, "--context", errs)) {
    const size_t colon = item.find(':');
    if (colon == std::string::npos) {
      auto v = parse_tokens(item);
      if (!v && tokens_beyond_int64(item))
        errs.add(Diagnostic{"", "--context", fmt::format("is too large: must be below 2^63 (got '{}')", item), valid});
      else if (!v) errs.add(Diagnostic{"", "--context", fmt::format("must be a positive token count (got '{}')", item), valid});
      else out.push_back(*v);
      continue;
    }
    auto a = parse_tokens(item.substr(0, colon));
    auto b = parse_tokens(item.substr(colon + 1));
    if (!a || !b) {
      errs.add(Diagnostic{"", "--context", fmt::format("a range must be two token counts a:b (got '{}')", item), valid});
      continue;
    }
    if (*a > *b) {
      errs.add(Diagnostic{"", "--context", fmt::format("the range {} runs backwards: {} > {}", item, *a, *b), valid});
      continue;
    }
    // Doubling up to b: s <= b / 2 before each doubling, so s never wraps (the loop stopped
    // silently past 2^40 before: 1000G:2^63-1 gave two contexts).
    for (int64_t s = *a;; s *= 2) {
      out.push_back(s);
      if (s > *b / 2) break;
    }
  }
  return out;
}

std::vector<int64_t> parse_counts(const std::string& text, const std::string& flag, InputErrors& errs, int64_t max_value) {
  std::vector<int64_t> out;
  for (const std::string& item : split_list(text, flag, errs)) {
    auto v = parse_tokens(item);
    if (!v && tokens_beyond_int64(item) && item.find_first_not_of("0123456789") == std::string::npos)
      errs.add(Diagnostic{"", flag, fmt::format("must be at most {} (got '{}')", max_value, item), "valid: e.g. 8,16,32"});
    else if (!v || item.find_first_not_of("0123456789") != std::string::npos)
      errs.add(Diagnostic{"", flag, fmt::format("must be positive integers (got '{}')", item), "valid: e.g. 8,16,32"});
    else if (*v > max_value)
      errs.add(Diagnostic{"", flag, fmt::format("must be at most {} (got '{}')", max_value, item), "valid: e.g. 8,16,32"});
    else out.push_back(*v);
  }
  return out;
}

std::string tokens_text(int64_t tokens) { return tokens == 0 ? "0" : format_tokens(tokens); }

}  // namespace flatpeak::cli
