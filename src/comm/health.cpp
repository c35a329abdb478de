// Heartbeats and the registry of live groups (see health.h).
#include "health.h"

#include <fmt/format.h>
#include <time.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <list>

#include "dtrain/comm/progress.h"
#include "dtrain/core/file.h"
#include "dtrain/core/log.h"
#include "flight_record.h"

namespace dtrain::comm {

namespace health {

// ---------------------------------------------------------------------------------- Heartbeat
//
// Keys under the group's prefix: hb/R holds rank R's counter (or "exit" once it left cleanly),
// hb/failed the first failure any rank found. Each rank watches only the next one, so the
// store sees three small requests per rank and interval whatever the world size.

namespace {
constexpr const char* kExited = "exit";
}

Heartbeat::Heartbeat(std::shared_ptr<Store> store, std::string prefix, int rank, int size, Duration interval,
                     Duration timeout, std::function<void(const std::string&)> on_failure)
    : store_(std::move(store)),
      prefix_(std::move(prefix)),
      rank_(rank),
      size_(size),
      interval_(interval > Duration::zero() ? interval : std::max(Duration(1), timeout / 5)),
      timeout_(timeout),
      on_failure_(std::move(on_failure)) {
  thread_ = std::thread([this] { run(); });
}

Heartbeat::~Heartbeat() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
  // A clean exit is not a failure: the watcher stops watching this rank.
  try {
    if (!fired_) store_->set(fmt::format("{}/hb/{}", prefix_, rank_), kExited);
  } catch (const std::exception&) {
  }
}

void Heartbeat::report(const std::string& reason) {
  try {
    store_->compare_set(prefix_ + "/hb/failed", "", reason);
  } catch (const std::exception&) {
  }
}

void Heartbeat::run() {
  const int watched = (rank_ + 1) % size_;
  const std::string mine = fmt::format("{}/hb/{}", prefix_, rank_);
  const std::string theirs = fmt::format("{}/hb/{}", prefix_, watched);
  const std::string failed = prefix_ + "/hb/failed";
  const std::string status_key = fmt::format("{}/status/{}", prefix_, rank_);
  std::string last_seen;
  Clock::time_point last_change = Clock::now();
  uint64_t beat = 0;
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    lock.unlock();
    std::string reason;
    try {
      store_->set(mine, std::to_string(++beat));
      store_->set(status_key, status_json(rank_, beat, interval_, timeout_));
      if (auto f = store_->try_get(failed); f && !f->empty()) {
        reason = *f;
      } else if (const std::string stall = progress_stall(timeout_); !stall.empty()) {
        // This thread beats, but the work it stands for does not move: this rank is the hang.
        reason = fmt::format(
            "heartbeat: rank {} made no progress (heartbeat timeout {} ms): its main work is stuck in {}, outside "
            "any collective",
            rank_, timeout_.count(), stall);
        report(reason);
      } else if (watched != rank_) {
        const std::string now_seen = store_->try_get(theirs).value_or("");
        const auto now = Clock::now();
        if (now_seen == kExited) {
          last_change = now;  // left cleanly: nothing to watch
        } else if (now_seen != last_seen) {
          last_seen = now_seen;
          last_change = now;
        } else if (now - last_change >= timeout_) {
          reason = fmt::format(
              "heartbeat: rank {} sent no heartbeat for {} ms (heartbeat timeout {} ms): it died, is stopped or hung, "
              "or its host is unreachable",
              watched, std::chrono::duration_cast<Duration>(now - last_change).count(), timeout_.count());
          report(reason);
        }
      }
    } catch (const std::exception& e) {
      reason = fmt::format("heartbeat: rank {} cannot reach the rendezvous store: {}", rank_, e.what());
    }
    lock.lock();
    if (!reason.empty() && !stop_) {
      fired_ = true;
      lock.unlock();
      on_failure_(reason);
      return;
    }
    cv_.wait_for(lock, interval_, [&] { return stop_; });
  }
}

// ---------------------------------------------------------------------------------- progress

namespace {
// The last note: its time (steady clock, ns), what and step; `watching` once noted and not paused.
std::atomic<int64_t> progress_at{0};
std::atomic<const char*> progress_what{nullptr};
std::atomic<int64_t> progress_step{-1};
std::atomic<bool> watching{false};
std::atomic<int> waiting{0};            // WaitScopes alive in this process
std::atomic<int64_t> waiting_since{0};  // when `waiting` last went from 0 to 1 (coarse ns)
std::atomic<double> throughput{-1.0};
std::atomic<const char*> throughput_unit{nullptr};

int64_t coarse_ns() {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}
}  // namespace

WaitScope::WaitScope() {
  if (waiting.fetch_add(1, std::memory_order_relaxed) == 0) waiting_since.store(coarse_ns(), std::memory_order_relaxed);
}

WaitScope::~WaitScope() {
  // Leaving a wait is progress too: the time spent waiting does not count against the work.
  if (watching.load(std::memory_order_relaxed)) progress_at.store(coarse_ns(), std::memory_order_relaxed);
  waiting.fetch_sub(1, std::memory_order_relaxed);
}

std::string progress_stall(Duration timeout) {
  if (!watching.load(std::memory_order_acquire) || waiting.load(std::memory_order_acquire) > 0) return {};
  const int64_t age_ms = (coarse_ns() - progress_at.load(std::memory_order_relaxed)) / 1000000;
  if (age_ms < timeout.count()) return {};
  const char* what = progress_what.load(std::memory_order_relaxed);
  const int64_t step = progress_step.load(std::memory_order_relaxed);
  return fmt::format("'{}'{} for {} ms", what != nullptr ? what : "?",
                     step >= 0 ? fmt::format(" at step {}", step) : "", age_ms);
}

}  // namespace health

void note_throughput(double per_s, const char* unit) {
  health::throughput.store(per_s, std::memory_order_relaxed);
  health::throughput_unit.store(unit, std::memory_order_relaxed);
}

void note_progress(const char* what, int64_t step) {
  health::progress_what.store(what, std::memory_order_relaxed);
  health::progress_step.store(step, std::memory_order_relaxed);
  health::progress_at.store(health::coarse_ns(), std::memory_order_relaxed);
  health::watching.store(true, std::memory_order_release);
}

void pause_progress() { health::watching.store(false, std::memory_order_release); }

namespace health {

// ---------------------------------------------------------------------------------- registry

struct Registration {
  std::function<void(const std::string&)> abort;
  std::function<std::string()> json;
  std::function<std::string()> pending;
  ~Registration();
};

namespace {
std::mutex& registry_mu() {
  static std::mutex mu;
  return mu;
}
std::list<Registration*>& registry() {
  static std::list<Registration*> r;
  return r;
}
std::atomic<bool> dumped{false};
// Why abort_all first ran in this process (a heartbeat's finding), for the flight record.
std::mutex& first_abort_mu() {
  static std::mutex mu;
  return mu;
}
std::string& first_abort() {
  static std::string reason;
  return reason;
}
}  // namespace

Registration::~Registration() {
  std::lock_guard<std::mutex> lock(registry_mu());
  registry().remove(this);
}

std::shared_ptr<Registration> register_group(std::function<void(const std::string&)> abort,
                                             std::function<std::string()> json, std::function<std::string()> pending) {
  auto r = std::make_shared<Registration>();
  r->abort = std::move(abort);
  r->json = std::move(json);
  r->pending = std::move(pending);
  std::lock_guard<std::mutex> lock(registry_mu());
  registry().push_back(r.get());
  return r;
}

void abort_all(const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(first_abort_mu());
    if (first_abort().empty()) first_abort() = reason;
  }
  std::lock_guard<std::mutex> lock(registry_mu());
  for (Registration* r : registry()) r->abort(reason);
}

void dump_on_first_failure() {
  const char* dir = std::getenv("DTRAIN_FLIGHT_DIR");
  if (dir == nullptr || *dir == '\0' || dumped.exchange(true)) return;
  const char* rank = std::getenv("RANK");
  const std::string who = rank != nullptr ? rank : fmt::format("pid{}", ::getpid());
  // time_ms (Unix, to the microsecond): the entries' "ms ago" of every rank's record on one clock.
  const double unix_ms =
      std::chrono::duration<double, std::milli>(std::chrono::system_clock::now().time_since_epoch()).count();
  std::string reason;
  {
    std::lock_guard<std::mutex> lock(first_abort_mu());
    reason = first_abort();
  }
  std::string body = fmt::format("{{\"rank\":\"{}\",\"pid\":{},\"time_ms\":{:.3f},\"reason\":\"{}\",\"groups\":[", who,
                                 ::getpid(), unix_ms, detail::json_escape(reason));
  {
    std::lock_guard<std::mutex> lock(registry_mu());
    bool first = true;
    for (Registration* r : registry()) {
      body += (first ? "" : ",") + r->json();
      first = false;
    }
  }
  body += "]}\n";
  const std::string path = fmt::format("{}/rank-{}.json", dir, who);
  try {
    write_file_atomic(path, body, "comm");
  } catch (const std::exception& e) {
    DT_LOG_WARN("cannot write the flight record: {}", e.what());
  }
}

// ---------------------------------------------------------------------------------- status

std::string status_json(int rank, uint64_t beat, Duration interval, Duration timeout) {
  const int64_t now = coarse_ns();
  const int64_t unix_ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
          .count();
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  const bool noted = progress_at.load(std::memory_order_relaxed) != 0;
  const char* what = progress_what.load(std::memory_order_relaxed);
  const char* unit = throughput_unit.load(std::memory_order_relaxed);
  const bool in_wait = waiting.load(std::memory_order_relaxed) > 0;
  const double rate = throughput.load(std::memory_order_relaxed);
  std::string out = fmt::format(
      R"({{"rank":{},"pid":{},"host":"{}","time_ms":{},"beat":{},"interval_ms":{},"timeout_ms":{},"step":{},)"
      R"("what":"{}","what_ms":{},"wait_ms":{},"rate":{},"unit":"{}","ops":[)",
      rank, ::getpid(), detail::json_escape(host), unix_ms, beat, interval.count(), timeout.count(),
      progress_step.load(std::memory_order_relaxed), detail::json_escape(what != nullptr ? what : ""),
      noted ? (now - progress_at.load(std::memory_order_relaxed)) / 1000000 : -1,
      in_wait ? (now - waiting_since.load(std::memory_order_relaxed)) / 1000000 : -1, std::isfinite(rate) ? rate : -1.0,
      detail::json_escape(unit != nullptr ? unit : ""));
  bool first = true;
  std::lock_guard<std::mutex> lock(registry_mu());
  for (Registration* r : registry()) {
    if (!r->pending) continue;
    const std::string p = r->pending();
    if (p.empty()) continue;
    out += (first ? "" : ",") + p;
    first = false;
  }
  return out + "]}";
}

}  // namespace health
}  // namespace dtrain::comm
