// Parsing and printing of token counts and byte sizes, as DESIGN.md defines them.
//   parse_tokens("1M") == 1048576;  parse_bytes("80GiB") == 85899345920;  parse_bytes("141GB")
//   format_bytes(85899345920) == "80.00 GiB"
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace flatpeak {

// Token counts: a positive integer, optionally with K, M or G = powers of 1024 ("32K", "1M").
// Returns nullopt for anything else (empty, negative, fractions, other suffixes, overflow).
std::optional<int64_t> parse_tokens(const std::string& text);
// A well-formed token count whose value is beyond 2^63 - 1 ("99999999999999999999", "16G" is
// not): parse_tokens rejects it, and the message should say it is too large, not malformed.
bool tokens_beyond_int64(const std::string& text);

// Byte sizes: an integer or decimal number with a unit: B, KB, MB, GB, TB (powers of 1000)
// or KiB, MiB, GiB, TiB (powers of 1024); a bare integer is bytes. Result rounded down to bytes.
// Returns nullopt for anything else (unknown suffix, negative, overflow past int64).
std::optional<int64_t> parse_bytes(const std::string& text);
// A well-formed byte size at or beyond 2^63 - 1 bytes ("9000000TiB").
bool bytes_beyond_int64(const std::string& text);

// Plain decimal numbers, for flags and fields that take a number rather than a size: digits
// with an optional sign, decimal point and exponent ("2.5", "-1", "1e-3"). nullopt for anything
// else: hex ("0x10", which strtod reads as 16), inf, nan, blanks, a suffix, or overflow.
std::optional<double> parse_decimal(const std::string& text);
// Decimal digits only ("16"; no sign, hex "0x10" or octal reading of "010"); nullopt past int64.
std::optional<int64_t> parse_decimal_integer(const std::string& text);

// "80.00 GiB", "512.0 MiB", "123 B": binary units, for tables meant for people.
std::string format_bytes(int64_t bytes);

// "1M", "32K", "1000": the shortest exact token spelling.
std::string format_tokens(int64_t tokens);

}  // namespace flatpeak
