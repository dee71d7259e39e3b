// `flatpeak verify --backend cuda`: the components that have a CUDA twin run on one GPU, with the
// DeviceAllocator's tracked bytes compared with the planner's prediction phase by phase (as on
// the CPU), and the device's own view (what the device says this process holds) against the
// tracked peak plus the plan's runtime overhead. Library flatpeak_verify_cuda, built with the CUDA
// backend; the CLI calls it only where it was built (FLATPEAK_HAVE_CUDA_BACKEND).
//   VerifyReport r = run_verification_cuda(in, scale_config(in, 1.0), {"vocab", "checkpoint", "dispatch"}, 0.03);
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "verify_config.h"
#include "verify_run.h"

namespace flatpeak::cli {

// The components with a CUDA twin, in report order: vocab (materialised, blocked, or Ring-DTP: a
// ring of R > 1 runs its R ranks sharing device 0), checkpoint (boundaries kept, offloaded in
// line, or by SCO on copy streams) and dispatch (standard EP, LLEP or PipelinedLLEP: one EP
// group's EP ranks sharing device 0, each rank's tracked dispatch bytes per phase; with more
// scaled ranks than EP, group 0 alone, a note says so).
std::vector<std::string> cuda_verify_components();

// The device's own view passes within this fraction of the expected footprint plus kDeviceViewSlackBytes.
constexpr double kDeviceViewTolerance = 0.03;
constexpr int64_t kDeviceViewSlackBytes = int64_t{256} << 20;

// Runs `components` on device 0. A component without a CUDA twin is an input error when asked for
// alone (UnsupportedPlan, exit 2) and a note when several are asked for. Throws
// cuda::BackendError when there is no device or the run cannot fit in the device's free memory
// (exit 4), exec::OutOfMemory likewise (also from a rank of a multi-rank run); exec::RankFailed
// for a rank that failed otherwise.
VerifyReport run_verification_cuda(const VerifyInputs& in, const ScaledConfig& scaled,
                                   const std::vector<std::string>& components, double tolerance,
                                   const PredictionAdjust& adjust = nullptr);

}  // namespace flatpeak::cli
