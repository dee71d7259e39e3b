// Launchers of the tensor-core attention kernels (attention_tc_kernels.cuh): the shared-memory
// opt-in, the 16-byte load path where every input is aligned, the grids, a check after every launch.
#include <cstdint>

#include "executor/cuda/attention_tc_cuda.h"
#include "executor/cuda/attention_tc_kernels.cuh"
#include "executor/cuda/cuda_check.h"

namespace flatpeak::exec::cuda_detail {
namespace {

template <class Kernel>
void allow_shared(Kernel kernel, int64_t bytes) {
  if (bytes > 48 * 1024) {  // above the default limit a kernel must opt in (H200: 227 KiB)
    FLATPEAK_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             static_cast<int>(bytes)));
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

dim3 tile_grid(int64_t tokens, int64_t heads) {
  // tiles in x (up to 2^31 − 1; T < 2^31 is checked by the caller), heads in y (<= 65535)
  return dim3(static_cast<unsigned>((tokens + kTile - 1) / kTile), static_cast<unsigned>(heads));
}

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
  const int64_t bytes = attention_forward_tc_shared_bytes(a.head_dim);
  allow_shared(attention_forward_tc_kernel, bytes);
  attention_forward_tc_kernel<<<tile_grid(a.tokens, a.q_heads), kTcThreads,
                                static_cast<size_t>(bytes), stream>>>(
      q, k, v, static_cast<Bf16*>(a.out), a.lse, a.tokens, a.q_heads, a.kv_heads, a.head_dim,
      scale, vec16);
  FLATPEAK_CUDA_CHECK_LAUNCH();
}

void attention_backward_tc(const AttentionArgs& a, const float* delta, float scale,
                           cudaStream_t stream) {
  const Bf16* q = static_cast<const Bf16*>(a.q);
  const Bf16* k = static_cast<const Bf16*>(a.k);
  const Bf16* v = static_cast<const Bf16*>(a.v);
  const Bf16* d_out = static_cast<const Bf16*>(a.d_out);
  const bool vec16 = aligned16(q) && aligned16(k) && aligned16(v) && aligned16(d_out);
  const int64_t dkv_bytes = attention_dkv_tc_shared_bytes(a.head_dim);
  allow_shared(attention_dkv_tc_kernel, dkv_bytes);
  attention_dkv_tc_kernel<<<tile_grid(a.tokens, a.kv_heads), kTcThreads,
                            static_cast<size_t>(dkv_bytes), stream>>>(
      q, k, v, d_out, a.lse, delta, static_cast<Bf16*>(a.d_k), static_cast<Bf16*>(a.d_v),
      a.tokens, a.q_heads, a.kv_heads, a.head_dim, scale, vec16);
  FLATPEAK_CUDA_CHECK_LAUNCH();
  const int64_t dq_bytes = attention_dq_tc_shared_bytes(a.head_dim);
  allow_shared(attention_dq_tc_kernel, dq_bytes);
  attention_dq_tc_kernel<<<tile_grid(a.tokens, a.q_heads), kTcThreads,
                           static_cast<size_t>(dq_bytes), stream>>>(
      q, k, v, d_out, a.lse, delta, static_cast<Bf16*>(a.d_q), a.tokens, a.q_heads, a.kv_heads,
      a.head_dim, scale, vec16);
  FLATPEAK_CUDA_CHECK_LAUNCH();
}

}  // namespace flatpeak::exec::cuda_detail
