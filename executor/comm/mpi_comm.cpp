#include "executor/comm/mpi_comm.h"

#include <mpi.h>

#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace flatpeak::exec {

namespace {

int to_int(int64_t value, int rank, const char* op) {
  if (value < 0 || value > INT_MAX) {
    throw CommError(rank, op, "message of " + std::to_string(value) +
                                  " bytes exceeds MPI's int count");
  }
  return static_cast<int>(value);
}

}  // namespace

struct MpiCommunicator::CommHandle {
  MPI_Comm comm = MPI_COMM_WORLD;
  bool owned = false;  // a split's communicator, freed with this object
};

// Marks a collective in progress for the watchdog.
class MpiCommunicator::OpScope {
 public:
  OpScope(MpiCommunicator& comm, const char* op) : comm_(comm) {
    std::lock_guard<std::mutex> lock(comm_.mutex_);
    comm_.current_op_ = op;
    comm_.op_start_ = std::chrono::steady_clock::now();
  }
  ~OpScope() {
    std::lock_guard<std::mutex> lock(comm_.mutex_);
    comm_.current_op_ = nullptr;
  }
  OpScope(const OpScope&) = delete;
  OpScope& operator=(const OpScope&) = delete;

 private:
  MpiCommunicator& comm_;
};

MpiCommunicator::MpiCommunicator(MpiOptions options) : options_(options), comm_(std::make_unique<CommHandle>()) {
  int initialised = 0;
  MPI_Initialized(&initialised);
  if (!initialised) {
    int provided = 0;
    // The watchdog may call MPI_Abort while the main thread is inside a collective.
    MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
    initialised_here_ = true;
  }
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
  MPI_Comm_size(MPI_COMM_WORLD, &size_);
  world_rank_ = rank_;
  watchdog_ = std::thread([this]() { watchdog_loop(); });
}

MpiCommunicator::MpiCommunicator(MpiOptions options, std::unique_ptr<CommHandle> comm, int world_rank)
    : options_(options), comm_(std::move(comm)), world_rank_(world_rank) {
  MPI_Comm_set_errhandler(comm_->comm, MPI_ERRORS_RETURN);
  MPI_Comm_rank(comm_->comm, &rank_);
  MPI_Comm_size(comm_->comm, &size_);
  watchdog_ = std::thread([this]() { watchdog_loop(); });
}

std::unique_ptr<Communicator> MpiCommunicator::split(int color, int key) {
  const char* op = "split";
  OpScope scope(*this, op);
  if (color < 0) throw CommError(rank_, op, "color must be >= 0 (got " + std::to_string(color) + ")");
  auto handle = std::make_unique<CommHandle>();
  check(MPI_Comm_split(comm_->comm, color, key, &handle->comm), op);
  handle->owned = true;
  return std::unique_ptr<Communicator>(new MpiCommunicator(options_, std::move(handle), world_rank_));
}

int MpiCommunicator::world_rank_of(int rank) const {
  if (!comm_->owned) return rank;
  MPI_Group mine = MPI_GROUP_NULL, world = MPI_GROUP_NULL;
  int out = rank;
  MPI_Comm_group(comm_->comm, &mine);
  MPI_Comm_group(MPI_COMM_WORLD, &world);
  MPI_Group_translate_ranks(mine, 1, &rank, world, &out);
  MPI_Group_free(&mine);
  MPI_Group_free(&world);
  return out;
}

MpiCommunicator::~MpiCommunicator() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (watchdog_.joinable()) watchdog_.join();
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (comm_->owned && !finalized) MPI_Comm_free(&comm_->comm);
  if (initialised_here_ && !finalized) MPI_Finalize();
}

void MpiCommunicator::watchdog_loop() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stopping_) {
    cv_.wait_for(lock, std::chrono::milliseconds(50));
    if (current_op_ == nullptr) continue;
    const double waited_s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - op_start_).count();
    if (waited_s > options_.peer_timeout_s) {
      const std::string message = std::string("no answer from a peer in ") + current_op_ +
                                  " within " + std::to_string(options_.peer_timeout_s) +
                                  " s; a rank stopped answering (watchdog abort)";
      lock.unlock();
      abort(kExitRuntimeError, message);
      return;
    }
  }
}

void MpiCommunicator::check(int mpi_result, const char* op) const {
  if (mpi_result == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(mpi_result, text, &length);
  throw CommError(rank_, op, std::string("MPI error: ") + std::string(text, static_cast<size_t>(length)));
}

void MpiCommunicator::all_to_allv(const void* send, const int64_t* send_counts,
                                  const int64_t* send_displs, void* recv,
                                  const int64_t* recv_counts, const int64_t* recv_displs,
                                  DType dtype) {
  const char* op = "all_to_allv";
  OpScope scope(*this, op);
  const size_t n = static_cast<size_t>(size_);
  // Counts first, so that a mismatch is an error naming the peer (as with threads), not a
  // truncated message.
  std::vector<int64_t> incoming(n);
  check(MPI_Alltoall(send_counts, 1, MPI_INT64_T, incoming.data(), 1, MPI_INT64_T,
                     comm_->comm), op);
  for (size_t p = 0; p < n; ++p) {
    if (incoming[p] != recv_counts[p]) {
      throw CommError(rank_, op, "expects " + std::to_string(recv_counts[p]) +
                                     " elements from rank " + std::to_string(p) +
                                     ", which sends " + std::to_string(incoming[p]));
    }
  }
  const int64_t elem = dtype_bytes(dtype);
  std::vector<int> sc(n), sd(n), rc(n), rd(n);
  for (size_t p = 0; p < n; ++p) {
    sc[p] = to_int(send_counts[p] * elem, rank_, op);
    sd[p] = to_int(send_displs[p] * elem, rank_, op);
    rc[p] = to_int(recv_counts[p] * elem, rank_, op);
    rd[p] = to_int(recv_displs[p] * elem, rank_, op);
  }
  check(MPI_Alltoallv(send, sc.data(), sd.data(), MPI_BYTE, recv, rc.data(), rd.data(), MPI_BYTE,
                      comm_->comm), op);
}

void MpiCommunicator::sendrecv_shift(const void* send, void* recv, int64_t count, DType dtype,
                                     int shift) {
  const char* op = "sendrecv_shift";
  OpScope scope(*this, op);
  const int bytes = to_int(count * dtype_bytes(dtype), rank_, op);
  const int dst = ((rank_ + shift) % size_ + size_) % size_;
  const int src = ((rank_ - shift) % size_ + size_) % size_;
  check(MPI_Sendrecv(send, bytes, MPI_BYTE, dst, 71, recv, bytes, MPI_BYTE, src, 71,
                     comm_->comm, MPI_STATUS_IGNORE), op);
}

void MpiCommunicator::all_gather(const void* send, void* recv, int64_t count, DType dtype) {
  const char* op = "all_gather";
  OpScope scope(*this, op);
  const int bytes = to_int(count * dtype_bytes(dtype), rank_, op);
  check(MPI_Allgather(send, bytes, MPI_BYTE, recv, bytes, MPI_BYTE, comm_->comm), op);
}

void MpiCommunicator::reduce_scatter(const void* send, void* recv, int64_t count, DType dtype) {
  const char* op = "reduce_scatter";
  OpScope scope(*this, op);
  // Exchange the blocks, then sum in rank order here: deterministic, identical to threads.
  const int64_t bytes = count * dtype_bytes(dtype);
  std::vector<char> blocks(static_cast<size_t>(bytes * size_));  // [n, count]: block of rank p
  const int block_bytes = to_int(bytes, rank_, op);
  check(MPI_Alltoall(send, block_bytes, MPI_BYTE, blocks.data(), block_bytes, MPI_BYTE,
                     comm_->comm), op);
  std::vector<const void*> parts(static_cast<size_t>(size_));
  for (int p = 0; p < size_; ++p) parts[static_cast<size_t>(p)] = blocks.data() + p * bytes;
  reduce_in_rank_order(parts, recv, count, dtype, ReduceOp::Sum);
}

void MpiCommunicator::all_reduce(const void* send, void* recv, int64_t count, DType dtype,
                                 ReduceOp reduce) {
  const char* op = reduce == ReduceOp::Sum ? "all_reduce(sum)" : "all_reduce(max)";
  OpScope scope(*this, op);
  const int64_t bytes = count * dtype_bytes(dtype);
  std::vector<char> all(static_cast<size_t>(bytes * size_));  // [n, count]
  check(MPI_Allgather(send, to_int(bytes, rank_, op), MPI_BYTE, all.data(),
                      to_int(bytes, rank_, op), MPI_BYTE, comm_->comm), op);
  std::vector<const void*> parts(static_cast<size_t>(size_));
  for (int p = 0; p < size_; ++p) parts[static_cast<size_t>(p)] = all.data() + p * bytes;
  reduce_in_rank_order(parts, recv, count, dtype, reduce);
}

void MpiCommunicator::barrier() {
  OpScope scope(*this, "barrier");
  check(MPI_Barrier(comm_->comm), "barrier");
}

void MpiCommunicator::check_status(int exit_code, const std::string& message) {
  const char* op = "check_status";
  OpScope scope(*this, op);
  std::vector<int> codes(static_cast<size_t>(size_));
  check(MPI_Allgather(&exit_code, 1, MPI_INT, codes.data(), 1, MPI_INT, comm_->comm), op);
  int failing = -1;
  for (int p = 0; p < size_ && failing < 0; ++p) {
    if (codes[static_cast<size_t>(p)] != 0) failing = p;
  }
  if (failing < 0) return;
  // The failing rank's message travels to every rank, so that rank 0 can print it.
  int length = rank_ == failing ? static_cast<int>(message.size()) : 0;
  check(MPI_Bcast(&length, 1, MPI_INT, failing, comm_->comm), op);
  std::string reason(static_cast<size_t>(length), '\0');
  if (rank_ == failing) reason = message;
  if (length > 0) check(MPI_Bcast(&reason[0], length, MPI_CHAR, failing, comm_->comm), op);
  throw RankFailed(world_rank_of(failing), codes[static_cast<size_t>(failing)], reason);
}

void MpiCommunicator::abort(int exit_code, const std::string& message) {
  std::fprintf(stderr, "flatpeak: error: rank %d: %s\n", world_rank_, message.c_str());
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, exit_code);
  std::_Exit(exit_code);  // MPI_Abort does not return; this is for a broken MPI
}

RankStatus run_mpi_rank(MpiCommunicator& comm,
                        const std::function<void(int rank, Communicator& comm)>& fn) {
  RankStatus status;
  status.rank = comm.rank();
  try {
    fn(comm.rank(), comm);
  } catch (const RankFailed& e) {
    status.ok = false;
    status.exit_code = e.exit_code;
    status.message = "rank " + std::to_string(e.failing_rank) + ": " + e.reason;
  } catch (const std::exception& e) {
    comm.abort(exit_code_for_current_exception(), e.what());
  } catch (...) {
    comm.abort(kExitRuntimeError, "unknown exception");
  }
  return status;
}

}  // namespace flatpeak::exec
