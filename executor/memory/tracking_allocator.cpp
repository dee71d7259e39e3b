#include "executor/memory/tracking_allocator.h"

#include <new>
#include <string>

namespace flatpeak::exec {
namespace {

constexpr std::array<const char*, kCategoryCount> kCategoryNames = {
    "params", "grads", "optimizer", "fsdp", "boundaries",
    "activations", "dispatch", "vocab", "workspace", "comm"};

size_t space_index(MemorySpace space) { return static_cast<size_t>(space); }
size_t category_index(Category category) { return static_cast<size_t>(category); }

std::string oom_message(MemorySpace space, int64_t requested_bytes, int64_t live_bytes,
                        int64_t capacity_bytes) {
  return std::string("out of ") + memory_space_name(space) + " memory: requested " +
         std::to_string(requested_bytes) + " bytes with " + std::to_string(live_bytes) +
         " live of " + std::to_string(capacity_bytes);
}

}  // namespace

const char* memory_space_name(MemorySpace space) {
  return space == MemorySpace::Device ? "device" : "host";
}

const char* category_name(Category category) { return kCategoryNames[category_index(category)]; }

std::optional<Category> category_from_name(const std::string& name) {
  for (size_t i = 0; i < kCategoryNames.size(); ++i) {
    if (name == kCategoryNames[i]) return static_cast<Category>(i);
  }
  return std::nullopt;
}

OutOfMemory::OutOfMemory(MemorySpace space_, int64_t requested_bytes_, int64_t live_bytes_,
                         int64_t capacity_bytes_)
    : std::runtime_error(oom_message(space_, requested_bytes_, live_bytes_, capacity_bytes_)),
      space(space_),
      requested_bytes(requested_bytes_),
      live_bytes(live_bytes_),
      capacity_bytes(capacity_bytes_) {}

TrackingAllocator::TrackingAllocator(Options options) : options_(options) {
  const int64_t a = options_.alignment_bytes;
  if (a < 1 || (a & (a - 1)) != 0) {
    throw std::invalid_argument("alignment_bytes must be a power of two >= 1 (got " +
                                std::to_string(a) + ")");
  }
  open_phase_locked("init");
}

TrackingAllocator::~TrackingAllocator() = default;

int64_t TrackingAllocator::tracked_bytes_for(int64_t bytes) const {
  const int64_t a = options_.alignment_bytes;
  return (bytes + a - 1) / a * a;
}

Allocation TrackingAllocator::allocate(int64_t bytes, Category category, MemorySpace space) {
  if (bytes < 0) {
    throw std::invalid_argument("allocation of negative size (" + std::to_string(bytes) + ")");
  }
  Allocation out;
  out.requested_bytes = bytes;
  out.tracked_bytes = tracked_bytes_for(bytes);
  out.category = category;
  out.space = space;
  if (bytes == 0) return out;

  const int64_t capacity = space == MemorySpace::Device ? options_.device_capacity_bytes
                                                        : options_.host_capacity_bytes;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    const SpaceState& s = spaces_[space_index(space)];
    if (capacity >= 0 && s.live_total + out.tracked_bytes > capacity) {
      throw OutOfMemory(space, out.tracked_bytes, s.live_total, capacity);
    }
  }
  // Storage is aligned to at least 64 bytes (a cache line) so that kernels can vectorise.
  const size_t storage_alignment =
      static_cast<size_t>(options_.alignment_bytes < 64 ? 64 : options_.alignment_bytes);
  out.data = ::operator new(static_cast<size_t>(out.tracked_bytes),
                            std::align_val_t(storage_alignment));

  std::lock_guard<std::mutex> lock(mutex_);
  SpaceState& s = spaces_[space_index(space)];
  s.live[category_index(category)] += out.tracked_bytes;
  s.live_total += out.tracked_bytes;
  ++live_allocations_;
  update_peaks_locked(space);
  return out;
}

void TrackingAllocator::release(const Allocation& allocation) {
  if (allocation.data == nullptr) return;
  const size_t storage_alignment =
      static_cast<size_t>(options_.alignment_bytes < 64 ? 64 : options_.alignment_bytes);
  ::operator delete(allocation.data, std::align_val_t(storage_alignment));
  std::lock_guard<std::mutex> lock(mutex_);
  SpaceState& s = spaces_[space_index(allocation.space)];
  s.live[category_index(allocation.category)] -= allocation.tracked_bytes;
  s.live_total -= allocation.tracked_bytes;
  --live_allocations_;
}

void TrackingAllocator::retag(Allocation& allocation, Category category) {
  if (allocation.data == nullptr || allocation.category == category) {
    allocation.category = category;
    return;
  }
  std::lock_guard<std::mutex> lock(mutex_);
  SpaceState& s = spaces_[space_index(allocation.space)];
  s.live[category_index(allocation.category)] -= allocation.tracked_bytes;
  s.live[category_index(category)] += allocation.tracked_bytes;
  allocation.category = category;
  update_peaks_locked(allocation.space);  // the total is unchanged; a category's own maximum may rise
}

void TrackingAllocator::update_peaks_locked(MemorySpace space) {
  SpaceState& s = spaces_[space_index(space)];
  if (s.live_total > s.high_water) {
    s.high_water = s.live_total;
    s.at_high_water = s.live;
    s.high_water_phase = phase_;
  }
  PhaseRecord& r = records_[records_.size() - kMemorySpaceCount + space_index(space)];
  if (s.live_total > r.peak_bytes) {
    r.peak_bytes = s.live_total;
    r.bytes_at_peak = s.live;
  }
  for (size_t c = 0; c < static_cast<size_t>(kCategoryCount); ++c) {
    if (s.live[c] > r.category_peak_bytes[c]) r.category_peak_bytes[c] = s.live[c];
  }
  const int64_t columns = s.live_total - s.live[category_index(Category::Workspace)] - s.live[category_index(Category::Comm)];
  if (columns > r.column_peak_bytes) {
    r.column_peak_bytes = columns;
    r.bytes_at_column_peak = s.live;
  }
}

void TrackingAllocator::open_phase_locked(const std::string& phase) {
  phase_ = phase;
  for (int i = 0; i < kMemorySpaceCount; ++i) {
    PhaseRecord r;
    r.phase = phase;
    r.space = static_cast<MemorySpace>(i);
    records_.push_back(r);
  }
  for (int i = 0; i < kMemorySpaceCount; ++i) update_peaks_locked(static_cast<MemorySpace>(i));
}

void TrackingAllocator::set_phase(const std::string& phase) {
  std::lock_guard<std::mutex> lock(mutex_);
  open_phase_locked(phase);
}

std::string TrackingAllocator::phase() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return phase_;
}

int64_t TrackingAllocator::live_bytes(MemorySpace space) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return spaces_[space_index(space)].live_total;
}

int64_t TrackingAllocator::live_bytes(MemorySpace space, Category category) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return spaces_[space_index(space)].live[category_index(category)];
}

int64_t TrackingAllocator::live_allocations() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return live_allocations_;
}

int64_t TrackingAllocator::high_water_bytes(MemorySpace space) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return spaces_[space_index(space)].high_water;
}

std::string TrackingAllocator::high_water_phase(MemorySpace space) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return spaces_[space_index(space)].high_water_phase;
}

CategoryBytes TrackingAllocator::bytes_at_high_water(MemorySpace space) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return spaces_[space_index(space)].at_high_water;
}

std::vector<PhaseRecord> TrackingAllocator::phase_records() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return records_;
}

void TrackingAllocator::reset_records() {
  std::lock_guard<std::mutex> lock(mutex_);
  records_.clear();
  for (SpaceState& s : spaces_) {
    s.high_water = 0;
    s.at_high_water = CategoryBytes{};
    s.high_water_phase.clear();
  }
  open_phase_locked(phase_);
}

}  // namespace flatpeak::exec
