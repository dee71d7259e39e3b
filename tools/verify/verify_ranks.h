// Multi-rank verify: a component's multi-rank function run on every rank (threads in this process,
// or the processes of an MPI job), each rank with its own report, merged into one on rank 0.
//   VerifyReport r = run_component_on_ranks(verify_dispatch_ranks, in, scaled, nullptr, 4, nullptr);
//   // r.rows: per (component, space, phase) the largest measurement over ranks, with its rank
#pragma once

#include <string>
#include <vector>

#include "executor/comm/communicator.h"
#include "verify_config.h"
#include "verify_run.h"

namespace flatpeak::cli {

struct VerifyContext;
using RankComponentRun = void (*)(const VerifyContext&, VerifyReport&);

// Runs `run` on `ranks` ranks: thread ranks joined by a threads communicator when world is
// nullptr, else this process's rank of `world` (world->size() == ranks). Every rank fills its own
// report; the reports are gathered and merged (merge_rank_reports); the merged report is complete
// on rank 0 (with threads, it is the one returned). A failing rank: threads throw
// exec::RankFailed naming the first failing rank with its exit code; under MPI the failing rank
// aborts the job with its exit code (executor/comm/README.md, "Failure protocol").
// How long a thread rank waits at a collective for a peer before the run fails naming it.
constexpr double kVerifyPeerTimeoutSeconds = 900.0;

VerifyReport run_component_on_ranks(RankComponentRun run, const VerifyInputs& in, const ScaledConfig& scaled,
                                    const PredictionAdjust& adjust, int ranks, exec::Communicator* world);

// Per (component, space, phase), in first-seen order: the row with the largest measured bytes
// over ranks (the lowest rank on ties), with that rank's prediction and relative error; the
// largest |dloss| and |dgrad|; rank 0's measured trace and notes.
VerifyReport merge_rank_reports(const std::vector<VerifyReport>& per_rank);

// The multi-rank functions (verify_<component>_ranks.cpp); ctx.comm is this rank's communicator.
void verify_dispatch_ranks(const VerifyContext& ctx, VerifyReport& report);
void verify_step_ranks(const VerifyContext& ctx, VerifyReport& report);
void verify_layer_ranks(const VerifyContext& ctx, VerifyReport& report);  // CP > 1: a ring of the first CP' ranks

// Every rank's report, in rank order, on every rank (rows, dloss, dgrad; not the traces).
std::vector<VerifyReport> gather_reports(exec::Communicator& comm, const VerifyReport& mine);

// The report's rows, dloss and dgrad as text and back (what gather_reports sends).
std::string report_rows_to_text(const VerifyReport& report);
VerifyReport report_rows_from_text(const std::string& text);

}  // namespace flatpeak::cli
