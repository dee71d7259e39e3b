// HardwareSpec: one accelerator and the node it sits in, from a hardware card in models/hardware.
//   HardwareSpec g = load_hardware("H200");    // hardware_loader.h; aliases like "H100" accepted
//   bool fits = peak_bytes <= g.device_memory_bytes;
// Bandwidths are bytes per second in ONE direction (cards store per-direction figures).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace flatpeak {

// What a training process holds on the device beside its tensors, by source.
struct OverheadTerms {
  bool present = false;
  int64_t cuda_context_bytes = 0;
  int64_t cublas_bytes = 0;            // handle and loaded kernels
  int64_t cublas_workspace_bytes = 0;  // the explicit cublasSetWorkspace block
  int64_t nccl_bytes = 0;              // communicator buffers (one rank as calibrated)
  int64_t sum() const { return cuda_context_bytes + cublas_bytes + cublas_workspace_bytes + nccl_bytes; }
};

struct HardwareSpec {
  std::string name;                 // card name: "H200"
  std::vector<std::string> aliases; // other accepted names: "H200-141GB", "h200"
  std::string source;               // file it was read from, or "embedded:<card>"

  int64_t device_memory_bytes = 0;          // what the device reports (nvidia-smi memory.total)
  double hbm_bandwidth_bytes_per_s = 0;     // device memory bandwidth
  double bf16_dense_flops = 0;              // dense bf16 tensor FLOP/s
  double scale_up_bandwidth_bytes_per_s = 0;   // NVLink/xGMI per GPU, one direction
  double host_link_bandwidth_bytes_per_s = 0;  // PCIe/C2C per GPU, one direction
  double inter_node_bandwidth_bytes_per_s = 0; // network per GPU, one direction
  int64_t gpus_per_node = 0;
  int64_t host_memory_bytes_per_node = 0;
  double host_memory_bandwidth_bytes_per_s = 0;  // per node
  int64_t cpu_cores_per_node = 0;

  // Runtime overhead and allocator terms; defaults documented in models/README.md, replaced by
  // calibrated figures once measured on the device.
  int64_t runtime_overhead_bytes = 0;       // CUDA context + NCCL buffers + cuBLAS workspace
  double fragmentation_fraction = 0.0;      // allocator reserve as a fraction of the tracked peak
  int64_t allocation_alignment_bytes = 0;   // every device allocation rounds up to this
  bool overhead_calibrated = false;         // true once runtime_overhead_bytes was measured
  // The calibrated overhead's parts, as flatpeak_calibrate measures them (optional in a card;
  // present: they add up to runtime_overhead_bytes).
  OverheadTerms runtime_overhead_terms;
};

}  // namespace flatpeak
