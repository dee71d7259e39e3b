// The executor's only source of buffer storage: counts live bytes per category and memory space,
// keeps per-space high-water marks and the peak of every phase.
//   TrackingAllocator alloc({/*alignment_bytes=*/256});
//   alloc.set_phase("fwd/L0/attn");  Tensor q(alloc, DType::BF16, {T, a, d}, Category::Activations);
//   alloc.high_water_bytes(MemorySpace::Device);  alloc.phase_records();  // measured timeline
#pragma once

#include <array>
#include <cstdint>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace flatpeak::exec {

// Device = what would be accelerator memory; Host = pinned host memory.
enum class MemorySpace : uint8_t { Device, Host };
constexpr int kMemorySpaceCount = 2;

// What a buffer is for. The first eight are the columns of the traces/ timeline format
// (traces/README.md) under the same names; Workspace and Comm have no column there, so callers
// should tag op scratch with the category of the component it serves (the loss's logits block
// is Vocab) and keep these two for scratch that belongs to none; a trace counts them in `total`.
enum class Category : uint8_t {
  Params,       // "params": parameter shards, gathered bf16 compute copies
  Grads,        // "grads": gradient shards
  Optimizer,    // "optimizer": fp32 master (offloaded), Adam m and v, grad staging
  Fsdp,         // "fsdp": gathered/prefetched units, unsharded grads, reduce-scatter inputs
  Boundaries,   // "boundaries": checkpoint boundaries (layer inputs kept for backward)
  Activations,  // "activations": layer working set: norms, Q/K/V/O, lse, dense FFN, gradients
  Dispatch,     // "dispatch": routing, send/receive buffers, expert intermediates, combine
  Vocab,        // "vocab": final hidden, LM head, logits blocks, lse, loss, their gradients
  Workspace,    // "workspace": op scratch owned by no component
  Comm,         // "comm": communication staging owned by no component
};
constexpr int kCategoryCount = 10;

const char* memory_space_name(MemorySpace space);  // "device" | "host"
const char* category_name(Category category);      // "params", "grads", ... as above
std::optional<Category> category_from_name(const std::string& name);

using CategoryBytes = std::array<int64_t, kCategoryCount>;

// One phase's measurement in one space: the largest live total seen while the phase was current
// (including what was live when it began), the per-category split at that moment, and each
// category's own maximum during the phase.
struct PhaseRecord {
  std::string phase;
  MemorySpace space = MemorySpace::Device;
  int64_t peak_bytes = 0;
  CategoryBytes bytes_at_peak{};      // split of peak_bytes by category
  CategoryBytes category_peak_bytes{};  // max of each category alone during the phase
  // The same for the timeline's columns alone (every category but workspace and comm, which the
  // traces/ format has no column for): their largest sum during the phase and the split then.
  int64_t column_peak_bytes = 0;
  CategoryBytes bytes_at_column_peak{};
};

// Thrown when a space's configured capacity would be exceeded (the CLI maps it to exit 4).
class OutOfMemory : public std::runtime_error {
 public:
  OutOfMemory(MemorySpace space, int64_t requested_bytes, int64_t live_bytes,
              int64_t capacity_bytes);
  MemorySpace space;
  int64_t requested_bytes;
  int64_t live_bytes;
  int64_t capacity_bytes;
};

// A block handed out by the allocator. tracked_bytes = requested_bytes rounded up to the
// alignment; that is what the counters see.
struct Allocation {
  void* data = nullptr;
  int64_t requested_bytes = 0;
  int64_t tracked_bytes = 0;
  Category category = Category::Workspace;
  MemorySpace space = MemorySpace::Device;
};

class TrackingAllocator {
 public:
  struct Options {
    int64_t alignment_bytes = 256;  // backend parameter: every tracked size rounds up to it
    int64_t device_capacity_bytes = -1;  // -1: unbounded
    int64_t host_capacity_bytes = -1;
  };

  TrackingAllocator() : TrackingAllocator(Options{}) {}
  explicit TrackingAllocator(Options options);
  TrackingAllocator(const TrackingAllocator&) = delete;
  TrackingAllocator& operator=(const TrackingAllocator&) = delete;
  ~TrackingAllocator();

  // Zero bytes gives a null block that counts nothing. Throws OutOfMemory past a capacity,
  // std::invalid_argument for negative sizes, std::bad_alloc when the system has no memory.
  Allocation allocate(int64_t bytes, Category category, MemorySpace space);
  void release(const Allocation& allocation);
  // Moves a live block to another category (its role changed: a layer output becomes a
  // checkpoint boundary, a gathered LM head becomes the loss's W); its bytes stay live, the
  // per-category counters follow. Updates allocation.category.
  void retag(Allocation& allocation, Category category);

  // Starts a new phase (its record starts from the bytes live now). Phases are recorded in the
  // order they are entered; entering the same name again adds a new record.
  void set_phase(const std::string& phase);
  std::string phase() const;

  int64_t alignment_bytes() const { return options_.alignment_bytes; }
  int64_t tracked_bytes_for(int64_t bytes) const;
  int64_t live_bytes(MemorySpace space) const;
  int64_t live_bytes(MemorySpace space, Category category) const;
  int64_t live_allocations() const;
  int64_t high_water_bytes(MemorySpace space) const;
  std::string high_water_phase(MemorySpace space) const;  // phase current when it was reached
  CategoryBytes bytes_at_high_water(MemorySpace space) const;
  // Records of every phase entered so far, each space once per phase (device first).
  std::vector<PhaseRecord> phase_records() const;
  // Forgets the phase records and restarts the high-water marks from the live bytes.
  void reset_records();

 private:
  struct SpaceState {
    CategoryBytes live{};
    int64_t live_total = 0;
    int64_t high_water = 0;
    CategoryBytes at_high_water{};
    std::string high_water_phase;
  };
  void open_phase_locked(const std::string& phase);
  void update_peaks_locked(MemorySpace space);

  Options options_;
  mutable std::mutex mutex_;
  std::array<SpaceState, kMemorySpaceCount> spaces_{};
  std::vector<PhaseRecord> records_;  // current phase's records are the last kMemorySpaceCount
  std::string phase_;
  int64_t live_allocations_ = 0;
};

}  // namespace flatpeak::exec
