// The model and hardware cards of models/, compiled into the binary (cmake/EmbedCards.cmake).
//   for (const auto& card : embedded_model_cards()) std::cout << card.name << "\n";
#pragma once

#include <string>
#include <vector>

namespace flatpeak {

struct EmbeddedCard {
  std::string name;  // file name without .json: "gpt-oss-120b", "H200"
  std::string json;  // the card's text
};

const std::vector<EmbeddedCard>& embedded_model_cards();
const std::vector<EmbeddedCard>& embedded_hardware_cards();

}  // namespace flatpeak
