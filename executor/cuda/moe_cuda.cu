// CUDA twins of the MoE data movement (routing plan, permute/unpermute, combine) and of the
// linear projection (executor/cpu/{permute,combine,linear}_cpu.cpp).
#include "executor/cpu/op_util.h"
#include "executor/cuda/cuda_check.h"
#include "executor/cuda/kernel_util.cuh"
#include "executor/cuda/ops_cuda.h"

namespace flatpeak::exec {
namespace {

using cuda_detail::block_sum;
using cuda_detail::global_thread;
using cuda_detail::grid_for;
using cuda_detail::grid_threads;
using cuda_detail::kThreads;

// ---- routing plan ------------------------------------------------------------------------

// One block. Each thread owns experts e ≡ threadIdx.x (mod blockDim.x): counts its copies,
// then (after one thread turns counts into first rows) walks the copies in (token, slot) order
// and hands out its rows, which is the CPU's stable counting sort. expert_counts holds first
// rows in between, as on the CPU.
__global__ void moe_route_kernel(const int32_t* topk_ids, int64_t copies, int64_t experts,
                                 int64_t* expert_counts, int32_t* slot_to_row,
                                 int32_t* row_to_slot) {
  for (int64_t e = threadIdx.x; e < experts; e += blockDim.x) {
    int64_t count = 0;
    for (int64_t i = 0; i < copies; ++i) count += topk_ids[i] == e ? 1 : 0;
    expert_counts[e] = count;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int64_t next_row = 0;
    for (int64_t e = 0; e < experts; ++e) {
      const int64_t count = expert_counts[e];
      expert_counts[e] = next_row;
      next_row += count;
    }
  }
  __syncthreads();
  for (int64_t e = threadIdx.x; e < experts; e += blockDim.x) {
    const int64_t first = expert_counts[e];
    int64_t row = first;
    for (int64_t i = 0; i < copies; ++i) {
      if (topk_ids[i] == e) {
        slot_to_row[i] = static_cast<int32_t>(row);
        row_to_slot[row] = static_cast<int32_t>(i);
        ++row;
      }
    }
    expert_counts[e] = row - first;
  }
}

// ---- permute / unpermute -----------------------------------------------------------------

// dst row r = src row index_of(r); used for permute (src row = token of the copy), unpermute
// forward (src row = permuted row of the slot) and unpermute backward (src = slot of the row).
template <class T>
__global__ void gather_rows_kernel(const T* src, const int32_t* index, int64_t index_divisor,
                                   T* dst, int64_t rows, int64_t hidden) {
  for (int64_t i = global_thread(); i < rows * hidden; i += grid_threads()) {
    const int64_t r = i / hidden;
    const int64_t h = i % hidden;
    dst[i] = src[(static_cast<int64_t>(index[r]) / index_divisor) * hidden + h];
  }
}

// d_x[t, h] = Σ_{s=0..k-1} d_x_perm[slot_to_row[t·k + s], h], in slot order.
template <class T>
__global__ void permute_backward_kernel(const T* d_x_perm, const int32_t* slot_to_row, T* d_x,
                                        int64_t tokens, int64_t top_k, int64_t hidden) {
  for (int64_t i = global_thread(); i < tokens * hidden; i += grid_threads()) {
    const int64_t t = i / hidden;
    const int64_t h = i % hidden;
    float sum = 0.0f;
    for (int64_t s = 0; s < top_k; ++s) {
      sum += to_f32(d_x_perm[static_cast<int64_t>(slot_to_row[t * top_k + s]) * hidden + h]);
    }
    store_f32(&d_x[i], sum);
  }
}

// ---- combine -----------------------------------------------------------------------------

__device__ inline int64_t combine_row(const int32_t* slot_to_row, int64_t slot) {
  return slot_to_row != nullptr ? slot_to_row[slot] : slot;
}

template <class T>
__global__ void combine_forward_kernel(const T* y, const float* weights, const int32_t* slot_to_row,
                                       T* out, int64_t tokens, int64_t top_k, int64_t hidden) {
  for (int64_t i = global_thread(); i < tokens * hidden; i += grid_threads()) {
    const int64_t t = i / hidden;
    const int64_t h = i % hidden;
    float sum = 0.0f;
    for (int64_t s = 0; s < top_k; ++s) {
      sum += weights[t * top_k + s] * to_f32(y[combine_row(slot_to_row, t * top_k + s) * hidden + h]);
    }
    store_f32(&out[i], sum);
  }
}

// One block per (token, slot): d_y = w · d_out; d_weights = dot(d_out[t], y[t, s]) (fp32).
template <class T>
__global__ void combine_backward_kernel(const T* y, const float* weights, const int32_t* slot_to_row,
                                        const T* d_out, T* d_y, float* d_weights, int64_t top_k,
                                        int64_t hidden) {
  __shared__ float scratch[32];
  const int64_t slot = blockIdx.x;
  const int64_t t = slot / top_k;
  const int64_t row = combine_row(slot_to_row, slot);
  const float w = weights[slot];
  float partial = 0.0f;
  for (int64_t h = threadIdx.x; h < hidden; h += blockDim.x) {
    const float g = to_f32(d_out[t * hidden + h]);
    partial += g * to_f32(y[row * hidden + h]);
    store_f32(&d_y[row * hidden + h], w * g);
  }
  const float dot = block_sum(partial, scratch);
  if (threadIdx.x == 0) d_weights[slot] = dot;
}

void check_permute(const PermuteArgs& a) {
  require(a.tokens >= 0 && a.top_k > 0 && a.experts > 0 && a.hidden > 0, "permute",
          "need tokens >= 0 and top_k, experts, hidden > 0");
  require(a.slot_to_row && a.row_to_slot, "permute", "needs slot_to_row and row_to_slot");
}

void check_combine(const CombineArgs& a) {
  require(a.tokens >= 0 && a.top_k > 0 && a.hidden > 0, "combine",
          "need tokens >= 0 and top_k, hidden > 0");
  require(a.y && a.weights, "combine", "needs y and weights");
}

}  // namespace

void moe_route_cuda(const PermuteArgs& a, cudaStream_t stream) {
  check_permute(a);
  require(a.topk_ids && a.expert_counts, "permute", "routing needs topk_ids and expert_counts");
  moe_route_kernel<<<1, 1024, 0, stream>>>(a.topk_ids, a.tokens * a.top_k, a.experts,
                                          a.expert_counts, a.slot_to_row, a.row_to_slot);
  FLATPEAK_CUDA_CHECK_LAUNCH();
}

void permute_forward_cuda(const PermuteArgs& a, cudaStream_t stream) {
  check_permute(a);
  require(a.x && a.x_perm, "permute", "forward needs x and x_perm");
  const int64_t rows = a.tokens * a.top_k;
  if (rows == 0) return;
  dispatch_compute(a.dtype, "permute", [&](auto tag) {
    using T = decltype(tag);
    gather_rows_kernel<<<grid_for(rows * a.hidden), kThreads, 0, stream>>>(
        static_cast<const T*>(a.x), a.row_to_slot, a.top_k, static_cast<T*>(a.x_perm), rows,
        a.hidden);
  });
  FLATPEAK_CUDA_CHECK_LAUNCH();
}

void permute_backward_cuda(const PermuteArgs& a, cudaStream_t stream) {
  check_permute(a);
  require(a.d_x_perm && a.d_x, "permute", "backward needs d_x_perm and d_x");
  if (a.tokens == 0) return;
  dispatch_compute(a.dtype, "permute", [&](auto tag) {
    using T = decltype(tag);
    permute_backward_kernel<<<grid_for(a.tokens * a.hidden), kThreads, 0, stream>>>(
        static_cast<const T*>(a.d_x_perm), a.slot_to_row, static_cast<T*>(a.d_x), a.tokens,
        a.top_k, a.hidden);
  });
  FLATPEAK_CUDA_CHECK_LAUNCH();
}

void unpermute_forward_cuda(const PermuteArgs& a, cudaStream_t stream) {
  check_permute(a);
  require(a.y_perm && a.y_slots, "permute", "unpermute needs y_perm and y_slots");
  const int64_t rows = a.tokens * a.top_k;
  if (rows == 0) return;
  dispatch_compute(a.dtype, "permute", [&](auto tag) {
    using T = decltype(tag);
    gather_rows_kernel<<<grid_for(rows * a.hidden), kThreads, 0, stream>>>(
        static_cast<const T*>(a.y_perm), a.slot_to_row, 1, static_cast<T*>(a.y_slots), rows,
        a.hidden);
  });
  FLATPEAK_CUDA_CHECK_LAUNCH();
}

void unpermute_backward_cuda(const PermuteArgs& a, cudaStream_t stream) {
  check_permute(a);
  require(a.d_y_slots && a.d_y_perm, "permute", "unpermute backward needs d_y_slots and d_y_perm");
  const int64_t rows = a.tokens * a.top_k;
  if (rows == 0) return;
  dispatch_compute(a.dtype, "permute", [&](auto tag) {
    using T = decltype(tag);
    gather_rows_kernel<<<grid_for(rows * a.hidden), kThreads, 0, stream>>>(
        static_cast<const T*>(a.d_y_slots), a.row_to_slot, 1, static_cast<T*>(a.d_y_perm), rows,
        a.hidden);
  });
  FLATPEAK_CUDA_CHECK_LAUNCH();
}

void combine_forward_cuda(const CombineArgs& a, cudaStream_t stream) {
  check_combine(a);
  require(a.out != nullptr, "combine", "forward needs out");
  if (a.tokens == 0) return;
  dispatch_compute(a.dtype, "combine", [&](auto tag) {
    using T = decltype(tag);
    combine_forward_kernel<<<grid_for(a.tokens * a.hidden), kThreads, 0, stream>>>(
        static_cast<const T*>(a.y), a.weights, a.slot_to_row, static_cast<T*>(a.out), a.tokens,
        a.top_k, a.hidden);
  });
  FLATPEAK_CUDA_CHECK_LAUNCH();
}

void combine_backward_cuda(const CombineArgs& a, cudaStream_t stream) {
  check_combine(a);
  require(a.d_out && a.d_y && a.d_weights, "combine", "backward needs d_out, d_y and d_weights");
  const int64_t slots = a.tokens * a.top_k;
  require(slots <= 0x7fffffff, "combine", "tokens · top_k must be < 2^31 (one block per slot)");
  if (slots == 0) return;
  dispatch_compute(a.dtype, "combine", [&](auto tag) {
    using T = decltype(tag);
    combine_backward_kernel<<<static_cast<unsigned>(slots), 128, 0, stream>>>(
        static_cast<const T*>(a.y), a.weights, a.slot_to_row, static_cast<const T*>(a.d_out),
        static_cast<T*>(a.d_y), a.d_weights, a.top_k, a.hidden);
  });
  FLATPEAK_CUDA_CHECK_LAUNCH();
}

void linear_forward_cuda(const LinearArgs& a, const cuda::CublasContext& blas) {
  require(a.tokens >= 0 && a.in_features > 0 && a.out_features > 0, "linear",
          "tokens must be >= 0 and features > 0");
  require(a.x && a.w && a.y, "linear", "forward needs x, w and y");
  dispatch_compute(a.dtype, "linear", [](auto) {});
  cuda::gemm_cuda(blas, false, true, a.tokens, a.out_features, a.in_features, 1.0f, a.dtype, a.x,
                  a.in_features, a.dtype, a.w, a.in_features, false, a.dtype, a.y, a.out_features);
}

void linear_backward_cuda(const LinearArgs& a, const cuda::CublasContext& blas) {
  require(a.tokens >= 0 && a.in_features > 0 && a.out_features > 0, "linear",
          "tokens must be >= 0 and features > 0");
  require(a.d_y != nullptr, "linear", "backward needs d_y");
  dispatch_compute(a.dtype, "linear", [](auto) {});
  if (a.d_x != nullptr) {
    require(a.w != nullptr, "linear", "d_x needs w");
    cuda::gemm_cuda(blas, false, false, a.tokens, a.in_features, a.out_features, 1.0f, a.dtype,
                    a.d_y, a.out_features, a.dtype, a.w, a.in_features, false, a.dtype, a.d_x,
                    a.in_features);
  }
  if (a.d_w != nullptr) {
    require(a.x != nullptr, "linear", "d_w needs x");
    cuda::gemm_cuda(blas, true, false, a.out_features, a.in_features, a.tokens, 1.0f, a.dtype,
                    a.d_y, a.out_features, a.dtype, a.x, a.in_features, true, a.dtype, a.d_w,
                    a.in_features);
  }
}

}  // namespace flatpeak::exec
