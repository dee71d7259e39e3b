#include "json_util.h"

#include <fstream>
#include <sstream>

#include <fmt/format.h>

#include "errors.h"

namespace flatpeak {

std::string read_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InputError(Diagnostic{path, "", "cannot open file for reading", ""});
  std::ostringstream buffer;
  buffer << in.rdbuf();
  if (in.bad()) throw InputError(Diagnostic{path, "", "error while reading file", ""});
  return buffer.str();
}

nlohmann::json parse_json_text(const std::string& text, const std::string& file) {
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::parse_error& e) {
    // e.byte is 1-based and points one past the offending character; turn it into line:column.
    const size_t end = std::min(e.byte == 0 ? size_t{0} : e.byte - 1, text.size());
    size_t line = 1, column = 1;
    for (size_t i = 0; i < end; ++i) {
      if (text[i] == '\n') {
        ++line;
        column = 1;
      } else {
        ++column;
      }
    }
    // nlohmann's message starts with "[json.exception.parse_error.101] parse error at line ...: ";
    // keep only the description after the last ": " prefix it adds.
    std::string what = e.what();
    const size_t cut = what.find("syntax error");
    std::string description = cut == std::string::npos ? what : what.substr(cut);
    throw InputError(Diagnostic{file, fmt::format("{}:{}", line, column), "malformed JSON: " + description, ""});
  }
}

std::string child_pointer(const std::string& parent, const std::string& key) {
  std::string escaped;
  for (char c : key) {
    if (c == '~') {
      escaped += "~0";
    } else if (c == '/') {
      escaped += "~1";
    } else {
      escaped += c;
    }
  }
  return parent + "/" + escaped;
}

std::string describe_json_value(const nlohmann::json& value) {
  std::string text = value.dump();
  if (text.size() > 60) text = text.substr(0, 57) + "...";
  return text;
}

}  // namespace flatpeak
