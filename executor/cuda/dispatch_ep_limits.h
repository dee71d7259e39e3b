// Limits and per-round ranges of the CUDA dispatch at EP >= 1, shared by its launchers
// (dispatch_ep_cuda_internal.cuh) and its kernels (dispatch_ep_kernels.cuh); plain C++, so that
// the kernels also build on the host through tests/unit/cuda_emulation.h.
//   if (top_k > kMaxTopK) throw ...;   RoundRanges rr = round_ranges(plan, round);
#pragma once

#include <cstdint>

namespace flatpeak::cuda::dispatch_ep_detail {

constexpr int kMaxEp = 64;    // per-destination arrays passed by value to kernels
constexpr int kMaxTopK = 32;  // a token's k rows sorted in registers

// One round's rows at the source, per destination (host values passed to the kernels).
struct RoundRanges {
  int64_t lo[kMaxEp];    // first send position of the round's rows for each destination
  int64_t n[kMaxEp];     // how many
  int64_t q0[kMaxEp];    // their first row in the round's send layout
  int ep;
};

}  // namespace flatpeak::cuda::dispatch_ep_detail
