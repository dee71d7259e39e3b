// Loading hardware cards: by name or alias (embedded cards from models/hardware/), or a path.
//   HardwareSpec g = load_hardware("H100");   // alias of H100-80GB
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "spec/hardware_spec.h"

namespace flatpeak {

// The embedded hardware cards, sorted by name.
std::vector<HardwareSpec> list_hardware_cards();

// A card name or alias (case-insensitive), or a path to a hardware card JSON.
HardwareSpec load_hardware(const std::string& name_or_path);

// Parses one hardware card (schema in models/README.md); `file` is used in messages.
HardwareSpec parse_hardware_card(const nlohmann::json& card, const std::string& file);

}  // namespace flatpeak
