// Loading models: by card name or alias (embedded cards from models/), or from a path to one of
// our cards or to a Hugging Face config.json (detected by content).
//   ModelSpec m = load_model("gpt-oss-120b");
//   ModelSpec c = load_model("path/to/config.json");   // InputError lists every problem
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "spec/model_spec.h"

namespace flatpeak {

// Upper bounds of a model card (ours or a Hugging Face config), far above any real model: they
// keep every derived size finite, and the knob search (which grows with L^2) and the routing
// tables (with E) small; 65536 layers took minutes, 2^31 experts ran out of host memory.
inline constexpr int64_t kMaxCardDim = (int64_t{1} << 31) - 1;  // widths, heads, vocab, context
inline constexpr int64_t kMaxCardLayers = 4096;
inline constexpr int64_t kMaxCardExperts = 65536;
// MTP modules (real models have 1 to 3): each is its own timeline entry holding every earlier
// module's saved tensors, so plans grow with its square (4096 modules ran out of time and memory).
inline constexpr int64_t kMaxCardMtpLayers = 64;

struct ModelCardInfo {
  std::string name;                  // "gpt-oss-120b"
  std::vector<std::string> aliases;  // other accepted names
  std::string architecture;          // "gpt_oss"
};

// The embedded model cards, sorted by name.
std::vector<ModelCardInfo> list_model_cards();

// A card name or alias (case-insensitive), or a path to a card or an HF config.json.
// Unknown names throw InputError with a did-you-mean.
ModelSpec load_model(const std::string& name_or_path);

// Parses one of our model cards (schema in models/README.md); `file` is used in messages.
ModelSpec parse_model_card(const nlohmann::json& card, const std::string& file);

}  // namespace flatpeak
