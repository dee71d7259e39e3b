// The `mpi` communicator: one rank per process under mpirun/srun (built when MPI is found,
// FLATPEAK_HAVE_MPI). Same contract as communicator.h; sums reduce in rank order locally.
//   MpiCommunicator comm(MpiOptions{});            // MPI_Init_thread unless already initialised
//   RankStatus s = run_mpi_rank(comm, [&](int rank, Communicator& c) { ... });
//   return s.exit_code;                             // equal on every rank (agreed), else aborted
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "executor/comm/communicator.h"
#include "executor/comm/threads_comm.h"

namespace flatpeak::exec {

struct MpiOptions {
  // Watchdog: a collective that has not completed after this long means a peer stopped
  // answering; the rank writes "flatpeak: error: rank R: ..." to stderr and calls
  // MPI_Abort(MPI_COMM_WORLD, kExitRuntimeError), which ends every process of the job.
  double peer_timeout_s = 60.0;
};

class MpiCommunicator final : public Communicator {
 public:
  explicit MpiCommunicator(MpiOptions options = {});
  ~MpiCommunicator() override;  // joins the watchdog; MPI_Finalize if this object initialised MPI
  MpiCommunicator(const MpiCommunicator&) = delete;
  MpiCommunicator& operator=(const MpiCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const char* backend_name() const override { return "mpi"; }

  void all_to_allv(const void* send, const int64_t* send_counts, const int64_t* send_displs,
                   void* recv, const int64_t* recv_counts, const int64_t* recv_displs,
                   DType dtype) override;
  void sendrecv_shift(const void* send, void* recv, int64_t count, DType dtype,
                      int shift) override;
  void all_gather(const void* send, void* recv, int64_t count, DType dtype) override;
  void reduce_scatter(const void* send, void* recv, int64_t count, DType dtype) override;
  void all_reduce(const void* send, void* recv, int64_t count, DType dtype,
                  ReduceOp op) override;
  void barrier() override;
  // MPI_Comm_split of this communicator (its own watchdog; MPI_Comm_free when destroyed).
  std::unique_ptr<Communicator> split(int color, int key) override;
  void check_status(int exit_code, const std::string& message) override;
  // Writes "flatpeak: error: rank R: message" (R: the job's rank) to stderr, then
  // MPI_Abort(MPI_COMM_WORLD, exit_code), also from a split: the only place the library writes,
  // because the process ends here.
  void abort(int exit_code, const std::string& message) override;

 private:
  class OpScope;
  struct CommHandle;  // the MPI_Comm (mpi.h stays out of this header)
  MpiCommunicator(MpiOptions options, std::unique_ptr<CommHandle> comm, int world_rank);
  void check(int mpi_result, const char* op) const;
  int world_rank_of(int rank) const;
  void watchdog_loop();

  MpiOptions options_;
  std::unique_ptr<CommHandle> comm_;
  int world_rank_ = 0;
  int rank_ = 0;
  int size_ = 1;
  bool initialised_here_ = false;
  std::mutex mutex_;
  std::condition_variable cv_;
  bool stopping_ = false;
  const char* current_op_ = nullptr;  // the collective in progress, or null
  std::chrono::steady_clock::time_point op_start_;
  std::thread watchdog_;
};

// Runs fn(rank, comm) on this process's rank. An exception on this rank aborts the job through
// comm.abort (exit code: kExitInputError for InputError, else kExitRuntimeError; the message
// names this rank); a RankFailed from an agreed check_status returns that status, identical on
// every rank. Returns {ok, 0} on success.
RankStatus run_mpi_rank(MpiCommunicator& comm,
                        const std::function<void(int rank, Communicator& comm)>& fn);

}  // namespace flatpeak::exec
