// Hugging Face config.json -> ModelSpec. One reader per family; every key is checked for type and
// range, every problem is collected, and only then is InputError thrown, so that a user sees all
// problems of a config at once. Keys the importer does not read are ignored (configs carry many).
//
// Conventions shared with count_params (param_count.h):
//  - MLA: head_dim = qk_nope_head_dim + qk_rope_head_dim, num_kv_heads = num_heads (per-head K
//    and V as training materialises them), q_lora_rank 0 = q projected directly from H.
//  - Shared experts: shared_expert_ffn_width is the total width of the shared MLP
//    (DeepSeek/Kimi/GLM: n_shared_experts * moe_intermediate_size; Llama 4: intermediate_size).
//  - dense_ffn_width is 0 when no layer is dense.
#include "hf_import.h"

#include <algorithm>
#include <initializer_list>
#include <cmath>
#include <limits>
#include <map>
#include <optional>
#include <set>

#include <fmt/format.h>

#include "errors.h"
#include "json_util.h"
#include "model_loader.h"

namespace flatpeak {

namespace {

using nlohmann::json;

// Upper bounds that keep every product in count_params and the planner inside int64 and keep
// per-layer tables small. Real models sit orders of magnitude below them.
constexpr int64_t kMaxLayers = kMaxCardLayers;  // model_loader.h, as for our cards
constexpr int64_t kMaxExperts = kMaxCardExperts;
constexpr int64_t kMaxDim = int64_t{1} << 30;
constexpr double kMaxParams = 1e15;

const std::vector<std::string>& architecture_names() {
  static const std::vector<std::string> names{"deepseek_v2", "deepseek_v3", "kimi_k2",
                                              "qwen3_moe",   "gpt_oss",     "mixtral",
                                              "glm4_moe",    "olmoe",       "llama4",
                                              "minimax_m2",  "ernie4_5_moe", "qwen2_moe",
                                              "qwen3_vl_moe", "glm4v_moe",  "dots1",
                                              "phimoe"};
  return names;
}

// model_type spellings beyond the canonical names, and `architectures` class names (fall-back).
const std::map<std::string, std::string>& model_type_aliases() {
  static const std::map<std::string, std::string> aliases{{"llama4_text", "llama4"},
                                                          {"qwen3_vl_moe_text", "qwen3_vl_moe"},
                                                          {"glm4v_moe_text", "glm4v_moe"}};
  return aliases;
}

const std::map<std::string, std::string>& architecture_classes() {
  static const std::map<std::string, std::string> classes{
      {"DeepseekV2ForCausalLM", "deepseek_v2"},
      {"DeepseekV3ForCausalLM", "deepseek_v3"},
      {"Qwen3MoeForCausalLM", "qwen3_moe"},
      {"GptOssForCausalLM", "gpt_oss"},
      {"MixtralForCausalLM", "mixtral"},
      {"Glm4MoeForCausalLM", "glm4_moe"},
      {"OlmoeForCausalLM", "olmoe"},
      {"Llama4ForConditionalGeneration", "llama4"},
      {"Llama4ForCausalLM", "llama4"},
      {"MiniMaxM2ForCausalLM", "minimax_m2"},
      {"Ernie4_5_MoeForCausalLM", "ernie4_5_moe"},
      {"Qwen2MoeForCausalLM", "qwen2_moe"},
      {"Qwen3VLMoeForConditionalGeneration", "qwen3_vl_moe"},
      {"Glm4vMoeForConditionalGeneration", "glm4v_moe"},
      {"Dots1ForCausalLM", "dots1"},
      {"PhimoeForCausalLM", "phimoe"},
      {"PhiMoEForCausalLM", "phimoe"},
  };
  return classes;
}

std::string join(const std::vector<std::string>& words) {
  std::string out;
  for (const auto& w : words) out += (out.empty() ? "" : ", ") + w;
  return out;
}

// Collects diagnostics in read order. A missing required key gets its did-you-mean only at the
// end, from the keys present in its object that no reader asked for: a key the importer reads
// itself ("num_experts_per_tok") is never offered as the spelling of another ("num_experts").
class Collector {
 public:
  explicit Collector(std::string file) : file_(std::move(file)) {}

  const std::string& file() const { return file_; }

  void add(const std::string& pointer, std::string message) {
    diagnostics_.push_back(Diagnostic{file_, pointer, std::move(message), ""});
  }

  void add_missing(const std::string& pointer, const std::string& key, const json* object) {
    missing_.push_back(Missing{diagnostics_.size(), key, object});
    add(pointer, "required key missing");
  }

  void note_read(const json* object, const std::string& key) { read_[object].insert(key); }

  void throw_if_any() {
    for (const auto& m : missing_) {
      std::vector<std::string> candidates;
      if (m.object != nullptr && m.object->is_object()) {
        const auto& read = read_[m.object];
        for (const auto& item : m.object->items()) {
          if (read.count(item.key()) == 0) candidates.push_back(item.key());
        }
      }
      const std::string guess = did_you_mean(m.key, candidates);
      if (!guess.empty()) {
        diagnostics_[m.index].message =
            fmt::format("required key missing (did you mean \"{}\", present in the file?)", guess);
      }
    }
    missing_.clear();
    if (!diagnostics_.empty()) throw InputError(diagnostics_);
  }

  bool empty() const { return diagnostics_.empty(); }

 private:
  struct Missing {
    size_t index;
    std::string key;
    const json* object;
  };
  std::string file_;
  std::vector<Diagnostic> diagnostics_;
  std::vector<Missing> missing_;
  std::map<const json*, std::set<std::string>> read_;
};

// Typed, range-checked access to the keys of one JSON object (the config, or a vision-language
// wrapper's text_config). Errors go to the collector; the returned value is then a harmless placeholder.
class Fields {
 public:
  Fields(const json& object, std::string base, Collector& out)
      : object_(object), base_(std::move(base)), out_(out) {}

  std::string pointer(const std::string& key) const { return child_pointer(base_, key); }
  void error(const std::string& key, std::string message) {
    bad_.insert(key);
    out_.add(pointer(key), std::move(message));
  }

  // A problem with entry `index` of the array under `key`.
  void error_item(const std::string& key, size_t index, std::string message) {
    bad_.insert(key);
    out_.add(pointer(key) + "/" + std::to_string(index), std::move(message));
  }

  // False when reading `key` reported a problem: checks that combine several keys (top-k <= E)
  // are skipped then, so that one bad value gives one diagnostic.
  bool ok(std::initializer_list<const char*> keys) const {
    return std::none_of(keys.begin(), keys.end(), [this](const char* k) { return bad_.count(k) > 0; });
  }

  // nullptr when the key is absent; JSON null is returned as a value (callers decide).
  const json* find(const std::string& key) {
    out_.note_read(&object_, key);
    if (!object_.is_object()) return nullptr;
    const auto it = object_.find(key);
    return it == object_.end() ? nullptr : &*it;
  }

  bool has(const std::string& key) {
    const json* v = find(key);
    return v != nullptr && !v->is_null();
  }

  // An integer in [min, max]; missing or null is an error. Returns `min` after an error.
  int64_t required_int(const std::string& key, int64_t min, int64_t max) {
    const json* v = find(key);
    if (v == nullptr) {
      bad_.insert(key);
      out_.add_missing(pointer(key), key, &object_);
      return min;
    }
    const auto x = checked_int(key, *v, min, max);
    if (!x) bad_.insert(key);
    return x.value_or(min);
  }

  // Absent or null gives `fallback` (unchecked); anything else must be an integer in [min, max].
  int64_t optional_int(const std::string& key, int64_t fallback, int64_t min, int64_t max) {
    const json* v = find(key);
    if (v == nullptr || v->is_null()) return fallback;
    const auto x = checked_int(key, *v, min, max);
    if (!x) bad_.insert(key);
    return x.value_or(fallback);
  }

  bool optional_bool(const std::string& key, bool fallback) {
    const json* v = find(key);
    if (v == nullptr || v->is_null()) return fallback;
    if (!v->is_boolean()) {
      error(key, fmt::format("must be true or false (got {})", describe_json_value(*v)));
      return fallback;
    }
    return v->get<bool>();
  }

  // A number in (0, 1]; absent or null gives `fallback`.
  double optional_fraction(const std::string& key, double fallback) {
    const json* v = find(key);
    if (v == nullptr || v->is_null()) return fallback;
    if (!v->is_number()) {
      error(key, fmt::format("must be a number in (0, 1] (got {})", describe_json_value(*v)));
      return fallback;
    }
    const double x = v->get<double>();
    if (!(x > 0.0 && x <= 1.0)) {
      error(key, fmt::format("must be a number in (0, 1] (got {})", describe_json_value(*v)));
      return fallback;
    }
    return x;
  }

  std::optional<std::string> optional_string(const std::string& key) {
    const json* v = find(key);
    if (v == nullptr || v->is_null()) return std::nullopt;
    if (!v->is_string()) {
      error(key, fmt::format("must be a string (got {})", describe_json_value(*v)));
      return std::nullopt;
    }
    return v->get<std::string>();
  }

  // An array of integers in [min, max]; absent or null gives nullopt. Bad entries are reported
  // with their own pointer and left out.
  std::optional<std::vector<int64_t>> optional_int_list(const std::string& key, int64_t min, int64_t max) {
    const json* v = find(key);
    if (v == nullptr || v->is_null()) return std::nullopt;
    if (!v->is_array()) {
      error(key, fmt::format("must be an array of integers (got {})", describe_json_value(*v)));
      return std::nullopt;
    }
    std::vector<int64_t> values;
    bool all_good = true;
    for (size_t i = 0; i < v->size(); ++i) {
      if (auto x = checked_int_at(pointer(key) + "/" + std::to_string(i), (*v)[i], min, max)) {
        values.push_back(*x);
      } else {
        all_good = false;
      }
    }
    if (!all_good) {
      bad_.insert(key);
      return std::nullopt;
    }
    return values;
  }

  std::optional<int64_t> checked_int(const std::string& key, const json& v, int64_t min, int64_t max) {
    return checked_int_at(pointer(key), v, min, max);
  }

  std::optional<int64_t> checked_int_at(const std::string& at, const json& v, int64_t min, int64_t max) {
    const std::string got = describe_json_value(v);
    if (!v.is_number_integer()) {
      out_.add(at, fmt::format("must be an integer (got {})", got));
      return std::nullopt;
    }
    int64_t x = 0;
    if (v.is_number_unsigned()) {
      const uint64_t u = v.get<uint64_t>();
      if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        out_.add(at, fmt::format("must be at most {} (got {})", max, got));
        return std::nullopt;
      }
      x = static_cast<int64_t>(u);
    } else {
      x = v.get<int64_t>();
    }
    if (x < min) {
      if (min == 1) {
        out_.add(at, fmt::format("must be a positive integer (got {})", got));
      } else if (min == 0) {
        out_.add(at, fmt::format("must be a non-negative integer (got {})", got));
      } else {
        out_.add(at, fmt::format("must be at least {} (got {})", min, got));
      }
      return std::nullopt;
    }
    if (x > max) {
      out_.add(at, fmt::format("must be at most {} (got {})", max, got));
      return std::nullopt;
    }
    return x;
  }

 private:
  const json& object_;
  std::string base_;
  Collector& out_;
  std::set<std::string> bad_;
};

// The dims every family has, read under their usual HF names.
struct CommonDims {
  int64_t layers = 0;
  int64_t hidden = 0;
  int64_t vocab = 0;
  int64_t heads = 0;
  int64_t kv_heads = 0;
  int64_t max_positions = 0;
  bool tied = false;
};

CommonDims read_common(Fields& f, bool read_kv_heads) {
  CommonDims d;
  d.layers = f.required_int("num_hidden_layers", 1, kMaxLayers);
  d.hidden = f.required_int("hidden_size", 1, kMaxDim);
  d.vocab = f.required_int("vocab_size", 1, kMaxDim);
  d.heads = f.required_int("num_attention_heads", 1, kMaxDim);
  d.max_positions = f.required_int("max_position_embeddings", 1, int64_t{1} << 40);
  d.tied = f.optional_bool("tie_word_embeddings", false);
  if (read_kv_heads) {
    d.kv_heads = f.optional_int("num_key_value_heads", d.heads, 1, kMaxDim);
    if (f.ok({"num_attention_heads", "num_key_value_heads"}) && d.heads % d.kv_heads != 0) {
      f.error("num_key_value_heads",
              fmt::format("must divide num_attention_heads (got {}, num_attention_heads = {})",
                          d.kv_heads, d.heads));
    }
  }
  return d;
}

void apply_common(ModelSpec& m, const CommonDims& d) {
  m.num_layers = d.layers;
  m.hidden_size = d.hidden;
  m.vocab_size = d.vocab;
  m.max_position_embeddings = d.max_positions;
  m.tie_word_embeddings = d.tied;
  m.num_heads = d.heads;
  m.num_kv_heads = d.kv_heads;
}

// head_dim when the config gives it, else hidden/heads (which must then divide evenly).
int64_t read_head_dim(Fields& f, const CommonDims& d) {
  if (f.has("head_dim")) return f.required_int("head_dim", 1, kMaxDim);
  if (!f.ok({"hidden_size", "num_attention_heads"})) return 1;
  if (d.hidden % d.heads != 0) {
    f.error("hidden_size", fmt::format("must be a multiple of num_attention_heads when head_dim is not "
                                       "given (got {}, num_attention_heads = {})",
                                       d.hidden, d.heads));
    return 1;
  }
  return d.hidden / d.heads;
}

// The largest valid layer index, for lists of layer indices (any index when the count is bad).
int64_t last_layer_index(Fields& f, const CommonDims& d) {
  return f.ok({"num_hidden_layers"}) ? d.layers - 1 : kMaxLayers - 1;
}

// Routed experts and top-k under the family's key names; top-k must be in 1..E.
void read_experts(Fields& f, ModelSpec& m, const std::string& experts_key, const std::string& top_k_key,
                  const std::string& top_k_alt_key = "") {
  m.num_experts = f.required_int(experts_key, 1, kMaxExperts);
  std::string used_key = top_k_key;
  if (!top_k_alt_key.empty() && !f.has(top_k_key) && f.has(top_k_alt_key)) used_key = top_k_alt_key;
  const json* raw = f.find(used_key);
  m.top_k = f.required_int(used_key, 1, kMaxExperts);
  if (raw != nullptr && f.ok({experts_key.c_str(), used_key.c_str()}) && m.top_k > m.num_experts) {
    f.error(used_key, fmt::format("must be in 1..{} (got {}, {} = {})", experts_key, m.top_k, experts_key,
                                  m.num_experts));
  }
}

void fill_layers(ModelSpec& m, const std::vector<bool>& is_moe) {
  m.layers.assign(static_cast<size_t>(m.num_layers), LayerSpec{});
  for (size_t i = 0; i < m.layers.size(); ++i) {
    m.layers[i].ffn = is_moe[i] ? FfnKind::Moe : FfnKind::Dense;
  }
}

bool any_dense(const std::vector<bool>& is_moe) {
  return std::any_of(is_moe.begin(), is_moe.end(), [](bool moe) { return !moe; });
}

// deepseek_v2 / deepseek_v3 / kimi_k2: MLA attention, DeepSeekMoE with a dense prefix.
void import_deepseek(Fields& f, ModelSpec& m, const std::string& family) {
  const CommonDims d = read_common(f, false);
  apply_common(m, d);
  m.attention = AttentionKind::Mla;
  m.num_kv_heads = d.heads;  // MLA materialises per-head K and V
  f.find("num_key_value_heads");  // present in configs, not used for MLA
  m.q_lora_rank = f.optional_int("q_lora_rank", 0, 1, kMaxDim);
  m.kv_lora_rank = f.required_int("kv_lora_rank", 1, kMaxDim);
  m.qk_nope_head_dim = f.required_int("qk_nope_head_dim", 1, kMaxDim);
  m.qk_rope_head_dim = f.required_int("qk_rope_head_dim", 1, kMaxDim);
  m.v_head_dim = f.required_int("v_head_dim", 1, kMaxDim);
  m.head_dim = m.qk_nope_head_dim + m.qk_rope_head_dim;
  const bool bias = f.optional_bool("attention_bias", false);
  m.qkv_bias = bias;
  m.o_bias = bias;

  read_experts(f, m, "n_routed_experts", "num_experts_per_tok");
  m.expert_ffn_width = f.required_int("moe_intermediate_size", 1, kMaxDim);
  // HF defaults: DeepseekV2Config has no shared experts unless given, V3 has one.
  m.num_shared_experts = f.optional_int("n_shared_experts", family == "deepseek_v2" ? 0 : 1, 0, kMaxExperts);
  m.shared_expert_ffn_width = m.num_shared_experts * m.expert_ffn_width;
  const int64_t first_dense = f.optional_int("first_k_dense_replace", 0, 0, kMaxLayers);
  const int64_t moe_freq = f.optional_int("moe_layer_freq", 1, 1, kMaxLayers);
  if (f.ok({"num_hidden_layers", "first_k_dense_replace"}) && first_dense > d.layers) {
    f.error("first_k_dense_replace", fmt::format("must be in 0..num_hidden_layers (got {}, num_hidden_layers = {})",
                                                 first_dense, d.layers));
  }
  // Selection-only correction bias per expert: DeepSeek-V3's "noaux_tc" (the V3 default).
  const std::string default_method = family == "deepseek_v2" ? "greedy" : "noaux_tc";
  m.router_correction_bias = f.optional_string("topk_method").value_or(default_method) == "noaux_tc";
  m.mtp_layers = f.optional_int("num_nextn_predict_layers", 0, 0, kMaxCardMtpLayers);

  std::vector<bool> is_moe(static_cast<size_t>(d.layers));
  for (int64_t i = 0; i < d.layers; ++i) {
    is_moe[static_cast<size_t>(i)] = i >= first_dense && i % moe_freq == 0;
  }
  if (any_dense(is_moe)) m.dense_ffn_width = f.required_int("intermediate_size", 1, kMaxDim);
  fill_layers(m, is_moe);
}

// Qwen's MoE layers (qwen2_moe, qwen3_moe): every decoder_sparse_step-th layer (i + 1 a multiple
// of it) except those in mlp_only_layers.
std::vector<bool> qwen_moe_layers(Fields& f, const CommonDims& d) {
  const int64_t sparse_step = f.optional_int("decoder_sparse_step", 1, 1, kMaxLayers);
  const auto mlp_only = f.optional_int_list("mlp_only_layers", 0, last_layer_index(f, d));
  std::vector<bool> is_moe(static_cast<size_t>(d.layers));
  for (int64_t i = 0; i < d.layers; ++i) is_moe[static_cast<size_t>(i)] = (i + 1) % sparse_step == 0;
  if (mlp_only) {
    for (int64_t i : *mlp_only) {
      if (i < d.layers) is_moe[static_cast<size_t>(i)] = false;
    }
  }
  return is_moe;
}

// Qwen3's attention (qwen3_moe, dots1): GQA with per-head QK norm, attention_bias on q, k, v and o.
void read_qwen3_attention(Fields& f, const CommonDims& d, ModelSpec& m) {
  m.head_dim = read_head_dim(f, d);
  m.v_head_dim = m.head_dim;
  const bool bias = f.optional_bool("attention_bias", false);
  m.qkv_bias = bias;
  m.o_bias = bias;
  m.qk_norm = QkNorm::PerHead;
}

// MoE from layer first_k_dense_replace on (glm4_moe, dots1), the layers before it dense.
std::vector<bool> dense_prefix_layers(Fields& f, const CommonDims& d, int64_t default_first_dense) {
  const int64_t first_dense = f.optional_int("first_k_dense_replace", default_first_dense, 0, kMaxLayers);
  if (f.ok({"num_hidden_layers", "first_k_dense_replace"}) && first_dense > d.layers) {
    f.error("first_k_dense_replace", fmt::format("must be in 0..num_hidden_layers (got {}, num_hidden_layers = {})",
                                                 first_dense, d.layers));
  }
  std::vector<bool> is_moe(static_cast<size_t>(d.layers));
  for (int64_t i = 0; i < d.layers; ++i) is_moe[static_cast<size_t>(i)] = i >= first_dense;
  return is_moe;
}

// qwen3_moe: GQA with per-head QK norm; MoE every decoder_sparse_step layers except mlp_only_layers.
void import_qwen3_moe(Fields& f, ModelSpec& m) {
  const CommonDims d = read_common(f, true);
  apply_common(m, d);
  read_qwen3_attention(f, d, m);
  read_experts(f, m, "num_experts", "num_experts_per_tok");
  m.expert_ffn_width = f.required_int("moe_intermediate_size", 1, kMaxDim);
  const std::vector<bool> is_moe = qwen_moe_layers(f, d);
  const bool use_sliding = f.optional_bool("use_sliding_window", false);
  int64_t window = 0;
  int64_t max_window_layers = d.layers;
  if (use_sliding) {
    window = f.required_int("sliding_window", 1, int64_t{1} << 40);
    max_window_layers = f.optional_int("max_window_layers", d.layers, 0, kMaxLayers);
  }
  if (any_dense(is_moe)) m.dense_ffn_width = f.required_int("intermediate_size", 1, kMaxDim);
  fill_layers(m, is_moe);
  // Qwen's sliding window applies to layers from max_window_layers on.
  for (int64_t i = max_window_layers; use_sliding && i < d.layers; ++i) {
    m.layers[static_cast<size_t>(i)].window = AttentionWindow::Sliding;
    m.layers[static_cast<size_t>(i)].attention_window_tokens = window;
  }
}

// qwen2_moe (Qwen1.5-MoE, Qwen2-MoE): GQA with biases on q, k and v (qkv_bias, true by default)
// and none on o; MoE every decoder_sparse_step layers except mlp_only_layers (dense FFN of
// intermediate_size there); in every MoE layer one shared expert of
// shared_expert_intermediate_size whose output a per-token sigmoid gate scales
// (shared_expert_gate, [H -> 1]). Sliding windows are refused: the released models attend to the
// whole context, and transformers' versions disagree on which layers a window applies to.
void import_qwen2_moe(Fields& f, ModelSpec& m) {
  const CommonDims d = read_common(f, true);
  apply_common(m, d);
  m.head_dim = read_head_dim(f, d);
  m.v_head_dim = m.head_dim;
  m.qkv_bias = f.optional_bool("qkv_bias", true);
  read_experts(f, m, "num_experts", "num_experts_per_tok");
  m.expert_ffn_width = f.required_int("moe_intermediate_size", 1, kMaxDim);
  m.num_shared_experts = 1;
  m.shared_expert_ffn_width = f.required_int("shared_expert_intermediate_size", 1, kMaxDim);
  m.shared_expert_gate = true;
  if (f.optional_bool("use_sliding_window", false)) {
    f.error("use_sliding_window", "must be false: sliding windows are not modelled for qwen2_moe (got true)");
  }
  if (const json* types = f.find("layer_types"); types != nullptr && !types->is_null() && !types->is_array()) {
    f.error("layer_types", fmt::format("must be a list of layer kinds (got {})", describe_json_value(*types)));
  } else if (types != nullptr && types->is_array()) {
    for (size_t i = 0; i < types->size(); ++i) {
      if ((*types)[i] != "full_attention") {
        f.error("layer_types", fmt::format("must be all \"full_attention\": windowed layers are not modelled for "
                                           "qwen2_moe (got {} at layer {})",
                                           describe_json_value((*types)[i]), i));
        break;
      }
    }
  }
  const std::vector<bool> is_moe = qwen_moe_layers(f, d);
  if (any_dense(is_moe)) m.dense_ffn_width = f.required_int("intermediate_size", 1, kMaxDim);
  fill_layers(m, is_moe);
}

// layer_types, when given and not null: one "sliding_attention" or "full_attention" a layer,
// written into `sliding`; absent or null leaves `sliding` as the family's default.
void read_layer_types(Fields& f, const CommonDims& d, std::vector<bool>& sliding) {
  const json* types = f.find("layer_types");
  if (types == nullptr || types->is_null()) return;
  if (!types->is_array()) {
    f.error("layer_types", fmt::format("must be an array of \"sliding_attention\" or \"full_attention\" (got {})",
                                       describe_json_value(*types)));
  } else if (!f.ok({"num_hidden_layers"})) {
    // the length check needs a valid layer count
  } else if (static_cast<int64_t>(types->size()) != d.layers) {
    f.error("layer_types", fmt::format("must have one entry per layer (got {} entries, num_hidden_layers = {})",
                                       types->size(), d.layers));
  } else {
    for (size_t i = 0; i < types->size(); ++i) {
      const json& t = (*types)[i];
      if (t == "sliding_attention") {
        sliding[i] = true;
      } else if (t == "full_attention") {
        sliding[i] = false;
      } else {
        f.error_item("layer_types", i,
                     fmt::format("must be \"sliding_attention\" or \"full_attention\" (got {})", describe_json_value(t)));
      }
    }
  }
}

void apply_sliding_window(ModelSpec& m, const std::vector<bool>& sliding, int64_t window) {
  for (size_t i = 0; i < sliding.size() && i < m.layers.size(); ++i) {
    if (sliding[i]) {
      m.layers[i].window = AttentionWindow::Sliding;
      m.layers[i].attention_window_tokens = window;
    }
  }
}

// gpt_oss: alternating sliding/full attention, sinks, biases everywhere, all layers MoE.
void import_gpt_oss(Fields& f, ModelSpec& m) {
  const CommonDims d = read_common(f, true);
  apply_common(m, d);
  m.head_dim = read_head_dim(f, d);
  m.v_head_dim = m.head_dim;
  const bool bias = f.optional_bool("attention_bias", true);
  m.qkv_bias = bias;
  m.o_bias = bias;
  m.attention_sinks = true;
  m.router_bias = true;
  m.expert_bias = true;
  read_experts(f, m, "num_local_experts", "num_experts_per_tok", "experts_per_token");
  m.expert_ffn_width = f.required_int("intermediate_size", 1, kMaxDim);

  const int64_t window = f.required_int("sliding_window", 1, int64_t{1} << 40);
  std::vector<bool> is_moe(static_cast<size_t>(d.layers), true);
  fill_layers(m, is_moe);
  // layer_types names each layer; without it the HF default alternates, starting with sliding.
  std::vector<bool> sliding(static_cast<size_t>(d.layers));
  for (size_t i = 0; i < sliding.size(); ++i) sliding[i] = i % 2 == 0;
  read_layer_types(f, d, sliding);
  apply_sliding_window(m, sliding, window);
}

// mixtral: GQA, every layer MoE; sliding_window (may be null) applies to all layers.
void import_mixtral(Fields& f, ModelSpec& m) {
  const CommonDims d = read_common(f, true);
  apply_common(m, d);
  m.head_dim = read_head_dim(f, d);
  m.v_head_dim = m.head_dim;
  read_experts(f, m, "num_local_experts", "num_experts_per_tok");
  m.expert_ffn_width = f.required_int("intermediate_size", 1, kMaxDim);
  const int64_t window = f.optional_int("sliding_window", 0, 1, int64_t{1} << 40);
  fill_layers(m, std::vector<bool>(static_cast<size_t>(d.layers), true));
  for (auto& layer : m.layers) {
    if (window > 0) {
      layer.window = AttentionWindow::Sliding;
      layer.attention_window_tokens = window;
    }
  }
}

// phimoe (Phi-3.5-MoE): Mixtral's layout (GQA, every layer MoE with num_local_experts experts of
// intermediate_size, top num_experts_per_tok; sliding_window, may be null, on every layer) with
// transformers' PhimoeConfig and PhimoeModel differences: every norm a LayerNorm with weight and
// bias; attention_bias (default false) on q, k, v and o alike; lm_head_bias (default false) on the
// LM head. Its sparsemixer routing picks top-2 like any top-k router (no memory difference).
void import_phimoe(Fields& f, ModelSpec& m) {
  import_mixtral(f, m);
  m.qkv_bias = f.optional_bool("attention_bias", false);
  m.o_bias = m.qkv_bias;
  m.lm_head_bias = f.optional_bool("lm_head_bias", false);
  m.norm_bias = true;
}

// glm4_moe: GQA with q/k/v bias, optional per-head QK norm, partial RoPE, shared experts,
// dense prefix, MTP layers; the router always carries the noaux correction bias. GLM-4.5V's text
// model (`vision_text`) differs in two defaults of transformers' Glm4vMoeTextConfig: attention_bias
// true, and no QK norm whatever use_qk_norm says (its attention is Glm4Attention, which has none).
void import_glm4_moe(Fields& f, ModelSpec& m, bool vision_text = false) {
  const CommonDims d = read_common(f, true);
  apply_common(m, d);
  m.head_dim = read_head_dim(f, d);
  m.v_head_dim = m.head_dim;
  m.qkv_bias = f.optional_bool("attention_bias", vision_text);
  m.o_bias = false;  // Glm4MoeAttention: o_proj has no bias whatever attention_bias says
  if (!vision_text) m.qk_norm = f.optional_bool("use_qk_norm", false) ? QkNorm::PerHead : QkNorm::None;
  m.partial_rotary_factor = f.optional_fraction("partial_rotary_factor", 0.5);
  read_experts(f, m, "n_routed_experts", "num_experts_per_tok");
  m.expert_ffn_width = f.required_int("moe_intermediate_size", 1, kMaxDim);
  m.num_shared_experts = f.optional_int("n_shared_experts", 1, 0, kMaxExperts);
  m.shared_expert_ffn_width = m.num_shared_experts * m.expert_ffn_width;
  m.router_correction_bias = true;
  m.mtp_layers = f.optional_int("num_nextn_predict_layers", 0, 0, kMaxCardMtpLayers);
  const std::vector<bool> is_moe = dense_prefix_layers(f, d, 1);
  if (any_dense(is_moe)) m.dense_ffn_width = f.required_int("intermediate_size", 1, kMaxDim);
  fill_layers(m, is_moe);
}

// dots1 (rednote dots.llm1): Qwen3's attention (GQA with per-head QK norm; attention_bias on q, k,
// v and o) and DeepSeek-V3's MoE (its router always carries the noaux correction bias;
// n_shared_experts shared experts of the routed width; a dense prefix of first_k_dense_replace
// layers, default 0). Windows as transformers' Dots1Config and Dots1Attention decide them: the
// layers layer_types names "sliding_attention", else those at or past max_window_layers (default
// 62), attend within sliding_window tokens (default 4096; null: no layer is windowed). The
// released 62-layer models attend to the whole context.
void import_dots1(Fields& f, ModelSpec& m) {
  const CommonDims d = read_common(f, true);
  apply_common(m, d);
  read_qwen3_attention(f, d, m);
  read_experts(f, m, "n_routed_experts", "num_experts_per_tok");
  m.expert_ffn_width = f.required_int("moe_intermediate_size", 1, kMaxDim);
  // Dots1Config has no default for it (transformers cannot build the model without it).
  m.num_shared_experts = f.required_int("n_shared_experts", 0, kMaxExperts);
  m.shared_expert_ffn_width = m.num_shared_experts * m.expert_ffn_width;
  m.router_correction_bias = true;
  const std::vector<bool> is_moe = dense_prefix_layers(f, d, 0);
  if (any_dense(is_moe)) m.dense_ffn_width = f.required_int("intermediate_size", 1, kMaxDim);
  fill_layers(m, is_moe);

  // A null sliding_window: no layer is windowed, whatever layer_types says (the attention's
  // window is the config's value, None).
  const json* window_raw = f.find("sliding_window");
  const bool windowed = window_raw == nullptr || !window_raw->is_null();
  const int64_t window = f.optional_int("sliding_window", 4096, 1, int64_t{1} << 40);
  int64_t max_window_layers = 62;
  if (const json* mwl = f.find("max_window_layers"); mwl != nullptr && mwl->is_null()) {
    // transformers compares each layer index with it when layer_types is not given (a TypeError).
    if (windowed && !f.has("layer_types"))
      f.error("max_window_layers", "must be an integer when sliding_window is set and layer_types is not given (got null)");
  } else {
    max_window_layers = f.optional_int("max_window_layers", 62, 0, kMaxLayers);
  }
  std::vector<bool> sliding(static_cast<size_t>(d.layers));
  for (int64_t i = 0; i < d.layers; ++i) sliding[static_cast<size_t>(i)] = i >= max_window_layers;
  read_layer_types(f, d, sliding);
  if (windowed) apply_sliding_window(m, sliding, window);
}

// olmoe: GQA/MHA with QK RMSNorm over the whole q and k projections; every layer MoE.
void import_olmoe(Fields& f, ModelSpec& m) {
  const CommonDims d = read_common(f, true);
  apply_common(m, d);
  m.head_dim = read_head_dim(f, d);
  m.v_head_dim = m.head_dim;
  const bool bias = f.optional_bool("attention_bias", false);
  m.qkv_bias = bias;
  m.o_bias = bias;
  m.qk_norm = QkNorm::FullProjection;
  read_experts(f, m, "num_experts", "num_experts_per_tok");
  m.expert_ffn_width = f.required_int("intermediate_size", 1, kMaxDim);
  fill_layers(m, std::vector<bool>(static_cast<size_t>(d.layers), true));
}

// minimax_m2: GQA without biases, RMSNorm over the whole q and k projections ("per_layer"),
// partial RoPE (rotary_dim of head_dim), every layer MoE with Mixtral's expert layout
// (intermediate_size is the expert width), sigmoid routing with a per-expert correction bias,
// untied head. The publisher's config (MiniMax's remote code) also names what M2 does not use and
// this model does not express: linear-attention layers (attn_type_list entries 0), a shared
// expert (shared_intermediate_size), sliding windows; each is refused rather than dropped. Its
// multi-token-prediction modules (use_mtp, num_mtp_modules of mtp_transformer_layers decoder
// layers) are counted as DeepSeek's MTP modules (one decoder layer with its projection and
// norms each), the one MTP shape flatpeak models; the transformers model does not build them.
void import_minimax_m2(Fields& f, ModelSpec& m) {
  const CommonDims d = read_common(f, true);
  apply_common(m, d);
  m.head_dim = read_head_dim(f, d);
  m.v_head_dim = m.head_dim;
  if (f.optional_bool("attention_bias", false)) {
    f.error("attention_bias", "must be false: MiniMax-M2's projections have no biases (got true)");
  }
  if (f.optional_bool("use_qk_norm", true)) {
    const std::string norm = f.optional_string("qk_norm_type").value_or("per_layer");
    if (norm == "per_layer") {
      m.qk_norm = QkNorm::FullProjection;
    } else if (norm == "per_head") {
      m.qk_norm = QkNorm::PerHead;
    } else {
      f.error("qk_norm_type", fmt::format("must be \"per_layer\" or \"per_head\" (got {})",
                                          describe_json_value(json(norm))));
    }
  }
  if (f.has("rotary_dim")) {
    const int64_t rotary = f.required_int("rotary_dim", 1, kMaxDim);
    if (!f.ok({"rotary_dim", "head_dim", "hidden_size", "num_attention_heads"})) {
      // reported already; the fraction needs both dims
    } else if (rotary > m.head_dim) {
      f.error("rotary_dim",
              fmt::format("must be in 1..head_dim (got {}, head_dim = {})", rotary, m.head_dim));
    } else {
      m.partial_rotary_factor = static_cast<double>(rotary) / static_cast<double>(m.head_dim);
    }
  } else {
    m.partial_rotary_factor = f.optional_fraction("partial_rotary_factor", 1.0);
  }
  read_experts(f, m, "num_local_experts", "num_experts_per_tok");
  m.expert_ffn_width = f.required_int("intermediate_size", 1, kMaxDim);
  m.router_correction_bias = f.optional_bool("use_routing_bias", true);
  const int64_t shared = f.optional_int("shared_intermediate_size", 0, 0, kMaxDim);
  if (shared > 0) {
    f.error("shared_intermediate_size",
            fmt::format("must be 0: a MiniMax shared expert is not modelled (got {})", shared));
  }
  for (const char* key : {"sliding_window", "attn_window_size"}) {
    if (f.has(key)) {
      f.error(key, fmt::format("must be null: MiniMax-M2 attends to the whole context, and windows are "
                               "not modelled for minimax_m2 (got {})",
                               describe_json_value(*f.find(key))));
    }
  }
  if (const auto types = f.optional_int_list("attn_type_list", 0, 1)) {
    for (size_t i = 0; i < types->size(); ++i) {
      if ((*types)[i] == 0) {
        f.error("attn_type_list", fmt::format("must be all 1 (softmax attention): linear-attention layers "
                                              "are not modelled (got 0 at layer {})",
                                              i));
        break;
      }
    }
  }
  if (f.optional_bool("use_mtp", false)) {
    const int64_t modules = f.optional_int("num_mtp_modules", 0, 0, kMaxCardMtpLayers);
    const int64_t layers_per_module = f.optional_int("mtp_transformer_layers", 1, 1, kMaxLayers);
    if (layers_per_module != 1) {
      f.error("mtp_transformer_layers",
              fmt::format("must be 1: an MTP module of several decoder layers is not modelled (got {})",
                          layers_per_module));
    }
    m.mtp_layers = modules;
  }
  fill_layers(m, std::vector<bool>(static_cast<size_t>(d.layers), true));
}

// ernie4_5_moe (ERNIE 4.5 MoE, text): GQA, MoE at the layers i with (i + 1) % moe_layer_interval
// == 0 within moe_layer_start_index..moe_layer_end_index (-1: the last), dense FFN of
// intermediate_size elsewhere; moe_num_shared_experts shared experts of moe_intermediate_size as
// one MLP; softmax routing with a per-expert correction bias (moe_statics, always present);
// tied embeddings unless told otherwise (transformers' defaults: shared experts 2, tied). use_bias
// puts biases on every projection, MLPs and the head included, which the model spec cannot hold:
// refused. MTP modules (num_nextn_predict_layers, which the transformers port ignores) are counted
// as DeepSeek's.
void import_ernie4_5_moe(Fields& f, ModelSpec& m) {
  const CommonDims d = read_common(f, true);
  apply_common(m, d);
  if (!f.has("tie_word_embeddings")) m.tie_word_embeddings = true;
  m.head_dim = read_head_dim(f, d);
  m.v_head_dim = m.head_dim;
  if (f.optional_bool("use_bias", false)) {
    f.error("use_bias", "must be false: biases on the MLPs and the head are not modelled (got true)");
  }
  read_experts(f, m, "moe_num_experts", "moe_k");
  m.expert_ffn_width = f.required_int("moe_intermediate_size", 1, kMaxDim);
  const int64_t shared = f.optional_int("moe_num_shared_experts", 2, 0, kMaxExperts);
  m.num_shared_experts = shared;
  m.shared_expert_ffn_width = shared * m.expert_ffn_width;
  m.router_correction_bias = true;
  m.mtp_layers = f.optional_int("num_nextn_predict_layers", 0, 0, kMaxCardMtpLayers);
  const int64_t last = last_layer_index(f, d);
  const int64_t start = f.optional_int("moe_layer_start_index", 1, 0, last);
  int64_t end = f.optional_int("moe_layer_end_index", -1, -1, last);
  if (end == -1) end = last;
  const int64_t interval = f.optional_int("moe_layer_interval", 1, 1, kMaxLayers);
  std::vector<bool> is_moe(static_cast<size_t>(d.layers));
  for (int64_t i = 0; i < d.layers; ++i) {
    is_moe[static_cast<size_t>(i)] = (i + 1) % interval == 0 && i >= start && i <= end;
  }
  if (any_dense(is_moe)) m.dense_ffn_width = f.required_int("intermediate_size", 1, kMaxDim);
  fill_layers(m, is_moe);
}

// llama4: the text model under text_config (the vision tower is not counted). MoE every
// interleave_moe_layer_step layers (or the explicit moe_layers list), one shared expert of width
// intermediate_size beside the routed experts of the same width, dense layers of width
// intermediate_size_mlp. RoPE layers attend within attention_chunk_size chunks; NoPE layers
// (no_rope_layers[i] == 0) see the whole context. use_qk_norm is an L2 norm without weights.
void import_llama4(Fields& f, ModelSpec& m) {
  const CommonDims d = read_common(f, true);
  apply_common(m, d);
  m.head_dim = read_head_dim(f, d);
  m.v_head_dim = m.head_dim;
  const bool bias = f.optional_bool("attention_bias", false);
  m.qkv_bias = bias;
  m.o_bias = bias;
  read_experts(f, m, "num_local_experts", "num_experts_per_tok");
  m.expert_ffn_width = f.required_int("intermediate_size", 1, kMaxDim);
  m.num_shared_experts = 1;
  m.shared_expert_ffn_width = m.expert_ffn_width;
  const int64_t step = f.optional_int("interleave_moe_layer_step", 1, 1, kMaxLayers);
  const auto moe_list = f.optional_int_list("moe_layers", 0, last_layer_index(f, d));
  const int64_t chunk = f.optional_int("attention_chunk_size", 0, 1, int64_t{1} << 40);
  const int64_t nope_interval = f.optional_int("no_rope_layer_interval", 4, 1, kMaxLayers);
  const auto rope_flags = f.optional_int_list("no_rope_layers", 0, 1);

  std::vector<bool> is_moe(static_cast<size_t>(d.layers), false);
  if (moe_list) {
    for (int64_t i : *moe_list) {
      if (i < d.layers) is_moe[static_cast<size_t>(i)] = true;
    }
  } else {
    for (int64_t i = step - 1; i < d.layers; i += step) is_moe[static_cast<size_t>(i)] = true;
  }
  if (any_dense(is_moe)) m.dense_ffn_width = f.required_int("intermediate_size_mlp", 1, kMaxDim);
  fill_layers(m, is_moe);

  // no_rope_layers: 1 = RoPE layer, 0 = NoPE layer; HF's default: every nope_interval-th is NoPE.
  std::vector<bool> rope(static_cast<size_t>(d.layers));
  for (int64_t i = 0; i < d.layers; ++i) rope[static_cast<size_t>(i)] = (i + 1) % nope_interval != 0;
  if (rope_flags && !rope_flags->empty()) {
    if (!f.ok({"num_hidden_layers"})) {
      // the length check needs a valid layer count
    } else if (static_cast<int64_t>(rope_flags->size()) < d.layers) {
      f.error("no_rope_layers", fmt::format("must have at least one entry per layer (got {} entries, "
                                            "num_hidden_layers = {})",
                                            rope_flags->size(), d.layers));
    } else {
      for (size_t i = 0; i < rope.size(); ++i) rope[i] = (*rope_flags)[i] == 1;
    }
  }
  for (size_t i = 0; i < rope.size(); ++i) {
    m.layers[i].rope = rope[i];
    if (rope[i] && chunk > 0) {
      m.layers[i].window = AttentionWindow::Chunked;
      m.layers[i].attention_window_tokens = chunk;
    }
  }
}

// A generous overestimate of the parameter count, in double, so that absurd dims are rejected
// before any int64 product is formed downstream.
double estimated_params(const ModelSpec& m) {
  const double h = static_cast<double>(m.hidden_size);
  const double attention =
      h * (static_cast<double>(m.q_lora_rank) + static_cast<double>(m.kv_lora_rank) +
           static_cast<double>(m.num_heads + 2 * m.num_kv_heads) * static_cast<double>(m.head_dim + m.v_head_dim)) +
      static_cast<double>(m.q_lora_rank + m.kv_lora_rank) * static_cast<double>(m.num_heads) *
          static_cast<double>(m.head_dim + m.v_head_dim) +
      static_cast<double>(m.num_heads) * static_cast<double>(m.v_head_dim) * h;
  const double ffn = 3.0 * h *
                         (static_cast<double>(m.dense_ffn_width) + static_cast<double>(m.shared_expert_ffn_width) +
                          static_cast<double>(m.num_experts) * static_cast<double>(m.expert_ffn_width)) +
                     4.0 * static_cast<double>(m.num_experts) * (h + 1.0);
  const double per_layer = attention + ffn + 8.0 * h;
  return 2.0 * static_cast<double>(m.vocab_size) * h +
         static_cast<double>(m.num_layers + m.mtp_layers + 1) * per_layer;
}

std::string file_display_name(const std::string& file) {
  std::string path = file;
  while (path.size() > 1 && path.back() == '/') path.pop_back();
  const size_t slash = path.find_last_of('/');
  std::string base = slash == std::string::npos ? path : path.substr(slash + 1);
  // ".../DeepSeek-V3/config.json" is named after its folder.
  if (base == "config.json" && slash != std::string::npos && slash > 0) {
    const std::string dir = path.substr(0, slash);
    const size_t up = dir.find_last_of('/');
    const std::string parent = up == std::string::npos ? dir : dir.substr(up + 1);
    if (!parent.empty() && parent != "." && parent != "..") return parent;
  }
  if (base.size() > 5 && base.compare(base.size() - 5, 5, ".json") == 0) base.resize(base.size() - 5);
  return base;
}

// The family from model_type, else from architectures; nullopt (with a diagnostic) if neither
// names a supported one.
std::optional<std::string> detect_family(const json& config, Collector& out) {
  std::string model_type;
  bool has_model_type = false;
  if (const auto it = config.find("model_type"); it != config.end()) {
    if (it->is_string()) {
      model_type = it->get<std::string>();
      has_model_type = true;
    } else if (!it->is_null()) {
      out.add("/model_type", fmt::format("must be a string (got {})", describe_json_value(*it)));
      return std::nullopt;
    }
  }
  const auto& names = architecture_names();
  if (has_model_type) {
    if (std::find(names.begin(), names.end(), model_type) != names.end()) return model_type;
    const auto alias = model_type_aliases().find(model_type);
    if (alias != model_type_aliases().end()) return alias->second;
  }
  std::vector<std::string> classes;
  if (const auto it = config.find("architectures"); it != config.end() && it->is_array()) {
    for (const auto& entry : *it) {
      if (!entry.is_string()) continue;
      classes.push_back(entry.get<std::string>());
      const auto known = architecture_classes().find(classes.back());
      if (known != architecture_classes().end()) return known->second;
    }
  }
  if (has_model_type) {
    out.add("/model_type", fmt::format("unsupported architecture (got {}); supported: {}",
                                       describe_json_value(json(model_type)), join(names)));
  } else if (!classes.empty()) {
    out.add("/architectures", fmt::format("unsupported architecture (got {}); supported: {}",
                                          describe_json_value(json(classes)), join(names)));
  } else {
    out.add("/model_type", fmt::format("required key missing; supported architectures: {}", join(names)));
  }
  return std::nullopt;
}

}  // namespace

bool looks_like_hf_config(const nlohmann::json& document) {
  if (!document.is_object() || !(document.contains("model_type") || document.contains("architectures"))) return false;
  // Keys only our card schema has (no HF config uses them): a card that also carries
  // `architectures` or `model_type` (a typo for `architecture`, a pasted key) is still a card, so
  // the card parser names the stray key with a did-you-mean instead of the HF importer
  // complaining about an architecture it does not know.
  for (const char* key : {"architecture", "aliases", "attention_type", "qk_norm", "attention_sinks", "o_proj_bias",
                          "dense_layers", "params_total_official", "params_active_official", "params_official_statement"})
    if (document.contains(key)) return false;
  return true;
}

std::vector<std::string> supported_hf_architectures() { return architecture_names(); }

ModelSpec import_hf_config(const nlohmann::json& config, const std::string& file) {
  Collector out(file);
  if (!config.is_object()) {
    out.add("", fmt::format("a Hugging Face config must be a JSON object (got {})", describe_json_value(config)));
    out.throw_if_any();
  }
  const std::optional<std::string> family = detect_family(config, out);
  out.throw_if_any();

  ModelSpec m;
  m.name = file_display_name(file);
  m.architecture = *family;
  m.source = file;

  Fields root(config, "", out);
  // Vision-language wrappers: the language model under text_config (the vision tower beside it is
  // not counted), or a config of the text model alone (its own model_type); import_text gets the
  // text model's fields. The text model's tie_word_embeddings wins; without it, the wrapper's.
  const auto from_text_config = [&](const char* text_model_type, const auto& import_text) {
    const json* text = root.find("text_config");
    const auto model_type = config.find("model_type");
    if (model_type != config.end() && *model_type == text_model_type) {
      import_text(root);
    } else if (text == nullptr) {
      out.add_missing("/text_config", "text_config", &config);
    } else if (!text->is_object()) {
      out.add("/text_config", fmt::format("must be an object (got {})", describe_json_value(*text)));
    } else {
      Fields text_fields(*text, "/text_config", out);
      import_text(text_fields);
      if (!text_fields.has("tie_word_embeddings")) m.tie_word_embeddings = root.optional_bool("tie_word_embeddings", false);
    }
  };
  if (*family == "llama4") {
    from_text_config("llama4_text", [&](Fields& f) { import_llama4(f, m); });
  } else if (*family == "qwen3_vl_moe") {
    // Qwen3-VL's language model is Qwen3-MoE's (its M-RoPE changes no shape).
    from_text_config("qwen3_vl_moe_text", [&](Fields& f) { import_qwen3_moe(f, m); });
  } else if (*family == "glm4v_moe") {
    // GLM-4.5V's language model is GLM-4.5-Air's glm4_moe (its M-RoPE sections change no shape).
    from_text_config("glm4v_moe_text", [&](Fields& f) { import_glm4_moe(f, m, true); });
  } else if (*family == "qwen3_moe") {
    import_qwen3_moe(root, m);
  } else if (*family == "qwen2_moe") {
    import_qwen2_moe(root, m);
  } else if (*family == "gpt_oss") {
    import_gpt_oss(root, m);
  } else if (*family == "mixtral") {
    import_mixtral(root, m);
  } else if (*family == "glm4_moe") {
    import_glm4_moe(root, m);
  } else if (*family == "olmoe") {
    import_olmoe(root, m);
  } else if (*family == "minimax_m2") {
    import_minimax_m2(root, m);
  } else if (*family == "ernie4_5_moe") {
    import_ernie4_5_moe(root, m);
  } else if (*family == "dots1") {
    import_dots1(root, m);
  } else if (*family == "phimoe") {
    import_phimoe(root, m);
  } else {
    import_deepseek(root, m, *family);
  }
  out.throw_if_any();

  const double estimate = estimated_params(m);
  if (!(estimate <= kMaxParams)) {
    out.add("", fmt::format("implausible model size: the dimensions give about {:.3g} parameters (limit {:.0e})",
                            estimate, kMaxParams));
    out.throw_if_any();
  }
  return m;
}

}  // namespace flatpeak
