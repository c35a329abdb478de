// Liveness of a process's main work, not only of its threads. A heartbeat thread keeps beating
// while the main thread is stuck (blocked reading data, deadlocked on a lock), so a hang would
// be found only by the collective timeout, and blamed on whichever peer waited. A program that
// calls note_progress() in its loop gets more: once it has called it, every group's heartbeat
// also checks that the last call is younger than the heartbeat timeout whenever the process is
// not waiting inside a collective or a send/receive (a wait is the peers' business, and the
// call's own timeout bounds it). When the check fails, this rank reports itself, naming what
// it was doing, and every rank stops.
#pragma once

#include <cstdint>

namespace dtrain::comm {

/// This process's main work moved on and is now doing `what` (a string with static storage:
/// a literal) at `step` (-1: none). Cheap: two relaxed stores and a coarse clock read.
void note_progress(const char* what, int64_t step = -1);

/// This process's throughput, `per_s` units (a literal such as "samples") a second: shown by
/// `dtrain status` beside the step. Cheap: two relaxed stores.
void note_throughput(double per_s, const char* unit);

/// Stops the progress check (until the next note_progress): for phases that may legitimately
/// run longer than the heartbeat timeout without a step, such as a program's shutdown.
void pause_progress();

}  // namespace dtrain::comm
