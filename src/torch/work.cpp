#include "work.h"

#include <pthread.h>

#include <ATen/core/ivalue.h>
#include <ATen/core/jit_type.h>

namespace dtrain::torch_backend {

PendingWork::PendingWork(int rank, c10d::OpType type, std::chrono::milliseconds timeout,
                         std::weak_ptr<Completer> completer)
    : c10d::Work(rank, type), timeout_(timeout), completer_(std::move(completer)) {}

void PendingWork::finish(std::exception_ptr error) {
  std::call_once(once_, [&] {
    if (!error && epilogue) {
      try {
        epilogue();
      } catch (...) {
        error = std::current_exception();
      }
    }
    c10::intrusive_ptr<c10::ivalue::Future> future;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      completed_ = true;
      exception_ = error;
      future = future_;
      keep.clear();  // dtrain no longer touches them
      epilogue = nullptr;
    }
    cv_.notify_all();
    if (future) mark_future(future, error);
  });
}

void PendingWork::mark_future(const c10::intrusive_ptr<c10::ivalue::Future>& future, const std::exception_ptr& error) {
  if (error) {
    future->setError(error);
  } else {
    future->markCompleted(c10::IValue(outputs));
  }
}

void PendingWork::finish_inline(std::exception_ptr error) { finish(std::move(error)); }

void PendingWork::wait_and_finish() noexcept {
  std::exception_ptr error;
  if (inner.valid()) {
    try {
      inner.wait(timeout_);
    } catch (...) {
      error = std::current_exception();
    }
  }
  finish(error);
}

bool PendingWork::isCompleted() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (completed_) return true;
  }
  std::exception_ptr error;
  try {
    if (inner.valid() && !inner.test()) return false;
  } catch (...) {
    error = std::current_exception();
  }
  finish(error);
  return true;
}

bool PendingWork::isSuccess() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return completed_ && !exception_;
}

std::exception_ptr PendingWork::exception() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return exception_;
}

bool PendingWork::wait(std::chrono::milliseconds timeout) {
  bool done;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    done = completed_;
  }
  if (!done) {
    std::exception_ptr error;
    if (inner.valid()) {
      try {
        inner.wait(timeout > std::chrono::milliseconds::zero() ? timeout : timeout_);
      } catch (...) {
        error = std::current_exception();
      }
    }
    finish(error);
  }
  std::lock_guard<std::mutex> lock(mutex_);
  if (exception_) std::rethrow_exception(exception_);
  return true;
}

void PendingWork::abort() {
  TORCH_CHECK(false, "dtrain: Work.abort() is not supported; a timed-out wait() breaks the group instead");
}

c10::intrusive_ptr<c10::ivalue::Future> PendingWork::getFuture() {
  c10::intrusive_ptr<c10::ivalue::Future> future;
  bool completed;
  std::exception_ptr error;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (future_) return future_;
    future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
    future = future_;
    completed = completed_;
    error = exception_;
  }
  if (completed) {
    mark_future(future, error);
  } else if (auto completer = completer_.lock()) {
    completer->add(c10::intrusive_ptr<PendingWork>::reclaim_copy(this));
  } else {
    wait_and_finish();  // the process group is gone: no thread to hand it to
  }
  return future;
}

Completer::~Completer() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void Completer::add(c10::intrusive_ptr<PendingWork> work) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(work));
    if (!thread_.joinable()) thread_ = std::thread([this] { run(); });
  }
  cv_.notify_one();
}

void Completer::run() {
  ::pthread_setname_np(::pthread_self(), "dtrain-futures");
  while (true) {
    c10::intrusive_ptr<PendingWork> work;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and everything completed
      work = std::move(queue_.front());
      queue_.pop_front();
    }
    work->wait_and_finish();
  }
}

}  // namespace dtrain::torch_backend
