// CUDA twin of the blocked cross-entropy (executor/cpu/cross_entropy_cpu.cpp): per token block,
// each [T_blk, V_blk] fp32 logits block comes from cuBLAS and is folded into the running
// (max, sum) with the shared lse_fold; the backward recomputes it from the saved lse and turns it
// into dz with the shared cross_entropy_dlogit, rounded into the compute-dtype dlogits block as on
// the CPU. The same order of blocks and the same workspace as on the CPU. The kernels' source is
// in cross_entropy_kernels.cuh; this file holds the checks and the GEMMs; the launch sequences are
// the header's.
#include <algorithm>

#include "executor/cpu/op_util.h"
#include "executor/cuda/cross_entropy_blocks_cuda.h"
#include "executor/cuda/cross_entropy_kernels.cuh"
#include "executor/cuda/cuda_check.h"
#include "executor/cuda/kernel_util.cuh"
#include "executor/cuda/ops_cuda.h"

namespace flatpeak::exec {
namespace {


// Workspace: the CPU's layout (cross_entropy_cpu.cpp): fp32 logits block [T_blk, V_blk], fp32
// running max, running sum, target logit [T_blk] each, fp32 dX accumulator [T_blk, H], then the
// dlogits block [T_blk, V_blk] in the compute dtype. dz is rounded once into that block and is the
// operand of the dX and dW GEMMs (bf16 × bf16 with fp32 accumulation, as on the CPU), so the two
// backends hold the same bytes and the planner's vocab terms describe both.
struct Workspace {
  float* logits;
  float* row_max;
  float* row_sum;
  float* target_logit;
  float* dx_acc;
  void* dlogits;
};

// The backward alone keeps no row state (it reads the saved lse): its dX accumulator follows the
// logits block (blocked_cross_entropy_backward_workspace_bytes).
Workspace carve(const CrossEntropyArgs& a, bool backward_only) {
  const int64_t tb = a.token_block_rows;
  float* p = a.workspace;
  Workspace ws{};
  ws.logits = p;
  p += tb * a.vocab_block_rows;
  if (!backward_only) {
    ws.row_max = p;
    ws.row_sum = p + tb;
    ws.target_logit = p + 2 * tb;
    p += 3 * tb;  // the forward uses only what comes before this point
  }
  ws.dx_acc = p;
  ws.dlogits = p + tb * a.hidden;
  return ws;
}

const void* offset_rows(const void* base, int64_t row, int64_t hidden, DType dtype) {
  return static_cast<const unsigned char*>(base) + row * hidden * dtype_bytes(dtype);
}

// The head bias of vocab rows v0.. over [rows, vb] of `out` (the logits GEMM then adds into it).
template <class To>
void broadcast_bias(const void* bias, DType dtype, int64_t v0, int64_t rows, int64_t vb, To* out, cudaStream_t stream) {
  if (bias == nullptr) return;
  dispatch_compute(dtype, "cross_entropy", [&](auto tag) {
    using T = decltype(tag);
    cuda_detail::launch_broadcast_bias(static_cast<const T*>(bias) + v0, out, rows, vb, stream);
  });
}

void forward_block(const CrossEntropyArgs& a, const Workspace& ws, const cuda::CublasContext& blas,
                   int64_t t0, int64_t tb) {
  cuda_detail::blocked_forward_block(
      ws.logits, ws.row_max, ws.row_sum, ws.target_logit, a.targets + t0, a.lse + t0, a.loss + t0,
      tb, a.vocab, a.vocab_block_rows, blas.stream(), [&](int64_t v0, int64_t vb) {
        broadcast_bias(a.bias, a.dtype, v0, tb, vb, ws.logits, blas.stream());
        cuda::gemm_cuda(blas, false, true, tb, vb, a.hidden, 1.0f, a.dtype,
                        offset_rows(a.x, t0, a.hidden, a.dtype), a.hidden, a.dtype,
                        offset_rows(a.w, v0, a.hidden, a.dtype), a.hidden, a.bias != nullptr, DType::F32,
                        ws.logits, vb);
      });
}

// logits_ready: the workspace still holds this token block's logits (the fused pass when one
// vocab block covers V), so the logits GEMM is not run again.
void backward_block(const CrossEntropyArgs& a, const Workspace& ws, const cuda::CublasContext& blas,
                    int64_t t0, int64_t tb, bool logits_ready) {
  cudaStream_t stream = blas.stream();
  const int64_t H = a.hidden;
  FLATPEAK_CUDA_CHECK(cudaMemsetAsync(ws.dx_acc, 0, static_cast<size_t>(tb * H) * 4, stream));
  const void* x_blk = offset_rows(a.x, t0, H, a.dtype);
  auto logits_gemm = [&](int64_t v0, int64_t vb) {
    if (logits_ready) return;
    broadcast_bias(a.bias, a.dtype, v0, tb, vb, ws.logits, stream);
    cuda::gemm_cuda(blas, false, true, tb, vb, H, 1.0f, a.dtype, x_blk, H, a.dtype,
                    offset_rows(a.w, v0, H, a.dtype), H, a.bias != nullptr, DType::F32, ws.logits, vb);
  };
  // dX_blk += dz · W_blk;  dW_blk += dzᵀ · X_blk  (compute-dtype operands, fp32 accumulators)
  auto grad_gemms = [&](int64_t v0, int64_t vb) {
    const void* w_blk = offset_rows(a.w, v0, H, a.dtype);
    cuda::gemm_cuda(blas, false, false, tb, H, vb, 1.0f, a.dtype, ws.dlogits, vb, a.dtype, w_blk,
                    H, true, DType::F32, ws.dx_acc, H);
    cuda::gemm_cuda(blas, true, false, vb, H, tb, 1.0f, a.dtype, ws.dlogits, vb, a.dtype, x_blk,
                    H, true, DType::F32, a.d_w + v0 * H, H);
    if (a.d_bias != nullptr)  // d bias += Σ_r dz (fp32)
      dispatch_compute(a.dtype, "cross_entropy", [&](auto tag) {
        using T = decltype(tag);
        cuda_detail::launch_bias_grad(static_cast<const T*>(ws.dlogits), tb, vb, a.d_bias + v0, true, stream);
      });
  };
  dispatch_compute(a.dtype, "cross_entropy", [&](auto tag) {
    using T = decltype(tag);
    cuda_detail::blocked_backward_block(ws.logits, static_cast<T*>(ws.dlogits), ws.dx_acc,
                                        static_cast<T*>(a.d_x) + t0 * H, a.targets + t0,
                                        a.lse + t0, a.grad_scale, tb, H, a.vocab,
                                        a.vocab_block_rows, stream, logits_gemm, grad_gemms);
  });
}

enum class Pass { Forward, Backward, Fused };

void run(const CrossEntropyArgs& a, const cuda::CublasContext& blas, Pass pass) {
  require(a.tokens >= 0 && a.vocab > 0 && a.hidden > 0, "cross_entropy",
          "need tokens >= 0 and vocab, hidden > 0");
  require(a.token_block_rows > 0 && a.vocab_block_rows > 0, "cross_entropy",
          "block sizes must be > 0");
  require(a.token_block_rows <= 0x7fffffff, "cross_entropy", "token_block_rows must be < 2^31");
  require(a.x && a.w && a.targets && a.lse && a.loss && a.workspace, "cross_entropy",
          "needs x, w, targets, lse, loss and a workspace");
  if (pass != Pass::Forward) {
    require(a.d_x && a.d_w, "cross_entropy", "backward needs d_x and d_w");
    require(!a.bias || a.d_bias, "cross_entropy", "backward with a bias needs d_bias");
  }
  dispatch_compute(a.dtype, "cross_entropy", [](auto) {});
  const Workspace ws = carve(a, pass == Pass::Backward);
  // Fused with one vocab block: the backward reads the logits the forward left (3 GEMMs a block,
  // as the materialised loss, instead of 4), as the CPU op does.
  const bool reuse_logits = pass == Pass::Fused && a.vocab_block_rows >= a.vocab;
  for (int64_t t0 = 0; t0 < a.tokens; t0 += a.token_block_rows) {
    const int64_t tb = std::min(a.token_block_rows, a.tokens - t0);
    if (pass != Pass::Backward) forward_block(a, ws, blas, t0, tb);
    if (pass != Pass::Forward) backward_block(a, ws, blas, t0, tb, reuse_logits);
  }
}

// ---- materialised (the naive baseline) ----

void check_materialized(const MaterializedCrossEntropyArgs& a) {
  require(a.tokens >= 0 && a.vocab > 0 && a.hidden > 0, "cross_entropy",
          "need tokens >= 0 and vocab, hidden > 0");
  require(a.tokens <= 0x7fffffff, "cross_entropy", "materialised tokens must be < 2^31");
  require(a.x && a.w && a.targets && a.logits && a.log_probs && a.lse && a.loss, "cross_entropy",
          "materialised needs x, w, targets, logits, log_probs, lse and loss");
  dispatch_compute(a.dtype, "cross_entropy", [](auto) {});
}

}  // namespace

void materialized_cross_entropy_forward_cuda(const MaterializedCrossEntropyArgs& a,
                                             const cuda::CublasContext& blas) {
  check_materialized(a);
  if (a.tokens == 0) return;
  dispatch_compute(a.dtype, "cross_entropy", [&](auto tag) {
    using T = decltype(tag);
    broadcast_bias(a.bias, a.dtype, 0, a.tokens, a.vocab, static_cast<T*>(a.logits), blas.stream());
  });
  cuda::gemm_cuda(blas, false, true, a.tokens, a.vocab, a.hidden, 1.0f, a.dtype, a.x, a.hidden,
                  a.dtype, a.w, a.hidden, a.bias != nullptr, a.dtype, a.logits, a.vocab);
  dispatch_compute(a.dtype, "cross_entropy", [&](auto tag) {
    using T = decltype(tag);
    cuda_detail::materialized_log_softmax(static_cast<const T*>(a.logits), a.log_probs, a.targets,
                                          a.lse, a.loss, a.tokens, a.vocab, blas.stream());
  });
}

void materialized_cross_entropy_backward_cuda(const MaterializedCrossEntropyArgs& a,
                                              const cuda::CublasContext& blas) {
  check_materialized(a);
  require(a.d_logits && a.d_x && a.d_w, "cross_entropy",
          "materialised backward needs d_logits, d_x and d_w");
  require(!a.bias || a.d_bias, "cross_entropy", "materialised backward with a bias needs d_bias");
  const int64_t T = a.tokens, V = a.vocab, H = a.hidden;
  if (T == 0) return;
  dispatch_compute(a.dtype, "cross_entropy", [&](auto tag) {
    using Tc = decltype(tag);
    cuda_detail::materialized_dlogits(a.log_probs, a.d_logits, static_cast<Tc*>(a.logits),
                                      a.targets, T, V, a.grad_scale, blas.stream());
  });
  // dX = dz · W (over all V), dW = dzᵀ · X (one GEMM over all T), both written in the compute dtype.
  cuda::gemm_cuda(blas, false, false, T, H, V, 1.0f, a.dtype, a.logits, V, a.dtype, a.w, H, false,
                  a.dtype, a.d_x, H);
  cuda::gemm_cuda(blas, true, false, V, H, T, 1.0f, a.dtype, a.logits, V, a.dtype, a.x, H, false,
                  a.dtype, a.d_w, H);
  // d bias = Σ_t d_logits in fp32 (the CPU sums the same fp32 values), written in the compute dtype.
  dispatch_compute(a.dtype, "cross_entropy", [&](auto tag) {
    using Tc = decltype(tag);
    cuda_detail::launch_bias_grad(a.d_logits, T, V, static_cast<Tc*>(a.d_bias), false, blas.stream());
  });
}

namespace cuda_detail {

namespace {
// One CUDA block per row: rows must fit the grid's x dimension.
void check_block_rows(int64_t rows) {
  require(rows >= 0 && rows <= 0x7fffffff, "cross_entropy", "a logits block has at most 2^31 - 1 rows");
}
}  // namespace

void init_online_rows_cuda(float* row_max, float* row_sum, float* target_logit, int64_t rows, cudaStream_t stream) {
  if (rows <= 0) return;
  launch_init_rows(row_max, row_sum, target_logit, rows, stream);
}

void fold_logits_block_cuda(const float* logits, int64_t rows, int64_t cols, int64_t first_col, const int32_t* targets,
                            float* row_max, float* row_sum, float* target_logit, cudaStream_t stream) {
  check_block_rows(rows);
  if (rows == 0 || cols <= 0) return;
  launch_fold_block(logits, rows, cols, first_col, targets, row_max, row_sum, target_logit, stream);
}

void finish_online_rows_cuda(const float* row_max, const float* row_sum, const float* target_logit, const int32_t* targets,
                             float* lse, float* loss, int64_t rows, cudaStream_t stream) {
  if (rows <= 0) return;
  launch_finish_rows(row_max, row_sum, target_logit, targets, lse, loss, rows, stream);
}

void dlogits_block_bf16_cuda(const float* logits, Bf16* dz, int64_t rows, int64_t cols, int64_t first_col,
                             const int32_t* targets, const float* lse, float grad_scale, cudaStream_t stream) {
  check_block_rows(rows);
  if (rows == 0 || cols <= 0) return;
  launch_dlogits(logits, dz, rows, cols, first_col, targets, lse, grad_scale, stream);
}

}  // namespace cuda_detail

int64_t blocked_cross_entropy_workspace_bytes_cuda(const CrossEntropyArgs& a) {
  return blocked_cross_entropy_workspace_bytes(a);  // the CPU's layout, byte for byte
}

void blocked_cross_entropy_forward_cuda(const CrossEntropyArgs& a, const cuda::CublasContext& blas) {
  run(a, blas, Pass::Forward);
}
void blocked_cross_entropy_backward_cuda(const CrossEntropyArgs& a, const cuda::CublasContext& blas) {
  run(a, blas, Pass::Backward);
}
void blocked_cross_entropy_fused_cuda(const CrossEntropyArgs& a, const cuda::CublasContext& blas) {
  run(a, blas, Pass::Fused);
}

}  // namespace flatpeak::exec
