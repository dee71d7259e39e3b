// CLI11 validators for the flags CLI11 reads natively into numbers. CLI11 alone saturates an
// out-of-range integer (strtoll: 99999999999999999999 became INT64_MAX) and reads "0x10" as 16 and
// "010" as 8; these take plain decimals only and name the flag, the rule and the value.
//   sub.add_option("--max-ranks", o->max_ranks, "...")->check(decimal_integer(1, planner::kMaxGpus));
//   sub.add_option("--tolerance", o->tolerance, "...")->check(decimal_number());
#pragma once

#include <cstdint>

#include <CLI/CLI.hpp>

namespace flatpeak::cli {

// Decimal digits, min_value <= value <= max_value ("010" is ten, and is handed on as "10"). Fails
// with "--flag: must be a decimal integer in MIN..MAX (got 'TEXT')" (exit 2).
CLI::Validator decimal_integer(int64_t min_value, int64_t max_value);

// A plain finite decimal number ("0.01", "1e-3"); the flag's own range is checked where it is used.
CLI::Validator decimal_number();

}  // namespace flatpeak::cli
