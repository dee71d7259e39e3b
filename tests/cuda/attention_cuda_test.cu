// CPU vs CUDA for causal GQA attention, forward and backward, both kernel sets:
// - the reference kernels: f32 and bf16, d = 32, 4 query heads over 2 kv heads, T not a multiple
//   of the CPU tile or the CUDA key tile;
// - the tensor-core kernels (bf16, 64-row tiles): d = 64 and 128, 8 query heads over 2 kv heads,
//   T in {1, 15, 200, 1000} (none a multiple of the tile), against the CPU and against the
//   reference CUDA kernels on the same inputs; and Auto at bf16 d = 32 (which takes them).
// Tolerances: out, d_q, d_k, d_v within rel 1e-5 (+ 1e-5 of the largest magnitude) in f32 and
// rel 1e-2 (+ 1e-3) in bf16 storage for the reference kernels; rel 1e-2 (+ 5e-3) for the
// tensor-core ones, which round P and dS to bf16 (unit roundoff 2^-8) as GEMM operands: an
// output's error is then bounded by 2^-8 · Σ|p·v| (Σ|dS·k| for the gradients), not by the result,
// which cancels (Σ_j dS_ij = 0 exactly); the same kernels run on the host (the emulation of
// tests/unit/executor_attention_tc_emulation_test.cpp, which rounds as they do) reached 3.0e-3 of
// the largest magnitude over these cases (d_q at T = 1000, d = 128).
// lse [a, T] fp32 within rel 1e-5 (+ 1e-5) for the reference kernels and rel 1e-4 (+ 1e-5) for
// the tensor-core ones (scores sum exact bf16 products in fp32 in the tensor cores' order, not
// the CPU's; P's rounding does not reach lse). At T = 1, d_q and d_k are zero in exact arithmetic
// (the one key has probability 1, so dS = dP − D = 0): checked as |x| <= 1e-3, rounding noise.
// Also: asking for the tensor-core kernels where they do not apply is an argument error with
// its exact text, and T = 0 queues nothing. Random non-zero inputs from a fixed seed; exit 77
// (skipped) without a CUDA device.
#include <cmath>
#include <cstdio>
#include <exception>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda_test_util.h"
#include "executor/cuda/attention_tc_cuda.h"
#include "executor/cuda/ops_cuda.h"

using namespace flatpeak;
using namespace flatpeak::exec;
using namespace flatpeak::cuda;
using namespace flatpeak::cuda::test;

namespace {

// The tensor-core kernels' bounds (see the top of the file).
constexpr Tol kTensorCoreTol{1e-2, 5e-3};
constexpr Tol kTensorCoreLseTol{1e-4, 1e-5};

struct Case {
  DType dtype = DType::BF16;
  int64_t tokens = 0;
  int64_t q_heads = 0;
  int64_t kv_heads = 0;
  int64_t head_dim = 0;
  int64_t cpu_tile = 16;
};

struct Outputs {
  std::vector<float> out, lse, d_q, d_k, d_v;  // [T, a, d], [a, T], [T, a, d], [T, g, d] x2
};

bool uses_tensor_cores(const Case& c, AttentionKernel kernel) {
  AttentionArgs a;
  a.dtype = c.dtype;
  a.head_dim = c.head_dim;
  return kernel == AttentionKernel::TensorCore ||
         (kernel == AttentionKernel::Auto && cuda_detail::attention_tc_applies(a) &&
          cuda_detail::attention_tc_shared_bytes(c.head_dim) <=
              cuda_detail::device_shared_bytes_per_block_optin());
}

// Largest |x|: for outputs that are zero in exact arithmetic.
float max_abs(const std::vector<float>& x) {
  float m = 0.0f;
  for (float v : x) m = std::fmax(m, std::fabs(v));
  return m;
}

void compare(const std::string& name, const Outputs& got, const Outputs& want, Tol tol,
             Tol lse_tol, int64_t tokens) {
  expect_close(name + "/out", got.out, want.out, tol);
  expect_close(name + "/lse", got.lse, want.lse, lse_tol);
  if (tokens == 1) {
    const float dq = max_abs(got.d_q), dk = max_abs(got.d_k);
    expect_true(name + "/d_q", dq <= 1e-3f, "max |d_q| " + std::to_string(dq) + " (zero exactly)");
    expect_true(name + "/d_k", dk <= 1e-3f, "max |d_k| " + std::to_string(dk) + " (zero exactly)");
  } else {
    expect_close(name + "/d_q", got.d_q, want.d_q, tol);
    expect_close(name + "/d_k", got.d_k, want.d_k, tol);
  }
  expect_close(name + "/d_v", got.d_v, want.d_v, tol);
}

// Runs the CPU op once and each kernel set on the device; every device run against the CPU,
// and (with two kernel sets) the first against the second.
void test_attention(DeviceAllocator& alloc, const Case& c,
                    const std::vector<AttentionKernel>& kernels) {
  const int64_t T = c.tokens, a_heads = c.q_heads, g_heads = c.kv_heads, d = c.head_dim;
  const DType dtype = c.dtype;
  Rng rng(51);
  HostTensor q = HostTensor::from(rng.uniform(T * a_heads * d), dtype);    // [T, a, d]
  HostTensor k = HostTensor::from(rng.uniform(T * g_heads * d), dtype);    // [T, g, d]
  HostTensor v = HostTensor::from(rng.uniform(T * g_heads * d), dtype);    // [T, g, d]
  HostTensor d_out = HostTensor::from(rng.uniform(T * a_heads * d), dtype);  // [T, a, d]
  HostTensor out = HostTensor::from(std::vector<float>(static_cast<size_t>(T * a_heads * d)), dtype);
  HostTensor d_q = out;
  HostTensor d_k = HostTensor::from(std::vector<float>(static_cast<size_t>(T * g_heads * d)), dtype);
  HostTensor d_v = d_k;
  std::vector<float> lse(static_cast<size_t>(a_heads * T));  // [a, T]
  AttentionArgs args;
  args.dtype = dtype;
  args.tokens = T;
  args.q_heads = a_heads;
  args.kv_heads = g_heads;
  args.head_dim = d;
  args.tile_rows = c.cpu_tile;
  std::vector<float> ws(static_cast<size_t>(attention_workspace_bytes(args) / 4));
  args.q = q.data();
  args.k = k.data();
  args.v = v.data();
  args.out = out.data();
  args.lse = lse.data();
  args.workspace = ws.data();
  args.d_out = d_out.data();
  args.d_q = d_q.data();
  args.d_k = d_k.data();
  args.d_v = d_v.data();
  attention_forward_cpu(args);
  attention_backward_cpu(args);
  const Outputs cpu{out.values(), lse, d_q.values(), d_k.values(), d_v.values()};

  DeviceBuffer g_q = upload(alloc, q), g_k = upload(alloc, k), g_v = upload(alloc, v);
  DeviceBuffer g_dout = upload(alloc, d_out);
  const int64_t qo_bytes = T * a_heads * d * dtype_bytes(dtype);
  const int64_t kv_bytes = T * g_heads * d * dtype_bytes(dtype);
  const std::string base = "attention/" + std::string(dtype_name(dtype)) + "/d" +
                           std::to_string(d) + "/T" + std::to_string(T);
  std::vector<Outputs> runs;
  for (AttentionKernel kernel : kernels) {
    DeviceBuffer g_out(alloc, qo_bytes, Category::Activations);             // [T, a, d]
    DeviceBuffer g_lse(alloc, a_heads * T * 4, Category::Activations);      // [a, T] fp32
    DeviceBuffer g_dq(alloc, qo_bytes, Category::Activations);              // [T, a, d]
    DeviceBuffer g_dk(alloc, kv_bytes, Category::Activations);              // [T, g, d]
    DeviceBuffer g_dv(alloc, kv_bytes, Category::Activations);              // [T, g, d]
    DeviceBuffer g_ws(alloc, attention_backward_workspace_bytes_cuda(args), Category::Activations);
    AttentionArgs ga = args;
    ga.q = g_q.raw();
    ga.k = g_k.raw();
    ga.v = g_v.raw();
    ga.out = g_out.raw();
    ga.lse = g_lse.as<float>();
    ga.workspace = nullptr;
    attention_forward_cuda(ga, nullptr, kernel);
    ga.d_out = g_dout.raw();
    ga.d_q = g_dq.raw();
    ga.d_k = g_dk.raw();
    ga.d_v = g_dv.raw();
    ga.workspace = g_ws.as<float>();
    attention_backward_cuda(ga, nullptr, kernel);
    runs.push_back({download(g_out, dtype).values(), download<float>(g_lse, a_heads * T),
                    download(g_dq, dtype).values(), download(g_dk, dtype).values(),
                    download(g_dv, dtype).values()});
    const bool tc = uses_tensor_cores(c, kernel);
    compare(base + "/" + attention_kernel_name(kernel) + " vs cpu", runs.back(), cpu,
            tc ? kTensorCoreTol : Tol::of(dtype), tc ? kTensorCoreLseTol : Tol::f32(), T);

    // T = 0 queues nothing and throws nothing, on the same (valid) pointers.
    ga.tokens = 0;
    attention_forward_cuda(ga, nullptr, kernel);
    attention_backward_cuda(ga, nullptr, kernel);
  }
  if (runs.size() == 2) {
    compare(base + "/" + attention_kernel_name(kernels[0]) + " vs " +
                attention_kernel_name(kernels[1]),
            runs[0], runs[1], kTensorCoreTol, kTensorCoreLseTol, T);
  }
}

void expect_rejected(DType dtype, int64_t head_dim, const std::string& want) {
  AttentionArgs a;
  a.dtype = dtype;
  a.tokens = 4;
  a.q_heads = 2;
  a.kv_heads = 1;
  a.head_dim = head_dim;
  int dummy = 0;  // never dereferenced: the check throws before anything is queued
  a.q = a.k = a.v = &dummy;
  a.out = &dummy;
  a.lse = reinterpret_cast<float*>(&dummy);
  std::string got = "(no exception)";
  try {
    attention_forward_cuda(a, nullptr, AttentionKernel::TensorCore);
  } catch (const std::invalid_argument& e) {
    got = e.what();
  }
  expect_true("attention/tensor-core rejects " + std::string(dtype_name(dtype)) + " d" +
                  std::to_string(head_dim),
              got == want, got);
}

}  // namespace

int main() {
  if (const int rc = skip_unless_device(); rc != 0) return rc;
  try {
    for (int64_t d : {64, 128}) {
      std::printf("tensor-core shared memory at d = %lld: forward %lld, dK/dV %lld, dQ %lld bytes\n",
                  static_cast<long long>(d),
                  static_cast<long long>(cuda_detail::attention_forward_tc_shared_bytes(d)),
                  static_cast<long long>(cuda_detail::attention_dkv_tc_shared_bytes(d)),
                  static_cast<long long>(cuda_detail::attention_dq_tc_shared_bytes(d)));
    }
    DeviceAllocator alloc;
    // Reference kernels (any dtype); at bf16 d = 32, Auto takes the tensor-core ones.
    for (int64_t T : {77, 300}) {  // 300: more than one 128-key tile of the reference kernel
      test_attention(alloc, {DType::F32, T, 4, 2, 32, 16}, {AttentionKernel::Reference});
      test_attention(alloc, {DType::F32, T, 4, 2, 32, 16}, {AttentionKernel::Auto});
      test_attention(alloc, {DType::BF16, T, 4, 2, 32, 16},
                     {AttentionKernel::Auto, AttentionKernel::Reference});
    }
    // Tensor-core kernels at gpt-oss-like head dims, every tail: T < 16, T < 64, T % 64 != 0.
    for (int64_t d : {64, 128}) {
      for (int64_t T : {1, 15, 200, 1000}) {
        test_attention(alloc, {DType::BF16, T, 8, 2, d, 64},
                       {AttentionKernel::TensorCore, AttentionKernel::Reference});
      }
    }
    expect_rejected(DType::F32, 64,
                    "attention: the tensor-core kernel needs dtype bf16 and head_dim a multiple of "
                    "16, at most 128 (got dtype f32, head_dim 64)");
    expect_rejected(DType::BF16, 40,
                    "attention: the tensor-core kernel needs dtype bf16 and head_dim a multiple of "
                    "16, at most 128 (got dtype bf16, head_dim 40)");
    expect_rejected(DType::BF16, 144,
                    "attention: the tensor-core kernel needs dtype bf16 and head_dim a multiple of "
                    "16, at most 128 (got dtype bf16, head_dim 144)");
  } catch (const std::exception& e) {
    std::printf("FAIL: %s\n", e.what());
    return 1;
  }
  return finish();
}
