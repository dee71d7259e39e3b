#include "json_util.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "errors.h"

namespace flatpeak {

namespace {
// The largest input file read; cards, configs, plans and routing files are far smaller.
constexpr size_t kMaxTextFileBytes = size_t{256} << 20;
}  // namespace

std::string read_text_file(const std::string& path) {
  std::error_code ignored;
  if (std::filesystem::is_directory(path, ignored))
    throw InputError(Diagnostic{path, "", "is a folder, not a file", ""});
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InputError(Diagnostic{path, "", "cannot open file for reading", ""});
  // Read in pieces up to a bound, so that an endless source such as /dev/zero ends in an error
  // instead of a hang that exhausts memory (a pipe still works: it is read to its end).
  std::string text;
  char piece[65536];
  while (in.read(piece, sizeof piece) || in.gcount() > 0) {
    text.append(piece, static_cast<size_t>(in.gcount()));
    if (text.size() > kMaxTextFileBytes)
      throw InputError(Diagnostic{path, "", fmt::format("is larger than {} MiB, too large for an input file", kMaxTextFileBytes >> 20), ""});
  }
  if (in.bad()) throw InputError(Diagnostic{path, "", "error while reading file", ""});
  return text;
}

namespace {

bool json_delimiter(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '{' || c == '}' || c == '[' || c == ']' || c == ',' || c == ':';
}

// The start of the JSON token that holds byte `at`, found by lexing from the start of the text
// (a string with its escapes, a number or literal up to the next delimiter, or one punctuation
// character); `at` itself when it lies in whitespace or past the text.
size_t token_start(const std::string& text, size_t at) {
  size_t i = 0;
  while (i < text.size() && i <= at) {
    const char c = text[i];
    if (c == ' ' || c == '\t' || c == '\n' || c == '\r') {
      ++i;
      continue;
    }
    size_t end = i + 1;
    if (c == '"') {
      while (end < text.size() && text[end] != '"') end += text[end] == '\\' ? size_t{2} : size_t{1};
      end = std::min(end + 1, text.size());  // past the closing quote
    } else if (!json_delimiter(c)) {
      while (end < text.size() && !json_delimiter(text[end]) && text[end] != '"') ++end;
    }
    if (at < end) return i;
    i = end;
  }
  return at;
}

}  // namespace

nlohmann::json parse_json_text(const std::string& text, const std::string& file) {
  // An empty file is most often the stdout of a command that failed (its error went to stderr):
  // say so, instead of a parse error at 1:1.
  if (text.find_first_not_of(" \t\r\n") == std::string::npos)
    throw InputError(Diagnostic{file, "", text.empty() ? std::string("is empty: no JSON text") : fmt::format("holds no JSON text ({} bytes of whitespace)", text.size()),
                                "a command whose stdout was redirected here may have failed: see its error output"});
  // No input of ours nests deeper than a few levels; a deeper document (thousands of levels) would
  // overflow the stack where a message echoes its value (dump is recursive). Refused as it is read.
  constexpr int kMaxDepth = 256;
  // A key given twice in one object is refused too: the parser keeps the last silently, so a card
  // with "num_experts" twice would be planned on whichever came last. The frames track the
  // pointer of the object being read, for the message.
  struct Frame {
    bool array = false;
    int64_t index = 0;           // the element being read, in an array
    std::string key;             // the member being read, in an object
    std::set<std::string> keys;  // the members seen, in an object
  };
  std::vector<Frame> frames;
  const auto pointer_of = [&](size_t frame_count) {
    std::string out;
    for (size_t i = 0; i < frame_count; ++i)
      out = frames[i].array ? out + "/" + std::to_string(frames[i].index) : child_pointer(out, frames[i].key);
    return out;
  };
  using Event = nlohmann::json::parse_event_t;
  const auto check = [&](int depth, Event event, nlohmann::json& parsed) {
    if (depth > kMaxDepth && (event == Event::object_start || event == Event::array_start))
      throw InputError(Diagnostic{file, "", fmt::format("nests objects and arrays deeper than {} levels", kMaxDepth), ""});
    const auto element_done = [&] {
      if (!frames.empty() && frames.back().array) ++frames.back().index;
    };
    switch (event) {
      case Event::object_start:
      case Event::array_start:
        frames.push_back(Frame{event == Event::array_start, 0, "", {}});
        break;
      case Event::key: {
        Frame& f = frames.back();
        f.key = parsed.get<std::string>();
        if (!f.keys.insert(f.key).second)
          throw InputError(Diagnostic{file, pointer_of(frames.size()), "is given twice in one object", "keep one of them"});
        break;
      }
      case Event::object_end:
      case Event::array_end:
        frames.pop_back();
        element_done();
        break;
      case Event::value:
        element_done();
        break;
    }
    return true;
  };
  try {
    return nlohmann::json::parse(text, check);
  } catch (const nlohmann::json::parse_error& e) {
    // e.byte is 1-based and points at the last character the parser read, the end of the
    // offending token; the position reported is that token's first character, as line:column.
    const size_t last = std::min(e.byte == 0 ? size_t{0} : e.byte - 1, text.size());
    const size_t end = token_start(text, last);
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
    // keep the description from "syntax error" on.
    const std::string what = e.what();
    const size_t cut = what.find("syntax error");
    const std::string description = cut == std::string::npos ? what : what.substr(cut);
    throw InputError(Diagnostic{file, fmt::format("{}:{}", line, column), "malformed JSON: " + description, ""});
  } catch (const nlohmann::json::out_of_range& e) {
    // A number too large for any JSON number type ("1E400"): the text is valid JSON syntax, but
    // no value can hold it; nlohmann reports no position for it.
    const std::string what = e.what();
    const size_t cut = what.find("] ");
    throw InputError(Diagnostic{file, "", "malformed JSON: " + (cut == std::string::npos ? what : what.substr(cut + 2)), ""});
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
  // "replace" keeps invalid UTF-8 in strings built in code from throwing while we describe them.
  std::string text = value.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  if (text.size() > 60) text = text.substr(0, 57) + "...";
  return text;
}

}  // namespace flatpeak
