// The AdamW, embedding, RMSNorm, LayerNorm and router kernels (executor/cuda/norm_adamw_kernels.cuh) run on
// the host through cuda_emulation.h, by the launch sequences norm_adamw_cuda.cu itself runs (the
// header's), against the CPU ops (executor/cpu/{adamw,embedding,rmsnorm,layernorm,router}_cpu.cpp):
// indexing, the grid- and block-stride loops, RMSNorm's block reductions and the router's top-k
// tie rule, without a GPU (the device itself is checked by tests/cuda/ops_cuda_test.cu). Bounds
// as there: router expert ids and the in-order embedding copies and scatter-add exactly; the
// rest within emulation_check.h's Tol. Inputs carry NaN past their end, outputs sentinels.
#include "cuda_emulation.h"
// The emulation header first: it defines what the kernels' source expects from CUDA.
#include "executor/cuda/norm_adamw_kernels.cuh"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "emulation_check.h"
#include "executor/ops/adamw.h"
#include "executor/ops/embedding.h"
#include "executor/ops/layernorm.h"
#include "executor/ops/rmsnorm.h"
#include "executor/ops/router.h"

namespace flatpeak::exec {
namespace {

namespace cd = cuda_detail;
using namespace emu_check;


// ---- AdamW -------------------------------------------------------------------------------

template <class G>
void adamw_case(int64_t n, int64_t steps, bool with_param_out) {
  SCOPED_TRACE(tag<G>("adamw") + " n" + std::to_string(n));
  std::mt19937 rng(11);
  std::vector<float> master = uniform(rng, n);                   // [n] fp32
  std::vector<float> m = uniform(rng, n, 0.001f, 0.01f);          // [n] fp32
  std::vector<float> v = positive(rng, n, 0.0001f, 0.001f);       // [n] fp32, never negative
  const std::vector<G> grad = to_storage<G>(uniform(rng, n));     // [n] G
  std::vector<Bf16> param_out(static_cast<size_t>(n));           // [n] bf16
  Guarded<float> e_master = inout_of<float>(master), e_m = inout_of<float>(m);
  Guarded<float> e_v = inout_of<float>(v);
  const Guarded<G> g_grad = guarded(grad, nan_of<G>());
  Guarded<Bf16> e_out = output_of<Bf16>(n);
  for (int64_t step = 1; step <= steps; ++step) {  // m, v and the bias corrections carry over
    AdamWArgs a;
    a.grad_dtype = dtype_of<G>();
    a.elems = n;
    a.step = step;
    a.lr = 1e-2f;
    a.weight_decay = 0.1f;
    a.grad_scale = 0.5f;
    a.master = master.data();
    a.grad = grad.data();
    a.m = m.data();
    a.v = v.data();
    a.param_out = with_param_out ? param_out.data() : nullptr;
    adamw_step_cpu(a);
    const AdamWScalars scalars = adamw_scalars(a);
    Bf16* out = with_param_out ? e_out.ptr() : nullptr;
    cd::launch_adamw(e_master.ptr(), g_grad.ptr(), e_m.ptr(), e_v.ptr(), out, n, scalars, nullptr);
  }
  expect_within("adamw/master", e_master.head(), master, kF32Tol);
  expect_within("adamw/m", e_m.head(), m, kF32Tol);
  expect_within("adamw/v", e_v.head(), v, kF32Tol);
  if (with_param_out) {
    expect_within("adamw/param_out", widen(e_out), widen(param_out), kBf16Tol);
  } else {
    expect_same("adamw/param_out untouched", e_out,
                std::vector<Bf16>(static_cast<size_t>(n), sentinel_of<Bf16>()));
  }
  for (const Guarded<float>* g : {&e_master, &e_m, &e_v}) expect_guard_intact("adamw", *g);
  expect_guard_intact("adamw/param_out", e_out);
}

TEST(NormAdamwEmulation, AdamW) {
  adamw_case<float>(300, 2, true);  // two blocks, the second partial
  adamw_case<Bf16>(300, 2, true);
  adamw_case<float>(100, 1, false);  // param_out null: nothing written there
}

// ---- embedding ---------------------------------------------------------------------------

template <class T>
void embedding_case(int64_t tokens, int64_t vocab, int64_t H) {
  SCOPED_TRACE(tag<T>("embedding"));
  std::mt19937 rng(12);
  std::uniform_int_distribution<int32_t> id_dist(0, static_cast<int32_t>(vocab - 1));
  std::vector<int32_t> ids(static_cast<size_t>(tokens));  // [T] repeating: the add order matters
  for (int32_t& id : ids) id = id_dist(rng);
  const std::vector<T> table = to_storage<T>(uniform(rng, vocab * H));   // [V, H]
  const std::vector<T> d_out = to_storage<T>(uniform(rng, tokens * H));  // [T, H]
  const std::vector<float> d_table_init = uniform(rng, vocab * H);   // [V, H] accumulated into
  std::vector<T> out(static_cast<size_t>(tokens * H));               // [T, H]
  std::vector<T> d_table = to_storage<T>(d_table_init);
  EmbeddingArgs a;
  a.dtype = dtype_of<T>();
  a.tokens = tokens;
  a.vocab = vocab;
  a.hidden = H;
  a.token_ids = ids.data();
  a.table = table.data();
  a.out = out.data();
  a.d_out = d_out.data();
  a.d_table = d_table.data();
  embedding_forward_cpu(a);
  embedding_backward_cpu(a);

  const Guarded<int32_t> g_ids = guarded(ids, static_cast<int32_t>(vocab));  // row V: NaN guard
  const Guarded<T> g_table = guarded(table, nan_of<T>());
  const Guarded<T> g_dout = guarded(d_out, nan_of<T>());
  Guarded<T> e_out = output_of<T>(tokens * H);
  Guarded<T> e_dtable = inout_of<T>(d_table_init);
  cd::launch_embedding_forward(g_ids.ptr(), g_table.ptr(), e_out.ptr(), tokens, H, nullptr);
  cd::launch_embedding_backward(g_ids.ptr(), g_dout.ptr(), e_dtable.ptr(), tokens, H, nullptr);
  expect_same(tag<T>("embedding/out"), e_out, out);
  expect_same(tag<T>("embedding/d_table"), e_dtable, d_table);
  expect_guard_intact(tag<T>("embedding/out"), e_out);
  expect_guard_intact(tag<T>("embedding/d_table"), e_dtable);
}

// H past one block in backward (two blocks of column threads); T·H not a multiple of 256; more
// tokens than vocabulary, so ids repeat and the scatter-add order matters.
TEST(NormAdamwEmulation, Embedding) {
  embedding_case<float>(3, 2, 260);
  embedding_case<Bf16>(9, 4, 30);
}

// ---- RMSNorm -----------------------------------------------------------------------------

template <class T>
void rmsnorm_case(int64_t tokens, int64_t H) {
  SCOPED_TRACE(tag<T>("rmsnorm") + " T" + std::to_string(tokens) + " H" + std::to_string(H));
  std::mt19937 rng(13);
  const std::vector<T> x = to_storage<T>(uniform(rng, tokens * H));      // [T, H]
  const std::vector<T> w = to_storage<T>(positive(rng, H, 0.5f, 1.5f));  // [H]
  const std::vector<T> dy = to_storage<T>(uniform(rng, tokens * H));     // [T, H]
  const std::vector<float> dw_init = uniform(rng, H);                 // [H] accumulated into
  std::vector<T> out(static_cast<size_t>(tokens * H)), dx(out.size());  // [T, H]
  std::vector<T> dw = to_storage<T>(dw_init);                           // [H]
  std::vector<float> rstd(static_cast<size_t>(tokens)), workspace(static_cast<size_t>(H));
  RmsNormArgs a;
  a.dtype = dtype_of<T>();
  a.tokens = tokens;
  a.hidden = H;
  a.x = x.data();
  a.weight = w.data();
  a.out = out.data();
  a.rstd = rstd.data();
  a.d_out = dy.data();
  a.d_x = dx.data();
  a.d_weight = dw.data();
  a.workspace = workspace.data();
  rmsnorm_forward_cpu(a);
  rmsnorm_backward_cpu(a);

  const Guarded<T> g_x = guarded(x, nan_of<T>()), g_w = guarded(w, nan_of<T>());
  const Guarded<T> g_dy = guarded(dy, nan_of<T>());
  Guarded<T> e_out = output_of<T>(tokens * H), e_dx = output_of<T>(tokens * H);
  Guarded<T> e_dw = inout_of<T>(dw_init);
  Guarded<float> e_rstd = output_of<float>(tokens);
  cd::launch_rmsnorm_forward(g_x.ptr(), g_w.ptr(), e_out.ptr(), e_rstd.ptr(), tokens, H, a.eps,
                             nullptr);
  // Backward reads the emulated forward's rstd, as rmsnorm_backward_cuda reads the device's.
  cd::launch_rmsnorm_backward(g_x.ptr(), g_w.ptr(), g_dy.ptr(), e_rstd.ptr(), e_dx.ptr(),
                              e_dw.ptr(), tokens, H, nullptr);
  const Tol tol = tol_of(dtype_of<T>());
  expect_within(tag<T>("rmsnorm/rstd"), e_rstd.head(), rstd, kF32Tol);
  expect_within(tag<T>("rmsnorm/out"), widen(e_out), widen(out), tol);
  expect_within(tag<T>("rmsnorm/d_x"), widen(e_dx), widen(dx), tol);
  expect_within(tag<T>("rmsnorm/d_weight"), widen(e_dw), widen(dw), tol);
  expect_guard_intact(tag<T>("rmsnorm/rstd"), e_rstd);
  for (const Guarded<T>* g : {&e_out, &e_dx, &e_dw}) expect_guard_intact(tag<T>("rmsnorm"), *g);
}

// H past one block of 256 (two rounds of the block-stride loops, two blocks of dw columns);
// H below a warp (block_sum over mostly idle threads).
TEST(NormAdamwEmulation, RmsNorm) {
  rmsnorm_case<float>(2, 300);
  rmsnorm_case<Bf16>(2, 20);
}

// ---- LayerNorm ---------------------------------------------------------------------------

template <class T>
void layernorm_case(int64_t tokens, int64_t H) {
  SCOPED_TRACE(tag<T>("layernorm") + " T" + std::to_string(tokens) + " H" + std::to_string(H));
  std::mt19937 rng(17);
  const std::vector<T> x = to_storage<T>(uniform(rng, tokens * H));      // [T, H]
  const std::vector<T> w = to_storage<T>(positive(rng, H, 0.5f, 1.5f));  // [H]
  const std::vector<T> b = to_storage<T>(uniform(rng, H));               // [H]
  const std::vector<T> dy = to_storage<T>(uniform(rng, tokens * H));     // [T, H]
  const std::vector<float> dw_init = uniform(rng, H), db_init = uniform(rng, H);  // [H] accumulated into
  std::vector<T> out(static_cast<size_t>(tokens * H)), dx(out.size());  // [T, H]
  std::vector<T> dw = to_storage<T>(dw_init), db = to_storage<T>(db_init);
  std::vector<float> mean(static_cast<size_t>(tokens)), rstd(mean.size()), workspace(static_cast<size_t>(2 * H));
  LayerNormArgs a;
  a.dtype = dtype_of<T>();
  a.tokens = tokens;
  a.hidden = H;
  a.x = x.data();
  a.weight = w.data();
  a.bias = b.data();
  a.out = out.data();
  a.mean = mean.data();
  a.rstd = rstd.data();
  a.d_out = dy.data();
  a.d_x = dx.data();
  a.d_weight = dw.data();
  a.d_bias = db.data();
  a.workspace = workspace.data();
  layernorm_forward_cpu(a);
  layernorm_backward_cpu(a);

  const Guarded<T> g_x = guarded(x, nan_of<T>()), g_w = guarded(w, nan_of<T>()), g_b = guarded(b, nan_of<T>());
  const Guarded<T> g_dy = guarded(dy, nan_of<T>());
  Guarded<T> e_out = output_of<T>(tokens * H), e_dx = output_of<T>(tokens * H);
  Guarded<T> e_dw = inout_of<T>(dw_init), e_db = inout_of<T>(db_init);
  Guarded<float> e_mean = output_of<float>(tokens), e_rstd = output_of<float>(tokens);
  cd::launch_layernorm_forward(g_x.ptr(), g_w.ptr(), g_b.ptr(), e_out.ptr(), e_mean.ptr(), e_rstd.ptr(), tokens, H,
                               a.eps, nullptr);
  // Backward reads the emulated forward's mean and rstd, as layernorm_backward_cuda reads the device's.
  cd::launch_layernorm_backward(g_x.ptr(), g_w.ptr(), g_dy.ptr(), e_mean.ptr(), e_rstd.ptr(), e_dx.ptr(), e_dw.ptr(),
                                e_db.ptr(), tokens, H, nullptr);
  const Tol tol = tol_of(dtype_of<T>());
  expect_within(tag<T>("layernorm/mean"), e_mean.head(), mean, kF32Tol);
  expect_within(tag<T>("layernorm/rstd"), e_rstd.head(), rstd, kF32Tol);
  expect_within(tag<T>("layernorm/out"), widen(e_out), widen(out), tol);
  expect_within(tag<T>("layernorm/d_x"), widen(e_dx), widen(dx), tol);
  expect_within(tag<T>("layernorm/d_weight"), widen(e_dw), widen(dw), tol);
  expect_within(tag<T>("layernorm/d_bias"), widen(e_db), widen(db), tol);
  for (const Guarded<float>* g : {&e_mean, &e_rstd}) expect_guard_intact(tag<T>("layernorm"), *g);
  for (const Guarded<T>* g : {&e_out, &e_dx, &e_dw, &e_db}) expect_guard_intact(tag<T>("layernorm"), *g);
}

// As RMSNorm's: H past one block of 256, and H below a warp.
TEST(NormAdamwEmulation, LayerNorm) {
  layernorm_case<float>(2, 300);
  layernorm_case<Bf16>(3, 20);
}

// ---- router ------------------------------------------------------------------------------

void router_case(const std::string& name, const std::vector<float>& logits, int64_t tokens,
                 int64_t E, int64_t k, uint32_t seed) {
  SCOPED_TRACE(name);
  std::mt19937 rng(seed);
  const std::vector<float> d_w = uniform(rng, tokens * k);  // [T, k]
  std::vector<int32_t> ids(static_cast<size_t>(tokens * k));  // [T, k]
  std::vector<float> w(ids.size());                           // [T, k]
  std::vector<float> dz(static_cast<size_t>(tokens * E));     // [T, E]
  RouterArgs a;
  a.tokens = tokens;
  a.experts = E;
  a.top_k = k;
  a.logits = logits.data();
  a.topk_ids = ids.data();
  a.topk_weights = w.data();
  a.d_topk_weights = d_w.data();
  a.d_logits = dz.data();
  router_forward_cpu(a);
  router_backward_cpu(a);

  const Guarded<float> g_logits = guarded(logits, nan_of<float>());
  const Guarded<float> g_dw = guarded(d_w, nan_of<float>());
  Guarded<int32_t> e_ids = output_of<int32_t>(tokens * k);
  Guarded<float> e_w = output_of<float>(tokens * k), e_dz = output_of<float>(tokens * E);
  cd::launch_router_forward(g_logits.ptr(), e_ids.ptr(), e_w.ptr(), tokens, E, k, nullptr);
  cd::launch_router_backward(e_ids.ptr(), e_w.ptr(), g_dw.ptr(), e_dz.ptr(), tokens, E, k, nullptr);
  expect_same(name + "/topk_ids", e_ids, ids);
  expect_within(name + "/topk_weights", e_w.head(), w, kF32Tol);
  expect_within(name + "/d_logits", e_dz.head(), dz, kF32Tol);
  expect_guard_intact(name + "/topk_ids", e_ids);
  expect_guard_intact(name + "/topk_weights", e_w);
  expect_guard_intact(name + "/d_logits", e_dz);
}

// T past one block of 128 (a partial second block).
TEST(NormAdamwEmulation, Router) {
  const int64_t T = 150, E = 9, k = 3;
  std::mt19937 rng(14);
  router_case("router", positive(rng, T * E, 0.05f, 4.0f), T, E, k, 15);
}

// Logits from three values: ties everywhere; the rule (lower expert first among equals) must
// give the CPU's ids exactly. k = E takes every expert.
TEST(NormAdamwEmulation, RouterTies) {
  const int64_t T = 40, E = 6;
  std::mt19937 rng(16);
  std::uniform_int_distribution<int> pick(0, 2);
  std::vector<float> logits(static_cast<size_t>(T * E));
  for (float& z : logits) z = 0.5f + static_cast<float>(pick(rng));
  router_case("router_ties", logits, T, E, 4, 17);
  router_case("router_all", logits, T, E, E, 18);
}

// One block for every grid-stride kernel: each thread takes several elements (tokens for the
// router, columns for embedding backward and RMSNorm's dw).
TEST(NormAdamwEmulation, GridStride) {
  const BlockCap cap(1);
  adamw_case<float>(300, 1, true);
  embedding_case<float>(3, 2, 260);
  rmsnorm_case<float>(2, 300);
  const int64_t T = 150, E = 9, k = 3;
  std::mt19937 rng(19);
  router_case("router_one_block", positive(rng, T * E, 0.05f, 4.0f), T, E, k, 20);
}

}  // namespace
}  // namespace flatpeak::exec
