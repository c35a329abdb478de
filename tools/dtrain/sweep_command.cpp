// dtrain sweep: runs the jobs of a search (include/dtrain/train/sweep.h) as `dtrain train` child
// processes, --parallel at a time, and keeps every trial's state in the sweep directory:
//
//   DIR/sweep.json               the search (space, strategy, seed, metric): a --resume of another is
//                                refused; "run": --parallel and --retries, the defaults of a resume
//   DIR/.lock                    held while a sweep runs in DIR
//   DIR/trial-NNNN/trial.json    the trial's values and the dtrain train command that reproduces it
//   DIR/trial-NNNN/status.json   its outcome at each rung (written atomically after each job)
//   DIR/trial-NNNN/metrics-K.jsonl, log-K.txt, checkpoints/   rung K's metrics, output, checkpoints
//   DIR/results.jsonl            one JSON line per trial, best first (at the end)
//
// A job's child dies with the sweep (PR_SET_PDEATHSIG) and holds DIR/trial-NNNN/.lock until it and
// its own children are gone, so a resumed sweep never trains a trial twice at once. A killed sweep
// resumes every unfinished job from its trial's last checkpoint; the strategy's decisions depend
// only on recorded metrics (sweep.h), so the results are those of a sweep that never stopped.
#include "sweep_command.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <numeric>
#include <optional>
#include <set>
#include <thread>
#include <tuple>

#include "dtrain/core/error.h"
#include "dtrain/core/file.h"
#include "dtrain/train/sweep.h"
#include "sweep_hosts.h"

namespace dtrain::tools {

namespace fs = std::filesystem;
using train::RungOutcome;
using train::SweepJob;
using train::SweepPlan;
using train::TrialRecord;
using Clock = std::chrono::steady_clock;

namespace {

constexpr const char* kSearchFlags[] = {"strategy",  "trials",    "seed", "metric",          "mode",
                                        "min-steps", "max-steps", "eta",  "checkpoint-every"};

std::string trial_dir(const std::string& dir, int64_t trial) { return fmt::format("{}/trial-{:04d}", dir, trial); }

std::string self_path() {
  char self[4096] = {};
  const ssize_t len = ::readlink("/proc/self/exe", self, sizeof(self) - 1);
  DT_CHECK(len > 0, "sweep", "cannot find this program's path (/proc/self/exe)");
  return std::string(self, static_cast<size_t>(len));
}

nlohmann::json read_json(const std::string& path, bool* missing = nullptr) {
  std::string bytes;
  const std::string why = read_regular_file(path, &bytes, missing);
  if (missing != nullptr && *missing) return nullptr;
  DT_CHECK(why.empty(), "sweep", "{}: cannot read: {}", path, why);
  try {
    return nlohmann::json::parse(bytes);
  } catch (const nlohmann::json::exception& e) {
    DT_THROW("sweep", "{}: not valid JSON: {}", path, e.what());
  }
}

// The spec from a stored search (resume) or defaults (new), then the config file, then flags.
train::SweepSpec build_spec(train::SweepSpec spec, const CLI::App& app, const SweepOptions& o) {
  std::set<std::string> given;
  for (const char* name : kSearchFlags) {
    if (app.count(std::string("--") + name) > 0) given.insert(name);
  }
  if (!o.config.empty()) train::read_sweep_file(o.config, spec, given);
  if (given.count("strategy")) spec.strategy = train::parse_strategy(o.strategy, "--strategy");
  if (given.count("trials")) spec.trials = o.trials;
  if (given.count("seed")) spec.seed = o.seed;
  if (given.count("metric")) spec.metric = o.metric;
  if (given.count("mode")) spec.mode = o.mode;
  if (given.count("min-steps")) spec.min_steps = o.min_steps;
  if (given.count("max-steps")) spec.max_steps = o.max_steps;
  if (given.count("eta")) spec.eta = o.eta;
  if (given.count("checkpoint-every")) spec.checkpoint_every = o.checkpoint_every;
  for (const std::string& p : o.params) {
    train::SweepAxis a = train::parse_sweep_axis(p);
    auto same = std::find_if(spec.space.begin(), spec.space.end(), [&](const auto& x) { return x.name == a.name; });
    if (same != spec.space.end()) {
      *same = a;
    } else {
      spec.space.push_back(a);
    }
  }
  if (!o.train_args.empty()) spec.train = train::merge_options(spec.train, train::parse_train_flags(o.train_args));
  return spec;
}

// Takes DIR/.lock for the sweep's whole life (the kernel drops it however the sweep ends).
int lock_sweep_dir(const std::string& dir) {
  const std::string path = dir + "/.lock";
  const int fd = open_locked_file(path, "sweep");
  if (fd < 0) {
    std::string pid;
    read_regular_file(path, &pid);
    while (!pid.empty() && (pid.back() == '\n' || pid.back() == ' ')) pid.pop_back();
    DT_THROW("sweep", "{} is in use by another dtrain sweep (pid {}, holding {})", dir, pid.empty() ? "?" : pid, path);
  }
  DT_CHECK(::ftruncate(fd, 0) == 0, "sweep", "{}: cannot truncate: {}", path, std::strerror(errno));
  write_all(fd, fmt::format("{}\n", ::getpid()), path, "sweep");
  return fd;
}

// The metric and steps of a job's final metrics record; "" and the figures, or why not.
std::string read_final(const std::string& path, const std::string& metric, double* value, int64_t* steps) {
  std::ifstream in(path);
  if (!in) return "no metrics file " + path;
  std::string line, last;
  while (std::getline(in, line)) {
    if (line.find("\"final\"") != std::string::npos) last = line;
  }
  if (last.empty()) return "no final record in " + path;
  try {
    const nlohmann::json j = nlohmann::json::parse(last);
    if (!j.contains(metric) || !j[metric].is_number()) return fmt::format("its final record reports no {}", metric);
    *value = j[metric].get<double>();
    *steps = j.at("steps").get<int64_t>();
  } catch (const nlohmann::json::exception& e) {
    return fmt::format("{}: a damaged final record: {}", path, e.what());
  }
  return "";
}

// The line of a failed job's output that says why: its last error, else its last line.
std::string failure_line(const std::string& log) {
  std::ifstream in(log);
  std::string line, last, error;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    last = line;
    if (line.find("error:") != std::string::npos) error = line;
  }
  std::string why = error.empty() ? last : error;
  if (why.size() > 300) why = why.substr(0, 297) + "...";
  return why;
}

class SweepRunner {
 public:
  SweepRunner(SweepPlan plan, std::string dir, const SweepOptions& o, SweepHosts* hosts)
      : plan_(std::move(plan)), dir_(std::move(dir)), opts_(o), self_(self_path()), hosts_(hosts) {}

  void load(bool resume);
  void run();
  int finish();

 private:
  struct Running {
    SweepJob job;
    int attempt = 0;
    Clock::time_point start;
    int rank = 0;  // the host's rank that runs it
  };
  std::vector<std::vector<RungOutcome>> outcomes() const;
  bool adopt(const SweepJob& job);
  bool busy(const SweepJob& job) const;
  void start(const SweepJob& job, int rank);
  void wait_any();
  void reap(const Running& run, int status, double seconds, const std::string& where);
  void save(const TrialRecord& r) const;
  std::vector<std::string> child_args(const SweepJob& job) const;
  std::string metrics_path(const SweepJob& job) const {
    return fmt::format("{}/metrics-{}.jsonl", trial_dir(dir_, job.trial), job.rung);
  }
  std::string log_path(const SweepJob& job) const {
    return fmt::format("{}/log-{}.txt", trial_dir(dir_, job.trial), job.rung);
  }
  std::string job_name(const SweepJob& job) const {
    return plan_.rungs.size() > 1 ? fmt::format("trial {} rung {} ({} steps)", job.trial, job.rung,
                                                plan_.rungs[static_cast<size_t>(job.rung)])
                                  : fmt::format("trial {}", job.trial);
  }

  SweepPlan plan_;
  std::string dir_;
  const SweepOptions& opts_;
  std::string self_;
  std::vector<TrialRecord> records_;
  SweepHosts* hosts_;                                      // the other hosts' ranks (nullptr: this host alone)
  std::map<pid_t, Running> running_;                       // jobs on this host, by process id
  std::map<std::pair<int64_t, int64_t>, Running> remote_;  // jobs on the other hosts, by (trial, rung)
  int64_t local_jobs_ = 0;
  std::map<std::pair<int64_t, int64_t>, int> attempts_;  // restarts used per (trial, rung)
  int64_t jobs_done_ = 0;
};

void SweepRunner::save(const TrialRecord& r) const {
  write_file_atomic(trial_dir(dir_, r.trial) + "/status.json", train::trial_record_json(plan_, r).dump(1) + "\n",
                    "sweep");
}

void SweepRunner::load(bool resume) {
  for (const train::SweepTrial& trial : plan_.trials) {
    const std::string tdir = trial_dir(dir_, trial.index);
    bool missing = false;
    const nlohmann::json j = resume ? read_json(tdir + "/status.json", &missing) : nlohmann::json();
    if (resume && !missing) {
      TrialRecord r = train::trial_record_from_json(plan_, j, tdir + "/status.json");
      if (r.running >= 0) {
        std::fprintf(stderr, "dtrain sweep: %s was running when the sweep stopped: it continues from its checkpoint\n",
                     job_name({r.trial, r.running}).c_str());
        r.running = -1;
      }
      if (opts_.retry_failed) {
        for (auto& o : r.rungs) {
          if (o.state == RungOutcome::State::failed) o = RungOutcome{};
        }
        r.error.clear();
      }
      records_.push_back(r);
      continue;
    }
    TrialRecord r;
    r.trial = trial.index;
    r.rungs.assign(plan_.rungs.size(), RungOutcome{});
    records_.push_back(r);
  }
}

std::vector<std::vector<RungOutcome>> SweepRunner::outcomes() const {
  std::vector<std::vector<RungOutcome>> out;
  for (const auto& r : records_) out.push_back(r.rungs);
  return out;
}

std::vector<std::string> SweepRunner::child_args(const SweepJob& job) const {
  const train::SweepTrial& trial = plan_.trials[static_cast<size_t>(job.trial)];
  const bool asha = plan_.spec.strategy == train::SweepStrategy::asha;
  std::vector<std::string> flags =
      train::trial_flags(plan_, trial, asha ? plan_.rungs[static_cast<size_t>(job.rung)] : 0);
  int64_t log_every = 50;
  bool threads = false;
  std::vector<std::string> args{"dtrain", "train"};
  for (const std::string& f : flags) {
    if (f.starts_with("--log-every=")) {
      log_every = std::stoll(f.substr(12));
      continue;
    }
    threads = threads || f.starts_with("--threads=");
    args.push_back(f);
  }
  const int64_t every = train::trial_checkpoint_every(plan_, trial);
  // Log records on checkpoint boundaries: a resumed job's last interval is the uninterrupted one's.
  if (every > 0) log_every = std::gcd(log_every, every);
  args.push_back(fmt::format("--log-every={}", log_every));
  if (!threads) args.emplace_back("--threads=1");  // a trial's result does not depend on --parallel
  args.push_back("--progress=false");
  args.push_back("--metrics=" + metrics_path(job));
  if (every > 0) {
    args.push_back("--checkpoint-dir=" + trial_dir(dir_, job.trial) + "/checkpoints");
    args.push_back(fmt::format("--checkpoint-every={}", every));
    args.emplace_back("--keep=1");
  }
  return args;
}

// A job whose process ended but whose outcome was not recorded (the sweep was killed between):
// its final metrics record is there; taken as it is instead of training again.
bool SweepRunner::adopt(const SweepJob& job) {
  const std::string metrics = metrics_path(job);
  double value = 0.0;
  int64_t steps = 0;
  if (!fs::exists(metrics) || !read_final(metrics, plan_.spec.metric, &value, &steps).empty()) return false;
  const int64_t budget = plan_.rungs[static_cast<size_t>(job.rung)];
  if (budget > 0 && steps != budget) return false;
  TrialRecord& r = records_[static_cast<size_t>(job.trial)];
  RungOutcome& o = r.rungs[static_cast<size_t>(job.rung)];
  o.state = RungOutcome::State::done;
  o.metric = value;
  o.steps = steps;
  save(r);
  ++jobs_done_;
  return true;
}

bool SweepRunner::busy(const SweepJob& job) const {
  if (remote_.count({job.trial, job.rung}) > 0) return true;
  for (const auto& [pid, run] : running_) {
    if (run.job == job) return true;
  }
  return false;
}

// Starts a job on this host (rank 0) or hands it to another host's rank.
void SweepRunner::start(const SweepJob& job, int rank) {
  const std::string tdir = trial_dir(dir_, job.trial);
  fs::create_directories(tdir);
  const train::SweepTrial& trial = plan_.trials[static_cast<size_t>(job.trial)];
  if (!fs::exists(tdir + "/trial.json")) {
    nlohmann::json params = nlohmann::json::object();
    for (const auto& [name, value] : trial.params) params[name] = value;
    write_file_atomic(
        tdir + "/trial.json",
        nlohmann::json{{"trial", trial.index}, {"params", params}, {"command", train::trial_command(plan_, trial)}}
                .dump(1) +
            "\n",
        "sweep");
  }
  const int attempt = attempts_[{job.trial, job.rung}];
  TrialRecord& r = records_[static_cast<size_t>(job.trial)];
  r.running = job.rung;
  save(r);
  if (hosts_ != nullptr)
    std::fprintf(stderr, "dtrain sweep: %s started on %s\n", job_name(job).c_str(), hosts_->name(rank).c_str());
  if (rank > 0) {
    hosts_->dispatch(rank, job.trial, job.rung, attempt, child_args(job), log_path(job));
    remote_[{job.trial, job.rung}] = Running{job, attempt, Clock::now(), rank};
    return;
  }
  const pid_t pid = spawn_job(self_, child_args(job), log_path(job), lock_trial(tdir), attempt);
  running_[pid] = Running{job, attempt, Clock::now(), 0};
  ++local_jobs_;
}

void SweepRunner::reap(const Running& run, int status, double seconds, const std::string& where) {
  const SweepJob& job = run.job;
  TrialRecord& r = records_[static_cast<size_t>(job.trial)];
  RungOutcome& o = r.rungs[static_cast<size_t>(job.rung)];
  r.running = -1;
  o.time_s += seconds;
  std::string why;
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) {
    why = read_final(metrics_path(job), plan_.spec.metric, &o.metric, &o.steps);
    if (why.empty()) {
      o.state = RungOutcome::State::done;
      ++jobs_done_;
      std::fprintf(stderr, "dtrain sweep: %s: %s %.6g after %ld steps (%.1f s%s)\n", job_name(job).c_str(),
                   plan_.spec.metric.c_str(), o.metric, static_cast<long>(o.steps), seconds, where.c_str());
    }
  } else if (WIFSIGNALED(status) && run.attempt < opts_.retries) {
    attempts_[{job.trial, job.rung}] = run.attempt + 1;
    std::fprintf(stderr, "dtrain sweep: %s was %s: restarting it from its checkpoint (retry %d of %d)\n",
                 job_name(job).c_str(), describe_status(status).c_str(), run.attempt + 1, opts_.retries);
    save(r);
    return;
  } else {
    why = describe_status(status);
    const std::string line = failure_line(log_path(job));
    if (!line.empty()) why += ": " + line;
  }
  if (!why.empty()) {
    o.state = RungOutcome::State::failed;
    r.error = why;
    ++jobs_done_;
    std::fprintf(stderr, "dtrain sweep: %s failed: %s (%s)\n", job_name(job).c_str(), why.c_str(),
                 log_path(job).c_str());
  }
  save(r);
}

void SweepRunner::run() {
  for (;;) {
    const auto outs = outcomes();
    const train::SweepLadder ladder = train::successive_halving(outs, plan_.spec.eta, plan_.maximize);
    bool changed = false;
    for (const SweepJob& job : train::pending_jobs(ladder, outs)) {
      // The host with the most free slots, this one first among equals.
      int rank = 0;
      int free = opts_.parallel - static_cast<int>(running_.size());
      if (hosts_ != nullptr) {
        const auto [other, other_free] = hosts_->most_free();
        if (other_free > free) std::tie(rank, free) = std::pair(other, other_free);
      }
      if (free <= 0) break;
      if (busy(job)) continue;
      if (adopt(job)) {
        changed = true;  // the ladder may promote: decide again
        break;
      }
      start(job, rank);
    }
    if (changed) continue;
    if (running_.empty() && remote_.empty()) return;  // nothing running and nothing to start: the ladder is finished
    wait_any();
  }
}

// Waits until a job ended (on any host) or a host was lost, and records it.
void SweepRunner::wait_any() {
  for (;;) {
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, hosts_ != nullptr ? WNOHANG : 0);
    if (pid < 0) {
      DT_CHECK(errno == EINTR || errno == ECHILD, "sweep", "waitpid failed: {}", std::strerror(errno));
      if (hosts_ == nullptr) return;
    }
    bool ended = false;
    if (pid > 0) {
      auto it = running_.find(pid);
      if (it != running_.end()) {
        const Running run = it->second;
        running_.erase(it);
        reap(run, status, std::chrono::duration<double>(Clock::now() - run.start).count(),
             hosts_ != nullptr ? ", " + hosts_->name(0) : "");
        ended = true;
      }
    }
    if (hosts_ != nullptr) {
      for (const SweepHosts::Ended& e : hosts_->poll()) {
        auto it = remote_.find({e.trial, e.rung});
        if (it == remote_.end()) continue;
        const Running run = it->second;
        remote_.erase(it);
        ended = true;
        if (!e.lost.empty()) {
          // Not the trial's fault: it runs again on another host, from its checkpoint.
          TrialRecord& r = records_[static_cast<size_t>(e.trial)];
          r.running = -1;
          save(r);
          std::fprintf(stderr, "dtrain sweep: %s was lost (%s): %s runs again on another host from its checkpoint\n",
                       hosts_->name(e.rank).c_str(), e.lost.c_str(), job_name(run.job).c_str());
          continue;
        }
        reap(run, e.status, e.time_s, ", " + hosts_->name(e.rank));
      }
    }
    if (ended || hosts_ == nullptr) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

int SweepRunner::finish() {
  const std::vector<nlohmann::json> results = train::sweep_results(plan_, records_);
  std::string lines;
  for (const auto& j : results) lines += j.dump() + "\n";
  write_file_atomic(dir_ + "/results.jsonl", lines, "sweep");
  if (hosts_ != nullptr) {
    write_file_atomic(dir_ + "/hosts.json", hosts_->summary(opts_.parallel, local_jobs_).dump(1) + "\n", "sweep");
  }
  if (opts_.json) {
    std::fputs(lines.c_str(), stdout);
  } else {
    std::fputs(train::sweep_table(plan_, results).c_str(), stdout);
    const int64_t total = train::sweep_total_steps(records_);
    if (plan_.spec.strategy == train::SweepStrategy::asha) {
      const int64_t full = static_cast<int64_t>(plan_.trials.size()) * plan_.rungs.back();
      std::printf("steps trained: %ld, %.1f%% of the %ld that %zu trials of %ld steps take\n", static_cast<long>(total),
                  100.0 * static_cast<double>(total) / static_cast<double>(full), static_cast<long>(full),
                  plan_.trials.size(), static_cast<long>(plan_.rungs.back()));
    } else {
      std::printf("steps trained: %ld\n", static_cast<long>(total));
    }
  }
  std::fflush(stdout);
  if (!opts_.keep_checkpoints) {
    for (const auto& r : records_) {
      std::error_code ec;
      fs::remove_all(trial_dir(dir_, r.trial) + "/checkpoints", ec);
    }
  }
  bool any = false;
  for (const auto& j : results) any = any || j["status"] == "done";
  return any ? 0 : 1;
}

}  // namespace

void add_sweep_options(CLI::App& app, SweepOptions& o) {
  app.add_option("--dir", o.dir, "a new sweep directory (trials, checkpoints, metrics, results)");
  app.add_option("--resume", o.resume,
                 "continue the sweep in this directory (search options given too must match its search)");
  app.add_option("--config", o.config, "TOML file: strategy, trials, ..., a [space] table of axes, a [train] table")
      ->check(CLI::ExistingFile);
  app.add_option("--strategy", o.strategy, "grid | random (seeded) | asha (successive halving, early stopping)")
      ->capture_default_str();
  app.add_option("--param,-p", o.params,
                 "an axis: NAME=V1,V2,... | NAME=range:MIN:MAX[:N] | NAME=log:MIN:MAX[:N] (NAME: a dtrain train "
                 "option; N: evenly spaced points; list options such as hidden separate values by '/'); once per axis")
      ->allow_extra_args(false);  // one axis per --param, so that `--param A -- TRAIN FLAGS` ends at --
  app.add_option("--trials", o.trials, "random, asha: trials to run (default: every point of a discrete space)");
  app.add_option("--seed", o.seed, "the sampling seed (random, asha)")->capture_default_str();
  app.add_option("--metric", o.metric,
                 "the final metrics record's figure to judge by: test_accuracy (mlp, default), val_loss (gpt, "
                 "default), train_loss, samples_per_s, tokens_per_s");
  app.add_option("--mode", o.mode, "min | max (default: the metric's direction)");
  app.add_option("--min-steps", o.min_steps,
                 "asha: the first rung's steps (default: about --max-steps / eta^3, a divisor of it)");
  app.add_option("--max-steps", o.max_steps, "asha: the last rung's steps (default: --steps of the train options)");
  app.add_option("--eta", o.eta, "asha: the best 1/eta of a rung go on to the next, eta times longer")
      ->capture_default_str();
  app.add_option("--checkpoint-every", o.checkpoint_every,
                 "steps between a trial's checkpoints (default: asha every rung's divisor, else a quarter of "
                 "--steps)");
  app.add_option("--parallel,-j", o.parallel, "trials running at once (each one process, or its --dp group)")
      ->capture_default_str();
  app.add_option("--retries", o.retries, "restarts from its checkpoint of a trial killed by a signal")
      ->capture_default_str();
  app.add_flag("--retry-failed", o.retry_failed, "with --resume: run the failed trials again");
  app.add_flag("--json", o.json, "print the results as JSON lines instead of the table");
  app.add_option("--host-timeout", o.host_timeout,
                 "across hosts (dtrain launch, mpirun): seconds a host may go without a heartbeat before its trials "
                 "run again elsewhere; also how long the hosts get to join")
      ->capture_default_str();
  app.add_flag("--keep-checkpoints", o.keep_checkpoints, "keep the trials' checkpoints when the sweep ends");
  app.add_option("train", o.train_args, "-- dtrain train options every trial gets (e.g. -- --model mlp --steps 400)");
}

namespace {

int coordinate_sweep(const CLI::App& app, const SweepOptions& options, SweepHosts* hosts) {
  SweepOptions o = options;
  DT_CHECK(o.dir.empty() != o.resume.empty(), "sweep",
           "give --dir DIR for a new sweep or --resume DIR to continue one (not both)");
  const bool resume = !o.resume.empty();
  // Across hosts the directory's path must be the same on each: the jobs' files are named by it.
  const std::string dir = hosts != nullptr ? fs::absolute(resume ? o.resume : o.dir).lexically_normal().string()
                                           : (resume ? o.resume : o.dir);
  nlohmann::json stored;
  train::SweepSpec base;
  if (resume) {
    bool missing = false;
    stored = read_json(dir + "/sweep.json", &missing);
    DT_CHECK(!missing, "sweep", "--resume {}: no sweep there ({}/sweep.json is missing)", dir, dir);
    // How it ran (not the search): the resumed sweep runs alike unless told otherwise.
    if (stored.is_object() && stored.contains("run")) {
      const nlohmann::json run = stored["run"];
      stored.erase("run");
      if (app.count("--parallel") == 0 && run.contains("parallel")) o.parallel = run["parallel"].get<int>();
      if (app.count("--retries") == 0 && run.contains("retries")) o.retries = run["retries"].get<int>();
    }
    try {
      base = train::sweep_spec_from_json(stored);
    } catch (const Error& e) {
      DT_THROW("sweep", "--resume {}: {}/sweep.json: {}", dir, dir, e.message());
    }
  }
  DT_CHECK(o.parallel >= 1 && o.parallel <= 256, "sweep", "--parallel {} not in [1, 256]", o.parallel);
  DT_CHECK(o.retries >= 0, "sweep", "--retries {} must be non-negative", o.retries);
  // Everything is checked before the directory is touched or any trial starts.
  const train::SweepSpec spec = build_spec(base, app, o);
  if (resume) {
    // Options given with --resume must describe the stored search. Named as given (before the
    // plan, whose own errors would not say that the search differs), unless they only spell it
    // another way (1e-3 for 0.001): then the plans are equal.
    const std::vector<std::string> diff = train::sweep_differences(stored, train::sweep_spec_json(spec));
    bool same = diff.empty();
    if (!same) {
      try {
        same = train::sweep_spec_json(train::plan_sweep(spec).spec) == stored;
      } catch (const Error&) {
        same = false;
      }
    }
    DT_CHECK(same, "sweep", "--resume {}: the sweep there is another search ({}: there vs here): {}", dir, dir,
             fmt::join(diff, "; "));
  }
  const SweepPlan plan = train::plan_sweep(spec);
  const nlohmann::json search = train::sweep_spec_json(plan.spec);
  if (resume) {
    DT_CHECK(search == stored, "sweep", "--resume {}: the sweep there is another search ({}: there vs here): {}", dir,
             dir, fmt::join(train::sweep_differences(stored, search), "; "));
  } else {
    std::error_code ec;
    fs::create_directories(dir, ec);
    DT_CHECK(!ec, "sweep", "--dir {}: cannot create it: {}", dir, ec.message());
  }
  const int lock_fd = lock_sweep_dir(dir);
  if (!resume) {
    DT_CHECK(!fs::exists(dir + "/sweep.json"), "sweep",
             "--dir {} holds a sweep already: continue it with --resume {} (or choose another --dir)", dir, dir);
    for (const auto& entry : fs::directory_iterator(dir)) {
      DT_CHECK(entry.path().filename() == ".lock", "sweep",
               "--dir {}: not empty ({}); a new sweep starts in an empty one", dir, entry.path().filename().string());
    }
  }
  nlohmann::json manifest = search;
  manifest["run"] = {{"parallel", o.parallel}, {"retries", o.retries}};
  write_file_atomic(dir + "/sweep.json", manifest.dump(1) + "\n", "sweep");
  if (hosts != nullptr) hosts->meet(dir);
  std::fprintf(stderr, "dtrain sweep: %s, %zu trials%s, %s %s, %d at a time%s, in %s\n",
               train::strategy_name(plan.spec.strategy), plan.trials.size(),
               plan.rungs.size() > 1 ? fmt::format(", rungs of {} steps", fmt::join(plan.rungs, "/")).c_str() : "",
               plan.spec.mode.c_str(), plan.spec.metric.c_str(), o.parallel,
               hosts != nullptr ? fmt::format(" here and {} on the other hosts", hosts->slots()).c_str() : "",
               dir.c_str());
  SweepRunner runner(plan, dir, o, hosts);
  runner.load(resume);
  runner.run();
  const int code = runner.finish();
  if (hosts != nullptr) hosts->end("");
  ::close(lock_fd);
  return code;
}

}  // namespace

int run_sweep(const CLI::App& app, const SweepOptions& options) {
  DT_CHECK(options.host_timeout > 0, "sweep", "--host-timeout {} must be positive", options.host_timeout);
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(options.host_timeout * 1000.0));
  // Started as one of several ranks (dtrain launch, mpirun, srun): rank 0 coordinates, the others run its jobs.
  std::optional<SweepWorld> world = sweep_world(timeout);
  if (world && world->rank > 0) {
    DT_CHECK(options.parallel >= 1 && options.parallel <= 256, "sweep", "--parallel {} not in [1, 256]",
             options.parallel);
    return run_sweep_worker(*world, options.parallel, timeout);
  }
  std::unique_ptr<SweepHosts> hosts;
  if (world) hosts = std::make_unique<SweepHosts>(std::move(*world), timeout);
  try {
    return coordinate_sweep(app, options, hosts.get());
  } catch (const std::exception& e) {
    if (hosts) hosts->end(e.what());  // the workers stop and say why
    throw;
  }
}

}  // namespace dtrain::tools
