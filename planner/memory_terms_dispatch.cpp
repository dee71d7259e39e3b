// The dispatch working set of one MoE layer on the worst rank (reference/dispatch.md §3–§5):
// routing tensors, dispatch/combine buffers, expert activations and their gradients, LLEP's
// foreign expert weights. Standard EP (and LLEP without a cap) sizes receive buffers by the
// layer's received rows R; PipelinedLLEP sizes per-round buffers once at launch by the cap C.
// Each phase is the largest over the candidate ranks (workload.h, candidate_ranks) of that
// rank's live set, with its own R_p, S_p and S_sent: the rank that receives the most rows lends
// weights and borrows none, its helpers the other way round, so no one rank holds every maximum.
// At EP > 1 the received rows are source-major and are regrouped into the expert input (a copy:
// the receive buffer and the expert input are live together), and the experts read the probs as
// received, which stay until the backward has used them (planner/README.md, "Dispatch").
// Symbols: T*k rows sent, R rows received, C cap, B rows received per round, D rounds in flight,
// F expert FFN width, p_e parameters of one expert. bf16 unless stated.
#include <string>

#include "memory_model.h"

namespace flatpeak::planner {

namespace {

constexpr Category kDsp = Category::Dispatch;

struct MoeShape {
  int64_t T, H, E, k, F, rows_sent, rows_recv;
  int64_t foreign, lent;  // this rank's S_p and S_sent (0 without LLEP)
  bool regroup;           // EP > 1: received rows are copied into expert order
  const MoeLoad* load;
};

bool pipelined(const Context& c) { return c.run.llep && c.run.chunk_cap_rows > 0; }

// The shape of one candidate rank of the layer's load. PipelinedLLEP holds launch-time buffers
// whatever the routing: the store's rows, the foreign-weight pool S_cap and, at EP > 1, one
// staging slot for the lent weights' gradients coming home (so every candidate is the same).
MoeShape shape_of(const Context& c, const MoeLoad& load, const RankLoad& r) {
  const Workload& w = c.work;
  const bool llep = c.run.llep;
  if (pipelined(c))
    return MoeShape{w.tokens, c.model.hidden_size, c.model.num_experts, c.model.top_k, c.model.expert_ffn_width, load.send_rows,
                    load.store_rows, load.foreign_pool, c.run.ep > 1 ? 1 : 0, c.run.ep > 1, &load};
  return MoeShape{w.tokens, c.model.hidden_size, c.model.num_experts, c.model.top_k, c.model.expert_ffn_width, load.send_rows,
                  r.recv_rows, llep ? r.foreign_experts : 0, llep ? r.lent_experts : 0, c.run.ep > 1, &load};
}

// The phase lists of every candidate rank, merged phase by phase into the largest (the first
// candidate on ties); every candidate has the same phases.
template <class Build>
std::vector<PhaseTerms> worst_rank(const Context& c, int64_t layer, Build build) {
  const Workload& w = c.work;
  const MoeLoad& load = w.load_of(w.moe_index[static_cast<size_t>(layer)]);
  std::vector<PhaseTerms> out;
  for (const RankLoad& r : load.ranks) {
    std::vector<PhaseTerms> mine = build(shape_of(c, load, r));
    if (out.empty()) {
      out = std::move(mine);
      continue;
    }
    for (size_t i = 0; i < out.size() && i < mine.size(); ++i)
      if (mine[i].terms.bytes(kDsp) > out[i].terms.bytes(kDsp)) out[i] = std::move(mine[i]);
  }
  return out;
}

// The larger of two moments of one phase (the first on ties).
TermList larger(TermList a, TermList b) { return b.bytes(kDsp) > a.bytes(kDsp) ? b : a; }

void add_route(const MoeShape& s, TermList& t) {
  t.add("router logits", {{"T", s.T}, {"E", s.E}}, kFp32, kDsp);
  t.add("router scores", {{"T", s.T}, {"E", s.E}}, kFp32, kDsp);
  t.add("scattered routing probs", {{"T", s.T}, {"E", s.E}}, kFp32, kDsp);
  t.add("routing map", {{"T", s.T}, {"E", s.E}}, kBool, kDsp);
  t.add("top-k weights", {{"T", s.T}, {"k", s.k}}, kFp32, kDsp);
  t.add("top-k ids", {{"T", s.T}, {"k", s.k}}, kInt64, kDsp);
}

void add_meta(const MoeShape& s, TermList& t) {
  t.add("sort indices", {{"T*k", s.rows_sent}}, kInt64, kDsp);
  t.add("permuted probs", {{"T*k", s.rows_sent}}, kFp32, kDsp);
}

void add_foreign_weights(const Context& c, const MoeShape& s, TermList& t) {
  if (!c.run.llep) return;
  if (pipelined(c)) t.add("LLEP foreign expert weight pool", {{"S_cap", s.foreign}, {"p_e", c.work.expert_params_each}}, kBf16, kDsp);
  else t.add("LLEP foreign expert weights", {{"S_p", s.foreign}, {"p_e", c.work.expert_params_each}}, kBf16, kDsp);
}

// fp32: a borrowed expert's gradient is an accumulator (over PipelinedLLEP's rounds, then into the
// native rank's fp32 accumulator), and DESIGN.md keeps every cross-block accumulator in fp32; in
// bf16 where LLA puts an expert's rows would change its gradient (by bf16 rounding of each part).
// PipelinedLLEP: the pool's gradients, and the lent weights' gradients come home one (expert,
// helper) pair at a time through one fp32 staging slot (the native rank adds each in helper order).
void add_foreign_weight_grads(const Context& c, const MoeShape& s, TermList& t) {
  if (!c.run.llep) return;
  if (pipelined(c)) {
    t.add("LLEP foreign weight pool grads", {{"S_cap", s.foreign}, {"p_e", c.work.expert_params_each}}, kFp32, kDsp);
    t.add("LLEP lent weight grad staging", {{"1", s.lent}, {"p_e", c.work.expert_params_each}}, kFp32, kDsp);
    return;
  }
  t.add("LLEP foreign weight grads", {{"S_p", s.foreign}, {"p_e", c.work.expert_params_each}}, kFp32, kDsp);
  t.add("LLEP lent weight grads received", {{"S_sent", s.lent}, {"p_e", c.work.expert_params_each}}, kFp32, kDsp);
}

// EP > 1: the probs as received [R] (fp32), read by the experts (act*prob) and, saved by the
// recompute, by their backward, which writes d prob over them for the way home.
void add_received_probs(const MoeShape& s, TermList& t) {
  if (s.regroup) t.add("received probs", {{"R", s.rows_recv}}, kFp32, kDsp);
}

void add_saved_experts(const MoeShape& s, int64_t rows, const char* rsym, TermList& t, const std::string& tag) {
  t.add("expert input" + tag, {{rsym, rows}, {"H", s.H}}, kBf16, kDsp);
  t.add("expert fc1 out" + tag, {{rsym, rows}, {"2F", 2 * s.F}}, kBf16, kDsp);
  t.add("expert act*prob" + tag, {{rsym, rows}, {"F", s.F}}, kBf16, kDsp);
}

void add_expert_grads(const MoeShape& s, int64_t rows, const char* rsym, TermList& t) {
  t.add("d expert fc2 out", {{rsym, rows}, {"H", s.H}}, kBf16, kDsp);
  t.add("d expert act", {{rsym, rows}, {"F", s.F}}, kBf16, kDsp);
  t.add("d expert fc1 out", {{rsym, rows}, {"2F", 2 * s.F}}, kBf16, kDsp);
}

// ---- standard EP, and LLEP without a cap (one dispatch of all rows).

void add_combine_buffers(const MoeShape& s, TermList& t) {
  t.add("expert fc2 out", {{"R", s.rows_recv}, {"H", s.H}}, kBf16, kDsp);
  t.add("unpermuted rows", {{"R", s.rows_recv}, {"H", s.H}}, kBf16, kDsp);
  t.add("combine receive buffer", {{"T*k", s.rows_sent}, {"H", s.H}}, kBf16, kDsp);
  t.add("MoE output", {{"T", s.T}, {"H", s.H}}, kBf16, kDsp);
}

std::vector<PhaseTerms> ep_phases(const Context& c, const MoeShape& s, bool recompute) {
  std::vector<PhaseTerms> out;
  auto phase = [&](const char* suffix) -> TermList& {
    out.push_back(PhaseTerms{suffix, "", c.list()});
    TermList& t = out.back().terms;
    add_route(s, t);
    return t;
  };
  auto common = [&](TermList& t) {
    add_route(s, t);
    add_meta(s, t);
    add_foreign_weights(c, s, t);
  };
  if (!recompute) phase("moe/route");
  {
    // The all-to-all: send buffer (LLEP: and the reference's repeated tokens) beside the receive
    // buffers. EP > 1: then the send side is freed and the received rows are regrouped into the
    // expert input, beside the receive buffer.
    TermList a = c.list();
    common(a);
    a.add("dispatch send buffer", {{"T*k", s.rows_sent}, {"H", s.H}}, kBf16, kDsp);
    if (c.run.llep) a.add("LLEP repeated tokens", {{"T*k", s.rows_sent}, {"H", s.H}}, kBf16, kDsp);
    a.add("dispatch receive buffer", {{"R", s.rows_recv}, {"H", s.H}}, kBf16, kDsp);
    a.add("received probs", {{"R", s.rows_recv}}, kFp32, kDsp);
    if (s.regroup) {
      TermList b = c.list();
      common(b);
      b.add("dispatch receive buffer", {{"R", s.rows_recv}, {"H", s.H}}, kBf16, kDsp);
      b.add("received probs", {{"R", s.rows_recv}}, kFp32, kDsp);
      b.add("expert input", {{"R", s.rows_recv}, {"H", s.H}}, kBf16, kDsp);
      a = larger(std::move(a), std::move(b));
    }
    out.push_back(PhaseTerms{"moe/dispatch", "", std::move(a)});
  }
  {
    TermList& t = phase("moe/experts");
    add_meta(s, t);
    add_saved_experts(s, s.rows_recv, "R", t, recompute ? " (saved)" : "");
    if (recompute) t.add("expert fc2 out", {{"R", s.rows_recv}, {"H", s.H}}, kBf16, kDsp);
    add_received_probs(s, t);
    add_foreign_weights(c, s, t);
  }
  {
    TermList& t = phase("moe/combine");
    add_meta(s, t);
    if (recompute) {
      add_saved_experts(s, s.rows_recv, "R", t, " (saved)");
      add_received_probs(s, t);
    }
    add_combine_buffers(s, t);
    add_foreign_weights(c, s, t);
  }
  return out;
}

std::vector<PhaseTerms> ep_backward(const Context& c, const MoeShape& s) {
  std::vector<PhaseTerms> out;
  auto common = [&](TermList& t) {
    add_route(s, t);
    add_meta(s, t);
    add_foreign_weights(c, s, t);
  };
  {
    // The reversed combine: d combine rows beside what arrives; EP > 1: then regrouped into the
    // experts' d fc2 out, beside the received rows.
    TermList a = c.list();
    common(a);
    add_saved_experts(s, s.rows_recv, "R", a, " (saved)");
    add_received_probs(s, a);
    a.add("d combine rows", {{"T*k", s.rows_sent}, {"H", s.H}}, kBf16, kDsp);
    a.add("d received rows", {{"R", s.rows_recv}, {"H", s.H}}, kBf16, kDsp);
    if (s.regroup) {
      TermList b = c.list();
      common(b);
      add_saved_experts(s, s.rows_recv, "R", b, " (saved)");
      add_received_probs(s, b);
      b.add("d received rows", {{"R", s.rows_recv}, {"H", s.H}}, kBf16, kDsp);
      b.add("d expert fc2 out", {{"R", s.rows_recv}, {"H", s.H}}, kBf16, kDsp);
      a = larger(std::move(a), std::move(b));
    }
    out.push_back(PhaseTerms{"moe/combine", "", std::move(a)});
  }
  {
    out.push_back(PhaseTerms{"moe/experts", "", c.list()});
    TermList& t = out.back().terms;
    common(t);
    add_saved_experts(s, s.rows_recv, "R", t, " (saved)");
    add_received_probs(s, t);
    add_expert_grads(s, s.rows_recv, "R", t);
    add_foreign_weight_grads(c, s, t);
  }
  {
    // EP > 1: d expert input back to source-major order (both copies live), then the reversed
    // all-to-all into the d dispatch rows and the fp32 accumulator. With shared experts the
    // accumulator exists from the end of moe/experts (their backward starts it: d norm-2 output
    // gathers their part, the router's and the dispatch rows'), so it is live at the first moment
    // too; without, the router's backward makes it after the d expert input is freed.
    TermList b = c.list();
    common(b);
    b.add(s.regroup ? "d expert input (send order)" : "d expert input", {{"R", s.rows_recv}, {"H", s.H}}, kBf16, kDsp);
    b.add("d dispatch rows", {{"T*k", s.rows_sent}, {"H", s.H}}, kBf16, kDsp);
    b.add("d norm-2 output accumulator", {{"T", s.T}, {"H", s.H}}, kFp32, kDsp);
    add_foreign_weight_grads(c, s, b);
    if (s.regroup) {
      TermList a = c.list();
      common(a);
      a.add("d expert input", {{"R", s.rows_recv}, {"H", s.H}}, kBf16, kDsp);
      a.add("d expert input (send order)", {{"R", s.rows_recv}, {"H", s.H}}, kBf16, kDsp);
      if (c.model.shared_expert_ffn_width > 0)
        a.add("d norm-2 output accumulator (begun by the shared experts)", {{"T", s.T}, {"H", s.H}}, kFp32, kDsp);
      add_foreign_weight_grads(c, s, a);
      b = larger(std::move(a), std::move(b));
    }
    out.push_back(PhaseTerms{"moe/dispatch", "", std::move(b)});
  }
  return out;
}

// ---- PipelinedLLEP: rounds of at most C copies per source, buffers allocated once at launch.

struct Rounds {
  int64_t C, B, D, n;
};

// C: the cap the buffers were sized for at launch (the cap in effect may be smaller: more rounds).
Rounds rounds_of(const Context& c, const MoeShape& s) {
  return Rounds{s.load->launch_chunk_cap_rows, s.load->round_recv_rows, c.run.dispatch_depth, s.load->rounds};
}

void add_round_buffers(const MoeShape& s, const Rounds& r, TermList& t) {
  t.add("round send buffers", {{"D", r.D}, {"C", r.C}, {"H", s.H}}, kBf16, kDsp);
  t.add("round receive buffers", {{"D", r.D}, {"B", r.B}, {"H", s.H}}, kBf16, kDsp);
  t.add("round combine send buffers", {{"D", r.D}, {"B", r.B}, {"H", s.H}}, kBf16, kDsp);
  t.add("round combine receive buffers", {{"D", r.D}, {"C", r.C}, {"H", s.H}}, kBf16, kDsp);
  t.add("round probs", {{"D", r.D}, {"2(B+C)", 2 * (r.B + r.C)}}, kFp32, kDsp);
  t.add("round indices", {{"D", r.D}, {"2(B+C)", 2 * (r.B + r.C)}}, kInt64, kDsp);
  t.add("destination/sort/unsort indices", {{"3", 3}, {"T*k", s.rows_sent}}, kInt64, kDsp);
  t.add("combine accumulator", {{"T", s.T}, {"H", s.H}}, kFp32, kDsp);
}

std::string round_name(int64_t j) { return "moe/dispatch/r" + std::to_string(j); }
std::string round_folds(const Rounds& r) { return r.n > 1 ? "r0-r" + std::to_string(r.n - 1) : ""; }

std::vector<PhaseTerms> pipelined_forward(const Context& c, const MoeShape& s, bool recompute) {
  const Rounds r = rounds_of(c, s);
  const bool store = c.run.dispatch_mode == DispatchMode::Store;
  std::vector<PhaseTerms> out;
  if (recompute && !store) {
    // Recompute mode: only the routing is recomputed here; experts are recomputed per round in
    // backward from the layer input.
    out.push_back(PhaseTerms{"moe/route", "", c.list()});
    add_route(s, out.back().terms);
    add_foreign_weights(c, s, out.back().terms);
    return out;
  }
  if (!recompute) {
    out.push_back(PhaseTerms{"moe/route", "", c.list()});
    add_route(s, out.back().terms);
  }
  // In the no-grad forward nothing is kept between rounds; the recompute in store mode keeps
  // every round's expert activations, so its last round is the largest.
  const int64_t j = recompute ? r.n - 1 : 0;
  out.push_back(PhaseTerms{round_name(j), round_folds(r), c.list()});
  TermList& t = out.back().terms;
  add_route(s, t);
  add_round_buffers(s, r, t);
  if (recompute) add_saved_experts(s, s.rows_recv, "R_store", t, " (saved, all rounds)");
  else add_saved_experts(s, r.B, "B", t, " (round)");
  t.add("round expert fc2 out", {{"B", r.B}, {"H", s.H}}, kBf16, kDsp);
  t.add("round unpermuted rows", {{"B", r.B}, {"H", s.H}}, kBf16, kDsp);
  add_foreign_weights(c, s, t);
  return out;
}

std::vector<PhaseTerms> pipelined_backward(const Context& c, const MoeShape& s) {
  const Rounds r = rounds_of(c, s);
  const bool store = c.run.dispatch_mode == DispatchMode::Store;
  std::vector<PhaseTerms> out;
  // Store: the first backward round (the last forward round) still has every round's saved
  // activations. Recompute: every round re-dispatches and recomputes its own chunk.
  out.push_back(PhaseTerms{round_name(store ? r.n - 1 : 0), round_folds(r), c.list()});
  TermList& t = out.back().terms;
  add_route(s, t);
  add_round_buffers(s, r, t);
  if (store) add_saved_experts(s, s.rows_recv, "R_store", t, " (saved, all rounds)");
  else add_saved_experts(s, r.B, "B", t, " (round, recomputed)");
  t.add("round grad buffers", {{"D", r.D}, {"2(B+C)", 2 * (r.B + r.C)}, {"H", s.H}}, kBf16, kDsp);
  add_expert_grads(s, r.B, "B", t);
  t.add("d norm-2 output accumulator", {{"T", s.T}, {"H", s.H}}, kFp32, kDsp);
  add_foreign_weights(c, s, t);
  add_foreign_weight_grads(c, s, t);
  return out;
}

}  // namespace

std::vector<PhaseTerms> moe_forward_phases(const Context& c, int64_t layer) {
  return worst_rank(c, layer, [&](const MoeShape& s) { return pipelined(c) ? pipelined_forward(c, s, false) : ep_phases(c, s, false); });
}

std::vector<PhaseTerms> moe_recompute_phases(const Context& c, int64_t layer) {
  return worst_rank(c, layer, [&](const MoeShape& s) { return pipelined(c) ? pipelined_forward(c, s, true) : ep_phases(c, s, true); });
}

std::vector<PhaseTerms> moe_backward_phases(const Context& c, int64_t layer) {
  return worst_rank(c, layer, [&](const MoeShape& s) { return pipelined(c) ? pipelined_backward(c, s) : ep_backward(c, s); });
}

}  // namespace flatpeak::planner
