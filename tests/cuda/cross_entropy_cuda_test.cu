// CPU vs CUDA for the blocked cross-entropy: forward (lse, loss), backward from the saved lse
// (d_x, d_w accumulated) and gradients-in-forward, with T and V not multiples of their blocks and
// some ignored targets. Tolerances: lse, loss, d_w (fp32) rel 1e-5 (+ 1e-5 of the largest
// magnitude; d_w in bf16 + 1e-3, its addends being bf16-rounded dz); d_x rel 1e-5 in f32 and
// 1e-2 (+ 1e-3) in bf16 storage. On the device the fused
// variant must equal forward + backward bitwise (same kernels, same order), as on the CPU; with one
// vocab block too, where it reuses the forward's logits; each with and without a head bias (its
// gradient at d_w's tolerance). The bias cases were added after the H200 run of 2026-12-04.
// Random non-zero inputs from a fixed seed; exit 77 (skipped) without a CUDA device.
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "cuda_test_util.h"
#include "executor/cuda/cublas_context.h"
#include "executor/cuda/ops_cuda.h"

using namespace flatpeak;
using namespace flatpeak::exec;
using namespace flatpeak::cuda;
using namespace flatpeak::cuda::test;

namespace {

constexpr int64_t kTokens = 150, kVocab = 1000, kHidden = 64;

struct Outputs {
  std::vector<float> lse, loss, d_w;
  HostTensor d_x;
  std::vector<float> d_bias;  // [V] fp32, with a head bias
};

// vocab_block_rows: 256 (several vocab blocks), or kVocab: one block, where the fused pass reads
// the forward's logits instead of recomputing them (and must still equal forward + backward).
// with_bias: a head bias [V] in the storage dtype (logits x·Wᵀ + b), its gradient compared too.
void test_cross_entropy(DeviceAllocator& alloc, const CublasContext& blas, DType dtype, int64_t vocab_block_rows,
                        bool with_bias) {
  Rng rng(31);
  HostTensor x = HostTensor::from(rng.uniform(kTokens * kHidden), dtype);
  HostTensor w = HostTensor::from(rng.uniform(kVocab * kHidden), dtype);
  std::vector<int32_t> targets = rng.ints(kTokens, 0, static_cast<int32_t>(kVocab - 1));
  for (int64_t t = 5; t < kTokens; t += 17) targets[static_cast<size_t>(t)] = -1;  // ignored
  const std::vector<float> d_w0 = rng.uniform(kVocab * kHidden, 0.001f, 0.01f);
  HostTensor bias = HostTensor::from(rng.uniform(kVocab), dtype);
  const std::vector<float> d_bias0(static_cast<size_t>(kVocab), 0.0f);

  CrossEntropyArgs a;
  a.dtype = dtype;
  a.tokens = kTokens;
  a.vocab = kVocab;
  a.hidden = kHidden;
  a.grad_scale = 1.0f / static_cast<float>(kTokens);
  a.token_block_rows = 64;
  a.vocab_block_rows = vocab_block_rows;

  // CPU: forward, then backward from the saved lse.
  Outputs cpu{std::vector<float>(kTokens), std::vector<float>(kTokens), d_w0,
              HostTensor::from(std::vector<float>(static_cast<size_t>(kTokens * kHidden)), dtype)};
  std::vector<float> cpu_ws(static_cast<size_t>(blocked_cross_entropy_workspace_bytes(a) / 4));
  a.x = x.data();
  a.w = w.data();
  a.targets = targets.data();
  a.lse = cpu.lse.data();
  a.loss = cpu.loss.data();
  a.d_x = cpu.d_x.data();
  a.d_w = cpu.d_w.data();
  cpu.d_bias = d_bias0;
  a.bias = with_bias ? bias.data() : nullptr;
  a.d_bias = with_bias ? cpu.d_bias.data() : nullptr;
  a.workspace = cpu_ws.data();
  blocked_cross_entropy_forward_cpu(a);
  blocked_cross_entropy_backward_cpu(a);

  DeviceBuffer g_x = upload(alloc, x, Category::Vocab), g_w = upload(alloc, w, Category::Vocab);
  DeviceBuffer g_targets = upload(alloc, targets, Category::Vocab);
  DeviceBuffer g_bias = upload(alloc, bias, Category::Vocab);
  a.bias = with_bias ? g_bias.raw() : nullptr;
  DeviceBuffer g_ws(alloc, blocked_cross_entropy_workspace_bytes_cuda(a), Category::Vocab);
  a.x = g_x.raw();
  a.w = g_w.raw();
  a.targets = g_targets.as<int32_t>();
  a.workspace = g_ws.as<float>();
  Outputs gpu[2];  // [0] forward + backward, [1] fused
  for (int variant = 0; variant < 2; ++variant) {
    DeviceBuffer g_lse(alloc, kTokens * 4, Category::Vocab), g_loss(alloc, kTokens * 4, Category::Vocab);
    DeviceBuffer g_dx(alloc, kTokens * kHidden * dtype_bytes(dtype), Category::Vocab);
    DeviceBuffer g_dw = upload(alloc, d_w0, Category::Grads);
    DeviceBuffer g_db = upload(alloc, d_bias0, Category::Grads);
    a.d_bias = with_bias ? g_db.as<float>() : nullptr;
    a.lse = g_lse.as<float>();
    a.loss = g_loss.as<float>();
    a.d_x = g_dx.raw();
    a.d_w = g_dw.as<float>();
    if (variant == 0) {
      blocked_cross_entropy_forward_cuda(a, blas);
      blocked_cross_entropy_backward_cuda(a, blas);
    } else {
      blocked_cross_entropy_fused_cuda(a, blas);
    }
    gpu[variant] = Outputs{download<float>(g_lse, kTokens), download<float>(g_loss, kTokens),
                           download<float>(g_dw, kVocab * kHidden), download(g_dx, dtype),
                           download<float>(g_db, kVocab)};
  }
  const std::string name = std::string("cross_entropy/") + dtype_name(dtype) + "/v_blk" + std::to_string(vocab_block_rows) +
                           (with_bias ? "/bias" : "");
  expect_close(name + "/lse", gpu[0].lse, cpu.lse, Tol::f32());
  expect_close(name + "/loss", gpu[0].loss, cpu.loss, Tol::f32());
  expect_close(name + "/d_x", gpu[0].d_x.values(), cpu.d_x.values(), Tol::of(dtype));
  // d_w is fp32, but in bf16 its addends are the bf16-rounded dz: an fp32-level difference in a
  // logit (cuBLAS's summation order, CUDA's expf within 2 ulp) may round a dz the other way, one
  // bf16 ulp (2^-8 relative, up to g·2^-8 for the largest dz) times x. Hence a bf16 floor there;
  // the relative part stays fp32's. A wrong block, offset or transpose moves the target rows of
  // d_w by about g·x (g = 1/150: a tenth of the largest magnitude here), far past it.
  expect_close(name + "/d_w", gpu[0].d_w, cpu.d_w,
               dtype == DType::BF16 ? Tol{Tol::f32().rel, Tol::bf16().floor} : Tol::f32());
  expect_equal(name + "/fused_lse", gpu[1].lse, gpu[0].lse);
  expect_equal(name + "/fused_loss", gpu[1].loss, gpu[0].loss);
  expect_equal(name + "/fused_d_x", gpu[1].d_x.bytes, gpu[0].d_x.bytes);
  expect_equal(name + "/fused_d_w", gpu[1].d_w, gpu[0].d_w);
  if (!with_bias) return;
  // d bias = Σ_t dz of the same rounded dz: d_w's tolerance.
  expect_close(name + "/d_bias", gpu[0].d_bias, cpu.d_bias,
               dtype == DType::BF16 ? Tol{Tol::f32().rel, Tol::bf16().floor} : Tol::f32());
  expect_equal(name + "/fused_d_bias", gpu[1].d_bias, gpu[0].d_bias);
}

}  // namespace

int main() {
  if (const int rc = skip_unless_device(); rc != 0) return rc;
  try {
    DeviceAllocator alloc;
    CublasContext blas(alloc, nullptr);
    for (DType dtype : {DType::F32, DType::BF16})
      for (int64_t v_blk : {int64_t{256}, kVocab})
        for (bool with_bias : {false, true}) test_cross_entropy(alloc, blas, dtype, v_blk, with_bias);
  } catch (const std::exception& e) {
    std::printf("FAIL: %s\n", e.what());
    return 1;
  }
  return finish();
}
