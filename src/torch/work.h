// The c10d::Work of the dtrain backend, and the thread that completes futures.
//
// A PendingWork wraps a dtrain comm::Work (invalid when the operation ran in the calling
// thread and is already over) with what the tensors need once it ends: the output tensors
// (result(), the future's value), the buffers dtrain reads and writes (kept alive until it
// is done, even when the caller dropped the Work), and an epilogue that copies results into
// the caller's tensors where they went through a copy. Whoever sees the end first (wait(),
// isCompleted(), or the Completer) runs the epilogue, once, then marks the Work completed.
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include <torch/csrc/distributed/c10d/Work.hpp>

#include "dtrain/comm/group.h"

namespace dtrain::torch_backend {

class Completer;

class PendingWork final : public c10d::Work {
 public:
  PendingWork(int rank, c10d::OpType type, std::chrono::milliseconds timeout, std::weak_ptr<Completer> completer);

  comm::Work inner;                      // the dtrain operation (invalid: finished at issue)
  std::vector<at::Tensor> outputs;       // result() and the future's value
  std::vector<at::Tensor> keep;          // buffers in use by dtrain until it completes
  std::function<void()> epilogue;        // copies results back; runs once, on success

  /// Ends the Work now (an operation that ran in the calling thread): epilogue, then done.
  void finish_inline(std::exception_ptr error);
  /// Waits for the dtrain operation (its own timeout), then finishes; never throws.
  void wait_and_finish() noexcept;

  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  void synchronize() override {}
  std::vector<at::Tensor> result() override { return outputs; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  void abort() override;

 private:
  void finish(std::exception_ptr error);
  void mark_future(const c10::intrusive_ptr<c10::ivalue::Future>& future, const std::exception_ptr& error);

  const std::chrono::milliseconds timeout_;
  std::weak_ptr<Completer> completer_;
  std::once_flag once_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

/// One thread per process group, started by its first future: it waits for the works whose
/// futures were asked for, in issue order, and completes them. Destroying it completes (or
/// times out) every queued work first.
class Completer {
 public:
  Completer() = default;
  ~Completer();
  Completer(const Completer&) = delete;
  Completer& operator=(const Completer&) = delete;
  void add(c10::intrusive_ptr<PendingWork> work);

 private:
  void run();
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<c10::intrusive_ptr<PendingWork>> queue_;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace dtrain::torch_backend
