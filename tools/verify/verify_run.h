// `flatpeak verify`: the scaled configuration planned (on the data the executor ran) and executed,
// and the comparison, phase by phase and at each component's peak.
//   VerifyReport r = run_verification(inputs, scaled, {"vocab"}, 0.01);   // r.pass, r.rows
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "verify_config.h"

namespace flatpeak::exec {
class Communicator;
}

namespace flatpeak::cli {

struct VerifyRow {
  std::string component;  // "vocab", "dispatch", "checkpoint", "optimizer", "layer", "step"
  std::string space;      // "device" | "host"
  std::string phase;      // predicted phase name, or "peak"
  int64_t predicted_bytes = 0;
  int64_t measured_bytes = 0;
  double relative_error = 0.0;  // (measured − predicted) / predicted
  int rank = 0;                 // the rank whose measurement this is (the maximum's, over ranks)
  // How the row is judged: |relative_error| ≤ its tolerance (the report's unless set), or, when
  // `slack_bytes` > 0, |measured − predicted| ≤ tolerance · predicted + slack_bytes (the device's
  // own view, which holds the pool's granularity). A row that is not `judged` is reported only.
  int64_t slack_bytes = 0;
  double tolerance = -1.0;  // < 0: the report's
  bool judged = true;
  // Failed by at most one allocation unit where the tolerance allows less than one unit: the
  // scale, not the prediction, decides such a row (set_aside_unresolved_rows).
  bool below_resolution = false;
};

struct VerifyReport {
  std::string plan_file;
  std::vector<VerifyRow> rows;
  double max_abs_dloss = 0.0;  // over techniques, against the naive schedule on the same data
  double max_abs_dgrad = 0.0;
  double tolerance = 0.01;
  bool pass = true;
  nlohmann::ordered_json measured_trace;  // traces/README.md timeline, source "measured" (rank 0's)
  int ranks = 1;                          // ranks the multi-rank components ran on
  std::string launcher = "threads";       // "threads" | "mpi"
  std::string backend = "cpu";            // "cpu" | "cuda"
  std::string device;                     // the GPU's name on the cuda backend
  std::vector<std::string> notes;         // e.g. a component that ran on one rank only
  // Rows set aside as below resolution; with none failing, the run is not judged and verify
  // exits 2 naming the --scale that judges them (`resolving_scale`, 0 when none does).
  int unresolved_rows = 0;
  double resolving_scale = 0.0;
  std::string unresolved_note;  // also among `notes`
};

// Changes the predicted timeline before the comparison, to show that verify catches a wrong
// prediction: tests raise one term by 2 %, the CLI's --perturb FACTOR scales every figure.
using PredictionAdjust = std::function<void(nlohmann::ordered_json& predicted_timeline)>;

// Whether a row passes (VerifyRow says how each is judged); a "bound" row passes at or under its
// predicted upper bound.
bool row_passes(const VerifyRow& row, double tolerance);

// Every tracked size is a whole number of allocation units (`unit_bytes`, the card's alignment).
// Under kMinResolvedUnits units one unit is more than the default 1 % tolerance (a --scale too
// fine: --scale 1000 leaves Qwen3-30B-A3B a 43 KB vocab peak, 84 units), so a row there that
// fails by exactly one unit is decided by one small buffer rounded up, which says nothing about
// the plan at its full size: it is set aside (not judged, `below_resolution`) and a note names the
// largest --scale at which it holds kMinResolvedUnits (sizes grow at least linearly as the factor
// falls). Rows that pass, fail by more, are bounds or carry their own slack are left as they are.
// `factor` is the run's T / T_scaled.
constexpr int64_t kMinResolvedUnits = 100;
void set_aside_unresolved_rows(VerifyReport& report, double tolerance, int64_t unit_bytes, double factor);

// The components this version verifies (every one `--component` accepts), in report order.
std::vector<std::string> verify_components();

// With scaled.ranks > 1, each component's multi-rank function runs on every rank: as threads
// (world == nullptr) or on the processes of `world` (an MPI communicator of scaled.ranks
// processes; the returned report is complete on rank 0 only). Components without one run on one
// rank (a note says so). A failing rank throws exec::RankFailed naming it (verify_ranks.h).
VerifyReport run_verification(const VerifyInputs& in, const ScaledConfig& scaled,
                              const std::vector<std::string>& components, double tolerance,
                              const PredictionAdjust& adjust = nullptr, exec::Communicator* world = nullptr);

}  // namespace flatpeak::cli
