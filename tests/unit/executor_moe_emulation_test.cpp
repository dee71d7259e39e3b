// The MoE kernels (executor/cuda/moe_kernels.cuh) run on the host through cuda_emulation.h, by the
// launch sequences moe_cuda.cu itself runs (the header's), against the CPU ops
// (executor/cpu/{permute,combine}_cpu.cpp): indexing, the grid- and block-stride loops, the routing
// plan's barriers (one block, and the four launches over chunks) and combine backward's block
// reduction, without a GPU (the device itself is checked by tests/cuda/moe_cuda_test.cu). Bounds as
// there: the routing plan exactly, permute / unpermute (copies) bitwise, the k-slot sums and
// d_weights within emulation_check.h's Tol. Inputs carry NaN past their end (index arrays: an index
// into that NaN), outputs sentinels.
#include "cuda_emulation.h"
// The emulation header first: it defines what the kernels' source expects from CUDA.
#include "executor/cuda/moe_kernels.cuh"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "emulation_check.h"
#include "executor/ops/combine.h"
#include "executor/ops/permute.h"

namespace flatpeak::exec {
namespace {

namespace cd = cuda_detail;
using namespace emu_check;

// ---- MoE ---------------------------------------------------------------------------------

// k distinct experts per token, every third token's sorted so the low ids get more copies.
std::vector<int32_t> topk_ids(std::mt19937& rng, int64_t tokens, int64_t k, int64_t experts) {
  std::vector<int32_t> ids, all(static_cast<size_t>(experts));
  std::iota(all.begin(), all.end(), 0);
  for (int64_t t = 0; t < tokens; ++t) {
    std::shuffle(all.begin(), all.end(), rng);
    if (t % 3 == 0) std::sort(all.begin(), all.begin() + std::min(experts, k + 2));
    ids.insert(ids.end(), all.begin(), all.begin() + k);
  }
  return ids;
}

struct MoeShape {
  int64_t tokens, top_k, experts, hidden;
};

// moe_route_cuda's launch against moe_route_cpu.
// chunk: the launch's wanted chunk (kRouteChunk, or a few copies so that a small case spans
// several chunks and runs the four-launch sort).
void check_route(const MoeShape& s, const std::vector<int32_t>& ids, const PermuteArgs& cpu,
                 int64_t chunk = cd::kRouteChunk) {
  const int64_t rows = s.tokens * s.top_k;
  const Guarded<int32_t> g_ids = guarded(ids, 0);           // a read past the end counts expert 0 more
  Guarded<int64_t> counts = output_of<int64_t>(s.experts);  // [E]
  Guarded<int32_t> s2r = output_of<int32_t>(rows);         // [T·k]
  Guarded<int32_t> r2s = output_of<int32_t>(rows);         // [T·k]
  cd::launch_moe_route(g_ids.ptr(), rows, s.experts, counts.ptr(), s2r.ptr(), r2s.ptr(), nullptr,
                       chunk);
  expect_same("route/expert_counts", counts,
              std::vector<int64_t>(cpu.expert_counts, cpu.expert_counts + s.experts));
  expect_same("route/slot_to_row", s2r, std::vector<int32_t>(cpu.slot_to_row, cpu.slot_to_row + rows));
  expect_same("route/row_to_slot", r2s, std::vector<int32_t>(cpu.row_to_slot, cpu.row_to_slot + rows));
  expect_guard_intact("route/expert_counts", counts);
  expect_guard_intact("route/slot_to_row", s2r);
  expect_guard_intact("route/row_to_slot", r2s);
}

template <class T>
void moe_case(const MoeShape& s, uint32_t seed) {
  SCOPED_TRACE("T" + std::to_string(s.tokens) + " k" + std::to_string(s.top_k) + " E" +
               std::to_string(s.experts) + " H" + std::to_string(s.hidden) + " " +
               dtype_name(dtype_of<T>()));
  std::mt19937 rng(seed);
  const int64_t H = s.hidden, k = s.top_k, tokens = s.tokens, rows = tokens * k;
  const std::vector<int32_t> ids = topk_ids(rng, tokens, k, s.experts);  // [T, k]

  // The CPU plan; the kernels below read it (guarded), as they would read the device's.
  std::vector<int64_t> counts(static_cast<size_t>(s.experts));  // [E]
  std::vector<int32_t> s2r(static_cast<size_t>(rows)), r2s(s2r.size());  // [T·k]
  PermuteArgs p;
  p.dtype = dtype_of<T>();
  p.tokens = tokens;
  p.top_k = k;
  p.experts = s.experts;
  p.hidden = H;
  p.topk_ids = ids.data();
  p.expert_counts = counts.data();
  p.slot_to_row = s2r.data();
  p.row_to_slot = r2s.data();
  moe_route_cpu(p);
  // Past the end, index `rows`: row T of x, row T·k of the [T·k, H] buffers, all NaN guard.
  const Guarded<int32_t> g_s2r = guarded(s2r, static_cast<int32_t>(rows));
  const Guarded<int32_t> g_r2s = guarded(r2s, static_cast<int32_t>(rows));

  // permute forward / backward, unpermute forward / backward.
  const std::vector<T> x = to_storage<T>(uniform(rng, tokens * H));        // [T, H]
  const std::vector<T> d_x_perm = to_storage<T>(uniform(rng, rows * H));   // [T·k, H]
  const std::vector<T> y_perm = to_storage<T>(uniform(rng, rows * H));     // [T·k, H]
  const std::vector<T> d_y_slots = to_storage<T>(uniform(rng, rows * H));  // [T, k, H]
  std::vector<T> x_perm(static_cast<size_t>(rows * H)), d_x(static_cast<size_t>(tokens * H));
  std::vector<T> y_slots(x_perm.size()), d_y_perm(x_perm.size());
  p.x = x.data();
  p.x_perm = x_perm.data();
  p.d_x_perm = d_x_perm.data();
  p.d_x = d_x.data();
  p.y_perm = y_perm.data();
  p.y_slots = y_slots.data();
  p.d_y_slots = d_y_slots.data();
  p.d_y_perm = d_y_perm.data();
  permute_forward_cpu(p);
  permute_backward_cpu(p);
  unpermute_forward_cpu(p);
  unpermute_backward_cpu(p);

  const Guarded<T> g_x = guarded(x, nan_of<T>());
  const Guarded<T> g_dxp = guarded(d_x_perm, nan_of<T>());
  const Guarded<T> g_yp = guarded(y_perm, nan_of<T>());
  const Guarded<T> g_dys = guarded(d_y_slots, nan_of<T>());
  Guarded<T> e_xp = output_of<T>(rows * H), e_dx = output_of<T>(tokens * H);
  Guarded<T> e_ys = output_of<T>(rows * H), e_dyp = output_of<T>(rows * H);
  cd::launch_permute_forward(g_x.ptr(), g_r2s.ptr(), e_xp.ptr(), tokens, k, H, nullptr);
  cd::launch_permute_backward(g_dxp.ptr(), g_s2r.ptr(), e_dx.ptr(), tokens, k, H, nullptr);
  cd::launch_unpermute_forward(g_yp.ptr(), g_s2r.ptr(), e_ys.ptr(), tokens, k, H, nullptr);
  cd::launch_unpermute_backward(g_dys.ptr(), g_r2s.ptr(), e_dyp.ptr(), tokens, k, H, nullptr);
  expect_same(tag<T>("permute/x_perm"), e_xp, x_perm);
  expect_within(tag<T>("permute/d_x"), widen(e_dx), widen(d_x), tol_of(dtype_of<T>()));
  expect_same(tag<T>("unpermute/y_slots"), e_ys, y_slots);
  expect_same(tag<T>("unpermute/d_y_perm"), e_dyp, d_y_perm);
  for (const Guarded<T>* g : {&e_xp, &e_dx, &e_ys, &e_dyp}) expect_guard_intact(tag<T>("permute"), *g);

  // combine forward / backward, on slot-order y and through slot_to_row (the fused unpermute).
  const std::vector<float> weights = positive(rng, rows, 0.05f, 1.0f);  // [T, k] fp32
  const std::vector<T> d_out = to_storage<T>(uniform(rng, tokens * H));  // [T, H]
  const Guarded<float> g_w = guarded(weights, nan_of<float>());
  const Guarded<T> g_dout = guarded(d_out, nan_of<T>());
  for (const bool fused : {false, true}) {
    const std::vector<T>& y = fused ? y_perm : d_y_slots;  // [T·k, H] either way, non-zero
    const std::string name = tag<T>(fused ? "combine_fused" : "combine");
    std::vector<T> out(static_cast<size_t>(tokens * H)), d_y(static_cast<size_t>(rows * H));
    std::vector<float> d_weights(static_cast<size_t>(rows));  // [T, k]
    CombineArgs c;
    c.dtype = dtype_of<T>();
    c.tokens = tokens;
    c.top_k = k;
    c.hidden = H;
    c.y = y.data();
    c.weights = weights.data();
    c.slot_to_row = fused ? s2r.data() : nullptr;
    c.out = out.data();
    c.d_out = d_out.data();
    c.d_y = d_y.data();
    c.d_weights = d_weights.data();
    combine_forward_cpu(c);
    combine_backward_cpu(c);

    const Guarded<T> g_y = guarded(y, nan_of<T>());
    const int32_t* slot_to_row = fused ? g_s2r.ptr() : nullptr;
    Guarded<T> e_out = output_of<T>(tokens * H), e_dy = output_of<T>(rows * H);
    Guarded<float> e_dw = output_of<float>(rows);
    cd::launch_combine_forward(g_y.ptr(), g_w.ptr(), slot_to_row, e_out.ptr(), tokens, k, H,
                               nullptr);
    cd::launch_combine_backward(g_y.ptr(), g_w.ptr(), slot_to_row, g_dout.ptr(), e_dy.ptr(),
                                e_dw.ptr(), tokens, k, H, nullptr);
    expect_within(name + "/out", widen(e_out), widen(out), tol_of(dtype_of<T>()));
    expect_within(name + "/d_y", widen(e_dy), widen(d_y), tol_of(dtype_of<T>()));
    expect_within(name + "/d_weights", e_dw.head(), d_weights, kF32Tol);
    expect_guard_intact(name + "/out", e_out);
    expect_guard_intact(name + "/d_y", e_dy);
    expect_guard_intact(name + "/d_weights", e_dw);
  }
}

// H past one 128-thread block (combine backward's block-stride loop) and one 256-thread block;
// T·k·H and T·H not multiples of 256.
TEST(MoeEmulation, F32) { moe_case<float>({2, 2, 3, 130}, 21); }
// H below a warp: most of combine backward's threads idle in its reduction.
TEST(MoeEmulation, Bf16) { moe_case<Bf16>({4, 2, 3, 20}, 22); }

// The routing plan alone (one 1024-thread launch each, below two chunks): skewed counts over a
// few experts, and more experts than threads (threads own two; most experts empty).
void route_case(const MoeShape& s, std::vector<int32_t> ids, int64_t chunk = cd::kRouteChunk) {
  const int64_t rows = s.tokens * s.top_k;
  std::vector<int64_t> counts(static_cast<size_t>(s.experts));
  std::vector<int32_t> s2r(static_cast<size_t>(rows)), r2s(s2r.size());
  PermuteArgs p;
  p.tokens = s.tokens;
  p.top_k = s.top_k;
  p.experts = s.experts;
  p.hidden = s.hidden;
  p.topk_ids = ids.data();
  p.expert_counts = counts.data();
  p.slot_to_row = s2r.data();
  p.row_to_slot = r2s.data();
  moe_route_cpu(p);
  check_route(s, ids, p, chunk);
}

TEST(MoeEmulation, Route) {
  const MoeShape s{23, 3, 7, 1};
  std::mt19937 rng(23);
  route_case(s, topk_ids(rng, s.tokens, s.top_k, s.experts));
}

TEST(MoeEmulation, RouteMoreExpertsThanThreads) {
  const MoeShape s{9, 4, 1100, 1};
  std::mt19937 rng(24);
  std::vector<int32_t> ids = topk_ids(rng, s.tokens, s.top_k, s.experts);
  ids[0] = 1024;  // experts in the second round of the stride loop, one of them twice
  ids[5] = 1099;
  ids[9] = 1024;
  route_case(s, ids);
}

// ---- the routing plan over chunks (count, scan, scatter, invert) ----------------------------

TEST(MoeEmulation, RouteChunkSizes) {
  // Below two chunks, or more experts than the scatter's shared memory holds: the single block.
  EXPECT_EQ(cd::route_chunk_for(4096, 128, cd::kRouteChunk), 0);
  EXPECT_EQ(cd::route_chunk_for(4097, 128, cd::kRouteChunk), 4096);
  EXPECT_EQ(cd::route_chunk_for(1 << 22, 4000, cd::kRouteChunk), 8000);  // 2·experts per chunk
  EXPECT_EQ(cd::route_chunk_for(int64_t{1} << 30, cd::kRouteMaxExperts + 1, cd::kRouteChunk), 0);
  // The table [experts, chunks] fits in slot_to_row [copies] wherever the chunks are used.
  for (int64_t experts : {1, 7, 128, 300, 8192}) {
    for (int64_t copies = 1; copies < 40000; copies = copies * 3 + 1) {
      const int64_t chunk = cd::route_chunk_for(copies, experts, 16);
      if (chunk == 0) continue;
      const int64_t chunks = (copies + chunk - 1) / chunk;
      EXPECT_GE(chunks, 2);
      EXPECT_LE(experts * chunks, copies) << experts << " experts, " << copies << " copies";
    }
  }
}

// 19 chunks of 16 copies (the last one 12), so tiles end inside a chunk.
TEST(MoeEmulation, RouteChunks) {
  const MoeShape s{100, 3, 7, 1};
  std::mt19937 rng(31);
  route_case(s, topk_ids(rng, s.tokens, s.top_k, s.experts), 16);
}

// More experts than the count kernel's 256 and the scatter's 128 threads: 3 chunks of 600.
TEST(MoeEmulation, RouteChunksManyExperts) {
  const MoeShape s{400, 4, 300, 1};
  std::mt19937 rng(32);
  std::vector<int32_t> ids = topk_ids(rng, s.tokens, s.top_k, s.experts);
  ids[601] = 299;  // the second chunk's first experts past both thread counts
  route_case(s, ids, 16);
}

// A tile of copies of two experts (ranks up to 127 within one tile, the next rows carried to the
// next tile and chunk), chunks of 130 copies: a chunk's second tile holds 2.
TEST(MoeEmulation, RouteChunksRepeatedExperts) {
  const MoeShape s{200, 2, 5, 1};
  std::vector<int32_t> ids;
  for (int64_t t = 0; t < s.tokens; ++t) {
    const bool odd_one = t % 37 == 5;
    ids.push_back(odd_one ? 4 : 0);
    ids.push_back(odd_one ? 2 : 1);
  }
  route_case(s, ids, 130);
}

// Out-of-range ids (the CPU refuses them; callers check that the counts add up): the valid
// copies get their rows in the same stable order, the invalid slots row -1, the rows left over
// slot -1; over chunks (16 copies each) and in the single block alike.
void route_out_of_range_case(int64_t chunk) {
  const MoeShape s{60, 2, 5, 1};
  std::mt19937 rng(33);
  std::vector<int32_t> ids = topk_ids(rng, s.tokens, s.top_k, s.experts);
  ids[3] = -1;
  ids[50] = 5;
  ids[99] = 1 << 20;
  const int64_t rows = s.tokens * s.top_k;
  std::vector<int32_t> valid_slots;
  std::vector<int64_t> want_counts(static_cast<size_t>(s.experts), 0);
  for (int32_t slot = 0; slot < rows; ++slot) {
    const int32_t e = ids[static_cast<size_t>(slot)];
    if (e < 0 || e >= s.experts) continue;
    valid_slots.push_back(slot);
    ++want_counts[static_cast<size_t>(e)];
  }
  std::stable_sort(valid_slots.begin(), valid_slots.end(), [&](int32_t a, int32_t b) {
    return ids[static_cast<size_t>(a)] < ids[static_cast<size_t>(b)];
  });
  std::vector<int32_t> want_r2s(static_cast<size_t>(rows), -1);
  std::copy(valid_slots.begin(), valid_slots.end(), want_r2s.begin());
  std::vector<int32_t> want_s2r(static_cast<size_t>(rows), -1);
  for (size_t r = 0; r < valid_slots.size(); ++r)
    want_s2r[static_cast<size_t>(valid_slots[r])] = static_cast<int32_t>(r);
  const Guarded<int32_t> g_ids = guarded(ids, 0);
  Guarded<int64_t> counts = output_of<int64_t>(s.experts);
  Guarded<int32_t> s2r = output_of<int32_t>(rows);
  Guarded<int32_t> r2s = output_of<int32_t>(rows);
  cd::launch_moe_route(g_ids.ptr(), rows, s.experts, counts.ptr(), s2r.ptr(), r2s.ptr(), nullptr, chunk);
  expect_same("route/expert_counts", counts, want_counts);
  expect_same("route/row_to_slot", r2s, want_r2s);
  expect_same("route/slot_to_row", s2r, want_s2r);
  expect_guard_intact("route/slot_to_row", s2r);
  expect_guard_intact("route/row_to_slot", r2s);
}

TEST(MoeEmulation, RouteChunksSkipOutOfRangeIds) { route_out_of_range_case(16); }
TEST(MoeEmulation, RouteSkipsOutOfRangeIds) { route_out_of_range_case(cd::kRouteChunk); }

// One block for every grid-stride kernel: each thread takes several elements.
TEST(MoeEmulation, GridStride) {
  const BlockCap cap(1);
  moe_case<float>({2, 2, 3, 130}, 25);
}

}  // namespace
}  // namespace flatpeak::exec
