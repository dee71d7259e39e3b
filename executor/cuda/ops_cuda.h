// The CUDA twin of every CPU op in executor/ops/: the same Args struct (every pointer a device
// pointer), the same name with _cuda for _cpu, and the stream (or the cuBLAS context that holds
// it) last. Calls are asynchronous on that stream; argument errors throw std::invalid_argument
// before anything is queued, CUDA/cuBLAS errors throw BackendError.
//   RmsNormArgs a = ...;  rmsnorm_forward_cuda(a, stream);      // as rmsnorm_forward_cpu(a)
//   LinearArgs l = ...;   linear_forward_cuda(l, blas);          // cuBLAS on blas.stream()
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "executor/cuda/cublas_context.h"
#include "executor/ops/adamw.h"
#include "executor/ops/attention.h"
#include "executor/ops/combine.h"
#include "executor/ops/cross_entropy.h"
#include "executor/ops/embedding.h"
#include "executor/ops/expert_ffn.h"
#include "executor/ops/layernorm.h"
#include "executor/ops/linear.h"
#include "executor/ops/permute.h"
#include "executor/ops/rmsnorm.h"
#include "executor/ops/router.h"

namespace flatpeak::exec {

// AdamW: element-wise, bitwise-order-free; scalars computed once on the host (adamw_scalars).
void adamw_step_cuda(const AdamWArgs& args, cudaStream_t stream);

// Embedding: gather; the backward adds tokens to d_table in order 0..T-1 (one thread per hidden
// column walks the tokens), so repeated ids round exactly as on the CPU.
void embedding_forward_cuda(const EmbeddingArgs& args, cudaStream_t stream);
void embedding_backward_cuda(const EmbeddingArgs& args, cudaStream_t stream);

// RMSNorm: one block per token; d_weight from an fp32 sum over tokens in order (workspace unused).
void rmsnorm_forward_cuda(const RmsNormArgs& args, cudaStream_t stream);
void rmsnorm_backward_cuda(const RmsNormArgs& args, cudaStream_t stream);
// LayerNorm: as RMSNorm, with the mean saved beside rstd; d_weight and d_bias from fp32 sums over
// tokens in order (workspace unused).
void layernorm_forward_cuda(const LayerNormArgs& args, cudaStream_t stream);
void layernorm_backward_cuda(const LayerNormArgs& args, cudaStream_t stream);

// Router: one thread per token, the CPU's selection loop (ties to the lower expert).
void router_forward_cuda(const RouterArgs& args, cudaStream_t stream);
void router_backward_cuda(const RouterArgs& args, cudaStream_t stream);

// Routing plan on the device (one block; stable by (token, slot) within an expert). topk_ids
// are not range-checked on the device: an id outside 0..E-1 is ignored and leaves its slot
// unassigned, and the counts then sum to less than T·k.
void moe_route_cuda(const PermuteArgs& args, cudaStream_t stream);
void permute_forward_cuda(const PermuteArgs& args, cudaStream_t stream);
void permute_backward_cuda(const PermuteArgs& args, cudaStream_t stream);
void unpermute_forward_cuda(const PermuteArgs& args, cudaStream_t stream);
void unpermute_backward_cuda(const PermuteArgs& args, cudaStream_t stream);

// Combine: slot order s = 0..k-1 in fp32, as on the CPU.
void combine_forward_cuda(const CombineArgs& args, cudaStream_t stream);
void combine_backward_cuda(const CombineArgs& args, cudaStream_t stream);

// Linear through cuBLAS (bf16 or f32 storage, fp32 accumulation): y =, dx =, dW +=.
void linear_forward_cuda(const LinearArgs& args, const cuda::CublasContext& blas);
void linear_backward_cuda(const LinearArgs& args, const cuda::CublasContext& blas);

// Blocked cross-entropy (online log-sum-exp), the CPU's block order; logits blocks from cuBLAS.
// targets are not range-checked on the device (the CPU twin checks them). The workspace is the
// CPU's, byte for byte (dz rounded into the compute-dtype dlogits block, the operand of the dX and
// dW GEMMs with fp32 accumulation): blocked_cross_entropy_workspace_bytes_cuda().
int64_t blocked_cross_entropy_workspace_bytes_cuda(const CrossEntropyArgs& args);
void blocked_cross_entropy_forward_cuda(const CrossEntropyArgs& args, const cuda::CublasContext& blas);
void blocked_cross_entropy_backward_cuda(const CrossEntropyArgs& args, const cuda::CublasContext& blas);
void blocked_cross_entropy_fused_cuda(const CrossEntropyArgs& args, const cuda::CublasContext& blas);
// The naive materialised cross-entropy (logits [T, V] in the compute dtype, fp32 log-softmax and
// fp32 d_logits [T, V]), the baseline the blocked version is measured against. One difference
// from the CPU twin: cuBLAS has no fp32 × bf16 GEMM, so the backward rounds dz once into the
// `logits` buffer (dead after the forward: log_probs is what the backward reads) and runs the dX
// and dW GEMMs on that compute-dtype copy; the CPU multiplies the fp32 d_logits directly. Same
// buffers, so the same bytes; dX and dW agree to the compute dtype's rounding of dz.
void materialized_cross_entropy_forward_cuda(const MaterializedCrossEntropyArgs& args,
                                             const cuda::CublasContext& blas);
void materialized_cross_entropy_backward_cuda(const MaterializedCrossEntropyArgs& args,
                                              const cuda::CublasContext& blas);

// SwiGLU expert FFN: per expert, cuBLAS over its rows with fp32 accumulation; in bf16 the two
// GEMMs of stored tensors (gate_up, dh) on tensor cores, the four that take the fp32 h or
// d[gate | up] on fp32 operands (the bf16 one widened into the workspace) in TF32; in f32 storage
// every GEMM is exact fp32. expert_counts is read
// on the host (a host pointer, unlike the other fields), because it decides the GEMM shapes.
// Workspace: (n·H + 2F·H + 3·n·F) fp32, n = the busiest expert's rows.
int64_t expert_ffn_workspace_bytes_cuda(const ExpertFfnArgs& args);
int64_t expert_ffn_workspace_bytes_cuda(int64_t max_expert_rows, int64_t hidden, int64_t ffn);
void expert_ffn_forward_cuda(const ExpertFfnArgs& args, const cuda::CublasContext& blas);
void expert_ffn_backward_cuda(const ExpertFfnArgs& args, const cuda::CublasContext& blas);

// Causal GQA attention; out and lse [a, T] as on the CPU; tile_rows unused. Two kernel sets:
//   TensorCore: tiled flash attention on WMMA (attention_tc_cuda.cu): 64-row query and key tiles,
//     bf16 operands with fp32 accumulation, P and dS rounded to bf16 as GEMM operands; needs dtype
//     bf16 and head_dim a multiple of 16, at most 128.
//   Reference: one block per (query row, head), key tiles of 128, fp32 dot products; any dtype,
//     head_dim <= 512; O(T²) reads of K and V, slow at long T.
// Auto takes TensorCore where it applies (and the device lets a block opt in to the shared memory
// of its tiles: up to 169.5 KiB at d = 128), else Reference; asking for TensorCore where it does
// not apply throws std::invalid_argument. The forward needs no workspace; the backward recomputes P
// from lse and needs attention_backward_workspace_bytes_cuda() (D = rowsum(dO ⊙ O), [a, T] fp32),
// the same bytes for both kernel sets.
enum class AttentionKernel { Auto, Reference, TensorCore };
const char* attention_kernel_name(AttentionKernel kernel);
void attention_forward_cuda(const AttentionArgs& args, cudaStream_t stream,
                            AttentionKernel kernel = AttentionKernel::Auto);
int64_t attention_backward_workspace_bytes_cuda(const AttentionArgs& args);
void attention_backward_cuda(const AttentionArgs& args, cudaStream_t stream,
                             AttentionKernel kernel = AttentionKernel::Auto);

}  // namespace flatpeak::exec
