// The `threads` communicator: ranks as threads of one process, joined by a shared world with
// per-rank posting slots and a generation barrier. Each rank owns its own TrackingAllocator.
//   RunResult r = run_ranks(4, [&](int rank, Communicator& comm) {
//     TrackingAllocator alloc;  ...; comm.all_reduce(x, x, n, DType::F32, ReduceOp::Sum); });
//   if (!r.ok()) return r.exit_code;   // r.failing_rank, r.message, r.ranks[p]
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "executor/comm/communicator.h"

namespace flatpeak::exec {

struct ThreadsOptions {
  // A rank waiting longer than this at a collective for a peer that does not arrive fails the
  // run, naming the lowest missing rank (exit code kExitRuntimeError).
  double peer_timeout_s = 60.0;
};

// What one rank ended with.
struct RankStatus {
  int rank = 0;
  bool ok = true;
  int exit_code = 0;    // 0, or the code of the failure that stopped this rank
  std::string message;  // empty when ok; else what stopped it (its own error or RankFailed)
};

struct RunResult {
  std::vector<RankStatus> ranks;  // [n]
  int exit_code = 0;              // the first failing rank's code (0 when every rank is ok)
  int failing_rank = -1;          // the first rank that failed, -1 when none
  std::string message;            // "rank R: <its error>" of the first failure
  bool ok() const { return failing_rank < 0; }
};

// The shared state of n thread ranks. Collectives post pointers to their send buffers; after a
// barrier every rank reads its peers' buffers directly, then a second barrier releases them.
class ThreadsWorld {
 public:
  ThreadsWorld(int size, ThreadsOptions options);
  // A sub-world of `parent` (split): rank r here is rank world_ranks[r] of the root world.
  ThreadsWorld(std::vector<int> world_ranks, ThreadsOptions options, ThreadsWorld* parent);
  int size() const { return size_; }
  int world_rank(int rank) const { return world_ranks_[static_cast<size_t>(rank)]; }

  struct Post {
    std::string op;
    const void* send = nullptr;
    const int64_t* send_counts = nullptr;  // all_to_allv
    const int64_t* send_displs = nullptr;  // all_to_allv
    int64_t count = 0;
    DType dtype = DType::F32;
    int shift = 0;
    int status_code = 0;  // check_status
    std::string status_message;
  };
  // Publishes `post` and waits for every rank (a generation barrier). Throws RankFailed when the
  // world has failed or a peer does not arrive within the timeout.
  void arrive(int rank, Post post);
  // Waits for every rank without posting (a generation barrier, as arrive(rank, post)).
  void arrive(int rank, const std::string& op);
  // The release of a collective: this rank is done reading its peers; waits until every rank of
  // the world is. Unlike a barrier it does not end when the world fails: every rank that passed
  // the collective's posting barrier reads and then releases (read_then_release), so the wait
  // ends, and until it does a peer may be reading this rank's send buffer, which leaving would
  // let the caller free. Only a peer that does not release within the timeout ends it early
  // (the run fails, naming that peer). Throws RankFailed afterwards when the world has failed.
  void release(int rank, const std::string& op);
  // The second half of a collective, after arrive(rank, post): runs `read` (this rank reading
  // its peers' posts and buffers), then `settle` (work the reads queued must end: the CUDA
  // communicator waits for its stream), then release(). When `read` or `settle` throws, this
  // rank still settles and releases before the error leaves: peers may be reading its send
  // buffer, which the error's unwinding would free. A failure of the world met there is
  // dropped; the rank's own error is the one that leaves.
  template <class Read, class Settle>
  void read_then_release(int rank, const std::string& op, Read&& read, Settle&& settle) {
    try {
      read();
      settle();
    } catch (...) {
      try {
        settle();
      } catch (...) {
      }
      try {
        release(rank, op + " (release)");
      } catch (...) {
      }
      throw;
    }
    release(rank, op + " (release)");
  }
  template <class Read>
  void read_then_release(int rank, const std::string& op, Read&& read) {
    read_then_release(rank, op, std::forward<Read>(read), [] {});
  }
  const Post& post(int rank) const { return posts_[static_cast<size_t>(rank)]; }

  // Collective over this world (Communicator::split): the sub-world of `rank`'s color, made by
  // the group's first member and kept alive by this world, and `rank`'s rank in it.
  std::pair<std::shared_ptr<ThreadsWorld>, int> split(int rank, int color, int key);

  // Marks the world failed (the first call wins), wakes every waiting rank, and fails its parent
  // and sub-worlds too. `rank` is in this world's numbering; failing_rank() is the root's.
  void fail(int rank, int exit_code, const std::string& message);
  bool failed() const;
  int failing_rank() const;
  int failure_code() const;
  std::string failure_message() const;

 private:
  void wait_locked(std::unique_lock<std::mutex>& lock, int rank, const std::string& op);
  bool fail_locked(int world_rank, int exit_code, const std::string& message);
  void fail_world(int world_rank, int exit_code, const std::string& message);
  void propagate_failure(int world_rank, int exit_code, const std::string& message);
  [[noreturn]] void throw_failed_locked() const;

  const int size_;
  const ThreadsOptions options_;
  std::vector<int> world_ranks_;     // [n] root-world rank of each rank
  ThreadsWorld* parent_ = nullptr;   // null for the root world
  std::map<std::pair<int64_t, int>, std::shared_ptr<ThreadsWorld>> children_;  // (split, color)
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  std::vector<Post> posts_;          // [n]
  std::vector<bool> arrived_;        // [n] in the current generation
  std::vector<int64_t> released_;    // [n] collectives each rank has released (release())
  int arrived_count_ = 0;
  int64_t generation_ = 0;
  bool failed_ = false;
  int failing_rank_ = -1;
  int failure_code_ = 0;
  std::string failure_message_;
};

class ThreadsCommunicator final : public Communicator {
 public:
  ThreadsCommunicator(ThreadsWorld& world, int rank) : world_(world), rank_(rank) {}
  ThreadsCommunicator(std::shared_ptr<ThreadsWorld> world, int rank) : world_(*world), rank_(rank), owned_(std::move(world)) {}
  int rank() const override { return rank_; }
  int size() const override { return world_.size(); }
  const char* backend_name() const override { return "threads"; }

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
  std::unique_ptr<Communicator> split(int color, int key) override;
  void check_status(int exit_code, const std::string& message) override;
  void abort(int exit_code, const std::string& message) override;

 private:
  void post_and_wait(ThreadsWorld::Post post);
  void check_same_op(const std::string& op, int64_t count, DType dtype);

  ThreadsWorld& world_;
  const int rank_;
  std::shared_ptr<ThreadsWorld> owned_;  // a split's sub-world
};

// Runs fn(rank, comm) on n threads (n ≥ 1). The first rank to throw fails the world: every rank
// blocked in (or later entering) a collective throws RankFailed naming it. Returns when every
// thread has returned; never throws for a rank's failure (it is in the result). A rank stuck in
// computation outside collectives is only stopped at its next collective.
RunResult run_ranks(int n, const std::function<void(int rank, Communicator& comm)>& fn,
                    ThreadsOptions options = {});

// run_ranks with each rank's communicator made by `make_comm` on that rank's thread (e.g. the
// CUDA backend's communicator for ranks sharing one GPU, over the same world); the same failure
// handling. A factory that throws fails its rank like fn would.
using CommFactory = std::function<std::unique_ptr<Communicator>(ThreadsWorld& world, int rank)>;
RunResult run_ranks_with(int n, const CommFactory& make_comm,
                         const std::function<void(int rank, Communicator& comm)>& fn,
                         ThreadsOptions options = {});

}  // namespace flatpeak::exec
