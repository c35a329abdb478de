// What the report shows of one run, computed from its files (internal to src/report): the
// curves, each rank's step split into compute / communication / waiting / bubble, the first
// steps per rank (Gantt), bytes on the wire, memory, and the restarts with the work they cost.
//
// Vocabulary of the split (per rank, mean seconds per step, the first step of each start left
// out: it agrees shapes and warms up):
//   compute        forward, backward and optimizer spans inside the step;
//   waiting        the part of the gradient synchronisation spent waiting for a later rank
//                  (the last rank's end of backward minus this rank's, at most the sync);
//   communication  the rest of the synchronisation (transfer not hidden behind backward);
//   bubble         pipelines: the rest of the step, idle while other stages work;
//   other          non-pipelines: the rest of the step (data, logging).
#pragma once

#include <nlohmann/json.hpp>

#include "run_data.h"

namespace dtrain::report {

/// The run as the page's data: {"name", "series": {...}, "split", "gantt", "wire", "memory",
/// "timeline", "restarts"}; parts that the files do not support are null.
nlohmann::json analyse(const RunData& run);

}  // namespace dtrain::report
