// Knob search: FastPeaks equals the memory model (the timeline listing every layer) byte for
// byte; on small configurations the chosen knobs are optimal by brute force over the whole knob
// grid (no feasible knob set is faster, and ties break as documented); given knobs are kept;
// the output is deterministic; when nothing fits, the diagnosis names the peak and what would fit.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <tuple>

#include "knob_search.h"
#include "planner_test_util.h"
#include "spec/hardware_loader.h"
#include "spec/model_loader.h"

namespace flatpeak::planner::test {
namespace {

using Flags = std::vector<std::pair<std::string, std::string>>;

HardwareSpec timed_gpu() {
  HardwareSpec h = tiny_gpu();
  h.bf16_dense_flops = 1e12;
  h.hbm_bandwidth_bytes_per_s = 1e11;
  h.scale_up_bandwidth_bytes_per_s = 1e9;
  h.inter_node_bandwidth_bytes_per_s = 1e8;
  h.host_link_bandwidth_bytes_per_s = 2e6;
  h.host_memory_bandwidth_bytes_per_s = 1e7;
  return h;
}

PlanSummary unfolded(const Plan& p) {
  return summarize(build_timeline(Context{p.model, p.run, p.work}, false), p.run, p.hardware);
}

void expect_equal(const FastSummary& f, const PlanSummary& s, const std::string& what) {
  for (int k = 0; k < kPeakCount; ++k) {
    const auto ku = static_cast<size_t>(k);
    EXPECT_EQ(f.peak_bytes[ku], s.peaks[ku].bytes) << what << " " << to_string(static_cast<PeakKind>(k));
    EXPECT_EQ(f.component_bytes[ku], s.peaks[ku].component_bytes) << what << " " << to_string(static_cast<PeakKind>(k));
  }
  EXPECT_EQ(f.gpu_peak_bytes, s.gpu_peak_bytes) << what;
  EXPECT_EQ(f.binding, s.binding) << what;
  EXPECT_EQ(f.required_bytes, s.required_bytes) << what;
  EXPECT_EQ(f.gpu_fits, s.gpu_fits) << what;
  EXPECT_EQ(f.host_peak_bytes, s.host_peak_bytes) << what;
  EXPECT_EQ(f.host_fits, s.host_fits) << what;
}

void expect_fast_equals_real(const ModelSpec& m, const HardwareSpec& h, const Flags& flags, const std::string& what) {
  const Plan p = make_plan(m, h, spec_of(flags));
  LoadCache cache;
  const Workload w = fast_workload(m, p.run, cache);
  ASSERT_EQ(w.moe_loads.size(), p.work.moe_loads.size()) << what;
  for (size_t i = 0; i < w.moe_loads.size(); ++i) {
    const MoeLoad &a = w.moe_loads[i], &b = p.work.moe_loads[i];
    EXPECT_EQ(std::tie(a.send_rows, a.recv_rows_ep, a.recv_rows_llep, a.foreign_experts, a.lent_experts, a.chunk_cap_rows,
                       a.round_recv_rows, a.rounds),
              std::tie(b.send_rows, b.recv_rows_ep, b.recv_rows_llep, b.foreign_experts, b.lent_experts, b.chunk_cap_rows,
                       b.round_recv_rows, b.rounds))
        << what;
  }
  EXPECT_EQ(w.shard_params, p.work.shard_params) << what;
  const FastPeaks fp(m, h, p.run, w);
  expect_equal(fp.evaluate(fp.knobs_of(p.run, w)), unfolded(p), what);
}

TEST(PlannerKnobSearch, FastPeaksEqualTheMemoryModelOnRandomConfigs) {
  std::mt19937_64 rng(20261130);
  auto pick = [&](std::vector<std::string> v) { return v[std::uniform_int_distribution<size_t>(0, v.size() - 1)(rng)]; };
  for (int trial = 0; trial < 150; ++trial) {
    ModelSpec m = tiny_moe(std::stoi(pick({"1", "2", "3", "5"})));
    m.hidden_size = std::stoi(pick({"8", "16"}));
    m.vocab_size = std::stoi(pick({"32", "96"}));
    m.num_experts = std::stoi(pick({"2", "4"}));
    m.top_k = std::stoi(pick({"1", "2"}));
    m.shared_expert_ffn_width = std::stoi(pick({"0", "8"}));
    m.shared_expert_gate = m.shared_expert_ffn_width > 0 && trial % 2 == 0;  // Qwen2-MoE's (no draw: same configs)
    m.norm_bias = trial % 3 == 0;     // Phi-3.5-MoE's LayerNorm (no draw)
    m.lm_head_bias = trial % 5 == 0;  // and its LM head bias
    m.mtp_layers = std::stoi(pick({"0", "1", "3"}));
    if (pick({"0", "1"}) == "1") m.layers[0].ffn = FfnKind::Dense, m.dense_ffn_width = 16;
    if (m.num_layers > 1 && pick({"0", "1"}) == "1") {
      m.layers[1].window = AttentionWindow::Sliding;
      m.layers[1].attention_window_tokens = 8;
    }
    if (pick({"0", "1"}) == "1") {
      m.attention = AttentionKind::Mla;
      m.num_kv_heads = m.num_heads;
      // Wide latents (40) put the peak of an attention phase at the projections' moments.
      m.q_lora_rank = std::stoi(pick({"0", "6", "40"}));
      m.kv_lora_rank = std::stoi(pick({"5", "40"}));
      m.qk_nope_head_dim = 3;
      m.qk_rope_head_dim = 2;
      m.head_dim = 5;
    }
    const std::string schedule = pick({"baseline", "practice", "flatpeak"});
    const std::string gpus = pick({"1", "2", "4"});
    Flags flags{{"--gpus", gpus}, {"--context", pick({"16", "64", "256"})}, {"--schedule", schedule},
                {"--cp", pick({"1", "2"})}, {"--imbalance", pick({"balanced", "zipf=1.2", "rho=1.5"})},
                {"--optimizer", pick({"gpu", "serial", "stream"})}};
    if (m.mtp_layers > 0) flags.push_back({"--mtp", pick({"on", "off"})});
    if (pick({"0", "1"}) == "1") flags.push_back({"--global-batch", std::to_string(2 * std::stoi(gpus))});
    if (schedule == "flatpeak") {
      flags.push_back({"--sco-layers", pick({"0", "1", "all", "0,2"})});
      flags.push_back({"--sco-prefetch", pick({"0", "1", "3"})});
      flags.push_back({"--vocab-backward", pick({"recompute", "in-forward"})});
      flags.push_back({"--ring-size", pick({"1", "2"})});
      flags.push_back({"--ring-rotate", pick({"weights", "activations"})});
      flags.push_back({"--token-block", pick({"4", "16"})});
      flags.push_back({"--vocab-block", pick({"4", "16"})});
      flags.push_back({"--chunk-cap-rows", pick({"0", "8", "32"})});
      flags.push_back({"--dispatch-mode", pick({"store", "recompute"})});
      flags.push_back({"--llep-min-rows", "4"});
      flags.push_back({"--bucket-params", pick({"64", "100000"})});
    }
    std::string what = "trial " + std::to_string(trial);
    for (const auto& [k, v] : flags) what += " " + k + " " + v;
    try {
      expect_fast_equals_real(m, tiny_gpu(), flags, what);
    } catch (const InputError&) {
      // an invalid combination (e.g. a sliding window with CP): the planner refuses it too
    }
    if (HasFailure()) break;
  }
}

TEST(PlannerKnobSearch, FastPeaksEqualTheMemoryModelOnTheReferenceModels) {
  const HardwareSpec h = load_hardware("H100-80GB");
  for (const char* name : {"gpt-oss-120b", "Qwen3-235B-A22B", "GLM-4.5", "DeepSeek-V3", "Mixtral-8x7B"})
    for (const char* schedule : {"baseline", "practice", "flatpeak"}) {
      const ModelSpec m = load_model(name);
      Flags flags{{"--gpus", "16"}, {"--context", "32K"}, {"--schedule", schedule}, {"--cp", "2"}};
      if (std::string(schedule) == "flatpeak") flags.push_back({"--sco-layers", "5"});
      expect_fast_equals_real(m, h, flags, std::string(name) + " " + schedule);
    }
}

// A gated shared expert (Qwen2-MoE, imported from its config.json): its saved output and gate in
// every MoE recompute and backward phase, in both models.
TEST(PlannerKnobSearch, FastPeaksEqualTheMemoryModelWithAGatedSharedExpert) {
  const ModelSpec m = load_model(std::string(FLATPEAK_TEST_DATA_DIR) + "/hf/Qwen2-57B-A14B/config.json");
  ASSERT_TRUE(m.shared_expert_gate);
  const HardwareSpec h = load_hardware("H100-80GB");
  for (const char* schedule : {"baseline", "practice", "flatpeak"})
    expect_fast_equals_real(m, h, {{"--gpus", "16"}, {"--context", "32K"}, {"--schedule", schedule}}, schedule);
}

// The layer grads' copy-in moment (timeline.cpp backward_layer) taking bwd/Ll/attn: the tiny MoE
// with 32 local experts on one GPU (planner_tiny_test.cpp), and gpt-oss-120b at EP = 1, each with
// the optimizer on the GPU and offloaded, the loss materialised and blocked, SCO on and off.
TEST(PlannerKnobSearch, FastPeaksEqualTheMemoryModelWhenTheGradCopyInIsLargest) {
  ModelSpec tiny = tiny_moe();
  tiny.num_experts = 32;
  for (const char* schedule : {"baseline", "practice", "flatpeak"}) {
    expect_fast_equals_real(tiny, tiny_gpu(), {{"--gpus", "1"}, {"--context", "16"}, {"--schedule", schedule}},
                            std::string("tiny E = 32 ") + schedule);
    expect_fast_equals_real(load_model("gpt-oss-120b"), load_hardware("H200"),
                            {{"--gpus", "4"}, {"--ep", "1"}, {"--context", "16K"}, {"--schedule", schedule}},
                            std::string("gpt-oss-120b EP = 1 ") + schedule);
  }
}

// A unit's grad shard landing through its fp32 reduce-scatter output (timeline.cpp: the start of
// bwd/Ll/recompute/attn and of bwd/embed) taking the phase: the tiny MoE with 32 experts at EP = 1
// on four GPUs (planner_tiny_test.cpp) with the optimizer offloaded, SCO's offloaded sets and
// prefetch depths (the boundaries the previous layer fetched are live then), blocked and
// materialised losses; and a vocabulary of 4096 on two GPUs, where the LM head's landing (its
// fp32 input and output beside the small last layer) is the checkpoint peak.
TEST(PlannerKnobSearch, FastPeaksEqualTheMemoryModelWhenAShardLandingIsLargest) {
  ModelSpec wide = tiny_moe(2);
  wide.vocab_size = 4096;
  for (const char* optimizer : {"serial", "stream"})
    for (const char* schedule : {"baseline", "practice", "flatpeak"})
      expect_fast_equals_real(wide, tiny_gpu(),
                              {{"--gpus", "2"}, {"--context", "16"}, {"--schedule", schedule}, {"--optimizer", optimizer}},
                              std::string("tiny V = 4096 ") + schedule + " " + optimizer);
  ModelSpec tiny = tiny_moe(3);
  tiny.num_experts = 32;
  for (const char* optimizer : {"serial", "stream"})
    for (const char* schedule : {"baseline", "practice", "flatpeak"}) {
      const bool sco = std::string(schedule) == "flatpeak";
      for (const char* layers : sco ? std::vector<const char*>{"0", "1", "all", "0,2"} : std::vector<const char*>{""})
        for (const char* prefetch : sco ? std::vector<const char*>{"0", "1", "2"} : std::vector<const char*>{""}) {
          Flags flags{{"--gpus", "4"}, {"--ep", "1"}, {"--context", "16"}, {"--schedule", schedule}, {"--optimizer", optimizer}};
          if (sco) flags.insert(flags.end(), {{"--sco-layers", layers}, {"--sco-prefetch", prefetch}});
          expect_fast_equals_real(tiny, tiny_gpu(), flags,
                                  std::string("tiny E = 32 ") + schedule + " " + optimizer + " sco " + layers + " prefetch " + prefetch);
          if (HasFailure()) return;
        }
    }
}

// ---- brute force -------------------------------------------------------------------------

struct Candidate {
  double per_token = 0;
  int64_t gpu = 0, host = 0;
  std::vector<int64_t> key;
  bool operator<(const Candidate& o) const {
    return std::tie(per_token, gpu, host, key) < std::tie(o.per_token, o.gpu, o.host, o.key);
  }
};

// Every knob set on the search's grids, planned by make_plan (the real model), the best by the
// documented order. Budgets: the device and host memory that let about half the grid fit.
struct BruteForce {
  std::vector<std::pair<Flags, Candidate>> all;  // with budgets that never bind
  std::vector<int64_t> required, host;
};

BruteForce enumerate(const ModelSpec& m, const HardwareSpec& h, const Flags& base) {
  BruteForce bf;
  const Plan probe = make_plan(m, h, spec_of(base));
  const int64_t T = probe.work.tokens, N = probe.run.gpus, L = m.num_layers;
  const bool moe = m.num_experts > 0;
  const std::vector<int64_t> caps = moe ? chunk_cap_grid(T * m.top_k) : std::vector<int64_t>{0};
  for (int64_t cap : caps)
    for (int64_t R : ring_size_grid(N, probe.run.gpus_per_node))
      for (int64_t tb : token_block_grid(T))
        for (int64_t vb : vocab_block_grid((m.vocab_size + R - 1) / R))
          for (int64_t n = 0; n <= L; ++n)
            for (int64_t p = 0; p <= 4; ++p)
              for (int64_t bucket : bucket_grid(probe.work.shard_params))
                for (int64_t depth = 1; depth <= 8; ++depth) {
                  Flags f = base;
                  if (moe) f.push_back({"--chunk-cap-rows", std::to_string(cap)});
                  f.push_back({"--ring-size", std::to_string(R)});
                  f.push_back({"--token-block", std::to_string(tb)});
                  f.push_back({"--vocab-block", std::to_string(vb)});
                  f.push_back({"--sco-layers", std::to_string(n)});
                  f.push_back({"--sco-prefetch", std::to_string(p)});
                  f.push_back({"--bucket-params", std::to_string(bucket)});
                  f.push_back({"--bucket-depth", std::to_string(depth)});
                  InputErrors errs;
                  const ResolvedRun run = resolve_run(m, h, spec_of(f), errs);
                  errs.throw_if_any();
                  const Plan plan = make_plan_resolved(m, h, run);  // no baseline summary: faster
                  const PlanSummary s = unfolded(plan);
                  Candidate c;
                  c.per_token = plan.time.step_seconds / (static_cast<double>(plan.run.global_batch) * static_cast<double>(plan.run.context_tokens));
                  c.gpu = s.gpu_peak_bytes;
                  c.host = s.host_peak_bytes;
                  c.key = {plan.run.cp, plan.run.micro_batch, moe ? cap : 0, R, tb, vb, n, p, bucket, depth};
                  bf.all.emplace_back(f, c);
                  bf.required.push_back(s.required_bytes);
                  bf.host.push_back(s.host_peak_bytes);
                }
  return bf;
}

void expect_search_is_optimal(const ModelSpec& m, HardwareSpec h, const Flags& base, const BruteForce& bf,
                              double gpu_quantile, double host_quantile, const std::string& what) {
  std::vector<int64_t> req = bf.required, host = bf.host;
  std::sort(req.begin(), req.end());
  std::sort(host.begin(), host.end());
  h.device_memory_bytes = req[static_cast<size_t>(gpu_quantile * static_cast<double>(req.size() - 1))];
  const int64_t host_budget = host[static_cast<size_t>(host_quantile * static_cast<double>(host.size() - 1))];
  // Host budget per node = floor(0.85 x host memory): pick the memory that gives exactly it or just above.
  h.host_memory_bytes_per_node = static_cast<int64_t>(std::ceil(static_cast<double>(host_budget) / kHostUsableFraction));
  const int64_t host_limit = static_cast<int64_t>(std::floor(kHostUsableFraction * static_cast<double>(h.host_memory_bytes_per_node)));
  const Candidate* best = nullptr;
  for (size_t i = 0; i < bf.all.size(); ++i) {
    if (bf.required[i] > h.device_memory_bytes || bf.host[i] > host_limit) continue;
    if (!best || bf.all[i].second < *best) best = &bf.all[i].second;
  }
  const SearchResult r = search_knobs(m, h, spec_of(base), Efficiency{});
  ASSERT_EQ(r.found, best != nullptr) << what;
  if (!best) return;
  const SearchChoice& c = r.choice;
  const std::vector<int64_t> key = {c.cp, c.micro_batch, m.num_experts > 0 ? c.chunk_cap_rows : 0, c.ring_size, c.token_block,
                                    c.vocab_block, c.sco_layers, c.sco_prefetch, c.bucket_params, c.bucket_depth};
  EXPECT_EQ(key, best->key) << what;
  EXPECT_EQ(r.time.step_seconds / (static_cast<double>(r.run.global_batch) * static_cast<double>(r.run.context_tokens)),
            best->per_token)
      << what;
  EXPECT_EQ(r.summary.gpu_peak_bytes, best->gpu) << what;
  EXPECT_EQ(r.summary.host_peak_bytes, best->host) << what;
}

TEST(PlannerKnobSearch, ChosenKnobsAreOptimalByBruteForce) {
  const Flags base{{"--gpus", "2"}, {"--context", "64"}, {"--schedule", "flatpeak"}, {"--llep-min-rows", "4"}};
  const HardwareSpec h = timed_gpu();  // budgets never bind while enumerating
  const BruteForce two = enumerate(tiny_moe(2), h, base);
  // Budgets from loose to tight, so that different knobs bind.
  for (double q : {0.9, 0.5, 0.2})
    expect_search_is_optimal(tiny_moe(2), h, base, two, q, 0.9, "gpu quantile " + std::to_string(q));
  expect_search_is_optimal(tiny_moe(2), h, base, two, 0.6, 0.3, "tight host");
  ModelSpec three = tiny_moe(3);
  three.layers[0].ffn = FfnKind::Dense;
  three.dense_ffn_width = 16;
  const Flags zipf{{"--gpus", "2"}, {"--context", "128"}, {"--schedule", "flatpeak"}, {"--llep-min-rows", "4"},
                   {"--imbalance", "zipf=1.5"}};
  const BruteForce b3 = enumerate(three, h, zipf);
  expect_search_is_optimal(three, h, zipf, b3, 0.4, 0.7, "three layers, zipf");
  expect_search_is_optimal(three, h, zipf, b3, 0.1, 0.9, "three layers, zipf, tight GPU");
}

TEST(PlannerKnobSearch, GivenKnobsAreKeptAndSearchedOnesSayWhy) {
  const RunSpec spec = spec_of({{"--gpus", "2"}, {"--context", "256"}, {"--schedule", "flatpeak"}, {"--ring-size", "2"},
                                {"--sco-prefetch", "3"}, {"--llep-min-rows", "4"}});
  const Plan p = make_searched_plan(tiny_moe(3), timed_gpu(), spec, Efficiency{});
  std::map<std::string, std::string> reasons;
  for (const Knob& k : p.run.knobs) reasons[k.name] = k.reason;
  EXPECT_EQ(p.run.ring_size, 2);
  EXPECT_EQ(reasons["ring_size"], "given");
  EXPECT_EQ(p.run.sco_prefetch, 3);
  EXPECT_EQ(reasons["sco_prefetch"], "given");
  for (const char* searched : {"chunk_cap_rows", "token_block", "vocab_block", "sco_layers", "bucket_params", "bucket_depth"})
    EXPECT_EQ(reasons[searched].rfind("searched: ", 0), 0u) << searched << ": " << reasons[searched];
}

// A bucket larger than the shard stages only the shard, one bucket: every depth then takes the
// same time and the least host memory (depth 1) wins. At 2^60 parameters, bucket · depth
// overflowed int64 and the tie went to depth 8 with eight times the host buffers.
TEST(PlannerKnobSearch, BucketBeyondTheShardTakesDepthOne) {
  const Flags base{{"--gpus", "2"}, {"--context", "64"}, {"--schedule", "flatpeak"}, {"--llep-min-rows", "4"}};
  for (const char* bucket : {"1152921504606846976", "4611686018427387904"}) {
    Flags f = base;
    f.push_back({"--bucket-params", bucket});
    const SearchResult r = search_knobs(tiny_moe(2), timed_gpu(), spec_of(f), Efficiency{});
    ASSERT_TRUE(r.found) << bucket;
    EXPECT_EQ(r.choice.bucket_depth, 1) << bucket;
    Flags one = base;
    const int64_t shard = make_searched_plan(tiny_moe(2), timed_gpu(), spec_of(f), Efficiency{}).work.shard_params;
    one.push_back({"--bucket-params", std::to_string(shard)});
    one.push_back({"--bucket-depth", "1"});
    const SearchResult s = search_knobs(tiny_moe(2), timed_gpu(), spec_of(one), Efficiency{});
    EXPECT_EQ(r.summary.host_peak_bytes, s.summary.host_peak_bytes) << bucket;
  }
}

TEST(PlannerKnobSearch, OutputIsByteIdenticalAcrossRuns) {
  const RunSpec spec = spec_of({{"--gpus", "4"}, {"--context", "1K"}, {"--schedule", "flatpeak"}, {"--cp", "auto"},
                                {"--global-batch", "8"}, {"--llep-min-rows", "4"}});
  const std::string a = plan_to_json(make_searched_plan(tiny_moe(3), timed_gpu(), spec, Efficiency{})).dump();
  const std::string b = plan_to_json(make_searched_plan(tiny_moe(3), timed_gpu(), spec, Efficiency{})).dump();
  EXPECT_EQ(a, b);
}

TEST(PlannerKnobSearch, NothingFitsSaysWhichPeakByHowMuchAndWhatWouldFit) {
  HardwareSpec h = timed_gpu();
  const Flags base{{"--gpus", "2"}, {"--context", "4K"}, {"--schedule", "flatpeak"}, {"--llep-min-rows", "4"}};
  // The least a GPU can need at CP = 2 (a budget nothing fits returns the most frugal knobs).
  h.device_memory_bytes = 1;
  Flags cp2 = base;
  cp2.push_back({"--cp", "2"});
  const SearchResult frugal = search_knobs(tiny_moe(2), h, spec_of(cp2), Efficiency{});
  ASSERT_FALSE(frugal.found);
  // A device that holds exactly that: CP = 1 does not fit, CP = 2 does.
  h.device_memory_bytes = frugal.summary.required_bytes;
  const Plan p = make_searched_plan(tiny_moe(2), h, spec_of(base), Efficiency{});
  EXPECT_FALSE(p.summary.gpu_fits);
  ASSERT_FALSE(p.diagnosis.is_null());
  const std::string peak = p.diagnosis["peak"];
  EXPECT_TRUE(peak == "dispatch" || peak == "vocab" || peak == "checkpoint" || peak == "optimizer" || peak == "layer") << peak;
  EXPECT_GT(p.diagnosis["over_bytes"].get<int64_t>(), 0);
  const std::string remedies = p.diagnosis["remedies"].dump();
  EXPECT_NE(remedies.find("context parallelism: it fits at CP = 2 (--cp auto)"), std::string::npos) << remedies;
  EXPECT_NE(remedies.find("out of scope: "), std::string::npos) << remedies;
  for (const Knob& k : p.run.knobs)
    if (k.name == "chunk_cap_rows") {
      EXPECT_EQ(k.reason, "nothing fits: part of the knob set with the lowest GPU peak (see diagnosis)");
    }
}

}  // namespace
}  // namespace flatpeak::planner::test
