// The memory model in numbers only, for the knob search: the workload's MoE loads, and per phase
// the device bytes by category, with the parts the searched knobs move (chunk cap, ring size and
// blocks, SCO layers and prefetch, bucket size and depth) kept apart, so that one candidate costs
// O(phases) additions and no timeline is rebuilt.
//   LoadCache cache;  Workload w = fast_workload(model, run, cache);
//   FastPeaks fp(model, hardware, run, w);   FastSummary s = fp.evaluate(fp.knobs_of(run));
// It mirrors workload.cpp, timeline.cpp, memory_terms_*.cpp and summarize() byte for byte:
// tests/unit/planner_knob_search_test.cpp compares the two on random configurations, so a change
// to the memory model must be made in both.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "plan.h"
#include "spec/routing.h"

namespace flatpeak::planner {

// MoE loads without a cap, and the send matrix the cap logic needs, per (T, EP, routing, layer).
struct MoeBasis {
  MoeLoad load;       // chunk_cap_rows = 0, rounds = 1
  CountMatrix send;   // [EP][EP] rows each source sends (LLA plan when it ran, else standard EP)
  CountMatrix copies; // [EP][E] expected copies (PipelinedLLEP's pool may need the LLA again)
};

// Expected loads and least-loaded assignments, shared by every plan of one query (the
// schedules and knob candidates of one S reuse them).
class LoadCache {
 public:
  const MoeBasis& basis(const ModelSpec& model, const ResolvedRun& run, int64_t tokens, int64_t moe_layer);

 private:
  // (T, EP, E, k, MoE layer, routing model as text); LLEP adds (α, λ, m).
  using ExpectedKey = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, std::string>;
  using Key = std::tuple<ExpectedKey, bool, double, double, int64_t>;
  std::map<Key, std::unique_ptr<MoeBasis>> entries_;
  std::map<ExpectedKey, std::unique_ptr<ExpectedLoads>> expected_;
};

// make_workload with its MoE loads from the cache (equal to make_workload's).
Workload fast_workload(const ModelSpec& model, const ResolvedRun& run, LoadCache& cache);

// A load with the chunk cap in effect: the cap clamped to T·k, the round buffer B sized at launch,
// the cap shrunk when known loads would overflow it, and the rounds (workload.cpp's rule).
MoeLoad load_with_cap(const MoeBasis& basis, const ModelSpec& model, const ResolvedRun& run, int64_t chunk_cap_rows);

// The knob values FastPeaks varies.
struct PeakKnobs {
  std::vector<MoeLoad> loads;         // per distinct routing, with the cap in effect
  int64_t ring_size = 1;
  RingRotate ring_rotate = RingRotate::Weights;
  int64_t token_block = 0;
  int64_t vocab_block = 0;
  int64_t sco_first = -1;             // >= 0: the first n layers offloaded; -1: `offloaded`
  std::vector<bool> offloaded;
  int64_t sco_prefetch = 0;
  int64_t bucket_params = 0;
  int64_t bucket_depth = 1;
};

// summarize() in numbers. Phase indices refer to FastPeaks::phases() (the timeline's order).
struct FastSummary {
  std::array<int64_t, kPeakCount> peak_bytes{};
  std::array<int64_t, kPeakCount> component_bytes{};
  std::array<int, kPeakCount> peak_phase{};  // -1: no such phase
  int64_t gpu_peak_bytes = 0;
  int gpu_peak_phase = -1;
  PeakKind binding = PeakKind::Layer;
  int64_t required_bytes = 0;
  int64_t budget_bytes = 0;
  bool gpu_fits = false;
  int64_t host_per_gpu_bytes = 0;
  int64_t host_peak_bytes = 0;
  int64_t host_budget_bytes = 0;
  bool host_fits = false;
  bool fits() const { return gpu_fits && host_fits; }
};

class FastPeaks {
 public:
  using Cats = std::array<int64_t, kCategoryCount>;
  enum class Bnd : uint8_t { None, Forward, Backward, Loss };
  enum class Disp : uint8_t { None, ForwardRound, RecomputeRound, BackwardRound };
  enum class Voc : uint8_t { None, BlockForward, BlockBackward };
  struct HeadRoles {
    int8_t bf16 = 0, fp32 = 0;  // FSDP roles of the LM head unit: gathered/prefetch/grad (bf16), RS input (fp32)
  };
  // A phase outside the decoder layers (embedding, losses, optimizer) and its knob rules.
  struct Phase {
    uint8_t home = 0;  // bit k: PeakKind k has this phase as home
    Cats fixed{};      // bytes no searched knob moves
    Bnd bnd = Bnd::None;
    int64_t layer = 0;  // Loss: extra resident boundaries (MTP inputs)
    Voc voc = Voc::None;
    HeadRoles head;
  };
  // One phase's transient terms of a layer kind (same for every layer of that kind).
  // The five peaks' own parts of a set of categories: dispatch, vocab, boundaries,
  // params + grads + optimizer, activations (PeakKind order).
  using Comps = std::array<int64_t, kPeakCount>;
  struct Extra {
    uint8_t home = 0;
    Cats terms{};
    Comps comps{};
    int64_t total = 0;
    Disp disp = Disp::None;  // round phases: the dispatch terms come from the cap
    uint8_t base = 0;        // 0 forward, 1 recompute, 2 backward, 3 copy-in, 4 landing
    // bwd/Ll/attn: the phase holds the larger (by total) of this and the copy-in moment, base 3
    // plus the extra after this one (timeline.cpp, backward_layer).
    bool or_copy_in = false;
    // bwd/Ll/recompute/attn: the larger (by total) of this and the landing of the unit in flight
    // through its staged reduce-scatter output, base 4 plus the extra after this one, where the
    // layer has that moment (Layer::landing).
    bool or_landing = false;
  };
  // A decoder layer or MTP module: its persistent-state + FSDP bases and its kind.
  struct Layer {
    int64_t layer = 0;
    int32_t kind = 0;
    int32_t load_index = 0;
    // 0 forward, 1 recompute, 2 backward, 3 the grads' copy-in, 4 the landing of the unit in flight
    std::array<Cats, 5> base{};
    std::array<Comps, 5> base_comps{};
    std::array<int64_t, 5> base_total{};
    std::array<HeadRoles, 5> head{};
    bool landing = false;  // a unit in flight lands through a staged reduce-scatter output (base 4)
  };
  // Execution order: a standalone phase, or a layer's forward or backward phases.
  struct Step {
    enum class Type : uint8_t { Phase, Forward, Backward } type = Type::Phase;
    int32_t index = 0;
  };

  FastPeaks(const ModelSpec& model, const HardwareSpec& hardware, const ResolvedRun& run, const Workload& work);

  // The knobs of `run` and `work` as they are (the real plan's).
  PeakKnobs knobs_of(const ResolvedRun& run, const Workload& work) const;
  FastSummary evaluate(const PeakKnobs& knobs) const;

  // Pieces for the search.
  const std::vector<Phase>& phases() const { return phases_; }
  const std::vector<Layer>& layer_entries() const { return layers_; }
  const std::vector<std::vector<Extra>>& kinds() const { return kinds_; }
  const std::vector<Step>& order() const { return order_; }
  // Boundaries resident or in flight with the first n layers offloaded and prefetch p.
  int64_t boundary_count(Bnd rule, int64_t layer, int64_t n, int64_t prefetch) const;
  int64_t boundary_one() const { return boundary_one_; }
  int64_t dispatch_bytes(Disp kind, const MoeLoad& load) const;
  int64_t vocab_bytes(Voc kind, int64_t ring_size, RingRotate rotate, int64_t token_block, int64_t vocab_block) const;
  int64_t head_bytes(HeadRoles roles, int64_t ring_size) const;
  int64_t host_per_gpu_bytes(int64_t offloaded_layers, int64_t bucket_params, int64_t bucket_depth) const;
  int64_t host_peak_bytes(int64_t host_per_gpu) const;
  // The largest tracked peak whose requirement (peak + overhead + fragmentation) fits the device.
  int64_t gpu_peak_budget() const { return gpu_peak_budget_; }
  int64_t host_budget_bytes() const { return host_budget_; }
  int64_t device_budget_bytes() const { return device_budget_; }
  int64_t required_bytes(int64_t gpu_peak) const;
  int64_t layers() const { return L_; }
  int64_t tokens() const { return T_; }

 private:
  const ModelSpec& model_;
  const ResolvedRun& run_;
  Workload stub_;                   // expert_params_each, for the dispatch round terms
  int64_t L_ = 0, T_ = 0, al_ = 1;
  int64_t boundary_one_ = 0;        // one [T, H] bf16 boundary, aligned
  int64_t head_gathered_ = 0;       // LM head unit's gathered params
  int64_t loss_w_params_ = 0;       // the buffer the loss reads W from at R = 1 (loss_weight_params)
  int64_t host_fixed_per_gpu_ = 0;  // host terms that no searched knob moves
  int64_t shard_params_ = 0;
  int64_t gpus_per_node_ = 1, host_fixed_per_node_ = 0, host_budget_ = 0;
  int64_t overhead_ = 0, device_budget_ = 0, gpu_peak_budget_ = 0;
  double fragmentation_ = 0;
  std::vector<Phase> phases_;
  std::vector<Layer> layers_;
  std::vector<std::vector<Extra>> kinds_;
  std::vector<Step> order_;
};

}  // namespace flatpeak::planner
