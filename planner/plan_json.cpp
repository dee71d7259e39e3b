// The plan as one JSON document (nlohmann::ordered_json: stable key order; integers for bytes).
#include <fmt/format.h>

#include "plan.h"

namespace flatpeak::planner {

namespace {

using ojson = nlohmann::ordered_json;

std::string layer_pattern(const ModelSpec& m) {
  // One letter per decoder layer: D dense FFN, M MoE; lower case for windowed attention.
  std::string s;
  for (const auto& l : m.layers) {
    char ch = l.ffn == FfnKind::Moe ? 'M' : 'D';
    if (l.window != AttentionWindow::Full) ch = static_cast<char>(ch - 'A' + 'a');
    s.push_back(ch);
  }
  return s;
}

ojson model_json(const ModelSpec& m) {
  ojson j;
  j["name"] = m.name;
  j["architecture"] = m.architecture;
  j["source"] = m.source;
  j["num_layers"] = m.num_layers;
  j["hidden_size"] = m.hidden_size;
  j["vocab_size"] = m.vocab_size;
  j["max_position_embeddings"] = m.max_position_embeddings;
  j["tie_word_embeddings"] = m.tie_word_embeddings;
  j["attention"] = to_string(m.attention);
  j["num_heads"] = m.num_heads;
  j["num_kv_heads"] = m.num_kv_heads;
  j["head_dim"] = m.head_dim;
  j["v_head_dim"] = m.v_head_dim;
  j["q_lora_rank"] = m.q_lora_rank;
  j["kv_lora_rank"] = m.kv_lora_rank;
  j["qk_nope_head_dim"] = m.qk_nope_head_dim;
  j["qk_rope_head_dim"] = m.qk_rope_head_dim;
  j["dense_ffn_width"] = m.dense_ffn_width;
  j["num_experts"] = m.num_experts;
  j["top_k"] = m.top_k;
  j["expert_ffn_width"] = m.expert_ffn_width;
  j["num_shared_experts"] = m.num_shared_experts;
  j["shared_expert_ffn_width"] = m.shared_expert_ffn_width;
  j["shared_expert_gate"] = m.shared_expert_gate;
  j["mtp_layers"] = m.mtp_layers;
  int64_t window = 0;
  for (const auto& l : m.layers)
    if (l.window != AttentionWindow::Full) window = l.attention_window_tokens;
  j["attention_window_tokens"] = window;
  j["layers"] = layer_pattern(m);
  return j;
}

ojson hardware_json(const HardwareSpec& h) {
  ojson j;
  j["name"] = h.name;
  j["source"] = h.source;
  j["device_memory_bytes"] = h.device_memory_bytes;
  j["gpus_per_node"] = h.gpus_per_node;
  j["host_memory_bytes_per_node"] = h.host_memory_bytes_per_node;
  j["host_link_bandwidth_bytes_per_s"] = h.host_link_bandwidth_bytes_per_s;
  j["allocation_alignment_bytes"] = h.allocation_alignment_bytes;
  return j;
}

ojson run_json(const Plan& p) {
  const ResolvedRun& r = p.run;
  ojson j;
  j["gpus"] = r.gpus;
  j["context_tokens"] = r.context_tokens;
  j["micro_batch"] = r.micro_batch;
  j["global_batch"] = r.global_batch;
  j["accumulation_steps"] = r.accumulation_steps();
  j["cp"] = r.cp;
  j["cp_auto"] = r.cp_auto;
  j["dp"] = r.dp();
  j["ep"] = r.ep;
  j["experts_per_rank"] = p.work.experts_per_rank;
  j["tokens_per_gpu"] = p.work.tokens;
  j["gpus_per_node"] = r.gpus_per_node;
  j["host_memory_bytes_per_node"] = r.host_memory_bytes_per_node;
  j["host_usable_fraction"] = r.host_usable_fraction;
  j["host_fixed_bytes_per_node"] = r.host_fixed_bytes_per_node;
  j["mtp"] = r.mtp;
  j["schedule"] = to_string(r.schedule);
  j["imbalance"] = p.work.moe_loads.empty() ? std::string("balanced") : to_string(r.imbalance);
  j["overhead_bytes"] = r.overhead_bytes;
  j["overhead_calibrated"] = r.overhead_calibrated;
  if (r.overhead_terms.present) {
    const OverheadTerms& t = r.overhead_terms;
    j["overhead_terms"] = {{"cuda_context_bytes", t.cuda_context_bytes},
                           {"cublas_bytes", t.cublas_bytes},
                           {"cublas_workspace_bytes", t.cublas_workspace_bytes},
                           {"nccl_bytes", t.nccl_bytes}};
  }
  j["fragmentation"] = r.fragmentation;
  j["allocation_alignment_bytes"] = r.alignment_bytes;
  return j;
}

ojson params_json(const Workload& w) {
  ojson j;
  j["total"] = w.counts.total;
  j["trained"] = w.trained_params;
  j["shard_per_gpu"] = w.shard_params;
  j["expert_each"] = w.expert_params_each;
  ojson units = ojson::array();
  for (const auto& u : w.units)
    units.push_back(ojson{{"name", u.name}, {"params", u.params}, {"gathered_params", u.gathered_params},
                          {"shard_params", u.shard_params}});
  j["fsdp_units"] = std::move(units);
  return j;
}

ojson routing_json(const Plan& p) {
  ojson list = ojson::array();
  for (const auto& l : p.work.moe_loads) {
    ojson j;
    j["send_rows"] = l.send_rows;
    j["recv_rows_ep"] = l.recv_rows_ep;
    j["rho_ep"] = l.rho_ep;
    if (p.run.llep) {
      j["lla_ran"] = l.lla_ran;
      j["recv_rows_llep"] = l.recv_rows_llep;
      j["rho_l"] = l.rho_llep;
      j["foreign_experts"] = l.foreign_experts;
      j["lent_experts"] = l.lent_experts;
      if (p.run.chunk_cap_rows > 0) {
        j["chunk_cap_rows"] = l.chunk_cap_rows;
        j["round_recv_rows"] = l.round_recv_rows;
        j["rounds"] = l.rounds;
      }
    }
    list.push_back(std::move(j));
  }
  return list;
}

ojson terms_json(const std::vector<Term>& terms) {
  ojson list = ojson::array();
  for (const auto& t : terms)
    list.push_back(ojson{{"name", t.name}, {"shape", t.shape}, {"count", t.count}, {"bytes", t.bytes}});
  return list;
}

ojson summary_json(const PlanSummary& s, bool with_terms) {
  ojson j;
  ojson peaks;
  for (const Peak& p : s.peaks) {
    ojson pj;
    pj["bytes"] = p.bytes;
    pj["component_bytes"] = p.component_bytes;
    pj["phase"] = p.phase.empty() ? ojson(nullptr) : ojson(p.phase);
    if (with_terms) pj["terms"] = terms_json(p.terms);
    peaks[to_string(p.kind)] = std::move(pj);
  }
  j["peaks"] = std::move(peaks);
  j["gpu"] = ojson{{"peak_bytes", s.gpu_peak_bytes},
                   {"peak_phase", s.gpu_peak_phase},
                   {"overhead_bytes", s.overhead_bytes},
                   {"fragmentation_bytes", s.fragmentation_bytes},
                   {"required_bytes", s.required_bytes},
                   {"budget_bytes", s.budget_bytes},
                   {"fits", s.gpu_fits},
                   {"binding", to_string(s.binding)}};
  j["host"] = ojson{{"peak_bytes", s.host_peak_bytes},
                    {"budget_bytes", s.host_budget_bytes},
                    {"fits", s.host_fits},
                    {"per_gpu_bytes", s.host_per_gpu_bytes},
                    {"fixed_bytes", s.host_fixed_bytes}};
  return j;
}

}  // namespace

ojson timeline_to_json(const Timeline& tl) {
  ojson j;
  j["format"] = "flatpeak-timeline";
  j["version"] = 1;
  j["source"] = "predicted";
  j["unit"] = "bytes";
  ojson phases = ojson::array();
  const int64_t host_total = tl.host_per_gpu.bytes(Space::Host);
  for (const Phase& p : tl.phases) {
    ojson pj;
    pj["name"] = p.name;
    if (!p.folds.empty()) pj["folds"] = p.folds;
    ojson dev;
    for (int c = 0; c < kCategoryCount; ++c) {
      const auto cat = static_cast<Category>(c);
      dev[to_string(cat)] = p.terms.bytes(cat, Space::Device);
    }
    dev["total"] = p.device_bytes();
    pj["device"] = std::move(dev);
    pj["host"] = ojson{{"optimizer", tl.host_per_gpu.bytes(Category::Optimizer, Space::Host)},
                       {"boundaries", tl.host_per_gpu.bytes(Category::Boundaries, Space::Host)},
                       {"total", host_total}};
    phases.push_back(std::move(pj));
  }
  j["phases"] = std::move(phases);
  return j;
}

const std::vector<PlanObject>& plan_json_objects() {
  using K = PlanFieldKind;
  // In the order of the writers above; a key added there is added here.
  static const std::vector<PlanObject> objects = {
      {"",
       {{"schema_version", K::Integer}, {"inputs", K::Object}, {"knobs", K::Object}, {"routing", K::Array},
        {"peaks", K::Object}, {"gpu", K::Object}, {"host", K::Object}, {"time", K::Object}, {"diagnosis", K::Object},
        {"timeline", K::Object}, {"baseline", K::Object}, {"warnings", K::Array}}},
      {"/inputs", {{"model", K::Object}, {"hardware", K::Object}, {"run", K::Object}, {"params", K::Object}}},
      {"/inputs/model",
       {{"name", K::String},
        {"architecture", K::String},
        {"source", K::String},
        {"num_layers", K::Integer},
        {"hidden_size", K::Integer},
        {"vocab_size", K::Integer},
        {"max_position_embeddings", K::Integer},
        {"tie_word_embeddings", K::Bool},
        {"attention", K::String},
        {"num_heads", K::Integer},
        {"num_kv_heads", K::Integer},
        {"head_dim", K::Integer},
        {"v_head_dim", K::Integer},
        {"q_lora_rank", K::Integer},
        {"kv_lora_rank", K::Integer},
        {"qk_nope_head_dim", K::Integer},
        {"qk_rope_head_dim", K::Integer},
        {"dense_ffn_width", K::Integer},
        {"num_experts", K::Integer},
        {"top_k", K::Integer},
        {"expert_ffn_width", K::Integer},
        {"num_shared_experts", K::Integer},
        {"shared_expert_ffn_width", K::Integer},
        {"shared_expert_gate", K::Bool},
        {"mtp_layers", K::Integer},
        {"attention_window_tokens", K::Integer},
        {"layers", K::String}}},
      {"/inputs/hardware",
       {{"name", K::String},
        {"source", K::String},
        {"device_memory_bytes", K::Integer},
        {"gpus_per_node", K::Integer},
        {"host_memory_bytes_per_node", K::Integer},
        {"host_link_bandwidth_bytes_per_s", K::Number},
        {"allocation_alignment_bytes", K::Integer}}},
      {"/inputs/run",
       {{"gpus", K::Integer},
        {"context_tokens", K::Integer},
        {"micro_batch", K::Integer},
        {"global_batch", K::Integer},
        {"accumulation_steps", K::Integer},
        {"cp", K::Integer},
        {"cp_auto", K::Bool},
        {"dp", K::Integer},
        {"ep", K::Integer},
        {"experts_per_rank", K::Integer},
        {"tokens_per_gpu", K::Integer},
        {"gpus_per_node", K::Integer},
        {"host_memory_bytes_per_node", K::Integer},
        {"host_usable_fraction", K::Number},
        {"host_fixed_bytes_per_node", K::Integer},
        {"mtp", K::Bool},
        {"schedule", K::String},
        {"imbalance", K::String},
        {"overhead_bytes", K::Integer},
        {"overhead_calibrated", K::Bool},
        {"overhead_terms", K::Object},
        {"fragmentation", K::Number},
        {"allocation_alignment_bytes", K::Integer}}},
      {"/inputs/run/overhead_terms",
       {{"cuda_context_bytes", K::Integer}, {"cublas_bytes", K::Integer}, {"cublas_workspace_bytes", K::Integer},
        {"nccl_bytes", K::Integer}}},
      {"/inputs/params",
       {{"total", K::Integer}, {"trained", K::Integer}, {"shard_per_gpu", K::Integer}, {"expert_each", K::Integer},
        {"fsdp_units", K::Array}}},
  };
  return objects;
}

const std::vector<std::string>& plan_knob_names() {
  static const std::vector<std::string> names = {
      "llep",       "chunk_cap_rows", "dispatch_mode", "llep_alpha",  "llep_lambda",  "llep_min_rows",
      "striping",   "dispatch_depth", "vocab",         "ring_size",   "ring_rotate",  "vocab_backward",
      "token_block", "vocab_block",   "boundaries",    "sco_layers",  "sco_prefetch", "optimizer",
      "bucket_params", "bucket_depth", "cp",           "micro_batch"};
  return names;
}

ojson plan_to_json(const Plan& p) {
  ojson j;
  j["schema_version"] = kPlanSchemaVersion;
  ojson inputs;
  inputs["model"] = model_json(p.model);
  inputs["hardware"] = hardware_json(p.hardware);
  inputs["run"] = run_json(p);
  inputs["params"] = params_json(p.work);
  j["inputs"] = std::move(inputs);
  ojson knobs;
  for (const Knob& k : p.run.knobs) knobs[k.name] = ojson{{"value", k.value}, {"reason", k.reason}};
  j["knobs"] = std::move(knobs);
  if (!p.work.moe_loads.empty()) j["routing"] = routing_json(p);
  ojson s = summary_json(p.summary, true);
  j["peaks"] = std::move(s["peaks"]);
  j["gpu"] = std::move(s["gpu"]);
  ojson host = std::move(s["host"]);
  host["terms_per_gpu"] = terms_json(p.timeline.host_per_gpu.terms());
  j["host"] = std::move(host);
  j["time"] = step_time_to_json(p.time);
  if (!p.diagnosis.is_null()) j["diagnosis"] = p.diagnosis;
  j["timeline"] = timeline_to_json(p.timeline);
  ojson base = summary_json(p.baseline, false);
  base = ojson{{"schedule", "baseline"}, {"peaks", base["peaks"]}, {"gpu", base["gpu"]}, {"host", base["host"]}};
  j["baseline"] = std::move(base);
  j["warnings"] = p.warnings;
  return j;
}

}  // namespace flatpeak::planner
