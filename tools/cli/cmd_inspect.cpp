// `flatpeak inspect MODEL [--format table|json]`: a model's resolved dims and its parameter counts
// by part, with the card's official figures beside them. MODEL is a card name or alias, or a path
// to a card or a Hugging Face config.json.
#include <cmath>
#include <iostream>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "commands.h"
#include "exit_codes.h"
#include "spec/model_loader.h"
#include "spec/param_count.h"

namespace flatpeak::cli {

namespace {

using ordered_json = nlohmann::ordered_json;

struct InspectOptions {
  std::string model;
  OutputFormat format = OutputFormat::Table;
};

// Layers that share one attention restriction: (kind, tokens) -> indices.
using WindowGroups = std::map<std::pair<AttentionWindow, int64_t>, std::vector<int64_t>>;

WindowGroups window_groups(const ModelSpec& m) {
  WindowGroups groups;
  for (size_t i = 0; i < m.layers.size(); ++i) {
    const LayerSpec& layer = m.layers[i];
    if (layer.window != AttentionWindow::Full) {
      groups[{layer.window, layer.attention_window_tokens}].push_back(static_cast<int64_t>(i));
    }
  }
  return groups;
}

std::vector<int64_t> dense_indices(const ModelSpec& m) {
  std::vector<int64_t> indices;
  for (size_t i = 0; i < m.layers.size(); ++i) {
    if (m.layers[i].ffn == FfnKind::Dense) indices.push_back(static_cast<int64_t>(i));
  }
  return indices;
}

std::vector<int64_t> no_rope_indices(const ModelSpec& m) {
  std::vector<int64_t> indices;
  for (size_t i = 0; i < m.layers.size(); ++i) {
    if (!m.layers[i].rope) indices.push_back(static_cast<int64_t>(i));
  }
  return indices;
}

// "0-2", "0,2,...,34" (an arithmetic progression), or "1,5,9" for short irregular lists.
std::string compact_indices(const std::vector<int64_t>& indices) {
  if (indices.empty()) return "none";
  if (indices.size() == 1) return std::to_string(indices[0]);
  const int64_t step = indices[1] - indices[0];
  bool progression = true;
  for (size_t i = 2; i < indices.size(); ++i) progression = progression && indices[i] - indices[i - 1] == step;
  if (progression && step == 1) return fmt::format("{}-{}", indices.front(), indices.back());
  if (progression && indices.size() > 3) return fmt::format("{},{},...,{}", indices[0], indices[1], indices.back());
  std::string text;
  for (int64_t index : indices) text += (text.empty() ? "" : ",") + std::to_string(index);
  return text;
}

std::string with_commas(int64_t value) {
  std::string digits = std::to_string(value < 0 ? -value : value);
  std::string text;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) text += ',';
    text += digits[i];
  }
  return value < 0 ? "-" + text : text;
}

std::string billions(int64_t params) { return fmt::format("{:.2f}B", static_cast<double>(params) / 1e9); }

// 116.83B, 26.55M, 5.76K, 0: the size of a part at a glance.
std::string short_count(int64_t params) {
  const double value = static_cast<double>(params);
  if (params >= 1000000000) return billions(params);
  if (params >= 1000000) return fmt::format("{:.2f}M", value / 1e6);
  if (params >= 1000) return fmt::format("{:.2f}K", value / 1e3);
  return std::to_string(params);
}

ordered_json optional_json(const std::optional<int64_t>& value) {
  return value ? ordered_json(*value) : ordered_json(nullptr);
}

ordered_json model_json(const ModelSpec& m) {
  ordered_json attention;
  attention["kind"] = to_string(m.attention);
  attention["num_heads"] = m.num_heads;
  attention["num_kv_heads"] = m.num_kv_heads;
  attention["head_dim"] = m.head_dim;
  attention["v_head_dim"] = m.v_head_dim;
  attention["q_lora_rank"] = m.q_lora_rank;
  attention["kv_lora_rank"] = m.kv_lora_rank;
  attention["qk_nope_head_dim"] = m.qk_nope_head_dim;
  attention["qk_rope_head_dim"] = m.qk_rope_head_dim;
  attention["qkv_bias"] = m.qkv_bias;
  attention["o_bias"] = m.o_bias;
  attention["qk_norm"] = to_string(m.qk_norm);
  attention["sinks"] = m.attention_sinks;
  attention["partial_rotary_factor"] = m.partial_rotary_factor;

  ordered_json moe;
  moe["num_experts"] = m.num_experts;
  moe["top_k"] = m.top_k;
  moe["expert_ffn_width"] = m.expert_ffn_width;
  moe["num_shared_experts"] = m.num_shared_experts;
  moe["shared_expert_ffn_width"] = m.shared_expert_ffn_width;
  moe["shared_expert_gate"] = m.shared_expert_gate;
  moe["router_bias"] = m.router_bias;
  moe["router_correction_bias"] = m.router_correction_bias;
  moe["expert_bias"] = m.expert_bias;

  ordered_json windows = ordered_json::array();
  for (const auto& [key, indices] : window_groups(m)) {
    windows.push_back({{"kind", to_string(key.first)}, {"tokens", key.second}, {"layers", indices}});
  }
  ordered_json layers;
  layers["dense"] = m.count_layers(FfnKind::Dense);
  layers["moe"] = m.count_layers(FfnKind::Moe);
  layers["dense_indices"] = dense_indices(m);
  layers["windows"] = windows;
  layers["no_rope_indices"] = no_rope_indices(m);

  ordered_json model;
  model["name"] = m.name;
  model["architecture"] = m.architecture;
  model["source"] = m.source;
  model["num_layers"] = m.num_layers;
  model["hidden_size"] = m.hidden_size;
  model["vocab_size"] = m.vocab_size;
  model["max_position_embeddings"] = m.max_position_embeddings;
  model["tie_word_embeddings"] = m.tie_word_embeddings;
  model["lm_head_bias"] = m.lm_head_bias;
  model["layer_norm"] = m.norm_bias ? "layernorm" : "rmsnorm";
  model["attention"] = attention;
  model["moe"] = moe;
  model["dense_ffn_width"] = m.dense_ffn_width;
  model["layers"] = layers;
  model["mtp_layers"] = m.mtp_layers;
  return model;
}

ordered_json params_json(const ModelSpec& m, const ParamCounts& p) {
  ordered_json per_layer;
  per_layer["attention"] = p.attention_per_layer;
  per_layer["layer_norms"] = p.layer_norms_per_layer;
  per_layer["dense_ffn"] = p.dense_ffn_per_layer;
  per_layer["router"] = p.router_per_layer;
  per_layer["expert"] = p.expert_params;
  per_layer["shared_experts"] = p.shared_experts_per_layer;
  per_layer["dense_layer"] = p.dense_layer_total;
  per_layer["moe_layer_total"] = p.moe_layer_total;
  per_layer["moe_layer_active"] = p.moe_layer_active;

  ordered_json official;
  official["total"] = optional_json(m.params_total_official);
  official["active"] = optional_json(m.params_active_official);
  official["statement"] = m.params_official_statement.empty() ? ordered_json(nullptr) : ordered_json(m.params_official_statement);

  ordered_json params;
  params["total"] = p.total;
  params["active"] = p.active;
  params["active_with_embedding"] = p.active_with_embedding;
  params["embedding"] = p.embedding;
  params["lm_head"] = p.lm_head;
  params["final_norm"] = p.final_norm;
  params["mtp"] = p.mtp;
  params["per_layer"] = per_layer;
  params["official"] = official;
  return params;
}

std::string attention_summary(const ModelSpec& m) {
  std::string text;
  if (m.attention == AttentionKind::Mla) {
    text = fmt::format("MLA, {} heads; q {}, kv latent {}; q/k head {} ({} nope + {} rope), v head {}", m.num_heads,
                       m.q_lora_rank > 0 ? fmt::format("latent {}", m.q_lora_rank) : std::string("direct"),
                       m.kv_lora_rank, m.head_dim, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim);
  } else {
    text = fmt::format("{}, {} query heads, {} kv heads, head_dim {}", m.num_kv_heads == m.num_heads ? "MHA" : "GQA",
                       m.num_heads, m.num_kv_heads, m.head_dim);
  }
  std::vector<std::string> extras;
  if (m.qkv_bias) extras.emplace_back("qkv bias");
  if (m.o_bias) extras.emplace_back("o bias");
  if (m.qk_norm == QkNorm::PerHead) extras.emplace_back("per-head QK norm");
  if (m.qk_norm == QkNorm::FullProjection) extras.emplace_back("full-projection QK norm");
  if (m.attention_sinks) extras.emplace_back("sinks");
  if (m.partial_rotary_factor != 1.0) extras.push_back(fmt::format("partial RoPE {}", m.partial_rotary_factor));
  for (const auto& extra : extras) text += "; " + extra;
  return text;
}

std::string layers_summary(const ModelSpec& m) {
  const auto dense = dense_indices(m);
  std::string text = fmt::format("{}: {} MoE", m.num_layers, m.count_layers(FfnKind::Moe));
  if (!dense.empty()) text += fmt::format(", {} dense (layers {})", dense.size(), compact_indices(dense));
  return text;
}

std::string attention_layers_summary(const ModelSpec& m) {
  std::string text;
  int64_t restricted = 0;
  for (const auto& [key, indices] : window_groups(m)) {
    text += fmt::format("{} {} {} (layers {}), ", indices.size(), to_string(key.first), key.second,
                        compact_indices(indices));
    restricted += static_cast<int64_t>(indices.size());
  }
  text += fmt::format("{} full", m.num_layers - restricted);
  const auto no_rope = no_rope_indices(m);
  if (!no_rope.empty()) text += fmt::format("; no RoPE on {} (layers {})", no_rope.size(), compact_indices(no_rope));
  return text;
}

// "(ours -0.00%)" against the official figure, or "" when there is none.
std::string official_cell(const std::optional<int64_t>& official, int64_t ours) {
  if (!official) return "";
  const double difference = (static_cast<double>(ours) - static_cast<double>(*official)) / static_cast<double>(*official);
  return fmt::format("{} (ours {:+.2f}%)", billions(*official), 100.0 * difference);
}

void print_table(const ModelSpec& m, const ParamCounts& p, std::ostream& out) {
  out << fmt::format("{} ({}; {})\n\n", m.name, m.architecture, m.source);

  const auto dim = [&](const char* label, const std::string& value) { out << fmt::format("  {:<25}{}\n", label, value); };
  out << "Dimensions\n";
  dim("layers", layers_summary(m));
  dim("hidden_size", std::to_string(m.hidden_size));
  dim("vocab_size", std::to_string(m.vocab_size));
  dim("max_position_embeddings", std::to_string(m.max_position_embeddings));
  dim("tie_word_embeddings", m.tie_word_embeddings ? "true" : "false");
  dim("norms", m.norm_bias ? "LayerNorm (weight and bias)" : "RMSNorm");
  if (m.lm_head_bias) dim("lm head bias", "true");
  dim("attention", attention_summary(m));
  dim("attention layers", attention_layers_summary(m));
  std::string experts = fmt::format("{} routed, top-{}, expert FFN {}", m.num_experts, m.top_k, m.expert_ffn_width);
  if (m.router_bias) experts += "; router bias";
  if (m.router_correction_bias) experts += "; router correction bias";
  if (m.expert_bias) experts += "; expert biases";
  dim("experts", experts);
  dim("shared experts", m.num_shared_experts > 0 ? fmt::format("{}, FFN {} in all{}", m.num_shared_experts,
                                                               m.shared_expert_ffn_width,
                                                               m.shared_expert_gate ? ", sigmoid-gated" : "")
                                                 : std::string("none"));
  dim("dense FFN", m.dense_ffn_width > 0 ? std::to_string(m.dense_ffn_width) : std::string("none"));
  dim("MTP layers", std::to_string(m.mtp_layers));

  out << fmt::format("\n{:<27}{:>19}{:>11}  {}\n", "Parameters", "exact", "", "official");
  const auto row = [&](const char* label, int64_t value, const std::string& official = "") {
    std::string line = fmt::format("  {:<25}{:>19}{:>11}", label, with_commas(value), short_count(value));
    if (!official.empty()) line += "  " + official;
    out << line << "\n";
  };
  row("total", p.total, official_cell(m.params_total_official, p.total));
  row("active per token", p.active, official_cell(m.params_active_official, p.active));
  row("active incl. embedding", p.active_with_embedding);
  row("embedding", p.embedding);
  row("lm head", p.lm_head);
  row("final norm", p.final_norm);
  row("MTP (not in total)", p.mtp);
  out << "  per layer\n";
  row("  attention", p.attention_per_layer);
  row("  layer norms", p.layer_norms_per_layer);
  row("  dense FFN", p.dense_ffn_per_layer);
  row("  router", p.router_per_layer);
  row("  one routed expert", p.expert_params);
  row("  shared experts", p.shared_experts_per_layer);
  row("  dense layer", p.dense_layer_total);
  row("  MoE layer, total", p.moe_layer_total);
  row("  MoE layer, active", p.moe_layer_active);
  out << "\nactive: what one token uses, lm head included, input embedding (a lookup) not.\n";
  if (!m.params_official_statement.empty()) out << "official: " << m.params_official_statement << "\n";
}

}  // namespace

Command make_inspect_command() {
  return {"inspect", "Show a model's resolved dims and its parameter counts by part",
          [](CLI::App& sub) -> RunFunction {
            auto options = std::make_shared<InspectOptions>();
            sub.add_option("model", options->model,
                           "Model card name or alias, or a path to a card or a Hugging Face config.json")
                ->required();
            add_format_option(sub, options->format);
            return [options]() {
              const ModelSpec model = load_model(options->model);
              const ParamCounts params = count_params(model);
              if (options->format == OutputFormat::Json) {
                ordered_json document;
                document["model"] = model_json(model);
                document["params"] = params_json(model, params);
                std::cout << document.dump(2) << "\n";
              } else {
                print_table(model, params, std::cout);
              }
              return int{kExitOk};
            };
          }};
}

}  // namespace flatpeak::cli
