#include <string>

#include "executor/cpu/op_util.h"
#include "executor/ops/embedding.h"

namespace flatpeak::exec {
namespace {

void check(const EmbeddingArgs& a) {
  require(a.tokens >= 0 && a.vocab > 0 && a.hidden > 0, "embedding",
          "tokens must be >= 0, vocab and hidden > 0");
  require(a.token_ids != nullptr || a.tokens == 0, "embedding", "token_ids is null");
  for (int64_t t = 0; t < a.tokens; ++t) {
    const int64_t id = a.token_ids[t];
    if (id < 0 || id >= a.vocab) {
      fail("embedding", "token_ids[" + std::to_string(t) + "] = " + std::to_string(id) +
                        " not in 0.." + std::to_string(a.vocab - 1));
    }
  }
}

}  // namespace

void embedding_forward_cpu(const EmbeddingArgs& a) {
  check(a);
  require(a.table && a.out, "embedding", "forward needs table and out");
  dispatch_compute(a.dtype, "embedding", [&](auto tag) {
    using T = decltype(tag);
    const T* table = static_cast<const T*>(a.table);
    T* out = static_cast<T*>(a.out);
    for (int64_t t = 0; t < a.tokens; ++t) {
      const T* row = table + a.token_ids[t] * a.hidden;
      for (int64_t h = 0; h < a.hidden; ++h) out[t * a.hidden + h] = row[h];
    }
  });
}

void embedding_backward_cpu(const EmbeddingArgs& a) {
  check(a);
  require(a.d_out && a.d_table, "embedding", "backward needs d_out and d_table");
  dispatch_compute(a.dtype, "embedding", [&](auto tag) {
    using T = decltype(tag);
    const T* d_out = static_cast<const T*>(a.d_out);
    T* d_table = static_cast<T*>(a.d_table);
    for (int64_t t = 0; t < a.tokens; ++t) {
      T* row = d_table + a.token_ids[t] * a.hidden;
      for (int64_t h = 0; h < a.hidden; ++h) {
        store_f32(&row[h], to_f32(row[h]) + to_f32(d_out[t * a.hidden + h]));
      }
    }
  });
}

}  // namespace flatpeak::exec
