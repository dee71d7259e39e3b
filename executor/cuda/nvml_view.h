// The driver's own count of this process's device memory, through NVML, loaded at run time
// (dlopen "libnvidia-ml.so.1", shipped with the driver): nothing links against NVML, so machines
// without a driver still build and link, and a missing library is a reason, not a failure.
//   NvmlMemory m = nvml_process_memory(/*cuda_device=*/0);
//   if (m.available) use(m.process_used_bytes); else report(m.reason);
// The CUDA device is mapped to NVML's by PCI bus id (CUDA_VISIBLE_DEVICES renumbers CUDA's
// indices, not NVML's). NVML is initialised once per process and never shut down (a shutdown in
// a static destructor could run after the CUDA runtime's own teardown).
#pragma once

#include <cstdint>
#include <string>

namespace flatpeak::cuda {

struct NvmlMemory {
  bool available = false;           // process_used_bytes is this process's figure
  std::string reason;               // why not: library or symbol missing, an NVML error, pid not listed
  int64_t process_used_bytes = -1;  // nvmlDeviceGetComputeRunningProcesses: usedGpuMemory of getpid()
  int64_t device_used_bytes = -1;   // nvmlDeviceGetMemoryInfo: the whole device, all processes
  int64_t device_total_bytes = -1;  // (device figures are filled whenever NVML answers them)
};

// Never throws for NVML's sake: every failure comes back as available = false with a reason.
// Throws BackendError only when the CUDA runtime cannot name the device's PCI bus id.
NvmlMemory nvml_process_memory(int cuda_device);

// The same for a PCI bus id as NVML spells it ("0000:41:00.0"); needs no CUDA runtime call.
NvmlMemory nvml_process_memory_by_pci_bus_id(const std::string& pci_bus_id);

}  // namespace flatpeak::cuda
