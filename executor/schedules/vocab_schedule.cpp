// The vocab component run (vocab_schedule.h). Blocked: the op is called once per token block, so
// each block is its own phase; dW accumulates (+=) across the calls in token order, which is the
// order one whole-T call uses, so splitting changes no bit.
#include "executor/schedules/vocab_schedule.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>

#include "executor/memory/tensor.h"
#include "executor/ops/cross_entropy.h"
#include "executor/ops/dtype.h"
#include "executor/schedules/schedule_util.h"

namespace flatpeak::exec {

namespace {

struct LossData {
  Tensor x, w, targets;  // w: the head unit, W [V, H] at head_unit_before_w
  LossData(TrackingAllocator& alloc, const VocabScheduleConfig& c)
      : x(alloc, DType::BF16, {c.tokens, c.hidden}, Category::Vocab),    // [T, H] bf16
        w(alloc, DType::BF16, {vocab_head_unit_params(c)}, Category::Vocab),  // [U] bf16
        targets(alloc, DType::I32, {c.tokens}, Category::Workspace) {   // [T] i32 labels
    fill_bf16(x.data<Bf16>(), x.numel(), c.seed * 3 + 1, 1.0f);
    // W is the same for any unit around it; the rest of the unit (never read here) is random too.
    fill_bf16(w.data<Bf16>(), c.head_unit_before_w, c.seed * 3 + 4, 1.0f);
    fill_bf16(w.data<Bf16>() + c.head_unit_before_w, c.vocab * c.hidden, c.seed * 3 + 2, 0.5f);
    fill_bf16(w.data<Bf16>() + c.head_unit_before_w + c.vocab * c.hidden, c.head_unit_after_w, c.seed * 3 + 5, 0.5f);
    fill_targets(targets.data<int32_t>(), c.tokens, c.vocab, c.seed * 3 + 3);
  }
};

void check(const VocabScheduleConfig& c) {
  if (c.tokens <= 0 || c.hidden <= 0 || c.vocab <= 0)
    throw std::invalid_argument("vocab schedule: tokens, hidden and vocab must be positive");
  vocab_head_unit_params(c);  // the head unit's parts
  if (c.mode == VocabScheduleMode::Blocked && (c.token_block_rows <= 0 || c.vocab_block_rows <= 0))
    throw std::invalid_argument("vocab schedule: blocked mode needs positive token and vocab blocks");
}

double mean_of(const Tensor& loss) {
  double sum = 0.0;
  const float* p = loss.data<float>();
  for (int64_t i = 0; i < loss.numel(); ++i) sum += static_cast<double>(p[i]);
  return sum / static_cast<double>(loss.numel());
}

// n values of a bf16 or fp32 buffer, widened: dX is bf16; dW (and a head bias's gradient) the fp32
// accumulator (blocked) or the bf16 GEMM output (materialised).
std::vector<float> widened(const void* p, DType dtype, int64_t n) {
  std::vector<float> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    out[static_cast<size_t>(i)] = dtype == DType::F32 ? static_cast<const float*>(p)[i] : to_f32(static_cast<const Bf16*>(p)[i]);
  return out;
}

// Every buffer of the loss other than the caller's (LossInputs) is made and released here.
LossOutputs run_blocked(TrackingAllocator& alloc, const VocabScheduleConfig& c, LossInputs& io) {
  const int64_t T = c.tokens, H = c.hidden, V = c.vocab, Tb = std::min(c.token_block_rows, c.tokens);
  const int64_t blocks = (T + Tb - 1) / Tb;
  const std::string& prefix = io.phase_prefix;
  alloc.set_phase(prefix + "/fwd/blk0");
  if (io.on_forward) io.on_forward();
  Tensor lse(alloc, DType::F32, {T}, Category::Vocab);   // [T] fp32
  LossOutputs out;
  out.loss = Tensor(alloc, DType::F32, {T}, Category::Vocab);  // [T] fp32 per token
  Tensor& loss = out.loss;
  Tensor& dx = out.d_x;
  float* dw = nullptr;
  auto args_for = [&](int64_t block) {
    const int64_t t0 = block * Tb, rows = std::min(Tb, T - t0);
    CrossEntropyArgs a;
    a.dtype = DType::BF16;
    a.x = io.x.data<Bf16>() + t0 * H;
    a.w = io.w;
    a.bias = io.bias;
    a.targets = io.targets + t0;
    a.lse = lse.data<float>() + t0;
    a.loss = loss.data<float>() + t0;
    a.grad_scale = 1.0f / static_cast<float>(T);
    a.d_x = dx.empty() ? nullptr : static_cast<void*>(dx.data<Bf16>() + t0 * H);
    a.d_w = dw;
    a.d_bias = dw == nullptr ? nullptr : static_cast<float*>(io.d_bias);
    a.tokens = rows;
    a.vocab = V;
    a.hidden = H;
    a.token_block_rows = Tb;
    a.vocab_block_rows = std::min(c.vocab_block_rows, V);
    return a;
  };
  auto make_grads = [&]() {
    dx = Tensor(alloc, DType::BF16, {T, H}, Category::Vocab);  // [T, H] bf16
    dw = static_cast<float*>(io.make_dw(DType::F32));           // [V, H] fp32, +=
  };
  auto release = [&]() {
    if (io.before_release) io.before_release();
    io.x.reset();
    io.w_storage.reset();
    lse.reset();
  };
  if (c.gradients_in_forward) make_grads();
  for (int64_t b = 0; b < blocks; ++b) {
    if (b > 0) alloc.set_phase(prefix + "/fwd/blk" + std::to_string(b));
    CrossEntropyArgs a = args_for(b);
    const int64_t ws_bytes = c.gradients_in_forward ? blocked_cross_entropy_workspace_bytes(a)
                                                    : blocked_cross_entropy_forward_workspace_bytes(a);
    Tensor ws(alloc, DType::F32, {ws_bytes / 4}, Category::Vocab);
    a.workspace = ws.data<float>();
    if (c.gradients_in_forward) blocked_cross_entropy_fused_cpu(a);
    else blocked_cross_entropy_forward_cpu(a);
  }
  if (c.gradients_in_forward) {
    // Nothing left to compute: X, the gathered W and lse are released; dX and dW wait for the
    // layers' backward.
    out.mean_loss = mean_of(loss);
    release();
    if (io.between) io.between();
    alloc.set_phase(prefix + "/bwd");
    if (io.on_backward) io.on_backward();
  } else {
    if (io.between) {
      io.w_storage.reset();  // gathered again by on_backward
      io.between();
    }
    for (int64_t b = 0; b < blocks; ++b) {
      alloc.set_phase(prefix + "/bwd/blk" + std::to_string(b));
      if (b == 0) {
        if (io.on_backward) io.on_backward();
        make_grads();
      }
      CrossEntropyArgs a = args_for(b);
      Tensor ws(alloc, DType::F32, {blocked_cross_entropy_backward_workspace_bytes(a) / 4}, Category::Vocab);
      a.workspace = ws.data<float>();
      blocked_cross_entropy_backward_cpu(a);
    }
    out.mean_loss = mean_of(loss);
    release();
  }
  return out;
}

LossOutputs run_materialized(TrackingAllocator& alloc, const VocabScheduleConfig& c, LossInputs& io) {
  const int64_t T = c.tokens, H = c.hidden, V = c.vocab;
  alloc.set_phase(io.phase_prefix + "/fwd");
  if (io.on_forward) io.on_forward();
  LossOutputs out;
  Tensor lse(alloc, DType::F32, {T}, Category::Vocab);            // [T] fp32
  out.loss = Tensor(alloc, DType::F32, {T}, Category::Vocab);     // [T] fp32
  Tensor logits(alloc, DType::BF16, {T, V}, Category::Vocab);     // [T, V] bf16
  Tensor log_probs(alloc, DType::F32, {T, V}, Category::Vocab);   // [T, V] fp32
  MaterializedCrossEntropyArgs m;
  m.dtype = DType::BF16;
  m.x = io.x.raw();
  m.w = io.w;
  m.bias = io.bias;
  m.targets = io.targets;
  m.logits = logits.raw();
  m.log_probs = log_probs.data<float>();
  m.lse = lse.data<float>();
  m.loss = out.loss.data<float>();
  m.grad_scale = 1.0f / static_cast<float>(T);
  m.tokens = T;
  m.vocab = V;
  m.hidden = H;
  materialized_cross_entropy_forward_cpu(m);
  if (io.between) {
    io.w_storage.reset();  // gathered again by on_backward
    io.between();
  }
  alloc.set_phase(io.phase_prefix + "/bwd");
  if (io.on_backward) io.on_backward();
  m.w = io.w;
  m.bias = io.bias;
  Tensor dlogits(alloc, DType::F32, {T, V}, Category::Vocab);        // [T, V] fp32
  out.d_x = Tensor(alloc, DType::BF16, {T, H}, Category::Vocab);     // [T, H] bf16
  m.d_logits = dlogits.data<float>();
  m.d_x = out.d_x.raw();
  m.d_w = io.make_dw(DType::BF16);  // [V, H] bf16: one GEMM over T
  m.d_bias = io.d_bias;
  materialized_cross_entropy_backward_cpu(m);
  out.mean_loss = mean_of(out.loss);
  dlogits.reset(), log_probs.reset(), logits.reset();
  if (io.before_release) io.before_release();
  io.x.reset();
  io.w_storage.reset();
  lse.reset();
  return out;
}

}  // namespace

int64_t vocab_head_unit_params(const VocabScheduleConfig& c) {
  if (c.head_unit_before_w < 0 || c.head_unit_after_w < 0)
    throw std::invalid_argument("vocab schedule: the head unit's parts around W must be >= 0");
  if (c.head_bias && c.head_unit_after_w < c.vocab)
    throw std::invalid_argument("vocab schedule: a head bias needs head_unit_after_w >= vocab");
  return c.head_unit_before_w + c.vocab * c.hidden + c.head_unit_after_w;
}

LossOutputs run_vocab_loss(TrackingAllocator& alloc, const VocabScheduleConfig& config, LossInputs& in) {
  check(config);
  if (!in.make_dw) throw std::invalid_argument("vocab loss: make_dw is required");
  return config.mode == VocabScheduleMode::Materialized ? run_materialized(alloc, config, in) : run_blocked(alloc, config, in);
}

VocabScheduleResult run_vocab_schedule(TrackingAllocator& alloc, const VocabScheduleConfig& config) {
  check(config);
  LossData data(alloc, config);
  LossInputs in;
  in.x = std::move(data.x);
  in.w = data.w.data<Bf16>() + config.head_unit_before_w;
  if (config.head_bias) in.bias = in.w + config.vocab * config.hidden;
  in.w_storage = std::move(data.w);
  in.targets = data.targets.data<int32_t>();
  Tensor dw;              // the head unit's grads [U]
  void* dw_first = nullptr;  // dW [V, H], +=
  in.make_dw = [&](DType dtype) {
    dw = Tensor(alloc, dtype, {vocab_head_unit_params(config)}, Category::Vocab);
    std::memset(dw.raw(), 0, static_cast<size_t>(dw.bytes()));
    dw_first = static_cast<unsigned char*>(dw.raw()) + config.head_unit_before_w * dtype_bytes(dtype);  // dW [V, H] in the unit's grads
    if (config.head_bias) in.d_bias = static_cast<unsigned char*>(dw_first) + config.vocab * config.hidden * dtype_bytes(dtype);
    return dw_first;
  };
  const LossOutputs out = run_vocab_loss(alloc, config, in);
  VocabScheduleResult result;
  result.mean_loss = out.mean_loss;
  const int64_t VH = config.vocab * config.hidden;
  result.d_x = widened(out.d_x.raw(), DType::BF16, out.d_x.numel());
  result.d_w = widened(dw_first, dw.dtype(), VH);
  if (config.head_bias)  // the head bias's gradient, after dW in the unit's grads
    result.d_bias = widened(static_cast<const unsigned char*>(dw_first) + VH * dtype_bytes(dw.dtype()), dw.dtype(), config.vocab);
  return result;
}

}  // namespace flatpeak::exec
