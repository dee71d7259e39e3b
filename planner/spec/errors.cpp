#include "errors.h"

#include <algorithm>
#include <cctype>

namespace flatpeak {

namespace {
std::string join_messages(const std::vector<Diagnostic>& diagnostics) {
  std::string joined;
  for (const auto& d : diagnostics) {
    if (!joined.empty()) joined += '\n';
    joined += d.to_string();
  }
  return joined;
}

// Levenshtein distance, case-insensitive, on short identifiers.
size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t above = row[j];
      const bool same = std::tolower(static_cast<unsigned char>(a[i - 1])) ==
                        std::tolower(static_cast<unsigned char>(b[j - 1]));
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (same ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}
}  // namespace

std::string Diagnostic::to_string() const {
  std::string text;
  if (!file.empty()) text += file + ": ";
  if (!pointer.empty()) text += pointer + ": ";
  text += message;
  return text;
}

InputError::InputError(std::vector<Diagnostic> diagnostics)
    : std::runtime_error(join_messages(diagnostics)), diagnostics_(std::move(diagnostics)) {}

InputError::InputError(Diagnostic diagnostic)
    : InputError(std::vector<Diagnostic>{std::move(diagnostic)}) {}

void InputErrors::throw_if_any() const {
  if (!diagnostics_.empty()) throw InputError(diagnostics_);
}

std::string did_you_mean(const std::string& word, const std::vector<std::string>& candidates) {
  std::string best;
  size_t best_distance = std::string::npos;
  for (const auto& candidate : candidates) {
    const size_t distance = edit_distance(word, candidate);
    if (distance < best_distance) {
      best_distance = distance;
      best = candidate;
    }
  }
  // Suggest only near misses: at most a third of the word's length, and at least one edit allowed.
  const size_t allowed = std::max<size_t>(1, word.size() / 3);
  if (best_distance <= allowed) return best;
  // A candidate that contains the word (or the reverse) is also a near miss: "H100" vs "H100-80GB".
  for (const auto& candidate : candidates) {
    std::string lw = word, lc = candidate;
    std::transform(lw.begin(), lw.end(), lw.begin(), [](unsigned char c) { return std::tolower(c); });
    std::transform(lc.begin(), lc.end(), lc.begin(), [](unsigned char c) { return std::tolower(c); });
    if (lw.size() >= 3 && (lc.find(lw) != std::string::npos || lw.find(lc) != std::string::npos)) {
      return candidate;
    }
  }
  return "";
}

}  // namespace flatpeak
