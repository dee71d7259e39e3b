#include "numeric_flags.h"

#include <fmt/format.h>

#include "spec/sizes.h"

namespace flatpeak::cli {

CLI::Validator decimal_integer(int64_t min_value, int64_t max_value) {
  return CLI::Validator(
      [min_value, max_value](std::string& text) -> std::string {
        const auto v = parse_decimal_integer(text);
        if (v && *v >= min_value && *v <= max_value) {
          text = std::to_string(*v);  // CLI11 converts with base 0, which reads "010" as octal 8
          return "";
        }
        return fmt::format("must be a decimal integer in {}..{} (got '{}')", min_value, max_value, text);
      },
      "");
}

CLI::Validator decimal_number() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        if (parse_decimal(text)) return "";
        return fmt::format("must be a decimal number (got '{}')", text);
      },
      "");
}

}  // namespace flatpeak::cli
