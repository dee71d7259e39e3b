#include "routing.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <numeric>
#include <stdexcept>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "errors.h"
#include "json_util.h"
#include "sizes.h"

namespace flatpeak {

namespace {

constexpr int64_t kUnit = int64_t{1} << 30;  // one token's worth of inclusion weight
constexpr const char* kFlag = "--imbalance";
constexpr const char* kValidForms =
    "valid forms: balanced, rho=X (1 <= X <= EP*min(k,E/EP)/k), hot-expert=f,h (0 <= f <= 1, "
    "1 <= h <= E), hot-rank=f (0 <= f <= 1), zipf=s (s >= 0), file=PATH";

Diagnostic problem(std::string message, std::string hint = kValidForms) {
  return Diagnostic{"", kFlag, std::move(message), std::move(hint)};
}

// A plain decimal number ("2.5", "1e-3"): no hex, inf or nan, nothing after it.
bool parse_number(const std::string& text, double& value) {
  const auto v = parse_decimal(text);
  if (v) value = *v;
  return v.has_value();
}

bool parse_count(const std::string& text, int64_t& value) {
  if (text.empty() || text.size() > 15) return false;
  for (char c : text) {
    if (!std::isdigit(static_cast<unsigned char>(c))) return false;
  }
  value = std::stoll(text);
  return true;
}

void check_shape(const RoutingShape& shape) {
  if (shape.ep_ranks < 1 || shape.num_experts < 1 || shape.num_experts % shape.ep_ranks != 0 ||
      shape.top_k < 1 || shape.top_k > shape.num_experts) {
    throw std::invalid_argument(fmt::format(
        "routing shape needs EP >= 1, E % EP == 0, 1 <= k <= E (got EP={}, E={}, k={})",
        shape.ep_ranks, shape.num_experts, shape.top_k));
  }
}

size_t idx(int64_t i) { return static_cast<size_t>(i); }

const CountMatrix& file_layer(const RoutingFile& file, int64_t moe_layer) {
  const int64_t n = static_cast<int64_t>(file.layers.size());
  return file.layers[idx(moe_layer % n)];
}

// Desired (unnormalised) shares of source `ep_rank`'s copies per expert, before clamping.
std::vector<double> desired_shares(const RoutingModel& model, const RoutingShape& shape,
                                   int64_t ep_rank, int64_t moe_layer) {
  const int64_t e_count = shape.num_experts;
  const int64_t local = shape.experts_per_rank();
  std::vector<double> d(idx(e_count), 1.0);
  auto two_groups = [&](int64_t hot_count, double hot_share) {
    for (int64_t e = 0; e < e_count; ++e) {
      d[idx(e)] = e < hot_count ? hot_share / static_cast<double>(hot_count)
                                : (1.0 - hot_share) / static_cast<double>(e_count - hot_count);
    }
  };
  switch (model.kind) {
    case RoutingKind::Balanced:
      break;
    case RoutingKind::Rho:
      if (shape.ep_ranks > 1) two_groups(local, model.rho / static_cast<double>(shape.ep_ranks));
      break;
    case RoutingKind::HotExpert:
      if (model.hot_experts < e_count) two_groups(model.hot_experts, model.hot_fraction);
      break;
    case RoutingKind::HotRank:
      if (shape.ep_ranks > 1) two_groups(local, model.hot_fraction);
      break;
    case RoutingKind::Zipf:
      for (int64_t e = 0; e < e_count; ++e) {
        d[idx(e)] = std::pow(static_cast<double>(e + 1), -model.zipf_exponent);
      }
      break;
    case RoutingKind::File: {
      if (!model.file) throw std::invalid_argument("routing model file=" + model.file_path + " not loaded");
      const auto& row = file_layer(*model.file, moe_layer)[idx(ep_rank)];
      for (int64_t e = 0; e < e_count; ++e) d[idx(e)] = static_cast<double>(row[idx(e)]);
      break;
    }
  }
  for (double& x : d) x = std::max(0.0, x);
  if (std::accumulate(d.begin(), d.end(), 0.0) <= 0.0) std::fill(d.begin(), d.end(), 1.0);
  return d;
}

struct Inclusion {
  std::vector<int64_t> weight_units;  // [E], Σ = k·kUnit, each ≤ kUnit
  int64_t saturated_experts = 0;      // experts clamped to one copy per token
  double largest_share = 0.0;         // largest requested share of the copies (before clamping)
};

// Water-filling: inclusion probability π_e = k·q_e capped at 1, excess spread over the others
// in proportion to their shares; then integer units by largest remainder.
Inclusion inclusion_weights(const std::vector<double>& desired, int64_t top_k) {
  const size_t n = desired.size();
  const double total = std::accumulate(desired.begin(), desired.end(), 0.0);
  Inclusion out;
  out.largest_share = *std::max_element(desired.begin(), desired.end()) / total;
  std::vector<double> pi(n, 0.0);
  std::vector<char> saturated(n, 0);
  int64_t saturated_count = 0;
  while (true) {
    const double free_mass = static_cast<double>(top_k - saturated_count);
    double free_weight = 0.0;
    for (size_t e = 0; e < n; ++e) free_weight += saturated[e] ? 0.0 : desired[e];
    const double free_count = static_cast<double>(static_cast<int64_t>(n) - saturated_count);
    bool changed = false;
    for (size_t e = 0; e < n; ++e) {
      if (saturated[e]) continue;
      pi[e] = free_weight > 0.0 ? free_mass * desired[e] / free_weight : free_mass / free_count;
      if (pi[e] > 1.0 + 1e-9) {  // rounding noise at exactly 1 is not a clamp
        saturated[e] = 1;
        pi[e] = 1.0;
        ++saturated_count;
        changed = true;
      }
    }
    if (!changed) break;
  }
  out.saturated_experts = saturated_count;

  // Integer units: floors, then the deficit by largest fractional part (ties: lower expert).
  std::vector<int64_t>& w = out.weight_units;
  w.assign(n, 0);
  std::vector<double> frac(n, 0.0);
  int64_t sum = 0;
  for (size_t e = 0; e < n; ++e) {
    const double x = std::min(1.0, std::max(0.0, pi[e])) * static_cast<double>(kUnit);
    w[e] = static_cast<int64_t>(std::floor(x));
    frac[e] = x - static_cast<double>(w[e]);
    sum += w[e];
  }
  int64_t deficit = top_k * kUnit - sum;
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), size_t{0});
  if (deficit > 0) {
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return frac[a] > frac[b]; });
    while (deficit > 0) {
      for (size_t e : order) {
        if (deficit == 0) break;
        if (w[e] < kUnit) {
          ++w[e];
          --deficit;
        }
      }
    }
  } else if (deficit < 0) {
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return frac[a] < frac[b]; });
    while (deficit < 0) {
      for (size_t e : order) {
        if (deficit == 0) break;
        if (w[e] > 0) {
          --w[e];
          ++deficit;
        }
      }
    }
  }
  return out;
}

uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

// A counter-based stream of 32-bit draws for one token.
class TokenDraws {
 public:
  explicit TokenDraws(uint64_t key) : key_(key) {}
  uint32_t next() {
    if (!have_low_) {
      bits_ = splitmix64(key_ + counter_++);
      have_low_ = true;
      return static_cast<uint32_t>(bits_ >> 32);
    }
    have_low_ = false;
    return static_cast<uint32_t>(bits_ & 0xFFFFFFFFULL);
  }

 private:
  uint64_t key_;
  uint64_t counter_ = 0;
  uint64_t bits_ = 0;
  bool have_low_ = false;
};

std::string format_number(double x) { return fmt::format("{}", x); }

}  // namespace

bool operator==(const RoutingModel& a, const RoutingModel& b) {
  if (a.kind != b.kind) return false;
  switch (a.kind) {
    case RoutingKind::Balanced: return true;
    case RoutingKind::Rho: return a.rho == b.rho;
    case RoutingKind::HotExpert: return a.hot_fraction == b.hot_fraction && a.hot_experts == b.hot_experts;
    case RoutingKind::HotRank: return a.hot_fraction == b.hot_fraction;
    case RoutingKind::Zipf: return a.zipf_exponent == b.zipf_exponent;
    case RoutingKind::File: return a.file_path == b.file_path;
  }
  return false;
}

RoutingModel parse_routing_model(const std::string& text) {
  InputErrors errors;
  RoutingModel model;
  const size_t eq = text.find('=');
  const std::string name = text.substr(0, eq);
  const bool has_value = eq != std::string::npos;
  const std::string value = has_value ? text.substr(eq + 1) : "";
  const std::string quoted = "\"" + text + "\"";
  auto need_value = [&](const char* form) {
    if (!has_value) errors.add(problem(fmt::format("{} needs a value, as {} (got {})", name, form, quoted)));
    return has_value;
  };

  if (name == "balanced") {
    model.kind = RoutingKind::Balanced;
    if (has_value) errors.add(problem(fmt::format("balanced takes no value (got {})", quoted)));
  } else if (name == "rho") {
    model.kind = RoutingKind::Rho;
    if (need_value("rho=X")) {
      if (!parse_number(value, model.rho)) {
        errors.add(problem(fmt::format("rho=X needs a number X (got {})", quoted)));
      } else if (model.rho < 1.0) {
        errors.add(problem(fmt::format("rho=X needs X >= 1 (got {})", value)));
      }
    }
  } else if (name == "hot-expert") {
    model.kind = RoutingKind::HotExpert;
    if (need_value("hot-expert=f,h")) {
      const size_t comma = value.find(',');
      if (comma == std::string::npos || value.find(',', comma + 1) != std::string::npos) {
        errors.add(problem(fmt::format("hot-expert=f,h needs two values f,h (got {})", quoted)));
      } else {
        const std::string f_text = value.substr(0, comma), h_text = value.substr(comma + 1);
        if (!parse_number(f_text, model.hot_fraction) || model.hot_fraction < 0.0 ||
            model.hot_fraction > 1.0) {
          errors.add(problem(fmt::format("hot-expert=f,h needs 0 <= f <= 1 (got {})", f_text)));
        }
        if (!parse_count(h_text, model.hot_experts) || model.hot_experts < 1) {
          errors.add(problem(fmt::format("hot-expert=f,h needs an integer h >= 1 (got {})", h_text)));
        }
      }
    }
  } else if (name == "hot-rank") {
    model.kind = RoutingKind::HotRank;
    if (need_value("hot-rank=f")) {
      if (!parse_number(value, model.hot_fraction) || model.hot_fraction < 0.0 ||
          model.hot_fraction > 1.0) {
        errors.add(problem(fmt::format("hot-rank=f needs 0 <= f <= 1 (got {})", value)));
      }
    }
  } else if (name == "zipf") {
    model.kind = RoutingKind::Zipf;
    if (need_value("zipf=s")) {
      if (!parse_number(value, model.zipf_exponent) || model.zipf_exponent < 0.0) {
        errors.add(problem(fmt::format("zipf=s needs a number s >= 0 (got {})", value)));
      }
    }
  } else if (name == "file") {
    model.kind = RoutingKind::File;
    if (need_value("file=PATH")) {
      if (value.empty()) {
        errors.add(problem(fmt::format("file=PATH needs a path (got {})", quoted)));
      } else {
        model.file_path = value;
        errors.throw_if_any();
        model.file = std::make_shared<const RoutingFile>(load_routing_file(value));
      }
    }
  } else {
    const std::string guess =
        did_you_mean(name, {"balanced", "rho", "hot-expert", "hot-rank", "zipf", "file"});
    errors.add(problem(fmt::format("unknown routing model (got {})", quoted),
                       guess.empty() ? kValidForms
                                     : fmt::format("did you mean \"{}\"? {}", guess, kValidForms)));
  }
  errors.throw_if_any();
  return model;
}

std::string to_string(const RoutingModel& model) {
  switch (model.kind) {
    case RoutingKind::Balanced: return "balanced";
    case RoutingKind::Rho: return "rho=" + format_number(model.rho);
    case RoutingKind::HotExpert:
      return fmt::format("hot-expert={},{}", format_number(model.hot_fraction), model.hot_experts);
    case RoutingKind::HotRank: return "hot-rank=" + format_number(model.hot_fraction);
    case RoutingKind::Zipf: return "zipf=" + format_number(model.zipf_exponent);
    case RoutingKind::File: return "file=" + model.file_path;
  }
  return "balanced";
}

RoutingFile load_routing_file(const std::string& path) {
  return parse_routing_file(read_text_file(path), path);
}

RoutingFile parse_routing_file(const std::string& json_text, const std::string& path) {
  const nlohmann::json j = parse_json_text(json_text, path);
  InputErrors errors;
  auto add = [&](const std::string& pointer, std::string message) {
    errors.add(Diagnostic{path, pointer, std::move(message), ""});
  };
  RoutingFile file;
  file.path = path;
  if (!j.is_object()) {
    add("", fmt::format("a routing file must be a JSON object (got {})", describe_json_value(j)));
    errors.throw_if_any();
  }
  const std::vector<std::string> keys = {"flatpeak_routing", "ep_ranks", "num_experts", "layers"};
  for (const auto& item : j.items()) {
    if (std::find(keys.begin(), keys.end(), item.key()) == keys.end()) {
      const std::string guess = did_you_mean(item.key(), keys);
      errors.add(Diagnostic{path, child_pointer("", item.key()), "unknown key",
                            guess.empty() ? "" : fmt::format("did you mean \"{}\"?", guess)});
    }
  }
  auto positive = [&](const char* key, int64_t& out) {
    const auto it = j.find(key);
    if (it == j.end()) {
      add(child_pointer("", key), "missing (a positive integer)");
    } else if (!it->is_number_integer() || it->get<int64_t>() < 1) {
      add(child_pointer("", key), fmt::format("must be a positive integer (got {})", describe_json_value(*it)));
    } else {
      out = it->get<int64_t>();
    }
  };
  const auto version = j.find("flatpeak_routing");
  if (version == j.end() || !version->is_number_integer() || version->get<int64_t>() != 1) {
    add("/flatpeak_routing", fmt::format("must be 1 (got {})",
                                         version == j.end() ? "nothing" : describe_json_value(*version)));
  }
  positive("ep_ranks", file.ep_ranks);
  positive("num_experts", file.num_experts);
  const auto layers = j.find("layers");
  if (layers == j.end() || !layers->is_array() || layers->empty()) {
    add("/layers", "must be a non-empty array of EP x E matrices");
  }
  if (layers == j.end() || !layers->is_array() || layers->empty() || file.ep_ranks == 0 ||
      file.num_experts == 0) {
    errors.throw_if_any();
  }

  for (size_t l = 0; l < layers->size(); ++l) {
    const std::string lp = fmt::format("/layers/{}", l);
    const auto& m = (*layers)[l];
    if (!m.is_array() || static_cast<int64_t>(m.size()) != file.ep_ranks) {
      add(lp, fmt::format("must be an array of ep_ranks = {} rows (got {})", file.ep_ranks,
                          describe_json_value(m)));
      continue;
    }
    CountMatrix matrix;
    for (size_t s = 0; s < m.size(); ++s) {
      const std::string sp = fmt::format("{}/{}", lp, s);
      const auto& row = m[s];
      if (!row.is_array() || static_cast<int64_t>(row.size()) != file.num_experts) {
        add(sp, fmt::format("must be an array of num_experts = {} counts (got {})",
                            file.num_experts, describe_json_value(row)));
        continue;
      }
      std::vector<int64_t> counts;
      int64_t row_sum = 0;
      bool row_ok = true;
      for (size_t e = 0; e < row.size(); ++e) {
        if (!row[e].is_number_integer() || row[e].get<int64_t>() < 0 ||
            row[e].get<int64_t>() > (int64_t{1} << 40)) {
          add(fmt::format("{}/{}", sp, e), fmt::format("must be an integer in 0..2^40 (got {})",
                                                       describe_json_value(row[e])));
          row_ok = false;
          continue;
        }
        counts.push_back(row[e].get<int64_t>());
        row_sum += counts.back();
      }
      if (row_ok && row_sum == 0) add(sp, "must have a positive sum (got all zeros)");
      matrix.push_back(std::move(counts));
    }
    file.layers.push_back(std::move(matrix));
  }
  errors.throw_if_any();
  return file;
}

void validate_routing_model(const RoutingModel& model, const RoutingShape& shape,
                            int64_t num_moe_layers) {
  check_shape(shape);
  InputErrors errors;
  const double limit = rho_max(shape);
  if (model.kind == RoutingKind::Rho && model.rho > limit * (1.0 + 1e-12)) {
    errors.add(problem(fmt::format("rho=X needs X <= EP*min(k,E/EP)/k = {} at EP={}, E={}, k={} (got {})",
                                   format_number(limit), shape.ep_ranks, shape.num_experts,
                                   shape.top_k, format_number(model.rho))));
  }
  if (model.kind == RoutingKind::HotExpert && model.hot_experts > shape.num_experts) {
    errors.add(problem(fmt::format("hot-expert=f,h needs h <= E = {} (got {})", shape.num_experts,
                                   model.hot_experts)));
  }
  if (model.kind == RoutingKind::File) {
    if (!model.file) {
      errors.add(problem(fmt::format("file={} was not loaded", model.file_path)));
    } else {
      const RoutingFile& f = *model.file;
      if (f.ep_ranks != shape.ep_ranks) {
        errors.add(Diagnostic{f.path, "/ep_ranks", fmt::format("must equal EP = {} (got {})", shape.ep_ranks, f.ep_ranks), ""});
      }
      if (f.num_experts != shape.num_experts) {
        errors.add(Diagnostic{f.path, "/num_experts", fmt::format("must equal E = {} (got {})", shape.num_experts, f.num_experts), ""});
      }
      const int64_t count = static_cast<int64_t>(f.layers.size());
      if (num_moe_layers > 0 && count != 1 && count != num_moe_layers) {
        errors.add(Diagnostic{f.path, "/layers",
                              fmt::format("must hold 1 matrix or one per MoE layer ({}) (got {})",
                                          num_moe_layers, count), ""});
      }
    }
  }
  errors.throw_if_any();
}

ExpectedLoads expected_loads(const RoutingModel& model, const RoutingShape& shape,
                             int64_t tokens_per_rank, int64_t moe_layer) {
  check_shape(shape);
  if (tokens_per_rank < 0 || tokens_per_rank > (int64_t{1} << 32) || moe_layer < 0) {
    throw std::invalid_argument(fmt::format("expected_loads needs 0 <= T <= 2^32 and layer >= 0 (got T={}, layer={})",
                                            tokens_per_rank, moe_layer));
  }
  ExpectedLoads out;
  const int64_t e_count = shape.num_experts;
  for (int64_t s = 0; s < shape.ep_ranks; ++s) {
    const Inclusion inc = inclusion_weights(desired_shares(model, shape, s, moe_layer), shape.top_k);
    if (inc.saturated_experts > 0 && !out.clamped) {
      out.clamped = true;
      out.clamp_note = fmt::format(
          "--imbalance {}: {} expert(s) would receive more than one copy per token (largest share "
          "{:.4g} of a source's copies > 1/k = {:.4g}{}); clamped to one copy per token, the excess "
          "spread over the other experts",
          to_string(model), inc.saturated_experts, inc.largest_share,
          1.0 / static_cast<double>(shape.top_k),
          model.kind == RoutingKind::File ? fmt::format(", source rank {}", s) : std::string());
    }
    std::vector<int64_t> row(idx(e_count));
    std::vector<int64_t> remainder(idx(e_count));
    int64_t assigned = 0;
    for (int64_t e = 0; e < e_count; ++e) {
      const int64_t scaled = tokens_per_rank * inc.weight_units[idx(e)];  // ≤ 2^62
      row[idx(e)] = scaled / kUnit;
      remainder[idx(e)] = scaled % kUnit;
      assigned += row[idx(e)];
    }
    std::vector<size_t> order(idx(e_count));
    std::iota(order.begin(), order.end(), size_t{0});
    std::stable_sort(order.begin(), order.end(),
                     [&](size_t a, size_t b) { return remainder[a] > remainder[b]; });
    int64_t deficit = tokens_per_rank * shape.top_k - assigned;  // < E: Σ remainder = deficit·kUnit
    for (size_t i = 0; i < order.size() && deficit > 0; ++i, --deficit) ++row[order[i]];
    out.copies.push_back(std::move(row));
  }
  return out;
}

std::vector<int32_t> generate_routing(const RoutingModel& model, const RoutingShape& shape,
                                      int64_t tokens, uint64_t seed, int64_t rank,
                                      int64_t ep_rank, int64_t moe_layer) {
  check_shape(shape);
  if (tokens < 0 || ep_rank < 0 || ep_rank >= shape.ep_ranks || moe_layer < 0) {
    throw std::invalid_argument(fmt::format("generate_routing needs T >= 0, 0 <= ep_rank < EP, layer >= 0 "
                                            "(got T={}, ep_rank={}, layer={})", tokens, ep_rank, moe_layer));
  }
  const Inclusion inc =
      inclusion_weights(desired_shares(model, shape, ep_rank, moe_layer), shape.top_k);
  // Only experts that can be drawn take part in the per-token order.
  std::vector<int32_t> candidates;
  for (int64_t e = 0; e < shape.num_experts; ++e) {
    if (inc.weight_units[idx(e)] > 0) candidates.push_back(static_cast<int32_t>(e));
  }
  const uint64_t stream = splitmix64(splitmix64(splitmix64(seed) ^ static_cast<uint64_t>(rank)) ^
                                     static_cast<uint64_t>(moe_layer));
  const size_t k = idx(shape.top_k);
  std::vector<int32_t> ids(idx(tokens) * k);
  std::vector<int32_t> order(candidates.size());
  for (int64_t t = 0; t < tokens; ++t) {
    TokenDraws draws(splitmix64(stream ^ static_cast<uint64_t>(t)));
    std::copy(candidates.begin(), candidates.end(), order.begin());
    for (size_t i = order.size(); i > 1; --i) {  // Fisher-Yates, index by multiply-shift
      const size_t j = idx(static_cast<int64_t>((static_cast<uint64_t>(draws.next()) * i) >> 32));
      std::swap(order[i - 1], order[j]);
    }
    // Systematic sampling: targets u, u + 1, ..., u + k − 1 (in token units) over the cumulative
    // weights; each weight ≤ one unit, so no expert is hit twice.
    int64_t target = static_cast<int64_t>(draws.next() >> 2);  // uniform in [0, kUnit)
    int64_t cumulative = 0;
    size_t picked = 0;
    int32_t* out = ids.data() + idx(t) * k;
    for (int32_t e : order) {
      cumulative += inc.weight_units[idx(e)];
      if (target < cumulative) {
        out[picked++] = e;
        target += kUnit;
        if (picked == k) break;
      }
    }
  }
  return ids;
}

std::vector<int64_t> count_routing(const std::vector<int32_t>& expert_ids,
                                   const RoutingShape& shape) {
  std::vector<int64_t> counts(idx(shape.num_experts), 0);
  for (int32_t e : expert_ids) {
    if (e < 0 || e >= shape.num_experts) {
      throw std::out_of_range(fmt::format("expert id {} outside 0..{}", e, shape.num_experts - 1));
    }
    ++counts[static_cast<size_t>(e)];
  }
  return counts;
}

CountMatrix count_matrix(const std::vector<std::vector<int32_t>>& expert_ids_per_rank,
                         const RoutingShape& shape) {
  if (static_cast<int64_t>(expert_ids_per_rank.size()) != shape.ep_ranks) {
    throw std::invalid_argument(fmt::format("count_matrix needs EP = {} id arrays (got {})",
                                            shape.ep_ranks, expert_ids_per_rank.size()));
  }
  CountMatrix m;
  for (const auto& ids : expert_ids_per_rank) m.push_back(count_routing(ids, shape));
  return m;
}

std::vector<int64_t> expert_loads(const CountMatrix& copies) {
  std::vector<int64_t> loads(copies.empty() ? 0 : copies.front().size(), 0);
  for (const auto& row : copies) {
    for (size_t e = 0; e < row.size() && e < loads.size(); ++e) loads[e] += row[e];
  }
  return loads;
}

std::vector<int64_t> received_rows_per_rank(const CountMatrix& copies, const RoutingShape& shape) {
  check_shape(shape);
  std::vector<int64_t> rows(idx(shape.ep_ranks), 0);
  for (const auto& row : copies) {
    for (int64_t e = 0; e < shape.num_experts && idx(e) < row.size(); ++e) {
      rows[idx(shape.rank_of_expert(e))] += row[idx(e)];
    }
  }
  return rows;
}

double imbalance_rho(const std::vector<int64_t>& rows_per_rank) {
  if (rows_per_rank.empty()) return 1.0;
  const int64_t total = std::accumulate(rows_per_rank.begin(), rows_per_rank.end(), int64_t{0});
  if (total <= 0) return 1.0;
  const int64_t most = *std::max_element(rows_per_rank.begin(), rows_per_rank.end());
  return static_cast<double>(most) * static_cast<double>(rows_per_rank.size()) /
         static_cast<double>(total);
}

double rho_max(const RoutingShape& shape) {
  check_shape(shape);
  return static_cast<double>(shape.ep_ranks * std::min(shape.top_k, shape.experts_per_rank())) /
         static_cast<double>(shape.top_k);
}

}  // namespace flatpeak
