// The kernels of the MoE data movement (internal to executor/cuda): the routing plan (a stable
// counting sort by expert: one block for a few thousand copies, else four launches over chunks),
// the row gathers of permute / unpermute, the k-slot sum of permute backward, and combine forward /
// backward (optionally through slot_to_row, the fused unpermute). moe_cuda.cu runs the launch
// sequences at the end; tests/unit/executor_moe_emulation_test.cpp runs the same ones on the host
// (FLATPEAK_CUDA_EMULATION, tests/unit/cuda_emulation.h) against the CPU ops
// (executor/cpu/{permute,combine}_cpu.cpp), without a GPU.
//   #include "executor/cuda/moe_kernels.cuh"
//   launch_permute_forward(x, row_to_slot, x_perm, tokens, top_k, hidden, stream);
#pragma once

#include <cstdint>

#include "executor/cuda/kernel_util.cuh"
#include "executor/ops/dtype.h"

// One translation unit per binary includes this header (the kernels have internal linkage).
namespace flatpeak::exec::cuda_detail {
namespace {

// ---- routing plan ------------------------------------------------------------------------

// Out-of-range ids (the CPU refuses them; callers check that the counts add up): their slots
// map to row -1, and the rows left over at the end hold slot -1, in both forms below.

// One block. Each thread owns experts e ≡ threadIdx.x (mod blockDim.x): counts its copies,
// then (after one thread turns counts into first rows) walks the copies in (token, slot) order
// and hands out its rows, which is the CPU's stable counting sort. expert_counts holds first
// rows in between, as on the CPU.
__global__ void __launch_bounds__(1024)
    moe_route_kernel(const int32_t* topk_ids, int64_t copies, int64_t experts,
                     int64_t* expert_counts, int32_t* slot_to_row, int32_t* row_to_slot) {
  for (int64_t i = threadIdx.x; i < copies; i += blockDim.x) {
    row_to_slot[i] = -1;
    if (topk_ids[i] < 0 || topk_ids[i] >= experts) slot_to_row[i] = -1;
  }
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

// Past one chunk of copies the single block above is slow (each expert's thread reads every copy
// twice: ~8M loads each at T·k = 4M), so the same sort runs over chunks of the copies, in four
// launches and without memory of its own:
//   1 count    per chunk c, its copies of expert e -> table[e·chunks + c]; row_to_slot := -1
//   2 scan     one block: the exclusive prefix sum of the table in (expert, chunk) order, which
//              is the first row of chunk c's copies of e; expert_counts[e] = e's copies
//   3 scatter  per chunk, a tile of copies at a time in slot order: row_to_slot[row] = slot, the
//              row advanced by the tile's earlier copies of the same expert (so stable)
//   4 invert   slot_to_row[row_to_slot[r]] = r
// The table lives in slot_to_row until step 4 overwrites it: experts·chunks <= copies holds when
// a chunk holds at least 2·experts copies and there are two chunks or more (route_chunk_for).
constexpr int64_t kRouteChunk = 4096;       // copies per chunk (at least 2·experts)
constexpr int64_t kRouteMaxExperts = 8192;  // the scatter's shared memory: 4 B per expert + a tile
constexpr int kRouteCountThreads = 256;
constexpr int kRouteTile = 128;             // the scatter's block: copies ranked together
constexpr int kRouteScanThreads = 1024;

__global__ void moe_route_count_kernel(const int32_t* topk_ids, int64_t copies, int64_t experts,
                                       int64_t chunk, int64_t chunks, int32_t* table,
                                       int32_t* row_to_slot) {
  FLATPEAK_DYNAMIC_SHARED(int32_t, counts);  // [experts]
  for (int64_t e = threadIdx.x; e < experts; e += blockDim.x) counts[e] = 0;
  __syncthreads();
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * chunk;
  const int64_t end = begin + chunk < copies ? begin + chunk : copies;
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    const int32_t e = topk_ids[i];
    if (e >= 0 && e < experts) atomicAdd(&counts[e], 1);
    row_to_slot[i] = -1;  // a row no copy takes (out-of-range ids) stays -1; step 4 skips it
  }
  __syncthreads();
  for (int64_t e = threadIdx.x; e < experts; e += blockDim.x) table[e * chunks + blockIdx.x] = counts[e];
}

// One block: each thread sums a run of the table, thread 0 scans the runs' sums, each thread
// rewrites its run as first rows; then every expert's total from its first rows.
__global__ void __launch_bounds__(kRouteScanThreads)
    moe_route_scan_kernel(int32_t* table, int64_t experts, int64_t chunks, int64_t* expert_counts) {
  __shared__ int64_t run_start[kRouteScanThreads];
  __shared__ int64_t total;  // every copy with an expert in range
  const int64_t n = experts * chunks;
  const int64_t per_thread = (n + blockDim.x - 1) / blockDim.x;
  const int64_t lo = threadIdx.x * per_thread < n ? threadIdx.x * per_thread : n;
  const int64_t hi = lo + per_thread < n ? lo + per_thread : n;
  int64_t sum = 0;
  for (int64_t i = lo; i < hi; ++i) sum += table[i];
  run_start[threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.x == 0) {
    int64_t next = 0;
    for (unsigned t = 0; t < blockDim.x; ++t) {
      const int64_t run = run_start[t];
      run_start[t] = next;
      next += run;
    }
    total = next;
  }
  __syncthreads();
  int64_t row = run_start[threadIdx.x];
  for (int64_t i = lo; i < hi; ++i) {
    const int64_t count = table[i];
    table[i] = static_cast<int32_t>(row);
    row += count;
  }
  __syncthreads();
  for (int64_t e = threadIdx.x; e < experts; e += blockDim.x) {
    const int64_t end = e + 1 < experts ? table[(e + 1) * chunks] : total;
    expert_counts[e] = end - table[e * chunks];
  }
}

__global__ void moe_route_scatter_kernel(const int32_t* topk_ids, int64_t copies, int64_t experts,
                                         int64_t chunk, int64_t chunks, const int32_t* table,
                                         int32_t* row_to_slot) {
  FLATPEAK_DYNAMIC_SHARED(int32_t, shared);
  int32_t* next_row = shared;            // [experts]: this chunk's next row of each expert
  int32_t* tile_ids = shared + experts;  // [blockDim.x]: the tile's experts (-1: none)
  for (int64_t e = threadIdx.x; e < experts; e += blockDim.x) next_row[e] = table[e * chunks + blockIdx.x];
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * chunk;
  const int64_t end = begin + chunk < copies ? begin + chunk : copies;
  for (int64_t base = begin; base < end; base += blockDim.x) {
    const int64_t i = base + threadIdx.x;
    const int32_t id = i < end ? topk_ids[i] : -1;
    const int32_t e = id >= 0 && id < experts ? id : -1;
    tile_ids[threadIdx.x] = e;
    __syncthreads();  // the tile, and the previous tile's next_row updates
    int32_t rank = 0;  // the tile's earlier copies of e
    bool last = true;  // no later copy of e in the tile
    for (unsigned j = 0; j < blockDim.x; ++j) {
      if (tile_ids[j] != e) continue;
      if (j < threadIdx.x) ++rank;
      if (j > threadIdx.x) last = false;
    }
    if (e >= 0) row_to_slot[next_row[e] + rank] = static_cast<int32_t>(i);
    __syncthreads();  // every read of next_row and tile_ids done
    if (e >= 0 && last) next_row[e] += rank + 1;
  }
}

// Row r's slot gets r; a slot with an out-of-range id (in no row) gets -1. The two writes never
// meet: such a slot is in no row.
__global__ void moe_route_invert_kernel(const int32_t* topk_ids, const int32_t* row_to_slot,
                                        int32_t* slot_to_row, int64_t copies, int64_t experts) {
  for (int64_t r = global_thread(); r < copies; r += grid_threads()) {
    const int32_t slot = row_to_slot[r];
    if (slot >= 0) slot_to_row[slot] = static_cast<int32_t>(r);
    if (topk_ids[r] < 0 || topk_ids[r] >= experts) slot_to_row[r] = -1;
  }
}

// The chunk the four-launch sort uses (at least 2·experts copies), or 0 for the single block:
// every copy in one chunk, or more experts than the scatter's shared memory holds.
inline int64_t route_chunk_for(int64_t copies, int64_t experts, int64_t wanted_chunk) {
  const int64_t chunk = wanted_chunk > 2 * experts ? wanted_chunk : 2 * experts;
  return copies > chunk && experts <= kRouteMaxExperts ? chunk : 0;
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

// ---- launch sequences (moe_cuda.cu's, after its argument checks) ---------------------------

// wanted_chunk: kRouteChunk, or smaller in a test (so that a few copies span several chunks).
inline void launch_moe_route(const int32_t* topk_ids, int64_t copies, int64_t experts,
                             int64_t* expert_counts, int32_t* slot_to_row, int32_t* row_to_slot,
                             cudaStream_t stream, int64_t wanted_chunk = kRouteChunk) {
  const int64_t chunk = route_chunk_for(copies, experts, wanted_chunk);
  if (chunk == 0) {
    FLATPEAK_LAUNCH(moe_route_kernel, 1, 1024, 0, stream, topk_ids, copies, experts, expert_counts,
                    slot_to_row, row_to_slot);
    return;
  }
  const int64_t chunks = (copies + chunk - 1) / chunk;
  int32_t* table = slot_to_row;  // [experts, chunks], until the invert launch writes slot_to_row
  const size_t counts_bytes = static_cast<size_t>(experts) * sizeof(int32_t);
  FLATPEAK_LAUNCH(moe_route_count_kernel, chunks, kRouteCountThreads, counts_bytes, stream, topk_ids,
                  copies, experts, chunk, chunks, table, row_to_slot);
  FLATPEAK_LAUNCH(moe_route_scan_kernel, 1, kRouteScanThreads, 0, stream, table, experts, chunks,
                  expert_counts);
  FLATPEAK_LAUNCH(moe_route_scatter_kernel, chunks, kRouteTile,
                  counts_bytes + kRouteTile * sizeof(int32_t), stream, topk_ids, copies, experts,
                  chunk, chunks, static_cast<const int32_t*>(table), row_to_slot);
  FLATPEAK_LAUNCH(moe_route_invert_kernel, grid_for(copies), kThreads, 0, stream, topk_ids,
                  static_cast<const int32_t*>(row_to_slot), slot_to_row, copies, experts);
}

// x_perm [T·k, H] from x [T, H]: the row of copy row_to_slot[r] is token row_to_slot[r] / k.
template <class T>
void launch_permute_forward(const T* x, const int32_t* row_to_slot, T* x_perm, int64_t tokens,
                            int64_t top_k, int64_t hidden, cudaStream_t stream) {
  const int64_t rows = tokens * top_k;
  FLATPEAK_LAUNCH(gather_rows_kernel<T>, grid_for(rows * hidden), kThreads, 0, stream, x,
                  row_to_slot, top_k, x_perm, rows, hidden);
}

template <class T>
void launch_permute_backward(const T* d_x_perm, const int32_t* slot_to_row, T* d_x, int64_t tokens,
                             int64_t top_k, int64_t hidden, cudaStream_t stream) {
  FLATPEAK_LAUNCH(permute_backward_kernel<T>, grid_for(tokens * hidden), kThreads, 0, stream,
                  d_x_perm, slot_to_row, d_x, tokens, top_k, hidden);
}

// y_slots [T·k, H] in slot order from y_perm [T·k, H] in expert order.
template <class T>
void launch_unpermute_forward(const T* y_perm, const int32_t* slot_to_row, T* y_slots,
                              int64_t tokens, int64_t top_k, int64_t hidden, cudaStream_t stream) {
  const int64_t rows = tokens * top_k;
  FLATPEAK_LAUNCH(gather_rows_kernel<T>, grid_for(rows * hidden), kThreads, 0, stream, y_perm,
                  slot_to_row, int64_t{1}, y_slots, rows, hidden);
}

template <class T>
void launch_unpermute_backward(const T* d_y_slots, const int32_t* row_to_slot, T* d_y_perm,
                               int64_t tokens, int64_t top_k, int64_t hidden, cudaStream_t stream) {
  const int64_t rows = tokens * top_k;
  FLATPEAK_LAUNCH(gather_rows_kernel<T>, grid_for(rows * hidden), kThreads, 0, stream, d_y_slots,
                  row_to_slot, int64_t{1}, d_y_perm, rows, hidden);
}

template <class T>
void launch_combine_forward(const T* y, const float* weights, const int32_t* slot_to_row, T* out,
                            int64_t tokens, int64_t top_k, int64_t hidden, cudaStream_t stream) {
  FLATPEAK_LAUNCH(combine_forward_kernel<T>, grid_for(tokens * hidden), kThreads, 0, stream, y,
                  weights, slot_to_row, out, tokens, top_k, hidden);
}

// One block of 128 per slot (tokens · top_k < 2^31, checked by the caller).
template <class T>
void launch_combine_backward(const T* y, const float* weights, const int32_t* slot_to_row,
                             const T* d_out, T* d_y, float* d_weights, int64_t tokens,
                             int64_t top_k, int64_t hidden, cudaStream_t stream) {
  const int64_t slots = tokens * top_k;
  FLATPEAK_LAUNCH(combine_backward_kernel<T>, static_cast<unsigned>(slots), 128, 0, stream, y,
                  weights, slot_to_row, d_out, d_y, d_weights, top_k, hidden);
}

}  // namespace
}  // namespace flatpeak::exec::cuda_detail
