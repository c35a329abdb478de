// The progress engine of a group (see executor.h for its vocabulary) and the Work handle.
#include "executor.h"

#include <pthread.h>
#include <time.h>

#include <algorithm>

namespace dtrain::comm {

namespace {
thread_local bool t_progress_thread = false;
}  // namespace

bool on_progress_thread() { return t_progress_thread; }

// ---------------------------------------------------------------------------------- Work

void Work::State::finish(std::exception_ptr e, bool dump) {
  if (recorder) recorder->ended(flight_id, e);
  if (e && dump) health::dump_on_first_failure();
  {
    std::lock_guard<std::mutex> lock(mu);
    finished_at = Clock::now();
    done = true;
    error = std::move(e);
  }
  cv.notify_all();
}

bool Work::test() {
  DT_CHECK(state_ != nullptr, "comm", "test() on an empty Work");
  std::lock_guard<std::mutex> lock(state_->mu);
  if (state_->done && state_->error) std::rethrow_exception(state_->error);
  return state_->done;
}

Clock::time_point Work::finish_time() const {
  DT_CHECK(state_ != nullptr, "comm", "finish_time() on an empty Work");
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->finished_at;
}

void Work::wait(Duration timeout) {
  DT_CHECK(state_ != nullptr, "comm", "wait() on an empty Work");
  if (timeout == Duration::zero()) timeout = state_->default_timeout;
  const health::WaitScope waiting;  // not a stall of this process's work (progress.h)
  std::unique_lock<std::mutex> lock(state_->mu);
  if (!state_->cv.wait_for(lock, timeout, [&] { return state_->done; })) {
    // Give up: break the group so the operation stops touching the caller's buffers, then
    // wait for it to acknowledge (the transport's waits wake up on abort).
    const std::string reason = fmt::format("{} #{} not complete after {} ms", state_->op, state_->seq, timeout.count());
    lock.unlock();
    if (state_->on_abandon) state_->on_abandon(reason);
    lock.lock();
    state_->cv.wait_for(lock, std::chrono::seconds(10), [&] { return state_->done; });
    throw CommError(state_->op, state_->seq, {}, fmt::format("not complete after {} ms", timeout.count()), __FILE__,
                    __LINE__);
  }
  if (state_->error) std::rethrow_exception(state_->error);
}

namespace detail {

std::pair<Clock::time_point, Clock::duration> coarse_now() {
  static const Clock::duration tick = [] {
    timespec r{};
    ::clock_getres(CLOCK_MONOTONIC_COARSE, &r);
    return std::chrono::duration_cast<Clock::duration>(std::chrono::seconds(r.tv_sec) +
                                                       std::chrono::nanoseconds(r.tv_nsec));
  }();
  timespec t{};
  if (::clock_gettime(CLOCK_MONOTONIC_COARSE, &t) != 0) return {Clock::now(), Clock::duration::zero()};
  return {Clock::time_point(std::chrono::duration_cast<Clock::duration>(std::chrono::seconds(t.tv_sec) +
                                                                        std::chrono::nanoseconds(t.tv_nsec))),
          tick};
}

// ---------------------------------------------------------------------------------- Executor

Executor::Executor(Transport& transport, std::string group, int rank, Duration timeout,
                   std::shared_ptr<FlightRecorder> recorder, std::function<void(const std::string&)> also_abort)
    : transport_(transport),
      group_(std::move(group)),
      rank_(rank),
      timeout_(timeout),
      recorder_(std::move(recorder)),
      also_abort_(std::move(also_abort)) {
  worker_ = std::thread([this] { run(); });
}

Executor::~Executor() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (worker_.joinable()) worker_.join();
}

void Executor::abort(const std::string& reason) {
  transport_.abort(reason);
  if (also_abort_) also_abort_(reason);
}

void Executor::run() {
  ::pthread_setname_np(::pthread_self(), "dtrain-progress");  // as top, gdb and the tests see it
  t_progress_thread = true;
  int idle_polls = 0;
  while (true) {
    std::optional<Task> task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      auto runnable = [&] { return !queue_.empty() && !busy_; };
      if (inflight_count_ == 0) {
        // Woken too when a caller posted a send or receive inline and left it in flight.
        cv_.wait(lock, [&] { return (stopping_ && queue_.empty()) || runnable() || inflight_count_ > 0; });
      } else if (!runnable()) {
        // Sends and receives in flight: poll them, spinning at first, then backing off to 1 ms.
        const auto pause = std::chrono::microseconds(idle_polls < 64 ? 0 : std::min(1000, 10 * (idle_polls - 63)));
        if (pause.count() > 0) cv_.wait_for(lock, pause, runnable);
      }
      if (busy_) {  // a blocking call runs inline and holds the transport
        waits_for_idle_ = true;
        cv_.wait(lock, [&] { return !busy_; });
        waits_for_idle_ = false;
        continue;
      }
      if (stopping_ && queue_.empty()) {
        fail_inflight("the group was destroyed while it was pending", /*dump=*/false);
        return;
      }
      busy_ = true;
      if (!queue_.empty()) {
        task = std::move(queue_.front());
        queue_.pop_front();
      }
    }
    if (task) {
      execute_task(task->state, task->body);
      idle_polls = 0;
    }
    const bool progressed = poll_inflight();
    idle_polls = progressed ? 0 : idle_polls + 1;
    {
      std::lock_guard<std::mutex> lock(mu_);
      busy_ = false;
      inflight_count_ = inflight_.size();
    }
    cv_.notify_all();
    if (!task && idle_polls > 0 && idle_polls < 64) std::this_thread::yield();
  }
}

bool Executor::poll_inflight() {
  bool any = false;
  try {
    for (auto it = inflight_.begin(); it != inflight_.end();) {
      if (transport_.test({it->id})) {
        it->state->finish(nullptr);
        it = inflight_.erase(it);
        any = true;
      } else if (Clock::now() >= it->deadline) {
        throw TransportError(TransportError::Kind::timeout, {it->peer},
                             fmt::format("{} not complete after {} ms", it->what, timeout_.count()), __FILE__,
                             __LINE__);
      } else {
        ++it;
      }
    }
  } catch (const TransportError& e) {
    if (e.kind() != TransportError::Kind::aborted) {
      abort(fmt::format("rank {} failed in point-to-point: {}", rank_, e.message()));
    }
    broken_ = std::make_exception_ptr(CommError(inflight_.front().state->op, inflight_.front().state->seq, e.peers(),
                                                e.message(), __FILE__, __LINE__));
    fail_inflight(e.message());
    return true;
  }
  return any;
}

void Executor::fail_inflight(const std::string& why, bool dump) {
  for (auto& f : inflight_) {
    f.state->finish(std::make_exception_ptr(CommError(f.state->op, f.state->seq, {f.peer},
                                                      fmt::format("{}: {}", f.what, why), __FILE__, __LINE__)),
                    dump);
  }
  inflight_.clear();
}

Work Executor::submit(const std::string& op, bool blocking, Body body, size_t bytes, int root) {
  return dispatch(op, true, blocking, std::move(body), bytes, root);
}

Work Executor::post(bool is_send, void* buffer, size_t bytes, int peer, uint32_t tag, bool blocking) {
  std::string what = fmt::format("{} rank {} (tag {}, {} bytes)", is_send ? "send to" : "recv from", peer, tag, bytes);
  return dispatch(
      is_send ? "send" : "recv", false, blocking,
      [this, is_send, buffer, bytes, peer, tag, blocking, what = std::move(what)](uint64_t, Deadline deadline) {
        const uint64_t wire_tag = (uint64_t{1} << 63) | tag;
        const RequestId id = is_send ? transport_.post_send(peer, wire_tag, buffer, bytes)
                                     : transport_.post_recv(peer, wire_tag, buffer, bytes);
        if (blocking) {
          transport_.wait({id}, deadline);
          return;
        }
        pending_post_ = Inflight{id, nullptr, what, deadline, peer};
      },
      bytes, peer);
}

// A blocking call issued while nothing is queued or running runs inline in the caller's
// thread; so does the post of a send or receive. Everything else is queued.
Work Executor::dispatch(const std::string& op, bool collective, bool blocking, Body body, size_t bytes, int peer) {
  auto state = std::make_shared<Work::State>();
  state->op = op;
  state->default_timeout = timeout_;
  state->on_abandon = [this](const std::string& reason) { abort(reason); };
  state->recorder = recorder_;
  bool run_now = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    state->seq = collective ? collective_seq_++ : p2p_seq_++;
    state->flight_id = recorder_->queued(op.c_str(), state->seq, collective, bytes, peer);
    // A send or receive is posted right here too, and a few passes move a message that fits
    // the transport's buffers completely: the progress thread then need not wake up at all
    // (each wake-up and hand-back costs tens of microseconds, more when ranks share cores).
    if ((blocking || !collective) && queue_.empty() && !busy_) {
      busy_ = true;
      run_now = true;
    } else {
      queue_.push_back(Task{state, std::move(body)});
    }
  }
  if (!run_now) {
    cv_.notify_all();
    return Work(state);
  }
  // `body` was moved into the queue only when run_now is false, and then this returned above.
  if (blocking) {
    const health::WaitScope waiting;
    execute_task(state, body);  // NOLINT(bugprone-use-after-move): not moved on this path (above)
  } else {
    execute_task(state, body);  // NOLINT(bugprone-use-after-move): not moved on this path (above)
  }
  for (int pass = 0; !blocking && pass < 8 && !inflight_.empty(); ++pass) poll_inflight();
  bool wake = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    busy_ = false;
    inflight_count_ = inflight_.size();
    wake = progress_needed();
  }
  if (wake) cv_.notify_all();
  return Work(state);
}

void Executor::execute_task(const std::shared_ptr<Work::State>& state, const Body& body) {
  recorder_->started(state->flight_id);
  std::exception_ptr err =
      guarded(state->op.c_str(), state->seq, Clock::now() + timeout_, [&](Deadline d) { body(state->seq, d); });
  if (err || !pending_post_) {
    pending_post_.reset();
    state->finish(err);
    return;
  }
  Inflight f = std::move(*pending_post_);
  pending_post_.reset();
  f.state = state;
  inflight_.push_back(std::move(f));
}

std::exception_ptr Executor::broken_error(const char* op, uint64_t seq) const {
  try {
    std::rethrow_exception(broken_);
  } catch (const std::exception& e) {
    return std::make_exception_ptr(
        CommError(op, seq, {}, fmt::format("group '{}' is broken by an earlier failure: {}", group_, e.what()),
                  __FILE__, __LINE__));
  }
}

std::exception_ptr Executor::fail(const char* op, uint64_t seq, const TransportError& e) {
  auto err = std::make_exception_ptr(CommError(op, seq, e.peers(), e.message(), __FILE__, __LINE__));
  broken_ = err;
  if (e.kind() != TransportError::Kind::aborted) {
    abort(fmt::format("rank {} failed in {} #{}: {}", rank_, op, seq, e.message()));
  }
  return err;
}

std::exception_ptr Executor::fail(const char* op, uint64_t seq, const std::exception& e) {
  auto err = std::make_exception_ptr(CommError(op, seq, {}, e.what(), __FILE__, __LINE__));
  broken_ = err;
  abort(fmt::format("rank {} failed in {} #{}: {}", rank_, op, seq, e.what()));
  return err;
}

bool Executor::begin_inline(uint64_t* seq) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!queue_.empty() || busy_) return false;
  busy_ = true;
  *seq = collective_seq_++;
  return true;
}

void Executor::end_inline(const char* op, uint64_t seq, size_t bytes, int peer, Clock::time_point start,
                          const std::exception_ptr& err) {
  recorder_->completed(op, seq, bytes, peer, start, err);
  if (err) health::dump_on_first_failure();
  bool wake = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    busy_ = false;
    wake = progress_needed();
  }
  if (wake) cv_.notify_all();
}

void Executor::wait_polling(Work& w, Deadline deadline) {
  for (int polls = 0; !inflight_.empty() && !w.test(); ++polls) {
    poll_inflight();
    if (Clock::now() >= deadline) {
      throw TransportError(TransportError::Kind::timeout, {}, "not complete by the deadline", __FILE__, __LINE__);
    }
    if (polls > 64) std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  w.wait(std::max(Duration(1), std::chrono::duration_cast<Duration>(deadline - Clock::now())));
}

}  // namespace detail
}  // namespace dtrain::comm
