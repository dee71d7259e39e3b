// Four ranks sharing one GPU (DeviceThreadsCommunicator): every collective on random non-zero
// data (seeded by rank) against the CPU's rank-order reduction of the same host data — bitwise,
// since both sum in rank order in fp32 (bf16 rounded once); all-to-allv with uneven counts; the
// ring shift both ways; a failing rank ends every rank with RankFailed naming it.
// Exit 77 (skipped) without a CUDA device.
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include "cuda_test_util.h"
#include "executor/cuda/device_threads_comm.h"

using namespace flatpeak;
using namespace flatpeak::exec;
using namespace flatpeak::cuda;
using namespace flatpeak::cuda::test;

namespace {

constexpr int kRanks = 4;
constexpr int64_t kCount = 777;

std::vector<unsigned char> host_data(int rank, int64_t count, DType dtype) {
  Rng rng(100 + static_cast<uint32_t>(rank));
  return HostTensor::from(rng.uniform(count), dtype).bytes;
}

std::vector<unsigned char> reduced(const std::vector<std::vector<unsigned char>>& parts, int64_t offset_elems,
                                   int64_t count, DType dtype, ReduceOp op) {
  std::vector<const void*> ptrs;
  for (const auto& p : parts) ptrs.push_back(p.data() + offset_elems * dtype_bytes(dtype));
  std::vector<unsigned char> out(static_cast<size_t>(count * dtype_bytes(dtype)));
  reduce_in_rank_order(ptrs, out.data(), count, dtype, op);
  return out;
}

std::vector<unsigned char> fetch(const DeviceBuffer& b) {
  std::vector<unsigned char> out(static_cast<size_t>(b.bytes()));
  FLATPEAK_CUDA_CHECK(cudaMemcpy(out.data(), b.raw(), out.size(), cudaMemcpyDeviceToHost));
  return out;
}

void collectives(int rank, Communicator& c, DType dtype) {
  auto& comm = static_cast<DeviceThreadsCommunicator&>(c);
  const std::string tag = std::string(dtype_name(dtype)) + "/rank" + std::to_string(rank);
  std::vector<std::vector<unsigned char>> all;
  for (int p = 0; p < kRanks; ++p) all.push_back(host_data(p, kRanks * kCount, dtype));
  const int64_t elem = dtype_bytes(dtype);
  DeviceBuffer send = upload_bytes(comm.allocator(), all[static_cast<size_t>(rank)].data(), kRanks * kCount * elem,
                                   Category::Comm);
  DeviceBuffer recv(comm.allocator(), kRanks * kCount * elem, Category::Comm, comm.stream());

  comm.all_reduce(send.raw(), recv.raw(), kCount, dtype, ReduceOp::Sum);
  std::vector<unsigned char> got = fetch(recv);
  got.resize(static_cast<size_t>(kCount * elem));
  expect_equal("all_reduce/" + tag, got, reduced(all, 0, kCount, dtype, ReduceOp::Sum));

  comm.reduce_scatter(send.raw(), recv.raw(), kCount, dtype);
  got = fetch(recv);
  got.resize(static_cast<size_t>(kCount * elem));
  expect_equal("reduce_scatter/" + tag, got, reduced(all, rank * kCount, kCount, dtype, ReduceOp::Sum));

  comm.all_gather(send.raw(), recv.raw(), kCount, dtype);
  got = fetch(recv);
  std::vector<unsigned char> want;
  for (int p = 0; p < kRanks; ++p)
    want.insert(want.end(), all[static_cast<size_t>(p)].begin(), all[static_cast<size_t>(p)].begin() + kCount * elem);
  expect_equal("all_gather/" + tag, got, want);

  for (int shift : {1, -1}) {
    comm.sendrecv_shift(send.raw(), recv.raw(), kCount, dtype, shift);
    got = fetch(recv);
    got.resize(static_cast<size_t>(kCount * elem));
    const auto& src = all[static_cast<size_t>(((rank - shift) % kRanks + kRanks) % kRanks)];
    expect_equal("sendrecv_shift" + std::to_string(shift) + "/" + tag, got,
                 std::vector<unsigned char>(src.begin(), src.begin() + kCount * elem));
  }

  // Uneven all-to-allv: rank p sends (p + q + 1) elements to rank q, from offset q·kCount.
  int64_t sc[kRanks], sd[kRanks], rc[kRanks], rd[kRanks];
  int64_t at = 0;
  for (int q = 0; q < kRanks; ++q) {
    sc[q] = rank + q + 1;
    sd[q] = q * kCount;
    rc[q] = q + rank + 1;
    rd[q] = at;
    at += rc[q];
  }
  comm.all_to_allv(send.raw(), sc, sd, recv.raw(), rc, rd, dtype);
  got = fetch(recv);
  got.resize(static_cast<size_t>(at * elem));
  want.clear();
  for (int q = 0; q < kRanks; ++q) {
    const auto& src = all[static_cast<size_t>(q)];
    want.insert(want.end(), src.begin() + rank * kCount * elem, src.begin() + (rank * kCount + rc[q]) * elem);
  }
  expect_equal("all_to_allv/" + tag, got, want);
  comm.barrier();
}

}  // namespace

int main() {
  if (const int rc = skip_unless_device(); rc != 0) return rc;
  RunResult r = run_ranks_on_device(kRanks, 0, [](int rank, Communicator& comm) {
    for (DType dtype : {DType::F32, DType::BF16}) collectives(rank, comm, dtype);
    comm.check_status(0, "");
  });
  if (!r.ok()) {
    std::printf("FAIL: %s\n", r.message.c_str());
    return 1;
  }
  // A failure on rank 2 ends every rank, naming it.
  r = run_ranks_on_device(kRanks, 0, [](int rank, Communicator& comm) {
    if (rank == 2) throw std::runtime_error("injected failure");
    comm.barrier();
  });
  expect_equal("failure/rank", std::vector<int>{r.failing_rank}, std::vector<int>{2});
  // Rank 0 rejects its all-to-allv right after the barrier (it expects an element from itself it
  // does not send) while its peers copy 64 MiB each out of its send buffer: it must wait for their
  // copies before its error frees that buffer (and its pool, with its communicator). Every peer
  // receives its block intact, and the device has no sticky error after.
  constexpr int64_t kBlock = int64_t{16} << 20;  // floats rank 0 sends each peer
  std::vector<int> intact(kRanks, 0);
  r = run_ranks_on_device(kRanks, 0, [&](int rank, Communicator& c) {
    auto& comm = static_cast<DeviceThreadsCommunicator&>(c);
    int64_t sc[kRanks] = {}, sd[kRanks] = {}, rc[kRanks] = {}, rd[kRanks] = {};
    std::vector<float> ones(static_cast<size_t>(kBlock), 1.0f);
    DeviceBuffer send(comm.allocator(), rank == 0 ? (kRanks - 1) * kBlock * 4 : 0, Category::Comm, comm.stream());
    DeviceBuffer recv(comm.allocator(), rank == 0 ? 0 : kBlock * 4, Category::Comm, comm.stream());
    if (rank == 0) {
      // The block was allocated on the rank's (non-blocking) stream: let that land before the
      // legacy stream writes it.
      FLATPEAK_CUDA_CHECK(cudaStreamSynchronize(comm.stream()));
      for (int p = 1; p < kRanks; ++p) {
        sc[p] = kBlock;
        sd[p] = (p - 1) * kBlock;
        FLATPEAK_CUDA_CHECK(cudaMemcpy(static_cast<float*>(send.raw()) + sd[p], ones.data(),
                                       static_cast<size_t>(kBlock * 4), cudaMemcpyHostToDevice));
      }
      // From pageable memory cudaMemcpy may return before its DMA has landed, and the peers copy
      // on their own non-blocking streams: wait for the legacy stream (as upload_bytes does).
      FLATPEAK_CUDA_CHECK(cudaStreamSynchronize(nullptr));
      rc[0] = 1;  // the error
    } else {
      rc[0] = kBlock;
    }
    auto check_intact = [&] {
      std::vector<float> got(static_cast<size_t>(kBlock));
      FLATPEAK_CUDA_CHECK(cudaMemcpy(got.data(), recv.raw(), got.size() * 4, cudaMemcpyDeviceToHost));
      intact[static_cast<size_t>(rank)] = got == ones ? 1 : 0;
    };
    // A peer's copy ends before the release barrier; rank 0's error may reach the world before
    // the peer leaves that barrier (RankFailed there) or after (at the barrier below).
    try {
      comm.all_to_allv(send.raw(), sc, sd, recv.raw(), rc, rd, DType::F32);
    } catch (const RankFailed&) {
      if (rank != 0) check_intact();
      throw;
    }
    if (rank != 0) check_intact();
    comm.barrier();  // rank 0 has failed: RankFailed here
  });
  expect_equal("rejected counts/rank", std::vector<int>{r.failing_rank}, std::vector<int>{0});
  if (r.message.find("expects 1 elements from rank 0, which sends 0") == std::string::npos) {
    std::printf("FAIL rejected counts/message: %s\n", r.message.c_str());
    return 1;
  }
  expect_equal("rejected counts/peers intact", std::vector<int>(intact.begin() + 1, intact.end()),
               std::vector<int>(kRanks - 1, 1));
  FLATPEAK_CUDA_CHECK(cudaDeviceSynchronize());  // no sticky error left by the failed run
  return finish();
}
