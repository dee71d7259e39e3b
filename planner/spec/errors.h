// Input errors carried up from the libraries to the CLI, which alone maps them to exit codes.
//   InputErrors errs;  errs.add({file, "/num_experts_per_tok", "must be in 1..8", "9"});
//   errs.throw_if_any();   // throws InputError listing every problem found in one pass
#pragma once

#include <stdexcept>
#include <string>
#include <vector>

namespace flatpeak {

// One problem in one input: where (file and JSON pointer), which rule, and what was found.
struct Diagnostic {
  std::string file;     // path as the user gave it; may be empty for command-line values
  std::string pointer;  // JSON pointer ("/moe/top_k"), "line:col" for parse errors, or a --flag
  std::string message;  // the rule and the value, e.g. "must be in 1..8 (got 9)"
  std::string hint;     // optional: a did-you-mean or a fix; empty when none

  // "file: /pointer: message" (parts that are empty are left out).
  std::string to_string() const;
};

// Thrown for bad input of any kind (exit code 2). Holds every diagnostic found.
class InputError : public std::runtime_error {
 public:
  explicit InputError(std::vector<Diagnostic> diagnostics);
  explicit InputError(Diagnostic diagnostic);
  const std::vector<Diagnostic>& diagnostics() const { return diagnostics_; }

 private:
  std::vector<Diagnostic> diagnostics_;
};

// Collects diagnostics during validation so that a whole input is checked in one pass.
class InputErrors {
 public:
  void add(Diagnostic diagnostic) { diagnostics_.push_back(std::move(diagnostic)); }
  bool empty() const { return diagnostics_.empty(); }
  size_t size() const { return diagnostics_.size(); }
  void throw_if_any() const;
  const std::vector<Diagnostic>& diagnostics() const { return diagnostics_; }

 private:
  std::vector<Diagnostic> diagnostics_;
};

// The candidate closest to `word` by edit distance, or "" when none is close enough to suggest.
std::string did_you_mean(const std::string& word, const std::vector<std::string>& candidates);

}  // namespace flatpeak
