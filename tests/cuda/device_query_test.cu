// Reports the CUDA devices this process can see. Exit 77 (CTest: skipped) when there is none,
// so a CPU-only machine never counts it as passed; exit 0 with the device's name and memory
// otherwise, after a kernel round trip proves the device executes code built for it.
#include <cuda_runtime.h>

#include <cstdio>

namespace {
constexpr int kSkipped = 77;

__global__ void double_each(float* values, int count) {
  const int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (i < count) values[i] *= 2.0f;
}
}  // namespace

int main() {
  int device_count = 0;
  const cudaError_t status = cudaGetDeviceCount(&device_count);
  if (status != cudaSuccess || device_count == 0) {
    std::printf("no CUDA device (%s): skipped\n", cudaGetErrorString(status));
    return kSkipped;
  }
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) return 1;
  std::printf("device 0: %s, %zu bytes, sm_%d%d\n", prop.name, prop.totalGlobalMem, prop.major, prop.minor);

  constexpr int kCount = 1024;
  float host[kCount];
  for (int i = 0; i < kCount; ++i) host[i] = static_cast<float>(i) + 0.5f;
  float* device = nullptr;
  if (cudaMalloc(&device, sizeof(host)) != cudaSuccess) return 1;
  cudaMemcpy(device, host, sizeof(host), cudaMemcpyHostToDevice);
  double_each<<<(kCount + 255) / 256, 256>>>(device, kCount);
  cudaMemcpy(host, device, sizeof(host), cudaMemcpyDeviceToHost);
  cudaFree(device);
  if (cudaGetLastError() != cudaSuccess) return 1;
  for (int i = 0; i < kCount; ++i) {
    if (host[i] != 2.0f * (static_cast<float>(i) + 0.5f)) {
      std::printf("kernel result wrong at %d\n", i);
      return 1;
    }
  }
  return 0;
}
