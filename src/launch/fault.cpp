// Fault injection (fault.h): reading DTRAIN_FAULT, and acting on it at the trainer's fault points.
#include "dtrain/launch/fault.h"

#include <dirent.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <stdexcept>
#include <thread>

#include "dtrain/comm/progress.h"
#include "dtrain/core/error.h"
#include "dtrain/core/log.h"

namespace dtrain::launch {

namespace {

// Reads one KIND or KEY=VALUE part of a fault into `f`; throws std::exception when it cannot.
void read_part(const std::string& part, Fault& f, bool& kind_given) {
  const size_t eq = part.find('=');
  const std::string key = part.substr(0, eq), value = eq == std::string::npos ? "" : part.substr(eq + 1);
  static const std::pair<const char*, FaultKind> kinds[] = {
      {"kill", FaultKind::kill},      {"stop", FaultKind::stop},   {"delay", FaultKind::delay},
      {"drop", FaultKind::drop},      {"hang", FaultKind::hang},   {"exit", FaultKind::exit},
      {"skip", FaultKind::skip},      {"extra", FaultKind::extra}, {"mismatch", FaultKind::mismatch},
      {"bitflip", FaultKind::bitflip}};
  const auto* kind = std::find_if(std::begin(kinds), std::end(kinds), [&](const auto& k) { return part == k.first; });
  if (!kind_given && kind != std::end(kinds)) {
    kind_given = true;
    f.kind = kind->second;
  } else if (key == "ms") {
    f.ms = std::stoll(value);
  } else if (key == "rank") {
    f.rank = std::stoi(value);
  } else if (key == "step") {
    f.step = std::stoll(value);
  } else if (key == "attempt") {
    f.attempt = value == "any" ? -1 : std::stoi(value);
  } else if (key == "phase" &&
             (value == "step" || value == "allreduce" || value == "checkpoint" || value == "optimizer")) {
    f.phase = value == "step"         ? FaultPhase::step
              : value == "allreduce"  ? FaultPhase::allreduce
              : value == "checkpoint" ? FaultPhase::checkpoint
                                      : FaultPhase::optimizer;
  } else {
    throw std::invalid_argument(part);
  }
}

// One fault of `spec`: its colon-separated parts.
Fault parse_fault(const std::string& spec, const std::string& one) {
  Fault f;
  bool kind_given = false;
  size_t p = 0;
  while (p <= one.size()) {
    const size_t colon = std::min(one.find(':', p), one.size());
    const std::string part = one.substr(p, colon - p);
    p = colon + 1;
    try {
      read_part(part, f, kind_given);
    } catch (const std::exception&) {
      DT_THROW(
          "train",
          "DTRAIN_FAULT '{}': cannot read '{}' (expected "
          "kill|stop|delay|drop|hang|exit|skip|extra|mismatch|bitflip:rank=R:step=S[:phase=step|allreduce|checkpoint|"
          "optimizer]"
          "[:attempt=A|any][:ms=M])",
          spec, part);
    }
  }
  DT_CHECK(kind_given && f.rank >= 0 && f.step >= 1, "train",
           "DTRAIN_FAULT '{}': '{}' needs a kind (kill, stop, delay, drop, hang, exit, skip, extra, mismatch or "
           "bitflip) first, "
           "rank=R and step=S (S >= 1)",
           spec, one);
  DT_CHECK((f.kind == FaultKind::delay) == (f.ms > 0), "train",
           "DTRAIN_FAULT '{}': '{}': ms=M (M > 0) goes with delay, and only with delay", spec, one);
  return f;
}

// Shuts down every socket of this process: its connections to the store and to TCP peers
// break as if the network went away (the peers read end-of-stream, later writes fail).
void drop_connections() {
  DIR* dir = ::opendir("/proc/self/fd");
  if (dir == nullptr) return;
  std::vector<int> fds;
  while (const dirent* e = ::readdir(dir)) {
    if (e->d_name[0] != '.') fds.push_back(std::atoi(e->d_name));
  }
  ::closedir(dir);
  for (int fd : fds) {
    struct stat st {};
    if (::fstat(fd, &st) == 0 && S_ISSOCK(st.st_mode)) ::shutdown(fd, SHUT_RDWR);
  }
}

// A straggler: sleeps `ms`, noting progress (slow, not stuck).
void delay(int64_t ms, int64_t step) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
  while (std::chrono::steady_clock::now() < until) {
    comm::note_progress("a delay (DTRAIN_FAULT)", step);  // slow, not stuck
    std::this_thread::sleep_until(std::min(until, std::chrono::steady_clock::now() + std::chrono::milliseconds(100)));
  }
}

// Blocks the calling thread for good, in a read nobody answers (until the process is stopped).
void hang(int64_t step) {
  comm::note_progress("reading its data (DTRAIN_FAULT hang)", step);
  int fds[2];
  if (::pipe(fds) == 0) {
    char c;
    while (::read(fds[0], &c, 1) != 0) {  // nobody writes: blocks until the process is stopped
    }
  }
}

}  // namespace

std::vector<Fault> parse_all_faults(const std::string& spec) {
  std::vector<Fault> out;
  if (spec.empty()) return out;
  size_t at = 0;
  while (at <= spec.size()) {
    const size_t comma = std::min(spec.find(',', at), spec.size());
    const std::string one = spec.substr(at, comma - at);
    at = comma + 1;
    out.push_back(parse_fault(spec, one));
  }
  return out;
}

std::vector<Fault> parse_faults(const std::string& spec, int rank, int attempt) {
  std::vector<Fault> out;
  for (const Fault& f : parse_all_faults(spec)) {
    if (f.rank == rank && (f.attempt == attempt || f.attempt < 0)) out.push_back(f);
  }
  return out;
}

std::vector<Fault> faults_from_env(int rank) {
  const char* spec = std::getenv("DTRAIN_FAULT");
  if (spec == nullptr || *spec == '\0') return {};
  const char* restart = std::getenv("DTRAIN_RESTART");
  const int attempt = restart != nullptr ? std::atoi(restart) : 0;
  return parse_faults(spec, rank, attempt);
}

void inject_faults(const std::vector<Fault>& faults, int64_t step, FaultPhase phase) {
  static const char* const where[] = {"", " before its gradient all_reduce", " during its checkpoint write",
                                      " in the middle of its optimizer step"};
  for (const Fault& f : faults) {
    if (f.step != step || f.phase != phase) continue;
    const char* at = where[static_cast<int>(phase)];
    switch (f.kind) {
      case FaultKind::kill:
        DT_LOG_WARN("DTRAIN_FAULT: killing this rank (pid {}) at step {}{}", ::getpid(), step, at);
        ::raise(SIGKILL);
        break;
      case FaultKind::stop:
        DT_LOG_WARN("DTRAIN_FAULT: stopping this rank (pid {}, SIGSTOP) at step {}{}", ::getpid(), step, at);
        ::raise(SIGSTOP);
        break;
      case FaultKind::delay:
        DT_LOG_WARN("DTRAIN_FAULT: delaying this rank by {} ms at step {}{}", f.ms, step, at);
        delay(f.ms, step);
        break;
      case FaultKind::exit:
        DT_LOG_WARN("DTRAIN_FAULT: this rank (pid {}) exits with code 0 at step {}{}", ::getpid(), step, at);
        std::exit(0);
      case FaultKind::hang:
        DT_LOG_WARN("DTRAIN_FAULT: hanging this rank's main thread (pid {}) at step {}{}", ::getpid(), step, at);
        hang(step);
        break;
      case FaultKind::drop:
        DT_LOG_WARN("DTRAIN_FAULT: dropping every connection of this rank (pid {}) at step {}{}", ::getpid(), step, at);
        drop_connections();
        break;
      case FaultKind::skip:
      case FaultKind::extra:
      case FaultKind::mismatch:
        break;  // at the program's next collective (collective_with_faults)
      case FaultKind::bitflip:
        break;  // in the gradient, by the trainer (bitflip_due)
    }
  }
}

bool bitflip_due(const std::vector<Fault>& faults, int64_t step) {
  return std::any_of(faults.begin(), faults.end(),
                     [&](const Fault& f) { return f.kind == FaultKind::bitflip && f.step == step; });
}

void collective_with_faults(std::vector<Fault>& faults, int64_t step, const std::function<void()>& call,
                            const std::function<void()>& other) {
  for (Fault& f : faults) {
    const bool order_fault = f.kind == FaultKind::skip || f.kind == FaultKind::extra || f.kind == FaultKind::mismatch;
    if (!order_fault || f.fired || step < f.step) continue;
    f.fired = true;
    switch (f.kind) {
      case FaultKind::skip:
        DT_LOG_WARN("DTRAIN_FAULT: this rank skips a collective at step {}", step);
        return;
      case FaultKind::extra:
        DT_LOG_WARN("DTRAIN_FAULT: this rank calls a collective twice at step {}", step);
        call();
        call();
        return;
      default:
        DT_LOG_WARN("DTRAIN_FAULT: this rank calls another collective in place of its own at step {}", step);
        other();
        return;
    }
  }
  call();
}

}  // namespace dtrain::launch
