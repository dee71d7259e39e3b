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

template <class G>
void update_range(const AdamWArgs& a, const AdamWScalars& s, int64_t begin, int64_t end) {
  const G* g = static_cast<const G*>(a.grad);
  float* p = a.master;
  float* m = a.m;
  float* v = a.v;
  for (int64_t i = begin; i < end; ++i) adamw_update(p[i], m[i], v[i], to_f32(g[i]), s);
  if (a.param_out != nullptr) {
    for (int64_t i = begin; i < end; ++i) a.param_out[i] = f32_to_bf16(p[i]);
  }
}

void update(const AdamWArgs& a, const AdamWScalars& s, int64_t begin, int64_t end) {
  if (a.grad_dtype == DType::BF16) {
    update_range<Bf16>(a, s, begin, end);
  } else {
    update_range<float>(a, s, begin, end);
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
