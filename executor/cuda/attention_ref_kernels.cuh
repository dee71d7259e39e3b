// The reference attention kernels (internal to executor/cuda): causal GQA attention without a
// [T, T] buffer, one block of kAttentionThreads per (query row, head) for the forward and dQ and
// per (key row, kv head) for dK/dV, walking the other side in tiles of blockDim.x rows with the
// CPU twin's online_softmax_rescale; plus the delta kernel D = rowsum(dO ⊙ O), which the
// tensor-core backward shares. fp32 arithmetic over f32 or bf16 storage; head_dim <= 512.
// attention_cuda.cu runs the launch functions at the end; tests/unit/executor_attention_ref_emulation_test.cpp
// runs the same ones on the host (FLATPEAK_CUDA_EMULATION, tests/unit/cuda_emulation.h) against
// the CPU op, so grids, shared-memory sizes, indexing, masks, tiling and barriers are checked
// without a GPU.
//   #include "executor/cuda/attention_ref_kernels.cuh"
//   launch_attention_ref_forward(q, k, v, out, lse, T, a, g, d, scale, stream);
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "executor/cuda/kernel_util.cuh"
#include "executor/ops/attention.h"
#include "executor/ops/dtype.h"

// One translation unit per binary includes this header (the kernels have internal linkage).
namespace flatpeak::exec::cuda_detail {
namespace {

constexpr int kAttentionThreads = 128;  // threads per block; also the key (query) tile length
constexpr int kDimsPerThread = 4;       // head_dim <= kAttentionThreads * kDimsPerThread = 512

// Dynamic shared memory per block (bytes) of each kernel, as laid out at its top.
inline size_t attention_forward_shared_bytes(int64_t d) {
  return static_cast<size_t>(d + kAttentionThreads) * sizeof(float);
}
inline size_t attention_dq_shared_bytes(int64_t d) {
  return static_cast<size_t>(2 * d + kAttentionThreads) * sizeof(float);
}
inline size_t attention_dkv_shared_bytes(int64_t d) {
  return static_cast<size_t>(2 * d + 2 * kAttentionThreads) * sizeof(float);
}

template <class T>
__global__ void attention_forward_kernel(const T* q, const T* k, const T* v, T* out, float* lse,
                                         int64_t tokens, int64_t q_heads, int64_t kv_heads,
                                         int64_t d, float scale) {
  FLATPEAK_DYNAMIC_SHARED(float, smem);  // q row [d], then the tile's probabilities [blockDim.x]
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

// D[h, i] = Σ_c dO[i, h, c] · O[i, h, c]
template <class T>
__global__ void attention_delta_kernel(const T* out, const T* d_out, float* delta, int64_t tokens,
                                       int64_t q_heads, int64_t d) {
  const int64_t n = tokens * q_heads;
  for (int64_t idx = cuda_detail::global_thread(); idx < n; idx += cuda_detail::grid_threads()) {
    const int64_t i = idx / q_heads;
    const int64_t h = idx % q_heads;
    float dot = 0.0f;
    for (int64_t c = 0; c < d; ++c) dot += to_f32(d_out[idx * d + c]) * to_f32(out[idx * d + c]);
    delta[h * tokens + i] = dot;
  }
}

// dQ[i, h] = scale · Σ_{j ≤ i} dS_ij K_j, dS = P ⊙ (dO·Vᵀ − D).
template <class T>
__global__ void attention_dq_kernel(const T* q, const T* k, const T* v, const T* d_out,
                                    const float* lse, const float* delta, T* d_q, int64_t tokens,
                                    int64_t q_heads, int64_t kv_heads, int64_t d, float scale) {
  FLATPEAK_DYNAMIC_SHARED(float, smem);  // q row [d], dO row [d], dS of the tile [blockDim.x]
  float* q_row = smem;
  float* do_row = smem + d;
  float* ds = smem + 2 * d;
  const int64_t i = blockIdx.x;
  const int64_t h = blockIdx.y;
  const int64_t kh = h / (q_heads / kv_heads);
  const int64_t tid = threadIdx.x;
  const int64_t threads = blockDim.x;
  for (int64_t c = tid; c < d; c += threads) {
    q_row[c] = to_f32(q[(i * q_heads + h) * d + c]);
    do_row[c] = to_f32(d_out[(i * q_heads + h) * d + c]);
  }
  __syncthreads();
  const float lse_i = lse[h * tokens + i];
  const float delta_i = delta[h * tokens + i];
  float acc[kDimsPerThread] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int64_t j0 = 0; j0 <= i; j0 += threads) {
    const int64_t j = j0 + tid;
    float ds_j = 0.0f;
    if (j <= i) {
      const T* k_row = k + (j * kv_heads + kh) * d;
      const T* v_row = v + (j * kv_heads + kh) * d;
      float qk = 0.0f;
      float dp = 0.0f;
      for (int64_t c = 0; c < d; ++c) {
        qk += q_row[c] * to_f32(k_row[c]);
        dp += do_row[c] * to_f32(v_row[c]);
      }
      const float p = expf(scale * qk - lse_i);
      ds_j = p * (dp - delta_i);
    }
    ds[tid] = ds_j;
    __syncthreads();
    const int64_t keys = (i - j0 + 1) < threads ? (i - j0 + 1) : threads;
    for (int s = 0; s < kDimsPerThread; ++s) {
      const int64_t c = tid + s * threads;
      if (c < d) {
        float a = acc[s];
        for (int64_t jj = 0; jj < keys; ++jj) a += ds[jj] * to_f32(k[((j0 + jj) * kv_heads + kh) * d + c]);
        acc[s] = a;
      }
    }
    __syncthreads();
  }
  for (int s = 0; s < kDimsPerThread; ++s) {
    const int64_t c = tid + s * threads;
    if (c < d) store_f32(&d_q[(i * q_heads + h) * d + c], scale * acc[s]);
  }
}

// dV[j, kh] = Σ_{h in group} Σ_{i ≥ j} P_ij dO_i;  dK[j, kh] = scale · Σ Σ dS_ij Q_i.
template <class T>
__global__ void attention_dkv_kernel(const T* q, const T* k, const T* v, const T* d_out,
                                     const float* lse, const float* delta, T* d_k, T* d_v,
                                     int64_t tokens, int64_t q_heads, int64_t kv_heads, int64_t d,
                                     float scale) {
  FLATPEAK_DYNAMIC_SHARED(float, smem);  // k row [d], v row [d], P [blockDim.x], dS [blockDim.x]
  float* k_row = smem;
  float* v_row = smem + d;
  float* p_tile = smem + 2 * d;
  float* ds_tile = p_tile + blockDim.x;
  const int64_t j = blockIdx.x;
  const int64_t kh = blockIdx.y;
  const int64_t group = q_heads / kv_heads;
  const int64_t tid = threadIdx.x;
  const int64_t threads = blockDim.x;
  for (int64_t c = tid; c < d; c += threads) {
    k_row[c] = to_f32(k[(j * kv_heads + kh) * d + c]);
    v_row[c] = to_f32(v[(j * kv_heads + kh) * d + c]);
  }
  __syncthreads();
  float dk[kDimsPerThread] = {0.0f, 0.0f, 0.0f, 0.0f};
  float dv[kDimsPerThread] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int64_t h = kh * group; h < (kh + 1) * group; ++h) {
    for (int64_t i0 = j; i0 < tokens; i0 += threads) {  // causal: query rows j..T-1
      const int64_t i = i0 + tid;
      float p = 0.0f;
      float ds_i = 0.0f;
      if (i < tokens) {
        const T* q_i = q + (i * q_heads + h) * d;
        const T* do_i = d_out + (i * q_heads + h) * d;
        float qk = 0.0f;
        float dp = 0.0f;
        for (int64_t c = 0; c < d; ++c) {
          qk += to_f32(q_i[c]) * k_row[c];
          dp += to_f32(do_i[c]) * v_row[c];
        }
        p = expf(scale * qk - lse[h * tokens + i]);
        ds_i = p * (dp - delta[h * tokens + i]);
      }
      p_tile[tid] = p;
      ds_tile[tid] = ds_i;
      __syncthreads();
      const int64_t rows = (tokens - i0) < threads ? (tokens - i0) : threads;
      for (int s = 0; s < kDimsPerThread; ++s) {
        const int64_t c = tid + s * threads;
        if (c < d) {
          float a_k = dk[s];
          float a_v = dv[s];
          for (int64_t ii = 0; ii < rows; ++ii) {
            const int64_t row = ((i0 + ii) * q_heads + h) * d + c;
            a_v += p_tile[ii] * to_f32(d_out[row]);
            a_k += ds_tile[ii] * to_f32(q[row]);
          }
          dk[s] = a_k;
          dv[s] = a_v;
        }
      }
      __syncthreads();
    }
  }
  for (int s = 0; s < kDimsPerThread; ++s) {
    const int64_t c = tid + s * threads;
    if (c < d) {
      store_f32(&d_k[(j * kv_heads + kh) * d + c], scale * dk[s]);
      store_f32(&d_v[(j * kv_heads + kh) * d + c], dv[s]);
    }
  }
}

// ---- launches (attention_cuda.cu's, after its checks: T < 2^31, heads <= 65535, d <= 512) ----

// Grid (T, a): one block per (query row, head).
template <class T>
void launch_attention_ref_forward(const T* q, const T* k, const T* v, T* out, float* lse,
                                  int64_t tokens, int64_t q_heads, int64_t kv_heads,
                                  int64_t head_dim, float scale, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(tokens), static_cast<unsigned>(q_heads));
  const size_t shared_bytes = attention_forward_shared_bytes(head_dim);
  FLATPEAK_LAUNCH(attention_forward_kernel<T>, grid, kAttentionThreads, shared_bytes, stream, q, k,
                  v, out, lse, tokens, q_heads, kv_heads, head_dim, scale);
}

// D [a, T] = rowsum(dO ⊙ O), one thread per (row, head); the tensor-core backward's too.
template <class T>
void launch_attention_delta(const T* out, const T* d_out, float* delta, int64_t tokens,
                            int64_t q_heads, int64_t head_dim, cudaStream_t stream) {
  FLATPEAK_LAUNCH(attention_delta_kernel<T>, grid_for(tokens * q_heads), kThreads, 0, stream, out,
                  d_out, delta, tokens, q_heads, head_dim);
}

// After the delta: dQ on grid (T, a), then dK/dV on grid (T, g).
template <class T>
void launch_attention_ref_backward(const T* q, const T* k, const T* v, const T* d_out,
                                   const float* lse, const float* delta, T* d_q, T* d_k, T* d_v,
                                   int64_t tokens, int64_t q_heads, int64_t kv_heads,
                                   int64_t head_dim, float scale, cudaStream_t stream) {
  const size_t dq_shared = attention_dq_shared_bytes(head_dim);
  FLATPEAK_LAUNCH(attention_dq_kernel<T>,
                  dim3(static_cast<unsigned>(tokens), static_cast<unsigned>(q_heads)),
                  kAttentionThreads, dq_shared, stream, q, k, v, d_out, lse, delta, d_q, tokens,
                  q_heads, kv_heads, head_dim, scale);
  const size_t dkv_shared = attention_dkv_shared_bytes(head_dim);
  FLATPEAK_LAUNCH(attention_dkv_kernel<T>,
                  dim3(static_cast<unsigned>(tokens), static_cast<unsigned>(kv_heads)),
                  kAttentionThreads, dkv_shared, stream, q, k, v, d_out, lse, delta, d_k, d_v,
                  tokens, q_heads, kv_heads, head_dim, scale);
}

}  // namespace
}  // namespace flatpeak::exec::cuda_detail
