// Ranks sharing one GPU: the `threads` protocol (executor/comm/threads_comm.h: ranks as threads
// of one process, posting their send buffers to a shared world and reading their peers') with
// device buffers. Each rank has its own stream and its own DeviceAllocator (so per-rank peaks are
// tracked apart, as on separate GPUs); peers' buffers are read with device-to-device copies on the
// reading rank's stream, and sums run in a kernel in rank order 0..n−1 in fp32 (bf16 rounded
// once), so results are bitwise those of the threads and mpi communicators. NCCL refuses two
// ranks on one device, and a lent machine has one GPU and no launcher: this is how several ranks
// run there.
//   RunResult r = run_ranks_on_device(4, /*device=*/0, [&](int rank, Communicator& c) {
//     auto& comm = static_cast<DeviceThreadsCommunicator&>(c);
//     DeviceBuffer x(comm.allocator(), bytes, Category::Dispatch, comm.stream()); ... });
// Each collective synchronises the rank's stream at its start (its send buffer must be written)
// and before it releases its peers (they must be done reading): a reference mode, not a fast one.
#pragma once

#include <cuda_runtime.h>

#include <memory>
#include <string>

#include "executor/comm/threads_comm.h"
#include "executor/cuda/device_allocator.h"
#include "executor/cuda/device_communicator.h"

namespace flatpeak::cuda {

class DeviceThreadsCommunicator final : public DeviceCommunicator {
 public:
  DeviceThreadsCommunicator(exec::ThreadsWorld& world, int rank, int device,
                            DeviceAllocator::Options allocator_options = {});
  ~DeviceThreadsCommunicator() override;
  DeviceThreadsCommunicator(const DeviceThreadsCommunicator&) = delete;
  DeviceThreadsCommunicator& operator=(const DeviceThreadsCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return world_.size(); }
  const char* backend_name() const override { return "cuda-threads"; }
  cudaStream_t stream() const override { return stream_; }
  DeviceAllocator& allocator() { return *allocator_; }

  void all_to_allv(const void* send, const int64_t* send_counts, const int64_t* send_displs,
                   void* recv, const int64_t* recv_counts, const int64_t* recv_displs,
                   exec::DType dtype) override;
  void sendrecv_shift(const void* send, void* recv, int64_t count, exec::DType dtype,
                      int shift) override;
  void all_gather(const void* send, void* recv, int64_t count, exec::DType dtype) override;
  void reduce_scatter(const void* send, void* recv, int64_t count, exec::DType dtype) override;
  void all_reduce(const void* send, void* recv, int64_t count, exec::DType dtype,
                  exec::ReduceOp op) override;
  void barrier() override;
  // A sub-world of this one (threads_comm.h, ThreadsWorld::split), on the same device with its
  // own stream and allocator.
  std::unique_ptr<exec::Communicator> split(int color, int key) override;
  void check_status(int exit_code, const std::string& message) override;
  void abort(int exit_code, const std::string& message) override;

 private:
  // Waits for this rank's queued work (its send buffer must be written), posts, waits for every rank.
  void post_and_wait(exec::ThreadsWorld::Post post);
  // Throws CommError when a rank posted another op, count or dtype than this one.
  void check_same_op() const;
  // check_same_op, then `read` (copies from peers' buffers on this rank's stream), then waits for
  // the stream and for every rank, peers being free to reuse their buffers after; on an error,
  // ThreadsWorld::read_then_release still waits for the stream and every rank before it leaves,
  // so that no peer is copying from a buffer this rank's unwinding frees.
  template <class Read>
  void read_then_release(const std::string& op, Read&& read);
  // Reduces the n contributions staged at [n, count] into out, in rank order, on the stream.
  void reduce_staged(const void* staged, void* out, int64_t count, exec::DType dtype, exec::ReduceOp op);

  exec::ThreadsWorld& world_;
  const int rank_;
  const int device_;
  const DeviceAllocator::Options allocator_options_;
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<DeviceAllocator> allocator_;
  std::shared_ptr<exec::ThreadsWorld> owned_world_;  // a split's sub-world
};

// run_ranks_with (threads_comm.h) with a DeviceThreadsCommunicator per rank on `device`, each
// rank's allocator made with `allocator_options` (its device set to `device`).
exec::RunResult run_ranks_on_device(int n, int device,
                                    const std::function<void(int rank, exec::Communicator& comm)>& fn,
                                    exec::ThreadsOptions options = {},
                                    DeviceAllocator::Options allocator_options = {});

}  // namespace flatpeak::cuda
