// Fault injection (DTRAIN_FAULT), for tests and demonstrations of the launcher's restarts and
// the failure detection: a worker crashes, stops, straggles, loses its network, hangs or exits
// early at a chosen step.
//
// DTRAIN_FAULT is a comma-separated list of
// KIND:rank=R:step=S[:phase=step|allreduce|checkpoint|optimizer][:attempt=A][:ms=M]. Rank R acts
// when it starts step S (1-based); with phase=allreduce, after its backward, when the other ranks
// are in (or entering) the gradient all_reduce; with phase=checkpoint, in the middle of writing
// the checkpoint of step S (its file written, the manifest not yet); with phase=optimizer (and
// --offload), in the middle of its optimizer step, after the first chunk of offloaded state was
// updated. KIND is
//   kill   SIGKILL itself (a crash);
//   stop   SIGSTOP itself (a hung process: only the heartbeats can tell);
//   delay  sleep M ms (a straggler: the run goes on unless M exceeds --timeout);
//   drop   shut down every socket it holds (a lost network: store and TCP peers);
//   hang   block its main thread for good, as a read from a stuck file system does, while its
//          heartbeat thread beats on (only the progress watch can tell, comm/progress.h);
//   exit   exit(0) in the middle of the job (a script that returns early: its peers would wait);
//   bitflip  flip one bit of one element of its gradient of its first micro-batch of step S
//          (silent data corruption; `dtrain train --audit K` catches it, docs/determinism.md).
// Three kinds break the order of collectives, at the first collective that the program routes
// through collective_with_faults at or after step S (the trainer: the loss all_reduce of a
// logging step, on the world group):
//   skip      the rank does not call it (its peers wait in it);
//   extra     the rank calls it twice (one call its peers never make);
//   mismatch  the rank calls another collective in its place (a broadcast for an all_reduce).
// A delay is a straggler that still makes progress (it notes progress while it sleeps).
// Only on start A of the job (DTRAIN_RESTART, default 0), so that a restarted job runs through;
// attempt=any fires on every start (a worker that cannot come back).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace dtrain::launch {

/// Where in a step a fault fires.
enum class FaultPhase { step, allreduce, checkpoint, optimizer };
enum class FaultKind { kill, stop, delay, drop, hang, exit, skip, extra, mismatch, bitflip };

struct Fault {
  FaultKind kind = FaultKind::kill;
  int64_t ms = 0;  // delay only
  int rank = -1;
  int64_t step = -1;  // 1-based
  FaultPhase phase = FaultPhase::step;
  int attempt = 0;     // -1: every start
  bool fired = false;  // skip, extra, mismatch: acted on already
};

/// The faults of `spec` (DTRAIN_FAULT's syntax, above) that rank `rank` acts on in start
/// `attempt`; none for an empty spec. Throws dtrain::Error naming the spec and the part that
/// cannot be read.
std::vector<Fault> parse_faults(const std::string& spec, int rank, int attempt);

/// Every fault of `spec`, whatever rank and start it is for (to check a whole spec, as the
/// torch adapter does for the kinds it cannot act on). Throws as parse_faults does.
std::vector<Fault> parse_all_faults(const std::string& spec);

/// parse_faults of DTRAIN_FAULT for the start DTRAIN_RESTART says (default 0).
std::vector<Fault> faults_from_env(int rank);

/// Acts on every one of `faults` planned for `step` at `phase` (kill, exit and hang do not
/// return). Leaves skip, extra and mismatch to collective_with_faults.
void inject_faults(const std::vector<Fault>& faults, int64_t step, FaultPhase phase);

/// Whether a bitflip fault of `faults` is planned for `step` (the trainer flips the bit itself).
bool bitflip_due(const std::vector<Fault>& faults, int64_t step);

/// A collective of the program at `step`: runs `call` once, unless a skip, extra or mismatch
/// fault of `faults` is due (planned at or before `step`, not fired yet): then nothing, `call`
/// twice, or `other` (another collective over the same group) instead. Marks it fired.
void collective_with_faults(std::vector<Fault>& faults, int64_t step, const std::function<void()>& call,
                            const std::function<void()>& other);

}  // namespace dtrain::launch
