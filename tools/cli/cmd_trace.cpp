// `flatpeak trace FILE [--space device|host] [--format table|csv|chrome|svg]`: a memory timeline
// (a plan's predicted `timeline`, or a trace `verify --trace` wrote; traces/README.md) as a table,
// as CSV for a spreadsheet or a plotting script, as Chrome trace events (chrome://tracing,
// ui.perfetto.dev: one stacked counter track by category, one slice per phase), or as a
// self-contained SVG chart (bars stacked by category, one per phase, with the GPU budget of a plan).
// The x axis of every form is the phase order, not time: the timeline has no durations.
//   flatpeak plan --model gpt-oss-120b --gpu H200 --gpus 64 --context 1M --format json > p.json
//   flatpeak trace p.json --format svg > p.svg
//   flatpeak verify p.json --trace m.json && flatpeak trace m.json --format chrome > m.trace.json
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "commands.h"
#include "exit_codes.h"
#include "spec/errors.h"
#include "spec/json_util.h"

namespace flatpeak::cli {

namespace {

using json = nlohmann::json;
using ordered_json = nlohmann::ordered_json;

enum class TraceFormat { Table, Csv, Chrome, Svg };

struct TraceOptions {
  std::string file;
  std::string space = "device";
  TraceFormat format = TraceFormat::Table;
};

// One phase of the timeline in the chosen space: its categories in the file's order, and the
// bytes the total holds beyond them (a measured host total counts categories with no column).
struct TracePhase {
  std::string name, folds;
  std::vector<int64_t> bytes;  // per Timeline::categories
  int64_t other = 0;
  int64_t total = 0;
};

struct Timeline {
  std::string source;                   // "predicted" or "measured"
  std::string title;                    // what it is of: the plan's model and run, or the file
  std::vector<std::string> categories;  // union over the phases, first-seen order
  std::vector<TracePhase> phases;
  // A plan's GPU budget (device space only) and what of it the timeline may use: the budget less
  // the runtime overhead and the fragmentation reserve (the plan fits when its peak is within it).
  std::optional<int64_t> budget, usable;
};

// The timeline object of `document` (a plan or a trace file) and the pointer it sits at.
std::pair<const json*, std::string> find_timeline(const json& document, const std::string& file) {
  if (!document.is_object())
    throw InputError({Diagnostic{file, "", "must be a plan or a flatpeak-timeline object (got " + describe_json_value(document) + ")", ""}});
  if (document.contains("timeline")) return {&document["timeline"], "/timeline"};
  if (document.contains("format")) return {&document, ""};
  throw InputError({Diagnostic{file, "", "is neither a plan (no /timeline) nor a trace (no /format)",
                               "give a plan from `flatpeak plan --format json` or a trace from `flatpeak verify --trace`"}});
}

Timeline read_timeline(const json& document, const std::string& file, const std::string& space) {
  const auto [tl, at] = find_timeline(document, file);
  InputErrors errs;
  auto fail = [&](const std::string& pointer, const std::string& rule) { errs.add(Diagnostic{file, pointer, rule, ""}); };
  if (!tl->is_object()) {
    fail(at, "must be an object (got " + describe_json_value(*tl) + ")");
    errs.throw_if_any();
  }
  const auto format = tl->find("format");
  if (format == tl->end() || *format != "flatpeak-timeline")
    fail(at + "/format", "must be \"flatpeak-timeline\" (got " + (format == tl->end() ? std::string("nothing") : describe_json_value(*format)) + ")");
  const auto version = tl->find("version");
  if (version == tl->end() || *version != 1)
    fail(at + "/version", "must be 1 (got " + (version == tl->end() ? std::string("nothing") : describe_json_value(*version)) + ")");
  const auto phases = tl->find("phases");
  if (phases == tl->end() || !phases->is_array() || phases->empty())
    fail(at + "/phases", "must be a non-empty array (got " + (phases == tl->end() ? std::string("nothing") : describe_json_value(*phases)) + ")");
  errs.throw_if_any();

  const auto unit = tl->find("unit");
  if (unit != tl->end() && *unit != "bytes") fail(at + "/unit", "must be \"bytes\" (got " + describe_json_value(*unit) + ")");
  const auto source = tl->find("source");
  if (source != tl->end() && *source != "predicted" && *source != "measured")
    fail(at + "/source", "must be \"predicted\" or \"measured\" (got " + describe_json_value(*source) + ")");
  errs.throw_if_any();

  Timeline out;
  out.source = source != tl->end() ? source->get<std::string>() : "predicted";
  std::map<std::string, size_t> column;
  for (size_t i = 0; i < phases->size(); ++i) {
    const json& p = (*phases)[i];
    const std::string pp = at + "/phases/" + std::to_string(i);
    if (!p.is_object()) {
      fail(pp, "must be an object with a name and bytes by category (got " + describe_json_value(p) + ")");
      continue;
    }
    if (!p.contains("name") || !p["name"].is_string()) {
      fail(pp + "/name", "must be a string (got " + (p.contains("name") ? describe_json_value(p["name"]) : std::string("nothing")) + ")");
      continue;
    }
    TracePhase phase;
    phase.name = p["name"].get<std::string>();
    if (p.contains("folds")) {
      if (p["folds"].is_string()) phase.folds = p["folds"].get<std::string>();
      else fail(pp + "/folds", "must be a string (got " + describe_json_value(p["folds"]) + ")");
    }
    const auto cols = p.find(space);
    if (cols == p.end() || !cols->is_object()) {
      fail(pp + "/" + space, "must be an object of bytes by category (got " + (cols == p.end() ? std::string("nothing") : describe_json_value(*cols)) + ")");
      continue;
    }
    int64_t sum = 0;
    bool has_total = false;
    for (const auto& [key, value] : cols->items()) {
      if (!value.is_number_integer() || value.get<int64_t>() < 0) {
        fail(child_pointer(pp + "/" + space, key), "must be a non-negative integer of bytes (got " + describe_json_value(value) + ")");
        continue;
      }
      const int64_t bytes = value.get<int64_t>();
      if (key == "total") {
        phase.total = bytes, has_total = true;
        continue;
      }
      if (!column.count(key)) column[key] = out.categories.size(), out.categories.push_back(key);
      const size_t c = column[key];
      if (phase.bytes.size() <= c) phase.bytes.resize(c + 1, 0);
      phase.bytes[c] = bytes;
      if (sum > INT64_MAX - bytes) {
        fail(pp + "/" + space, "its categories add up past 2^63 bytes");
        break;
      }
      sum += bytes;
    }
    if (!has_total) phase.total = sum;
    if (phase.total < sum)
      fail(pp + "/" + space + "/total", fmt::format("must be at least the sum of the categories, {} (got {})", sum, phase.total));
    phase.other = phase.total - sum;
    out.phases.push_back(std::move(phase));
  }
  errs.throw_if_any();
  // Columns in traces/README.md's order (a parsed object lists its keys sorted), any others after.
  static const std::vector<std::string> kOrder = {"params", "grads", "optimizer", "fsdp", "boundaries", "activations", "dispatch", "vocab"};
  std::vector<size_t> order(out.categories.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  const auto rank = [&](size_t c) {
    const auto it = std::find(kOrder.begin(), kOrder.end(), out.categories[c]);
    return it == kOrder.end() ? kOrder.size() : static_cast<size_t>(it - kOrder.begin());
  };
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return rank(a) < rank(b); });
  std::vector<std::string> names;
  for (size_t c : order) names.push_back(out.categories[c]);
  out.categories = names;
  for (TracePhase& p : out.phases) {
    p.bytes.resize(order.size(), 0);
    std::vector<int64_t> sorted;
    for (size_t c : order) sorted.push_back(p.bytes[c]);
    p.bytes = sorted;
  }
  // Bytes the total holds beyond its listed categories, as one more column (named apart from them).
  if (std::any_of(out.phases.begin(), out.phases.end(), [](const TracePhase& p) { return p.other > 0; })) {
    std::string name = "unlisted";
    while (std::find(out.categories.begin(), out.categories.end(), name) != out.categories.end()) name += "'";
    out.categories.push_back(name);
  }
  for (TracePhase& p : out.phases)
    if (out.categories.size() > p.bytes.size()) p.bytes.push_back(p.other);

  // What it is of: a plan names its model, GPUs and context; a trace file only itself.
  out.title = file;
  if (document.contains("inputs") && document["inputs"].is_object()) {
    const json& in = document["inputs"];
    const auto text = [&](const char* a, const char* b) -> std::string {
      if (in.contains(a) && in[a].is_object() && in[a].contains(b) && in[a][b].is_primitive()) {
        const json& v = in[a][b];
        return v.is_string() ? v.get<std::string>() : v.dump();
      }
      return "?";
    };
    out.title = fmt::format("{} on {} x {}, S = {}, schedule {}", text("model", "name"), text("run", "gpus"),
                            text("hardware", "name"), text("run", "context_tokens"), text("run", "schedule"));
  }
  if (space == "device" && document.contains("gpu") && document["gpu"].is_object()) {
    const json& g = document["gpu"];
    const auto bytes = [&](const char* key) -> std::optional<int64_t> {
      if (!g.contains(key) || !g[key].is_number_integer() || g[key].get<int64_t>() < 0) return std::nullopt;
      return g[key].get<int64_t>();
    };
    const auto budget = bytes("budget_bytes"), overhead = bytes("overhead_bytes"), reserve = bytes("fragmentation_bytes");
    // Compared by subtraction: overhead + reserve can wrap (an edited 2^63 - 1 and 2 drew the
    // budget line at a negative usable size).
    if (budget && overhead && reserve && *overhead <= *budget && *reserve <= *budget - *overhead) {
      out.budget = budget;
      out.usable = *budget - *overhead - *reserve;
    }
  }
  return out;
}

std::string gib(int64_t bytes) { return fmt::format("{:.2f}", static_cast<double>(bytes) / double(int64_t{1} << 30)); }

size_t peak_index(const Timeline& t) {
  size_t best = 0;
  for (size_t i = 1; i < t.phases.size(); ++i)
    if (t.phases[i].total > t.phases[best].total) best = i;  // the first on ties
  return best;
}

// Categories with a byte in some phase (a table or chart of only zeros says nothing).
std::vector<size_t> used_categories(const Timeline& t) {
  std::vector<size_t> used;
  for (size_t c = 0; c < t.categories.size(); ++c)
    if (std::any_of(t.phases.begin(), t.phases.end(), [c](const TracePhase& p) { return p.bytes[c] > 0; })) used.push_back(c);
  return used;
}

void print_table(const Timeline& t, const std::string& space, std::ostream& out) {
  const std::vector<size_t> used = used_categories(t);
  const size_t peak = peak_index(t);
  size_t name_width = 5;
  for (const auto& p : t.phases) name_width = std::max(name_width, p.name.size());
  out << fmt::format("{} {} memory per phase (GiB{}): {}\n", t.source, space, space == "host" ? ", one GPU's process" : "",
                     t.title);
  std::string header = fmt::format("  {:<{}}", "phase", name_width);
  for (size_t c : used) header += fmt::format(" {:>12}", t.categories[c]);
  header += fmt::format(" {:>12}  {}", "total", "folds");
  out << header << "\n";
  for (size_t i = 0; i < t.phases.size(); ++i) {
    const TracePhase& p = t.phases[i];
    std::string line = fmt::format("{} {:<{}}", i == peak ? "*" : " ", p.name, name_width);
    for (size_t c : used) line += fmt::format(" {:>12}", gib(p.bytes[c]));
    line += fmt::format(" {:>12}  {}", gib(p.total), p.folds);
    while (!line.empty() && line.back() == ' ') line.pop_back();
    out << line << "\n";
  }
  out << fmt::format("peak (*): {} GiB at {}", gib(t.phases[peak].total), t.phases[peak].name);
  if (t.budget)
    out << fmt::format("; GPU budget {} GiB, of which {} GiB for the timeline (less overhead and fragmentation reserve)",
                       gib(*t.budget), gib(*t.usable));
  out << "\n";
}

std::string csv_field(const std::string& text) {
  if (text.find_first_of(",\"\r\n") == std::string::npos) return text;
  std::string quoted = "\"";
  for (char ch : text) quoted += ch == '"' ? std::string("\"\"") : std::string(1, ch);
  return quoted + "\"";
}

void print_csv(const Timeline& t, const std::string& space, std::ostream& out) {
  out << "index,phase,folds,space";
  for (const auto& c : t.categories) out << "," << csv_field(c);
  out << ",total\n";
  for (size_t i = 0; i < t.phases.size(); ++i) {
    const TracePhase& p = t.phases[i];
    out << i << "," << csv_field(p.name) << "," << csv_field(p.folds) << "," << space;
    for (int64_t b : p.bytes) out << "," << b;
    out << "," << p.total << "\n";
  }
}

// Chrome trace events: phase i spans [i, i + 1) ms; a counter event per phase carries its bytes by
// category (a stacked track), a complete event names the phase (its folds in args).
void print_chrome(const Timeline& t, const std::string& space, std::ostream& out) {
  ordered_json events = ordered_json::array();
  events.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", 1}, {"args", {{"name", "flatpeak " + t.source + " " + space + ": " + t.title}}}});
  events.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", 1}, {"tid", 1}, {"args", {{"name", "phases (x axis: phase order, 1 ms each)"}}}});
  for (size_t i = 0; i < t.phases.size(); ++i) {
    const TracePhase& p = t.phases[i];
    const int64_t ts = static_cast<int64_t>(i) * 1000;
    ordered_json args;
    for (size_t c = 0; c < t.categories.size(); ++c) args[t.categories[c]] = p.bytes[c];
    events.push_back({{"name", space + " bytes"}, {"ph", "C"}, {"ts", ts}, {"pid", 1}, {"tid", 1}, {"args", args}});
    ordered_json slice_args{{"total_bytes", p.total}};
    if (!p.folds.empty()) slice_args["folds"] = p.folds;
    events.push_back({{"name", p.name}, {"ph", "X"}, {"ts", ts}, {"dur", 1000}, {"pid", 1}, {"tid", 1}, {"args", slice_args}});
  }
  ordered_json zero;
  for (const auto& c : t.categories) zero[c] = 0;
  events.push_back({{"name", space + " bytes"}, {"ph", "C"}, {"ts", static_cast<int64_t>(t.phases.size()) * 1000}, {"pid", 1}, {"tid", 1}, {"args", zero}});
  // Text that is not UTF-8 (a file name given so) is written with replacement characters.
  out << ordered_json{{"traceEvents", events}, {"displayTimeUnit", "ms"}}.dump(1, ' ', false, ordered_json::error_handler_t::replace)
      << "\n";
}

std::string xml_escape(const std::string& text) {
  std::string out;
  for (char ch : text) {
    switch (ch) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      default:  // XML 1.0 has no other control characters
        out += static_cast<unsigned char>(ch) < 0x20 && ch != '\t' && ch != '\n' && ch != '\r' ? '?' : ch;
    }
  }
  return out;
}

// A fill per category: the traces/README.md ones fixed, anything else from a grey ramp.
std::string color_of(const std::string& category, size_t index) {
  static const std::map<std::string, std::string> fixed{
      {"params", "#4e79a7"},     {"grads", "#f28e2b"},     {"optimizer", "#e15759"}, {"fsdp", "#76b7b2"},
      {"boundaries", "#59a14f"}, {"activations", "#edc948"}, {"dispatch", "#b07aa1"}, {"vocab", "#ff9da7"},
      {"workspace", "#9c755f"},  {"other", "#bab0ac"}};
  const auto it = fixed.find(category);
  if (it != fixed.end()) return it->second;
  static const char* greys[] = {"#6b6b6b", "#8c8c8c", "#adadad", "#cfcfcf"};
  return greys[index % 4];
}

// A round step for the y axis: 1, 2 or 5 times a power of ten GiB, about 6 ticks to the top.
double tick_step_gib(double top_gib) {
  const double raw = std::max(top_gib / 6.0, 1e-9);
  const double base = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0, 10.0})
    if (m * base >= raw) return m * base;
  return 10.0 * base;
}

void print_svg(const Timeline& t, const std::string& space, std::ostream& out) {
  const std::vector<size_t> used = used_categories(t);
  const size_t n = t.phases.size(), peak = peak_index(t);
  const double gib_bytes = double(int64_t{1} << 30);
  // One slot a phase (at least 20 px), the bar 80 % of it up to 40 px.
  const double left = 80, top = 86, plot_h = 320, label_h = 230;
  const double plot_w = std::max(560.0, static_cast<double>(n) * 20.0);
  const double slot = plot_w / static_cast<double>(n), bar_w = std::min(40.0, 0.8 * slot);
  const auto bar_x = [&](size_t i) { return left + static_cast<double>(i) * slot + (slot - bar_w) / 2; };
  const double width = left + plot_w + 30, height = top + plot_h + label_h;
  const int64_t highest = std::max(t.phases[peak].total, t.usable.value_or(0));
  const double step = tick_step_gib(std::max(0.01, static_cast<double>(highest) / gib_bytes * 1.05));
  const double top_gib = std::max(step, std::ceil(static_cast<double>(highest) / gib_bytes * 1.05 / step) * step);
  const auto y_of = [&](double gib) { return top + plot_h - gib / top_gib * plot_h; };

  out << fmt::format("<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{:.0f}\" height=\"{:.0f}\" viewBox=\"0 0 {:.0f} {:.0f}\" "
                     "font-family=\"sans-serif\" font-size=\"11\">\n",
                     width, height, width, height);
  out << fmt::format("<rect width=\"{:.0f}\" height=\"{:.0f}\" fill=\"white\"/>\n", width, height);
  out << fmt::format("<text x=\"{:.0f}\" y=\"20\" font-size=\"14\">{}</text>\n", left,
                     xml_escape("flatpeak: " + t.source + " " + space + " memory per phase"));
  out << fmt::format("<text x=\"{:.0f}\" y=\"38\">{}</text>\n", left, xml_escape(t.title));
  // Legend.
  double lx = left;
  for (size_t c : used) {
    out << fmt::format("<rect x=\"{:.0f}\" y=\"50\" width=\"10\" height=\"10\" fill=\"{}\"/>", lx, color_of(t.categories[c], c));
    out << fmt::format("<text x=\"{:.0f}\" y=\"59\">{}</text>\n", lx + 14, xml_escape(t.categories[c]));
    lx += 24 + 7.0 * static_cast<double>(t.categories[c].size());
  }
  // Axis and grid.
  for (double g = 0; g <= top_gib + 1e-9; g += step) {
    out << fmt::format("<line x1=\"{:.0f}\" y1=\"{:.1f}\" x2=\"{:.0f}\" y2=\"{:.1f}\" stroke=\"#e0e0e0\"/>", left, y_of(g), left + plot_w, y_of(g));
    out << fmt::format("<text x=\"{:.0f}\" y=\"{:.1f}\" text-anchor=\"end\">{:g}</text>\n", left - 6, y_of(g) + 4, g);
  }
  out << fmt::format("<text x=\"16\" y=\"{:.0f}\" transform=\"rotate(-90 16 {:.0f})\" text-anchor=\"middle\">GiB</text>\n",
                     top + plot_h / 2, top + plot_h / 2);
  out << fmt::format("<line x1=\"{:.0f}\" y1=\"{:.0f}\" x2=\"{:.0f}\" y2=\"{:.0f}\" stroke=\"black\"/>\n", left, top + plot_h,
                     left + plot_w, top + plot_h);
  // Bars: categories stacked from the bottom in the file's order, a tooltip per phase.
  for (size_t i = 0; i < n; ++i) {
    const TracePhase& p = t.phases[i];
    const double x = bar_x(i);
    std::string tip = p.name + (p.folds.empty() ? "" : " (" + p.folds + ")") + ": " + gib(p.total) + " GiB";
    for (size_t c : used)
      if (p.bytes[c] > 0) tip += "\n  " + t.categories[c] + " " + gib(p.bytes[c]);
    out << fmt::format("<g><title>{}</title>", xml_escape(tip));
    double below = 0;
    for (size_t c : used) {
      if (p.bytes[c] == 0) continue;
      const double gib_c = static_cast<double>(p.bytes[c]) / gib_bytes;
      out << fmt::format("<rect x=\"{:.1f}\" y=\"{:.2f}\" width=\"{:.1f}\" height=\"{:.2f}\" fill=\"{}\"/>", x, y_of(below + gib_c),
                         bar_w, y_of(below) - y_of(below + gib_c), color_of(t.categories[c], c));
      below += gib_c;
    }
    out << "</g>\n";
    const double lx2 = x + bar_w / 2 + 3, ly = top + plot_h + 8;
    out << fmt::format("<text x=\"{:.1f}\" y=\"{:.0f}\" transform=\"rotate(-60 {:.1f} {:.0f})\" text-anchor=\"end\"{}>{}</text>\n",
                       lx2, ly, lx2, ly, i == peak ? " font-weight=\"bold\"" : "", xml_escape(p.name));
  }
  // The peak, and a plan's budget.
  const double px = bar_x(peak) + bar_w / 2;
  const double pgib = static_cast<double>(t.phases[peak].total) / gib_bytes;
  out << fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"middle\">peak {} GiB</text>\n", px, y_of(pgib) - 5, gib(t.phases[peak].total));
  if (t.usable) {  // the line the bars must stay under for the plan to fit
    const double by = y_of(static_cast<double>(*t.usable) / gib_bytes);
    out << fmt::format("<line x1=\"{:.0f}\" y1=\"{:.1f}\" x2=\"{:.0f}\" y2=\"{:.1f}\" stroke=\"#c00000\" stroke-dasharray=\"6 4\"/>", left, by,
                       left + plot_w, by);
    out << fmt::format("<text x=\"{:.0f}\" y=\"{:.1f}\" text-anchor=\"end\" fill=\"#c00000\">GPU budget {} GiB less overhead and "
                       "fragmentation reserve: {} GiB</text>\n",
                       left + plot_w, by - 4, gib(*t.budget), gib(*t.usable));
  }
  out << "</svg>\n";
}

}  // namespace

Command make_trace_command() {
  return {"trace",
          "A memory timeline (a plan's, or one verify --trace wrote) as a table, CSV, Chrome trace events or an SVG chart",
          [](CLI::App& sub) -> RunFunction {
            auto o = std::make_shared<TraceOptions>();
            sub.add_option("file", o->file, "plan.json (its predicted timeline) or a trace from verify --trace")->required();
            sub.add_option("--space", o->space, "device or host")
                ->check(CLI::IsMember({"device", "host"}))
                ->default_str("device");
            const std::map<std::string, TraceFormat> names{
                {"table", TraceFormat::Table}, {"csv", TraceFormat::Csv}, {"chrome", TraceFormat::Chrome}, {"svg", TraceFormat::Svg}};
            sub.add_option("--format", o->format, "table, csv, chrome (trace events for chrome://tracing or Perfetto) or svg")
                ->transform(CLI::CheckedTransformer(names).description(""))
                ->transform(CLI::IsMember(std::vector<std::string>{"table", "csv", "chrome", "svg"}).description(""))
                ->type_name("table|csv|chrome|svg")
                ->default_str("table");
            return [o]() -> int {
              const json document = parse_json_text(read_text_file(o->file), o->file);
              const Timeline t = read_timeline(document, o->file, o->space);
              std::ostringstream out;  // written whole, so an error leaves no partial output
              switch (o->format) {
                case TraceFormat::Table: print_table(t, o->space, out); break;
                case TraceFormat::Csv: print_csv(t, o->space, out); break;
                case TraceFormat::Chrome: print_chrome(t, o->space, out); break;
                case TraceFormat::Svg: print_svg(t, o->space, out); break;
              }
              std::cout << out.str() << std::flush;
              return kExitOk;
            };
          }};
}

}  // namespace flatpeak::cli
