// Tensor-core (WMMA, bf16 operands, fp32 accumulation) causal GQA attention, the fast path behind
// attention_forward_cuda / attention_backward_cuda (internal to executor/cuda).
//   if (attention_tc_applies(a)) attention_forward_tc(a, scale, stream);
//   attention_backward_tc(a, delta, scale, stream);  // delta: D = rowsum(dO ⊙ O) [a, T] fp32, computed
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "executor/ops/attention.h"

namespace flatpeak::exec::cuda_detail {

constexpr int64_t kAttentionTcMaxHeadDim = 128;

// The rule the tensor-core kernels need: bf16 storage, head_dim a multiple of 16 (the WMMA
// fragment edge) and at most 128 (the shared-memory tiles of the backward fit 227 KiB).
inline bool attention_tc_applies(const AttentionArgs& a) {
  return a.dtype == DType::BF16 && a.head_dim % 16 == 0 && a.head_dim <= kAttentionTcMaxHeadDim;
}

// Arguments already checked by the caller; tokens > 0. Writes out and lse [a, T].
void attention_forward_tc(const AttentionArgs& a, float scale, cudaStream_t stream);
// delta [a, T] fp32 already computed on `stream`. Overwrites d_q, d_k, d_v; no other memory.
void attention_backward_tc(const AttentionArgs& a, const float* delta, float scale,
                           cudaStream_t stream);

// Dynamic shared memory of each kernel at this head_dim (for the README's budget and tests).
int64_t attention_forward_tc_shared_bytes(int64_t head_dim);
int64_t attention_dkv_tc_shared_bytes(int64_t head_dim);
int64_t attention_dq_tc_shared_bytes(int64_t head_dim);
// The largest of the three, and what the current device lets one block opt in to
// (cudaDevAttrMaxSharedMemoryPerBlockOptin: 227 KiB on H100/H200, 163 KiB on A100).
int64_t attention_tc_shared_bytes(int64_t head_dim);
int64_t device_shared_bytes_per_block_optin();

}  // namespace flatpeak::exec::cuda_detail
