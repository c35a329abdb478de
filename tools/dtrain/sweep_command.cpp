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
#include <set>
#include <thread>

#include "dtrain/core/error.h"
#include "dtrain/core/file.h"
#include "dtrain/train/sweep.h"

extern char** environ;

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

// A trial's lock; held by its job's process tree. Waits a while for one left by a killed sweep.
int lock_trial(const std::string& tdir) {
  const std::string path = tdir + "/.lock";
  const auto until = Clock::now() + std::chrono::seconds(30);
  for (;;) {
    const int fd = open_locked_file(path, "sweep");
    if (fd >= 0) return fd;
    DT_CHECK(Clock::now() < until, "sweep",
             "{}: a process of an earlier sweep still trains this trial (it has held the lock for 30 s)", path);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
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

std::string describe_status(int status) {
  if (WIFEXITED(status)) return fmt::format("exit code {}", WEXITSTATUS(status));
  if (WIFSIGNALED(status))
    return fmt::format("killed by signal {} ({})", WTERMSIG(status), ::strsignal(WTERMSIG(status)));
  return fmt::format("status {}", status);
}

class SweepRunner {
 public:
  SweepRunner(SweepPlan plan, std::string dir, const SweepOptions& o)
      : plan_(std::move(plan)), dir_(std::move(dir)), opts_(o), self_(self_path()) {}

  void load(bool resume);
  void run();
  int finish();

 private:
  struct Running {
    SweepJob job;
    int attempt = 0;
    Clock::time_point start;
  };
  std::vector<std::vector<RungOutcome>> outcomes() const;
  bool adopt(const SweepJob& job);
  void start(const SweepJob& job);
  void reap(pid_t pid, int status);
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
  std::map<pid_t, Running> running_;
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

void SweepRunner::start(const SweepJob& job) {
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
  const int lock_fd = lock_trial(tdir);
  const std::vector<std::string> args = child_args(job);
  std::vector<char*> argv;
  argv.reserve(args.size() + 1);
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  // The child's environment: not a worker of a launcher this sweep may run under; its start number
  // (DTRAIN_RESTART) is the job's attempt, as under dtrain launch --max-restarts.
  const int attempt = attempts_[{job.trial, job.rung}];
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string var(*e);
    const std::string name = var.substr(0, var.find('='));
    if (name == "RANK" || name == "WORLD_SIZE" || name == "LOCAL_RANK" || name == "LOCAL_WORLD_SIZE" ||
        name == "MASTER_ADDR" || name == "MASTER_PORT" || name == "DTRAIN_RESTART") {
      continue;
    }
    env.push_back(var);
  }
  env.push_back(fmt::format("DTRAIN_RESTART={}", attempt));
  std::vector<char*> envp;
  envp.reserve(env.size() + 1);
  for (auto& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);

  // Truncates: a retried job's output is its last attempt's.
  const int log_fd = open_output_file(log_path(job), "sweep");
  TrialRecord& r = records_[static_cast<size_t>(job.trial)];
  r.running = job.rung;
  save(r);
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(127);  // the sweep died before the line above
    ::dup2(log_fd, STDOUT_FILENO);
    ::dup2(log_fd, STDERR_FILENO);
    const int null_fd = ::open("/dev/null", O_RDONLY);
    if (null_fd >= 0) ::dup2(null_fd, STDIN_FILENO);
    ::fcntl(lock_fd, F_SETFD, 0);  // the trial's lock stays held across exec, by the job's process tree
    ::execve(self_.c_str(), argv.data(), envp.data());
    ::_exit(127);
  }
  const int fork_errno = errno;
  ::close(log_fd);
  ::close(lock_fd);
  DT_CHECK(pid > 0, "sweep", "cannot start {}: fork failed: {}", job_name(job), std::strerror(fork_errno));
  running_[pid] = Running{job, attempt, Clock::now()};
}

void SweepRunner::reap(pid_t pid, int status) {
  auto it = running_.find(pid);
  if (it == running_.end()) return;
  const Running run = it->second;
  running_.erase(it);
  const SweepJob& job = run.job;
  const double seconds = std::chrono::duration<double>(Clock::now() - run.start).count();
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
      std::fprintf(stderr, "dtrain sweep: %s: %s %.6g after %ld steps (%.1f s)\n", job_name(job).c_str(),
                   plan_.spec.metric.c_str(), o.metric, static_cast<long>(o.steps), seconds);
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
      if (static_cast<int>(running_.size()) >= opts_.parallel) break;
      bool busy = false;
      for (const auto& [pid, run] : running_) busy = busy || run.job == job;
      if (busy) continue;
      if (adopt(job)) {
        changed = true;  // the ladder may promote: decide again
        break;
      }
      start(job);
    }
    if (changed) continue;
    if (running_.empty()) return;  // nothing running and nothing to start: the ladder is finished
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, 0);
    if (pid < 0) {
      DT_CHECK(errno == EINTR, "sweep", "waitpid failed: {}", std::strerror(errno));
      continue;
    }
    reap(pid, status);
  }
}

int SweepRunner::finish() {
  const std::vector<nlohmann::json> results = train::sweep_results(plan_, records_);
  std::string lines;
  for (const auto& j : results) lines += j.dump() + "\n";
  write_file_atomic(dir_ + "/results.jsonl", lines, "sweep");
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
  app.add_flag("--keep-checkpoints", o.keep_checkpoints, "keep the trials' checkpoints when the sweep ends");
  app.add_option("train", o.train_args, "-- dtrain train options every trial gets (e.g. -- --model mlp --steps 400)");
}

int run_sweep(const CLI::App& app, const SweepOptions& options) {
  SweepOptions o = options;
  DT_CHECK(o.dir.empty() != o.resume.empty(), "sweep",
           "give --dir DIR for a new sweep or --resume DIR to continue one (not both)");
  const bool resume = !o.resume.empty();
  const std::string dir = resume ? o.resume : o.dir;
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
  std::fprintf(stderr, "dtrain sweep: %s, %zu trials%s, %s %s, %d at a time, in %s\n",
               train::strategy_name(plan.spec.strategy), plan.trials.size(),
               plan.rungs.size() > 1 ? fmt::format(", rungs of {} steps", fmt::join(plan.rungs, "/")).c_str() : "",
               plan.spec.mode.c_str(), plan.spec.metric.c_str(), o.parallel, dir.c_str());
  SweepRunner runner(plan, dir, o);
  runner.load(resume);
  runner.run();
  const int code = runner.finish();
  ::close(lock_fd);
  return code;
}

}  // namespace dtrain::tools
