#include "model_spec.h"

#include <algorithm>
#include <numeric>

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
  if (window == AttentionWindow::Full || window_tokens <= 0 || T <= 0 || cp <= 1) return {};
  int64_t reach = 0;
  if (window == AttentionWindow::Sliding) {
    reach = std::min(window_tokens - 1, (cp - 1) * T);
  } else {
    // r·T mod C over r = 1 .. cp − 1 runs through the multiples of g = gcd(T, C) below C with
    // period C / g: all of them (the largest C − g) once cp − 1 reaches it.
    const int64_t C = window_tokens;
    const int64_t g = std::gcd(T, C);
    if (cp - 1 >= C / g) {
      reach = C - g;
    } else {
      for (int64_t r = 1; r < cp; ++r) reach = std::max(reach, (r % C) * (T % C) % C);
    }
  }
  if (reach > T) return {};
  return {false, reach};
}

}  // namespace flatpeak
