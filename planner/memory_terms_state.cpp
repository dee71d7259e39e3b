// Model state (parameter, gradient and optimizer shards), FSDP transients, checkpoint boundaries,
// host memory and the optimizer step. Shard symbol P/N: this GPU's share of every FSDP unit
// (dense parts over N, local experts over N/EP).
#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "memory_model.h"

namespace flatpeak::planner {

namespace {
bool offload_optimizer(const Context& c) { return c.run.optimizer != OptimizerPlacement::Gpu; }

// The grad shards `params` stands for: one tensor per unit, each aligned.
void add_grad_shards(const Context& c, int64_t params, const Dtype& dtype, TermList& t) {
  const int64_t bytes = reduced_grad_bytes(c.work, c.run.mtp ? c.model.mtp_layers : 0, params, dtype.bytes, t.alignment_bytes());
  t.add_sized("grad shards", "[P/N=" + std::to_string(params) + "] " + dtype.name + ", one per reduced unit", bytes, Category::Grads);
}
}  // namespace

int64_t reduced_grad_bytes(const Workload& w, int64_t mtp_modules, int64_t params, int64_t bytes_per_param, int64_t alignment) {
  const int64_t L = static_cast<int64_t>(w.moe_index.size()) - mtp_modules;
  // Units in the order backward reduces them: with MTP the head first (after the last module's
  // loss; the later losses' grads are reduced into the same shard), then the modules from the last.
  std::vector<int64_t> order;
  if (mtp_modules > 0) order.push_back(w.head_unit);
  for (int64_t j = L + mtp_modules - 1; j >= L; --j) order.push_back(w.layer_unit(j));
  if (mtp_modules == 0) order.push_back(w.head_unit);
  for (int64_t l = L - 1; l >= 0; --l) order.push_back(w.layer_unit(l));
  order.push_back(0);
  int64_t sum = 0, bytes = 0;
  for (int64_t u : order) {
    if (sum == params) return bytes;
    const int64_t shard = w.units[static_cast<size_t>(u)].shard_params;
    sum = checked_add(sum, shard);
    bytes = checked_add(bytes, align_up(checked_mul(shard, bytes_per_param), alignment));
  }
  if (sum == params) return bytes;
  throw std::logic_error("planner: " + std::to_string(params) + " grad shard params are not the units reduced first");
}

void add_model_state(const Context& c, int64_t grad_shard_params, TermList& t) {
  const int64_t P = c.work.shard_params;
  // Grad shards appear unit by unit as backward reduce-scatters them; each unit's is its own
  // tensor (FSDP2's reduce-scatter output of the unit), aligned on its own.
  if (!offload_optimizer(c)) {
    // Baseline FSDP2: fp32 sharded params are the master; fp32 reduce-scattered grads; Adam m, v.
    t.add_flat("param shards (fp32, master)", "P/N", P, kFp32, Category::Params);
    add_grad_shards(c, grad_shard_params, kFp32, t);
    t.add_flat("Adam m", "P/N", P, kFp32, Category::Optimizer);
    t.add_flat("Adam v", "P/N", P, kFp32, Category::Optimizer);
  } else {
    // Optimizer offload: the GPU keeps bf16 param and grad shards; master, m, v on the host.
    t.add_flat("param shards", "P/N", P, kBf16, Category::Params);
    add_grad_shards(c, grad_shard_params, kBf16, t);
  }
}

void add_fsdp(const Context& c, const FsdpLive& live, TermList& t) {
  const auto& units = c.work.units;
  auto params = [&](int64_t unit) {
    int64_t p = units[static_cast<size_t>(unit)].gathered_params;
    // Ring-DTP: each rank holds and reduces only its V/R shard of the LM head.
    if (unit == c.work.head_unit && c.run.vocab == VocabMode::RingDtp) p = ceil_div(p, c.run.ring_size);
    return p;
  };
  auto name = [&](int64_t unit) { return units[static_cast<size_t>(unit)].name; };
  if (live.gathered >= 0)
    t.add_flat("gathered params " + name(live.gathered), "U", params(live.gathered), kBf16, Category::Fsdp);
  if (live.prefetch >= 0)
    t.add_flat("prefetched params " + name(live.prefetch), "U", params(live.prefetch), kBf16, Category::Fsdp);
  if (live.grad >= 0)
    t.add_flat("unsharded grads " + name(live.grad), "U", params(live.grad), kBf16, Category::Fsdp);
  if (live.reduce_scatter >= 0)
    t.add_flat("reduce-scatter input " + name(live.reduce_scatter), "U", params(live.reduce_scatter), kFp32,
               Category::Fsdp);
}

bool reduce_scatter_output_staged(const Context& c) { return offload_optimizer(c) && c.work.gpus > 1; }

bool head_reduced_through_an_output(const Context& c) { return !offload_optimizer(c) && c.work.gpus > 1; }

void add_head_accumulate_output(const Context& c, TermList& t) {
  const FsdpUnit& u = c.work.units[static_cast<size_t>(c.work.head_unit)];
  t.add_flat("reduce-scatter output " + u.name + " (fp32, added into its grad shard)", "S", u.reduced_shard_params, kFp32,
             Category::Fsdp);
}

void add_reduce_scatter_output(const Context& c, int64_t unit, TermList& t) {
  if (unit < 0 || !reduce_scatter_output_staged(c)) return;
  const FsdpUnit& u = c.work.units[static_cast<size_t>(unit)];
  t.add_flat("reduce-scatter output " + u.name + " (fp32, rounded into its bf16 grad shard)", "S", u.reduced_shard_params, kFp32,
             Category::Fsdp);
}

void add_boundaries(const Context& c, int64_t resident, int64_t in_flight, bool final_hidden, TermList& t) {
  const int64_t T = c.work.tokens;
  const int64_t H = c.model.hidden_size;
  t.add("checkpoint boundaries", {{"T", T}, {"H", H}}, kBf16, Category::Boundaries, resident);
  t.add("offloaded boundaries on device (copy or prefetch)", {{"T", T}, {"H", H}}, kBf16, Category::Boundaries,
        in_flight);
  if (final_hidden) t.add("final hidden h_L", {{"T", T}, {"H", H}}, kBf16, Category::Boundaries);
}

// Host tensors are aligned like the device's (the executor's allocator aligns both): the optimizer
// state one [P/N] tensor each, the stream's staging one bucket per slot and direction, the
// offloaded boundaries one [slots, T, H] tensor.
TermList host_terms_per_gpu(const Context& c) {
  TermList t = c.list();
  const int64_t P = c.work.shard_params;
  const Space host = Space::Host;
  if (offload_optimizer(c)) {
    t.add_flat("fp32 master", "P/N", P, kFp32, Category::Optimizer, 1, host);
    t.add_flat("Adam m", "P/N", P, kFp32, Category::Optimizer, 1, host);
    t.add_flat("Adam v", "P/N", P, kFp32, Category::Optimizer, 1, host);
    t.add_flat("fp32 grad staging", "P/N", P, kFp32, Category::Optimizer, 1, host);
    if (c.run.optimizer == OptimizerPlacement::Serial) {
      t.add_flat("grad D2H landing", "P/N", P, kBf16, Category::Optimizer, 1, host);
      t.add_flat("param H2D staging", "P/N", P, kBf16, Category::Optimizer, 1, host);
    } else {
      const int64_t bucket = std::min(c.run.bucket_params, P);
      t.add("bucket staging (grad in, param out; one per slot)", {{"bucket", bucket}}, kBf16, Category::Optimizer,
            2 * c.run.bucket_depth, host);
    }
  }
  const int64_t offloaded = std::count(c.run.sco_offloaded.begin(), c.run.sco_offloaded.end(), true);
  if (offloaded > 0)
    t.add("offloaded checkpoint boundaries", {{"slots", offloaded}, {"T", c.work.tokens}, {"H", c.model.hidden_size}}, kBf16,
          Category::Boundaries, 1, host);
  return t;
}

std::vector<PhaseTerms> optimizer_phases(const Context& c) {
  std::vector<PhaseTerms> out;
  switch (c.run.optimizer) {
    case OptimizerPlacement::Gpu:
      out.push_back(PhaseTerms{"step", "", c.list()});  // fused AdamW: no transients
      break;
    case OptimizerPlacement::Serial:
      for (const char* s : {"d2h", "cpu_step", "h2d"}) out.push_back(PhaseTerms{s, "", c.list()});
      break;
    case OptimizerPlacement::Stream: {
      const int64_t buckets = ceil_div(c.work.shard_params, std::max<int64_t>(1, c.run.bucket_params));
      out.push_back(PhaseTerms{"bucket0", buckets > 1 ? "bucket0-bucket" + std::to_string(buckets - 1) : "", c.list()});
      break;
    }
  }
  return out;
}

}  // namespace flatpeak::planner
