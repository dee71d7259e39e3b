#include "executor/cpu/gemm_cpu.h"

#include <Eigen/Core>
#include <algorithm>

namespace flatpeak::exec {
namespace {

constexpr int64_t kBlock = 64;
using Panel = Eigen::Matrix<float, kBlock, kBlock, Eigen::RowMajor>;

// Copies the [rows, cols] block of op(X) at (r0, c0) into an fp32 panel.
template <class T>
void load_panel(const T* X, int64_t ldx, bool trans, int64_t r0, int64_t c0, int64_t rows,
                int64_t cols, Panel& panel) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t i = r0 + r;
      const int64_t j = c0 + c;
      panel(r, c) = to_f32(trans ? X[j * ldx + i] : X[i * ldx + j]);
    }
  }
}

}  // namespace

template <class TA, class TB, class TC>
void gemm_cpu(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
              const TA* A, int64_t lda, const TB* B, int64_t ldb, bool accumulate, TC* C,
              int64_t ldc) {
  Panel a_panel;
  Panel b_panel;
  Panel c_panel;
  for (int64_t i0 = 0; i0 < M; i0 += kBlock) {
    const int64_t mb = std::min(kBlock, M - i0);
    for (int64_t j0 = 0; j0 < N; j0 += kBlock) {
      const int64_t nb = std::min(kBlock, N - j0);
      c_panel.setZero();
      for (int64_t k0 = 0; k0 < K; k0 += kBlock) {
        const int64_t kb = std::min(kBlock, K - k0);
        // Zero-padded full panels keep Eigen on one fixed-size code path: the padding adds
        // exact zeros, so the sum over k is the same as over the unpadded block.
        if (mb < kBlock || kb < kBlock) a_panel.setZero();
        if (kb < kBlock || nb < kBlock) b_panel.setZero();
        load_panel(A, lda, trans_a, i0, k0, mb, kb, a_panel);
        load_panel(B, ldb, trans_b, k0, j0, kb, nb, b_panel);
        c_panel.noalias() += a_panel * b_panel;
      }
      for (int64_t r = 0; r < mb; ++r) {
        TC* row = C + (i0 + r) * ldc + j0;
        for (int64_t c = 0; c < nb; ++c) {
          const float prior = accumulate ? to_f32(row[c]) : 0.0f;
          store_f32(&row[c], prior + alpha * c_panel(r, c));
        }
      }
    }
  }
}

#define FLATPEAK_GEMM_INSTANTIATE(TA, TB, TC)                                                \
  template void gemm_cpu<TA, TB, TC>(bool, bool, int64_t, int64_t, int64_t, float, const TA*, \
                                     int64_t, const TB*, int64_t, bool, TC*, int64_t);
FLATPEAK_GEMM_INSTANTIATE(float, float, float)
FLATPEAK_GEMM_INSTANTIATE(Bf16, Bf16, float)
FLATPEAK_GEMM_INSTANTIATE(Bf16, Bf16, Bf16)
FLATPEAK_GEMM_INSTANTIATE(float, Bf16, float)
FLATPEAK_GEMM_INSTANTIATE(float, Bf16, Bf16)
FLATPEAK_GEMM_INSTANTIATE(Bf16, float, float)
FLATPEAK_GEMM_INSTANTIATE(Bf16, float, Bf16)
FLATPEAK_GEMM_INSTANTIATE(float, float, Bf16)
#undef FLATPEAK_GEMM_INSTANTIATE

}  // namespace flatpeak::exec
