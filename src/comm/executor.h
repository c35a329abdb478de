// The progress engine of a group (internal to comm): the only code of a group that owns a
// thread. It runs the group's operations in issue order over one Transport and applies the
// failure rule, so that the collectives, the algorithms and the bootstrap know none of it.
//
// Vocabulary:
//   operation  one call on the group (a collective, a send or a receive), with a Work handle
//              and a sequence number (collectives and point-to-point counted apart: every
//              rank issues the same collectives, so their numbers agree across ranks)
//   body       what an operation does, body(seq, deadline), run by whichever thread holds
//              the transport: the progress thread, or the caller
//   busy       the flag that says a thread holds the transport (one at a time)
//   inline     a blocking call issued while nothing is queued or running runs in the caller's
//              thread without a hand-off (the latency of small collectives); run_inline goes
//              further for the blocking collectives: no Work, no queue entry, no allocation
//   in flight  a send or receive whose body posted it to the transport and returned; it
//              completes later, polled by the thread holding the transport (Transport::test),
//              so later operations start meanwhile
//   failure    any error in a body or a poll breaks the executor: the operation and everything
//              in flight fail with CommError, every later operation fails at once, and unless
//              the transport reported an abort itself, the transport is aborted so that the
//              peers fail too instead of waiting
//   abandon    a Work::wait that gives up aborts the executor, so the operation stops
//              touching the caller's buffers, then waits (bounded) for it to acknowledge
#pragma once

#include <fmt/format.h>

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "dtrain/comm/group.h"
#include "dtrain/comm/transport.h"
#include "flight_record.h"
#include "health.h"

namespace dtrain::comm {

// The completion of one operation, shared by its Work handles and the executor.
struct Work::State {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  std::exception_ptr error;
  std::string op;
  uint64_t seq = 0;
  Duration default_timeout{0};
  std::function<void(const std::string&)> on_abandon;  // aborts the executor when a wait gives up
  std::shared_ptr<detail::FlightRecorder> recorder;
  uint64_t flight_id = UINT64_MAX;

  Clock::time_point finished_at{};

  // `dump`: a failure worth the process's one flight-record dump (not a teardown).
  void finish(std::exception_ptr e, bool dump = true);
};

namespace detail {

class Executor {
 public:
  /// What an operation does, given its sequence number and its deadline (now + timeout when
  /// it starts). Throws TransportError (or any exception) to fail.
  using Body = std::function<void(uint64_t seq, Deadline deadline)>;

  /// Runs the operations of group `group` (for messages), this process being `rank`, over
  /// `transport` (which must outlive the executor), each with `timeout`. `also_abort` (may be
  /// empty) is called with the reason whenever the executor aborts its transport (a failure,
  /// an abandoned wait, abort()), from whichever thread that happens on. Starts the progress
  /// thread.
  Executor(Transport& transport, std::string group, int rank, Duration timeout,
           std::shared_ptr<FlightRecorder> recorder, std::function<void(const std::string&)> also_abort = {});
  /// Runs what is queued, fails what is in flight ("the group was destroyed while it was
  /// pending") and joins the progress thread.
  ~Executor();
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  /// Runs `body` as collective `op` in issue order and returns its Work: inline in the caller
  /// when `blocking` and nothing is queued or running, on the progress thread otherwise.
  /// `bytes` and `root` are for the flight record.
  Work submit(const std::string& op, bool blocking, Body body, size_t bytes = 0, int root = -1);

  /// Posts a send (or receive) of `bytes` bytes to (from) `peer` with `tag`, in issue order.
  /// `blocking`: the post waits for its completion. Otherwise it is left in flight and the
  /// Work completes when the transport says so; posted while nothing is queued or running, it
  /// is posted in the caller's thread and polled a few times there, so a message that fits
  /// the transport's buffers needs no wake-up of the progress thread.
  Work post(bool is_send, void* buffer, size_t bytes, int peer, uint32_t tag, bool blocking);

  /// The latency path of blocking collectives: when nothing is queued or running, runs
  /// body(deadline) right here (no Work, no queue entry, no allocation) with the failure
  /// rule, rethrowing its CommError; false when the executor is not idle (submit instead).
  template <typename F>
  bool run_inline(const char* op, size_t bytes, int peer, F&& body);

  /// Fails every pending and later wait on the transport (and the peers', where the medium
  /// allows), and calls also_abort. Any thread.
  void abort(const std::string& reason);

  /// Whether a failure broke the executor. Read it only where no operation runs (teardown).
  bool broken() const { return broken_ != nullptr; }

  /// For a body running on this executor that waits for an operation of another executor
  /// (the hierarchical all_reduce waits for its sub-groups): waits for `w` until `deadline`
  /// while this executor's sends and receives in flight keep moving (a peer may need them
  /// before it reaches this call). Throws w's error, or TransportError on the deadline.
  void wait_polling(Work& w, Deadline deadline);

  Duration timeout() const { return timeout_; }

 private:
  // A queued operation; a p2p one leaves its request in flight by setting pending_post_.
  struct Task {
    std::shared_ptr<Work::State> state;
    Body body;
  };
  // A send or receive posted to the transport, completed by polling. Only touched by the
  // thread that holds `busy_`.
  struct Inflight {
    RequestId id;
    std::shared_ptr<Work::State> state;
    std::string what;  // "send to rank 2 (tag 5, 64 bytes)"
    Deadline deadline;
    int peer;
  };

  Work dispatch(const std::string& op, bool collective, bool blocking, Body body, size_t bytes, int peer);
  void execute_task(const std::shared_ptr<Work::State>& state, const Body& body);
  void run();  // the progress thread
  // Completes the requests in flight that finished; true if any did. A failure or a passed
  // deadline fails them all and breaks the executor, as a failed collective does.
  bool poll_inflight();
  void fail_inflight(const std::string& why, bool dump = true);
  // Under mu_, after an inline call cleared busy_: whether the progress thread has anything to
  // do. Waking it for nothing costs every small collective a context switch, tens of
  // microseconds when ranks share cores.
  bool progress_needed() const { return !queue_.empty() || inflight_count_ > 0 || waits_for_idle_; }

  // body(deadline) under the failure rule: a broken executor fails at once; a failure breaks
  // it and aborts the transport. Returns the error (null on success).
  template <typename F>
  std::exception_ptr guarded(const char* op, uint64_t seq, Deadline deadline, F&& body);
  std::exception_ptr broken_error(const char* op, uint64_t seq) const;
  std::exception_ptr fail(const char* op, uint64_t seq, const TransportError& e);
  std::exception_ptr fail(const char* op, uint64_t seq, const std::exception& e);
  // run_inline's bookkeeping around the body, out of line.
  bool begin_inline(uint64_t* seq);
  void end_inline(const char* op, uint64_t seq, size_t bytes, int peer, Clock::time_point start,
                  const std::exception_ptr& err);

  Transport& transport_;
  const std::string group_;
  const int rank_;
  const Duration timeout_;
  std::shared_ptr<FlightRecorder> recorder_;
  std::function<void(const std::string&)> also_abort_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Task> queue_;
  bool busy_ = false;            // a thread holds the transport: the progress thread or an inline call
  bool waits_for_idle_ = false;  // the progress thread waits for busy_ to clear
  bool stopping_ = false;
  uint64_t collective_seq_ = 0;  // identical on every rank: all ranks issue the same collectives
  uint64_t p2p_seq_ = 0;
  std::exception_ptr broken_;  // written by the thread holding busy_
  std::deque<Inflight> inflight_;
  size_t inflight_count_ = 0;             // inflight_.size(), readable under mu_
  std::optional<Inflight> pending_post_;  // set by a p2p body that left its request in flight
  std::thread worker_;
};

// CLOCK_MONOTONIC_COARSE, steady_clock's clock read from the last tick, and that tick's length.
std::pair<Clock::time_point, Clock::duration> coarse_now();

template <typename F>
std::exception_ptr Executor::guarded(const char* op, uint64_t seq, Deadline deadline, F&& body) {
  if (broken_) return broken_error(op, seq);
  try {
    body(deadline);
    return nullptr;
  } catch (const TransportError& e) {
    return fail(op, seq, e);
  } catch (const std::exception& e) {
    return fail(op, seq, e);
  }
}

template <typename F>
bool Executor::run_inline(const char* op, size_t bytes, int peer, F&& body) {
  uint64_t seq = 0;
  if (!begin_inline(&seq)) return false;
  // Recorded once it ended (one clock read and one lock on this latency path): a failure or a
  // timeout still ends it, so the record dumped on failure has it. The coarse clock (a third
  // of a precise read: docs/measurements.md) lags by up to one tick: the record's
  // start is at most that early, the deadline is pushed one tick later so that it never
  // comes early.
  const auto [start, tick] = coarse_now();
  std::exception_ptr err;
  {
    const health::WaitScope waiting;
    err = guarded(op, seq, start + tick + timeout_, body);
  }
  end_inline(op, seq, bytes, peer, start, err);
  if (err) std::rethrow_exception(err);
  return true;
}

}  // namespace detail
}  // namespace dtrain::comm
