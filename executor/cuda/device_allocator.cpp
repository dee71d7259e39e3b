#include "executor/cuda/device_allocator.h"

#include <stdexcept>
#include <string>
#include <utility>

#include "executor/cuda/cuda_check.h"
#include "executor/cuda/nvml_view.h"

namespace flatpeak::cuda {
namespace {

size_t category_index(exec::Category category) { return static_cast<size_t>(category); }

int64_t pool_attribute(cudaMemPool_t pool, cudaMemPoolAttr attribute) {
  uint64_t value = 0;
  FLATPEAK_CUDA_CHECK(cudaMemPoolGetAttribute(pool, attribute, &value));
  return static_cast<int64_t>(value);
}

}  // namespace

DeviceAllocator::DeviceAllocator(Options options) : options_(options) {
  const int64_t a = options_.alignment_bytes;
  if (a < 1 || (a & (a - 1)) != 0) {
    throw std::invalid_argument("alignment_bytes must be a power of two >= 1 (got " +
                                std::to_string(a) + ")");
  }
  FLATPEAK_CUDA_CHECK(cudaSetDevice(options_.device));
  // A pool of our own: its attributes then count this allocator's blocks and nothing else
  // (cuBLAS, NCCL and the context allocate outside it; cudaMemGetInfo sees those).
  cudaMemPoolProps props{};
  props.allocType = cudaMemAllocationTypePinned;
  props.location.type = cudaMemLocationTypeDevice;
  props.location.id = options_.device;
  FLATPEAK_CUDA_CHECK(cudaMemPoolCreate(&pool_, &props));
  uint64_t threshold = options_.release_threshold_bytes;
  FLATPEAK_CUDA_CHECK(
      cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReleaseThreshold, &threshold));
  open_phase_locked("init");
}

DeviceAllocator::~DeviceAllocator() {
  // Blocks still outstanding are freed by the driver when they are released (documented
  // behaviour of cudaMemPoolDestroy); a destructor cannot report errors.
  if (pool_ != nullptr) (void)cudaMemPoolDestroy(pool_);
}

int64_t DeviceAllocator::tracked_bytes_for(int64_t bytes) const {
  const int64_t a = options_.alignment_bytes;
  return (bytes + a - 1) / a * a;
}

exec::Allocation DeviceAllocator::allocate(int64_t bytes, exec::Category category,
                                           cudaStream_t stream) {
  if (bytes < 0) {
    throw std::invalid_argument("allocation of negative size (" + std::to_string(bytes) + ")");
  }
  exec::Allocation out;
  out.requested_bytes = bytes;
  out.tracked_bytes = tracked_bytes_for(bytes);
  out.category = category;
  out.space = exec::MemorySpace::Device;
  if (bytes == 0) return out;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (options_.capacity_bytes >= 0 && live_total_ + out.tracked_bytes > options_.capacity_bytes) {
      throw exec::OutOfMemory(exec::MemorySpace::Device, out.tracked_bytes, live_total_,
                              options_.capacity_bytes);
    }
  }
  trim_before_growth(out.tracked_bytes, stream);
  // The pool is asked for the tracked size, so its used figure and ours count the same bytes.
  FLATPEAK_CUDA_CHECK(cudaMallocFromPoolAsync(&out.data, static_cast<size_t>(out.tracked_bytes),
                                              pool_, stream));
  std::lock_guard<std::mutex> lock(mutex_);
  live_[category_index(category)] += out.tracked_bytes;
  live_total_ += out.tracked_bytes;
  ++live_allocations_;
  update_peaks_locked();
  return out;
}

void DeviceAllocator::trim_before_growth(int64_t bytes, cudaStream_t stream) {
  const int64_t min_bytes = options_.trim_before_growth_min_bytes;
  if (min_bytes < 0 || bytes < min_bytes) return;
  const int64_t unused = pool_attribute(pool_, cudaMemPoolAttrReservedMemCurrent) -
                         pool_attribute(pool_, cudaMemPoolAttrUsedMemCurrent);
  if (unused <= 0 || unused >= bytes) return;  // nothing to give back, or the reserve may serve it
  // Blocks freed on `stream` count as in use until the stream has passed their free.
  FLATPEAK_CUDA_CHECK(cudaStreamSynchronize(stream));
  FLATPEAK_CUDA_CHECK(cudaMemPoolTrimTo(pool_, 0));
}

void DeviceAllocator::release(const exec::Allocation& allocation, cudaStream_t stream) {
  if (allocation.data == nullptr) return;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    live_[category_index(allocation.category)] -= allocation.tracked_bytes;
    live_total_ -= allocation.tracked_bytes;
    --live_allocations_;
  }
  FLATPEAK_CUDA_CHECK(cudaFreeAsync(allocation.data, stream));
}

void DeviceAllocator::update_peaks_locked() {
  if (live_total_ > high_water_) {
    high_water_ = live_total_;
    at_high_water_ = live_;
    high_water_phase_ = phase_;
  }
  exec::PhaseRecord& r = records_.back();
  if (live_total_ > r.peak_bytes) {
    r.peak_bytes = live_total_;
    r.bytes_at_peak = live_;
  }
  for (size_t c = 0; c < live_.size(); ++c) {
    if (live_[c] > r.category_peak_bytes[c]) r.category_peak_bytes[c] = live_[c];
  }
  // The timeline's columns alone (TrackingAllocator's): verify splits a phase's categories there.
  const int64_t columns =
      live_total_ - live_[category_index(exec::Category::Workspace)] - live_[category_index(exec::Category::Comm)];
  if (columns > r.column_peak_bytes) {
    r.column_peak_bytes = columns;
    r.bytes_at_column_peak = live_;
  }
}

void DeviceAllocator::open_phase_locked(const std::string& phase) {
  phase_ = phase;
  exec::PhaseRecord r;
  r.phase = phase;
  r.space = exec::MemorySpace::Device;
  records_.push_back(r);
  update_peaks_locked();
}

void DeviceAllocator::set_phase(const std::string& phase) {
  std::lock_guard<std::mutex> lock(mutex_);
  open_phase_locked(phase);
}

std::string DeviceAllocator::phase() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return phase_;
}

int64_t DeviceAllocator::live_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return live_total_;
}

int64_t DeviceAllocator::live_bytes(exec::Category category) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return live_[category_index(category)];
}

int64_t DeviceAllocator::live_allocations() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return live_allocations_;
}

int64_t DeviceAllocator::high_water_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return high_water_;
}

std::string DeviceAllocator::high_water_phase() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return high_water_phase_;
}

exec::CategoryBytes DeviceAllocator::bytes_at_high_water() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return at_high_water_;
}

std::vector<exec::PhaseRecord> DeviceAllocator::phase_records() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return records_;
}

void DeviceAllocator::reset_records() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    records_.clear();
    high_water_ = 0;
    at_high_water_ = exec::CategoryBytes{};
    high_water_phase_.clear();
    open_phase_locked(phase_);
  }
  // Setting a high attribute to 0 restarts it from the current value.
  uint64_t zero = 0;
  FLATPEAK_CUDA_CHECK(cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrUsedMemHigh, &zero));
  FLATPEAK_CUDA_CHECK(cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReservedMemHigh, &zero));
}

DeviceMemoryView DeviceAllocator::device_view() const {
  DeviceMemoryView view;
  view.pool_used_bytes = pool_attribute(pool_, cudaMemPoolAttrUsedMemCurrent);
  view.pool_used_high_bytes = pool_attribute(pool_, cudaMemPoolAttrUsedMemHigh);
  view.pool_reserved_bytes = pool_attribute(pool_, cudaMemPoolAttrReservedMemCurrent);
  view.pool_reserved_high_bytes = pool_attribute(pool_, cudaMemPoolAttrReservedMemHigh);
  size_t free_bytes = 0;
  size_t total_bytes = 0;
  FLATPEAK_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  view.device_free_bytes = static_cast<int64_t>(free_bytes);
  view.device_total_bytes = static_cast<int64_t>(total_bytes);
  NvmlMemory nvml = nvml_process_memory(options_.device);
  view.nvml_available = nvml.available;
  view.nvml_reason = std::move(nvml.reason);
  view.nvml_process_used_bytes = nvml.process_used_bytes;
  view.nvml_device_used_bytes = nvml.device_used_bytes;
  view.nvml_device_total_bytes = nvml.device_total_bytes;
  return view;
}

}  // namespace flatpeak::cuda
