// DTRAIN_FAULT inside a PyTorch job. The spec is read by the launcher's parser
// (launch::parse_faults, dtrain/launch/fault.h: KIND:rank=R:step=S[:attempt=A|any][:ms=M],
// comma-separated); a torch program's steps are invisible to the backend, so here a *step* is
// a collective on the default group (the world). The kinds that apply:
//   kill   SIGKILL itself (a crash);
//   stop   SIGSTOP itself (a hung process);
//   delay  sleep M ms (a straggler);
//   exit   exit(0) (a program that ends early).
// drop, hang, skip, extra and mismatch, and phase=allreduce|checkpoint|optimizer, act at points of
// dtrain's trainer that a torch job does not have: a spec naming them is refused, on every rank.
// Rank R acts when it issues its S-th collective (1-based), before the collective starts; only
// on start A of the job (DTRAIN_RESTART, default 0; attempt=any: every start).
#pragma once

#include <cstdint>
#include <vector>

#include "dtrain/launch/fault.h"

namespace dtrain::torch_backend {

class FaultPlan {
 public:
  /// This rank's faults from DTRAIN_FAULT; throws dtrain::Error naming a malformed entry or
  /// one that a torch job cannot act on (whichever rank it is for).
  static FaultPlan from_env(int rank);
  bool empty() const { return faults_.empty(); }
  /// Called as collective number `n` (1-based) of the world is issued.
  void at_collective(uint64_t n) const;

 private:
  std::vector<launch::Fault> faults_;
};

}  // namespace dtrain::torch_backend
