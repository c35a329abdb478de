// dtrain report: one self-contained HTML page (no network needed to view it) from the files a
// run leaves: its JSON-lines metrics (--metrics), the trace gathered to rank 0 (--trace), the
// checkpoint directory and, after a failure, the flight records. Several runs are overlaid.
//
// A run is named by its metrics file (or a directory holding one: metrics.jsonl, else the only
// *.jsonl). The metrics' start records (one per start of the job) name the trace, the
// checkpoint directory and the restarts with their causes; files given on the command line
// replace what the records name. What is missing or unreadable is said on the page, never fatal,
// as long as some metrics could be read.
#pragma once

#include <string>
#include <vector>

namespace dtrain::report {

struct ReportInput {
  std::string run;             // a metrics file, or a directory that holds one
  std::string trace;           // overrides the start record's (empty: as recorded)
  std::string checkpoint_dir;  // overrides the start record's
};

/// The HTML page of `runs` (one or more). Throws dtrain::Error naming the input when a run has
/// no readable metrics at all (a missing or empty file, not JSON lines).
std::string build_report(const std::vector<ReportInput>& runs, const std::string& title);

/// Whether `path` is a dtrain sweep's directory (it holds sweep.json).
bool is_sweep(const std::string& path);
/// The page of a sweep (dtrain sweep --dir DIR, finished: results.jsonl): every trial's metric at
/// the end of each of its jobs and its training loss on one chart each, trials stopped early by
/// asha dashed, and the results table (best first) with the command that reproduces each trial.
/// Throws dtrain::Error naming the directory when it has no results.
std::string build_sweep_report(const std::string& dir, const std::string& title);

}  // namespace dtrain::report
