#include "executor/dispatch/ep_dispatch_case.h"

#include <cmath>

namespace flatpeak::exec {
namespace {

size_t z(int64_t i) { return static_cast<size_t>(i); }

// Uniform in [-1, 1), a pure function of (seed, stream, index) (splitmix64).
float uniform(uint64_t seed, uint64_t stream, int64_t index) {
  uint64_t v = seed * 0x9e3779b97f4a7c15ull + stream * 0xd1b54a32d192ed03ull +
               static_cast<uint64_t>(index);
  v = (v ^ (v >> 30)) * 0xbf58476d1ce4e5b9ull;
  v = (v ^ (v >> 27)) * 0x94d049bb133111ebull;
  v ^= v >> 31;
  return static_cast<float>(static_cast<double>(v >> 40) / static_cast<double>(1ull << 23) - 1.0);
}

}  // namespace

EpCase make_ep_case(const MoeDims& dims, int64_t ep, const RoutingModel& routing, uint64_t seed) {
  EpCase c;
  c.dims = dims;
  c.ep = ep;
  c.seed = seed;
  const int64_t T = dims.tokens, H = dims.hidden, F = dims.ffn, E = dims.experts, k = dims.top_k;
  const int64_t tokens = ep * T;
  c.x.resize(z(tokens * H));
  c.d_out.resize(z(tokens * H));
  for (int64_t i = 0; i < tokens * H; ++i) {
    c.x[z(i)] = uniform(seed, 1, i);
    c.d_out[z(i)] = uniform(seed, 2, i);
  }
  const RoutingShape shape{ep, E, k};
  c.topk_ids.reserve(z(tokens * k));
  for (int64_t r = 0; r < ep; ++r) {
    const std::vector<int32_t> ids = generate_routing(routing, shape, T, seed, r, r, 0);
    c.topk_ids.insert(c.topk_ids.end(), ids.begin(), ids.end());
  }
  c.topk_weights.resize(z(tokens * k));
  for (int64_t t = 0; t < tokens; ++t) {
    float sum = 0.0f;
    for (int64_t s = 0; s < k; ++s) {
      const float u = 0.55f + 0.45f * uniform(seed, 3, t * k + s);  // in [0.1, 1)
      c.topk_weights[z(t * k + s)] = u;
      sum += u;
    }
    for (int64_t s = 0; s < k; ++s) c.topk_weights[z(t * k + s)] /= sum;
  }
  const float gu_scale = 1.0f / std::sqrt(static_cast<float>(H));
  const float d_scale = 1.0f / std::sqrt(static_cast<float>(F));
  c.w_gate_up.resize(z(E * 2 * F * H));
  c.w_down.resize(z(E * H * F));
  for (int64_t i = 0; i < E * 2 * F * H; ++i) c.w_gate_up[z(i)] = gu_scale * uniform(seed, 4, i);
  for (int64_t i = 0; i < E * H * F; ++i) c.w_down[z(i)] = d_scale * uniform(seed, 5, i);
  return c;
}

EpRankResult run_ep_rank(Communicator& comm, TrackingAllocator& alloc, const EpCase& c,
                         const EpDispatchConfig& config) {
  const MoeDims& d = c.dims;
  const int64_t r = comm.rank();
  const int64_t L = d.experts / c.ep;
  EpRankResult result;
  result.out.resize(z(d.tokens * d.hidden));
  result.d_x.resize(z(d.tokens * d.hidden));
  result.d_weights.resize(z(d.tokens * d.top_k));
  result.d_w_gate_up.assign(z(L * 2 * d.ffn * d.hidden), 0.0f);
  result.d_w_down.assign(z(L * d.hidden * d.ffn), 0.0f);
  MoeRankTensors io;
  io.x = c.x.data() + r * d.tokens * d.hidden;
  io.topk_ids = c.topk_ids.data() + r * d.tokens * d.top_k;
  io.topk_weights = c.topk_weights.data() + r * d.tokens * d.top_k;
  io.d_out = c.d_out.data() + r * d.tokens * d.hidden;
  io.w_gate_up = c.w_gate_up.data() + r * L * 2 * d.ffn * d.hidden;
  io.w_down = c.w_down.data() + r * L * d.hidden * d.ffn;
  io.out = result.out.data();
  io.d_x = result.d_x.data();
  io.d_weights = result.d_weights.data();
  io.d_w_gate_up = result.d_w_gate_up.data();
  io.d_w_down = result.d_w_down.data();
  result.stats = moe_dispatch_backward(comm, alloc, d, config, io);
  return result;
}

EpRankResult run_ep_reference(const EpCase& c) {
  MoeDims d = c.dims;
  d.tokens = c.ep * c.dims.tokens;
  EpRankResult result;
  result.out.resize(z(d.tokens * d.hidden));
  result.d_x.resize(z(d.tokens * d.hidden));
  result.d_weights.resize(z(d.tokens * d.top_k));
  result.d_w_gate_up.assign(c.w_gate_up.size(), 0.0f);
  result.d_w_down.assign(c.w_down.size(), 0.0f);
  MoeRankTensors io;
  io.x = c.x.data();
  io.topk_ids = c.topk_ids.data();
  io.topk_weights = c.topk_weights.data();
  io.d_out = c.d_out.data();
  io.w_gate_up = c.w_gate_up.data();
  io.w_down = c.w_down.data();
  io.out = result.out.data();
  io.d_x = result.d_x.data();
  io.d_weights = result.d_weights.data();
  io.d_w_gate_up = result.d_w_gate_up.data();
  io.d_w_down = result.d_w_down.data();
  moe_reference_backward(d, io);
  return result;
}

}  // namespace flatpeak::exec
