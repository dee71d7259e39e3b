// A host emulation of the CUDA features the kernels of executor/cuda use, so that kernel source
// kept in a .cuh (attention_tc_kernels.cuh, and any kernel written with only kernel_util.cuh's
// helpers) runs on a machine without a GPU:
//   #define FLATPEAK_CUDA_EMULATION
//   #include "cuda_emulation.h"  then  #include "executor/cuda/attention_tc_kernels.cuh"
//   emu::launch(grid_x, grid_y, 128, smem_bytes, [&] { some_kernel(args...); });
// One std::thread per CUDA thread; __syncthreads and __syncwarp are barriers (a mutex and a
// condition variable, so every write before one is seen after it); atomicAdd (float, int) takes a lock;
// __shfl_xor_sync goes through a per-warp array between two warp barriers. WMMA fragments hold
// the whole 16x16 tile and only lane 0 of a warp loads, multiplies and stores them: a lane that
// reads a tile another lane stored without a __syncwarp between may see stale data, as on a
// device. Shared memory starts filled with 0xCD bytes (reads of unwritten shared memory give large
// garbage, not zeros); a write past the launch's dynamic shared bytes makes launch() throw. A
// launcher's FLATPEAK_LAUNCH (kernel_util.cuh) comes here with its grid, block and shared bytes,
// and grid_for honours a test's cap (grid_cap). Misaligned fragment pointers (WMMA needs 32
// bytes) and leading dimensions that are not a multiple of 8 (16-bit) or 4 (fp32) are counted in
// emu::violations(). Not
// emulated: timing, bank conflicts, registers, the real fragment layouts and the tensor cores' own
// rounding of fp32 sums.
#pragma once

#ifndef FLATPEAK_CUDA_EMULATION
#define FLATPEAK_CUDA_EMULATION
#endif

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <type_traits>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __launch_bounds__(threads)
// Static __shared__ arrays become function statics: one block runs at a time, so its threads
// share them as on a device (they start zeroed, not as garbage). Dynamic shared memory is the
// block's buffer, filled with 0xCD like the tensor-core kernels' FLATPEAK_TC_SHARED.
#define __shared__ static
#define FLATPEAK_DYNAMIC_SHARED(type, name) type* name = reinterpret_cast<type*>(emu::shared_memory())
#define FLATPEAK_UNROLL
#define FLATPEAK_TC_SHARED(name) unsigned char* name = emu::shared_memory()

struct EmuDim3 {
  unsigned x = 0, y = 0, z = 0;
};
inline thread_local EmuDim3 threadIdx;
inline thread_local EmuDim3 blockIdx;
inline thread_local EmuDim3 blockDim;
inline thread_local EmuDim3 gridDim;
// A launch's grid and block, as the runtime's dim3 (unset dimensions are 1); implicit from any
// integer as the launchers write it (kThreads is an int).
struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  dim3(int64_t x_ = 1, int64_t y_ = 1, int64_t z_ = 1)  // NOLINT(google-explicit-constructor)
      : x(static_cast<unsigned>(x_)), y(static_cast<unsigned>(y_)), z(static_cast<unsigned>(z_)) {}
};
// Streams order nothing here: every launch runs to its end before the call returns.
struct CUstream_st;
using cudaStream_t = CUstream_st*;

struct uint4 {
  unsigned x, y, z, w;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }

struct __nv_bfloat16 {
  uint16_t bits;
};
inline __nv_bfloat16 __ushort_as_bfloat16(uint16_t bits) { return {bits}; }
inline __nv_bfloat16 __float2bfloat16_rn(float x) {  // round to nearest even, NaN kept quiet
  uint32_t u = 0;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return {static_cast<uint16_t>((u >> 16) | 0x40u)};
  return {static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16)};
}

namespace emu {

class Barrier {
 public:
  explicit Barrier(int count) : count_(count) {}
  void arrive_and_wait() {
    std::unique_lock<std::mutex> lock(mutex_);
    const int64_t generation = generation_;
    if (++waiting_ == count_) {
      waiting_ = 0;
      ++generation_;
      cv_.notify_all();
    } else {
      cv_.wait(lock, [&] { return generation != generation_; });
    }
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  int count_;
  int waiting_ = 0;
  int64_t generation_ = 0;
};

// Bytes of 0xCD past a block's dynamic shared memory: a kernel launched with fewer shared bytes
// than it uses writes there, which launch() reports (a device would corrupt or fault).
constexpr size_t kSharedGuard = 64 * 1024;

struct Block {
  explicit Block(int threads, int64_t shared_bytes)
      : block(threads), shuffle(static_cast<size_t>(threads)),
        shared(static_cast<size_t>(shared_bytes) + 128 + kSharedGuard, static_cast<unsigned char>(0xCD)),
        shared_bytes_(static_cast<size_t>(shared_bytes)) {
    for (int w = 0; w < threads / 32; ++w) warps.push_back(std::make_unique<Barrier>(32));
  }
  Barrier block;
  std::vector<std::unique_ptr<Barrier>> warps;
  std::vector<float> shuffle;
  std::vector<unsigned char> shared;
  size_t shared_bytes_;
  bool guard_intact() const {
    const uintptr_t p = reinterpret_cast<uintptr_t>(shared.data());
    const size_t start = static_cast<size_t>(((p + 127) & ~uintptr_t{127}) - p) + shared_bytes_;
    for (size_t i = start; i < start + kSharedGuard; ++i)
      if (shared[i] != 0xCD) return false;
    return true;
  }
};
inline thread_local Block* current = nullptr;
inline std::atomic<int64_t>& violation_count() {
  static std::atomic<int64_t> count{0};
  return count;
}
inline int64_t violations() { return violation_count().load(); }

// A cap on grid_for's blocks (kernel_util.cuh): a test lowers it to run the grid-stride loops more
// than once per thread, as grid_for's own cap (2^20 blocks) does past 2^28 elements.
inline unsigned& grid_cap() {
  static unsigned cap = ~0u;
  return cap;
}

inline unsigned char* shared_memory() {  // aligned to 128 bytes, as __align__(128) asks
  const uintptr_t p = reinterpret_cast<uintptr_t>(current->shared.data());
  return reinterpret_cast<unsigned char*>((p + 127) & ~uintptr_t{127});
}

// Where a test sets it, launches run only the blocks whose x is listed (blockIdx and gridDim as
// in the whole grid): a few rows of a large grid of independent blocks.
inline const std::vector<unsigned>*& block_x_subset() {
  static const std::vector<unsigned>* xs = nullptr;
  return xs;
}

// Runs body() as every thread of every block of a (grid_x, grid_y) grid, one block at a time.
template <class Body>
void launch(unsigned grid_x, unsigned grid_y, unsigned threads, int64_t shared_bytes, Body body) {
  const std::vector<unsigned>* xs = block_x_subset();
  const size_t runs = xs != nullptr ? xs->size() : grid_x;
  for (unsigned by = 0; by < grid_y; ++by) {
    for (size_t i = 0; i < runs; ++i) {
      const unsigned bx = xs != nullptr ? (*xs)[i] : static_cast<unsigned>(i);
      if (bx >= grid_x) continue;
      Block block(static_cast<int>(threads), shared_bytes);
      std::vector<std::thread> pool;
      for (unsigned t = 0; t < threads; ++t) {
        pool.emplace_back([&, t] {
          current = &block;
          threadIdx = {t, 0, 0};
          blockIdx = {bx, by, 0};
          blockDim = {threads, 1, 1};
          gridDim = {grid_x, grid_y, 1};
          body();
        });
      }
      for (std::thread& th : pool) th.join();
      if (!block.guard_intact()) throw std::runtime_error("emu::launch: shared memory written past the launch's bytes");
    }
  }
}

// A launch as the launchers write it (kernel_util.cuh's FLATPEAK_LAUNCH). A configuration a device
// rejects (an empty grid or block, more than 1024 threads, grid y above 65535) throws, as the
// launch check would; so do 3-D grids and 2-D blocks, which are not emulated.
template <class Body>
void launch(dim3 grid, dim3 block, size_t shared_bytes, cudaStream_t, Body body) {
  if (grid.x == 0 || grid.y == 0 || grid.y > 65535 || block.x == 0 || block.x > 1024)
    throw std::runtime_error("emu::launch: a configuration a device rejects");
  if (grid.z != 1 || block.y != 1 || block.z != 1)
    throw std::runtime_error("emu::launch: only 2-D grids of 1-D blocks are emulated");
  launch(grid.x, grid.y, block.x, static_cast<int64_t>(shared_bytes), body);
}

}  // namespace emu

inline void __syncthreads() { emu::current->block.arrive_and_wait(); }
// Separately rounded float ops: nvcc never contracts them into an fma (nor does the host here).
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fmul_rn(float a, float b) { return a * b; }
// Atomic as on a device (one lock for all addresses); the order of a location's additions is the
// order the threads reach it, so sums of several terms may differ in their last bits run to run.
inline float atomicAdd(float* address, float value) {
  static std::mutex lock;
  const std::lock_guard<std::mutex> guard(lock);
  const float old = *address;
  *address = old + value;
  return old;
}
inline int atomicAdd(int* address, int value) {
  static std::mutex lock;
  const std::lock_guard<std::mutex> guard(lock);
  const int old = *address;
  *address = old + value;
  return old;
}
inline void __syncwarp() { emu::current->warps[threadIdx.x / 32]->arrive_and_wait(); }
inline float __shfl_xor_sync(unsigned, float value, int lane_mask) {
  const unsigned t = threadIdx.x;
  emu::current->shuffle[t] = value;
  __syncwarp();
  const float other = emu::current->shuffle[(t & ~31u) | ((t % 32) ^ static_cast<unsigned>(lane_mask))];
  __syncwarp();
  return other;
}

namespace nvcuda::wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

template <class Use, int M, int N, int K, class T, class Layout = void>
struct fragment {
  static_assert(M == 16 && N == 16 && K == 16, "only 16x16x16 is emulated");
  float x[16][16];
};

namespace detail {
inline bool lead() { return threadIdx.x % 32 == 0; }
inline void check(const void* p, unsigned ldm, unsigned multiple) {
  if (reinterpret_cast<uintptr_t>(p) % 32 != 0 || ldm % multiple != 0) ++emu::violation_count();
}
inline float widen(__nv_bfloat16 b) {
  const uint32_t u = static_cast<uint32_t>(b.bits) << 16;
  float f = 0.0f;
  std::memcpy(&f, &u, 4);
  return f;
}
}  // namespace detail

template <class Use, class Layout>
void load_matrix_sync(fragment<Use, 16, 16, 16, __nv_bfloat16, Layout>& f, const __nv_bfloat16* p,
                      unsigned ldm) {
  if (!detail::lead()) return;
  detail::check(p, ldm, 8);
  for (unsigned r = 0; r < 16; ++r)
    for (unsigned c = 0; c < 16; ++c)
      f.x[r][c] = detail::widen(std::is_same_v<Layout, row_major> ? p[r * ldm + c] : p[r + c * ldm]);
}
inline void load_matrix_sync(fragment<accumulator, 16, 16, 16, float>& f, const float* p,
                             unsigned ldm, layout_t layout) {
  if (!detail::lead()) return;
  detail::check(p, ldm, 4);
  for (unsigned r = 0; r < 16; ++r)
    for (unsigned c = 0; c < 16; ++c)
      f.x[r][c] = layout == mem_row_major ? p[r * ldm + c] : p[r + c * ldm];
}
inline void store_matrix_sync(float* p, const fragment<accumulator, 16, 16, 16, float>& f,
                              unsigned ldm, layout_t layout) {
  if (!detail::lead()) return;
  detail::check(p, ldm, 4);
  for (unsigned r = 0; r < 16; ++r)
    for (unsigned c = 0; c < 16; ++c)
      (layout == mem_row_major ? p[r * ldm + c] : p[r + c * ldm]) = f.x[r][c];
}
inline void fill_fragment(fragment<accumulator, 16, 16, 16, float>& f, float value) {
  if (!detail::lead()) return;
  for (auto& row : f.x)
    for (float& e : row) e = value;
}
template <class LayoutA, class LayoutB>
void mma_sync(fragment<accumulator, 16, 16, 16, float>& d,
              const fragment<matrix_a, 16, 16, 16, __nv_bfloat16, LayoutA>& a,
              const fragment<matrix_b, 16, 16, 16, __nv_bfloat16, LayoutB>& b,
              const fragment<accumulator, 16, 16, 16, float>& c) {
  if (!detail::lead()) return;
  float out[16][16];
  for (int r = 0; r < 16; ++r) {
    for (int n = 0; n < 16; ++n) {
      float sum = c.x[r][n];
      for (int k = 0; k < 16; ++k) sum += a.x[r][k] * b.x[k][n];
      out[r][n] = sum;
    }
  }
  std::memcpy(d.x, out, sizeof out);
}

}  // namespace nvcuda::wmma
