#include <Eigen/Core>
#include <algorithm>
#include <cmath>

#include "executor/cpu/op_util.h"
#include "executor/ops/attention.h"

namespace flatpeak::exec {
namespace {

using Mat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using MatMap = Eigen::Map<Mat>;

void check(const AttentionArgs& a) {
  require(a.tokens >= 0 && a.q_heads > 0 && a.kv_heads > 0 && a.head_dim > 0, "attention",
          "tokens must be >= 0, heads and head_dim > 0");
  require(a.q_heads % a.kv_heads == 0, "attention", "q_heads must be a multiple of kv_heads");
  require(a.tile_rows > 0, "attention", "tile_rows must be > 0");
  require(a.v_head_dim >= 0, "attention", "v_head_dim must be >= 0 (0: head_dim)");
  require(a.q && a.k && a.v && a.out && a.lse, "attention", "needs q, k, v, out and lse");
  require(a.workspace != nullptr, "attention", "needs a workspace");
}

float scale_of(const AttentionArgs& a) {
  return a.softmax_scale != 0.0f ? a.softmax_scale
                                 : 1.0f / std::sqrt(static_cast<float>(a.head_dim));
}

// Rows [row0, row0 + rows) of head `head` of a [T, heads, d] tensor into an fp32 tile.
template <class T>
void load_rows(const T* src, int64_t heads, int64_t head, int64_t d, int64_t row0, int64_t rows,
               float* tile) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* p = src + ((row0 + r) * heads + head) * d;
    for (int64_t i = 0; i < d; ++i) tile[r * d + i] = to_f32(p[i]);
  }
}

template <class T>
void store_rows(const float* tile, int64_t heads, int64_t head, int64_t d, int64_t row0,
                int64_t rows, T* dst) {
  for (int64_t r = 0; r < rows; ++r) {
    T* p = dst + ((row0 + r) * heads + head) * d;
    for (int64_t i = 0; i < d; ++i) store_f32(&p[i], tile[r * d + i]);
  }
}

template <class T>
void forward(const AttentionArgs& a) {
  const int64_t B = a.tile_rows;
  const int64_t d = a.head_dim;
  const int64_t dv = attention_v_dim(a);
  const int64_t group = a.q_heads / a.kv_heads;
  const float scale = scale_of(a);
  float* ws = a.workspace;
  MatMap q_tile(ws, B, d);          // [B, d]
  MatMap k_tile(ws + B * d, B, d);  // [B, d]
  MatMap v_tile(ws + 2 * B * d, B, dv);
  MatMap acc(ws + 2 * B * d + B * dv, B, dv);  // [B, dv] unnormalised output
  MatMap s(ws + 2 * B * d + 2 * B * dv, B, B);  // [B, B] scores, then probabilities
  float* row_max = ws + 2 * B * d + 2 * B * dv + B * B;  // [B]
  float* row_sum = row_max + B;                          // [B]
  const T* q = static_cast<const T*>(a.q);
  const T* k = static_cast<const T*>(a.k);
  const T* v = static_cast<const T*>(a.v);
  T* out = static_cast<T*>(a.out);

  for (int64_t h = 0; h < a.q_heads; ++h) {
    const int64_t kh = h / group;
    for (int64_t i0 = 0; i0 < a.tokens; i0 += B) {
      const int64_t bq = std::min(B, a.tokens - i0);
      load_rows(q, a.q_heads, h, d, i0, bq, q_tile.data());
      acc.setZero();
      std::fill(row_max, row_max + B, -INFINITY);
      std::fill(row_sum, row_sum + B, 0.0f);
      for (int64_t j0 = 0; j0 < i0 + bq; j0 += B) {  // causal: keys up to the last query row
        const int64_t bk = std::min(B, a.tokens - j0);
        load_rows(k, a.kv_heads, kh, d, j0, bk, k_tile.data());
        load_rows(v, a.kv_heads, kh, dv, j0, bk, v_tile.data());
        s.topLeftCorner(bq, bk).noalias() =
            scale * (q_tile.topRows(bq) * k_tile.topRows(bk).transpose());
        for (int64_t r = 0; r < bq; ++r) {
          float block_max = -INFINITY;
          for (int64_t c = 0; c < bk; ++c) {
            if (j0 + c > i0 + r) s(r, c) = -INFINITY;
            block_max = std::max(block_max, s(r, c));
          }
          const float new_max = std::max(row_max[r], block_max);
          const float rescale = online_softmax_rescale(row_max[r], new_max);
          float block_sum = 0.0f;
          for (int64_t c = 0; c < bk; ++c) {
            const float p = s(r, c) == -INFINITY ? 0.0f : std::exp(s(r, c) - new_max);
            s(r, c) = p;
            block_sum += p;
          }
          row_sum[r] = row_sum[r] * rescale + block_sum;
          row_max[r] = new_max;
          acc.row(r) *= rescale;
        }
        acc.topRows(bq).noalias() += s.topLeftCorner(bq, bk) * v_tile.topRows(bk);
      }
      for (int64_t r = 0; r < bq; ++r) {
        acc.row(r) /= row_sum[r];
        a.lse[h * a.tokens + i0 + r] = row_max[r] + std::log(row_sum[r]);
      }
      store_rows(acc.data(), a.q_heads, h, dv, i0, bq, out);
    }
  }
}

// Shared by both backward passes: for query rows [i0, i0+bq) of head h and key rows
// [j0, j0+bk), fills p = softmax probabilities and ds = p ⊙ (dO·Vᵀ − D) (scaled by nothing).
struct BackwardTiles {
  MatMap q, k, v, d_o, p, dp;
  float* lse;    // [B]
  float* delta;  // [B] D = Σ dO ⊙ O per row
};

void probs_and_dscores(BackwardTiles& t, int64_t i0, int64_t bq, int64_t j0, int64_t bk,
                       float scale) {
  t.p.topLeftCorner(bq, bk).noalias() = scale * (t.q.topRows(bq) * t.k.topRows(bk).transpose());
  t.dp.topLeftCorner(bq, bk).noalias() = t.d_o.topRows(bq) * t.v.topRows(bk).transpose();
  for (int64_t r = 0; r < bq; ++r) {
    for (int64_t c = 0; c < bk; ++c) {
      const float p = (j0 + c > i0 + r) ? 0.0f : std::exp(t.p(r, c) - t.lse[r]);
      t.p(r, c) = p;
      t.dp(r, c) = p * (t.dp(r, c) - t.delta[r]);  // now dS
    }
  }
}

template <class T>
void load_query_side(const AttentionArgs& a, int64_t h, int64_t i0, int64_t bq,
                     BackwardTiles& t, float* o_scratch) {
  const int64_t d = a.head_dim;
  const int64_t dv = attention_v_dim(a);
  load_rows(static_cast<const T*>(a.q), a.q_heads, h, d, i0, bq, t.q.data());
  load_rows(static_cast<const T*>(a.d_out), a.q_heads, h, dv, i0, bq, t.d_o.data());
  load_rows(static_cast<const T*>(a.out), a.q_heads, h, dv, i0, bq, o_scratch);
  for (int64_t r = 0; r < bq; ++r) {
    float dot = 0.0f;
    for (int64_t i = 0; i < dv; ++i) dot += o_scratch[r * dv + i] * t.d_o(r, i);
    t.delta[r] = dot;
    t.lse[r] = a.lse[h * a.tokens + i0 + r];
  }
}

template <class T>
void backward(const AttentionArgs& a) {
  const int64_t B = a.tile_rows;
  const int64_t d = a.head_dim;
  const int64_t dv = attention_v_dim(a);
  const int64_t group = a.q_heads / a.kv_heads;
  const float scale = scale_of(a);
  // Tiles in the workspace: q, k, dK/dQ accumulator [B, d]; v, dO, dV accumulator, O rows [B, dv];
  // p, dS [B, B]; lse, D [B].
  float* ws = a.workspace;
  float* at = ws;
  const auto take = [&](int64_t cols) {
    float* p = at;
    at += B * cols;
    return p;
  };
  float* q_tile = take(d);
  float* k_tile = take(d);
  float* v_tile = take(dv);
  float* do_tile = take(dv);
  MatMap acc1(take(d), B, d);          // dK (pass A) or dQ (pass B)
  MatMap acc2(take(dv), B, dv);        // dV (pass A)
  float* o_scratch = take(dv);         // [B, dv] O rows, for D = Σ dO ⊙ O
  float* p_tile = take(B);
  float* ds_tile = take(B);
  float* lse_tile = take(1);
  BackwardTiles t{MatMap(q_tile, B, d), MatMap(k_tile, B, d), MatMap(v_tile, B, dv), MatMap(do_tile, B, dv),
                  MatMap(p_tile, B, B), MatMap(ds_tile, B, B), lse_tile, take(1)};
  const T* k = static_cast<const T*>(a.k);
  const T* v = static_cast<const T*>(a.v);

  // Pass A: one key tile at a time, over every query tile at or below it, for all heads of
  // the group: dV = Σ Pᵀ·dO, dK = scale · Σ dSᵀ·Q.
  for (int64_t kh = 0; kh < a.kv_heads; ++kh) {
    for (int64_t j0 = 0; j0 < a.tokens; j0 += B) {
      const int64_t bk = std::min(B, a.tokens - j0);
      load_rows(k, a.kv_heads, kh, d, j0, bk, t.k.data());
      load_rows(v, a.kv_heads, kh, dv, j0, bk, t.v.data());
      acc1.setZero();
      acc2.setZero();
      for (int64_t h = kh * group; h < (kh + 1) * group; ++h) {
        for (int64_t i0 = j0 / B * B; i0 < a.tokens; i0 += B) {
          const int64_t bq = std::min(B, a.tokens - i0);
          load_query_side<T>(a, h, i0, bq, t, o_scratch);
          probs_and_dscores(t, i0, bq, j0, bk, scale);
          acc2.topRows(bk).noalias() += t.p.topLeftCorner(bq, bk).transpose() * t.d_o.topRows(bq);
          acc1.topRows(bk).noalias() +=
              scale * (t.dp.topLeftCorner(bq, bk).transpose() * t.q.topRows(bq));
        }
      }
      store_rows(acc1.data(), a.kv_heads, kh, d, j0, bk, static_cast<T*>(a.d_k));
      store_rows(acc2.data(), a.kv_heads, kh, dv, j0, bk, static_cast<T*>(a.d_v));
    }
  }
  // Pass B: one query tile at a time over the key tiles it sees: dQ = scale · Σ dS·K.
  for (int64_t h = 0; h < a.q_heads; ++h) {
    const int64_t kh = h / group;
    for (int64_t i0 = 0; i0 < a.tokens; i0 += B) {
      const int64_t bq = std::min(B, a.tokens - i0);
      load_query_side<T>(a, h, i0, bq, t, o_scratch);
      acc1.setZero();
      for (int64_t j0 = 0; j0 < i0 + bq; j0 += B) {
        const int64_t bk = std::min(B, a.tokens - j0);
        load_rows(k, a.kv_heads, kh, d, j0, bk, t.k.data());
        load_rows(v, a.kv_heads, kh, dv, j0, bk, t.v.data());
        probs_and_dscores(t, i0, bq, j0, bk, scale);
        acc1.topRows(bq).noalias() += scale * (t.dp.topLeftCorner(bq, bk) * t.k.topRows(bk));
      }
      store_rows(acc1.data(), a.q_heads, h, d, i0, bq, static_cast<T*>(a.d_q));
    }
  }
}

}  // namespace

int64_t attention_workspace_bytes(const AttentionArgs& a) {
  const int64_t B = a.tile_rows;
  // Backward (the larger): q, k, acc1 [B, d]; v, dO, acc2, O scratch [B, dv]; p, dS [B, B]; lse, D [B].
  return (3 * B * a.head_dim + 4 * B * attention_v_dim(a) + 2 * B * B + 2 * B) * 4;
}

void attention_forward_cpu(const AttentionArgs& a) {
  check(a);
  dispatch_compute(a.dtype, "attention", [&](auto tag) { forward<decltype(tag)>(a); });
}

void attention_backward_cpu(const AttentionArgs& a) {
  check(a);
  require(a.d_out && a.d_q && a.d_k && a.d_v, "attention",
          "backward needs d_out, d_q, d_k and d_v");
  dispatch_compute(a.dtype, "attention", [&](auto tag) { backward<decltype(tag)>(a); });
}

}  // namespace flatpeak::exec
