// CUDA twin of the causal GQA attention forward (executor/cpu/attention_cpu.cpp): no [T, T]
// buffer; each block owns one (query row, head) and walks the keys up to the row in tiles of
// blockDim.x, folding each tile into the running (max, sum) with the shared
// online_softmax_rescale and rescaling its fp32 output accumulator; saves lse [a, T] in fp32.
// A reference kernel, not a fast one (K and V are read once per query row). Backward: not yet.
#include "executor/cpu/op_util.h"
#include "executor/cuda/cuda_check.h"
#include "executor/cuda/kernel_util.cuh"
#include "executor/cuda/ops_cuda.h"

namespace flatpeak::exec {
namespace {

using cuda_detail::block_max;
using cuda_detail::block_sum;

constexpr int kAttentionThreads = 128;
constexpr int kDimsPerThread = 4;  // head_dim <= 512

template <class T>
__global__ void attention_forward_kernel(const T* q, const T* k, const T* v, T* out, float* lse,
                                         int64_t tokens, int64_t q_heads, int64_t kv_heads,
                                         int64_t d, float scale) {
  extern __shared__ float smem[];  // q row [d], then the tile's probabilities [blockDim.x]
  __shared__ float scratch[32];
  float* q_row = smem;
  float* p = smem + d;
  const int64_t i = blockIdx.x;  // query row
  const int64_t h = blockIdx.y;  // query head
  const int64_t kh = h / (q_heads / kv_heads);
  const int64_t tid = threadIdx.x;
  const int64_t threads = blockDim.x;
  for (int64_t c = tid; c < d; c += threads) q_row[c] = to_f32(q[(i * q_heads + h) * d + c]);
  __syncthreads();
  float acc[kDimsPerThread] = {0.0f, 0.0f, 0.0f, 0.0f};
  float row_max = -INFINITY;
  float row_sum = 0.0f;
  for (int64_t j0 = 0; j0 <= i; j0 += threads) {  // causal: keys 0..i
    const int64_t j = j0 + tid;
    float score = -INFINITY;
    if (j <= i) {
      const T* k_row = k + (j * kv_heads + kh) * d;
      float dot = 0.0f;
      for (int64_t c = 0; c < d; ++c) dot += q_row[c] * to_f32(k_row[c]);
      score = scale * dot;
    }
    const float new_max = fmaxf(row_max, block_max(score, scratch));
    const float rescale = online_softmax_rescale(row_max, new_max);
    const float prob = j <= i ? expf(score - new_max) : 0.0f;
    row_sum = row_sum * rescale + block_sum(prob, scratch);
    row_max = new_max;
    p[tid] = prob;
    __syncthreads();
    const int64_t keys = (i - j0 + 1) < threads ? (i - j0 + 1) : threads;
    for (int s = 0; s < kDimsPerThread; ++s) {
      const int64_t c = tid + s * threads;
      if (c < d) {
        float a = acc[s] * rescale;
        for (int64_t jj = 0; jj < keys; ++jj) a += p[jj] * to_f32(v[((j0 + jj) * kv_heads + kh) * d + c]);
        acc[s] = a;
      }
    }
    __syncthreads();  // p is rewritten by the next tile
  }
  for (int s = 0; s < kDimsPerThread; ++s) {
    const int64_t c = tid + s * threads;
    if (c < d) store_f32(&out[(i * q_heads + h) * d + c], acc[s] / row_sum);
  }
  if (tid == 0) lse[h * tokens + i] = row_max + logf(row_sum);
}

}  // namespace

void attention_forward_cuda(const AttentionArgs& a, cudaStream_t stream) {
  require(a.tokens >= 0 && a.q_heads > 0 && a.kv_heads > 0 && a.head_dim > 0, "attention",
          "tokens must be >= 0, heads and head_dim > 0");
  require(a.q_heads % a.kv_heads == 0, "attention", "q_heads must be a multiple of kv_heads");
  require(a.q && a.k && a.v && a.out && a.lse, "attention", "needs q, k, v, out and lse");
  require(a.head_dim <= kAttentionThreads * kDimsPerThread, "attention",
          "head_dim must be <= 512 on CUDA");
  require(a.tokens <= 0x7fffffff && a.q_heads <= 65535, "attention",
          "tokens must be < 2^31 and q_heads <= 65535 on CUDA");
  if (a.tokens == 0) return;
  const float scale = a.softmax_scale != 0.0f ? a.softmax_scale
                                              : 1.0f / sqrtf(static_cast<float>(a.head_dim));
  const dim3 grid(static_cast<unsigned>(a.tokens), static_cast<unsigned>(a.q_heads));
  const size_t shared_bytes = static_cast<size_t>(a.head_dim + kAttentionThreads) * sizeof(float);
  dispatch_compute(a.dtype, "attention", [&](auto tag) {
    using T = decltype(tag);
    attention_forward_kernel<<<grid, kAttentionThreads, shared_bytes, stream>>>(
        static_cast<const T*>(a.q), static_cast<const T*>(a.k), static_cast<const T*>(a.v),
        static_cast<T*>(a.out), a.lse, a.tokens, a.q_heads, a.kv_heads, a.head_dim, scale);
  });
  FLATPEAK_CUDA_CHECK_LAUNCH();
}

}  // namespace flatpeak::exec
