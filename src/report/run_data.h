// One run's files as the report reads them (internal to src/report): the metrics' records,
// the trace's spans on one clock, the checkpoints, and every problem met on the way (a
// missing file, a truncated line, a trace of another run), which the page lists.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "dtrain/report/report.h"

namespace dtrain::report {

/// A "start" record: one start of the job (the first, a restart, an elastic round).
struct Start {
  double time = 0;
  int attempt = 0;
  int world = 1, dp = 1, pp = 1, tp = 1;
  int64_t resumed_step = 0, steps = 0, batch_size = 0;
  std::string run_id, model, trace, checkpoint_dir;
  std::string reason;    // why the previous start ended (restarts)
  double failed_at = 0;  // when (Unix seconds; 0: unknown)
  std::string failed_flight_dir;
};

/// A "log" record.
struct LogPoint {
  int64_t step = 0;
  double loss = 0, lr = 0, rate = -1, mfu = -1, time = 0;
  size_t start = 0;  // index of the start that wrote it
};

/// An evaluation during or at the end of the run (accuracy or validation loss).
struct EvalPoint {
  int64_t step = 0;
  double value = 0;
};

/// One trace span on the common clock (microseconds since the first rank's origin).
struct Span {
  int rank = 0, tid = 0, index = -1;
  int64_t step = 0, bytes = -1;
  double ts = 0, dur = 0;
  std::string name;  // forward, backward, bucket, synchronize, optimizer, checkpoint, step
};

struct Checkpoint {
  int64_t step = 0;
  double time = 0;  // its manifest's modification time (Unix seconds; 0: none)
  bool complete = false;
};

struct RunData {
  std::string name, metrics_path;
  std::vector<Start> starts;
  std::vector<LogPoint> logs;
  std::vector<EvalPoint> evals;
  std::string eval_name;  // "test accuracy" or "validation loss"
  std::optional<nlohmann::json> final;
  std::string unit = "samples";
  // The trace, when one was found and belongs to this run.
  std::string trace_path;
  bool has_trace = false;
  int trace_world = 0;
  std::vector<Span> spans;
  std::vector<Checkpoint> checkpoints;
  std::string checkpoint_dir;
  std::vector<std::string> problems;  // said on the page
};

/// Reads the metrics file (or directory) of `in`; throws dtrain::Error naming it when no
/// record at all can be read from it.
RunData load_metrics(const ReportInput& in);
/// Adds the trace (`in.trace`, else the one the start records name) to `run`; problems noted.
void load_trace(const ReportInput& in, RunData& run);
/// Adds the checkpoints (`in.checkpoint_dir`, else the recorded one) to `run`; problems noted.
void load_checkpoints(const ReportInput& in, RunData& run);

/// One trial of a sweep: its jobs' metrics (one file per rung) read as one run, and its figure at
/// the end of each job (the metric of the job's final record).
struct SweepTrialData {
  int64_t trial = 0;
  nlohmann::json result;  // its line of results.jsonl (rank, params, value, status, command, ...)
  RunData run;            // every rung's records, in rung order
  std::vector<EvalPoint> metric;
};

/// A sweep directory (dtrain sweep --dir): the search, the results best first, every trial.
struct SweepData {
  std::string dir;
  nlohmann::json search;  // sweep.json
  std::string metric, mode, strategy;
  std::vector<SweepTrialData> trials;  // in the results' order (best first)
  std::vector<std::string> problems;
};

/// Whether `path` is a sweep directory (it holds sweep.json).
bool is_sweep_dir(const std::string& path);
/// Reads a sweep directory; throws dtrain::Error naming it when it has no results to show.
SweepData load_sweep(const std::string& dir);

}  // namespace dtrain::report
