// The step-time model. Per micro-batch on the worst rank, then accumulated, plus the optimizer
// step. Overlap rules (planner/README.md, "Step time"):
//  - Compute (attention, dense GEMMs, expert GEMMs, LM head) at reference efficiency is the
//    critical path; everything else adds what it cannot hide.
//  - FSDP all-gathers (forward and backward, bf16) and reduce-scatters (fp32) hide behind the
//    micro-batch's reference compute; the excess is exposed. Waits and slow small GEMMs hide
//    nothing (conservative).
//  - EP all-to-all: blocking (dispatch, experts, combine in sequence) for standard EP and LLEP
//    without a cap; PipelinedLLEP with depth ≥ 2 overlaps round j+1's transfers with round j's
//    expert GEMMs. Each round pays a latency per transfer.
//  - CP ring attention: each hop's K,V transfer hides behind that hop's attention block;
//    sliding-window halos are one exposed hop.
//  - Ring-DTP: each hop hides behind the logits blocks of the shard in hand.
//  - SCO: a boundary's D2H copy runs beside the next layer's forward (the next layer waits for
//    it: one copy in flight); in backward, boundary l is fetched once layer l+p+1 is done
//    (prefetch depth p) and layer l waits for it. Sync offload (practice) blocks on every copy.
//  - OffloadStreamAdamW: buckets flow D2H -> CPU AdamW -> H2D (depth in flight), starting during
//    the last micro-batch's backward; what runs past its reference compute is exposed. Serial
//    offload and the GPU AdamW run after backward, exposed. H2D and D2H are separate directions.
#include "step_time.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <utility>

#include <fmt/format.h>

#include "spec/errors.h"
#include "spec/sizes.h"
#include "terms.h"

namespace flatpeak::planner {

namespace {

double d(int64_t v) { return static_cast<double>(v); }

struct KeyField {
  const char* name;
  double Efficiency::*field;
  bool latency_us;
};

const std::vector<KeyField>& key_fields() {
  static const std::vector<KeyField> fields = {
      {"gemm", &Efficiency::gemm, false},
      {"attention", &Efficiency::attention, false},
      {"hbm", &Efficiency::hbm, false},
      {"nvlink", &Efficiency::nvlink, false},
      {"network", &Efficiency::network, false},
      {"host-link", &Efficiency::host_link, false},
      {"host-memory", &Efficiency::host_memory, false},
      {"round-latency-us", &Efficiency::round_latency_s, true},
      {"hop-latency-us", &Efficiency::hop_latency_s, true},
      {"bucket-latency-us", &Efficiency::bucket_latency_s, true},
      {"transfer-latency-us", &Efficiency::transfer_latency_s, true},
      {"kernel-latency-us", &Efficiency::kernel_latency_s, true},
  };
  return fields;
}

}  // namespace

const std::vector<EfficiencyKey>& efficiency_keys() {
  static const std::vector<EfficiencyKey> keys = {
      {"gemm", "large bf16 GEMMs, fraction of the card's dense bf16 FLOP/s (default 0.75)"},
      {"attention", "flash attention forward and backward, fraction of dense bf16 FLOP/s (default 0.5)"},
      {"hbm", "device memory bandwidth for memory-bound kernels (default 0.8)"},
      {"nvlink", "scale-up bandwidth per GPU (default 0.75)"},
      {"network", "inter-node bandwidth per GPU (default 0.8)"},
      {"host-link", "PCIe/C2C bandwidth per GPU (default 0.8)"},
      {"host-memory", "host DRAM bandwidth per node for the CPU AdamW (default 0.5)"},
      {"round-latency-us", "latency per all-to-all round in microseconds (default 20)"},
      {"hop-latency-us", "latency per ring hop in microseconds (default 10)"},
      {"bucket-latency-us", "latency per optimizer bucket in microseconds (default 50)"},
      {"transfer-latency-us", "latency per boundary copy to or from the host in microseconds (default 10)"},
      {"kernel-latency-us", "latency per kernel launch (expert GEMM round, logits block) in microseconds (default 5)"},
  };
  return keys;
}

Efficiency parse_efficiency(const std::string& text, InputErrors& errs) {
  Efficiency e;
  // Bounds that keep every time finite and meaningful: no device runs a GEMM or a link at under 1 %
  // of its rating, and no launch, hop or copy waits a second; past them a time overflows (1e-300
  // gave 4e301 s and "flop": null in the JSON) or says nothing about a real machine.
  constexpr double kMinFraction = 0.01, kMaxLatencyUs = 1e6;
  const std::string valid = "valid: key=value,... with keys gemm, attention, hbm, nvlink, network, host-link, "
                            "host-memory (fractions in [0.01, 1]) and round-, hop-, bucket-, transfer-, "
                            "kernel-latency-us (microseconds in [0, 1e6]), each key once";
  std::vector<std::string> seen;
  size_t pos = 0;
  while (pos <= text.size()) {
    const size_t comma = text.find(',', pos);
    const std::string item = text.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    const size_t eq = item.find('=');
    const std::string key = item.substr(0, eq);
    const KeyField* field = nullptr;
    for (const auto& f : key_fields())
      if (key == f.name) field = &f;
    if (!field) {
      std::vector<std::string> names;
      for (const auto& f : key_fields()) names.emplace_back(f.name);
      const std::string guess = did_you_mean(key, names);
      errs.add(Diagnostic{"", "--efficiency", fmt::format("unknown key '{}'", key),
                          guess.empty() ? valid : "did you mean '" + guess + "'?"});
    } else if (std::find(seen.begin(), seen.end(), key) != seen.end()) {
      errs.add(Diagnostic{"", "--efficiency", fmt::format("{} given twice (in '{}')", key, text), valid});
    } else {
      seen.push_back(key);
      const std::string value = eq == std::string::npos ? "" : item.substr(eq + 1);
      const double v = parse_decimal(value).value_or(std::nan(""));  // no hex, inf or nan
      const bool ok = std::isfinite(v) && (field->latency_us ? v >= 0 && v <= kMaxLatencyUs : v >= kMinFraction && v <= 1);
      if (!ok) {
        errs.add(Diagnostic{"", "--efficiency",
                            fmt::format("{} must be {} (got '{}')", key,
                                        field->latency_us ? "a number of microseconds in [0, 1e6]" : "a fraction in [0.01, 1]", value),
                            valid});
      } else {
        e.*(field->field) = field->latency_us ? v * 1e-6 : v;
      }
    }
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return e;
}

nlohmann::ordered_json efficiency_to_json(const Efficiency& e) {
  nlohmann::ordered_json j;
  for (const auto& f : key_fields()) j[f.name] = f.latency_us ? e.*(f.field) * 1e6 : e.*(f.field);
  return j;
}

MatmulParams matmul_params(const ModelSpec& m) {
  MatmulParams p;
  const int64_t H = m.hidden_size;
  const int64_t a = m.num_heads;
  if (m.attention == AttentionKind::Mla) {
    const int64_t qk = m.qk_nope_head_dim + m.qk_rope_head_dim;
    const int64_t q = m.q_lora_rank > 0 ? H * m.q_lora_rank + m.q_lora_rank * a * qk : H * a * qk;
    const int64_t kv = H * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank * a * (m.qk_nope_head_dim + m.v_head_dim);
    p.attention = q + kv + a * m.v_head_dim * H;
  } else {
    p.attention = H * a * m.head_dim + H * m.num_kv_heads * m.head_dim + H * m.num_kv_heads * m.v_head_dim +
                  a * m.v_head_dim * H;
  }
  p.dense_ffn = 3 * H * m.dense_ffn_width;
  p.moe_common = H * m.num_experts + 3 * H * m.shared_expert_ffn_width;
  p.expert = 3 * H * m.expert_ffn_width;
  p.head = H * m.vocab_size;
  p.mtp_extra = 2 * H * H;
  return p;
}

double mean_attended_keys(const LayerSpec& layer, int64_t context_tokens) {
  const double S = d(context_tokens);
  const int64_t w = layer.attention_window_tokens;
  if (layer.window == AttentionWindow::Full || w <= 0 || (layer.window == AttentionWindow::Sliding && w >= context_tokens))
    return (S + 1) / 2;
  const double W = d(w);
  if (layer.window == AttentionWindow::Sliding) return (W * (W + 1) / 2 + (S - W) * W) / S;
  // Chunked: queries attend within their chunk of w tokens.
  const double q = d(context_tokens / w), r = d(context_tokens % w);
  return (q * W * (W + 1) / 2 + r * (r + 1) / 2) / S;
}

double attention_forward_flops_per_token(const ModelSpec& m, const LayerSpec& layer, int64_t context_tokens) {
  return 2.0 * d(m.num_heads) * d(m.head_dim + m.v_head_dim) * mean_attended_keys(layer, context_tokens);
}

TimeModel::TimeModel(const ModelSpec& model, const HardwareSpec& hardware, const ResolvedRun& run, const Workload& work,
                     const Efficiency& efficiency)
    : model_(model), hw_(hardware), eff_(efficiency) {
  N_ = run.gpus;
  gpn_ = std::max<int64_t>(1, run.gpus_per_node);
  cp_ = run.cp;
  ep_ = run.ep;
  T_ = work.tokens;
  S_ = run.context_tokens;
  accumulation_ = std::max<int64_t>(1, work.accumulation_steps);
  llep_ = run.llep;
  pipelined_ = run.llep && run.chunk_cap_rows > 0;
  store_ = run.dispatch_mode == DispatchMode::Store;
  depth_ = run.dispatch_depth;
  vocab_mode_ = run.vocab;
  vocab_backward_ = run.vocab_backward;
  boundary_mode_ = run.boundaries;
  placement_ = run.optimizer;
  const int64_t L = model.num_layers;
  const int64_t M = run.mtp ? model.mtp_layers : 0;
  losses_ = 1 + M;
  shard_params_ = work.shard_params;
  tokens_per_step_ = d(run.global_batch) * d(run.context_tokens);

  // Rates; a figure the card lacks (0) makes its terms free rather than infinite.
  auto rate = [](double v) { return v > 0 ? v : std::numeric_limits<double>::infinity(); };
  gemm_rate_ = rate(hardware.bf16_dense_flops * eff_.gemm);
  attn_rate_ = rate(hardware.bf16_dense_flops * eff_.attention);
  hbm_rate_ = rate(hardware.hbm_bandwidth_bytes_per_s * eff_.hbm);
  nvlink_rate_ = rate(hardware.scale_up_bandwidth_bytes_per_s * eff_.nvlink);
  network_rate_ = rate(hardware.inter_node_bandwidth_bytes_per_s * eff_.network);
  host_link_rate_ = rate(hardware.host_link_bandwidth_bytes_per_s * eff_.host_link);
  // CPU AdamW: host-memory bandwidth shared by the node's GPUs.
  cpu_rate_ = rate(hardware.host_memory_bandwidth_bytes_per_s * eff_.host_memory / d(gpn_));
  const double gemm_rate = gemm_rate_;
  const double attn_rate = attn_rate_;
  const MatmulParams mm = matmul_params(model);
  const double T = d(T_);
  const int64_t E = model.num_experts;
  const double kv = d(model.num_kv_heads * (model.head_dim + model.v_head_dim));

  for (int64_t l = 0; l < L + M; ++l) {
    const bool mtp = l >= L;
    LayerSpec spec;
    if (!mtp) spec = model.layers[static_cast<size_t>(l)];
    else spec.ffn = E > 0 ? FfnKind::Moe : FfnKind::Dense;
    const bool moe = spec.ffn == FfnKind::Moe && E > 0;
    const int64_t dense_params = mm.attention + (moe ? mm.moe_common : mm.dense_ffn) + (mtp ? mm.mtp_extra : 0);
    const double dense_flops = 2 * T * d(dense_params);  // one pass (2 FLOPs per weight per token)
    double expert_flops = 0, expert_model_flops = 0;
    if (moe) {
      const int64_t moe_index = work.moe_index[static_cast<size_t>(l)];
      moe_layer_loads_.push_back(moe_index);
      const MoeLoad& load = work.load_of(moe_index);
      const int64_t rows = run.llep ? load.recv_rows_llep : load.recv_rows_ep;  // the worst rank's
      expert_flops = 2 * d(rows) * d(mm.expert);
      expert_model_flops = 2 * T * d(model.top_k) * d(mm.expert);
    }
    const double attn_fwd = T * attention_forward_flops_per_token(model, spec, S_);
    const double gemm_pass_s = (dense_flops + expert_flops) / gemm_rate;
    const double attn_pass_s = attn_fwd / attn_rate;
    // Full checkpointing: no-grad forward, then recompute + backward (2 passes of GEMMs, flash
    // backward ≈ 2.5 forward passes with its score recompute).
    LayerTime lt{gemm_pass_s + attn_pass_s, 3 * gemm_pass_s + 3.5 * attn_pass_s};
    if (!mtp) layers_.push_back(lt);
    mtp_backward_s_ += mtp ? lt.backward_s : 0;
    attention_s_ += 4.5 * attn_pass_s;
    gemm_dense_s_ += 4 * dense_flops / gemm_rate;
    gemm_experts_s_ += 4 * expert_flops / gemm_rate;
    model_flops_mb_ += 3 * (dense_flops + expert_model_flops) + 3 * attn_fwd;
    hw_flops_dense_mb_ += 4 * (dense_flops + expert_flops) + 4.5 * attn_fwd;

    if (cp_ > 1) {
      const double hops = d(cp_ - 1);
      const CpKeyReach reach = cp_key_reach(spec.window, spec.attention_window_tokens, T_, cp_);
      if (!reach.ring) {
        // Halo of the previous rank's last keys the window reaches (none for chunks that never
        // straddle a rank boundary): K,V in forward and recompute, K,V + fp32 dK,dV in backward;
        // one exposed hop per pass.
        if (reach.halo_rows > 0) {
          const double bytes = d(reach.halo_rows) * kv * (2 + 2 + 6);
          cp_bytes_ += bytes;
          const double busy = link_seconds(bytes, cp_, true);
          cp_busy_s_ += busy;
          cp_exposed_s_ += busy + 3 * eff_.hop_latency_s;
        }
      } else {
        // (CP−1) hops per pass: K,V chunks (bf16) forward and in the recompute; K,V + dK,dV
        // (fp32) in backward. Each hop hides behind 1/CP of that pass's attention.
        const double chunk = T * kv;
        const double passes[3][2] = {{2, attn_pass_s}, {2, attn_pass_s}, {6, 2.5 * attn_pass_s}};
        for (const auto& pass : passes) {
          const double hop_bytes = chunk * pass[0];
          const double hop_s = link_seconds(hop_bytes, cp_, true);
          cp_bytes_ += hops * hop_bytes;
          cp_busy_s_ += hops * hop_s;
          cp_exposed_s_ += hops * (std::max(0.0, hop_s - pass[1] / d(cp_)) + eff_.hop_latency_s);
        }
      }
    }
  }
  // LM head per loss: one GEMM pass = 2·T·H·V. Materialized and in-forward: 3 passes; the
  // blocked/ring backward that recomputes logits from lse: 4.
  const double head_pass = 2 * T * d(mm.head);
  const bool recompute_logits = vocab_mode_ != VocabMode::Materialized && vocab_backward_ == VocabBackward::Recompute;
  head_passes_ = recompute_logits ? 4 : 3;
  head_pass_flops_ = head_pass;
  head_ref_s_ = d(losses_) * d(head_passes_) * head_pass / gemm_rate;
  model_flops_mb_ += d(losses_) * 3 * head_pass;
  hw_flops_dense_mb_ += d(losses_) * d(head_passes_) * head_pass;
  const double head_backward_passes = vocab_mode_ == VocabMode::Materialized ? 2 : (recompute_logits ? 3 : 0);
  loss_backward_s_ = d(losses_) * head_backward_passes * head_pass / gemm_rate;
  compute_ref_s_ = ((attention_s_ + gemm_dense_s_) + gemm_experts_s_) + head_ref_s_;

  // FSDP: per micro-batch, gathers in forward and in backward (bf16) and one reduce-scatter of
  // fp32 gradients. Dense parts over N, local experts over N/EP.
  const int64_t expert_group = N_ / std::max<int64_t>(1, ep_);
  const int64_t local_expert_params = work.experts_per_rank * work.expert_params_each;
  auto unit_bytes = [](double params, int64_t group) {
    return group <= 1 ? 0.0 : params * (2 * 2 + 4) * d(group - 1) / d(group);
  };
  for (size_t u = 0; u < work.units.size(); ++u) {
    const FsdpUnit& unit = work.units[u];
    if (static_cast<int64_t>(u) == work.head_unit) {
      fsdp_head_params_ = unit.gathered_params;
      continue;
    }
    const bool has_experts = unit.params != unit.gathered_params;  // MoE layers: E/EP local experts
    const int64_t experts = has_experts ? local_expert_params : 0;
    fsdp_rest_bytes_ += unit_bytes(d(unit.gathered_params - experts), N_) + unit_bytes(d(experts), expert_group);
  }

  double backward_ref = loss_backward_s_ + mtp_backward_s_;
  for (const LayerTime& lt : layers_) backward_ref += lt.backward_s;
  backward_window_s_ = backward_ref;
}

double TimeModel::link_seconds(double bytes, int64_t group, bool contiguous) const {
  if (group <= 1 || bytes <= 0) return 0;
  const double nvlink = nvlink_rate_, network = network_rate_;
  if (group <= gpn_ && (contiguous || N_ <= gpn_)) return bytes / nvlink;
  if (!contiguous) return bytes / network;  // strided groups span nodes: every byte on the network
  // A contiguous group over several nodes: peers on the node over NVLink, the rest over the
  // network, both at once.
  const double on_node = d(gpn_ - 1) / d(group - 1);
  return std::max(bytes * on_node / nvlink, bytes * (1 - on_node) / network);
}

double TimeModel::gemm_seconds(double flops, double bytes) const {
  // Roofline: GEMMs with few rows per weight matrix are bound by reading the weights.
  return std::max(flops / gemm_rate_, bytes / hbm_rate_);
}

DispatchTime TimeModel::dispatch(const std::vector<MoeLoad>& loads) const {
  DispatchTime out;
  if (moe_layer_loads_.empty() || loads.empty()) return out;
  const MatmulParams mm = matmul_params(model_);
  const double H = d(model_.hidden_size), F = d(model_.expert_ffn_width);
  const double frac = ep_ > 1 ? d(ep_ - 1) / d(ep_) : 0;
  const double latency = ep_ > 1 ? eff_.round_latency_s : 0;
  const double ref_rate = gemm_rate_;
  const double weight_bytes = d(mm.expert) * 2;
  double rows_sum = 0, gemms = 0;
  // MoE layers with the same load contribute equally: one evaluation per distinct load.
  std::vector<int64_t> layers_per_load(loads.size(), 0);
  for (int64_t moe_index : moe_layer_loads_) ++layers_per_load[static_cast<size_t>(moe_index) % loads.size()];
  for (size_t li = 0; li < loads.size(); ++li) {
    if (layers_per_load[li] == 0) continue;
    const double count = d(layers_per_load[li]);
    const MoeLoad& load = loads[li];
    const int64_t rows = llep_ ? load.recv_rows_llep : load.recv_rows_ep;
    const double X = d(std::max(load.send_rows, rows)) * H * 2 * frac;  // one transfer of all rows
    const double Wf = llep_ ? d(std::max(load.foreign_experts, load.lent_experts)) * weight_bytes : 0;
    const double local = d(model_.num_experts / std::max<int64_t>(1, ep_) + (llep_ ? load.foreign_experts : 0));
    const double n = pipelined_ ? d(std::max<int64_t>(1, load.rounds)) : 1;
    const double flops = 2 * d(rows) * d(mm.expert);
    // Each round reads every local expert's weights; activations in and out once.
    const double bytes = n * local * weight_bytes + d(rows) * (2 * H + 3 * F) * 2;
    const double pass = gemm_seconds(flops, bytes) + n * 3 * eff_.kernel_latency_s;
    const double ref = flops / ref_rate;
    rows_sum += count * d(rows);
    gemms += count * n * local;
    // Pipelines of one MoE layer per micro-batch: {transfers in, transfers out, GEMM passes}.
    struct Pipe {
      double in, out, passes;
    };
    // Forward, recompute, backward; recompute mode: the backward re-dispatches each round.
    const bool three = !pipelined_ || store_;
    const Pipe pipes[3] = {{X, X, 1}, three ? Pipe{X, X, 1} : Pipe{2 * X, X, 3}, {X, X, 2}};
    for (int pi = 0; pi < (three ? 3 : 2); ++pi) {
      const Pipe& p = pipes[pi];
      const double c_in = link_seconds(p.in / n, ep_, true), c_out = link_seconds(p.out / n, ep_, true);
      const double e = p.passes * pass / n;
      double total = 0;
      if (pipelined_ && depth_ >= 2) total = c_in + e + c_out + (n - 1) * std::max(c_in + c_out, e);
      else total = n * (c_in + e + c_out);
      total += 2 * n * latency;
      out.busy_s += count * n * (c_in + c_out);
      out.bytes += count * (p.in + p.out);
      out.exposed_s += count * (total - p.passes * pass);
      out.small_gemm_s += count * p.passes * (pass - ref);
    }
    // LLEP: foreign expert weights arrive before their rows (forward, recompute) and their
    // gradients go back after the backward; not hidden.
    if (llep_ && Wf > 0) {
      const double w = link_seconds(Wf, ep_, true);
      const double transfers = pipelined_ && !store_ ? 3 : 4;
      out.exposed_s += count * transfers * w;
      out.busy_s += count * transfers * w;
      out.bytes += count * transfers * Wf;
    }
  }
  out.rows_per_gemm = gemms > 0 ? rows_sum / gemms : 0;
  return out;
}

double TimeModel::head_pass_seconds(int64_t rows, int64_t cols, int64_t gemms, int64_t token_block, int64_t vocab_block,
                                    int64_t blocks, bool materialized) const {
  // One visit of the logits: `gemms` GEMMs over [rows × H] × [H × cols] in `blocks` blocks of
  // [token_block × vocab_block], reading X and W blocks per GEMM and the fp32 logits block
  // (written and read back; bf16 dlogits too when gradients are formed).
  const double H = d(model_.hidden_size);
  const double flops = d(gemms) * 2 * d(rows) * H * d(cols);
  if (materialized) return flops / gemm_rate_;
  const double block_bytes = d(gemms) * (d(token_block) + d(vocab_block)) * H * 2 +
                             d(token_block) * d(vocab_block) * (gemms > 1 ? 12 : 8);
  return gemm_seconds(flops, d(blocks) * block_bytes) + d(blocks) * d(gemms) * eff_.kernel_latency_s;
}

bool TimeModel::logits_visited_once(int64_t ring_size, int64_t vocab_block) const {
  return vocab_mode_ != VocabMode::Materialized && vocab_backward_ == VocabBackward::InForward && ring_size == 1 &&
         vocab_block >= model_.vocab_size;
}

VocabTime TimeModel::vocab(int64_t ring_size, RingRotate rotate, int64_t token_block, int64_t vocab_block) const {
  VocabTime out;
  const int64_t V = model_.vocab_size;
  const double H = d(model_.hidden_size), T = d(T_);
  const int64_t R = vocab_mode_ == VocabMode::RingDtp ? std::max<int64_t>(1, ring_size) : 1;
  double total = 0;
  if (vocab_mode_ == VocabMode::Materialized) {
    // GEMMs at reference, plus the [T, V] logits traffic: bf16 logits written and read, fp32
    // log-softmax written and read, fp32 dlogits written and read twice (dX and dW).
    const double traffic = T * d(V) * (2 + 2 + 4 + 4 + 4 + 8);
    total = d(losses_) * (head_pass_seconds(T_, V, 3, 0, 0, 0, true) +
                          traffic / hbm_rate_);
  } else {
    const int64_t shard = ceil_div(V, R);
    const int64_t tb = std::max<int64_t>(1, std::min(token_block, T_));
    const int64_t vb = std::max<int64_t>(1, std::min(vocab_block, shard));
    const int64_t blocks = R * ceil_div(T_, tb) * ceil_div(shard, vb);
    // Two visits of the logits: the forward (1 GEMM per block) makes lse, then the gradient pass
    // (recompute + dX + dW) in the backward, or right after the forward with gradients in
    // forward, which need every row's lse before any dz. One visit (3 GEMMs per block, as
    // materialised) with gradients in forward on one rank with one vocab block: the executor's
    // fused pass reads the forward's logits block.
    const bool once = logits_visited_once(R, vb);
    const double fwd = head_pass_seconds(T_, shard * R, once ? 3 : 1, tb, vb, blocks, false);
    const double bwd = once ? 0 : head_pass_seconds(T_, shard * R, 3, tb, vb, blocks, false);
    total = d(losses_) * (fwd + bwd);
    if (R > 1) {
      // Each pass goes R hops around the ring, as the executor runs it (ring_dtp_schedule.cpp):
      // with rotating weights every hop moves a W shard (bf16; and its travelling fp32 dW
      // accumulator when gradients are made), the last one bringing the rank's own shard home;
      // with rotating activations R − 1 hops move the token blocks (X bf16, targets i32, and the
      // online state, or lse and the fp32 dX block in backward) and the last hop brings only the
      // state (forward) or the finished dX (backward) home.
      const bool weights = rotate == RingRotate::Weights;
      const double shard_bytes = d(shard) * H;
      const double state_bytes = 3 * T * 4, targets_bytes = T * 4, dx_bytes = T * H * 4;
      struct Pass {
        double full_hop_bytes;  // R − 1 hops
        double last_hop_bytes;  // 1 hop
        double compute_s;
      };
      // With gradients in forward the gradient pass is a second trip round the ring, as in
      // backward (ring_dtp_schedule.cpp), so the hops are those of recompute.
      const Pass passes[2] = {
          weights ? Pass{shard_bytes * 2, shard_bytes * 2, fwd}
                  : Pass{T * H * 2 + targets_bytes + state_bytes, state_bytes, fwd},
          weights ? Pass{shard_bytes * (2 + 4), shard_bytes * (2 + 4), bwd}
                  : Pass{T * H * 2 + targets_bytes + T * 4 + dx_bytes, dx_bytes, bwd}};
      for (const Pass& p : passes) {
        if (p.compute_s <= 0) continue;
        const double hidden_s = p.compute_s / d(R);  // one shard's blocks hide one hop
        for (const auto& [hops, bytes] : {std::pair<double, double>{d(R - 1), p.full_hop_bytes}, {1.0, p.last_hop_bytes}}) {
          const double hop_s = link_seconds(bytes, R, true);
          out.ring_busy_s += d(losses_) * hops * hop_s;
          out.ring_bytes += d(losses_) * hops * bytes;
          out.ring_exposed_s += d(losses_) * hops * (std::max(0.0, hop_s - hidden_s) + eff_.hop_latency_s);
        }
      }
    }
  }
  out.head_extra_s = total - head_ref_s_;
  // FSDP with the head unit's share: Ring-DTP gathers only a V/R shard of the LM head. With MTP
  // every loss gathers the head for its forward and its backward and reduce-scatters its grads
  // (timeline.cpp: an MTP module runs between two uses).
  const double head_params = d(R > 1 ? ceil_div(fsdp_head_params_, R) : fsdp_head_params_);
  out.fsdp_bytes = fsdp_rest_bytes_ + (N_ > 1 ? d(losses_) * head_params * (2 * 2 + 4) * d(N_ - 1) / d(N_) : 0);
  out.fsdp_busy_s = link_seconds(out.fsdp_bytes, N_, false);
  out.fsdp_exposed_s = std::max(0.0, out.fsdp_busy_s - compute_ref_s_);
  return out;
}

BoundaryTime TimeModel::boundaries(const std::vector<bool>& offloaded, int64_t prefetch) const {
  return boundaries_of([&](int64_t l) { return static_cast<size_t>(l) < offloaded.size() && offloaded[static_cast<size_t>(l)]; },
                       prefetch);
}

BoundaryTime TimeModel::boundaries_first(int64_t layers, int64_t prefetch) const {
  return boundaries_of([&](int64_t l) { return l < layers; }, prefetch);
}

template <class Offloaded>
double TimeModel::forward_wait(const Offloaded& off, double x) const {
  double wait = 0;
  for (size_t l = 0; l < layers_.size(); ++l)
    if (off(static_cast<int64_t>(l))) wait += std::max(0.0, x - layers_[l].forward_s);
  return wait;
}

template <class Offloaded>
BoundaryTime TimeModel::boundaries_of(const Offloaded& off, int64_t prefetch) const {
  BoundaryTime out;
  if (boundary_mode_ == BoundaryMode::Device) return out;
  const auto L = static_cast<int64_t>(layers_.size());
  int64_t count = 0;
  for (int64_t l = 0; l < L; ++l) count += off(l) ? 1 : 0;
  const double boundary_bytes = d(T_) * d(model_.hidden_size) * 2;
  const double x = boundary_bytes / host_link_rate_;
  out.bytes = 2 * d(count) * boundary_bytes;
  out.busy_s = 2 * d(count) * x;
  if (boundary_mode_ == BoundaryMode::SyncOffload) {
    out.exposed_s = 2 * d(count) * (x + eff_.transfer_latency_s);
    return out;
  }
  // Forward: copy l runs beside layer l; layer l+1 starts when both are done. The previous copy
  // always ended before layer l started, so layer l takes max(f_l, x): the wait is max(0, x - f_l),
  // summed in layer order (boundaries_first sums the same terms in the same order).
  out.exposed_s = forward_wait(off, x);
  // Backward, layers L-1 .. 0: fetch l may start once layer l+p+1 is done (the last p+2 ends kept).
  constexpr int64_t kRing = 8;
  std::array<double, kRing> end{};
  double link = 0, compute = 0;
  double prev_end = 0;
  for (int64_t l = L - 1; l >= 0; --l) {
    double start = prev_end;
    if (off(l)) {
      const int64_t after = l + prefetch + 1;
      const double slot = after <= L - 1 ? end[static_cast<size_t>(after % kRing)] : 0;
      const double fetch_end = std::max(slot, link) + x;
      link = fetch_end;
      start = std::max(start, fetch_end);
    }
    const double g = layers_[static_cast<size_t>(l)].backward_s;
    end[static_cast<size_t>(l % kRing)] = start + g;
    prev_end = start + g;
    compute += g;
  }
  out.exposed_s += (prev_end - compute) + 2 * d(count) * eff_.transfer_latency_s;
  return out;
}

OptimizerTime TimeModel::optimizer(int64_t bucket_params, int64_t bucket_depth) const {
  OptimizerTime out;
  const double P = d(shard_params_);
  const double link = host_link_rate_;
  // CPU AdamW streams 32 B/param (fp32 master, grad, m, v read; master, m, v written; bf16 grad
  // in, bf16 param out) at host-memory bandwidth shared by the node's GPUs.
  const double cpu = cpu_rate_;
  switch (placement_) {
    case OptimizerPlacement::Gpu:
      // Fused AdamW on the fp32 shard: 16 B read, 12 B written per parameter.
      out.bytes = P * 28;
      out.busy_s = out.bytes / hbm_rate_;
      out.exposed_s = out.busy_s;
      break;
    case OptimizerPlacement::Serial:
      out.bytes = P * 4;
      out.busy_s = P * 2 / link + P * 32 / cpu + P * 2 / link;
      out.exposed_s = out.busy_s + 3 * eff_.bucket_latency_s;
      break;
    case OptimizerPlacement::Stream: {
      const int64_t buckets = std::max<int64_t>(1, ceil_div(shard_params_, std::max<int64_t>(1, bucket_params)));
      const double b = P / d(buckets);
      const double a = b * 2 / link, c = b * 32 / cpu, h = b * 2 / link;
      const double s = a + c + h;
      const double total = s + d(buckets - 1) * std::max({a, c, h, s / d(std::max<int64_t>(1, bucket_depth))}) +
                           d(buckets) * eff_.bucket_latency_s;
      out.bytes = P * 4;
      out.busy_s = total;
      out.exposed_s = std::max(s + eff_.bucket_latency_s, total - backward_window_s_);
      break;
    }
  }
  return out;
}

StepTime TimeModel::full(const ResolvedRun& run, const Workload& work) const {
  const DispatchTime dt = dispatch(work.moe_loads);
  const VocabTime vt = vocab(run.vocab == VocabMode::RingDtp ? run.ring_size : 1, run.ring_rotate, run.token_block,
                             run.vocab_block);
  const BoundaryTime bt = boundaries(run.sco_offloaded, run.sco_prefetch);
  const OptimizerTime ot = optimizer(run.bucket_params, run.bucket_depth);
  StepTime st;
  st.step_seconds = combine(dt.total(), vt.total(), bt.exposed_s, ot.exposed_s);
  st.micro_batches = accumulation_;
  const double a = d(accumulation_);
  const double peak = hw_.bf16_dense_flops;
  auto term = [&](const char* name, double seconds, double busy, double amount, const char* unit, std::string detail) {
    st.terms.push_back(TimeTerm{name, seconds, busy, amount, unit, std::move(detail)});
  };
  term("attention", a * attention_s_, a * attention_s_, 0, "flop",
       "causal flash attention 2*a*(d_qk+d_v) per key, windows limited; forward, recompute and backward (2.5x)");
  term("gemm", a * (gemm_dense_s_ + gemm_experts_s_), a * (gemm_dense_s_ + gemm_experts_s_), 0, "flop",
       "dense and expert matmuls at the large-GEMM efficiency: 8 FLOPs per weight per token with recompute; "
       "experts on the worst rank's rows");
  term("lm_head", a * head_ref_s_, a * head_ref_s_, 0, "flop", "LM head GEMMs at the large-GEMM efficiency");
  term("expert_small_gemms", a * dt.small_gemm_s, a * dt.small_gemm_s, dt.rows_per_gemm, "rows per GEMM",
       "expert GEMMs slower than reference: rows per GEMM (roofline on the expert weights) and launches per round");
  term("ep_all_to_all", a * dt.exposed_s, a * dt.busy_s, a * dt.bytes, "bytes",
       pipelined_ ? "PipelinedLLEP rounds overlap expert GEMMs; fill, excess and round latencies exposed"
                  : "blocking dispatch and combine around the expert GEMMs");
  term("cp_ring", a * cp_exposed_s_, a * cp_busy_s_, a * cp_bytes_, "bytes",
       "ring attention K,V hops hidden behind each hop's attention block");
  term("logits", a * vt.head_extra_s, a * vt.head_extra_s, 0, "",
       "logits traffic (materialized) or block GEMMs below reference and block launches");
  term("ring_dtp", a * vt.ring_exposed_s, a * vt.ring_busy_s, a * vt.ring_bytes, "bytes",
       "Ring-DTP hops hidden behind the blocks of the shard in hand");
  term("fsdp", a * vt.fsdp_exposed_s, a * vt.fsdp_busy_s, a * vt.fsdp_bytes, "bytes",
       "all-gathers (forward, backward) and reduce-scatters hidden behind the micro-batch's compute");
  term("host_link_boundaries", a * bt.exposed_s, a * bt.busy_s, a * bt.bytes, "bytes",
       boundary_mode_ == BoundaryMode::SyncOffload ? "synchronous boundary copies" : "SCO copies beside layer compute");
  term("optimizer", ot.exposed_s, ot.busy_s, ot.bytes, "bytes",
       placement_ == OptimizerPlacement::Stream ? "bucket pipeline from the last backward on"
                                                : "after backward, not hidden");
  // Amounts of the compute terms: FLOPs on this GPU per step.
  st.terms[0].amount = a * attention_s_ * peak * eff_.attention;
  st.terms[1].amount = a * (gemm_dense_s_ + gemm_experts_s_) * peak * eff_.gemm;
  st.terms[2].amount = a * head_ref_s_ * peak * eff_.gemm;
  double best = -1;
  for (const TimeTerm& t : st.terms)
    if (t.seconds > best) {
      best = t.seconds;
      st.bound_by = t.name;
    }
  st.efficiency = eff_;
  st.model_flops_per_gpu = a * model_flops_mb_;
  // hw_flops_dense_mb_ counts 3 head passes for gradients in forward; a 4th when they visit the
  // logits twice (vocab() says when).
  const int64_t R = run.vocab == VocabMode::RingDtp ? std::max<int64_t>(1, run.ring_size) : 1;
  const bool twice_in_forward = vocab_mode_ != VocabMode::Materialized && vocab_backward_ == VocabBackward::InForward &&
                                !logits_visited_once(R, run.vocab_block);
  st.hardware_flops_per_gpu = a * (hw_flops_dense_mb_ + (twice_in_forward ? d(losses_) * head_pass_flops_ : 0));
  st.tokens_per_second = st.step_seconds > 0 ? tokens_per_step_ / st.step_seconds : 0;
  st.mfu = st.step_seconds > 0 && peak > 0 ? st.model_flops_per_gpu / (st.step_seconds * peak) : 0;
  return st;
}

StepTime estimate_step_time(const ModelSpec& model, const HardwareSpec& hardware, const ResolvedRun& run,
                            const Workload& work, const Efficiency& efficiency) {
  return TimeModel(model, hardware, run, work, efficiency).full(run, work);
}

double round_significant(double v, int digits) {
  if (v == 0 || !std::isfinite(v)) return v;
  return std::stod(fmt::format("{:.{}g}", v, digits));
}

nlohmann::ordered_json step_time_to_json(const StepTime& t) {
  // Six significant digits: the model is no more precise, and the text stays the same on every
  // platform (last-bit differences of fused multiply-adds do not show).
  auto r = [](double v) { return round_significant(v, 6); };
  nlohmann::ordered_json j;
  j["step_seconds"] = r(t.step_seconds);
  j["tokens_per_second"] = r(t.tokens_per_second);
  j["mfu"] = r(t.mfu);
  j["bound_by"] = t.bound_by;
  j["micro_batches"] = t.micro_batches;
  j["model_flops_per_gpu"] = r(t.model_flops_per_gpu);
  j["hardware_flops_per_gpu"] = r(t.hardware_flops_per_gpu);
  nlohmann::ordered_json terms;
  for (const TimeTerm& term : t.terms) {
    nlohmann::ordered_json tj;
    tj["seconds"] = r(term.seconds);
    tj["busy_seconds"] = r(term.busy_seconds);
    if (!term.unit.empty()) tj[term.unit == "rows per GEMM" ? "rows_per_gemm" : term.unit] = r(term.amount);
    tj["detail"] = term.detail;
    terms[term.name] = std::move(tj);
  }
  j["terms"] = std::move(terms);
  j["efficiency"] = efficiency_to_json(t.efficiency);
  return j;
}

}  // namespace flatpeak::planner
