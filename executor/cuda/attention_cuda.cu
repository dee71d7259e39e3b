// CUDA twin of the causal GQA attention forward (executor/cpu/attention_cpu.cpp): no [T, T]
// buffer; each block owns one (query row, head) and walks the keys up to the row in tiles of
// blockDim.x, folding each tile into the running (max, sum) with the shared
// online_softmax_rescale and rescaling its fp32 output accumulator; saves lse [a, T] in fp32.
// The backward recomputes the probabilities from lse: dQ one block per (query row, head) over
// its key tiles; dK, dV one block per (key row, kv head) over the query rows at or after it, for
// every head of the group. Reference kernels, not fast ones (K and V are read once per row).
// attention_forward_cuda / attention_backward_cuda pick the tensor-core kernels
// (attention_tc_cuda.cu) where they apply (bf16, head_dim a multiple of 16 up to 128), else these;
// both paths share the argument checks, the delta kernel and the workspace.
#include <string>

#include "executor/cpu/op_util.h"
#include "executor/cuda/attention_tc_cuda.h"
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
  extern __shared__ float smem[];  // q row [d], dO row [d], dS of the tile [blockDim.x]
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
  extern __shared__ float smem[];  // k row [d], v row [d], P [blockDim.x], dS [blockDim.x]
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

}  // namespace

const char* attention_kernel_name(AttentionKernel kernel) {
  switch (kernel) {
    case AttentionKernel::Auto: return "auto";
    case AttentionKernel::Reference: return "reference";
    case AttentionKernel::TensorCore: return "tensor-core";
  }
  return "unknown";
}

namespace {

// True for the tensor-core kernels. Asking for them where they do not apply (the arguments, or a
// device whose per-block shared memory is smaller than their tiles) is an argument error naming
// the rule and the values; Auto then takes the reference kernels.
bool use_tensor_cores(const AttentionArgs& a, AttentionKernel kernel) {
  if (kernel == AttentionKernel::Reference) return false;
  const bool applies = cuda_detail::attention_tc_applies(a);
  if (kernel == AttentionKernel::TensorCore && !applies) {
    fail("attention", std::string("the tensor-core kernel needs dtype bf16 and head_dim a multiple "
                                  "of 16, at most 128 (got dtype ") +
                          dtype_name(a.dtype) + ", head_dim " + std::to_string(a.head_dim) + ")");
  }
  if (!applies) return false;
  const int64_t need = cuda_detail::attention_tc_shared_bytes(a.head_dim);
  const int64_t allowed = cuda_detail::device_shared_bytes_per_block_optin();
  if (need <= allowed) return true;
  if (kernel == AttentionKernel::TensorCore) {
    fail("attention", "the tensor-core kernel needs " + std::to_string(need) +
                          " bytes of shared memory per block at head_dim " +
                          std::to_string(a.head_dim) + "; this device allows " +
                          std::to_string(allowed));
  }
  return false;
}

float softmax_scale_of(const AttentionArgs& a) {
  return a.softmax_scale != 0.0f ? a.softmax_scale : 1.0f / sqrtf(static_cast<float>(a.head_dim));
}

}  // namespace

void attention_forward_cuda(const AttentionArgs& a, cudaStream_t stream, AttentionKernel kernel) {
  require(a.tokens >= 0 && a.q_heads > 0 && a.kv_heads > 0 && a.head_dim > 0, "attention",
          "tokens must be >= 0, heads and head_dim > 0");
  require(a.q_heads % a.kv_heads == 0, "attention", "q_heads must be a multiple of kv_heads");
  require(a.q && a.k && a.v && a.out && a.lse, "attention", "needs q, k, v, out and lse");
  require(a.head_dim <= kAttentionThreads * kDimsPerThread, "attention",
          "head_dim must be <= 512 on CUDA");
  require(a.tokens <= 0x7fffffff && a.q_heads <= 65535, "attention",
          "tokens must be < 2^31 and q_heads <= 65535 on CUDA");
  const bool tensor_cores = use_tensor_cores(a, kernel);
  if (a.tokens == 0) return;
  const float scale = softmax_scale_of(a);
  if (tensor_cores) {
    cuda_detail::attention_forward_tc(a, scale, stream);
    return;
  }
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

int64_t attention_backward_workspace_bytes_cuda(const AttentionArgs& a) {
  return a.q_heads * a.tokens * 4;  // D [a, T] fp32
}

void attention_backward_cuda(const AttentionArgs& a, cudaStream_t stream, AttentionKernel kernel) {
  require(a.tokens >= 0 && a.q_heads > 0 && a.kv_heads > 0 && a.head_dim > 0, "attention",
          "tokens must be >= 0, heads and head_dim > 0");
  require(a.q_heads % a.kv_heads == 0, "attention", "q_heads must be a multiple of kv_heads");
  require(a.q && a.k && a.v && a.out && a.lse, "attention", "needs q, k, v, out and lse");
  require(a.d_out && a.d_q && a.d_k && a.d_v, "attention", "backward needs d_out, d_q, d_k and d_v");
  require(a.workspace != nullptr, "attention",
          "backward needs a workspace of attention_backward_workspace_bytes_cuda()");
  require(a.head_dim <= kAttentionThreads * kDimsPerThread, "attention",
          "head_dim must be <= 512 on CUDA");
  require(a.tokens <= 0x7fffffff && a.q_heads <= 65535, "attention",
          "tokens must be < 2^31 and q_heads <= 65535 on CUDA");
  const bool tensor_cores = use_tensor_cores(a, kernel);
  if (a.tokens == 0) return;
  const float scale = softmax_scale_of(a);
  float* delta = a.workspace;  // [a, T]
  dispatch_compute(a.dtype, "attention", [&](auto tag) {
    using T = decltype(tag);
    const T* q = static_cast<const T*>(a.q);
    const T* k = static_cast<const T*>(a.k);
    const T* v = static_cast<const T*>(a.v);
    const T* d_out = static_cast<const T*>(a.d_out);
    attention_delta_kernel<<<cuda_detail::grid_for(a.tokens * a.q_heads), cuda_detail::kThreads, 0,
                             stream>>>(static_cast<const T*>(a.out), d_out, delta, a.tokens,
                                       a.q_heads, a.head_dim);
    FLATPEAK_CUDA_CHECK_LAUNCH();
    if (tensor_cores) {
      cuda_detail::attention_backward_tc(a, delta, scale, stream);
      return;
    }
    const size_t dq_shared = static_cast<size_t>(2 * a.head_dim + kAttentionThreads) * sizeof(float);
    attention_dq_kernel<<<dim3(static_cast<unsigned>(a.tokens), static_cast<unsigned>(a.q_heads)),
                          kAttentionThreads, dq_shared, stream>>>(
        q, k, v, d_out, a.lse, delta, static_cast<T*>(a.d_q), a.tokens, a.q_heads, a.kv_heads,
        a.head_dim, scale);
    FLATPEAK_CUDA_CHECK_LAUNCH();
    const size_t dkv_shared =
        static_cast<size_t>(2 * a.head_dim + 2 * kAttentionThreads) * sizeof(float);
    attention_dkv_kernel<<<dim3(static_cast<unsigned>(a.tokens), static_cast<unsigned>(a.kv_heads)),
                           kAttentionThreads, dkv_shared, stream>>>(
        q, k, v, d_out, a.lse, delta, static_cast<T*>(a.d_k), static_cast<T*>(a.d_v), a.tokens,
        a.q_heads, a.kv_heads, a.head_dim, scale);
  });
  FLATPEAK_CUDA_CHECK_LAUNCH();
}

}  // namespace flatpeak::exec
