// The c10d::Work of the dtrain backend, and the thread that completes futures.
//
// A PendingWork wraps a dtrain comm::Work (invalid when the operation ran in the calling
// thread and is already over) with what the tensors need once it ends: the output tensors
// (result(), the future's value), the buffers dtrain reads and writes (kept alive until it
// is done, even when the caller dropped the Work), and an epilogue that copies results into
// the caller's tensors where they went through a copy. Whoever sees the end first (wait(),
// isCompleted(), or the Completer) runs the epilogue, once, then marks the Work completed.
//
// Deferred collectives. torch.distributed's blocking calls are an asynchronous call followed
// at once by wait(): handing each one to dtrain's progress thread would cost every small
// collective two thread hand-offs (tens of microseconds when ranks share cores), while dtrain
// runs a blocking collective in the caller's thread. So a collective that has both forms is
// *deferred*: its Work holds both, and dtrain sees it only when something needs it started.
// wait() with no timeout runs the blocking form in the caller's thread; anything else starts
// the asynchronous form first: the next operation on any dtrain group of the process,
// isCompleted(), getFuture() (DDP's buckets), wait(timeout), or, after one to two
// milliseconds, the process's flusher thread (so an operation nobody waits for still runs,
// and ranks that wait for something else meanwhile cannot deadlock on it).
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <vector>

#include "dtrain/comm/group.h"

namespace dtrain::torch_backend {

class Completer;
class Ordering;

class PendingWork final : public c10d::Work {
 public:
  PendingWork(int rank, c10d::OpType type, std::chrono::milliseconds timeout, std::weak_ptr<Completer> completer);

  comm::Work inner;                 // the dtrain operation (invalid: finished at issue)
  std::vector<at::Tensor> outputs;  // result() and the future's value
  std::vector<at::Tensor> keep;     // buffers in use by dtrain until it completes
  std::function<void()> epilogue;   // copies results back; runs once, on success
  // While deferred (under its Ordering's mutex): the operation's two forms.
  std::function<comm::Work()> start;  // asynchronous: returns dtrain's Work
  std::function<void()> run;          // blocking, in the calling thread

  /// Ends the Work now (an operation that ran in the calling thread): epilogue, then done.
  void finish_inline(std::exception_ptr error);
  /// Waits for the dtrain operation (its own timeout), then finishes; never throws.
  void wait_and_finish() noexcept;
  /// Whether the dtrain operation ended (finishing the Work if so), without starting it.
  bool poll();

  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  void synchronize() override {}
  std::vector<at::Tensor> result() override { return outputs; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  void abort() override;

 private:
  friend class Ordering;
  void finish(std::exception_ptr error);
  void start_if_deferred();

  const std::chrono::milliseconds timeout_;
  std::weak_ptr<Completer> completer_;
  std::shared_ptr<Ordering> ordering_;  // set while (and after) the Work was deferred
  std::once_flag once_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

/// One thread per process group, started by its first future: it waits for the works whose
/// futures were asked for, in issue order, and completes them. Destroying it completes (or
/// times out) every queued work first.
///
/// Futures are completed on this thread only: completing one runs its callbacks there and then
/// (DDP's communication hooks: Python, which takes the GIL), and a work that ends elsewhere may
/// end under an Ordering's mutex (a blocking wait, or the inflight works polled as another
/// starts), while the thread holding the GIL waits for that mutex (getFuture() starts a
/// deferred collective under it). That deadlock stopped one rank of a DDP job now and then.
class Completer {
 public:
  Completer() = default;
  ~Completer();
  Completer(const Completer&) = delete;
  Completer& operator=(const Completer&) = delete;
  void add(c10::intrusive_ptr<PendingWork> work);
  /// Completes `future` with `value` (or `error`) on this thread.
  void complete(c10::intrusive_ptr<c10::ivalue::Future> future, std::exception_ptr error,
                std::vector<at::Tensor> value);
  /// Whether the calling thread is a Completer's.
  static bool on_this_thread();

 private:
  struct Completion {
    c10::intrusive_ptr<c10::ivalue::Future> future;
    std::exception_ptr error;
    std::vector<at::Tensor> value;
  };
  void start_locked();
  void run();
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<c10::intrusive_ptr<PendingWork>> queue_;
  std::deque<Completion> completions_;
  bool stopping_ = false;
  std::thread thread_;
};

/// The order in which one process group's operations reach dtrain, and its deferred
/// collective (see above). `mu` is held while an operation is handed to dtrain, and while a
/// blocking one runs, so that operations reach dtrain in the order they were issued.
class Ordering : public std::enable_shared_from_this<Ordering> {
 public:
  std::mutex mu;

  // Under mu:
  /// Starts the deferred collective, if any.
  void flush();
  /// flush(), then holds `work` (whose start and run are set) until something needs it.
  void defer(const c10::intrusive_ptr<PendingWork>& work);
  /// Hands `work` to dtrain now through `start`, and keeps it until dtrain is done with its
  /// buffers (the caller may drop it, as with isend).
  void start(const c10::intrusive_ptr<PendingWork>& work, std::function<comm::Work()> start);
  bool is_deferred(const PendingWork* work) const { return deferred_.get() == work; }
  /// Takes `work` out of the deferral (the caller runs its blocking form).
  void take() { deferred_.reset(); }
  /// No deferring after this (the process group is going away).
  void close();
  /// The flusher's tick: starts the collective deferred since the last tick; whether one was.
  bool tick();
  /// Drops the works kept for dtrain (once the group stopped touching their buffers).
  void forget_inflight() { inflight_.clear(); }

  /// Registers with the process's flusher thread.
  void enroll();
  /// Flushes the other groups of the process (try-lock: one busy elsewhere is not deferring).
  void flush_others();

 private:
  c10::intrusive_ptr<PendingWork> deferred_;
  uint64_t deferred_seq_ = 0;  // counts deferrals, for the flusher's "seen at its last tick"
  uint64_t seen_seq_ = 0;
  bool closed_ = false;
  std::vector<c10::intrusive_ptr<PendingWork>> inflight_;
};

}  // namespace dtrain::torch_backend
