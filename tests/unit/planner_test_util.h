// Tiny hand-built models and hardware for the planner tests: every byte is derivable by hand.
// Tiny MoE: H = 8, V = 32, L = 2 MoE layers, E = 4 experts, k = 2, F = 4, a = 2 heads, g = 1 kv
// head, d = dv = 4, no biases; on N = 2 GPUs (one node of 2), S = 16, b = 1, CP = 1, EP = 2.
#pragma once

#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "plan.h"

namespace flatpeak::planner::test {

inline ModelSpec tiny_moe(int64_t layers = 2) {
  ModelSpec m;
  m.name = "tiny-moe";
  m.architecture = "test";
  m.source = "test";
  m.num_layers = layers;
  m.hidden_size = 8;
  m.vocab_size = 32;
  m.max_position_embeddings = 1 << 20;
  m.attention = AttentionKind::Gqa;
  m.num_heads = 2;
  m.num_kv_heads = 1;
  m.head_dim = 4;
  m.v_head_dim = 4;
  m.num_experts = 4;
  m.top_k = 2;
  m.expert_ffn_width = 4;
  m.layers.assign(static_cast<size_t>(layers), LayerSpec{});
  return m;
}

inline HardwareSpec tiny_gpu() {
  HardwareSpec h;
  h.name = "tiny-gpu";
  h.device_memory_bytes = int64_t{1} << 40;
  h.gpus_per_node = 2;
  h.host_memory_bytes_per_node = int64_t{1} << 40;
  h.runtime_overhead_bytes = 1000;
  h.fragmentation_fraction = 0.05;
  h.allocation_alignment_bytes = 1;
  return h;
}

inline RunSpec spec_of(const std::vector<std::pair<std::string, std::string>>& flags) {
  InputErrors errs;
  RunSpec s = parse_run_flags(flags, errs);
  errs.throw_if_any();
  return s;
}

inline Plan plan_of(const ModelSpec& m, const HardwareSpec& h, std::vector<std::pair<std::string, std::string>> flags) {
  return make_plan(m, h, spec_of(flags));
}

inline const Phase& phase(const Plan& p, const std::string& name) {
  for (const auto& ph : p.timeline.phases)
    if (ph.name == name) return ph;
  throw std::runtime_error("no phase " + name);
}

inline bool has_phase(const Plan& p, const std::string& name) {
  for (const auto& ph : p.timeline.phases)
    if (ph.name == name) return true;
  return false;
}

inline int64_t term_bytes(const Phase& ph, const std::string& name) {
  int64_t sum = 0;
  bool found = false;
  for (const auto& t : ph.terms.terms())
    if (t.name == name) sum += t.bytes, found = true;
  if (!found) throw std::runtime_error("no term " + name + " in " + ph.name);
  return sum;
}

}  // namespace flatpeak::planner::test
