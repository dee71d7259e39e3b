// PinnedArena (pinned_arena.h).
#include "executor/cuda/pinned_arena.h"

#include <cuda_runtime.h>
#include <sys/resource.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include "executor/cuda/cuda_check.h"

namespace flatpeak::cuda {

namespace {

std::string gib(int64_t bytes) {
  if (bytes < 0) return "unlimited";
  std::ostringstream out;
  out.precision(3);
  out << static_cast<double>(bytes) / (1024.0 * 1024.0 * 1024.0) << " GiB";
  return out.str();
}

}  // namespace

HostMemoryLimits read_host_memory_limits() {
  HostMemoryLimits limits;
  rlimit memlock{};
  if (getrlimit(RLIMIT_MEMLOCK, &memlock) == 0 && memlock.rlim_cur != RLIM_INFINITY)
    limits.memlock_limit_bytes = static_cast<int64_t>(memlock.rlim_cur);
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  int64_t kib = 0;
  std::string unit;
  while (meminfo >> key >> kib >> unit) {
    if (key == "MemAvailable:") {
      limits.mem_available_bytes = kib * 1024;
      break;
    }
  }
  return limits;
}

PinnedArena::PinnedArena(PinnedArenaOptions options) : options_(options) {
  if (options_.bytes < 0 || options_.alignment_bytes <= 0)
    throw std::invalid_argument("PinnedArena: bytes must be >= 0 and alignment > 0");
  if (options_.bytes == 0) return;
  const HostMemoryLimits limits = read_host_memory_limits();
  std::string problem;
  if (limits.mem_available_bytes >= 0 && options_.bytes > limits.mem_available_bytes)
    problem = "more than the host's available memory (" + gib(limits.mem_available_bytes) + ")";
  // The driver pins with its own mechanism, but a low memlock limit is the usual reason a
  // container refuses large pinned blocks; say it beside the failure.
  const std::string context = "pinning " + gib(options_.bytes) + " of host memory (memlock limit " +
                              gib(limits.memlock_limit_bytes) + ", available " +
                              gib(limits.mem_available_bytes) + ")";
  if (problem.empty()) {
    void* p = nullptr;
    const cudaError_t status = cudaHostAlloc(&p, static_cast<size_t>(options_.bytes), cudaHostAllocPortable);
    if (status == cudaSuccess) {
      base_ = static_cast<unsigned char*>(p);
      pinned_ = true;
      return;
    }
    (void)cudaGetLastError();  // clear the sticky-free error so later calls do not see it
    problem = std::string(cudaGetErrorName(status)) + ": " + cudaGetErrorString(status);
  }
  if (!options_.allow_pageable_fallback)
    throw_backend_error("cudaHostAlloc", __FILE__, __LINE__, context.c_str(),
                        (problem + "; raise `ulimit -l`, free host memory, or allow the pageable fallback").c_str());
  const size_t rounded = static_cast<size_t>((options_.bytes + 4095) / 4096 * 4096);
  base_ = static_cast<unsigned char*>(std::aligned_alloc(4096, rounded));
  if (base_ == nullptr)
    throw_backend_error("aligned_alloc", __FILE__, __LINE__, context.c_str(), "the pageable fallback failed too");
  fallback_reason_ = context + " failed (" + problem + "): using pageable memory, copies are synchronous";
}

PinnedArena::~PinnedArena() {
  if (base_ == nullptr) return;
  if (pinned_) (void)cudaFreeHost(base_);
  else std::free(base_);
}

void* PinnedArena::carve_bytes(int64_t bytes, exec::Category category) {
  if (bytes < 0) throw std::invalid_argument("PinnedArena::carve: negative size");
  const int64_t a = options_.alignment_bytes;
  const int64_t tracked = (bytes + a - 1) / a * a;
  if (used_ + tracked > options_.bytes)
    throw exec::OutOfMemory(exec::MemorySpace::Host, tracked, used_, options_.bytes);
  void* p = base_ + used_;
  used_ += tracked;
  by_category_[static_cast<size_t>(category)] += tracked;
  return p;
}

}  // namespace flatpeak::cuda
