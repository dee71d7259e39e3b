// Measured per-rank dispatch peak (TrackingAllocator category Dispatch) of uncapped EP, LLEP and
// PipelinedLLEP on EP = 4 thread ranks, one MoE layer's recompute + backward, per routing model.
//   dispatch_ranks                     # the README table (T = 512 per rank, H = 128, F = 64)
//   dispatch_ranks --tokens 2048 --cap 256
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "executor/comm/threads_comm.h"
#include "executor/dispatch/ep_dispatch_case.h"

using namespace flatpeak;
using namespace flatpeak::exec;

namespace {

struct Measured {
  int64_t peak_bytes = 0;  // max over ranks
  int peak_rank = 0;
  int64_t rounds = 0;
  int64_t cap_rows = 0;
  int64_t buffer_rows = 0;
  double rho = 1.0;
};

Measured measure(const EpCase& c, const EpDispatchConfig& config) {
  std::vector<EpDispatchStats> stats(static_cast<size_t>(c.ep));
  const RunResult run = run_ranks(static_cast<int>(c.ep), [&](int rank, Communicator& comm) {
    TrackingAllocator alloc;
    stats[static_cast<size_t>(rank)] = run_ep_rank(comm, alloc, c, config).stats;
  });
  if (!run.ok()) {
    std::fprintf(stderr, "dispatch_ranks: %s\n", run.message.c_str());
    std::exit(4);
  }
  Measured m;
  for (size_t r = 0; r < stats.size(); ++r) {
    if (stats[r].dispatch_peak_bytes > m.peak_bytes) {
      m.peak_bytes = stats[r].dispatch_peak_bytes;
      m.peak_rank = static_cast<int>(r);
    }
  }
  m.rounds = stats[0].rounds;
  m.cap_rows = stats[0].chunk_cap_rows;
  m.buffer_rows = stats[0].round_buffer_rows;
  m.rho = stats[0].rho;
  return m;
}

double mib(int64_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0); }

}  // namespace

int main(int argc, char** argv) {
  MoeDims dims{512, 128, 64, 16, 2};
  int64_t cap_rows = 128;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--tokens") == 0) dims.tokens = std::atoll(argv[i + 1]);
    else if (std::strcmp(argv[i], "--cap") == 0) cap_rows = std::atoll(argv[i + 1]);
    else {
      std::fprintf(stderr, "dispatch_ranks: unknown flag %s (--tokens N, --cap C)\n", argv[i]);
      return 2;
    }
  }
  const int64_t ep = 4;
  std::printf("EP = %lld (threads), T = %lld tokens per rank, H = %lld, F = %lld, E = %lld, k = %lld, "
              "fp32; LLA alpha = 1.0, m = 64, lambda = 1.3; PipelinedLLEP C = %lld rows\n",
              static_cast<long long>(ep), static_cast<long long>(dims.tokens),
              static_cast<long long>(dims.hidden), static_cast<long long>(dims.ffn),
              static_cast<long long>(dims.experts), static_cast<long long>(dims.top_k),
              static_cast<long long>(cap_rows));
  std::printf("| routing | realised rho | uncapped EP MiB | LLEP MiB | rho after LLA | PipelinedLLEP MiB "
              "| PL / EP | rounds (cap) | PL buffer rows |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|\n");
  for (const char* routing : {"rho=1", "rho=2.5", "rho=4", "hot-expert=0.5,1"}) {
    const EpCase c = make_ep_case(dims, ep, parse_routing_model(routing), 1);
    EpDispatchConfig config;
    config.lla.llep_alpha = 1.0;
    config.lla.min_rows_per_gemm = 64;
    config.lla.imbalance_trigger = 1.3;
    config.chunk_cap_rows = cap_rows;
    config.schedule = EpSchedule::Uncapped;
    const Measured ep_m = measure(c, config);
    config.schedule = EpSchedule::Llep;
    const Measured llep_m = measure(c, config);
    config.schedule = EpSchedule::PipelinedLlep;
    const Measured pl_m = measure(c, config);
    std::printf("| %s | %.2f | %.2f (rank %d) | %.2f (rank %d) | %.2f | %.2f (rank %d) | %.2f | %lld (%lld) | %lld |\n",
                routing, ep_m.rho, mib(ep_m.peak_bytes), ep_m.peak_rank, mib(llep_m.peak_bytes),
                llep_m.peak_rank, llep_m.rho, mib(pl_m.peak_bytes), pl_m.peak_rank,
                static_cast<double>(pl_m.peak_bytes) / static_cast<double>(ep_m.peak_bytes),
                static_cast<long long>(pl_m.rounds), static_cast<long long>(pl_m.cap_rows),
                static_cast<long long>(pl_m.buffer_rows));
  }
  return 0;
}
