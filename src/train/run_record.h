// What a run's metrics say about the run itself (internal to src/train): the record each start
// writes first, so that `dtrain report` finds the trace, the checkpoints and the flight records
// of the run, and places restarts, their cause and the work they cost on its timeline.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

#include "dtrain/train/config.h"

namespace dtrain::train {

/// Seconds since the Unix epoch (the metrics' and the report's common clock).
double unix_seconds();

/// A fresh identifier of one start of a run (16 hex digits), in its start record and its trace.
std::string make_run_id();

/// Which start of the job this is: DTRAIN_RESTART (the launcher's restarts, elastic rounds), 0 if unset.
int restart_attempt();

/// The start record: {"event":"start", time, run_id, attempt, world, dp/pp/tp, model, steps,
/// resumed_step, the absolute paths of the trace, checkpoint and flight directories, and after a
/// restart the launcher's one-line cause of the failure and when it happened}.
nlohmann::json start_record(const TrainConfig& cfg, int world, int64_t resumed_step, int64_t total_steps,
                            const std::string& run_id);

}  // namespace dtrain::train
