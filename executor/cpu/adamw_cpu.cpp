#include <algorithm>
#include <thread>
#include <vector>

#include "executor/cpu/op_util.h"
#include "executor/ops/adamw.h"

namespace flatpeak::exec {
namespace {

void check(const AdamWArgs& a) {
  require(a.elems >= 0, "adamw", "elems must be >= 0");
  require(a.step >= 1, "adamw", "step must be >= 1");
  require(a.master && a.grad && a.m && a.v, "adamw", "needs master, grad, m and v");
  require(a.grad_dtype == DType::F32 || a.grad_dtype == DType::BF16, "adamw",
          "grad_dtype must be f32 or bf16");
}

// Gradient element i as fp32; bf16 is read through its raw bits so the loop vectorises.
inline float grad_at(const float* __restrict g, int64_t i) { return g[i]; }
inline float grad_at(const uint16_t* __restrict g, int64_t i) { return to_f32(Bf16{g[i]}); }

// One pass over memory: each element is read, updated and (optionally) written as bf16 at once.
// The arrays never overlap (restrict), which lets the compiler vectorise without versioning.
template <class G, bool kWriteBf16>
void update_range(const AdamWArgs& a, const AdamWScalars scalars, int64_t begin, int64_t end) {
  const AdamWScalars s = scalars;  // a local copy: no store in the loop can alias it
  const G* __restrict g = static_cast<const G*>(a.grad);
  float* __restrict p = a.master;
  float* __restrict m = a.m;
  float* __restrict v = a.v;
  uint16_t* __restrict out = reinterpret_cast<uint16_t*>(a.param_out);
  for (int64_t i = begin; i < end; ++i) {
    float pi = p[i];
    float mi = m[i];
    float vi = v[i];
    adamw_update(pi, mi, vi, grad_at(g, i), s);
    p[i] = pi;
    m[i] = mi;
    v[i] = vi;
    if (kWriteBf16) out[i] = f32_to_bf16(pi).bits;
  }
}

void update(const AdamWArgs& a, const AdamWScalars& s, int64_t begin, int64_t end) {
  const bool bf16_grad = a.grad_dtype == DType::BF16;
  if (a.param_out != nullptr) {
    bf16_grad ? update_range<uint16_t, true>(a, s, begin, end) : update_range<float, true>(a, s, begin, end);
  } else {
    bf16_grad ? update_range<uint16_t, false>(a, s, begin, end)
              : update_range<float, false>(a, s, begin, end);
  }
}

}  // namespace

void adamw_step_cpu(const AdamWArgs& a) {
  check(a);
  update(a, adamw_scalars(a), 0, a.elems);
}

void adamw_step_cpu_threaded(const AdamWArgs& a, int threads) {
  check(a);
  require(threads >= 1, "adamw", "threads must be >= 1");
  const AdamWScalars s = adamw_scalars(a);
  const int64_t parts = std::min<int64_t>(threads, std::max<int64_t>(a.elems, 1));
  // Parts start on multiples of 16 elements (64 bytes) so threads never share a cache line.
  const int64_t per_part = (a.elems + parts - 1) / parts;
  const int64_t chunk = (per_part + 15) / 16 * 16;
  std::vector<std::thread> pool;
  for (int64_t i = 1; i < parts; ++i) {
    const int64_t begin = std::min(a.elems, i * chunk);
    const int64_t end = std::min(a.elems, begin + chunk);
    if (begin < end) pool.emplace_back([&a, &s, begin, end] { update(a, s, begin, end); });
  }
  update(a, s, 0, std::min(a.elems, chunk));
  for (std::thread& t : pool) t.join();
}

}  // namespace flatpeak::exec
