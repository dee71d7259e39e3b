// Device memory a user can trust: every allocation comes from one CUDA memory pool through this
// allocator, with its category, and is counted like the TrackingAllocator counts (tracked bytes =
// requested rounded up to the alignment; live bytes per category; high-water mark and its split;
// per-phase peaks). Beside the tracked figures, the device's own view: the pool's used/reserved
// high-water attributes, cudaMemGetInfo, and the driver's per-process figure through NVML.
//   DeviceAllocator alloc({/*alignment_bytes=*/256});
//   DeviceBuffer x(alloc, T * H * 2, exec::Category::Activations, stream);  // [T, H] bf16
//   alloc.high_water_bytes();  alloc.device_view().pool_used_high_bytes;
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "executor/memory/tracking_allocator.h"

namespace flatpeak::cuda {

// What the device itself reports, to set beside the tracked counters.
struct DeviceMemoryView {
  int64_t pool_used_bytes = 0;           // cudaMemPoolAttrUsedMemCurrent
  int64_t pool_used_high_bytes = 0;      // cudaMemPoolAttrUsedMemHigh since the last reset
  int64_t pool_reserved_bytes = 0;       // cudaMemPoolAttrReservedMemCurrent
  int64_t pool_reserved_high_bytes = 0;  // cudaMemPoolAttrReservedMemHigh since the last reset
  int64_t device_free_bytes = 0;         // cudaMemGetInfo: the whole device, all processes
  int64_t device_total_bytes = 0;
  // NVML (nvml_view.h), loaded at run time: this process's device memory as the driver counts it
  // (context, library kernels and workspaces, every pool), the current value only (no high mark).
  bool nvml_available = false;           // nvml_process_used_bytes holds the figure
  std::string nvml_reason;               // why not, when !nvml_available
  int64_t nvml_process_used_bytes = -1;
  int64_t nvml_device_used_bytes = -1;   // nvmlDeviceGetMemoryInfo (-1 when NVML did not answer)
  int64_t nvml_device_total_bytes = -1;
};

class DeviceAllocator {
 public:
  struct Options {
    int64_t alignment_bytes = 256;     // every tracked size (and pool request) rounds up to it
    int64_t capacity_bytes = -1;       // -1: unbounded; else exec::OutOfMemory past it
    int device = 0;
    // Pool memory kept reserved after frees; the default keeps all of it (no release on every
    // synchronisation), so the reserved figure is the process's device footprint for the pool.
    uint64_t release_threshold_bytes = UINT64_MAX;
    // A request of at least this many bytes that the pool's unused reserve cannot hold first
    // waits for `stream` and returns that reserve to the device (cudaMemPoolTrimTo), so the pool
    // grows by the request rather than beside blocks it can no longer reuse: a freed 53 GB
    // logits block is otherwise kept while an 80 GB backward workspace is mapped next to it (seen
    // on an H200: 134 GB reserved for an 84 GB high-water). Costs a stream wait on such growth
    // only. -1: never trims.
    int64_t trim_before_growth_min_bytes = int64_t{64} << 20;
  };

  DeviceAllocator() : DeviceAllocator(Options{}) {}
  explicit DeviceAllocator(Options options);
  DeviceAllocator(const DeviceAllocator&) = delete;
  DeviceAllocator& operator=(const DeviceAllocator&) = delete;
  ~DeviceAllocator();

  // Stream-ordered: the block may be used on `stream` (or after synchronising with it). Zero
  // bytes gives a null block that counts nothing. Throws exec::OutOfMemory past the capacity
  // and BackendError when the device has no memory.
  exec::Allocation allocate(int64_t bytes, exec::Category category, cudaStream_t stream = nullptr);
  // Frees once the work queued on `stream` is done; the counters drop at once.
  void release(const exec::Allocation& allocation, cudaStream_t stream = nullptr);

  void set_phase(const std::string& phase);
  std::string phase() const;

  int64_t alignment_bytes() const { return options_.alignment_bytes; }
  int64_t tracked_bytes_for(int64_t bytes) const;
  int64_t live_bytes() const;
  int64_t live_bytes(exec::Category category) const;
  int64_t live_allocations() const;
  int64_t high_water_bytes() const;
  std::string high_water_phase() const;
  exec::CategoryBytes bytes_at_high_water() const;
  // Device-space records of every phase entered so far, in order (the traces/ timeline).
  std::vector<exec::PhaseRecord> phase_records() const;
  // Restarts the tracked high-water mark and phase records from the live bytes, and the pool's
  // high-water attributes from its current use.
  void reset_records();

  DeviceMemoryView device_view() const;
  cudaMemPool_t pool() const { return pool_; }
  int device() const { return options_.device; }

 private:
  void trim_before_growth(int64_t bytes, cudaStream_t stream);
  void open_phase_locked(const std::string& phase);
  void update_peaks_locked();

  Options options_;
  cudaMemPool_t pool_ = nullptr;
  mutable std::mutex mutex_;
  exec::CategoryBytes live_{};
  int64_t live_total_ = 0;
  int64_t high_water_ = 0;
  exec::CategoryBytes at_high_water_{};
  std::string high_water_phase_;
  std::vector<exec::PhaseRecord> records_;  // the current phase's record is the last
  std::string phase_;
  int64_t live_allocations_ = 0;
};

// A move-only block of device memory from a DeviceAllocator, released (stream-ordered) when it
// goes out of scope.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(DeviceAllocator& allocator, int64_t bytes, exec::Category category,
               cudaStream_t stream = nullptr)
      : allocator_(&allocator), stream_(stream),
        allocation_(allocator.allocate(bytes, category, stream)) {}
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& other) noexcept { *this = std::move(other); }
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept {
    if (this != &other) {
      reset();
      allocator_ = other.allocator_;
      stream_ = other.stream_;
      allocation_ = other.allocation_;
      other.allocator_ = nullptr;
      other.allocation_ = exec::Allocation{};
    }
    return *this;
  }
  ~DeviceBuffer() { reset(); }

  // Never throws: a failed free here leaves the counters right and the error for the next call.
  void reset() noexcept {
    if (allocator_ != nullptr) {
      try {
        allocator_->release(allocation_, stream_);
      } catch (...) {
      }
    }
    allocator_ = nullptr;
    allocation_ = exec::Allocation{};
  }

  void* raw() const { return allocation_.data; }
  template <class T>
  T* as() const { return static_cast<T*>(allocation_.data); }
  int64_t bytes() const { return allocation_.requested_bytes; }
  int64_t tracked_bytes() const { return allocation_.tracked_bytes; }
  exec::Category category() const { return allocation_.category; }

 private:
  DeviceAllocator* allocator_ = nullptr;
  cudaStream_t stream_ = nullptr;
  exec::Allocation allocation_;
};

}  // namespace flatpeak::cuda
