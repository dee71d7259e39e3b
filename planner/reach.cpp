// reach, reach --target-context, and compare: knob searches at many contexts, cluster sizes and
// technique sets, sharing one LoadCache (expected loads and LLA per tokens per GPU).
#include "reach.h"

#include <algorithm>
#include <map>

namespace flatpeak::planner {

std::string ScheduleRun::binding() const {
  if (!search.summary.gpu_fits) return to_string(search.summary.binding);
  if (!search.summary.host_fits) return "host";
  return to_string(search.summary.binding);
}

namespace {

SearchResult try_search(const ModelSpec& model, const HardwareSpec& hardware, const RunSpec& spec, const Efficiency& eff,
                        LoadCache& cache, bool first_fit) {
  try {
    return search_knobs(model, hardware, spec, eff, &cache, SearchOptions{false, first_fit});
  } catch (const InputError&) {
    return SearchResult{};  // e.g. tokens per GPU beyond 2^32: treated as not fitting
  }
}

bool faster(const SearchResult& a, const SearchResult& b) {
  return a.time.tokens_per_second > b.time.tokens_per_second;
}

std::vector<int64_t> allowed_cps(const RunSpec& base, int64_t gpus) {
  if (!base.cp_auto) return {base.cp.value_or(1)};
  std::vector<int64_t> out;
  for (int64_t cp = 1; cp <= gpus; cp *= 2)
    if (gpus % cp == 0) out.push_back(cp);
  return out;
}

RunSpec at(const RunSpec& base, Schedule schedule, int64_t context, int64_t cp) {
  RunSpec s = base;
  s.schedule = schedule;
  s.context_tokens = context;
  s.cp_auto = false;
  s.cp = cp;
  return s;
}

}  // namespace

ScheduleRun run_schedule(const ModelSpec& model, const HardwareSpec& hardware, const RunSpec& spec, const Efficiency& eff,
                         LoadCache& cache, bool tuned_baseline, bool first_fit) {
  ScheduleRun out;
  out.name = to_string(spec.schedule);
  // The tuned baseline (DESIGN.md) and practice, which builds on it: the better optimizer placement.
  if (tuned_baseline && spec.schedule != Schedule::Flatpeak && !spec.optimizer) {
    RunSpec gpu = spec, serial = spec;
    gpu.optimizer = OptimizerPlacement::Gpu;
    serial.optimizer = OptimizerPlacement::Serial;
    SearchResult g = try_search(model, hardware, gpu, eff, cache, first_fit);
    if (first_fit && g.found) {
      out.search = std::move(g);
      out.fits = true;
      return out;
    }
    SearchResult s = try_search(model, hardware, serial, eff, cache, first_fit);
    // Neither fits: the one that fits the GPU (its binding is then the host), else the GPU's,
    // unless the GPU placement runs out on the optimizer (its model state alone overflows) and
    // serial offload does not: then serial gets further and its binding is what stops the tuned
    // baseline.
    const bool take_serial = (s.found && !g.found) || (s.found && g.found && faster(s, g)) ||
                             (!s.found && !g.found && s.summary.gpu_fits && !g.summary.gpu_fits) ||
                             (!s.found && !g.found && !s.summary.gpu_fits && !g.summary.gpu_fits &&
                              g.summary.binding == PeakKind::Optimizer && s.summary.binding != PeakKind::Optimizer);
    out.search = take_serial ? std::move(s) : std::move(g);
    out.optimizer = take_serial ? OptimizerPlacement::Serial : OptimizerPlacement::Gpu;
  } else {
    out.search = try_search(model, hardware, spec, eff, cache, first_fit);
    out.optimizer = out.search.run.optimizer;
  }
  out.fits = out.search.found;
  return out;
}

namespace {

// Fits at (S, CP) for one schedule, memoised.
class Fitter {
 public:
  Fitter(const ModelSpec& model, const HardwareSpec& hardware, const Query& q, Schedule schedule, LoadCache& cache)
      : model_(model), hw_(hardware), q_(q), schedule_(schedule), cache_(cache) {}

  // The schedule's best knobs at (S, CP).
  const ScheduleRun& run(int64_t context, int64_t cp) {
    auto it = memo_.find({context, cp});
    if (it != memo_.end()) return it->second;
    ScheduleRun r;
    if (context % cp == 0) r = run_schedule(model_, hw_, at(q_.base, schedule_, context, cp), q_.efficiency, cache_, true);
    else r.name = to_string(schedule_);
    return memo_.emplace(std::make_pair(context, cp), std::move(r)).first->second;
  }
  // Whether some knob set fits at (S, CP): the search stops at the first.
  bool fits(int64_t context, int64_t cp) {
    auto it = fits_.find({context, cp});
    if (it != fits_.end()) return it->second;
    bool f = false;
    if (context % cp == 0)
      f = run_schedule(model_, hw_, at(q_.base, schedule_, context, cp), q_.efficiency, cache_, true, true).fits;
    return fits_.emplace(std::make_pair(context, cp), f).first->second;
  }

  // Largest multiple of `step` in [from, limit] that fits at `cp`, given that `from` fits.
  int64_t bisect(int64_t from, int64_t cp, int64_t step, bool& at_limit) {
    int64_t lo = from, hi = 0;
    for (int64_t s = from * 2; s <= q_.limit_tokens; s *= 2) {
      if (!fits(s, cp)) {
        hi = s;
        break;
      }
      lo = s;
    }
    if (hi == 0) {
      if (lo < q_.limit_tokens && fits(q_.limit_tokens, cp)) lo = q_.limit_tokens;
      if (lo == q_.limit_tokens) {
        at_limit = true;
        return lo;
      }
      hi = q_.limit_tokens + step;
    }
    while (hi - lo > step) {
      const int64_t mid = lo + (hi - lo) / (2 * step) * step;
      if (mid <= lo) break;
      if (fits(mid, cp)) lo = mid;
      else hi = mid;
    }
    return lo;
  }

 private:
  const ModelSpec& model_;
  const HardwareSpec& hw_;
  const Query& q_;
  Schedule schedule_;
  LoadCache& cache_;
  std::map<std::pair<int64_t, int64_t>, ScheduleRun> memo_;
  std::map<std::pair<int64_t, int64_t>, bool> fits_;
};

}  // namespace

std::vector<Reach> reach(const ModelSpec& model, const HardwareSpec& hardware, const Query& query) {
  LoadCache cache;
  std::vector<Reach> out;
  std::vector<int64_t> cps = allowed_cps(query.base, query.base.gpus);
  std::sort(cps.rbegin(), cps.rend());  // the largest CP reaches furthest: bisect it first
  for (Schedule schedule : {Schedule::Baseline, Schedule::Practice, Schedule::Flatpeak}) {
    Fitter f(model, hardware, query, schedule, cache);
    Reach r;
    r.schedule = to_string(schedule);
    int64_t best = 0, best_cp = 0, reach_cp = 0;
    for (int64_t cp : cps) {
      const int64_t step = std::max<int64_t>(1024, cp);
      if (best > 0) {
        // A smaller CP: does it still fit the best context, and beyond?
        if (best % cp != 0 || !f.fits(best, cp)) continue;
        best_cp = cp;
        if (best + step > query.limit_tokens || !f.fits(best + step, cp)) continue;
        bool at_limit = false;
        best = f.bisect(best + step, cp, step, at_limit);
        r.at_limit = r.at_limit || at_limit;
        best_cp = reach_cp = cp;
        continue;
      }
      if (!f.fits(step, cp)) continue;
      bool at_limit = false;
      best = f.bisect(step, cp, step, at_limit);
      r.at_limit = at_limit;
      best_cp = reach_cp = cp;
    }
    r.max_context_tokens = best;
    r.cp = best_cp;
    if (best > 0) {
      int64_t p2 = 1;
      while (p2 * 2 <= best) p2 *= 2;
      r.max_power_of_two_tokens = p2;
      r.at_max = f.run(best, best_cp);
      if (r.at_limit) {
        r.binding = "limit";
      } else {
        const int64_t next = best + std::max<int64_t>(1024, reach_cp);
        r.binding = f.run(next, reach_cp).binding();
      }
    } else {
      const int64_t cp = cps.back();  // the smallest allowed CP, at the smallest context
      r.at_max = f.run(std::max<int64_t>(1024, cp), cp);
      r.binding = r.at_max.binding();
    }
    out.push_back(std::move(r));
  }
  return out;
}

std::vector<TargetFit> reach_target(const ModelSpec& model, const HardwareSpec& hardware, const Query& query,
                                    int64_t context_tokens, int64_t max_gpus) {
  LoadCache cache;
  std::vector<TargetFit> out;
  for (Schedule schedule : {Schedule::Baseline, Schedule::Practice, Schedule::Flatpeak}) {
    TargetFit t;
    t.schedule = to_string(schedule);
    // Fits at N: the smallest allowed CP that fits (none: 0).
    std::map<int64_t, std::pair<int64_t, ScheduleRun>> memo;
    auto fit = [&](int64_t n) -> const std::pair<int64_t, ScheduleRun>& {
      auto it = memo.find(n);
      if (it != memo.end()) return it->second;
      RunSpec base = query.base;
      base.gpus = n;
      base.global_batch.reset();
      std::pair<int64_t, ScheduleRun> result{0, ScheduleRun{}};
      for (int64_t cp : allowed_cps(query.base, n)) {
        if (n % cp != 0 || context_tokens % cp != 0) continue;
        ScheduleRun r = run_schedule(model, hardware, at(base, schedule, context_tokens, cp), query.efficiency, cache, true, true);
        if (r.fits) {
          result = {cp, std::move(r)};
          break;
        }
        result.second = std::move(r);
      }
      return memo.emplace(n, std::move(result)).first->second;
    };
    // The N (powers of two up to max_gpus) at which the flags resolve for some allowed CP: EP, CP,
    // the routing model and the tokens per GPU depend on N. The others are skipped rather than
    // taken for "does not fit" (a routing file for EP = 2 resolves at N = 2 only; the bisection
    // started at 65536 and answered that nothing fits); when none resolves, that is the user's
    // error, reported at the largest N.
    std::vector<int64_t> valid;
    std::vector<Diagnostic> largest_errors;
    for (int64_t n = 1; n <= max_gpus; n *= 2) {
      RunSpec base = query.base;
      base.gpus = n;
      base.global_batch.reset();
      std::vector<Diagnostic> errors;
      bool resolves = false;
      for (int64_t cp : allowed_cps(query.base, n)) {
        InputErrors e;
        resolve_run(model, hardware, at(base, schedule, context_tokens, cp), e);
        if (e.empty()) {
          resolves = true;
          break;
        }
        if (errors.empty()) errors = e.diagnostics();
      }
      if (resolves) valid.push_back(n);
      else largest_errors = errors;
      if (n > max_gpus / 2) break;
    }
    if (valid.empty()) {
      if (largest_errors.empty()) largest_errors.push_back(Diagnostic{"", "--max-gpus", "leaves no GPU count to try", ""});
      throw InputError(largest_errors);
    }
    size_t lo = 0, hi = valid.size() - 1;  // indices into valid: valid[hi] fits, valid[lo - 1] does not
    if (fit(valid[hi]).first > 0) {
      while (lo < hi) {
        const size_t mid = (lo + hi) / 2;
        if (fit(valid[mid]).first > 0) hi = mid;
        else lo = mid + 1;
      }
      const auto& best = fit(valid[lo]);
      t.gpus = valid[lo];
      t.cp = best.first;
      // The answer with the best knobs at that N and CP.
      RunSpec base = query.base;
      base.gpus = t.gpus;
      base.global_batch.reset();
      t.at = run_schedule(model, hardware, at(base, schedule, context_tokens, t.cp), query.efficiency, cache, true);
    } else {
      t.at = fit(valid[hi]).second;
    }
    out.push_back(std::move(t));
  }
  return out;
}

namespace {

Comparison compare_at(const ModelSpec& model, const HardwareSpec& hardware, const Query& query, int64_t context,
                      LoadCache& cache) {
  Comparison c;
  RunSpec base = query.base;
  base.context_tokens = context;
  if (!base.global_batch) base.global_batch = 8 * (base.cp_auto ? base.gpus : base.gpus / base.cp.value_or(1));
  c.global_batch = *base.global_batch;
  c.imbalance = base.imbalance.value_or("balanced");
  const bool moe = model.num_experts > 0 && model.count_layers(FfnKind::Moe) > 0;
  auto run = [&](RunSpec s, const std::string& name, bool tuned) {
    ScheduleRun r = run_schedule(model, hardware, s, query.efficiency, cache, tuned);
    r.name = name;
    return r;
  };
  for (Schedule sch : {Schedule::Baseline, Schedule::Practice, Schedule::Flatpeak}) {
    RunSpec s = base;
    s.schedule = sch;
    c.schedules.push_back(run(s, to_string(sch), true));
  }
  const OptimizerPlacement tuned = c.schedules[0].optimizer;
  struct Technique {
    const char* name;
    bool dispatch;
  };
  const Technique techniques[] = {{"pipelined_llep", true}, {"ring_dtp", false}, {"sco", false}, {"offload_stream_adamw", false}};
  for (const Technique& t : techniques) {
    if (t.dispatch && !moe) continue;
    const std::string name = t.name;
    // Baseline + this technique alone (the tuned baseline's optimizer placement otherwise).
    RunSpec alone = base;
    alone.schedule = Schedule::Baseline;
    alone.optimizer = tuned;
    if (name == "pipelined_llep") alone.llep = true;
    if (name == "ring_dtp") alone.ring_dtp = true;
    if (name == "sco") alone.sco = true;
    if (name == "offload_stream_adamw") alone.optimizer = OptimizerPlacement::Stream;
    c.alone.push_back(TechniqueSet{name, run(alone, name, false)});
    // Flatpeak without it (the optimizer back to the better of GPU and serial offload).
    RunSpec without = base;
    without.schedule = Schedule::Flatpeak;
    bool tune = false;
    if (name == "pipelined_llep") without.llep = false;
    if (name == "ring_dtp") without.ring_dtp = false;
    if (name == "sco") without.sco = false;
    if (name == "offload_stream_adamw") {
      without.optimizer = OptimizerPlacement::Gpu;
      ScheduleRun g = run(without, name, false);
      without.optimizer = OptimizerPlacement::Serial;
      ScheduleRun s = run(without, name, false);
      const bool take_serial = (s.fits && !g.fits) || (s.fits && g.fits && faster(s.search, g.search));
      c.all_but_one.push_back(TechniqueSet{name, take_serial ? std::move(s) : std::move(g)});
      continue;
    }
    c.all_but_one.push_back(TechniqueSet{name, run(without, name, tune)});
  }
  return c;
}

}  // namespace

Comparison compare(const ModelSpec& model, const HardwareSpec& hardware, const Query& query, int64_t context_tokens) {
  LoadCache cache;
  return compare_at(model, hardware, query, context_tokens, cache);
}

nlohmann::ordered_json schedule_run_json(const ScheduleRun& run, const ModelSpec& model) {
  using ojson = nlohmann::ordered_json;
  const SearchResult& r = run.search;
  const FastSummary& s = r.summary;
  ojson j;
  j["fits"] = run.fits;
  j["gpu_fits"] = s.gpu_fits;
  j["host_fits"] = s.host_fits;
  j["binding"] = run.binding();
  j["optimizer"] = to_string(run.optimizer);
  j["cp"] = r.choice.cp;
  j["micro_batch"] = r.choice.micro_batch;
  j["accumulation_steps"] = r.time.micro_batches;
  j["step_seconds"] = round_significant(r.time.step_seconds, 6);
  j["tokens_per_second"] = round_significant(r.time.tokens_per_second, 6);
  j["mfu"] = round_significant(r.time.mfu, 6);
  j["bound_by"] = r.time.bound_by;
  ojson peaks;
  for (int k = 0; k < kPeakCount; ++k) {
    const auto ku = static_cast<size_t>(k);
    peaks[to_string(static_cast<PeakKind>(k))] = ojson{{"bytes", s.peak_bytes[ku]}, {"component_bytes", s.component_bytes[ku]}};
  }
  j["peaks"] = std::move(peaks);
  j["gpu"] = ojson{{"peak_bytes", s.gpu_peak_bytes}, {"required_bytes", s.required_bytes}, {"budget_bytes", s.budget_bytes},
                   {"fits", s.gpu_fits}, {"binding", to_string(s.binding)}};
  j["host"] = ojson{{"peak_bytes", s.host_peak_bytes}, {"budget_bytes", s.host_budget_bytes}, {"fits", s.host_fits}};
  ojson knobs = ojson::object();
  const ResolvedRun& rr = r.run;
  const SearchChoice& c = r.choice;
  const bool moe = model.num_experts > 0 && model.count_layers(FfnKind::Moe) > 0;
  if (moe && rr.llep) knobs["chunk_cap_rows"] = c.chunk_cap_rows;
  if (rr.vocab == VocabMode::RingDtp) {
    knobs["ring_size"] = c.ring_size;
    knobs["token_block"] = c.token_block;
    knobs["vocab_block"] = c.vocab_block;
  }
  if (rr.boundaries == BoundaryMode::Sco) {
    knobs["sco_layers"] = c.sco_layers >= 0 ? std::to_string(c.sco_layers) : rr.sco_layers_text;
    knobs["sco_prefetch"] = c.sco_prefetch;
  }
  if (rr.optimizer == OptimizerPlacement::Stream) {
    knobs["bucket_params"] = c.bucket_params;
    knobs["bucket_depth"] = c.bucket_depth;
  }
  j["knobs"] = std::move(knobs);
  return j;
}

}  // namespace flatpeak::planner
