// The one-line cause of a failed or hung job (internal to the launch layer): every rank's
// flight record joined by group and sequence number, so that the first place where the ranks
// went different ways is named, with the operation and the ranks that never arrived, e.g.
//   rank 2 never called all_reduce #17 on group 'world'; ranks 0, 1 and 3 waited 300.0 s in it
//
// Vocabulary. A *divergence* is the lowest sequence number of a group's collectives at which
// a member has an operation that did not complete: the *arrived* ranks recorded a call with
// that number, the *missing* ones did not (their record ends before it, or they left no
// record: killed, stopped). Among the divergences of all groups the earliest (by the time its
// first rank entered it) is the root. When every missing rank is itself blocked in another
// divergence that the arrived ranks never joined, the ranks wait for each other: the smaller
// side is the one that broke the order (a rank that skipped a call, or made one too many).
#pragma once

#include <map>
#include <string>
#include <vector>

#include "flight_records.h"

namespace dtrain::launch {

/// What the launcher knows of a rank besides its flight record.
struct RankFate {
  std::string ended;  // e.g. "was killed by signal 9 (Killed)", "exited with code 1"; empty: unknown
  bool stopped_by_launcher = false;
  std::string last_status;  // its last live status (what it was doing), e.g. "'forward' at step 5"
};

/// The root cause in one line (no trailing newline); empty when the records say nothing.
/// `silent`: a rank the heartbeats found silent (-1: none); `stalled`: it hung rather than
/// stopped beating.
std::string root_cause(const std::vector<FlightRecord>& records, const std::map<int, RankFate>& fates, int silent,
                       bool stalled);

}  // namespace dtrain::launch
