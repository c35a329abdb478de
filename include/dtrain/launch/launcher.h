// dtrain launch: starts the local workers of a job with the conventional environment,
// forwards signals, prefixes their output with the rank, and when one fails stops the rest
// and reports who failed and how.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace dtrain::launch {

struct LaunchOptions {
  int nproc_per_node = 1;  // -n
  int nnodes = 1;          // --nnodes
  int node_rank = 0;       // --node-rank
  std::string master_addr = "127.0.0.1";
  int master_port = 0;         // 0: pick a free port (single node only)
  std::string secret;          // empty: DTRAIN_SECRET from the environment, else a fresh one
  double grace_seconds = 5.0;  // SIGTERM -> SIGKILL delay when stopping workers
  bool prefix_output = true;
  int max_restarts = 0;  // after a failure, start all workers again (DTRAIN_RESTART=attempt)
  int min_workers = 0;   // elastic: fewest workers to go on with (0: all of -n)
  /// CPU binding of the workers: "core" gives local rank i the i-th equal slice of the CPUs
  /// this launcher may use, whole cores while -n <= cores (see assign_cpus; needs -n <= CPUs),
  /// "none" leaves them to the scheduler, "auto" (the default) binds when -n <= CPUs. "" means
  /// DTRAIN_BIND, else auto. While -n <= cores, bound ranks never share a core, so one rank's
  /// waiting does not slow another's compute, and timings hold.
  std::string bind;
  /// Elastic nodes (--nnodes MIN:MAX): see run_elastic. 0: a fixed --nnodes.
  int min_nodes = 0, max_nodes = 0;
  double last_call_seconds = 3.0;     // elastic: once MIN nodes joined a round, wait this long for more
  double join_timeout_seconds = 600;  // elastic: give up when MIN nodes did not join within this
  std::vector<std::string> command;   // PROGRAM ARGS...

  // Set by the elastic agent for one round of workers (not options of the tool):
  bool serve_store = true;  // node 0 serves the rendezvous store (false: someone else does)
  std::string run_id;       // DTRAIN_RUN_ID for the workers: their groups' names in the store
  /// Polled while the workers run: a non-empty reason stops them (LaunchResult::interrupted).
  std::function<std::string()> interrupt;
};

/// What happened to one worker.
struct WorkerExit {
  int rank = -1;
  int pid = -1;
  int exit_code = -1;  // valid when !signaled
  int signal = 0;      // non-zero when killed by a signal
  bool stopped_by_launcher = false;
  /// Exited with code 0 before the job ended (before joining its world while other ranks had
  /// joined, or without leaving the world it joined): a failure all the same; `why` says which.
  bool early = false;
  std::string why;
};

struct LaunchResult {
  int exit_code = 0;  // 0 when every worker exited 0
  std::vector<WorkerExit> workers;
  std::string report;        // human-readable summary of failures
  bool interrupted = false;  // stopped because interrupt() asked, not because a worker failed
  /// The ranks whose failure stopped the job: those killed by a signal among the first to
  /// fail, else every worker that failed first (same poll interval).
  std::vector<int> first_failed;
  int received_signal = 0;  // the launcher itself was told to stop (SIGINT, SIGTERM)
  /// A failure's cause in one line (also the report's first line): the first sequence number
  /// where the ranks' flight records diverge, the operation, who never arrived; else who failed.
  std::string cause;
  std::string flight_dir;  // where the failure's flight records were kept (empty: none)
};

/// One logical CPU the launcher may use, with its place in the machine (from sysfs; -1 when
/// unknown, which makes every CPU its own core).
struct LogicalCpu {
  int id = 0;
  int package = -1;
  int core = -1;  // core_id within the package: SMT siblings share it
};

/// The CPUs of each of `n` local workers under binding: whole cores when n <= cores (SMT
/// siblings stay together, so no two workers share a core), otherwise logical CPUs taken core
/// by core; empty when n > CPUs. Every worker gets the same number.
std::vector<std::vector<int>> assign_cpus(const std::vector<LogicalCpu>& cpus, size_t n);

/// Runs the job to completion. Throws dtrain::Error for bad options (before starting anything).
LaunchResult run_launch(const LaunchOptions& options);

/// An elastic job (--nnodes MIN:MAX): this node's agent. The agents meet in rounds at the
/// store (served by the agent with --node-rank 0, which must stay up); a round closes when MAX
/// nodes joined, or MIN did and no other came within last_call_seconds. Its members, ordered
/// by --node-rank, form the world (nodes x -n workers). The round ends when the workers
/// finish (done), when a worker on any node fails (a restart: at most --max-restarts), or when
/// a node asks to join (the workers stop and a larger round forms). Workers resume from their
/// checkpoints in whatever world the round has; DTRAIN_RESTART is the round number. Returns
/// the exit code.
int run_elastic(const LaunchOptions& options);

}  // namespace dtrain::launch
