// The trainer's trace (internal to src/train): Chrome / Perfetto "X" complete events of
// forward, backward, bucket all-reduces, synchronisation, optimizer and checkpoints, written by
// rank 0 for every rank at the end of a run (open the file in https://ui.perfetto.dev).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "dtrain/comm/group.h"

namespace dtrain::train {

using Clock = std::chrono::steady_clock;

inline double seconds_since(Clock::time_point t0, Clock::time_point t) {
  return std::chrono::duration<double>(t - t0).count();
}

// Events in microseconds since the run started. Kept as plain records (a run has millions of
// them) and turned into JSON once at the end.
class Trace {
 public:
  Trace(bool on, int rank, Clock::time_point origin) : on_(on), rank_(rank), origin_(origin) {}
  /// `name` must outlive the trace (a literal); `index` a micro-step or bucket (-1: none); `tid`
  /// 0 for compute, 1 for communication.
  void span(const char* name, int index, int tid, Clock::time_point start, Clock::time_point end, int64_t step,
            int64_t bytes = -1) {
    if (!on_) return;
    spans_.push_back({name, index, tid, seconds_since(origin_, start) * 1e6,
                      std::max(0.0, seconds_since(start, end) * 1e6), step, bytes});
  }
  nlohmann::json events() const;
  /// The run's start on the steady clock, in microseconds: on one host the ranks' origins align
  /// their rows (each rank's events count from its own origin).
  double origin_us() const { return std::chrono::duration<double, std::micro>(origin_.time_since_epoch()).count(); }

 private:
  struct Span {
    const char* name;
    int index;  // micro-step or bucket, -1: none
    int tid;
    double ts, dur;
    int64_t step, bytes;
  };
  bool on_;
  int rank_;
  Clock::time_point origin_;
  std::vector<Span> spans_;
};

/// Every rank sends its events to rank 0, which writes them all into `path` (one process per
/// rank row), atomically and never through a symlink. Collective over `group` (null: one process).
/// The file's "otherData" holds `run_id` (the metrics' start record has it too) and each rank's
/// clock origin (Trace::origin_us), for `dtrain report`.
void write_trace(const Trace& trace, const std::string& path, comm::Group* group, int rank, int world,
                 const std::string& run_id = "");

}  // namespace dtrain::train
