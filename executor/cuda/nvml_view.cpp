#include "executor/cuda/nvml_view.h"

#include <cuda_runtime.h>
#include <dlfcn.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <vector>

#include "executor/cuda/cuda_check.h"

namespace flatpeak::cuda {
namespace {

// The few NVML declarations used here, as nvml.h documents them (no nvml.h on build machines
// without the driver's development files; the symbols are resolved with dlsym).
using nvmlReturn_t = int;
constexpr nvmlReturn_t kNvmlSuccess = 0;
constexpr nvmlReturn_t kNvmlErrorInsufficientSize = 7;
constexpr unsigned long long kNvmlValueNotAvailable = ~0ULL;  // NVML_VALUE_NOT_AVAILABLE
struct NvmlDeviceOpaque;
using nvmlDevice_t = NvmlDeviceOpaque*;
struct NvmlMemoryV1 {  // nvmlMemory_t
  unsigned long long total;
  unsigned long long free;
  unsigned long long used;
};
// nvmlProcessInfo_v2_t, which the _v2 entry point takes; the _v3 entry point takes nvmlProcessInfo_t,
// the same four fields in current drivers' headers (an early CUDA 12 header appended a
// usedGpuCcProtectedMemory field, later removed). The buffer handed to NVML is sized for 32-byte
// entries anyway, so a driver with the longer layout cannot write past it; its entries would then
// simply not match getpid() here.
struct NvmlProcessInfoV2 {
  unsigned int pid;
  unsigned long long usedGpuMemory;
  unsigned int gpuInstanceId;
  unsigned int computeInstanceId;
};
static_assert(sizeof(NvmlProcessInfoV2) == 24, "nvmlProcessInfo_v2_t is 24 bytes on LP64");
static_assert(sizeof(NvmlMemoryV1) == 24, "nvmlMemory_t is 24 bytes");
constexpr size_t kLongestProcessInfoBytes = 32;

using InitFn = nvmlReturn_t (*)();
using ErrorStringFn = const char* (*)(nvmlReturn_t);
using HandleByPciBusIdFn = nvmlReturn_t (*)(const char*, nvmlDevice_t*);
using MemoryInfoFn = nvmlReturn_t (*)(nvmlDevice_t, NvmlMemoryV1*);
using RunningProcessesFn = nvmlReturn_t (*)(nvmlDevice_t, unsigned int*, NvmlProcessInfoV2*);

template <class Fn>
Fn symbol(void* library, const char* name) {
  void* address = dlsym(library, name);
  Fn fn = nullptr;
  static_assert(sizeof(fn) == sizeof(address), "function and object pointers differ in size");
  if (address != nullptr) std::memcpy(&fn, &address, sizeof(fn));  // POSIX: dlsym gives code addresses
  return fn;
}

// Loaded and initialised once per process (a function-local static: thread-safe); the handle is
// never closed and nvmlShutdown never called (see nvml_view.h).
struct Nvml {
  bool ready = false;
  std::string reason;  // why not ready
  ErrorStringFn error_string = nullptr;
  HandleByPciBusIdFn handle_by_pci_bus_id = nullptr;
  MemoryInfoFn memory_info = nullptr;
  RunningProcessesFn running_processes = nullptr;
  const char* running_processes_name = nullptr;

  std::string error_text(const char* call, nvmlReturn_t rc) const {
    const char* text = error_string != nullptr ? error_string(rc) : nullptr;
    return std::string(call) + " returned " + std::to_string(rc) + " (" +
           (text != nullptr ? text : "no error string") + ")";
  }
};

Nvml load_nvml() {
  Nvml nvml;
  void* library = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (library == nullptr) {
    const char* why = dlerror();
    nvml.reason = std::string("libnvidia-ml.so.1 not loaded (") + (why != nullptr ? why : "dlopen failed") +
                  "): no NVIDIA driver library on this machine";
    return nvml;
  }
  const auto init = symbol<InitFn>(library, "nvmlInit_v2");
  nvml.error_string = symbol<ErrorStringFn>(library, "nvmlErrorString");
  nvml.handle_by_pci_bus_id = symbol<HandleByPciBusIdFn>(library, "nvmlDeviceGetHandleByPciBusId_v2");
  nvml.memory_info = symbol<MemoryInfoFn>(library, "nvmlDeviceGetMemoryInfo");
  for (const char* name : {"nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetComputeRunningProcesses_v2"}) {
    nvml.running_processes = symbol<RunningProcessesFn>(library, name);
    if (nvml.running_processes != nullptr) {
      nvml.running_processes_name = name;
      break;
    }
  }
  std::string missing;
  if (init == nullptr) missing += " nvmlInit_v2";
  if (nvml.handle_by_pci_bus_id == nullptr) missing += " nvmlDeviceGetHandleByPciBusId_v2";
  if (nvml.memory_info == nullptr) missing += " nvmlDeviceGetMemoryInfo";
  if (nvml.running_processes == nullptr) missing += " nvmlDeviceGetComputeRunningProcesses_v3/_v2";
  if (!missing.empty()) {
    nvml.reason = "libnvidia-ml.so.1 lacks" + missing + " (a driver older than R450?)";
    return nvml;
  }
  const nvmlReturn_t rc = init();
  if (rc != kNvmlSuccess) {
    nvml.reason = nvml.error_text("nvmlInit_v2", rc);
    return nvml;
  }
  nvml.ready = true;
  return nvml;
}

const Nvml& nvml_once() {
  static const Nvml nvml = load_nvml();
  return nvml;
}

}  // namespace

NvmlMemory nvml_process_memory_by_pci_bus_id(const std::string& pci_bus_id) {
  NvmlMemory out;
  const Nvml& nvml = nvml_once();
  if (!nvml.ready) {
    out.reason = nvml.reason;
    return out;
  }
  nvmlDevice_t device = nullptr;
  nvmlReturn_t rc = nvml.handle_by_pci_bus_id(pci_bus_id.c_str(), &device);
  if (rc != kNvmlSuccess) {
    out.reason = nvml.error_text("nvmlDeviceGetHandleByPciBusId_v2", rc) + " for PCI bus id " + pci_bus_id;
    return out;
  }
  NvmlMemoryV1 memory{};
  rc = nvml.memory_info(device, &memory);
  if (rc == kNvmlSuccess) {
    out.device_used_bytes = static_cast<int64_t>(memory.used);
    out.device_total_bytes = static_cast<int64_t>(memory.total);
  }
  // Ask for the count first; processes may start between the calls, so retry a few times with room.
  unsigned int count = 0;
  std::vector<NvmlProcessInfoV2> infos;
  rc = nvml.running_processes(device, &count, nullptr);
  for (int attempt = 0; attempt < 4 && rc == kNvmlErrorInsufficientSize; ++attempt) {
    const unsigned int capacity = count + 8;
    infos.assign((capacity * kLongestProcessInfoBytes + sizeof(NvmlProcessInfoV2) - 1) / sizeof(NvmlProcessInfoV2),
                 NvmlProcessInfoV2{});
    count = capacity;
    rc = nvml.running_processes(device, &count, infos.data());
  }
  if (rc != kNvmlSuccess) {
    out.reason = nvml.error_text(nvml.running_processes_name, rc);
    return out;
  }
  const unsigned int self = static_cast<unsigned int>(getpid());
  bool listed = false;
  bool figure_hidden = false;
  int64_t used = 0;
  for (unsigned int i = 0; i < count && i < infos.size(); ++i) {
    if (infos[i].pid != self) continue;
    listed = true;
    // One entry per MIG instance (or MPS client) the process uses: the sum is the process's.
    if (infos[i].usedGpuMemory == kNvmlValueNotAvailable) figure_hidden = true;
    else used += static_cast<int64_t>(infos[i].usedGpuMemory);
  }
  if (!listed) {
    out.reason = "this process (pid " + std::to_string(self) + ") is not among the " + std::to_string(count) +
                 " compute processes " + nvml.running_processes_name +
                 " lists (a container's PID namespace hides it, or no CUDA context exists yet)";
    return out;
  }
  if (figure_hidden) {
    out.reason = std::string(nvml.running_processes_name) + " lists this process without its memory "
                 "(NVML_VALUE_NOT_AVAILABLE: no permission, or a virtualised GPU)";
    return out;
  }
  out.available = true;
  out.process_used_bytes = used;
  return out;
}

NvmlMemory nvml_process_memory(int cuda_device) {
  char pci_bus_id[64] = {};
  FLATPEAK_CUDA_CHECK(cudaDeviceGetPCIBusId(pci_bus_id, static_cast<int>(sizeof pci_bus_id), cuda_device));
  return nvml_process_memory_by_pci_bus_id(pci_bus_id);
}

}  // namespace flatpeak::cuda
