// One decoder layer (RMSNorm, GQA attention, top-k MoE through a standard EP alltoall path on one
// rank or across the EP ranks of a Communicator, optional shared experts) computed on caller-owned weights: the no-grad forward from the
// layer's boundary, the forward that saves what backward needs (the recompute, or the naive
// reference's forward), and the backward into caller-owned gradient storage. The layer component
// (layer_schedule.h) and the whole step (step_schedule.h) both run it; every buffer it makes comes
// from the TrackingAllocator under the traces/ categories and the shared phase names.
//   LayerWeightPtrs w = layer_weights_in(gathered_unit.raw(), c);      // views, storage order
//   DecoderLayer layer(alloc, c, w);
//   Tensor y = layer.forward_no_grad(x, "fwd/L3/");                    // fwd/L3/attn, fwd/L3/moe/...
//   DecoderLayer again(alloc, c, w);                                   // backward: recompute, then back-propagate
//   again.forward_saving(x, "bwd/L3/recompute/", false, [&] { return std::move(dy); });
//   Tensor dx = again.backward(x, "bwd/L3/", nullptr, [&] { return layer_weights_in(grads.raw(), c); });
//   c.ep = 4;  DecoderLayer on_ep(alloc, c, layer_weights_in(dense, c, experts), &ep_group);  // ep_group.size() == 4
//   c.cp = 2;  DecoderLayer on_ring(alloc, c, w, nullptr, &cp_group);  // cp_group.size() == 2, this rank's T tokens
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "executor/comm/communicator.h"
#include "executor/memory/tensor.h"
#include "executor/memory/tracking_allocator.h"
#include "executor/ops/dtype.h"

namespace flatpeak::exec {

struct LayerScheduleConfig {
  int64_t tokens = 0;      // T (one sequence, causal)
  int64_t hidden = 0;      // H
  int64_t q_heads = 0;     // a
  int64_t kv_heads = 0;    // g (a multiple of it is a)
  int64_t head_dim = 0;    // d (q and k; v too unless v_head_dim)
  int64_t v_head_dim = 0;  // dv, of v and the attention output (0: d)
  // Multi-head latent attention (DeepSeek-V2/V3, Kimi K2) when kv_lora > 0, in place of the q, k, v
  // projections: q = RMSNorm(norm-1 output · W_q_aᵀ) · W_q_bᵀ (q_lora > 0; else norm-1 output ·
  // W_qᵀ); the kv latent = norm-1 output · W_kv_aᵀ, its first kv_lora columns RMS-normed and
  // projected by W_kv_b into each head's k_nope [d − rope_dim] and v [dv], its last rope_dim
  // columns (k_rope) the rest of every head's k. kv_heads = q_heads. The latents q latent
  // [T, q_lora] and kv latent [T, kv_lora] are saved (their norms' statistics beside norm-1's and
  // norm-2's); the normed latents and k_rope are transients (the normed latents recomputed in
  // backward; k_rope's gradient is the sum of dk's rope columns over the heads). RoPE itself is not
  // applied (as for every layer here): it changes no buffer.
  int64_t q_lora = 0;
  int64_t kv_lora = 0;
  int64_t rope_dim = 0;
  int64_t experts = 0;     // E, the experts the router chooses among
  int64_t ep = 1;          // EP ranks the experts are split over: this rank computes E/ep of them
                           // (its EP rank's, [r·E/ep, (r+1)·E/ep)); ep > 1 needs a Communicator of ep ranks
  // CP ranks the sequence is split over (ring attention): this rank's T tokens are the r-th T of
  // the sequence (r its rank in the CP group). cp > 1 needs a Communicator of cp ranks; the
  // attention then holds two K,V chunks in flight, an fp32 output and lse accumulator (forward),
  // and two fp32 dK,dV chunks travelling with them (backward): planner/README.md, "Terms, one by one".
  int64_t cp = 1;
  // A sliding window (gpt-oss's local layers): each query attends to the `attention_window` latest
  // keys up to its own (0: full causal). Chunked attention (Llama 4's local layers): each query
  // attends to the keys of its own chunk of `attention_chunk` tokens (0: none); at most one of the
  // two. At CP > 1 a window whose reach (the most keys a rank's first query needs from before the
  // rank: w − 1 for a window, r·T mod C for chunks) stays within the previous rank receives that
  // rank's last K,V rows it reaches (the halo) in place of the ring, and in backward sends their dK,dV back while receiving the next rank's for its own
  // last rows; chunks that never straddle a rank boundary exchange nothing; a longer window runs
  // the ring, masked.
  int64_t attention_window = 0;
  int64_t attention_chunk = 0;
  int64_t top_k = 0;       // k
  int64_t expert_ffn = 0;  // F
  int64_t shared_ffn = 0;  // F_s, total width of the shared experts (0: none)
  // The shared experts' output scaled per token by sigmoid(norm-2 output · shared_gate) (Qwen2-MoE;
  // weight shared_gate [1, H]); needs shared_ffn > 0. The recompute keeps the ungated output
  // [T, H] and the gate [T] (activations) for the backward.
  bool shared_gate = false;
  // F_d > 0: a dense layer, one SwiGLU FFN of this width (weights ffn_gate_up [2F_d, H], ffn_down
  // [H, F_d]; phases .../ffn) in place of the MoE block; experts, shared_ffn 0 and ep 1 then.
  int64_t dense_ffn = 0;
  // LayerNorm norms with a bias (Phi-3.5-MoE; weights norm1_bias, norm2_bias [H]) in place of
  // RMSNorm: each norm saves its per-token mean [T] fp32 beside its rstd.
  bool layer_norm = false;
  // Biases inside each routed expert (gpt-oss; weight b_expert [E/ep, 2F + H]: gate/up [2F] onto
  // fc1, down [H] onto fc2, each written into the GEMM's output rows before it accumulates onto
  // them; the prob rides on the activation, so the down bias is not scaled by it). Their
  // gradients are the rows' sums. MoE layers only.
  bool expert_bias = false;
  int64_t layer_index = 0;  // layer component: phase names use L<layer_index>
  // Layer component: true runs the checkpointed step (no-grad forward, recompute + backward);
  // false the naive reference that keeps every activation from one forward with grad (phases fwd/...).
  bool checkpointed = true;
  DType dtype = DType::BF16;  // storage of activations, weights and their gradients (F32 for tests)
  uint64_t seed = 1;
};

// Throws std::invalid_argument for a shape the layer cannot run.
void check_layer_config(const LayerScheduleConfig& config);

// The layer's weights, or their gradients, as pointers into caller-owned storage of the layer's
// dtype (shared_* null without shared experts).
struct LayerWeightPtrs {
  void *norm1 = nullptr, *wq = nullptr, *wk = nullptr, *wv = nullptr, *wo = nullptr, *norm2 = nullptr;
  // shared_*: the shared experts, or a dense layer's FFN (the same SwiGLU MLP over every token).
  void *router = nullptr, *w_gate_up = nullptr, *w_down = nullptr, *shared_gate_up = nullptr, *shared_down = nullptr;
  void* shared_gate = nullptr;  // [1, H] with LayerScheduleConfig::shared_gate
  void *norm1_bias = nullptr, *norm2_bias = nullptr;  // [H] each with LayerScheduleConfig::layer_norm
  void* b_expert = nullptr;                           // [E/ep, 2F + H] with LayerScheduleConfig::expert_bias
  // MLA (LayerScheduleConfig::kv_lora > 0; wk and wv null, wq only without q_lora).
  void *wq_a = nullptr, *q_norm = nullptr, *wq_b = nullptr, *wkv_a = nullptr, *kv_norm = nullptr, *wkv_b = nullptr;
};

// Weights in storage order: norm1 [H], wq [a·d, H], wk [g·d, H], wv [g·dv, H], wo [H, a·dv],
// norm2 [H], router [E, H], w_gate_up [E/ep, 2F, H], w_down [E/ep, H, F]; with shared experts
// shared_gate_up [2F_s, H], shared_down [H, F_s], and with their gate shared_gate [1, H]; with
// LayerNorm, norm1_bias [H] after norm1 and norm2_bias [H] after norm2; with expert biases,
// b_expert [E/ep, 2F + H] after w_down. MLA in place of wq, wk, wv: wq_a [q_lora, H], q_norm
// [q_lora], wq_b [a·d, q_lora] (or wq [a·d, H] without q_lora), wkv_a [kv_lora + rope, H], kv_norm
// [kv_lora], wkv_b [a·(d − rope) + a·dv, kv_lora] (every head's k_nope rows, then every head's v rows).
struct LayerWeightShape {
  std::string name;
  std::vector<int64_t> shape;
  int64_t numel() const;
};
std::vector<LayerWeightShape> layer_weight_shapes(const LayerScheduleConfig& config);
int64_t layer_weight_elems(const LayerScheduleConfig& config);  // their sum
bool is_expert_weight(const std::string& name);                  // w_gate_up, w_down, b_expert
// Views of one flat buffer holding the weights back to back in storage order; with `experts` set,
// the expert weights back to back there instead and the others back to back from `base` (the
// FSDP layout at EP > 1: the sharded part, then the rank's own experts).
LayerWeightPtrs layer_weights_in(void* base, const LayerScheduleConfig& config, void* experts = nullptr);
// The pointer of weight `name` ("norm1", "wq", ...) in `w`; throws for an unknown name.
void*& layer_weight_ptr(LayerWeightPtrs& w, const std::string& name);

using TensorSource = std::function<Tensor()>;
using Hook = std::function<void()>;
// Zeroed gradient storage for the layer's weights, called once when the backward starts (the
// first phase of the backward has been entered).
using GradSource = std::function<LayerWeightPtrs()>;

class DecoderLayer {
 public:
  // The weights must outlive the layer; the config is copied. config.ep > 1: `ep_group` holds the
  // config.ep EP ranks (this rank computes the experts of its rank in it); every rank of the group
  // makes the same calls (the dispatch and combine are its all-to-alls). config.cp > 1: `cp_group`
  // holds the config.cp ranks of the ring, in sequence order (its ring shifts pass K and V on).
  DecoderLayer(TrackingAllocator& alloc, const LayerScheduleConfig& config, const LayerWeightPtrs& weights,
               Communicator* ep_group = nullptr, Communicator* cp_group = nullptr);
  ~DecoderLayer();
  DecoderLayer(DecoderLayer&&) noexcept;
  DecoderLayer& operator=(DecoderLayer&&) noexcept;

  // Phases prefix + attn, moe/route, moe/dispatch, moe/experts, moe/combine; saves nothing.
  // Returns y [T, H] (category boundaries: the next layer's input). on_start (forward calls):
  // called right after prefix + attn is entered, before x is read (a step prefetches there, or
  // fetches x from the host into the tensor x refers to).
  Tensor forward_no_grad(const Tensor& x, const std::string& prefix, const Hook& on_start = nullptr);
  // Phases prefix + attn, moe/dispatch, moe/experts, moe/combine, keeping the saved set for
  // backward(). grad_stream (the recompute): called right after prefix + attn is entered, its
  // [T, H] tensor (the layer output's gradient) starts the gradient stream there. keep_output
  // (the naive forward): returns y [T, H] (boundaries); otherwise an empty tensor.
  Tensor forward_saving(const Tensor& x, const std::string& prefix, bool keep_output, const TensorSource& grad_stream,
                        const Hook& on_start = nullptr);
  // Phases prefix + moe/combine, moe/experts, moe/dispatch, attn, after forward_saving on the same
  // x. grad_stream: used when forward_saving did not start the stream. Returns dx [T, H]
  // (activations: the previous layer's dy).
  Tensor backward(const Tensor& x, const std::string& prefix, const TensorSource& grad_stream, const GradSource& grads);
  // [E] this rank's token copies per expert at the last routing (the routing data of the layer).
  const std::vector<int64_t>& expert_counts() const;

  struct Engine {
    virtual ~Engine() = default;
    virtual Tensor forward_no_grad(const Tensor& x, const std::string& prefix, const Hook& on_start) = 0;
    virtual Tensor forward_saving(const Tensor& x, const std::string& prefix, bool keep_output, const TensorSource& grad_stream,
                                  const Hook& on_start) = 0;
    virtual Tensor backward(const Tensor& x, const std::string& prefix, const TensorSource& grad_stream, const GradSource& grads) = 0;
    virtual const std::vector<int64_t>& expert_counts() const = 0;
  };

 private:
  std::unique_ptr<Engine> engine_;
};

}  // namespace flatpeak::exec
