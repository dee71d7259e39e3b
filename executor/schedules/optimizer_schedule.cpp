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
void fill_grads_bf16(Bf16* g, int64_t n, uint64_t seed) { fill_bf16(g, n, seed + 1, 0.01f); }

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

// Host state of the offload placements: fp32 master, m, v and the fp32 grad staging (where the
// bf16 grads land widened; with gradient accumulation they would accumulate there).
struct HostState {
  Tensor master, m, v, grad_staging;  // [P] fp32 each, host
  HostState(TrackingAllocator& alloc, int64_t P)
      : master(alloc, DType::F32, {P}, Category::Optimizer, MemorySpace::Host),
        m(alloc, DType::F32, {P}, Category::Optimizer, MemorySpace::Host),
        v(alloc, DType::F32, {P}, Category::Optimizer, MemorySpace::Host),
        grad_staging(alloc, DType::F32, {P}, Category::Optimizer, MemorySpace::Host) {
    make_resident(grad_staging);
  }
};

// Device state of the offload placements: bf16 param and grad shards.
struct OffloadDevice {
  Tensor params, grads;  // [P] bf16 each, device
  OffloadDevice(TrackingAllocator& alloc, int64_t P)
      : params(alloc, DType::BF16, {P}, Category::Params, MemorySpace::Device),
        grads(alloc, DType::BF16, {P}, Category::Grads, MemorySpace::Device) {}
};

// The CPU stage on elements [begin, begin + n): widen the landed bf16 grads into the fp32
// staging, then AdamW on master, m, v writing the bf16 params into `param_out`.
void cpu_stage(const OptimizerScheduleConfig& c, HostState& h, const Bf16* grad_landed, Bf16* param_out, int64_t begin,
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

void keep_offload_results(const OptimizerScheduleConfig& c, HostState& h, OffloadDevice& d, OptimizerScheduleResult& r) {
  if (!c.keep_results) return;
  const int64_t P = c.params;
  r.master = copy_out(h.master.data<float>(), P);
  r.m = copy_out(h.m.data<float>(), P);
  r.v = copy_out(h.v.data<float>(), P);
  r.params = copy_out(d.params.data<Bf16>(), P);
}

OptimizerScheduleResult run_device(TrackingAllocator& alloc, const OptimizerScheduleConfig& c) {
  const int64_t P = c.params;
  OptimizerScheduleResult r;
  enter_init(alloc);
  // Baseline FSDP2: the fp32 param shard is the master; fp32 grads; m, v on the device.
  Tensor params(alloc, DType::F32, {P}, Category::Params, MemorySpace::Device);  // [P] fp32
  Tensor grads(alloc, DType::F32, {P}, Category::Grads, MemorySpace::Device);    // [P] fp32
  Tensor m(alloc, DType::F32, {P}, Category::Optimizer, MemorySpace::Device);    // [P] fp32
  Tensor v(alloc, DType::F32, {P}, Category::Optimizer, MemorySpace::Device);    // [P] fp32
  fill_state(params.data<float>(), m.data<float>(), v.data<float>(), P, c.seed);
  float* g = grads.data<float>();
  for (int64_t i = 0; i < P; ++i) g[i] = to_f32(f32_to_bf16(0.01f * uniform_pm1(c.seed + 1, static_cast<uint64_t>(i))));
  const auto start = Clock::now();
  alloc.set_phase("opt/step");
  AdamWArgs a = adam_args(c);
  a.master = params.data<float>();
  a.grad = g;
  a.grad_dtype = DType::F32;
  a.m = m.data<float>();
  a.v = v.data<float>();
  a.elems = P;
  adamw_step_cpu_threaded(a, c.cpu_threads);
  r.seconds = seconds_since(start);
  if (c.keep_results) {
    r.master = copy_out(params.data<float>(), P);
    r.m = copy_out(m.data<float>(), P);
    r.v = copy_out(v.data<float>(), P);
  }
  return r;
}

OptimizerScheduleResult run_serial(TrackingAllocator& alloc, const OptimizerScheduleConfig& c) {
  const int64_t P = c.params;
  OptimizerScheduleResult r;
  enter_init(alloc);
  OffloadDevice d(alloc, P);
  HostState h(alloc, P);
  Tensor grad_landing(alloc, DType::BF16, {P}, Category::Optimizer, MemorySpace::Host);   // [P] bf16
  Tensor param_staging(alloc, DType::BF16, {P}, Category::Optimizer, MemorySpace::Host);  // [P] bf16
  make_resident(grad_landing);
  make_resident(param_staging);
  fill_state(h.master.data<float>(), h.m.data<float>(), h.v.data<float>(), P, c.seed);
  fill_grads_bf16(d.grads.data<Bf16>(), P, c.seed);
  Bf16* dev_params = d.params.data<Bf16>();
  for (int64_t i = 0; i < P; ++i) dev_params[i] = f32_to_bf16(h.master.data<float>()[i]);
  const auto start = Clock::now();
  alloc.set_phase("opt/d2h");
  auto t = Clock::now();
  std::memcpy(grad_landing.raw(), d.grads.raw(), static_cast<size_t>(grad_landing.bytes()));
  r.d2h_busy_seconds = seconds_since(t);
  alloc.set_phase("opt/cpu_step");
  t = Clock::now();
  cpu_stage(c, h, grad_landing.data<Bf16>(), param_staging.data<Bf16>(), 0, P);
  r.cpu_busy_seconds = seconds_since(t);
  alloc.set_phase("opt/h2d");
  t = Clock::now();
  std::memcpy(d.params.raw(), param_staging.raw(), static_cast<size_t>(param_staging.bytes()));
  r.h2d_busy_seconds = seconds_since(t);
  r.seconds = seconds_since(start);
  keep_offload_results(c, h, d, r);
  return r;
}

// OffloadStreamAdamW. Bucket b uses staging slot b % depth; a slot cycles
// Free -> (D2H thread) GradLanded -> (CPU stage) ParamReady -> (H2D thread) Free,
// so at most `depth` buckets are between their D2H and their H2D at any time.
class StreamPipeline {
 public:
  StreamPipeline(TrackingAllocator& alloc, const OptimizerScheduleConfig& c, HostState& h, OffloadDevice& d)
      : alloc_(alloc), c_(c), h_(h), d_(d) {
    bucket_ = std::min(c.bucket_params, c.params);
    buckets_ = ceil_div(c.params, bucket_);
    // Host staging sized once at launch: per slot a grad-in and a param-out bucket, bf16.
    for (int64_t s = 0; s < c.bucket_depth; ++s) {
      grad_in_.emplace_back(alloc, DType::BF16, std::vector<int64_t>{bucket_}, Category::Optimizer, MemorySpace::Host);
      param_out_.emplace_back(alloc, DType::BF16, std::vector<int64_t>{bucket_}, Category::Optimizer, MemorySpace::Host);
      make_resident(grad_in_.back());
      make_resident(param_out_.back());
    }
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
      std::memcpy(grad_in_[slot_of(b)].raw(), d_.grads.data<Bf16>() + begin_of(b), static_cast<size_t>(size_of(b)) * 2);
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
      cpu_stage(c_, h_, grad_in_[s].data<Bf16>(), param_out_[s].data<Bf16>(), begin_of(b), size_of(b));
      busy += seconds_since(t);
      set_state(b, SlotState::ParamReady);
    }
  }
  void h2d_loop(double& busy) {
    for (int64_t b = 0; b < buckets_; ++b) {
      if (!wait_for(b, SlotState::ParamReady)) return;
      const auto t = Clock::now();
      std::memcpy(d_.params.data<Bf16>() + begin_of(b), param_out_[slot_of(b)].raw(), static_cast<size_t>(size_of(b)) * 2);
      busy += seconds_since(t);
      set_state(b, SlotState::Free);
    }
  }

  TrackingAllocator& alloc_;
  const OptimizerScheduleConfig& c_;
  HostState& h_;
  OffloadDevice& d_;
  int64_t bucket_ = 0, buckets_ = 0;
  std::vector<Tensor> grad_in_, param_out_;  // depth × [bucket] bf16 each, host
  std::mutex mutex_;
  std::condition_variable changed_;
  std::vector<SlotState> state_;
  bool failed_ = false;
  std::exception_ptr error_;
};

OptimizerScheduleResult run_stream(TrackingAllocator& alloc, const OptimizerScheduleConfig& c) {
  const int64_t P = c.params;
  OptimizerScheduleResult r;
  enter_init(alloc);
  OffloadDevice d(alloc, P);
  HostState h(alloc, P);
  StreamPipeline pipeline(alloc, c, h, d);
  fill_state(h.master.data<float>(), h.m.data<float>(), h.v.data<float>(), P, c.seed);
  fill_grads_bf16(d.grads.data<Bf16>(), P, c.seed);
  Bf16* dev_params = d.params.data<Bf16>();
  for (int64_t i = 0; i < P; ++i) dev_params[i] = f32_to_bf16(h.master.data<float>()[i]);
  r.buckets = pipeline.buckets();
  const auto start = Clock::now();
  pipeline.run(r);
  r.seconds = seconds_since(start);
  keep_offload_results(c, h, d, r);
  return r;
}

}  // namespace

int64_t rank_shard_params(const ModelSpec& model, int64_t gpus, int64_t ep, bool mtp) {
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
  int64_t shard = unit(pc.embedding, 0);
  for (const LayerSpec& l : model.layers) shard += layer(l.ffn, 0);
  if (mtp) {
    // An MTP module: a decoder layer (MoE when the model has experts) plus enorm, hnorm,
    // eh_proj [2H -> H] and the shared-head norm.
    const FfnKind ffn = model.num_experts > 0 ? FfnKind::Moe : FfnKind::Dense;
    for (int64_t j = 0; j < model.mtp_layers; ++j) shard += layer(ffn, 2 * H + 2 * H * H + H);
  }
  shard += unit(pc.final_norm + pc.lm_head, 0);
  return shard;
}

OptimizerScheduleResult run_optimizer_schedule(TrackingAllocator& alloc, const OptimizerScheduleConfig& config) {
  check_config(config);
  switch (config.placement) {
    case OptimizerPlacement::Device: return run_device(alloc, config);
    case OptimizerPlacement::Serial: return run_serial(alloc, config);
    case OptimizerPlacement::Stream: return run_stream(alloc, config);
  }
  throw std::logic_error("optimizer schedule: unknown placement");
}

}  // namespace flatpeak::exec
