// TCP transport: data integrity for every size class in both directions at once, rings of
// threads and of processes, queued messages, and every failure mode (protocol mismatch,
// timeout, dead or departed peer, abort, wrong secret, impostors at the handshake) with its
// message and its bound; then Group collectives over TCP.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <future>
#include <iostream>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "../src/comm/store/auth.h"
#include "../src/comm/tcp/net.h"
#include "../src/comm/tcp/tcp_wire.h"
#include "comm_test_util.h"
#include "dtrain/comm/group.h"
#include "dtrain/comm/store.h"
#include "dtrain/comm/transport.h"

namespace dtrain::comm {
namespace {

using namespace std::chrono_literals;
using Kind = TransportError::Kind;

// Generous bounds for what must succeed (a loaded 2-core machine), tight ones for failures.
constexpr Duration kRendezvousTimeout = 20000ms;
constexpr Duration kWaitTimeout = 20000ms;
const std::string kSecret =
    "1c3bb001f5158726072c1ffaa155ff16ae8abb2164296417592a6791d7c44922";  // strong: see comm::check_secret

std::string test_prefix(const std::string& what) {
  static std::atomic<int> counter{0};
  return fmt::format("tcptest-{}-{}-{}", ::getpid(), what, counter++);
}

std::vector<uint8_t> pattern(size_t bytes, uint64_t seed) {
  std::vector<uint8_t> v(bytes);
  for (size_t i = 0; i < bytes; ++i) v[i] = static_cast<uint8_t>((i * 131 + seed * 977 + (i >> 12)) & 0xff);
  return v;
}

// Index of the first differing byte, or -1: a readable failure for megabyte buffers.
long first_difference(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
  if (a.size() != b.size()) return 0;
  auto [ia, ib] = std::mismatch(a.begin(), a.end(), b.begin());
  return ia == a.end() ? -1 : static_cast<long>(ia - a.begin());
}

void wait_one(Transport& t, RequestId id, Duration timeout = kWaitTimeout) { t.wait({id}, deadline_after(timeout)); }

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// A one-shot event between rank threads. wait() is bounded, so a rank that failed before
// signalling cannot hang the test; signal() may be called more than once.
class Signal {
 public:
  void signal() {
    std::call_once(once_, [this] { promise_.set_value(); });
  }
  bool wait(Duration timeout = kWaitTimeout) { return future_.wait_for(timeout) == std::future_status::ready; }

 private:
  std::promise<void> promise_;
  std::shared_future<void> future_ = promise_.get_future().share();
  std::once_flag once_;
};

// Signals on scope exit, whichever way the scope is left.
struct SignalOnExit {
  Signal& s;
  ~SignalOnExit() { s.signal(); }
};

std::unique_ptr<Transport> connect(Store& store, const std::string& prefix, int rank, int size,
                                   const std::string& secret = kSecret, Duration timeout = kRendezvousTimeout) {
  return make_tcp_transport(store, prefix, rank, size, secret, "127.0.0.1", timeout);
}

// Runs `fn` on `size` ranks as threads, each with its own transport over one memory store.
// Returns each rank's error text ("" when it succeeded).
std::vector<std::string> run_threads(int size, const std::function<void(Transport&)>& fn) {
  auto store = make_memory_store();
  const std::string prefix = test_prefix("threads");
  std::vector<std::string> errors(static_cast<size_t>(size));
  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(size));
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      try {
        auto t = connect(*store, prefix, r, size);
        fn(*t);
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  }
  for (auto& th : threads) th.join();
  return errors;
}

void expect_all_ok(const std::vector<std::string>& errors) {
  for (size_t r = 0; r < errors.size(); ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

struct TempDir {
  TempDir() {
    std::string templ = (std::filesystem::temp_directory_path() / "dtrain-tcptest-XXXXXX").string();
    if (::mkdtemp(templ.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    path = templ;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  std::string path;
};

// Waits for a forked child at most `timeout`; kills it if it is still running. Returns its
// exit code, or -1 when it was killed or died of a signal.
int reap(pid_t pid, Duration timeout) {
  const auto deadline = deadline_after(timeout);
  int status = 0;
  for (;;) {
    const pid_t r = ::waitpid(pid, &status, WNOHANG);
    if (r == pid) return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    if (r < 0) return -1;
    if (Clock::now() >= deadline) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      return -1;
    }
    std::this_thread::sleep_for(1ms);
  }
}

// Runs fn(transport) as `rank` in a child process, over a file store in `dir`. Returns the pid.
pid_t fork_rank(const std::string& dir, const std::string& prefix, int rank, int size,
                const std::function<void(Transport&)>& fn) {
  std::cout.flush();
  std::cerr.flush();
  const pid_t pid = ::fork();
  if (pid != 0) return pid;
  int code = 0;
  try {
    auto store = make_file_store(dir);
    auto t = connect(*store, prefix, rank, size);
    fn(*t);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d (pid %d) failed: %s\n", rank, ::getpid(), e.what());
    code = 1;
  }
  std::cout.flush();
  std::fflush(stderr);
  ::_exit(code);
}

// ---- data integrity ----

class TcpExchange : public ::testing::TestWithParam<size_t> {};

TEST_P(TcpExchange, BothDirectionsAtOnceAreBitExact) {
  const size_t bytes = GetParam();
  auto errors = run_threads(2, [&](Transport& t) {
    EXPECT_EQ(t.kind(), TransportKind::tcp);
    const int peer = 1 - t.rank();
    const auto mine = pattern(bytes, static_cast<uint64_t>(t.rank()));
    std::vector<uint8_t> got(bytes, 0xee);
    const RequestId s = t.post_send(peer, 11, mine.data(), bytes);
    const RequestId r = t.post_recv(peer, 11, got.data(), bytes);
    // Waiting for the send alone must still drain the posted receive, or both sides stall once
    // the socket buffers are full.
    wait_one(t, s);
    wait_one(t, r);
    if (long at = first_difference(got, pattern(bytes, static_cast<uint64_t>(peer))); at >= 0) {
      throw std::runtime_error(fmt::format("rank {}: byte {} differs", t.rank(), at));
    }
  });
  expect_all_ok(errors);
}

INSTANTIATE_TEST_SUITE_P(CommTcp, TcpExchange,
                         ::testing::Values(size_t{0}, size_t{1}, size_t{4095}, (size_t{1} << 20) + 13,
                                           size_t{32} << 20),
                         [](const ::testing::TestParamInfo<size_t>& info) {
                           return fmt::format("bytes_{}", info.param);
                         });

// Each rank sends 4 MiB to the next and receives 4 MiB from the previous, all at once.
void ring_exchange(Transport& t) {
  constexpr size_t kBytes = size_t{4} << 20;
  const int n = t.size();
  const int next = (t.rank() + 1) % n;
  const int prev = (t.rank() + n - 1) % n;
  const auto mine = pattern(kBytes, static_cast<uint64_t>(t.rank()) + 100);
  std::vector<uint8_t> got(kBytes);
  const RequestId s = t.post_send(next, 5, mine.data(), kBytes);
  const RequestId r = t.post_recv(prev, 5, got.data(), kBytes);
  t.wait({s, r}, deadline_after(kWaitTimeout));
  if (long at = first_difference(got, pattern(kBytes, static_cast<uint64_t>(prev) + 100)); at >= 0) {
    throw std::runtime_error(fmt::format("rank {}: byte {} from rank {} differs", t.rank(), at, prev));
  }
}

class TcpRing : public ::testing::TestWithParam<int> {};

TEST_P(TcpRing, FourMiBToNextInThreads) { expect_all_ok(run_threads(GetParam(), ring_exchange)); }

INSTANTIATE_TEST_SUITE_P(CommTcp, TcpRing, ::testing::Values(4, 7),
                         [](const ::testing::TestParamInfo<int>& info) { return fmt::format("ranks_{}", info.param); });

TEST(CommTcpTransport, RingOfFourProcesses) {
  TempDir dir;
  const std::string prefix = test_prefix("procs");
  std::vector<pid_t> pids;
  for (int r = 0; r < 4; ++r) pids.push_back(fork_rank(dir.path, prefix, r, 4, ring_exchange));
  std::vector<int> codes;
  for (pid_t pid : pids) codes.push_back(reap(pid, 60000ms));
  EXPECT_EQ(codes, std::vector<int>(4, 0));
}

TEST(CommTcpTransport, ManyOddSizedMessagesQueuedBackToBackArriveInOrder) {
  constexpr size_t kMessages = 600;
  auto size_of_message = [](size_t i) { return (i * 7919) % 10007; };  // 0 first, then up to 10006
  auto seed_of = [](size_t i, int rank) { return static_cast<uint64_t>(i) + 1000 * static_cast<uint64_t>(rank); };
  auto errors = run_threads(2, [&](Transport& t) {
    const int peer = 1 - t.rank();
    std::vector<std::vector<uint8_t>> out, in;
    std::vector<RequestId> ids;
    for (size_t i = 0; i < kMessages; ++i) {
      out.push_back(pattern(size_of_message(i), seed_of(i, t.rank())));
      in.emplace_back(size_of_message(i));
    }
    for (size_t i = 0; i < kMessages; ++i) {
      ids.push_back(t.post_send(peer, i, out[i].data(), out[i].size()));
      ids.push_back(t.post_recv(peer, i, in[i].data(), in[i].size()));
    }
    t.wait(ids, deadline_after(kWaitTimeout));
    for (size_t i = 0; i < kMessages; ++i) {
      if (first_difference(in[i], pattern(size_of_message(i), seed_of(i, peer))) >= 0) {
        throw std::runtime_error(fmt::format("rank {}: message {} corrupted", t.rank(), i));
      }
    }
    // Ids already reaped by a wait are accepted again; an id never issued is an error.
    t.wait({ids.front()}, deadline_after(kWaitTimeout));
    EXPECT_THROW(t.wait({ids.back() + 1000}, deadline_after(kWaitTimeout)), Error);
  });
  expect_all_ok(errors);
}

TEST(CommTcpTransport, ReceivesPostedLaterFindMessagesWaitingInTheSocket) {
  // Rank 1 sends three messages before rank 0 posts any receive; they wait in the kernel.
  auto errors = run_threads(2, [&](Transport& t) {
    std::vector<uint8_t> a = pattern(100, 1), b = pattern(200000, 2), c;
    if (t.rank() == 1) {
      t.wait({t.post_send(0, 1, a.data(), a.size()), t.post_send(0, 2, b.data(), b.size()),
              t.post_send(0, 3, c.data(), 0)},
             deadline_after(kWaitTimeout));
      uint8_t ack = 0;
      wait_one(t, t.post_recv(0, 4, &ack, 1));
      return;
    }
    std::vector<uint8_t> ga(a.size()), gb(b.size());
    const RequestId ra = t.post_recv(1, 1, ga.data(), ga.size());
    wait_one(t, ra);
    const RequestId rb = t.post_recv(1, 2, gb.data(), gb.size());
    const RequestId rc = t.post_recv(1, 3, nullptr, 0);
    t.wait({rc, rb}, deadline_after(kWaitTimeout));
    EXPECT_EQ(first_difference(ga, a), -1);
    EXPECT_EQ(first_difference(gb, b), -1);
    uint8_t ack = 1;
    wait_one(t, t.post_send(1, 4, &ack, 1));
  });
  expect_all_ok(errors);
}

TEST(CommTcpTransport, TestProgressesWithoutBlockingAndReapsLikeWait) {
  const auto sent = pattern((size_t{1} << 20) + 7, 4);
  Signal polled_once;
  auto errors = run_threads(2, [&](Transport& t) {
    if (t.rank() == 1) {
      EXPECT_TRUE(polled_once.wait());
      wait_one(t, t.post_send(0, 9, sent.data(), sent.size()));
      return;
    }
    SignalOnExit release{polled_once};
    std::vector<uint8_t> got(sent.size());
    const RequestId r = t.post_recv(1, 9, got.data(), got.size());
    const auto start = Clock::now();
    EXPECT_FALSE(t.test({r}));  // nothing was sent yet: returns at once
    EXPECT_LT(Clock::now() - start, 1s);
    polled_once.signal();
    const auto deadline = deadline_after(kWaitTimeout);
    while (!t.test({r})) ASSERT_LT(Clock::now(), deadline) << "test() never completed the receive";
    EXPECT_EQ(first_difference(got, sent), -1);
    EXPECT_TRUE(t.test({r}));  // reaped by test(): accepted again, as after wait()
  });
  expect_all_ok(errors);
}

TEST(CommTcpTransport, SingleRankSendsToItself) {
  auto errors = run_threads(1, [&](Transport& t) {
    EXPECT_EQ(t.kind(), TransportKind::tcp);
    const auto sent = pattern(1000, 9);
    std::vector<uint8_t> got(1000);
    const RequestId r = t.post_recv(0, 4, got.data(), got.size());
    const RequestId s = t.post_send(0, 4, sent.data(), sent.size());
    t.wait({s, r}, deadline_after(kWaitTimeout));
    EXPECT_EQ(first_difference(got, sent), -1);
    t.post_send(0, 4, sent.data(), sent.size());
    const RequestId bad = t.post_recv(0, 5, got.data(), got.size());
    try {
      t.wait({bad}, deadline_after(kWaitTimeout));
      ADD_FAILURE() << "expected a protocol error";
    } catch (const TransportError& e) {
      EXPECT_EQ(e.kind(), Kind::protocol);
      EXPECT_TRUE(contains(e.what(), "rank 0 sent tag 4 (1000 bytes) to itself but expected tag 5 (1000 bytes)"))
          << e.what();
    }
  });
  expect_all_ok(errors);
}

// ---- failures ----

// Rank 1 sends (send_tag, send_bytes); rank 0 expects (recv_tag, recv_bytes).
void expect_mismatch(uint64_t send_tag, size_t send_bytes, uint64_t recv_tag, size_t recv_bytes,
                     const std::string& expected_text) {
  std::vector<uint8_t> buf(std::max(send_bytes, recv_bytes));
  Signal checked;
  auto errors = run_threads(2, [&](Transport& t) {
    if (t.rank() == 1) {
      wait_one(t, t.post_send(0, send_tag, buf.data(), send_bytes));
      EXPECT_TRUE(checked.wait());  // keep the connection open until rank 0 saw the mismatch
      return;
    }
    SignalOnExit release{checked};
    std::vector<uint8_t> got(recv_bytes);
    const RequestId r = t.post_recv(1, recv_tag, got.data(), recv_bytes);
    try {
      wait_one(t, r);
      ADD_FAILURE() << "expected a protocol error";
    } catch (const TransportError& e) {
      EXPECT_EQ(e.kind(), Kind::protocol);
      EXPECT_EQ(e.peers(), std::vector<int>{1});
      EXPECT_TRUE(contains(e.what(), expected_text)) << e.what();
    }
    // The stream is out of step now: later waits fail the same way instead of misreading it.
    EXPECT_THROW(wait_one(t, r), TransportError);
  });
  expect_all_ok(errors);
}

TEST(CommTcpTransport, TagMismatchNamesBothSides) {
  expect_mismatch(7, 4096, 9, 4096, "tcp: rank 1 sent tag 7 (4096 bytes) but rank 0 expected tag 9 (4096 bytes)");
}

TEST(CommTcpTransport, SizeMismatchNamesBothSides) {
  expect_mismatch(9, 4096, 9, 8192, "tcp: rank 1 sent tag 9 (4096 bytes) but rank 0 expected tag 9 (8192 bytes)");
}

TEST(CommTcpTransport, TimeoutFiresAtTheDeadlineNamesThePeerAndLeavesTheRequestQueued) {
  Signal timed_out;
  const auto sent = pattern(4096, 5);
  auto errors = run_threads(2, [&](Transport& t) {
    if (t.rank() == 1) {
      EXPECT_TRUE(timed_out.wait());  // alive but silent until rank 0 gave up once
      wait_one(t, t.post_send(0, 5, sent.data(), sent.size()));
      return;
    }
    SignalOnExit release{timed_out};
    std::vector<uint8_t> buf(4096);
    const RequestId r = t.post_recv(1, 5, buf.data(), buf.size());
    const auto start = Clock::now();
    try {
      t.wait({r}, start + 300ms);
      ADD_FAILURE() << "expected a timeout";
    } catch (const TransportError& e) {
      const auto waited = Clock::now() - start;
      EXPECT_EQ(e.kind(), Kind::timeout);
      EXPECT_EQ(e.peers(), std::vector<int>{1});
      EXPECT_GE(waited, 300ms);
      EXPECT_LT(waited, 1500ms);
      EXPECT_TRUE(contains(e.what(), "rank 0 timed out after")) << e.what();
      EXPECT_TRUE(contains(e.what(), "recv from rank 1 (tag 5, 0 of 4096 bytes)")) << e.what();
    }
    timed_out.signal();
    wait_one(t, r);  // a timeout is not fatal: the same receive completes once the data comes
    EXPECT_EQ(first_difference(buf, sent), -1);
  });
  expect_all_ok(errors);
}

TEST(CommTcpTransport, PeerThatClosedItsTransportIsReported) {
  auto errors = run_threads(2, [&](Transport& t) {
    if (t.rank() == 1) return;  // closes without sending
    std::vector<uint8_t> buf(16);
    const auto start = Clock::now();
    try {
      wait_one(t, t.post_recv(1, 1, buf.data(), buf.size()));
      ADD_FAILURE() << "expected peer_dead";
    } catch (const TransportError& e) {
      EXPECT_EQ(e.kind(), Kind::peer_dead);
      EXPECT_EQ(e.peers(), std::vector<int>{1});
      EXPECT_TRUE(contains(e.what(), "rank 1 (127.0.0.1:")) << e.what();
      EXPECT_TRUE(contains(e.what(), "closed its transport")) << e.what();
      EXPECT_LT(Clock::now() - start, 2s);
    }
    // A send to it fails too, and the transport stays broken.
    uint8_t byte = 0;
    EXPECT_THROW(wait_one(t, t.post_send(1, 2, &byte, 1)), TransportError);
  });
  expect_all_ok(errors);
}

TEST(CommTcpTransport, MessagesSentBeforeThePeerLeftAreStillDelivered) {
  const auto sent = pattern(100000, 3);
  auto errors = run_threads(2, [&](Transport& t) {
    if (t.rank() == 1) {
      wait_one(t, t.post_send(0, 2, sent.data(), sent.size()));
      return;  // gone before rank 0 even posts its receive (or not: either order must work)
    }
    std::vector<uint8_t> got(sent.size());
    wait_one(t, t.post_recv(1, 2, got.data(), got.size()));
    EXPECT_EQ(first_difference(got, sent), -1);
  });
  expect_all_ok(errors);
}

TEST(CommTcpTransport, KilledPeerProcessIsReportedDeadQuickly) {
  TempDir dir;
  const std::string prefix = test_prefix("kill");
  const pid_t child = fork_rank(dir.path, prefix, 1, 2, [](Transport& t) {
    uint8_t ready = 1;
    wait_one(t, t.post_send(0, 1, &ready, 1));
    for (;;) ::pause();  // until SIGKILL
  });
  {
    auto store = make_file_store(dir.path);
    auto t = connect(*store, prefix, 0, 2);
    uint8_t ready = 0;
    wait_one(*t, t->post_recv(1, 1, &ready, 1));
    ASSERT_EQ(ready, 1);
    std::vector<uint8_t> buf(1 << 20);
    const RequestId r = t->post_recv(1, 2, buf.data(), buf.size());
    std::atomic<int64_t> killed_at{0};
    // Killed while rank 0 waits, or just before: either order must be reported the same way.
    std::thread killer([&] {
      killed_at = Clock::now().time_since_epoch().count();
      ::kill(child, SIGKILL);
    });
    try {
      t->wait({r}, deadline_after(10000ms));
      ADD_FAILURE() << "expected peer_dead";
    } catch (const TransportError& e) {
      const auto noticed = Clock::now();
      killer.join();
      EXPECT_EQ(e.kind(), Kind::peer_dead);
      EXPECT_EQ(e.peers(), std::vector<int>{1});
      EXPECT_TRUE(contains(e.what(), "rank 1 (127.0.0.1:")) << e.what();
      EXPECT_TRUE(contains(e.what(), "closed the connection")) << e.what();
      EXPECT_TRUE(contains(e.what(), "recv from rank 1 (tag 2, 0 of 1048576 bytes)")) << e.what();
      EXPECT_LT(noticed - Clock::time_point(Clock::duration(killed_at.load())), 2s);
    }
    if (killer.joinable()) killer.join();
  }
  EXPECT_EQ(reap(child, 5000ms), -1);
}

TEST(CommTcpTransport, AbortReachesRanksWaitingOnSomeoneElseWithTheReason) {
  auto errors = run_threads(3, [&](Transport& t) {
    uint8_t byte = 0;
    if (t.rank() == 1) {
      t.abort("loss is NaN at step 12");
      try {
        wait_one(t, t.post_recv(0, 2, &byte, 1));
        ADD_FAILURE() << "expected aborted";
      } catch (const TransportError& e) {
        EXPECT_EQ(e.kind(), Kind::aborted);
        EXPECT_TRUE(contains(e.what(), "aborted by rank 1: loss is NaN at step 12")) << e.what();
      }
      return;
    }
    // Ranks 0 and 2 wait for each other (neither sends): only rank 1's abort can end this.
    const RequestId r = t.post_recv(2 - t.rank(), 3, &byte, 1);
    const auto start = Clock::now();
    try {
      t.wait({r}, deadline_after(10000ms));
      ADD_FAILURE() << "expected aborted";
    } catch (const TransportError& e) {
      EXPECT_EQ(e.kind(), Kind::aborted);
      EXPECT_EQ(e.peers(), std::vector<int>{1});
      EXPECT_TRUE(contains(e.what(), "aborted by rank 1: loss is NaN at step 12")) << e.what();
      EXPECT_LT(Clock::now() - start, 2s);
    }
    EXPECT_THROW(wait_one(t, r), TransportError);  // and every later wait
  });
  expect_all_ok(errors);
}

TEST(CommTcpTransport, AbortFromAnotherThreadEndsABlockedWaitHereAndAtThePeer) {
  auto errors = run_threads(2, [&](Transport& t) {
    uint8_t byte = 0;
    const RequestId r = t.post_recv(1 - t.rank(), 1, &byte, 1);  // nobody sends
    std::thread aborter;
    if (t.rank() == 0) aborter = std::thread([&] { t.abort("stopped by the watchdog"); });
    const auto start = Clock::now();
    try {
      t.wait({r}, deadline_after(10000ms));
      ADD_FAILURE() << "expected aborted";
    } catch (const TransportError& e) {
      EXPECT_EQ(e.kind(), Kind::aborted);
      EXPECT_TRUE(contains(e.what(), "aborted by rank 0: stopped by the watchdog")) << e.what();
      EXPECT_EQ(e.peers(), t.rank() == 0 ? std::vector<int>{} : std::vector<int>{0});
      EXPECT_LT(Clock::now() - start, 2s);
    }
    if (aborter.joinable()) aborter.join();
  });
  expect_all_ok(errors);
}

TEST(CommTcpTransport, AbortInTheMiddleOfALargeSendResetsThePeerThatIsNotReading) {
  // Neither rank posts a receive, so both 32 MiB sends stall once the socket buffers are full:
  // rank 0 aborts in the middle of its frame, and rank 1, stuck sending, must notice at once.
  constexpr size_t kBytes = size_t{32} << 20;
  Signal judged;
  auto errors = run_threads(2, [&](Transport& t) {
    const auto mine = pattern(kBytes, static_cast<uint64_t>(t.rank()));
    const RequestId s = t.post_send(1 - t.rank(), 1, mine.data(), kBytes);
    if (t.rank() == 0) {
      t.abort("out of memory");
      EXPECT_THROW(wait_one(t, s), TransportError);
      // Stay alive: closing a socket with unread data would reset it anyway, hiding the abort.
      EXPECT_TRUE(judged.wait());
      return;
    }
    SignalOnExit release{judged};
    const auto start = Clock::now();
    try {
      t.wait({s}, deadline_after(10000ms));
      ADD_FAILURE() << "expected peer_dead";
    } catch (const TransportError& e) {
      EXPECT_EQ(e.kind(), Kind::peer_dead);
      EXPECT_EQ(e.peers(), std::vector<int>{0});
      EXPECT_TRUE(contains(e.what(), "rank 0 (127.0.0.1:")) << e.what();
      EXPECT_TRUE(contains(e.what(), "send to rank 0 (tag 1, ")) << e.what();
      EXPECT_LT(Clock::now() - start, 2s);
    }
  });
  expect_all_ok(errors);
}

TEST(CommTcpTransport, WrongSecretIsRefusedOnBothSides) {
  auto store = make_memory_store();
  const std::string prefix = test_prefix("secret");
  std::string errors[2];
  Duration took[2];
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      const auto start = Clock::now();
      try {
        // Rank 0 could wait 10 s: it must hear the refusal long before. Rank 1 waits 1.5 s.
        connect(*store, prefix, r, 2,
                r == 0 ? "5ee30c0229ab532b585dd4dbc335e4a20b7a640ff77c52f6de7cea30da00d5e3"
                       : "2e75d2843225c8bd225723ef536051b6a4cb5e91a6fd35c64574cb398ad5bfa1",
                r == 0 ? 10000ms : 1500ms);
        ADD_FAILURE() << "rank " << r << " connected with a different secret";
      } catch (const TransportError& e) {
        errors[r] = e.what();
        EXPECT_EQ(e.peers(), std::vector<int>{1 - r});
        EXPECT_EQ(e.kind(), r == 0 ? Kind::protocol : Kind::timeout);
      }
      took[r] = std::chrono::duration_cast<Duration>(Clock::now() - start);
    });
  }
  for (auto& th : threads) th.join();
  // The dialling rank hears the refusal at once; the dialled one waits for a genuine rank 0.
  EXPECT_TRUE(contains(errors[0], "rank 1 at 127.0.0.1:")) << errors[0];
  EXPECT_TRUE(contains(errors[0], "refused the connection from rank 0: authentication failed: wrong job secret"))
      << errors[0];
  EXPECT_LT(took[0], 5000ms);
  EXPECT_TRUE(contains(errors[1], "no authenticated connection with rank(s) 0")) << errors[1];
  EXPECT_TRUE(contains(errors[1], "claiming rank 0: authentication failed: wrong job secret")) << errors[1];
  EXPECT_GE(took[1], 1500ms);
  EXPECT_LT(took[1], 4000ms);
}

// A hand-made client that dials a rank's listener and speaks the handshake.
class RawClient {
 public:
  RawClient(Store& store, const std::string& prefix, int rank) {
    std::string host;
    uint16_t port = 0;
    const std::string address = store.get(tcp_wire::address_key(prefix, rank), kRendezvousTimeout);
    if (!net::parse_endpoint(address, host, port)) throw std::runtime_error("bad address " + address);
    fd_ = net::connect_tcp(host, port, deadline_after(kWaitTimeout));
    uint8_t greeting[tcp_wire::kGreetingBytes];
    net::recv_all(fd_.get(), greeting, sizeof(greeting), deadline_after(kWaitTimeout));
    EXPECT_EQ(std::memcmp(greeting, tcp_wire::kMagic, 4), 0);
    EXPECT_EQ(greeting[4], tcp_wire::kVersion);
    their_rank = static_cast<int>(net::load_u32(greeting + 5));
    their_size = static_cast<int>(net::load_u32(greeting + 9));
    std::memcpy(challenge_.data(), greeting + 13, challenge_.size());
  }

  // Sends a hello claiming `rank`; returns "" when accepted (answer checked), else the refusal.
  std::string hello(const std::string& prefix, int rank, const std::string& secret) {
    const auth::Mac mac =
        auth::answer_challenge(secret, tcp_wire::connect_context(prefix, rank, their_rank, their_size), challenge_);
    const auth::Challenge mine = auth::make_challenge();
    std::string out;
    net::put_u32(out, static_cast<uint32_t>(rank));
    out.append(reinterpret_cast<const char*>(mac.data()), mac.size());
    out.append(reinterpret_cast<const char*>(mine.data()), mine.size());
    net::send_all(fd_.get(), out.data(), out.size(), deadline_after(kWaitTimeout));
    uint8_t verdict = 0xff;
    net::recv_all(fd_.get(), &verdict, 1, deadline_after(kWaitTimeout));
    if (verdict == tcp_wire::kAccepted) {
      uint8_t answer[auth::kMacBytes];
      net::recv_all(fd_.get(), answer, sizeof(answer), deadline_after(kWaitTimeout));
      EXPECT_TRUE(auth::verify_answer(secret, tcp_wire::accept_context(prefix, their_rank, rank, their_size), mine,
                                      answer, sizeof(answer)));
      return "";
    }
    EXPECT_EQ(verdict, tcp_wire::kRefused);
    uint8_t length[4];
    net::recv_all(fd_.get(), length, 4, deadline_after(kWaitTimeout));
    std::string reason(net::load_u32(length), '\0');
    net::recv_all(fd_.get(), reason.data(), reason.size(), deadline_after(kWaitTimeout));
    return reason;
  }

  int their_rank = -1;
  int their_size = 0;

 private:
  net::Fd fd_;
  auth::Challenge challenge_{};
};

TEST(CommTcpTransport, HandshakeRefusesWrongSecretWrongRankAndDuplicateRank) {
  auto store = make_memory_store();
  const std::string prefix = test_prefix("impostor");
  std::string rank2_error;
  std::vector<int> rank2_missing;
  std::thread rank2([&] {  // rank 2 of 3 waits to be dialled by ranks 0 and 1
    try {
      connect(*store, prefix, 2, 3, kSecret, 3000ms);
    } catch (const TransportError& e) {
      rank2_error = e.what();
      rank2_missing = e.peers();
    }
  });
  {
    RawClient c(*store, prefix, 2);
    EXPECT_EQ(c.their_rank, 2);
    EXPECT_EQ(c.their_size, 3);
    EXPECT_EQ(c.hello(prefix, 0, "not-the-secret"),
              "authentication failed: wrong job secret (or a connection meant for another group)");
  }
  EXPECT_EQ(RawClient(*store, prefix, 2).hello(prefix, 2, kSecret),
            "rank 2 may not dial rank 2: in a group of 3 each rank dials the higher ranks only");
  EXPECT_EQ(RawClient(*store, prefix, 2).hello(prefix, 7, kSecret),
            "rank 7 may not dial rank 2: in a group of 3 each rank dials the higher ranks only");
  EXPECT_EQ(RawClient(*store, prefix, 2).hello(prefix + "-other-group", 0, kSecret),
            "authentication failed: wrong job secret (or a connection meant for another group)");
  RawClient genuine(*store, prefix, 2);
  EXPECT_EQ(genuine.hello(prefix, 0, kSecret), "");  // knows the secret: accepted as rank 0
  EXPECT_EQ(RawClient(*store, prefix, 2).hello(prefix, 0, kSecret), "rank 0 is already connected to rank 2");
  rank2.join();  // rank 1 never came
  EXPECT_EQ(rank2_missing, std::vector<int>{1});
  EXPECT_TRUE(contains(rank2_error, "no authenticated connection with rank(s) 1; refused 5 connection(s)"))
      << rank2_error;
  EXPECT_TRUE(contains(rank2_error, "claiming rank 0: authentication failed")) << rank2_error;
}

TEST(CommTcpTransport, RendezvousTimeoutNamesTheRankThatNeverPublished) {
  auto store = make_memory_store();
  const std::string prefix = test_prefix("rdv");
  std::vector<std::string> errors(2);
  std::vector<std::thread> threads;
  const auto start = Clock::now();
  for (int r = 0; r < 2; ++r) {  // rank 2 of 3 never comes
    threads.emplace_back([&, r] {
      try {
        connect(*store, prefix, r, 3, kSecret, 300ms);
      } catch (const TransportError& e) {
        EXPECT_EQ(e.kind(), Kind::timeout);
        EXPECT_EQ(e.peers(), std::vector<int>{2});
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_LT(Clock::now() - start, 2000ms);
  for (const auto& e : errors) EXPECT_TRUE(contains(e, "for rank(s) 2 to publish their address")) << e;
}

// ---- Group over TCP ----

using dtrain::comm::test_util::run_ranks;

GroupOptions tcp_options() {
  GroupOptions o;
  o.transport = TransportKind::tcp;
  o.secret = kSecret;
  o.timeout = kWaitTimeout;
  return o;
}

class TcpGroup : public ::testing::TestWithParam<int> {};

TEST_P(TcpGroup, AllReduceSumIsExactAndIdenticalOnEveryRank) {
  const int p = GetParam();
  for (size_t count : {size_t{0}, size_t{1}, size_t{13}, size_t{4099}, size_t{1} << 18}) {
    run_ranks(
        p,
        [&](Group& g) {
          ASSERT_EQ(g.transport_kind(), TransportKind::tcp);
          std::vector<float> x(count);
          for (size_t i = 0; i < count; ++i) x[i] = static_cast<float>((g.rank() + 1) * 10 + static_cast<int>(i % 7));
          std::vector<float> out(count);
          g.all_reduce(x.data(), out.data(), count, DataType::f32, ReduceOp::sum);
          for (size_t i = 0; i < count; ++i) {
            const float expected = static_cast<float>(10 * p * (p + 1) / 2 + p * static_cast<int>(i % 7));
            ASSERT_EQ(out[i], expected) << "rank " << g.rank() << " element " << i << " count " << count;
          }
          g.all_reduce(x.data(), x.data(), count, DataType::f32, ReduceOp::avg);  // in place
          for (size_t i = 0; i < count; ++i) {
            ASSERT_FLOAT_EQ(x[i], out[i] / static_cast<float>(p)) << "avg, element " << i;
          }
        },
        tcp_options());
  }
}

INSTANTIATE_TEST_SUITE_P(CommTcp, TcpGroup, ::testing::Range(1, 9),
                         [](const ::testing::TestParamInfo<int>& info) { return fmt::format("ranks_{}", info.param); });

TEST(CommTcpGroupOptions, EnvironmentChoosesTcpAndSuppliesTheSecret) {
  ::setenv("DTRAIN_TRANSPORT", "tcp", 1);
  ::setenv("DTRAIN_SECRET", "ee0a2c207b0b944442ee484f74c11eab1c818ce044368d708cc813e858668f31", 1);
  GroupOptions opts;  // transport "auto", no secret
  opts.timeout = kWaitTimeout;
  EXPECT_NO_THROW(run_ranks(
      3,
      [](Group& g) {
        EXPECT_EQ(g.transport_kind(), TransportKind::tcp);
        int32_t v = g.rank() + 1, sum = 0;
        g.all_reduce(&v, &sum, 1, DataType::i32, ReduceOp::sum);
        EXPECT_EQ(sum, 6);
      },
      opts));
  ::unsetenv("DTRAIN_SECRET");
  ::setenv("DTRAIN_TRANSPORT", "carrier-pigeon", 1);
  try {
    run_ranks(
        1, [](Group&) {}, opts);
    ADD_FAILURE() << "expected an error for DTRAIN_TRANSPORT";
  } catch (const Error& e) {
    EXPECT_TRUE(contains(e.what(), "DTRAIN_TRANSPORT='carrier-pigeon': expected auto, shm or tcp")) << e.what();
  }
  ::unsetenv("DTRAIN_TRANSPORT");
  opts.transport = TransportKind::tcp;  // and no secret anywhere
  try {
    run_ranks(
        1, [](Group&) {}, opts);
    ADD_FAILURE() << "expected an error for the missing secret";
  } catch (const Error& e) {
    EXPECT_TRUE(contains(e.what(), "the tcp transport needs the job secret")) << e.what();
  }
}

TEST(CommTcpGroupOptions, RanksThatChoseDifferentTransportsAreNamed) {
  auto store = make_memory_store();
  std::vector<std::string> errors(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      GroupOptions o = tcp_options();
      o.transport = r == 0 ? TransportKind::tcp : TransportKind::shm;
      try {
        Group::create(store, r, 2, o, "mixed");
      } catch (const Error& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_TRUE(contains(errors[0], "rank 0 uses transport tcp but rank 1 uses shm")) << errors[0];
  EXPECT_TRUE(contains(errors[1], "rank 1 uses transport shm but rank 0 uses tcp")) << errors[1];
}

TEST(CommTcpGroupOptions, FromEnvInTwoProcessesUsesTheLauncherVariables) {
  // A free port for the store rank 0 hosts (MASTER_PORT); rank 1 retries until it is up.
  uint16_t port = 0;
  {
    net::Fd probe = net::listen_tcp("127.0.0.1", 0, 1);
    port = net::local_port(probe.get());
  }
  std::vector<pid_t> pids;
  for (int r = 0; r < 2; ++r) {
    std::cout.flush();
    std::cerr.flush();
    const pid_t pid = ::fork();
    if (pid != 0) {
      pids.push_back(pid);
      continue;
    }
    int code = 0;
    try {
      ::setenv("RANK", std::to_string(r).c_str(), 1);
      ::setenv("WORLD_SIZE", "2", 1);
      ::setenv("MASTER_ADDR", "127.0.0.1", 1);
      ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      ::setenv("DTRAIN_SECRET", kSecret.c_str(), 1);
      ::setenv("DTRAIN_TRANSPORT", "tcp", 1);
      ::unsetenv("DTRAIN_STORE_HOSTED");
      ::unsetenv("DTRAIN_BIND_ADDR");  // so the address that routes to MASTER_ADDR is used
      GroupOptions o;
      o.timeout = kWaitTimeout;
      Group g = Group::from_env(o);
      int32_t v = g.rank() + 1, sum = 0;
      g.all_reduce(&v, &sum, 1, DataType::i32, ReduceOp::sum);
      if (g.transport_kind() != TransportKind::tcp || sum != 3) {
        std::fprintf(stderr, "rank %d: transport %s, sum %d\n", r, name_of(g.transport_kind()), sum);
        code = 2;
      }
    } catch (const std::exception& e) {
      std::fprintf(stderr, "rank %d failed: %s\n", r, e.what());
      code = 1;
    }
    std::fflush(stderr);
    ::_exit(code);
  }
  for (pid_t pid : pids) EXPECT_EQ(reap(pid, 60000ms), 0);
}

// What a rank publishes when the store is elsewhere (the torch backend under torchrun, and
// Group::from_env): the local address of the route to the store's host.
TEST(CommTcpGroupOptions, AddressTowardIsTheLocalEndOfTheRouteAndNamesAHostThatDoesNotResolve) {
  EXPECT_EQ(dtrain::comm::address_toward("127.0.0.1", 29500), "127.0.0.1");
  try {
    // .invalid never resolves (RFC 6761); resolvers answer it without asking anyone.
    dtrain::comm::address_toward("no-such-host.invalid", 29500);
    FAIL() << "an unresolvable host gave an address";
  } catch (const dtrain::Error& e) {
    EXPECT_NE(std::string(e.what()).find("'no-such-host.invalid'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("DTRAIN_BIND_ADDR"), std::string::npos) << e.what();
  }
  EXPECT_THROW(dtrain::comm::address_toward("127.0.0.1", 70000), dtrain::Error);
  // This host's own name: where it resolves to loopback here (Debian's /etc/hosts), the address
  // of an interface the others can reach instead, when there is one; else where the name routes.
  const std::string me = dtrain::comm::host_name();
  const std::string route = net::local_address_toward(me, 29500);
  const auto interfaces = net::interface_addresses();
  const net::InterfaceAddress* out = net::outward_address(interfaces);
  const bool loopback = route.starts_with("127.") || route == "::1";
  EXPECT_EQ(dtrain::comm::address_toward(me, 29500), loopback && out != nullptr ? out->address : route) << me;
}

// Which interface address stands for this host when routing cannot tell: the first one up and not
// loopback, IPv4 before IPv6, never an IPv6 link-local one.
TEST(CommTcpGroupOptions, OutwardAddressIsTheFirstUpNonLoopbackIPv4ThenAGlobalIPv6) {
  using net::InterfaceAddress;
  const std::vector<InterfaceAddress> ifs = {{"lo", "127.0.0.1", AF_INET, true, true},
                                             {"eth1", "fe80::1", AF_INET6, true, false},
                                             {"eth1", "fd00::2", AF_INET6, true, false},
                                             {"eth0", "10.0.0.9", AF_INET, false, false},
                                             {"eth2", "10.0.0.7", AF_INET, true, false}};
  ASSERT_NE(net::outward_address(ifs), nullptr);
  EXPECT_EQ(net::outward_address(ifs)->address, "10.0.0.7");  // eth0 is down
  const std::vector<InterfaceAddress> v6 = {ifs[0], ifs[1], ifs[2]};
  ASSERT_NE(net::outward_address(v6), nullptr);
  EXPECT_EQ(net::outward_address(v6)->address, "fd00::2");
  EXPECT_EQ(net::outward_address({ifs[0], ifs[1]}), nullptr);  // only loopback and link-local
  EXPECT_FALSE(net::interface_addresses().empty());            // loopback at least
}

// Asynchronous sends far larger than the socket buffers, then a blocking receive, all ranks at
// once around a ring: the receive must not queue behind the send (that deadlocks).
TEST(CommTcpGroupOptions, AsyncSendThenBlockingRecvAroundARingDoesNotDeadlock) {
  const size_t n = size_t{3} << 20;  // 12 MiB of f32
  for (int p : {2, 3, 5}) {
    run_ranks(
        p,
        [&](Group& g) {
          const int r = g.rank();
          const int from = (r + p - 1) % p;
          std::vector<float> out(n), in(n, -1.0f), small(5);
          for (size_t i = 0; i < n; ++i) out[i] = static_cast<float>(r * 1000 + static_cast<int>(i % 997));
          Work w = g.send_async(out.data(), n, DataType::f32, (r + 1) % p, 3);
          Work w2 = g.send_async(out.data(), 5, DataType::f32, (r + 1) % p, 4);
          g.recv(in.data(), n, DataType::f32, from, 3);
          Work rw = g.recv_async(small.data(), 5, DataType::f32, from, 4);
          w.wait(kWaitTimeout);
          w2.wait(kWaitTimeout);
          rw.wait(kWaitTimeout);
          for (size_t i = 0; i < n; ++i) {
            ASSERT_EQ(in[i], static_cast<float>(from * 1000 + static_cast<int>(i % 997))) << i;
          }
          for (size_t i = 0; i < 5; ++i) ASSERT_EQ(small[i], static_cast<float>(from * 1000 + static_cast<int>(i)));
          g.barrier();
        },
        tcp_options());
  }
}

TEST(CommTcpGroupOptions, AFailedRankBreaksTheGroupOnEveryRankWithinTheTimeout) {
  GroupOptions opts = tcp_options();
  opts.timeout = 500ms;
  std::atomic<int> raised{0};
  run_ranks(
      3,
      [&](Group& g) {
        if (g.rank() == 2) return;  // never joins the all_reduce (its transport closes)
        float x = 1, y = 0;
        const auto t0 = Clock::now();
        try {
          g.all_reduce(&x, &y, 1, DataType::f32, ReduceOp::sum);
          ADD_FAILURE() << "all_reduce returned without rank 2";
        } catch (const CommError& e) {
          EXPECT_LT(Clock::now() - t0, 3s) << e.what();
          EXPECT_EQ(e.op(), "all_reduce");
          raised++;
        }
        EXPECT_THROW(g.barrier(), CommError);  // a broken group fails at once
      },
      opts);
  EXPECT_EQ(raised.load(), 2);
}

}  // namespace
}  // namespace dtrain::comm
