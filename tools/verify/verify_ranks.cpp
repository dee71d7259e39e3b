// Multi-rank verify: running a component on every rank and merging the reports (verify_ranks.h).
#include "verify_ranks.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <tuple>

#include "executor/comm/threads_comm.h"
#include "spec/errors.h"
#include "verify_common.h"

namespace flatpeak::cli {

using nlohmann::json;

std::string report_rows_to_text(const VerifyReport& report) {
  json rows = json::array();
  for (const auto& r : report.rows)
    rows.push_back({r.component, r.space, r.phase, r.predicted_bytes, r.measured_bytes, r.rank});
  // Doubles are written shortest round-trip, so the receiving rank reads back the same bits.
  return json{{"rows", rows}, {"dloss", report.max_abs_dloss}, {"dgrad", report.max_abs_dgrad}}.dump();
}

VerifyReport report_rows_from_text(const std::string& text) {
  const json j = json::parse(text);
  VerifyReport report;
  for (const auto& r : j.at("rows")) {
    VerifyRow row{r[0].get<std::string>(), r[1].get<std::string>(), r[2].get<std::string>(),
                  r[3].get<int64_t>(),     r[4].get<int64_t>(),     0.0,
                  r[5].get<int>()};
    row.relative_error = relative_error(row.measured_bytes, row.predicted_bytes);
    report.rows.push_back(row);
  }
  report.max_abs_dloss = j.at("dloss").get<double>();
  report.max_abs_dgrad = j.at("dgrad").get<double>();
  return report;
}

std::vector<VerifyReport> gather_reports(exec::Communicator& comm, const VerifyReport& mine) {
  const std::string text = report_rows_to_text(mine);
  const int n = comm.size();
  // Lengths first, then every text padded to the longest, as int64 words (the communicator's
  // element types have no bytes).
  const int64_t length = static_cast<int64_t>(text.size());
  std::vector<int64_t> lengths(static_cast<size_t>(n));
  comm.all_gather(&length, lengths.data(), 1, exec::DType::I64);
  const int64_t words = (*std::max_element(lengths.begin(), lengths.end()) + 7) / 8;
  std::vector<int64_t> send(static_cast<size_t>(words), 0);
  std::memcpy(send.data(), text.data(), text.size());
  std::vector<int64_t> all(static_cast<size_t>(words * n));
  comm.all_gather(send.data(), all.data(), words, exec::DType::I64);
  std::vector<VerifyReport> reports;
  for (int p = 0; p < n; ++p) {
    const char* begin = reinterpret_cast<const char*>(all.data() + static_cast<size_t>(p) * static_cast<size_t>(words));
    reports.push_back(report_rows_from_text(std::string(begin, static_cast<size_t>(lengths[static_cast<size_t>(p)]))));
  }
  return reports;
}

VerifyReport merge_rank_reports(const std::vector<VerifyReport>& per_rank) {
  VerifyReport merged;
  if (per_rank.empty()) return merged;
  merged.plan_file = per_rank[0].plan_file;
  merged.tolerance = per_rank[0].tolerance;
  merged.measured_trace = per_rank[0].measured_trace;
  merged.notes = per_rank[0].notes;
  std::map<std::tuple<std::string, std::string, std::string>, size_t> index;  // key → merged row
  for (const auto& report : per_rank) {
    merged.max_abs_dloss = std::max(merged.max_abs_dloss, report.max_abs_dloss);
    merged.max_abs_dgrad = std::max(merged.max_abs_dgrad, report.max_abs_dgrad);
    for (const auto& row : report.rows) {
      const auto key = std::make_tuple(row.component, row.space, row.phase);
      const auto found = index.find(key);
      if (found == index.end()) {
        index.emplace(key, merged.rows.size());
        merged.rows.push_back(row);
      } else if (row.measured_bytes > merged.rows[found->second].measured_bytes) {
        merged.rows[found->second] = row;  // strictly larger: the lowest rank keeps a tie
      }
    }
  }
  return merged;
}

VerifyReport run_component_on_ranks(RankComponentRun run, const VerifyInputs& in, const ScaledConfig& scaled,
                                    const PredictionAdjust& adjust, int ranks, exec::Communicator* world) {
  // One rank's part: its own report, tagged with its rank, then every report gathered.
  auto one_rank = [&](int rank, exec::Communicator& comm) -> std::vector<VerifyReport> {
    VerifyReport mine;
    mine.plan_file = in.file;
    const VerifyContext ctx{in, scaled, adjust, &comm};
    run(ctx, mine);
    for (auto& row : mine.rows) row.rank = rank;
    std::vector<VerifyReport> all = gather_reports(comm, mine);
    all[static_cast<size_t>(rank)].measured_trace = mine.measured_trace;
    all[static_cast<size_t>(rank)].notes = mine.notes;
    return all;
  };
  if (world != nullptr) {
    if (world->size() != ranks)
      throw InputError({Diagnostic{"", "--max-ranks",
                                   "the job has " + std::to_string(world->size()) + " processes but the scaled configuration has " +
                                       std::to_string(ranks) + " ranks",
                                   "launch verify with -np " + std::to_string(ranks) + ", or choose --max-ranks to match"}});
    std::vector<VerifyReport> all;
    try {
      all = one_rank(world->rank(), *world);
    } catch (...) {
      // A rank cannot fail alone under MPI (its peers would wait in the next collective): abort
      // the job with this rank's code; the communicator names the rank on stderr.
      std::string message = "unknown error";
      try {
        throw;
      } catch (const std::exception& e) {
        message = e.what();
      } catch (...) {
      }
      world->abort(exec::exit_code_for_current_exception(), message);
      throw;  // threads-like communicators return from abort by throwing; MPI never gets here
    }
    return merge_rank_reports(all);
  }
  VerifyReport merged;
  // A rank may compute alone for minutes while its peers wait at the next collective (Ring-DTP's
  // materialised reference is rank 0's alone, and at a small --scale it is large): the default
  // 60 s would call that a hung peer. A rank that never arrives still ends the run.
  exec::ThreadsOptions options;
  options.peer_timeout_s = kVerifyPeerTimeoutSeconds;
  const exec::RunResult result = exec::run_ranks(
      ranks,
      [&](int rank, exec::Communicator& comm) {
        std::vector<VerifyReport> all = one_rank(rank, comm);
        if (rank == 0) merged = merge_rank_reports(all);
      },
      options);
  if (!result.ok()) {
    const exec::RankStatus& failed = result.ranks[static_cast<size_t>(result.failing_rank)];
    throw exec::RankFailed(result.failing_rank, result.exit_code, failed.message);
  }
  return merged;
}

}  // namespace flatpeak::cli
