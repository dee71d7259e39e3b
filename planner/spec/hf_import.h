// Importing a Hugging Face config.json into a ModelSpec, by model_type / architectures.
// Supported: deepseek_v2, deepseek_v3, kimi_k2, qwen3_moe, gpt_oss, mixtral, glm4_moe, olmoe, llama4,
// minimax_m2, ernie4_5_moe.
//   ModelSpec m = import_hf_config(parse_json_text(text, path), path);
// Unknown keys are ignored (configs carry many); a missing required key is an InputError that
// suggests a near-miss key present in the file; an unknown architecture lists the supported ones.
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "spec/model_spec.h"

namespace flatpeak {

// True when the document looks like an HF config (has model_type or architectures) rather than
// one of our cards (it has none of the keys only a card has: architecture, attention_type, ...).
bool looks_like_hf_config(const nlohmann::json& document);

std::vector<std::string> supported_hf_architectures();

ModelSpec import_hf_config(const nlohmann::json& config, const std::string& file);

}  // namespace flatpeak
