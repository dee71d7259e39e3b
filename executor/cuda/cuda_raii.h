// CUDA events and streams owned by scope (host code only, so plain .cpp files use them too;
// schedule_util_cuda.cuh re-exports them for the .cu schedules).
//   ScopedStream stream;  ScopedEvent done;  done.record(stream.get());
#pragma once

#include <cuda_runtime.h>

#include "executor/cuda/cuda_check.h"

namespace flatpeak::exec::cuda_detail {

// A CUDA event owned by scope.
class ScopedEvent {
 public:
  ScopedEvent() { FLATPEAK_CUDA_CHECK(cudaEventCreate(&event_)); }
  ~ScopedEvent() { (void)cudaEventDestroy(event_); }
  ScopedEvent(const ScopedEvent&) = delete;
  ScopedEvent& operator=(const ScopedEvent&) = delete;
  cudaEvent_t get() const { return event_; }
  void record(cudaStream_t stream) { FLATPEAK_CUDA_CHECK(cudaEventRecord(event_, stream)); }

 private:
  cudaEvent_t event_ = nullptr;
};

// A non-blocking CUDA stream owned by scope; declared before the allocator and buffers that use
// it, it outlives them. As with ScopedEvent, a failed destroy is ignored (destructors do not throw).
class ScopedStream {
 public:
  ScopedStream() { FLATPEAK_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking)); }
  ~ScopedStream() { (void)cudaStreamDestroy(stream_); }
  ScopedStream(const ScopedStream&) = delete;
  ScopedStream& operator=(const ScopedStream&) = delete;
  cudaStream_t get() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

}  // namespace flatpeak::exec::cuda_detail
