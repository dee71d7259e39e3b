// FastPeaks' term builders (internal to fast_peaks.cpp): the functions of memory_terms_*.cpp in
// numbers, one for one (same terms, same alignment per tensor), adding category sums to an Acc
// instead of named terms to a TermList.
//   Acc t = ctx.acc();  attention_forward(ctx, layer, t);  int64_t act = t.c[cat(Category::Activations)];
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "fast_peaks.h"

namespace flatpeak::planner::fast_terms {

constexpr size_t cat(Category c) { return static_cast<size_t>(c); }

// align_up for a power-of-two alignment without a division (the same result).
inline int64_t align(int64_t bytes, int64_t alignment) {
  if (alignment <= 1 || bytes <= 0 || (alignment & (alignment - 1)) != 0) return align_up(bytes, alignment);
  int64_t up = 0;
  if (__builtin_add_overflow(bytes, alignment - 1, &up)) return align_up(bytes, alignment);  // throws as it does
  return up & ~(alignment - 1);
}

// Category sums of a list of terms, as TermList::add counts them.
struct Acc {
  std::array<int64_t, kCategoryCount> c{};
  int64_t al = 1;
  explicit Acc(int64_t alignment) : al(alignment) {}
  void add(Category category, int64_t elems, int64_t dtype_bytes, int64_t count = 1) {
    if (elems <= 0 || count <= 0) return;
    const int64_t one = align(checked_mul(elems, dtype_bytes), al);
    c[cat(category)] = checked_add(c[cat(category)], checked_mul(count, one));
  }
  void append(const Acc& o) {
    for (size_t i = 0; i < c.size(); ++i) c[i] = checked_add(c[i], o.c[i]);
  }
  int64_t total() const {
    int64_t s = 0;
    for (int64_t v : c) s = checked_add(s, v);
    return s;
  }
};

inline int64_t mul(int64_t a, int64_t b) { return checked_mul(a, b); }
inline int64_t mul(int64_t a, int64_t b, int64_t c) { return checked_mul(checked_mul(a, b), c); }

inline constexpr int64_t kB16 = 2, kF32 = 4, kI64 = 8, kB1 = 1;
inline constexpr Category kAct = Category::Activations, kDsp = Category::Dispatch, kVoc = Category::Vocab;

struct Ctx {
  const ModelSpec& m;
  const ResolvedRun& r;
  const Workload& w;
  int64_t T, H, al;
  LayerSpec spec(int64_t layer) const {
    if (layer < m.num_layers) return m.layers[static_cast<size_t>(layer)];
    LayerSpec s;
    s.ffn = m.num_experts > 0 ? FfnKind::Moe : FfnKind::Dense;
    return s;
  }
  Acc acc() const { return Acc(al); }
};

void qkvo(const Ctx& c, Acc& t);

void ring_attention(const Ctx& c, int64_t layer, bool backward, Acc& t);

void layer_grad_stream(const Ctx& c, Acc& t);

void attention_forward(const Ctx& c, int64_t layer, Acc& t);

void attention_saved(const Ctx& c, Acc& t);
// The recompute's attention phase (add_attention_recompute): saved set, ring, gradient stream.
void attention_recompute(const Ctx& c, int64_t layer, Acc& t);

void attention_backward(const Ctx& c, int64_t layer, Acc& t);

void ffn_block_inputs(const Ctx& c, Acc& t);

// Dense FFN and shared experts, forward and saved alike: gate,up then act*up.
void ffn_pair(const Ctx& c, int64_t width, Acc& t);

void ffn_backward_grads(const Ctx& c, int64_t width, Acc& t);

// A gated shared expert's saved ungated output [T, H] and gate [T] (add_shared_gate_saved).
void shared_gate_saved(const Ctx& c, Acc& t);

struct MoeShape {
  int64_t T, H, E, k, F, sent, recv;
  int64_t foreign, lent;  // the rank's S_p and S_sent (0 without LLEP)
  bool regroup;           // EP > 1
  const MoeLoad* load;
};

// One shape per candidate rank of the load (workload.h, candidate_ranks).
std::vector<MoeShape> moe_shapes(const Ctx& c, const MoeLoad& load);

void received_probs(const MoeShape& s, Acc& t);

void route(const MoeShape& s, Acc& t);

void meta(const MoeShape& s, Acc& t);

void foreign(const Ctx& c, const MoeShape& s, Acc& t);

void foreign_grads(const Ctx& c, const MoeShape& s, Acc& t);

void saved_experts(const MoeShape& s, int64_t rows, Acc& t);

void expert_grads(const MoeShape& s, int64_t rows, Acc& t);

void dispatch_buffers(const Ctx& c, const MoeShape& s, Acc& t);

void combine_buffers(const MoeShape& s, Acc& t);

// The phases of one MoE block: (suffix kind, dispatch bytes); suffix kinds tell the timeline
// where the shared expert's terms go.
enum class MoePhase { Route, Dispatch, Experts, Combine, Round };

struct MoeTerms {
  MoePhase kind;
  FastPeaks::Disp disp;  // round phases: computed per cap
  Acc terms;
};

std::vector<MoeTerms> ep_phases(const Ctx& c, const MoeShape& s, bool recompute);

std::vector<MoeTerms> ep_backward(const Ctx& c, const MoeShape& s);

void round_buffers(const MoeShape& s, int64_t C, int64_t B, int64_t D, Acc& t);

// Dispatch bytes of a round phase (the whole Dispatch category of that phase).
Acc round_phase(const Ctx& c, const MoeShape& s, FastPeaks::Disp kind);

std::vector<MoeTerms> pipelined_forward(const Ctx& c, const MoeShape& s, bool recompute);

// A MoE block's phases over the candidate ranks: each phase the largest (dispatch bytes, the
// first on ties), as memory_terms_dispatch.cpp's worst_rank.
template <class Build>
std::vector<MoeTerms> worst_rank(const std::vector<MoeShape>& shapes, Build build) {
  std::vector<MoeTerms> out;
  for (const MoeShape& s : shapes) {
    std::vector<MoeTerms> mine = build(s);
    if (out.empty()) {
      out = std::move(mine);
      continue;
    }
    for (size_t i = 0; i < out.size() && i < mine.size(); ++i)
      if (mine[i].terms.c[cat(Category::Dispatch)] > out[i].terms.c[cat(Category::Dispatch)]) out[i] = std::move(mine[i]);
  }
  return out;
}

bool pipelined(const Ctx& c);

struct VocabShape {
  int64_t T, H, V, R, shard, Tb, Vb;
  int64_t w_params;  // R = 1: the buffer W is read from (loss_weight_params)
};

VocabShape vocab_shape_of(int64_t T, int64_t H, int64_t V, int64_t R, int64_t token_block, int64_t vocab_block,
                          int64_t w_params);

void x_w(const VocabShape& s, Acc& t);

void ring(RingRotate rotate, const VocabShape& s, bool grads, Acc& t);

void lse_loss(const VocabShape& s, Acc& t);

void dx(const VocabShape& s, Acc& t);

void dw(RingRotate rotate, const VocabShape& s, Acc& t);

VocabShape vocab_shape(const Ctx& c);

void loss_saved(const Ctx& c, Acc& t);

}  // namespace flatpeak::planner::fast_terms
