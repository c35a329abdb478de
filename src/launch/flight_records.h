// The flight records workers dump on their first failure (internal to the launch layer): the
// launcher reads them to say which rank failed and what every rank was doing.
#pragma once

#include <string>
#include <vector>

namespace dtrain::launch {

/// One worker's record (DTRAIN_FLIGHT_DIR/rank-R.json): (path, contents).
struct FlightRecord {
  std::string path, text;
};

/// The records in `dir`, in rank order.
std::vector<FlightRecord> read_flight_records(const std::string& dir);

/// For each rank, the operation it was in (or its last one), so the report says who waited on
/// whom. Records that cannot be parsed are named, not fatal.
std::string flight_summary(const std::vector<FlightRecord>& records);

/// A rank that the heartbeats found silent (stopped, hung), named in a worker's flight record;
/// -1 if none (*stalled: it made no progress rather than went silent). That rank is the
/// failure, not the worker that noticed and exited first.
int silent_rank(const std::vector<FlightRecord>& records, bool* stalled);

}  // namespace dtrain::launch
