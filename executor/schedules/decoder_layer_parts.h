// Pieces of the decoder layer (decoder_layer.cpp) that stand on their own: where an MoE layer's
// rows go across the EP ranks (EpRows), FlashAttention-2's backward over the layer's saved
// attention set, and ring attention's per-chunk forward fold and backward (CP > 1). Internal to
// executor/schedules.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "executor/comm/communicator.h"
#include "executor/ops/attention.h"
#include "executor/ops/dtype.h"

namespace flatpeak::exec::layer_detail {

// Where the rows of one MoE layer go at EP > 1 (host metadata, from every rank's [E] counts):
// what this rank sends each destination (send order: expert-major over all E, so destination
// blocks), what it receives from each source (source-major, each source's rows in expert order),
// and the regrouping of the received rows by local expert (chunks of one (source, expert)).
struct EpRows {
  struct Chunk {
    int64_t exp_row, recv_row, rows;
  };
  std::vector<int64_t> send_rows, send_begin, recv_rows, recv_begin;  // [EP] each
  std::vector<Chunk> chunks;                                          // in expert order
  std::vector<int64_t> local_begin;                                   // [E/EP + 1] expert-order rows
  int64_t received = 0;                                               // R

  // all_counts [EP·E]: rank s's copies per expert at s·E.
  EpRows(const std::vector<int64_t>& all_counts, int64_t ep, int64_t me, int64_t E) {
    const int64_t EL = E / ep;
    auto count = [&](int64_t s, int64_t e) { return all_counts[static_cast<size_t>(s * E + e)]; };
    send_rows.assign(static_cast<size_t>(ep), 0), send_begin.assign(static_cast<size_t>(ep), 0);
    recv_rows.assign(static_cast<size_t>(ep), 0), recv_begin.assign(static_cast<size_t>(ep), 0);
    for (int64_t d = 0, at = 0; d < ep; ++d) {
      send_begin[static_cast<size_t>(d)] = at;
      for (int64_t e = d * EL; e < (d + 1) * EL; ++e) send_rows[static_cast<size_t>(d)] += count(me, e);
      at += send_rows[static_cast<size_t>(d)];
    }
    for (int64_t s = 0; s < ep; ++s) {
      recv_begin[static_cast<size_t>(s)] = received;
      for (int64_t l = 0; l < EL; ++l) recv_rows[static_cast<size_t>(s)] += count(s, me * EL + l);
      received += recv_rows[static_cast<size_t>(s)];
    }
    local_begin.assign(static_cast<size_t>(EL + 1), 0);
    std::vector<int64_t> cursor(recv_begin);  // next unread row of each source's block
    int64_t row = 0;
    for (int64_t l = 0; l < EL; ++l) {
      for (int64_t s = 0; s < ep; ++s) {
        const int64_t n = count(s, me * EL + l);
        if (n > 0) chunks.push_back({row, cursor[static_cast<size_t>(s)], n});
        cursor[static_cast<size_t>(s)] += n;
        row += n;
      }
      local_begin[static_cast<size_t>(l + 1)] = row;
    }
  }
  // Source-major rows (width W) into expert order, and back.
  template <class V>
  void regroup(const V* src, V* dst, int64_t W) const {
    for (const Chunk& ch : chunks) std::copy(src + ch.recv_row * W, src + (ch.recv_row + ch.rows) * W, dst + ch.exp_row * W);
  }
  template <class V>
  void ungroup(const V* src, V* dst, int64_t W) const {
    for (const Chunk& ch : chunks) std::copy(src + ch.exp_row * W, src + (ch.exp_row + ch.rows) * W, dst + ch.recv_row * W);
  }
  // One all-to-allv of rows of width W: to the experts (send order → received order), or home.
  void exchange(Communicator& comm, const void* from, void* to, int64_t W, DType dtype, bool to_experts) const {
    const std::vector<int64_t>& out = to_experts ? send_rows : recv_rows;
    const std::vector<int64_t>& out_at = to_experts ? send_begin : recv_begin;
    const std::vector<int64_t>& in = to_experts ? recv_rows : send_rows;
    const std::vector<int64_t>& in_at = to_experts ? recv_begin : send_begin;
    const size_t n = out.size();
    std::vector<int64_t> sc(n), sd(n), rc(n), rd(n);
    for (size_t p = 0; p < n; ++p) sc[p] = out[p] * W, sd[p] = out_at[p] * W, rc[p] = in[p] * W, rd[p] = in_at[p] * W;
    static const int64_t nothing = 0;  // a valid address for an empty side
    comm.all_to_allv(from ? from : &nothing, sc.data(), sd.data(), to ? to : const_cast<int64_t*>(&nothing), rc.data(), rd.data(), dtype);
  }
};

// Head widths of one attention: D of q and k, Dv of v, the output and their gradients (MLA:
// D = nope + rope, Dv apart; GQA: the same).
struct HeadDims {
  int64_t D, Dv;
};

// The saved forward of one attention: q [T, a, d], k [T, g, d], v [T, g, dv], o [T, a, dv] in
// the storage dtype, lse [a, T] fp32 (causal, GQA: query head h reads kv head h / (a / g)).
template <class S>
struct SavedAttention {
  const S *q, *k, *v, *o;
  const float* lse;
  int64_t tokens, q_heads, kv_heads;
  HeadDims dims;
};

// delta [a, T] fp32: Σ dO ⊙ O over each query row's value width Dv (the backward's softmax term).
template <class S>
void attention_row_delta(const S* d_o, const S* o, float* delta, int64_t T, int64_t A, int64_t Dv) {
  for (int64_t h = 0; h < A; ++h)
    for (int64_t i = 0; i < T; ++i) {
      float dot = 0.0f;
      for (int64_t j = 0; j < Dv; ++j) dot += to_f32(d_o[(i * A + h) * Dv + j]) * to_f32(o[(i * A + h) * Dv + j]);
      delta[h * T + i] = dot;
    }
}

// One key row j (kv head kh) of the attention backward against query rows [i_begin, i_end) of the
// group's query heads, FlashAttention-2's arithmetic against the final lse and delta ([a, T]
// fp32): dK of the row added into dk_row [d], dV into dv_row [dv] (fp32), dQ into dq_acc [T, a, d].
template <class S>
void key_row_backward(const S* q, const S* d_o, const float* lse, const float* delta, const S* kj, const S* vj, int64_t kh,
                      int64_t i_begin, int64_t i_end, int64_t T, int64_t A, int64_t group, HeadDims hd, float* dk_row, float* dv_row,
                      float* dq_acc) {
  const int64_t D = hd.D, Dv = hd.Dv;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  for (int64_t h = kh * group; h < (kh + 1) * group; ++h)
    for (int64_t i = i_begin; i < i_end; ++i) {
      const S* qi = q + (i * A + h) * D;
      const S* gi = d_o + (i * A + h) * Dv;
      float s = 0.0f, dp = 0.0f;
      for (int64_t x = 0; x < D; ++x) s += to_f32(qi[x]) * to_f32(kj[x]);
      for (int64_t x = 0; x < Dv; ++x) dp += to_f32(gi[x]) * to_f32(vj[x]);
      const float pr = std::exp(scale * s - lse[h * T + i]);
      const float ds = pr * (dp - delta[h * T + i]);
      float* aq = dq_acc + (i * A + h) * D;
      for (int64_t x = 0; x < Dv; ++x) dv_row[x] += pr * to_f32(gi[x]);
      for (int64_t x = 0; x < D; ++x) {
        dk_row[x] += scale * ds * to_f32(qi[x]);
        aq[x] += scale * ds * to_f32(kj[x]);
      }
    }
}

// FlashAttention-2's backward, one key row at a time: dK and dV of the row in fp32 registers
// (`regs`, [d + dv]), dQ accumulated in fp32 over key rows (`dq_acc` [T, a·d]), delta = Σ dO ⊙ O per
// query row (`delta` [a, T] fp32); writes dq, dk, dv in the storage dtype.
template <class S>
void flash2_attention_backward(const SavedAttention<S>& a, const S* d_o, float* dq_acc, float* delta, float* regs, S* dq, S* dk, S* dv) {
  const S *q = a.q, *k = a.k, *v = a.v, *o = a.o, *g = d_o;
  const float* lse = a.lse;
  const int64_t T = a.tokens, A = a.q_heads, G = a.kv_heads, D = a.dims.D, Dv = a.dims.Dv;
  float* acc = dq_acc;
  float* dl = delta;
  const int64_t group = A / G;
  attention_row_delta(g, o, dl, T, A, Dv);
  std::fill(acc, acc + T * A * D, 0.0f);
  float* dk_row = regs;
  float* dv_row = dk_row + D;
  for (int64_t kh = 0; kh < G; ++kh)
    for (int64_t j = 0; j < T; ++j) {
      std::fill(dk_row, dk_row + D + Dv, 0.0f);
      const S* kj = k + (j * G + kh) * D;
      const S* vj = v + (j * G + kh) * Dv;
      key_row_backward(q, g, lse, dl, kj, vj, kh, j, T, T, A, group, a.dims, dk_row, dv_row, acc);
      for (int64_t x = 0; x < D; ++x) store_f32(dk + (j * G + kh) * D + x, dk_row[x]);
      for (int64_t x = 0; x < Dv; ++x) store_f32(dv + (j * G + kh) * Dv + x, dv_row[x]);
    }
  for (int64_t i = 0; i < T * A * D; ++i) store_f32(dq + i, acc[i]);
}

// The keys a query attends to, by position in the whole sequence (causal): every earlier one; with
// `window` > 0 the `window` latest up to its own (a sliding window, gpt-oss); with `chunk` > 0 those
// of its own chunk of `chunk` tokens (chunked attention, Llama 4). The kernels below take the
// sequence positions of their first query and first key, so one mask serves a rank's own keys,
// a halo and a ring chunk.
struct KeyWindow {
  int64_t window = 0, chunk = 0;
  int64_t first_key(int64_t query) const {
    if (window > 0) return std::max<int64_t>(0, query - window + 1);
    if (chunk > 0) return query / chunk * chunk;
    return 0;
  }
  // One past the last of queries [q0, q0 + T) that attend to the key at `key`, as a row of them.
  int64_t query_end(int64_t key, int64_t q0, int64_t T) const {
    int64_t last = q0 + T - 1;
    if (window > 0) last = std::min(last, key + window - 1);
    if (chunk > 0) last = std::min(last, (key / chunk + 1) * chunk - 1);
    return std::max<int64_t>(0, last - q0 + 1);
  }
  // The first of queries [q0, ...) that attends to `key` (causal), as a row.
  static int64_t query_begin(int64_t key, int64_t q0) { return std::max<int64_t>(0, key - q0); }
};

// Ring attention (CP > 1). The sequence is split into CP chunks of T consecutive tokens, rank r
// holding the r-th; a K,V chunk travels as one buffer of T·g·d keys then T·g·dv values. Query rows
// at q0 (the rank's first token) attend to the keys of the chunk at k0 that `mask` lets them:
// every key of an earlier chunk and causally their own chunk's with full attention.

// One online-softmax step of a row: score s with value row vj folded into (m, l, o).
template <class S>
inline void fold_key(float s, const S* vj, int64_t D, float& m, float& l, float* o) {
  if (s > m) {
    const float r = online_softmax_rescale(m, s);
    l *= r;
    for (int64_t x = 0; x < D; ++x) o[x] *= r;
    m = s;
  }
  const float p = std::exp(s - m);
  l += p;
  for (int64_t x = 0; x < D; ++x) o[x] += p * to_f32(vj[x]);
}

// Forward into o (storage dtype) and lse [a, T] of queries at q0..q0+T−1 over their own keys and
// the `halo` rows before them (positions q0 − halo ...; K rows then V rows); `row` is a [dv] fp32
// scratch.
template <class S>
void windowed_attention_forward(const S* q, const S* k, const S* v, const S* halo_kv, int64_t halo, S* o, float* lse, float* row,
                                int64_t T, int64_t A, int64_t G, HeadDims hd, const KeyWindow& mask, int64_t q0) {
  const int64_t D = hd.D, Dv = hd.Dv;
  const int64_t group = A / G;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const auto score = [&](const S* qi, const S* kj) {
    float s = 0.0f;
    for (int64_t x = 0; x < D; ++x) s += to_f32(qi[x]) * to_f32(kj[x]);
    return s * scale;
  };
  for (int64_t h = 0; h < A; ++h)
    for (int64_t i = 0; i < T; ++i) {
      const S* qi = q + (i * A + h) * D;
      const int64_t kh = h / group;
      const int64_t first = mask.first_key(q0 + i);
      float m = -INFINITY, l = 0.0f;
      std::fill(row, row + Dv, 0.0f);
      for (int64_t jh = std::max<int64_t>(0, first - (q0 - halo)); jh < halo; ++jh)
        fold_key(score(qi, halo_kv + (jh * G + kh) * D), halo_kv + halo * G * D + (jh * G + kh) * Dv, Dv, m, l, row);
      for (int64_t j = std::max<int64_t>(0, first - q0); j <= i; ++j)
        fold_key(score(qi, k + (j * G + kh) * D), v + (j * G + kh) * Dv, Dv, m, l, row);
      for (int64_t x = 0; x < Dv; ++x) store_f32(o + (i * A + h) * Dv + x, row[x] / l);
      lse[h * T + i] = m + std::log(l);
    }
}

// Folds one K,V chunk into this rank's running attention: `acc` [T, a, dv] fp32 holds the output
// normalised over the chunks folded so far and `lse_acc` [a, T] their log-sum-exp (−inf before the
// first), so the fold starts each row from (max = lse, sum = 1, output = acc) and ends with
// acc = output / sum, lse = max + log(sum): the online softmax carried across chunks.
template <class S>
void ring_attention_fold(const S* q, const S* kv, float* acc, float* lse_acc, int64_t T, int64_t A, int64_t G, HeadDims hd,
                         const KeyWindow& mask, int64_t q0, int64_t k0) {
  const int64_t D = hd.D, Dv = hd.Dv;
  const S* k = kv;
  const S* v = kv + T * G * D;
  const int64_t group = A / G;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  for (int64_t h = 0; h < A; ++h)
    for (int64_t i = 0; i < T; ++i) {
      const S* qi = q + (i * A + h) * D;
      float* o = acc + (i * A + h) * Dv;
      float m = lse_acc[h * T + i];
      float l = m == -INFINITY ? 0.0f : 1.0f;
      const int64_t kh = h / group;
      const int64_t j_end = std::min(T, q0 + i - k0 + 1);
      for (int64_t j = std::max<int64_t>(0, mask.first_key(q0 + i) - k0); j < j_end; ++j) {
        const S* kj = k + (j * G + kh) * D;
        const S* vj = v + (j * G + kh) * Dv;
        float s = 0.0f;
        for (int64_t x = 0; x < D; ++x) s += to_f32(qi[x]) * to_f32(kj[x]);
        fold_key(s * scale, vj, Dv, m, l, o);
      }
      if (l == 0.0f) continue;  // no key folded (never for a rank's own chunk: key i is its own)
      for (int64_t x = 0; x < Dv; ++x) o[x] /= l;
      lse_acc[h * T + i] = m + std::log(l);
    }
}

// One K,V chunk's part of the attention backward, FlashAttention-2's arithmetic against the
// final lse and delta = Σ dO ⊙ O ([a, T] fp32 each): dQ added into `dq_acc` [T, a, d] fp32 and the
// chunk's dK [T, g, d] then dV [T, g, dv] into `dkv` (fp32), the accumulator that travels with
// the chunk.
template <class S>
void ring_attention_backward_chunk(const S* q, const S* d_o, const float* lse, const float* delta, const S* kv, float* dq_acc,
                                   float* dkv, int64_t T, int64_t A, int64_t G, HeadDims hd, const KeyWindow& mask, int64_t q0,
                                   int64_t k0) {
  const int64_t D = hd.D, Dv = hd.Dv;
  const S* k = kv;
  const S* v = kv + T * G * D;
  float* dk = dkv;
  float* dv = dkv + T * G * D;
  const int64_t group = A / G;
  for (int64_t kh = 0; kh < G; ++kh)
    for (int64_t j = 0; j < T; ++j) {
      const S* kj = k + (j * G + kh) * D;
      const S* vj = v + (j * G + kh) * Dv;
      key_row_backward(q, d_o, lse, delta, kj, vj, kh, std::min(T, KeyWindow::query_begin(k0 + j, q0)), mask.query_end(k0 + j, q0, T),
                       T, A, group, hd, dk + (j * G + kh) * D, dv + (j * G + kh) * Dv, dq_acc);
    }
}

// Windowed attention (sliding or chunked) at CP > 1 when the window stays within the previous
// rank (DecoderLayer's halo_from_mask): the keys a rank's first queries need from the
// previous rank are among its last `halo` rows (the halo, packed K [halo, g, d] then V [halo, g, dv]),
// placed before this rank's own T rows; halo = 0 without one (CP = 1, the sequence's first rank,
// or chunks that never straddle a rank boundary).

// Backward of the halo's keys: their dK, dV into `halo_dkv` (the halo's layout, fp32; zeroed by
// the caller; it goes to the previous rank), dQ into dq_acc.
template <class S>
void windowed_attention_backward_halo(const S* q, const S* d_o, const float* lse, const float* delta, const S* halo_kv, int64_t halo,
                                      float* halo_dkv, float* dq_acc, int64_t T, int64_t A, int64_t G, HeadDims hd, const KeyWindow& mask,
                                      int64_t q0) {
  const int64_t D = hd.D, Dv = hd.Dv;
  const int64_t group = A / G;
  for (int64_t kh = 0; kh < G; ++kh)
    for (int64_t jh = 0; jh < halo; ++jh) {
      const int64_t k_at = (jh * G + kh) * D, v_at = halo * G * D + (jh * G + kh) * Dv;
      key_row_backward(q, d_o, lse, delta, halo_kv + k_at, halo_kv + v_at, kh, 0, mask.query_end(q0 - halo + jh, q0, T), T, A, group,
                       hd, halo_dkv + k_at, halo_dkv + v_at, dq_acc);
    }
}

// Backward of this rank's own keys into dk, dv (storage dtype), dQ into dq_acc; `received`
// (the halo's layout, fp32, or null): the next rank's dK, dV of this rank's last `halo` keys,
// added to those rows first. `regs` is a [d + dv] fp32 scratch.
template <class S>
void windowed_attention_backward_local(const S* q, const S* k, const S* v, const S* d_o, const float* lse, const float* delta,
                                       const float* received, int64_t halo, float* regs, float* dq_acc, S* dk, S* dv, int64_t T,
                                       int64_t A, int64_t G, HeadDims hd, const KeyWindow& mask, int64_t q0) {
  const int64_t D = hd.D, Dv = hd.Dv;
  const int64_t group = A / G;
  float* dk_row = regs;
  float* dv_row = regs + D;
  for (int64_t kh = 0; kh < G; ++kh)
    for (int64_t j = 0; j < T; ++j) {
      std::fill(dk_row, dk_row + D + Dv, 0.0f);
      const int64_t jh = j - (T - halo);  // this key's row in the next rank's halo
      if (received != nullptr && jh >= 0) {
        for (int64_t x = 0; x < D; ++x) dk_row[x] = received[(jh * G + kh) * D + x];
        for (int64_t x = 0; x < Dv; ++x) dv_row[x] = received[halo * G * D + (jh * G + kh) * Dv + x];
      }
      key_row_backward(q, d_o, lse, delta, k + (j * G + kh) * D, v + (j * G + kh) * Dv, kh, j, mask.query_end(q0 + j, q0, T), T, A, group,
                       hd, dk_row, dv_row, dq_acc);
      for (int64_t x = 0; x < D; ++x) store_f32(dk + (j * G + kh) * D + x, dk_row[x]);
      for (int64_t x = 0; x < Dv; ++x) store_f32(dv + (j * G + kh) * Dv + x, dv_row[x]);
    }
}

}  // namespace flatpeak::exec::layer_detail
