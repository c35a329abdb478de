#include "sweep_hosts.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <thread>

#include "dtrain/comm/group.h"
#include "dtrain/comm/mpi.h"
#include "dtrain/comm/store.h"
#include "dtrain/core/error.h"
#include "dtrain/core/file.h"

extern char** environ;

namespace dtrain::tools {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

namespace {

// A launcher's variables: a trial is a job of its own, not a rank of the launcher this sweep runs under.
bool launcher_variable(const std::string& name) {
  static const char* const names[] = {"RANK",          "WORLD_SIZE",      "LOCAL_RANK",          "LOCAL_WORLD_SIZE",
                                      "NODE_RANK",     "MASTER_ADDR",     "MASTER_PORT",         "DTRAIN_RESTART",
                                      "DTRAIN_RUN_ID", "DTRAIN_JOB_CPUS", "DTRAIN_STORE_HOSTED", "SLURM_PROCID",
                                      "SLURM_NTASKS",  "SLURM_STEP_ID",   "SLURM_STEPID"};
  for (const char* n : names) {
    if (name == n) return true;
  }
  return name.starts_with("OMPI_") || name.starts_with("PMIX_") || name.starts_with("PMI_");
}

int env_number(const char* name) {
  const char* v = std::getenv(name);
  char* end = nullptr;
  const long n = v != nullptr ? std::strtol(v, &end, 10) : -1;
  DT_CHECK(v != nullptr && *v != '\0' && *end == '\0' && n >= 0 && n < (1 << 24), "sweep",
           "environment variable {}='{}': expected a non-negative integer", name, v != nullptr ? v : "");
  return static_cast<int>(n);
}

nlohmann::json parse_message(const std::string& text, const std::string& key) {
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    DT_THROW("sweep", "store key {}: not a sweep message: {}", key, e.what());
  }
}

milliseconds beat_period(milliseconds timeout) {
  return std::clamp(timeout / 10, milliseconds(50), milliseconds(1000));
}

}  // namespace

// Adds to sweep/beat/RANK every period from a thread of its own, so that a main loop waiting on
// a trial's lock or a slow file system does not look like a dead host.
struct SweepBeat {
  SweepBeat(const SweepBeat&) = delete;
  SweepBeat& operator=(const SweepBeat&) = delete;
  SweepBeat(std::shared_ptr<comm::Store> store, int rank, milliseconds period)
      : store_(std::move(store)), key_(fmt::format("sweep/beat/{}", rank)) {
    thread_ = std::thread([this, period] {
      std::unique_lock<std::mutex> lock(mu_);
      while (!stop_) {
        lock.unlock();
        try {
          store_->add(key_, 1);
        } catch (const std::exception& e) {
          lock.lock();
          error_ = e.what();
          return;
        }
        lock.lock();
        cv_.wait_for(lock, period, [this] { return stop_; });
      }
    });
  }
  ~SweepBeat() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  std::string error() {
    std::lock_guard<std::mutex> lock(mu_);
    return error_;
  }

 private:
  std::shared_ptr<comm::Store> store_;
  std::string key_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::string error_;
  std::thread thread_;
};

int lock_trial(const std::string& tdir) {
  const std::string path = tdir + "/.lock";
  const auto until = Clock::now() + std::chrono::seconds(30);
  for (;;) {
    const int fd = open_locked_file(path, "sweep");
    if (fd >= 0) return fd;
    DT_CHECK(Clock::now() < until, "sweep",
             "{}: a process of an earlier sweep still trains this trial (it has held the lock for 30 s)", path);
    std::this_thread::sleep_for(milliseconds(20));
  }
}

pid_t spawn_job(const std::string& self, const std::vector<std::string>& args, const std::string& log, int lock_fd,
                int attempt) {
  std::vector<char*> argv;
  argv.reserve(args.size() + 1);
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  // Its start number (DTRAIN_RESTART) is the job's attempt, as under dtrain launch --max-restarts.
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string var(*e);
    if (!launcher_variable(var.substr(0, var.find('=')))) env.push_back(var);
  }
  env.push_back(fmt::format("DTRAIN_RESTART={}", attempt));
  std::vector<char*> envp;
  envp.reserve(env.size() + 1);
  for (auto& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);

  const int log_fd = open_output_file(log, "sweep");  // truncates: a retried job's output is its last attempt's
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
    ::execve(self.c_str(), argv.data(), envp.data());
    ::_exit(127);
  }
  const int fork_errno = errno;
  ::close(log_fd);
  ::close(lock_fd);
  DT_CHECK(pid > 0, "sweep", "cannot start a job: fork failed: {}", std::strerror(fork_errno));
  return pid;
}

std::string describe_status(int status) {
  if (WIFEXITED(status)) return fmt::format("exit code {}", WEXITSTATUS(status));
  if (WIFSIGNALED(status))
    return fmt::format("killed by signal {} ({})", WTERMSIG(status), ::strsignal(WTERMSIG(status)));
  return fmt::format("status {}", status);
}

std::optional<SweepWorld> sweep_world(milliseconds timeout) {
  const comm::LauncherVars vars = comm::launcher_vars();
  if (vars.rank == nullptr || vars.size == nullptr) return std::nullopt;
  SweepWorld w;
  w.rank = env_number(vars.rank);
  w.size = env_number(vars.size);
  if (w.size <= 1) return std::nullopt;
  DT_CHECK(w.rank < w.size, "sweep", "{}={} is not below {}={}", vars.rank, w.rank, vars.size, w.size);
  w.host = comm::host_name();
  const char* addr = std::getenv("MASTER_ADDR");
  if (addr != nullptr && *addr != '\0') {
    const char* secret = std::getenv("DTRAIN_SECRET");
    DT_CHECK(secret != nullptr && *secret != '\0', "sweep",
             "rank {} of {}: MASTER_ADDR is set but DTRAIN_SECRET is not (the store's secret; export the same one "
             "on every host)",
             w.rank, w.size);
    const int port = env_number("MASTER_PORT");
    DT_CHECK(port > 0 && port < 65536, "sweep", "MASTER_PORT {} out of range", port);
    const char* hosted = std::getenv("DTRAIN_STORE_HOSTED");
    if (w.rank == 0 && (hosted == nullptr || std::string(hosted) != "1")) {
      w.server = std::make_shared<comm::TcpStoreServer>(addr, static_cast<uint16_t>(port), secret);
    }
    w.store = comm::connect_tcp_store(addr, static_cast<uint16_t>(port), secret, timeout);
    return w;
  }
  DT_CHECK(comm::mpi_built(), "sweep",
           "rank {} of {} ({} is set) but no store to meet at: set MASTER_ADDR, MASTER_PORT and DTRAIN_SECRET (or "
           "start the sweep with dtrain launch; this dtrain was built without MPI)",
           w.rank, w.size, vars.rank);
  // Under mpirun: rank 0 serves the store; its address and a fresh secret reach the others through MPI.
  const comm::MpiWorld mpi = comm::mpi_world();
  DT_CHECK(mpi.rank == w.rank && mpi.size == w.size, "sweep", "MPI's world (rank {} of {}) is not {}={} of {}={}",
           mpi.rank, mpi.size, vars.rank, w.rank, vars.size, w.size);
  comm::MpiStore met = comm::mpi_store("", timeout);
  w.server = met.server;
  w.store = met.store;
  return w;
}

SweepHosts::SweepHosts(SweepWorld world, milliseconds timeout) : world_(std::move(world)), timeout_(timeout) {
  beat_ = std::make_unique<SweepBeat>(world_.store, 0, beat_period(timeout_));
}

SweepHosts::~SweepHosts() {
  if (!ended_) {
    try {
      end("the coordinator stopped");
    } catch (const std::exception&) {  // the store is gone: the workers find out by its silence
    }
  }
}

void SweepHosts::meet(const std::string& dir) {
  auto& store = *world_.store;
  const auto until = Clock::now() + timeout_;
  for (int r = 1; r < world_.size; ++r) {
    const std::string key = fmt::format("sweep/hello/{}", r);
    std::string text;
    try {
      text =
          store.get(key, std::chrono::duration_cast<milliseconds>(std::max(until - Clock::now(), Clock::duration(1))));
    } catch (const Error&) {
      DT_THROW("sweep", "rank {} of {} did not join the sweep within {} s (--host-timeout)", r, world_.size,
               timeout_.count() / 1000.0);
    }
    const nlohmann::json hello = parse_message(text, key);
    Worker w;
    w.host = hello.value("host", "?");
    w.parallel = hello.value("parallel", 1);
    w.beat_at = Clock::now();
    workers_[r] = w;
  }
  const std::string token = comm::make_secret().substr(0, 32);
  write_file_atomic(dir + "/.token", token + "\n", "sweep");
  store.set("sweep/start", nlohmann::json{{"dir", dir}, {"token", token}}.dump());
  std::vector<std::string> problems;
  for (auto& [r, w] : workers_) {
    const std::string key = fmt::format("sweep/ready/{}", r);
    std::string why;
    try {
      why =
          store.get(key, std::chrono::duration_cast<milliseconds>(std::max(until - Clock::now(), Clock::duration(1))));
    } catch (const Error&) {
      why = fmt::format("it did not answer within {} s (--host-timeout)", timeout_.count() / 1000.0);
    }
    if (!why.empty()) problems.push_back(fmt::format("{}: {}", name(r), why));
  }
  DT_CHECK(problems.empty(), "sweep",
           "the sweep directory {} must be one every host sees at the same path (the trials' checkpoints live "
           "there): {}",
           dir, fmt::join(problems, "; "));
  for (auto& [r, w] : workers_) w.beat_at = Clock::now();
}

std::pair<int, int> SweepHosts::most_free() const {
  std::pair<int, int> best{-1, 0};
  for (const auto& [r, w] : workers_) {
    if (!w.lost.empty()) continue;
    const int free = w.parallel - static_cast<int>(w.running.size());
    if (free > best.second) best = {r, free};
  }
  return best;
}

void SweepHosts::dispatch(int rank, int64_t trial, int64_t rung, int attempt, const std::vector<std::string>& args,
                          const std::string& log) {
  Worker& w = workers_.at(rank);
  const int64_t seq = w.next_job++;
  Ended e;
  e.rank = rank;
  e.trial = trial;
  e.rung = rung;
  e.attempt = attempt;
  w.running[seq] = e;
  world_.store->set(
      fmt::format("sweep/job/{}/{}", rank, seq),
      nlohmann::json{{"trial", trial}, {"rung", rung}, {"attempt", attempt}, {"args", args}, {"log", log}}.dump());
}

std::vector<SweepHosts::Ended> SweepHosts::poll() {
  const std::string beat_error = beat_->error();
  DT_CHECK(beat_error.empty(), "sweep", "the sweep's store went away: {}", beat_error);
  std::vector<Ended> out;
  auto& store = *world_.store;
  for (auto& [r, w] : workers_) {
    if (!w.lost.empty()) continue;
    for (;;) {
      const std::string key = fmt::format("sweep/done/{}/{}", r, w.next_done);
      const std::optional<std::string> text = store.try_get(key);
      if (!text) break;
      const nlohmann::json done = parse_message(*text, key);
      auto it = w.running.find(w.next_done++);
      if (it == w.running.end()) continue;
      Ended e = it->second;
      w.running.erase(it);
      e.status = done.value("status", 0);
      e.time_s = done.value("time_s", 0.0);
      ++w.jobs;
      out.push_back(e);
    }
    const int64_t beat = store.add(fmt::format("sweep/beat/{}", r), 0);
    const auto now = Clock::now();
    if (beat != w.beat) {
      w.beat = beat;
      w.beat_at = now;
    } else if (now - w.beat_at > timeout_) {
      w.lost = fmt::format("no heartbeat for {} s (--host-timeout)", timeout_.count() / 1000.0);
      for (auto& [seq, e] : w.running) {
        e.lost = w.lost;
        out.push_back(e);
      }
      w.running.clear();
    }
  }
  return out;
}

int SweepHosts::slots() const {
  int n = 0;
  for (const auto& [r, w] : workers_) n += w.parallel;
  return n;
}

std::string SweepHosts::name(int rank) const {
  auto it = workers_.find(rank);
  return fmt::format("rank {} ({})", rank, rank == 0 ? world_.host : it != workers_.end() ? it->second.host : "?");
}

nlohmann::json SweepHosts::summary(int local_parallel, int64_t local_jobs) const {
  nlohmann::json hosts = nlohmann::json::array();
  hosts.push_back({{"rank", 0}, {"host", world_.host}, {"parallel", local_parallel}, {"jobs", local_jobs}});
  for (const auto& [r, w] : workers_) {
    nlohmann::json h{{"rank", r}, {"host", w.host}, {"parallel", w.parallel}, {"jobs", w.jobs}};
    if (!w.lost.empty()) h["lost"] = w.lost;
    hosts.push_back(h);
  }
  return hosts;
}

void SweepHosts::end(const std::string& error) {
  ended_ = true;
  world_.store->set("sweep/end", error);
  // The store may be this process's: it stays until every live worker read the end (or the timeout).
  const auto until = Clock::now() + timeout_;
  for (int r = 1; r < world_.size; ++r) {
    auto it = workers_.find(r);
    if (it != workers_.end() && !it->second.lost.empty()) continue;
    try {
      world_.store->get(fmt::format("sweep/bye/{}", r),
                        std::chrono::duration_cast<milliseconds>(std::max(until - Clock::now(), Clock::duration(1))));
    } catch (const Error&) {
      std::fprintf(stderr, "dtrain sweep: %s did not confirm the end within %g s\n", name(r).c_str(),
                   timeout_.count() / 1000.0);
    }
  }
}

namespace {

struct LocalJob {
  int64_t seq = 0;
  Clock::time_point start;
};

// Ends this worker's jobs (it is leaving without finishing them): SIGKILL, then reaped.
void kill_jobs(std::map<pid_t, LocalJob>& jobs) {
  for (const auto& [pid, job] : jobs) ::kill(pid, SIGKILL);
  for (const auto& [pid, job] : jobs) ::waitpid(pid, nullptr, 0);
  jobs.clear();
}

std::string self_exe() {
  char self[4096] = {};
  const ssize_t len = ::readlink("/proc/self/exe", self, sizeof(self) - 1);
  DT_CHECK(len > 0, "sweep", "cannot find this program's path (/proc/self/exe)");
  return std::string(self, static_cast<size_t>(len));
}

}  // namespace

int run_sweep_worker(SweepWorld& world, int parallel, milliseconds timeout) {
  auto& store = *world.store;
  const std::string me = fmt::format("dtrain sweep: rank {} of {} ({})", world.rank, world.size, world.host);
  const std::string self = self_exe();
  store.set(fmt::format("sweep/hello/{}", world.rank),
            nlohmann::json{{"host", world.host}, {"parallel", parallel}, {"pid", ::getpid()}}.dump());
  SweepBeat beat(world.store, world.rank, beat_period(timeout));
  std::map<pid_t, LocalJob> jobs;
  try {
    // The search is checked by the coordinator first: wait for it to publish the directory, or its error.
    const auto until = Clock::now() + timeout;
    std::optional<std::string> start;
    for (;;) {
      if (const auto end = store.try_get("sweep/end")) {
        store.set(fmt::format("sweep/bye/{}", world.rank), "");
        std::fprintf(stderr, "%s: the sweep ended before it started%s%s\n", me.c_str(), end->empty() ? "" : ": ",
                     end->c_str());
        return end->empty() ? 0 : 1;
      }
      start = store.try_get("sweep/start");
      if (start) break;
      DT_CHECK(Clock::now() < until, "sweep", "rank 0 did not start the sweep within {} s (--host-timeout)",
               timeout.count() / 1000.0);
      std::this_thread::sleep_for(milliseconds(20));
    }
    const nlohmann::json s = parse_message(*start, "sweep/start");
    const std::string dir = s.at("dir").get<std::string>();
    std::string token, why;
    bool missing = false;
    const std::string read_error = read_regular_file(dir + "/.token", &token, &missing);
    while (!token.empty() && token.back() == '\n') token.pop_back();
    if (missing) {
      why = fmt::format("{}/.token does not exist on this host", dir);
    } else if (!read_error.empty()) {
      why = fmt::format("cannot read {}/.token: {}", dir, read_error);
    } else if (token != s.at("token").get<std::string>()) {
      why = fmt::format("{} here is another directory (its .token differs)", dir);
    }
    store.set(fmt::format("sweep/ready/{}", world.rank), why);
    if (!why.empty()) {
      store.set(fmt::format("sweep/bye/{}", world.rank), "");
      std::fprintf(stderr, "%s: error: [sweep] %s\n", me.c_str(), why.c_str());
      return 1;
    }

    int64_t next_job = 0;
    int64_t coordinator_beat = -1;
    auto coordinator_beat_at = Clock::now();
    for (;;) {
      bool busy = false;
      const std::string beat_error = beat.error();
      DT_CHECK(beat_error.empty(), "sweep", "the sweep's store went away: {}", beat_error);
      for (;;) {
        const std::string key = fmt::format("sweep/job/{}/{}", world.rank, next_job);
        const std::optional<std::string> text = store.try_get(key);
        if (!text) break;
        const nlohmann::json job = parse_message(*text, key);
        const auto args = job.at("args").get<std::vector<std::string>>();
        const std::string log = job.at("log").get<std::string>();
        const std::string tdir = fs::path(log).parent_path().string();
        const pid_t pid = spawn_job(self, args, log, lock_trial(tdir), job.at("attempt").get<int>());
        jobs[pid] = LocalJob{next_job++, Clock::now()};
        busy = true;
      }
      for (;;) {
        int status = 0;
        const pid_t pid = ::waitpid(-1, &status, WNOHANG);
        if (pid <= 0) break;
        auto it = jobs.find(pid);
        if (it == jobs.end()) continue;
        const double seconds = std::chrono::duration<double>(Clock::now() - it->second.start).count();
        store.set(fmt::format("sweep/done/{}/{}", world.rank, it->second.seq),
                  nlohmann::json{{"status", status}, {"time_s", seconds}}.dump());
        jobs.erase(it);
        busy = true;
      }
      if (const auto end = store.try_get("sweep/end")) {
        if (!end->empty()) {
          kill_jobs(jobs);
          store.set(fmt::format("sweep/bye/{}", world.rank), "");
          std::fprintf(stderr, "%s: the sweep failed on rank 0: %s\n", me.c_str(), end->c_str());
          return 1;
        }
        if (jobs.empty()) {
          store.set(fmt::format("sweep/bye/{}", world.rank), "");
          return 0;
        }
      }
      const int64_t b = store.add("sweep/beat/0", 0);
      if (b != coordinator_beat) {
        coordinator_beat = b;
        coordinator_beat_at = Clock::now();
      }
      DT_CHECK(Clock::now() - coordinator_beat_at <= timeout, "sweep",
               "rank 0 (the sweep's coordinator) stopped answering: no heartbeat for {} s (--host-timeout)",
               timeout.count() / 1000.0);
      if (!busy) std::this_thread::sleep_for(milliseconds(20));
    }
  } catch (const std::exception& e) {
    kill_jobs(jobs);
    std::fprintf(stderr, "%s: error: %s\n", me.c_str(), e.what());
    return 1;
  }
}

}  // namespace dtrain::tools
