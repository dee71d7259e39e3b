// A cuBLAS handle bound to one stream, with its workspace set explicitly (cublasSetWorkspace)
// from the DeviceAllocator under Category::Workspace, so the tracked bytes include it and cuBLAS
// allocates nothing behind the allocator's back.
//   CublasContext blas(alloc, stream);            // 32 MiB workspace, the Hopper recommendation
//   gemm_cuda(blas, false, true, M, N, K, 1.0f, DType::BF16, x, K, DType::BF16, w, K, false, DType::BF16, y, N);
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "executor/cuda/device_allocator.h"
#include "executor/ops/dtype.h"

namespace flatpeak::cuda {

class CublasContext {
 public:
  static constexpr int64_t kDefaultWorkspaceBytes = int64_t{32} << 20;
  // cuBLAS (cublasSetWorkspace): a smaller workspace may fail routines with
  // CUBLAS_STATUS_ALLOC_FAILED, 16 KiB is enough to prevent that (4 MiB, 32 MiB on Hopper, is
  // what it recommends for speed); the pointer must be aligned to 256 bytes.
  static constexpr int64_t kMinWorkspaceBytes = int64_t{16} << 10;
  static constexpr int64_t kWorkspaceAlignmentBytes = 256;

  // std::invalid_argument for workspace_bytes < kMinWorkspaceBytes (0 included: a handle with a
  // user workspace never falls back to cuBLAS's own pool); BackendError when cuBLAS or the
  // allocation fails, or the block the pool returns is not 256-byte aligned.
  CublasContext(DeviceAllocator& allocator, cudaStream_t stream,
                int64_t workspace_bytes = kDefaultWorkspaceBytes);
  CublasContext(const CublasContext&) = delete;
  CublasContext& operator=(const CublasContext&) = delete;
  ~CublasContext();

  cublasHandle_t handle() const { return handle_; }
  cudaStream_t stream() const { return stream_; }
  DeviceAllocator& allocator() const { return *allocator_; }
  int64_t workspace_bytes() const { return workspace_.bytes(); }

 private:
  DeviceAllocator* allocator_;
  cudaStream_t stream_;
  cublasHandle_t handle_ = nullptr;
  DeviceBuffer workspace_;  // [workspace_bytes] cuBLAS scratch
};

// How F32 operands are multiplied. Exact: fp32 products (CUDA cores). Tf32: the operands rounded
// to TF32 (10-bit mantissa, rel 2^-11) on tensor cores, fp32 accumulation; bf16 values are exact
// in TF32, so only genuinely fp32 operands are rounded. BF16 operands ignore it.
enum class GemmMath { Exact, Tf32 };

// C = alpha · op(A) · op(B) + (accumulate ? C : 0) on the context's stream, row-major like
// gemm_cpu (same argument order): op(A) [M, K], op(B) [K, N], C [M, N]; a transposed operand is
// read as stored. Accumulation is fp32 (CUBLAS_COMPUTE_32F, or its TF32 form when asked), C
// rounded once. Storage: A and B both F32 or both BF16; C F32, or BF16 when A and B are BF16.
void gemm_cuda(const CublasContext& blas, bool trans_a, bool trans_b, int64_t M, int64_t N,
               int64_t K, float alpha, exec::DType a_dtype, const void* A, int64_t lda,
               exec::DType b_dtype, const void* B, int64_t ldb, bool accumulate,
               exec::DType c_dtype, void* C, int64_t ldc, GemmMath math = GemmMath::Exact);

}  // namespace flatpeak::cuda
