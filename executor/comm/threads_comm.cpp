#include "executor/comm/threads_comm.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <exception>
#include <numeric>
#include <thread>

namespace flatpeak::exec {

ThreadsWorld::ThreadsWorld(int size, ThreadsOptions options)
    : size_(size),
      options_(options),
      posts_(static_cast<size_t>(size > 0 ? size : 0)),
      arrived_(static_cast<size_t>(size > 0 ? size : 0), false),
      released_(static_cast<size_t>(size > 0 ? size : 0), 0) {
  if (size < 1) throw std::invalid_argument("threads world: size must be >= 1");
  world_ranks_.resize(static_cast<size_t>(size));
  std::iota(world_ranks_.begin(), world_ranks_.end(), 0);
}

ThreadsWorld::ThreadsWorld(std::vector<int> world_ranks, ThreadsOptions options, ThreadsWorld* parent)
    : ThreadsWorld(static_cast<int>(world_ranks.size()), options) {
  world_ranks_ = std::move(world_ranks);
  parent_ = parent;
}

void ThreadsWorld::throw_failed_locked() const {
  throw RankFailed(failing_rank_, failure_code_, failure_message_);
}

bool ThreadsWorld::fail_locked(int world_rank, int exit_code, const std::string& message) {
  if (failed_) return false;
  failed_ = true;
  failing_rank_ = world_rank;
  failure_code_ = exit_code;
  failure_message_ = message;
  cv_.notify_all();
  return true;
}

// The parent and the sub-worlds fail too, outside this world's lock (each has its own; the first
// call in each wins, so the walk ends).
void ThreadsWorld::propagate_failure(int world_rank, int exit_code, const std::string& message) {
  std::vector<ThreadsWorld*> others;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (parent_ != nullptr) others.push_back(parent_);
    for (const auto& child : children_) others.push_back(child.second.get());
  }
  for (ThreadsWorld* w : others) w->fail_world(world_rank, exit_code, message);
}

void ThreadsWorld::fail_world(int world_rank, int exit_code, const std::string& message) {
  bool first = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    first = fail_locked(world_rank, exit_code, message);
  }
  if (first) propagate_failure(world_rank, exit_code, message);
}

void ThreadsWorld::fail(int rank, int exit_code, const std::string& message) {
  fail_world(world_rank(rank), exit_code, message);
}

std::pair<std::shared_ptr<ThreadsWorld>, int> ThreadsWorld::split(int rank, int color, int key) {
  Post post;
  post.op = "split";
  post.count = color;
  post.shift = key;
  arrive(rank, post);
  // Every rank is between the two barriers: the posts and the generation are stable.
  std::vector<int> members;  // this color's ranks by (key, rank)
  int64_t split_id = 0;
  int other = -1;            // a rank that called another collective, and which
  std::string other_op;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    split_id = generation_;
    for (int p = 0; p < size_ && other < 0; ++p)
      if (posts_[static_cast<size_t>(p)].op != "split") {
        other = p;
        other_op = posts_[static_cast<size_t>(p)].op;
      }
    for (int p = 0; p < size_; ++p)
      if (posts_[static_cast<size_t>(p)].op == "split" && posts_[static_cast<size_t>(p)].count == color) members.push_back(p);
    std::stable_sort(members.begin(), members.end(), [&](int a, int b) {
      return posts_[static_cast<size_t>(a)].shift < posts_[static_cast<size_t>(b)].shift;
    });
  }
  const auto me = std::find(members.begin(), members.end(), rank);
  if (other >= 0) {
    arrive(rank, "split (release)");
    throw CommError(rank, "split", "rank " + std::to_string(other) + " called " + other_op +
                                       " (collectives must be called in the same order)");
  }
  if (color < 0 || me == members.end()) {
    arrive(rank, "split (release)");
    throw CommError(rank, "split", "color must be >= 0 (got " + std::to_string(color) + ")");
  }
  if (me == members.begin()) {  // the group's first member makes its world before the release
    std::vector<int> world_ranks;
    for (int m : members) world_ranks.push_back(world_rank(m));
    auto child = std::make_shared<ThreadsWorld>(std::move(world_ranks), options_, this);
    std::lock_guard<std::mutex> lock(mutex_);
    children_[{split_id, color}] = std::move(child);
  }
  arrive(rank, "split (release)");
  std::lock_guard<std::mutex> lock(mutex_);
  return {children_.at({split_id, color}), static_cast<int>(me - members.begin())};
}

bool ThreadsWorld::failed() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return failed_;
}
int ThreadsWorld::failing_rank() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return failing_rank_;
}
int ThreadsWorld::failure_code() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return failure_code_;
}
std::string ThreadsWorld::failure_message() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return failure_message_;
}

void ThreadsWorld::wait_locked(std::unique_lock<std::mutex>& lock, int rank,
                               const std::string& op) {
  if (failed_) throw_failed_locked();
  arrived_[static_cast<size_t>(rank)] = true;
  const int64_t generation = generation_;
  if (++arrived_count_ == size_) {
    arrived_count_ = 0;
    std::fill(arrived_.begin(), arrived_.end(), false);
    ++generation_;
    cv_.notify_all();
    return;
  }
  const auto deadline =
      std::chrono::steady_clock::now() +
      std::chrono::duration_cast<std::chrono::steady_clock::duration>(
          std::chrono::duration<double>(options_.peer_timeout_s));
  while (generation_ == generation && !failed_) {
    if (cv_.wait_until(lock, deadline) == std::cv_status::timeout && generation_ == generation &&
        !failed_) {
      int missing = -1;
      for (int p = 0; p < size_; ++p) {
        if (!arrived_[static_cast<size_t>(p)]) {
          missing = p;
          break;
        }
      }
      fail_locked(world_rank(missing), kExitRuntimeError,
                  "did not reach " + op + " within " + std::to_string(options_.peer_timeout_s) +
                      " s (rank " + std::to_string(world_rank(rank)) + " waited)");
    }
  }
  if (generation_ == generation) throw_failed_locked();
}

void ThreadsWorld::arrive(int rank, Post post) {
  std::unique_lock<std::mutex> lock(mutex_);
  const std::string op = post.op;
  posts_[static_cast<size_t>(rank)] = std::move(post);
  wait_locked(lock, rank, op);
}

void ThreadsWorld::arrive(int rank, const std::string& op) {
  std::unique_lock<std::mutex> lock(mutex_);
  wait_locked(lock, rank, op);
}

void ThreadsWorld::release(int rank, const std::string& op) {
  std::unique_lock<std::mutex> lock(mutex_);
  // Ranks call collectives in the same order, so a rank's n-th release is every rank's n-th.
  const int64_t mine = ++released_[static_cast<size_t>(rank)];
  cv_.notify_all();
  auto first_behind = [&] {
    for (int p = 0; p < size_; ++p)
      if (released_[static_cast<size_t>(p)] < mine) return p;
    return -1;
  };
  const auto deadline =
      std::chrono::steady_clock::now() +
      std::chrono::duration_cast<std::chrono::steady_clock::duration>(
          std::chrono::duration<double>(options_.peer_timeout_s));
  // A failure of the world wakes this wait but does not end it: peers still reading must finish.
  while (first_behind() >= 0) {
    if (cv_.wait_until(lock, deadline) == std::cv_status::timeout && first_behind() >= 0) {
      fail_locked(world_rank(first_behind()), kExitRuntimeError,
                  "did not reach " + op + " within " + std::to_string(options_.peer_timeout_s) +
                      " s (rank " + std::to_string(world_rank(rank)) + " waited)");
      throw_failed_locked();
    }
  }
  if (failed_) throw_failed_locked();
}

// ---- ThreadsCommunicator ----

void ThreadsCommunicator::post_and_wait(ThreadsWorld::Post post) {
  world_.arrive(rank_, std::move(post));
}

void ThreadsCommunicator::check_same_op(const std::string& op, int64_t count, DType dtype) {
  for (int p = 0; p < size(); ++p) {
    const ThreadsWorld::Post& other = world_.post(p);
    if (other.op != op) {
      throw CommError(rank_, op, "rank " + std::to_string(p) + " called " + other.op +
                                     " (collectives must be called in the same order)");
    }
    if (count >= 0 && (other.count != count || other.dtype != dtype)) {
      throw CommError(rank_, op, "rank " + std::to_string(p) + " passed " +
                                     std::to_string(other.count) + " " +
                                     dtype_name(other.dtype) + " elements, this rank " +
                                     std::to_string(count) + " " + dtype_name(dtype));
    }
  }
}

void ThreadsCommunicator::all_to_allv(const void* send, const int64_t* send_counts,
                                      const int64_t* send_displs, void* recv,
                                      const int64_t* recv_counts, const int64_t* recv_displs,
                                      DType dtype) {
  ThreadsWorld::Post post;
  post.op = "all_to_allv";
  post.send = send;
  post.send_counts = send_counts;
  post.send_displs = send_displs;
  post.count = -1;
  post.dtype = dtype;
  post_and_wait(post);
  const int64_t elem = dtype_bytes(dtype);
  world_.read_then_release(rank_, "all_to_allv", [&] {
    check_same_op("all_to_allv", -1, dtype);
    for (int p = 0; p < size(); ++p) {
      const ThreadsWorld::Post& src = world_.post(p);
      const int64_t n = src.send_counts[rank_];
      if (n != recv_counts[p]) {
        throw CommError(rank_, "all_to_allv",
                        "expects " + std::to_string(recv_counts[p]) + " elements from rank " +
                            std::to_string(p) + ", which sends " + std::to_string(n));
      }
      if (n > 0) {
        std::memcpy(static_cast<char*>(recv) + recv_displs[p] * elem,
                    static_cast<const char*>(src.send) + src.send_displs[rank_] * elem,
                    static_cast<size_t>(n * elem));
      }
    }
  });
}

void ThreadsCommunicator::sendrecv_shift(const void* send, void* recv, int64_t count,
                                         DType dtype, int shift) {
  ThreadsWorld::Post post;
  post.op = "sendrecv_shift";
  post.send = send;
  post.count = count;
  post.dtype = dtype;
  post.shift = shift;
  post_and_wait(post);
  world_.read_then_release(rank_, "sendrecv_shift", [&] {
    check_same_op("sendrecv_shift", count, dtype);
    const int n = size();
    const int src = ((rank_ - shift) % n + n) % n;
    if (world_.post(src).shift != shift) {
      throw CommError(rank_, "sendrecv_shift", "rank " + std::to_string(src) + " shifts by " +
                                                   std::to_string(world_.post(src).shift) +
                                                   ", this rank by " + std::to_string(shift));
    }
    if (count > 0) {
      std::memcpy(recv, world_.post(src).send, static_cast<size_t>(count * dtype_bytes(dtype)));
    }
  });
}

void ThreadsCommunicator::all_gather(const void* send, void* recv, int64_t count, DType dtype) {
  ThreadsWorld::Post post;
  post.op = "all_gather";
  post.send = send;
  post.count = count;
  post.dtype = dtype;
  post_and_wait(post);
  world_.read_then_release(rank_, "all_gather", [&] {
    check_same_op("all_gather", count, dtype);
    const int64_t bytes = count * dtype_bytes(dtype);
    for (int p = 0; p < size(); ++p) {
      if (bytes > 0) {
        std::memcpy(static_cast<char*>(recv) + p * bytes, world_.post(p).send,
                    static_cast<size_t>(bytes));
      }
    }
  });
}

void ThreadsCommunicator::reduce_scatter(const void* send, void* recv, int64_t count,
                                         DType dtype) {
  ThreadsWorld::Post post;
  post.op = "reduce_scatter";
  post.send = send;
  post.count = count;
  post.dtype = dtype;
  post_and_wait(post);
  world_.read_then_release(rank_, "reduce_scatter", [&] {
    check_same_op("reduce_scatter", count, dtype);
    const int64_t bytes = count * dtype_bytes(dtype);
    std::vector<const void*> parts(static_cast<size_t>(size()));
    for (int p = 0; p < size(); ++p) {
      parts[static_cast<size_t>(p)] = static_cast<const char*>(world_.post(p).send) + rank_ * bytes;
    }
    reduce_in_rank_order(parts, recv, count, dtype, ReduceOp::Sum);
  });
}

void ThreadsCommunicator::all_reduce(const void* send, void* recv, int64_t count, DType dtype,
                                     ReduceOp op) {
  ThreadsWorld::Post post;
  post.op = op == ReduceOp::Sum ? "all_reduce(sum)" : "all_reduce(max)";
  post.send = send;
  post.count = count;
  post.dtype = dtype;
  const std::string name = post.op;
  post_and_wait(post);
  // Peers read this rank's send, which may be recv: reduce into a private buffer first.
  std::vector<char> result;
  world_.read_then_release(rank_, name, [&] {
    check_same_op(name, count, dtype);
    result.resize(static_cast<size_t>(count * dtype_bytes(dtype)));
    std::vector<const void*> parts(static_cast<size_t>(size()));
    for (int p = 0; p < size(); ++p) parts[static_cast<size_t>(p)] = world_.post(p).send;
    reduce_in_rank_order(parts, result.data(), count, dtype, op);
  });
  if (!result.empty()) std::memcpy(recv, result.data(), result.size());
}

void ThreadsCommunicator::barrier() {
  ThreadsWorld::Post post;
  post.op = "barrier";
  post_and_wait(post);
  // Peers may still be reading the posts.
  world_.read_then_release(rank_, "barrier", [&] { check_same_op("barrier", -1, DType::F32); });
}

void ThreadsCommunicator::check_status(int exit_code, const std::string& message) {
  ThreadsWorld::Post post;
  post.op = "check_status";
  post.status_code = exit_code;
  post.status_message = message;
  post_and_wait(post);
  int failing = -1;
  int code = 0;
  std::string reason;
  world_.read_then_release(rank_, "check_status", [&] {
    check_same_op("check_status", -1, DType::F32);
    for (int p = 0; p < size() && failing < 0; ++p) {
      if (world_.post(p).status_code != 0) failing = p;
    }
    if (failing >= 0) {
      code = world_.post(failing).status_code;
      reason = world_.post(failing).status_message;
    }
  });
  if (failing >= 0) throw RankFailed(world_.world_rank(failing), code, reason);
}

std::unique_ptr<Communicator> ThreadsCommunicator::split(int color, int key) {
  auto [world, rank] = world_.split(rank_, color, key);
  return std::make_unique<ThreadsCommunicator>(std::move(world), rank);
}

void ThreadsCommunicator::abort(int exit_code, const std::string& message) {
  world_.fail(rank_, exit_code, message);
  throw RankFailed(world_.failing_rank(), world_.failure_code(), world_.failure_message());
}

// ---- run_ranks ----

RunResult run_ranks(int n, const std::function<void(int rank, Communicator& comm)>& fn,
                    ThreadsOptions options) {
  return run_ranks_with(
      n, [](ThreadsWorld& world, int rank) { return std::make_unique<ThreadsCommunicator>(world, rank); }, fn,
      options);
}

RunResult run_ranks_with(int n, const CommFactory& make_comm,
                         const std::function<void(int rank, Communicator& comm)>& fn,
                         ThreadsOptions options) {
  ThreadsWorld world(n, options);
  RunResult result;
  result.ranks.resize(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r]() {
      RankStatus& status = result.ranks[static_cast<size_t>(r)];
      status.rank = r;
      try {
        const std::unique_ptr<Communicator> comm = make_comm(world, r);
        fn(r, *comm);
      } catch (const std::exception& e) {
        status.ok = false;
        status.exit_code = exit_code_for_current_exception();
        status.message = e.what();
        // A RankFailed naming another rank is a consequence, not a new failure.
        const auto* rank_failed = dynamic_cast<const RankFailed*>(&e);
        if (rank_failed != nullptr) {
          world.fail(rank_failed->failing_rank, rank_failed->exit_code, rank_failed->reason);
        } else {
          world.fail(r, status.exit_code, e.what());
        }
      } catch (...) {
        status.ok = false;
        status.exit_code = kExitRuntimeError;
        status.message = "unknown exception";
        world.fail(r, status.exit_code, status.message);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  if (world.failed()) {
    result.failing_rank = world.failing_rank();
    result.exit_code = world.failure_code();
    const std::string prefix = "rank " + std::to_string(result.failing_rank) + ": ";
    const std::string reason = world.failure_message();
    result.message = reason.compare(0, prefix.size(), prefix) == 0 ? reason : prefix + reason;
  }
  return result;
}

}  // namespace flatpeak::exec
