// dtrain sweep across hosts: the ranks of one sweep started by `dtrain launch`, `mpirun` or
// `srun`, and how they share the trials. Rank 0 is the coordinator: it owns the sweep directory,
// the search and successive halving's decisions, and runs trials like every other rank (each
// with its own --parallel K). The other ranks are workers: they run the jobs the coordinator
// hands them and report how each process ended. Messages go over the rendezvous store the
// launcher serves (dtrain launch), or one rank 0 serves (MASTER_ADDR and MASTER_PORT set by
// hand, or mpirun: its address reaches the ranks through MPI):
//
//   sweep/hello/R     worker R: {host, parallel, pid} once it is up
//   sweep/start       the coordinator: {dir, token} once the search is checked; the directory
//                     must be one every host sees at the same path (the trials' checkpoints,
//                     which the next rung and --resume continue from, live there): a worker
//                     checks that it reads the token from DIR/.token
//   sweep/ready/R     worker R: "" when it sees the directory, else why not
//   sweep/job/R/N     the coordinator: worker R's N-th job {trial, rung, attempt, args, log}
//   sweep/done/R/N    worker R: how its N-th job's process ended {status, time_s}
//   sweep/beat/R      a counter each rank (the coordinator too) adds to while it runs
//   sweep/end         the coordinator: "" when the sweep ended, else its error
//   sweep/bye/R       worker R: it read the end (the coordinator, which may serve the store, waits
//                     for it up to --host-timeout before it exits)
//
// A worker whose beat stops for --host-timeout is lost: its jobs run again on the other hosts
// (from their trials' checkpoints), and the sweep goes on. A worker whose coordinator's beat
// stops (or whose store goes away) stops its jobs and exits with an error.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

namespace dtrain::comm {
class Store;
}

namespace dtrain::tools {

struct SweepBeat;

/// A trial's lock (DIR/trial-NNNN/.lock), held by its job's process tree. Waits up to 30 s for
/// one left by a process of a killed sweep or a lost host.
int lock_trial(const std::string& tdir);

/// Starts a job: `args` run as this program (`self`), output to `log` (truncated), stdin from
/// /dev/null, dying with this process, holding `lock_fd` across exec; without the variables of a
/// launcher this sweep may run under, with DTRAIN_RESTART=`attempt`. Closes `lock_fd` here.
pid_t spawn_job(const std::string& self, const std::vector<std::string>& args, const std::string& log, int lock_fd,
                int attempt);

/// What a wait status says: "exit code 3", "killed by signal 9 (Killed)".
std::string describe_status(int status);

/// This process as one rank of a sweep on several hosts.
struct SweepWorld {
  int rank = 0;
  int size = 1;
  std::string host;  // this host's name
  std::shared_ptr<comm::Store> store;
  std::shared_ptr<void> server;  // the store, where this rank serves it
};

/// The sweep's world when a launcher started this process as one of several ranks (RANK and
/// WORLD_SIZE, Open MPI's, PMI's or Slurm's variables), else nullopt. Connects to the store (it
/// waits up to `timeout` for it).
std::optional<SweepWorld> sweep_world(std::chrono::milliseconds timeout);

/// The coordinator's side: the workers, their free slots and running jobs.
class SweepHosts {
 public:
  SweepHosts(SweepWorld world, std::chrono::milliseconds timeout);
  ~SweepHosts();
  SweepHosts(const SweepHosts&) = delete;
  SweepHosts& operator=(const SweepHosts&) = delete;

  /// Waits (up to the timeout) until every worker said hello, publishes the sweep directory and
  /// waits until each one sees it. Throws dtrain::Error naming the rank and host that did not.
  void meet(const std::string& dir);
  /// The worker with the most free slots (lowest rank first), and how many; {-1, 0} when none.
  std::pair<int, int> most_free() const;
  /// Hands a job to worker `rank`.
  void dispatch(int rank, int64_t trial, int64_t rung, int attempt, const std::vector<std::string>& args,
                const std::string& log);

  /// A job that ended on a worker, or that was running on a worker now lost (`lost` says why).
  struct Ended {
    int rank = 0;
    int64_t trial = 0, rung = 0;
    int attempt = 0;
    int status = 0;
    double time_s = 0.0;
    std::string lost;
  };
  /// The jobs that ended since the last call, and those of workers lost since then. Never waits.
  std::vector<Ended> poll();
  /// The other hosts' slots together (the sum of their --parallel).
  int slots() const;
  /// "rank 1 (host-b)".
  std::string name(int rank) const;
  /// Every rank: host, parallel, jobs run, lost or not (DIR/hosts.json).
  nlohmann::json summary(int local_parallel, int64_t local_jobs) const;
  /// Tells the workers the sweep ended ("") or failed (`error`); they exit.
  void end(const std::string& error);

 private:
  struct Worker {
    std::string host;
    int parallel = 0;
    int64_t next_job = 0, next_done = 0;  // sequence numbers of jobs handed out and reported
    std::map<int64_t, Ended> running;     // by sequence number
    int64_t jobs = 0;
    int64_t beat = -1;
    std::chrono::steady_clock::time_point beat_at;
    std::string lost;
  };
  SweepWorld world_;
  std::chrono::milliseconds timeout_;
  std::map<int, Worker> workers_;
  std::unique_ptr<SweepBeat> beat_;
  bool ended_ = false;
};

/// A worker's life (rank > 0): runs the jobs it is handed, `parallel` at most at once, until the
/// coordinator ends the sweep. Returns the exit code.
int run_sweep_worker(SweepWorld& world, int parallel, std::chrono::milliseconds timeout);

}  // namespace dtrain::tools
