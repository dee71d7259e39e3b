// The `nccl` communicator: the Communicator interface (executor/comm/communicator.h) over NCCL,
// one rank per GPU, every buffer a device pointer, every collective queued on the rank's stream.
// Bootstrapped over any host communicator (mpi under mpirun/srun, threads on one machine with
// several GPUs): rank 0 makes the NCCL unique id and the host communicator hands it to the others;
// the host communicator also carries check_status and abort, which are host-side decisions.
//   MpiCommunicator host;                                 // or a ThreadsCommunicator
//   NcclCommunicator comm(host, stream);                  // cudaSetDevice(...) first
//   comm.all_to_allv(d_send, counts, displs, d_recv, rcounts, rdispls, DType::BF16);
//   cudaStreamSynchronize(stream);                        // collectives are asynchronous
// Built when nccl.h and libnccl are found beside the CUDA toolkit (FLATPEAK_HAVE_NCCL).
//
// Differences from the contract of communicator.h, both documented there for the CUDA backend:
// - Sums are NCCL's (ring/tree order), not rank order: results agree with threads/mpi within
//   fp32 rounding, not bitwise. The CUDA tolerances (3 %, DESIGN.md "Verify") cover this.
// - all_to_allv does not exchange the counts to check them (that would cost a synchronising
//   host round trip per call); a mismatch is NCCL's error or a hang caught by the watchdog of
//   the host communicator's next check_status.
// NCCL refuses two ranks on one device; ranks sharing one GPU use a threads-style device
// communicator instead (not this class).
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstdint>
#include <memory>
#include <string>

#include "executor/comm/communicator.h"
#include "executor/cuda/device_communicator.h"

namespace flatpeak::cuda {

class NcclCommunicator final : public DeviceCommunicator {
 public:
  // Collective over `host`: every rank of `host` must construct one, with the current CUDA device
  // set to its own GPU. Throws BackendError when NCCL fails.
  NcclCommunicator(exec::Communicator& host, cudaStream_t stream);
  ~NcclCommunicator() override;
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const char* backend_name() const override { return "nccl"; }
  cudaStream_t stream() const override { return stream_; }

  void all_to_allv(const void* send, const int64_t* send_counts, const int64_t* send_displs,
                   void* recv, const int64_t* recv_counts, const int64_t* recv_displs,
                   exec::DType dtype) override;
  void sendrecv_shift(const void* send, void* recv, int64_t count, exec::DType dtype,
                      int shift) override;
  void all_gather(const void* send, void* recv, int64_t count, exec::DType dtype) override;
  void reduce_scatter(const void* send, void* recv, int64_t count, exec::DType dtype) override;
  void all_reduce(const void* send, void* recv, int64_t count, exec::DType dtype,
                  exec::ReduceOp op) override;
  // Waits for this rank's queued collectives, then for every rank (host barrier).
  void barrier() override;
  // The host communicator's split and ncclCommSplit (NCCL ≥ 2.18; older: a new NCCL communicator
  // bootstrapped over the host's split), on the same stream.
  std::unique_ptr<exec::Communicator> split(int color, int key) override;
  void check_status(int exit_code, const std::string& message) override;
  // Aborts the NCCL communicator (unblocking queued collectives), then the host's abort.
  void abort(int exit_code, const std::string& message) override;

 private:
  NcclCommunicator(std::unique_ptr<exec::Communicator> host, cudaStream_t stream, ncclComm_t comm);

  exec::Communicator& host_;
  std::unique_ptr<exec::Communicator> owned_host_;  // a split's host communicator
  cudaStream_t stream_;
  ncclComm_t comm_ = nullptr;
  int rank_ = 0;
  int size_ = 1;
};

// NCCL's element type for a DType (F32, BF16, I32, I64).
ncclDataType_t nccl_type(exec::DType dtype);

}  // namespace flatpeak::cuda
