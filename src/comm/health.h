// Failure detection for process groups (internal to comm; their flight records are in
// flight_record.h):
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

#include "dtrain/comm/store.h"
#include "dtrain/comm/types.h"

namespace dtrain::comm::health {

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
/// when destroyed. `abort` aborts its pending operations; `json` describes it and its flight
/// record; `pending` its oldest operation not completed (JSON, empty if none: live status).
struct Registration;
std::shared_ptr<Registration> register_group(std::function<void(const std::string&)> abort,
                                             std::function<std::string()> json,
                                             std::function<std::string()> pending = nullptr);
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
/// This rank's live status as one JSON object (what `dtrain status` shows): the time (Unix ms),
/// pid, host, heartbeat count, what the main work last noted (step, what, for how long), how
/// long it has been waiting in communication, its throughput, and each live group's oldest
/// pending operation. The heartbeat thread publishes it under PREFIX/status/RANK.
std::string status_json(int rank, uint64_t beat, Duration interval, Duration timeout);

/// Empty when the main work is fine (never noted, paused, waiting in a call, or noted within
/// `timeout`); otherwise what it last noted and how long ago, as "<what> at step S for N ms".
std::string progress_stall(Duration timeout);

}  // namespace dtrain::comm::health
