// The progress engine of a group (src/comm/executor.h) against a fake transport whose requests
// complete, fail or hang exactly when the test says: completions in any order, a failing peer,
// deadlines, abort, the inline path, teardown. No network, no second rank, no sleeps.
#include <gtest/gtest.h>
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <future>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "../src/comm/executor.h"
#include "comm_test_util.h"
#include "dtrain/comm/transport.h"

using namespace dtrain::comm;
using dtrain::comm::detail::Executor;
using dtrain::comm::test_util::since;
using Kind = TransportError::Kind;
using namespace std::chrono_literals;

namespace {

// Rank 0 of 3. A request completes when the test calls complete(); fail_peer(p) makes every
// later test()/wait() that covers a request to or from p throw peer_dead naming p; abort()
// fails every test()/wait() with `aborted`, as a real transport does.
class FakeTransport : public Transport {
 public:
  struct Posted {
    RequestId id;
    bool send;
    int peer;
    uint64_t tag;
    size_t bytes;
  };

  int rank() const override { return 0; }
  int size() const override { return 3; }
  TransportKind kind() const override { return TransportKind::none; }

  RequestId post_send(int peer, uint64_t tag, const void*, size_t bytes) override {
    return post(true, peer, tag, bytes);
  }
  RequestId post_recv(int peer, uint64_t tag, void*, size_t bytes) override { return post(false, peer, tag, bytes); }

  void wait(const std::vector<RequestId>& requests, Deadline deadline) override {
    std::unique_lock<std::mutex> lock(mu_);
    while (!reap(requests)) {
      if (cv_.wait_until(lock, deadline) == std::cv_status::timeout && !reap(requests)) {
        std::vector<int> peers;
        for (RequestId id : requests) {
          if (auto it = pending_.find(id); it != pending_.end()) peers.push_back(it->second.peer);
        }
        throw TransportError(Kind::timeout, peers, "fake: not complete by the deadline", __FILE__, __LINE__);
      }
    }
  }

  bool test(const std::vector<RequestId>& requests) override {
    std::lock_guard<std::mutex> lock(mu_);
    ++tests_;
    cv_.notify_all();
    return reap(requests);
  }

  void abort(const std::string& reason) override {
    std::lock_guard<std::mutex> lock(mu_);
    abort_reasons_.push_back(reason);
    cv_.notify_all();
  }

  // ---- the test's side
  void complete(RequestId id) {
    std::lock_guard<std::mutex> lock(mu_);
    completed_.insert(id);
    cv_.notify_all();
  }
  void fail_peer(int peer) {
    std::lock_guard<std::mutex> lock(mu_);
    dead_peer_ = peer;
    cv_.notify_all();
  }
  // Waits until `n` requests were posted in all; returns them in posting order.
  std::vector<Posted> wait_posted(size_t n) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return posted_.size() >= n; });
    return posted_;
  }
  // Waits until the executor polled at least `n` more times (it is alive and polling).
  void wait_polls(int n) {
    std::unique_lock<std::mutex> lock(mu_);
    const long target = tests_ + n;
    cv_.wait(lock, [&] { return tests_ >= target; });
  }
  std::vector<std::string> abort_reasons() {
    std::lock_guard<std::mutex> lock(mu_);
    return abort_reasons_;
  }

 private:
  RequestId post(bool send, int peer, uint64_t tag, size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    const RequestId id = next_++;
    pending_[id] = Posted{id, send, peer, tag, bytes};
    posted_.push_back(pending_[id]);
    cv_.notify_all();
    return id;
  }
  // Under mu_: throws as the medium would; true (and forgets them) when every request completed.
  bool reap(const std::vector<RequestId>& requests) {
    if (!abort_reasons_.empty()) {
      throw TransportError(Kind::aborted, {}, "fake: aborted: " + abort_reasons_.front(), __FILE__, __LINE__);
    }
    for (RequestId id : requests) {
      auto it = pending_.find(id);
      if (it != pending_.end() && it->second.peer == dead_peer_) {
        throw TransportError(Kind::peer_dead, {dead_peer_}, "fake: rank " + std::to_string(dead_peer_) + " died",
                             __FILE__, __LINE__);
      }
    }
    for (RequestId id : requests) {
      if (pending_.count(id) != 0 && completed_.count(id) == 0) return false;
    }
    for (RequestId id : requests) pending_.erase(id);
    return true;
  }

  std::mutex mu_;
  std::condition_variable cv_;
  RequestId next_ = 1;
  std::map<RequestId, Posted> pending_;
  std::vector<Posted> posted_;
  std::set<RequestId> completed_;
  int dead_peer_ = -1;
  long tests_ = 0;
  std::vector<std::string> abort_reasons_;
};

struct Fixture {
  explicit Fixture(Duration timeout = 30s)
      : recorder(std::make_shared<detail::FlightRecorder>(16)),
        executor(std::make_unique<Executor>(fake, "g", 0, timeout, recorder, [this](const std::string& reason) {
          std::lock_guard<std::mutex> lock(mu);
          also_aborted.push_back(reason);
        })) {}
  std::vector<std::string> hooks() {
    std::lock_guard<std::mutex> lock(mu);
    return also_aborted;
  }
  FakeTransport fake;
  std::shared_ptr<detail::FlightRecorder> recorder;
  std::mutex mu;
  std::vector<std::string> also_aborted;
  std::unique_ptr<Executor> executor;
};

// A gate a body waits at until the test opens it (with the deadline as a bound).
struct Gate {
  std::promise<void> open;
  std::shared_future<void> opened = open.get_future().share();
  std::promise<void> reached;
};

std::string error_of(Work& w) {
  try {
    w.wait(10s);
  } catch (const CommError& e) {
    return e.what();
  }
  return "";
}

bool has(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

std::string thread_name() {
  char name[32] = {};
  ::pthread_getname_np(::pthread_self(), name, sizeof(name));
  return name;
}

TEST(Executor, SendsAndReceivesCompleteInTheOrderTheTransportCompletesThem) {
  Fixture f;
  char buf[64];
  Work a = f.executor->post(false, buf, 8, 1, 5, false);
  Work b = f.executor->post(false, buf + 8, 16, 2, 6, false);
  Work c = f.executor->post(true, buf + 32, 4, 1, 7, false);
  const auto posted = f.fake.wait_posted(3);
  ASSERT_EQ(posted.size(), 3u);
  // Posted in issue order, with the point-to-point bit above the plans' tags.
  EXPECT_FALSE(posted[0].send);
  EXPECT_EQ(posted[0].peer, 1);
  EXPECT_EQ(posted[0].tag, (uint64_t{1} << 63) | 5);
  EXPECT_EQ(posted[1].peer, 2);
  EXPECT_EQ(posted[1].bytes, 16u);
  EXPECT_TRUE(posted[2].send);

  f.fake.complete(posted[2].id);  // the last first
  c.wait(10s);
  EXPECT_FALSE(a.test());
  EXPECT_FALSE(b.test());
  f.fake.complete(posted[1].id);
  b.wait(10s);
  EXPECT_FALSE(a.test());
  f.fake.complete(posted[0].id);
  a.wait(10s);
  EXPECT_LE(c.finish_time(), b.finish_time());
  EXPECT_LE(b.finish_time(), a.finish_time());
}

TEST(Executor, CollectivesRunInIssueOrderWhileSendsAndReceivesWaitInFlight) {
  Fixture f;
  Gate gate;
  std::mutex mu;
  std::vector<uint64_t> order;
  auto record = [&](uint64_t seq) {
    std::lock_guard<std::mutex> lock(mu);
    order.push_back(seq);
  };
  char buf[8];
  Work recv = f.executor->post(false, buf, 8, 2, 0, false);  // stays in flight throughout
  Work first = f.executor->submit("all_reduce", false, [&](uint64_t seq, Deadline) {
    record(seq);
    gate.reached.set_value();
    gate.opened.wait();
  });
  gate.reached.get_future().wait();
  // Issued while `first` holds the transport: queued behind it, whatever their form.
  Work second = f.executor->submit("broadcast", false, [&](uint64_t seq, Deadline) { record(seq); });
  std::thread blocking([&] {
    f.executor
        ->submit("barrier", true,
                 [&](uint64_t seq, Deadline) {
                   record(seq);
                   EXPECT_EQ(thread_name(), "dtrain-progress");  // not the caller's: the executor was busy
                 })
        .wait(10s);
  });
  EXPECT_TRUE(test_util::eventually([&] { return f.recorder->entries().size() == 4; }));  // the barrier is queued
  EXPECT_FALSE(second.test());
  gate.open.set_value();
  second.wait(10s);
  blocking.join();
  first.wait(10s);
  std::lock_guard<std::mutex> lock(mu);
  // Collectives numbered 0, 1, 2 in issue order (the receive counts apart).
  EXPECT_EQ(order, (std::vector<uint64_t>{0, 1, 2}));
  EXPECT_FALSE(recv.test());
}

TEST(Executor, AFailingPeerFailsEveryPendingOperationNamingItAndBreaksTheExecutor) {
  Fixture f;
  char buf[16];
  Work from2 = f.executor->post(false, buf, 8, 2, 3, false);
  Work to1 = f.executor->post(true, buf + 8, 8, 1, 4, false);
  f.fake.wait_posted(2);
  f.fake.fail_peer(2);

  std::string e = error_of(from2);
  EXPECT_TRUE(has(e, "recv #0")) << e;
  EXPECT_TRUE(has(e, "recv from rank 2 (tag 3, 8 bytes)")) << e;
  EXPECT_TRUE(has(e, "fake: rank 2 died")) << e;
  EXPECT_TRUE(has(e, "(peers: 2)")) << e;
  try {
    from2.wait(1s);
    ADD_FAILURE() << "no error";
  } catch (const CommError& err) {
    EXPECT_EQ(err.op(), "recv");
    EXPECT_EQ(err.peers(), std::vector<int>{2});
  }
  // The send to a healthy peer fails too: the group is broken, its peers are told.
  e = error_of(to1);
  EXPECT_TRUE(has(e, "send #1")) << e;
  EXPECT_TRUE(has(e, "fake: rank 2 died")) << e;
  const auto reasons = f.fake.abort_reasons();
  ASSERT_EQ(reasons.size(), 1u);
  EXPECT_TRUE(has(reasons[0], "rank 0 failed in point-to-point: fake: rank 2 died")) << reasons[0];
  EXPECT_EQ(f.hooks(), reasons);  // also_abort saw the same reason
  EXPECT_TRUE(f.executor->broken());

  // Later operations fail at once, naming the first failure, and run no body.
  bool ran = false;
  Work later = f.executor->submit("all_reduce", false, [&](uint64_t, Deadline) { ran = true; });
  e = error_of(later);
  EXPECT_TRUE(has(e, "all_reduce #0: group 'g' is broken by an earlier failure")) << e;
  EXPECT_TRUE(has(e, "rank 2 died")) << e;
  EXPECT_FALSE(ran);
}

TEST(Executor, ACollectiveWhosePeerDiesFailsNamingItAndAbortsTheTransport) {
  Fixture f;
  Work w = f.executor->submit("all_gather", false, [&](uint64_t, Deadline deadline) {
    char x = 0;
    const RequestId id = f.fake.post_recv(1, 9, &x, 1);
    f.fake.fail_peer(1);
    f.fake.wait({id}, deadline);
  });
  try {
    w.wait(10s);
    ADD_FAILURE() << "no error";
  } catch (const CommError& e) {
    EXPECT_EQ(e.op(), "all_gather");
    EXPECT_EQ(e.seq(), 0u);
    EXPECT_EQ(e.peers(), std::vector<int>{1});
    EXPECT_TRUE(has(e.what(), "fake: rank 1 died")) << e.what();
  }
  const auto reasons = f.fake.abort_reasons();
  ASSERT_EQ(reasons.size(), 1u);
  EXPECT_TRUE(has(reasons[0], "rank 0 failed in all_gather #0: fake: rank 1 died")) << reasons[0];
  const auto record = f.recorder->entries();
  ASSERT_EQ(record.size(), 1u);
  EXPECT_EQ(record[0].state, FlightEntry::State::failed);
  EXPECT_TRUE(has(record[0].error, "rank 1 died")) << record[0].error;
}

TEST(Executor, ASendOrReceiveInFlightFailsAtItsDeadlineNamingThePeer) {
  Fixture f(150ms);
  char buf[8];
  const auto start = Clock::now();
  Work w = f.executor->post(false, buf, 8, 1, 2, false);  // never completed
  try {
    w.wait(20s);
    ADD_FAILURE() << "no timeout";
  } catch (const CommError& e) {
    EXPECT_EQ(e.peers(), std::vector<int>{1});
    EXPECT_TRUE(has(e.what(), "recv from rank 1 (tag 2, 8 bytes) not complete after 150 ms")) << e.what();
  }
  EXPECT_GE(since(start), 150ms);
  EXPECT_LT(since(start), 5s);
  ASSERT_EQ(f.fake.abort_reasons().size(), 1u);  // the peer is told, as for any failure
}

TEST(Executor, ABodyGetsTheExecutorsTimeoutAsItsDeadline) {
  Fixture f(150ms);
  const auto start = Clock::now();
  Work w = f.executor->submit(
      "reduce", false,
      [&](uint64_t, Deadline deadline) {
        char x = 0;
        f.fake.wait({f.fake.post_recv(2, 1, &x, 1)}, deadline);
      },
      1, 2);
  const std::string e = error_of(w);
  EXPECT_TRUE(has(e, "reduce #0: fake: not complete by the deadline (peers: 2)")) << e;
  EXPECT_GE(since(start), 150ms);
  EXPECT_LT(since(start), 5s);
}

TEST(Executor, AWaitThatGivesUpAbortsSoTheOperationStopsTouchingTheBuffers) {
  Fixture f;  // the operation's own deadline is 30 s away
  std::atomic<bool> body_ended{false};
  Work w = f.executor->submit("all_reduce", false, [&](uint64_t, Deadline deadline) {
    char x = 0;
    try {
      f.fake.wait({f.fake.post_recv(1, 1, &x, 1)}, deadline);
    } catch (...) {
      body_ended = true;
      throw;
    }
  });
  const auto start = Clock::now();
  try {
    w.wait(100ms);
    ADD_FAILURE() << "no timeout";
  } catch (const CommError& e) {
    EXPECT_TRUE(has(e.what(), "all_reduce #0: not complete after 100 ms")) << e.what();
  }
  EXPECT_LT(since(start), 5s);
  EXPECT_TRUE(body_ended);  // it ended before wait() threw
  const auto reasons = f.fake.abort_reasons();
  ASSERT_EQ(reasons.size(), 1u);  // the aborted body does not abort again
  EXPECT_EQ(reasons[0], "all_reduce #0 not complete after 100 ms");
  EXPECT_EQ(f.hooks(), reasons);
}

TEST(Executor, AbortFailsTheRunningOperationAndEveryLaterOne) {
  Fixture f;
  Gate gate;
  Work w = f.executor->submit("barrier", false, [&](uint64_t, Deadline deadline) {
    char x = 0;
    const RequestId id = f.fake.post_recv(1, 1, &x, 1);
    gate.reached.set_value();
    f.fake.wait({id}, deadline);
  });
  gate.reached.get_future().wait();
  f.executor->abort("heartbeat: rank 1 missed its beats");
  std::string e = error_of(w);
  EXPECT_TRUE(has(e, "barrier #0: fake: aborted: heartbeat: rank 1 missed its beats")) << e;
  EXPECT_EQ(f.fake.abort_reasons().size(), 1u);
  EXPECT_EQ(f.hooks(), std::vector<std::string>{"heartbeat: rank 1 missed its beats"});
  // A blocking call too (inline or queued, whichever the executor is free for).
  Work later = f.executor->submit("all_reduce", true, [](uint64_t, Deadline) { ADD_FAILURE() << "ran when broken"; });
  e = error_of(later);
  EXPECT_TRUE(has(e, "all_reduce #1: group 'g' is broken by an earlier failure")) << e;
}

TEST(Executor, BlockingCallsOnAnIdleExecutorRunInTheCallersThread) {
  Fixture f;
  const auto caller = std::this_thread::get_id();
  std::thread::id ran_on;
  Deadline seen{};
  const auto before = Clock::now();
  EXPECT_TRUE(f.executor->run_inline("all_reduce", 8, -1, [&](Deadline d) {
    ran_on = std::this_thread::get_id();
    seen = d;
  }));
  EXPECT_EQ(ran_on, caller);
  EXPECT_GE(seen, before + 30s - 100ms);  // the coarse clock may lag by one tick, never lead
  f.executor->submit("broadcast", true, [&](uint64_t, Deadline) { ran_on = std::this_thread::get_id(); }).wait(10s);
  EXPECT_EQ(ran_on, caller);

  // While an operation holds the transport, run_inline declines (the caller queues instead).
  Gate gate;
  Work busy = f.executor->submit("all_gather", false, [&](uint64_t, Deadline) {
    gate.reached.set_value();
    gate.opened.wait();
  });
  gate.reached.get_future().wait();
  EXPECT_FALSE(f.executor->run_inline("all_reduce", 8, -1, [](Deadline) { ADD_FAILURE() << "ran while busy"; }));
  gate.open.set_value();
  busy.wait(10s);

  // An inline failure is rethrown to the caller, recorded and breaks the executor. (The
  // progress thread may still hold the transport for a moment after `busy` completed.)
  try {
    while (!f.executor->run_inline("all_reduce", 8, -1, [](Deadline) {
      throw TransportError(Kind::protocol, {2}, "fake: rank 2 called broadcast", __FILE__, __LINE__);
    })) {
      std::this_thread::yield();
    }
    ADD_FAILURE() << "no error";
  } catch (const CommError& e) {
    EXPECT_EQ(e.peers(), std::vector<int>{2});
    EXPECT_TRUE(has(e.what(), "all_reduce #3: fake: rank 2 called broadcast")) << e.what();
  }
  const auto record = f.recorder->entries();
  ASSERT_EQ(record.size(), 4u);
  EXPECT_EQ(record[0].op, "all_reduce");
  EXPECT_EQ(record[0].state, FlightEntry::State::done);
  EXPECT_EQ(record[3].state, FlightEntry::State::failed);
  EXPECT_EQ(f.fake.abort_reasons().size(), 1u);
}

TEST(Executor, TeardownFailsWhatIsStillInFlight) {
  Fixture f;
  char buf[8];
  Work w = f.executor->post(true, buf, 8, 1, 0, false);
  f.fake.wait_posted(1);
  f.fake.wait_polls(2);  // the progress thread is polling it
  f.executor.reset();
  const std::string e = error_of(w);
  EXPECT_TRUE(has(e, "send to rank 1 (tag 0, 8 bytes): the group was destroyed while it was pending")) << e;
  EXPECT_TRUE(f.fake.abort_reasons().empty());  // a teardown is no failure to tell the peers of
}

}  // namespace
