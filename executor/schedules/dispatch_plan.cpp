// Where every copy of the dispatch goes (dispatch_internal.h): the row plan every rank derives
// from the all-gathered counts (LLEP's least-loaded ranges, or each expert's native rank), this
// rank's send order, the grouping of received rows into expert order, and the all-to-allv of
// rows that the uncapped dispatch, the rounds and the lending all move their data with.
#include "executor/schedules/dispatch_internal.h"

#include <algorithm>
#include <utility>
#include <vector>

namespace flatpeak::exec::dispatch_detail {

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

}  // namespace flatpeak::exec::dispatch_detail
