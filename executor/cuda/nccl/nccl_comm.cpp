// NcclCommunicator (nccl_comm.h).
#include "executor/cuda/nccl/nccl_comm.h"

#include <cstring>
#include <stdexcept>
#include <string>

#include "executor/cuda/cuda_check.h"

#define FLATPEAK_NCCL_CHECK(statement)                                                          \
  do {                                                                                          \
    const ncclResult_t flatpeak_nccl_status_ = (statement);                                     \
    if (flatpeak_nccl_status_ != ncclSuccess) {                                                 \
      ::flatpeak::cuda::throw_backend_error(#statement, __FILE__, __LINE__, "ncclResult",       \
                                            ncclGetErrorString(flatpeak_nccl_status_));         \
    }                                                                                           \
  } while (0)

namespace flatpeak::cuda {

namespace {

size_t count_of(int64_t count, int rank, const char* op) {
  if (count < 0) throw exec::CommError(rank, op, "negative count " + std::to_string(count));
  return static_cast<size_t>(count);
}

const unsigned char* at(const void* base, int64_t displ, exec::DType dtype) {
  return static_cast<const unsigned char*>(base) + displ * exec::dtype_bytes(dtype);
}

// An open ncclGroupStart() closed on every path. A call that fails inside a group records the
// error in the calling thread's group state; ncclGroupEnd() then discards the group's queued
// sends and receives, returns that error and leaves the group. Left open, the group would defer
// every later NCCL call of this thread (queued, never launched). end() is the normal path and
// checked; the destructor, on unwind only, closes it and drops its result (the error being thrown
// is the one that counts). Only NCCL calls may throw between start and end: host-side checks run
// before the group opens, so an unwinding group never launches a partial exchange.
class NcclGroup {
 public:
  NcclGroup() { FLATPEAK_NCCL_CHECK(ncclGroupStart()); }
  ~NcclGroup() {
    if (open_) (void)ncclGroupEnd();
  }
  NcclGroup(const NcclGroup&) = delete;
  NcclGroup& operator=(const NcclGroup&) = delete;
  void end() {
    open_ = false;
    FLATPEAK_NCCL_CHECK(ncclGroupEnd());
  }

 private:
  bool open_ = true;
};

}  // namespace

ncclDataType_t nccl_type(exec::DType dtype) {
  switch (dtype) {
    case exec::DType::F32: return ncclFloat32;
    case exec::DType::BF16: return ncclBfloat16;
    case exec::DType::I32: return ncclInt32;
    case exec::DType::I64: return ncclInt64;
  }
  throw std::invalid_argument("nccl: unknown dtype");
}

NcclCommunicator::NcclCommunicator(exec::Communicator& host, cudaStream_t stream)
    : host_(host), stream_(stream), rank_(host.rank()), size_(host.size()) {
  // The unique id is 128 opaque bytes; rank 0 makes it, the host all-gather hands it round as
  // I32 words (all_gather moves typed elements) and each rank takes rank 0's copy.
  static_assert(sizeof(ncclUniqueId) % sizeof(int32_t) == 0, "ncclUniqueId is whole words");
  constexpr int64_t kWords = sizeof(ncclUniqueId) / sizeof(int32_t);
  ncclUniqueId id{};
  if (rank_ == 0) FLATPEAK_NCCL_CHECK(ncclGetUniqueId(&id));
  std::string all(static_cast<size_t>(size_) * sizeof(ncclUniqueId), '\0');
  host_.all_gather(&id, all.data(), kWords, exec::DType::I32);
  std::memcpy(&id, all.data(), sizeof(ncclUniqueId));
  FLATPEAK_NCCL_CHECK(ncclCommInitRank(&comm_, size_, id, rank_));
}

NcclCommunicator::NcclCommunicator(std::unique_ptr<exec::Communicator> host, cudaStream_t stream, ncclComm_t comm)
    : host_(*host), owned_host_(std::move(host)), stream_(stream), comm_(comm), rank_(host_.rank()), size_(host_.size()) {}

std::unique_ptr<exec::Communicator> NcclCommunicator::split(int color, int key) {
  FLATPEAK_CUDA_CHECK(cudaStreamSynchronize(stream_));
  std::unique_ptr<exec::Communicator> host = host_.split(color, key);
#if defined(NCCL_VERSION_CODE) && NCCL_VERSION_CODE >= NCCL_VERSION(2, 18, 0)
  // Ranks ordered by key, ties by this communicator's rank: the host split's order too.
  ncclComm_t sub = nullptr;
  FLATPEAK_NCCL_CHECK(ncclCommSplit(comm_, color, key, &sub, nullptr));
  return std::unique_ptr<exec::Communicator>(new NcclCommunicator(std::move(host), stream_, sub));
#else
  auto out = std::make_unique<NcclCommunicator>(*host, stream_);
  out->owned_host_ = std::move(host);
  return out;
#endif
}

NcclCommunicator::~NcclCommunicator() {
  if (comm_ != nullptr) (void)ncclCommDestroy(comm_);
}

void NcclCommunicator::all_to_allv(const void* send, const int64_t* send_counts,
                                   const int64_t* send_displs, void* recv,
                                   const int64_t* recv_counts, const int64_t* recv_displs,
                                   exec::DType dtype) {
  const ncclDataType_t type = nccl_type(dtype);
  for (int p = 0; p < size_; ++p) {  // every count checked before the group opens
    (void)count_of(send_counts[p], rank_, "all_to_allv");
    (void)count_of(recv_counts[p], rank_, "all_to_allv");
  }
  NcclGroup group;
  for (int p = 0; p < size_; ++p) {
    const size_t sc = static_cast<size_t>(send_counts[p]);
    const size_t rc = static_cast<size_t>(recv_counts[p]);
    if (sc > 0) FLATPEAK_NCCL_CHECK(ncclSend(at(send, send_displs[p], dtype), sc, type, p, comm_, stream_));
    if (rc > 0)
      FLATPEAK_NCCL_CHECK(ncclRecv(const_cast<unsigned char*>(at(recv, recv_displs[p], dtype)), rc, type, p, comm_, stream_));
  }
  group.end();
}

void NcclCommunicator::sendrecv_shift(const void* send, void* recv, int64_t count,
                                      exec::DType dtype, int shift) {
  const size_t n = count_of(count, rank_, "sendrecv_shift");
  const int to = ((rank_ + shift) % size_ + size_) % size_;
  const int from = ((rank_ - shift) % size_ + size_) % size_;
  if (n == 0) return;
  if (to == rank_) {  // a shift by a multiple of n: NCCL would send to itself; a copy does it
    FLATPEAK_CUDA_CHECK(cudaMemcpyAsync(recv, send, n * static_cast<size_t>(exec::dtype_bytes(dtype)),
                                        cudaMemcpyDeviceToDevice, stream_));
    return;
  }
  const ncclDataType_t type = nccl_type(dtype);  // may throw: before the group opens
  NcclGroup group;
  FLATPEAK_NCCL_CHECK(ncclSend(send, n, type, to, comm_, stream_));
  FLATPEAK_NCCL_CHECK(ncclRecv(recv, n, type, from, comm_, stream_));
  group.end();
}

void NcclCommunicator::all_gather(const void* send, void* recv, int64_t count, exec::DType dtype) {
  FLATPEAK_NCCL_CHECK(ncclAllGather(send, recv, count_of(count, rank_, "all_gather"), nccl_type(dtype), comm_, stream_));
}

void NcclCommunicator::reduce_scatter(const void* send, void* recv, int64_t count,
                                      exec::DType dtype) {
  FLATPEAK_NCCL_CHECK(ncclReduceScatter(send, recv, count_of(count, rank_, "reduce_scatter"), nccl_type(dtype), ncclSum,
                                        comm_, stream_));
}

void NcclCommunicator::all_reduce(const void* send, void* recv, int64_t count, exec::DType dtype,
                                  exec::ReduceOp op) {
  FLATPEAK_NCCL_CHECK(ncclAllReduce(send, recv, count_of(count, rank_, "all_reduce"), nccl_type(dtype),
                                    op == exec::ReduceOp::Sum ? ncclSum : ncclMax, comm_, stream_));
}

void NcclCommunicator::barrier() {
  FLATPEAK_CUDA_CHECK(cudaStreamSynchronize(stream_));
  host_.barrier();
}

void NcclCommunicator::check_status(int exit_code, const std::string& message) {
  host_.check_status(exit_code, message);
}

void NcclCommunicator::abort(int exit_code, const std::string& message) {
  if (comm_ != nullptr) {
    (void)ncclCommAbort(comm_);
    comm_ = nullptr;
  }
  host_.abort(exit_code, message);
}

}  // namespace flatpeak::cuda
