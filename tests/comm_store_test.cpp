// Rendezvous stores: one behavioural suite over the memory, file and TCP stores, then the TCP
// server's defences (authentication, malformed frames) and its wire format.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <future>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "../src/comm/store/auth.h"
#include "../src/comm/store/store_wire.h"
#include "../src/comm/tcp/net.h"
#include "comm_test_util.h"
#include "dtrain/comm/store.h"

namespace dc = dtrain::comm;
namespace net = dtrain::comm::net;
namespace wire = dtrain::comm::net::store_wire;
using namespace std::chrono_literals;
using Ms = std::chrono::milliseconds;

namespace {

enum class Kind { memory, file, tcp };

using dtrain::comm::test_util::eventually;
using dtrain::comm::test_util::since;

class TempDir {
 public:
  TempDir() {
    std::string templ = (std::filesystem::temp_directory_path() / "dtrain-store-XXXXXX").string();
    const char* made = ::mkdtemp(templ.data());
    if (made == nullptr) throw std::runtime_error("mkdtemp failed");
    path_ = made;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// One store and a way to open more handles on it: the same object (memory), another
// FileStore on the same directory (as another process would), another TCP connection.
class Backend {
 public:
  explicit Backend(Kind kind) : kind_(kind) {
    if (kind == Kind::memory) memory_ = dc::make_memory_store();
    if (kind == Kind::file) dir_ = std::make_unique<TempDir>();
    if (kind == Kind::tcp) server_ = std::make_unique<dc::TcpStoreServer>("127.0.0.1", 0, secret_);
  }
  std::shared_ptr<dc::Store> connect() {
    switch (kind_) {
      case Kind::memory:
        return memory_;
      case Kind::file:
        return dc::make_file_store(dir_->path());
      case Kind::tcp:
        return dc::connect_tcp_store("127.0.0.1", server_->port(), secret_, 5000ms);
    }
    return nullptr;
  }

 private:
  Kind kind_;
  std::string secret_ = dc::make_secret();
  std::shared_ptr<dc::Store> memory_;
  std::unique_ptr<TempDir> dir_;
  std::unique_ptr<dc::TcpStoreServer> server_;
};

std::string kind_name(const ::testing::TestParamInfo<Kind>& info) {
  switch (info.param) {
    case Kind::memory:
      return "Memory";
    case Kind::file:
      return "File";
    case Kind::tcp:
      return "Tcp";
  }
  return "?";
}

class StoreTest : public ::testing::TestWithParam<Kind> {
 protected:
  void SetUp() override {
    backend_ = std::make_unique<Backend>(GetParam());
    store_ = backend_->connect();
  }
  std::unique_ptr<Backend> backend_;
  std::shared_ptr<dc::Store> store_;
};

TEST_P(StoreTest, SetThenGetReturnsTheLatestValue) {
  store_->set("a", "1");
  EXPECT_EQ(store_->get("a", 1000ms), "1");
  store_->set("a", "two");
  EXPECT_EQ(store_->get("a", 1000ms), "two");
  store_->set("empty", "");
  EXPECT_EQ(store_->get("empty", 1000ms), "");
  // Another handle sees it too.
  EXPECT_EQ(backend_->connect()->get("a", 1000ms), "two");
}

TEST_P(StoreTest, KeysAndValuesAreArbitraryBytes) {
  const std::string binary_value("x\0y\xff\n", 5);
  const std::vector<std::string> keys = {
      "", ".", "..", "a/b", "../escape", "%41", "A", "a", std::string("k\0z", 3), std::string(300, 'k'), "rank 3 addr"};
  for (size_t i = 0; i < keys.size(); ++i) store_->set(keys[i], binary_value + std::to_string(i));
  for (size_t i = 0; i < keys.size(); ++i) EXPECT_EQ(store_->get(keys[i], 1000ms), binary_value + std::to_string(i));
  const std::string big(1 << 20, 'v');
  store_->set("big", big);
  EXPECT_EQ(store_->get("big", 1000ms), big);
}

TEST_P(StoreTest, GetWaitsForALaterSetFromAnotherThread) {
  auto getter = std::async(std::launch::async, [other = backend_->connect()] { return other->get("late", 5000ms); });
  // Still waiting: get must not return before the key exists.
  EXPECT_EQ(getter.wait_for(50ms), std::future_status::timeout);
  const auto start = dc::Clock::now();
  store_->set("late", "here");
  ASSERT_EQ(getter.wait_for(2000ms), std::future_status::ready);
  EXPECT_EQ(getter.get(), "here");
  EXPECT_LT(since(start), 1000ms);
}

TEST_P(StoreTest, TryGetDoesNotWait) {
  const auto start = dc::Clock::now();
  EXPECT_EQ(store_->try_get("absent"), std::nullopt);
  EXPECT_LT(since(start), 500ms);
  store_->set("present", "v");
  EXPECT_EQ(store_->try_get("present"), std::optional<std::string>("v"));
}

TEST_P(StoreTest, AddFromEightThreadsIsAtomic) {
  EXPECT_EQ(store_->add("fresh", 5), 5);  // absent counts as 0
  EXPECT_EQ(store_->add("fresh", -7), -2);
  EXPECT_EQ(store_->get("fresh", 1000ms), "-2");

  constexpr int kThreads = 8, kAdds = 100;
  std::vector<std::vector<int64_t>> seen(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    // Even threads share one handle (thread safety), odd ones have their own (cross-handle atomicity).
    auto handle = t % 2 == 0 ? store_ : backend_->connect();
    threads.emplace_back([&, t, handle] {
      for (int i = 0; i < kAdds; ++i) seen[t].push_back(handle->add("counter", 1));
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(store_->get("counter", 1000ms), "800");
  // Every intermediate value was returned exactly once.
  std::vector<int64_t> all;
  for (const auto& s : seen) all.insert(all.end(), s.begin(), s.end());
  std::sort(all.begin(), all.end());
  std::vector<int64_t> expected(kThreads * kAdds);
  std::iota(expected.begin(), expected.end(), 1);
  EXPECT_EQ(all, expected);
}

TEST_P(StoreTest, CompareSetSemantics) {
  // Absent matches "".
  EXPECT_EQ(store_->compare_set("k", "", "first"), "first");
  EXPECT_EQ(store_->get("k", 1000ms), "first");
  // Mismatch: unchanged, returns the current value.
  EXPECT_EQ(store_->compare_set("k", "wrong", "second"), "first");
  EXPECT_EQ(store_->get("k", 1000ms), "first");
  // Absent key with a non-empty expectation: stays absent.
  EXPECT_EQ(store_->compare_set("absent", "x", "y"), "");
  EXPECT_EQ(store_->try_get("absent"), std::nullopt);
  // Match: replaced.
  EXPECT_EQ(store_->compare_set("k", "first", "second"), "second");
  EXPECT_EQ(store_->get("k", 1000ms), "second");
}

TEST_P(StoreTest, CompareSetElectsExactlyOneLeader) {
  constexpr int kThreads = 8;
  std::vector<std::string> results(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t, handle = backend_->connect()] {
      results[t] = handle->compare_set("leader", "", "rank" + std::to_string(t));
    });
  }
  for (auto& th : threads) th.join();
  const std::string winner = store_->get("leader", 1000ms);
  for (const auto& r : results) EXPECT_EQ(r, winner);  // everyone agrees on the one that won
  EXPECT_EQ(winner.rfind("rank", 0), 0u);
}

TEST_P(StoreTest, WaitReturnsOnceAllKeysExist) {
  store_->set("w0", "");
  auto waiter = std::async(std::launch::async, [other = backend_->connect()] {
    other->wait({"w0", "w1", "w2"}, 5000ms);
  });
  store_->set("w1", "");
  EXPECT_EQ(waiter.wait_for(50ms), std::future_status::timeout);  // w2 still missing
  store_->set("w2", "");
  ASSERT_EQ(waiter.wait_for(2000ms), std::future_status::ready);
  waiter.get();
  store_->wait({}, 0ms);  // nothing to wait for
}

TEST_P(StoreTest, WaitTimeoutThrowsCommErrorNamingMissingKeys) {
  store_->set("here", "1");
  const auto timeout = 200ms;
  const auto start = dc::Clock::now();
  try {
    store_->wait({"here", "missing_a", "missing_b"}, timeout);
    FAIL() << "wait returned although keys are missing";
  } catch (const dc::CommError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("timed out after 200 ms waiting for keys: missing_a, missing_b"), std::string::npos) << what;
    EXPECT_EQ(what.find("here"), std::string::npos) << what;
    EXPECT_EQ(e.op(), "store.wait");
  }
  const auto elapsed = since(start);
  EXPECT_GE(elapsed, timeout - 5ms);
  EXPECT_LT(elapsed, timeout + 200ms);
}

TEST_P(StoreTest, GetTimeoutThrowsCommErrorNamingTheKey) {
  const auto start = dc::Clock::now();
  try {
    store_->get("never", 150ms);
    FAIL() << "get returned a key that was never set";
  } catch (const dc::CommError& e) {
    EXPECT_NE(std::string(e.what()).find("waiting for keys: never"), std::string::npos) << e.what();
  }
  EXPECT_GE(since(start), 145ms);
  EXPECT_LT(since(start), 150ms + 200ms);
  // The handle is still usable after a timeout.
  store_->set("never", "now");
  EXPECT_EQ(store_->get("never", 0ms), "now");
}

INSTANTIATE_TEST_SUITE_P(AllStores, StoreTest, ::testing::Values(Kind::memory, Kind::file, Kind::tcp), kind_name);

// MemoryStore (another file) reports a non-integer through std::stoll, so it is not part of this.
class StoreAddErrorTest : public StoreTest {};

TEST_P(StoreAddErrorTest, AddOnANonIntegerValueThrowsCommError) {
  store_->set("text", "12abc");
  try {
    store_->add("text", 1);
    FAIL() << "add accepted a non-integer value";
  } catch (const dc::CommError& e) {
    EXPECT_NE(std::string(e.what()).find("not an integer: '12abc'"), std::string::npos) << e.what();
  }
  EXPECT_EQ(store_->get("text", 0ms), "12abc");  // unchanged, and the handle still works
  store_->set("max", std::to_string(INT64_MAX));
  EXPECT_THROW(store_->add("max", 1), dc::CommError);
}

INSTANTIATE_TEST_SUITE_P(FileAndTcp, StoreAddErrorTest, ::testing::Values(Kind::file, Kind::tcp), kind_name);

TEST(FileStoreTest, KeepsNoTemporaryFilesAndSurvivesANewHandle) {
  TempDir dir;
  {
    auto a = dc::make_file_store(dir.path() + "/nested/store");
    a->set("x", "1");
    a->add("n", 3);
    a->compare_set("c", "", "v");
  }
  auto b = dc::make_file_store(dir.path() + "/nested/store");
  EXPECT_EQ(b->get("x", 0ms), "1");
  EXPECT_EQ(b->add("n", 1), 4);
  for (const auto& entry : std::filesystem::directory_iterator(dir.path() + "/nested/store")) {
    EXPECT_EQ(entry.path().filename().string().rfind(".tmp", 0), std::string::npos) << entry.path();
  }
}

TEST(FileStoreTest, AddIsAtomicAcrossProcesses) {
  // Threads of one process serialise on a mutex before the flock, so only processes test it.
  TempDir dir;
  constexpr int kProcesses = 4, kAdds = 100;
  std::vector<pid_t> children;
  for (int p = 0; p < kProcesses; ++p) {
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      int status = 0;
      try {
        auto store = dc::make_file_store(dir.path());
        for (int i = 0; i < kAdds; ++i) store->add("n", 1);
      } catch (...) {
        status = 1;
      }
      ::_exit(status);
    }
    children.push_back(pid);
  }
  for (const pid_t pid : children) {
    int status = -1;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child status " << status;
  }
  EXPECT_EQ(dc::make_file_store(dir.path())->get("n", 0ms), std::to_string(kProcesses * kAdds));
}

// A rank stopped (SIGSTOP, a debugger) while it writes one key must not hold up the writers of
// other keys: every survivor's heartbeat writes its own key through this store, and with one
// lock for the directory a victim stopped mid-heartbeat silenced them all until the lock
// timeout (the Heartbeat fault test failed so, rarely, under load).
TEST(FileStoreTest, AWriterStoppedHoldingOneKeyHoldsUpThatKeyOnly) {
  TempDir dir;
  auto store = dc::make_file_store(dir.path());
  store->set("a", "1");
  int locked[2];
  ASSERT_EQ(::pipe(locked), 0);
  const pid_t holder = ::fork();
  ASSERT_GE(holder, 0);
  if (holder == 0) {  // takes key a's lock as a writer would, and stops holding it
    const int fd = ::open((dir.path() + "/.lock.k.a").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    const char ok = fd >= 0 && ::flock(fd, LOCK_EX) == 0 ? 1 : 0;
    (void)!::write(locked[1], &ok, 1);
    ::raise(SIGSTOP);
    ::_exit(0);
  }
  ::close(locked[1]);
  char ok = 0;
  const bool got = ::read(locked[0], &ok, 1) == 1 && ok == 1;
  ::close(locked[0]);
  int status = 0;
  ASSERT_EQ(::waitpid(holder, &status, WUNTRACED), holder);  // stopped, lock held
  const auto cleanup = [&] {
    ::kill(holder, SIGKILL);
    ::waitpid(holder, &status, 0);
  };
  if (!got || !WIFSTOPPED(status)) {
    cleanup();
    FAIL() << "the lock holder did not take the lock and stop";
  }
  // Other keys: each write completes (bounded, so a regression fails instead of hanging).
  auto others = std::async(std::launch::async, [&] {
    store->set("b", "2");
    store->add("n", 5);
    return store->compare_set("c", "", "3");
  });
  const bool others_done = others.wait_for(10s) == std::future_status::ready;
  // Key a: its writers wait for the stopped holder.
  auto blocked = std::async(std::launch::async, [&] { store->set("a", "4"); });
  const bool a_waited = blocked.wait_for(300ms) == std::future_status::timeout;
  cleanup();  // the kernel drops the holder's flock, and the waiting set goes through
  ASSERT_TRUE(others_done) << "writes of other keys waited for the stopped holder of key a";
  EXPECT_EQ(others.get(), "3");
  EXPECT_TRUE(a_waited) << "a write of key a did not wait for the holder of its lock";
  ASSERT_EQ(blocked.wait_for(10s), std::future_status::ready);
  blocked.get();
  EXPECT_EQ(store->get("a", 0ms), "4");
  EXPECT_EQ(store->get("b", 0ms), "2");
  EXPECT_EQ(store->get("n", 0ms), "5");
}

// ---- TCP store: the server's defences ----

// A hand-driven client speaking the wire protocol (or not).
class RawClient {
 public:
  explicit RawClient(uint16_t port) : fd_(net::connect_tcp("127.0.0.1", port, dc::deadline_after(2000ms))) {
    uint8_t greeting[wire::kGreetingBytes];
    net::recv_all(fd_.get(), greeting, sizeof(greeting), dc::deadline_after(2000ms));
    std::copy(greeting + 5, greeting + sizeof(greeting), challenge_.begin());
  }
  void authenticate(const std::string& secret) {
    const auto mac = dtrain::comm::auth::answer_challenge(secret, wire::kAuthContext, challenge_);
    send(std::string(reinterpret_cast<const char*>(mac.data()), mac.size()));
    uint8_t verdict = 0;
    net::recv_all(fd_.get(), &verdict, 1, dc::deadline_after(2000ms));
    ASSERT_EQ(verdict, wire::kAuthAccepted);
  }
  void send(const std::string& bytes) {
    net::send_all(fd_.get(), bytes.data(), bytes.size(), dc::deadline_after(2000ms));
  }
  std::string read_frame_body() {
    uint8_t header[4];
    net::recv_all(fd_.get(), header, 4, dc::deadline_after(2000ms));
    std::string body(net::load_u32(header), '\0');
    net::recv_all(fd_.get(), body.data(), body.size(), dc::deadline_after(2000ms));
    return body;
  }
  void close() { fd_.reset(); }
  // True when the server closes this connection within `timeout` (data it sends is skipped).
  bool closed_by_server(Ms timeout = 2000ms) {
    const auto deadline = dc::deadline_after(timeout);
    char buf[256];
    for (;;) {
      if (!net::wait_ready(fd_.get(), POLLIN, deadline)) return false;
      const ssize_t n = ::recv(fd_.get(), buf, sizeof(buf), 0);
      if (n == 0 || (n < 0 && errno == ECONNRESET)) return true;
    }
  }

 private:
  net::Fd fd_;
  dtrain::comm::auth::Challenge challenge_{};
};

std::string frame_of(const std::string& body) {
  std::string f;
  net::put_u32(f, static_cast<uint32_t>(body.size()));
  return f + body;
}

std::string set_frame(const std::string& key, const std::string& value) {
  wire::Request q;
  q.op = wire::Op::set;
  q.key = key;
  q.value = value;
  return wire::encode_request_frame(q);
}

class TcpStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    server_ = std::make_unique<dc::TcpStoreServer>("127.0.0.1", 0, secret_);
    good_ = connect();
  }
  std::shared_ptr<dc::Store> connect() { return dc::connect_tcp_store("127.0.0.1", server_->port(), secret_, 2000ms); }
  // Sends `bytes` on a fresh connection (authenticated first when asked) and expects the
  // server to drop it, count it as rejected, and keep serving the good client.
  void expect_rejected(const std::string& bytes, bool authenticate, bool then_close = false) {
    const uint64_t before = server_->rejected_connections();
    RawClient raw(server_->port());
    if (authenticate) raw.authenticate(secret_);
    raw.send(bytes);
    if (then_close) {
      raw.close();
    } else {
      EXPECT_TRUE(raw.closed_by_server());
    }
    EXPECT_TRUE(eventually([&] { return server_->rejected_connections() == before + 1; }))
        << "rejected " << server_->rejected_connections() << ", expected " << before + 1;
    good_->set("alive", std::to_string(before));
    EXPECT_EQ(good_->get("alive", 1000ms), std::to_string(before));
  }

  std::string secret_ = dc::make_secret();
  std::unique_ptr<dc::TcpStoreServer> server_;
  std::shared_ptr<dc::Store> good_;
};

TEST_F(TcpStoreTest, WrongSecretIsRefusedWithAClearMessage) {
  const auto start = dc::Clock::now();
  try {
    dc::connect_tcp_store("127.0.0.1", server_->port(), dc::make_secret(), 3000ms);
    FAIL() << "a client with the wrong secret was accepted";
  } catch (const dc::CommError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("authentication refused: wrong job secret?"), std::string::npos) << what;
    EXPECT_NE(what.find("127.0.0.1:" + std::to_string(server_->port())), std::string::npos) << what;
  }
  EXPECT_LT(since(start), 1000ms);  // refused at once, not retried until the timeout
  EXPECT_TRUE(eventually([&] { return server_->rejected_connections() == 1; }));
  // Both the client connected before and a new one keep working.
  good_->set("k", "v");
  EXPECT_EQ(connect()->get("k", 1000ms), "v");
}

TEST_F(TcpStoreTest, RejectsGarbageBeforeAuthentication) {
  expect_rejected(std::string(100, '\x5a'), /*authenticate=*/false);
}

TEST_F(TcpStoreTest, RejectsAFrameSentBeforeAuthentication) {
  const std::string frame = set_frame("stolen", "value-long-enough-to-pass-32-bytes");
  ASSERT_GT(frame.size(), dtrain::comm::auth::kMacBytes);
  expect_rejected(frame, /*authenticate=*/false);
  EXPECT_EQ(good_->try_get("stolen"), std::nullopt);
}

TEST_F(TcpStoreTest, RejectsAShortAnswerThenClose) {
  expect_rejected("short", /*authenticate=*/false, /*then_close=*/true);
}

TEST_F(TcpStoreTest, RejectsAnUnknownOpcode) {
  expect_rejected(frame_of(std::string("\x7f garbage garbage", 17)), /*authenticate=*/true);
}

TEST_F(TcpStoreTest, RejectsAStringLengthPastTheFrame) {
  std::string body;
  net::put_u8(body, static_cast<uint8_t>(wire::Op::set));
  net::put_u32(body, 1000);  // key length, but only 3 bytes follow
  body += "abc";
  expect_rejected(frame_of(body), /*authenticate=*/true);
}

TEST_F(TcpStoreTest, RejectsTrailingBytesAndEmptyFrames) {
  expect_rejected(frame_of(set_frame("k", "v").substr(4) + "x"), /*authenticate=*/true);
  expect_rejected(std::string(4, '\0'), /*authenticate=*/true);
}

TEST_F(TcpStoreTest, RejectsAnOversizedLengthPrefix) {
  expect_rejected(std::string(4, '\xff'), /*authenticate=*/true);  // 0xFFFFFFFF
  std::string just_over;
  net::put_u32(just_over, static_cast<uint32_t>(dc::kMaxFrameBytes + 1));
  expect_rejected(just_over, /*authenticate=*/true);
}

TEST_F(TcpStoreTest, RejectsATruncatedFrameThenClose) {
  const std::string frame = set_frame("half", "written");
  expect_rejected(frame.substr(0, frame.size() - 3), /*authenticate=*/true, /*then_close=*/true);
  EXPECT_EQ(good_->try_get("half"), std::nullopt);
}

TEST_F(TcpStoreTest, GoodClientsKeepWorkingDuringAttacks) {
  // A good client parked in a server-side get, and an attacker holding half a frame open.
  auto parked = std::async(std::launch::async, [other = connect()] { return other->get("release", 5000ms); });
  RawClient half_open(server_->port());
  half_open.authenticate(secret_);
  half_open.send(set_frame("partial", "x").substr(0, 7));

  for (int i = 0; i < 3; ++i) {
    RawClient attacker(server_->port());
    attacker.authenticate(secret_);
    attacker.send(std::string(4, '\xff'));
    EXPECT_TRUE(attacker.closed_by_server());
    good_->add("progress", 1);
  }
  EXPECT_TRUE(eventually([&] { return server_->rejected_connections() == 3; }));
  EXPECT_EQ(parked.wait_for(0ms), std::future_status::timeout);
  good_->set("release", "go");
  ASSERT_EQ(parked.wait_for(2000ms), std::future_status::ready);
  EXPECT_EQ(parked.get(), "go");
  half_open.close();
  EXPECT_TRUE(eventually([&] { return server_->rejected_connections() == 4; }));
  EXPECT_EQ(good_->get("progress", 0ms), "3");
}

TEST_F(TcpStoreTest, PipelinedRequestsAreAnsweredInOrder) {
  RawClient raw(server_->port());
  raw.authenticate(secret_);
  wire::Request get;
  get.op = wire::Op::get;
  get.key = "p";
  get.timeout_ms = 2000;
  wire::Request add;
  add.op = wire::Op::add;
  add.key = "n";
  add.delta = 41;
  // The get parks until another client sets "p"; the add behind it waits its turn.
  raw.send(wire::encode_request_frame(get) + wire::encode_request_frame(add) + set_frame("p", "late"));
  good_->set("p", "first");
  auto body = raw.read_frame_body();
  auto reply = wire::decode_reply_body(wire::Op::get, reinterpret_cast<const uint8_t*>(body.data()), body.size());
  ASSERT_TRUE(reply.ok) << reply.error;
  EXPECT_EQ(reply.reply.value, "first");
  body = raw.read_frame_body();
  reply = wire::decode_reply_body(wire::Op::add, reinterpret_cast<const uint8_t*>(body.data()), body.size());
  ASSERT_TRUE(reply.ok) << reply.error;
  EXPECT_EQ(reply.reply.number, 41);
  body = raw.read_frame_body();
  reply = wire::decode_reply_body(wire::Op::set, reinterpret_cast<const uint8_t*>(body.data()), body.size());
  ASSERT_TRUE(reply.ok) << reply.error;
  EXPECT_EQ(good_->get("p", 0ms), "late");
  EXPECT_EQ(server_->rejected_connections(), 0u);
}

TEST_F(TcpStoreTest, ManyClientsWaitOnOneKey) {
  constexpr int kClients = 32;
  std::vector<std::future<void>> waiters;
  for (int i = 0; i < kClients; ++i) {
    waiters.push_back(std::async(std::launch::async, [c = connect()] { c->wait({"go"}, 5000ms); }));
  }
  good_->set("go", "");
  for (auto& w : waiters) {
    ASSERT_EQ(w.wait_for(2000ms), std::future_status::ready);
    w.get();
  }
}

TEST_F(TcpStoreTest, OversizedValueIsRefusedBeforeSending) {
  EXPECT_THROW(good_->set("huge", std::string(dc::kMaxFrameBytes, 'x')), dc::CommError);
  good_->set("small", "ok");  // the connection is still in step
  EXPECT_EQ(good_->get("small", 0ms), "ok");
  EXPECT_EQ(server_->rejected_connections(), 0u);
}

TEST_F(TcpStoreTest, DestructorReturnsPromptlyWithClientsConnected) {
  auto idle = connect();
  auto parked = std::async(std::launch::async, [c = connect()] { return c->get("never", 10'000ms); });
  RawClient unauthenticated(server_->port());
  EXPECT_EQ(parked.wait_for(50ms), std::future_status::timeout);
  const std::string where = "127.0.0.1:" + std::to_string(server_->port());
  const auto start = dc::Clock::now();
  server_.reset();
  EXPECT_LT(since(start), 500ms);
  ASSERT_EQ(parked.wait_for(2000ms), std::future_status::ready);
  try {
    parked.get();
    FAIL() << "get returned after the server was destroyed";
  } catch (const dc::CommError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(where + ": server closed the connection"), std::string::npos) << what;
  }
  EXPECT_THROW(idle->set("k", "v"), dc::CommError);
  EXPECT_TRUE(unauthenticated.closed_by_server());
}

// A port that was free a moment ago (ephemeral ports are not reused at once).
uint16_t free_port() {
  dc::TcpStoreServer probe("127.0.0.1", 0, dc::make_secret());
  return probe.port();
}

TEST(TcpStoreConnectTest, RetriesUntilTheServerStarts) {
  const std::string secret = dc::make_secret();
  const uint16_t port = free_port();
  auto client =
      std::async(std::launch::async, [&] { return dc::connect_tcp_store("127.0.0.1", port, secret, 5000ms); });
  EXPECT_EQ(client.wait_for(100ms), std::future_status::timeout);  // still retrying
  dc::TcpStoreServer server("127.0.0.1", port, secret);
  ASSERT_EQ(client.wait_for(2000ms), std::future_status::ready);
  auto store = client.get();
  store->set("up", "1");
  EXPECT_EQ(store->get("up", 0ms), "1");
}

TEST(TcpStoreConnectTest, TimesOutNamingTheEndpoint) {
  const uint16_t port = free_port();
  const auto start = dc::Clock::now();
  try {
    dc::connect_tcp_store("127.0.0.1", port, dc::make_secret(), 300ms);
    FAIL() << "connected to a port nobody listens on";
  } catch (const dc::CommError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("127.0.0.1:" + std::to_string(port) + ": could not connect within 300 ms"), std::string::npos)
        << what;
  }
  EXPECT_GE(since(start), 295ms);
  EXPECT_LT(since(start), 300ms + 200ms);
}

TEST(TcpStoreConnectTest, BindingATakenPortThrowsCommError) {
  const std::string secret = dc::make_secret();
  dc::TcpStoreServer first("127.0.0.1", 0, secret);
  try {
    dc::TcpStoreServer second("127.0.0.1", first.port(), secret);
    FAIL() << "two servers bound one port";
  } catch (const dc::CommError& e) {
    EXPECT_NE(std::string(e.what()).find("Address already in use"), std::string::npos) << e.what();
  }
  EXPECT_THROW(dc::TcpStoreServer("127.0.0.1", 0, ""), dtrain::Error);  // no secret, no server
}

TEST(StoreSecretTest, MakeSecretIs32RandomBytesInHex) {
  const std::string a = dc::make_secret(), b = dc::make_secret();
  EXPECT_EQ(a.size(), 64u);
  EXPECT_EQ(a.find_first_not_of("0123456789abcdef"), std::string::npos);
  EXPECT_NE(a, b);
}

// ---- the wire format ----

std::vector<wire::Request> sample_requests() {
  std::vector<wire::Request> out;
  wire::Request q;
  q.op = wire::Op::set, q.key = "key", q.value = std::string("v\0v", 3);
  out.push_back(q);
  q = {}, q.op = wire::Op::get, q.key = "g", q.timeout_ms = 1234;
  out.push_back(q);
  q = {}, q.op = wire::Op::try_get, q.key = "";
  out.push_back(q);
  q = {}, q.op = wire::Op::add, q.key = "n", q.delta = -5;
  out.push_back(q);
  q = {}, q.op = wire::Op::compare_set, q.key = "c", q.value = "old", q.desired = "new";
  out.push_back(q);
  q = {}, q.op = wire::Op::wait, q.keys = {"a", "", "c"}, q.timeout_ms = 99;
  out.push_back(q);
  return out;
}

TEST(StoreWireTest, EveryRequestRoundTripsAndEveryPrefixIsIncomplete) {
  for (const auto& q : sample_requests()) {
    const std::string frame = wire::encode_request_frame(q);
    const auto* bytes = reinterpret_cast<const uint8_t*>(frame.data());
    const auto d = wire::decode_request_frame(bytes, frame.size());
    ASSERT_EQ(d.status, wire::Decode::ok) << d.error;
    EXPECT_EQ(d.consumed, frame.size());
    EXPECT_EQ(wire::encode_request_frame(d.request), frame);
    for (size_t n = 0; n < frame.size(); ++n) {
      EXPECT_EQ(wire::decode_request_frame(bytes, n).status, wire::Decode::incomplete) << wire::op_name(q.op) << n;
    }
  }
}

TEST(StoreWireTest, MalformedFramesAreErrorsNamingTheProblem) {
  auto decode = [](const std::string& f) {
    return wire::decode_request_frame(reinterpret_cast<const uint8_t*>(f.data()), f.size());
  };
  auto d = decode(std::string("\xff\xff\xff\xff", 4));
  EXPECT_EQ(d.status, wire::Decode::error);
  EXPECT_NE(d.error.find("4294967295"), std::string::npos) << d.error;
  d = decode(frame_of("\x09"));
  EXPECT_EQ(d.status, wire::Decode::error);
  EXPECT_NE(d.error.find("unknown opcode 0x09"), std::string::npos) << d.error;
  d = decode(frame_of(set_frame("k", "v").substr(4) + "!"));
  EXPECT_NE(d.error.find("1 trailing bytes"), std::string::npos) << d.error;
  std::string wait_body;
  net::put_u8(wait_body, static_cast<uint8_t>(wire::Op::wait));
  net::put_u64(wait_body, 10);
  net::put_u32(wait_body, 0xffffffffu);  // key count, with no keys behind it
  d = decode(frame_of(wait_body));
  EXPECT_EQ(d.status, wire::Decode::error);
  EXPECT_NE(d.error.find("keys exceed the limit"), std::string::npos) << d.error;
}

TEST(StoreWireTest, RepliesRoundTripAndRejectForeignStatuses) {
  wire::Reply y;
  y.status = wire::Status::timeout;
  y.keys = {"x", "y"};
  const std::string frame = wire::encode_reply_frame(wire::Op::wait, y);
  auto d =
      wire::decode_reply_body(wire::Op::wait, reinterpret_cast<const uint8_t*>(frame.data()) + 4, frame.size() - 4);
  ASSERT_TRUE(d.ok) << d.error;
  EXPECT_EQ(d.reply.keys, y.keys);
  // A timeout status is meaningless for set.
  d = wire::decode_reply_body(wire::Op::set, reinterpret_cast<const uint8_t*>(frame.data()) + 4, frame.size() - 4);
  EXPECT_FALSE(d.ok);
  const uint8_t bad_present[] = {0, 2};
  EXPECT_FALSE(wire::decode_reply_body(wire::Op::try_get, bad_present, sizeof(bad_present)).ok);
}

}  // namespace
