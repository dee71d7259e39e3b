#include <string>

#include "executor/cpu/op_util.h"
#include "executor/ops/permute.h"

namespace flatpeak::exec {
namespace {

void check(const PermuteArgs& a) {
  require(a.tokens >= 0 && a.top_k > 0 && a.experts > 0 && a.hidden > 0, "permute",
          "need tokens >= 0 and top_k, experts, hidden > 0");
  require(a.slot_to_row && a.row_to_slot, "permute", "needs slot_to_row and row_to_slot");
}

template <class T>
void copy_row(const T* src, T* dst, int64_t hidden) {
  for (int64_t h = 0; h < hidden; ++h) dst[h] = src[h];
}

}  // namespace

void moe_route_cpu(const PermuteArgs& a) {
  check(a);
  require(a.topk_ids && a.expert_counts, "permute", "routing needs topk_ids and expert_counts");
  const int64_t copies = a.tokens * a.top_k;
  for (int64_t e = 0; e < a.experts; ++e) a.expert_counts[e] = 0;
  for (int64_t i = 0; i < copies; ++i) {
    const int64_t e = a.topk_ids[i];
    if (e < 0 || e >= a.experts) {
      fail("permute", "topk_ids[" + std::to_string(i) + "] = " + std::to_string(e) +
                      " not in 0.." + std::to_string(a.experts - 1));
    }
    ++a.expert_counts[e];
  }
  // Counting sort: each expert's first row, then copies in (token, slot) order.
  int64_t next_row = 0;
  for (int64_t e = 0; e < a.experts; ++e) {
    const int64_t count = a.expert_counts[e];
    a.expert_counts[e] = next_row;  // temporarily: the expert's next free row
    next_row += count;
  }
  for (int64_t i = 0; i < copies; ++i) {
    const int64_t row = a.expert_counts[a.topk_ids[i]]++;
    a.slot_to_row[i] = static_cast<int32_t>(row);
    a.row_to_slot[row] = static_cast<int32_t>(i);
  }
  int64_t start = 0;
  for (int64_t e = 0; e < a.experts; ++e) {  // next free row = end; turn back into counts
    const int64_t end = a.expert_counts[e];
    a.expert_counts[e] = end - start;
    start = end;
  }
}

void permute_forward_cpu(const PermuteArgs& a) {
  check(a);
  require(a.x && a.x_perm, "permute", "forward needs x and x_perm");
  dispatch_compute(a.dtype, "permute", [&](auto tag) {
    using T = decltype(tag);
    const T* x = static_cast<const T*>(a.x);
    T* xp = static_cast<T*>(a.x_perm);
    for (int64_t row = 0; row < a.tokens * a.top_k; ++row) {
      const int64_t t = a.row_to_slot[row] / a.top_k;
      copy_row(x + t * a.hidden, xp + row * a.hidden, a.hidden);
    }
  });
}

void permute_backward_cpu(const PermuteArgs& a) {
  check(a);
  require(a.d_x_perm && a.d_x, "permute", "backward needs d_x_perm and d_x");
  dispatch_compute(a.dtype, "permute", [&](auto tag) {
    using T = decltype(tag);
    const T* dxp = static_cast<const T*>(a.d_x_perm);
    T* dx = static_cast<T*>(a.d_x);
    for (int64_t t = 0; t < a.tokens; ++t) {
      for (int64_t h = 0; h < a.hidden; ++h) {
        float sum = 0.0f;
        for (int64_t s = 0; s < a.top_k; ++s) {
          sum += to_f32(dxp[a.slot_to_row[t * a.top_k + s] * a.hidden + h]);
        }
        store_f32(&dx[t * a.hidden + h], sum);
      }
    }
  });
}

void unpermute_forward_cpu(const PermuteArgs& a) {
  check(a);
  require(a.y_perm && a.y_slots, "permute", "unpermute needs y_perm and y_slots");
  dispatch_compute(a.dtype, "permute", [&](auto tag) {
    using T = decltype(tag);
    const T* yp = static_cast<const T*>(a.y_perm);
    T* ys = static_cast<T*>(a.y_slots);
    for (int64_t i = 0; i < a.tokens * a.top_k; ++i) {
      copy_row(yp + a.slot_to_row[i] * a.hidden, ys + i * a.hidden, a.hidden);
    }
  });
}

void unpermute_backward_cpu(const PermuteArgs& a) {
  check(a);
  require(a.d_y_slots && a.d_y_perm, "permute", "unpermute backward needs d_y_slots and d_y_perm");
  dispatch_compute(a.dtype, "permute", [&](auto tag) {
    using T = decltype(tag);
    const T* dys = static_cast<const T*>(a.d_y_slots);
    T* dyp = static_cast<T*>(a.d_y_perm);
    for (int64_t row = 0; row < a.tokens * a.top_k; ++row) {
      copy_row(dys + a.row_to_slot[row] * a.hidden, dyp + row * a.hidden, a.hidden);
    }
  });
}

}  // namespace flatpeak::exec
