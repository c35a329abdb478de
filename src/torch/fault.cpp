#include "fault.h"

#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

#include "dtrain/core/error.h"
#include "dtrain/core/log.h"

namespace dtrain::torch_backend {

namespace {

using launch::FaultKind;

// A kind's name and whether a torch job can act on it. Every kind is listed (no default), so a
// new one must be decided on here.
struct KindInfo {
  const char* name;
  bool applies;
};
KindInfo info(FaultKind kind) {
  switch (kind) {
    case FaultKind::kill:
      return {"kill", true};
    case FaultKind::stop:
      return {"stop", true};
    case FaultKind::delay:
      return {"delay", true};
    case FaultKind::exit:
      return {"exit", true};
    // At points of dtrain's trainer (its step loop, its loss all_reduce) a torch job does not have.
    case FaultKind::drop:
      return {"drop", false};
    case FaultKind::hang:
      return {"hang", false};
    case FaultKind::skip:
      return {"skip", false};
    case FaultKind::extra:
      return {"extra", false};
    case FaultKind::mismatch:
      return {"mismatch", false};
    // dtrain's trainer flips it in its own gradients; a torch job's gradients are torch's.
    case FaultKind::bitflip:
      return {"bitflip", false};
  }
  return {"?", false};
}

// Refuses `f` of `spec` when a torch job has no point to act on it at.
void check_applies(const std::string& spec, const launch::Fault& f) {
  const KindInfo kind = info(f.kind);
  DT_CHECK(kind.applies, "torch",
           "DTRAIN_FAULT '{}': {} (rank {}, step {}) cannot act in a PyTorch job: use kill, stop, delay or exit "
           "(a step is a collective of the world here)",
           spec, kind.name, f.rank, f.step);
  DT_CHECK(f.phase == launch::FaultPhase::step, "torch",
           "DTRAIN_FAULT '{}': phase={} (rank {}, step {}) means nothing in a PyTorch job, which has no gradient "
           "all_reduce, checkpoint or optimizer step of dtrain's trainer: leave phase out (a step is a collective of "
           "the world here)",
           spec,
           f.phase == launch::FaultPhase::allreduce    ? "allreduce"
           : f.phase == launch::FaultPhase::checkpoint ? "checkpoint"
                                                       : "optimizer",
           f.rank, f.step);
}

}  // namespace

FaultPlan FaultPlan::from_env(int rank) {
  FaultPlan plan;
  const char* spec = std::getenv("DTRAIN_FAULT");
  if (spec == nullptr || *spec == '\0') return plan;
  std::vector<launch::Fault> all;
  try {
    all = launch::parse_all_faults(spec);
  } catch (const Error& e) {
    DT_THROW("torch", "{} (in a PyTorch job a step is a collective of the world; the kinds that apply: {})",
             e.message(), "kill, stop, delay, exit");
  }
  for (const launch::Fault& f : all) check_applies(spec, f);
  plan.faults_ = launch::faults_from_env(rank);
  return plan;
}

void FaultPlan::at_collective(uint64_t n) const {
  for (const launch::Fault& f : faults_) {
    if (static_cast<uint64_t>(f.step) != n) continue;
    switch (f.kind) {
      case FaultKind::kill:
        DT_LOG_WARN("DTRAIN_FAULT: killing this rank (pid {}) at collective {}", ::getpid(), n);
        ::raise(SIGKILL);
        break;
      case FaultKind::stop:
        DT_LOG_WARN("DTRAIN_FAULT: stopping this rank (pid {}, SIGSTOP) at collective {}", ::getpid(), n);
        ::raise(SIGSTOP);
        break;
      case FaultKind::delay:
        DT_LOG_WARN("DTRAIN_FAULT: delaying this rank by {} ms at collective {}", f.ms, n);
        std::this_thread::sleep_for(std::chrono::milliseconds(f.ms));
        break;
      case FaultKind::exit:
        DT_LOG_WARN("DTRAIN_FAULT: this rank (pid {}) exits with code 0 at collective {}", ::getpid(), n);
        std::fflush(nullptr);
        std::_Exit(0);  // not exit(): Python's and torch's threads are still running
      case FaultKind::drop:
      case FaultKind::hang:
      case FaultKind::skip:
      case FaultKind::extra:
      case FaultKind::mismatch:
      case FaultKind::bitflip:
        break;  // refused by from_env
    }
  }
}

}  // namespace dtrain::torch_backend
