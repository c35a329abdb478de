// Group: a handle over a transport (shared memory or TCP, see GroupOptions), a progress thread
// that runs the group's operations in issue order, and the error handling that turns any
// failure into a CommError on every rank.
#include "dtrain/comm/group.h"

#include <pthread.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <functional>
#include <mutex>
#include <numeric>
#include <optional>
#include <thread>

#include <fmt/format.h>

#include "dtrain/comm/mpi.h"
#include "dtrain/comm/plan.h"
#include "dtrain/comm/reduce.h"
#include "dtrain/comm/transport.h"
#include "compress_collectives.h"
#include "dtrain/core/log.h"
#include "health.h"
#include "net.h"
#include "plan_common.h"
#include "shm_segment.h"

namespace dtrain::comm {

namespace {

// CLOCK_MONOTONIC_COARSE, steady_clock's clock read from the last tick, and that tick's length.
std::pair<Clock::time_point, Clock::duration> coarse_now() {
  static const Clock::duration tick = [] {
    timespec r{};
    ::clock_getres(CLOCK_MONOTONIC_COARSE, &r);
    return std::chrono::duration_cast<Clock::duration>(std::chrono::seconds(r.tv_sec) + std::chrono::nanoseconds(r.tv_nsec));
  }();
  timespec t{};
  if (::clock_gettime(CLOCK_MONOTONIC_COARSE, &t) != 0) return {Clock::now(), Clock::duration::zero()};
  return {Clock::time_point(std::chrono::duration_cast<Clock::duration>(std::chrono::seconds(t.tv_sec) + std::chrono::nanoseconds(t.tv_nsec))), tick};
}
// Hierarchical all_reduce: a vector of at least twice this goes in segments of about this
// size (at most 8), pipelined between the host's shm and the link between hosts.
constexpr size_t kHierarchicalSegmentBytes = size_t{512} << 10;
// Below this, auto runs the flat algorithms on such a group (see Impl::hierarchical_for).
constexpr size_t kHierarchicalMinBytes = size_t{64} << 10;
}  // namespace

// ---------------------------------------------------------------------------------- Work

struct Work::State {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  std::exception_ptr error;
  std::string op;
  uint64_t seq = 0;
  Duration default_timeout{0};
  std::function<void(const std::string&)> on_abandon;  // aborts the group when a wait gives up
  std::shared_ptr<health::FlightRecorder> recorder;
  uint64_t flight_id = UINT64_MAX;

  Clock::time_point finished_at{};

  // `dump`: a failure worth the process's one flight-record dump (not a teardown).
  void finish(std::exception_ptr e, bool dump = true) {
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
};

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

// ---------------------------------------------------------------------------------- Impl

struct Group::Impl {
  int rank = 0;
  int size = 0;
  std::string name;
  GroupOptions options;
  std::shared_ptr<Store> store;
  std::shared_ptr<void> keep_alive;  // e.g. the store server hosted by rank 0
  std::unique_ptr<Transport> transport;
  std::string kind;
  uint64_t splits = 0;
  uint64_t shared_allocations = 0;

  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::function<void()>> queue;
  bool busy = false;  // an operation runs, on the progress thread or inline in a blocking call
  bool waits_for_idle = false;  // the progress thread waits for `busy` to clear
  bool stopping = false;
  std::thread worker;
  uint64_t collective_seq = 0;  // identical on every rank: all ranks issue the same collectives
  uint64_t p2p_seq = 0;
  std::exception_ptr broken;
  std::shared_ptr<health::FlightRecorder> recorder;
  std::unique_ptr<health::Heartbeat> heartbeat;
  std::shared_ptr<health::Registration> registration;
  // A world started by dtrain launch: the key that tells the launcher this rank left the job
  // cleanly (see from_env); empty otherwise.
  std::string left_key;

  // A group spanning `hosts` hosts with `local_size` >= 2 ranks on each (see group.h): this
  // rank is `local_rank` on host `host` (hosts numbered in order of their lowest rank). The
  // two sub-groups are created by the first hierarchical all_reduce, which every rank issues
  // at the same point; only the thread running the group's operations touches them.
  struct Hierarchy {
    int hosts = 0, host = 0, local_size = 0, local_rank = 0;
    Group local;  // the ranks of this host (shm)
    Group cross;  // the ranks of the same local_rank on every host (tcp)
    std::vector<uint8_t> padded;  // count rounded up to a multiple of local_size, when it is not one
    std::vector<uint8_t> piece;   // this rank's 1/local_size of the vector
    std::mutex mu;                // local and cross, against abort() from other threads
  };
  // A pointer: clang cannot construct a nested struct with member initializers in this context.
  std::unique_ptr<Hierarchy> hierarchy;

  ~Impl() {
    registration.reset();  // no abort_all() reaches a group being torn down
    heartbeat.reset();
    if (!left_key.empty() && !broken) {
      try {
        store->set(left_key, std::to_string(::getpid()));
      } catch (const std::exception&) {  // the launcher then reports this rank's exit as early
      }
    }
    {
      std::lock_guard<std::mutex> lock(mu);
      stopping = true;
    }
    cv.notify_all();
    if (worker.joinable()) worker.join();
  }

  // Point-to-point operations in flight: posted to the transport, completed by polling. Only
  // touched by the thread that holds `busy`.
  struct Inflight {
    RequestId id;
    std::shared_ptr<Work::State> state;
    std::string what;  // "send to rank 2 (tag 5)"
    Deadline deadline;
    int peer;
  };
  std::deque<Inflight> inflight;
  size_t inflight_count = 0;  // inflight.size(), readable under mu

  // Under mu, after an inline call cleared `busy`: whether the progress thread has anything to
  // do. Waking it for nothing costs every small collective a context switch, tens of
  // microseconds when ranks share cores.
  bool progress_needed() const { return !queue.empty() || inflight_count > 0 || waits_for_idle; }

  void run() {
    ::pthread_setname_np(::pthread_self(), "dtrain-progress");  // as top, gdb and the tests see it
    int idle_polls = 0;
    while (true) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> lock(mu);
        auto runnable = [&] { return !queue.empty() && !busy; };
        if (inflight_count == 0) {
          // Woken too when a caller posted a send or receive inline and left it in flight.
          cv.wait(lock, [&] { return (stopping && queue.empty()) || runnable() || inflight_count > 0; });
        } else if (!runnable()) {
          // Sends and receives in flight: poll them, spinning at first, then backing off to 1 ms.
          const auto pause = std::chrono::microseconds(idle_polls < 64 ? 0 : std::min(1000, 10 * (idle_polls - 63)));
          if (pause.count() > 0) cv.wait_for(lock, pause, runnable);
        }
        if (busy) {  // a blocking call runs inline and owns the transport
          waits_for_idle = true;
          cv.wait(lock, [&] { return !busy; });
          waits_for_idle = false;
          continue;
        }
        if (stopping && queue.empty()) {
          fail_inflight("the group was destroyed while it was pending", /*dump=*/false);
          return;
        }
        busy = true;
        if (!queue.empty()) {
          task = std::move(queue.front());
          queue.pop_front();
        }
      }
      if (task) {
        task();
        idle_polls = 0;
      }
      const bool progressed = poll_inflight();
      idle_polls = progressed ? 0 : idle_polls + 1;
      {
        std::lock_guard<std::mutex> lock(mu);
        busy = false;
        inflight_count = inflight.size();
      }
      cv.notify_all();
      if (!task && idle_polls > 0 && idle_polls < 64) std::this_thread::yield();
    }
  }

  // Completes the in-flight operations that finished; true if any did. A failure or a passed
  // deadline fails them all and breaks the group, as a failed collective does.
  bool poll_inflight() {
    bool any = false;
    try {
      for (auto it = inflight.begin(); it != inflight.end();) {
        if (transport->test({it->id})) {
          it->state->finish(nullptr);
          it = inflight.erase(it);
          any = true;
        } else if (Clock::now() >= it->deadline) {
          throw TransportError(TransportError::Kind::timeout, {it->peer},
                               fmt::format("{} not complete after {} ms", it->what, options.timeout.count()),
                               __FILE__, __LINE__);
        } else {
          ++it;
        }
      }
    } catch (const TransportError& e) {
      if (e.kind() != TransportError::Kind::aborted) {
        abort(fmt::format("rank {} failed in point-to-point: {}", rank, e.message()));
      }
      broken = std::make_exception_ptr(CommError(inflight.front().state->op, inflight.front().state->seq, e.peers(),
                                                 e.message(), __FILE__, __LINE__));
      fail_inflight(e.message());
      return true;
    }
    return any;
  }

  void fail_inflight(const std::string& why, bool dump = true) {
    for (auto& f : inflight) {
      f.state->finish(std::make_exception_ptr(CommError(f.state->op, f.state->seq, {f.peer},
                                                        fmt::format("{}: {}", f.what, why), __FILE__, __LINE__)),
                      dump);
    }
    inflight.clear();
  }

  // Posts a send or receive; it completes later, from poll_inflight (or in a blocking call).
  Work start_p2p(bool is_send, void* buffer, size_t bytes, int peer, uint32_t tag, bool blocking) {
    const std::string what = fmt::format("{} rank {} (tag {}, {} bytes)", is_send ? "send to" : "recv from", peer, tag, bytes);
    return dispatch(is_send ? "send" : "recv", false, blocking,
                    [this, is_send, buffer, bytes, peer, tag, blocking, what](uint64_t, Deadline deadline) -> bool {
                      Transport& t = *transport;
                      const uint64_t wire_tag = (uint64_t{1} << 63) | tag;
                      const RequestId id = is_send ? t.post_send(peer, wire_tag, buffer, bytes)
                                                   : t.post_recv(peer, wire_tag, buffer, bytes);
                      if (blocking) {
                        t.wait({id}, deadline);
                        return true;
                      }
                      pending_post = Inflight{id, nullptr, what, deadline, peer};
                      return false;
                    },
                    bytes, peer);
  }
  std::optional<Inflight> pending_post;  // set by a p2p body that left its request in flight

  void abort(const std::string& reason) {
    if (transport) transport->abort(reason);
    abort_hierarchy(reason);
  }

  // The hierarchy's sub-groups stop too, so that an abandoned hierarchical all_reduce stops
  // touching the caller's buffers. May run on any thread.
  void abort_hierarchy(const std::string& reason) {
    if (!hierarchy) return;
    std::lock_guard<std::mutex> lock(hierarchy->mu);
    for (Group* g : {&hierarchy->local, &hierarchy->cross}) {
      if (g->impl_) g->impl_->abort(reason);
    }
  }

  // Runs body(seq, deadline) in issue order and returns its Work. A blocking call issued while
  // nothing is queued or running runs inline in the caller's thread (no hand-off to the
  // progress thread: this is the latency of small collectives); everything else is queued.
  Work dispatch(const std::string& op, bool collective, bool blocking, std::function<bool(uint64_t, Deadline)> body,
                size_t bytes = 0, int peer = -1) {
    auto state = std::make_shared<Work::State>();
    state->op = op;
    state->default_timeout = options.timeout;
    state->on_abandon = [this](const std::string& reason) { abort(reason); };
    state->recorder = recorder;
    std::function<void()> task;
    bool run_now = false;
    {
      std::lock_guard<std::mutex> lock(mu);
      state->seq = collective ? collective_seq++ : p2p_seq++;
      state->flight_id = recorder->queued(op.c_str(), state->seq, collective, bytes, peer);
      task = [this, state, op, body = std::move(body)] { execute_task(state, op, body); };
      // A send or receive is posted right here too, and a few passes move a message that fits
      // the transport's buffers completely: the progress thread then need not wake up at all
      // (each wake-up and hand-back costs tens of microseconds, more when ranks share cores).
      if ((blocking || !collective) && queue.empty() && !busy) {
        busy = true;
        run_now = true;
      } else {
        queue.push_back(task);
      }
    }
    if (run_now) {
      if (blocking) {
        const health::WaitScope waiting;
        task();
      } else {
        task();
      }
      for (int pass = 0; !blocking && pass < 8 && !inflight.empty(); ++pass) poll_inflight();
      bool wake = false;
      {
        std::lock_guard<std::mutex> lock(mu);
        busy = false;
        inflight_count = inflight.size();
        wake = progress_needed();
      }
      if (wake) cv.notify_all();
      return Work(state);
    }
    cv.notify_all();
    return Work(state);
  }

  // Runs body(seq, deadline) with the group's failure rules: a broken group fails at once; a
  // failure breaks the group and aborts the transport so the peers fail too. Returns the
  // error (null on success); *left_in_flight tells whether a p2p body left its request posted.
  template <typename Body>
  std::exception_ptr guarded(const char* op, uint64_t seq, Body&& body, bool* left_in_flight = nullptr,
                             Clock::time_point now = Clock::time_point{}) {
    if (broken) {
      try {
        std::rethrow_exception(broken);
      } catch (const std::exception& e) {
        return std::make_exception_ptr(CommError(
            op, seq, {}, fmt::format("group '{}' is broken by an earlier failure: {}", name, e.what()), __FILE__,
            __LINE__));
      }
    }
    try {
      const bool finished = body(seq, (now == Clock::time_point{} ? Clock::now() : now) + options.timeout);
      if (left_in_flight != nullptr) *left_in_flight = !finished;
      return nullptr;
    } catch (const TransportError& e) {
      auto err = std::make_exception_ptr(CommError(op, seq, e.peers(), e.message(), __FILE__, __LINE__));
      broken = err;
      if (e.kind() != TransportError::Kind::aborted) {
        abort(fmt::format("rank {} failed in {} #{}: {}", rank, op, seq, e.message()));
      }
      return err;
    } catch (const std::exception& e) {
      auto err = std::make_exception_ptr(CommError(op, seq, {}, e.what(), __FILE__, __LINE__));
      broken = err;
      abort(fmt::format("rank {} failed in {} #{}: {}", rank, op, seq, e.what()));
      return err;
    }
  }

  void execute_task(const std::shared_ptr<Work::State>& state_ptr, const std::string& op,
                    const std::function<bool(uint64_t, Deadline)>& body) {
    bool in_flight = false;
    recorder->started(state_ptr->flight_id);
    std::exception_ptr err = guarded(op.c_str(), state_ptr->seq, body, &in_flight);
    if (err || !in_flight) {
      state_ptr->finish(err);
      return;
    }
    Inflight f = std::move(*pending_post);
    pending_post.reset();
    f.state = state_ptr;
    inflight.push_back(std::move(f));
  }

  // The latency path of blocking collectives: when nothing is queued or running, run `body`
  // right here without a Work, a queue entry or an allocation. False: not idle, queue it.
  template <typename Body>
  bool run_inline(const char* op, size_t bytes, int peer, Body&& body) {
    uint64_t seq = 0;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (!queue.empty() || busy) return false;
      busy = true;
      seq = collective_seq++;
    }
    // Recorded once it ended (one clock read and one lock on this latency path): a failure
    // or a timeout still ends it, so the record dumped on failure has it. The coarse clock
    // (a third of a precise read; 2-vCPU EPYC VM: 10 against 33 ns) lags by up to one tick:
    // the record's start is at most that early, the deadline is pushed one tick later so
    // that it never comes early.
    const auto [start, tick] = coarse_now();
    std::exception_ptr err;
    {
      const health::WaitScope waiting;
      err = guarded(
        op, seq,
        [&](uint64_t, Deadline deadline) {
          body(deadline);
          return true;
        },
        nullptr, start + tick);
    }
    recorder->completed(op, seq, bytes, peer, start, err);
    if (err) health::dump_on_first_failure();
    bool wake = false;
    {
      std::lock_guard<std::mutex> lock(mu);
      busy = false;
      wake = progress_needed();
    }
    if (wake) cv.notify_all();
    if (err) std::rethrow_exception(err);
    return true;
  }

  // The transport's native collectives when the algorithm is auto or direct (or hier, which
  // a one-host group runs as auto) and it has them.
  DirectCollectives* direct_for(Algorithm requested) const {
    if (requested != Algorithm::automatic && requested != Algorithm::direct &&
        requested != Algorithm::hierarchical) {
      return nullptr;
    }
    return transport->direct();
  }

  // The plan algorithm for all_reduce of `bytes` bytes when neither direct nor hier runs.
  Algorithm algorithm_for(size_t bytes) const {
    const Algorithm a = options.algorithm;
    return a == Algorithm::automatic || a == Algorithm::hierarchical ? choose_all_reduce(bytes, size) : a;
  }

  // Whether all_reduce of `bytes` bytes runs hierarchically: on a group of that shape, when
  // asked to, or when the algorithm is auto and the vector is large enough. On the 4-host test
  // cluster (4 x 2 ranks, 1 Gbit/s; bench/netns_cluster.py) the flat recursive doubling wins up
  // to 32 KiB (about 0.6 ms against 1.0: three phases and two hand-offs) and the hierarchical
  // one from 64 KiB (1.3-1.9 ms against 1.9-2.0 for rd, 2.3 for the ring).
  bool hierarchical_for(size_t bytes) const {
    if (!hierarchy) return false;
    if (options.algorithm == Algorithm::hierarchical) return true;
    return options.algorithm == Algorithm::automatic && bytes >= kHierarchicalMinBytes;
  }

  void ensure_hierarchy_groups() {
    Hierarchy& h = *hierarchy;
    if (h.local.size() > 0) return;
    GroupOptions sub = options;
    sub.heartbeat_timeout = Duration::zero();  // this group's processes are covered already
    sub.heartbeat_store = nullptr;
    sub.transport = "shm";
    sub.algorithm = Algorithm::direct;
    Group local = Group::create(store, h.local_rank, h.local_size, sub, fmt::format("{}/hier/host{}", name, h.host));
    sub.transport = "tcp";
    // The ring between hosts: one stream per link and direction. Halving-doubling (auto's
    // choice for the pieces of 512 KiB segments) ran both local ranks' exchanges at once over
    // the same rate-limited links and stalled on retransmissions (4 MiB: 113 ms, p99 283 ms,
    // against 64 ms for the flat ring; bench/netns_cluster.py).
    sub.algorithm = Algorithm::ring;
    Group cross = Group::create(store, h.host, h.hosts, sub, fmt::format("{}/hier/local{}", name, h.local_rank));
    std::lock_guard<std::mutex> lock(h.mu);
    h.local = std::move(local);
    h.cross = std::move(cross);
  }

  // reduce_scatter within the host, all_reduce across hosts, all_gather within the host.
  // Every rank ends with the same bytes: piece q is reduced by the same ring on every host,
  // and every rank gathers the same pieces. avg sums and divides once at the end. A large
  // vector goes in segments, pipelined: the host's reduce_scatter of segment s+1 and its
  // all_gather of segment s-1 run (on the local group's thread) while segment s crosses the
  // hosts (on the cross group's), so the link is rarely idle.
  void hierarchical_all_reduce(const void* send, void* recv, size_t count, DataType dtype, ReduceOp op,
                               Deadline deadline) {
    ensure_hierarchy_groups();
    Hierarchy& h = *hierarchy;
    const ReduceOp inner = op == ReduceOp::avg ? ReduceOp::sum : op;
    const size_t es = size_of(dtype);
    const auto l = static_cast<size_t>(h.local_size);
    const size_t segments = std::clamp<size_t>(count * es / kHierarchicalSegmentBytes, 1, 8);
    const size_t block = (count + l * segments - 1) / (l * segments);  // elements of one piece
    const size_t padded = block * l * segments;
    const bool pad = padded != count;
    const char* in = static_cast<const char*>(send);
    char* out = static_cast<char*>(recv);
    if (pad) {
      h.padded.resize(padded * es);
      if (count > 0) std::memcpy(h.padded.data(), send, count * es);
      std::memset(h.padded.data() + count * es, 0, (padded - count) * es);  // only the tail needs zeros
      in = out = reinterpret_cast<char*>(h.padded.data());
    }
    h.piece.resize(std::max<size_t>(block * segments * es, 1));
    char* piece = reinterpret_cast<char*>(h.piece.data());
    const size_t seg_bytes = block * l * es;
    std::vector<Work> rs(segments), ar(segments), ag(segments);
    std::exception_ptr failed;
    // Waits for a sub-operation until this call's deadline; meanwhile this group's sends and
    // receives in flight keep moving (a peer may need them before it reaches this call).
    auto wait = [&](Work& w) {
      if (!w.valid()) return false;
      try {
        for (int polls = 0; !inflight.empty() && !w.test(); ++polls) {
          poll_inflight();
          if (Clock::now() >= deadline) {
            throw TransportError(TransportError::Kind::timeout, {}, "not complete by the deadline", __FILE__, __LINE__);
          }
          if (polls > 64) std::this_thread::sleep_for(std::chrono::microseconds(50));
        }
        w.wait(std::max(Duration(1), std::chrono::duration_cast<Duration>(deadline - Clock::now())));
        return true;
      } catch (...) {
        if (!failed) {
          failed = std::current_exception();
          // The peers on this host and across hosts must not wait for phases this rank skips.
          abort_hierarchy(fmt::format("rank {}: hierarchical all_reduce failed", rank));
        }
        return false;
      }
    };
    for (size_t k = 0; k < segments; ++k) {
      rs[k] = h.local.reduce_scatter_async(in + k * seg_bytes, piece + k * block * es, block, dtype, inner);
    }
    for (size_t k = 0; k < segments && !failed; ++k) {
      if (!wait(rs[k])) break;
      ar[k] = h.cross.all_reduce_async(piece + k * block * es, piece + k * block * es, block, dtype, inner);
      if (k > 0 && wait(ar[k - 1])) {
        ag[k - 1] = h.local.all_gather_async(piece + (k - 1) * block * es, out + (k - 1) * seg_bytes, block, dtype);
      }
    }
    if (!failed && wait(ar[segments - 1])) {
      ag[segments - 1] = h.local.all_gather_async(piece + (segments - 1) * block * es,
                                                  out + (segments - 1) * seg_bytes, block, dtype);
    }
    // Every operation still touching the buffers ends before this returns or throws.
    for (auto* works : {&rs, &ar, &ag}) {
      for (Work& w : *works) wait(w);
    }
    if (failed) std::rethrow_exception(failed);
    if (pad && count > 0) std::memcpy(recv, h.padded.data(), count * es);
    finish_avg(recv, count, dtype, op, size);
  }

  Work run_plan(const std::string& op, Plan plan, const void* in, void* out, DataType dtype, ReduceOp rop,
                bool blocking, size_t bytes = 0, int root = -1) {
    return dispatch(
        op, true, blocking,
        [this, plan = std::move(plan), in, out, dtype, rop](uint64_t seq, Deadline deadline) {
          execute(plan, *transport, in, out, dtype, rop, seq << 20, deadline);
          return true;
        },
        bytes, root);
  }

  Work run_direct(const std::string& op, bool blocking, std::function<void(DirectCollectives&, Deadline)> body,
                  size_t bytes = 0, int root = -1) {
    return dispatch(
        op, true, blocking,
        [this, body = std::move(body)](uint64_t, Deadline deadline) {
          body(*transport->direct(), deadline);
          return true;
        },
        bytes, root);
  }

  // This group and its flight record as JSON (times in ms before now).
  std::string describe_json() const {
    const auto now = Clock::now();
    auto ago = [&](Clock::time_point t) {
      return t == Clock::time_point{} ? std::string("null")
                                      : fmt::format("{:.3f}", std::chrono::duration<double, std::milli>(now - t).count());
    };
    std::string out = fmt::format(R"({{"group":"{}","rank":{},"size":{},"transport":"{}","entries":[)",
                                  health::json_escape(name), rank, size, kind);
    bool first = true;
    for (const FlightEntry& e : recorder->entries()) {
      out += fmt::format(
          R"({}{{"seq":{},"op":"{}","collective":{},"bytes":{},"peer":{},"state":"{}","queued_ms_ago":{},"started_ms_ago":{},"finished_ms_ago":{},"error":"{}"}})",
          first ? "" : ",", e.seq, e.op, e.collective, e.bytes, e.peer, name_of(e.state), ago(e.queued_at),
          ago(e.started_at), ago(e.finished_at), health::json_escape(e.error));
      first = false;
    }
    return out + "]}";
  }
};

namespace {

std::string host_identity(const GroupOptions& options) {
  if (!options.host_id.empty()) return options.host_id;
  if (const char* id = std::getenv("DTRAIN_HOST_ID")) return id;
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  std::string boot;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> boot;
  return std::string(host) + "/" + boot;
}

int env_int(const char* var) {
  const char* v = std::getenv(var);
  DT_CHECK(v != nullptr && *v != '\0', "comm", "environment variable {} is not set (start ranks with dtrain launch)", var);
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  DT_CHECK(end != v && *end == '\0' && x >= 0 && x < (1L << 30), "comm", "environment variable {}='{}' is not a valid integer",
           var, v);
  return static_cast<int>(x);
}

// The first of `vars` set (and not empty) in the environment, or nullptr.
const char* first_set(std::initializer_list<const char*> vars) {
  for (const char* v : vars) {
    if (const char* x = std::getenv(v); x != nullptr && *x != '\0') return v;
  }
  return nullptr;
}

// options.transport, or DTRAIN_TRANSPORT while it is "auto", with "auto" resolved.
std::string choose_transport(const std::string& option, bool same_host) {
  std::string kind = option;
  const char* env = std::getenv("DTRAIN_TRANSPORT");
  if (kind == "auto" && env != nullptr && *env != '\0') {
    kind = env;
    DT_CHECK(kind == "auto" || kind == "shm" || kind == "tcp", "comm",
             "DTRAIN_TRANSPORT='{}': expected auto, shm or tcp", kind);
  }
  DT_CHECK(kind == "auto" || kind == "shm" || kind == "tcp" || kind == "mpi", "comm",
           "transport '{}': expected auto, shm, tcp or mpi", option);
  if (kind == "auto") kind = same_host ? "shm" : "tcp";
  return kind;
}

// Ranks that chose different transports would each wait for the other at the rendezvous until
// the timeout; compare the choices first and name the odd one out.
void check_same_choice(Store& store, const std::string& name, int rank, int size, const std::string& kind,
                       Duration timeout) {
  store.set(fmt::format("{}/transport/{}", name, rank), kind);
  for (int r = 0; r < size; ++r) {
    const std::string theirs = store.get(fmt::format("{}/transport/{}", name, r), timeout);
    DT_CHECK(theirs == kind, "comm",
             "group '{}': rank {} uses transport {} but rank {} uses {} (set DTRAIN_TRANSPORT the same on every rank)",
             name, rank, kind, r, net::printable(theirs));
  }
}

bool is_loopback(const std::string& address) {
  return address == "localhost" || address == "::1" || address.starts_with("127.");
}

void check_root(int root, int size, const char* op) {
  DT_CHECK(root >= 0 && root < size, "comm", "{}: root {} out of range for a group of {}", op, root, size);
}

}  // namespace

Group Group::create(std::shared_ptr<Store> store, int rank, int size, GroupOptions options, const std::string& name) {
  DT_CHECK(store != nullptr, "comm", "Group::create: no store");
  DT_CHECK(size >= 1 && rank >= 0 && rank < size, "comm", "Group::create: rank {} of size {}", rank, size);
  if (options.algorithm == Algorithm::automatic) {
    if (const char* a = std::getenv("DTRAIN_ALGO")) options.algorithm = parse_algorithm(a);
  }
  auto impl = std::make_shared<Impl>();
  impl->rank = rank;
  impl->size = size;
  impl->name = name;
  impl->options = options;
  impl->store = store;

  // Which transport: shared memory when every rank runs on this host, TCP otherwise.
  const std::string me = host_identity(options);
  store->set(fmt::format("{}/host/{}", name, rank), me);
  bool same_host = true;
  std::vector<std::string> hosts;         // in order of their lowest rank
  std::vector<int> ranks_on(size, 0), host_of(size, 0), local_rank_of(size, 0);
  for (int r = 0; r < size; ++r) {
    const std::string id = store->get(fmt::format("{}/host/{}", name, r), options.timeout);
    if (id != me) same_host = false;
    const auto it = std::find(hosts.begin(), hosts.end(), id);
    const int h = static_cast<int>(it - hosts.begin());
    if (it == hosts.end()) hosts.push_back(id);
    host_of[r] = h;
    local_rank_of[r] = ranks_on[h]++;
  }
  const std::string kind = choose_transport(options.transport, same_host);
  DT_CHECK(!(kind == "shm" && !same_host), "comm", "group '{}': transport shm needs every rank on one host", name);
  check_same_choice(*store, name, rank, size, kind, options.timeout);
  if (kind == "shm") {
    impl->transport = make_shm_transport(*store, name, rank, size, options.timeout, options.spin);
  } else if (kind == "mpi") {
    impl->transport = make_mpi_transport(*store, name, rank, size, options.timeout);
  } else {
    std::string secret = options.secret;
    const bool from_env = secret.empty();
    if (from_env) {
      const char* env = std::getenv("DTRAIN_SECRET");
      secret = env != nullptr ? env : "";
    }
    DT_CHECK(!secret.empty(), "comm",
             "group '{}': the tcp transport needs the job secret (GroupOptions::secret or DTRAIN_SECRET)", name);
    check_secret(secret, fmt::format("group '{}': {}", name, from_env ? "DTRAIN_SECRET" : "GroupOptions::secret"));
    const std::string bind = options.bind_address.empty() ? "127.0.0.1" : options.bind_address;
    DT_CHECK(same_host || !is_loopback(bind) || !options.host_id.empty(), "comm",
             "group '{}': ranks span several hosts but rank {} would publish the loopback address {}; set "
             "GroupOptions::bind_address (or DTRAIN_BIND_ADDR) to an address the other hosts can reach",
             name, rank, bind);
    impl->transport = make_tcp_transport(*store, name, rank, size, secret, bind, options.timeout);
    const int n_hosts = static_cast<int>(hosts.size());
    const bool uniform = std::all_of(ranks_on.begin(), ranks_on.begin() + n_hosts,
                                     [&](int k) { return k == ranks_on[0]; });
    if (n_hosts >= 2 && uniform && ranks_on[0] >= 2) {
      impl->hierarchy = std::make_unique<Impl::Hierarchy>();
      impl->hierarchy->hosts = n_hosts;
      impl->hierarchy->host = host_of[rank];
      impl->hierarchy->local_size = ranks_on[0];
      impl->hierarchy->local_rank = local_rank_of[rank];
    }
  }
  DT_CHECK(options.algorithm != Algorithm::direct || impl->transport->direct() != nullptr, "comm",
           "group '{}': algorithm 'direct' needs a transport with native collectives (shm), not {}", name,
           impl->transport->kind());
  impl->kind = impl->transport->kind();
  impl->recorder = std::make_shared<health::FlightRecorder>(options.flight_record_size);
  Impl* raw = impl.get();
  impl->registration = health::register_group([raw](const std::string& reason) { raw->abort(reason); },
                                               [raw] { return raw->describe_json(); });
  if (options.heartbeat_timeout > Duration::zero() && size > 1) {
    impl->heartbeat = std::make_unique<health::Heartbeat>(
        options.heartbeat_store ? options.heartbeat_store : store, name, rank, size, options.heartbeat_interval,
        options.heartbeat_timeout, [rank](const std::string& reason) {
          DT_LOG_ERROR("rank {}: {}; aborting every pending operation", rank, reason);
          health::abort_all(reason);
        });
  }
  impl->worker = std::thread([raw] { raw->run(); });
  return Group(impl);
}

Group Group::from_env(GroupOptions options) {
  const LauncherVars vars = launcher_vars();
  const int rank = env_int(vars.rank != nullptr ? vars.rank : "RANK");  // names RANK when none is set
  const int size = env_int(vars.size != nullptr ? vars.size : "WORLD_SIZE");
  const char* addr = std::getenv("MASTER_ADDR");
  const char* secret = std::getenv("DTRAIN_SECRET");
  DT_CHECK(addr != nullptr && *addr != '\0', "comm",
           "environment variable MASTER_ADDR is not set (start ranks with dtrain launch; under mpirun or srun "
           "without MASTER_ADDR and MASTER_PORT, use --backend mpi)");
  DT_CHECK(secret != nullptr && *secret != '\0', "comm", "environment variable DTRAIN_SECRET is not set");
  const int port = env_int("MASTER_PORT");
  DT_CHECK(port > 0 && port < 65536, "comm", "MASTER_PORT {} out of range", port);
  if (options.bind_address.empty()) {
    const char* bind = std::getenv("DTRAIN_BIND_ADDR");
    if (bind != nullptr && *bind != '\0') {
      options.bind_address = bind;
    } else {
      try {
        options.bind_address = net::local_address_toward(addr, static_cast<uint16_t>(port));
      } catch (const net::NetError& e) {
        DT_THROW("comm", "cannot find the local address that reaches MASTER_ADDR={} ({}); set DTRAIN_BIND_ADDR", addr,
                 e.message());
      }
    }
  }
  if (options.secret.empty()) options.secret = secret;
  std::shared_ptr<void> server;
  const char* hosted = std::getenv("DTRAIN_STORE_HOSTED");
  if (rank == 0 && (hosted == nullptr || std::string(hosted) != "1")) {
    server = std::make_shared<TcpStoreServer>(addr, static_cast<uint16_t>(port), secret);
  }
  auto store = connect_tcp_store(addr, static_cast<uint16_t>(port), secret, options.timeout);
  if (options.heartbeat_timeout > Duration::zero() && !options.heartbeat_store) {
    // Its own connection: the group's requests (a blocking get) must not hold up a heartbeat;
    // and a short I/O timeout, so that a silent store counts as a missed beat, not a long wait.
    options.heartbeat_store = connect_tcp_store(addr, static_cast<uint16_t>(port), secret,
                                                std::max(options.heartbeat_timeout, Duration(1000)));
  }
  // An elastic job meets in rounds at one store: each round's world has a name of its own.
  const char* run = std::getenv("DTRAIN_RUN_ID");
  const std::string name = run != nullptr && *run != '\0' ? fmt::format("world@{}", run) : "world";
  // Under dtrain launch, the launcher tells a rank that ends before the job does (exit code 0
  // without leaving its world, or before joining it while others wait) from one that finished.
  const bool launched = hosted != nullptr && std::string(hosted) == "1";
  if (launched) store->set(fmt::format("{}/joined/{}", name, rank), std::to_string(::getpid()));
  Group g = create(store, rank, size, options, name);
  g.impl_->keep_alive = server;
  if (launched) g.impl_->left_key = fmt::format("{}/left/{}", name, rank);
  return g;
}

LauncherVars launcher_vars() {
  LauncherVars v;
  v.rank = first_set({"RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"});
  v.size = first_set({"WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"});
  if (first_set({"SLURM_STEP_ID", "SLURM_STEPID"}) != nullptr) {
    if (v.rank == nullptr) v.rank = first_set({"SLURM_PROCID"});
    if (v.size == nullptr) v.size = first_set({"SLURM_NTASKS"});
  }
  return v;
}

Group Group::from_mpi(GroupOptions options) {
  const MpiWorld world = mpi_world();
  // The store (splits, heartbeats, checks) is served by rank 0; its address and a fresh secret
  // reach the others through MPI itself.
  std::shared_ptr<TcpStoreServer> server;
  std::string contact;
  if (world.rank == 0) {
    const char* master = std::getenv("MASTER_ADDR");
    std::string host = master != nullptr && *master != '\0' ? master : "";
    std::string bind = host;
    if (host.empty()) {
      if (world.one_host) {
        host = bind = "127.0.0.1";
      } else {
        char name[256] = {};
        ::gethostname(name, sizeof(name) - 1);
        host = name;
        bind = "0.0.0.0";
      }
    }
    const std::string secret = make_secret();
    try {
      server = std::make_shared<TcpStoreServer>(bind, 0, secret);
      contact = fmt::format("{}\n{}\n{}", host, server->port(), secret);
    } catch (const std::exception& e) {
      contact = fmt::format("!{}", e.what());  // the others raise it too instead of waiting
    }
  }
  contact = mpi_broadcast_from_root(contact);
  DT_CHECK(contact.empty() || contact[0] != '!', "comm", "from_mpi: rank 0 could not serve the store: {}",
           contact.substr(1));
  const size_t a = contact.find('\n'), b = contact.rfind('\n');
  DT_CHECK(a != std::string::npos && b != a, "comm", "from_mpi: malformed store contact from rank 0");
  const std::string host = contact.substr(0, a);
  const auto port = static_cast<uint16_t>(std::stoi(contact.substr(a + 1, b - a - 1)));
  const std::string secret = contact.substr(b + 1);
  auto store = connect_tcp_store(host, port, secret, options.timeout);
  if (options.heartbeat_timeout > Duration::zero() && !options.heartbeat_store) {
    options.heartbeat_store = connect_tcp_store(host, port, secret, std::max(options.heartbeat_timeout, Duration(1000)));
  }
  options.transport = "mpi";
  options.secret = secret;
  Group g = create(store, world.rank, world.size, options, "world");
  g.impl_->keep_alive = server;
  return g;
}

int Group::rank() const { return impl_ ? impl_->rank : -1; }
int Group::size() const { return impl_ ? impl_->size : 0; }
const std::string& Group::transport_kind() const {
  static const std::string none = "none";
  return impl_ ? impl_->kind : none;
}

const GroupOptions& Group::options() const { return impl("options").options; }

std::vector<FlightEntry> Group::flight_record() const { return impl("flight_record").recorder->entries(); }

Group Group::split(int color, int key) const {
  DT_CHECK(impl_ != nullptr, "comm", "split on an empty group");
  return split(color, key, impl_->options);
}

Algorithm Group::all_reduce_algorithm(size_t bytes) const {
  const Impl& g = impl("all_reduce_algorithm");
  if (g.direct_for(g.options.algorithm) != nullptr) return Algorithm::direct;
  return g.hierarchical_for(bytes) ? Algorithm::hierarchical : g.algorithm_for(bytes);
}

Group Group::split(int color, int key, const GroupOptions& requested) const {
  DT_CHECK(impl_ != nullptr, "comm", "split on an empty group");
  GroupOptions options = requested;
  // Where this process listens, its secret and its host are the parent's unless set.
  if (options.bind_address.empty()) options.bind_address = impl_->options.bind_address;
  if (options.secret.empty()) options.secret = impl_->options.secret;
  if (options.host_id.empty()) options.host_id = impl_->options.host_id;
  options.heartbeat_timeout = Duration::zero();  // the parent's heartbeat covers these processes
  options.heartbeat_store = nullptr;
  const int n = size();
  std::vector<int32_t> mine = {color, key};
  std::vector<int32_t> all(static_cast<size_t>(2 * n));
  const_cast<Group*>(this)->all_gather(mine.data(), all.data(), 2, DataType::i32);
  const uint64_t split_id = impl_->splits++;
  if (color < 0) return Group();
  std::vector<std::pair<std::pair<int, int>, int>> members;  // ((key, rank), rank)
  for (int r = 0; r < n; ++r) {
    if (all[2 * r] == color) members.push_back({{all[2 * r + 1], r}, r});
  }
  std::sort(members.begin(), members.end());
  int new_rank = -1;
  for (size_t i = 0; i < members.size(); ++i) {
    if (members[i].second == rank()) new_rank = static_cast<int>(i);
  }
  return create(impl_->store, new_rank, static_cast<int>(members.size()), options,
                fmt::format("{}/split{}/color{}", impl_->name, split_id, color));
}

// ---------------------------------------------------------------------------------- collectives
//
// Each collective is written once, with a `blocking` flag: the blocking form may run inline.

namespace {

using Impl = Group::Impl;

Work all_reduce_impl(Impl& g, const void* send, void* recv, size_t count, DataType dtype, ReduceOp op, bool blocking) {
  if (g.hierarchical_for(count * size_of(dtype))) {
    return g.dispatch(
        "all_reduce", true, blocking,
        [&g, send, recv, count, dtype, op](uint64_t, Deadline deadline) {
          g.hierarchical_all_reduce(send, recv, count, dtype, op, deadline);
          return true;
        },
        count * size_of(dtype));
  }
  if (g.direct_for(g.options.algorithm) != nullptr) {
    return g.run_direct("all_reduce", blocking, [=](DirectCollectives& d, Deadline deadline) {
      d.all_reduce(send, recv, count, dtype, op, deadline);
    }, count * size_of(dtype));
  }
  Plan plan = plan_all_reduce(g.algorithm_for(count * size_of(dtype)), g.rank, g.size, count);
  return g.run_plan("all_reduce", std::move(plan), send, recv, dtype, op, blocking, count * size_of(dtype));
}

// The group's algorithm where it applies to reduce_scatter / all_gather, else the ring.
Algorithm reduce_scatter_algorithm(const Impl& g) {
  const Algorithm a = g.options.algorithm;
  return a == Algorithm::halving_doubling ? a : Algorithm::ring;
}

Algorithm all_gather_algorithm(const Impl& g) {
  const Algorithm a = g.options.algorithm;
  return a == Algorithm::halving_doubling || a == Algorithm::recursive_doubling ? a : Algorithm::ring;
}

Work reduce_scatter_impl(Impl& g, const void* send, void* recv, size_t recv_count, DataType dtype, ReduceOp op,
                         bool blocking) {
  if (g.direct_for(g.options.algorithm) != nullptr) {
    return g.run_direct("reduce_scatter", blocking, [=](DirectCollectives& d, Deadline deadline) {
      d.reduce_scatter(send, recv, recv_count, dtype, op, deadline);
    }, recv_count * g.size * size_of(dtype));
  }
  std::vector<size_t> counts(static_cast<size_t>(g.size), recv_count);
  return g.run_plan("reduce_scatter", plan_reduce_scatter(reduce_scatter_algorithm(g), g.rank, g.size, counts), send,
                    recv, dtype, op, blocking, recv_count * g.size * size_of(dtype));
}

Work all_gather_impl(Impl& g, const void* send, void* recv, size_t send_count, DataType dtype, bool blocking) {
  if (g.direct_for(g.options.algorithm) != nullptr) {
    return g.run_direct("all_gather", blocking, [=](DirectCollectives& d, Deadline deadline) {
      d.all_gather(send, recv, send_count, dtype, deadline);
    }, send_count * size_of(dtype));
  }
  std::vector<size_t> counts(static_cast<size_t>(g.size), send_count);
  return g.run_plan("all_gather", plan_all_gather(all_gather_algorithm(g), g.rank, g.size, counts), send, recv,
                    dtype, ReduceOp::sum, blocking, send_count * size_of(dtype));
}

Work broadcast_impl(Impl& g, void* buffer, size_t count, DataType dtype, int root, bool blocking) {
  check_root(root, g.size, "broadcast");
  if (g.direct_for(g.options.algorithm) != nullptr) {
    return g.run_direct("broadcast", blocking, [=](DirectCollectives& d, Deadline deadline) {
      d.broadcast(buffer, count, dtype, root, deadline);
    }, count * size_of(dtype), root);
  }
  return g.run_plan("broadcast", plan_broadcast(Algorithm::binomial, g.rank, g.size, count, root), buffer, buffer,
                    dtype, ReduceOp::sum, blocking, count * size_of(dtype), root);
}

void check_peer(const Impl& g, int peer, const char* op) {
  DT_CHECK(peer >= 0 && peer < g.size && peer != g.rank, "comm", "{}: peer {} invalid for rank {} of {}", op, peer,
           g.rank, g.size);
}

Work p2p_impl(Impl& g, bool is_send, void* buffer, size_t count, DataType dtype, int peer, uint32_t tag,
              bool blocking) {
  check_peer(g, peer, is_send ? "send" : "recv");
  return g.start_p2p(is_send, buffer, count * size_of(dtype), peer, tag, blocking);
}

bool overlaps(const float* a, size_t na, const float* b, size_t nb) {
  if (na == 0 || nb == 0) return false;
  const auto a0 = reinterpret_cast<uintptr_t>(a);
  const auto b0 = reinterpret_cast<uintptr_t>(b);
  return a0 < b0 + nb * sizeof(float) && b0 < a0 + na * sizeof(float);
}

// The compressed collectives (compress_collectives.cpp), checked here in the caller's thread
// so that a bad argument raises without breaking the group.
Work compressed_impl(Impl& g, detail::CompressedKind kind, const float* send, float* recv, size_t block_count,
                     Codec codec, ReduceOp op, float* residual, CompressStats* stats, bool blocking) {
  const bool all_reduce = kind == detail::CompressedKind::all_reduce;
  const char* name = all_reduce ? "all_reduce_compressed" : "reduce_scatter_compressed";
  DT_CHECK(op == ReduceOp::sum || op == ReduceOp::avg, "comm", "{}: op {} is not supported (sum or avg)", name,
           name_of(op));
  DT_CHECK(codec <= Codec::int4, "comm", "{}: unknown codec {}", name, static_cast<int>(codec));
  const auto p = static_cast<size_t>(g.size);
  const size_t total = all_reduce ? block_count : block_count * p;
  DT_CHECK(!overlaps(residual, total, send, total) && !overlaps(residual, total, recv, block_count), "comm",
           "{}: the residual buffer overlaps the send or recv buffer", name);
  detail::CompressedCall call{kind, send, recv, {}, codec, op, residual, stats};
  call.counts = all_reduce ? detail::even_counts(block_count, g.size) : std::vector<size_t>(p, block_count);
  return g.dispatch(
      name, true, blocking,
      [&g, call = std::move(call)](uint64_t seq, Deadline deadline) {
        detail::execute_compressed(call, *g.transport, seq, deadline);
        return true;
      },
      total * sizeof(float));
}

}  // namespace

Impl& Group::impl(const char* op) const {
  DT_CHECK(impl_ != nullptr, "comm", "{} on an empty group", op);
  return *impl_;
}

Work Group::all_reduce_async(const void* send, void* recv, size_t count, DataType dtype, ReduceOp op) {
  return all_reduce_impl(impl("all_reduce"), send, recv, count, dtype, op, false);
}

Work Group::reduce_scatter_async(const void* send, void* recv, size_t recv_count, DataType dtype, ReduceOp op) {
  return reduce_scatter_impl(impl("reduce_scatter"), send, recv, recv_count, dtype, op, false);
}

Work Group::all_gather_async(const void* send, void* recv, size_t send_count, DataType dtype) {
  return all_gather_impl(impl("all_gather"), send, recv, send_count, dtype, false);
}

Work Group::broadcast_async(void* buffer, size_t count, DataType dtype, int root) {
  return broadcast_impl(impl("broadcast"), buffer, count, dtype, root, false);
}

Work Group::send_async(const void* buffer, size_t count, DataType dtype, int peer, uint32_t tag) {
  return p2p_impl(impl("send"), true, const_cast<void*>(buffer), count, dtype, peer, tag, false);
}

Work Group::recv_async(void* buffer, size_t count, DataType dtype, int peer, uint32_t tag) {
  return p2p_impl(impl("recv"), false, buffer, count, dtype, peer, tag, false);
}

Work Group::all_reduce_compressed_async(const float* send, float* recv, size_t count, Codec codec, ReduceOp op,
                                        float* residual, CompressStats* stats) {
  return compressed_impl(impl("all_reduce_compressed"), detail::CompressedKind::all_reduce, send, recv, count, codec,
                         op, residual, stats, false);
}

Work Group::reduce_scatter_compressed_async(const float* send, float* recv, size_t recv_count, Codec codec, ReduceOp op,
                                            float* residual, CompressStats* stats) {
  return compressed_impl(impl("reduce_scatter_compressed"), detail::CompressedKind::reduce_scatter, send, recv,
                         recv_count, codec, op, residual, stats, false);
}

void Group::all_reduce_compressed(const float* send, float* recv, size_t count, Codec codec, ReduceOp op,
                                  float* residual, CompressStats* stats) {
  compressed_impl(impl("all_reduce_compressed"), detail::CompressedKind::all_reduce, send, recv, count, codec, op,
                  residual, stats, true)
      .wait();
}

void Group::reduce_scatter_compressed(const float* send, float* recv, size_t recv_count, Codec codec, ReduceOp op,
                                      float* residual, CompressStats* stats) {
  compressed_impl(impl("reduce_scatter_compressed"), detail::CompressedKind::reduce_scatter, send, recv, recv_count,
                  codec, op, residual, stats, true)
      .wait();
}

void Group::all_reduce(const void* send, void* recv, size_t count, DataType dtype, ReduceOp op) {
  Impl& g = impl("all_reduce");
  if (DirectCollectives* d = g.direct_for(g.options.algorithm)) {
    if (g.run_inline("all_reduce", count * size_of(dtype), -1, [&](Deadline deadline) { d->all_reduce(send, recv, count, dtype, op, deadline); })) {
      return;
    }
  }
  all_reduce_impl(g, send, recv, count, dtype, op, true).wait();
}

void Group::reduce_scatter(const void* send, void* recv, size_t recv_count, DataType dtype, ReduceOp op) {
  reduce_scatter_impl(impl("reduce_scatter"), send, recv, recv_count, dtype, op, true).wait();
}

void Group::reduce_scatter_v(const void* send, void* recv, const std::vector<size_t>& counts, DataType dtype,
                             ReduceOp op) {
  Impl& g = impl("reduce_scatter_v");
  DT_CHECK(counts.size() == static_cast<size_t>(size()), "comm", "reduce_scatter_v: {} counts for a group of {}",
           counts.size(), size());
  g.run_plan("reduce_scatter_v", plan_reduce_scatter(reduce_scatter_algorithm(g), rank(), size(), counts), send,
             recv, dtype, op, true)
      .wait();
}

void Group::all_gather(const void* send, void* recv, size_t send_count, DataType dtype) {
  all_gather_impl(impl("all_gather"), send, recv, send_count, dtype, true).wait();
}

void Group::all_gather_v(const void* send, void* recv, const std::vector<size_t>& counts, DataType dtype) {
  Impl& g = impl("all_gather_v");
  DT_CHECK(counts.size() == static_cast<size_t>(size()), "comm", "all_gather_v: {} counts for a group of {}",
           counts.size(), size());
  g.run_plan("all_gather_v", plan_all_gather(all_gather_algorithm(g), rank(), size(), counts), send, recv, dtype,
             ReduceOp::sum, true)
      .wait();
}

void Group::broadcast(void* buffer, size_t count, DataType dtype, int root) {
  broadcast_impl(impl("broadcast"), buffer, count, dtype, root, true).wait();
}

void Group::reduce(const void* send, void* recv, size_t count, DataType dtype, ReduceOp op, int root) {
  Impl& g = impl("reduce");
  check_root(root, size(), "reduce");
  g.run_plan("reduce", plan_reduce(Algorithm::binomial, rank(), size(), count, root), send, recv, dtype, op, true,
             count * size_of(dtype), root)
      .wait();
}

void Group::gather(const void* send, void* recv, size_t count, DataType dtype, int root) {
  Impl& g = impl("gather");
  check_root(root, size(), "gather");
  std::vector<size_t> counts(static_cast<size_t>(size()), count);
  g.run_plan("gather", plan_gather(Algorithm::binomial, rank(), size(), counts, root), send, recv, dtype,
             ReduceOp::sum, true)
      .wait();
}

void Group::scatter(const void* send, void* recv, size_t count, DataType dtype, int root) {
  Impl& g = impl("scatter");
  check_root(root, size(), "scatter");
  std::vector<size_t> counts(static_cast<size_t>(size()), count);
  g.run_plan("scatter", plan_scatter(Algorithm::binomial, rank(), size(), counts, root), send, recv, dtype,
             ReduceOp::sum, true)
      .wait();
}

void Group::all_to_all(const void* send, void* recv, size_t count, DataType dtype) {
  Impl& g = impl("all_to_all");
  DT_CHECK(send != recv || count == 0 || size() == 1, "comm", "all_to_all cannot run in place");
  g.run_plan("all_to_all", plan_all_to_all(Algorithm::pairwise, rank(), size(), count), send, recv, dtype,
             ReduceOp::sum, true)
      .wait();
}

bool Group::can_share_memory() const {
  Impl& g = impl("can_share_memory");
  return g.kind == "shm" && g.transport->direct() != nullptr;
}

SharedMemory Group::allocate_shared(size_t bytes) {
  Impl& g = impl("allocate_shared");
  DT_CHECK(can_share_memory(), "comm",
           "group '{}': allocate_shared needs every rank on one host over the shm transport, not {}", g.name, g.kind);
  const std::string prefix = fmt::format("{}/mem{}", g.name, g.shared_allocations++);
  auto mapping = std::make_shared<shm::Mapping>(
      shm::share_mapping(*g.store, prefix, g.rank, g.size, bytes, g.options.timeout));
  SharedMemory m;
  m.data_ = mapping->data();
  m.bytes_ = bytes;
  m.mapping_ = std::move(mapping);
  return m;
}

namespace {

// The byte at which rank 0's vector of `bytes` starts in `memory`, after checking that every
// rank's vector, `stride` bytes apart from `offset`, fits without overlapping.
char* shared_vectors(const SharedMemory& memory, bool can_share, const std::string& group,
                           const std::string& kind, const char* op, size_t offset, size_t stride, size_t bytes,
                           int size) {
  DT_CHECK(memory.valid() && can_share, "comm", "group '{}': {} needs memory from allocate_shared on a shm group ({})",
           group, op, kind);
  size_t span = 0, end = 0;
  const bool wraps = __builtin_mul_overflow(static_cast<size_t>(size - 1), stride, &span) ||
                     __builtin_add_overflow(span, offset, &end) || __builtin_add_overflow(end, bytes, &end);
  DT_CHECK(!wraps && end <= memory.bytes() && (size == 1 || stride >= bytes), "comm",
           "{}: vectors of {} bytes at offset {} every {} bytes do not fit {} bytes of shared memory without "
           "overlapping", op, bytes, offset, stride, memory.bytes());
  return memory.data() + offset;
}

}  // namespace

Work Group::reduce_scatter_shared_async(const SharedMemory& memory, size_t offset, size_t stride, void* recv,
                                        size_t recv_count, DataType dtype, ReduceOp op) {
  Impl& g = impl("reduce_scatter_shared");
  const size_t input = static_cast<size_t>(g.size) * recv_count * size_of(dtype);
  const char* inputs = shared_vectors(memory, can_share_memory(), g.name, g.kind, "reduce_scatter_shared", offset,
                                      stride, input, g.size);
  return g.run_direct(
      "reduce_scatter_shared", false,
      [=, keep = memory.keep_alive()](DirectCollectives& d, Deadline deadline) {
        d.reduce_scatter_mapped(inputs, stride, recv, recv_count, dtype, op, deadline);
      },
      input);
}

Work Group::all_reduce_shared_impl(const SharedMemory& memory, size_t offset, size_t stride, size_t count,
                                   DataType dtype, ReduceOp op, bool blocking) {
  Impl& g = impl("all_reduce_shared");
  size_t bytes = 0;
  DT_CHECK(!__builtin_mul_overflow(count, size_of(dtype), &bytes), "comm", "all_reduce_shared: {} elements of {} overflow",
           count, name_of(dtype));
  char* vectors = shared_vectors(memory, can_share_memory(), g.name, g.kind, "all_reduce_shared", offset, stride,
                                 bytes, g.size);
  return g.run_direct(
      "all_reduce_shared", blocking,
      [=, keep = memory.keep_alive()](DirectCollectives& d, Deadline deadline) {
        d.all_reduce_mapped(vectors, stride, count, dtype, op, deadline);
      },
      bytes);
}

Work Group::all_reduce_shared_async(const SharedMemory& memory, size_t offset, size_t stride, size_t count,
                                    DataType dtype, ReduceOp op) {
  return all_reduce_shared_impl(memory, offset, stride, count, dtype, op, false);
}

void Group::all_reduce_shared(const SharedMemory& memory, size_t offset, size_t stride, size_t count, DataType dtype,
                              ReduceOp op) {
  // Blocking: runs on the caller's thread when nothing is queued, like the blocking all_reduce.
  all_reduce_shared_impl(memory, offset, stride, count, dtype, op, true).wait();
}

void Group::barrier() {
  Impl& g = impl("barrier");
  if (DirectCollectives* d = g.direct_for(g.options.algorithm)) {
    if (g.run_inline("barrier", 0, -1, [&](Deadline deadline) { d->barrier(deadline); })) return;
    g.run_direct("barrier", true, [](DirectCollectives& dc, Deadline deadline) { dc.barrier(deadline); }).wait();
    return;
  }
  g.run_plan("barrier", plan_barrier(rank(), size()), nullptr, nullptr, DataType::u8, ReduceOp::sum, true).wait();
}

void Group::send(const void* buffer, size_t count, DataType dtype, int peer, uint32_t tag) {
  p2p_impl(impl("send"), true, const_cast<void*>(buffer), count, dtype, peer, tag, true).wait();
}

void Group::recv(void* buffer, size_t count, DataType dtype, int peer, uint32_t tag) {
  p2p_impl(impl("recv"), false, buffer, count, dtype, peer, tag, true).wait();
}

}  // namespace dtrain::comm
