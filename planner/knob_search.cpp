// Knob search over fixed grids. Per structure (CP, micro-batch): the knob groups act on separate
// time terms (dispatch: the cap; vocabulary: ring size and blocks; boundaries: SCO layers and
// prefetch; optimizer: bucket size and depth), and on the peaks through per-phase parts that
// FastPeaks keeps apart. For each (ring size, prefetch, n offloaded layers) the slack of every
// rule costs O(1) (envelopes built once in O(layers), knob_search_space.h); the fastest cap and
// blocks that fit follow from lists sorted by time. n starts at the fewest layers that fit
// (bisection: peaks fall with n) and grows while a larger n can still pay for its host-link time.
#include "knob_search.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <tuple>

#include <fmt/format.h>

#include "knob_search_space.h"
#include "spec/sizes.h"

namespace flatpeak::planner {

std::vector<int64_t> chunk_cap_grid(int64_t rows) {
  std::vector<int64_t> g;
  for (int64_t c = 64; c < rows; c *= 2) g.push_back(c);
  g.push_back(std::max<int64_t>(1, rows));
  return g;
}

std::vector<int64_t> token_block_grid(int64_t tokens) {
  std::vector<int64_t> g;
  for (int64_t b = 256; b < tokens && b <= 65536; b *= 2) g.push_back(b);
  if (tokens <= 65536 || g.empty()) g.push_back(std::max<int64_t>(1, std::min<int64_t>(tokens, 65536)));
  return g;
}

std::vector<int64_t> vocab_block_grid(int64_t shard) {
  std::vector<int64_t> g;
  for (int64_t d = 1; d <= 8; d *= 2) {
    const int64_t v = ceil_div(shard, d);
    if (v >= 1 && (g.empty() || v < g.back())) g.push_back(v);
  }
  std::reverse(g.begin(), g.end());
  return g;
}

std::vector<int64_t> bucket_grid(int64_t shard_params) {
  std::vector<int64_t> g;
  for (int64_t b = int64_t{16} << 20; b <= int64_t{1} << 30; b *= 2) {
    g.push_back(b);
    if (b >= shard_params) break;  // larger buckets behave as one bucket of the whole shard
  }
  return g;
}

std::vector<int64_t> ring_size_grid(int64_t gpus, int64_t gpus_per_node) {
  std::vector<int64_t> g;
  for (int64_t r = 1; r <= std::min(gpus, gpus_per_node); ++r)
    if (gpus % r == 0) g.push_back(r);
  return g;
}

namespace {

using namespace search_detail;

// ---- candidates over CP and micro-batch -----------------------------------------------------

std::vector<int64_t> cp_candidates(const RunSpec& spec) {
  if (!spec.cp_auto) return {spec.cp.value_or(1)};
  std::vector<int64_t> out;
  for (int64_t cp = 1; cp <= spec.gpus; cp *= 2)
    if (spec.gpus % cp == 0 && spec.context_tokens % cp == 0) out.push_back(cp);
  return out;
}

std::vector<int64_t> micro_batch_candidates(const RunSpec& spec, int64_t cp) {
  if (spec.micro_batch) return {*spec.micro_batch};
  if (!spec.global_batch) return {1};
  const int64_t dp = spec.gpus / cp;
  std::vector<int64_t> out;
  if (*spec.global_batch % dp != 0) return {1};
  const int64_t per = *spec.global_batch / dp;
  // b x S / CP must stay within 2^32 tokens per GPU (resolve_run's rule), so larger divisors
  // are not candidates; this also bounds the loop for a huge --global-batch. Beyond 2^24
  // sequences per micro-batch (only at contexts under 256 tokens) nothing more is tried.
  const int64_t context = std::max<int64_t>(1, spec.context_tokens);
  const int64_t b_max = std::min({per, std::max<int64_t>(1, (kMaxTokensPerGpu + 1) * cp / context), int64_t{1} << 24});
  for (int64_t b = 1; b <= b_max; ++b)
    if (per % b == 0) out.push_back(b);
  return out;
}

std::string gib(int64_t bytes) { return format_bytes(bytes); }

RunSpec apply(const RunSpec& spec, const SearchChoice& c, const Structure& s) {
  RunSpec out = spec;
  out.cp = c.cp;
  out.cp_auto = false;
  out.micro_batch = c.micro_batch;
  const ResolvedRun& r = s.run();
  if (s.cap_free()) out.chunk_cap_rows = c.chunk_cap_rows;
  if (r.vocab == VocabMode::RingDtp) {
    if (!spec.ring_size) out.ring_size = c.ring_size;
    if (!spec.token_block) out.token_block = c.token_block;
    if (!spec.vocab_block) out.vocab_block = c.vocab_block;
  }
  if (s.sco_free()) out.sco_layers = std::to_string(c.sco_layers);
  if (r.boundaries == BoundaryMode::Sco && !spec.sco_prefetch) out.sco_prefetch = c.sco_prefetch;
  if (s.bucket_free()) {
    if (!spec.bucket_params) out.bucket_params = c.bucket_params;
    if (!spec.bucket_depth) out.bucket_depth = c.bucket_depth;
  }
  return out;
}

// Why each searched knob has its value: the faster values of that knob alone (others fixed)
// that do not fit, or the time term it minimises.
std::vector<KnobReason> explain(Structure& s, const SearchChoice& best, const std::vector<int64_t>& cps,
                                const std::vector<int64_t>& bs, const RunSpec& spec) {
  std::vector<KnobReason> out;
  const auto base = s.evaluate(best);
  auto why = [&](const char* name, const nlohmann::ordered_json& value, const char* term,
                 const std::vector<std::pair<std::string, SearchChoice>>& alternatives) {
    std::string blocked, slower;
    double slower_delta = std::numeric_limits<double>::infinity();
    for (const auto& [label, alt] : alternatives) {
      const auto e = s.evaluate(alt);
      if (e.step == 0) continue;
      if (e.step < base.step && !(e.gpu_fits && e.host_fits)) {
        if (blocked.empty())
          blocked = !e.gpu_fits ? fmt::format("{} would be {:.3g} s faster but the GPU needs {} more", label, base.step - e.step,
                                              gib(s.peaks().required_bytes(e.gpu_peak) - s.peaks().device_budget_bytes()))
                                : fmt::format("{} would be {:.3g} s faster but the host needs {} more per node", label,
                                              base.step - e.step, gib(e.host_peak - s.peaks().host_budget_bytes()));
      } else if (e.step > base.step && e.step - base.step < slower_delta) {
        slower_delta = e.step - base.step;
        slower = fmt::format("{} adds {:.3g} s", label, slower_delta);
      } else if (e.step == base.step && e.gpu_fits && e.host_fits && slower.empty()) {
        slower = fmt::format("{} ties on step time with a higher peak", label);
      }
    }
    std::string reason;
    if (!blocked.empty()) reason = "binding: " + blocked;
    else reason = std::string("time: minimises ") + term + (slower.empty() ? "" : " (" + slower + ")");
    out.push_back(KnobReason{name, value, reason});
  };
  if (s.cap_free()) {
    std::vector<std::pair<std::string, SearchChoice>> alts;
    for (const auto& c : s.caps())
      if (c.cap != best.chunk_cap_rows) {
        SearchChoice a = best;
        a.chunk_cap_rows = c.cap;
        alts.emplace_back(fmt::format("cap {}", c.cap), a);
      }
    const CapCand* cc = s.find_cap(best.chunk_cap_rows);
    why("chunk_cap_rows", best.chunk_cap_rows, "expert GEMMs and the EP all-to-all", alts);
    if (cc && !cc->loads.empty()) out.back().reason += fmt::format("; {} rounds", cc->loads.front().rounds);
  }
  if (s.vocab_free()) {
    std::vector<std::pair<std::string, SearchChoice>> ring_alts, tb_alts, vb_alts;
    for (int64_t R : s.rings())
      if (R != best.ring_size) {
        for (const auto& v : s.vocab().at(R))
          if (v.tb == best.token_block) {
            SearchChoice a = best;
            a.ring_size = R;
            a.vocab_block = v.vb;
            ring_alts.emplace_back(fmt::format("ring size {}", R), a);
            break;
          }
      }
    for (const auto& v : s.vocab().at(best.ring_size)) {
      if (v.tb != best.token_block && v.vb == best.vocab_block) {
        SearchChoice a = best;
        a.token_block = v.tb;
        tb_alts.emplace_back(fmt::format("token block {}", v.tb), a);
      }
      if (v.vb != best.vocab_block && v.tb == best.token_block) {
        SearchChoice a = best;
        a.vocab_block = v.vb;
        vb_alts.emplace_back(fmt::format("vocab block {}", v.vb), a);
      }
    }
    if (s.rings().size() > 1) why("ring_size", best.ring_size, "Ring-DTP hops and the LM head's FSDP traffic", ring_alts);
    if (!spec.token_block) why("token_block", best.token_block, "logits block GEMMs and launches", tb_alts);
    if (!spec.vocab_block) why("vocab_block", best.vocab_block, "logits block GEMMs and launches", vb_alts);
  }
  if (s.sco_free()) {
    const int64_t fewest = s.fewest_layers(best);
    std::string reason;
    if (best.sco_layers == 0) reason = "the boundaries fit on the device: no host-link traffic";
    else if (best.sco_layers == fewest)
      reason = fmt::format("binding: checkpoint boundaries: the fewest first layers at which the GPU fits ({} would not)", best.sco_layers - 1);
    else
      reason = fmt::format("time: {} more layers than the fewest that fit ({}) let larger caps or blocks run faster",
                           best.sco_layers - fewest, fewest);
    out.push_back(KnobReason{"sco_layers", std::to_string(best.sco_layers), reason});
  }
  if (s.run().boundaries == BoundaryMode::Sco && !spec.sco_prefetch) {
    std::vector<std::pair<std::string, SearchChoice>> alts;
    for (int64_t p : s.prefetches())
      if (p != best.sco_prefetch) {
        SearchChoice a = best;
        a.sco_prefetch = p;
        alts.emplace_back(fmt::format("prefetch {}", p), a);
      }
    why("sco_prefetch", best.sco_prefetch, "host-link waits in backward", alts);
  }
  if (s.bucket_free()) {
    std::vector<std::pair<std::string, SearchChoice>> size_alts, depth_alts;
    for (const auto& b : s.buckets()) {
      if (b.depth == best.bucket_depth && b.bucket != best.bucket_params) {
        SearchChoice a = best;
        a.bucket_params = b.bucket;
        size_alts.emplace_back(fmt::format("{} params per bucket", format_tokens(b.bucket)), a);
      }
      if (b.bucket == best.bucket_params && b.depth != best.bucket_depth) {
        SearchChoice a = best;
        a.bucket_depth = b.depth;
        depth_alts.emplace_back(fmt::format("depth {}", b.depth), a);
      }
    }
    if (!spec.bucket_params) why("bucket_params", best.bucket_params, "the optimizer step's exposed time", size_alts);
    if (!spec.bucket_depth) why("bucket_depth", best.bucket_depth, "the optimizer step's exposed time", depth_alts);
  }
  if (spec.cp_auto)
    out.push_back(KnobReason{"cp", best.cp, fmt::format("the least time per token of the CPs that fit ({{{}}} tried)",
                                                        fmt::join(cps, ", "))});
  if (!spec.micro_batch && spec.global_batch)
    out.push_back(KnobReason{"micro_batch", best.micro_batch,
                             fmt::format("the least time per token of the micro-batches that fit at global batch {} ({{{}}} tried)",
                                         spec.global_batch.value_or(0), fmt::join(bs, ", "))});
  return out;
}

}  // namespace

Diagnosis diagnose(const ModelSpec& model, const HardwareSpec& hardware, const RunSpec& spec, const Efficiency& efficiency,
                   LoadCache& cache, const SearchResult& failed, const FastPeaks& peaks);

std::vector<std::string> searchable_knobs(const ModelSpec& model, const RunSpec& spec) {
  std::vector<std::string> out;
  const bool moe = model.num_experts > 0 && model.count_layers(FfnKind::Moe) > 0;
  const bool flat = spec.schedule == Schedule::Flatpeak;
  if (spec.cp_auto) out.push_back("cp");
  if (!spec.micro_batch && spec.global_batch) out.push_back("micro_batch");
  if (moe && spec.llep.value_or(flat) && !spec.chunk_cap_rows) out.push_back("chunk_cap_rows");
  if (spec.ring_dtp.value_or(flat)) {
    if (!spec.ring_size && spec.vocab_backward != VocabBackward::InForward) out.push_back("ring_size");
    if (!spec.token_block) out.push_back("token_block");
    if (!spec.vocab_block) out.push_back("vocab_block");
  }
  if (spec.sco.value_or(flat)) {
    if (!spec.sco_layers || *spec.sco_layers == "auto") out.push_back("sco_layers");
    if (!spec.sco_prefetch) out.push_back("sco_prefetch");
  }
  if (spec.optimizer.value_or(flat ? OptimizerPlacement::Stream : OptimizerPlacement::Gpu) == OptimizerPlacement::Stream) {
    if (!spec.bucket_params) out.push_back("bucket_params");
    if (!spec.bucket_depth) out.push_back("bucket_depth");
  }
  return out;
}

SearchResult search_knobs(const ModelSpec& model, const HardwareSpec& hardware, const RunSpec& spec,
                          const Efficiency& efficiency, LoadCache* cache, const SearchOptions& options) {
  LoadCache local;
  LoadCache& loads = cache ? *cache : local;
  SearchResult result;
  if (searchable_knobs(model, spec).empty()) {
    // Nothing to search: the plan at its knobs, without the search's structures.
    InputErrors errs;
    ResolvedRun run = resolve_run(model, hardware, spec, errs);
    errs.throw_if_any();
    const Workload work = fast_workload(model, run, loads);
    const FastPeaks fp(model, hardware, run, work);
    result.summary = fp.evaluate(fp.knobs_of(run, work));
    result.found = result.summary.fits();
    result.time = TimeModel(model, hardware, run, work, efficiency).full(run, work);
    result.spec = spec;
    result.choice.cp = run.cp;
    result.choice.micro_batch = run.micro_batch;
    result.choice.chunk_cap_rows = run.chunk_cap_rows;
    result.choice.ring_size = run.ring_size;
    result.choice.ring_rotate = run.ring_rotate;
    result.choice.token_block = run.token_block;
    result.choice.vocab_block = run.vocab_block;
    result.choice.sco_prefetch = run.sco_prefetch;
    result.choice.bucket_params = run.bucket_params;
    result.choice.bucket_depth = run.bucket_depth;
    result.candidates = 1;
    if (options.explain && !result.found) result.diagnosis = diagnose(model, hardware, spec, efficiency, loads, result, fp);
    result.run = std::move(run);  // after the diagnosis: fp refers to it
    return result;
  }
  const std::vector<int64_t> cps = cp_candidates(spec);
  Best best;
  std::unique_ptr<Structure> best_structure;
  std::vector<int64_t> best_bs;
  // The most memory-frugal structure, for plans that fit nowhere.
  std::unique_ptr<Structure> frugal_structure;
  SearchChoice frugal_choice;
  int64_t frugal_required = std::numeric_limits<int64_t>::max();
  bool resolved_any = false;
  for (int64_t cp : cps) {
    if (options.first_fit && best.any) break;
    const std::vector<int64_t> bs = micro_batch_candidates(spec, cp);
    for (int64_t b : bs) {
      RunSpec s = spec;
      s.cp_auto = false;
      s.cp = cp;
      s.micro_batch = b;
      InputErrors errs;
      const ResolvedRun run = resolve_run(model, hardware, s, errs, spec.cp_auto ? std::optional<int64_t>(cp) : std::nullopt);
      if (!errs.empty()) {
        if (!resolved_any && cp == cps.back() && b == bs.back()) errs.throw_if_any();
        continue;
      }
      resolved_any = true;
      auto st = std::make_unique<Structure>(model, hardware, spec, run, efficiency, loads);
      Best here = st->search(options.first_fit);
      result.candidates += st->evaluated();
      if (here.any && here.better_than(best)) {
        best = here;
        best_structure = std::move(st);
        best_bs = bs;
        if (options.first_fit) break;
        continue;
      }
      if (!best.any) {
        const SearchChoice f = st->frugal();
        const auto e = st->evaluate(f);
        const int64_t required = st->peaks().required_bytes(e.gpu_peak);
        if (required < frugal_required) {
          frugal_required = required;
          frugal_choice = f;
          frugal_structure = std::move(st);
        }
      }
    }
  }
  if (!resolved_any) {
    InputErrors errs;
    resolve_run(model, hardware, spec, errs, spec.cp_auto ? std::optional<int64_t>(1) : std::nullopt);
    errs.throw_if_any();
  }
  Structure* chosen = best.any ? best_structure.get() : frugal_structure.get();
  if (!chosen) return result;
  result.found = best.any;
  result.choice = best.any ? best.c : frugal_choice;
  if (!best.any && !options.first_fit && chosen->evaluate(frugal_choice).gpu_fits) {
    // Only the host does not fit: show the fastest knobs that fit the GPU.
    const Best gpu_only = chosen->search_gpu_only();
    if (gpu_only.any) result.choice = gpu_only.c;
  }
  result.spec = apply(spec, result.choice, *chosen);
  result.run = chosen->run();
  if (options.first_fit && result.found) return result;  // a yes/no question: no peaks or time
  // Peaks and time at the choice, from the real rules (FastPeaks evaluate, TimeModel).
  PeakKnobs k = chosen->peaks().knobs_of(chosen->run(), chosen->work());
  if (const CapCand* c = chosen->find_cap(result.choice.chunk_cap_rows)) k.loads = c->loads;
  k.ring_size = result.choice.ring_size;
  k.ring_rotate = result.choice.ring_rotate;
  k.token_block = result.choice.token_block;
  k.vocab_block = result.choice.vocab_block;
  k.sco_first = result.choice.sco_layers;
  k.sco_prefetch = result.choice.sco_prefetch;
  k.bucket_params = result.choice.bucket_params;
  k.bucket_depth = result.choice.bucket_depth;
  result.summary = chosen->peaks().evaluate(k);
  {
    ResolvedRun r = chosen->run();
    Workload w = chosen->work();
    w.moe_loads = k.loads;
    r.chunk_cap_rows = result.choice.chunk_cap_rows;
    if (r.vocab == VocabMode::RingDtp) r.ring_size = result.choice.ring_size;
    r.ring_rotate = result.choice.ring_rotate;
    r.token_block = result.choice.token_block;
    r.vocab_block = result.choice.vocab_block;
    if (result.choice.sco_layers >= 0) {
      r.sco_offloaded.assign(static_cast<size_t>(model.num_layers), false);
      for (int64_t i = 0; i < std::min(result.choice.sco_layers, model.num_layers); ++i) r.sco_offloaded[static_cast<size_t>(i)] = true;
    }
    r.sco_prefetch = result.choice.sco_prefetch;
    r.bucket_params = result.choice.bucket_params;
    r.bucket_depth = result.choice.bucket_depth;
    result.time = chosen->time_model().full(r, w);
  }
  if (options.explain && best.any) result.reasons = explain(*chosen, best.c, cps, best_bs, spec);
  if (options.explain && !best.any) result.diagnosis = diagnose(model, hardware, spec, efficiency, loads, result, chosen->peaks());
  return result;
}

namespace {

std::string gpus_text(int64_t n) { return n == 1 ? "1 GPU" : std::to_string(n) + " GPUs"; }

}  // namespace

Diagnosis diagnose(const ModelSpec& model, const HardwareSpec& hardware, const RunSpec& spec, const Efficiency& efficiency,
                   LoadCache& cache, const SearchResult& failed, const FastPeaks& peaks) {
  Diagnosis d;
  const FastSummary& fs = failed.summary;
  SearchOptions quiet;
  quiet.explain = false;
  quiet.first_fit = true;
  auto fits = [&](const RunSpec& s) {
    try {
      return search_knobs(model, hardware, s, efficiency, &cache, quiet);
    } catch (const InputError&) {
      return SearchResult{};
    }
  };
  if (!fs.gpu_fits) {
    d.peak = to_string(fs.binding);
    d.over_bytes = fs.required_bytes - peaks.device_budget_bytes();
    d.at = "the knobs with the lowest GPU peak";
  } else {
    d.peak = "host";
    d.over_bytes = fs.host_peak_bytes - peaks.host_budget_bytes();
    d.at = "the fastest knobs that fit the GPU";
  }
  // More GPUs: shards (and the host's optimizer state per GPU) shrink. Fitting only gets easier
  // with N: bisect over N = 2N .. 64N (powers of two).
  auto fits_on = [&](int64_t n) {
    RunSpec s = spec;
    s.gpus = n;
    s.global_batch.reset();
    s.ep.reset();
    return fits(s).found;
  };
  if (!fits_on(spec.gpus * 64)) {
    d.remedies.push_back(fmt::format("more GPUs alone do not make it fit (tried up to {})", gpus_text(spec.gpus * 64)));
  } else {
    int64_t lo = 1, hi = 6;  // exponents: 2^hi fits
    while (lo < hi) {
      const int64_t mid = (lo + hi) / 2;
      if (fits_on(spec.gpus << mid)) hi = mid;
      else lo = mid + 1;
    }
    d.remedies.push_back(fmt::format("more GPUs: it fits on {} at the same CP", gpus_text(spec.gpus << lo)));
  }
  // Context parallelism: fewer tokens per GPU.
  if (!spec.cp_auto) {
    RunSpec s = spec;
    s.cp.reset();
    s.cp_auto = true;
    s.global_batch.reset();
    const SearchResult r = fits(s);
    if (r.found) d.remedies.push_back(fmt::format("context parallelism: it fits at CP = {} (--cp auto)", r.choice.cp));
    else d.remedies.push_back("context parallelism alone does not make it fit (--cp auto tried every power of two dividing N)");
  }
  // Host memory: what the host would need if the GPU can fit with more boundaries offloaded
  // (the fastest knobs then; they offload the fewest layers that fit).
  {
    RunSpec s = spec;
    s.host_memory_bytes_per_node = int64_t{1} << 60;
    SearchResult r;
    try {
      r = search_knobs(model, hardware, s, efficiency, &cache, SearchOptions{false, false});
    } catch (const InputError&) {
    }
    if (r.found) {
      const auto needed = static_cast<int64_t>(std::ceil(static_cast<double>(r.summary.host_peak_bytes) / kHostUsableFraction));
      d.remedies.push_back(fmt::format("host memory: it fits with {} of host DRAM per node (--host-memory; {} of it usable)",
                                       format_bytes(needed), format_bytes(r.summary.host_peak_bytes)));
    }
  }
  // What is out of scope here.
  if (d.peak == "layer")
    d.remedies.push_back("out of scope: tiling inside a layer or tensor parallelism would bound the layer working set, "
                         "which only CP bounds here");
  else if (d.peak == "optimizer")
    d.remedies.push_back("out of scope: pipeline or tensor parallelism would shrink the per-GPU model state");
  else if (d.peak == "dispatch")
    d.remedies.push_back("out of scope: expert-tensor parallelism would split the expert activations");
  else if (d.peak == "vocab" || d.peak == "checkpoint")
    d.remedies.push_back("out of scope: tensor or pipeline parallelism would split the remaining tensors");
  return d;
}


nlohmann::ordered_json diagnosis_to_json(const Diagnosis& d) {
  nlohmann::ordered_json j;
  j["peak"] = d.peak;
  j["over_bytes"] = d.over_bytes;
  j["at"] = d.at;
  j["remedies"] = d.remedies;
  return j;
}

Plan make_searched_plan(const ModelSpec& model, const HardwareSpec& hardware, const RunSpec& spec,
                        const Efficiency& efficiency) {
  if (searchable_knobs(model, spec).empty()) {
    Plan p = make_plan(model, hardware, spec);
    p.time = estimate_step_time(p.model, p.hardware, p.run, p.work, efficiency);
    return p;
  }
  const SearchResult r = search_knobs(model, hardware, spec, efficiency);
  Plan p = make_plan(model, hardware, r.spec);
  p.run.cp_auto = spec.cp_auto;
  p.time = estimate_step_time(p.model, p.hardware, p.run, p.work, efficiency);
  const std::vector<std::string> searched = searchable_knobs(model, spec);
  const std::string frugal = r.summary.gpu_fits
                                 ? "nothing fits (the host does not): part of the fastest knob set that fits the GPU (see diagnosis)"
                                 : "nothing fits: part of the knob set with the lowest GPU peak (see diagnosis)";
  for (const std::string& name : searched) {
    std::string reason = frugal;
    for (const KnobReason& k : r.reasons)
      if (k.name == name) reason = "searched: " + k.reason;
    bool found = false;
    for (Knob& knob : p.run.knobs)
      if (knob.name == name) {
        knob.reason = reason;
        found = true;
      }
    if (!found && (name == "cp" || name == "micro_batch"))
      p.run.knobs.push_back(Knob{name, name == "cp" ? p.run.cp : p.run.micro_batch, reason});
  }
  if (r.diagnosis) p.diagnosis = diagnosis_to_json(*r.diagnosis);
  return p;
}

}  // namespace flatpeak::planner
