// `flatpeak models [--format table|json]`: the built-in cards. The listing is a list of sections
// (model cards, then hardware cards): each is one titled table in table output and one key of
// the JSON object.
#include <algorithm>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "commands.h"
#include "exit_codes.h"
#include "spec/hardware_loader.h"
#include "spec/model_loader.h"
#include "spec/param_count.h"
#include "spec/sizes.h"

namespace flatpeak::cli {

namespace {

using ordered_json = nlohmann::ordered_json;

struct Column {
  std::string title;
  bool right_aligned;
};

// One section of the listing.
struct Section {
  std::string json_key;  // key of the JSON output: "models"
  std::string title;     // first line above the table
  std::vector<Column> columns;
  std::vector<std::vector<std::string>> rows;
  std::string footnote;  // printed under the table; empty for none
  ordered_json items = ordered_json::array();
};

std::string billions(int64_t params) { return fmt::format("{:.2f}B", static_cast<double>(params) / 1e9); }

std::string join(const std::vector<std::string>& parts, const char* separator) {
  std::string text;
  for (const auto& part : parts) text += (text.empty() ? "" : separator) + part;
  return text;
}

Section model_cards_section() {
  Section section;
  section.json_key = "models";
  section.title = "Model cards (built in from models/*.json; `flatpeak inspect MODEL` shows one in full)";
  section.columns = {{"MODEL", false}, {"ARCHITECTURE", false}, {"LAYERS", true}, {"EXPERTS", false},
                     {"TOTAL", true},  {"ACTIVE", true},        {"ALIASES", false}};
  section.footnote =
      "TOTAL excludes MTP modules; ACTIVE: parameters one token uses, lm head included, input embedding not.";
  for (const auto& card : list_model_cards()) {
    const ModelSpec model = load_model(card.name);
    const ParamCounts params = count_params(model);
    std::string experts = fmt::format("{} top-{}", model.num_experts, model.top_k);
    if (model.num_shared_experts > 0) experts += fmt::format(" +{} shared", model.num_shared_experts);
    std::string layers = std::to_string(model.num_layers);
    if (model.mtp_layers > 0) layers += fmt::format(" +{} MTP", model.mtp_layers);
    section.rows.push_back({card.name, card.architecture, layers, experts, billions(params.total),
                            billions(params.active), card.aliases.empty() ? "-" : join(card.aliases, ", ")});

    ordered_json item;
    item["name"] = card.name;
    item["aliases"] = card.aliases;
    item["architecture"] = card.architecture;
    item["num_layers"] = model.num_layers;
    item["mtp_layers"] = model.mtp_layers;
    item["num_experts"] = model.num_experts;
    item["top_k"] = model.top_k;
    item["num_shared_experts"] = model.num_shared_experts;
    item["params"] = {{"total", params.total},
                      {"active", params.active},
                      {"active_with_embedding", params.active_with_embedding},
                      {"total_official", model.params_total_official ? ordered_json(*model.params_total_official) : nullptr},
                      {"active_official", model.params_active_official ? ordered_json(*model.params_active_official) : nullptr}};
    section.items.push_back(std::move(item));
  }
  return section;
}

Section hardware_cards_section() {
  Section section;
  section.json_key = "hardware";
  section.title = "Hardware cards (built in from models/hardware/*.json; select with --gpu NAME)";
  section.columns = {{"GPU", false},     {"MEMORY", true},      {"HBM", true},       {"BF16", true},
                     {"SCALE-UP", true}, {"HOST LINK", true},   {"GPUS/NODE", true}, {"HOST/NODE", true},
                     {"ALIASES", false}};
  section.footnote =
      "MEMORY: what the device reports (the GPU budget). Bandwidths per direction; HBM and links in GB/s, "
      "BF16 dense in TFLOP/s.";
  for (const auto& card : list_hardware_cards()) {
    section.rows.push_back({card.name, format_bytes(card.device_memory_bytes),
                            fmt::format("{:.0f}", card.hbm_bandwidth_bytes_per_s / 1e9),
                            fmt::format("{:.1f}", card.bf16_dense_flops / 1e12),
                            fmt::format("{:.0f}", card.scale_up_bandwidth_bytes_per_s / 1e9),
                            fmt::format("{:.0f}", card.host_link_bandwidth_bytes_per_s / 1e9),
                            std::to_string(card.gpus_per_node), format_bytes(card.host_memory_bytes_per_node),
                            card.aliases.empty() ? "-" : join(card.aliases, ", ")});
    ordered_json item;
    item["name"] = card.name;
    item["aliases"] = card.aliases;
    item["device_memory_bytes"] = card.device_memory_bytes;
    item["hbm_bandwidth_bytes_per_s"] = card.hbm_bandwidth_bytes_per_s;
    item["bf16_dense_flops"] = card.bf16_dense_flops;
    item["scale_up_bandwidth_bytes_per_s"] = card.scale_up_bandwidth_bytes_per_s;
    item["host_link_bandwidth_bytes_per_s"] = card.host_link_bandwidth_bytes_per_s;
    item["inter_node_bandwidth_bytes_per_s"] = card.inter_node_bandwidth_bytes_per_s;
    item["gpus_per_node"] = card.gpus_per_node;
    item["host_memory_bytes_per_node"] = card.host_memory_bytes_per_node;
    item["host_memory_bandwidth_bytes_per_s"] = card.host_memory_bandwidth_bytes_per_s;
    item["cpu_cores_per_node"] = card.cpu_cores_per_node;
    item["runtime_overhead_bytes"] = card.runtime_overhead_bytes;
    item["overhead_calibrated"] = card.overhead_calibrated;
    section.items.push_back(std::move(item));
  }
  return section;
}

std::vector<Section> listing_sections() { return {model_cards_section(), hardware_cards_section()}; }

void print_table(const Section& section, std::ostream& out) {
  std::vector<size_t> widths;
  for (const auto& column : section.columns) widths.push_back(column.title.size());
  for (const auto& row : section.rows) {
    for (size_t i = 0; i < row.size(); ++i) widths[i] = std::max(widths[i], row[i].size());
  }
  const auto print_row = [&](const std::vector<std::string>& cells) {
    std::string line;
    for (size_t i = 0; i < cells.size(); ++i) {
      const bool last = i + 1 == cells.size();
      if (section.columns[i].right_aligned) {
        line += fmt::format("{:>{}}", cells[i], widths[i]);
      } else {
        line += last ? cells[i] : fmt::format("{:<{}}", cells[i], widths[i]);
      }
      if (!last) line += "  ";
    }
    out << line << "\n";
  };
  out << section.title << "\n\n";
  std::vector<std::string> titles;
  for (const auto& column : section.columns) titles.push_back(column.title);
  print_row(titles);
  for (const auto& row : section.rows) print_row(row);
  if (!section.footnote.empty()) out << "\n" << section.footnote << "\n";
}

}  // namespace

Command make_models_command() {
  return {"models", "List the built-in model cards (with parameter counts) and hardware cards",
          [](CLI::App& sub) -> RunFunction {
            auto format = std::make_shared<OutputFormat>(OutputFormat::Table);
            add_format_option(sub, *format);
            return [format]() {
              const std::vector<Section> sections = listing_sections();
              if (*format == OutputFormat::Json) {
                ordered_json document = ordered_json::object();
                for (const auto& section : sections) document[section.json_key] = section.items;
                std::cout << document.dump(2) << "\n";
                return int{kExitOk};
              }
              for (size_t i = 0; i < sections.size(); ++i) {
                if (i > 0) std::cout << "\n";
                print_table(sections[i], std::cout);
              }
              return int{kExitOk};
            };
          }};
}

}  // namespace flatpeak::cli
