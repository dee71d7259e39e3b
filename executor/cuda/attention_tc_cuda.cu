// Launchers of the tensor-core attention kernels (attention_tc_kernels.cuh): the 16-byte load path
// where every input is aligned; the shared-memory opt-in, the grids and a check after every launch
// are the header's launch functions.
#include <cstdint>

#include "executor/cuda/attention_tc_cuda.h"
#include "executor/cuda/attention_tc_kernels.cuh"
#include "executor/cuda/cuda_check.h"

namespace flatpeak::exec::cuda_detail {
namespace {

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

int64_t attention_forward_tc_shared_bytes(int64_t head_dim) { return ForwardSmem(head_dim).bytes; }
int64_t attention_dkv_tc_shared_bytes(int64_t head_dim) { return DkvSmem(head_dim).bytes; }
int64_t attention_dq_tc_shared_bytes(int64_t head_dim) { return DqSmem(head_dim).bytes; }
int64_t attention_tc_shared_bytes(int64_t head_dim) {
  const int64_t f = attention_forward_tc_shared_bytes(head_dim);
  const int64_t kv = attention_dkv_tc_shared_bytes(head_dim);
  const int64_t q = attention_dq_tc_shared_bytes(head_dim);
  return f > kv ? (f > q ? f : q) : (kv > q ? kv : q);
}

int64_t device_shared_bytes_per_block_optin() {
  int device = 0;
  int bytes = 0;
  FLATPEAK_CUDA_CHECK(cudaGetDevice(&device));
  FLATPEAK_CUDA_CHECK(cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  return bytes;
}

void attention_forward_tc(const AttentionArgs& a, float scale, cudaStream_t stream) {
  const Bf16* q = static_cast<const Bf16*>(a.q);
  const Bf16* k = static_cast<const Bf16*>(a.k);
  const Bf16* v = static_cast<const Bf16*>(a.v);
  const bool vec16 = aligned16(q) && aligned16(k) && aligned16(v);
  launch_attention_forward_tc(q, k, v, static_cast<Bf16*>(a.out), a.lse, a.tokens, a.q_heads,
                              a.kv_heads, a.head_dim, scale, vec16, stream);
}

void attention_backward_tc(const AttentionArgs& a, const float* delta, float scale,
                           cudaStream_t stream) {
  const Bf16* q = static_cast<const Bf16*>(a.q);
  const Bf16* k = static_cast<const Bf16*>(a.k);
  const Bf16* v = static_cast<const Bf16*>(a.v);
  const Bf16* d_out = static_cast<const Bf16*>(a.d_out);
  const bool vec16 = aligned16(q) && aligned16(k) && aligned16(v) && aligned16(d_out);
  launch_attention_backward_tc(q, k, v, d_out, a.lse, delta, static_cast<Bf16*>(a.d_q),
                               static_cast<Bf16*>(a.d_k), static_cast<Bf16*>(a.d_v), a.tokens,
                               a.q_heads, a.kv_heads, a.head_dim, scale, vec16, stream);
}

}  // namespace flatpeak::exec::cuda_detail
