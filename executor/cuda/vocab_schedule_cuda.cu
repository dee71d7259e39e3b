// The vocab component run on the GPU (vocab_schedule_cuda.h): run_vocab_schedule's order of
// allocations, releases and phases, with the CUDA ops. Blocked: one op call per token block, each
// its own phase with its own workspace (stream-ordered pool blocks, so a block's workspace is
// reused by the next once the stream reaches it); dW accumulates (+=) across the calls.
#include "executor/cuda/vocab_schedule_cuda.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "executor/cuda/cuda_check.h"
#include "executor/cuda/ops_cuda.h"
#include "executor/cuda/schedule_util_cuda.cuh"
#include "executor/ops/cross_entropy.h"

namespace flatpeak::cuda {

namespace {

using exec::Bf16;
using exec::Category;
using exec::DType;
using exec::VocabScheduleConfig;
using exec::cuda_detail::ScopedEvent;
using exec::cuda_detail::event_seconds;

constexpr Category kVocab = Category::Vocab;

void check(const VocabScheduleConfig& c) {
  if (c.tokens <= 0 || c.hidden <= 0 || c.vocab <= 0)
    throw std::invalid_argument("vocab schedule: tokens, hidden and vocab must be positive");
  if (c.mode == exec::VocabScheduleMode::Blocked && (c.token_block_rows <= 0 || c.vocab_block_rows <= 0))
    throw std::invalid_argument("vocab schedule: blocked mode needs positive token and vocab blocks");
  exec::vocab_head_unit_params(c);  // the head unit's parts
  if (c.vocab > 0x7fffffff) throw std::invalid_argument("vocab schedule: vocab must be < 2^31 (int32 targets)");
}

int64_t aligned(int64_t bytes, int64_t a) { return (bytes + a - 1) / a * a; }

// The op's arguments for one token block (run_vocab_schedule's args_for), without pointers.
exec::CrossEntropyArgs block_shape(const VocabScheduleConfig& c, int64_t rows) {
  exec::CrossEntropyArgs a;
  a.dtype = DType::BF16;
  a.tokens = rows;
  a.vocab = c.vocab;
  a.hidden = c.hidden;
  a.token_block_rows = std::min(c.token_block_rows, c.tokens);
  a.vocab_block_rows = std::min(c.vocab_block_rows, c.vocab);
  return a;
}

// X [T, H] bf16, the head unit [U] bf16 holding W [V, H] (vocab), targets [T] i32 (workspace),
// filled from the seed as run_vocab_schedule fills them.
struct LossData {
  DeviceBuffer x, w, targets;
  const Bf16* w_first = nullptr;  // W [V, H] inside w
  LossData(DeviceAllocator& alloc, const VocabScheduleConfig& c, cudaStream_t s)
      : x(alloc, c.tokens * c.hidden * 2, kVocab, s),
        w(alloc, exec::vocab_head_unit_params(c) * 2, kVocab, s),
        targets(alloc, c.tokens * 4, Category::Workspace, s) {
    exec::cuda_detail::fill_bf16_cuda(x.as<Bf16>(), c.tokens * c.hidden, c.seed * 3 + 1, 1.0f, s);
    const int64_t VH = c.vocab * c.hidden;
    Bf16* unit = w.as<Bf16>();
    if (c.head_unit_before_w > 0) exec::cuda_detail::fill_bf16_cuda(unit, c.head_unit_before_w, c.seed * 3 + 4, 1.0f, s);
    exec::cuda_detail::fill_bf16_cuda(unit + c.head_unit_before_w, VH, c.seed * 3 + 2, 0.5f, s);
    if (c.head_unit_after_w > 0)
      exec::cuda_detail::fill_bf16_cuda(unit + c.head_unit_before_w + VH, c.head_unit_after_w, c.seed * 3 + 5, 0.5f, s);
    w_first = unit + c.head_unit_before_w;
    exec::cuda_detail::fill_targets_cuda(targets.as<int32_t>(), c.tokens, c.vocab, c.seed * 3 + 3, s);
  }
};

double mean_loss_of(const DeviceBuffer& loss, int64_t tokens, cudaStream_t s) {
  std::vector<float> host(static_cast<size_t>(tokens));
  FLATPEAK_CUDA_CHECK(cudaMemcpyAsync(host.data(), loss.raw(), static_cast<size_t>(tokens) * 4,
                                      cudaMemcpyDeviceToHost, s));
  FLATPEAK_CUDA_CHECK(cudaStreamSynchronize(s));
  double sum = 0.0;
  for (float v : host) sum += static_cast<double>(v);
  return sum / static_cast<double>(tokens);
}

// Records the end of a run on the stream, waits for it, and fills the result's times (forward:
// start..mid, backward: mid..stop) and its mean loss.
void finish_timed_run(VocabScheduleCudaResult& result, const ScopedEvent& start, const ScopedEvent& mid, ScopedEvent& stop,
                      const DeviceBuffer& loss, int64_t tokens, cudaStream_t s) {
  stop.record(s);
  FLATPEAK_CUDA_CHECK(cudaEventSynchronize(stop.get()));
  result.seconds = event_seconds(start.get(), stop.get());
  result.forward_s = event_seconds(start.get(), mid.get());
  result.backward_s = event_seconds(mid.get(), stop.get());
  result.mean_loss = mean_loss_of(loss, tokens, s);
}

VocabScheduleCudaResult run_blocked(DeviceAllocator& alloc, const CublasContext& blas,
                                    const VocabScheduleConfig& c) {
  cudaStream_t s = blas.stream();
  VocabScheduleCudaResult result;
  LossData in(alloc, c, s);
  const int64_t T = c.tokens, H = c.hidden, Tb = std::min(c.token_block_rows, c.tokens);
  const int64_t U = exec::vocab_head_unit_params(c);
  const int64_t blocks = (T + Tb - 1) / Tb;
  ScopedEvent start, mid, stop;
  start.record(s);
  DeviceBuffer lse(alloc, T * 4, kVocab, s);   // [T] fp32
  DeviceBuffer loss(alloc, T * 4, kVocab, s);  // [T] fp32 per token
  DeviceBuffer dx, dw;
  auto args_for = [&](int64_t block) {
    const int64_t t0 = block * Tb, rows = std::min(Tb, T - t0);
    exec::CrossEntropyArgs a = block_shape(c, rows);
    a.x = in.x.as<Bf16>() + t0 * H;
    a.w = in.w_first;
    a.bias = c.head_bias ? in.w_first + c.vocab * H : nullptr;
    a.targets = in.targets.as<int32_t>() + t0;
    a.lse = lse.as<float>() + t0;
    a.loss = loss.as<float>() + t0;
    a.grad_scale = 1.0f / static_cast<float>(T);
    a.d_x = dx.raw() == nullptr ? nullptr : static_cast<void*>(dx.as<Bf16>() + t0 * H);
    a.d_w = dw.raw() == nullptr ? nullptr : dw.as<float>() + c.head_unit_before_w;
    a.d_bias = dw.raw() == nullptr || !c.head_bias ? nullptr : dw.as<float>() + c.head_unit_before_w + c.vocab * H;
    return a;
  };
  auto make_grads = [&]() {
    dx = DeviceBuffer(alloc, T * H * 2, kVocab, s);  // [T, H] bf16
    dw = DeviceBuffer(alloc, U * 4, kVocab, s);  // the head unit's grads [U] fp32, dW [V, H] +=
    FLATPEAK_CUDA_CHECK(cudaMemsetAsync(dw.raw(), 0, static_cast<size_t>(U) * 4, s));
  };
  if (c.gradients_in_forward) make_grads();
  for (int64_t b = 0; b < blocks; ++b) {
    alloc.set_phase("loss/fwd/blk" + std::to_string(b));
    exec::CrossEntropyArgs a = args_for(b);
    const int64_t ws_bytes = c.gradients_in_forward ? exec::blocked_cross_entropy_workspace_bytes(a)
                                                    : exec::blocked_cross_entropy_forward_workspace_bytes(a);
    DeviceBuffer ws(alloc, ws_bytes, kVocab, s);
    a.workspace = ws.as<float>();
    if (c.gradients_in_forward) exec::blocked_cross_entropy_fused_cuda(a, blas);
    else exec::blocked_cross_entropy_forward_cuda(a, blas);
  }
  mid.record(s);
  if (c.gradients_in_forward) {
    // Nothing left to compute: X, W and lse go; dX and dW wait for the layers' backward.
    in.x.reset();
    in.w.reset();
    lse.reset();
    alloc.set_phase("loss/bwd");
  } else {
    for (int64_t b = 0; b < blocks; ++b) {
      alloc.set_phase("loss/bwd/blk" + std::to_string(b));
      // The workspace before dX and dW (the CPU schedule makes them first; the phase holds the
      // same bytes): the pool then maps it in place of the forward's freed workspace instead of
      // beside what is left of it once dX and dW are cut from it.
      DeviceBuffer ws(alloc, exec::blocked_cross_entropy_backward_workspace_bytes(block_shape(c, std::min(Tb, T - b * Tb))),
                      kVocab, s);
      if (b == 0) make_grads();
      exec::CrossEntropyArgs a = args_for(b);
      a.workspace = ws.as<float>();
      exec::blocked_cross_entropy_backward_cuda(a, blas);
    }
  }
  finish_timed_run(result, start, mid, stop, loss, T, s);
  return result;
}

VocabScheduleCudaResult run_materialized(DeviceAllocator& alloc, const CublasContext& blas,
                                         const VocabScheduleConfig& c) {
  cudaStream_t s = blas.stream();
  VocabScheduleCudaResult result;
  LossData in(alloc, c, s);
  const int64_t T = c.tokens, H = c.hidden, V = c.vocab;
  ScopedEvent start, mid, stop;
  start.record(s);
  alloc.set_phase("loss/fwd");
  DeviceBuffer lse(alloc, T * 4, kVocab, s);             // [T] fp32
  DeviceBuffer loss(alloc, T * 4, kVocab, s);            // [T] fp32
  DeviceBuffer logits(alloc, T * V * 2, kVocab, s);      // [T, V] bf16 (dz in the backward)
  DeviceBuffer log_probs(alloc, T * V * 4, kVocab, s);   // [T, V] fp32
  exec::MaterializedCrossEntropyArgs m;
  m.dtype = DType::BF16;
  m.x = in.x.raw();
  m.w = in.w_first;
  m.bias = c.head_bias ? in.w_first + V * H : nullptr;
  m.targets = in.targets.as<int32_t>();
  m.logits = logits.raw();
  m.log_probs = log_probs.as<float>();
  m.lse = lse.as<float>();
  m.loss = loss.as<float>();
  m.grad_scale = 1.0f / static_cast<float>(T);
  m.tokens = T;
  m.vocab = V;
  m.hidden = H;
  exec::materialized_cross_entropy_forward_cuda(m, blas);
  mid.record(s);
  alloc.set_phase("loss/bwd");
  DeviceBuffer dlogits(alloc, T * V * 4, kVocab, s);  // [T, V] fp32
  DeviceBuffer dx(alloc, T * H * 2, kVocab, s);       // [T, H] bf16
  DeviceBuffer dw(alloc, exec::vocab_head_unit_params(c) * 2, kVocab, s);  // the head unit's grads [U] bf16: dW one GEMM over T
  m.d_logits = dlogits.as<float>();
  m.d_x = dx.raw();
  m.d_w = dw.as<Bf16>() + c.head_unit_before_w;
  m.d_bias = c.head_bias ? static_cast<void*>(dw.as<Bf16>() + c.head_unit_before_w + V * H) : nullptr;
  exec::materialized_cross_entropy_backward_cuda(m, blas);
  finish_timed_run(result, start, mid, stop, loss, T, s);
  return result;
}

}  // namespace

int64_t vocab_schedule_cuda_peak_bytes(const VocabScheduleConfig& c, int64_t al) {
  check(c);
  const int64_t T = c.tokens, H = c.hidden, V = c.vocab, U = exec::vocab_head_unit_params(c);
  const int64_t inputs = aligned(T * H * 2, al) + aligned(U * 2, al) + aligned(T * 4, al);
  const int64_t rows = 2 * aligned(T * 4, al);  // lse, loss
  if (c.mode == exec::VocabScheduleMode::Materialized) {
    return inputs + rows + aligned(T * V * 2, al) + 2 * aligned(T * V * 4, al) + aligned(T * H * 2, al) +
           aligned(U * 2, al);
  }
  const exec::CrossEntropyArgs a = block_shape(c, std::min(c.token_block_rows, c.tokens));
  const int64_t grads = aligned(T * H * 2, al) + aligned(U * 4, al);  // dX, the fp32 dW accumulator [U]
  if (c.gradients_in_forward) return inputs + rows + grads + aligned(exec::blocked_cross_entropy_workspace_bytes(a), al);
  // Recompute: the forward's blocks hold the logits and row state, the backward's (beside dX and
  // dW) the logits, dX accumulator and dlogits, no row state.
  const int64_t forward = inputs + rows + aligned(exec::blocked_cross_entropy_forward_workspace_bytes(a), al);
  const int64_t backward = inputs + rows + grads + aligned(exec::blocked_cross_entropy_backward_workspace_bytes(a), al);
  return std::max(forward, backward);
}

VocabScheduleCudaResult run_vocab_schedule_cuda(DeviceAllocator& alloc, const CublasContext& blas,
                                                const VocabScheduleConfig& config) {
  check(config);
  return config.mode == exec::VocabScheduleMode::Materialized ? run_materialized(alloc, blas, config)
                                                              : run_blocked(alloc, blas, config);
}

}  // namespace flatpeak::cuda
