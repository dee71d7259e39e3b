// The dispatch working set of one MoE layer on the worst rank (reference/dispatch.md §3–§5):
// routing tensors, dispatch/combine buffers, expert activations and their gradients, LLEP's
// foreign expert weights. Standard EP (and LLEP without a cap) sizes receive buffers by the
// layer's received rows R; PipelinedLLEP sizes per-round buffers once by the cap C.
// Symbols: T*k rows sent, R rows received, C cap, B rows received per round, D rounds in flight,
// F expert FFN width, p_e parameters of one expert. bf16 unless stated.
#include <string>

#include "memory_model.h"

namespace flatpeak::planner {

namespace {

constexpr Category kDsp = Category::Dispatch;

struct MoeShape {
  int64_t T, H, E, k, F, rows_sent, rows_recv;
  const MoeLoad* load;
};

MoeShape shape_of(const Context& c, int64_t layer) {
  const Workload& w = c.work;
  const MoeLoad& load = w.load_of(w.moe_index[static_cast<size_t>(layer)]);
  const int64_t R = c.run.llep ? load.recv_rows_llep : load.recv_rows_ep;
  return MoeShape{w.tokens, c.model.hidden_size, c.model.num_experts, c.model.top_k,
                  c.model.expert_ffn_width, load.send_rows, R, &load};
}

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
  t.add("LLEP foreign expert weights", {{"S_p", s.load->foreign_experts}, {"p_e", c.work.expert_params_each}}, kBf16, kDsp);
}

void add_foreign_weight_grads(const Context& c, const MoeShape& s, TermList& t) {
  if (!c.run.llep) return;
  t.add("LLEP foreign weight grads", {{"S_p", s.load->foreign_experts}, {"p_e", c.work.expert_params_each}}, kBf16, kDsp);
  t.add("LLEP lent weight grads received", {{"S_sent", s.load->lent_experts}, {"p_e", c.work.expert_params_each}}, kBf16, kDsp);
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

void add_dispatch_buffers(const Context& c, const MoeShape& s, TermList& t) {
  t.add("dispatch send buffer", {{"T*k", s.rows_sent}, {"H", s.H}}, kBf16, kDsp);
  if (c.run.llep) t.add("LLEP repeated tokens", {{"T*k", s.rows_sent}, {"H", s.H}}, kBf16, kDsp);
  t.add("dispatch receive buffer", {{"R", s.rows_recv}, {"H", s.H}}, kBf16, kDsp);
  t.add("received probs", {{"R", s.rows_recv}}, kFp32, kDsp);
}

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
  if (!recompute) phase("moe/route");
  {
    TermList& t = phase("moe/dispatch");
    add_meta(s, t);
    add_dispatch_buffers(c, s, t);
    add_foreign_weights(c, s, t);
  }
  {
    TermList& t = phase("moe/experts");
    add_meta(s, t);
    add_saved_experts(s, s.rows_recv, "R", t, recompute ? " (saved)" : "");
    if (recompute) t.add("expert fc2 out", {{"R", s.rows_recv}, {"H", s.H}}, kBf16, kDsp);
    add_foreign_weights(c, s, t);
  }
  {
    TermList& t = phase("moe/combine");
    add_meta(s, t);
    if (recompute) add_saved_experts(s, s.rows_recv, "R", t, " (saved)");
    add_combine_buffers(s, t);
    add_foreign_weights(c, s, t);
  }
  return out;
}

std::vector<PhaseTerms> ep_backward(const Context& c, const MoeShape& s) {
  std::vector<PhaseTerms> out;
  auto phase = [&](const char* suffix) -> TermList& {
    out.push_back(PhaseTerms{suffix, "", c.list()});
    TermList& t = out.back().terms;
    add_route(s, t);
    add_meta(s, t);
    add_foreign_weights(c, s, t);
    return t;
  };
  {
    TermList& t = phase("moe/combine");
    add_saved_experts(s, s.rows_recv, "R", t, " (saved)");
    t.add("d combine rows", {{"T*k", s.rows_sent}, {"H", s.H}}, kBf16, kDsp);
    t.add("d received rows", {{"R", s.rows_recv}, {"H", s.H}}, kBf16, kDsp);
  }
  {
    TermList& t = phase("moe/experts");
    add_saved_experts(s, s.rows_recv, "R", t, " (saved)");
    add_expert_grads(s, s.rows_recv, "R", t);
    add_foreign_weight_grads(c, s, t);
  }
  {
    TermList& t = phase("moe/dispatch");
    t.add("d expert input", {{"R", s.rows_recv}, {"H", s.H}}, kBf16, kDsp);
    t.add("d dispatch rows", {{"T*k", s.rows_sent}, {"H", s.H}}, kBf16, kDsp);
    t.add("d norm-2 output accumulator", {{"T", s.T}, {"H", s.H}}, kFp32, kDsp);
    add_foreign_weight_grads(c, s, t);
  }
  return out;
}

// ---- PipelinedLLEP: rounds of at most C copies per source, buffers allocated once at launch.

struct Rounds {
  int64_t C, B, D, n;
};

Rounds rounds_of(const Context& c, const MoeShape& s) {
  return Rounds{s.load->chunk_cap_rows, s.load->round_recv_rows, c.run.dispatch_depth, s.load->rounds};
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
  if (recompute) add_saved_experts(s, s.rows_recv, "R", t, " (saved, all rounds)");
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
  if (store) add_saved_experts(s, s.rows_recv, "R", t, " (saved, all rounds)");
  else add_saved_experts(s, r.B, "B", t, " (round, recomputed)");
  t.add("round grad buffers", {{"D", r.D}, {"2(B+C)", 2 * (r.B + r.C)}, {"H", s.H}}, kBf16, kDsp);
  add_expert_grads(s, r.B, "B", t);
  t.add("d norm-2 output accumulator", {{"T", s.T}, {"H", s.H}}, kFp32, kDsp);
  add_foreign_weights(c, s, t);
  add_foreign_weight_grads(c, s, t);
  return out;
}

bool pipelined(const Context& c) { return c.run.llep && c.run.chunk_cap_rows > 0; }

}  // namespace

std::vector<PhaseTerms> moe_forward_phases(const Context& c, int64_t layer) {
  const MoeShape s = shape_of(c, layer);
  return pipelined(c) ? pipelined_forward(c, s, false) : ep_phases(c, s, false);
}

std::vector<PhaseTerms> moe_recompute_phases(const Context& c, int64_t layer) {
  const MoeShape s = shape_of(c, layer);
  return pipelined(c) ? pipelined_forward(c, s, true) : ep_phases(c, s, true);
}

std::vector<PhaseTerms> moe_backward_phases(const Context& c, int64_t layer) {
  const MoeShape s = shape_of(c, layer);
  return pipelined(c) ? pipelined_backward(c, s) : ep_backward(c, s);
}

}  // namespace flatpeak::planner
