// Token counts and byte sizes as DESIGN.md defines them: K/M/G tokens are powers of 1024;
// KB..TB are decimal and KiB..TiB binary; anything else is rejected.
#include "spec/sizes.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <string>

namespace flatpeak {
namespace {

TEST(ParseTokens, PowersOf1024) {
  EXPECT_EQ(parse_tokens("1M"), 1048576);
  EXPECT_EQ(parse_tokens("32K"), 32768);
  EXPECT_EQ(parse_tokens("32k"), 32768);
  EXPECT_EQ(parse_tokens("2G"), int64_t{2147483648});
  EXPECT_EQ(parse_tokens("1000"), 1000);
  EXPECT_EQ(parse_tokens("1048576"), 1048576);
}

TEST(ParseTokens, RejectsEverythingElse) {
  for (const char* bad : {"", "0", "-1", "1.5M", "1MB", "1m", "M", "1 M", "abc", "1KiB", "99999999999999999999",
                          "9223372036854775807G"}) {
    EXPECT_FALSE(parse_tokens(bad).has_value()) << bad;
  }
}

// Too large (well-formed, beyond int64) is told apart from malformed, so a message can say which.
TEST(ParseTokens, TooLargeIsToldApartFromMalformed) {
  for (const char* big : {"99999999999999999999", "9223372036854775808", "9000000000G", "9007199254740992M"})
    EXPECT_TRUE(tokens_beyond_int64(big)) << big;
  for (const char* other : {"9223372036854775807", "8G", "0", "000", "-1", "1.5K", "99999999999999999999T", "abc", "",
                            "000000000000000000032K"})
    EXPECT_FALSE(tokens_beyond_int64(other)) << other;
  EXPECT_EQ(parse_tokens("000000000000000000032K"), 32768);  // leading zeros are not digits of the value
  EXPECT_TRUE(tokens_beyond_int64(std::string(5000, '9')));
}

TEST(ParseBytes, DecimalAndBinaryUnits) {
  EXPECT_EQ(parse_bytes("80GiB"), int64_t{85899345920});
  EXPECT_EQ(parse_bytes("141GB"), int64_t{141000000000});
  EXPECT_EQ(parse_bytes("2TB"), int64_t{2000000000000});
  EXPECT_EQ(parse_bytes("1.5TiB"), int64_t{1649267441664});
  EXPECT_EQ(parse_bytes("512"), 512);
  EXPECT_EQ(parse_bytes("512B"), 512);
  EXPECT_EQ(parse_bytes("3GiB"), int64_t{3} << 30);
  EXPECT_EQ(parse_bytes("0"), 0);
}

TEST(ParseBytes, RejectsEverythingElse) {
  for (const char* bad : {"", "80G", "80gb", "80 GiB", "-1GB", "1.5", "1.5B", "GiB", "80GiBs", "1e9",
                          "9223372036854775807KB", "99999999999TiB"}) {
    EXPECT_FALSE(parse_bytes(bad).has_value()) << bad;
  }
}

// Numbers of flags such as --llep-alpha and --tolerance: strtod alone read "0x10" as 16.
TEST(ParseBytes, TooLargeIsToldApartFromMalformed) {
  for (const char* big : {"99999999999999999999", "9000000TiB", "10000000TB", "8388608.5TiB"}) EXPECT_TRUE(bytes_beyond_int64(big)) << big;
  for (const char* other : {"9223372036854775806", "8TiB", "0", "-1", "1.5KiB", "99999999999XB", "9.3e18", "abc", "", "."})
    EXPECT_FALSE(bytes_beyond_int64(other)) << other;
  // 5000 digits (std::stold throws out_of_range on them, which ended as an internal error).
  EXPECT_TRUE(bytes_beyond_int64(std::string(5000, '9')));
  EXPECT_TRUE(bytes_beyond_int64(std::string(5000, '1') + "GB"));
  EXPECT_FALSE(bytes_beyond_int64("0." + std::string(5000, '0') + "1GB"));
  EXPECT_TRUE(bytes_beyond_int64("8388608.5TiB"));
  EXPECT_FALSE(parse_bytes(std::string(5000, '9') + ".5GB").has_value());
  EXPECT_EQ(parse_bytes("0." + std::string(5000, '0') + "1GB"), 0);
  EXPECT_EQ(parse_bytes("000000000000000000001.5KiB"), 1536);
}

TEST(ParseDecimal, PlainDecimalsOnly) {
  EXPECT_EQ(parse_decimal("2.5"), 2.5);
  EXPECT_EQ(parse_decimal("-1"), -1.0);
  EXPECT_EQ(parse_decimal("1e-3"), 1e-3);
  EXPECT_EQ(parse_decimal(".5"), 0.5);
  EXPECT_EQ(parse_decimal("+3."), 3.0);
  for (const std::string bad : {"", "0x10", "0x1p-4", "inf", "nan", " 1", "1 ", "1e", "1e+", ".", "-", "1.5x", "1e999", "1,5"}) {
    EXPECT_FALSE(parse_decimal(bad).has_value()) << bad;
  }
}

TEST(ParseDecimalInteger, DigitsOnlyWithinInt64) {
  EXPECT_EQ(parse_decimal_integer("16"), 16);
  EXPECT_EQ(parse_decimal_integer("010"), 10);  // decimal, not octal
  EXPECT_EQ(parse_decimal_integer("9223372036854775807"), INT64_MAX);
  for (const std::string bad : {"", "0x10", "-1", "+1", "1K", " 8", "9223372036854775808", "99999999999999999999"}) {
    EXPECT_FALSE(parse_decimal_integer(bad).has_value()) << bad;
  }
}

TEST(FormatBytes, BinaryUnitsForPeople) {
  EXPECT_EQ(format_bytes(85899345920), "80.00 GiB");
  EXPECT_EQ(format_bytes(512), "512 B");
  EXPECT_EQ(format_bytes(int64_t{3} << 20), "3.0 MiB");
  EXPECT_EQ(format_bytes(int64_t{2} << 40), "2.00 TiB");
}

TEST(FormatTokens, ShortestExactSpelling) {
  EXPECT_EQ(format_tokens(1048576), "1M");
  EXPECT_EQ(format_tokens(32768), "32K");
  EXPECT_EQ(format_tokens(1000), "1000");
  EXPECT_EQ(format_tokens(int64_t{1} << 30), "1G");
}

}  // namespace
}  // namespace flatpeak
