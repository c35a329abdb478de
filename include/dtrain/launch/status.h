// The live status of a running job (`dtrain status`): where to find the jobs on this host,
// and what each rank's heartbeat thread last published in the job's store (comm/health.h:
// step, what its main work is doing and for how long, the collective it waits in, throughput).
//
// Finding jobs: dtrain launch (the process that serves the store) writes a job file with the
// store's address, port and secret into jobs_dir(), a directory only its user can read
// (0700, the file 0600), and removes it when the job ends.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/comm/store.h"

namespace dtrain::launch {

/// A job that a dtrain launch on this host runs, as its job file says.
struct JobInfo {
  int pid = 0;  // the launcher's
  std::string addr;
  int port = 0;
  std::string secret;
  std::string command;
  double started = 0.0;  // Unix seconds
  std::string path;      // the job file
};

/// $XDG_RUNTIME_DIR/dtrain/jobs when XDG_RUNTIME_DIR is set, else $HOME/.cache/dtrain/jobs.
std::string jobs_dir();

/// The jobs of live launchers in jobs_dir(), oldest first. Files that cannot be read, that are
/// readable by others, or whose launcher is gone are left out (the last are removed).
std::vector<JobInfo> find_jobs();

/// The store key under which the launcher names the job's current world: {"name", "size"}.
inline constexpr const char* kJobWorldKey = "job/world";

/// One rank's last published status.
struct RankStatus {
  int rank = 0;
  bool published = false;  // false: nothing in the store for this rank (yet)
  int pid = 0;
  std::string host;
  int64_t step = -1;
  std::string what;      // what its main work last noted
  double what_s = -1;    // for how long
  double wait_s = -1;    // in communication for how long (-1: not waiting)
  double rate = -1;      // throughput
  std::string unit;      // of the throughput ("samples", "tok")
  std::string op;        // the oldest pending operation, e.g. "all_reduce #12 on 'world'"
  double op_s = -1;      // for how long
  double age_s = 0;      // since it was published (its last heartbeat)
  double timeout_s = 0;  // the job's heartbeat timeout
  bool stale = false;    // no heartbeat for two intervals: stopped, hung, or gone
  bool stuck = false;    // beats, but its main work made no progress for the heartbeat timeout
};

struct JobStatus {
  std::string world;  // the world group's name in the store
  int size = 0;
  std::vector<RankStatus> ranks;
};

/// Reads the job's status from its store (one request per rank). Throws dtrain::Error when the
/// store does not name a world (not a job started by dtrain launch).
JobStatus read_job_status(comm::Store& store);

/// The status as a table, one line per rank; stale and stuck ranks are marked in capitals.
/// `job` (may be null) adds a heading line.
std::string format_job_status(const JobStatus& status, const JobInfo* job);

}  // namespace dtrain::launch
