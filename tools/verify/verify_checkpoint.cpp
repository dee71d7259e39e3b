// verify --component checkpoint: an L-layer checkpointed stack with its boundaries kept on the
// device, offloaded synchronously (practice) or by SCO (the scaled sco_layers and sco_prefetch),
// against the planner's `boundaries` column, device and host, of every decoder-layer and main-loss
// phase.
//
// Phase matching: the executor runs each layer as attention then one FFN block (fwd/LI/attn,
// fwd/LI/ffn, bwd/LI/recompute/{attn,ffn}, bwd/LI/{ffn,attn}); the planner's MoE block phases
// (moe/route, moe/dispatch[/rR], moe/experts, moe/combine) are compared with the FFN block phase of
// the same layer and pass, and the loss phases (loss/fwd[/blkI], loss/bwd[/blkI]) with loss/fwd and
// loss/bwd. A folded predicted entry is compared with the layer it names, not the maximum over
// its fold, since boundary bytes differ from layer to layer; the "peak" row compares the largest
// prediction with the largest measurement over every phase the executor ran. MTP modules are not
// run by this component and are left out.
#include <algorithm>
#include <cmath>
#include <string>

#include "executor/memory/tracking_allocator.h"
#include "executor/schedules/checkpoint_schedule.h"
#include "verify_common.h"

namespace flatpeak::cli {

namespace {

// "0-2,3-3": scaled layer indices as --sco-layers reads them ("0" for none; a lone index is
// written i-i, since a bare number is a count).
std::string layer_set_text(const std::vector<bool>& offloaded) {
  std::string out;
  for (size_t i = 0; i < offloaded.size();) {
    if (!offloaded[i]) {
      ++i;
      continue;
    }
    size_t j = i;
    while (j + 1 < offloaded.size() && offloaded[j + 1]) ++j;
    if (!out.empty()) out += ",";
    out += std::to_string(i) + "-" + std::to_string(j);
    i = j + 1;
  }
  return out.empty() ? "0" : out;
}

// The executor phase a predicted phase is compared with; "" when the component does not run it.
std::string measured_phase_for(const std::string& predicted) {
  if (predicted.rfind("loss/fwd", 0) == 0) return "loss/fwd";
  if (predicted.rfind("loss/bwd", 0) == 0) return "loss/bwd";
  for (const std::string pass : {"fwd/", "bwd/"}) {
    if (predicted.rfind(pass + "L", 0) != 0) continue;
    const size_t layer_end = predicted.find('/', pass.size());
    if (layer_end == std::string::npos) return "";
    const std::string layer = predicted.substr(0, layer_end + 1);  // "bwd/L3/"
    std::string part = predicted.substr(layer_end + 1);
    std::string prefix;
    if (part.rfind("recompute/", 0) == 0) prefix = "recompute/", part = part.substr(prefix.size());
    return layer + prefix + (part == "attn" ? "attn" : "ffn");
  }
  return "";
}

}  // namespace

void compare_boundaries(exec::MemorySpace space, const nlohmann::ordered_json& predicted, const std::vector<exec::PhaseRecord>& records,
                        VerifyReport& report) {
  const std::string space_name = exec::memory_space_name(space);
  const auto column = static_cast<size_t>(exec::Category::Boundaries);
  int64_t predicted_peak = 0, measured_peak = 0;
  for (const auto& r : records)
    if (r.space == space && r.phase != "init" && !r.phase.empty()) measured_peak = std::max(measured_peak, r.bytes_at_peak[column]);
  for (const auto& phase : predicted["phases"]) {
    const std::string name = phase["name"].get<std::string>();
    const std::string measured_name = measured_phase_for(name);
    if (measured_name.empty() || !phase.contains(space_name)) continue;
    const int64_t predicted_bytes = phase[space_name]["boundaries"].get<int64_t>();
    int64_t measured_bytes = 0;
    // The boundary bytes when the phase's total peaked (the planner's columns split the peak).
    for (const auto& r : records)
      if (r.space == space && r.phase == measured_name) measured_bytes = std::max(measured_bytes, r.bytes_at_peak[column]);
    report.rows.push_back({"checkpoint", space_name, name, predicted_bytes, measured_bytes, relative_error(measured_bytes, predicted_bytes)});
    predicted_peak = std::max(predicted_peak, predicted_bytes);
  }
  report.rows.push_back({"checkpoint", space_name, "peak", predicted_peak, measured_peak, relative_error(measured_peak, predicted_peak)});
}

FlagList checkpoint_prediction_flags(const ScaledConfig& s, VerifyReport& report) {
  FlagList flags;
  if (s.boundaries == "sco") {
    flags = {{"--sco", "on"}, {"--sco-layers", layer_set_text(s.sco_offloaded)}, {"--sco-prefetch", std::to_string(s.sco_prefetch)}};
    report.notes.push_back("checkpoint: SCO offloads scaled layers " + layer_set_text(s.sco_offloaded) + " of " +
                           std::to_string(s.layers) + ", prefetch " + std::to_string(s.sco_prefetch));
  } else {
    flags = {{"--sco", "off"}};  // practice: synchronous offload of every layer; otherwise kept
  }
  flags.push_back(kWithoutMtp);
  return flags;
}

exec::CheckpointScheduleConfig checkpoint_schedule_config(const ScaledConfig& s) {
  exec::CheckpointScheduleConfig c;
  c.tokens = s.tokens;
  c.hidden = s.hidden;
  c.layers = s.layers;
  if (s.boundaries != "device") c.offloaded = s.sco_offloaded;  // sync-offload: every layer
  c.prefetch = s.boundaries == "sco" ? s.sco_prefetch : 0;
  return c;
}

void verify_checkpoint(const VerifyContext& ctx, VerifyReport& report) {
  const VerifyInputs& in = ctx.in;
  const ScaledConfig& s = ctx.scaled;
  const nlohmann::ordered_json predicted = predicted_timeline(ctx, checkpoint_prediction_flags(s, report));
  const exec::CheckpointScheduleConfig c = checkpoint_schedule_config(s);
  exec::TrackingAllocator alloc({in.alignment_bytes, -1, -1});
  const exec::CheckpointScheduleResult got = exec::run_checkpoint_schedule(alloc, c);

  // Against the naive stack (no checkpointing, nothing offloaded) on the same data.
  exec::CheckpointScheduleConfig naive = c;
  naive.offloaded.clear();
  naive.prefetch = 0;
  naive.checkpoint = false;
  exec::TrackingAllocator naive_alloc({in.alignment_bytes, -1, -1});
  const exec::CheckpointScheduleResult ref = exec::run_checkpoint_schedule(naive_alloc, naive);
  report.max_abs_dloss = std::max(report.max_abs_dloss, std::fabs(got.loss - ref.loss));
  auto dgrad = [&](const std::vector<uint16_t>& a, const std::vector<uint16_t>& b) {
    for (size_t i = 0; i < a.size(); ++i)
      report.max_abs_dgrad =
          std::max(report.max_abs_dgrad, static_cast<double>(std::fabs(exec::bf16_value(a[i]) - exec::bf16_value(b[i]))));
  };
  dgrad(got.d_input, ref.d_input);
  dgrad(got.d_weights, ref.d_weights);

  compare_boundaries(exec::MemorySpace::Device, predicted, alloc.phase_records(), report);
  compare_boundaries(exec::MemorySpace::Host, predicted, alloc.phase_records(), report);
  report.measured_trace = measured_trace(alloc);
}

}  // namespace flatpeak::cli
