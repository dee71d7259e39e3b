// Pinned host memory sized once at launch: SCO's host boundaries and OffloadStreamAdamW's host
// state and staging slots are carved from one cudaHostAlloc block, so the loop never pins or
// allocates. Before pinning, the limits that make pinning fail are read (RLIMIT_MEMLOCK, which
// containers often set low, and /proc/meminfo MemAvailable); when the block cannot be had, the
// arena either throws a clear error (default) or, with allow_pageable_fallback, uses pageable
// memory and says so (copies are then synchronous and slower; the byte counts are the same).
//   PinnedArena arena({/*bytes=*/n * 12 + slots, /*allow_pageable_fallback=*/false});
//   float* master = arena.carve<float>(n, exec::Category::Optimizer);
//   arena.pinned();  arena.used_bytes();  arena.bytes_for(exec::Category::Optimizer);
#pragma once

#include <cstdint>
#include <string>

#include "executor/memory/tracking_allocator.h"

namespace flatpeak::cuda {

// What the host allows: -1 where unlimited or unknown.
struct HostMemoryLimits {
  int64_t memlock_limit_bytes = -1;   // getrlimit(RLIMIT_MEMLOCK) soft limit
  int64_t mem_available_bytes = -1;   // /proc/meminfo MemAvailable
};
HostMemoryLimits read_host_memory_limits();

struct PinnedArenaOptions {
  int64_t bytes = 0;
  bool allow_pageable_fallback = false;
  int64_t alignment_bytes = 256;  // every carve rounds up to it (copy engines like aligned rows)
};

class PinnedArena {
 public:
  // Throws BackendError when the block cannot be pinned (and no fallback is allowed), naming the
  // size, the memlock limit and the available memory.
  explicit PinnedArena(PinnedArenaOptions options);
  ~PinnedArena();
  PinnedArena(const PinnedArena&) = delete;
  PinnedArena& operator=(const PinnedArena&) = delete;

  // The next `bytes` of the arena (aligned), counted under `category`. Throws exec::OutOfMemory
  // (host space) when the arena is full: it never grows.
  void* carve_bytes(int64_t bytes, exec::Category category);
  template <class T>
  T* carve(int64_t elems, exec::Category category) {
    return static_cast<T*>(carve_bytes(elems * static_cast<int64_t>(sizeof(T)), category));
  }

  bool pinned() const { return pinned_; }
  const std::string& fallback_reason() const { return fallback_reason_; }  // empty when pinned
  int64_t capacity_bytes() const { return options_.bytes; }
  int64_t used_bytes() const { return used_; }
  int64_t bytes_for(exec::Category category) const {
    return by_category_[static_cast<size_t>(category)];
  }

 private:
  PinnedArenaOptions options_;
  unsigned char* base_ = nullptr;
  bool pinned_ = false;
  std::string fallback_reason_;
  int64_t used_ = 0;
  exec::CategoryBytes by_category_{};
};

}  // namespace flatpeak::cuda
