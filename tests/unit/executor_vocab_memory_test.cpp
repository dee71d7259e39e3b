// Ops running on tracked tensors: the allocator's measured peak for the loss, blocked (online
// log-sum-exp) vs materialised, equals the bytes derived by hand from the shapes.
#include <gtest/gtest.h>

#include "executor/memory/tensor.h"
#include "executor/ops/cross_entropy.h"

namespace flatpeak::exec {
namespace {

constexpr int64_t T = 64, V = 1000, H = 32, kTokenBlock = 16, kVocabBlock = 128;

struct LossInputs {
  Tensor x, w, targets;
  explicit LossInputs(TrackingAllocator& alloc)
      : x(alloc, DType::BF16, {T, H}, Category::Vocab),  // [T, H] bf16 final hidden: 4096 B
        w(alloc, DType::BF16, {V, H}, Category::Vocab),  // [V, H] bf16 gathered LM head: 64000 B
        targets(alloc, DType::I32, {T}, Category::Vocab) {     // [T] i32: 256 B
    Bf16* xp = x.data<Bf16>();
    Bf16* wp = w.data<Bf16>();
    for (int64_t i = 0; i < T * H; ++i) xp[i] = f32_to_bf16(static_cast<float>(i % 7) * 0.125f - 0.25f);
    for (int64_t i = 0; i < V * H; ++i) wp[i] = f32_to_bf16(static_cast<float>(i % 11) * 0.0625f - 0.3f);
    int32_t* y = targets.data<int32_t>();
    for (int64_t t = 0; t < T; ++t) y[t] = static_cast<int32_t>((t * 37) % V);
  }
};
constexpr int64_t kInputBytes = 4096 + 64000 + 256;
constexpr int64_t kGradBytes = T * H * 2 + V * H * 4;  // dx [T, H] bf16 + dW [V, H] fp32 = 132096
// The materialised dW is one GEMM over all T whose output is bf16 (fp32 accumulation inside).
constexpr int64_t kMaterialisedGradBytes = T * H * 2 + V * H * 2;

TEST(ExecutorVocabMemory, BlockedPeakIsHandDerived) {
  TrackingAllocator alloc({1, -1, -1});
  LossInputs in(alloc);
  alloc.set_phase("loss/fwd");
  Tensor lse(alloc, DType::F32, {T}, Category::Vocab);   // [T] fp32: 256 B
  Tensor loss(alloc, DType::F32, {T}, Category::Vocab);  // [T] fp32: 256 B
  Tensor dx(alloc, DType::BF16, {T, H}, Category::Vocab);
  Tensor dw(alloc, DType::F32, {V, H}, Category::Grads);
  CrossEntropyArgs a;
  a.dtype = DType::BF16;
  a.x = in.x.raw(); a.w = in.w.raw(); a.targets = in.targets.data<int32_t>();
  a.lse = lse.data<float>(); a.loss = loss.data<float>(); a.d_x = dx.raw(); a.d_w = dw.data<float>();
  a.tokens = T; a.vocab = V; a.hidden = H; a.token_block_rows = kTokenBlock; a.vocab_block_rows = kVocabBlock;
  a.grad_scale = 1.0f / T;
  // fp32 [16, 128] logits block + [16, 32] dX accumulator + 3 × [16] row state = 10432 B, and the
  // bf16 [16, 128] dlogits block the dX and dW GEMMs read (a GPU kernel's operand) = 4096 B.
  ASSERT_EQ(blocked_cross_entropy_workspace_bytes(a), (16 * 128 + 16 * 32 + 3 * 16) * 4 + 16 * 128 * 2);
  Tensor ws(alloc, DType::F32, {blocked_cross_entropy_workspace_bytes(a) / 4}, Category::Vocab);
  a.workspace = ws.data<float>();
  for (int64_t i = 0; i < V * H; ++i) a.d_w[i] = 0.0f;
  blocked_cross_entropy_fused_cpu(a);
  ws.reset();
  EXPECT_EQ(alloc.high_water_bytes(MemorySpace::Device), kInputBytes + 512 + kGradBytes + 10432 + 4096);
  EXPECT_EQ(alloc.high_water_phase(MemorySpace::Device), "loss/fwd");
  EXPECT_EQ(alloc.live_bytes(MemorySpace::Device), kInputBytes + 512 + kGradBytes);
  // The vocab component alone (everything but the fp32 dW grad): inputs, lse, loss, dX, block.
  EXPECT_EQ(alloc.phase_records()[2].category_peak_bytes[static_cast<size_t>(Category::Vocab)],
            kInputBytes + 512 + T * H * 2 + 10432 + 4096);
  EXPECT_GT(loss.data<float>()[0], 0.0f);  // it ran
}

TEST(ExecutorVocabMemory, MaterialisedAddsTenBytesPerLogit) {
  TrackingAllocator alloc({1, -1, -1});
  LossInputs in(alloc);
  alloc.set_phase("loss/bwd");
  Tensor lse(alloc, DType::F32, {T}, Category::Vocab);
  Tensor loss(alloc, DType::F32, {T}, Category::Vocab);
  Tensor dx(alloc, DType::BF16, {T, H}, Category::Vocab);
  Tensor dw(alloc, DType::BF16, {V, H}, Category::Grads);
  Tensor logits(alloc, DType::BF16, {T, V}, Category::Vocab);    // [T, V] bf16
  Tensor logp(alloc, DType::F32, {T, V}, Category::Vocab);       // [T, V] fp32
  Tensor dlogits(alloc, DType::F32, {T, V}, Category::Vocab);    // [T, V] fp32
  MaterializedCrossEntropyArgs m;
  m.dtype = DType::BF16;
  m.x = in.x.raw(); m.w = in.w.raw(); m.targets = in.targets.data<int32_t>();
  m.logits = logits.raw(); m.log_probs = logp.data<float>(); m.d_logits = dlogits.data<float>();
  m.lse = lse.data<float>(); m.loss = loss.data<float>(); m.d_x = dx.raw(); m.d_w = dw.raw();
  m.tokens = T; m.vocab = V; m.hidden = H; m.grad_scale = 1.0f / T;
  materialized_cross_entropy_forward_cpu(m);
  materialized_cross_entropy_backward_cpu(m);
  const int64_t vocab_transient = T * V * 10;  // 640000: DESIGN's 10 bytes per logit
  EXPECT_EQ(alloc.high_water_bytes(MemorySpace::Device), kInputBytes + 512 + kMaterialisedGradBytes + vocab_transient);
  const PhaseRecord r = alloc.phase_records()[2];
  EXPECT_EQ(r.phase, "loss/bwd");
  EXPECT_EQ(r.category_peak_bytes[static_cast<size_t>(Category::Vocab)],
            kInputBytes + 512 + T * H * 2 + vocab_transient);
}

}  // namespace
}  // namespace flatpeak::exec
