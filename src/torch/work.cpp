#include "work.h"

#include <ATen/core/ivalue.h>
#include <ATen/core/jit_type.h>
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <optional>

namespace dtrain::torch_backend {

namespace {

void complete_future(const c10::intrusive_ptr<c10::ivalue::Future>& future, const std::exception_ptr& error,
                     const std::vector<at::Tensor>& value) {
  if (error) {
    future->setError(error);
  } else {
    future->markCompleted(c10::IValue(value));
  }
}

thread_local bool t_completer_thread = false;

}  // namespace

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
    if (!future) return;
    auto completer = completer_.lock();
    if (completer && !Completer::on_this_thread()) {
      completer->complete(future, error, outputs);  // its callbacks on the futures' thread (work.h)
    } else {
      complete_future(future, error, outputs);
    }
  });
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

void PendingWork::start_if_deferred() {
  if (!ordering_) return;
  std::lock_guard<std::mutex> lock(ordering_->mu);
  if (ordering_->is_deferred(this)) ordering_->flush();
}

bool PendingWork::isCompleted() {
  start_if_deferred();
  return poll();
}

bool PendingWork::poll() {
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
  if (ordering_) {
    std::lock_guard<std::mutex> order(ordering_->mu);
    if (ordering_->is_deferred(this)) {
      if (timeout > std::chrono::milliseconds::zero()) {
        ordering_->flush();  // a timeout of its own: only the asynchronous form waits with one
      } else {
        // The blocking form, here, in the order the operations were issued (mu is held).
        ordering_->take();
        const auto blocking = std::move(run);
        start = nullptr;
        std::exception_ptr error;
        try {
          blocking();
        } catch (...) {
          error = std::current_exception();
        }
        finish(error);
      }
    }
  }
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
  start_if_deferred();
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
    complete_future(future, error, outputs);
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

void Completer::start_locked() {
  if (!thread_.joinable()) thread_ = std::thread([this] { run(); });
}

void Completer::add(c10::intrusive_ptr<PendingWork> work) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(work));
    start_locked();
  }
  cv_.notify_one();
}

void Completer::complete(c10::intrusive_ptr<c10::ivalue::Future> future, std::exception_ptr error,
                         std::vector<at::Tensor> value) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    completions_.push_back({std::move(future), std::move(error), std::move(value)});
    start_locked();
  }
  cv_.notify_one();
}

bool Completer::on_this_thread() { return t_completer_thread; }

void Completer::run() {
  ::pthread_setname_np(::pthread_self(), "dtrain-futures");
  t_completer_thread = true;
  while (true) {
    c10::intrusive_ptr<PendingWork> work;
    std::optional<Completion> done;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty() || !completions_.empty(); });
      if (!completions_.empty()) {  // ended elsewhere: only the future to complete, first
        done = std::move(completions_.front());
        completions_.pop_front();
      } else if (!queue_.empty()) {
        work = std::move(queue_.front());
        queue_.pop_front();
      } else {
        return;  // stopping, and everything completed
      }
    }
    if (done) {
      complete_future(done->future, done->error, done->value);
    } else {
      work->wait_and_finish();
    }
  }
}

// ---------------------------------------------------------------------------------- Ordering

namespace {

// The process's flusher: every millisecond, while any group deferred something lately, it
// starts the collectives that were already deferred at its previous tick. Asleep otherwise
// (woken by the next deferral). Never destroyed: its thread may outlive static destructors.
class Flusher {
 public:
  static Flusher& get() {
    static Flusher* f = new Flusher();
    return *f;
  }

  void enroll(std::weak_ptr<Ordering> o) {
    std::lock_guard<std::mutex> lock(mu_);
    orderings_.push_back(std::move(o));
  }

  // After a deferral: wakes the thread if it sleeps.
  void deferred() {
    if (!idle_.load(std::memory_order_relaxed)) return;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!idle_.load(std::memory_order_relaxed)) return;
      idle_.store(false, std::memory_order_relaxed);
      if (!started_) {
        started_ = true;
        std::thread([this] { run(); }).detach();
      }
    }
    cv_.notify_one();
  }

  // Under `self`'s mutex.
  template <typename F>
  void for_others(const Ordering* self, F&& f) {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& w : orderings_) {
      auto o = w.lock();
      if (o && o.get() != self) f(*o);
    }
  }

 private:
  void run() {
    ::pthread_setname_np(::pthread_self(), "dtrain-flusher");
    int quiet_ticks = 0;
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      cv_.wait(lock, [&] { return !idle_.load(std::memory_order_relaxed); });
      cv_.wait_for(lock, std::chrono::milliseconds(1));
      bool any = false;
      for (auto it = orderings_.begin(); it != orderings_.end();) {
        auto o = it->lock();
        if (!o) {
          it = orderings_.erase(it);
          continue;
        }
        ++it;
        std::unique_lock<std::mutex> order(o->mu, std::try_to_lock);
        if (!order.owns_lock()) {
          any = true;  // busy: issuing, or running a blocking collective
          continue;
        }
        any = o->tick() || any;
      }
      quiet_ticks = any ? 0 : quiet_ticks + 1;
      if (quiet_ticks >= 100) idle_.store(true, std::memory_order_relaxed);
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<bool> idle_{true};
  bool started_ = false;
  std::vector<std::weak_ptr<Ordering>> orderings_;
};

}  // namespace

void Ordering::enroll() { Flusher::get().enroll(weak_from_this()); }

void Ordering::flush_others() {
  Flusher::get().for_others(this, [](Ordering& o) {
    std::unique_lock<std::mutex> lock(o.mu, std::try_to_lock);
    if (lock.owns_lock()) o.flush();
  });
}

void Ordering::flush() {
  if (!deferred_) return;
  const c10::intrusive_ptr<PendingWork> work = std::move(deferred_);
  deferred_.reset();
  work->run = nullptr;
  start(work, std::move(work->start));
}

void Ordering::defer(const c10::intrusive_ptr<PendingWork>& work) {
  flush();
  if (closed_) {
    start(work, std::move(work->start));
    return;
  }
  work->ordering_ = shared_from_this();
  deferred_ = work;
  ++deferred_seq_;
  Flusher::get().deferred();
}

// `start` by value on purpose: callers pass std::move(work->start), which this clears first.
// NOLINTNEXTLINE(performance-unnecessary-value-param)
void Ordering::start(const c10::intrusive_ptr<PendingWork>& work, std::function<comm::Work()> start) {
  work->start = nullptr;
  work->run = nullptr;
  try {
    work->inner = start();
  } catch (...) {
    work->finish_inline(std::current_exception());
    return;
  }
  inflight_.erase(std::remove_if(inflight_.begin(), inflight_.end(),
                                 [](const c10::intrusive_ptr<PendingWork>& w) { return w->poll(); }),
                  inflight_.end());
  inflight_.push_back(work);
}

bool Ordering::tick() {
  if (!deferred_) return false;
  if (seen_seq_ == deferred_seq_) {
    flush();  // deferred since the last tick at least
  } else {
    seen_seq_ = deferred_seq_;
  }
  return true;
}

void Ordering::close() {
  flush();
  closed_ = true;
}

}  // namespace dtrain::torch_backend
