// A communicator that moves device buffers in the order of one CUDA stream: its collectives are
// queued on that stream (NcclCommunicator) or synchronise it at their start and end
// (DeviceThreadsCommunicator). Work a caller queues around a collective (a copy into the send
// buffer, a read of the received one) is ordered with it only when it runs on that same stream.
//   DeviceCommunicator& dc = require_device_communicator(comm, blas.stream(), "ring-dtp schedule");
//   copy_into(send, s);  dc.all_gather(send, recv, n, DType::I64);  read(recv, s);  // one stream s
#pragma once

#include <cuda_runtime.h>

#include <sstream>
#include <stdexcept>
#include <string>

#include "executor/comm/communicator.h"

namespace flatpeak::cuda {

class DeviceCommunicator : public exec::Communicator {
 public:
  // The stream every collective of this communicator is ordered on.
  virtual cudaStream_t stream() const = 0;
};

// `comm` as a DeviceCommunicator whose stream is `stream`. std::invalid_argument, prefixed by
// `who`, for a host communicator (threads, mpi: they would memcpy device pointers on the CPU) or
// one on another stream (nothing would order the caller's work with the collectives).
inline DeviceCommunicator& require_device_communicator(exec::Communicator& comm, cudaStream_t stream,
                                                       const std::string& who) {
  auto* device = dynamic_cast<DeviceCommunicator*>(&comm);
  if (device == nullptr)
    throw std::invalid_argument(who + ": the communicator must move device buffers (cuda-threads or nccl), got " +
                                comm.backend_name());
  if (device->stream() != stream) {
    std::ostringstream message;
    message << who << ": the cuBLAS context must run on the communicator's stream (the " << comm.backend_name()
            << " communicator's collectives are ordered on stream " << static_cast<const void*>(device->stream())
            << ", the cuBLAS context's stream is " << static_cast<const void*>(stream) << ")";
    throw std::invalid_argument(message.str());
  }
  return *device;
}

}  // namespace flatpeak::cuda
