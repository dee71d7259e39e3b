#include "sizes.h"

#include <cctype>
#include <cmath>
#include <cstdlib>
#include <limits>

#include <fmt/format.h>

namespace flatpeak {

namespace {
// Splits "123.5GiB" into the number "123.5" and the suffix "GiB". Fails on signs and blanks.
bool split_number(const std::string& text, std::string& number, std::string& suffix) {
  size_t i = 0;
  bool seen_digit = false, seen_dot = false;
  while (i < text.size()) {
    const char c = text[i];
    if (std::isdigit(static_cast<unsigned char>(c))) {
      seen_digit = true;
    } else if (c == '.' && !seen_dot) {
      seen_dot = true;
    } else {
      break;
    }
    ++i;
  }
  if (!seen_digit) return false;
  number = text.substr(0, i);
  suffix = text.substr(i);
  return true;
}

// Any number of digits (leading zeros included: "00000000000000000008" is 8); nullopt past int64,
// found as the digits are read.
std::optional<int64_t> parse_integer(const std::string& digits) {
  if (digits.empty()) return std::nullopt;
  int64_t value = 0;
  for (char c : digits) {
    if (!std::isdigit(static_cast<unsigned char>(c))) return std::nullopt;
    const int64_t digit = c - '0';
    if (value > (std::numeric_limits<int64_t>::max() - digit) / 10) return std::nullopt;
    value = value * 10 + digit;
  }
  return value;
}
}  // namespace

std::optional<double> parse_decimal(const std::string& text) {
  // sign? digits [. digits] ([eE] sign? digits)?, with at least one digit in the mantissa.
  size_t i = 0;
  auto digits = [&]() {
    const size_t start = i;
    while (i < text.size() && std::isdigit(static_cast<unsigned char>(text[i]))) ++i;
    return i - start;
  };
  if (i < text.size() && (text[i] == '+' || text[i] == '-')) ++i;
  size_t mantissa = digits();
  if (i < text.size() && text[i] == '.') {
    ++i;
    mantissa += digits();
  }
  if (mantissa == 0) return std::nullopt;
  if (i < text.size() && (text[i] == 'e' || text[i] == 'E')) {
    ++i;
    if (i < text.size() && (text[i] == '+' || text[i] == '-')) ++i;
    if (digits() == 0) return std::nullopt;
  }
  if (i != text.size()) return std::nullopt;
  const double value = std::strtod(text.c_str(), nullptr);
  if (!std::isfinite(value)) return std::nullopt;
  return value;
}

std::optional<int64_t> parse_decimal_integer(const std::string& text) { return parse_integer(text); }

std::optional<int64_t> parse_tokens(const std::string& text) {
  std::string number, suffix;
  if (!split_number(text, number, suffix) || number.find('.') != std::string::npos) return std::nullopt;
  int64_t multiplier = 1;
  if (suffix == "K" || suffix == "k") {
    multiplier = int64_t{1} << 10;
  } else if (suffix == "M") {
    multiplier = int64_t{1} << 20;
  } else if (suffix == "G") {
    multiplier = int64_t{1} << 30;
  } else if (!suffix.empty()) {
    return std::nullopt;
  }
  const auto value = parse_integer(number);
  if (!value || *value <= 0) return std::nullopt;
  if (*value > std::numeric_limits<int64_t>::max() / multiplier) return std::nullopt;
  return *value * multiplier;
}

bool tokens_beyond_int64(const std::string& text) {
  std::string number, suffix;
  if (!split_number(text, number, suffix) || number.find('.') != std::string::npos) return false;
  if (!(suffix.empty() || suffix == "K" || suffix == "k" || suffix == "M" || suffix == "G")) return false;
  return !parse_tokens(text) && number.find_first_not_of('0') != std::string::npos;
}

namespace {

struct ByteUnit {
  const char* name;
  double multiplier;
};

const ByteUnit* byte_unit(const std::string& suffix) {
  static const ByteUnit kUnits[] = {
      {"", 1.0},       {"B", 1.0},        {"KB", 1e3},       {"MB", 1e6},
      {"GB", 1e9},     {"TB", 1e12},      {"KiB", 1024.0},   {"MiB", 1048576.0},
      {"GiB", 1073741824.0}, {"TiB", 1099511627776.0},
  };
  for (const auto& candidate : kUnits)
    if (suffix == candidate.name) return &candidate;
  return nullptr;
}

}  // namespace

namespace {

// A decimal "digits[.digits]" as a long double, read from at most 19 integer digits (leading
// zeros dropped) and 30 fraction digits: std::stold throws out_of_range on thousands of digits.
// nullopt when the integer part alone is beyond int64.
std::optional<long double> bounded_decimal(const std::string& number) {
  const size_t dot = number.find('.');
  std::string whole = number.substr(0, dot);
  whole.erase(0, std::min(whole.find_first_not_of('0'), whole.size()));
  if (whole.size() > 19) return std::nullopt;
  const std::string fraction = dot == std::string::npos ? "" : number.substr(dot + 1, 30);
  return std::stold((whole.empty() ? "0" : whole) + "." + (fraction.empty() ? "0" : fraction));
}

}  // namespace

bool bytes_beyond_int64(const std::string& text) {
  std::string number, suffix;
  if (!split_number(text, number, suffix) || number == ".") return false;
  const ByteUnit* unit = byte_unit(suffix);
  if (unit == nullptr) return false;
  const std::optional<long double> value = bounded_decimal(number);  // none: past 19 integer digits
  return !value || *value * static_cast<long double>(unit->multiplier) >= static_cast<long double>(std::numeric_limits<int64_t>::max());
}

std::optional<int64_t> parse_bytes(const std::string& text) {
  std::string number, suffix;
  if (!split_number(text, number, suffix)) return std::nullopt;
  const ByteUnit* unit = byte_unit(suffix);
  if (unit == nullptr) return std::nullopt;
  // Integers stay exact; decimals go through long double (exact to well past TiB scale).
  if (number.find('.') == std::string::npos) {
    const auto value = parse_integer(number);
    if (!value) return std::nullopt;
    const auto multiplier = static_cast<int64_t>(unit->multiplier);
    if (*value > std::numeric_limits<int64_t>::max() / multiplier) return std::nullopt;
    return *value * multiplier;
  }
  if (suffix.empty() || suffix == "B") return std::nullopt;  // fractional bytes make no sense
  const std::optional<long double> decimal = bounded_decimal(number);
  if (!decimal) return std::nullopt;
  const long double value = *decimal * static_cast<long double>(unit->multiplier);
  if (!(value < static_cast<long double>(std::numeric_limits<int64_t>::max()))) return std::nullopt;
  return static_cast<int64_t>(std::floor(value));
}

std::string format_bytes(int64_t bytes) {
  const double magnitude = std::fabs(static_cast<double>(bytes));
  if (magnitude >= 1099511627776.0) return fmt::format("{:.2f} TiB", static_cast<double>(bytes) / 1099511627776.0);
  if (magnitude >= 1073741824.0) return fmt::format("{:.2f} GiB", static_cast<double>(bytes) / 1073741824.0);
  if (magnitude >= 1048576.0) return fmt::format("{:.1f} MiB", static_cast<double>(bytes) / 1048576.0);
  if (magnitude >= 1024.0) return fmt::format("{:.1f} KiB", static_cast<double>(bytes) / 1024.0);
  return fmt::format("{} B", bytes);
}

std::string format_tokens(int64_t tokens) {
  if (tokens > 0 && tokens % (int64_t{1} << 30) == 0) return fmt::format("{}G", tokens >> 30);
  if (tokens > 0 && tokens % (int64_t{1} << 20) == 0) return fmt::format("{}M", tokens >> 20);
  if (tokens > 0 && tokens % (int64_t{1} << 10) == 0) return fmt::format("{}K", tokens >> 10);
  return fmt::format("{}", tokens);
}

}  // namespace flatpeak
