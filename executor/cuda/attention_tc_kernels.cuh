// Tiled causal GQA attention on tensor cores (nvcuda::wmma 16x16x16, bf16 operands, fp32
// accumulation; sm_80+), the flash-attention scheme with the CPU twin's numerics where it matters:
// scores and their softmax in fp32 (the shared online_softmax_rescale), lse [a, T] from the fp32
// probabilities; only the operands of the second GEMM of each pair (P, dS) are rounded to bf16.
// Blocks of 4 warps; each warp owns 16 rows of a 64-row tile, so the softmax and the fp32
// accumulators (kept in shared memory: the WMMA accumulator layout is unspecified, and the
// per-row rescale needs rows) are the warp's own and need only __syncwarp; K/V (forward, dQ) or
// Q/dO (dK/dV) tiles are shared by the block and guarded by __syncthreads.
//   forward: block (query tile, head), key tiles up to the diagonal.
//   dK, dV:  block (key tile, kv head), every head of the group, query tiles from the diagonal.
//   dQ:      block (query tile, head), key tiles up to the diagonal. No atomics, no extra memory.
// Rows past T load as zeros and are never written; offsets are 64-bit.
// This header holds the kernels, their shared-memory layouts and their launches (internal to
// executor/cuda): attention_tc_cuda.cu calls the launch functions at the end;
// tests/unit/executor_attention_tc_emulation_test.cpp runs the same ones on the host
// (FLATPEAK_CUDA_EMULATION, tests/unit/cuda_emulation.h), so the grids, shared-memory sizes,
// tiling, masking and barrier logic are checked against the CPU op without a GPU.
//   #include "executor/cuda/attention_tc_kernels.cuh"
//   launch_attention_forward_tc(q, k, v, out, lse, T, a, g, d, scale, vec16, stream);
#pragma once

#ifndef FLATPEAK_CUDA_EMULATION
#include <cuda_bf16.h>
#include <mma.h>
#define FLATPEAK_UNROLL _Pragma("unroll")
#define FLATPEAK_TC_SHARED(name) extern __shared__ __align__(128) unsigned char name[]
#endif

#include <cmath>
#include <cstdint>

#include "executor/cuda/kernel_util.cuh"
#include "executor/ops/attention.h"

// One translation unit per binary includes this header (the kernels have internal linkage).
namespace flatpeak::exec::cuda_detail {
namespace {

namespace wmma = nvcuda::wmma;
using bf16 = __nv_bfloat16;

constexpr int kTile = 64;             // query rows per query tile = keys per key tile
constexpr int kWarps = 4;             // warp w owns tile rows [16w, 16w + 16)
constexpr int kTcThreads = kWarps * 32;
constexpr int kFrag = 16;             // WMMA m = n = k
constexpr int64_t kBf16Pad = 8;       // row padding of bf16 tiles: ldm stays a multiple of 8
constexpr int64_t kF32Pad = 4;        // of fp32 tiles: ldm a multiple of 4
constexpr int64_t kScoreLd = kTile + kF32Pad;  // 68: fp32 [64, 64] score tiles
constexpr int64_t kProbLd = kTile + kBf16Pad;  // 72: bf16 [64, 64] P / dS tiles
constexpr int64_t kRegionAlign = 128;  // every region (WMMA needs 32 bytes; uint4 stores 16)

using FragA = wmma::fragment<wmma::matrix_a, kFrag, kFrag, kFrag, bf16, wmma::row_major>;
using FragBRow = wmma::fragment<wmma::matrix_b, kFrag, kFrag, kFrag, bf16, wmma::row_major>;
using FragBCol = wmma::fragment<wmma::matrix_b, kFrag, kFrag, kFrag, bf16, wmma::col_major>;
using FragC = wmma::fragment<wmma::accumulator, kFrag, kFrag, kFrag, float>;

// Leading dimensions (elements). With d a multiple of 16, every 16-row block of a tile starts on
// a 32-byte boundary: 16·(d+8)·2, 16·(d+4)·4, 16·68·4 and 16·72·2 bytes are multiples of 32,
// and so are the 16-column offsets (32 or 64 bytes).
__host__ __device__ inline int64_t bf16_ld(int64_t d) { return d + kBf16Pad; }
__host__ __device__ inline int64_t f32_ld(int64_t d) { return d + kF32Pad; }
__host__ __device__ inline int64_t bf16_tile_bytes(int64_t d) { return kTile * bf16_ld(d) * 2; }
__host__ __device__ inline int64_t f32_tile_bytes(int64_t d) { return kTile * f32_ld(d) * 4; }
constexpr int64_t kScoreBytes = kTile * kScoreLd * 4;  // fp32 [64, 68]
constexpr int64_t kProbBytes = kTile * kProbLd * 2;    // bf16 [64, 72]
constexpr int64_t kRowBytes = kTile * 4;               // fp32 [64]

// Carves the dynamic shared memory into regions aligned to kRegionAlign, the same on host
// (size) and device (offsets).
struct Carve {
  int64_t bytes = 0;
  __host__ __device__ int64_t take(int64_t n) {
    const int64_t at = bytes;
    bytes += (n + kRegionAlign - 1) / kRegionAlign * kRegionAlign;
    return at;
  }
};

struct ForwardSmem {
  int64_t q, k, v, s, p, o, bytes;
  __host__ __device__ explicit ForwardSmem(int64_t d) {
    Carve c;
    q = c.take(bf16_tile_bytes(d));  // [64, d+8] bf16
    k = c.take(bf16_tile_bytes(d));  // [64, d+8] bf16
    v = c.take(bf16_tile_bytes(d));  // [64, d+8] bf16
    s = c.take(kScoreBytes);         // [64, 68] fp32 scores
    p = c.take(kProbBytes);          // [64, 72] bf16 probabilities
    o = c.take(f32_tile_bytes(d));   // [64, d+4] fp32 unnormalised output
    bytes = c.bytes;
  }
};

struct DkvSmem {
  int64_t k, v, q, d_o, st, pt, dst, dk, dv, lse, delta, bytes;
  __host__ __device__ explicit DkvSmem(int64_t d) {
    Carve c;
    k = c.take(bf16_tile_bytes(d));    // [64 keys, d+8] bf16
    v = c.take(bf16_tile_bytes(d));    // [64 keys, d+8] bf16
    q = c.take(bf16_tile_bytes(d));    // [64 queries, d+8] bf16
    d_o = c.take(bf16_tile_bytes(d));  // [64 queries, d+8] bf16
    st = c.take(kScoreBytes);          // [64 keys, 68] fp32 Sᵀ, then dPᵀ
    pt = c.take(kProbBytes);           // [64 keys, 72] bf16 Pᵀ
    dst = c.take(kProbBytes);          // [64 keys, 72] bf16 dSᵀ
    dk = c.take(f32_tile_bytes(d));    // [64 keys, d+4] fp32 dK (unscaled)
    dv = c.take(f32_tile_bytes(d));    // [64 keys, d+4] fp32 dV
    lse = c.take(kRowBytes);           // [64 queries] fp32
    delta = c.take(kRowBytes);         // [64 queries] fp32 D
    bytes = c.bytes;
  }
};

struct DqSmem {
  int64_t q, d_o, k, v, s, dp, ds, dq, bytes;
  __host__ __device__ explicit DqSmem(int64_t d) {
    Carve c;
    q = c.take(bf16_tile_bytes(d));    // [64 queries, d+8] bf16
    d_o = c.take(bf16_tile_bytes(d));  // [64 queries, d+8] bf16
    k = c.take(bf16_tile_bytes(d));    // [64 keys, d+8] bf16
    v = c.take(bf16_tile_bytes(d));    // [64 keys, d+8] bf16
    s = c.take(kScoreBytes);           // [64, 68] fp32 S
    dp = c.take(kScoreBytes);          // [64, 68] fp32 dP
    ds = c.take(kProbBytes);           // [64, 72] bf16 dS
    dq = c.take(f32_tile_bytes(d));    // [64, d+4] fp32 dQ (unscaled)
    bytes = c.bytes;
  }
};

// Rows [row0, row0 + 64) of head `head` of a [T, heads, d] bf16 tensor into a [64, d+8] tile;
// rows at or past T are zeros. vec16: every row start is 16-byte aligned (the base pointer is;
// d·2 bytes is a multiple of 32), so 8 elements move per load. All threads of the block take part.
__device__ void load_tile(const Bf16* src, int64_t tokens, int64_t heads, int64_t head, int64_t d,
                          int64_t row0, bf16* tile, bool vec16) {
  const int64_t ld = bf16_ld(d);
  if (vec16) {
    const int64_t chunks = d / 8;
    for (int64_t idx = threadIdx.x; idx < kTile * chunks; idx += blockDim.x) {
      const int64_t r = idx / chunks;
      const int64_t c = idx % chunks * 8;
      uint4 val = make_uint4(0u, 0u, 0u, 0u);
      if (row0 + r < tokens) {
        val = *reinterpret_cast<const uint4*>(src + ((row0 + r) * heads + head) * d + c);
      }
      *reinterpret_cast<uint4*>(tile + r * ld + c) = val;
    }
  } else {
    for (int64_t idx = threadIdx.x; idx < kTile * d; idx += blockDim.x) {
      const int64_t r = idx / d;
      const int64_t c = idx % d;
      const uint16_t bits = row0 + r < tokens ? src[((row0 + r) * heads + head) * d + c].bits
                                              : uint16_t{0};
      tile[r * ld + c] = __ushort_as_bfloat16(bits);
    }
  }
}

__device__ void zero_f32(float* p, int64_t n) {
  for (int64_t idx = threadIdx.x; idx < n; idx += blockDim.x) p[idx] = 0.0f;
}

// acc[16 rows of the warp, 64] = A[16, d] · Bᵀ where B is a [64, d] tile (row-major, ld): Bᵀ read
// as a col-major matrix_b. The warp's rows of `acc` (fp32, ld kScoreLd) are overwritten.
__device__ void rows_times_tile_t(const bf16* a_rows, const bf16* b_tile, int64_t ld, int64_t d,
                                  float* acc_rows) {
  for (int n = 0; n < kTile; n += kFrag) {
    FragC acc;
    wmma::fill_fragment(acc, 0.0f);
    for (int64_t kk = 0; kk < d; kk += kFrag) {
      FragA a;
      FragBCol b;
      wmma::load_matrix_sync(a, a_rows + kk, static_cast<unsigned>(ld));
      wmma::load_matrix_sync(b, b_tile + n * ld + kk, static_cast<unsigned>(ld));
      wmma::mma_sync(acc, a, b, acc);
    }
    wmma::store_matrix_sync(acc_rows + n, acc, static_cast<unsigned>(kScoreLd), wmma::mem_row_major);
  }
}

// acc[16 rows of the warp, d] += P[16, 64] · B where P is bf16 (ld kProbLd) and B a [64, d] tile
// (row-major, ld); acc is fp32 with ld f32_ld(d), read and written back.
__device__ void accumulate_rows_times_tile(const bf16* p_rows, const bf16* b_tile, int64_t ld,
                                           int64_t d, float* acc_rows) {
  const int64_t acc_ld = f32_ld(d);
  for (int64_t n = 0; n < d; n += kFrag) {
    FragC acc;
    wmma::load_matrix_sync(acc, acc_rows + n, static_cast<unsigned>(acc_ld), wmma::mem_row_major);
    for (int kk = 0; kk < kTile; kk += kFrag) {
      FragA a;
      FragBRow b;
      wmma::load_matrix_sync(a, p_rows + kk, static_cast<unsigned>(kProbLd));
      wmma::load_matrix_sync(b, b_tile + kk * ld + n, static_cast<unsigned>(ld));
      wmma::mma_sync(acc, a, b, acc);
    }
    wmma::store_matrix_sync(acc_rows + n, acc, static_cast<unsigned>(acc_ld), wmma::mem_row_major);
  }
}

// Each row of a warp's 16 belongs to a lane pair: lanes 2r and 2r+1 own row r, and of each row
// the elements c with c % 2 == half (interleaved, so the pair reads neighbouring banks).
struct LaneRow {
  int64_t warp_row0;  // first tile row of the warp
  int64_t row;        // tile row of this lane
  int half;           // 0 or 1
};
__device__ LaneRow lane_row() {
  const int64_t warp = threadIdx.x / 32;
  const int lane = static_cast<int>(threadIdx.x % 32);
  return {warp * kFrag, warp * kFrag + lane / 2, lane % 2};
}

__global__ void __launch_bounds__(kTcThreads)
    attention_forward_tc_kernel(const Bf16* q, const Bf16* k, const Bf16* v, Bf16* out, float* lse,
                                int64_t tokens, int64_t q_heads, int64_t kv_heads, int64_t d,
                                float scale, bool vec16) {
  FLATPEAK_TC_SHARED(smem);
  const ForwardSmem lay(d);
  bf16* q_tile = reinterpret_cast<bf16*>(smem + lay.q);  // [64, d+8]
  bf16* k_tile = reinterpret_cast<bf16*>(smem + lay.k);  // [64, d+8]
  bf16* v_tile = reinterpret_cast<bf16*>(smem + lay.v);  // [64, d+8]
  float* s_tile = reinterpret_cast<float*>(smem + lay.s);  // [64, 68]
  bf16* p_tile = reinterpret_cast<bf16*>(smem + lay.p);    // [64, 72]
  float* o_acc = reinterpret_cast<float*>(smem + lay.o);   // [64, d+4]
  const int64_t ld = bf16_ld(d);
  const int64_t o_ld = f32_ld(d);
  const int64_t q0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int64_t h = blockIdx.y;
  const int64_t kh = h / (q_heads / kv_heads);
  const LaneRow lr = lane_row();
  const int64_t i = q0 + lr.row;  // this lane's query row
  load_tile(q, tokens, q_heads, h, d, q0, q_tile, vec16);
  zero_f32(o_acc, kTile * o_ld);
  float row_max = -INFINITY;
  float row_sum = 0.0f;
  const int64_t key_end = q0 + kTile < tokens ? q0 + kTile : tokens;  // causal: up to the diagonal
  for (int64_t k0 = 0; k0 < key_end; k0 += kTile) {
    __syncthreads();  // every warp is done with the previous K, V tiles
    load_tile(k, tokens, kv_heads, kh, d, k0, k_tile, vec16);
    load_tile(v, tokens, kv_heads, kh, d, k0, v_tile, vec16);
    __syncthreads();  // K, V (and Q, the zeroed O on the first tile) visible to every warp
    rows_times_tile_t(q_tile + lr.warp_row0 * ld, k_tile, ld, d, s_tile + lr.warp_row0 * kScoreLd);
    __syncwarp();
    // Online softmax of row i over keys k0 + c; a key is valid when j <= i and j < T
    // (rows past T stay finite on zero queries and are never written). Key 0 is valid for every
    // row, so row_max is finite after the first tile.
    const float* s_row = s_tile + lr.row * kScoreLd;
    bf16* p_row = p_tile + lr.row * kProbLd;
    float block_max = -INFINITY;
    for (int c = lr.half; c < kTile; c += 2) {
      const int64_t j = k0 + c;
      if (j <= i && j < tokens) block_max = fmaxf(block_max, scale * s_row[c]);
    }
    block_max = fmaxf(block_max, __shfl_xor_sync(0xffffffffu, block_max, 1));
    const float new_max = fmaxf(row_max, block_max);
    const float rescale = online_softmax_rescale(row_max, new_max);
    float block_sum = 0.0f;
    for (int c = lr.half; c < kTile; c += 2) {
      const int64_t j = k0 + c;
      const float p = (j <= i && j < tokens) ? expf(scale * s_row[c] - new_max) : 0.0f;
      p_row[c] = __float2bfloat16_rn(p);
      block_sum += p;  // the fp32 probability: lse is not touched by P's rounding
    }
    block_sum += __shfl_xor_sync(0xffffffffu, block_sum, 1);
    row_sum = row_sum * rescale + block_sum;
    row_max = new_max;
    float* o_row = o_acc + lr.row * o_ld;
    for (int64_t c = lr.half; c < d; c += 2) o_row[c] *= rescale;
    __syncwarp();  // P and the rescaled O rows visible to the whole warp's fragments
    accumulate_rows_times_tile(p_tile + lr.warp_row0 * kProbLd, v_tile, ld, d,
                               o_acc + lr.warp_row0 * o_ld);
  }
  __syncwarp();  // the warp's last O fragments visible to its lanes
  if (i < tokens) {
    const float* o_row = o_acc + lr.row * o_ld;
    Bf16* dst = out + (i * q_heads + h) * d;
    for (int64_t c = lr.half; c < d; c += 2) store_f32(&dst[c], o_row[c] / row_sum);
    if (lr.half == 0) lse[h * tokens + i] = row_max + logf(row_sum);
  }
}

// dV[j] = Σ_h Σ_{i ≥ j} P_ij dO_i;  dK[j] = scale · Σ_h Σ_{i ≥ j} dS_ij Q_i, dS = P ⊙ (dP − D).
// The warp computes the transposed tiles (its 16 key rows against the 64 query columns).
__global__ void __launch_bounds__(kTcThreads)
    attention_dkv_tc_kernel(const Bf16* q, const Bf16* k, const Bf16* v, const Bf16* d_out,
                            const float* lse, const float* delta, Bf16* d_k, Bf16* d_v,
                            int64_t tokens, int64_t q_heads, int64_t kv_heads, int64_t d,
                            float scale, bool vec16) {
  FLATPEAK_TC_SHARED(smem);
  const DkvSmem lay(d);
  bf16* k_tile = reinterpret_cast<bf16*>(smem + lay.k);     // [64 keys, d+8]
  bf16* v_tile = reinterpret_cast<bf16*>(smem + lay.v);     // [64 keys, d+8]
  bf16* q_tile = reinterpret_cast<bf16*>(smem + lay.q);     // [64 queries, d+8]
  bf16* do_tile = reinterpret_cast<bf16*>(smem + lay.d_o);  // [64 queries, d+8]
  float* st = reinterpret_cast<float*>(smem + lay.st);      // [64 keys, 68] Sᵀ, then dPᵀ
  bf16* pt = reinterpret_cast<bf16*>(smem + lay.pt);        // [64 keys, 72] Pᵀ
  bf16* dst = reinterpret_cast<bf16*>(smem + lay.dst);      // [64 keys, 72] dSᵀ
  float* dk_acc = reinterpret_cast<float*>(smem + lay.dk);  // [64 keys, d+4]
  float* dv_acc = reinterpret_cast<float*>(smem + lay.dv);  // [64 keys, d+4]
  float* lse_tile = reinterpret_cast<float*>(smem + lay.lse);      // [64 queries]
  float* delta_tile = reinterpret_cast<float*>(smem + lay.delta);  // [64 queries]
  const int64_t ld = bf16_ld(d);
  const int64_t acc_ld = f32_ld(d);
  const int64_t j0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int64_t kh = blockIdx.y;
  const int64_t group = q_heads / kv_heads;
  const LaneRow lr = lane_row();
  const int64_t j = j0 + lr.row;  // this lane's key row
  load_tile(k, tokens, kv_heads, kh, d, j0, k_tile, vec16);
  load_tile(v, tokens, kv_heads, kh, d, j0, v_tile, vec16);
  zero_f32(dk_acc, kTile * acc_ld);
  zero_f32(dv_acc, kTile * acc_ld);
  for (int64_t h = kh * group; h < (kh + 1) * group; ++h) {
    for (int64_t i0 = j0; i0 < tokens; i0 += kTile) {  // causal: query tiles from the diagonal
      __syncthreads();  // every warp is done with the previous Q, dO, lse, D tiles
      load_tile(q, tokens, q_heads, h, d, i0, q_tile, vec16);
      load_tile(d_out, tokens, q_heads, h, d, i0, do_tile, vec16);
      for (int64_t r = threadIdx.x; r < kTile; r += blockDim.x) {
        const bool in = i0 + r < tokens;
        lse_tile[r] = in ? lse[h * tokens + i0 + r] : 0.0f;
        delta_tile[r] = in ? delta[h * tokens + i0 + r] : 0.0f;
      }
      __syncthreads();
      // Sᵀ and dPᵀ take turns in one fp32 tile (d = 64: 105.5 KiB, two blocks per SM); the
      // lane's 32 fp32 probabilities wait in registers in between.
      float* st_rows = st + lr.warp_row0 * kScoreLd;
      const float* st_row = st + lr.row * kScoreLd;
      bf16* p_row = pt + lr.row * kProbLd;
      bf16* ds_row = dst + lr.row * kProbLd;
      rows_times_tile_t(k_tile + lr.warp_row0 * ld, q_tile, ld, d, st_rows);
      __syncwarp();
      float p[kTile / 2];
FLATPEAK_UNROLL
      for (int m = 0; m < kTile / 2; ++m) {
        const int c = 2 * m + lr.half;
        const int64_t i = i0 + c;
        // j <= i < T; a key row past T fails j <= i for every valid query row
        p[m] = (i < tokens && j <= i) ? expf(scale * st_row[c] - lse_tile[c]) : 0.0f;
        p_row[c] = __float2bfloat16_rn(p[m]);
      }
      __syncwarp();  // every lane has read its Sᵀ before dPᵀ overwrites it
      rows_times_tile_t(v_tile + lr.warp_row0 * ld, do_tile, ld, d, st_rows);
      __syncwarp();
FLATPEAK_UNROLL
      for (int m = 0; m < kTile / 2; ++m) {
        const int c = 2 * m + lr.half;
        ds_row[c] = __float2bfloat16_rn(p[m] * (st_row[c] - delta_tile[c]));
      }
      __syncwarp();  // Pᵀ, dSᵀ visible to the whole warp's fragments
      accumulate_rows_times_tile(pt + lr.warp_row0 * kProbLd, do_tile, ld, d,
                                 dv_acc + lr.warp_row0 * acc_ld);
      accumulate_rows_times_tile(dst + lr.warp_row0 * kProbLd, q_tile, ld, d,
                                 dk_acc + lr.warp_row0 * acc_ld);
    }
  }
  __syncwarp();  // the warp's last dK, dV fragments visible to its lanes
  if (j < tokens) {
    const float* dk_row = dk_acc + lr.row * acc_ld;
    const float* dv_row = dv_acc + lr.row * acc_ld;
    Bf16* dk_dst = d_k + (j * kv_heads + kh) * d;
    Bf16* dv_dst = d_v + (j * kv_heads + kh) * d;
    for (int64_t c = lr.half; c < d; c += 2) {
      store_f32(&dk_dst[c], scale * dk_row[c]);
      store_f32(&dv_dst[c], dv_row[c]);
    }
  }
}

// dQ[i] = scale · Σ_{j ≤ i} dS_ij K_j.
__global__ void __launch_bounds__(kTcThreads)
    attention_dq_tc_kernel(const Bf16* q, const Bf16* k, const Bf16* v, const Bf16* d_out,
                           const float* lse, const float* delta, Bf16* d_q, int64_t tokens,
                           int64_t q_heads, int64_t kv_heads, int64_t d, float scale, bool vec16) {
  FLATPEAK_TC_SHARED(smem);
  const DqSmem lay(d);
  bf16* q_tile = reinterpret_cast<bf16*>(smem + lay.q);     // [64 queries, d+8]
  bf16* do_tile = reinterpret_cast<bf16*>(smem + lay.d_o);  // [64 queries, d+8]
  bf16* k_tile = reinterpret_cast<bf16*>(smem + lay.k);     // [64 keys, d+8]
  bf16* v_tile = reinterpret_cast<bf16*>(smem + lay.v);     // [64 keys, d+8]
  float* s_tile = reinterpret_cast<float*>(smem + lay.s);   // [64, 68]
  float* dp_tile = reinterpret_cast<float*>(smem + lay.dp); // [64, 68]
  bf16* ds_tile = reinterpret_cast<bf16*>(smem + lay.ds);   // [64, 72]
  float* dq_acc = reinterpret_cast<float*>(smem + lay.dq);  // [64, d+4]
  const int64_t ld = bf16_ld(d);
  const int64_t acc_ld = f32_ld(d);
  const int64_t i0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int64_t h = blockIdx.y;
  const int64_t kh = h / (q_heads / kv_heads);
  const LaneRow lr = lane_row();
  const int64_t i = i0 + lr.row;  // this lane's query row
  const float lse_i = i < tokens ? lse[h * tokens + i] : 0.0f;
  const float delta_i = i < tokens ? delta[h * tokens + i] : 0.0f;
  load_tile(q, tokens, q_heads, h, d, i0, q_tile, vec16);
  load_tile(d_out, tokens, q_heads, h, d, i0, do_tile, vec16);
  zero_f32(dq_acc, kTile * acc_ld);
  const int64_t key_end = i0 + kTile < tokens ? i0 + kTile : tokens;
  for (int64_t k0 = 0; k0 < key_end; k0 += kTile) {
    __syncthreads();  // every warp is done with the previous K, V tiles
    load_tile(k, tokens, kv_heads, kh, d, k0, k_tile, vec16);
    load_tile(v, tokens, kv_heads, kh, d, k0, v_tile, vec16);
    __syncthreads();
    rows_times_tile_t(q_tile + lr.warp_row0 * ld, k_tile, ld, d, s_tile + lr.warp_row0 * kScoreLd);
    rows_times_tile_t(do_tile + lr.warp_row0 * ld, v_tile, ld, d, dp_tile + lr.warp_row0 * kScoreLd);
    __syncwarp();
    const float* s_row = s_tile + lr.row * kScoreLd;
    const float* dp_row = dp_tile + lr.row * kScoreLd;
    bf16* ds_row = ds_tile + lr.row * kProbLd;
    for (int c = lr.half; c < kTile; c += 2) {
      const int64_t j = k0 + c;
      const float p = (i < tokens && j <= i) ? expf(scale * s_row[c] - lse_i) : 0.0f;
      ds_row[c] = __float2bfloat16_rn(p * (dp_row[c] - delta_i));
    }
    __syncwarp();  // dS visible to the whole warp's fragments
    accumulate_rows_times_tile(ds_tile + lr.warp_row0 * kProbLd, k_tile, ld, d,
                               dq_acc + lr.warp_row0 * acc_ld);
  }
  __syncwarp();
  if (i < tokens) {
    const float* dq_row = dq_acc + lr.row * acc_ld;
    Bf16* dst = d_q + (i * q_heads + h) * d;
    for (int64_t c = lr.half; c < d; c += 2) store_f32(&dst[c], scale * dq_row[c]);
  }
}

// ---- launches (attention_tc_cuda.cu's: T < 2^31, heads <= 65535 checked by the caller) ----

template <class Kernel>
void allow_tc_shared(Kernel kernel, int64_t bytes) {
#ifdef FLATPEAK_CUDA_EMULATION
  (void)kernel;
  (void)bytes;
#else
  if (bytes > 48 * 1024) {  // above the default limit a kernel must opt in (H200: 227 KiB)
    FLATPEAK_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             static_cast<int>(bytes)));
  }
#endif
}

inline dim3 tile_grid(int64_t tokens, int64_t heads) {
  // tiles in x (up to 2^31 − 1; T < 2^31 is checked by the caller), heads in y (<= 65535)
  return dim3(static_cast<unsigned>((tokens + kTile - 1) / kTile), static_cast<unsigned>(heads));
}

// Grid (query tiles, a). vec16: every input 16-byte aligned (the 16-byte load path).
inline void launch_attention_forward_tc(const Bf16* q, const Bf16* k, const Bf16* v, Bf16* out,
                                        float* lse, int64_t tokens, int64_t q_heads,
                                        int64_t kv_heads, int64_t head_dim, float scale,
                                        bool vec16, cudaStream_t stream) {
  const int64_t bytes = ForwardSmem(head_dim).bytes;
  allow_tc_shared(attention_forward_tc_kernel, bytes);
  FLATPEAK_LAUNCH(attention_forward_tc_kernel, tile_grid(tokens, q_heads), kTcThreads,
                  static_cast<size_t>(bytes), stream, q, k, v, out, lse, tokens, q_heads,
                  kv_heads, head_dim, scale, vec16);
}

// After the delta D [a, T]: dK/dV on grid (key tiles, g), then dQ on grid (query tiles, a).
inline void launch_attention_backward_tc(const Bf16* q, const Bf16* k, const Bf16* v,
                                         const Bf16* d_out, const float* lse, const float* delta,
                                         Bf16* d_q, Bf16* d_k, Bf16* d_v, int64_t tokens,
                                         int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                                         float scale, bool vec16, cudaStream_t stream) {
  const int64_t dkv_bytes = DkvSmem(head_dim).bytes;
  allow_tc_shared(attention_dkv_tc_kernel, dkv_bytes);
  FLATPEAK_LAUNCH(attention_dkv_tc_kernel, tile_grid(tokens, kv_heads), kTcThreads,
                  static_cast<size_t>(dkv_bytes), stream, q, k, v, d_out, lse, delta, d_k, d_v,
                  tokens, q_heads, kv_heads, head_dim, scale, vec16);
  const int64_t dq_bytes = DqSmem(head_dim).bytes;
  allow_tc_shared(attention_dq_tc_kernel, dq_bytes);
  FLATPEAK_LAUNCH(attention_dq_tc_kernel, tile_grid(tokens, q_heads), kTcThreads,
                  static_cast<size_t>(dq_bytes), stream, q, k, v, d_out, lse, delta, d_q, tokens,
                  q_heads, kv_heads, head_dim, scale, vec16);
}

}  // namespace
}  // namespace flatpeak::exec::cuda_detail
