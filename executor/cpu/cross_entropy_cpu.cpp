#include <algorithm>
#include <cmath>

#include "executor/cpu/gemm_cpu.h"
#include "executor/cpu/op_util.h"
#include "executor/ops/cross_entropy.h"

namespace flatpeak::exec {
namespace {

void check(const CrossEntropyArgs& a) {
  require(a.tokens >= 0 && a.vocab > 0 && a.hidden > 0, "cross_entropy",
          "need tokens >= 0 and vocab, hidden > 0");
  require(a.token_block_rows > 0 && a.vocab_block_rows > 0, "cross_entropy",
          "block sizes must be > 0");
  require(a.x && a.w && a.targets && a.lse && a.loss && a.workspace, "cross_entropy",
          "needs x, w, targets, lse, loss and a workspace");
  for (int64_t t = 0; t < a.tokens; ++t) {
    require(a.targets[t] < a.vocab, "cross_entropy", "targets must be < vocab");
  }
}

// Workspace layout: fp32 logits block [T_blk, V_blk], fp32 running max, running sum, target
// logit [T_blk] each (all the forward needs), fp32 dX accumulator [T_blk, H], then the dlogits block [T_blk, V_blk] in
// the compute dtype (bf16 in training): the operand of the dX and dW GEMMs, as a GPU kernel
// needs it beside the fp32 logits block.
struct Workspace {
  float* logits;
  float* dx_acc;
  float* row_max;
  float* row_sum;
  float* target_logit;
  void* dlogits;
};

// The backward alone keeps no row state (it reads the saved lse): its dX accumulator follows the
// logits block (blocked_cross_entropy_backward_workspace_bytes).
Workspace carve(const CrossEntropyArgs& a, bool backward_only) {
  const int64_t tb = a.token_block_rows;
  float* p = a.workspace;
  Workspace ws{};
  ws.logits = p;
  p += tb * a.vocab_block_rows;
  if (!backward_only) {
    ws.row_max = p;
    ws.row_sum = p + tb;
    ws.target_logit = p + 2 * tb;
    p += 3 * tb;  // the forward uses only what comes before this point
  }
  ws.dx_acc = p;
  ws.dlogits = p + tb * a.hidden;
  return ws;
}

// logits[r, c] = x[t0 + r] · w[v0 + c] (+ bias[v0 + c]), fp32.
template <class T>
void logits_block(const CrossEntropyArgs& a, int64_t t0, int64_t tb, int64_t v0, int64_t vb,
                  float* logits) {
  if (a.bias) {
    const T* b = static_cast<const T*>(a.bias) + v0;
    for (int64_t r = 0; r < tb; ++r)
      for (int64_t c = 0; c < vb; ++c) logits[r * vb + c] = to_f32(b[c]);
  }
  gemm_cpu(false, true, tb, vb, a.hidden, 1.0f, static_cast<const T*>(a.x) + t0 * a.hidden,
           a.hidden, static_cast<const T*>(a.w) + v0 * a.hidden, a.hidden, a.bias != nullptr, logits, vb);
}

template <class T>
void forward_block(const CrossEntropyArgs& a, const Workspace& ws, int64_t t0, int64_t tb) {
  std::fill(ws.row_max, ws.row_max + tb, -INFINITY);
  std::fill(ws.row_sum, ws.row_sum + tb, 0.0f);
  std::fill(ws.target_logit, ws.target_logit + tb, 0.0f);
  for (int64_t v0 = 0; v0 < a.vocab; v0 += a.vocab_block_rows) {
    const int64_t vb = std::min(a.vocab_block_rows, a.vocab - v0);
    logits_block<T>(a, t0, tb, v0, vb, ws.logits);
    for (int64_t r = 0; r < tb; ++r) {
      const float* z = ws.logits + r * vb;
      float block_max = -INFINITY;
      for (int64_t c = 0; c < vb; ++c) block_max = std::max(block_max, z[c]);
      float block_sum = 0.0f;
      for (int64_t c = 0; c < vb; ++c) block_sum += std::exp(z[c] - block_max);
      lse_fold(ws.row_max[r], ws.row_sum[r], block_max, block_sum);
      const int64_t y = a.targets[t0 + r];
      if (y >= v0 && y < v0 + vb) ws.target_logit[r] = z[y - v0];
    }
  }
  for (int64_t r = 0; r < tb; ++r) {
    const float lse = ws.row_max[r] + std::log(ws.row_sum[r]);
    a.lse[t0 + r] = lse;
    a.loss[t0 + r] = a.targets[t0 + r] >= 0 ? lse - ws.target_logit[r] : 0.0f;
  }
}

// logits_ready: the workspace still holds this token block's logits (the fused pass when one
// vocab block covers V: the forward just made them), so the block is not recomputed.
template <class T>
void backward_block(const CrossEntropyArgs& a, const Workspace& ws, int64_t t0, int64_t tb, bool logits_ready) {
  std::fill(ws.dx_acc, ws.dx_acc + tb * a.hidden, 0.0f);
  for (int64_t v0 = 0; v0 < a.vocab; v0 += a.vocab_block_rows) {
    const int64_t vb = std::min(a.vocab_block_rows, a.vocab - v0);
    if (!logits_ready) logits_block<T>(a, t0, tb, v0, vb, ws.logits);
    T* dz = static_cast<T*>(ws.dlogits);  // rounded once to the compute dtype
    for (int64_t r = 0; r < tb; ++r) {
      const float* z = ws.logits + r * vb;
      const int64_t y = a.targets[t0 + r];
      const float lse = a.lse[t0 + r];
      for (int64_t c = 0; c < vb; ++c) {
        store_f32(&dz[r * vb + c],
                  y < 0 ? 0.0f : cross_entropy_dlogit(z[c], lse, v0 + c == y, a.grad_scale));
      }
    }
    gemm_cpu(false, false, tb, a.hidden, vb, 1.0f, dz, vb,
             static_cast<const T*>(a.w) + v0 * a.hidden, a.hidden, true, ws.dx_acc, a.hidden);
    gemm_cpu(true, false, vb, a.hidden, tb, 1.0f, dz, vb,
             static_cast<const T*>(a.x) + t0 * a.hidden, a.hidden, true, a.d_w + v0 * a.hidden,
             a.hidden);
    if (a.d_bias) {  // d bias += Σ_r dz, fp32
      for (int64_t c = 0; c < vb; ++c) {
        float sum = 0.0f;
        for (int64_t r = 0; r < tb; ++r) sum += to_f32(dz[r * vb + c]);
        a.d_bias[v0 + c] += sum;
      }
    }
  }
  T* dx = static_cast<T*>(a.d_x) + t0 * a.hidden;
  for (int64_t i = 0; i < tb * a.hidden; ++i) store_f32(&dx[i], ws.dx_acc[i]);
}

enum class Pass { Forward, Backward, Fused };

void run(const CrossEntropyArgs& a, Pass pass) {
  check(a);
  if (pass != Pass::Forward) {
    require(a.d_x && a.d_w, "cross_entropy", "backward needs d_x and d_w");
    require(!a.bias || a.d_bias, "cross_entropy", "backward with a bias needs d_bias");
  }
  const Workspace ws = carve(a, pass == Pass::Backward);
  // Fused with one vocab block: the backward reads the logits the forward left (3 GEMMs a block,
  // as the materialised loss, instead of 4; the same values, so the same bits).
  const bool reuse_logits = pass == Pass::Fused && a.vocab_block_rows >= a.vocab;
  dispatch_compute(a.dtype, "cross_entropy", [&](auto tag) {
    using T = decltype(tag);
    for (int64_t t0 = 0; t0 < a.tokens; t0 += a.token_block_rows) {
      const int64_t tb = std::min(a.token_block_rows, a.tokens - t0);
      if (pass != Pass::Backward) forward_block<T>(a, ws, t0, tb);
      if (pass != Pass::Forward) backward_block<T>(a, ws, t0, tb, reuse_logits);
    }
  });
}

}  // namespace

int64_t blocked_cross_entropy_backward_workspace_bytes(const CrossEntropyArgs& a) {
  const int64_t tb = a.token_block_rows;
  const int64_t dlogits_bytes = tb * a.vocab_block_rows * (a.dtype == DType::BF16 ? 2 : 4);
  return (tb * a.vocab_block_rows + tb * a.hidden) * 4 + (dlogits_bytes + 3) / 4 * 4;
}

int64_t blocked_cross_entropy_forward_workspace_bytes(const CrossEntropyArgs& a) {
  return (a.token_block_rows * a.vocab_block_rows + 3 * a.token_block_rows) * 4;
}

int64_t blocked_cross_entropy_workspace_bytes(const CrossEntropyArgs& a) {
  const int64_t tb = a.token_block_rows;
  const int64_t dlogits_bytes = tb * a.vocab_block_rows * (a.dtype == DType::BF16 ? 2 : 4);
  return (tb * a.vocab_block_rows + tb * a.hidden + 3 * tb) * 4 + (dlogits_bytes + 3) / 4 * 4;
}

void blocked_cross_entropy_forward_cpu(const CrossEntropyArgs& a) { run(a, Pass::Forward); }
void blocked_cross_entropy_backward_cpu(const CrossEntropyArgs& a) { run(a, Pass::Backward); }
void blocked_cross_entropy_fused_cpu(const CrossEntropyArgs& a) { run(a, Pass::Fused); }

void materialized_cross_entropy_forward_cpu(const MaterializedCrossEntropyArgs& a) {
  require(a.tokens >= 0 && a.vocab > 0 && a.hidden > 0, "cross_entropy",
          "need tokens >= 0 and vocab, hidden > 0");
  require(a.x && a.w && a.targets && a.logits && a.log_probs && a.lse && a.loss, "cross_entropy",
          "materialised forward needs x, w, targets, logits, log_probs, lse and loss");
  dispatch_compute(a.dtype, "cross_entropy", [&](auto tag) {
    using T = decltype(tag);
    T* logits = static_cast<T*>(a.logits);
    if (a.bias) {  // the GEMM adds x·Wᵀ to the bias in fp32 and rounds once
      const T* b = static_cast<const T*>(a.bias);
      for (int64_t t = 0; t < a.tokens; ++t) std::copy(b, b + a.vocab, logits + t * a.vocab);
    }
    gemm_cpu(false, true, a.tokens, a.vocab, a.hidden, 1.0f, static_cast<const T*>(a.x), a.hidden,
             static_cast<const T*>(a.w), a.hidden, a.bias != nullptr, logits, a.vocab);
    for (int64_t t = 0; t < a.tokens; ++t) {
      const T* z = logits + t * a.vocab;
      float* lp = a.log_probs + t * a.vocab;
      float mx = -INFINITY;
      for (int64_t j = 0; j < a.vocab; ++j) mx = std::max(mx, to_f32(z[j]));
      float sum = 0.0f;
      for (int64_t j = 0; j < a.vocab; ++j) sum += std::exp(to_f32(z[j]) - mx);
      const float lse = mx + std::log(sum);
      for (int64_t j = 0; j < a.vocab; ++j) lp[j] = to_f32(z[j]) - lse;
      a.lse[t] = lse;
      const int64_t y = a.targets[t];
      require(y < a.vocab, "cross_entropy", "targets must be < vocab");
      a.loss[t] = y >= 0 ? -lp[y] : 0.0f;
    }
  });
}

void materialized_cross_entropy_backward_cpu(const MaterializedCrossEntropyArgs& a) {
  require(a.log_probs && a.d_logits && a.d_x && a.d_w && a.x && a.w && a.targets,
          "cross_entropy", "materialised backward needs log_probs, d_logits, d_x, d_w, x, w");
  require(!a.bias || a.d_bias, "cross_entropy", "materialised backward with a bias needs d_bias");
  dispatch_compute(a.dtype, "cross_entropy", [&](auto tag) {
    using T = decltype(tag);
    for (int64_t t = 0; t < a.tokens; ++t) {
      const int64_t y = a.targets[t];
      for (int64_t j = 0; j < a.vocab; ++j) {
        const float p = std::exp(a.log_probs[t * a.vocab + j]);
        a.d_logits[t * a.vocab + j] = y < 0 ? 0.0f : a.grad_scale * (p - (j == y ? 1.0f : 0.0f));
      }
    }
    const float* dz = a.d_logits;
    gemm_cpu(false, false, a.tokens, a.hidden, a.vocab, 1.0f, dz, a.vocab,
             static_cast<const T*>(a.w), a.hidden, false, static_cast<T*>(a.d_x), a.hidden);
    // One GEMM over all T: fp32 accumulation inside, dW written once in the compute dtype.
    gemm_cpu(true, false, a.vocab, a.hidden, a.tokens, 1.0f, dz, a.vocab,
             static_cast<const T*>(a.x), a.hidden, false, static_cast<T*>(a.d_w), a.hidden);
    if (a.d_bias) {  // d bias = Σ_t dz in fp32, written once in the compute dtype
      T* db = static_cast<T*>(a.d_bias);
      for (int64_t j = 0; j < a.vocab; ++j) {
        float sum = 0.0f;
        for (int64_t t = 0; t < a.tokens; ++t) sum += dz[t * a.vocab + j];
        store_f32(&db[j], sum);
      }
    }
  });
}

}  // namespace flatpeak::exec
