// LLEP's lending (dispatch_internal.h): the native rank of every expert that LLA gives helpers
// sends its weights into the helpers' borrowed-expert slots (the uncapped pass sizes them by
// S_p, the capped passes by the launch-time pool S_cap), and after the backward the helpers'
// fp32 gradients of those experts come back and are added to the native accumulators.
#include "executor/schedules/dispatch_internal.h"

#include <functional>
#include <stdexcept>
#include <vector>

namespace flatpeak::exec::dispatch_detail {

namespace {

// Adds the fp32 gradient g ([P]: gate/up, down, then any biases) a helper returned for expert e,
// native on this rank, into its accumulators.
void add_returned_grads(const Dims& d, LayerData& L, int64_t e, const float* g) {
  float* gu = L.dw_gate_up.data<float>() + (e - d.me * d.L) * 2 * d.F * d.H;
  float* dn = L.dw_down.data<float>() + (e - d.me * d.L) * d.H * d.F;
  for (int64_t i = 0; i < 2 * d.F * d.H; ++i) gu[i] += g[i];
  for (int64_t i = 0; i < d.H * d.F; ++i) dn[i] += g[2 * d.F * d.H + i];
  if (d.Pb == 0) return;
  float* db = L.db_expert.data<float>() + (e - d.me * d.L) * d.Pb;
  for (int64_t i = 0; i < d.Pb; ++i) db[i] += g[3 * d.F * d.H + i];
}

}  // namespace

Tensor borrow_weights(Communicator& comm, TrackingAllocator& alloc, const Dims& d, const RowPlan& p, const LayerData& L,
                      int64_t slots) {
  if (static_cast<int64_t>(p.foreign.size()) > slots) throw std::logic_error("dispatch schedule: more borrowed experts than weight slots");
  Tensor w(alloc, DType::BF16, {slots, d.P}, kDsp);  // [S, P] bf16
  if (p.lla_ran)
    lend_weights(comm, d, p, L.w_gate_up.raw(), L.w_down.raw(), L.b_expert.empty() ? nullptr : L.b_expert.raw(),
                 w.empty() ? nullptr : w.raw());
  return w;
}

// LLEP: the helpers' fp32 gradients of every lent expert back to its native rank ([S_sent, P]
// slots), which adds them to its fp32 accumulators in helper-rank order.
void return_weight_grads(Communicator& comm, const Dims& d, const RowPlan& p, LayerData& L, const Tensor& foreign_dw, Tensor& lent_dw) {
  send_lent_grads(comm, d, p, foreign_dw.empty() ? nullptr : foreign_dw.raw(), lent_dw.empty() ? nullptr : lent_dw.raw());
  for (int64_t e = d.me * d.L; e < (d.me + 1) * d.L; ++e)
    for (int64_t slot : p.lent_slot[z(e)]) add_returned_grads(d, L, e, lent_dw.data<float>() + slot * d.P);
}

// LLEP, capped: the helpers' fp32 gradients of every lent expert back to its native rank one
// (expert, helper) pair at a time through one [1, P] staging slot, added in helper-rank order
// (the same sums in the same order as the [S_sent, P] way, in a buffer that does not depend on
// the routing).
void return_weight_grads_staged(Communicator& comm, const Dims& d, const RowPlan& p, LayerData& L, const Tensor& foreign_dw,
                                Tensor& staging) {
  send_lent_grads_staged(comm, d, p, foreign_dw.empty() ? nullptr : foreign_dw.raw(), staging.empty() ? nullptr : staging.raw(),
                         [&](int64_t e) { add_returned_grads(d, L, e, staging.data<float>()); });
}

void lend_weights(Communicator& comm, const Dims& d, const RowPlan& p, const void* w_gate_up, const void* w_down,
                  const void* b_expert, void* foreign) {
  const std::vector<int64_t> none(z(d.ep), 0);
  // Each part of an expert's [P]: its source tensor, elements per expert, offset in the slot.
  struct Part {
    const void* src;
    int64_t count, offset;
  };
  std::vector<Part> parts{{w_gate_up, 2 * d.F * d.H, 0}, {w_down, d.H * d.F, 2 * d.F * d.H}};
  if (d.Pb > 0) {
    if (b_expert == nullptr) throw std::logic_error("dispatch schedule: expert biases to lend but no bias tensor");
    parts.push_back({b_expert, d.Pb, 3 * d.F * d.H});
  }
  for (int64_t e = 0; e < d.E; ++e) {
    if (p.helpers[z(e)].empty()) continue;
    const int64_t native = e / d.L;
    for (const Part& part : parts) {
      const int64_t count = part.count;
      std::vector<int64_t> sc = none, sd = none, rc = none, rd = none;
      if (d.me == native)
        for (int64_t h : p.helpers[z(e)]) {
          sc[z(h)] = count;
          sd[z(h)] = (e - native * d.L) * count;
        }
      if (p.local_of[z(e)] >= d.L) {
        rc[z(native)] = count;
        rd[z(native)] = (p.local_of[z(e)] - d.L) * d.P + part.offset;
      }
      exchange(comm, part.src, sc, sd, foreign, rc, rd, 1, DType::BF16);
    }
  }
}

void send_lent_grads(Communicator& comm, const Dims& d, const RowPlan& p, const void* foreign_dw, void* lent_dw) {
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
    exchange(comm, foreign_dw, sc, sd, lent_dw, rc, rd, d.P, DType::F32);
  }
}

void send_lent_grads_staged(Communicator& comm, const Dims& d, const RowPlan& p, const void* foreign_dw, void* staging,
                            const std::function<void(int64_t e)>& add) {
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
      exchange(comm, d.me == h ? foreign_dw : nullptr, sc, sd, d.me == native ? staging : nullptr, rc, rd, d.P, DType::F32);
      if (d.me == native) add(e);
    }
  }
}

}  // namespace flatpeak::exec::dispatch_detail
