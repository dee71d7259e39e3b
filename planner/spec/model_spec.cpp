#include "model_spec.h"

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

}  // namespace flatpeak
