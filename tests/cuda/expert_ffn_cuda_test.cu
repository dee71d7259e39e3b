// CPU vs CUDA for the SwiGLU expert FFN over rows grouped by expert (uneven counts, one expert
// with no rows): gate_up, out, d_x and the accumulated d_w_gate_up, d_w_down, within rel 1e-5
// (+ 1e-5 of the largest magnitude) in f32 and rel 1e-2 (+ 1e-3) in bf16 storage. In bf16 the
// gate_up and dh GEMMs run on tensor cores from the bf16 buffers (the same exact bf16 products the
// CPU forms, summed in fp32 in another order); the four with an fp32 activation run in TF32 (h and
// d[gate | up] rounded to rel 2^-11, well inside the bf16 bound every output is rounded to).
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

void test_expert_ffn(DeviceAllocator& alloc, const CublasContext& blas, DType dtype) {
  std::vector<int64_t> counts = {37, 0, 90, 5, 64};
  const int64_t E = static_cast<int64_t>(counts.size()), H = 48, F = 40;
  int64_t R = 0;
  for (int64_t c : counts) R += c;
  const int64_t eb = dtype_bytes(dtype);
  Rng rng(41);
  HostTensor x = HostTensor::from(rng.uniform(R * H), dtype);
  HostTensor wgu = HostTensor::from(rng.uniform(E * 2 * F * H, 0.01f, 0.2f), dtype);
  HostTensor wd = HostTensor::from(rng.uniform(E * H * F, 0.01f, 0.2f), dtype);
  HostTensor dy = HostTensor::from(rng.uniform(R * H), dtype);
  HostTensor dwgu = HostTensor::from(rng.uniform(E * 2 * F * H, 0.01f, 0.1f), dtype);
  HostTensor dwd = HostTensor::from(rng.uniform(E * H * F, 0.01f, 0.1f), dtype);
  HostTensor gu = HostTensor::from(std::vector<float>(static_cast<size_t>(R * 2 * F)), dtype);
  HostTensor out = HostTensor::from(std::vector<float>(static_cast<size_t>(R * H)), dtype);
  HostTensor dx = out;

  ExpertFfnArgs a;
  a.dtype = dtype;
  a.rows = R;
  a.experts = E;
  a.hidden = H;
  a.ffn = F;
  a.expert_counts = counts.data();  // host, for both backends
  std::vector<float> cpu_ws(static_cast<size_t>(expert_ffn_workspace_bytes(a) / 4));
  a.x = x.data();
  a.w_gate_up = wgu.data();
  a.w_down = wd.data();
  a.gate_up = gu.data();
  a.out = out.data();
  a.d_out = dy.data();
  a.d_x = dx.data();
  a.d_w_gate_up = dwgu.data();
  a.d_w_down = dwd.data();
  a.workspace = cpu_ws.data();
  // Device copies before the CPU run accumulates into the host gradients.
  DeviceBuffer g_x = upload(alloc, x, Category::Dispatch), g_dy = upload(alloc, dy, Category::Dispatch);
  DeviceBuffer g_wgu = upload(alloc, wgu, Category::Params), g_wd = upload(alloc, wd, Category::Params);
  DeviceBuffer g_dwgu = upload(alloc, dwgu, Category::Grads), g_dwd = upload(alloc, dwd, Category::Grads);
  DeviceBuffer g_gu(alloc, R * 2 * F * eb, Category::Dispatch);
  DeviceBuffer g_out(alloc, R * H * eb, Category::Dispatch);
  DeviceBuffer g_dx(alloc, R * H * eb, Category::Dispatch);
  DeviceBuffer g_ws(alloc, expert_ffn_workspace_bytes_cuda(a), Category::Dispatch);
  expert_ffn_forward_cpu(a);
  expert_ffn_backward_cpu(a);
  a.x = g_x.raw();
  a.w_gate_up = g_wgu.raw();
  a.w_down = g_wd.raw();
  a.gate_up = g_gu.raw();
  a.out = g_out.raw();
  a.d_out = g_dy.raw();
  a.d_x = g_dx.raw();
  a.d_w_gate_up = g_dwgu.raw();
  a.d_w_down = g_dwd.raw();
  a.workspace = g_ws.as<float>();
  expert_ffn_forward_cuda(a, blas);
  expert_ffn_backward_cuda(a, blas);
  const std::string name = std::string("expert_ffn/") + dtype_name(dtype);
  const Tol tol = Tol::of(dtype);
  expect_close(name + "/gate_up", download(g_gu, dtype).values(), gu.values(), tol);
  expect_close(name + "/out", download(g_out, dtype).values(), out.values(), tol);
  expect_close(name + "/d_x", download(g_dx, dtype).values(), dx.values(), tol);
  expect_close(name + "/d_w_gate_up", download(g_dwgu, dtype).values(), dwgu.values(), tol);
  expect_close(name + "/d_w_down", download(g_dwd, dtype).values(), dwd.values(), tol);
}

}  // namespace

int main() {
  if (const int rc = skip_unless_device(); rc != 0) return rc;
  try {
    DeviceAllocator alloc;
    CublasContext blas(alloc, nullptr);
    for (DType dtype : {DType::F32, DType::BF16}) test_expert_ffn(alloc, blas, dtype);
  } catch (const std::exception& e) {
    std::printf("FAIL: %s\n", e.what());
    return 1;
  }
  return finish();
}
