// CUDA twins of the MoE data movement (routing plan, permute/unpermute, combine) and of the
// linear projection (executor/cpu/{permute,combine,linear}_cpu.cpp).
#include <cstdint>
#include <limits>

#include "executor/cpu/op_util.h"
#include "executor/cuda/cuda_check.h"
#include "executor/cuda/kernel_util.cuh"
#include "executor/cuda/moe_kernels.cuh"
#include "executor/cuda/ops_cuda.h"

namespace flatpeak::exec {
namespace {

// The launch sequences (moe_kernels.cuh).
using cuda_detail::launch_combine_backward;
using cuda_detail::launch_combine_forward;
using cuda_detail::launch_moe_route;
using cuda_detail::launch_permute_backward;
using cuda_detail::launch_permute_forward;
using cuda_detail::launch_unpermute_backward;
using cuda_detail::launch_unpermute_forward;

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
  // slot_to_row and row_to_slot hold int32 rows and slots, the routing's first rows included.
  require(a.tokens <= std::numeric_limits<int32_t>::max() / a.top_k, "permute",
          "routing needs tokens * top_k < 2^31 (int32 rows)");
  launch_moe_route(a.topk_ids, a.tokens * a.top_k, a.experts, a.expert_counts, a.slot_to_row,
                   a.row_to_slot, stream);
}

void permute_forward_cuda(const PermuteArgs& a, cudaStream_t stream) {
  check_permute(a);
  require(a.x && a.x_perm, "permute", "forward needs x and x_perm");
  const int64_t rows = a.tokens * a.top_k;
  if (rows == 0) return;
  dispatch_compute(a.dtype, "permute", [&](auto tag) {
    using T = decltype(tag);
    launch_permute_forward(static_cast<const T*>(a.x), a.row_to_slot, static_cast<T*>(a.x_perm),
                           a.tokens, a.top_k, a.hidden, stream);
  });
}

void permute_backward_cuda(const PermuteArgs& a, cudaStream_t stream) {
  check_permute(a);
  require(a.d_x_perm && a.d_x, "permute", "backward needs d_x_perm and d_x");
  if (a.tokens == 0) return;
  dispatch_compute(a.dtype, "permute", [&](auto tag) {
    using T = decltype(tag);
    launch_permute_backward(static_cast<const T*>(a.d_x_perm), a.slot_to_row,
                            static_cast<T*>(a.d_x), a.tokens, a.top_k, a.hidden, stream);
  });
}

void unpermute_forward_cuda(const PermuteArgs& a, cudaStream_t stream) {
  check_permute(a);
  require(a.y_perm && a.y_slots, "permute", "unpermute needs y_perm and y_slots");
  const int64_t rows = a.tokens * a.top_k;
  if (rows == 0) return;
  dispatch_compute(a.dtype, "permute", [&](auto tag) {
    using T = decltype(tag);
    launch_unpermute_forward(static_cast<const T*>(a.y_perm), a.slot_to_row,
                             static_cast<T*>(a.y_slots), a.tokens, a.top_k, a.hidden, stream);
  });
}

void unpermute_backward_cuda(const PermuteArgs& a, cudaStream_t stream) {
  check_permute(a);
  require(a.d_y_slots && a.d_y_perm, "permute", "unpermute backward needs d_y_slots and d_y_perm");
  const int64_t rows = a.tokens * a.top_k;
  if (rows == 0) return;
  dispatch_compute(a.dtype, "permute", [&](auto tag) {
    using T = decltype(tag);
    launch_unpermute_backward(static_cast<const T*>(a.d_y_slots), a.row_to_slot,
                              static_cast<T*>(a.d_y_perm), a.tokens, a.top_k, a.hidden, stream);
  });
}

void combine_forward_cuda(const CombineArgs& a, cudaStream_t stream) {
  check_combine(a);
  require(a.out != nullptr, "combine", "forward needs out");
  if (a.tokens == 0) return;
  dispatch_compute(a.dtype, "combine", [&](auto tag) {
    using T = decltype(tag);
    launch_combine_forward(static_cast<const T*>(a.y), a.weights, a.slot_to_row,
                           static_cast<T*>(a.out), a.tokens, a.top_k, a.hidden, stream);
  });
}

void combine_backward_cuda(const CombineArgs& a, cudaStream_t stream) {
  check_combine(a);
  require(a.d_out && a.d_y && a.d_weights, "combine", "backward needs d_out, d_y and d_weights");
  const int64_t slots = a.tokens * a.top_k;
  require(slots <= 0x7fffffff, "combine", "tokens · top_k must be < 2^31 (one block per slot)");
  if (slots == 0) return;
  dispatch_compute(a.dtype, "combine", [&](auto tag) {
    using T = decltype(tag);
    launch_combine_backward(static_cast<const T*>(a.y), a.weights, a.slot_to_row,
                            static_cast<const T*>(a.d_out), static_cast<T*>(a.d_y), a.d_weights,
                            a.tokens, a.top_k, a.hidden, stream);
  });
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
