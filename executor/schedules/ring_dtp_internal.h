// Ring-DTP's shape and its ring of ranks, shared by the CPU schedule (ring_dtp_schedule.cpp) and
// its CUDA twin (executor/cuda/ring_dtp_schedule_cuda.cu), so both check a config alike, cut the
// vocabulary into the same shards and hop over the same ranks.
//   check_ring_dtp(comm, config);  const RingDims d = ring_dims_of(config);
//   Ring ring(comm, d.R, copy_bytes);  ring.shift(send, recv, count, DType::F32);
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "executor/comm/communicator.h"
#include "executor/schedules/ring_dtp_schedule.h"

namespace flatpeak::exec {

struct RingDims {
  int64_t T, H, V, R, shard, Tb, Vb, token_blocks;
  float grad_scale;  // 1 / (R·T): the loss is the mean over the ring's tokens
  // Rows of ring position `owner`'s shard that exist (the last one may be short).
  int64_t rows_of(int64_t owner) const { return std::max<int64_t>(0, std::min(shard, V - owner * shard)); }
};

inline RingDims ring_dims_of(const RingDtpConfig& c) {
  RingDims d{};
  d.T = c.tokens;
  d.H = c.hidden;
  d.V = c.vocab;
  d.R = c.ring_size;
  d.shard = (c.vocab + c.ring_size - 1) / c.ring_size;
  d.Tb = std::min(c.token_block_rows, c.tokens);
  d.Vb = std::min(c.vocab_block_rows, d.shard);
  d.token_blocks = (d.T + d.Tb - 1) / d.Tb;
  d.grad_scale = 1.0f / static_cast<float>(d.R * d.T);
  return d;
}

// Throws std::invalid_argument for a config no ring can run.
inline void check_ring_dtp(const Communicator& comm, const RingDtpConfig& c) {
  if (c.tokens <= 0 || c.hidden <= 0 || c.vocab <= 0 || c.ring_size <= 0)
    throw std::invalid_argument("ring-dtp schedule: tokens, hidden, vocab and ring_size must be positive");
  if (c.token_block_rows <= 0 || c.vocab_block_rows <= 0)
    throw std::invalid_argument("ring-dtp schedule: token and vocab blocks must be positive");
  if (comm.size() % c.ring_size != 0)
    throw std::invalid_argument("ring-dtp schedule: ring_size " + std::to_string(c.ring_size) +
                                " must divide the communicator's " + std::to_string(comm.size()) + " ranks");
  const int64_t shard = (c.vocab + c.ring_size - 1) / c.ring_size;
  if ((c.ring_size - 1) * shard >= c.vocab)
    throw std::invalid_argument("ring-dtp schedule: V = " + std::to_string(c.vocab) + " leaves the last of " +
                                std::to_string(c.ring_size) + " shards of ceil(V/R) rows empty");
}

// Blocks of logits are numbered per pass; each one is its own phase (traces/ grammar). Allocator:
// TrackingAllocator on the CPU, DeviceAllocator on the GPU (both have phase() and set_phase()).
template <class Allocator>
struct BlockPhaseCounter {
  Allocator& alloc;
  std::string prefix;  // "loss/fwd/blk" or "loss/bwd/blk"
  int64_t next = 0;
  void advance() {
    const std::string name = prefix + std::to_string(next++);
    if (name != alloc.phase()) alloc.set_phase(name);  // a phase set ahead is not opened twice
  }
};

// The ring this rank belongs to: ranks [g·R, (g+1)·R) of the communicator. shift() sends to the
// next position and receives from the previous one; a ring of one rank copies with `copy_bytes`
// (memcpy on the host, a device-to-device copy on the GPU).
class Ring {
 public:
  using CopyBytes = std::function<void(void* dst, const void* src, int64_t bytes)>;
  Ring(Communicator& comm, int64_t ring_size, CopyBytes copy_bytes)
      : size(ring_size), position(comm.rank() % ring_size), comm_(comm), first_rank_(comm.rank() - position),
        copy_bytes_(std::move(copy_bytes)) {}

  void shift(const void* send, void* recv, int64_t count, DType dtype) {
    if (size == 1) {
      copy_bytes_(recv, send, count * dtype_bytes(dtype));
    } else if (size == comm_.size()) {
      comm_.sendrecv_shift(send, recv, count, dtype, 1);
    } else {
      // Several rings in one communicator: a ring hop is an all-to-all with one peer each way.
      const size_t n = static_cast<size_t>(comm_.size());
      std::vector<int64_t> send_counts(n, 0), recv_counts(n, 0), displs(n, 0);
      send_counts[static_cast<size_t>(first_rank_ + (position + 1) % size)] = count;
      recv_counts[static_cast<size_t>(first_rank_ + (position + size - 1) % size)] = count;
      comm_.all_to_allv(send, send_counts.data(), displs.data(), recv, recv_counts.data(), displs.data(), dtype);
    }
  }
  // The rank of the ring position `p` in the communicator.
  int64_t rank_of(int64_t p) const { return first_rank_ + p; }

  const int64_t size;      // R
  const int64_t position;  // this rank's place in the ring, 0..R-1

 private:
  Communicator& comm_;
  const int64_t first_rank_;
  CopyBytes copy_bytes_;
};

}  // namespace flatpeak::exec
