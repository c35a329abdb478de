// DTRAIN_FAULT inside a PyTorch job: the faults `dtrain train` injects (src/train/trainer.cpp),
// where a torch program's step is invisible to the backend, so a *step* is a collective on the
// default group (the world): KIND:rank=R:step=S[:attempt=A|any][:ms=M], comma-separated, KIND
// one of
//   kill   SIGKILL itself (a crash);
//   stop   SIGSTOP itself (a hung process);
//   delay  sleep M ms (a straggler);
//   exit   exit(0) (a program that ends early).
// Rank R acts when it issues its S-th collective (1-based), before the collective starts; only
// on start A of the job (DTRAIN_RESTART, default 0; attempt=any: every start).
#pragma once

#include <cstdint>
#include <vector>

namespace dtrain::torch_backend {

class FaultPlan {
 public:
  /// This rank's faults from DTRAIN_FAULT; throws dtrain::Error naming a malformed entry.
  static FaultPlan from_env(int rank);
  bool empty() const { return faults_.empty(); }
  /// Called as collective number `n` (1-based) of the world is issued.
  void at_collective(uint64_t n) const;

 private:
  enum class Kind { kill, stop, delay, exit };
  struct Fault {
    Kind kind = Kind::kill;
    uint64_t step = 0;
    int64_t ms = 0;
  };
  std::vector<Fault> faults_;
};

}  // namespace dtrain::torch_backend
