// Reading JSON inputs with errors a user can act on.
//   nlohmann::json j = parse_json_text(text, "models/foo.json");  // InputError "file: 14:7: ..."
//   std::string text = read_text_file("plan.json");                // InputError when unreadable
#pragma once

#include <string>

#include <nlohmann/json.hpp>

namespace flatpeak {

// Reads a whole file; throws InputError naming the file when it cannot be read.
std::string read_text_file(const std::string& path);

// Parses JSON; a syntax error throws InputError with the file and "line:column".
nlohmann::json parse_json_text(const std::string& text, const std::string& file);

// JSON pointer for a key below a parent pointer: child_pointer("/a", "b") == "/a/b"
// (escapes "~" and "/" in the key as RFC 6901 requires).
std::string child_pointer(const std::string& parent, const std::string& key);

// Short printable form of a JSON value for messages: strings quoted, long values cut.
std::string describe_json_value(const nlohmann::json& value);

}  // namespace flatpeak
