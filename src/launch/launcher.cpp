#include "dtrain/launch/launcher.h"

#include <dirent.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>

#include "dtrain/comm/store.h"
#include "dtrain/core/error.h"
#include "finish.h"
#include "flight_records.h"
#include "job_file.h"
#include "root_cause.h"

extern char** environ;

namespace dtrain::launch {

namespace {

// Shared memory a worker created and did not unlink: killed while the others had not mapped it
// yet. Names embed the creator's pid (shm::make_segment_name): /dev/shm/dtrain-...-PID-RANDOM.
void remove_shm_of(pid_t pid) {
  DIR* dir = ::opendir("/dev/shm");
  if (dir == nullptr) return;
  const std::string tag = "-" + std::to_string(pid) + "-";
  std::vector<std::string> doomed;
  while (const dirent* e = ::readdir(dir)) {
    const std::string name = e->d_name;
    const size_t at = name.rfind(tag);
    if (name.starts_with("dtrain-") && at != std::string::npos && name.size() == at + tag.size() + 16) {
      doomed.push_back("/dev/shm/" + name);
    }
  }
  ::closedir(dir);
  for (const auto& path : doomed) (void)::unlink(path.c_str());
}

// A topology figure of logical CPU `cpu` from sysfs (physical_package_id, core_id); -1 if absent.
int read_topology(int cpu, const char* what) {
  std::ifstream in(fmt::format("/sys/devices/system/cpu/cpu{}/topology/{}", cpu, what));
  int v = -1;
  if (!(in >> v)) return -1;
  return v;
}

// The CPU set of each local worker under o.bind (see LaunchOptions::bind); empty: no binding.
std::vector<cpu_set_t> worker_cpus(const LaunchOptions& o) {
  std::string bind = o.bind;
  if (bind.empty()) {
    const char* env = std::getenv("DTRAIN_BIND");
    bind = env != nullptr && *env != '\0' ? env : "auto";
  }
  DT_CHECK(bind == "auto" || bind == "core" || bind == "none", "launch",
           "--bind '{}' (or DTRAIN_BIND): expected auto, core or none", bind);
  cpu_set_t mine;
  CPU_ZERO(&mine);
  if (bind == "none" || ::sched_getaffinity(0, sizeof(mine), &mine) != 0) return {};
  std::vector<LogicalCpu> allowed;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &mine))
      allowed.push_back({c, read_topology(c, "physical_package_id"), read_topology(c, "core_id")});
  }
  const size_t n = static_cast<size_t>(o.nproc_per_node);
  const std::vector<std::vector<int>> slices = assign_cpus(allowed, n);
  if (slices.empty()) {
    DT_CHECK(bind == "auto", "launch", "--bind core: {} workers but only {} CPUs to bind them to", n, allowed.size());
    return {};
  }
  std::vector<cpu_set_t> out(n);
  for (size_t w = 0; w < n; ++w) {
    CPU_ZERO(&out[w]);
    for (int c : slices[w]) CPU_SET(c, &out[w]);
  }
  return out;
}

int g_signal_pipe[2] = {-1, -1};

void on_signal(int sig) {
  const char c = static_cast<char>(sig);
  [[maybe_unused]] ssize_t n = ::write(g_signal_pipe[1], &c, 1);
}

struct Worker {
  int rank = 0;
  pid_t pid = -1;
  int out_fd = -1;  // stdout pipe
  int err_fd = -1;  // stderr pipe
  std::string out_buf, err_buf;
  bool out_split = false, err_split = false;  // a long line was split (said once per stream)
  bool running = false;
  bool exited_before_joining = false;  // exited 0 without joining the world: failed once others join
  WorkerExit exit;
};

// The longest line kept whole: a longer one (a worker printing without newlines) is written in
// pieces of this size, so the launcher's memory stays bounded whatever the workers print.
constexpr size_t kMaxLine = size_t{64} * 1024;

// Writes complete lines of `buf` to `fd`, each prefixed; keeps the unfinished tail, up to
// kMaxLine bytes (then written as a piece of its own; `*split` set the first time).
void flush_lines(std::string& buf, int fd, const std::string& prefix, bool final, bool* split = nullptr) {
  [[maybe_unused]] ssize_t n = 0;
  size_t start = 0;
  bool split_now = false;
  // Each line, or each kMaxLine piece of a longer one (complete or not).
  while (start < buf.size()) {
    const size_t nl = buf.find('\n', start);
    const size_t end = nl == std::string::npos ? buf.size() : nl;
    if (end - start >= kMaxLine) {
      const std::string piece = prefix + buf.substr(start, kMaxLine) + "\n";
      n = ::write(fd, piece.data(), piece.size());
      start += kMaxLine;
      if (start < buf.size() && buf[start] == '\n') ++start;  // the piece ended the line exactly
      split_now = true;
      continue;
    }
    if (nl == std::string::npos) break;  // an unfinished line, shorter than kMaxLine: kept
    const std::string line = prefix + buf.substr(start, nl - start + 1);
    n = ::write(fd, line.data(), line.size());
    start = nl + 1;
  }
  buf.erase(0, start);
  if (split_now && split != nullptr && !*split) {
    *split = true;
    const std::string note = fmt::format(
        "{}(dtrain launch: this output has lines longer than {} bytes; they are split)\n", prefix, kMaxLine);
    n = ::write(fd, note.data(), note.size());
  }
  if (final && !buf.empty()) {
    const std::string line = prefix + buf + "\n";
    n = ::write(fd, line.data(), line.size());
    buf.clear();
  }
}

std::string describe(const WorkerExit& w) {
  if (w.signal != 0) {
    return fmt::format("rank {} (pid {}) was killed by signal {} ({}){}", w.rank, w.pid, w.signal,
                       ::strsignal(w.signal), w.stopped_by_launcher ? " after the launcher stopped it" : "");
  }
  if (w.early) return fmt::format("rank {} (pid {}) exited with code 0 {}", w.rank, w.pid, w.why);
  return fmt::format("rank {} (pid {}) exited with code {}{}", w.rank, w.pid, w.exit_code,
                     w.stopped_by_launcher ? " after the launcher stopped it" : "");
}

void remove_directory(const std::string& dir) {
  if (DIR* d = ::opendir(dir.c_str())) {
    while (const dirent* e = ::readdir(d)) {
      if (e->d_name[0] != '.') ::unlink((dir + "/" + e->d_name).c_str());
    }
    ::closedir(d);
  }
  ::rmdir(dir.c_str());
}

}  // namespace

std::vector<std::vector<int>> assign_cpus(const std::vector<LogicalCpu>& cpus, size_t n) {
  if (n == 0 || n > cpus.size()) return {};
  // Cores in the order of their first CPU, each with its SMT siblings; a CPU without topology
  // is a core of its own.
  std::vector<std::vector<int>> cores;
  std::vector<std::pair<int, int>> keys;  // (package, core) of each entry of `cores`
  for (const LogicalCpu& c : cpus) {
    const std::pair<int, int> key{c.package, c.core};
    auto it = c.core < 0 ? keys.end() : std::find(keys.begin(), keys.end(), key);
    if (it == keys.end()) {
      keys.push_back(key);
      cores.push_back({c.id});
    } else {
      cores[static_cast<size_t>(it - keys.begin())].push_back(c.id);
    }
  }
  // More workers than cores: each logical CPU a unit of its own, still core by core, so a
  // core's siblings go to neighbouring workers.
  if (n > cores.size()) {
    std::vector<std::vector<int>> units;
    for (const auto& core : cores) {
      for (int id : core) units.push_back({id});
    }
    cores = std::move(units);
  }
  std::vector<std::vector<int>> out(n);
  const size_t each = cores.size() / n;
  for (size_t w = 0; w < n; ++w) {
    for (size_t k = w * each; k < (w + 1) * each; ++k) out[w].insert(out[w].end(), cores[k].begin(), cores[k].end());
  }
  return out;
}

void finish_together(comm::Store& store, const std::string& done_key, int64_t members, bool wait,
                     const std::string& stop_key) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  for (int64_t n = store.add(done_key, 1); wait && n < members && std::chrono::steady_clock::now() < until;
       n = store.add(done_key, 0)) {
    if (!stop_key.empty() && store.try_get(stop_key)) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // polling the store
  }
}

namespace {

using SteadyClock = std::chrono::steady_clock;

// After a worker failed, how long the others get to notice and write their flight records
// before they are asked to stop.
constexpr std::chrono::milliseconds kRecordWait{1000};

// Bad options fail here, before anything (store, signal handlers, flight directory) exists.
void check_options(const LaunchOptions& o) {
  DT_CHECK(!o.command.empty(), "launch", "no command to run (usage: dtrain launch -n N -- PROGRAM ARGS...)");
  DT_CHECK(o.nproc_per_node >= 1 && o.nproc_per_node <= 1024, "launch", "-n {} out of range [1, 1024]",
           o.nproc_per_node);
  DT_CHECK(o.nnodes >= 1 && o.node_rank >= 0 && o.node_rank < o.nnodes, "launch",
           "--node-rank {} out of range for --nnodes {}", o.node_rank, o.nnodes);
  DT_CHECK(o.nnodes == 1 || o.master_port > 0, "launch", "--master-port is required with --nnodes {}", o.nnodes);
  DT_CHECK(o.master_port >= 0 && o.master_port < 65536, "launch", "--master-port {} out of range", o.master_port);
}

// The job's secret: the option's, else DTRAIN_SECRET, else (one node) a fresh one; checked.
std::string job_secret(const LaunchOptions& o) {
  std::string secret = o.secret;
  if (secret.empty()) {
    const char* env = std::getenv("DTRAIN_SECRET");
    DT_CHECK(o.nnodes == 1 || env != nullptr, "launch",
             "multi-node jobs need the same DTRAIN_SECRET on every node (export it before dtrain launch)");
    secret = env != nullptr ? env : comm::make_secret();
  }
  comm::check_secret(secret,
                     o.secret.empty() ? "dtrain launch: DTRAIN_SECRET" : "dtrain launch: LaunchOptions::secret");
  return secret;
}

// Where the workers dump their flight records on a failure: a directory of this launch's own
// (under the user's DTRAIN_FLIGHT_DIR if set, else /tmp), so the report never shows records
// of an earlier start; empty when it cannot be made.
std::string make_flight_dir() {
  const char* env = std::getenv("DTRAIN_FLIGHT_DIR");
  std::string tmpl =
      (env != nullptr && *env != '\0' ? std::string(env) : std::string("/tmp")) + "/dtrain-flight-XXXXXX";
  return ::mkdtemp(tmpl.data()) != nullptr ? tmpl : std::string();
}

// One run_launch, in phases that run() calls in order:
//   start          the CPU binding, the secret, node 0's store, the signal handlers, the flight
//                  directory (the constructor), then every local worker
//   supervise      until every worker ended and its output is drained: signals forwarded,
//                  output prefixed, exits reaped, the first failure stopping the rest
//   report         the workers' exits, who failed first, the flight records' summary
//   finish_nodes   several nodes: node 0's store outlives the others' last use of it
class Launch {
 public:
  explicit Launch(const LaunchOptions& o);
  LaunchResult run();

 private:
  void install_signal_handlers();
  void restore_signals();
  void start_workers();
  void start_worker(int local);
  [[noreturn]] void exec_worker(const Worker& w, int local, const int out[2], const int err[2],
                                const sigset_t& previous) const;
  [[noreturn]] void abandon_started(const std::string& why);

  void supervise();
  void forward_signals();
  void check_interrupt();
  void pump_output();
  void read_output(Worker& w, int* fd) const;
  std::vector<Worker*> reap_exits();
  void fail_early_exits(std::vector<Worker*>& failed_now);
  void stop_for_failures(std::vector<Worker*>& failed_now);
  void terminate();
  void terminate_when_recorded();
  bool output_drained();
  void stop_all(int sig);
  SteadyClock::time_point grace_deadline() const;
  bool store_has(const std::string& key);
  void store_set(const std::string& key, const std::string& value);
  bool joined(int rank) { return store_has(fmt::format("{}/joined/{}", world_name_, rank)); }
  bool left(int rank) { return store_has(fmt::format("{}/left/{}", world_name_, rank)); }

  void report();
  void explain_from_flight_records();
  std::map<int, RankFate> rank_fates(const std::vector<FlightRecord>& records);
  void finish_nodes();

  const LaunchOptions& o_;
  std::vector<cpu_set_t> cpus_;  // of each local worker; empty: no binding
  int job_cpus_ = 0;
  std::string secret_;
  std::unique_ptr<comm::TcpStoreServer> server_;
  int port_ = 0;
  struct sigaction old_int_ {
  }, old_term_{};
  std::optional<JobFile> job_file_;  // for dtrain status, while this launcher serves the store
  std::string flight_dir_;
  bool keep_flight_dir_ = false;
  int world_ = 0;
  std::vector<Worker> workers_;
  pid_t launcher_pid_ = 0;

  LaunchResult result_;
  bool stopping_ = false;
  SteadyClock::time_point stop_deadline_ = SteadyClock::time_point::max();
  SteadyClock::time_point terminate_at_ = SteadyClock::time_point::max();  // after a failure (stop_for_failures)
  int received_signal_ = 0;
  SteadyClock::time_point all_exited_at_ = SteadyClock::time_point::max();
  // Whether a worker that exited 0 had finished: dtrain's world groups record in the store when
  // a rank joins (before its rendezvous) and when it leaves (its world closed cleanly). Asked
  // through a connection of our own, opened when first needed; plain programs never join, and
  // their exit 0 is a success as before.
  std::string world_name_;
  std::shared_ptr<comm::Store> probe_;
  bool probe_failed_ = false;
  SteadyClock::time_point next_early_check_;
};

Launch::Launch(const LaunchOptions& o) : o_(o) {
  // CPUs for each local worker (empty: no binding); a bad --bind fails here, before anything
  // (store, signal handlers, flight directory) exists.
  cpus_ = worker_cpus(o_);
  for (const cpu_set_t& c : cpus_) job_cpus_ += CPU_COUNT(&c);
  secret_ = job_secret(o_);
  // Node 0 hosts the rendezvous store for the whole job.
  port_ = o_.master_port;
  if (o_.node_rank == 0 && o_.serve_store) {
    server_ = std::make_unique<comm::TcpStoreServer>(o_.master_addr, static_cast<uint16_t>(port_), secret_);
    port_ = server_->port();
    job_file_.emplace(
        JobInfo{::getpid(), o_.master_addr, port_, secret_, fmt::format("{}", fmt::join(o_.command, " ")),
                std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count(), ""});
  }
  install_signal_handlers();
  // Removed after a clean run, kept (and named) after a failure.
  flight_dir_ = make_flight_dir();
  world_ = o_.nnodes * o_.nproc_per_node;
  world_name_ = o_.run_id.empty() ? std::string("world") : "world@" + o_.run_id;
}

LaunchResult Launch::run() {
  start_workers();
  supervise();
  report();
  finish_nodes();
  return result_;
}

// ------------------------------------------------------------------ starting

void Launch::install_signal_handlers() {
  DT_CHECK(::pipe2(g_signal_pipe, O_CLOEXEC | O_NONBLOCK) == 0, "launch", "pipe: {}", std::strerror(errno));
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, &old_int_);
  sigaction(SIGTERM, &sa, &old_term_);
}

// The handlers back and the signal pipe closed: at the end, or when starting workers failed.
void Launch::restore_signals() {
  sigaction(SIGINT, &old_int_, nullptr);
  sigaction(SIGTERM, &old_term_, nullptr);
  ::close(g_signal_pipe[0]);
  ::close(g_signal_pipe[1]);
}

void Launch::start_workers() {
  // dtrain status reads the world's name and size from the store, then each rank's status.
  if (o_.node_rank == 0) {
    store_set(kJobWorldKey, nlohmann::json{{"name", world_name_}, {"size", world_}}.dump());
  }
  workers_.resize(static_cast<size_t>(o_.nproc_per_node));
  launcher_pid_ = ::getpid();
  for (int local = 0; local < o_.nproc_per_node; ++local) start_worker(local);
}

// Forks local worker `local` with its output on two pipes of ours.
void Launch::start_worker(int local) {
  Worker& w = workers_[static_cast<size_t>(local)];
  w.rank = o_.node_rank * o_.nproc_per_node + local;
  int out[2] = {-1, -1}, err[2] = {-1, -1};
  if (::pipe2(out, O_CLOEXEC) != 0 || ::pipe2(err, O_CLOEXEC) != 0) {
    const int e = errno;
    for (int fd : {out[0], out[1], err[0], err[1]}) {
      if (fd >= 0) ::close(fd);
    }
    abandon_started(fmt::format("cannot create the pipes for a worker's output: {}", std::strerror(e)));
  }
  // A child inherits our handler, which reports signals through our pipe: a SIGTERM that
  // reaches it before it restored the default would look like one sent to the launcher.
  // Block the signals across the fork; the child unblocks them after restoring defaults.
  sigset_t block{}, previous{};
  sigemptyset(&block);
  sigaddset(&block, SIGINT);
  sigaddset(&block, SIGTERM);
  ::sigprocmask(SIG_BLOCK, &block, &previous);
  const pid_t pid = ::fork();
  if (pid == 0) exec_worker(w, local, out, err, previous);
  const int fork_errno = errno;
  ::sigprocmask(SIG_SETMASK, &previous, nullptr);
  if (pid < 0) {
    for (int fd : {out[0], out[1], err[0], err[1]}) ::close(fd);
    abandon_started(fmt::format("fork failed: {}", std::strerror(fork_errno)));
  }
  ::setpgid(pid, pid);  // also here: whichever runs first wins the race
  ::close(out[1]);
  ::close(err[1]);
  w.pid = pid;
  w.out_fd = out[0];
  w.err_fd = err[0];
  w.running = true;
  w.exit.rank = w.rank;
  w.exit.pid = pid;
}

// In the child: its signals, process group, output, CPUs and environment, then the command.
void Launch::exec_worker(const Worker& w, int local, const int out[2], const int err[2],
                         const sigset_t& previous) const {
  // A worker never outlives its launcher, whatever the heartbeat setting: killed with it
  // (and at once if the launcher died before this line).
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != launcher_pid_) ::_exit(128 + SIGKILL);
  ::signal(SIGINT, SIG_DFL);
  ::signal(SIGTERM, SIG_DFL);
  ::sigprocmask(SIG_SETMASK, &previous, nullptr);
  ::setpgid(0, 0);  // its own process group, so stopping a worker stops its children too
  ::dup2(out[1], STDOUT_FILENO);
  ::dup2(err[1], STDERR_FILENO);
  if (!cpus_.empty()) {
    (void)::sched_setaffinity(0, sizeof(cpu_set_t), &cpus_[static_cast<size_t>(local)]);
    ::setenv("DTRAIN_JOB_CPUS", std::to_string(job_cpus_).c_str(), 1);  // not its slice: see shm::job_cores
  }
  ::setenv("RANK", std::to_string(w.rank).c_str(), 1);
  ::setenv("WORLD_SIZE", std::to_string(world_).c_str(), 1);
  ::setenv("LOCAL_RANK", std::to_string(local).c_str(), 1);
  ::setenv("LOCAL_WORLD_SIZE", std::to_string(o_.nproc_per_node).c_str(), 1);
  ::setenv("NODE_RANK", std::to_string(o_.node_rank).c_str(), 1);
  ::setenv("MASTER_ADDR", o_.master_addr.c_str(), 1);
  ::setenv("MASTER_PORT", std::to_string(port_).c_str(), 1);
  ::setenv("DTRAIN_SECRET", secret_.c_str(), 1);
  ::setenv("DTRAIN_STORE_HOSTED", "1", 1);
  if (!flight_dir_.empty()) ::setenv("DTRAIN_FLIGHT_DIR", flight_dir_.c_str(), 1);
  if (!o_.run_id.empty()) ::setenv("DTRAIN_RUN_ID", o_.run_id.c_str(), 1);
  std::vector<char*> argv;
  for (const auto& a : o_.command) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  ::execvp(argv[0], argv.data());
  std::fprintf(stderr, "dtrain launch: cannot execute '%s': %s\n", argv[0], std::strerror(errno));
  ::_exit(127);
}

// Starting a worker can fail (no file descriptors for its pipes, no processes left): the
// workers started so far are stopped and reaped before the error leaves, never orphaned.
void Launch::abandon_started(const std::string& why) {
  for (auto& w : workers_) {
    if (w.pid <= 0) continue;
    ::kill(-w.pid, SIGKILL);
    ::kill(w.pid, SIGKILL);
    int status = 0;
    (void)::waitpid(w.pid, &status, 0);
    remove_shm_of(w.pid);
    if (w.out_fd >= 0) ::close(w.out_fd);
    if (w.err_fd >= 0) ::close(w.err_fd);
  }
  restore_signals();
  if (!flight_dir_.empty()) remove_directory(flight_dir_);
  int started = 0;
  for (const auto& w : workers_) started += w.pid > 0 ? 1 : 0;
  DT_THROW("launch", "{} (while starting worker {} of {}); the {} already started were stopped", why, started + 1,
           o_.nproc_per_node, started);
}

// ------------------------------------------------------------------ supervising

void Launch::supervise() {
  next_early_check_ = SteadyClock::now();
  while (true) {
    std::vector<pollfd> fds;
    fds.push_back({g_signal_pipe[0], POLLIN, 0});
    for (auto& w : workers_) {
      if (w.out_fd >= 0) fds.push_back({w.out_fd, POLLIN, 0});
      if (w.err_fd >= 0) fds.push_back({w.err_fd, POLLIN, 0});
    }
    ::poll(fds.data(), fds.size(), 100);
    forward_signals();
    check_interrupt();
    pump_output();
    // Exits: reap every worker that ended, then decide.
    std::vector<Worker*> failed_now = reap_exits();
    fail_early_exits(failed_now);
    stop_for_failures(failed_now);
    terminate_when_recorded();
    if (stopping_ && SteadyClock::now() > stop_deadline_) {
      stop_all(SIGKILL);
      stop_deadline_ = SteadyClock::time_point::max();
    }
    if (output_drained()) break;
  }
}

// Signals to the launcher: forwarded to the workers, escalated after the grace period.
void Launch::forward_signals() {
  char c;
  while (::read(g_signal_pipe[0], &c, 1) == 1) {
    received_signal_ = static_cast<unsigned char>(c);  // a signal number, 1..64
    if (!stopping_) {
      stopping_ = true;
      stop_deadline_ = grace_deadline();
    }
    stop_all(c);
  }
}

// Asked to stop from outside (elastic: another node failed or wants to join).
void Launch::check_interrupt() {
  if (!o_.interrupt || stopping_ ||
      std::none_of(workers_.begin(), workers_.end(), [](const Worker& w) { return w.running; })) {
    return;
  }
  const std::string why = o_.interrupt();
  if (why.empty()) return;
  stopping_ = true;
  result_.interrupted = true;
  result_.report += why + "\n";
  stop_deadline_ = grace_deadline();
  stop_all(SIGTERM);
  stop_all(SIGCONT);
}

void Launch::pump_output() {
  for (auto& w : workers_) {
    for (int* fd : {&w.out_fd, &w.err_fd}) read_output(w, fd);
  }
}

// What worker `w` wrote on *fd (its stdout or stderr pipe) since the last look, passed on in
// whole lines with its rank's prefix; at the end of the stream, the rest, and *fd closed.
void Launch::read_output(Worker& w, int* fd) const {
  if (*fd < 0) return;
  pollfd p{*fd, POLLIN, 0};
  if (::poll(&p, 1, 0) <= 0) return;
  char buf[65536];
  const ssize_t n = ::read(*fd, buf, sizeof(buf));
  std::string& acc = fd == &w.out_fd ? w.out_buf : w.err_buf;
  const int target = fd == &w.out_fd ? STDOUT_FILENO : STDERR_FILENO;
  const std::string prefix = o_.prefix_output ? fmt::format("[rank {}] ", w.rank) : "";
  bool* split = fd == &w.out_fd ? &w.out_split : &w.err_split;
  if (n > 0) {
    acc.append(buf, static_cast<size_t>(n));
    flush_lines(acc, target, prefix, false, split);
  } else if (n == 0 || (errno != EINTR && errno != EAGAIN)) {
    flush_lines(acc, target, prefix, true);
    ::close(*fd);
    *fd = -1;
  }
}

// The workers that ended since the last look and failed: exited non-zero, killed by a signal,
// or exited 0 after joining the world without leaving it. Those that exited 0 before joining
// are marked (fail_early_exits decides about them).
std::vector<Worker*> Launch::reap_exits() {
  std::vector<Worker*> failed_now;
  for (auto& w : workers_) {
    if (!w.running) continue;
    int status = 0;
    if (::waitpid(w.pid, &status, WNOHANG) != w.pid) continue;
    w.running = false;
    remove_shm_of(w.pid);
    if (WIFSIGNALED(status)) {
      w.exit.signal = WTERMSIG(status);
    } else {
      w.exit.exit_code = WEXITSTATUS(status);
    }
    if (w.exit.signal != 0 || w.exit.exit_code != 0) {
      failed_now.push_back(&w);
    } else if (!stopping_ && !result_.interrupted) {
      if (!joined(w.rank)) {
        w.exited_before_joining = true;  // a failure as soon as another rank joins (below)
      } else if (!left(w.rank)) {
        w.exit.early = true;
        w.exit.why =
            "before the job ended: it joined the job's world but never left it (its peers would wait "
            "for it until their timeout)";
        failed_now.push_back(&w);
      }
    }
  }
  return failed_now;
}

// A worker that exited 0 before joining fails the job once any rank joined: they would wait
// for it at the rendezvous until the timeout.
void Launch::fail_early_exits(std::vector<Worker*>& failed_now) {
  if (stopping_ || result_.interrupted || SteadyClock::now() < next_early_check_ ||
      std::none_of(workers_.begin(), workers_.end(),
                   [](const Worker& w) { return w.exited_before_joining && !w.exit.early; })) {
    return;
  }
  next_early_check_ = SteadyClock::now() + std::chrono::milliseconds(250);
  std::vector<int> waiting;
  for (int r = 0; r < world_ && waiting.size() < 8; ++r) {
    if (joined(r)) waiting.push_back(r);
  }
  if (waiting.empty()) return;
  for (auto& w : workers_) {
    if (!w.exited_before_joining || w.exit.early) continue;
    w.exit.early = true;
    w.exit.why = fmt::format("before joining the job, while rank{} {} joined and wait{} for it at the rendezvous",
                             waiting.size() > 1 ? "s" : "", fmt::join(waiting, ", "), waiting.size() > 1 ? "" : "s");
    failed_now.push_back(&w);
  }
}

// The first failure stops the job. Its cause is among the workers that failed on their own
// before the launcher stopped anyone: a worker killed by a signal is the cause rather than the
// peers that raised because it died (they often end within the same poll interval).
void Launch::stop_for_failures(std::vector<Worker*>& failed_now) {
  if (failed_now.empty() || stopping_ || result_.interrupted) return;
  stopping_ = true;
  std::stable_sort(failed_now.begin(), failed_now.end(),
                   [](const Worker* a, const Worker* b) { return (a->exit.signal != 0) > (b->exit.signal != 0); });
  const bool any_signal = failed_now.front()->exit.signal != 0;
  for (Worker* w : failed_now) {
    if (any_signal && w->exit.signal == 0) break;
    result_.first_failed.push_back(w->rank);
  }
  for (Worker* w : failed_now) result_.report += describe(w->exit) + "\n";
  // The others see the failure within milliseconds (a dead peer, an aborted group, their own
  // timeout a moment later) and write their flight records, which the root cause needs: a
  // SIGTERM now would often come first. Wait for them, briefly (terminate_when_recorded).
  if (!flight_dir_.empty()) {
    terminate_at_ = SteadyClock::now() + kRecordWait;
    return;
  }
  terminate();
}

// The survivors asked to stop (SIGTERM, escalated at the grace deadline).
void Launch::terminate() {
  terminate_at_ = SteadyClock::time_point::max();
  stop_deadline_ = grace_deadline();
  stop_all(SIGTERM);
  stop_all(SIGCONT);  // a stopped (hung) worker takes its SIGTERM now, not at the SIGKILL
}

// After a failure: every running worker wrote its flight record, or kRecordWait passed.
void Launch::terminate_when_recorded() {
  if (terminate_at_ == SteadyClock::time_point::max()) return;
  const bool recorded = std::all_of(workers_.begin(), workers_.end(), [&](const Worker& w) {
    return !w.running || ::access(fmt::format("{}/rank-{}.json", flight_dir_, w.rank).c_str(), F_OK) == 0;
  });
  if (recorded || SteadyClock::now() >= terminate_at_) terminate();
}

// True when every worker exited and its output is read. Every worker exited but something
// they started still holds their output: stop reading after a grace period instead of waiting
// on it forever.
bool Launch::output_drained() {
  bool running = false, open = false;
  for (auto& w : workers_) {
    running = running || w.running;
    open = open || w.out_fd >= 0 || w.err_fd >= 0;
  }
  if (!running && !open) return true;
  if (!running && all_exited_at_ == SteadyClock::time_point::max()) all_exited_at_ = SteadyClock::now();
  if (!running && SteadyClock::now() - all_exited_at_ > std::chrono::seconds(2)) {
    for (auto& w : workers_) {
      for (int* fd : {&w.out_fd, &w.err_fd}) {
        if (*fd >= 0) {
          ::close(*fd);
          *fd = -1;
        }
      }
    }
    return true;
  }
  return false;
}

// Signals each running worker's process group (the worker and anything it started). A
// reaped worker is never signalled: its pid may already belong to someone else.
void Launch::stop_all(int sig) {
  for (auto& w : workers_) {
    if (w.running) {
      ::kill(-w.pid, sig);
      w.exit.stopped_by_launcher = true;
    }
  }
}

// When workers asked to stop (SIGTERM) are killed (SIGKILL).
SteadyClock::time_point Launch::grace_deadline() const {
  return SteadyClock::now() + std::chrono::milliseconds(static_cast<int64_t>(o_.grace_seconds * 1000));
}

bool Launch::store_has(const std::string& key) {
  for (int attempt = 0; !probe_failed_; ++attempt) {
    try {
      if (!probe_) {
        probe_ =
            comm::connect_tcp_store(o_.master_addr, static_cast<uint16_t>(port_), secret_, std::chrono::seconds(5));
      }
      return probe_->try_get(key).has_value();
    } catch (const std::exception& e) {
      probe_.reset();
      if (attempt == 0) continue;  // once more on a fresh connection
      probe_failed_ = true;        // no store to ask: exits are judged by their codes alone
      std::fprintf(stderr, "dtrain launch: cannot ask the store whether workers finished: %s\n", e.what());
    }
  }
  return false;
}

void Launch::store_set(const std::string& key, const std::string& value) {
  try {
    if (!probe_) {
      probe_ = comm::connect_tcp_store(o_.master_addr, static_cast<uint16_t>(port_), secret_, std::chrono::seconds(5));
    }
    probe_->set(key, value);
  } catch (const std::exception& e) {
    probe_.reset();
    std::fprintf(stderr, "dtrain launch: cannot publish the job's world for dtrain status: %s\n", e.what());
  }
}

// ------------------------------------------------------------------ the end

// Every worker's exit in the result, the exit code, and for a failure the report.
void Launch::report() {
  restore_signals();
  for (auto& w : workers_) {
    result_.workers.push_back(w.exit);
    if (w.exit.signal != 0 || w.exit.exit_code != 0 || w.exit.early) result_.exit_code = 1;
  }
  result_.received_signal = received_signal_;
  if (received_signal_ != 0) {
    result_.report += fmt::format("stopped by signal {} ({})\n", received_signal_, ::strsignal(received_signal_));
    result_.exit_code = 128 + received_signal_;
  }
  if (result_.exit_code != 0) {
    // A worker that a signal from outside killed (kill -9, the OOM killer, a crash) is the cause
    // rather than a peer that raised because it died, even when the peer's exit was seen in an
    // earlier poll (a loaded machine): elastic restarts count failures by these ranks.
    std::vector<int> killed;
    for (const auto& w : result_.workers) {
      if (w.signal != 0 && !w.stopped_by_launcher) killed.push_back(w.rank);
    }
    const bool blames_killed = std::any_of(result_.first_failed.begin(), result_.first_failed.end(),
                                           [&](int r) { return std::count(killed.begin(), killed.end(), r) > 0; });
    if (!killed.empty() && !blames_killed) result_.first_failed = killed;
    for (const auto& w : result_.workers) {
      if (result_.report.find(fmt::format("rank {} (pid {})", w.rank, w.pid)) == std::string::npos) {
        result_.report += describe(w) + "\n";
      }
    }
    // An interrupt is not a failure to explain.
    if (!flight_dir_.empty() && !result_.interrupted) explain_from_flight_records();
  }
  if (!flight_dir_.empty() && !keep_flight_dir_) remove_directory(flight_dir_);
}

// The first to exit noticed a silent rank: that rank is the one that failed. The one-line root
// cause (root_cause.h) goes first in the report, then the records' summary; their directory is
// kept for the user.
void Launch::explain_from_flight_records() {
  const std::vector<FlightRecord> records = read_flight_records(flight_dir_);
  bool stalled = false;  // its heartbeat thread beat on, but its work stood still
  const int hung = silent_rank(records, &stalled);
  if (hung >= 0) {
    const bool ours = std::any_of(result_.workers.begin(), result_.workers.end(),
                                  [hung](const WorkerExit& w) { return w.rank == hung; });
    if (ours) {
      result_.first_failed = {hung};
      result_.report += fmt::format("rank {} {}: it is the failed worker\n", hung,
                                    stalled ? "made no progress (hung)" : "sent no heartbeats (stopped or hung)");
    }
  }
  std::string cause = root_cause(records, rank_fates(records), hung, stalled);
  if (cause.empty()) {
    for (const auto& w : result_.workers) {
      if (!result_.first_failed.empty() && w.rank == result_.first_failed.front()) cause = describe(w);
    }
  }
  if (!cause.empty()) {
    result_.cause = cause;
    result_.report = fmt::format("root cause: {}\n", cause) + result_.report;
  }
  const std::string summary = flight_summary(records);
  if (!summary.empty()) {
    result_.report += fmt::format("flight records ({}):\n{}", flight_dir_, summary);
    keep_flight_dir_ = true;  // for the user
    result_.flight_dir = flight_dir_;
  }
}

// How each rank ended, and for those that left no flight record, the last thing their live
// status said (published with their heartbeats).
std::map<int, RankFate> Launch::rank_fates(const std::vector<FlightRecord>& records) {
  std::map<int, RankFate> fates;
  for (const auto& w : result_.workers) {
    RankFate& f = fates[w.rank];
    const std::string full = describe(w), prefix = fmt::format("rank {} (pid {}) ", w.rank, w.pid);
    f.ended = full.starts_with(prefix) ? full.substr(prefix.size()) : full;
    f.stopped_by_launcher = w.stopped_by_launcher;
    const bool recorded = std::any_of(records.begin(), records.end(), [&](const FlightRecord& r) {
      return r.path.ends_with(fmt::format("/rank-{}.json", w.rank));
    });
    if (recorded || probe_failed_) continue;
    try {
      if (!probe_) {
        probe_ =
            comm::connect_tcp_store(o_.master_addr, static_cast<uint16_t>(port_), secret_, std::chrono::seconds(2));
      }
      const auto text = probe_->try_get(fmt::format("{}/status/{}", world_name_, w.rank));
      const nlohmann::json st = text ? nlohmann::json::parse(*text, nullptr, false) : nlohmann::json();
      if (st.is_object() && !st.value("what", "").empty()) {
        f.last_status = fmt::format("'{}'{}", st.value("what", ""),
                                    st.value("step", -1) >= 0 ? fmt::format(" at step {}", st.value("step", -1)) : "");
      }
    } catch (const std::exception&) {
      probe_.reset();
      probe_failed_ = true;
    }
  }
  return fates;
}

// Several nodes: node 0 serves the store, so after a clean run it stays until the other
// nodes' workers finished too (their heartbeats and last calls still reach the store).
void Launch::finish_nodes() {
  if (o_.nnodes <= 1 || !o_.serve_store || result_.exit_code != 0) return;
  try {
    auto store =
        comm::connect_tcp_store(o_.master_addr, static_cast<uint16_t>(port_), secret_, std::chrono::seconds(10));
    finish_together(*store, "launch/done", o_.nnodes, server_ != nullptr);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dtrain launch: node %d could not report its end to the store: %s\n", o_.node_rank, e.what());
  }
}

}  // namespace

LaunchResult run_launch(const LaunchOptions& o) {
  check_options(o);
  Launch launch(o);
  return launch.run();
}

}  // namespace dtrain::launch
