// Failure detection and diagnosis for process groups (internal to comm):
// - FlightRecorder: the last N operations of one group (what, how big, when queued, started
//   and finished, and how it ended), cheap enough to record every call.
// - Heartbeat: a thread that publishes this rank's liveness in the store and watches the
//   next rank's, so that a rank that died, stopped or lost the network is found within the
//   heartbeat timeout even when no collective is waiting on it.
// - A registry of the live groups of this process, so that a failure the heartbeat finds
//   aborts every group's pending operations (a failure inside one group aborts that group's
//   transport, which its peers see), and the flight records of all of them are dumped once on
//   the first failure (DTRAIN_FLIGHT_DIR).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "dtrain/comm/group.h"
#include "dtrain/comm/store.h"

namespace dtrain::comm::health {

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

/// Watches rank (rank + 1) % size through `store` (keys under `prefix`) and calls
/// on_failure(reason) once when it missed its heartbeats for `timeout`, when another rank
/// reported a failure, or when the store cannot be reached. Stops in the destructor.
class Heartbeat {
 public:
  Heartbeat(std::shared_ptr<Store> store, std::string prefix, int rank, int size, Duration interval, Duration timeout,
            std::function<void(const std::string&)> on_failure);
  ~Heartbeat();
  Heartbeat(const Heartbeat&) = delete;
  Heartbeat& operator=(const Heartbeat&) = delete;
  /// Tells the other ranks (through the store) that this rank failed, so that they stop at once.
  void report(const std::string& reason);

 private:
  void run();
  std::shared_ptr<Store> store_;
  std::string prefix_;
  int rank_, size_;
  Duration interval_, timeout_;
  std::function<void(const std::string&)> on_failure_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::atomic<bool> fired_{false};
  std::thread thread_;
};

/// The live groups of this process: register_group returns a token that unregisters the group
/// when destroyed. `abort` aborts its pending operations; `json` describes it and its flight record.
struct Registration;
std::shared_ptr<Registration> register_group(std::function<void(const std::string&)> abort,
                                             std::function<std::string()> json);
/// Aborts every live group of this process with `reason` (their pending operations raise).
void abort_all(const std::string& reason);
/// Writes every live group's flight record to DTRAIN_FLIGHT_DIR/rank-R.json (R: RANK, else
/// the pid) the first time it is called in this process; does nothing without the variable.
void dump_on_first_failure();

/// The progress watch (dtrain/comm/progress.h). While a WaitScope lives, this process waits
/// inside a communication call, which is not a stall of its main work.
struct WaitScope {
  WaitScope();
  ~WaitScope();
  WaitScope(const WaitScope&) = delete;
  WaitScope& operator=(const WaitScope&) = delete;
};
/// Empty when the main work is fine (never noted, paused, waiting in a call, or noted within
/// `timeout`); otherwise what it last noted and how long ago, as "<what> at step S for N ms".
std::string progress_stall(Duration timeout);

/// `text` as the inside of a JSON string.
std::string json_escape(std::string_view text);

}  // namespace dtrain::comm::health
