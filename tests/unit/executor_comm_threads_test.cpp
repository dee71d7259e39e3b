// The threads communicator: every collective on 1, 2 and 4 ranks with inputs a pure function of
// (seed, rank, index), each rank checking its own result; failures end every rank, naming the
// failing rank.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <stdexcept>
#include <thread>
#include <vector>

#include "executor/comm/threads_comm.h"
#include "spec/errors.h"

namespace flatpeak::exec {
namespace {

constexpr uint64_t kSeed = 12345;

// A value that depends only on (seed, rank, index): exact small integers in fp32 / bf16 too, so
// sums are checkable by hand while still order-sensitive in the test of rank order below.
int64_t value(int rank, int64_t index) {
  uint64_t z = kSeed + static_cast<uint64_t>(rank) * 1000003u + static_cast<uint64_t>(index);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return static_cast<int64_t>((z ^ (z >> 31)) % 201u) - 100;  // in [-100, 100]
}

class CommThreads : public ::testing::TestWithParam<int> {};

TEST_P(CommThreads, EveryCollectiveGivesEachRankItsExpectedResult) {
  const int n = GetParam();
  std::atomic<int> ranks_checked{0};
  const RunResult result = run_ranks(n, [&](int rank, Communicator& comm) {
    ASSERT_EQ(comm.rank(), rank);
    ASSERT_EQ(comm.size(), n);
    EXPECT_STREQ(comm.backend_name(), "threads");

    // all_to_allv: rank r sends (r + p + 1) elements to p, element i = value(r, 1000·p + i).
    std::vector<int64_t> send_counts(static_cast<size_t>(n)), send_displs(static_cast<size_t>(n));
    std::vector<int64_t> recv_counts(static_cast<size_t>(n)), recv_displs(static_cast<size_t>(n));
    int64_t send_total = 0, recv_total = 0;
    for (int p = 0; p < n; ++p) {
      send_counts[static_cast<size_t>(p)] = rank + p + 1;
      send_displs[static_cast<size_t>(p)] = send_total;
      send_total += rank + p + 1;
      recv_counts[static_cast<size_t>(p)] = p + rank + 1;
      recv_displs[static_cast<size_t>(p)] = recv_total;
      recv_total += p + rank + 1;
    }
    std::vector<float> send(static_cast<size_t>(send_total));
    for (int p = 0; p < n; ++p) {
      for (int64_t i = 0; i < send_counts[static_cast<size_t>(p)]; ++i) {
        send[static_cast<size_t>(send_displs[static_cast<size_t>(p)] + i)] =
            static_cast<float>(value(rank, 1000 * p + i));
      }
    }
    std::vector<float> recv(static_cast<size_t>(recv_total), -1.0f);
    comm.all_to_allv(send.data(), send_counts.data(), send_displs.data(), recv.data(),
                     recv_counts.data(), recv_displs.data(), DType::F32);
    for (int p = 0; p < n; ++p) {
      for (int64_t i = 0; i < recv_counts[static_cast<size_t>(p)]; ++i) {
        ASSERT_EQ(recv[static_cast<size_t>(recv_displs[static_cast<size_t>(p)] + i)],
                  static_cast<float>(value(p, 1000 * rank + i)))
            << "rank " << rank << " from " << p << " element " << i;
      }
    }

    // sendrecv_shift by +1 and by -2 around the ring.
    for (int shift : {1, -2}) {
      std::vector<int64_t> mine(7), got(7, 0);
      for (int64_t i = 0; i < 7; ++i) mine[static_cast<size_t>(i)] = value(rank, i);
      comm.sendrecv_shift(mine.data(), got.data(), 7, DType::I64, shift);
      const int src = ((rank - shift) % n + n) % n;
      for (int64_t i = 0; i < 7; ++i) ASSERT_EQ(got[static_cast<size_t>(i)], value(src, i));
    }

    // all_gather of 5 bf16 (small integers are exact in bf16).
    std::vector<Bf16> mine(5), all(static_cast<size_t>(5 * n));
    for (int64_t i = 0; i < 5; ++i) {
      mine[static_cast<size_t>(i)] = f32_to_bf16(static_cast<float>(value(rank, i)));
    }
    comm.all_gather(mine.data(), all.data(), 5, DType::BF16);
    for (int p = 0; p < n; ++p) {
      for (int64_t i = 0; i < 5; ++i) {
        ASSERT_EQ(to_f32(all[static_cast<size_t>(5 * p + i)]), static_cast<float>(value(p, i)));
      }
    }

    // reduce_scatter (sum) of [n, 3] fp32: block b of rank r holds value(r, 3b + i).
    std::vector<float> blocks(static_cast<size_t>(3 * n)), reduced(3);
    for (int64_t j = 0; j < 3 * n; ++j) blocks[static_cast<size_t>(j)] = static_cast<float>(value(rank, j));
    comm.reduce_scatter(blocks.data(), reduced.data(), 3, DType::F32);
    for (int64_t i = 0; i < 3; ++i) {
      int64_t want = 0;
      for (int p = 0; p < n; ++p) want += value(p, 3 * rank + i);
      ASSERT_EQ(reduced[static_cast<size_t>(i)], static_cast<float>(want));
    }

    // all_reduce sum (in place, int64) and max (fp32).
    std::vector<int64_t> counts(9);
    for (int64_t i = 0; i < 9; ++i) counts[static_cast<size_t>(i)] = value(rank, i);
    comm.all_reduce(counts.data(), counts.data(), 9, DType::I64, ReduceOp::Sum);
    std::vector<float> peaks(4), peak_max(4);
    for (int64_t i = 0; i < 4; ++i) peaks[static_cast<size_t>(i)] = static_cast<float>(value(rank, 50 + i));
    comm.all_reduce(peaks.data(), peak_max.data(), 4, DType::F32, ReduceOp::Max);
    for (int64_t i = 0; i < 9; ++i) {
      int64_t want = 0;
      for (int p = 0; p < n; ++p) want += value(p, i);
      ASSERT_EQ(counts[static_cast<size_t>(i)], want);
    }
    for (int64_t i = 0; i < 4; ++i) {
      int64_t want = value(0, 50 + i);
      for (int p = 1; p < n; ++p) want = std::max(want, value(p, 50 + i));
      ASSERT_EQ(peak_max[static_cast<size_t>(i)], static_cast<float>(want));
    }

    comm.barrier();
    comm.check_status(0, "");
    ++ranks_checked;
  });
  EXPECT_TRUE(result.ok()) << result.message;
  EXPECT_EQ(ranks_checked.load(), n);
}

INSTANTIATE_TEST_SUITE_P(Ranks, CommThreads, ::testing::Values(1, 2, 4));

// fp32 sums run in rank order 0..n−1: 1e8 + 1 + (−1e8) + 1 = 1 in that order (1e8 + 1 rounds
// to 1e8), which another order (e.g. pairwise) would not give.
TEST(CommThreadsSum, Fp32SumsFollowRankOrder) {
  const float contributions[4] = {1e8f, 1.0f, -1e8f, 1.0f};
  std::vector<float> results(4);
  const RunResult result = run_ranks(4, [&](int rank, Communicator& comm) {
    float x = contributions[rank];
    comm.all_reduce(&x, &x, 1, DType::F32, ReduceOp::Sum);
    results[static_cast<size_t>(rank)] = x;
  });
  ASSERT_TRUE(result.ok()) << result.message;
  for (float x : results) EXPECT_EQ(x, 1.0f);
}

TEST(CommThreadsFailure, ExceptionOnOneRankEndsEveryRankNamingIt) {
  const auto start = std::chrono::steady_clock::now();
  const RunResult result = run_ranks(4, [&](int rank, Communicator& comm) {
    comm.barrier();
    if (rank == 2) throw std::runtime_error("injected failure");
    for (int i = 0; i < 3; ++i) comm.barrier();  // the others block here and must wake
  });
  const double elapsed_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(elapsed_s, 5.0);
  EXPECT_FALSE(result.ok());
  EXPECT_EQ(result.failing_rank, 2);
  EXPECT_EQ(result.exit_code, kExitRuntimeError);
  EXPECT_EQ(result.message, "rank 2: injected failure");
  for (const RankStatus& s : result.ranks) {
    EXPECT_FALSE(s.ok) << "rank " << s.rank;
    EXPECT_EQ(s.exit_code, kExitRuntimeError);
  }
  EXPECT_EQ(result.ranks[0].message, "rank 2 failed: injected failure");
}

TEST(CommThreadsFailure, InputErrorMapsToExitCode2) {
  const RunResult result = run_ranks(4, [&](int rank, Communicator& comm) {
    if (rank == 1) throw InputError(Diagnostic{"plan.json", "/knobs/ep", "bad EP", ""});
    comm.barrier();
  });
  EXPECT_EQ(result.failing_rank, 1);
  EXPECT_EQ(result.exit_code, kExitInputError);
  EXPECT_EQ(result.ranks[3].exit_code, kExitInputError);
}

TEST(CommThreadsFailure, AgreedStatusStopsEveryRankWithTheLowestFailingRank) {
  const RunResult result = run_ranks(4, [&](int rank, Communicator& comm) {
    const int code = (rank == 3 || rank == 1) ? kExitInputError : 0;
    comm.check_status(code, "bad routing on rank " + std::to_string(rank));
  });
  EXPECT_EQ(result.failing_rank, 1);
  EXPECT_EQ(result.exit_code, kExitInputError);
  EXPECT_EQ(result.message, "rank 1: bad routing on rank 1");
  for (const RankStatus& s : result.ranks) EXPECT_EQ(s.exit_code, kExitInputError);
}

TEST(CommThreadsFailure, PeerThatNeverArrivesTimesOutNamingIt) {
  ThreadsOptions options;
  options.peer_timeout_s = 0.3;
  const RunResult result = run_ranks(
      3,
      [&](int rank, Communicator& comm) {
        if (rank != 1) comm.barrier();  // rank 1 returns without the collective
      },
      options);
  EXPECT_EQ(result.failing_rank, 1);
  EXPECT_EQ(result.exit_code, kExitRuntimeError);
  EXPECT_NE(result.message.find("did not reach barrier"), std::string::npos) << result.message;
  EXPECT_TRUE(result.ranks[1].ok);
  EXPECT_FALSE(result.ranks[0].ok);
}

TEST(CommThreadsFailure, MismatchedCountsNameRankAndOperation) {
  const RunResult result = run_ranks(2, [&](int rank, Communicator& comm) {
    std::vector<float> x(4, 1.0f);
    comm.all_reduce(x.data(), x.data(), rank == 0 ? 4 : 3, DType::F32, ReduceOp::Sum);
  });
  EXPECT_FALSE(result.ok());
  EXPECT_EQ(result.exit_code, kExitRuntimeError);
  EXPECT_NE(result.message.find("all_reduce(sum)"), std::string::npos) << result.message;
}

// Rank 0 rejects its all_to_allv (it expects an element from itself that it does not send) right
// after the barrier, while its peers copy 16 MiB each out of its send buffer. Its error must not
// free that buffer under them: it waits at the release barrier before the error leaves, so every
// peer receives its block intact (a buffer this size is unmapped when freed: reading it after
// would crash, and ASan reports it as a use after free).
TEST(CommThreadsFailure, ARankRejectingItsCountsKeepsItsBufferUntilPeersHaveRead) {
  constexpr int kRanks = 4;
  constexpr int64_t kBlock = int64_t{4} << 20;  // floats rank 0 sends each peer
  std::atomic<int> intact_blocks{0};
  const RunResult result = run_ranks(kRanks, [&](int rank, Communicator& comm) {
    std::vector<int64_t> send_counts(kRanks, 0), send_displs(kRanks, 0);
    std::vector<int64_t> recv_counts(kRanks, 0), recv_displs(kRanks, 0);
    std::vector<float> send;  // [3 · kBlock] on rank 0
    std::vector<float> recv;  // [kBlock] on the peers
    if (rank == 0) {
      send.resize(static_cast<size_t>((kRanks - 1) * kBlock));
      for (size_t i = 0; i < send.size(); ++i) send[i] = static_cast<float>(value(0, static_cast<int64_t>(i)));
      for (int p = 1; p < kRanks; ++p) {
        send_counts[static_cast<size_t>(p)] = kBlock;
        send_displs[static_cast<size_t>(p)] = (p - 1) * kBlock;
      }
      recv_counts[0] = 1;  // rank 0 sends itself nothing: the error
    } else {
      recv.resize(static_cast<size_t>(kBlock));
      recv_counts[0] = kBlock;
    }
    auto count_if_intact = [&] {
      bool intact = true;
      for (int64_t i = 0; i < kBlock; i += 4099) {
        intact = intact && recv[static_cast<size_t>(i)] ==
                               static_cast<float>(value(0, (rank - 1) * kBlock + i));
      }
      intact = intact && recv.back() == static_cast<float>(value(0, rank * kBlock - 1));
      if (intact) ++intact_blocks;
    };
    // A peer reads its block before the release barrier; rank 0's error may reach the world
    // before the peer leaves that barrier (RankFailed there) or after (RankFailed at the barrier
    // below): the block is whole either way.
    try {
      comm.all_to_allv(send.data(), send_counts.data(), send_displs.data(), recv.data(),
                       recv_counts.data(), recv_displs.data(), DType::F32);
    } catch (const RankFailed&) {
      if (rank != 0) count_if_intact();
      throw;
    }
    if (rank != 0) count_if_intact();
    comm.barrier();  // rank 0 has failed: RankFailed here
  });
  EXPECT_EQ(result.failing_rank, 0);
  EXPECT_EQ(result.exit_code, kExitRuntimeError);
  EXPECT_NE(result.message.find("expects 1 elements from rank 0, which sends 0"), std::string::npos)
      << result.message;
  EXPECT_EQ(intact_blocks.load(), kRanks - 1);
}

// As above inside an EP-style group {0, 1} of split(rank / 2): rank 0 rejects its all_to_allv
// while rank 1 copies 64 MiB out of its send buffer, and rank 2 of the other group fails the whole
// run meanwhile (2 ms after both have posted). That failure reaches the group's world while rank
// 0 waits to release: rank 0 must still wait for rank 1 to finish reading before its error frees
// the buffer (freed, a buffer this size is unmapped: rank 1 would crash, and ASan reports a use
// after free). Rank 1 then ends with the run's failure, its block read whole.
TEST(CommThreadsFailure, AFailureElsewhereDoesNotReleaseARankWhilePeersRead) {
  constexpr int64_t kBlock = int64_t{16} << 20;  // floats rank 0 sends rank 1
  enum Block { kNotChecked, kIntact, kUnread, kTorn };
  std::atomic<int> posting{0};  // ranks 0 and 1 about to post

  std::atomic<int> rank1_block{kNotChecked};
  const RunResult result = run_ranks(4, [&](int rank, Communicator& world) {
    const std::unique_ptr<Communicator> group = world.split(rank / 2, rank % 2);
    if (rank == 2) {
      while (posting.load() < 2) std::this_thread::yield();
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
      throw std::runtime_error("rank 2 stops the run");
    }
    if (rank == 3) return;
    std::vector<int64_t> send_counts(2, 0), send_displs(2, 0), recv_counts(2, 0), recv_displs(2, 0);
    std::vector<float> send;  // [kBlock] on rank 0
    std::vector<float> recv;  // [kBlock] on rank 1, zeros until read
    if (rank == 0) {
      send.resize(static_cast<size_t>(kBlock));
      for (size_t i = 0; i < send.size(); ++i) send[i] = static_cast<float>(value(0, static_cast<int64_t>(i)) + 1);
      send_counts[1] = kBlock;
      recv_counts[0] = 1;  // rank 0 sends itself nothing: the error
    } else {
      recv.resize(static_cast<size_t>(kBlock), 0.0f);
      recv_counts[0] = kBlock;
    }
    auto check_rank1_block = [&] {
      int intact = 0, unread = 0, samples = 0;
      for (int64_t i = 0; i < kBlock; i += 4099, ++samples) {
        const float got = recv[static_cast<size_t>(i)];
        intact += got == static_cast<float>(value(0, i) + 1) ? 1 : 0;
        unread += got == 0.0f ? 1 : 0;
      }
      rank1_block = intact == samples ? kIntact : (unread == samples ? kUnread : kTorn);
    };
    ++posting;
    try {
      group->all_to_allv(send.data(), send_counts.data(), send_displs.data(), recv.data(),
                         recv_counts.data(), recv_displs.data(), DType::F32);
    } catch (const RankFailed&) {
      if (rank == 1) check_rank1_block();
      throw;
    }
    // Rank 1 may also finish the collective before either failure reaches its world (rank 0's
    // error is the world's only once it leaves rank 0; rank 2's thread may start late on a
    // loaded machine): its block is then whole.
    if (rank == 1) check_rank1_block();
  });
  EXPECT_FALSE(result.ok());
  EXPECT_TRUE(result.failing_rank == 0 || result.failing_rank == 2) << result.message;
  // Rank 2's failure may reach the group before its posting barrier ends (nothing is read), while
  // rank 1 reads (the case this test is for) or after the collective: the block is never torn.
  EXPECT_NE(rank1_block.load(), kNotChecked);
  EXPECT_NE(rank1_block.load(), kTorn);
  std::printf("rank 1's block: %s\n", rank1_block.load() == kIntact ? "read whole" : "not read");
}

TEST(CommThreadsFailure, AbortStopsOthersWithItsCode) {
  const RunResult result = run_ranks(4, [&](int rank, Communicator& comm) {
    if (rank == 0) comm.abort(kExitInputError, "no such plan");
    comm.barrier();
  });
  EXPECT_EQ(result.failing_rank, 0);
  EXPECT_EQ(result.exit_code, kExitInputError);
  EXPECT_EQ(result.message, "rank 0: no such plan");
}

// split(rank / 2, rank % 2) on 4 ranks: EP groups {0, 1} and {2, 3}, each a communicator of its
// own (collectives see only the group), ranked by key; a nested split; the parent unchanged.
TEST(CommThreadsSplit, GroupsOfConsecutiveRanksAreCommunicatorsOfTheirOwn) {
  std::atomic<int> checked{0};
  const RunResult result = run_ranks(4, [&](int rank, Communicator& comm) {
    const std::unique_ptr<Communicator> group = comm.split(rank / 2, rank % 2);
    ASSERT_EQ(group->size(), 2);
    ASSERT_EQ(group->rank(), rank % 2);
    EXPECT_STREQ(group->backend_name(), "threads");
    // all_gather: the group's world ranks in group order.
    const int64_t me = rank;
    std::vector<int64_t> all(2, -1);
    group->all_gather(&me, all.data(), 1, DType::I64);
    EXPECT_EQ(all, (std::vector<int64_t>{rank / 2 * 2, rank / 2 * 2 + 1}));
    // all_reduce over the group only, in rank order.
    int64_t sum = value(rank, 7);
    group->all_reduce(&sum, &sum, 1, DType::I64, ReduceOp::Sum);
    EXPECT_EQ(sum, value(rank / 2 * 2, 7) + value(rank / 2 * 2 + 1, 7));
    // all_to_allv: 3 elements to the peer, value(rank, i).
    std::vector<int64_t> send = {value(rank, 0), value(rank, 1), value(rank, 2)}, recv(3, 0);
    const int peer = 1 - group->rank();
    std::vector<int64_t> sc(2, 0), sd(2, 0), rc(2, 0), rd(2, 0);
    sc[static_cast<size_t>(peer)] = 3;
    rc[static_cast<size_t>(peer)] = 3;
    group->all_to_allv(send.data(), sc.data(), sd.data(), recv.data(), rc.data(), rd.data(), DType::I64);
    const int peer_world = rank / 2 * 2 + peer;
    EXPECT_EQ(recv, (std::vector<int64_t>{value(peer_world, 0), value(peer_world, 1), value(peer_world, 2)}));
    // Key order: one group of all four, ranked in reverse.
    const std::unique_ptr<Communicator> reversed = comm.split(0, -rank);
    EXPECT_EQ(reversed->rank(), 3 - rank);
    // Nested: every group split into single ranks.
    const std::unique_ptr<Communicator> single = group->split(group->rank(), 0);
    EXPECT_EQ(single->size(), 1);
    single->barrier();
    // The parent is unaffected.
    int64_t total = 1;
    comm.all_reduce(&total, &total, 1, DType::I64, ReduceOp::Sum);
    EXPECT_EQ(total, 4);
    ++checked;
  });
  EXPECT_TRUE(result.ok()) << result.message;
  EXPECT_EQ(checked.load(), 4);
}

// A failure wakes ranks blocked in any group's collective: rank 3 fails; rank 2 waits for it in
// group 1, rank 1 in the parent, and rank 0 in group 0 for rank 1, which only the failure's
// spreading from the parent into the groups ends (else the 60 s peer timeout). The failure names
// the job's rank (3), also through a group's check_status.
TEST(CommThreadsSplit, FailureInOneGroupEndsEveryGroupNamingTheJobsRank) {
  const auto start = std::chrono::steady_clock::now();
  RunResult result = run_ranks(4, [&](int rank, Communicator& comm) {
    const std::unique_ptr<Communicator> group = comm.split(rank / 2, rank % 2);
    if (rank == 3) throw std::runtime_error("injected failure in group 1");
    if (rank == 1) comm.barrier();
    group->barrier();
  });
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 5.0);
  EXPECT_EQ(result.failing_rank, 3);
  EXPECT_EQ(result.message, "rank 3: injected failure in group 1");
  for (const RankStatus& s : result.ranks) EXPECT_EQ(s.exit_code, kExitRuntimeError) << "rank " << s.rank;

  result = run_ranks(4, [&](int rank, Communicator& comm) {
    const std::unique_ptr<Communicator> group = comm.split(rank / 2, rank % 2);
    group->check_status(rank == 3 ? kExitInputError : 0, "bad input on rank " + std::to_string(rank));
  });
  EXPECT_EQ(result.failing_rank, 3);
  EXPECT_EQ(result.exit_code, kExitInputError);
  EXPECT_EQ(result.message, "rank 3: bad input on rank 3");
}

}  // namespace
}  // namespace flatpeak::exec
