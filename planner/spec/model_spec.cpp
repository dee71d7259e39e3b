#include "model_spec.h"

#include <algorithm>

namespace flatpeak {

const char* to_string(AttentionKind kind) { return kind == AttentionKind::Mla ? "mla" : "gqa"; }

const char* to_string(FfnKind kind) { return kind == FfnKind::Moe ? "moe" : "dense"; }

const char* to_string(QkNorm kind) {
  switch (kind) {
    case QkNorm::PerHead: return "per_head";
    case QkNorm::FullProjection: return "full_projection";
    case QkNorm::None: break;
  }
  return "none";
}

const char* to_string(AttentionWindow kind) {
  switch (kind) {
    case AttentionWindow::Sliding: return "sliding";
    case AttentionWindow::Chunked: return "chunked";
    case AttentionWindow::Full: break;
  }
  return "full";
}

CpKeyReach cp_key_reach(AttentionWindow window, int64_t window_tokens, int64_t tokens_per_rank, int64_t cp) {
  const int64_t T = tokens_per_rank;
  if (window == AttentionWindow::Full || window_tokens <= 0 || window_tokens > T) return {};
  if (window == AttentionWindow::Sliding) return {false, window_tokens};
  // Chunks of C <= T: rank r's first query starts r*T mod C tokens into its chunk. The remainders
  // repeat with period C / gcd(T, C) <= C, so at most C ranks need looking at.
  int64_t halo = 0;
  for (int64_t r = 1; r < std::min(cp, window_tokens + 1); ++r) halo = std::max(halo, (r % window_tokens) * (T % window_tokens) % window_tokens);
  return {false, halo};
}

}  // namespace flatpeak
