// A group's flight record: its last operations, kept so that a failure can be explained
// afterwards (which call each rank was in, for how long). Group::flight_record() returns it;
// on the first failure in a process, every group's record is written to
// DTRAIN_FLIGHT_DIR/rank-R.json when that variable is set (dtrain launch sets it).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "dtrain/comm/types.h"

namespace dtrain::comm {

/// One operation in a group's flight record (the last GroupOptions::flight_record_size).
struct FlightEntry {
  enum class State : uint8_t { queued, running, done, failed };
  uint64_t seq = 0;  // the collective (or point-to-point) sequence number on the group
  std::string op;
  bool collective = true;
  size_t bytes = 0;  // payload per rank
  int peer = -1;     // point to point: the peer; broadcast/reduce: the root
  State state = State::queued;
  /// A blocking collective that ran inline in the caller (the small-message latency path) is
  /// recorded when it ends, with queued = started = its start and, when it succeeded,
  /// finished = started too: its duration is not measured, to keep clock reads off that path.
  Clock::time_point queued_at{}, started_at{}, finished_at{};
  std::string error;
};
const char* name_of(FlightEntry::State s);

}  // namespace dtrain::comm
