// Malformed JSON names the line and column; did-you-mean suggests only near misses.
#include "spec/json_util.h"

#include <gtest/gtest.h>

#include "spec/errors.h"

namespace flatpeak {
namespace {

Diagnostic parse_failure(const std::string& text) {
  try {
    parse_json_text(text, "card.json");
  } catch (const InputError& e) {
    EXPECT_EQ(e.diagnostics().size(), 1u);
    return e.diagnostics().at(0);
  }
  ADD_FAILURE() << "expected a parse error for: " << text;
  return {};
}

TEST(ParseJsonText, LineAndColumnOfTheError) {
  const Diagnostic missing_comma = parse_failure("{\n  \"a\": 1\n  \"b\": 2\n}\n");
  EXPECT_EQ(missing_comma.file, "card.json");
  EXPECT_EQ(missing_comma.pointer, "3:3");  // the start of "b", the token the parser did not expect
  EXPECT_EQ(missing_comma.message.rfind("malformed JSON: syntax error", 0), 0u) << missing_comma.message;

  const Diagnostic truncated = parse_failure("{\"a\": [1, 2");
  EXPECT_EQ(truncated.pointer, "1:12");
}

// An empty file is most often the redirected stdout of a command that failed: it says so.
TEST(ParseJsonText, EmptyTextSaysItIsEmpty) {
  const Diagnostic empty = parse_failure("");
  EXPECT_EQ(empty.to_string(), "card.json: is empty: no JSON text");
  EXPECT_NE(empty.hint.find("may have failed"), std::string::npos) << empty.hint;
  EXPECT_EQ(parse_failure(" \n\t").message, "holds no JSON text (3 bytes of whitespace)");
}

// The column is the first character of the offending token, not the last one the parser read.
TEST(ParseJsonText, ColumnIsTheStartOfTheToken) {
  EXPECT_EQ(parse_failure("{\"a\": 1 \"long_key\": 2}").pointer, "1:9");
  EXPECT_EQ(parse_failure("{\"a\": 1,\n \"b\\\"q\" 2}").pointer, "2:9");  // after a string with an escaped quote
  EXPECT_EQ(parse_failure("{\"a\": 12345 6789}").pointer, "1:13");
  EXPECT_EQ(parse_failure("{\"a\": [1, 2,, 3]}").pointer, "1:13");  // a one-character token
}

// A document nested far deeper than any input of ours is refused as it is read (its value echoed
// in a message would otherwise overflow the stack).
TEST(ParseJsonText, DeepNestingIsAnInputError) {
  const std::string deep = "{\"name\": " + std::string(100000, '[') + std::string(100000, ']') + "}";
  EXPECT_EQ(parse_failure(deep).to_string(), "card.json: nests objects and arrays deeper than 256 levels");
  const std::string fine = std::string(200, '[') + std::string(200, ']');
  EXPECT_TRUE(parse_json_text(fine, "card.json").is_array());
}

// The parser keeps the last of two equal keys: a card with "hidden_size" twice was planned on the
// second, silently. Refused, with the pointer of the second (array indices counted).
TEST(ParseJsonText, KeyGivenTwiceInOneObjectIsAnInputError) {
  EXPECT_EQ(parse_failure("{\"hidden_size\": 1024, \"hidden_size\": 2048}").to_string(),
            "card.json: /hidden_size: is given twice in one object");
  EXPECT_EQ(parse_failure("{\"a\": [1, {\"b\": 2}, [3, {\"c\": 1, \"c\": 2}]]}").to_string(),
            "card.json: /a/2/1/c: is given twice in one object");
  EXPECT_EQ(parse_failure("{\"k\": [{\"q\": 1}, {\"q/~\": 2, \"z\": 1, \"q/~\": 3}]}").to_string(),
            "card.json: /k/1/q~1~0: is given twice in one object");
  // The same key in sibling objects, or in an object and its parent, is fine.
  EXPECT_NO_THROW(parse_json_text("{\"a\": {\"b\": 1}, \"c\": {\"b\": 1, \"a\": {\"a\": 2}}}", "card.json"));
}

TEST(ParseJsonText, NumberTooLargeForAnyType) {
  const Diagnostic overflow = parse_failure("{\"hidden_size\": 1E400}");
  EXPECT_EQ(overflow.to_string(), "card.json: malformed JSON: number overflow parsing '1E400'");
}

TEST(DescribeJsonValue, InvalidUtf8DoesNotThrow) {
  EXPECT_EQ(describe_json_value(nlohmann::json(std::string("a\xff"))), "\"a\xEF\xBF\xBD\"");
}

TEST(ParseJsonText, ValidDocument) {
  EXPECT_EQ(parse_json_text("{\"a\": [1, 2]}", "x.json")["a"][1], 2);
}

TEST(ReadTextFile, MissingFileNamesIt) {
  try {
    read_text_file("/nonexistent/flatpeak.json");
    FAIL();
  } catch (const InputError& e) {
    EXPECT_EQ(e.diagnostics()[0].to_string(), "/nonexistent/flatpeak.json: cannot open file for reading");
  }
}

TEST(ReadTextFile, FolderIsNamedAsOne) {
  try {
    read_text_file(FLATPEAK_TEST_DATA_DIR);
    FAIL();
  } catch (const InputError& e) {
    EXPECT_EQ(e.diagnostics()[0].to_string(), std::string(FLATPEAK_TEST_DATA_DIR) + ": is a folder, not a file");
  }
}

// An endless file (it hung verify PLAN and --imbalance file=PATH) ends at the size bound.
TEST(ReadTextFile, EndlessFileStopsAtTheBound) {
  try {
    read_text_file("/dev/zero");
    FAIL();
  } catch (const InputError& e) {
    EXPECT_EQ(e.diagnostics()[0].to_string(), "/dev/zero: is larger than 256 MiB, too large for an input file");
  }
}

TEST(ChildPointer, EscapesPerRfc6901) {
  EXPECT_EQ(child_pointer("", "a"), "/a");
  EXPECT_EQ(child_pointer("/x", "a/b~c"), "/x/a~1b~0c");
}

TEST(DidYouMean, NearMissesOnly) {
  const std::vector<std::string> keys = {"num_experts_per_tok", "n_routed_experts", "hidden_size"};
  EXPECT_EQ(did_you_mean("num_expert_per_tok", keys), "num_experts_per_tok");
  EXPECT_EQ(did_you_mean("hiden_size", keys), "hidden_size");
  EXPECT_EQ(did_you_mean("vocab_size", keys), "");
  EXPECT_EQ(did_you_mean("H100", {"A100-80GB", "H100-80GB", "H200"}), "H200");  // one edit beats containment
  EXPECT_EQ(did_you_mean("gpt-oss", {"gpt-oss-120b", "DeepSeek-V3"}), "gpt-oss-120b");
}

}  // namespace
}  // namespace flatpeak
