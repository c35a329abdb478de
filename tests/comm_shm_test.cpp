// Shared-memory transport: data integrity for every size class, simultaneous streaming around
// rings of threads and of processes, and every failure mode (protocol mismatch, timeout, dead
// peer, abort, rendezvous timeout) with its message, its bound and a clean /dev/shm afterwards.
#include <dirent.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <iostream>
#include <latch>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "../src/comm/shm/shm_segment.h"
#include "dtrain/comm/copy.h"
#include "dtrain/comm/store.h"
#include "dtrain/comm/transport.h"

namespace dtrain::comm {
namespace {

using namespace std::chrono_literals;
using Kind = TransportError::Kind;

constexpr Duration kRendezvousTimeout = 8000ms;
constexpr Duration kWaitTimeout = 8000ms;

// Prefixes carry this process's pid so leftover checks only see this test binary's segments.
std::string test_prefix(const std::string& what) {
  static std::atomic<int> counter{0};
  return fmt::format("shmtest-{}-{}-{}", ::getpid(), what, counter++);
}

// /dev/shm entries created by this test process (their names embed our prefix).
std::vector<std::string> leftover_segments() {
  const std::string start = fmt::format("dtrain-shmtest-{}-", ::getpid());
  std::vector<std::string> found;
  if (DIR* dir = ::opendir("/dev/shm")) {
    while (const dirent* e = ::readdir(dir)) {
      if (std::strncmp(e->d_name, start.c_str(), start.size()) == 0) found.emplace_back(e->d_name);
    }
    ::closedir(dir);
  }
  return found;
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

// Runs `fn` on `size` ranks as threads, each with its own transport over one memory store.
// Returns each rank's error text ("" when it succeeded).
std::vector<std::string> run_threads(int size, const std::function<void(Transport&)>& fn,
                                     const std::string& prefix = test_prefix("threads")) {
  auto store = make_memory_store();
  std::vector<std::string> errors(static_cast<size_t>(size));
  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(size));
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      try {
        auto t = make_shm_transport(*store, prefix, r, size, kRendezvousTimeout);
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

// A store for forked ranks: one file per key in a directory, written by atomic rename;
// add and compare_set serialise on flock. Polls, which is fine for a handful of keys.
class DirStore : public Store {
 public:
  explicit DirStore(std::string dir) : dir_(std::move(dir)) {}

  void set(const std::string& key, const std::string& value) override {
    static std::atomic<int> counter{0};
    const std::string tmp = fmt::format("{}/.tmp-{}-{}", dir_, ::getpid(), counter++);
    {
      std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
      out << value;
    }
    if (std::rename(tmp.c_str(), path(key).c_str()) != 0) throw std::runtime_error("DirStore: rename failed");
  }

  std::string get(const std::string& key, Duration timeout) override {
    wait({key}, timeout);
    return *try_get(key);
  }

  std::optional<std::string> try_get(const std::string& key) override {
    std::ifstream in(path(key), std::ios::binary);
    if (!in) return std::nullopt;
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }

  int64_t add(const std::string& key, int64_t delta) override {
    Lock lock(dir_ + "/.lock");
    const auto cur = try_get(key);
    const int64_t v = (cur ? std::stoll(*cur) : 0) + delta;
    set(key, std::to_string(v));
    return v;
  }

  std::string compare_set(const std::string& key, const std::string& expected, const std::string& desired) override {
    Lock lock(dir_ + "/.lock");
    std::string cur = try_get(key).value_or("");
    if (cur != expected) return cur;
    set(key, desired);
    return desired;
  }

  void wait(const std::vector<std::string>& keys, Duration timeout) override {
    const auto deadline = deadline_after(timeout);
    for (;;) {
      std::vector<std::string> missing;
      for (const auto& k : keys) {
        if (!try_get(k)) missing.push_back(k);
      }
      if (missing.empty()) return;
      if (Clock::now() >= deadline) {
        throw CommError("store.wait", 0, {}, fmt::format("DirStore: keys missing after {} ms", timeout.count()),
                        __FILE__, __LINE__);
      }
      std::this_thread::sleep_for(1ms);
    }
  }

 private:
  struct Lock {
    explicit Lock(const std::string& file) : fd(::open(file.c_str(), O_CREAT | O_RDWR | O_CLOEXEC, 0600)) {
      if (fd < 0 || ::flock(fd, LOCK_EX) != 0) throw std::runtime_error("DirStore: cannot lock " + file);
    }
    ~Lock() { ::close(fd); }
    int fd;
  };

  std::string path(const std::string& key) const {
    std::string hex;
    for (unsigned char c : key) hex += fmt::format("{:02x}", c);
    return dir_ + "/" + hex;
  }

  std::string dir_;
};

struct TempDir {
  TempDir() {
    char tmpl[] = "/tmp/dtrain-shmtest-XXXXXX";
    const char* p = ::mkdtemp(tmpl);
    if (p == nullptr) throw std::runtime_error("mkdtemp failed");
    path = p;
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

// Runs fn(rank, transport) in a child process, with a DirStore in `dir`. Returns the pid.
pid_t fork_rank(const std::string& dir, const std::string& prefix, int rank, int size,
                const std::function<void(Transport&)>& fn) {
  std::cout.flush();
  std::cerr.flush();
  const pid_t pid = ::fork();
  if (pid != 0) return pid;
  int code = 0;
  try {
    DirStore store(dir);
    auto t = make_shm_transport(store, prefix, rank, size, kRendezvousTimeout);
    fn(*t);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d (pid %d) failed: %s\n", rank, ::getpid(), e.what());
    code = 1;
  }
  std::cout.flush();
  std::fflush(stderr);
  ::_exit(code);
}

// Runs `size` ranks as forked processes; returns their exit codes.
std::vector<int> run_processes(int size, const std::function<void(Transport&)>& fn, Duration limit = 20000ms) {
  TempDir dir;
  const std::string prefix = test_prefix("procs");
  std::vector<pid_t> pids;
  pids.reserve(static_cast<size_t>(size));
  for (int r = 0; r < size; ++r) pids.push_back(fork_rank(dir.path, prefix, r, size, fn));
  std::vector<int> codes;
  codes.reserve(pids.size());
  const auto deadline = deadline_after(limit);
  for (pid_t pid : pids)
    codes.push_back(reap(pid, std::max(Duration{0}, std::chrono::ceil<Duration>(deadline - Clock::now()))));
  return codes;
}

// ---- data integrity ----

class ShmPingPong : public ::testing::TestWithParam<size_t> {};

TEST(ShmSegment, RanksThatOutnumberTheCoresGetLargerStagingSlotsWhenDevShmHoldsThem) {
  namespace shm = dtrain::comm::shm;
  const size_t big = shm::kOversubscribedStageBytes, gib = size_t{1} << 30;
  EXPECT_EQ(shm::default_stage_bytes(2, 2, gib), shm::kDefaultStageBytes);  // a core each
  EXPECT_EQ(shm::default_stage_bytes(4, 8, gib), shm::kDefaultStageBytes);
  EXPECT_EQ(shm::default_stage_bytes(4, 2, gib), big);
  EXPECT_EQ(shm::default_stage_bytes(3, 2, gib), big);
  // Four times the 4 x 2 larger slots must be free, or the group keeps the small ones.
  EXPECT_EQ(shm::default_stage_bytes(4, 2, 4 * 8 * big), big);
  EXPECT_EQ(shm::default_stage_bytes(4, 2, 4 * 8 * big - 1), shm::kDefaultStageBytes);
  EXPECT_EQ(shm::default_stage_bytes(4, 2, 0), shm::kDefaultStageBytes);
  EXPECT_GT(big, shm::kDefaultStageBytes);
}

// copy_bytes takes its own loop where the destination lies 1-63 bytes after the source modulo
// 4 KiB (glibc's rep movsb is 10-20x slower there on AMD); copy_streaming writes around its
// aligned middle. Every distance around that window, every length around the loop's step
// and the threshold, and the bytes before and after the destination must come out right.
TEST(ShmCopy, CopyBytesAndCopyStreamingAreExactAtEveryDistanceAndLength) {
  std::vector<unsigned char> src(3 * 4096 + 512), dst(3 * 4096 + 4096 + 512);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<unsigned char>(i * 131 + 7);
  const auto* page =
      reinterpret_cast<const unsigned char*>((reinterpret_cast<uintptr_t>(dst.data()) + 4095) & ~uintptr_t{4095});
  const size_t base = static_cast<size_t>(page - dst.data());  // dst.data() + base is on a page
  int checked = 0;
  for (const size_t len : {size_t{0}, size_t{1}, size_t{127}, size_t{2047}, size_t{2048}, size_t{2049},
                           size_t{2048 + 127}, size_t{4096}, size_t{3 * 4096 + 1}}) {
    for (const size_t s_off : {size_t{0}, size_t{3}, size_t{64}}) {
      for (const size_t distance :
           {size_t{0}, size_t{1}, size_t{16}, size_t{33}, size_t{63}, size_t{64}, size_t{4080}}) {
        const size_t d_off = (base + s_off + distance + (reinterpret_cast<uintptr_t>(src.data()) & 4095)) % 4096;
        unsigned char* to = dst.data() + d_off;
        const unsigned char* from = src.data() + s_off;
        ASSERT_LE(d_off + len + 1, dst.size());
        ASSERT_EQ(near_page_alias(to, from), distance != 0 && distance < 64) << distance;
        for (const bool streaming : {false, true}) {
          std::fill(dst.begin(), dst.end(), 0xEE);
          if (streaming) {
            copy_streaming(to, from, len);
          } else {
            copy_bytes(to, from, len);
          }
          ASSERT_TRUE(std::equal(from, from + len, to))
              << "len " << len << " distance " << distance << (streaming ? " streaming" : "");
          ASSERT_TRUE(std::all_of(dst.begin(), dst.begin() + static_cast<std::ptrdiff_t>(d_off),
                                  [](unsigned char c) { return c == 0xEE; }));
          ASSERT_TRUE(std::all_of(to + len, dst.data() + dst.size(), [](unsigned char c) { return c == 0xEE; }));
          ++checked;
        }
      }
    }
  }
  EXPECT_EQ(checked, 9 * 3 * 7 * 2);
}

TEST_P(ShmPingPong, EchoIsBitExact) {
  const size_t bytes = GetParam();
  const auto sent = pattern(bytes, 1);
  std::vector<uint8_t> echoed(bytes);
  auto errors = run_threads(2, [&](Transport& t) {
    if (t.rank() == 0) {
      const RequestId s = t.post_send(1, 11, sent.data(), bytes);
      const RequestId r = t.post_recv(1, 12, echoed.data(), bytes);
      t.wait({s, r}, deadline_after(kWaitTimeout));
    } else {
      std::vector<uint8_t> got(bytes, 0xee);
      wait_one(t, t.post_recv(0, 11, got.data(), bytes));
      if (long at = first_difference(got, sent); at >= 0)
        throw std::runtime_error(fmt::format("rank 1: byte {} differs", at));
      wait_one(t, t.post_send(0, 12, got.data(), bytes));
    }
  });
  expect_all_ok(errors);
  EXPECT_EQ(first_difference(echoed, sent), -1);
  EXPECT_EQ(leftover_segments(), std::vector<std::string>{});
}

INSTANTIATE_TEST_SUITE_P(Shm, ShmPingPong,
                         ::testing::Values(size_t{0}, size_t{1}, size_t{7}, size_t{4096}, (size_t{1} << 20) + 13,
                                           size_t{64} << 20),
                         [](const ::testing::TestParamInfo<size_t>& info) {
                           return fmt::format("bytes_{}", info.param);
                         });

TEST(ShmTransport, BidirectionalLargeExchangeDoesNotDeadlock) {
  constexpr size_t kBytes = size_t{32} << 20;  // 32 rings' worth in each direction at once
  auto errors = run_threads(2, [&](Transport& t) {
    const int peer = 1 - t.rank();
    const auto mine = pattern(kBytes, static_cast<uint64_t>(t.rank()));
    std::vector<uint8_t> got(kBytes);
    const RequestId s = t.post_send(peer, 3, mine.data(), kBytes);
    const RequestId r = t.post_recv(peer, 3, got.data(), kBytes);
    // Waiting for the send alone must still drain the posted receive, or both sides stall.
    wait_one(t, s);
    wait_one(t, r);
    if (long at = first_difference(got, pattern(kBytes, static_cast<uint64_t>(peer))); at >= 0) {
      throw std::runtime_error(fmt::format("rank {}: byte {} differs", t.rank(), at));
    }
  });
  expect_all_ok(errors);
}

// Each rank sends 8 MiB to the next and receives 8 MiB from the previous, all at once.
void ring_exchange(Transport& t) {
  constexpr size_t kBytes = size_t{8} << 20;
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

class ShmRing : public ::testing::TestWithParam<int> {};

TEST_P(ShmRing, EightMiBToNextInThreads) {
  expect_all_ok(run_threads(GetParam(), ring_exchange));
  EXPECT_EQ(leftover_segments(), std::vector<std::string>{});
}

INSTANTIATE_TEST_SUITE_P(Shm, ShmRing, ::testing::Values(2, 3, 5, 8),
                         [](const ::testing::TestParamInfo<int>& info) { return fmt::format("ranks_{}", info.param); });

TEST(ShmTransport, RingOfFourProcesses) {
  const auto codes = run_processes(4, ring_exchange);
  EXPECT_EQ(codes, std::vector<int>(4, 0));
  EXPECT_EQ(leftover_segments(), std::vector<std::string>{});
}

TEST(ShmTransport, ManyOddSizedMessagesWrapATinyRingInOrder) {
  // A 4 KiB ring forces headers, payloads and padding to wrap at every offset.
  ::setenv("DTRAIN_SHM_RING_BYTES", "4096", 1);
  constexpr size_t kMessages = 600;
  auto size_of_message = [](size_t i) { return (i * 7919) % 10007; };
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
    // Ids already reaped by a wait are accepted again.
    t.wait({ids.front()}, deadline_after(kWaitTimeout));
  });
  ::unsetenv("DTRAIN_SHM_RING_BYTES");
  expect_all_ok(errors);
}

TEST(ShmTransport, SingleRankSendsToItself) {
  auto errors = run_threads(1, [&](Transport& t) {
    EXPECT_EQ(t.kind(), TransportKind::shm);
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
      EXPECT_NE(std::string(e.what()).find("rank 0 sent tag 4 (1000 bytes) to itself but expected tag 5 (1000 bytes)"),
                std::string::npos)
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
  auto errors = run_threads(2, [&](Transport& t) {
    if (t.rank() == 1) {
      wait_one(t, t.post_send(0, send_tag, buf.data(), send_bytes));
      return;
    }
    const RequestId r = t.post_recv(1, recv_tag, buf.data(), recv_bytes);
    try {
      wait_one(t, r);
      ADD_FAILURE() << "expected a protocol error";
    } catch (const TransportError& e) {
      EXPECT_EQ(e.kind(), Kind::protocol);
      EXPECT_EQ(e.peers(), std::vector<int>{1});
      EXPECT_NE(std::string(e.what()).find(expected_text), std::string::npos) << e.what();
    }
    // The stream is out of step now: later waits fail the same way instead of misreading it.
    EXPECT_THROW(wait_one(t, r), TransportError);
  });
  expect_all_ok(errors);
}

TEST(ShmTransport, TagMismatchNamesBothSides) {
  expect_mismatch(7, 4096, 9, 4096, "rank 1 sent tag 7 (4096 bytes) but rank 0 expected tag 9 (4096 bytes)");
}

TEST(ShmTransport, SizeMismatchNamesBothSides) {
  expect_mismatch(9, 4096, 9, 8192, "rank 1 sent tag 9 (4096 bytes) but rank 0 expected tag 9 (8192 bytes)");
}

TEST(ShmTransport, TimeoutFiresAtTheDeadlineAndNamesThePeer) {
  std::latch done(1);
  auto errors = run_threads(2, [&](Transport& t) {
    if (t.rank() == 1) {
      done.wait();  // alive but silent until rank 0 gave up
      return;
    }
    struct Release {
      std::latch& l;
      ~Release() { l.count_down(); }
    } release{done};
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
      EXPECT_LT(waited, 500ms);
      EXPECT_NE(std::string(e.what()).find("timed out after"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("recv from rank 1 (tag 5, 0 of 4096 bytes)"), std::string::npos) << e.what();
    }
  });
  expect_all_ok(errors);
}

TEST(ShmTransport, PeerThatClosedItsTransportIsReported) {
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
      EXPECT_NE(std::string(e.what()).find("closed its transport"), std::string::npos) << e.what();
      EXPECT_LT(Clock::now() - start, 1s);
    }
  });
  expect_all_ok(errors);
}

TEST(ShmTransport, MessagesSentBeforeThePeerLeftAreStillDelivered) {
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

TEST(ShmTransport, KilledPeerProcessIsReportedDeadQuickly) {
  TempDir dir;
  const std::string prefix = test_prefix("kill");
  const pid_t child = fork_rank(dir.path, prefix, 1, 2, [](Transport& t) {
    uint8_t ready = 1;
    wait_one(t, t.post_send(0, 1, &ready, 1));
    for (;;) ::pause();  // until SIGKILL
  });
  {
    DirStore store(dir.path);
    auto t = make_shm_transport(store, prefix, 0, 2, kRendezvousTimeout);
    uint8_t ready = 0;
    wait_one(*t, t->post_recv(1, 1, &ready, 1));
    ASSERT_EQ(ready, 1);
    std::vector<uint8_t> buf(1 << 20);
    const RequestId r = t->post_recv(1, 2, buf.data(), buf.size());
    std::atomic<int64_t> killed_at{0};
    std::thread killer([&] {
      std::this_thread::sleep_for(100ms);  // let rank 0 settle into its wait (either order is correct)
      killed_at = Clock::now().time_since_epoch().count();
      ::kill(child, SIGKILL);
    });
    try {
      t->wait({r}, deadline_after(5000ms));
      ADD_FAILURE() << "expected peer_dead";
    } catch (const TransportError& e) {
      const auto noticed = Clock::now();
      killer.join();
      EXPECT_EQ(e.kind(), Kind::peer_dead);
      EXPECT_EQ(e.peers(), std::vector<int>{1});
      EXPECT_NE(std::string(e.what()).find(fmt::format("rank 1 (pid {}) died", child)), std::string::npos) << e.what();
      EXPECT_LT(noticed - Clock::time_point(Clock::duration(killed_at.load())), 1s);
    }
    if (killer.joinable()) killer.join();
  }
  EXPECT_EQ(reap(child, 5000ms), -1);
  EXPECT_EQ(leftover_segments(), std::vector<std::string>{});
}

TEST(ShmTransport, AbortFailsTheWaitingPeerWithTheReason) {
  auto errors = run_threads(3, [&](Transport& t) {
    uint8_t byte = 0;
    if (t.rank() == 1) {
      wait_one(t, t.post_recv(0, 1, &byte, 1));  // rank 0 is about to wait
      t.abort("loss is NaN at step 12");
      EXPECT_THROW(wait_one(t, t.post_recv(0, 2, &byte, 1)), TransportError);
      return;
    }
    const RequestId r = t.post_recv(1, 3, &byte, 1);  // rank 1 never sends this
    if (t.rank() == 0) t.post_send(1, 1, &byte, 1);
    const auto start = Clock::now();
    try {
      t.wait({r}, deadline_after(5000ms));
      ADD_FAILURE() << "expected aborted";
    } catch (const TransportError& e) {
      EXPECT_EQ(e.kind(), Kind::aborted);
      EXPECT_EQ(e.peers(), std::vector<int>{1});
      EXPECT_NE(std::string(e.what()).find("aborted by rank 1: loss is NaN at step 12"), std::string::npos) << e.what();
      EXPECT_LT(Clock::now() - start, 1s);
    }
  });
  expect_all_ok(errors);
}

TEST(ShmTransport, RendezvousTimeoutNamesTheMissingRankAndLeavesNothing) {
  auto store = make_memory_store();
  const std::string prefix = test_prefix("rdv");
  std::vector<std::string> errors(2);
  std::vector<std::thread> threads;
  threads.reserve(2);
  const auto start = Clock::now();
  for (int r = 0; r < 2; ++r) {  // rank 2 of 3 never comes
    threads.emplace_back([&, r] {
      try {
        make_shm_transport(*store, prefix, r, 3, 300ms);
      } catch (const TransportError& e) {
        EXPECT_EQ(e.kind(), Kind::timeout);
        EXPECT_EQ(e.peers(), std::vector<int>{2});
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_LT(Clock::now() - start, 1s);
  for (const auto& e : errors) EXPECT_NE(e.find("rank(s) 2 did not"), std::string::npos) << e;
  EXPECT_EQ(leftover_segments(), std::vector<std::string>{});
}

TEST(ShmTransport, SegmentIsUnlinkedOnceEveryoneMappedIt) {
  std::latch mapped(3);
  std::vector<std::vector<std::string>> seen(3);
  expect_all_ok(run_threads(3, [&](Transport& t) {
    mapped.arrive_and_wait();  // all three transports exist and are alive
    seen[static_cast<size_t>(t.rank())] = leftover_segments();
    ring_exchange(t);
  }));
  for (const auto& s : seen) EXPECT_EQ(s, std::vector<std::string>{});
}

// ---- performance (printed, not asserted) ----

TEST(ShmTransport, ProcessPingPongLatencyAndBandwidth) {
  const auto codes = run_processes(2, [](Transport& t) {
    const int peer = 1 - t.rank();
    auto ping_pong = [&](void* buf, size_t bytes, int iterations) {
      for (int i = 0; i < iterations; ++i) {
        if (t.rank() == 0) {
          wait_one(t, t.post_send(peer, 1, buf, bytes));
          wait_one(t, t.post_recv(peer, 1, buf, bytes));
        } else {
          wait_one(t, t.post_recv(peer, 1, buf, bytes));
          wait_one(t, t.post_send(peer, 1, buf, bytes));
        }
      }
    };
    uint64_t word = 42;
    ping_pong(&word, 8, 1000);  // warm up
    constexpr int kSmall = 5000;
    auto t0 = Clock::now();
    ping_pong(&word, 8, kSmall);
    const double latency_us = std::chrono::duration<double, std::micro>(Clock::now() - t0).count() / (2.0 * kSmall);

    const size_t big = size_t{64} << 20;
    std::vector<uint8_t> buf = pattern(big, 5);
    constexpr int kBig = 3;
    t0 = Clock::now();
    ping_pong(buf.data(), big, kBig);
    const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    if (first_difference(buf, pattern(big, 5)) >= 0) throw std::runtime_error("64 MiB ping-pong corrupted data");
    if (t.rank() == 0) {
      std::cout << fmt::format("[ shm perf ] 8 B ping-pong one-way latency {:.2f} us; 64 MiB ping-pong {:.2f} GB/s\n",
                               latency_us, 2.0 * kBig * static_cast<double>(big) / seconds / 1e9);
    }
  });
  EXPECT_EQ(codes, std::vector<int>(2, 0));
}

}  // namespace
}  // namespace dtrain::comm
