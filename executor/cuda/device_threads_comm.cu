// DeviceThreadsCommunicator (device_threads_comm.h).
#include "executor/cuda/device_threads_comm.h"

#include <algorithm>
#include <vector>

#include "executor/cuda/cuda_check.h"
#include "executor/cuda/device_threads_comm_kernels.cuh"
#include "executor/cuda/kernel_util.cuh"

namespace flatpeak::cuda {

namespace {

using exec::cuda_detail::launch_reduce_rank_order;  // device_threads_comm_kernels.cuh

const char* byte_ptr(const void* p, int64_t elems, exec::DType dtype) {
  return static_cast<const char*>(p) + elems * exec::dtype_bytes(dtype);
}

}  // namespace

DeviceThreadsCommunicator::DeviceThreadsCommunicator(exec::ThreadsWorld& world, int rank, int device,
                                                     DeviceAllocator::Options allocator_options)
    : world_(world), rank_(rank), device_(device), allocator_options_(allocator_options) {
  FLATPEAK_CUDA_CHECK(cudaSetDevice(device));
  allocator_options.device = device;
  allocator_ = std::make_unique<DeviceAllocator>(allocator_options);
  FLATPEAK_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
}

DeviceThreadsCommunicator::~DeviceThreadsCommunicator() {
  if (stream_ != nullptr) {
    (void)cudaStreamSynchronize(stream_);
    (void)cudaStreamDestroy(stream_);
  }
}

void DeviceThreadsCommunicator::post_and_wait(exec::ThreadsWorld::Post post) {
  FLATPEAK_CUDA_CHECK(cudaStreamSynchronize(stream_));
  world_.arrive(rank_, std::move(post));
}

void DeviceThreadsCommunicator::check_same_op() const {
  const exec::ThreadsWorld::Post& mine = world_.post(rank_);
  const std::string& op = mine.op;
  const int64_t count = mine.count;
  const exec::DType dtype = mine.dtype;
  for (int p = 0; p < size(); ++p) {
    const auto& other = world_.post(p);
    if (other.op != op || other.count != count || other.dtype != dtype)
      throw exec::CommError(rank_, op, "rank " + std::to_string(p) + " called " + other.op + " with " +
                                           std::to_string(other.count) + " " + exec::dtype_name(other.dtype) +
                                           " elements, this rank " + std::to_string(count) + " " +
                                           exec::dtype_name(dtype));
  }
}

template <class Read>
void DeviceThreadsCommunicator::read_then_release(const std::string& op, Read&& read) {
  world_.read_then_release(
      rank_, op,
      [&] {
        check_same_op();
        read();
      },
      [&] { FLATPEAK_CUDA_CHECK(cudaStreamSynchronize(stream_)); });
}

void DeviceThreadsCommunicator::reduce_staged(const void* staged, void* out, int64_t count, exec::DType dtype,
                                              exec::ReduceOp op) {
  launch_reduce_rank_order(staged, out, count, dtype, size(), op == exec::ReduceOp::Sum, stream_);
}

void DeviceThreadsCommunicator::all_to_allv(const void* send, const int64_t* send_counts,
                                            const int64_t* send_displs, void* recv,
                                            const int64_t* recv_counts, const int64_t* recv_displs,
                                            exec::DType dtype) {
  exec::ThreadsWorld::Post post;
  post.op = "all_to_allv";
  post.send = send;
  post.send_counts = send_counts;
  post.send_displs = send_displs;
  post.count = -1;
  post.dtype = dtype;
  post_and_wait(post);
  const int64_t elem = exec::dtype_bytes(dtype);
  read_then_release("all_to_allv", [&] {
    for (int p = 0; p < size(); ++p) {
      const auto& src = world_.post(p);
      const int64_t n = src.send_counts[rank_];
      if (n != recv_counts[p])
        throw exec::CommError(rank_, "all_to_allv", "expects " + std::to_string(recv_counts[p]) +
                                                        " elements from rank " + std::to_string(p) +
                                                        ", which sends " + std::to_string(n));
      if (n > 0)
        FLATPEAK_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(recv) + recv_displs[p] * elem,
                                            byte_ptr(src.send, src.send_displs[rank_], dtype),
                                            static_cast<size_t>(n * elem), cudaMemcpyDeviceToDevice, stream_));
    }
  });
}

void DeviceThreadsCommunicator::sendrecv_shift(const void* send, void* recv, int64_t count,
                                               exec::DType dtype, int shift) {
  exec::ThreadsWorld::Post post;
  post.op = "sendrecv_shift";
  post.send = send;
  post.count = count;
  post.dtype = dtype;
  post.shift = shift;
  post_and_wait(post);
  read_then_release("sendrecv_shift", [&] {
    const int n = size();
    const int src = ((rank_ - shift) % n + n) % n;
    if (world_.post(src).shift != shift)
      throw exec::CommError(rank_, "sendrecv_shift", "rank " + std::to_string(src) + " shifts by " +
                                                         std::to_string(world_.post(src).shift) +
                                                         ", this rank by " + std::to_string(shift));
    if (count > 0)
      FLATPEAK_CUDA_CHECK(cudaMemcpyAsync(recv, world_.post(src).send,
                                          static_cast<size_t>(count * exec::dtype_bytes(dtype)),
                                          cudaMemcpyDeviceToDevice, stream_));
  });
}

void DeviceThreadsCommunicator::all_gather(const void* send, void* recv, int64_t count, exec::DType dtype) {
  exec::ThreadsWorld::Post post;
  post.op = "all_gather";
  post.send = send;
  post.count = count;
  post.dtype = dtype;
  post_and_wait(post);
  const int64_t bytes = count * exec::dtype_bytes(dtype);
  read_then_release("all_gather", [&] {
    for (int p = 0; p < size() && bytes > 0; ++p)
      FLATPEAK_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(recv) + p * bytes, world_.post(p).send,
                                          static_cast<size_t>(bytes), cudaMemcpyDeviceToDevice, stream_));
  });
}

void DeviceThreadsCommunicator::reduce_scatter(const void* send, void* recv, int64_t count, exec::DType dtype) {
  exec::ThreadsWorld::Post post;
  post.op = "reduce_scatter";
  post.send = send;
  post.count = count;
  post.dtype = dtype;
  post_and_wait(post);
  const int64_t bytes = count * exec::dtype_bytes(dtype);
  DeviceBuffer staged(*allocator_, size() * bytes, exec::Category::Comm, stream_);
  read_then_release("reduce_scatter", [&] {
    for (int p = 0; p < size() && bytes > 0; ++p)
      FLATPEAK_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(staged.raw()) + p * bytes,
                                          static_cast<const char*>(world_.post(p).send) + rank_ * bytes,
                                          static_cast<size_t>(bytes), cudaMemcpyDeviceToDevice, stream_));
  });
  reduce_staged(staged.raw(), recv, count, dtype, exec::ReduceOp::Sum);
  FLATPEAK_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void DeviceThreadsCommunicator::all_reduce(const void* send, void* recv, int64_t count, exec::DType dtype,
                                           exec::ReduceOp op) {
  exec::ThreadsWorld::Post post;
  post.op = op == exec::ReduceOp::Sum ? "all_reduce(sum)" : "all_reduce(max)";
  post.send = send;
  post.count = count;
  post.dtype = dtype;
  const std::string name = post.op;
  post_and_wait(post);
  const int64_t bytes = count * exec::dtype_bytes(dtype);
  DeviceBuffer staged(*allocator_, size() * bytes, exec::Category::Comm, stream_);
  // Peers read this rank's send, which may be recv: write recv only after every rank has copied.
  read_then_release(name, [&] {
    for (int p = 0; p < size() && bytes > 0; ++p)
      FLATPEAK_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(staged.raw()) + p * bytes, world_.post(p).send,
                                          static_cast<size_t>(bytes), cudaMemcpyDeviceToDevice, stream_));
  });
  reduce_staged(staged.raw(), recv, count, dtype, op);
  FLATPEAK_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void DeviceThreadsCommunicator::barrier() {
  exec::ThreadsWorld::Post post;
  post.op = "barrier";
  post_and_wait(post);
  read_then_release("barrier", [] {});
}

void DeviceThreadsCommunicator::check_status(int exit_code, const std::string& message) {
  exec::ThreadsWorld::Post post;
  post.op = "check_status";
  post.status_code = exit_code;
  post.status_message = message;
  post_and_wait(post);
  int failing = -1;
  int code = 0;
  std::string reason;
  read_then_release("check_status", [&] {
    for (int p = 0; p < size() && failing < 0; ++p)
      if (world_.post(p).status_code != 0) failing = p;
    if (failing >= 0) {
      code = world_.post(failing).status_code;
      reason = world_.post(failing).status_message;
    }
  });
  if (failing >= 0) throw exec::RankFailed(world_.world_rank(failing), code, reason);
}

std::unique_ptr<exec::Communicator> DeviceThreadsCommunicator::split(int color, int key) {
  FLATPEAK_CUDA_CHECK(cudaStreamSynchronize(stream_));
  auto [world, rank] = world_.split(rank_, color, key);
  auto out = std::make_unique<DeviceThreadsCommunicator>(*world, rank, device_, allocator_options_);
  out->owned_world_ = std::move(world);
  return out;
}

void DeviceThreadsCommunicator::abort(int exit_code, const std::string& message) {
  world_.fail(rank_, exit_code, message);
  throw exec::RankFailed(world_.failing_rank(), world_.failure_code(), world_.failure_message());
}

exec::RunResult run_ranks_on_device(int n, int device,
                                    const std::function<void(int rank, exec::Communicator& comm)>& fn,
                                    exec::ThreadsOptions options, DeviceAllocator::Options allocator_options) {
  return exec::run_ranks_with(
      n,
      [device, allocator_options](exec::ThreadsWorld& world, int rank) {
        return std::make_unique<DeviceThreadsCommunicator>(world, rank, device, allocator_options);
      },
      fn, options);
}

}  // namespace flatpeak::cuda
