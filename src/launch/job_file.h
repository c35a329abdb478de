// The job file of a running job (internal to the launch layer; readers: status.h's find_jobs):
// written when the launcher starts serving the store, removed when the job ends.
#pragma once

#include <string>

#include "dtrain/launch/status.h"

namespace dtrain::launch {

/// Writes `job` (pid, address, port, secret, command, start) as JSON to jobs_dir()/PID.json,
/// readable only by this user; removes it when destroyed. A file that cannot be written is
/// skipped with a warning (the job runs without `dtrain status` finding it).
class JobFile {
 public:
  explicit JobFile(const JobInfo& job);
  ~JobFile();
  JobFile(const JobFile&) = delete;
  JobFile& operator=(const JobFile&) = delete;

 private:
  std::string path_;
};

}  // namespace dtrain::launch
