#include "dtrain/launch/launcher.h"

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <sys/prctl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <regex>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "dtrain/comm/store.h"
#include "dtrain/core/error.h"
#include "finish.h"

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
  DT_CHECK(bind == "auto" || bind == "core" || bind == "none", "launch", "--bind '{}' (or DTRAIN_BIND): expected auto, core or none",
           bind);
  cpu_set_t mine;
  CPU_ZERO(&mine);
  if (bind == "none" || ::sched_getaffinity(0, sizeof(mine), &mine) != 0) return {};
  std::vector<LogicalCpu> allowed;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &mine)) allowed.push_back({c, read_topology(c, "physical_package_id"), read_topology(c, "core_id")});
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
constexpr size_t kMaxLine = 64 * 1024;

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
    const std::string note =
        fmt::format("{}(dtrain launch: this output has lines longer than {} bytes; they are split)\n", prefix, kMaxLine);
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

// The flight records the workers dumped on their first failure (DTRAIN_FLIGHT_DIR/rank-R.json),
// in rank order: (path, contents).
struct FlightRecord {
  std::string path, text;
};

std::vector<FlightRecord> read_flight_records(const std::string& dir) {
  std::vector<std::string> files;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (const dirent* e = ::readdir(d)) {
      const std::string name = e->d_name;
      if (name.starts_with("rank-") && name.ends_with(".json")) files.push_back(name);
    }
    ::closedir(d);
  }
  std::sort(files.begin(), files.end(), [](const std::string& a, const std::string& b) {
    return std::strtol(a.c_str() + 5, nullptr, 10) < std::strtol(b.c_str() + 5, nullptr, 10);
  });
  std::vector<FlightRecord> out;
  for (const std::string& name : files) {
    std::ifstream in(dir + "/" + name);
    out.push_back({dir + "/" + name, std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>())});
  }
  return out;
}

// For each rank, the operation it was in (or its last one), so the report says who waited on
// whom. Records that cannot be parsed are named, not fatal.
std::string flight_summary(const std::vector<FlightRecord>& records) {
  std::string out;
  for (const FlightRecord& record : records) {
    const std::string& path = record.path;
    try {
      const nlohmann::json j = nlohmann::json::parse(record.text);
      std::string line;
      for (const auto& g : j.at("groups")) {
        const auto& entries = g.at("entries");
        if (entries.empty()) continue;
        // The oldest operation that did not complete, else the last one.
        const nlohmann::json* pick = &entries.back();
        for (const auto& e : entries) {
          if (e.at("state") != "done") {
            pick = &e;
            break;
          }
        }
        const auto& e = *pick;
        const std::string state = e.at("state");
        const double started = e.at("started_ms_ago").is_number() ? e.at("started_ms_ago").get<double>() : 0.0;
        const double finished = e.at("finished_ms_ago").is_number() ? e.at("finished_ms_ago").get<double>() : 0.0;
        std::string what = fmt::format("{} #{} ({} bytes{}) on group '{}' (rank {} of {}, {})",
                                       e.at("op").get<std::string>(), e.at("seq").get<uint64_t>(),
                                       e.at("bytes").get<uint64_t>(),
                                       e.at("peer").get<int>() >= 0 ? fmt::format(", peer/root {}", e.at("peer").get<int>()) : "",
                                       g.at("group").get<std::string>(), g.at("rank").get<int>(), g.at("size").get<int>(),
                                       g.at("transport").get<std::string>());
        if (state == "done") {
          line += fmt::format("\n    last completed {}", what);
        } else {
          line += fmt::format("\n    {} {} after {:.0f} ms", state, what, std::max(0.0, started - finished));
          if (!e.at("error").get<std::string>().empty()) line += ": " + e.at("error").get<std::string>();
        }
      }
      out += fmt::format("  rank {}:{}\n", j.at("rank").get<std::string>(), line.empty() ? " no operations" : line);
    } catch (const std::exception& e) {
      out += fmt::format("  {}: unreadable flight record ({})\n", path, e.what());
    }
  }
  return out;
}

// A rank that the heartbeats found silent (stopped, hung), named in a worker's flight record;
// -1 if none (*stalled: it made no progress rather than went silent). That rank is the
// failure, not the worker that noticed and exited first.
int silent_rank(const std::vector<FlightRecord>& records, bool* stalled) {
  static const std::regex silent("rank (\\d+) (sent no heartbeat|made no progress)");
  int found = -1;
  for (const FlightRecord& record : records) {
    std::smatch m;
    if (std::regex_search(record.text, m, silent)) {
      found = std::stoi(m[1].str());
      *stalled = m[2].str() == "made no progress";
    }
  }
  return found;
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

LaunchResult run_launch(const LaunchOptions& o) {
  DT_CHECK(!o.command.empty(), "launch", "no command to run (usage: dtrain launch -n N -- PROGRAM ARGS...)");
  DT_CHECK(o.nproc_per_node >= 1 && o.nproc_per_node <= 1024, "launch", "-n {} out of range [1, 1024]",
           o.nproc_per_node);
  DT_CHECK(o.nnodes >= 1 && o.node_rank >= 0 && o.node_rank < o.nnodes, "launch",
           "--node-rank {} out of range for --nnodes {}", o.node_rank, o.nnodes);
  DT_CHECK(o.nnodes == 1 || o.master_port > 0, "launch", "--master-port is required with --nnodes {}", o.nnodes);
  DT_CHECK(o.master_port >= 0 && o.master_port < 65536, "launch", "--master-port {} out of range", o.master_port);
  // CPUs for each local worker (empty: no binding); a bad --bind fails here, before anything
  // (store, signal handlers, flight directory) exists.
  const std::vector<cpu_set_t> cpus = worker_cpus(o);
  int job_cpus = 0;
  for (const cpu_set_t& c : cpus) job_cpus += CPU_COUNT(&c);

  std::string secret = o.secret;
  if (secret.empty()) {
    const char* env = std::getenv("DTRAIN_SECRET");
    DT_CHECK(o.nnodes == 1 || env != nullptr, "launch",
             "multi-node jobs need the same DTRAIN_SECRET on every node (export it before dtrain launch)");
    secret = env != nullptr ? env : comm::make_secret();
  }
  comm::check_secret(secret,
                     o.secret.empty() ? "dtrain launch: DTRAIN_SECRET" : "dtrain launch: LaunchOptions::secret");
  // Node 0 hosts the rendezvous store for the whole job.
  std::unique_ptr<comm::TcpStoreServer> server;
  int port = o.master_port;
  if (o.node_rank == 0 && o.serve_store) {
    server = std::make_unique<comm::TcpStoreServer>(o.master_addr, static_cast<uint16_t>(port), secret);
    port = server->port();
  }

  DT_CHECK(::pipe2(g_signal_pipe, O_CLOEXEC | O_NONBLOCK) == 0, "launch", "pipe: {}", std::strerror(errno));
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  struct sigaction old_int {}, old_term {};
  sigaction(SIGINT, &sa, &old_int);
  sigaction(SIGTERM, &sa, &old_term);
  // The handlers back and the signal pipe closed: at the end, or when starting workers failed.
  auto restore_signals = [&] {
    sigaction(SIGINT, &old_int, nullptr);
    sigaction(SIGTERM, &old_term, nullptr);
    ::close(g_signal_pipe[0]);
    ::close(g_signal_pipe[1]);
  };

  // Where the workers dump their flight records on a failure: a directory of this launch's own
  // (under the user's DTRAIN_FLIGHT_DIR if set, else /tmp), so the report never shows records
  // of an earlier start; removed after a clean run, kept (and named) after a failure.
  std::string flight_dir;
  bool keep_flight_dir = false;
  {
    const char* env = std::getenv("DTRAIN_FLIGHT_DIR");
    std::string tmpl = (env != nullptr && *env != '\0' ? std::string(env) : std::string("/tmp")) + "/dtrain-flight-XXXXXX";
    if (::mkdtemp(tmpl.data()) != nullptr) flight_dir = tmpl;
  }

  const int world = o.nnodes * o.nproc_per_node;
  std::vector<Worker> workers(static_cast<size_t>(o.nproc_per_node));
  const pid_t launcher_pid = ::getpid();
  // Starting a worker can fail (no file descriptors for its pipes, no processes left): the
  // workers started so far are stopped and reaped before the error leaves, never orphaned.
  auto abandon_started = [&](const std::string& why) {
    for (auto& w : workers) {
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
    if (!flight_dir.empty()) remove_directory(flight_dir);
    int started = 0;
    for (const auto& w : workers) started += w.pid > 0 ? 1 : 0;
    DT_THROW("launch", "{} (while starting worker {} of {}); the {} already started were stopped", why, started + 1,
             o.nproc_per_node, started);
  };
  for (int local = 0; local < o.nproc_per_node; ++local) {
    Worker& w = workers[static_cast<size_t>(local)];
    w.rank = o.node_rank * o.nproc_per_node + local;
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
    if (pid == 0) {
      // A worker never outlives its launcher, whatever the heartbeat setting: killed with it
      // (and at once if the launcher died before this line).
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != launcher_pid) ::_exit(128 + SIGKILL);
      ::signal(SIGINT, SIG_DFL);
      ::signal(SIGTERM, SIG_DFL);
      ::sigprocmask(SIG_SETMASK, &previous, nullptr);
      ::setpgid(0, 0);  // its own process group, so stopping a worker stops its children too
      ::dup2(out[1], STDOUT_FILENO);
      ::dup2(err[1], STDERR_FILENO);
      if (!cpus.empty()) {
        (void)::sched_setaffinity(0, sizeof(cpu_set_t), &cpus[static_cast<size_t>(local)]);
        ::setenv("DTRAIN_JOB_CPUS", std::to_string(job_cpus).c_str(), 1);  // not its slice: see shm_collectives
      }
      ::setenv("RANK", std::to_string(w.rank).c_str(), 1);
      ::setenv("WORLD_SIZE", std::to_string(world).c_str(), 1);
      ::setenv("LOCAL_RANK", std::to_string(local).c_str(), 1);
      ::setenv("LOCAL_WORLD_SIZE", std::to_string(o.nproc_per_node).c_str(), 1);
      ::setenv("NODE_RANK", std::to_string(o.node_rank).c_str(), 1);
      ::setenv("MASTER_ADDR", o.master_addr.c_str(), 1);
      ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      ::setenv("DTRAIN_SECRET", secret.c_str(), 1);
      ::setenv("DTRAIN_STORE_HOSTED", "1", 1);
      if (!flight_dir.empty()) ::setenv("DTRAIN_FLIGHT_DIR", flight_dir.c_str(), 1);
      if (!o.run_id.empty()) ::setenv("DTRAIN_RUN_ID", o.run_id.c_str(), 1);
      std::vector<char*> argv;
      for (const auto& a : o.command) argv.push_back(const_cast<char*>(a.c_str()));
      argv.push_back(nullptr);
      ::execvp(argv[0], argv.data());
      std::fprintf(stderr, "dtrain launch: cannot execute '%s': %s\n", argv[0], std::strerror(errno));
      ::_exit(127);
    }
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

  LaunchResult result;
  bool stopping = false;
  auto stop_deadline = std::chrono::steady_clock::time_point::max();
  int received_signal = 0;
  // Signals each running worker's process group (the worker and anything it started). A
  // reaped worker is never signalled: its pid may already belong to someone else.
  auto stop_all = [&](int sig) {
    for (auto& w : workers) {
      if (w.running) {
        ::kill(-w.pid, sig);
        w.exit.stopped_by_launcher = true;
      }
    }
  };
  auto all_exited_at = std::chrono::steady_clock::time_point::max();
  // Whether a worker that exited 0 had finished: dtrain's world groups record in the store when
  // a rank joins (before its rendezvous) and when it leaves (its world closed cleanly). Asked
  // through a connection of our own, opened when first needed; plain programs never join, and
  // their exit 0 is a success as before.
  const std::string world_name = o.run_id.empty() ? std::string("world") : "world@" + o.run_id;
  std::shared_ptr<comm::Store> probe;
  bool probe_failed = false;
  auto store_has = [&](const std::string& key) -> bool {
    for (int attempt = 0; !probe_failed; ++attempt) {
      try {
        if (!probe) {
          probe = comm::connect_tcp_store(o.master_addr, static_cast<uint16_t>(port), secret, std::chrono::seconds(5));
        }
        return probe->try_get(key).has_value();
      } catch (const std::exception& e) {
        probe.reset();
        if (attempt == 0) continue;  // once more on a fresh connection
        probe_failed = true;  // no store to ask: exits are judged by their codes alone
        std::fprintf(stderr, "dtrain launch: cannot ask the store whether workers finished: %s\n", e.what());
      }
    }
    return false;
  };
  auto joined = [&](int rank) { return store_has(fmt::format("{}/joined/{}", world_name, rank)); };
  auto left = [&](int rank) { return store_has(fmt::format("{}/left/{}", world_name, rank)); };
  auto next_early_check = std::chrono::steady_clock::now();

  while (true) {
    std::vector<pollfd> fds;
    fds.push_back({g_signal_pipe[0], POLLIN, 0});
    for (auto& w : workers) {
      if (w.out_fd >= 0) fds.push_back({w.out_fd, POLLIN, 0});
      if (w.err_fd >= 0) fds.push_back({w.err_fd, POLLIN, 0});
    }
    ::poll(fds.data(), fds.size(), 100);
    // Signals: forward, then escalate after the grace period.
    char c;
    while (::read(g_signal_pipe[0], &c, 1) == 1) {
      received_signal = c;
      if (!stopping) {
        stopping = true;
        stop_deadline = std::chrono::steady_clock::now() +
                        std::chrono::milliseconds(static_cast<int64_t>(o.grace_seconds * 1000));
      }
      stop_all(c);
    }
    // Asked to stop from outside (elastic: another node failed or wants to join).
    if (o.interrupt && !stopping &&
        std::any_of(workers.begin(), workers.end(), [](const Worker& w) { return w.running; })) {
      const std::string why = o.interrupt();
      if (!why.empty()) {
        stopping = true;
        result.interrupted = true;
        result.report += why + "\n";
        stop_deadline = std::chrono::steady_clock::now() +
                        std::chrono::milliseconds(static_cast<int64_t>(o.grace_seconds * 1000));
        stop_all(SIGTERM);
        stop_all(SIGCONT);
      }
    }
    // Output.
    for (auto& w : workers) {
      for (int* fd : {&w.out_fd, &w.err_fd}) {
        if (*fd < 0) continue;
        pollfd p{*fd, POLLIN, 0};
        if (::poll(&p, 1, 0) <= 0) continue;
        char buf[65536];
        const ssize_t n = ::read(*fd, buf, sizeof(buf));
        std::string& acc = fd == &w.out_fd ? w.out_buf : w.err_buf;
        const int target = fd == &w.out_fd ? STDOUT_FILENO : STDERR_FILENO;
        const std::string prefix = o.prefix_output ? fmt::format("[rank {}] ", w.rank) : "";
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
    }
    // Exits: reap every worker that ended, then decide. The first failure's cause is among
    // the workers that failed on their own before the launcher stopped anyone: a worker killed
    // by a signal is the cause rather than the peers that raised because it died (they
    // often end within the same poll interval).
    std::vector<Worker*> failed_now;
    for (auto& w : workers) {
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
      } else if (!stopping && !result.interrupted) {
        if (!joined(w.rank)) {
          w.exited_before_joining = true;  // a failure as soon as another rank joins (below)
        } else if (!left(w.rank)) {
          w.exit.early = true;
          w.exit.why = "before the job ended: it joined the job's world but never left it (its peers would wait "
                       "for it until their timeout)";
          failed_now.push_back(&w);
        }
      }
    }
    // A worker that exited 0 before joining fails the job once any rank joined: they would wait
    // for it at the rendezvous until the timeout.
    if (!stopping && !result.interrupted && std::chrono::steady_clock::now() >= next_early_check &&
        std::any_of(workers.begin(), workers.end(), [](const Worker& w) { return w.exited_before_joining && !w.exit.early; })) {
      next_early_check = std::chrono::steady_clock::now() + std::chrono::milliseconds(250);
      std::vector<int> waiting;
      for (int r = 0; r < world && waiting.size() < 8; ++r) {
        if (joined(r)) waiting.push_back(r);
      }
      if (!waiting.empty()) {
        for (auto& w : workers) {
          if (!w.exited_before_joining || w.exit.early) continue;
          w.exit.early = true;
          w.exit.why = fmt::format("before joining the job, while rank{} {} joined and wait{} for it at the rendezvous",
                                   waiting.size() > 1 ? "s" : "", fmt::join(waiting, ", "), waiting.size() > 1 ? "" : "s");
          failed_now.push_back(&w);
        }
      }
    }
    if (!failed_now.empty() && !stopping && !result.interrupted) {
      stopping = true;
      std::stable_sort(failed_now.begin(), failed_now.end(),
                       [](const Worker* a, const Worker* b) { return (a->exit.signal != 0) > (b->exit.signal != 0); });
      const bool any_signal = failed_now.front()->exit.signal != 0;
      for (Worker* w : failed_now) {
        if (any_signal && w->exit.signal == 0) break;
        result.first_failed.push_back(w->rank);
      }
      for (Worker* w : failed_now) result.report += describe(w->exit) + "\n";
      stop_deadline = std::chrono::steady_clock::now() +
                      std::chrono::milliseconds(static_cast<int64_t>(o.grace_seconds * 1000));
      stop_all(SIGTERM);
      stop_all(SIGCONT);  // a stopped (hung) worker takes its SIGTERM now, not at the SIGKILL
    }
    if (stopping && std::chrono::steady_clock::now() > stop_deadline) {
      stop_all(SIGKILL);
      stop_deadline = std::chrono::steady_clock::time_point::max();
    }
    bool running = false, open = false;
    for (auto& w : workers) {
      running = running || w.running;
      open = open || w.out_fd >= 0 || w.err_fd >= 0;
    }
    if (!running && !open) break;
    // Every worker exited but something they started still holds their output: stop reading
    // after a grace period instead of waiting on it forever.
    if (!running && all_exited_at == std::chrono::steady_clock::time_point::max()) {
      all_exited_at = std::chrono::steady_clock::now();
    }
    if (!running && std::chrono::steady_clock::now() - all_exited_at > std::chrono::seconds(2)) {
      for (auto& w : workers) {
        for (int* fd : {&w.out_fd, &w.err_fd}) {
          if (*fd >= 0) {
            ::close(*fd);
            *fd = -1;
          }
        }
      }
      break;
    }
  }

  restore_signals();

  for (auto& w : workers) {
    result.workers.push_back(w.exit);
    if (w.exit.signal != 0 || w.exit.exit_code != 0 || w.exit.early) result.exit_code = 1;
  }
  result.received_signal = received_signal;
  if (received_signal != 0) {
    result.report += fmt::format("stopped by signal {} ({})\n", received_signal, ::strsignal(received_signal));
    result.exit_code = 128 + received_signal;
  }
  if (result.exit_code != 0) {
    for (const auto& w : result.workers) {
      if (result.report.find(fmt::format("rank {} (pid {})", w.rank, w.pid)) == std::string::npos) {
        result.report += describe(w) + "\n";
      }
    }
    if (!flight_dir.empty() && !result.interrupted) {  // an interrupt is not a failure to explain
      const std::vector<FlightRecord> records = read_flight_records(flight_dir);
      // The first to exit noticed a silent rank: that rank is the one that failed.
      bool stalled = false;  // its heartbeat thread beat on, but its work stood still
      if (const int hung = silent_rank(records, &stalled); hung >= 0) {
        const bool ours = std::any_of(result.workers.begin(), result.workers.end(),
                                      [hung](const WorkerExit& w) { return w.rank == hung; });
        if (ours) {
          result.first_failed = {hung};
          result.report += fmt::format("rank {} {}: it is the failed worker\n", hung,
                                       stalled ? "made no progress (hung)" : "sent no heartbeats (stopped or hung)");
        }
      }
      const std::string summary = flight_summary(records);
      if (!summary.empty()) {
        result.report += fmt::format("flight records ({}):\n{}", flight_dir, summary);
        keep_flight_dir = true;  // for the user
      }
    }
  }
  if (!flight_dir.empty() && !keep_flight_dir) remove_directory(flight_dir);
  // Several nodes: node 0 serves the store, so after a clean run it stays until the other
  // nodes' workers finished too (their heartbeats and last calls still reach the store).
  if (o.nnodes > 1 && o.serve_store && result.exit_code == 0) {
    try {
      auto store = comm::connect_tcp_store(o.master_addr, static_cast<uint16_t>(port), secret, std::chrono::seconds(10));
      finish_together(*store, "launch/done", o.nnodes, server != nullptr);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "dtrain launch: node %d could not report its end to the store: %s\n", o.node_rank, e.what());
    }
  }
  return result;
}

}  // namespace dtrain::launch
