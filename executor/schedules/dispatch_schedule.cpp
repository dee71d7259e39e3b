// The dispatch component run (dispatch_schedule.h), on one rank or on EP ranks. One design with
// planner/README.md ("Dispatch"): probabilities are applied to the activation (act*prob), so the
// combine is an unweighted sum and its backward needs no expert outputs; the router's weight
// gradient comes from the experts' backward (d prob = Σ_f d(act*prob)·act).
//
// Layouts. A source sends its copies in send order: destination-major, experts ascending within
// a destination, each expert's copies in token order (LLEP: the source's range for that
// destination). A destination receives source-major blocks and computes in expert order: its
// local experts (native, then borrowed ones by id), each expert's rows by source, then token
// order. At one rank both orders are the expert order, so the receive buffer becomes the expert
// input and the experts read the rank's own permuted probs. At EP > 1 the received rows are
// regrouped into the expert input (a copy of the receive buffer, Megatron's sort by local
// expert), and the received probs stay beside them until the backward has used them, because the
// probs belong to other ranks' tokens; d prob goes back to its source by the reversed all-to-all.
// Buffers the backward no longer needs hold its small gradients in place: d prob goes into the
// router scores [T, E] (scattered at the chosen experts) and the router's d logits into the router
// logits [T, E]; both are dead once the routing has been recomputed.
#include "executor/schedules/dispatch_schedule.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <utility>

#include "executor/cpu/gemm_cpu.h"
#include "executor/memory/tensor.h"
#include "executor/ops/dtype.h"
#include "executor/ops/expert_ffn.h"
#include "executor/schedules/schedule_util.h"
#include "spec/errors.h"

namespace flatpeak::exec {

namespace {

constexpr Category kDsp = Category::Dispatch;
size_t z(int64_t i) { return static_cast<size_t>(i); }

struct Dims {
  int64_t T, H, E, k, F, N;  // N = T·k token copies a rank sends
  int64_t ep, me, L;         // EP ranks, this rank, native experts per rank (E/EP)
  int64_t P;                 // elements of one expert's weights: [2F, H] gate/up then [H, F] down
};

Dims dims_of(const DispatchScheduleConfig& c, int64_t ep, int64_t me) {
  return Dims{c.tokens, c.hidden, c.experts, c.top_k, c.ffn, c.tokens * c.top_k, ep, me, c.experts / ep, 3 * c.hidden * c.ffn};
}

// At one rank the all-to-alls are copies: a communicator of one.
class SelfComm final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  const char* backend_name() const override { return "self"; }
  void all_to_allv(const void* send, const int64_t* send_counts, const int64_t* send_displs, void* recv,
                   const int64_t* recv_counts, const int64_t* recv_displs, DType dtype) override {
    if (send_counts[0] != recv_counts[0]) throw CommError(0, "all_to_allv", "send and receive counts differ");
    copy(static_cast<const char*>(send) + send_displs[0] * dtype_bytes(dtype),
         static_cast<char*>(recv) + recv_displs[0] * dtype_bytes(dtype), send_counts[0], dtype);
  }
  void sendrecv_shift(const void* send, void* recv, int64_t count, DType dtype, int) override { copy(send, recv, count, dtype); }
  void all_gather(const void* send, void* recv, int64_t count, DType dtype) override { copy(send, recv, count, dtype); }
  void reduce_scatter(const void* send, void* recv, int64_t count, DType dtype) override { copy(send, recv, count, dtype); }
  void all_reduce(const void* send, void* recv, int64_t count, DType dtype, ReduceOp) override {
    if (send != recv) copy(send, recv, count, dtype);
  }
  void barrier() override {}
  std::unique_ptr<Communicator> split(int, int) override { return std::make_unique<SelfComm>(); }
  void check_status(int exit_code, const std::string& message) override {
    if (exit_code != 0) throw RankFailed(0, exit_code, message);
  }
  void abort(int exit_code, const std::string& message) override { throw RankFailed(0, exit_code, message); }

 private:
  static void copy(const void* send, void* recv, int64_t count, DType dtype) {
    if (count > 0) std::memcpy(recv, send, z(count * dtype_bytes(dtype)));
  }
};

// What lives through the whole layer and is not the dispatch's own: the layer input and the
// upstream gradient (activations), the gathered weights of the rank's native experts and the
// router, and their fp32 gradient accumulators (fsdp).
struct LayerData {
  Tensor x, d_out, w_router, w_gate_up, w_down, dw_router, dw_gate_up, dw_down;
  LayerData(TrackingAllocator& alloc, const Dims& d)
      : x(alloc, DType::BF16, {d.T, d.H}, Category::Activations),               // [T, H] bf16
        d_out(alloc, DType::BF16, {d.T, d.H}, Category::Activations),           // [T, H] bf16
        w_router(alloc, DType::BF16, {d.E, d.H}, Category::Fsdp),               // [E, H] bf16
        w_gate_up(alloc, DType::BF16, {d.L, 2 * d.F, d.H}, Category::Fsdp),     // [E/EP, 2F, H] bf16
        w_down(alloc, DType::BF16, {d.L, d.H, d.F}, Category::Fsdp),            // [E/EP, H, F] bf16
        dw_router(alloc, DType::F32, {d.E, d.H}, Category::Fsdp),               // [E, H] fp32 +=
        dw_gate_up(alloc, DType::F32, {d.L, 2 * d.F, d.H}, Category::Fsdp),     // [E/EP, 2F, H] fp32 +=
        dw_down(alloc, DType::F32, {d.L, d.H, d.F}, Category::Fsdp) {}          // [E/EP, H, F] fp32 +=
};

// Seeds of the inputs (one stream each).
uint64_t seed_of(const DispatchScheduleConfig& c, uint64_t stream) { return c.seed * 8 + stream; }

// This rank's slices of the single-rank run's inputs over EP·T tokens and E experts.
void fill_inputs(const DispatchScheduleConfig& c, const Dims& d, Bf16* x, Bf16* d_out, Bf16* w_router, Bf16* w_gate_up,
                 Bf16* w_down) {
  const int64_t global = c.replica * d.ep + d.me;  // this rank's tokens among every group's
  fill_bf16(x, d.T * d.H, seed_of(c, 1), 1.0f, global * d.T * d.H);
  fill_bf16(d_out, d.T * d.H, seed_of(c, 2), 1.0f, global * d.T * d.H);
  fill_bf16(w_router, d.E * d.H, seed_of(c, 3), 1.0f / std::sqrt(static_cast<float>(d.H)));
  fill_bf16(w_gate_up, d.L * 2 * d.F * d.H, seed_of(c, 4), 2.0f / std::sqrt(static_cast<float>(d.H)), d.me * d.L * 2 * d.F * d.H);
  fill_bf16(w_down, d.L * d.H * d.F, seed_of(c, 5), 2.0f / std::sqrt(static_cast<float>(d.F)), d.me * d.L * d.H * d.F);
}

// The routing of one pass: router logits, softmax scores, scattered probs, routing map, the
// renormalised top-k weights over the drawn ids (softmax over the kept logits), and the ids.
struct Routing {
  Tensor logits, scores, scattered, map, topk_w, topk_ids;
  Routing(TrackingAllocator& alloc, const Dims& d)
      : logits(alloc, DType::F32, {d.T, d.E}, kDsp),     // [T, E] fp32
        scores(alloc, DType::F32, {d.T, d.E}, kDsp),     // [T, E] fp32
        scattered(alloc, DType::F32, {d.T, d.E}, kDsp),  // [T, E] fp32
        // [T, E] bool, 1 B each: held as ceil(T·E/2) two-byte cells (there is no 1-byte dtype)
        map(alloc, DType::BF16, {(d.T * d.E + 1) / 2}, kDsp),
        topk_w(alloc, DType::F32, {d.T, d.k}, kDsp),     // [T, k] fp32
        topk_ids(alloc, DType::I64, {d.T, d.k}, kDsp) {}  // [T, k] int64
};

void compute_routing(const Dims& d, const LayerData& L, const std::vector<int32_t>& ids, Routing& r) {
  float* logits = r.logits.data<float>();
  gemm_cpu(false, true, d.T, d.E, d.H, 1.0f, L.x.data<Bf16>(), d.H, L.w_router.data<Bf16>(), d.H, false, logits, d.E);
  float* scores = r.scores.data<float>();
  float* scattered = r.scattered.data<float>();
  auto* map = static_cast<uint8_t*>(r.map.raw());
  std::memset(map, 0, z(d.T * d.E));
  float* w = r.topk_w.data<float>();
  int64_t* id = r.topk_ids.data<int64_t>();
  for (int64_t t = 0; t < d.T; ++t) {
    const float* zt = logits + t * d.E;
    float max = zt[0];
    for (int64_t e = 1; e < d.E; ++e) max = std::max(max, zt[e]);
    float sum = 0.0f;
    for (int64_t e = 0; e < d.E; ++e) sum += (scores[t * d.E + e] = std::exp(zt[e] - max));
    for (int64_t e = 0; e < d.E; ++e) scores[t * d.E + e] /= sum;
    float kept = 0.0f;
    for (int64_t s = 0; s < d.k; ++s) kept += scores[t * d.E + ids[z(t * d.k + s)]];
    std::fill(scattered + t * d.E, scattered + (t + 1) * d.E, 0.0f);
    for (int64_t s = 0; s < d.k; ++s) {
      const int64_t e = ids[z(t * d.k + s)];
      id[t * d.k + s] = e;
      w[t * d.k + s] = scores[t * d.E + e] / kept;
      scattered[t * d.E + e] = w[t * d.k + s];
      map[t * d.E + e] = 1;
    }
  }
}

// ---- where every copy goes: identical on every rank (made from the all-gathered counts)

struct RowPlan {
  struct Seg {
    int64_t start, rows, dest, pos;  // this source's copies [start, start+rows) of an expert → dest, at send position pos
  };
  int64_t ep = 1, me = 0, E = 0, L = 0;
  CountMatrix copies;                          // [EP][E] copies per source and expert
  std::vector<int64_t> c;                      // [EP][E][EP] rows of source s's copies of e computed on d
  bool lla_ran = false;
  CountMatrix send_rows;                       // [EP][EP] source × destination
  std::vector<int64_t> rank_rows;              // [EP] rows each rank computes
  std::vector<int64_t> foreign;                // experts this rank borrows, ascending
  std::vector<int64_t> local_of;               // [E] local index: native e − me·L, borrowed L + i; −1
  std::vector<std::vector<int64_t>> helpers;   // [E] ranks other than the native one computing rows of e
  std::vector<std::vector<int64_t>> lent_slot; // [E] native here: slot of (e, helpers[e][i]) in the lent grads
  int64_t lent = 0;                            // S_sent
  std::vector<std::vector<Seg>> segs;          // this rank as source: [E], in row order
  std::vector<int64_t> dest_begin;             // [EP + 1] send-order offset of each destination
  std::vector<int64_t> recv_begin;             // [EP + 1] receive offset of each source (uncapped)

  int64_t rows(int64_t s, int64_t e, int64_t d) const { return c[z((s * E + e) * ep + d)]; }
  int64_t locals() const { return L + static_cast<int64_t>(foreign.size()); }
  int64_t received() const { return rank_rows[z(me)]; }
  // Send position of this source's i-th copy (token order) of expert e.
  int64_t position(int64_t e, int64_t i) const {
    for (const Seg& s : segs[z(e)])
      if (i >= s.start && i < s.start + s.rows) return s.pos + i - s.start;
    throw std::logic_error("dispatch schedule: a copy outside its expert's ranges");
  }
  int64_t destination(int64_t e, int64_t i) const {
    for (const Seg& s : segs[z(e)])
      if (i >= s.start && i < s.start + s.rows) return s.dest;
    throw std::logic_error("dispatch schedule: a copy outside its expert's ranges");
  }
};

RowPlan make_row_plan(const Dims& d, CountMatrix copies, bool llep, const LlaKnobs& knobs) {
  RowPlan p;
  p.ep = d.ep;
  p.me = d.me;
  p.E = d.E;
  p.L = d.L;
  p.copies = std::move(copies);
  p.c.assign(z(d.ep * d.E * d.ep), 0);
  p.segs.assign(z(d.E), {});
  LlaResult lla;
  if (llep && d.ep > 1) {
    lla = least_loaded_assignment(expert_loads(p.copies), d.ep, knobs);
    p.lla_ran = lla.triggered;
  }
  for (int64_t s = 0; s < d.ep; ++s) {
    std::vector<std::vector<LlaRange>> ranges;
    if (p.lla_ran) ranges = lla_source_ranges(lla, p.copies, s);
    for (int64_t e = 0; e < d.E; ++e) {
      std::vector<LlaRange> rs;
      if (p.lla_ran) rs = ranges[z(e)];
      else if (p.copies[z(s)][z(e)] > 0) rs.push_back(LlaRange{e / d.L, 0, p.copies[z(s)][z(e)]});
      std::sort(rs.begin(), rs.end(), [](const LlaRange& a, const LlaRange& b) { return a.start_row < b.start_row; });
      for (const LlaRange& r : rs) {
        if (r.rows <= 0) continue;
        p.c[z((s * d.E + e) * d.ep + r.rank)] += r.rows;
        if (s == d.me) p.segs[z(e)].push_back(RowPlan::Seg{r.start_row, r.rows, r.rank, 0});
      }
    }
  }
  p.send_rows.assign(z(d.ep), std::vector<int64_t>(z(d.ep), 0));
  p.rank_rows.assign(z(d.ep), 0);
  for (int64_t s = 0; s < d.ep; ++s)
    for (int64_t e = 0; e < d.E; ++e)
      for (int64_t t = 0; t < d.ep; ++t) {
        p.send_rows[z(s)][z(t)] += p.rows(s, e, t);
        p.rank_rows[z(t)] += p.rows(s, e, t);
      }
  // Send order: destination-major, experts ascending, each expert's segments in row order.
  p.dest_begin.assign(z(d.ep + 1), 0);
  int64_t pos = 0;
  for (int64_t t = 0; t < d.ep; ++t) {
    p.dest_begin[z(t)] = pos;
    for (int64_t e = 0; e < d.E; ++e)
      for (RowPlan::Seg& s : p.segs[z(e)])
        if (s.dest == t) {
          s.pos = pos;
          pos += s.rows;
        }
  }
  p.dest_begin[z(d.ep)] = pos;
  p.recv_begin.assign(z(d.ep + 1), 0);
  for (int64_t s = 0; s < d.ep; ++s) p.recv_begin[z(s + 1)] = p.recv_begin[z(s)] + p.send_rows[z(s)][z(d.me)];
  // This rank as a destination: native experts, then borrowed ones by id.
  p.local_of.assign(z(d.E), -1);
  for (int64_t l = 0; l < d.L; ++l) p.local_of[z(d.me * d.L + l)] = l;
  for (int64_t e = 0; e < d.E; ++e) {
    if (e / d.L == d.me) continue;
    int64_t rows = 0;
    for (int64_t s = 0; s < d.ep; ++s) rows += p.rows(s, e, d.me);
    if (rows > 0) {
      p.local_of[z(e)] = d.L + static_cast<int64_t>(p.foreign.size());
      p.foreign.push_back(e);
    }
  }
  // Lending: helper ranks of every expert, and this rank's slots for the gradients it gets back.
  p.helpers.assign(z(d.E), {});
  p.lent_slot.assign(z(d.E), {});
  for (int64_t e = 0; e < d.E; ++e) {
    for (int64_t t = 0; t < d.ep; ++t) {
      if (t == e / d.L) continue;
      int64_t rows = 0;
      for (int64_t s = 0; s < d.ep; ++s) rows += p.rows(s, e, t);
      if (rows > 0) p.helpers[z(e)].push_back(t);
    }
    if (e / d.L == d.me)
      for (size_t i = 0; i < p.helpers[z(e)].size(); ++i) p.lent_slot[z(e)].push_back(p.lent++);
  }
  return p;
}

// Fills the send order of this rank's copies: sort[pos] = slot; unsort[slot] = pos and
// dest[slot] = destination when given. At one rank: the stable sort of the copies by expert.
void fill_send_order(const RowPlan& p, const Dims& d, const int64_t* ids, int64_t* sort, int64_t* unsort, int64_t* dest) {
  std::vector<int64_t> seen(z(d.E), 0);  // O(E) bookkeeping
  for (int64_t slot = 0; slot < d.N; ++slot) {
    const int64_t e = ids[slot];
    const int64_t i = seen[z(e)]++;
    const int64_t pos = p.position(e, i);
    sort[pos] = slot;
    if (unsort) unsort[slot] = pos;
    if (dest) dest[slot] = p.destination(e, i);
  }
}

// Calls fn(t, pos, n): for every token in order, the send positions of its k copies in
// increasing expert order (n = k).
template <class Fn>
void for_each_token(const RowPlan& p, const Dims& d, const int64_t* ids, Fn fn) {
  std::vector<int64_t> seen(z(d.E), 0), order(z(d.k)), pos(z(d.k));  // O(E + k) bookkeeping
  for (int64_t t = 0; t < d.T; ++t) {
    for (int64_t s = 0; s < d.k; ++s) order[z(s)] = s;
    std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return ids[t * d.k + a] < ids[t * d.k + b]; });
    for (int64_t s = 0; s < d.k; ++s) {
      const int64_t e = ids[t * d.k + s];
      pos[z(s)] = p.position(e, seen[z(e)]++);
    }
    for (int64_t s = 0; s < d.k; ++s) order[z(s)] = pos[z(order[z(s)])];
    fn(t, order.data(), d.k);
  }
}

// Rows a destination received (source-major), grouped in expert order: chunk = rows of one
// (source, expert), contiguous in both layouts; begin[l] = first expert-order row of local l.
struct Grouping {
  struct Chunk {
    int64_t local, source, exp_row, recv_row, rows;
  };
  std::vector<Chunk> chunks;    // sorted by exp_row
  std::vector<int64_t> begin;   // [locals + 1]
  int64_t rows = 0;
};

// Source s sent rows [first[s], first[s] + count[s]) of its list for this rank (experts
// ascending, plan rows each), placed source-major in the receive buffer.
Grouping make_grouping(const RowPlan& p, const std::vector<int64_t>& first, const std::vector<int64_t>& count) {
  Grouping g;
  int64_t base = 0;
  for (int64_t s = 0; s < p.ep; ++s) {
    const int64_t a = first[z(s)], b = a + count[z(s)];
    int64_t off = 0;
    for (int64_t e = 0; e < p.E && off < b; ++e) {
      const int64_t n = p.rows(s, e, p.me);
      const int64_t lo = std::max(a, off), hi = std::min(b, off + n);
      if (hi > lo) g.chunks.push_back(Grouping::Chunk{p.local_of[z(e)], s, 0, base + lo - a, hi - lo});
      off += n;
    }
    base += count[z(s)];
  }
  std::sort(g.chunks.begin(), g.chunks.end(), [](const Grouping::Chunk& x, const Grouping::Chunk& y) {
    return x.local != y.local ? x.local < y.local : x.source < y.source;
  });
  g.begin.assign(z(p.locals() + 1), 0);
  for (Grouping::Chunk& ch : g.chunks) {
    ch.exp_row = g.rows;
    g.rows += ch.rows;
    g.begin[z(ch.local + 1)] += ch.rows;
  }
  for (int64_t l = 0; l < p.locals(); ++l) g.begin[z(l + 1)] += g.begin[z(l)];
  if (g.rows != base) throw std::logic_error("dispatch schedule: received rows of an expert no rank computes");
  return g;
}

// Source-major rows (width W) into expert order, and back.
template <class V>
void regroup(const Grouping& g, const V* src, V* dst, int64_t W) {
  for (const auto& ch : g.chunks) std::memcpy(dst + ch.exp_row * W, src + ch.recv_row * W, z(ch.rows * W) * sizeof(V));
}
template <class V>
void ungroup(const Grouping& g, const V* src, V* dst, int64_t W) {
  for (const auto& ch : g.chunks) std::memcpy(dst + ch.recv_row * W, src + ch.exp_row * W, z(ch.rows * W) * sizeof(V));
}

void copy_rows(const Bf16* src, Bf16* dst, int64_t rows, int64_t H) {
  if (rows > 0) std::memcpy(dst, src, z(rows * H) * sizeof(Bf16));
}

// ---- the experts a destination computes

// Weights and fp32 gradient accumulators of local expert l: native ones are the layer's,
// borrowed ones a slot of the foreign buffers. A borrowed expert's gradient is an accumulator
// like the native one it is added into (across rounds, then into the native rank's): fp32, so
// where LLA places an expert's rows does not change its gradient beyond fp32 re-association.
struct ExpertSlot {
  const Bf16 *gu, *down;
  float *dgu, *ddown;  // null: no gradient in this pass
};

std::vector<ExpertSlot> expert_slots(const Dims& d, const RowPlan& p, LayerData& L, const Tensor* foreign_w, Tensor* foreign_dw) {
  std::vector<ExpertSlot> out;
  for (int64_t l = 0; l < p.locals(); ++l) {
    ExpertSlot s{};
    if (l < d.L) {
      s.gu = L.w_gate_up.data<Bf16>() + l * 2 * d.F * d.H;
      s.down = L.w_down.data<Bf16>() + l * d.H * d.F;
      s.dgu = L.dw_gate_up.data<float>() + l * 2 * d.F * d.H;
      s.ddown = L.dw_down.data<float>() + l * d.H * d.F;
    } else {
      const int64_t off = (l - d.L) * d.P;
      s.gu = foreign_w->data<Bf16>() + off;
      s.down = s.gu + 2 * d.F * d.H;
      if (foreign_dw && !foreign_dw->empty()) {
        s.dgu = foreign_dw->data<float>() + off;
        s.ddown = s.dgu + 2 * d.F * d.H;
      }
    }
    out.push_back(s);
  }
  return out;
}

// prob of expert-order row i: from the receive-order probs (by_recv) or indexed by i.
struct Probs {
  float* p;
  bool by_recv;
};

// Calls fn(i, j) for every expert-order row i with j its prob index.
template <class Fn>
void for_each_row(const Grouping& g, const Probs& pr, Fn fn) {
  for (const auto& ch : g.chunks)
    for (int64_t r = 0; r < ch.rows; ++r) fn(ch.exp_row + r, pr.by_recv ? ch.recv_row + r : ch.exp_row + r);
}

// Expert forward over the grouped rows: fc1 = in·W_guᵀ, act*prob = silu(gate)·up·prob, and
// (when fc2 is given) fc2 = (act*prob)·W_downᵀ.
void experts_forward(const Dims& d, const std::vector<ExpertSlot>& w, const Grouping& g, const Probs& pr, const Bf16* in,
                     Bf16* fc1, Bf16* act, Bf16* fc2) {
  for (size_t l = 0; l + 1 < g.begin.size(); ++l) {
    const int64_t i0 = g.begin[l], m = g.begin[l + 1] - i0;
    if (m > 0) gemm_cpu(false, true, m, 2 * d.F, d.H, 1.0f, in + i0 * d.H, d.H, w[l].gu, d.H, false, fc1 + i0 * 2 * d.F, 2 * d.F);
  }
  for_each_row(g, pr, [&](int64_t i, int64_t j) {
    for (int64_t f = 0; f < d.F; ++f) {
      const float gt = to_f32(fc1[i * 2 * d.F + f]), u = to_f32(fc1[i * 2 * d.F + d.F + f]);
      act[i * d.F + f] = f32_to_bf16(silu_f32(gt) * u * pr.p[j]);
    }
  });
  if (!fc2) return;
  for (size_t l = 0; l + 1 < g.begin.size(); ++l) {
    const int64_t i0 = g.begin[l], m = g.begin[l + 1] - i0;
    if (m > 0) gemm_cpu(false, true, m, d.H, d.F, 1.0f, act + i0 * d.F, d.F, w[l].down, d.F, false, fc2 + i0 * d.H, d.H);
  }
}

// Expert backward, first half: d act = d fc2·W_down, dW_down += d fc2ᵀ·act, d fc1 from d act, and
// d prob per row, written over its prob (each row reads its prob first).
void experts_backward_fc(const Dims& d, const std::vector<ExpertSlot>& w, const Grouping& g, const Probs& pr, const Bf16* fc1,
                         const Bf16* act, const Bf16* d_fc2, Bf16* d_act, Bf16* d_fc1) {
  for (size_t l = 0; l + 1 < g.begin.size(); ++l) {
    const int64_t i0 = g.begin[l], m = g.begin[l + 1] - i0;
    if (m == 0) continue;
    gemm_cpu(false, false, m, d.F, d.H, 1.0f, d_fc2 + i0 * d.H, d.H, w[l].down, d.F, false, d_act + i0 * d.F, d.F);
    gemm_cpu(true, false, d.H, d.F, m, 1.0f, d_fc2 + i0 * d.H, d.H, act + i0 * d.F, d.F, true, w[l].ddown, d.F);
  }
  for_each_row(g, pr, [&](int64_t i, int64_t j) {
    float dp = 0.0f;
    for (int64_t f = 0; f < d.F; ++f) {
      const float gt = to_f32(fc1[i * 2 * d.F + f]), u = to_f32(fc1[i * 2 * d.F + d.F + f]);
      const float dh = to_f32(d_act[i * d.F + f]);
      dp += dh * silu_f32(gt) * u;
      const float da = dh * pr.p[j];
      d_fc1[i * 2 * d.F + f] = f32_to_bf16(da * u * silu_grad_f32(gt));
      d_fc1[i * 2 * d.F + d.F + f] = f32_to_bf16(da * silu_f32(gt));
    }
    pr.p[j] = dp;
  });
}

// Expert backward, second half: dW_gate_up += d fc1ᵀ·in and d in = d fc1·W_gate_up.
void experts_backward_in(const Dims& d, const std::vector<ExpertSlot>& w, const Grouping& g, const Bf16* in, const Bf16* d_fc1,
                         Bf16* d_in) {
  for (size_t l = 0; l + 1 < g.begin.size(); ++l) {
    const int64_t i0 = g.begin[l], m = g.begin[l + 1] - i0;
    if (m == 0) continue;
    gemm_cpu(true, false, 2 * d.F, d.H, m, 1.0f, d_fc1 + i0 * 2 * d.F, 2 * d.F, in + i0 * d.H, d.H, true, w[l].dgu, d.H);
    gemm_cpu(false, false, m, d.H, 2 * d.F, 1.0f, d_fc1 + i0 * 2 * d.F, 2 * d.F, w[l].gu, d.H, false, d_in + i0 * d.H, d.H);
  }
}

// fc2 of the grouped rows (the forward's second GEMM on its own).
void experts_fc2(const Dims& d, const std::vector<ExpertSlot>& w, const Grouping& g, const Bf16* act, Bf16* fc2) {
  for (size_t l = 0; l + 1 < g.begin.size(); ++l) {
    const int64_t i0 = g.begin[l], m = g.begin[l + 1] - i0;
    if (m > 0) gemm_cpu(false, true, m, d.H, d.F, 1.0f, act + i0 * d.F, d.F, w[l].down, d.F, false, fc2 + i0 * d.H, d.H);
  }
}

// The router's backward once every d prob is in r.scores ([t, e] at the chosen experts): the kept
// weights are a softmax over the kept logits, so dz_e = w_e·(dw_e − Σ_j w_j dw_j) for kept e,
// 0 elsewhere (into r.logits); then d_x += dz·W_router and dW_router += dzᵀ·x.
void router_backward(const Dims& d, LayerData& L, Routing& r, float* d_x) {
  float* dz = r.logits.data<float>();
  const float* dw = r.scores.data<float>();
  const float* w = r.topk_w.data<float>();
  const int64_t* ids = r.topk_ids.data<int64_t>();
  std::vector<float> row(z(d.E));
  for (int64_t t = 0; t < d.T; ++t) {
    float dot = 0.0f;
    for (int64_t s = 0; s < d.k; ++s) dot += w[t * d.k + s] * dw[t * d.E + ids[t * d.k + s]];
    std::fill(row.begin(), row.end(), 0.0f);
    for (int64_t s = 0; s < d.k; ++s) {
      const int64_t e = ids[t * d.k + s];
      row[z(e)] = w[t * d.k + s] * (dw[t * d.E + e] - dot);
    }
    std::copy(row.begin(), row.end(), dz + t * d.E);
  }
  gemm_cpu(false, false, d.T, d.H, d.E, 1.0f, dz, d.E, L.w_router.data<Bf16>(), d.H, true, d_x, d.H);
  gemm_cpu(true, false, d.E, d.H, d.T, 1.0f, dz, d.E, L.x.data<Bf16>(), d.H, true, L.dw_router.data<float>(), d.H);
}

// ---- exchanges

// One all-to-allv of rows of width W: this rank sends out[d] rows to d from send (at
// out_begin[d]) and receives in[s] rows from s into recv (at in_begin[s]).
void exchange(Communicator& comm, const void* send, const std::vector<int64_t>& out, const std::vector<int64_t>& out_begin,
              void* recv, const std::vector<int64_t>& in, const std::vector<int64_t>& in_begin, int64_t W, DType dtype) {
  const size_t n = out.size();
  std::vector<int64_t> sc(n), sd(n), rc(n), rd(n);
  for (size_t p = 0; p < n; ++p) {
    sc[p] = out[p] * W;
    sd[p] = out_begin[p] * W;
    rc[p] = in[p] * W;
    rd[p] = in_begin[p] * W;
  }
  static const int64_t dummy = 0;  // a valid address for a side with nothing to move
  comm.all_to_allv(send ? send : &dummy, sc.data(), sd.data(), recv ? recv : const_cast<int64_t*>(&dummy), rc.data(), rd.data(),
                   dtype);
}

// Per-destination counts and offsets of a matrix row / column.
std::vector<int64_t> row_of(const CountMatrix& m, int64_t s) { return m[z(s)]; }
std::vector<int64_t> column_of(const CountMatrix& m, int64_t d) {
  std::vector<int64_t> out;
  for (const auto& row : m) out.push_back(row[z(d)]);
  return out;
}
std::vector<int64_t> offsets_of(const std::vector<int64_t>& counts) {
  std::vector<int64_t> out(counts.size() + 1, 0);
  for (size_t i = 0; i < counts.size(); ++i) out[i + 1] = out[i] + counts[i];
  return out;
}

// LLEP: every expert with helpers goes from its native rank to them, gate/up then down, into
// the helpers' foreign slots [S, P] (two collectives per lent expert, in expert order).
void lend_weights(Communicator& comm, const Dims& d, const RowPlan& p, const LayerData& L, Tensor& foreign) {
  const std::vector<int64_t> none(z(d.ep), 0);
  for (int64_t e = 0; e < d.E; ++e) {
    if (p.helpers[z(e)].empty()) continue;
    const int64_t native = e / d.L;
    for (int part = 0; part < 2; ++part) {
      const int64_t count = part == 0 ? 2 * d.F * d.H : d.H * d.F;
      std::vector<int64_t> sc = none, sd = none, rc = none, rd = none;
      if (d.me == native)
        for (int64_t h : p.helpers[z(e)]) {
          sc[z(h)] = count;
          sd[z(h)] = (e - native * d.L) * count;
        }
      if (p.local_of[z(e)] >= d.L) {
        rc[z(native)] = count;
        rd[z(native)] = (p.local_of[z(e)] - d.L) * d.P + (part == 0 ? 0 : 2 * d.F * d.H);
      }
      const Bf16* src = part == 0 ? L.w_gate_up.data<Bf16>() : L.w_down.data<Bf16>();
      exchange(comm, src, sc, sd, foreign.empty() ? nullptr : foreign.raw(), rc, rd, 1, DType::BF16);
    }
  }
}

// LLEP: the helpers' fp32 gradients of every lent expert back to its native rank ([S_sent, P]
// slots), which adds them to its fp32 accumulators in helper-rank order.
void return_weight_grads(Communicator& comm, const Dims& d, const RowPlan& p, LayerData& L, const Tensor& foreign_dw, Tensor& lent_dw) {
  const std::vector<int64_t> none(z(d.ep), 0);
  for (int64_t e = 0; e < d.E; ++e) {
    if (p.helpers[z(e)].empty()) continue;
    const int64_t native = e / d.L;
    std::vector<int64_t> sc = none, sd = none, rc = none, rd = none;
    if (p.local_of[z(e)] >= d.L) {
      sc[z(native)] = 1;
      sd[z(native)] = p.local_of[z(e)] - d.L;
    }
    if (d.me == native)
      for (size_t i = 0; i < p.helpers[z(e)].size(); ++i) {
        rc[z(p.helpers[z(e)][i])] = 1;
        rd[z(p.helpers[z(e)][i])] = p.lent_slot[z(e)][i];
      }
    exchange(comm, foreign_dw.empty() ? nullptr : foreign_dw.raw(), sc, sd, lent_dw.empty() ? nullptr : lent_dw.raw(), rc, rd, d.P,
             DType::F32);
  }
  for (int64_t e = d.me * d.L; e < (d.me + 1) * d.L; ++e)
    for (int64_t slot : p.lent_slot[z(e)]) {
      const float* g = lent_dw.data<float>() + slot * d.P;
      float* gu = L.dw_gate_up.data<float>() + (e - d.me * d.L) * 2 * d.F * d.H;
      float* dn = L.dw_down.data<float>() + (e - d.me * d.L) * d.H * d.F;
      for (int64_t i = 0; i < 2 * d.F * d.H; ++i) gu[i] += g[i];
      for (int64_t i = 0; i < d.H * d.F; ++i) dn[i] += g[2 * d.F * d.H + i];
    }
}

// LLEP, capped: the helpers' fp32 gradients of every lent expert back to its native rank one
// (expert, helper) pair at a time through one [1, P] staging slot, added in helper-rank order
// (the same sums in the same order as the [S_sent, P] way, in a buffer that does not depend on
// the routing).
void return_weight_grads_staged(Communicator& comm, const Dims& d, const RowPlan& p, LayerData& L, const Tensor& foreign_dw,
                                Tensor& staging) {
  const std::vector<int64_t> none(z(d.ep), 0);
  for (int64_t e = 0; e < d.E; ++e) {
    const int64_t native = e / d.L;
    for (int64_t h : p.helpers[z(e)]) {
      std::vector<int64_t> sc = none, sd = none, rc = none, rd = none;
      if (d.me == h) {
        sc[z(native)] = 1;
        sd[z(native)] = p.local_of[z(e)] - d.L;
      }
      if (d.me == native) rc[z(h)] = 1;
      exchange(comm, d.me == h ? foreign_dw.raw() : nullptr, sc, sd, d.me == native ? staging.raw() : nullptr, rc, rd, d.P,
               DType::F32);
      if (d.me != native) continue;
      const float* g = staging.data<float>();
      float* gu = L.dw_gate_up.data<float>() + (e - d.me * d.L) * 2 * d.F * d.H;
      float* dn = L.dw_down.data<float>() + (e - d.me * d.L) * d.H * d.F;
      for (int64_t i = 0; i < 2 * d.F * d.H; ++i) gu[i] += g[i];
      for (int64_t i = 0; i < d.H * d.F; ++i) dn[i] += g[2 * d.F * d.H + i];
    }
  }
}

// The borrowed weights of one pass: [S, P] bf16 with S = `slots` (the realised S_p uncapped, the
// launch-time pool S_cap ≥ S_p capped; empty without LLEP or helpers).
Tensor borrow_weights(Communicator& comm, TrackingAllocator& alloc, const Dims& d, const RowPlan& p, const LayerData& L,
                      int64_t slots) {
  if (static_cast<int64_t>(p.foreign.size()) > slots) throw std::logic_error("dispatch schedule: more borrowed experts than weight slots");
  Tensor w(alloc, DType::BF16, {slots, d.P}, kDsp);  // [S, P] bf16
  if (p.lla_ran) lend_weights(comm, d, p, L, w);
  return w;
}

// ---- one uncapped dispatch (standard EP buffers; LLEP adds its repeated tokens and weights)

struct Meta {
  Tensor sort, pprobs;
  Meta(TrackingAllocator& alloc, const Dims& d, const RowPlan& p, const Routing& r)
      : sort(alloc, DType::I64, {d.N}, kDsp),     // [T·k] int64 send position → slot
        pprobs(alloc, DType::F32, {d.N}, kDsp) {  // [T·k] fp32 permuted probs (send order)
    fill_send_order(p, d, r.topk_ids.data<int64_t>(), sort.data<int64_t>(), nullptr, nullptr);
    for (int64_t i = 0; i < d.N; ++i) pprobs.data<float>()[i] = r.topk_w.data<float>()[sort.data<int64_t>()[i]];
  }
};

// What a dispatch leaves for the experts: their input in expert order and, at EP > 1, the probs
// as received (source-major; at one rank the experts read the permuted probs).
struct Dispatched {
  Tensor in, recv_probs;
};

// Dispatch: the send buffer gathers the rows in send order (LLEP: from the reference's repeated
// tokens [T·k, H]), the all-to-all moves them and their probs into the receive buffers, the send
// side is freed, and (EP > 1) the received rows are regrouped into the expert input.
Dispatched uncapped_dispatch(Communicator& comm, TrackingAllocator& alloc, const Dims& d, const LayerData& L, const RowPlan& p,
                             const Grouping& g, const Meta& m, bool repeated_tokens) {
  const int64_t R = p.received();
  Tensor repeated;
  if (repeated_tokens) {
    repeated = Tensor(alloc, DType::BF16, {d.N, d.H}, kDsp);  // [T·k, H] bf16, slot order
    for (int64_t i = 0; i < d.N; ++i) copy_rows(L.x.data<Bf16>() + (i / d.k) * d.H, repeated.data<Bf16>() + i * d.H, 1, d.H);
  }
  Tensor send(alloc, DType::BF16, {d.N, d.H}, kDsp);    // [T·k, H] bf16
  Tensor recv(alloc, DType::BF16, {R, d.H}, kDsp);      // [R, H] bf16
  Tensor recv_probs(alloc, DType::F32, {R}, kDsp);      // [R] fp32
  const int64_t* sort = m.sort.data<int64_t>();
  for (int64_t i = 0; i < d.N; ++i) {
    const Bf16* row = repeated_tokens ? repeated.data<Bf16>() + sort[i] * d.H : L.x.data<Bf16>() + (sort[i] / d.k) * d.H;
    copy_rows(row, send.data<Bf16>() + i * d.H, 1, d.H);
  }
  const std::vector<int64_t> out = row_of(p.send_rows, d.me), in = column_of(p.send_rows, d.me);
  exchange(comm, send.raw(), out, p.dest_begin, recv.raw(), in, p.recv_begin, d.H, DType::BF16);
  exchange(comm, m.pprobs.raw(), out, p.dest_begin, recv_probs.raw(), in, p.recv_begin, 1, DType::F32);
  send.reset();
  repeated.reset();
  if (d.ep == 1) return Dispatched{std::move(recv), Tensor()};
  Tensor input(alloc, DType::BF16, {R, d.H}, kDsp);     // [R, H] bf16, expert order
  regroup(g, recv.data<Bf16>(), input.data<Bf16>(), d.H);
  return Dispatched{std::move(input), std::move(recv_probs)};
}

// Combine: fc2 rows back to source-major order, the all-to-all back, and the MoE output [T, H]
// bf16 summing each token's k rows in increasing expert order.
void uncapped_combine(Communicator& comm, TrackingAllocator& alloc, const Dims& d, const RowPlan& p, const Grouping& g,
                      const Routing& r, const Tensor& fc2, std::vector<float>* out_values) {
  const int64_t R = p.received();
  Tensor unperm(alloc, DType::BF16, {R, d.H}, kDsp);       // [R, H] bf16, source-major
  Tensor comb_recv(alloc, DType::BF16, {d.N, d.H}, kDsp);  // [T·k, H] bf16, send order
  Tensor out(alloc, DType::BF16, {d.T, d.H}, kDsp);        // [T, H] bf16
  ungroup(g, fc2.data<Bf16>(), unperm.data<Bf16>(), d.H);
  exchange(comm, unperm.raw(), column_of(p.send_rows, d.me), p.recv_begin, comb_recv.raw(), row_of(p.send_rows, d.me), p.dest_begin,
           d.H, DType::BF16);
  const Bf16* rows = comb_recv.data<Bf16>();
  for_each_token(p, d, r.topk_ids.data<int64_t>(), [&](int64_t t, const int64_t* pos, int64_t n) {
    for (int64_t h = 0; h < d.H; ++h) {
      float sum = 0.0f;
      for (int64_t s = 0; s < n; ++s) sum += to_f32(rows[pos[s] * d.H + h]);
      out.data<Bf16>()[t * d.H + h] = f32_to_bf16(sum);
    }
  });
  if (out_values) {
    out_values->resize(z(d.T * d.H));
    for (int64_t i = 0; i < d.T * d.H; ++i) (*out_values)[z(i)] = to_f32(out.data<Bf16>()[i]);
  }
}

Grouping uncapped_grouping(const RowPlan& p) {
  std::vector<int64_t> first(z(p.ep), 0), count;
  for (int64_t s = 0; s < p.ep; ++s) count.push_back(p.send_rows[z(s)][z(p.me)]);
  return make_grouping(p, first, count);
}

void run_uncapped(Communicator& comm, TrackingAllocator& alloc, const Dims& d, LayerData& L, const RowPlan& p,
                  const std::vector<int32_t>& ids, const DispatchScheduleConfig& c, DispatchScheduleResult& res) {
  const bool llep = c.llep;  // the reference's repeated tokens ride with LLEP's dispatch
  const Grouping g = uncapped_grouping(p);
  const int64_t R = p.received();
  // No-grad forward: nothing is kept; each phase frees what the next does not read.
  {
    const std::string pre = "fwd/" + c.layer + "/moe/";
    alloc.set_phase(pre + "route");
    Routing r(alloc, d);
    compute_routing(d, L, ids, r);
    alloc.set_phase(pre + "dispatch");
    Tensor foreign = borrow_weights(comm, alloc, d, p, L, static_cast<int64_t>(p.foreign.size()));
    const std::vector<ExpertSlot> w = expert_slots(d, p, L, &foreign, nullptr);
    Meta m(alloc, d, p, r);
    Dispatched in = uncapped_dispatch(comm, alloc, d, L, p, g, m, llep);
    alloc.set_phase(pre + "experts");
    Tensor fc1(alloc, DType::BF16, {R, 2 * d.F}, kDsp);  // [R, 2F] bf16
    Tensor act(alloc, DType::BF16, {R, d.F}, kDsp);      // [R, F] bf16
    const Probs pr = d.ep == 1 ? Probs{m.pprobs.data<float>(), false} : Probs{in.recv_probs.data<float>(), true};
    experts_forward(d, w, g, pr, in.in.data<Bf16>(), fc1.data<Bf16>(), act.data<Bf16>(), nullptr);
    in.recv_probs.reset();
    in.in.reset();
    fc1.reset();
    Tensor fc2(alloc, DType::BF16, {R, d.H}, kDsp);  // [R, H] bf16
    experts_fc2(d, w, g, act.data<Bf16>(), fc2.data<Bf16>());
    act.reset();
    alloc.set_phase(pre + "combine");
    uncapped_combine(comm, alloc, d, p, g, r, fc2, &res.out);
    res.topk_weights.assign(r.topk_w.data<float>(), r.topk_w.data<float>() + d.N);
  }
  // Recompute: the same forward, keeping expert input, fc1 and act*prob (and the received probs)
  // for the backward; the borrowed weights stay until the backward has returned their gradients.
  const std::string q = "bwd/" + c.layer + "/recompute/moe/";
  alloc.set_phase(q + "dispatch");
  Routing r(alloc, d);
  compute_routing(d, L, ids, r);
  Tensor foreign = borrow_weights(comm, alloc, d, p, L, static_cast<int64_t>(p.foreign.size()));
  Meta m(alloc, d, p, r);
  const int64_t* sort = m.sort.data<int64_t>();
  const int64_t* eid = r.topk_ids.data<int64_t>();
  Dispatched in = uncapped_dispatch(comm, alloc, d, L, p, g, m, llep);
  const Probs pr = d.ep == 1 ? Probs{m.pprobs.data<float>(), false} : Probs{in.recv_probs.data<float>(), true};
  alloc.set_phase(q + "experts");
  Tensor fc1(alloc, DType::BF16, {R, 2 * d.F}, kDsp);  // [R, 2F] bf16, saved
  Tensor act(alloc, DType::BF16, {R, d.F}, kDsp);      // [R, F] bf16, saved
  Tensor fc2(alloc, DType::BF16, {R, d.H}, kDsp);      // [R, H] bf16
  {
    const std::vector<ExpertSlot> w = expert_slots(d, p, L, &foreign, nullptr);
    experts_forward(d, w, g, pr, in.in.data<Bf16>(), fc1.data<Bf16>(), act.data<Bf16>(), fc2.data<Bf16>());
  }
  alloc.set_phase(q + "combine");
  uncapped_combine(comm, alloc, d, p, g, r, fc2, nullptr);
  fc2.reset();

  // Backward. Combine: each copy's gradient is d_out of its token (unweighted sum), gathered in
  // send order; the reversed all-to-all brings them to the experts, regrouped in expert order.
  const std::string gp = "bwd/" + c.layer + "/moe/";
  alloc.set_phase(gp + "combine");
  Tensor d_fc2;
  {
    Tensor d_comb(alloc, DType::BF16, {d.N, d.H}, kDsp);  // [T·k, H] bf16, send order
    Tensor d_recv(alloc, DType::BF16, {R, d.H}, kDsp);    // [R, H] bf16, source-major
    for (int64_t i = 0; i < d.N; ++i) copy_rows(L.d_out.data<Bf16>() + (sort[i] / d.k) * d.H, d_comb.data<Bf16>() + i * d.H, 1, d.H);
    exchange(comm, d_comb.raw(), row_of(p.send_rows, d.me), p.dest_begin, d_recv.raw(), column_of(p.send_rows, d.me), p.recv_begin, d.H,
             DType::BF16);
    d_comb.reset();
    if (d.ep == 1) {
      d_fc2 = std::move(d_recv);
    } else {
      d_fc2 = Tensor(alloc, DType::BF16, {R, d.H}, kDsp);  // [R, H] bf16, expert order
      regroup(g, d_recv.data<Bf16>(), d_fc2.data<Bf16>(), d.H);
    }
  }
  alloc.set_phase(gp + "experts");
  // LLEP: the borrowed experts' fp32 gradients [S_p, P] and the lent ones coming back [S_sent, P].
  Tensor foreign_dw(alloc, DType::F32, {static_cast<int64_t>(p.foreign.size()), d.P}, kDsp);
  Tensor lent_dw(alloc, DType::F32, {p.lla_ran ? p.lent : 0, d.P}, kDsp);
  if (!foreign_dw.empty()) std::fill(foreign_dw.data<float>(), foreign_dw.data<float>() + foreign_dw.numel(), 0.0f);
  const std::vector<ExpertSlot> w = expert_slots(d, p, L, &foreign, &foreign_dw);
  Tensor d_in;
  {
    Tensor d_act(alloc, DType::BF16, {R, d.F}, kDsp);      // [R, F] bf16
    Tensor d_fc1(alloc, DType::BF16, {R, 2 * d.F}, kDsp);  // [R, 2F] bf16
    // d prob lands over the probs the experts read; at EP > 1 the reversed all-to-all takes it
    // home into the permuted probs; then it goes to the dead router scores at [t, e].
    experts_backward_fc(d, w, g, pr, fc1.data<Bf16>(), act.data<Bf16>(), d_fc2.data<Bf16>(), d_act.data<Bf16>(), d_fc1.data<Bf16>());
    if (d.ep > 1) {
      exchange(comm, in.recv_probs.raw(), column_of(p.send_rows, d.me), p.recv_begin, m.pprobs.raw(), row_of(p.send_rows, d.me),
               p.dest_begin, 1, DType::F32);
      in.recv_probs.reset();
    }
    const float* pp = m.pprobs.data<float>();
    for (int64_t i = 0; i < d.N; ++i) r.scores.data<float>()[(sort[i] / d.k) * d.E + eid[sort[i]]] = pp[i];
    d_fc2.reset();
    d_act.reset();
    act.reset();
    fc1.reset();
    d_in = Tensor(alloc, DType::BF16, {R, d.H}, kDsp);  // [R, H] bf16, expert order
    experts_backward_in(d, w, g, in.in.data<Bf16>(), d_fc1.data<Bf16>(), d_in.data<Bf16>());
    in.in.reset();
  }
  // Dispatch: d in back to source-major order (EP > 1), the reversed all-to-all to the sources,
  // and each token's k rows summed in increasing expert order into the fp32 d_x.
  alloc.set_phase(gp + "dispatch");
  Tensor d_src;
  if (d.ep > 1) {
    d_src = Tensor(alloc, DType::BF16, {R, d.H}, kDsp);  // [R, H] bf16, source-major
    ungroup(g, d_in.data<Bf16>(), d_src.data<Bf16>(), d.H);
    d_in.reset();
  }
  Tensor d_rows(alloc, DType::BF16, {d.N, d.H}, kDsp);  // [T·k, H] bf16, send order (reversed all-to-all)
  Tensor d_x(alloc, DType::F32, {d.T, d.H}, kDsp);      // [T, H] fp32 d norm-2 output accumulator
  exchange(comm, d.ep > 1 ? d_src.raw() : d_in.raw(), column_of(p.send_rows, d.me), p.recv_begin, d_rows.raw(), row_of(p.send_rows, d.me),
           p.dest_begin, d.H, DType::BF16);
  d_src.reset();
  std::fill(d_x.data<float>(), d_x.data<float>() + d_x.numel(), 0.0f);
  for_each_token(p, d, eid, [&](int64_t t, const int64_t* pos, int64_t n) {
    for (int64_t s = 0; s < n; ++s)
      for (int64_t h = 0; h < d.H; ++h) d_x.data<float>()[t * d.H + h] += to_f32(d_rows.data<Bf16>()[pos[s] * d.H + h]);
  });
  router_backward(d, L, r, d_x.data<float>());
  res.d_x.assign(d_x.data<float>(), d_x.data<float>() + d_x.numel());
  if (p.lla_ran) return_weight_grads(comm, d, p, L, foreign_dw, lent_dw);
}

// ---- capped rounds (PipelinedLLEP)

// Rows every source sends every destination in each round: proportional striping (spec
// pipelined_rounds), or the send order cut into rounds of C (O1).
std::vector<CountMatrix> round_counts(const RowPlan& p, int64_t cap, bool striping) {
  if (striping) return pipelined_rounds(p.send_rows, cap).send_rows;
  std::vector<CountMatrix> out;
  int64_t n = 0;
  for (const auto& row : p.send_rows) {
    int64_t total = 0;
    for (int64_t v : row) total += v;
    n = std::max(n, (total + cap - 1) / cap);
  }
  for (int64_t j = 0; j < n; ++j) {
    CountMatrix m(z(p.ep), std::vector<int64_t>(z(p.ep), 0));
    for (int64_t s = 0; s < p.ep; ++s) {
      const std::vector<int64_t> begin = offsets_of(p.send_rows[z(s)]);
      for (int64_t t = 0; t < p.ep; ++t) {
        const int64_t lo = std::max(begin[z(t)], j * cap), hi = std::min(begin[z(t + 1)], (j + 1) * cap);
        m[z(s)][z(t)] = std::max<int64_t>(0, hi - lo);
      }
    }
    out.push_back(std::move(m));
  }
  return out;
}

// The round buffers of one pass, allocated once at its launch: send [D, C, H], receive [D, B, H],
// combine send [D, B, H], combine receive [D, C, H] (bf16), probs and indices [D, 2(B+C)] (fp32,
// int64), destination/sort/unsort indices [3, T·k] (int64) and the combine accumulator [T, H]
// (fp32). Per slot the probs hold [C sent | B received | B in expert order (then d prob) | C d
// prob home], the indices [C expert ids sent | B received | B unused | C slots of the sent rows].
struct RoundSet {
  int64_t C, B, D;
  Tensor send, recv, comb_send, comb_recv, probs, index, dsu, comb_acc;
  RoundSet(TrackingAllocator& alloc, const Dims& d, int64_t cap, int64_t buffer_rows, int64_t depth, const RowPlan& p,
           const int64_t* ids)
      : C(cap), B(buffer_rows), D(depth),
        send(alloc, DType::BF16, {D, C, d.H}, kDsp),
        recv(alloc, DType::BF16, {D, B, d.H}, kDsp),
        comb_send(alloc, DType::BF16, {D, B, d.H}, kDsp),
        comb_recv(alloc, DType::BF16, {D, C, d.H}, kDsp),
        probs(alloc, DType::F32, {D, 2 * (B + C)}, kDsp),
        index(alloc, DType::I64, {D, 2 * (B + C)}, kDsp),
        dsu(alloc, DType::I64, {3, d.N}, kDsp),
        comb_acc(alloc, DType::F32, {d.T, d.H}, kDsp) {
    int64_t* q = dsu.data<int64_t>();
    fill_send_order(p, d, ids, q + d.N, q + 2 * d.N, q);
    std::fill(comb_acc.data<float>(), comb_acc.data<float>() + comb_acc.numel(), 0.0f);
  }
  const int64_t* sort() const { return dsu.data<int64_t>() + dsu.dim(1); }
  int64_t slot_of(int64_t j) const { return j % D; }
  float* prob_part(int64_t j, int64_t part) { return probs.data<float>() + slot_of(j) * 2 * (B + C) + part; }
  int64_t* index_part(int64_t j, int64_t part) { return index.data<int64_t>() + slot_of(j) * 2 * (B + C) + part; }
  Bf16* send_rows(int64_t j) { return send.data<Bf16>() + slot_of(j) * C * send.dim(2); }
  Bf16* recv_rows(int64_t j) { return recv.data<Bf16>() + slot_of(j) * B * recv.dim(2); }
};

// One round's traffic: rows this rank sends each destination and receives from each source,
// where they start in its lists, and the grouping of what it receives.
struct Round {
  std::vector<int64_t> out, out_begin, in, in_begin;  // [EP] (+1 for the begins)
  std::vector<int64_t> first_out;                     // [EP] start in this source's list for d
  int64_t sent = 0, received = 0;
  Grouping g;
};

std::vector<Round> make_rounds(const RowPlan& p, const std::vector<CountMatrix>& counts) {
  std::vector<Round> rounds;
  std::vector<int64_t> sent_so_far(z(p.ep), 0), recv_so_far(z(p.ep), 0);
  for (const CountMatrix& m : counts) {
    Round r;
    r.out = row_of(m, p.me);
    r.in = column_of(m, p.me);
    r.out_begin = offsets_of(r.out);
    r.in_begin = offsets_of(r.in);
    r.sent = r.out_begin.back();
    r.received = r.in_begin.back();
    r.first_out = sent_so_far;
    r.g = make_grouping(p, recv_so_far, r.in);
    for (int64_t t = 0; t < p.ep; ++t) {
      sent_so_far[z(t)] += r.out[z(t)];
      recv_so_far[z(t)] += r.in[z(t)];
    }
    rounds.push_back(std::move(r));
  }
  return rounds;
}

// Round j at the source: its rows (x, or d_out for `grads`) into the send buffer `rows`, their
// probs and expert ids, and the slot of each row kept for the way home.
void pack_round(const Dims& d, const RowPlan& p, const Routing& r, RoundSet& rs, const Round& rd, int64_t j, const Bf16* src, Bf16* rows) {
  const int64_t* sort = rs.sort();
  float* p_send = rs.prob_part(j, 0);
  int64_t* i_send = rs.index_part(j, 0);
  int64_t* i_home = rs.index_part(j, rs.C + 2 * rs.B);
  int64_t q = 0;
  for (int64_t t = 0; t < d.ep; ++t)
    for (int64_t i = 0; i < rd.out[z(t)]; ++i, ++q) {
      const int64_t slot = sort[p.dest_begin[z(t)] + rd.first_out[z(t)] + i];
      copy_rows(src + (slot / d.k) * d.H, rows + q * d.H, 1, d.H);
      p_send[q] = r.topk_w.data<float>()[slot];
      i_send[q] = r.topk_ids.data<int64_t>()[slot];
      i_home[q] = slot;
    }
}

// Round j's probs to the destination and into expert order ([C+B, C+2B)), checking the expert
// ids that came with them against the plan.
void send_round_probs(Communicator& comm, const RowPlan& p, RoundSet& rs, const Round& rd, int64_t j) {
  exchange(comm, rs.prob_part(j, 0), rd.out, rd.out_begin, rs.prob_part(j, rs.C), rd.in, rd.in_begin, 1, DType::F32);
  exchange(comm, rs.index_part(j, 0), rd.out, rd.out_begin, rs.index_part(j, rs.C), rd.in, rd.in_begin, 1, DType::I64);
  const int64_t* got = rs.index_part(j, rs.C);
  for (const auto& ch : rd.g.chunks)
    for (int64_t i = 0; i < ch.rows; ++i)
      if (p.local_of[z(got[ch.recv_row + i])] != ch.local) throw std::logic_error("dispatch schedule: a round's rows disagree with the plan");
  regroup(rd.g, rs.prob_part(j, rs.C), rs.prob_part(j, rs.C + rs.B), 1);
}

// Round j's forward up to act*prob: the source sends its rows with their probs and ids, the
// destination regroups them by expert into `in` and runs fc1 and act*prob.
void round_dispatch(Communicator& comm, const Dims& d, const LayerData& L, const RowPlan& p, const Routing& r, RoundSet& rs,
                    const Round& rd, int64_t j, const std::vector<ExpertSlot>& w, Bf16* in, Bf16* fc1, Bf16* act) {
  pack_round(d, p, r, rs, rd, j, L.x.data<Bf16>(), rs.send_rows(j));
  exchange(comm, rs.send_rows(j), rd.out, rd.out_begin, rs.recv_rows(j), rd.in, rd.in_begin, d.H, DType::BF16);
  send_round_probs(comm, p, rs, rd, j);
  regroup(rd.g, rs.recv_rows(j), in, d.H);
  experts_forward(d, w, rd.g, Probs{rs.prob_part(j, rs.C + rs.B), false}, in, fc1, act, nullptr);
}

// Round j's fc2 and combine: fc2 rows back to source-major order, sent home and added to the
// accumulator (one rank: in increasing expert order within and across rounds).
void round_combine(Communicator& comm, const Dims& d, const std::vector<ExpertSlot>& w, RoundSet& rs, const Round& rd, int64_t j,
                   const Bf16* act, Bf16* fc2, Bf16* unperm) {
  experts_fc2(d, w, rd.g, act, fc2);
  ungroup(rd.g, fc2, unperm, d.H);
  Bf16* comb_send = rs.comb_send.data<Bf16>() + rs.slot_of(j) * rs.B * d.H;
  Bf16* comb_recv = rs.comb_recv.data<Bf16>() + rs.slot_of(j) * rs.C * d.H;
  copy_rows(unperm, comb_send, rd.received, d.H);
  exchange(comm, comb_send, rd.in, rd.in_begin, comb_recv, rd.out, rd.out_begin, d.H, DType::BF16);
  const int64_t* i_home = rs.index_part(j, rs.C + 2 * rs.B);
  float* acc = rs.comb_acc.data<float>();
  for (int64_t q = 0; q < rd.sent; ++q) {
    const int64_t t = i_home[q] / d.k;
    for (int64_t h = 0; h < d.H; ++h) acc[t * d.H + h] += to_f32(comb_recv[q * d.H + h]);
  }
}

// Rounds [0, stored) whose rows fit in the store on every rank (prefix sums of each
// destination's received rows ≤ store_rows); the rest are recomputed in backward.
int64_t stored_rounds(const std::vector<CountMatrix>& counts, int64_t ep, int64_t store_rows) {
  std::vector<int64_t> used(z(ep), 0);
  for (size_t j = 0; j < counts.size(); ++j)
    for (int64_t t = 0; t < ep; ++t) {
      for (int64_t s = 0; s < ep; ++s) used[z(t)] += counts[j][z(s)][z(t)];
      if (used[z(t)] > store_rows) return static_cast<int64_t>(j);
    }
  return static_cast<int64_t>(counts.size());
}

void run_capped(Communicator& comm, TrackingAllocator& alloc, const Dims& d, LayerData& L, const RowPlan& p,
                const std::vector<int32_t>& ids, const DispatchScheduleConfig& c, DispatchScheduleResult& res) {
  const int64_t C = std::min(c.chunk_cap_rows, d.N), D = c.depth;
  // Launch-time sizes (spec/least_loaded.h), the same whatever the routing: round buffers of B
  // rows, the foreign-weight pool (LLA lent no rank more: make_row_plan), the store's rows.
  const int64_t B = dispatch_round_buffer_rows(c, d.ep);
  const int64_t pool = dispatch_foreign_pool(c, d.ep);
  const int64_t store_rows = c.store ? dispatch_store_rows(c, d.ep) : 0;
  // The buffers hold B rows per round whatever the routing; known loads that would overflow
  // them shrink the cap (more rounds, same memory).
  int64_t cap = C;
  if (d.ep > 1 && c.striping && round_receive_bound_rows(p.send_rows, C) > B) {
    cap = shrink_chunk_cap(p.send_rows, C, B);
    if (cap < 1) throw std::logic_error("dispatch schedule: no chunk cap fits the launch-time round buffers");
  }
  const std::vector<CountMatrix> counts = round_counts(p, cap, c.striping);
  const std::vector<Round> rounds = make_rounds(p, counts);
  const int64_t n = static_cast<int64_t>(rounds.size());
  const int64_t stored = c.store ? stored_rounds(counts, d.ep, store_rows) : 0;
  res.rounds = n;
  res.chunk_cap_rows = cap;
  res.launch_chunk_cap_rows = C;
  res.round_buffer_rows = B;
  res.foreign_pool = pool;
  res.store_rows = store_rows;
  res.stored_rounds = stored;
  for (const Round& rd : rounds) {
    res.max_round_received_rows = std::max(res.max_round_received_rows, rd.received);
    if (rd.received > B || rd.sent > C) throw std::logic_error("dispatch schedule: a round exceeds the launch-time buffers");
  }
  if (c.store && n > stored && res.max_round_received_rows > store_rows)
    throw std::logic_error("dispatch schedule: a recomputed round does not fit the store");
  auto round = [&](const std::string& prefix, int64_t j) { return prefix + "dispatch/r" + std::to_string(j); };
  // No-grad forward: one set of round expert buffers [B, ·], reused by every round.
  {
    const std::string pre = "fwd/" + c.layer + "/moe/";
    alloc.set_phase(pre + "route");
    Routing r(alloc, d);
    compute_routing(d, L, ids, r);
    alloc.set_phase(round(pre, 0));
    RoundSet rs(alloc, d, C, B, D, p, r.topk_ids.data<int64_t>());
    Tensor in(alloc, DType::BF16, {B, d.H}, kDsp);       // [B, H] bf16
    Tensor fc1(alloc, DType::BF16, {B, 2 * d.F}, kDsp);  // [B, 2F] bf16
    Tensor act(alloc, DType::BF16, {B, d.F}, kDsp);      // [B, F] bf16
    Tensor fc2(alloc, DType::BF16, {B, d.H}, kDsp);      // [B, H] bf16
    Tensor unperm(alloc, DType::BF16, {B, d.H}, kDsp);   // [B, H] bf16
    Tensor foreign = borrow_weights(comm, alloc, d, p, L, pool);
    const std::vector<ExpertSlot> w = expert_slots(d, p, L, &foreign, nullptr);
    for (int64_t j = 0; j < n; ++j) {
      if (j > 0) alloc.set_phase(round(pre, j));
      round_dispatch(comm, d, L, p, r, rs, rounds[z(j)], j, w, in.data<Bf16>(), fc1.data<Bf16>(), act.data<Bf16>());
      round_combine(comm, d, w, rs, rounds[z(j)], j, act.data<Bf16>(), fc2.data<Bf16>(), unperm.data<Bf16>());
    }
    res.out.resize(z(d.T * d.H));
    for (int64_t i = 0; i < d.T * d.H; ++i) res.out[z(i)] = to_f32(f32_to_bf16(rs.comb_acc.data<float>()[i]));
    res.topk_weights.assign(r.topk_w.data<float>(), r.topk_w.data<float>() + d.N);
  }
  // Recompute. Store: the rounds again, each writing its rows of the expert input, fc1 and
  // act*prob into a store allocated once when the recompute starts, sized at launch; rounds past
  // the ones that fit on every rank are skipped here and recomputed in backward into the store,
  // by then free (no per-round allocation). Recompute mode: only the routing (and the borrowed
  // weights); each round is recomputed in the backward.
  std::vector<int64_t> store_row(z(n) + 1, 0);  // first store row of each round
  for (int64_t j = 0; j < n; ++j) store_row[z(j) + 1] = store_row[z(j)] + rounds[z(j)].received;
  const std::string q = "bwd/" + c.layer + "/recompute/moe/";
  Tensor saved_in, saved_fc1, saved_act;  // store: [R_store, H], [R_store, 2F], [R_store, F] bf16
  if (!c.store) alloc.set_phase(q + "route");
  else alloc.set_phase(round(q, 0));
  Routing r(alloc, d);
  compute_routing(d, L, ids, r);
  const int64_t* eid = r.topk_ids.data<int64_t>();
  Tensor foreign = borrow_weights(comm, alloc, d, p, L, pool);
  if (c.store) {
    RoundSet rs(alloc, d, C, B, D, p, eid);
    Tensor fc2(alloc, DType::BF16, {B, d.H}, kDsp);     // [B, H] bf16
    Tensor unperm(alloc, DType::BF16, {B, d.H}, kDsp);  // [B, H] bf16
    saved_in = Tensor(alloc, DType::BF16, {store_rows, d.H}, kDsp);
    saved_fc1 = Tensor(alloc, DType::BF16, {store_rows, 2 * d.F}, kDsp);
    saved_act = Tensor(alloc, DType::BF16, {store_rows, d.F}, kDsp);
    const std::vector<ExpertSlot> w = expert_slots(d, p, L, &foreign, nullptr);
    for (int64_t j = 0; j < stored; ++j) {
      if (j > 0) alloc.set_phase(round(q, j));
      const int64_t s0 = store_row[z(j)];
      Bf16* act = saved_act.data<Bf16>() + s0 * d.F;
      round_dispatch(comm, d, L, p, r, rs, rounds[z(j)], j, w, saved_in.data<Bf16>() + s0 * d.H, saved_fc1.data<Bf16>() + s0 * 2 * d.F, act);
      round_combine(comm, d, w, rs, rounds[z(j)], j, act, fc2.data<Bf16>(), unperm.data<Bf16>());
    }
  }
  // Backward, rounds in forward order: the source sends each copy's gradient (d_out of its
  // token), the destination runs the expert backward and returns d in; the source adds it to
  // the fp32 d_x accumulator. d prob goes home the same way, into the dead router scores.
  const std::string gp = "bwd/" + c.layer + "/moe/";
  alloc.set_phase(round(gp, 0));
  RoundSet rs(alloc, d, C, B, D, p, eid);
  Tensor grads(alloc, DType::BF16, {D, 2 * (B + C), d.H}, kDsp);  // [D, 2(B+C), H] bf16
  Tensor d_fc2(alloc, DType::BF16, {B, d.H}, kDsp);               // [B, H] bf16 (then d in)
  Tensor d_act(alloc, DType::BF16, {B, d.F}, kDsp);               // [B, F] bf16
  Tensor d_fc1(alloc, DType::BF16, {B, 2 * d.F}, kDsp);           // [B, 2F] bf16
  Tensor d_x(alloc, DType::F32, {d.T, d.H}, kDsp);                // [T, H] fp32 d norm-2 output accumulator
  std::fill(d_x.data<float>(), d_x.data<float>() + d_x.numel(), 0.0f);
  Tensor in, fc1, act;  // recompute mode: the round's recomputed expert input, fc1, act*prob [B, ·]
  if (!c.store) {
    in = Tensor(alloc, DType::BF16, {B, d.H}, kDsp);
    fc1 = Tensor(alloc, DType::BF16, {B, 2 * d.F}, kDsp);
    act = Tensor(alloc, DType::BF16, {B, d.F}, kDsp);
  }
  Tensor foreign_dw(alloc, DType::F32, {pool, d.P}, kDsp);                                  // [S_cap, P] fp32
  Tensor lent_staging(alloc, DType::F32, {d.ep > 1 && c.llep ? 1 : 0, d.P}, kDsp);          // [1, P] fp32
  if (!foreign_dw.empty()) std::fill(foreign_dw.data<float>(), foreign_dw.data<float>() + foreign_dw.numel(), 0.0f);
  const std::vector<ExpertSlot> w = expert_slots(d, p, L, &foreign, &foreign_dw);
  for (int64_t j = 0; j < n; ++j) {
    if (j > 0) alloc.set_phase(round(gp, j));
    const Round& rd = rounds[z(j)];
    Bf16 *rin = nullptr, *rfc1 = nullptr, *ract = nullptr;
    if (c.store && j < stored) {
      const int64_t s0 = store_row[z(j)];
      rin = saved_in.data<Bf16>() + s0 * d.H;
      rfc1 = saved_fc1.data<Bf16>() + s0 * 2 * d.F;
      ract = saved_act.data<Bf16>() + s0 * d.F;
    } else if (c.store) {  // not stored: recomputed into the store, whose rounds are done
      rin = saved_in.data<Bf16>();
      rfc1 = saved_fc1.data<Bf16>();
      ract = saved_act.data<Bf16>();
      round_dispatch(comm, d, L, p, r, rs, rd, j, w, rin, rfc1, ract);
    } else {
      rin = in.data<Bf16>();
      rfc1 = fc1.data<Bf16>();
      ract = act.data<Bf16>();
      round_dispatch(comm, d, L, p, r, rs, rd, j, w, rin, rfc1, ract);
    }
    Bf16* g_send = grads.data<Bf16>() + rs.slot_of(j) * 2 * (B + C) * d.H;  // [C, H] d combine rows
    Bf16* g_recv = g_send + C * d.H;                                         // [B, H] received
    Bf16* g_back = g_recv + B * d.H;                                         // [B, H] d expert input
    Bf16* g_home = g_back + B * d.H;                                         // [C, H] d dispatch rows
    pack_round(d, p, r, rs, rd, j, L.d_out.data<Bf16>(), g_send);
    if (c.store && j < stored) send_round_probs(comm, p, rs, rd, j);  // the stored rounds' went with the recompute
    exchange(comm, g_send, rd.out, rd.out_begin, g_recv, rd.in, rd.in_begin, d.H, DType::BF16);
    regroup(rd.g, g_recv, d_fc2.data<Bf16>(), d.H);
    const Probs pr{rs.prob_part(j, C + B), false};
    experts_backward_fc(d, w, rd.g, pr, rfc1, ract, d_fc2.data<Bf16>(), d_act.data<Bf16>(), d_fc1.data<Bf16>());
    experts_backward_in(d, w, rd.g, rin, d_fc1.data<Bf16>(), d_fc2.data<Bf16>());
    ungroup(rd.g, d_fc2.data<Bf16>(), g_back, d.H);
    ungroup(rd.g, rs.prob_part(j, C + B), rs.prob_part(j, C), 1);
    exchange(comm, g_back, rd.in, rd.in_begin, g_home, rd.out, rd.out_begin, d.H, DType::BF16);
    exchange(comm, rs.prob_part(j, C), rd.in, rd.in_begin, rs.prob_part(j, 2 * B + C), rd.out, rd.out_begin, 1, DType::F32);
    const int64_t* i_home = rs.index_part(j, C + 2 * B);
    const float* dprob = rs.prob_part(j, 2 * B + C);
    for (int64_t i = 0; i < rd.sent; ++i) {
      const int64_t slot = i_home[i], t = slot / d.k;
      r.scores.data<float>()[t * d.E + eid[slot]] = dprob[i];
      for (int64_t h = 0; h < d.H; ++h) d_x.data<float>()[t * d.H + h] += to_f32(g_home[i * d.H + h]);
    }
  }
  router_backward(d, L, r, d_x.data<float>());
  res.d_x.assign(d_x.data<float>(), d_x.data<float>() + d_x.numel());
  if (p.lla_ran) return_weight_grads_staged(comm, d, p, L, foreign_dw, lent_staging);
}

DispatchScheduleResult run_on(Communicator& comm, TrackingAllocator& alloc, const DispatchScheduleConfig& c) {
  if (c.tokens <= 0 || c.hidden <= 0 || c.experts <= 0 || c.ffn <= 0 || c.top_k <= 0 || c.top_k > c.experts)
    throw std::invalid_argument("dispatch schedule: need tokens, hidden, experts, ffn > 0 and 1 <= top_k <= experts");
  if (c.chunk_cap_rows < 0 || c.depth < 1)
    throw std::invalid_argument("dispatch schedule: chunk_cap_rows must be >= 0 and depth >= 1");
  const int64_t ep = comm.size();
  if (c.experts % ep != 0) throw std::invalid_argument("dispatch schedule: the experts must divide over the EP ranks");
  if (c.topk_ids && static_cast<int64_t>(c.topk_ids->size()) != c.tokens * c.top_k)
    throw std::invalid_argument("dispatch schedule: topk_ids must hold tokens x top_k ids");
  {
    InputErrors errors;
    if (c.llep) validate_lla_knobs(c.lla, errors);
    errors.throw_if_any();
  }
  const Dims d = dims_of(c, ep, comm.rank());
  DispatchScheduleResult res;
  const std::vector<int32_t> ids = c.topk_ids ? *c.topk_ids : draw_dispatch_routing(c, ep, d.me);
  const RoutingShape shape{ep, d.E, d.k};
  res.expert_counts = count_routing(ids, shape);
  // Every rank learns the [EP][E] count matrix (O(EP·E) bookkeeping).
  std::vector<int64_t> gathered(z(ep * d.E));
  comm.all_gather(res.expert_counts.data(), gathered.data(), d.E, DType::I64);
  for (int64_t s = 0; s < ep; ++s) res.source_counts.emplace_back(gathered.begin() + s * d.E, gathered.begin() + (s + 1) * d.E);
  // PipelinedLLEP: LLA lends no rank more experts than the launch-time foreign-weight pool holds.
  LlaKnobs knobs = c.lla;
  if (c.chunk_cap_rows > 0 && c.llep) knobs.max_foreign_experts = dispatch_foreign_pool(c, ep);
  const RowPlan p = make_row_plan(d, res.source_counts, c.llep, knobs);
  res.received_rows = p.received();
  res.foreign_experts = static_cast<int64_t>(p.foreign.size());
  res.lent_weights = p.lla_ran ? p.lent : 0;
  res.lla_triggered = p.lla_ran;
  res.rho = imbalance_rho(p.rank_rows);
  LayerData L(alloc, d);
  fill_inputs(c, d, L.x.data<Bf16>(), L.d_out.data<Bf16>(), L.w_router.data<Bf16>(), L.w_gate_up.data<Bf16>(), L.w_down.data<Bf16>());
  for (Tensor* t : {&L.dw_router, &L.dw_gate_up, &L.dw_down}) std::fill(t->data<float>(), t->data<float>() + t->numel(), 0.0f);
  if (c.chunk_cap_rows == 0) run_uncapped(comm, alloc, d, L, p, ids, c, res);
  else run_capped(comm, alloc, d, L, p, ids, c, res);
  if (!c.outputs) {
    for (std::vector<float>* v : {&res.out, &res.d_x, &res.topk_weights}) std::vector<float>().swap(*v);
    return res;
  }
  res.d_w_router.assign(L.dw_router.data<float>(), L.dw_router.data<float>() + L.dw_router.numel());
  res.d_w_gate_up.assign(L.dw_gate_up.data<float>(), L.dw_gate_up.data<float>() + L.dw_gate_up.numel());
  res.d_w_down.assign(L.dw_down.data<float>(), L.dw_down.data<float>() + L.dw_down.numel());
  return res;
}

}  // namespace

const char* dispatch_schedule_name(const DispatchScheduleConfig& c) {
  if (c.chunk_cap_rows > 0) return "pipelined_llep";
  return c.llep ? "llep" : "uncapped";
}

std::vector<int32_t> draw_dispatch_routing(const DispatchScheduleConfig& c, int64_t ep, int64_t rank) {
  const RoutingShape shape{ep, c.experts, c.top_k};
  return generate_routing(c.routing, shape, c.tokens, seed_of(c, 6), c.replica * ep + rank, rank, c.moe_layer);
}

namespace {

// ρ the capped run's launch-time buffers are sized for: rho_bound, or the LLA bound
// (reference/dispatch.md §2.7), or plain EP's ρ_max.
double launch_rho(const DispatchScheduleConfig& c, int64_t ep) {
  if (c.rho_bound > 0.0) return c.rho_bound;
  if (c.llep) return pipelined_rho_bound(c.lla, ep, c.tokens * c.top_k);
  return rho_max(RoutingShape{ep, c.experts, c.top_k});
}

int64_t most_received_rows(const DispatchScheduleConfig& c, int64_t ep) {  // every copy a rank can receive
  return ep * c.tokens * std::min(c.top_k, c.experts / ep);
}

}  // namespace

int64_t dispatch_round_buffer_rows(const DispatchScheduleConfig& c, int64_t ep) {
  const int64_t N = c.tokens * c.top_k;
  const int64_t C = std::min(c.chunk_cap_rows, N);
  if (ep == 1) return C;
  if (!c.striping) return ep * C;
  return std::min(round_receive_bound_rows(C, ep, launch_rho(c, ep)), most_received_rows(c, ep));
}

int64_t dispatch_foreign_pool(const DispatchScheduleConfig& c, int64_t ep) {
  if (c.chunk_cap_rows <= 0 || !c.llep) return 0;
  return pipelined_foreign_pool(dispatch_round_buffer_rows(c, ep), ep, c.experts, c.lla);
}

int64_t dispatch_store_rows(const DispatchScheduleConfig& c, int64_t ep) {
  if (c.chunk_cap_rows <= 0) return 0;
  return pipelined_store_rows(dispatch_round_buffer_rows(c, ep), ep, c.tokens * c.top_k, most_received_rows(c, ep),
                              launch_rho(c, ep));
}

DispatchInputs make_dispatch_inputs(const DispatchScheduleConfig& c) {
  const Dims d = dims_of(c, 1, 0);
  std::vector<Bf16> x(z(d.T * d.H)), dout(z(d.T * d.H)), wr(z(d.E * d.H)), wgu(z(d.E * 2 * d.F * d.H)), wd(z(d.E * d.H * d.F));
  fill_inputs(c, d, x.data(), dout.data(), wr.data(), wgu.data(), wd.data());
  auto widen = [](const std::vector<Bf16>& v) {
    std::vector<float> out(v.size());
    for (size_t i = 0; i < v.size(); ++i) out[i] = to_f32(v[i]);
    return out;
  };
  return DispatchInputs{widen(x), widen(dout), widen(wr), widen(wgu), widen(wd), c.topk_ids ? *c.topk_ids : draw_dispatch_routing(c, 1, 0)};
}

DispatchScheduleResult run_dispatch_schedule(TrackingAllocator& alloc, const DispatchScheduleConfig& config) {
  SelfComm self;
  return run_on(self, alloc, config);
}

DispatchScheduleResult run_dispatch_schedule(Communicator& comm, TrackingAllocator& alloc, const DispatchScheduleConfig& config) {
  return run_on(comm, alloc, config);
}

}  // namespace flatpeak::exec
