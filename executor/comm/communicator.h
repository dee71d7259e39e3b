// The communicator every multi-rank schedule talks to: threads (ranks as threads in one process),
// mpi (processes under mpirun/srun), later nccl. Buffers are raw bytes plus an element type.
//   run_ranks(4, [&](Communicator& comm) {                      // threads_comm.h
//     comm.all_reduce(local, global, E, DType::I64, ReduceOp::Sum);   // per-expert counts
//     comm.all_to_allv(send, send_counts, send_displs, recv, recv_counts, recv_displs, DType::F32);
//   });
#pragma once

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "executor/ops/dtype.h"

namespace flatpeak::exec {

enum class ReduceOp : uint8_t { Sum, Max };

// Exit codes of DESIGN.md that a failed rank maps to.
constexpr int kExitInputError = 2;
constexpr int kExitRuntimeError = 4;

// Thrown on every rank (the failing one included) once any rank has failed: a blocked collective
// wakes and throws it. `failing_rank` names the first rank that failed, `exit_code` is its code.
class RankFailed : public std::runtime_error {
 public:
  RankFailed(int failing_rank_, int exit_code_, const std::string& message_);
  int failing_rank;
  int exit_code;
  std::string reason;  // the failing rank's own message
};

// Misuse of a collective (mismatched counts, bad arguments): names the rank and the operation.
class CommError : public std::runtime_error {
 public:
  CommError(int rank, const std::string& operation, const std::string& message);
};

// Contract shared by all implementations:
// - Every rank calls the same collectives in the same order (counts are per-element of dtype).
// - Sums are deterministic: every element is reduced in rank order 0, 1, ..., n−1, in fp32 for
//   F32 and BF16 (BF16 rounded once at the end), exactly in int64 for I64/I32; so threads and MPI
//   give bitwise identical results. Max is order-free.
// - send and receive buffers may not overlap (except all_reduce, which allows send == recv).
// - After any rank has failed, every collective throws RankFailed.
class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual const char* backend_name() const = 0;  // "threads" | "mpi" | "nccl"

  // Sends send_counts[p] elements at send + send_displs[p] to rank p and receives recv_counts[p]
  // elements from rank p at recv + recv_displs[p] (displacements in elements). recv_counts[p]
  // must equal what p sends here (CommError otherwise).
  virtual void all_to_allv(const void* send, const int64_t* send_counts,
                           const int64_t* send_displs, void* recv, const int64_t* recv_counts,
                           const int64_t* recv_displs, DType dtype) = 0;
  // Ring shift: sends `count` elements to rank (r + shift) mod n and receives `count` from rank
  // (r − shift) mod n. shift may be negative.
  virtual void sendrecv_shift(const void* send, void* recv, int64_t count, DType dtype,
                              int shift) = 0;
  // recv [n, count]: rank p's `count` elements at p·count.
  virtual void all_gather(const void* send, void* recv, int64_t count, DType dtype) = 0;
  // send [n, count]: block p summed over ranks (in rank order) lands in rank p's recv [count].
  virtual void reduce_scatter(const void* send, void* recv, int64_t count, DType dtype) = 0;
  virtual void all_reduce(const void* send, void* recv, int64_t count, DType dtype,
                          ReduceOp op) = 0;
  virtual void barrier() = 0;

  // Collective (as MPI_Comm_split): ranks passing the same color (≥ 0) form a new communicator,
  // ranked by key, ties in this communicator's rank order; e.g. EP groups of EP consecutive ranks:
  // split(rank / EP, rank % EP). The new communicator keeps this one's backend and contract; its
  // RankFailed names ranks of the whole job (the root communicator's numbering), and a failure on
  // either side wakes the other. Destroy it before this one.
  virtual std::unique_ptr<Communicator> split(int color, int key) = 0;

  // The agreed status at a checkpoint: every rank passes its own exit code (0 = fine) and a
  // message; if any is non-zero, every rank throws RankFailed naming the lowest failing rank,
  // with its code and message. Costs one small collective.
  virtual void check_status(int exit_code, const std::string& message) = 0;
  // Ends the run from this rank with `exit_code`: threads mark the world failed and throw
  // RankFailed here; MPI writes the message to stderr and calls MPI_Abort (never returns).
  virtual void abort(int exit_code, const std::string& message) = 0;
};

// Reduces n contributions element-wise in rank order into out (see the contract above).
void reduce_in_rank_order(const std::vector<const void*>& contributions, void* out,
                          int64_t count, DType dtype, ReduceOp op);

// Which launcher started this process: "mpi" when OMPI_COMM_WORLD_SIZE, PMI_SIZE or
// SLURM_NTASKS is set (an srun/mpirun job), "threads" otherwise.
std::string detect_launcher();

// The exit code a failure maps to: kExitInputError for flatpeak::InputError, kExitRuntimeError
// for anything else.
int exit_code_for_current_exception();

}  // namespace flatpeak::exec
