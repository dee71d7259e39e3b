// Measured per-rank vocab peak (TrackingAllocator category Vocab) of Ring-DTP on R = 4 thread
// ranks, both rotations and both backward variants, against the materialised logits and the
// blocked loss (R = 1) on one rank with the same tokens per rank, H and V.
//   ring_dtp_ranks                          # the README table: gpt-oss-120b's V = 201088, H = 64, T = 256
//   ring_dtp_ranks --tokens 512 --hidden 32 --token-block 128 --vocab-block 8192
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "executor/comm/threads_comm.h"
#include "executor/schedules/ring_dtp_schedule.h"
#include "executor/schedules/vocab_schedule.h"

using namespace flatpeak::exec;

namespace {

constexpr int64_t kRanks = 4;
constexpr int64_t kAlignment = 512;  // the hardware cards' allocation alignment

struct Options {
  int64_t tokens = 256, hidden = 64, vocab = 201088;
  int64_t token_block = 0, vocab_block = 0;  // 0: the planner's defaults, min(T, 8192) and ceil(V/R)
};

int64_t vocab_peak(const TrackingAllocator& alloc) {
  int64_t peak = 0;
  for (const auto& r : alloc.phase_records())
    if (r.space == MemorySpace::Device)
      peak = std::max(peak, r.category_peak_bytes[static_cast<size_t>(Category::Vocab)]);
  return peak;
}

struct RingPeak {
  int64_t bytes = 0;  // max over ranks
  int rank = 0;
  int64_t min_bytes = 0;  // min over ranks (the ranks are alike; a difference would show here)
};

RingPeak measure_ring(const Options& o, RingRotation rotation, bool in_forward) {
  RingDtpConfig c;
  c.tokens = o.tokens;
  c.hidden = o.hidden;
  c.vocab = o.vocab;
  c.ring_size = kRanks;
  c.token_block_rows = o.token_block;
  c.vocab_block_rows = o.vocab_block;
  c.rotation = rotation;
  c.gradients_in_forward = in_forward;
  std::vector<int64_t> peaks(static_cast<size_t>(kRanks));
  const RunResult run = run_ranks(static_cast<int>(kRanks), [&](int rank, Communicator& comm) {
    TrackingAllocator alloc({kAlignment});
    run_ring_dtp_schedule(comm, alloc, c);
    peaks[static_cast<size_t>(rank)] = vocab_peak(alloc);
  });
  if (!run.ok()) {
    std::fprintf(stderr, "ring_dtp_ranks: %s\n", run.message.c_str());
    std::exit(4);
  }
  RingPeak p;
  p.min_bytes = peaks[0];
  for (size_t r = 0; r < peaks.size(); ++r) {
    if (peaks[r] > p.bytes) {
      p.bytes = peaks[r];
      p.rank = static_cast<int>(r);
    }
    p.min_bytes = std::min(p.min_bytes, peaks[r]);
  }
  return p;
}

int64_t measure_one_rank(const Options& o, VocabScheduleMode mode) {
  VocabScheduleConfig c;
  c.tokens = o.tokens;
  c.hidden = o.hidden;
  c.vocab = o.vocab;
  c.mode = mode;
  // Blocked at R = 1: the practice schedule's Liger blocks, next_pow2(ceil(T / ceil(V/H))) tokens
  // by V, gradients in forward (planner/README.md).
  const int64_t vocab_over_hidden = (o.vocab + o.hidden - 1) / o.hidden;
  const int64_t wanted = (o.tokens + vocab_over_hidden - 1) / vocab_over_hidden;
  int64_t tb = 1;
  while (tb < wanted) tb *= 2;
  c.token_block_rows = tb;
  c.vocab_block_rows = o.vocab;
  c.gradients_in_forward = true;
  TrackingAllocator alloc({kAlignment});
  run_vocab_schedule(alloc, c);
  return vocab_peak(alloc);
}

int64_t parse(const char* flag, const char* text) {
  char* end = nullptr;
  const long long v = std::strtoll(text, &end, 10);
  if (end == text || *end != '\0' || v <= 0) {
    std::fprintf(stderr, "ring_dtp_ranks: %s: must be a positive integer (got '%s')\n", flag, text);
    std::exit(2);
  }
  return v;
}

double mib(int64_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0); }

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (i + 1 >= argc) {
      std::fprintf(stderr, "ring_dtp_ranks: %s needs a value\n", flag.c_str());
      return 2;
    }
    const int64_t v = parse(argv[i], argv[i + 1]);
    ++i;
    if (flag == "--tokens") o.tokens = v;
    else if (flag == "--hidden") o.hidden = v;
    else if (flag == "--vocab") o.vocab = v;
    else if (flag == "--token-block") o.token_block = v;
    else if (flag == "--vocab-block") o.vocab_block = v;
    else {
      std::fprintf(stderr, "ring_dtp_ranks: unknown flag %s (--tokens, --hidden, --vocab, --token-block, --vocab-block)\n",
                   flag.c_str());
      return 2;
    }
  }
  if (o.token_block == 0) o.token_block = std::min<int64_t>(o.tokens, 8192);
  if (o.vocab_block == 0) o.vocab_block = (o.vocab + kRanks - 1) / kRanks;
  std::printf("R = %lld ranks (threads), T = %lld tokens per rank, H = %lld, V = %lld, T_blk = %lld, V_blk = %lld, "
              "alignment %lld B\n\n",
              static_cast<long long>(kRanks), static_cast<long long>(o.tokens), static_cast<long long>(o.hidden),
              static_cast<long long>(o.vocab), static_cast<long long>(o.token_block), static_cast<long long>(o.vocab_block),
              static_cast<long long>(kAlignment));
  const int64_t materialised = measure_one_rank(o, VocabScheduleMode::Materialized);
  const int64_t blocked = measure_one_rank(o, VocabScheduleMode::Blocked);
  std::printf("| schedule | ranks | backward | vocab peak per rank MiB | vs materialised |\n");
  std::printf("|---|---|---|---:|---:|\n");
  std::printf("| materialised logits | 1 | - | %.2f | - |\n", mib(materialised));
  std::printf("| blocked (R = 1, Liger blocks) | 1 | in forward | %.2f | %+.1f%% |\n", mib(blocked),
              100.0 * (static_cast<double>(blocked) / static_cast<double>(materialised) - 1.0));
  for (RingRotation rotation : {RingRotation::Weights, RingRotation::Activations})
    for (bool in_forward : {false, true}) {
      const RingPeak p = measure_ring(o, rotation, in_forward);
      std::printf("| Ring-DTP, rotate %s | %lld | %s | %.2f (rank %d; min over ranks %.2f) | %+.1f%% |\n",
                  rotation == RingRotation::Weights ? "weights" : "activations", static_cast<long long>(kRanks),
                  in_forward ? "in forward" : "recompute", mib(p.bytes), p.rank, mib(p.min_bytes),
                  100.0 * (static_cast<double>(p.bytes) / static_cast<double>(materialised) - 1.0));
    }
  return 0;
}
