#include "executor/cuda/cublas_context.h"

#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>

#include "executor/cuda/cuda_check.h"

namespace flatpeak::cuda {
namespace {

cudaDataType_t cuda_type(exec::DType dtype) {
  if (dtype == exec::DType::F32) return CUDA_R_32F;
  if (dtype == exec::DType::BF16) return CUDA_R_16BF;
  throw std::invalid_argument(std::string("gemm_cuda: storage must be f32 or bf16 (got ") +
                              exec::dtype_name(dtype) + ")");
}

int to_int(int64_t value, const char* what) {
  if (value < 0 || value > std::numeric_limits<int>::max()) {
    throw std::invalid_argument(std::string("gemm_cuda: ") + what + " = " +
                                std::to_string(value) + " is outside 0..2^31-1");
  }
  return static_cast<int>(value);
}

}  // namespace

CublasContext::CublasContext(DeviceAllocator& allocator, cudaStream_t stream,
                             int64_t workspace_bytes)
    : allocator_(&allocator), stream_(stream) {
  if (workspace_bytes < kMinWorkspaceBytes) {
    throw std::invalid_argument("cuBLAS workspace_bytes must be >= " + std::to_string(kMinWorkspaceBytes) +
                                " (16 KiB; less may fail GEMMs with CUBLAS_STATUS_ALLOC_FAILED) (got " +
                                std::to_string(workspace_bytes) + ")");
  }
  FLATPEAK_CUBLAS_CHECK(cublasCreate(&handle_));
  try {
    // cublasSetStream resets the workspace to cuBLAS's own pool, so the stream comes first.
    FLATPEAK_CUBLAS_CHECK(cublasSetStream(handle_, stream_));
    workspace_ = DeviceBuffer(allocator, workspace_bytes, exec::Category::Workspace, stream_);
    // cublasSetWorkspace needs a 256-byte aligned pointer. The CUDA Programming Guide promises at
    // least 256 bytes for every address an allocation routine of the runtime or driver returns;
    // cudaMallocFromPoolAsync's own reference says nothing of it, so check rather than rely on it
    // (cuBLAS would answer only CUBLAS_STATUS_INVALID_VALUE).
    const auto address = reinterpret_cast<uintptr_t>(workspace_.raw());
    if (address % static_cast<uintptr_t>(kWorkspaceAlignmentBytes) != 0) {
      throw_backend_error("cudaMallocFromPoolAsync (the cuBLAS workspace)", __FILE__, __LINE__,
                          "misaligned workspace",
                          ("the pool returned address " + std::to_string(address) + ", not a multiple of " +
                           std::to_string(kWorkspaceAlignmentBytes) + " bytes as cublasSetWorkspace requires")
                              .c_str());
    }
    FLATPEAK_CUBLAS_CHECK(cublasSetWorkspace(handle_, workspace_.raw(),
                                             static_cast<size_t>(workspace_.bytes())));
    // Exact fp32 products for f32 operands, unless a call asks for TF32 through its compute type
    // (GemmMath::Tf32 selects CUBLAS_COMPUTE_32F_FAST_TF32, which holds whatever the math mode).
    FLATPEAK_CUBLAS_CHECK(cublasSetMathMode(handle_, CUBLAS_DEFAULT_MATH));
  } catch (...) {
    workspace_.reset();
    cublasDestroy(handle_);
    throw;
  }
}

CublasContext::~CublasContext() {
  // The workspace must outlive every queued GEMM: wait for the stream before releasing it.
  (void)cudaStreamSynchronize(stream_);
  (void)cublasDestroy(handle_);
  workspace_.reset();
}

void gemm_cuda(const CublasContext& blas, bool trans_a, bool trans_b, int64_t M, int64_t N,
               int64_t K, float alpha, exec::DType a_dtype, const void* A, int64_t lda,
               exec::DType b_dtype, const void* B, int64_t ldb, bool accumulate,
               exec::DType c_dtype, void* C, int64_t ldc, GemmMath math) {
  if (a_dtype != b_dtype) {
    throw std::invalid_argument("gemm_cuda: A and B must have the same storage (got " +
                                std::string(exec::dtype_name(a_dtype)) + " and " +
                                exec::dtype_name(b_dtype) + ")");
  }
  if (a_dtype == exec::DType::F32 && c_dtype == exec::DType::BF16) {
    throw std::invalid_argument("gemm_cuda: f32 operands need an f32 output");
  }
  if (M == 0 || N == 0) return;
  const float beta = accumulate ? 1.0f : 0.0f;
  // Row-major C [M, N] is column-major Cᵀ [N, M] = op(B)ᵀ · op(A)ᵀ: swap the operands. A row-
  // major operand stored untransposed is, read column-major, already the transpose we need.
  const cublasOperation_t op_b = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_a = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasComputeType_t compute = math == GemmMath::Tf32 && a_dtype == exec::DType::F32
                                          ? CUBLAS_COMPUTE_32F_FAST_TF32
                                          : CUBLAS_COMPUTE_32F;
  FLATPEAK_CUBLAS_CHECK(cublasGemmEx(
      blas.handle(), op_b, op_a, to_int(N, "N"), to_int(M, "M"), to_int(K, "K"), &alpha, B,
      cuda_type(b_dtype), to_int(ldb, "ldb"), A, cuda_type(a_dtype), to_int(lda, "lda"), &beta, C,
      cuda_type(c_dtype), to_int(ldc, "ldc"), compute, CUBLAS_GEMM_DEFAULT));
}

}  // namespace flatpeak::cuda
