// One optimizer step on one rank: on-device AdamW, serial offload, OffloadStreamAdamW
// (optimizer_schedule.h). The CPU backend's "device" and "host" are both host memory; a D2H or
// H2D copy is a memcpy between buffers the TrackingAllocator counts in the two spaces.
#include "executor/schedules/optimizer_schedule.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>

#include "executor/memory/tensor.h"
#include "executor/ops/adamw.h"
#include "executor/schedules/schedule_util.h"
#include "spec/param_count.h"

namespace flatpeak::exec {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

void check_config(const OptimizerScheduleConfig& c) {
  if (c.params < 1) throw std::invalid_argument("optimizer schedule: params must be >= 1");
  if (c.cpu_threads < 1) throw std::invalid_argument("optimizer schedule: cpu_threads must be >= 1");
  if (c.step < 1) throw std::invalid_argument("optimizer schedule: step must be >= 1");
  if (!c.grad_units.empty()) {
    int64_t sum = 0;
    for (int64_t u : c.grad_units) sum += u;
    if (sum != c.params)
      throw std::invalid_argument("optimizer schedule: grad_units must sum to params (got " + std::to_string(sum) + " for " +
                                  std::to_string(c.params) + ")");
  }
  if (c.placement == OptimizerPlacement::Stream && (c.bucket_params < 1 || c.bucket_depth < 1))
    throw std::invalid_argument("optimizer schedule: stream needs bucket_params >= 1 and bucket_depth >= 1 (got " +
                                std::to_string(c.bucket_params) + ", " + std::to_string(c.bucket_depth) + ")");
}

AdamWArgs adam_args(const OptimizerScheduleConfig& c) {
  AdamWArgs a;
  a.step = c.step;
  a.lr = c.lr;
  a.beta1 = c.beta1;
  a.beta2 = c.beta2;
  a.eps = c.eps;
  a.weight_decay = c.weight_decay;
  return a;
}

// The initial state every placement starts from (optimizer_schedule.h).
void fill_state(float* master, float* m, float* v, int64_t n, uint64_t seed) {
  fill_f32(master, n, seed, 1.0f);
  fill_f32(m, n, seed + 2, 1e-3f);
  for (int64_t i = 0; i < n; ++i) v[i] = 1e-5f * std::fabs(uniform_pm1(seed + 3, static_cast<uint64_t>(i)));
}

// Pinned host memory is resident from its allocation on; touching every page at launch gives the
// CPU backend's host buffers the same property, so no stage pays first-touch page faults.
void make_resident(Tensor& t) {
  if (!t.empty()) std::memset(t.raw(), 0, static_cast<size_t>(t.bytes()));
}

// Set-up (persistent state and staging) happens in phase "init", which a fresh allocator is in.
void enter_init(TrackingAllocator& alloc) {
  if (alloc.phase() != "init") alloc.set_phase("init");
}

template <class T>
std::vector<T> copy_out(const T* p, int64_t n) {
  return std::vector<T>(p, p + n);
}

// Copies grads [begin, begin + n) of the shards (bf16) into dst, walking the shards in order.
void copy_grads_bf16(const OptimizerDeviceView& d, int64_t begin, int64_t n, Bf16* dst) {
  int64_t offset = 0;
  for (const auto& [ptr, elems] : d.grads) {
    const int64_t lo = std::max(begin, offset), hi = std::min(begin + n, offset + elems);
    if (lo < hi) std::memcpy(dst + (lo - begin), static_cast<const Bf16*>(ptr) + (lo - offset), static_cast<size_t>(hi - lo) * 2);
    offset += elems;
  }
}

void check_view(const OptimizerScheduleConfig& c, const OptimizerDeviceView& d, const OptimizerHostState* host) {
  int64_t elems = 0;
  for (const auto& g : d.grads) elems += g.second;
  if (d.params == nullptr || elems != c.params)
    throw std::invalid_argument("optimizer step: the grad shards must cover the P = " + std::to_string(c.params) + " params (got " +
                                std::to_string(elems) + ")");
  if (c.placement == OptimizerPlacement::Device && (d.m == nullptr || d.v == nullptr))
    throw std::invalid_argument("optimizer step: the device placement needs m and v");
  if (c.placement != OptimizerPlacement::Device && host == nullptr)
    throw std::invalid_argument("optimizer step: an offload placement needs its host state");
}

// The CPU stage on elements [begin, begin + n): widen the landed bf16 grads into the fp32
// staging, then AdamW on master, m, v writing the bf16 params into `param_out`.
void cpu_stage(const OptimizerScheduleConfig& c, OptimizerHostState& h, const Bf16* grad_landed, Bf16* param_out, int64_t begin,
               int64_t n) {
  float* staging = h.grad_staging.data<float>() + begin;
  for (int64_t i = 0; i < n; ++i) staging[i] = to_f32(grad_landed[i]);
  AdamWArgs a = adam_args(c);
  a.master = h.master.data<float>() + begin;
  a.m = h.m.data<float>() + begin;
  a.v = h.v.data<float>() + begin;
  a.grad = staging;
  a.grad_dtype = DType::F32;
  a.param_out = param_out;
  a.elems = n;
  adamw_step_cpu_threaded(a, c.cpu_threads);
}

void keep_offload_results(const OptimizerScheduleConfig& c, OptimizerHostState& h, const OptimizerDeviceView& d,
                          OptimizerScheduleResult& r) {
  if (!c.keep_results) return;
  const int64_t P = c.params;
  r.master = copy_out(h.master.data<float>(), P);
  r.m = copy_out(h.m.data<float>(), P);
  r.v = copy_out(h.v.data<float>(), P);
  r.params = copy_out(static_cast<const Bf16*>(d.params), P);
}

// Fused AdamW on the device, shard by shard (element-wise: bitwise one full-vector step).
void step_device(TrackingAllocator& alloc, const OptimizerScheduleConfig& c, const OptimizerDeviceView& d, OptimizerScheduleResult& r) {
  const auto start = Clock::now();
  alloc.set_phase("opt/step");
  int64_t offset = 0;
  for (const auto& [ptr, elems] : d.grads) {
    AdamWArgs a = adam_args(c);
    a.master = static_cast<float*>(d.params) + offset;
    a.grad = static_cast<const float*>(ptr);
    a.grad_dtype = DType::F32;
    a.m = d.m + offset;
    a.v = d.v + offset;
    a.elems = elems;
    adamw_step_cpu_threaded(a, c.cpu_threads);
    offset += elems;
  }
  r.seconds = seconds_since(start);
  if (c.keep_results) {
    r.master = copy_out(static_cast<const float*>(d.params), c.params);
    r.m = copy_out(d.m, c.params);
    r.v = copy_out(d.v, c.params);
  }
}

void step_serial(TrackingAllocator& alloc, const OptimizerScheduleConfig& c, const OptimizerDeviceView& d, OptimizerHostState& h,
                 OptimizerScheduleResult& r) {
  const int64_t P = c.params;
  const auto start = Clock::now();
  alloc.set_phase("opt/d2h");
  auto t = Clock::now();
  copy_grads_bf16(d, 0, P, h.grad_landing.data<Bf16>());
  r.d2h_busy_seconds = seconds_since(t);
  alloc.set_phase("opt/cpu_step");
  t = Clock::now();
  cpu_stage(c, h, h.grad_landing.data<Bf16>(), h.param_staging.data<Bf16>(), 0, P);
  r.cpu_busy_seconds = seconds_since(t);
  alloc.set_phase("opt/h2d");
  t = Clock::now();
  std::memcpy(d.params, h.param_staging.raw(), static_cast<size_t>(h.param_staging.bytes()));
  r.h2d_busy_seconds = seconds_since(t);
  r.seconds = seconds_since(start);
  keep_offload_results(c, h, d, r);
}

// OffloadStreamAdamW. Bucket b uses staging slot b % depth; a slot cycles
// Free -> (D2H thread) GradLanded -> (CPU stage) ParamReady -> (H2D thread) Free,
// so at most `depth` buckets are between their D2H and their H2D at any time.
class StreamPipeline {
 public:
  StreamPipeline(TrackingAllocator& alloc, const OptimizerScheduleConfig& c, OptimizerHostState& h, const OptimizerDeviceView& d)
      : alloc_(alloc), c_(c), h_(h), d_(d) {
    bucket_ = std::min(c.bucket_params, c.params);
    buckets_ = ceil_div(c.params, bucket_);
    state_.assign(static_cast<size_t>(c.bucket_depth), SlotState::Free);
  }

  int64_t buckets() const { return buckets_; }

  void run(OptimizerScheduleResult& r) {
    std::thread d2h([&] { guarded([&] { d2h_loop(r.d2h_busy_seconds); }); });
    std::thread h2d([&] { guarded([&] { h2d_loop(r.h2d_busy_seconds); }); });
    guarded([&] { cpu_loop(r.cpu_busy_seconds); });
    d2h.join();
    h2d.join();
    if (error_) std::rethrow_exception(error_);
  }

 private:
  enum class SlotState { Free, GradLanded, ParamReady };

  int64_t begin_of(int64_t b) const { return b * bucket_; }
  int64_t size_of(int64_t b) const { return std::min(bucket_, c_.params - begin_of(b)); }
  size_t slot_of(int64_t b) const { return static_cast<size_t>(b % c_.bucket_depth); }

  // Waits until bucket b's slot is in `want`; false when another stage failed.
  bool wait_for(int64_t b, SlotState want) {
    std::unique_lock<std::mutex> lock(mutex_);
    changed_.wait(lock, [&] { return failed_ || state_[slot_of(b)] == want; });
    return !failed_;
  }
  void set_state(int64_t b, SlotState next) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      state_[slot_of(b)] = next;
    }
    changed_.notify_all();
  }
  template <class F>
  void guarded(F&& f) {
    try {
      f();
    } catch (...) {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!error_) error_ = std::current_exception();
      failed_ = true;
      changed_.notify_all();
    }
  }

  void d2h_loop(double& busy) {
    for (int64_t b = 0; b < buckets_; ++b) {
      if (!wait_for(b, SlotState::Free)) return;
      const auto t = Clock::now();
      copy_grads_bf16(d_, begin_of(b), size_of(b), h_.grad_in[slot_of(b)].data<Bf16>());
      busy += seconds_since(t);
      set_state(b, SlotState::GradLanded);
    }
  }
  void cpu_loop(double& busy) {
    for (int64_t b = 0; b < buckets_; ++b) {
      if (!wait_for(b, SlotState::GradLanded)) return;
      alloc_.set_phase("opt/bucket" + std::to_string(b));
      const auto t = Clock::now();
      const size_t s = slot_of(b);
      cpu_stage(c_, h_, h_.grad_in[s].data<Bf16>(), h_.param_out[s].data<Bf16>(), begin_of(b), size_of(b));
      busy += seconds_since(t);
      set_state(b, SlotState::ParamReady);
    }
  }
  void h2d_loop(double& busy) {
    for (int64_t b = 0; b < buckets_; ++b) {
      if (!wait_for(b, SlotState::ParamReady)) return;
      const auto t = Clock::now();
      std::memcpy(static_cast<Bf16*>(d_.params) + begin_of(b), h_.param_out[slot_of(b)].raw(), static_cast<size_t>(size_of(b)) * 2);
      busy += seconds_since(t);
      set_state(b, SlotState::Free);
    }
  }

  TrackingAllocator& alloc_;
  const OptimizerScheduleConfig& c_;
  OptimizerHostState& h_;
  const OptimizerDeviceView& d_;
  int64_t bucket_ = 0, buckets_ = 0;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::vector<SlotState> state_;
  bool failed_ = false;
  std::exception_ptr error_;
};

void step_stream(TrackingAllocator& alloc, const OptimizerScheduleConfig& c, const OptimizerDeviceView& d, OptimizerHostState& h,
                 OptimizerScheduleResult& r) {
  StreamPipeline pipeline(alloc, c, h, d);
  r.buckets = pipeline.buckets();
  const auto start = Clock::now();
  pipeline.run(r);
  r.seconds = seconds_since(start);
  keep_offload_results(c, h, d, r);
}

// The device grad shards: one buffer per grad unit, or one [P] buffer.
std::vector<Tensor> grad_shards(TrackingAllocator& alloc, const OptimizerScheduleConfig& c, DType dtype) {
  std::vector<Tensor> out;
  const std::vector<int64_t> units = c.grad_units.empty() ? std::vector<int64_t>{c.params} : c.grad_units;
  for (int64_t n : units) out.emplace_back(alloc, dtype, std::vector<int64_t>{n}, Category::Grads, MemorySpace::Device);
  return out;
}

OptimizerScheduleResult run_device(TrackingAllocator& alloc, const OptimizerScheduleConfig& c) {
  const int64_t P = c.params;
  enter_init(alloc);
  // Baseline FSDP2: the fp32 param shard is the master; fp32 grads; m, v on the device.
  Tensor params(alloc, DType::F32, {P}, Category::Params, MemorySpace::Device);  // [P] fp32
  std::vector<Tensor> grads = grad_shards(alloc, c, DType::F32);                 // [P] fp32
  Tensor m(alloc, DType::F32, {P}, Category::Optimizer, MemorySpace::Device);    // [P] fp32
  Tensor v(alloc, DType::F32, {P}, Category::Optimizer, MemorySpace::Device);    // [P] fp32
  fill_state(params.data<float>(), m.data<float>(), v.data<float>(), P, c.seed);
  OptimizerDeviceView d;
  d.params = params.raw();
  int64_t at = 0;
  for (Tensor& g : grads) {
    for (int64_t i = 0; i < g.numel(); ++i)
      g.data<float>()[i] = to_f32(f32_to_bf16(0.01f * uniform_pm1(c.seed + 1, static_cast<uint64_t>(at + i))));
    d.grads.emplace_back(g.raw(), g.numel());
    at += g.numel();
  }
  d.m = m.data<float>();
  d.v = v.data<float>();
  return run_optimizer_step(alloc, c, d, nullptr);
}

// Serial and Stream: bf16 device param and grad shards, the host state.
OptimizerScheduleResult run_offload(TrackingAllocator& alloc, const OptimizerScheduleConfig& c) {
  const int64_t P = c.params;
  enter_init(alloc);
  Tensor params(alloc, DType::BF16, {P}, Category::Params, MemorySpace::Device);  // [P] bf16
  std::vector<Tensor> grads = grad_shards(alloc, c, DType::BF16);                // [P] bf16
  OptimizerHostState h(alloc, c);
  fill_state(h.master.data<float>(), h.m.data<float>(), h.v.data<float>(), P, c.seed);
  Bf16* dev_params = params.data<Bf16>();
  for (int64_t i = 0; i < P; ++i) dev_params[i] = f32_to_bf16(h.master.data<float>()[i]);
  OptimizerDeviceView d;
  d.params = params.raw();
  int64_t at = 0;
  for (Tensor& g : grads) {
    for (int64_t i = 0; i < g.numel(); ++i)
      g.data<Bf16>()[i] = f32_to_bf16(0.01f * uniform_pm1(c.seed + 1, static_cast<uint64_t>(at + i)));
    d.grads.emplace_back(g.raw(), g.numel());
    at += g.numel();
  }
  return run_optimizer_step(alloc, c, d, &h);
}

}  // namespace

int64_t rank_shard_params(const ModelSpec& model, int64_t gpus, int64_t ep, bool mtp) {
  int64_t sum = 0;
  for (int64_t u : rank_shard_units(model, gpus, ep, mtp)) sum += u;
  return sum;
}

std::vector<int64_t> rank_shard_units(const ModelSpec& model, int64_t gpus, int64_t ep, bool mtp) {
  if (gpus < 1 || ep < 1 || gpus % ep != 0)
    throw std::invalid_argument("rank_shard_params: EP must divide N (got N = " + std::to_string(gpus) +
                                ", EP = " + std::to_string(ep) + ")");
  const ParamCounts pc = count_params(model);
  const int64_t N = gpus;
  const int64_t replicas = N / ep;  // ranks that FSDP-shard one expert group
  const int64_t local_experts = model.num_experts / ep;
  const int64_t H = model.hidden_size;
  auto unit = [&](int64_t dense, int64_t expert_params) { return ceil_div(dense, N) + ceil_div(expert_params, replicas); };
  auto layer = [&](FfnKind ffn, int64_t extra_dense) {
    const int64_t common = pc.attention_per_layer + pc.layer_norms_per_layer + extra_dense;
    if (ffn == FfnKind::Dense) return unit(common + pc.dense_ffn_per_layer, 0);
    return unit(common + pc.router_per_layer + pc.shared_experts_per_layer, local_experts * pc.expert_params);
  };
  std::vector<int64_t> units{unit(pc.embedding, 0)};
  for (const LayerSpec& l : model.layers) units.push_back(layer(l.ffn, 0));
  if (mtp) {
    // An MTP module: a decoder layer (MoE when the model has experts) plus enorm, hnorm,
    // eh_proj [2H -> H] and the shared-head norm.
    const FfnKind ffn = model.num_experts > 0 ? FfnKind::Moe : FfnKind::Dense;
    for (int64_t j = 0; j < model.mtp_layers; ++j) units.push_back(layer(ffn, 2 * H + 2 * H * H + H));
  }
  units.push_back(unit(pc.final_norm + pc.lm_head, 0));
  return units;
}

OptimizerHostState::OptimizerHostState(TrackingAllocator& alloc, const OptimizerScheduleConfig& c) {
  check_config(c);
  const int64_t P = c.params;
  auto host = [&](DType dtype, int64_t n) { return Tensor(alloc, dtype, {n}, Category::Optimizer, MemorySpace::Host); };
  master = host(DType::F32, P);  // [P] fp32 each
  m = host(DType::F32, P);
  v = host(DType::F32, P);
  grad_staging = host(DType::F32, P);
  make_resident(grad_staging);
  if (c.placement == OptimizerPlacement::Serial) {
    grad_landing = host(DType::BF16, P);   // [P] bf16
    param_staging = host(DType::BF16, P);  // [P] bf16
    make_resident(grad_landing);
    make_resident(param_staging);
  } else if (c.placement == OptimizerPlacement::Stream) {
    // Sized once at launch: per slot a grad-in and a param-out bucket, bf16.
    const int64_t bucket = std::min(c.bucket_params, P);
    for (int64_t s = 0; s < c.bucket_depth; ++s) {
      grad_in.push_back(host(DType::BF16, bucket));
      param_out.push_back(host(DType::BF16, bucket));
      make_resident(grad_in.back());
      make_resident(param_out.back());
    }
  }
}

OptimizerScheduleResult run_optimizer_step(TrackingAllocator& alloc, const OptimizerScheduleConfig& config,
                                           const OptimizerDeviceView& device, OptimizerHostState* host) {
  check_config(config);
  check_view(config, device, host);
  OptimizerScheduleResult r;
  switch (config.placement) {
    case OptimizerPlacement::Device: step_device(alloc, config, device, r); break;
    case OptimizerPlacement::Serial: step_serial(alloc, config, device, *host, r); break;
    case OptimizerPlacement::Stream: step_stream(alloc, config, device, *host, r); break;
  }
  return r;
}

OptimizerScheduleResult run_optimizer_schedule(TrackingAllocator& alloc, const OptimizerScheduleConfig& config) {
  check_config(config);
  return config.placement == OptimizerPlacement::Device ? run_device(alloc, config) : run_offload(alloc, config);
}

}  // namespace flatpeak::exec
