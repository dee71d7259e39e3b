#include "workload.h"

#include <algorithm>

#include "spec/least_loaded.h"
#include "spec/routing.h"
#include "terms.h"

namespace flatpeak::planner {

namespace {

// [EP][EP] rows source s sends to destination d under standard EP.
CountMatrix ep_send_rows(const CountMatrix& copies, const RoutingShape& shape) {
  const auto ep = static_cast<size_t>(shape.ep_ranks);
  CountMatrix send(ep, std::vector<int64_t>(ep, 0));
  for (size_t s = 0; s < copies.size(); ++s)
    for (size_t e = 0; e < copies[s].size(); ++e)
      send[s][static_cast<size_t>(shape.rank_of_expert(static_cast<int64_t>(e)))] += copies[s][e];
  return send;
}

MoeLoad moe_load(const ModelSpec& model, const ResolvedRun& run, int64_t tokens, int64_t moe_layer) {
  const RoutingShape shape{run.ep, model.num_experts, model.top_k};
  const ExpectedLoads expected = expected_loads(run.imbalance, shape, tokens, moe_layer);
  MoeLoad load;
  load.send_rows = checked_mul(tokens, model.top_k);
  const auto received = received_rows_per_rank(expected.copies, shape);
  load.recv_rows_ep = *std::max_element(received.begin(), received.end());
  load.rho_ep = imbalance_rho(received);
  load.clamp_note = expected.clamp_note;
  std::vector<RankLoad> per_rank;
  for (int64_t r : received) per_rank.push_back(RankLoad{r, 0, 0});
  load.ranks = candidate_ranks(per_rank);
  if (run.llep) {
    const CountMatrix send = apply_lla(load, run, expected.copies, shape, lla_knobs_of(run));
    if (run.chunk_cap_rows > 0) apply_chunk_cap(load, model, run, expected.copies, send, run.chunk_cap_rows);
  }
  return load;
}

}  // namespace

std::vector<RankLoad> candidate_ranks(const std::vector<RankLoad>& per_rank) {
  std::vector<RankLoad> out;
  for (size_t p = 0; p < per_rank.size(); ++p) {
    const RankLoad& a = per_rank[p];
    bool dominated = false;
    for (size_t q = 0; q < per_rank.size() && !dominated; ++q) {
      const RankLoad& b = per_rank[q];
      if (q == p || b.recv_rows < a.recv_rows || b.foreign_experts < a.foreign_experts || b.lent_experts < a.lent_experts) continue;
      const bool equal = b.recv_rows == a.recv_rows && b.foreign_experts == a.foreign_experts && b.lent_experts == a.lent_experts;
      dominated = !equal || q < p;
    }
    if (!dominated) out.push_back(a);
  }
  return out;
}

LlaKnobs lla_knobs_of(const ResolvedRun& run) {
  LlaKnobs knobs;
  knobs.llep_alpha = run.llep_alpha;
  knobs.min_rows_per_gemm = run.llep_min_rows;
  knobs.imbalance_trigger = run.llep_lambda;
  return knobs;
}

CountMatrix apply_lla(MoeLoad& load, const ResolvedRun& run, const CountMatrix& copies, const RoutingShape& shape,
                      const LlaKnobs& knobs) {
  const LlaResult lla = least_loaded_assignment(expert_loads(copies), run.ep, knobs);
  load.lla_ran = lla.triggered;
  load.recv_rows_llep = lla.triggered ? *std::max_element(lla.rank_rows.begin(), lla.rank_rows.end()) : load.recv_rows_ep;
  load.rho_llep = lla.triggered ? lla.rho_l : load.rho_ep;
  load.foreign_experts = 0;
  load.lent_experts = 0;
  for (int64_t s : lla.foreign_experts_per_rank) load.foreign_experts = std::max(load.foreign_experts, s);
  for (int64_t s : lla.lent_weights_per_rank) load.lent_experts = std::max(load.lent_experts, s);
  if (!lla.triggered) return ep_send_rows(copies, shape);
  std::vector<RankLoad> per_rank;
  for (size_t p = 0; p < lla.rank_rows.size(); ++p)
    per_rank.push_back(RankLoad{lla.rank_rows[p], lla.foreign_experts_per_rank[p], lla.lent_weights_per_rank[p]});
  load.ranks = candidate_ranks(per_rank);
  return lla_send_rows(lla, copies);
}

void apply_chunk_cap(MoeLoad& load, const ModelSpec& model, const ResolvedRun& run, const CountMatrix& copies, CountMatrix send,
                     int64_t chunk_cap_rows) {
  const int64_t C = std::min(chunk_cap_rows, load.send_rows);
  int64_t buffer = checked_mul(run.ep, C);
  LlaKnobs knobs = lla_knobs_of(run);
  const double rho = pipelined_rho_bound(knobs, run.ep, load.send_rows);
  const int64_t tokens = load.send_rows / model.top_k;
  const int64_t most = checked_mul(run.ep, checked_mul(tokens, std::min(model.top_k, model.num_experts / run.ep)));
  if (run.striping) buffer = std::min(round_receive_bound_rows(C, run.ep, rho), most);
  load.foreign_pool = pipelined_foreign_pool(buffer, run.ep, model.num_experts, knobs);
  load.store_rows = pipelined_store_rows(buffer, run.ep, load.send_rows, most, rho);
  if (load.lla_ran && load.foreign_experts > load.foreign_pool) {
    // The pool binds: LLA again with it (the executor runs the same), so no rank borrows more.
    knobs.max_foreign_experts = load.foreign_pool;
    send = apply_lla(load, run, copies, RoutingShape{run.ep, model.num_experts, model.top_k}, knobs);
  }
  int64_t cap = C;
  if (run.striping && round_receive_bound_rows(send, C) > buffer) cap = std::max<int64_t>(1, shrink_chunk_cap(send, C, buffer));
  load.launch_chunk_cap_rows = C;
  load.chunk_cap_rows = cap;
  load.round_recv_rows = buffer;
  load.rounds = ceil_div(load.send_rows, cap);
}

Workload workload_units(const ModelSpec& model, const ResolvedRun& run, bool unit_names) {
  Workload w;
  w.gpus = run.gpus;
  w.cp = run.cp;
  w.dp = run.dp();
  w.ep = run.ep;
  w.tokens = checked_mul(run.micro_batch, run.context_tokens) / run.cp;
  w.accumulation_steps = run.accumulation_steps();
  w.counts = count_params(model);
  const ParamCounts& pc = w.counts;
  const int64_t E = model.num_experts;
  w.experts_per_rank = E > 0 ? E / run.ep : 0;
  w.expert_params_each = pc.expert_params;
  const int64_t N = run.gpus;
  const int64_t expert_group = N / std::max<int64_t>(1, run.ep);

  auto dense_unit = [&](const std::string& name, int64_t params) {
    return FsdpUnit{unit_names ? name : std::string(), params, params, ceil_div(params, N), ceil_div(params, N)};
  };
  auto layer_unit = [&](const std::string& name, FfnKind ffn) {
    const int64_t common = pc.attention_per_layer + pc.layer_norms_per_layer;
    if (ffn == FfnKind::Dense) return dense_unit(name, common + pc.dense_ffn_per_layer);
    const int64_t dense = common + pc.router_per_layer + pc.shared_experts_per_layer;
    const int64_t local_experts = checked_mul(w.experts_per_rank, pc.expert_params);
    FsdpUnit u;
    if (unit_names) u.name = name;
    u.params = dense + checked_mul(E, pc.expert_params);
    u.gathered_params = dense + local_experts;
    u.shard_params = ceil_div(dense, N) + ceil_div(local_experts, expert_group);
    u.reduced_shard_params = ceil_div(dense, N) + (expert_group > 1 ? ceil_div(local_experts, expert_group) : 0);
    return u;
  };

  w.units.reserve(static_cast<size_t>(model.num_layers + model.mtp_layers + 2));
  w.units.push_back(dense_unit("embedding", pc.embedding));
  int64_t moe_layers = 0;
  for (int64_t l = 0; l < model.num_layers; ++l) {
    const FfnKind ffn = model.layers[static_cast<size_t>(l)].ffn;
    w.units.push_back(layer_unit(unit_names ? "L" + std::to_string(l) : std::string(), ffn));
    w.moe_index.push_back(ffn == FfnKind::Moe && E > 0 ? moe_layers++ : -1);
  }
  if (run.mtp) {
    // An MTP module: its decoder layer (MoE when the model has experts) plus enorm, hnorm,
    // eh_proj [2H -> H] and the shared-head norm, gathered together.
    const int64_t H = model.hidden_size;
    const FfnKind ffn = E > 0 ? FfnKind::Moe : FfnKind::Dense;
    for (int64_t j = 0; j < model.mtp_layers; ++j) {
      FsdpUnit u = layer_unit(unit_names ? "MTP" + std::to_string(j) : std::string(), ffn);
      const int64_t extra = 2 * H + 2 * H * H + H;
      u.params += extra;
      u.gathered_params += extra;
      u.shard_params += ceil_div(extra, N);
      u.reduced_shard_params += ceil_div(extra, N);
      w.units.push_back(u);
      w.moe_index.push_back(ffn == FfnKind::Moe ? moe_layers++ : -1);
    }
  }
  // Final norm + LM head (with tied embeddings the head's weight is the embedding's).
  w.units.push_back(dense_unit("head", pc.final_norm + pc.lm_head));
  w.head_unit = static_cast<int64_t>(w.units.size()) - 1;
  for (const auto& u : w.units) {
    w.shard_params = checked_add(w.shard_params, u.shard_params);
    w.trained_params = checked_add(w.trained_params, u.params);
  }

  return w;
}

int64_t distinct_moe_routings(const ResolvedRun& run, const Workload& w) {
  const bool any_moe = std::any_of(w.moe_index.begin(), w.moe_index.end(), [](int64_t m) { return m >= 0; });
  if (!any_moe) return 0;
  const bool per_layer = run.imbalance.kind == RoutingKind::File && run.imbalance.file &&
                         run.imbalance.file->layers.size() > 1;
  return per_layer ? static_cast<int64_t>(run.imbalance.file->layers.size()) : 1;
}

Workload make_workload(const ModelSpec& model, const ResolvedRun& run) {
  Workload w = workload_units(model, run, true);
  const int64_t distinct = distinct_moe_routings(run, w);
  for (int64_t m = 0; m < distinct; ++m) w.moe_loads.push_back(moe_load(model, run, w.tokens, m));
  return w;
}

int64_t loss_weight_params(const ModelSpec& model, const Workload& w) {
  const int64_t head = w.units[static_cast<size_t>(w.head_unit)].gathered_params;
  return model.tie_word_embeddings ? checked_add(w.counts.embedding, head) : head;
}

}  // namespace flatpeak::planner
