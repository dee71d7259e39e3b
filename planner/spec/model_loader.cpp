// Model cards: lookup by name or alias, loading from a path, and validation of our card schema
// (models/README.md, "Model cards"). Validation checks the whole card and reports every problem in
// one InputError; every JSON value is type-checked before it is read, so no nlohmann exception
// escapes whatever the card holds.
#include "model_loader.h"

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <limits>
#include <optional>
#include <set>

#include <fmt/format.h>

#include "embedded_cards.h"
#include "errors.h"
#include "hf_import.h"
#include "json_util.h"
#include "param_count.h"

namespace flatpeak {

namespace {

using nlohmann::json;

constexpr int64_t kMaxDim = kMaxCardDim;  // model_loader.h
constexpr int64_t kMaxLayers = kMaxCardLayers;
constexpr int64_t kMaxExperts = kMaxCardExperts;
constexpr int64_t kMaxCount = std::numeric_limits<int64_t>::max();

// Every key of the card schema, in the order of models/README.md (used for did-you-mean).
const std::vector<std::string>& card_keys() {
  static const std::vector<std::string> keys = {
      "name", "aliases", "architecture", "source",
      "num_hidden_layers", "hidden_size", "vocab_size", "max_position_embeddings", "tie_word_embeddings",
      "lm_head_bias", "layer_norm",
      "attention_type", "num_attention_heads", "num_key_value_heads", "head_dim",
      "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
      "attention_bias", "o_proj_bias", "qk_norm", "attention_sinks", "partial_rotary_factor",
      "sliding_window", "chunked_attention", "no_rope_layers",
      "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
      "n_shared_experts", "shared_expert_intermediate_size", "shared_expert_gate",
      "router_bias", "router_correction_bias", "expert_bias",
      "intermediate_size", "dense_layers", "num_nextn_predict_layers",
      "params_total_official", "params_active_official", "params_official_statement",
  };
  return keys;
}

std::string lowercase(std::string text) {
  std::transform(text.begin(), text.end(), text.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return text;
}

std::string quoted_list(const std::vector<std::string>& names) {
  std::string text;
  for (const auto& name : names) text += (text.empty() ? "\"" : ", \"") + name + "\"";
  return text;
}

// Reads and checks card values, collecting every problem into `errors`.
class CardParser {
 public:
  CardParser(std::string file, InputErrors& errors) : file_(std::move(file)), errors_(errors) {}

  void error(const std::string& pointer, std::string message) {
    errors_.add(Diagnostic{file_, pointer, std::move(message), ""});
  }

  // Keys of `object` not in `known` are errors with a did-you-mean.
  void check_keys(const json& object, const std::string& pointer, const std::vector<std::string>& known) {
    for (const auto& item : object.items()) {
      if (std::find(known.begin(), known.end(), item.key()) != known.end()) continue;
      const std::string guess = did_you_mean(item.key(), known);
      error(child_pointer(pointer, item.key()),
            guess.empty() ? std::string("unknown key") : fmt::format("unknown key (did you mean \"{}\"?)", guess));
    }
  }

  // An integer in min..max; nullopt (with a diagnostic) when it is not.
  std::optional<int64_t> integer(const json& value, const std::string& pointer, int64_t min, int64_t max) {
    int64_t number = 0;
    if (value.is_number_unsigned()) {
      const auto unsigned_value = value.get<uint64_t>();
      if (unsigned_value > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        error(pointer, fmt::format("must be <= {} (got {})", max, unsigned_value));
        return std::nullopt;
      }
      number = static_cast<int64_t>(unsigned_value);
    } else if (value.is_number_integer()) {
      number = value.get<int64_t>();
    } else {
      error(pointer, "must be an integer (got " + describe_json_value(value) + ")");
      return std::nullopt;
    }
    if (number < min) {
      error(pointer, min == 1   ? fmt::format("must be > 0 (got {})", number)
                     : min == 0 ? fmt::format("must be >= 0 (got {})", number)
                                : fmt::format("must be >= {} (got {})", min, number));
      return std::nullopt;
    }
    if (number > max) {
      error(pointer, fmt::format("must be <= {} (got {})", max, number));
      return std::nullopt;
    }
    return number;
  }

  std::optional<bool> boolean(const json& value, const std::string& pointer) {
    if (value.is_boolean()) return value.get<bool>();
    error(pointer, "must be true or false (got " + describe_json_value(value) + ")");
    return std::nullopt;
  }

  std::optional<std::string> string(const json& value, const std::string& pointer, bool allow_empty = false) {
    if (!value.is_string()) {
      error(pointer, "must be a string (got " + describe_json_value(value) + ")");
      return std::nullopt;
    }
    std::string text = value.get<std::string>();
    if (text.empty() && !allow_empty) {
      error(pointer, "must not be empty");
      return std::nullopt;
    }
    return text;
  }

  std::optional<std::string> choice(const json& value, const std::string& pointer, const std::vector<std::string>& options) {
    if (value.is_string()) {
      const auto& text = value.get_ref<const std::string&>();
      if (std::find(options.begin(), options.end(), text) != options.end()) return text;
    }
    error(pointer, fmt::format("must be one of {} (got {})", quoted_list(options), describe_json_value(value)));
    return std::nullopt;
  }

  // A layer selection (models/README.md): [indices], {"first": k} or {"every": n, "offset": r}.
  // `num_layers` is 0 when unknown (invalid), which skips the range checks.
  std::optional<std::vector<bool>> layer_set(const json& value, const std::string& pointer, int64_t num_layers) {
    const int64_t max_index = num_layers > 0 ? num_layers - 1 : kMaxLayers - 1;
    std::vector<bool> selected(static_cast<size_t>(num_layers > 0 ? num_layers : 0), false);
    bool ok = true;
    if (value.is_array()) {
      for (size_t i = 0; i < value.size(); ++i) {
        const std::string item_pointer = child_pointer(pointer, std::to_string(i));
        const json& item = value[i];
        if (!item.is_number_integer()) {
          error(item_pointer, "layer index must be an integer (got " + describe_json_value(item) + ")");
          ok = false;
          continue;
        }
        const bool negative = !item.is_number_unsigned() && item.get<int64_t>() < 0;
        const bool too_large = item.is_number_unsigned() ? item.get<uint64_t>() > static_cast<uint64_t>(max_index)
                                                         : item.get<int64_t>() > max_index;
        if (negative || too_large) {
          error(item_pointer, num_layers > 0
                                  ? fmt::format("layer index must be in 0..{} (got {})", max_index, describe_json_value(item))
                                  : fmt::format("layer index must be >= 0 (got {})", describe_json_value(item)));
          ok = false;
          continue;
        }
        const auto index = static_cast<size_t>(item.get<int64_t>());
        if (num_layers <= 0) continue;
        if (selected[index]) {
          error(item_pointer, fmt::format("duplicate layer index {}", index));
          ok = false;
        }
        selected[index] = true;
      }
    } else if (value.is_object()) {
      check_keys(value, pointer, {"first", "every", "offset"});
      const bool has_first = value.contains("first"), has_every = value.contains("every");
      if (has_first && has_every) {
        error(pointer, "give either \"first\" or \"every\", not both");
        return std::nullopt;
      }
      if (has_first) {
        if (value.contains("offset")) error(child_pointer(pointer, "offset"), "only valid with \"every\"");
        const auto first = integer(value["first"], child_pointer(pointer, "first"), 0, num_layers > 0 ? num_layers : kMaxLayers);
        if (!first || value.contains("offset")) return std::nullopt;
        for (int64_t i = 0; i < std::min(*first, num_layers); ++i) selected[static_cast<size_t>(i)] = true;
      } else if (has_every) {
        const auto every = integer(value["every"], child_pointer(pointer, "every"), 1, kMaxLayers);
        std::optional<int64_t> offset = 0;
        if (value.contains("offset")) {
          offset = integer(value["offset"], child_pointer(pointer, "offset"), 0, every ? *every - 1 : kMaxLayers);
        }
        if (!every || !offset) return std::nullopt;
        for (int64_t i = *offset; i < num_layers; i += *every) selected[static_cast<size_t>(i)] = true;
      } else {
        error(pointer, "must have \"first\" or \"every\"");
        return std::nullopt;
      }
    } else {
      error(pointer, "must be an array of layer indices, {\"first\": k} or {\"every\": n, \"offset\": r} (got " +
                         describe_json_value(value) + ")");
      return std::nullopt;
    }
    if (!ok) return std::nullopt;
    return selected;
  }

 private:
  std::string file_;
  InputErrors& errors_;
};

struct ParsedCard {
  ModelSpec spec;
  std::vector<std::string> aliases;
};

// A restricted-attention block: {"tokens": n, "layers": <layer selection>}.
struct WindowBlock {
  int64_t tokens = 0;
  std::vector<bool> layers;
};

std::optional<WindowBlock> parse_window(CardParser& p, const json& value, const std::string& pointer, int64_t num_layers) {
  if (!value.is_object()) {
    p.error(pointer, "must be an object {\"tokens\": n, \"layers\": ...} (got " + describe_json_value(value) + ")");
    return std::nullopt;
  }
  p.check_keys(value, pointer, {"tokens", "layers"});
  std::optional<int64_t> tokens;
  std::optional<std::vector<bool>> layers;
  if (value.contains("tokens")) {
    tokens = p.integer(value["tokens"], child_pointer(pointer, "tokens"), 1, kMaxDim);
  } else {
    p.error(child_pointer(pointer, "tokens"), "required key is missing");
  }
  if (value.contains("layers")) {
    layers = p.layer_set(value["layers"], child_pointer(pointer, "layers"), num_layers);
  } else {
    p.error(child_pointer(pointer, "layers"), "required key is missing");
  }
  if (!tokens || !layers) return std::nullopt;
  return WindowBlock{*tokens, std::move(*layers)};
}

ParsedCard parse_card(const json& card, const std::string& file) {
  InputErrors errors;
  CardParser p(file, errors);
  if (!card.is_object()) {
    throw InputError(Diagnostic{file, "", "a model card must be a JSON object (got " + describe_json_value(card) + ")", ""});
  }
  p.check_keys(card, "", card_keys());

  const auto present = [&](const char* key) { return card.contains(key); };
  const auto pointer = [](const char* key) { return child_pointer("", key); };
  const auto missing = [&](const char* key) { p.error(pointer(key), "required key is missing"); };
  // Optional and required readers; each returns nullopt when absent or invalid.
  const auto int_key = [&](const char* key, int64_t min, int64_t max, bool required) -> std::optional<int64_t> {
    if (!present(key)) {
      if (required) missing(key);
      return std::nullopt;
    }
    return p.integer(card[key], pointer(key), min, max);
  };
  const auto bool_key = [&](const char* key) -> std::optional<bool> {
    return present(key) ? p.boolean(card[key], pointer(key)) : std::optional<bool>(false);
  };

  ParsedCard parsed;
  ModelSpec& m = parsed.spec;
  m.source = file;

  // Identity.
  if (present("name")) {
    if (auto name = p.string(card["name"], pointer("name"))) m.name = *name;
  } else {
    missing("name");
  }
  if (present("aliases")) {
    const json& aliases = card["aliases"];
    if (!aliases.is_array()) {
      p.error(pointer("aliases"), "must be an array of strings (got " + describe_json_value(aliases) + ")");
    } else {
      std::set<std::string> seen;
      for (size_t i = 0; i < aliases.size(); ++i) {
        const std::string item_pointer = child_pointer("/aliases", std::to_string(i));
        auto alias = p.string(aliases[i], item_pointer);
        if (!alias) continue;
        if (!seen.insert(lowercase(*alias)).second) {
          p.error(item_pointer, fmt::format("duplicate alias \"{}\"", *alias));
          continue;
        }
        parsed.aliases.push_back(*alias);
      }
    }
  }
  if (present("architecture")) {
    if (auto architecture = p.string(card["architecture"], pointer("architecture"))) m.architecture = *architecture;
  } else {
    missing("architecture");
  }
  if (present("source")) p.string(card["source"], pointer("source"), true);

  // Shape.
  const auto layers = int_key("num_hidden_layers", 1, kMaxLayers, true);
  const auto hidden = int_key("hidden_size", 1, kMaxDim, true);
  const auto vocab = int_key("vocab_size", 1, kMaxDim, true);
  const auto max_positions = int_key("max_position_embeddings", 1, kMaxDim, true);
  const auto tied = bool_key("tie_word_embeddings");
  const auto head_bias = bool_key("lm_head_bias");
  std::optional<std::string> layer_norm = std::string("rmsnorm");
  if (present("layer_norm")) layer_norm = p.choice(card["layer_norm"], pointer("layer_norm"), {"rmsnorm", "layernorm"});
  const int64_t num_layers = layers.value_or(0);

  // Attention.
  std::optional<std::string> attention_type;
  if (present("attention_type")) {
    attention_type = p.choice(card["attention_type"], pointer("attention_type"), {"gqa", "mla"});
  } else {
    missing("attention_type");
  }
  const bool is_mla = attention_type && *attention_type == "mla";
  const bool is_gqa = attention_type && *attention_type == "gqa";
  const auto heads = int_key("num_attention_heads", 1, kMaxDim, true);
  const auto kv_heads = int_key("num_key_value_heads", 1, kMaxDim, is_gqa);
  const auto head_dim = int_key("head_dim", 1, kMaxDim, is_gqa);
  const auto q_lora = int_key("q_lora_rank", 0, kMaxDim, false);
  const auto kv_lora = int_key("kv_lora_rank", 1, kMaxDim, is_mla);
  const auto qk_nope = int_key("qk_nope_head_dim", 1, kMaxDim, is_mla);
  const auto qk_rope = int_key("qk_rope_head_dim", 1, kMaxDim, is_mla);
  const auto v_head = int_key("v_head_dim", 1, kMaxDim, is_mla);
  if (is_gqa) {
    for (const char* key : {"q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"}) {
      if (present(key)) p.error(pointer(key), "only valid with \"attention_type\": \"mla\"");
    }
  }
  if (is_mla && present("head_dim")) {
    p.error(pointer("head_dim"),
            "not used with \"attention_type\": \"mla\" (the q/k head width is qk_nope_head_dim + qk_rope_head_dim)");
  }
  if (heads && kv_heads) {
    if (is_mla && *kv_heads != *heads) {
      p.error(pointer("num_key_value_heads"),
              fmt::format("must equal num_attention_heads with \"attention_type\": \"mla\" (got {}, num_attention_heads = {})",
                          *kv_heads, *heads));
    } else if (*heads % *kv_heads != 0) {
      p.error(pointer("num_key_value_heads"),
              fmt::format("must divide num_attention_heads (got {}, num_attention_heads = {})", *kv_heads, *heads));
    }
  }
  const auto qkv_bias = bool_key("attention_bias");
  const auto o_bias = bool_key("o_proj_bias");
  std::optional<std::string> qk_norm = std::string("none");
  if (present("qk_norm")) qk_norm = p.choice(card["qk_norm"], pointer("qk_norm"), {"none", "per_head", "full_projection"});
  if (is_mla && qk_norm && *qk_norm != "none") {
    p.error(pointer("qk_norm"), "must be \"none\" with \"attention_type\": \"mla\" (MLA normalises its latents instead)");
  }
  const auto sinks = bool_key("attention_sinks");
  double rotary = 1.0;
  if (present("partial_rotary_factor")) {
    const json& value = card["partial_rotary_factor"];
    if (!value.is_number()) {
      p.error(pointer("partial_rotary_factor"), "must be a number (got " + describe_json_value(value) + ")");
    } else if (!(value.get<double>() > 0.0 && value.get<double>() <= 1.0)) {
      p.error(pointer("partial_rotary_factor"), "must be in (0, 1] (got " + describe_json_value(value) + ")");
    } else {
      rotary = value.get<double>();
    }
  }

  // Per-layer attention restrictions and RoPE.
  std::optional<WindowBlock> sliding, chunked;
  std::optional<std::vector<bool>> no_rope;
  if (present("sliding_window")) {
    sliding = parse_window(p, card["sliding_window"], "/sliding_window", num_layers);
  }
  if (present("chunked_attention")) {
    chunked = parse_window(p, card["chunked_attention"], "/chunked_attention", num_layers);
  }
  if (present("no_rope_layers")) {
    no_rope = p.layer_set(card["no_rope_layers"], "/no_rope_layers", num_layers);
  }
  if (sliding && chunked && layers) {
    for (int64_t i = 0; i < num_layers; ++i) {
      if (sliding->layers[static_cast<size_t>(i)] && chunked->layers[static_cast<size_t>(i)]) {
        p.error("/chunked_attention/layers", fmt::format("layer {} is also in /sliding_window/layers", i));
        break;
      }
    }
  }

  // Experts and FFNs.
  const auto experts = int_key("n_routed_experts", 1, kMaxExperts, true);
  int64_t top_k = 0;  // stays 0 (an error is recorded) unless valid
  if (present("num_experts_per_tok")) {
    const auto value = p.integer(card["num_experts_per_tok"], pointer("num_experts_per_tok"),
                                 std::numeric_limits<int64_t>::min(), kMaxCount);
    if (value && experts && (*value < 1 || *value > *experts)) {
      p.error(pointer("num_experts_per_tok"), fmt::format("must be in 1..n_routed_experts (got {}, n_routed_experts = {})",
                                                          *value, *experts));
    } else if (value && *value < 1) {
      p.error(pointer("num_experts_per_tok"), fmt::format("must be > 0 (got {})", *value));
    } else if (value) {
      top_k = *value;
    }
  } else {
    missing("num_experts_per_tok");
  }
  const auto expert_width = int_key("moe_intermediate_size", 1, kMaxDim, true);
  const auto shared_count = present("n_shared_experts") ? int_key("n_shared_experts", 0, kMaxDim, false)
                                                         : std::optional<int64_t>(0);
  const bool has_shared = shared_count && *shared_count > 0;
  const auto shared_width = int_key("shared_expert_intermediate_size", 1, kMaxDim, has_shared);
  if (shared_count && *shared_count == 0 && present("shared_expert_intermediate_size")) {
    p.error(pointer("shared_expert_intermediate_size"), "is set but n_shared_experts is 0");
  }
  const auto shared_gate = bool_key("shared_expert_gate");
  if (shared_gate && *shared_gate && shared_count && *shared_count == 0) {
    p.error(pointer("shared_expert_gate"), "is true but n_shared_experts is 0: there is no shared expert to gate");
  }
  const auto router_bias = bool_key("router_bias");
  const auto correction_bias = bool_key("router_correction_bias");
  const auto expert_bias = bool_key("expert_bias");

  std::optional<std::vector<bool>> dense = std::vector<bool>(static_cast<size_t>(num_layers), false);
  if (present("dense_layers")) {
    dense = p.layer_set(card["dense_layers"], "/dense_layers", num_layers);
  }
  const bool any_dense = dense && std::find(dense->begin(), dense->end(), true) != dense->end();
  const auto dense_width = int_key("intermediate_size", 1, kMaxDim, any_dense);
  if (layers && dense && !any_dense && present("intermediate_size")) {
    p.error(pointer("intermediate_size"), "is set but no layer is dense (dense_layers is empty)");
  }
  const auto mtp = present("num_nextn_predict_layers") ? int_key("num_nextn_predict_layers", 0, kMaxCardMtpLayers, false)
                                                        : std::optional<int64_t>(0);

  // The publisher's figures.
  const auto total_official = int_key("params_total_official", 1, kMaxCount, false);
  const auto active_official = int_key("params_active_official", 1, kMaxCount, false);
  if (total_official && active_official && *active_official > *total_official) {
    p.error(pointer("params_active_official"),
            fmt::format("must be <= params_total_official (got {}, params_total_official = {})", *active_official,
                        *total_official));
  }
  if (present("params_official_statement")) {
    if (auto statement = p.string(card["params_official_statement"], pointer("params_official_statement"), true)) {
      m.params_official_statement = *statement;
    }
  }

  errors.throw_if_any();
  // Every value below was checked above; an invalid one would have thrown.
  m.num_layers = *layers;
  m.hidden_size = *hidden;
  m.vocab_size = *vocab;
  m.max_position_embeddings = *max_positions;
  m.tie_word_embeddings = *tied;
  m.lm_head_bias = *head_bias;
  m.norm_bias = *layer_norm == "layernorm";
  m.attention = is_mla ? AttentionKind::Mla : AttentionKind::Gqa;
  m.num_heads = *heads;
  if (is_mla) {
    m.num_kv_heads = *heads;
    m.q_lora_rank = q_lora.value_or(0);
    m.kv_lora_rank = *kv_lora;
    m.qk_nope_head_dim = *qk_nope;
    m.qk_rope_head_dim = *qk_rope;
    m.head_dim = *qk_nope + *qk_rope;
    m.v_head_dim = *v_head;
  } else {
    m.num_kv_heads = *kv_heads;
    m.head_dim = *head_dim;
    m.v_head_dim = *head_dim;
  }
  m.qkv_bias = *qkv_bias;
  m.o_bias = *o_bias;
  m.qk_norm = *qk_norm == "per_head" ? QkNorm::PerHead : *qk_norm == "full_projection" ? QkNorm::FullProjection : QkNorm::None;
  m.attention_sinks = *sinks;
  m.partial_rotary_factor = rotary;
  m.num_experts = *experts;
  m.top_k = top_k;
  m.expert_ffn_width = *expert_width;
  m.num_shared_experts = *shared_count;
  m.shared_expert_ffn_width = has_shared ? *shared_width : 0;
  m.shared_expert_gate = *shared_gate;
  m.router_bias = *router_bias;
  m.router_correction_bias = *correction_bias;
  m.expert_bias = *expert_bias;
  m.dense_ffn_width = any_dense ? *dense_width : 0;
  m.mtp_layers = *mtp;
  m.params_total_official = total_official;
  m.params_active_official = active_official;

  m.layers.assign(static_cast<size_t>(m.num_layers), LayerSpec{});
  for (size_t i = 0; i < m.layers.size(); ++i) {
    LayerSpec& layer = m.layers[i];
    layer.ffn = (*dense)[i] ? FfnKind::Dense : FfnKind::Moe;
    if (sliding && sliding->layers[i]) {
      layer.window = AttentionWindow::Sliding;
      layer.attention_window_tokens = sliding->tokens;
    } else if (chunked && chunked->layers[i]) {
      layer.window = AttentionWindow::Chunked;
      layer.attention_window_tokens = chunked->tokens;
    }
    layer.rope = !(no_rope && (*no_rope)[i]);
  }
  // Dimensions whose products overflow int64 are rejected here, once, for every later user.
  count_params(m);
  return parsed;
}

// The embedded cards, parsed once. A card that fails to parse is a build defect; it throws.
struct EmbeddedModel {
  std::string name;
  std::vector<std::string> aliases;
  ModelSpec spec;
};

EmbeddedModel parse_embedded(const EmbeddedCard& card) {
  const std::string file = "models/" + card.name + ".json";
  ParsedCard parsed = parse_card(parse_json_text(card.json, file), file);
  parsed.spec.source = "embedded:" + card.name;
  return EmbeddedModel{card.name, std::move(parsed.aliases), std::move(parsed.spec)};
}

const std::vector<EmbeddedModel>& embedded_models() {
  static const std::vector<EmbeddedModel> models = [] {
    std::vector<EmbeddedModel> list;
    for (const auto& card : embedded_model_cards()) list.push_back(parse_embedded(card));
    std::sort(list.begin(), list.end(),
              [](const EmbeddedModel& a, const EmbeddedModel& b) { return lowercase(a.name) < lowercase(b.name); });
    return list;
  }();
  return models;
}

// parse_json_text reports syntax errors; a number beyond double's range arrives as out_of_range.
json parse_document(const std::string& text, const std::string& file) {
  try {
    return parse_json_text(text, file);
  } catch (const json::out_of_range& e) {
    std::string what = e.what();
    const size_t cut = what.find("] ");
    throw InputError(Diagnostic{file, "", "malformed JSON: " + (cut == std::string::npos ? what : what.substr(cut + 2)), ""});
  }
}

ModelSpec load_file(const std::string& path) {
  const json document = parse_document(read_text_file(path), path);
  if (document.is_object() && looks_like_hf_config(document)) return import_hf_config(document, path);
  return parse_model_card(document, path);
}

}  // namespace

std::vector<ModelCardInfo> list_model_cards() {
  std::vector<ModelCardInfo> cards;
  for (const auto& model : embedded_models()) cards.push_back({model.name, model.aliases, model.spec.architecture});
  return cards;
}

ModelSpec parse_model_card(const nlohmann::json& card, const std::string& file) { return parse_card(card, file).spec; }

ModelSpec load_model(const std::string& name_or_path) {
  const std::string wanted = lowercase(name_or_path);
  std::vector<std::string> names;
  for (const auto& model : embedded_models()) {
    if (lowercase(model.name) == wanted) return model.spec;
    for (const auto& alias : model.aliases) {
      if (lowercase(alias) == wanted) return model.spec;
    }
    names.push_back(model.name);
  }

  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path path(name_or_path);
  if (!name_or_path.empty() && fs::is_regular_file(path, ec)) return load_file(name_or_path);
  if (!name_or_path.empty() && fs::is_directory(path, ec)) {
    // A Hugging Face snapshot folder: its config.json.
    if (fs::is_regular_file(path / "config.json", ec)) return load_file((path / "config.json").string());
    throw InputError(Diagnostic{name_or_path, "", "is a folder without a config.json; give a model card or a config.json", ""});
  }

  std::vector<std::string> candidates = names;
  for (const auto& model : embedded_models()) candidates.insert(candidates.end(), model.aliases.begin(), model.aliases.end());
  const std::string guess = did_you_mean(name_or_path, candidates);
  std::string known;
  for (const auto& name : names) known += (known.empty() ? "" : ", ") + name;
  throw InputError(Diagnostic{
      "", "",
      fmt::format("unknown model '{}': not a model card or alias built in from models/*.json (see 'flatpeak "
                  "models'), nor a path to a model card or a Hugging Face config.json",
                  name_or_path),
      guess.empty() ? "known model cards: " + known : fmt::format("did you mean '{}'?", guess)});
}

}  // namespace flatpeak
