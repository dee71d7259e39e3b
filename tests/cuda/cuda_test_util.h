// Shared by the CPU-vs-CUDA op tests: the skip (exit 77, reported as skipped, when no device is
// present), random non-zero inputs from a fixed seed, device upload/download through the
// DeviceAllocator, and comparisons that print the worst error and count failures.
//   if (int rc = skip_unless_device(); rc != 0) return rc;
//   Rng rng(7); auto x = rng.uniform(n);  DeviceBuffer dx = upload(alloc, x, Category::Activations);
//   expect_close("rmsnorm/out", got, want, Tol::bf16());  return finish();
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "executor/cuda/cuda_check.h"
#include "executor/cuda/device_allocator.h"
#include "executor/ops/dtype.h"

namespace flatpeak::cuda::test {

constexpr int kSkipped = 77;
inline int g_failures = 0;
inline int g_checks = 0;

// 77 when this process sees no CUDA device (printing why), 0 otherwise.
inline int skip_unless_device() {
  int device_count = 0;
  const cudaError_t status = cudaGetDeviceCount(&device_count);
  if (status != cudaSuccess || device_count == 0) {
    std::printf("skipped: no CUDA device (%s: %s)\n", cudaGetErrorName(status),
                cudaGetErrorString(status));
    return kSkipped;
  }
  cudaDeviceProp prop{};
  FLATPEAK_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device 0: %s (sm_%d%d)\n", prop.name, prop.major, prop.minor);
  return 0;
}

// Uniform in ±[lo, hi]: never zero, so no product or gradient vanishes by accident.
class Rng {
 public:
  explicit Rng(uint32_t seed) : engine_(seed) {}
  std::vector<float> uniform(int64_t n, float lo = 0.05f, float hi = 1.0f) {
    std::uniform_real_distribution<float> magnitude(lo, hi);
    std::bernoulli_distribution negative(0.5);
    std::vector<float> out(static_cast<size_t>(n));
    for (float& x : out) x = negative(engine_) ? -magnitude(engine_) : magnitude(engine_);
    return out;
  }
  std::vector<int32_t> ints(int64_t n, int32_t lo, int32_t hi) {  // in [lo, hi]
    std::uniform_int_distribution<int32_t> dist(lo, hi);
    std::vector<int32_t> out(static_cast<size_t>(n));
    for (int32_t& x : out) x = dist(engine_);
    return out;
  }
  std::mt19937& engine() { return engine_; }

 private:
  std::mt19937 engine_;
};

inline std::vector<exec::Bf16> to_bf16(const std::vector<float>& x) {
  std::vector<exec::Bf16> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) out[i] = exec::f32_to_bf16(x[i]);
  return out;
}
inline std::vector<float> to_f32(const std::vector<exec::Bf16>& x) {
  std::vector<float> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) out[i] = exec::to_f32(x[i]);
  return out;
}
inline std::vector<float> to_f32(const std::vector<float>& x) { return x; }

// Host data of either storage type as raw bytes, so one test body serves F32 and BF16.
struct HostTensor {
  exec::DType dtype = exec::DType::F32;
  std::vector<unsigned char> bytes;
  static HostTensor from(const std::vector<float>& values, exec::DType dtype) {
    HostTensor t;
    t.dtype = dtype;
    if (dtype == exec::DType::BF16) {
      const std::vector<exec::Bf16> b = to_bf16(values);
      t.bytes.resize(b.size() * 2);
      std::memcpy(t.bytes.data(), b.data(), t.bytes.size());
    } else {
      t.bytes.resize(values.size() * 4);
      std::memcpy(t.bytes.data(), values.data(), t.bytes.size());
    }
    return t;
  }
  void* data() { return bytes.data(); }
  std::vector<float> values() const {
    const int64_t n = static_cast<int64_t>(bytes.size()) / exec::dtype_bytes(dtype);
    std::vector<float> out(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      if (dtype == exec::DType::BF16) {
        exec::Bf16 b;
        std::memcpy(&b, bytes.data() + 2 * i, 2);
        out[static_cast<size_t>(i)] = exec::to_f32(b);
      } else {
        std::memcpy(&out[static_cast<size_t>(i)], bytes.data() + 4 * i, 4);
      }
    }
    return out;
  }
};

inline DeviceBuffer upload_bytes(DeviceAllocator& alloc, const void* src, int64_t bytes,
                                 exec::Category category = exec::Category::Activations) {
  DeviceBuffer buffer(alloc, bytes, category);
  if (bytes > 0) {
    FLATPEAK_CUDA_CHECK(cudaMemcpy(buffer.raw(), src, static_cast<size_t>(bytes),
                                   cudaMemcpyHostToDevice));
  }
  // From pageable memory cudaMemcpy may return before its DMA has landed (CUDA's "API
  // synchronization behavior"), and a non-blocking stream (the offload copy streams, each rank's
  // stream in device_threads_comm_test) does not wait for the legacy stream: wait here, so the
  // block and its bytes are ready for any stream.
  FLATPEAK_CUDA_CHECK(cudaStreamSynchronize(nullptr));
  return buffer;
}
template <class T>
DeviceBuffer upload(DeviceAllocator& alloc, const std::vector<T>& host,
                    exec::Category category = exec::Category::Activations) {
  return upload_bytes(alloc, host.data(), static_cast<int64_t>(host.size() * sizeof(T)), category);
}
inline DeviceBuffer upload(DeviceAllocator& alloc, const HostTensor& host,
                           exec::Category category = exec::Category::Activations) {
  return upload_bytes(alloc, host.bytes.data(), static_cast<int64_t>(host.bytes.size()), category);
}
// Synchronises the device first, so every queued kernel has finished (and reported errors).
template <class T>
std::vector<T> download(const DeviceBuffer& buffer, int64_t count) {
  FLATPEAK_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<T> host(static_cast<size_t>(count));
  if (count > 0) {
    FLATPEAK_CUDA_CHECK(cudaMemcpy(host.data(), buffer.raw(), static_cast<size_t>(count) * sizeof(T),
                                   cudaMemcpyDeviceToHost));
  }
  return host;
}
inline HostTensor download(const DeviceBuffer& buffer, exec::DType dtype) {
  FLATPEAK_CUDA_CHECK(cudaDeviceSynchronize());
  HostTensor t;
  t.dtype = dtype;
  t.bytes.resize(static_cast<size_t>(buffer.bytes()));
  if (!t.bytes.empty()) {
    FLATPEAK_CUDA_CHECK(cudaMemcpy(t.bytes.data(), buffer.raw(), t.bytes.size(),
                                   cudaMemcpyDeviceToHost));
  }
  return t;
}

// |got − want| ≤ rel · |want| + floor · max|want| for every element. rel is the stated
// tolerance (bf16 storage ≈ 1e-2, fp32 ≈ 1e-5); the floor covers elements that cancel to near
// zero, where a relative bound means nothing.
struct Tol {
  double rel;
  double floor;
  static Tol f32() { return {1e-5, 1e-5}; }
  static Tol bf16() { return {1e-2, 1e-3}; }
  static Tol of(exec::DType dtype) { return dtype == exec::DType::BF16 ? bf16() : f32(); }
};

inline bool expect_close(const std::string& name, const std::vector<float>& got,
                         const std::vector<float>& want, Tol tol) {
  ++g_checks;
  if (got.size() != want.size()) {
    std::printf("FAIL %s: %zu values, expected %zu\n", name.c_str(), got.size(), want.size());
    ++g_failures;
    return false;
  }
  double max_want = 0.0;
  for (float w : want) max_want = std::fmax(max_want, std::fabs(static_cast<double>(w)));
  double worst_ratio = 0.0;
  size_t worst = 0;
  int64_t bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double diff = std::fabs(static_cast<double>(got[i]) - static_cast<double>(want[i]));
    const double bound = tol.rel * std::fabs(static_cast<double>(want[i])) + tol.floor * max_want;
    const double ratio = bound > 0.0 ? diff / bound : (diff > 0.0 ? INFINITY : 0.0);
    if (!(ratio <= 1.0)) ++bad;  // NaN counts as bad
    if (!(ratio <= worst_ratio)) {
      worst_ratio = ratio;
      worst = i;
    }
  }
  const bool ok = bad == 0 && !got.empty() && max_want > 0.0;
  std::printf("%s %s: n=%zu max|want|=%.3g worst at %zu: got %.8g want %.8g (%.3g of the bound "
              "rel=%.0e floor=%.0e)\n",
              ok ? "ok  " : "FAIL", name.c_str(), got.size(), max_want, worst,
              got.empty() ? 0.0 : static_cast<double>(got[worst]),
              want.empty() ? 0.0 : static_cast<double>(want[worst]), worst_ratio, tol.rel,
              tol.floor);
  if (!ok) ++g_failures;
  return ok;
}

template <class T>
bool expect_equal(const std::string& name, const std::vector<T>& got, const std::vector<T>& want) {
  ++g_checks;
  size_t first_bad = got.size();
  if (got.size() == want.size()) {
    for (size_t i = 0; i < got.size(); ++i) {
      if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0) {
        first_bad = i;
        break;
      }
    }
  }
  const bool ok = got.size() == want.size() && first_bad == got.size() && !got.empty();
  std::printf("%s %s: n=%zu bitwise%s\n", ok ? "ok  " : "FAIL", name.c_str(), got.size(),
              ok ? "" : (" differs at " + std::to_string(first_bad)).c_str());
  if (!ok) ++g_failures;
  return ok;
}

inline void expect_true(const std::string& name, bool condition, const std::string& detail) {
  ++g_checks;
  std::printf("%s %s: %s\n", condition ? "ok  " : "FAIL", name.c_str(), detail.c_str());
  if (!condition) ++g_failures;
}

inline int finish() {
  std::printf("%d of %d checks failed\n", g_failures, g_checks);
  return g_failures == 0 ? 0 : 1;
}

}  // namespace flatpeak::cuda::test
