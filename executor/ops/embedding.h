// Token embedding lookup and its gradient.
//   EmbeddingArgs a; a.dtype = DType::BF16; a.token_ids = ids; a.table = wte; a.out = x;
//   a.tokens = T; a.vocab = V; a.hidden = H;  embedding_forward_cpu(a);   // x [T, H] =
//   a.d_out = dx; a.d_table = d_wte;  embedding_backward_cpu(a);          // d_wte [V, H] +=
#pragma once

#include <cstdint>

#include "executor/ops/dtype.h"

namespace flatpeak::exec {

struct EmbeddingArgs {
  DType dtype = DType::F32;          // storage of table, out, d_out, d_table (f32 or bf16)
  const int32_t* token_ids = nullptr;  // [T] each in 0..V-1
  const void* table = nullptr;       // [V, H]
  void* out = nullptr;               // [T, H] forward output (overwritten)
  const void* d_out = nullptr;       // [T, H] backward input
  void* d_table = nullptr;           // [V, H] accumulated (+=), tokens added in order 0..T-1
  int64_t tokens = 0;
  int64_t vocab = 0;
  int64_t hidden = 0;
};

void embedding_forward_cpu(const EmbeddingArgs& args);
void embedding_backward_cpu(const EmbeddingArgs& args);

}  // namespace flatpeak::exec
