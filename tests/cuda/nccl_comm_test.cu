// The nccl communicator on one rank (a machine with one GPU cannot run more: NCCL refuses two
// ranks on one device): every collective of the interface on random non-zero data, bootstrapped
// over a one-rank threads communicator, in F32 and BF16. With one rank each collective is a
// copy, so results must be bitwise equal to the input. Multi-GPU runs need a multi-GPU machine.
// Exit 77 (skipped) without a CUDA device.
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "cuda_test_util.h"
#include "executor/comm/threads_comm.h"
#include "executor/cuda/nccl/nccl_comm.h"

using namespace flatpeak;
using namespace flatpeak::exec;
using namespace flatpeak::cuda;
using namespace flatpeak::cuda::test;

namespace {

void check_collectives(DeviceAllocator& alloc, NcclCommunicator& comm, DType dtype) {
  constexpr int64_t kCount = 1000;
  Rng rng(11);
  HostTensor x = HostTensor::from(rng.uniform(kCount), dtype);
  DeviceBuffer d_x = upload(alloc, x, Category::Comm);
  DeviceBuffer d_y(alloc, kCount * dtype_bytes(dtype), Category::Comm);
  const std::string name = std::string("nccl/") + dtype_name(dtype);
  const int64_t counts[1] = {kCount}, displs[1] = {0};

  comm.all_reduce(d_x.raw(), d_y.raw(), kCount, dtype, ReduceOp::Sum);
  FLATPEAK_CUDA_CHECK(cudaStreamSynchronize(comm.stream()));
  expect_equal(name + "/all_reduce", download(d_y, dtype).bytes, x.bytes);

  FLATPEAK_CUDA_CHECK(cudaMemset(d_y.raw(), 0, static_cast<size_t>(d_y.bytes())));
  comm.all_gather(d_x.raw(), d_y.raw(), kCount, dtype);
  FLATPEAK_CUDA_CHECK(cudaStreamSynchronize(comm.stream()));
  expect_equal(name + "/all_gather", download(d_y, dtype).bytes, x.bytes);

  FLATPEAK_CUDA_CHECK(cudaMemset(d_y.raw(), 0, static_cast<size_t>(d_y.bytes())));
  comm.reduce_scatter(d_x.raw(), d_y.raw(), kCount, dtype);
  FLATPEAK_CUDA_CHECK(cudaStreamSynchronize(comm.stream()));
  expect_equal(name + "/reduce_scatter", download(d_y, dtype).bytes, x.bytes);

  FLATPEAK_CUDA_CHECK(cudaMemset(d_y.raw(), 0, static_cast<size_t>(d_y.bytes())));
  comm.all_to_allv(d_x.raw(), counts, displs, d_y.raw(), counts, displs, dtype);
  FLATPEAK_CUDA_CHECK(cudaStreamSynchronize(comm.stream()));
  expect_equal(name + "/all_to_allv", download(d_y, dtype).bytes, x.bytes);

  FLATPEAK_CUDA_CHECK(cudaMemset(d_y.raw(), 0, static_cast<size_t>(d_y.bytes())));
  comm.sendrecv_shift(d_x.raw(), d_y.raw(), kCount, dtype, 1);
  comm.barrier();
  expect_equal(name + "/sendrecv_shift", download(d_y, dtype).bytes, x.bytes);
}

}  // namespace

int main() {
  if (const int rc = skip_unless_device(); rc != 0) return rc;
  const RunResult result = run_ranks(1, [](int, Communicator& host) {
    FLATPEAK_CUDA_CHECK(cudaSetDevice(0));
    DeviceAllocator alloc;
    cudaStream_t stream = nullptr;
    FLATPEAK_CUDA_CHECK(cudaStreamCreate(&stream));
    {
      NcclCommunicator comm(host, stream);
      for (DType dtype : {DType::F32, DType::BF16}) check_collectives(alloc, comm, dtype);
      comm.check_status(0, "");
    }
    FLATPEAK_CUDA_CHECK(cudaStreamDestroy(stream));
  });
  if (!result.ok()) {
    std::printf("FAIL: %s\n", result.message.c_str());
    return 1;
  }
  return finish();
}
