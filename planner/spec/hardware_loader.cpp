#include "hardware_loader.h"

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <limits>

#include <fmt/format.h>

#include "spec/embedded_cards.h"
#include "spec/errors.h"
#include "spec/json_util.h"

namespace flatpeak {

namespace {

std::string lowercase(std::string text) {
  std::transform(text.begin(), text.end(), text.begin(), [](unsigned char c) { return std::tolower(c); });
  return text;
}

// Reads the fields of one card, recording every problem instead of stopping at the first.
class CardReader {
 public:
  // `parent`: the JSON pointer of `card` inside the file ("" for the card itself).
  CardReader(const nlohmann::json& card, std::string file, std::string parent = "")
      : card_(card), file_(std::move(file)), parent_(std::move(parent)) {}

  // `max_value`: a bound that keeps the planner's sums of bytes inside 64 bits.
  int64_t positive_integer(const char* key, int64_t max_value = std::numeric_limits<int64_t>::max()) {
    const nlohmann::json* value = find(key, "a positive integer");
    if (value == nullptr) return 0;
    if (!value->is_number_integer() || value->get<int64_t>() <= 0) {
      problem(key, fmt::format("must be a positive integer (got {})", describe_json_value(*value)));
      return 0;
    }
    if (value->get<int64_t>() > max_value) {
      problem(key, fmt::format("must be at most {} (got {})", max_value, describe_json_value(*value)));
      return 0;
    }
    return value->get<int64_t>();
  }

  // A bandwidth (bytes/s) or a throughput (flop/s). Bounds that keep every time finite and
  // meaningful: 1e6/s is below any link a GPU has, 1e21/s far above any device; a rate of
  // 1e-300 turned a step time into inf or NaN with exit 0.
  double rate(const char* key) {
    constexpr double kMinRate = 1e6, kMaxRate = 1e21;
    const nlohmann::json* value = find(key, "a rate per second in [1e6, 1e21]");
    if (value == nullptr) return 0;
    if (!value->is_number() || !(value->get<double>() >= kMinRate && value->get<double>() <= kMaxRate)) {
      problem(key, fmt::format("must be a rate per second in [1e6, 1e21] (got {})", describe_json_value(*value)));
      return 0;
    }
    return value->get<double>();
  }

  double fraction(const char* key) {
    const nlohmann::json* value = find(key, "a number in [0, 1)");
    if (value == nullptr) return 0;
    if (!value->is_number() || !(value->get<double>() >= 0 && value->get<double>() < 1)) {
      problem(key, fmt::format("must be a number in [0, 1) (got {})", describe_json_value(*value)));
      return 0;
    }
    return value->get<double>();
  }

  int64_t nonnegative_integer(const char* key, int64_t max_value = std::numeric_limits<int64_t>::max()) {
    const nlohmann::json* value = find(key, "an integer >= 0");
    if (value == nullptr) return 0;
    if (!value->is_number_integer() || value->get<int64_t>() < 0) {
      problem(key, fmt::format("must be an integer >= 0 (got {})", describe_json_value(*value)));
      return 0;
    }
    if (value->get<int64_t>() > max_value) {
      problem(key, fmt::format("must be at most {} (got {})", max_value, describe_json_value(*value)));
      return 0;
    }
    return value->get<int64_t>();
  }

  bool boolean(const char* key) {
    const nlohmann::json* value = find(key, "true or false");
    if (value == nullptr) return false;
    if (!value->is_boolean()) {
      problem(key, fmt::format("must be true or false (got {})", describe_json_value(*value)));
      return false;
    }
    return value->get<bool>();
  }

  std::string string(const char* key) {
    const nlohmann::json* value = find(key, "a string");
    if (value == nullptr) return "";
    if (!value->is_string() || value->get<std::string>().empty()) {
      problem(key, fmt::format("must be a non-empty string (got {})", describe_json_value(*value)));
      return "";
    }
    return value->get<std::string>();
  }

  std::vector<std::string> string_list(const char* key) {
    const nlohmann::json* value = find(key, "a list of strings");
    std::vector<std::string> list;
    if (value == nullptr) return list;
    if (!value->is_array()) {
      problem(key, fmt::format("must be a list of strings (got {})", describe_json_value(*value)));
      return list;
    }
    for (size_t i = 0; i < value->size(); ++i) {
      const auto& item = (*value)[i];
      if (!item.is_string()) {
        errors_.add({file_, child_pointer(parent_ + "/" + std::string(key), std::to_string(i)),
                     fmt::format("must be a string (got {})", describe_json_value(item)), ""});
      } else {
        list.push_back(item.get<std::string>());
      }
    }
    return list;
  }

  // Keys that are allowed but not read here; `kind` "string" or "object" (free-form
  // documentation) is checked when given.
  void allow(const char* key, const char* kind = nullptr) {
    known_.emplace_back(key);
    const auto it = card_.find(key);
    if (kind == nullptr || it == card_.end()) return;
    const bool object = std::string(kind) == "object";
    if (object ? !it->is_object() : !it->is_string())
      problem(key, fmt::format("must be {} (got {})", object ? "an object" : "a string", describe_json_value(*it)));
  }

  void report_unknown_keys() {
    for (const auto& [key, value] : card_.items()) {
      if (std::find(known_.begin(), known_.end(), key) != known_.end()) continue;
      const std::string guess = did_you_mean(key, known_);
      errors_.add({file_, child_pointer(parent_, key),
                   guess.empty() ? "unknown key" : fmt::format("unknown key (did you mean \"{}\"?)", guess), ""});
    }
  }

  InputErrors& errors() { return errors_; }

 private:
  const nlohmann::json* find(const char* key, const char* what) {
    known_.emplace_back(key);
    const auto it = card_.find(key);
    if (it == card_.end()) {
      problem(key, fmt::format("required key missing (expected {})", what));
      return nullptr;
    }
    return &*it;
  }

  void problem(const char* key, std::string message) {
    errors_.add({file_, child_pointer(parent_, key), std::move(message), ""});
  }

  const nlohmann::json& card_;
  std::string file_;
  std::string parent_;
  std::vector<std::string> known_;
  InputErrors errors_;
};

bool matches_card(const HardwareSpec& spec, const std::string& wanted) {
  const std::string key = lowercase(wanted);
  if (lowercase(spec.name) == key) return true;
  return std::any_of(spec.aliases.begin(), spec.aliases.end(),
                     [&](const std::string& alias) { return lowercase(alias) == key; });
}

}  // namespace

HardwareSpec parse_hardware_card(const nlohmann::json& card, const std::string& file) {
  if (!card.is_object()) {
    throw InputError(Diagnostic{file, "", fmt::format("a hardware card must be a JSON object (got {})",
                                                      describe_json_value(card)), ""});
  }
  CardReader read(card, file);
  HardwareSpec spec;
  spec.source = file;
  spec.name = read.string("name");
  spec.aliases = read.string_list("aliases");
  read.allow("description", "string");
  read.allow("notes", "object");
  // 1 PiB of device memory and overhead, a 1 GiB alignment: far above any device, and the
  // planner's peak + overhead stays inside 64 bits.
  constexpr int64_t kMaxDeviceBytes = int64_t{1} << 50;
  spec.device_memory_bytes = read.positive_integer("device_memory_bytes", kMaxDeviceBytes);
  spec.hbm_bandwidth_bytes_per_s = read.rate("hbm_bandwidth_bytes_per_s");
  spec.bf16_dense_flops = read.rate("bf16_dense_flops");
  spec.scale_up_bandwidth_bytes_per_s = read.rate("scale_up_bandwidth_bytes_per_s");
  spec.host_link_bandwidth_bytes_per_s = read.rate("host_link_bandwidth_bytes_per_s");
  spec.inter_node_bandwidth_bytes_per_s = read.rate("inter_node_bandwidth_bytes_per_s");
  spec.gpus_per_node = read.positive_integer("gpus_per_node");
  spec.host_memory_bytes_per_node = read.positive_integer("host_memory_bytes_per_node");
  spec.host_memory_bandwidth_bytes_per_s = read.rate("host_memory_bandwidth_bytes_per_s");
  spec.cpu_cores_per_node = read.positive_integer("cpu_cores_per_node");
  spec.runtime_overhead_bytes = read.nonnegative_integer("runtime_overhead_bytes", kMaxDeviceBytes);
  spec.fragmentation_fraction = read.fraction("fragmentation_fraction");
  spec.allocation_alignment_bytes = read.positive_integer("allocation_alignment_bytes", int64_t{1} << 30);
  spec.overhead_calibrated = read.boolean("overhead_calibrated");
  // Optional: the calibrated overhead's parts (flatpeak_calibrate), which must add up to it.
  read.allow("runtime_overhead_terms");
  if (const auto terms = card.find("runtime_overhead_terms"); terms != card.end()) {
    if (!terms->is_object()) {
      read.errors().add({file, "/runtime_overhead_terms",
                         fmt::format("must be an object of byte counts (got {})", describe_json_value(*terms)), ""});
    } else {
      CardReader parts(*terms, file, "/runtime_overhead_terms");
      OverheadTerms& t = spec.runtime_overhead_terms;
      t.cuda_context_bytes = parts.nonnegative_integer("cuda_context_bytes", kMaxDeviceBytes);
      t.cublas_bytes = parts.nonnegative_integer("cublas_bytes", kMaxDeviceBytes);
      t.cublas_workspace_bytes = parts.nonnegative_integer("cublas_workspace_bytes", kMaxDeviceBytes);
      t.nccl_bytes = parts.nonnegative_integer("nccl_bytes", kMaxDeviceBytes);
      parts.report_unknown_keys();
      for (const auto& d : parts.errors().diagnostics()) read.errors().add(d);
      t.present = parts.errors().empty();
      if (t.present && t.sum() != spec.runtime_overhead_bytes)
        read.errors().add({file, "/runtime_overhead_terms",
                           fmt::format("must add up to runtime_overhead_bytes = {} (got {} + {} + {} + {} = {})",
                                       spec.runtime_overhead_bytes, t.cuda_context_bytes, t.cublas_bytes, t.cublas_workspace_bytes,
                                       t.nccl_bytes, t.sum()),
                           ""});
    }
  }
  read.report_unknown_keys();
  if (spec.allocation_alignment_bytes > 0 &&
      (spec.allocation_alignment_bytes & (spec.allocation_alignment_bytes - 1)) != 0) {
    read.errors().add({file, "/allocation_alignment_bytes",
                       fmt::format("must be a power of two (got {})", spec.allocation_alignment_bytes), ""});
  }
  read.errors().throw_if_any();
  return spec;
}

std::vector<HardwareSpec> list_hardware_cards() {
  std::vector<HardwareSpec> cards;
  for (const auto& embedded : embedded_hardware_cards()) {
    const std::string file = "embedded:models/hardware/" + embedded.name + ".json";
    cards.push_back(parse_hardware_card(parse_json_text(embedded.json, file), file));
  }
  std::sort(cards.begin(), cards.end(),
            [](const HardwareSpec& a, const HardwareSpec& b) { return a.name < b.name; });
  return cards;
}

HardwareSpec load_hardware(const std::string& name_or_path) {
  const std::vector<HardwareSpec> cards = list_hardware_cards();
  for (const auto& card : cards) {
    if (matches_card(card, name_or_path)) return card;
  }
  std::error_code ignored;
  if (std::filesystem::is_regular_file(name_or_path, ignored)) {
    return parse_hardware_card(parse_json_text(read_text_file(name_or_path), name_or_path), name_or_path);
  }
  std::vector<std::string> names;
  std::string listing;
  for (const auto& card : cards) {
    names.push_back(card.name);
    for (const auto& alias : card.aliases) names.push_back(alias);
    listing += (listing.empty() ? "" : ", ") + card.name;
  }
  const std::string guess = did_you_mean(name_or_path, names);
  std::string hint = guess.empty() ? "" : fmt::format("did you mean '{}'? ", guess);
  hint += fmt::format("hardware cards: {}; or give the path to a hardware card JSON", listing);
  throw InputError(Diagnostic{"", "--gpu", fmt::format("unknown hardware '{}'", name_or_path), hint});
}

}  // namespace flatpeak
