// One training step on one rank or on each rank of a Communicator (step_schedule.h): the decoder
// layers are DecoderLayer (decoder_layer.h), the loss run_vocab_loss (vocab_schedule.h), the
// optimizer run_optimizer_step (optimizer_schedule.h), the shards FsdpShards (fsdp_shards.h); this
// file adds what only a whole step has: the parameters and their FSDP units (gather, prefetch,
// unsharded grads, reduce-scatter into the grad shards), the
// embedding, the checkpoint boundaries across layers (kept or offloaded, fetched and prefetched as
// the checkpoint component does), the final norm around the loss, and the gradient stream from
// the loss down to the embedding.
//
// When each buffer comes and goes (at N = 1 an all-gather is a bf16 copy of the shard and a
// reduce-scatter an fp32 copy into the shard; at N > 1 they are the communicator's, every rank
// reaching them in the same order):
//   fwd/embed      gather embedding, prefetch L0; token ids [T] i64 and the output x_0 [T, H]
//                  (activations), x_0 becomes boundary x_0; embedding released.
//   fwd/Ll         prefetch L(l+1) (the head after the last layer) as the phase starts; an
//                  offloaded x_l is copied to its host slot; L l released, and the device copy
//                  of an offloaded x_l freed, when the layer's forward returns.
//   loss/...       the gathered head becomes the loss's W (vocab); X = final_norm(h_L) (rstd,
//                  and LayerNorm's mean, recomputed in backward); L(L-1) prefetched as the loss's
//                  backward starts; at the end the final norm's backward gives dy = d h_L, dX and
//                  the loss are freed, and the head's grads become the fp32 reduce-scatter input.
//   bwd/Ll         as recompute/attn starts: the previous unit's shard lands, L(l-1) (or the
//                  embedding) is prefetched, x_l is fetched and SCO's prefetch issued; the layer's
//                  unsharded grads from its backward's first phase; at its end L l is released,
//                  the previous reduce-scatter completes and this unit's starts, x_l is freed.
//   fwd/MTPj, loss/mtpj, bwd/MTPj (with MTP: between the main loss's passes, run_module): module
//                  j gathered and the head prefetched; eh_proj's input [2, T, H] (its norms'
//                  outputs; x_0 fetched when offloaded) into the module's input (boundary) and
//                  freed; the layer's no-grad forward gives h^j; its loss (the next module
//                  between its passes); the loss's backward gathers the head (not with gradients
//                  in forward), lands the next module's shard, prefetches module j, holds its
//                  head-norm grad [H]; bwd/MTPj as a layer, then eh_proj's and the norms'
//                  backward: d h^(j-1) for the loss before, d x_0 into one [T, H] buffer.
//   bwd/embed      L0's shard lands; the embedding's unsharded grads, its backward (token ids
//                  re-read as input data: workspace; the MTP modules' d x_0 after the layers'),
//                  its reduce-scatter, started and completed.
//   opt/...        the optimizer step on the shards (params, m, v from init; host state too).
#include "executor/schedules/step_schedule.h"

#include "executor/comm/threads_comm.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <utility>

#include "executor/cpu/gemm_cpu.h"
#include "executor/memory/tensor.h"
#include "executor/ops/adamw.h"
#include "executor/ops/embedding.h"
#include "executor/ops/layernorm.h"
#include "executor/ops/rmsnorm.h"
#include "executor/schedules/schedule_util.h"
#include "spec/param_count.h"

namespace flatpeak::exec {

namespace {

void require(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("step schedule: " + what);
}

void check(const StepScheduleConfig& c) {
  const ModelSpec& m = c.model;
  require(c.tokens > 0, "tokens must be positive");
  require(m.hidden_size > 0 && m.vocab_size > 0 && m.num_layers > 0, "hidden, vocab and layers must be positive");
  require(static_cast<int64_t>(m.layers.size()) == m.num_layers, "the model must list every layer");
  require(m.num_experts > 0 && m.top_k > 0 && m.top_k <= m.num_experts, "MoE layers with top_k <= the experts");
  require(c.ep >= 1 && m.num_experts % c.ep == 0, "ep must be >= 1 and divide the experts (got " + std::to_string(c.ep) + ")");
  for (const LayerSpec& l : m.layers)
    require(l.ffn == FfnKind::Moe || m.dense_ffn_width > 0, "a dense FFN layer needs dense_ffn_width > 0");
  require(!m.tie_word_embeddings, "an untied LM head only");
  require(m.attention == AttentionKind::Mla || m.v_head_dim == 0 || m.v_head_dim == m.head_dim,
          "v_head_dim must equal head_dim (GQA)");
  require(c.offloaded.empty() || static_cast<int64_t>(c.offloaded.size()) == m.num_layers, "offloaded must list every layer");
  require(c.prefetch >= 0, "prefetch must be >= 0");
  require(c.cp >= 1, "cp must be >= 1");
  if (c.mtp) {
    require(m.mtp_layers > 0, "mtp needs a model with MTP modules (mtp_layers = 0)");
    require(!m.norm_bias, "MTP modules with LayerNorm norms are not built (RMSNorm only)");
  }
}

int64_t mtp_modules(const StepScheduleConfig& c) { return c.mtp ? c.model.mtp_layers : 0; }

// Decoder layer `layer` of the step: the model's, or at L + j MTP module j's (full attention; MoE
// when the model has experts).
LayerSpec step_layer_spec(const StepScheduleConfig& c, int64_t layer) {
  if (layer < c.model.num_layers) return c.model.layers[static_cast<size_t>(layer)];
  LayerSpec s;
  s.ffn = c.model.num_experts > 0 ? FfnKind::Moe : FfnKind::Dense;
  return s;
}

bool is_dense_layer(const StepScheduleConfig& c, int64_t layer) { return step_layer_spec(c, layer).ffn != FfnKind::Moe; }

// An MTP module's parameters before its decoder layer: enorm [H], hnorm [H], eh_proj [H, 2H]
// (columns [0, H) read hnorm's output, [H, 2H) enorm's), its head norm [H].
int64_t module_extra_params(int64_t H) { return 3 * H + 2 * H * H; }
int64_t module_enorm_at(int64_t) { return 0; }
int64_t module_hnorm_at(int64_t H) { return H; }
int64_t module_eh_proj_at(int64_t H) { return 2 * H; }
int64_t module_head_norm_at(int64_t H) { return 2 * H + 2 * H * H; }

// Layer `layer`'s config: its MoE block, or a dense layer's FFN.
LayerScheduleConfig layer_config(const StepScheduleConfig& c, int64_t layer) {
  LayerScheduleConfig l;
  const ModelSpec& m = c.model;
  l.tokens = c.tokens;
  l.hidden = m.hidden_size;
  l.q_heads = m.num_heads;
  l.kv_heads = m.num_kv_heads;
  l.head_dim = m.head_dim;
  if (m.attention == AttentionKind::Mla) {
    l.v_head_dim = m.v_head_dim;
    l.q_lora = m.q_lora_rank;
    l.kv_lora = m.kv_lora_rank;
    l.rope_dim = m.qk_rope_head_dim;
  }
  if (is_dense_layer(c, layer)) {
    l.dense_ffn = m.dense_ffn_width;
  } else {
    l.experts = m.num_experts;
    l.ep = c.ep;
    l.top_k = m.top_k;
    l.expert_ffn = m.expert_ffn_width;
    l.shared_ffn = m.shared_expert_ffn_width;
    l.shared_gate = m.shared_expert_gate && l.shared_ffn > 0;
    l.expert_bias = m.expert_bias;
  }
  l.layer_norm = m.norm_bias;
  l.cp = c.cp;
  // Sliding windows (gpt-oss's local layers) and chunks (Llama 4's) run masked, at CP > 1 with a
  // halo or the ring as their reach needs (DecoderLayer).
  const LayerSpec spec = step_layer_spec(c, layer);
  if (spec.window == AttentionWindow::Sliding) l.attention_window = spec.attention_window_tokens;
  if (spec.window == AttentionWindow::Chunked) l.attention_chunk = spec.attention_window_tokens;
  l.dtype = DType::BF16;
  check_layer_config(l);
  return l;
}

void zero(Tensor& t) {
  if (!t.empty()) std::memset(t.raw(), 0, static_cast<size_t>(t.bytes()));
}

bool is_layer_unit(const StepScheduleConfig& c, int64_t unit) { return unit >= 1 && unit <= c.model.num_layers + mtp_modules(c); }
// The parameters an MTP module's unit holds before its decoder layer (0 for every other unit).
int64_t unit_extra_params(const StepScheduleConfig& c, int64_t unit) {
  return is_layer_unit(c, unit) && unit > c.model.num_layers ? module_extra_params(c.model.hidden_size) : 0;
}

// A run of a rank's gathered unit and where it lies in the whole model's unit (the EP = 1 layout:
// the weights in storage order, then every part not applied).
struct UnitSegment {
  int64_t begin, count, reference_begin;
};

// The rank's gathered unit as segments covering it in order. At EP = 1 (and for the embedding and
// the head) the identity; at EP > 1 a layer is [dense weights | dense parts not applied | its
// experts' w_gate_up | w_down | b_expert (with biases) | their parts not applied] (step_unit_shapes).
std::vector<UnitSegment> unit_segments(const StepScheduleConfig& c, int64_t unit, int64_t ep_rank) {
  const std::vector<int64_t> whole = step_unit_params(c.model, c.mtp);
  const int64_t U = whole[static_cast<size_t>(unit)];
  if (c.ep == 1 || !is_layer_unit(c, unit) || is_dense_layer(c, unit - 1)) return {{0, U, 0}};
  const FsdpUnitShape shape = step_unit_shapes(c)[static_cast<size_t>(unit)];
  StepScheduleConfig reference = c;
  reference.ep = 1;
  const LayerScheduleConfig ref_layer = layer_config(reference, unit - 1);
  const int64_t EL = c.model.num_experts / c.ep;
  std::vector<UnitSegment> out;
  const int64_t extra = unit_extra_params(c, unit);  // an MTP module's own weights, sharded first
  if (extra > 0) out.push_back({0, extra, 0});
  int64_t ref_at = extra, dense_at = extra, expert_at = shape.sharded_params, expert_weights = 0;
  for (const LayerWeightShape& w : layer_weight_shapes(ref_layer)) {
    const int64_t n = w.numel();
    if (is_expert_weight(w.name)) {
      const int64_t mine = n / c.model.num_experts * EL;  // [E/EP, ...] of [E, ...]
      out.push_back({expert_at, mine, ref_at + ep_rank * mine});
      expert_at += mine, expert_weights += mine;
    } else {
      out.push_back({dense_at, n, ref_at});
      dense_at += n;
    }
    ref_at += n;
  }
  // The parts not applied: the dense ones, then every rank's experts' in rank order.
  const int64_t dense_rest = shape.sharded_params - dense_at, expert_rest = shape.local_params - expert_weights;
  if (dense_rest < 0 || expert_rest < 0) throw std::logic_error("step schedule: the layer's weights exceed its unit");
  out.push_back({dense_at, dense_rest, ref_at});
  out.push_back({expert_at, expert_rest, ref_at + dense_rest + ep_rank * expert_rest});
  std::sort(out.begin(), out.end(), [](const UnitSegment& a, const UnitSegment& b) { return a.begin < b.begin; });
  return out;
}

// Calls f(reference_begin, offset, count) for the elements [begin, begin + count) of the rank's
// gathered unit, piece by piece in order (offset: from `begin`).
template <class Fn>
void for_each_reference_piece(const StepScheduleConfig& c, int64_t unit, int64_t ep_rank, int64_t begin, int64_t count, Fn f) {
  for (const UnitSegment& s : unit_segments(c, unit, ep_rank)) {
    const int64_t lo = std::max(begin, s.begin), hi = std::min(begin + count, s.begin + s.count);
    if (hi > lo) f(s.reference_begin + lo - s.begin, lo - begin, hi - lo);
  }
}

class StepRun {
 public:
  // cp_group: the one-rank step's CP ring (cp > 1 without FSDP across ranks); with `comm` the
  // ring is split from it (CP groups of cp consecutive ranks).
  StepRun(Communicator* comm, TrackingAllocator& alloc, const StepScheduleConfig& c, Communicator* cp_group = nullptr)
      : a_(alloc), comm_(comm), c_(c), T_(c.tokens), H_(c.model.hidden_size), V_(c.model.vocab_size), L_(c.model.num_layers),
        M_(mtp_modules(c)), lcs_(layer_configs(c)), unit_shapes_(step_unit_shapes(c)), unit_params_(gathered_sizes(unit_shapes_)),
        data_seed_(step_data_seed(c, comm != nullptr ? comm->rank() : 0)), ep_rank_(c.ep > 1 ? comm->rank() % c.ep : 0) {
    head_ = L_ + M_ + 1;
    cp_group_ = cp_group;
    offload_ = !c.naive && c.optimizer.placement != OptimizerPlacement::Device;
    for (int64_t l = 0; l < L_ + M_; ++l)
      require(unit_extra_params(c, l + 1) + layer_weight_elems(lcs_[static_cast<size_t>(l)]) <= unit_params_[static_cast<size_t>(l + 1)],
              "the layer's weights exceed its unit");
    loss_ = c.loss;
    loss_.tokens = T_;
    loss_.hidden = H_;
    loss_.vocab = V_;
    loss_.seed = c.seed;
    if (c.naive) loss_.mode = VocabScheduleMode::Materialized, loss_.gradients_in_forward = false;
    opt_ = c.optimizer;
    opt_.step = 1;
    if (c.naive) opt_.placement = OptimizerPlacement::Device;
    opt_.keep_results = false;  // run() copies the master itself: m and v are not the step's results
    for (int64_t l = 0; l < L_; ++l) offloaded_.push_back(!c.naive && !c.offloaded.empty() && c.offloaded[static_cast<size_t>(l)]);
    gathered_.resize(unit_params_.size());
    grad_shards_.resize(unit_params_.size());
    device_.resize(static_cast<size_t>(L_ + 1));
    module_in_.resize(static_cast<size_t>(M_));
    module_out_.resize(static_cast<size_t>(M_));
    module_norm_grad_.resize(static_cast<size_t>(M_));
  }

  static std::vector<int64_t> gathered_sizes(const std::vector<FsdpUnitShape>& shapes) {
    std::vector<int64_t> out;
    for (const FsdpUnitShape& s : shapes) out.push_back(s.sharded_params + s.local_params);
    return out;
  }

  StepScheduleResult run() {
    StepScheduleResult r;
    r.unit_params = unit_params_;
    r.reference_pieces = step_rank_pieces(c_, comm_ != nullptr ? comm_->size() : 1, comm_ != nullptr ? comm_->rank() : 0);
    const size_t first_record = a_.phase_records().size();
    init();
    for (size_t u = 0; u < unit_params_.size(); ++u) {
      r.shard_begin.push_back(shards_->slice_begin(u));
      r.shard_params.push_back(shards_->shard_length(u));
    }
    forward();
    result_ = &r;
    r.mtp_losses.assign(static_cast<size_t>(M_), 0.0);
    run_loss(0);  // with MTP the modules and their losses run inside it (between its passes)
    r.expert_counts = std::move(expert_counts_);
    backward();
    const bool keep = c_.keep_results || c_.result_sink;
    if (keep) {
      if (!c_.result_sink) r.grads.reserve(static_cast<size_t>(P_));
      int64_t offset = 0;
      for (size_t u = 0; u < grad_shards_.size(); ++u) {
        const Tensor& s = grad_shards_[u];
        const int64_t length = shards_->shard_length(u);  // an fp32 shard may be padded beyond it
        if (s.dtype() == DType::F32) {
          emit(StepResultPart::Grads, r.grads, offset, s.data<float>(), length);
        } else {
          float widened[1024];  // bf16 shards widened a chunk at a time
          for (int64_t at = 0; at < length; at += 1024) {
            const int64_t n = std::min<int64_t>(1024, length - at);
            for (int64_t i = 0; i < n; ++i) widened[i] = to_f32(s.data<Bf16>()[at + i]);
            emit(StepResultPart::Grads, r.grads, offset + at, widened, n);
          }
        }
        offset += length;
      }
    }
    OptimizerDeviceView d;
    d.params = shards_->params().raw();
    for (size_t u = 0; u < grad_shards_.size(); ++u) d.grads.emplace_back(grad_shards_[u].raw(), shards_->shard_length(u));
    d.m = m_.empty() ? nullptr : m_.data<float>();
    d.v = v_.empty() ? nullptr : v_.data<float>();
    run_optimizer_step(a_, opt_, d, host_state_.get());
    if (keep) emit(StepResultPart::Params, r.params, 0, offload_ ? host_state_->master.data<float>() : shards_->params().data<float>(), P_);
    const auto records = a_.phase_records();
    for (size_t i = first_record; i < records.size(); i += kMemorySpaceCount)
      if (records[i].phase != "init") r.phases.push_back(records[i].phase);
    return r;
  }

 private:
  int64_t U(int64_t unit) const { return unit_params_[static_cast<size_t>(unit)]; }
  static int64_t layer_unit(int64_t l) { return l + 1; }  // MTP module j: l = L + j
  std::string layer_prefix(const char* pass, int64_t l) const {
    return std::string(pass) + (l < L_ ? "/L" + std::to_string(l) : "/MTP" + std::to_string(l - L_)) + "/";
  }

  // Values [offset, offset + count) of the grads or params: to the sink, or appended to `kept`.
  void emit(StepResultPart part, std::vector<float>& kept, int64_t offset, const float* values, int64_t count) const {
    if (c_.result_sink) c_.result_sink(part, offset, values, count);
    else kept.insert(kept.end(), values, values + count);
  }

  // ---- parameters, optimizer state, host arenas (phase "init", live all step)

  void init() {
    if (a_.phase() != "init") a_.set_phase("init");
    // The rank's parameter shard [P]: the fp32 master with the optimizer on the device, bf16 with
    // offload; every unit sharded over the ranks (EP = 1: each rank holds a slice of every expert).
    // 1 < EP < N: EP groups of EP consecutive ranks (each MoE layer's dispatch), and the N/EP
    // replicas of each EP rank, which hold the same experts and shard them (FsdpShards' local group).
    if (comm_ != nullptr && c_.ep > 1 && c_.ep < comm_->size()) {
      const int rank = comm_->rank(), ep = static_cast<int>(c_.ep);
      ep_group_ = comm_->split(rank / ep, rank % ep);
      replicas_ = comm_->split(rank % ep, rank / ep);
    }
    if (comm_ != nullptr && c_.cp > 1) {  // ring attention within CP groups of consecutive ranks
      const int rank = comm_->rank(), cp = static_cast<int>(c_.cp);
      cp_ring_ = comm_->split(rank / cp, rank % cp);
      cp_group_ = cp_ring_.get();
    }
    shards_ = std::make_unique<FsdpShards>(a_, comm_, unit_shapes_, offload_ ? ShardPrecision::Bf16 : ShardPrecision::Fp32Master,
                                           GradShards::Caller, replicas_.get());
    P_ = shards_->shard_params();
    opt_.params = P_;
    Tensor& params = shards_->params();
    if (offload_) {
      host_state_ = std::make_unique<OptimizerHostState>(a_, opt_);  // master, m, v, staging (host)
    } else {
      m_ = Tensor(a_, DType::F32, {P_}, Category::Optimizer);  // [P] fp32 each
      v_ = Tensor(a_, DType::F32, {P_}, Category::Optimizer);
    }
    // Offloaded boundaries: one pinned arena [offloaded layers, T, H] bf16 for the whole step.
    int64_t slots = 0;
    for (bool off : offloaded_) slot_.push_back(off ? slots++ : -1);
    if (slots > 0) host_boundaries_ = Tensor(a_, DType::BF16, {slots, T_, H_}, Category::Boundaries, MemorySpace::Host);
    // Values: the master; m and v zero (the run's first step, t = 1).
    float* master = offload_ ? host_state_->master.data<float>() : params.data<float>();
    for (size_t u = 0; u < unit_params_.size(); ++u) {  // the slice of the sharded part, then the local part
      const int64_t slice = shards_->slice_length(u, shards_->rank());
      float* dst = master + shards_->shard_offset(u);
      step_initial_params(c_, static_cast<int64_t>(u), shards_->slice_begin(u), slice, dst, ep_rank_);
      step_initial_params(c_, static_cast<int64_t>(u), unit_shapes_[u].sharded_params + shards_->local_begin(u),
                          shards_->local_length(u, shards_->local_rank()), dst + slice, ep_rank_);
    }
    if (offload_)
      for (int64_t i = 0; i < P_; ++i) params.data<Bf16>()[i] = f32_to_bf16(master[i]);
    float* m = offload_ ? host_state_->m.data<float>() : m_.data<float>();
    float* v = offload_ ? host_state_->v.data<float>() : v_.data<float>();
    std::fill(m, m + P_, 0.0f);
    std::fill(v, v + P_, 0.0f);
  }

  // ---- FSDP units

  // All-gather of unit u (FsdpShards: one bf16 [U] buffer) unless already there.
  void gather(int64_t u) {
    Tensor& g = gathered_[static_cast<size_t>(u)];
    if (g.empty()) g = shards_->gather(static_cast<size_t>(u));
  }
  void reshard(int64_t u) { gathered_[static_cast<size_t>(u)].reset(); }

  // Unsharded grads of unit u: one bf16 [U] buffer, zeroed.
  Tensor unsharded_grads(int64_t u) {
    Tensor g(a_, DType::BF16, {U(u)}, Category::Fsdp);
    zero(g);
    return g;
  }
  // The reduce-scatter input [N·S] fp32 (N = 1: [U]) from bf16 unsharded grads, which are then freed.
  Tensor reduce_scatter_input(int64_t u, Tensor& grads) {
    Tensor in = shards_->reduce_scatter_input(static_cast<size_t>(u), grads);
    grads.reset();
    return in;
  }
  void start_reduce_scatter(int64_t u, Tensor input) {
    rs_input_ = std::move(input);
    rs_unit_ = u;
    rs_landed_ = false;
  }
  // The shard of the unit in flight lands (fp32, or bf16 with offload): the reduce-scatter runs
  // here (every rank reaches this point in the same order); its input stays in flight.
  void land_reduce_scatter() {
    if (rs_unit_ < 0 || rs_landed_) return;
    rs_landed_ = true;
    const size_t u = static_cast<size_t>(rs_unit_);
    // fp32 shards padded to S (+ S_l), as FSDP2 pads its shards: the sum lands in place on every
    // rank (bf16 shards land through the reduce-scatter output: FsdpShards::reduce_scatter_into).
    const int64_t n = offload_ ? shards_->shard_length(u) : std::max(shards_->shard_length(u), shards_->shard_capacity(u));
    Tensor& shard = grad_shards_[u];
    if (shard.empty()) {
      Tensor s(a_, offload_ ? DType::BF16 : DType::F32, {n}, Category::Grads);
      shards_->reduce_scatter_into(u, rs_input_, s);
      shard = std::move(s);
      return;
    }
    // The head again (MTP: every loss reduces it): the sum is added into the shard, on N ranks
    // through an fp32 [S] output; one rank's reduce-scatter is its input [U], added in place.
    if (shards_->ranks() > 1) return shards_->reduce_scatter_add(u, rs_input_, shard);
    const float* sum = rs_input_.data<float>();
    for (int64_t i = 0; i < shards_->shard_length(u); ++i) {
      if (offload_) shard.data<Bf16>()[i] = f32_to_bf16(to_f32(shard.data<Bf16>()[i]) + sum[i]);
      else shard.data<float>()[i] += sum[i];
    }
  }
  void finish_reduce_scatter() {
    land_reduce_scatter();
    rs_input_.reset();
    rs_unit_ = -1;
  }

  // Views of layer l's weights (or grads) in a gathered [U] bf16 buffer; at EP > 1 its experts
  // after the dense part.
  LayerWeightPtrs layer_views(int64_t l, Tensor& unit) const {
    Bf16* base = unit.data<Bf16>();
    const bool experts_apart = c_.ep > 1 && !is_dense_layer(c_, l);
    return layer_weights_in(base + unit_extra_params(c_, layer_unit(l)), lc(l),
                            experts_apart ? base + unit_shapes_[static_cast<size_t>(layer_unit(l))].sharded_params : nullptr);
  }
  LayerWeightPtrs weights_of(int64_t l) { return layer_views(l, gathered_[static_cast<size_t>(layer_unit(l))]); }
  Communicator* ep_group() const {
    if (c_.ep == 1) return nullptr;
    return ep_group_ ? ep_group_.get() : comm_;
  }
  Communicator* cp_group() const { return c_.cp > 1 ? cp_group_ : nullptr; }

  // ---- token ids (input data)

  int32_t token_id(int64_t t) const { return static_cast<int32_t>(mix64(data_seed_ * 7 + 11, static_cast<uint64_t>(t)) % static_cast<uint64_t>(V_)); }
  // [T] i32 for the CPU embedding op (its index type); workspace.
  Tensor index_copy(const Tensor& ids) {
    Tensor idx(a_, DType::I32, {T_}, Category::Workspace);
    for (int64_t t = 0; t < T_; ++t) idx.data<int32_t>()[t] = static_cast<int32_t>(ids.data<int64_t>()[t]);
    return idx;
  }
  Tensor token_ids(Category category) {
    Tensor ids(a_, DType::I64, {T_}, category);  // [T] int64
    for (int64_t t = 0; t < T_; ++t) ids.data<int64_t>()[t] = token_id(t);
    return ids;
  }

  // ---- boundaries

  void copy_to_host(int64_t l) {
    std::memcpy(host_slot(l), device_[static_cast<size_t>(l)].raw(), static_cast<size_t>(T_ * H_ * 2));
  }
  void fetch(int64_t l) {
    Tensor& d = device_[static_cast<size_t>(l)];
    if (!offloaded_[static_cast<size_t>(l)] || !d.empty()) return;
    d = Tensor(a_, DType::BF16, {T_, H_}, Category::Boundaries);
    std::memcpy(d.raw(), host_slot(l), static_cast<size_t>(T_ * H_ * 2));
  }
  Bf16* host_slot(int64_t l) { return host_boundaries_.data<Bf16>() + slot_[static_cast<size_t>(l)] * T_ * H_; }

  // ---- forward

  void forward() {
    a_.set_phase("fwd/embed");
    gather(0);
    gather(layer_unit(0));  // prefetch
    {
      Tensor ids = token_ids(Category::Activations);
      Tensor x0(a_, DType::BF16, {T_, H_}, Category::Activations);  // the embedding output
      Tensor idx = index_copy(ids);
      EmbeddingArgs e;
      e.dtype = DType::BF16;
      e.token_ids = idx.data<int32_t>();
      e.table = gathered_[0].raw();
      e.out = x0.raw();
      e.tokens = T_;
      e.vocab = V_;
      e.hidden = H_;
      embedding_forward_cpu(e);
      idx.reset(), ids.reset();
      reshard(0);
      x0.set_category(Category::Boundaries);  // x_0, the first layer's input
      device_[0] = std::move(x0);
    }
    for (int64_t l = 0; l < L_; ++l) {
      const int64_t next = l + 1 < L_ ? layer_unit(l + 1) : head_;
      const Hook start = [&, l, next] {
        gather(next);  // prefetch
        if (offloaded_[static_cast<size_t>(l)]) copy_to_host(l);  // D2H starts with the layer
      };
      Tensor y;
      if (c_.naive) {
        naive_layers_.emplace_back(a_, lc(l), weights_of(l), ep_group(), cp_group());
        y = naive_layers_.back().forward_saving(device_[static_cast<size_t>(l)], layer_prefix("fwd", l), true, nullptr, start);
        if (!is_dense_layer(c_, l)) expert_counts_.push_back(naive_layers_.back().expert_counts());
      } else {
        DecoderLayer layer(a_, lc(l), weights_of(l), ep_group(), cp_group());
        y = layer.forward_no_grad(device_[static_cast<size_t>(l)], layer_prefix("fwd", l), start);
        if (!is_dense_layer(c_, l)) expert_counts_.push_back(layer.expert_counts());
        reshard(layer_unit(l));
      }
      if (offloaded_[static_cast<size_t>(l)]) device_[static_cast<size_t>(l)].reset();
      device_[static_cast<size_t>(l + 1)] = std::move(y);
    }
  }

  // ---- loss: final norm, vocabulary projection and cross-entropy, final norm backward

  // Loss `index`: 0 the main loss on h_L (the head unit's final norm), j + 1 MTP module j's on h^j
  // (the module's head norm), its targets the tokens index + 1 ahead. With a module after it
  // (index < M) that module and the rest run between the loss's passes (LossInputs::between). On
  // return dy_ is the gradient of the loss's input (with the next module's hnorm gradient added).
  void run_loss(int64_t index) {
    const bool main_loss = index == 0;
    const int64_t module = index - 1;  // MTP loss: its module
    const Tensor& input = main_loss ? device_[static_cast<size_t>(L_)] : module_out_[static_cast<size_t>(module)];
    const int64_t shift = index + 1;
    Tensor targets(a_, DType::I32, {T_}, Category::Workspace);  // input labels: the token `shift` ahead
    for (int64_t t = 0; t < T_; ++t)
      targets.data<int32_t>()[t] = t + shift < T_ ? token_id(t + shift)
                                                  : static_cast<int32_t>(mix64(data_seed_ * 7 + 13, static_cast<uint64_t>(t + shift - T_)) %
                                                                         static_cast<uint64_t>(V_));
    const bool layer_norm = c_.model.norm_bias;
    const int64_t norm_params = layer_norm ? 2 * H_ : H_;  // the final norm's weight (and LayerNorm's bias)
    const bool deferred = index < M_;
    Tensor head_grads;   // [U] the head's grads, laid out as the unit
    Tensor norm_weight;  // [H] the main loss's final norm weight, kept when W goes
    LossInputs io;
    io.phase_prefix = main_loss ? "loss" : "loss/mtp" + std::to_string(module);
    io.targets = targets.data<int32_t>();
    // W from the gathered head (the last layer's or the module's prefetch, or gathered now).
    const auto take_head = [&] {
      gather(head_);
      Tensor& head = gathered_[static_cast<size_t>(head_)];
      head.set_category(Category::Vocab);  // the gathered head: [final norm | W | head bias]
      io.w = head.data<Bf16>() + norm_params;
      io.bias = c_.model.lm_head_bias ? io.w + V_ * H_ : nullptr;
      io.w_storage = std::move(head);
    };
    take_head();
    // The norm before the loss: the main loss's is the head unit's first H elements (copied out
    // when W goes: norm_weight); an MTP loss's is in its module's unit, copied out when the module
    // was resharded (module_head_norm_) and read again from the module's prefetch in backward.
    const auto module_norm = [&]() -> const Bf16* {
      return gathered_[static_cast<size_t>(layer_unit(L_ + module))].data<Bf16>() + module_head_norm_at(H_);
    };
    io.on_forward = [&] {
      io.x = Tensor(a_, DType::BF16, {T_, H_}, Category::Vocab);  // X = final_norm(input)
      Tensor rstd(a_, DType::F32, {T_}, Category::Activations);   // recomputed in backward
      if (layer_norm) {
        Tensor mean(a_, DType::F32, {T_}, Category::Activations);  // recomputed in backward
        LayerNormArgs n;
        n.dtype = DType::BF16;
        n.x = input.raw();
        n.weight = io.w_storage.raw();
        n.bias = io.w_storage.data<Bf16>() + H_;
        n.out = io.x.raw();
        n.mean = mean.data<float>();
        n.rstd = rstd.data<float>();
        n.tokens = T_;
        n.hidden = H_;
        layernorm_forward_cpu(n);
        return;
      }
      RmsNormArgs n;
      n.dtype = DType::BF16;
      n.x = input.raw();
      n.weight = main_loss ? io.w_storage.raw() : module_head_norm_.raw();
      n.out = io.x.raw();
      n.rstd = rstd.data<float>();
      n.tokens = T_;
      n.hidden = H_;
      rmsnorm_forward_cpu(n);
      module_head_norm_.reset();
    };
    io.make_dw = [&](DType dtype) {
      // fp32 (the blocked loss's accumulator, reduced in place): laid out as the reduce-scatter
      // input, [N·S] (N = 1: [U]); bf16: the unsharded grads [U].
      const int64_t n = dtype == DType::F32 ? shards_->reduce_scatter_input_params(static_cast<size_t>(head_)) : U(head_);
      head_grads = Tensor(a_, dtype, {n}, Category::Vocab);
      zero(head_grads);
      unsigned char* dw = static_cast<unsigned char*>(head_grads.raw()) + norm_params * dtype_bytes(dtype);
      if (c_.model.lm_head_bias) io.d_bias = dw + V_ * H_ * dtype_bytes(dtype);
      return static_cast<void*>(dw);
    };
    if (deferred) io.between = [&, index] { run_module(index); };
    io.on_backward = [&] {
      if (deferred) {
        land_reduce_scatter();  // the module after it: its shard lands, its input stays in flight
        if (!in_forward_loss()) take_head();  // gradients in forward read no W again
      }
      gather(layer_unit(main_loss ? L_ - 1 : L_ + module));  // prefetch: the layer (or module) before
    };
    io.before_release = [&] {
      // The norm's backward reads its weight, not LayerNorm's bias (whose gradient is Σ dy): with
      // gradients in forward kept from the forward, through any MTP modules.
      if (main_loss) keep_norm_weight(norm_weight, io.w_storage);
    };
    LossOutputs out = run_vocab_loss(a_, loss_, io);
    if (main_loss) result_->loss = out.mean_loss;
    else result_->mtp_losses[static_cast<size_t>(module)] = out.mean_loss;  // losses end from the last module
    // The norm's backward: dy = d input (the gradient stream), the norm's weight grad: into the
    // head's grads, or an MTP loss's into a [H] buffer its module's unsharded grads take.
    Tensor rstd(a_, DType::F32, {T_}, Category::Activations);
    Tensor mean;  // LayerNorm's, recomputed as layernorm_forward_cpu computes it
    if (layer_norm) mean = Tensor(a_, DType::F32, {T_}, Category::Activations);
    {
      const Bf16* x = input.data<Bf16>();
      for (int64_t t = 0; t < T_; ++t) {
        if (layer_norm) {  // as layernorm_forward_cpu computes them
          layernorm_row_stats(x + t * H_, H_, LayerNormArgs{}.eps, mean.data<float>()[t], rstd.data<float>()[t]);
          continue;
        }
        rstd.data<float>()[t] = row_rstd(x + t * H_);
      }
    }
    dy_ = Tensor(a_, DType::BF16, {T_, H_}, Category::Activations);
    {
      Tensor d_norm;  // the blocked loss's head grads are fp32: the norm's bf16 grads go here first
      if (!main_loss) {
        Tensor& held = module_norm_grad_[static_cast<size_t>(module)];
        held = Tensor(a_, DType::BF16, {H_}, Category::Fsdp);  // taken by the module's unsharded grads
        zero(held);
      } else if (head_grads.dtype() == DType::F32) {
        d_norm = Tensor(a_, DType::BF16, {norm_params}, Category::Workspace);
        zero(d_norm);
      }
      void* d_norm_params = !main_loss ? module_norm_grad_[static_cast<size_t>(module)].raw()
                                       : d_norm.empty() ? head_grads.raw() : d_norm.raw();  // [weight | LayerNorm bias]
      if (layer_norm) {
        LayerNormArgs n;
        n.dtype = DType::BF16;
        n.x = input.raw();
        n.weight = norm_weight.raw();
        n.mean = mean.data<float>();
        n.rstd = rstd.data<float>();
        n.d_out = out.d_x.raw();
        n.d_x = dy_.raw();
        n.d_weight = d_norm_params;
        n.d_bias = static_cast<Bf16*>(d_norm_params) + H_;
        n.tokens = T_;
        n.hidden = H_;
        Tensor ws(a_, DType::F32, {layernorm_workspace_bytes(n) / 4}, Category::Workspace);
        n.workspace = ws.data<float>();
        layernorm_backward_cpu(n);
      } else {
        RmsNormArgs n;
        n.dtype = DType::BF16;
        n.x = input.raw();
        n.weight = main_loss ? norm_weight.raw() : module_norm();
        n.rstd = rstd.data<float>();
        n.d_out = out.d_x.raw();
        n.d_x = dy_.raw();
        n.d_weight = d_norm_params;
        n.tokens = T_;
        n.hidden = H_;
        Tensor ws(a_, DType::F32, {rmsnorm_workspace_bytes(n) / 4}, Category::Workspace);
        n.workspace = ws.data<float>();
        rmsnorm_backward_cpu(n);
      }
      if (!d_norm.empty())
        for (int64_t h = 0; h < norm_params; ++h) head_grads.data<float>()[h] += to_f32(d_norm.data<Bf16>()[h]);
    }
    // The next module's hnorm gradient of the same input joins the stream.
    if (!d_input_from_module_.empty()) {
      add_into(dy_, d_input_from_module_);
      d_input_from_module_.reset();
    }
    rstd.reset(), mean.reset(), norm_weight.reset(), out.d_x.reset(), out.loss.reset(), targets.reset();
    // The loss's input: its norm's backward is done.
    if (main_loss) device_[static_cast<size_t>(L_)].reset();
    else module_out_[static_cast<size_t>(module)].reset();
    finish_reduce_scatter();  // the module after it (MTP): its input was in flight through the loss
    // The head's reduce-scatter input: the fp32 accumulator itself, or the bf16 grads widened.
    if (head_grads.dtype() == DType::F32) {
      head_grads.set_category(Category::Fsdp);
      start_reduce_scatter(head_, std::move(head_grads));
    } else {
      start_reduce_scatter(head_, reduce_scatter_input(head_, head_grads));
    }
  }

  bool in_forward_loss() const { return loss_.gradients_in_forward && loss_.mode == VocabScheduleMode::Blocked; }

  // The final norm's weight [H] (fsdp) copied from a gathered head, for the norm's backward
  // after W is released.
  void keep_norm_weight(Tensor& norm_weight, const Tensor& head) {
    norm_weight = Tensor(a_, DType::BF16, {H_}, Category::Fsdp);
    std::memcpy(norm_weight.raw(), head.raw(), static_cast<size_t>(H_) * 2);
  }

  // rstd of one bf16 row as rmsnorm_forward_cpu computes it.
  float row_rstd(const Bf16* x) const {
    float sum_squares = 0.0f;
    for (int64_t h = 0; h < H_; ++h) sum_squares += to_f32(x[h]) * to_f32(x[h]);
    return rmsnorm_rstd(sum_squares, H_, RmsNormArgs{}.eps);
  }

  // dst += src, [T, H] bf16 each (one rounding per element).
  static void add_into(Tensor& dst, const Tensor& src) {
    for (int64_t i = 0; i < dst.numel(); ++i) dst.data<Bf16>()[i] = f32_to_bf16(to_f32(dst.data<Bf16>()[i]) + to_f32(src.data<Bf16>()[i]));
  }

  // ---- MTP modules (planner/README.md "Multi-token prediction")

  // Module j, then its loss (which runs the modules after it between its passes), then module j's
  // backward: runs between the passes of the loss before it.
  void run_module(int64_t j) {
    forward_module(j);
    run_loss(j + 1);
    backward_module(j);
  }

  const Tensor& module_hidden_input(int64_t j) const {  // h^(j-1): h_L for module 0
    return j == 0 ? device_[static_cast<size_t>(L_)] : module_out_[static_cast<size_t>(j - 1)];
  }

  // eh_proj's input [2, T, H] bf16 (activations): hnorm(h^(j-1)) in rows [0, T), enorm(x_0
  // shifted by j + 1 rows) in rows [T, 2T) (the last j + 1 rows zero: no token there). The
  // norms' statistics are op scratch (workspace), recomputed in backward.
  Tensor eh_input(int64_t j) {
    const Bf16* unit = gathered_[static_cast<size_t>(layer_unit(L_ + j))].data<Bf16>();
    const int64_t shift = std::min(j + 1, T_);
    Tensor in(a_, DType::BF16, {2, T_, H_}, Category::Activations);
    Tensor rstd(a_, DType::F32, {T_}, Category::Workspace);
    RmsNormArgs n;
    n.dtype = DType::BF16;
    n.x = module_hidden_input(j).raw();
    n.weight = unit + module_hnorm_at(H_);
    n.out = in.raw();
    n.rstd = rstd.data<float>();
    n.tokens = T_;
    n.hidden = H_;
    rmsnorm_forward_cpu(n);
    Bf16* embedded = in.data<Bf16>() + T_ * H_;
    n.x = device_[0].data<Bf16>() + shift * H_;
    n.weight = unit + module_enorm_at(H_);
    n.out = embedded;
    n.tokens = T_ - shift;
    if (n.tokens > 0) rmsnorm_forward_cpu(n);
    std::fill(embedded + (T_ - shift) * H_, embedded + T_ * H_, Bf16{});
    return in;
  }

  // eh_proj: [T, 2H] · W_eh[H, 2H]ᵀ as two GEMMs over the halves (the second accumulating).
  void eh_proj_forward(int64_t j, const Tensor& in, Tensor& out) {
    const Bf16* w = gathered_[static_cast<size_t>(layer_unit(L_ + j))].data<Bf16>() + module_eh_proj_at(H_);
    const Bf16* a = in.data<Bf16>();
    gemm_cpu(false, true, T_, H_, H_, 1.0f, a, H_, w, 2 * H_, false, out.data<Bf16>(), H_);
    gemm_cpu(false, true, T_, H_, H_, 1.0f, a + T_ * H_, H_, w + H_, 2 * H_, true, out.data<Bf16>(), H_);
  }

  void forward_module(int64_t j) {
    const int64_t l = L_ + j;
    const std::string prefix = layer_prefix("fwd", l);
    a_.set_phase(prefix + "attn");
    gather(layer_unit(l));  // gathered as its forward starts
    gather(head_);          // prefetch: its loss follows
    fetch(0);               // x_0 offloaded: a copy for the shifted embedding input
    {
      Tensor in = eh_input(j);
      Tensor& u = module_in_[static_cast<size_t>(j)];
      u = Tensor(a_, DType::BF16, {T_, H_}, Category::Boundaries);  // the decoder layer's input, kept to its backward
      eh_proj_forward(j, in, u);
    }
    Tensor y;
    if (c_.naive) {
      naive_layers_.emplace_back(a_, lc(l), weights_of(l), ep_group(), cp_group());
      y = naive_layers_.back().forward_saving(module_in_[static_cast<size_t>(j)], prefix, true, nullptr, nullptr);
      if (!is_dense_layer(c_, l)) expert_counts_.push_back(naive_layers_.back().expert_counts());
    } else {
      DecoderLayer layer(a_, lc(l), weights_of(l), ep_group(), cp_group());
      y = layer.forward_no_grad(module_in_[static_cast<size_t>(j)], prefix, nullptr);
      if (!is_dense_layer(c_, l)) expert_counts_.push_back(layer.expert_counts());
    }
    // The module's head norm, for its loss's X (the unit is released before the loss): [H], freed
    // as X is made, before any of the loss's buffers (between two peaks: the planner has no term).
    module_head_norm_ = Tensor(a_, DType::BF16, {H_}, Category::Fsdp);
    std::memcpy(module_head_norm_.raw(), gathered_[static_cast<size_t>(layer_unit(l))].data<Bf16>() + module_head_norm_at(H_),
                static_cast<size_t>(H_) * 2);
    if (!c_.naive) reshard(layer_unit(l));
    if (offloaded_[0]) device_[0].reset();
    y.set_category(Category::Boundaries);
    module_out_[static_cast<size_t>(j)] = std::move(y);
  }

  void backward_module(int64_t j) {
    const int64_t l = L_ + j;
    const std::string prefix = layer_prefix("bwd", l);
    Tensor& u = module_in_[static_cast<size_t>(j)];
    Tensor grads, in;
    const GradSource make_grads = [&] {
      grads = unsharded_grads(layer_unit(l));
      Tensor& held = module_norm_grad_[static_cast<size_t>(j)];  // its loss's head-norm gradient
      std::memcpy(grads.data<Bf16>() + module_head_norm_at(H_), held.raw(), static_cast<size_t>(H_) * 2);
      held.reset();
      return layer_views(l, grads);
    };
    Tensor du;
    if (c_.naive) {
      land_reduce_scatter();
      in = eh_input(j);
      du = naive_layers_[static_cast<size_t>(l)].backward(u, prefix, [&] { return std::move(dy_); }, make_grads);
    } else {
      const Hook start = [&] {
        land_reduce_scatter();
        if (!in_forward_loss()) gather(head_);  // prefetch: the loss before it (it reads W)
        fetch(0);
        in = eh_input(j);  // recomputed: eh_proj's weight gradient reads it
      };
      DecoderLayer layer(a_, lc(l), weights_of(l), ep_group(), cp_group());
      layer.forward_saving(u, prefix + "recompute/", false, [&] { return std::move(dy_); }, start);
      du = layer.backward(u, prefix, nullptr, make_grads);
    }
    // eh_proj's backward (in the layer's last phase, bwd/MTPj/attn): d of its input [2, T, H]
    // and its weight gradient, then the norms': d h^(j-1) and d x_0 (shifted back, into the
    // modules' shared buffer).
    Bf16* g = grads.data<Bf16>();
    const Bf16* unit = gathered_[static_cast<size_t>(layer_unit(l))].data<Bf16>();
    const Bf16* w = unit + module_eh_proj_at(H_);
    Tensor d_in(a_, DType::BF16, {2, T_, H_}, Category::Activations);
    Bf16* da = d_in.data<Bf16>();
    Bf16* db = da + T_ * H_;
    gemm_cpu(false, false, T_, H_, H_, 1.0f, du.data<Bf16>(), H_, w, 2 * H_, false, da, H_);
    gemm_cpu(false, false, T_, H_, H_, 1.0f, du.data<Bf16>(), H_, w + H_, 2 * H_, false, db, H_);
    Bf16* g_eh = g + module_eh_proj_at(H_);
    gemm_cpu(true, false, H_, H_, T_, 1.0f, du.data<Bf16>(), H_, in.data<Bf16>(), H_, true, g_eh, 2 * H_);
    gemm_cpu(true, false, H_, H_, T_, 1.0f, du.data<Bf16>(), H_, in.data<Bf16>() + T_ * H_, H_, true, g_eh + H_, 2 * H_);
    in.reset(), du.reset();
    {
      Tensor rstd(a_, DType::F32, {T_}, Category::Workspace);
      Tensor ws(a_, DType::F32, {H_}, Category::Workspace);
      const Tensor& h = module_hidden_input(j);
      for (int64_t t = 0; t < T_; ++t) rstd.data<float>()[t] = row_rstd(h.data<Bf16>() + t * H_);
      d_input_from_module_ = Tensor(a_, DType::BF16, {T_, H_}, Category::Activations);  // d h^(j-1)
      RmsNormArgs n;
      n.dtype = DType::BF16;
      n.x = h.raw();
      n.weight = unit + module_hnorm_at(H_);
      n.rstd = rstd.data<float>();
      n.d_out = da;
      n.d_x = d_input_from_module_.raw();
      n.d_weight = g + module_hnorm_at(H_);
      n.workspace = ws.data<float>();
      n.tokens = T_;
      n.hidden = H_;
      rmsnorm_backward_cpu(n);
      if (mtp_embedding_grad_.empty()) {  // the last module's backward (the first) makes it
        mtp_embedding_grad_ = Tensor(a_, DType::BF16, {T_, H_}, Category::Activations);
        zero(mtp_embedding_grad_);
      }
      const int64_t shift = std::min(j + 1, T_);
      const Bf16* x = device_[0].data<Bf16>() + shift * H_;
      for (int64_t t = 0; t + shift < T_; ++t) rstd.data<float>()[t] = row_rstd(x + t * H_);
      n.x = x;
      n.weight = unit + module_enorm_at(H_);
      n.d_out = db;
      n.d_x = db;  // in place: the op reads each gradient element before writing the same one
      n.d_weight = g + module_enorm_at(H_);
      n.tokens = T_ - shift;
      if (n.tokens > 0) rmsnorm_backward_cpu(n);
      Bf16* e = mtp_embedding_grad_.data<Bf16>() + shift * H_;
      for (int64_t i = 0; i < n.tokens * H_; ++i) e[i] = f32_to_bf16(to_f32(e[i]) + to_f32(db[i]));
    }
    d_in.reset();
    reshard(layer_unit(l));
    finish_reduce_scatter();
    start_reduce_scatter(layer_unit(l), reduce_scatter_input(layer_unit(l), grads));
    u.reset();  // its backward is done
    if (offloaded_[0]) device_[0].reset();
  }

  // ---- backward

  void backward() {
    for (int64_t l = L_ - 1; l >= 0; --l) {
      const int64_t prev = l > 0 ? layer_unit(l - 1) : 0;
      Tensor grads;
      const GradSource make_grads = [&] {
        grads = unsharded_grads(layer_unit(l));
        return layer_views(l, grads);
      };
      Tensor dx;
      if (c_.naive) {
        land_reduce_scatter();
        dx = naive_layers_[static_cast<size_t>(l)].backward(device_[static_cast<size_t>(l)], layer_prefix("bwd", l),
                                                             [&] { return std::move(dy_); }, make_grads);
      } else {
        const Hook start = [&, l, prev] {
          land_reduce_scatter();
          gather(prev);  // prefetch
          fetch(l);
          for (int64_t i = l - 1; i >= 0 && i >= l - c_.prefetch; --i) fetch(i);  // SCO's prefetch
        };
        DecoderLayer layer(a_, lc(l), weights_of(l), ep_group(), cp_group());
        layer.forward_saving(device_[static_cast<size_t>(l)], layer_prefix("bwd", l) + "recompute/", false,
                             [&] { return std::move(dy_); }, start);
        dx = layer.backward(device_[static_cast<size_t>(l)], layer_prefix("bwd", l), nullptr, make_grads);
      }
      reshard(layer_unit(l));
      finish_reduce_scatter();
      start_reduce_scatter(layer_unit(l), reduce_scatter_input(layer_unit(l), grads));
      device_[static_cast<size_t>(l)].reset();  // x_l: its layer's backward is done
      dy_ = std::move(dx);
    }
    if (c_.naive) naive_layers_.clear();
    a_.set_phase("bwd/embed");
    land_reduce_scatter();
    gather(0);  // prefetched in bwd/L0 (the naive run gathers it here)
    Tensor grads = unsharded_grads(0);
    {
      Tensor ids = token_ids(Category::Workspace);  // the input ids, re-read
      Tensor idx = index_copy(ids);
      EmbeddingArgs e;
      e.dtype = DType::BF16;
      e.token_ids = idx.data<int32_t>();
      e.d_out = dy_.raw();
      e.d_table = grads.raw();
      e.tokens = T_;
      e.vocab = V_;
      e.hidden = H_;
      embedding_backward_cpu(e);
      if (!mtp_embedding_grad_.empty()) {  // the MTP modules' gradient of x_0, in row order
        e.d_out = mtp_embedding_grad_.raw();
        embedding_backward_cpu(e);
      }
    }
    dy_.reset();
    mtp_embedding_grad_.reset();
    reshard(0);
    finish_reduce_scatter();
    start_reduce_scatter(0, reduce_scatter_input(0, grads));
    finish_reduce_scatter();  // the embedding's shard lands; every grad shard exists
  }

  TrackingAllocator& a_;
  Communicator* comm_;
  const StepScheduleConfig& c_;
  const int64_t T_, H_, V_, L_;
  const int64_t M_;  // MTP modules run (decoder layers L .. L+M-1)
  static std::vector<LayerScheduleConfig> layer_configs(const StepScheduleConfig& c) {
    std::vector<LayerScheduleConfig> out;
    for (int64_t l = 0; l < c.model.num_layers + mtp_modules(c); ++l) out.push_back(layer_config(c, l));
    return out;
  }
  const LayerScheduleConfig& lc(int64_t l) const { return lcs_[static_cast<size_t>(l)]; }
  const std::vector<LayerScheduleConfig> lcs_;  // per layer
  const std::vector<FsdpUnitShape> unit_shapes_;  // step_unit_shapes
  const std::vector<int64_t> unit_params_;        // gathered [U] per unit
  const uint64_t data_seed_;
  const int64_t ep_rank_;                         // this rank's experts: [ep_rank·E/EP, ...)
  std::vector<std::vector<int64_t>> expert_counts_;
  int64_t P_ = 0, head_ = 0;
  bool offload_ = false;
  VocabScheduleConfig loss_;
  OptimizerScheduleConfig opt_;
  std::vector<bool> offloaded_;
  std::vector<int64_t> slot_;

  std::unique_ptr<Communicator> ep_group_, replicas_;  // 1 < EP < N only (destroyed after shards_, before comm_)
  std::unique_ptr<Communicator> cp_ring_;              // CP > 1 across the ranks of comm_
  Communicator* cp_group_ = nullptr;                   // the layers' CP ring (cp > 1), else null
  std::unique_ptr<FsdpShards> shards_;  // the rank's param shards; grad shards are grad_shards_
  Tensor m_, v_;
  std::unique_ptr<OptimizerHostState> host_state_;
  Tensor host_boundaries_;
  std::vector<Tensor> gathered_, grad_shards_, device_;
  Tensor rs_input_;
  int64_t rs_unit_ = -1;
  bool rs_landed_ = false;
  Tensor dy_;
  StepScheduleResult* result_ = nullptr;
  // MTP: per module its input (eh_proj's output) and output h^j, its loss's head-norm gradient
  // [H] until the module's grads exist; the head norm copied for the next loss's X; the gradient
  // of a module's hidden input waiting for the loss before it; the modules' gradient of x_0.
  std::vector<Tensor> module_in_, module_out_, module_norm_grad_;
  Tensor module_head_norm_, d_input_from_module_, mtp_embedding_grad_;
  std::vector<DecoderLayer> naive_layers_;
};

}  // namespace

std::vector<int64_t> step_unit_params(const ModelSpec& model, bool mtp) { return rank_shard_units(model, 1, 1, mtp); }

std::vector<FsdpUnitShape> step_unit_shapes(const StepScheduleConfig& config) {
  const std::vector<int64_t> whole = step_unit_params(config.model, config.mtp);
  const ParamCounts pc = count_params(config.model);
  const int64_t ep = std::max<int64_t>(1, config.ep);
  std::vector<FsdpUnitShape> out;
  for (size_t u = 0; u < whole.size(); ++u) {
    const std::string name = "unit" + std::to_string(u);
    if (ep == 1 || !is_layer_unit(config, static_cast<int64_t>(u)) || is_dense_layer(config, static_cast<int64_t>(u) - 1)) {
      out.push_back({name, whole[u], 0});
      continue;
    }
    const int64_t dense = pc.attention_per_layer + pc.layer_norms_per_layer + pc.router_per_layer + pc.shared_experts_per_layer +
                          unit_extra_params(config, static_cast<int64_t>(u));
    out.push_back({name, dense, config.model.num_experts / ep * pc.expert_params});
  }
  return out;
}

std::vector<ParamPiece> step_rank_pieces(const StepScheduleConfig& config, int ranks, int rank) {
  if (ranks < 1 || rank < 0 || rank >= ranks) throw std::invalid_argument("step schedule: rank out of range");
  if (config.ep < 1 || ranks % config.ep != 0) throw std::invalid_argument("step schedule: ep must divide the number of ranks");
  const std::vector<int64_t> whole = step_unit_params(config.model, config.mtp);
  const std::vector<FsdpUnitShape> shapes = step_unit_shapes(config);
  const int64_t ep_rank = rank % config.ep, replicas = ranks / config.ep, replica = rank / config.ep;
  std::vector<ParamPiece> out;
  int64_t unit_at = 0;
  auto add = [&](int64_t reference_begin, int64_t, int64_t count) {
    if (!out.empty() && out.back().begin + out.back().count == unit_at + reference_begin) out.back().count += count;
    else out.push_back({unit_at + reference_begin, count});
  };
  for (size_t u = 0; u < shapes.size(); ++u) {
    const int64_t sharded = shapes[u].sharded_params, S = (sharded + ranks - 1) / ranks;
    const int64_t begin = std::min(sharded, rank * S), end = std::min(sharded, begin + S);
    for_each_reference_piece(config, static_cast<int64_t>(u), ep_rank, begin, end - begin, add);
    const int64_t local = shapes[u].local_params, SL = (local + replicas - 1) / replicas;  // the local part over the replicas
    const int64_t local_begin = std::min(local, replica * SL), local_end = std::min(local, local_begin + SL);
    for_each_reference_piece(config, static_cast<int64_t>(u), ep_rank, sharded + local_begin, local_end - local_begin, add);
    unit_at += whole[u];
  }
  return out;
}

uint64_t step_data_seed(const StepScheduleConfig& config, int rank) {
  const uint64_t base = config.data_seed != 0 ? config.data_seed : config.seed;
  return rank == 0 ? base : mix64(base, 0x5eed0000u + static_cast<uint64_t>(rank));
}

namespace {

// step_initial_params in the EP = 1 layout (config.ep is 1).
void reference_initial_params(const StepScheduleConfig& config, int64_t unit, int64_t begin, int64_t count, float* dst) {
  const ModelSpec& m = config.model;
  const int64_t H = m.hidden_size, V = m.vocab_size, L = m.num_layers + mtp_modules(config);
  std::fill(dst, dst + count, 0.0f);  // parts the executor does not apply stay zero
  const uint64_t seed = mix64(config.seed, static_cast<uint64_t>(unit) * 64);
  // One tensor at `at` of the unit: its elements that fall in [begin, begin + count).
  auto tensor = [&](int64_t at, int64_t numel, uint64_t tensor_seed, auto value) {
    const int64_t lo = std::max(at, begin), hi = std::min(at + numel, begin + count);
    for (int64_t i = lo; i < hi; ++i) dst[i - begin] = value(uniform_pm1(tensor_seed, static_cast<uint64_t>(i - at)));
  };
  // Norms (1-D [H]) around 1, matrices uniform / sqrt(fan-in), the embedding uniform.
  auto weight = [](int64_t fan_in, bool norm) {
    return [fan_in, norm](float u) { return norm ? 1.0f + 0.1f * u : u / std::sqrt(static_cast<float>(fan_in)); };
  };
  if (unit == 0) {  // embedding [V, H]
    tensor(0, V * H, seed, [](float u) { return u; });
  } else if (unit == L + 1) {  // final norm [H] (LayerNorm: and its bias [H]), LM head [V, H] (and its bias [V])
    const int64_t norm = m.norm_bias ? 2 * H : H;
    tensor(0, H, seed, weight(H, true));
    if (m.norm_bias) tensor(H, H, seed + 2, [](float u) { return 0.1f * u; });
    tensor(norm, V * H, seed + 1, weight(H, false));
    if (m.lm_head_bias) tensor(norm + V * H, V, seed + 3, [](float u) { return 0.1f * u; });
  } else {
    int64_t at = unit_extra_params(config, unit);
    uint64_t j = 0;
    if (at > 0) {  // an MTP module: enorm, hnorm, eh_proj [H, 2H], its head norm
      tensor(module_enorm_at(H), H, seed + 1001, weight(H, true));
      tensor(module_hnorm_at(H), H, seed + 1002, weight(H, true));
      tensor(module_eh_proj_at(H), 2 * H * H, seed + 1003, weight(2 * H, false));
      tensor(module_head_norm_at(H), H, seed + 1004, weight(H, true));
    }
    for (const auto& w : layer_weight_shapes(layer_config(config, unit - 1))) {
      tensor(at, w.numel(), seed + ++j, weight(w.shape.back(), w.shape.size() == 1));
      at += w.numel();
    }
  }
}

}  // namespace

void step_initial_params(const StepScheduleConfig& config, int64_t unit, int64_t begin, int64_t count, float* dst, int64_t ep_rank) {
  StepScheduleConfig reference = config;
  reference.ep = 1;
  if (config.ep == 1) return reference_initial_params(reference, unit, begin, count, dst);
  for_each_reference_piece(config, unit, ep_rank, begin, count, [&](int64_t reference_begin, int64_t offset, int64_t n) {
    reference_initial_params(reference, unit, reference_begin, n, dst + offset);
  });
}

StepScheduleResult run_step_schedule(TrackingAllocator& alloc, const StepScheduleConfig& config, Communicator* cp_group) {
  check(config);
  require(config.ep == 1, "ep > 1 needs a Communicator of ep ranks");
  require(config.cp == 1 || (cp_group != nullptr && cp_group->size() == config.cp),
          "cp > 1 needs a CP group of cp ranks (got cp = " + std::to_string(config.cp) + ")");
  return StepRun(nullptr, alloc, config, cp_group).run();
}

StepScheduleResult run_step_schedule(Communicator& comm, TrackingAllocator& alloc, const StepScheduleConfig& config) {
  check(config);
  require(comm.size() % config.ep == 0,
          "ep must divide the number of ranks (got ep = " + std::to_string(config.ep) + " on " + std::to_string(comm.size()) + " ranks)");
  require(comm.size() % config.cp == 0,
          "cp must divide the number of ranks (got cp = " + std::to_string(config.cp) + " on " + std::to_string(comm.size()) + " ranks)");
  return StepRun(&comm, alloc, config).run();
}

StepReference step_reference(const StepScheduleConfig& config, int ranks, int64_t alignment_bytes) {
  if (ranks < 1) throw std::invalid_argument("step reference: ranks must be >= 1 (got " + std::to_string(ranks) + ")");
  StepReference ref;
  // Rank r's naive step: every expert on the rank, its own sequence; at CP > 1 its attention a ring
  // with the other ranks of its CP group, so a group's steps run together (thread ranks).
  const auto naive_step = [&](int r, Communicator* cp_group) {
    StepScheduleConfig n = config;
    n.ep = 1;
    n.naive = true;
    n.keep_results = true;
    n.data_seed = step_data_seed(config, r);
    TrackingAllocator alloc({alignment_bytes});
    return run_step_schedule(alloc, n, cp_group);
  };
  std::vector<StepScheduleResult> per_rank(static_cast<size_t>(ranks));
  if (config.cp > 1) {
    if (ranks % config.cp != 0)
      throw std::invalid_argument("step reference: cp = " + std::to_string(config.cp) + " must divide the ranks (got " + std::to_string(ranks) + ")");
    for (int group = 0; group < ranks / config.cp; ++group) {
      const RunResult run = run_ranks(static_cast<int>(config.cp), [&](int r, Communicator& ring) {
        per_rank[static_cast<size_t>(group * config.cp + r)] = naive_step(static_cast<int>(group * config.cp + r), &ring);
      });
      if (!run.ok()) throw std::runtime_error("step reference: " + run.message);
    }
  } else {
    for (int r = 0; r < ranks; ++r) per_rank[static_cast<size_t>(r)] = naive_step(r, nullptr);
  }
  for (int r = 0; r < ranks; ++r) {  // the grads summed in rank order
    const StepScheduleResult& got = per_rank[static_cast<size_t>(r)];
    ref.losses.push_back(got.loss);
    if (r == 0) ref.grads.assign(got.grads.size(), 0.0f), ref.unit_params = got.unit_params;
    for (size_t i = 0; i < got.grads.size(); ++i) ref.grads[i] = r == 0 ? got.grads[i] : ref.grads[i] + got.grads[i];
  }
  // With the optimizer offloaded the grad shards are bf16: the sum rounded once.
  if (config.optimizer.placement != OptimizerPlacement::Device)
    for (float& g : ref.grads) g = to_f32(f32_to_bf16(g));
  ref.params = step_reference_update(config, ref.grads);
  return ref;
}

std::vector<float> step_reference_update(const StepScheduleConfig& config, const std::vector<float>& grads,
                                         const std::vector<ParamPiece>& pieces) {
  StepScheduleConfig reference = config;
  reference.ep = 1;
  const std::vector<int64_t> units = step_unit_params(config.model, config.mtp);
  std::vector<ParamPiece> wanted = pieces;
  if (wanted.empty()) {
    int64_t P = 0;
    for (int64_t u : units) P += u;
    wanted.push_back({0, P});
  }
  int64_t total = 0;
  for (const ParamPiece& p : wanted) total += p.count;
  std::vector<float> params;
  params.reserve(static_cast<size_t>(total));  // no growth: the result is the only [P] held
  for (const ParamPiece& p : wanted) {  // each unit's part of the piece (a piece may span units)
    int64_t unit_at = 0;
    for (size_t u = 0; u < units.size(); ++u) {
      const int64_t lo = std::max(p.begin, unit_at), hi = std::min(p.begin + p.count, unit_at + units[u]);
      if (hi > lo) {
        const size_t at = params.size();
        params.resize(at + static_cast<size_t>(hi - lo));
        reference_initial_params(reference, static_cast<int64_t>(u), lo - unit_at, hi - lo, params.data() + at);
      }
      unit_at += units[u];
    }
  }
  if (grads.size() != params.size())
    throw std::invalid_argument("step reference: " + std::to_string(grads.size()) + " grads for " + std::to_string(params.size()) + " params");
  // AdamW is elementwise, so a chunk at a time gives the same bits while the moments (zero: the
  // run's first step) take two chunks, not two [P]: verify runs this on every thread rank at
  // once, and its heap outside the tracked allocator is held to 1 MiB per rank.
  constexpr int64_t kChunk = int64_t{1} << 16;
  const int64_t P = static_cast<int64_t>(params.size());
  std::vector<float> m(static_cast<size_t>(std::min(P, kChunk))), v(m.size());  // [chunk] fp32 each
  const OptimizerScheduleConfig& o = config.optimizer;
  for (int64_t at = 0; at < P; at += kChunk) {
    const int64_t count = std::min(kChunk, P - at);
    std::fill(m.begin(), m.end(), 0.0f);
    std::fill(v.begin(), v.end(), 0.0f);
    AdamWArgs a;
    a.master = params.data() + at;
    a.grad = grads.data() + at;
    a.grad_dtype = DType::F32;
    a.m = m.data();
    a.v = v.data();
    a.elems = count;
    a.step = 1;
    a.lr = o.lr, a.beta1 = o.beta1, a.beta2 = o.beta2, a.eps = o.eps, a.weight_decay = o.weight_decay;
    adamw_step_cpu(a);
  }
  return params;
}

}  // namespace flatpeak::exec
