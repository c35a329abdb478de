#include "fault.h"

#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <thread>

#include "dtrain/core/error.h"
#include "dtrain/core/log.h"

namespace dtrain::torch_backend {

FaultPlan FaultPlan::from_env(int rank) {
  FaultPlan plan;
  const char* spec = std::getenv("DTRAIN_FAULT");
  if (spec == nullptr || *spec == '\0') return plan;
  const char* restart = std::getenv("DTRAIN_RESTART");
  const int attempt = restart != nullptr ? std::atoi(restart) : 0;
  const std::string all = spec;
  size_t at = 0;
  while (at <= all.size()) {
    const size_t comma = std::min(all.find(',', at), all.size());
    const std::string one = all.substr(at, comma - at);
    at = comma + 1;
    Fault f;
    bool kind_given = false;
    int who = -1, when = 0;
    for (size_t p = 0; p <= one.size();) {
      const size_t colon = std::min(one.find(':', p), one.size());
      const std::string part = one.substr(p, colon - p);
      p = colon + 1;
      const size_t eq = part.find('=');
      const std::string key = part.substr(0, eq), value = eq == std::string::npos ? "" : part.substr(eq + 1);
      try {
        if (!kind_given && (part == "kill" || part == "stop" || part == "delay" || part == "exit")) {
          kind_given = true;
          f.kind = part == "kill"    ? Kind::kill
                   : part == "stop"  ? Kind::stop
                   : part == "delay" ? Kind::delay
                                     : Kind::exit;
        } else if (key == "rank") {
          who = std::stoi(value);
        } else if (key == "step") {
          f.step = std::stoull(value);
        } else if (key == "ms") {
          f.ms = std::stoll(value);
        } else if (key == "attempt") {
          when = value == "any" ? -1 : std::stoi(value);
        } else {
          throw std::invalid_argument(part);
        }
      } catch (const std::exception&) {
        DT_THROW("torch",
                 "DTRAIN_FAULT '{}': cannot read '{}' in a PyTorch job (expected "
                 "kill|stop|delay|exit:rank=R:step=S[:attempt=A|any][:ms=M], S counting the world's collectives)",
                 spec, part);
      }
    }
    DT_CHECK(kind_given && who >= 0 && f.step >= 1, "torch",
             "DTRAIN_FAULT '{}': '{}' needs a kind (kill, stop, delay or exit) first, rank=R and step=S (S >= 1)", spec,
             one);
    DT_CHECK((f.kind == Kind::delay) == (f.ms > 0), "torch",
             "DTRAIN_FAULT '{}': '{}': ms=M (M > 0) goes with delay, and only with delay", spec, one);
    if (who == rank && (when == attempt || when < 0)) plan.faults_.push_back(f);
  }
  return plan;
}

void FaultPlan::at_collective(uint64_t n) const {
  for (const Fault& f : faults_) {
    if (f.step != n) continue;
    switch (f.kind) {
      case Kind::kill:
        DT_LOG_WARN("DTRAIN_FAULT: killing this rank (pid {}) at collective {}", ::getpid(), n);
        ::raise(SIGKILL);
        break;
      case Kind::stop:
        DT_LOG_WARN("DTRAIN_FAULT: stopping this rank (pid {}, SIGSTOP) at collective {}", ::getpid(), n);
        ::raise(SIGSTOP);
        break;
      case Kind::delay:
        DT_LOG_WARN("DTRAIN_FAULT: delaying this rank by {} ms at collective {}", f.ms, n);
        std::this_thread::sleep_for(std::chrono::milliseconds(f.ms));
        break;
      case Kind::exit:
        DT_LOG_WARN("DTRAIN_FAULT: this rank (pid {}) exits with code 0 at collective {}", ::getpid(), n);
        std::fflush(nullptr);
        std::_Exit(0);  // not exit(): Python's and torch's threads are still running
    }
  }
}

}  // namespace dtrain::torch_backend
