// The flight recorder of a group (internal to comm; FlightEntry and what it records are in
// dtrain/comm/flight_record.h): the last N operations of one group (what, how big, when
// queued, started and finished, and how it ended), cheap enough to record every call, and
// the record as JSON for the dump on the first failure (health.h).
#pragma once

#include <atomic>
#include <cstdint>
#include <exception>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "dtrain/comm/flight_record.h"

namespace dtrain::comm::detail {

// Recording sits on the latency path of small collectives (a few hundred nanoseconds): a
// spin lock held for a few stores, one clock read per state change, no allocation for the
// usual short op names.
class FlightRecorder {
 public:
  explicit FlightRecorder(size_t capacity) : ring_(capacity) {}
  /// Records an operation as queued (started too, when `running`); returns its id for
  /// started()/ended().
  uint64_t queued(const char* op, uint64_t seq, bool collective, size_t bytes, int peer, bool running = false);
  void started(uint64_t id);
  void ended(uint64_t id, const std::exception_ptr& error);
  /// Records a collective that ran from `start` until now in one go.
  void completed(const char* op, uint64_t seq, size_t bytes, int peer, Clock::time_point start,
                 const std::exception_ptr& error);
  /// Oldest first.
  std::vector<FlightEntry> entries() const;
  /// The oldest entry that is queued or running (copies one entry, not the ring: live status).
  std::optional<FlightEntry> oldest_pending() const;

 private:
  struct Lock {
    explicit Lock(const std::atomic<bool>& flag);
    ~Lock();
    std::atomic<bool>& flag;
  };
  FlightEntry* find(uint64_t id);  // null once overwritten
  // Takes the next slot and fills it; returns its id.
  uint64_t write(const char* op, uint64_t seq, bool collective, size_t bytes, int peer, FlightEntry::State state,
                 Clock::time_point queued, Clock::time_point started, Clock::time_point finished, std::string error);
  mutable std::atomic<bool> busy_{false};
  std::vector<FlightEntry> ring_;
  std::vector<uint64_t> ids_ = std::vector<uint64_t>(ring_.size(), UINT64_MAX);
  uint64_t next_ = 0;
  size_t next_slot_ = 0;  // next_ % ring_.size()
};

/// A group and its flight record as one JSON object (times in ms before now). `members`: the
/// world ranks of the group's ranks (empty: the group is the world).
std::string flight_record_json(const std::string& group, int rank, int size, const std::string& transport,
                               const std::vector<FlightEntry>& entries, const std::vector<int>& members = {});

/// A pending entry as {"group","op","seq","state","ms"} (ms: since it started, or was queued);
/// empty for none.
std::string pending_json(const std::string& group, const std::optional<FlightEntry>& pending);

/// `text` as the inside of a JSON string.
std::string json_escape(std::string_view text);

}  // namespace dtrain::comm::detail
