// The CPU backend's one GEMM: fp32 accumulation over bf16 or fp32 storage, Eigen on 64-blocks.
//   // C[M,N] = alpha * A[M,K] · B[N,K]^T  (+ C when accumulate)
//   gemm_cpu(false, true, M, N, K, 1.0f, a, K, b, K, /*accumulate=*/false, c, N);
//   Operands are row-major; a transposed operand is read as stored ([K,M] for A, [N,K] for B).
#pragma once

#include <cstdint>

#include "executor/ops/dtype.h"

namespace flatpeak::exec {

// C = alpha * op(A) · op(B) + (accumulate ? C : 0), op(A) [M, K], op(B) [K, N], C [M, N].
// Storage: TA, TB, TC each float or Bf16. Every output element is accumulated in fp32 over K in
// 64-wide blocks in increasing k, then added to C once (rounded once when TC is Bf16), so the
// result is deterministic and independent of how callers tile M and N. Uses ~48 KiB of stack
// and no heap.
template <class TA, class TB, class TC>
void gemm_cpu(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
              const TA* A, int64_t lda, const TB* B, int64_t ldb, bool accumulate, TC* C,
              int64_t ldc);

}  // namespace flatpeak::exec
