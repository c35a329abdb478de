// dtrain launch: starts the local workers of a job with the conventional environment,
// forwards signals, prefixes their output with the rank, and when one fails stops the rest
// and reports who failed and how.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dtrain::launch {

struct LaunchOptions {
  int nproc_per_node = 1;          // -n
  int nnodes = 1;                  // --nnodes
  int node_rank = 0;               // --node-rank
  std::string master_addr = "127.0.0.1";
  int master_port = 0;             // 0: pick a free port (single node only)
  std::string secret;              // empty: DTRAIN_SECRET from the environment, else a fresh one
  double grace_seconds = 5.0;      // SIGTERM -> SIGKILL delay when stopping workers
  bool prefix_output = true;
  int max_restarts = 0;            // after a failure, start all workers again (DTRAIN_RESTART=attempt)
  int min_workers = 0;             // elastic: fewest workers to go on with (0: all of -n)
  std::vector<std::string> command;  // PROGRAM ARGS...
};

/// What happened to one worker.
struct WorkerExit {
  int rank = -1;
  int pid = -1;
  int exit_code = -1;  // valid when !signaled
  int signal = 0;      // non-zero when killed by a signal
  bool stopped_by_launcher = false;
};

struct LaunchResult {
  int exit_code = 0;  // 0 when every worker exited 0
  std::vector<WorkerExit> workers;
  std::string report;  // human-readable summary of failures
};

/// Runs the job to completion. Throws dtrain::Error for bad options (before starting anything).
LaunchResult run_launch(const LaunchOptions& options);

}  // namespace dtrain::launch
