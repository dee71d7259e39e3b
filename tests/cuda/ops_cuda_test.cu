// CPU vs CUDA for AdamW, embedding, RMSNorm, the router and linear (cuBLAS GEMM): the same Args
// struct runs through executor/cpu and executor/cuda on random non-zero inputs from a fixed seed,
// in f32 and bf16 storage. Tolerances (cuda_test_util.h Tol): fp32 values rel 1e-5 (+ 1e-5 of
// the tensor's largest magnitude), bf16 storage rel 1e-2 (+ 1e-3); pure copies and the
// in-order embedding scatter-add bitwise; router expert ids exactly.
// Exit 77 (skipped) without a CUDA device.
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "executor/cuda/cublas_context.h"
#include "executor/cuda/ops_cuda.h"
#include "cuda_test_util.h"

using namespace flatpeak;
using namespace flatpeak::exec;
using namespace flatpeak::cuda;
using namespace flatpeak::cuda::test;

namespace {

std::string tag(const char* op, DType dtype) { return std::string(op) + "/" + dtype_name(dtype); }

void test_adamw(DeviceAllocator& alloc, DType grad_dtype) {
  const int64_t n = 10007;  // not a multiple of any block size
  Rng rng(11);
  std::vector<float> master = rng.uniform(n);
  std::vector<float> m = rng.uniform(n, 0.001f, 0.01f);
  std::vector<float> v = rng.uniform(n, 0.0001f, 0.001f);
  for (float& x : v) x = std::fabs(x);  // a second moment is never negative
  HostTensor grad = HostTensor::from(rng.uniform(n), grad_dtype);
  DeviceBuffer d_master = upload(alloc, master, Category::Optimizer);
  DeviceBuffer d_m = upload(alloc, m, Category::Optimizer);
  DeviceBuffer d_v = upload(alloc, v, Category::Optimizer);
  DeviceBuffer d_grad = upload(alloc, grad, Category::Grads);
  DeviceBuffer d_out(alloc, n * 2, Category::Params);
  std::vector<Bf16> out(static_cast<size_t>(n));
  for (int64_t step = 1; step <= 3; ++step) {  // bias corrections change with t
    AdamWArgs a;
    a.grad_dtype = grad_dtype;
    a.elems = n;
    a.step = step;
    a.lr = 1e-2f;
    a.weight_decay = 0.1f;
    a.grad_scale = 0.5f;
    a.master = master.data();
    a.grad = grad.data();
    a.m = m.data();
    a.v = v.data();
    a.param_out = out.data();
    adamw_step_cpu(a);
    a.master = d_master.as<float>();
    a.grad = d_grad.raw();
    a.m = d_m.as<float>();
    a.v = d_v.as<float>();
    a.param_out = d_out.as<Bf16>();
    adamw_step_cuda(a, nullptr);
  }
  const std::string name = tag("adamw", grad_dtype);
  expect_close(name + "/master", download<float>(d_master, n), master, Tol::f32());
  expect_close(name + "/m", download<float>(d_m, n), m, Tol::f32());
  expect_close(name + "/v", download<float>(d_v, n), v, Tol::f32());
  expect_close(name + "/param_out", to_f32(download<Bf16>(d_out, n)), to_f32(out), Tol::bf16());
}

void test_embedding(DeviceAllocator& alloc, DType dtype) {
  const int64_t T = 300, V = 37, H = 72;  // ids repeat: the scatter-add order matters
  Rng rng(12);
  std::vector<int32_t> ids = rng.ints(T, 0, static_cast<int32_t>(V - 1));
  HostTensor table = HostTensor::from(rng.uniform(V * H), dtype);
  HostTensor d_out = HostTensor::from(rng.uniform(T * H), dtype);
  HostTensor d_table = HostTensor::from(rng.uniform(V * H), dtype);  // accumulated into
  HostTensor out = HostTensor::from(std::vector<float>(static_cast<size_t>(T * H), 1.0f), dtype);
  DeviceBuffer g_ids = upload(alloc, ids);
  DeviceBuffer g_table = upload(alloc, table, Category::Params);
  DeviceBuffer g_d_out = upload(alloc, d_out);
  DeviceBuffer g_d_table = upload(alloc, d_table, Category::Grads);
  DeviceBuffer g_out(alloc, T * H * dtype_bytes(dtype), Category::Activations);
  EmbeddingArgs a;
  a.dtype = dtype;
  a.tokens = T;
  a.vocab = V;
  a.hidden = H;
  a.token_ids = ids.data();
  a.table = table.data();
  a.out = out.data();
  a.d_out = d_out.data();
  a.d_table = d_table.data();
  embedding_forward_cpu(a);
  embedding_backward_cpu(a);
  a.token_ids = g_ids.as<int32_t>();
  a.table = g_table.raw();
  a.out = g_out.raw();
  a.d_out = g_d_out.raw();
  a.d_table = g_d_table.raw();
  embedding_forward_cuda(a, nullptr);
  embedding_backward_cuda(a, nullptr);
  expect_equal(tag("embedding", dtype) + "/out", download(g_out, dtype).bytes, out.bytes);
  expect_equal(tag("embedding", dtype) + "/d_table", download(g_d_table, dtype).bytes,
               d_table.bytes);
}

void test_rmsnorm(DeviceAllocator& alloc, DType dtype) {
  const int64_t T = 97, H = 320;
  Rng rng(13);
  HostTensor x = HostTensor::from(rng.uniform(T * H), dtype);
  HostTensor w = HostTensor::from(rng.uniform(H, 0.5f, 1.5f), dtype);
  HostTensor dy = HostTensor::from(rng.uniform(T * H), dtype);
  HostTensor dw = HostTensor::from(rng.uniform(H), dtype);  // accumulated into
  HostTensor out = HostTensor::from(std::vector<float>(static_cast<size_t>(T * H)), dtype);
  HostTensor dx = out;
  std::vector<float> rstd(static_cast<size_t>(T));
  std::vector<float> workspace(static_cast<size_t>(H));
  DeviceBuffer g_x = upload(alloc, x), g_w = upload(alloc, w, Category::Params);
  DeviceBuffer g_dy = upload(alloc, dy), g_dw = upload(alloc, dw, Category::Grads);
  DeviceBuffer g_out(alloc, T * H * dtype_bytes(dtype), Category::Activations);
  DeviceBuffer g_dx(alloc, T * H * dtype_bytes(dtype), Category::Activations);
  DeviceBuffer g_rstd(alloc, T * 4, Category::Activations);
  RmsNormArgs a;
  a.dtype = dtype;
  a.tokens = T;
  a.hidden = H;
  a.x = x.data();
  a.weight = w.data();
  a.out = out.data();
  a.rstd = rstd.data();
  a.d_out = dy.data();
  a.d_x = dx.data();
  a.d_weight = dw.data();
  a.workspace = workspace.data();
  rmsnorm_forward_cpu(a);
  rmsnorm_backward_cpu(a);
  a.x = g_x.raw();
  a.weight = g_w.raw();
  a.out = g_out.raw();
  a.rstd = g_rstd.as<float>();
  a.d_out = g_dy.raw();
  a.d_x = g_dx.raw();
  a.d_weight = g_dw.raw();
  a.workspace = nullptr;
  rmsnorm_forward_cuda(a, nullptr);
  rmsnorm_backward_cuda(a, nullptr);
  const std::string name = tag("rmsnorm", dtype);
  expect_close(name + "/rstd", download<float>(g_rstd, T), rstd, Tol::f32());
  expect_close(name + "/out", download(g_out, dtype).values(), out.values(), Tol::of(dtype));
  expect_close(name + "/d_x", download(g_dx, dtype).values(), dx.values(), Tol::of(dtype));
  expect_close(name + "/d_weight", download(g_dw, dtype).values(), dw.values(), Tol::of(dtype));
}

void test_layernorm(DeviceAllocator& alloc, DType dtype) {
  const int64_t T = 97, H = 320;
  Rng rng(15);
  HostTensor x = HostTensor::from(rng.uniform(T * H), dtype);
  HostTensor w = HostTensor::from(rng.uniform(H, 0.5f, 1.5f), dtype);
  HostTensor b = HostTensor::from(rng.uniform(H), dtype);
  HostTensor dy = HostTensor::from(rng.uniform(T * H), dtype);
  HostTensor dw = HostTensor::from(rng.uniform(H), dtype);  // accumulated into
  HostTensor db = HostTensor::from(rng.uniform(H), dtype);  // accumulated into
  HostTensor out = HostTensor::from(std::vector<float>(static_cast<size_t>(T * H)), dtype);
  HostTensor dx = out;
  std::vector<float> mean(static_cast<size_t>(T)), rstd(static_cast<size_t>(T));
  std::vector<float> workspace(static_cast<size_t>(2 * H));
  DeviceBuffer g_x = upload(alloc, x), g_w = upload(alloc, w, Category::Params), g_b = upload(alloc, b, Category::Params);
  DeviceBuffer g_dy = upload(alloc, dy), g_dw = upload(alloc, dw, Category::Grads), g_db = upload(alloc, db, Category::Grads);
  DeviceBuffer g_out(alloc, T * H * dtype_bytes(dtype), Category::Activations);
  DeviceBuffer g_dx(alloc, T * H * dtype_bytes(dtype), Category::Activations);
  DeviceBuffer g_mean(alloc, T * 4, Category::Activations), g_rstd(alloc, T * 4, Category::Activations);
  LayerNormArgs a;
  a.dtype = dtype;
  a.tokens = T;
  a.hidden = H;
  a.x = x.data();
  a.weight = w.data();
  a.bias = b.data();
  a.out = out.data();
  a.mean = mean.data();
  a.rstd = rstd.data();
  a.d_out = dy.data();
  a.d_x = dx.data();
  a.d_weight = dw.data();
  a.d_bias = db.data();
  a.workspace = workspace.data();
  layernorm_forward_cpu(a);
  layernorm_backward_cpu(a);
  a.x = g_x.raw();
  a.weight = g_w.raw();
  a.bias = g_b.raw();
  a.out = g_out.raw();
  a.mean = g_mean.as<float>();
  a.rstd = g_rstd.as<float>();
  a.d_out = g_dy.raw();
  a.d_x = g_dx.raw();
  a.d_weight = g_dw.raw();
  a.d_bias = g_db.raw();
  a.workspace = nullptr;
  layernorm_forward_cuda(a, nullptr);
  layernorm_backward_cuda(a, nullptr);
  const std::string name = tag("layernorm", dtype);
  expect_close(name + "/mean", download<float>(g_mean, T), mean, Tol::f32());
  expect_close(name + "/rstd", download<float>(g_rstd, T), rstd, Tol::f32());
  expect_close(name + "/out", download(g_out, dtype).values(), out.values(), Tol::of(dtype));
  expect_close(name + "/d_x", download(g_dx, dtype).values(), dx.values(), Tol::of(dtype));
  expect_close(name + "/d_weight", download(g_dw, dtype).values(), dw.values(), Tol::of(dtype));
  expect_close(name + "/d_bias", download(g_db, dtype).values(), db.values(), Tol::of(dtype));
}

void test_router(DeviceAllocator& alloc) {
  const int64_t T = 513, E = 24, k = 4;
  Rng rng(14);
  std::vector<float> logits = rng.uniform(T * E, 0.05f, 4.0f);
  std::vector<float> d_w = rng.uniform(T * k);
  std::vector<int32_t> ids(static_cast<size_t>(T * k));
  std::vector<float> w(static_cast<size_t>(T * k));
  std::vector<float> dz(static_cast<size_t>(T * E));
  DeviceBuffer g_logits = upload(alloc, logits, Category::Dispatch);
  DeviceBuffer g_d_w = upload(alloc, d_w, Category::Dispatch);
  DeviceBuffer g_ids(alloc, T * k * 4, Category::Dispatch);
  DeviceBuffer g_w(alloc, T * k * 4, Category::Dispatch);
  DeviceBuffer g_dz(alloc, T * E * 4, Category::Dispatch);
  RouterArgs a;
  a.tokens = T;
  a.experts = E;
  a.top_k = k;
  a.logits = logits.data();
  a.topk_ids = ids.data();
  a.topk_weights = w.data();
  a.d_topk_weights = d_w.data();
  a.d_logits = dz.data();
  router_forward_cpu(a);
  router_backward_cpu(a);
  a.logits = g_logits.as<float>();
  a.topk_ids = g_ids.as<int32_t>();
  a.topk_weights = g_w.as<float>();
  a.d_topk_weights = g_d_w.as<float>();
  a.d_logits = g_dz.as<float>();
  router_forward_cuda(a, nullptr);
  router_backward_cuda(a, nullptr);
  expect_equal("router/topk_ids", download<int32_t>(g_ids, T * k), ids);
  expect_close("router/topk_weights", download<float>(g_w, T * k), w, Tol::f32());
  expect_close("router/d_logits", download<float>(g_dz, T * E), dz, Tol::f32());
}

void test_linear(DeviceAllocator& alloc, const CublasContext& blas, DType dtype) {
  const int64_t T = 131, in = 96, out_f = 200;
  Rng rng(15);
  HostTensor x = HostTensor::from(rng.uniform(T * in), dtype);
  HostTensor w = HostTensor::from(rng.uniform(out_f * in), dtype);
  HostTensor dy = HostTensor::from(rng.uniform(T * out_f), dtype);
  HostTensor dw = HostTensor::from(rng.uniform(out_f * in), dtype);  // accumulated into
  HostTensor y = HostTensor::from(std::vector<float>(static_cast<size_t>(T * out_f)), dtype);
  HostTensor dx = HostTensor::from(std::vector<float>(static_cast<size_t>(T * in)), dtype);
  DeviceBuffer g_x = upload(alloc, x), g_w = upload(alloc, w, Category::Params);
  DeviceBuffer g_dy = upload(alloc, dy), g_dw = upload(alloc, dw, Category::Grads);
  DeviceBuffer g_y(alloc, T * out_f * dtype_bytes(dtype), Category::Activations);
  DeviceBuffer g_dx(alloc, T * in * dtype_bytes(dtype), Category::Activations);
  LinearArgs a;
  a.dtype = dtype;
  a.tokens = T;
  a.in_features = in;
  a.out_features = out_f;
  a.x = x.data();
  a.w = w.data();
  a.y = y.data();
  a.d_y = dy.data();
  a.d_x = dx.data();
  a.d_w = dw.data();
  linear_forward_cpu(a);
  linear_backward_cpu(a);
  a.x = g_x.raw();
  a.w = g_w.raw();
  a.y = g_y.raw();
  a.d_y = g_dy.raw();
  a.d_x = g_dx.raw();
  a.d_w = g_dw.raw();
  linear_forward_cuda(a, blas);
  linear_backward_cuda(a, blas);
  const std::string name = tag("linear", dtype);
  expect_close(name + "/y", download(g_y, dtype).values(), y.values(), Tol::of(dtype));
  expect_close(name + "/d_x", download(g_dx, dtype).values(), dx.values(), Tol::of(dtype));
  expect_close(name + "/d_w", download(g_dw, dtype).values(), dw.values(), Tol::of(dtype));
}

}  // namespace

int main() {
  if (const int rc = skip_unless_device(); rc != 0) return rc;
  try {
    DeviceAllocator alloc;
    CublasContext blas(alloc, nullptr);
    for (DType dtype : {DType::F32, DType::BF16}) {
      test_adamw(alloc, dtype);
      test_embedding(alloc, dtype);
      test_rmsnorm(alloc, dtype);
      test_layernorm(alloc, dtype);
      test_linear(alloc, blas, dtype);
    }
    test_router(alloc);
    expect_true("allocator/balanced", alloc.live_bytes() == blas.workspace_bytes(),
                "live bytes after the tests = the cuBLAS workspace (" +
                    std::to_string(alloc.live_bytes()) + ")");
  } catch (const std::exception& e) {
    std::printf("FAIL: %s\n", e.what());
    return 1;
  }
  return finish();
}
