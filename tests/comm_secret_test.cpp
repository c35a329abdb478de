// The job secret and the TCP store's defences against guessing it: the strength rule
// (comm::check_secret) enforced by the store server and client, the TCP transport, groups and
// the launchers; and a brute force against a TcpStoreServer on loopback, which must be slowed
// down and logged in a few summary lines while the job's own ranks keep working.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <spdlog/sinks/base_sink.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <iostream>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "../src/comm/store/auth.h"
#include "../src/comm/store/store_guard.h"
#include "../src/comm/store/store_wire.h"
#include "../src/comm/tcp/net.h"
#include "comm_test_util.h"
#include "dtrain/comm/group.h"
#include "dtrain/comm/store.h"
#include "dtrain/comm/transport.h"
#include "dtrain/core/log.h"
#include "dtrain/launch/launcher.h"

namespace dc = dtrain::comm;
namespace net = dtrain::comm::net;
namespace wire = dtrain::comm::net::store_wire;
using namespace std::chrono_literals;
using Ms = std::chrono::milliseconds;

namespace {

using dtrain::comm::test_util::eventually;
using dtrain::comm::test_util::since;

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// Sets an environment variable for one scope (unset: nullopt), restoring it after.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, std::optional<std::string> value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value) {
      ::setenv(name, value->c_str(), 1);
    } else {
      ::unsetenv(name);
    }
  }
  ~ScopedEnv() {
    if (old_) {
      ::setenv(name_, old_->c_str(), 1);
    } else {
      ::unsetenv(name_);
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  std::optional<std::string> old_;
};

// Keeps every message the dtrain logger writes. Installed once, before the servers of these
// tests start (a logger's sinks must not change while other threads log).
class CapturedLog final : public spdlog::sinks::base_sink<std::mutex> {
 public:
  std::vector<std::string> lines_containing(const std::string& part) {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<std::string> out;
    for (const auto& l : lines_) {
      if (contains(l, part)) out.push_back(l);
    }
    return out;
  }

 protected:
  void sink_it_(const spdlog::details::log_msg& msg) override {
    lines_.emplace_back(msg.payload.data(), msg.payload.size());
  }
  void flush_() override {}

 private:
  std::vector<std::string> lines_;
};

// The capture, with the logger writing warnings for the scope of a test.
class LogCapture {
 public:
  LogCapture() : level_(dtrain::logger()->level()) {
    static const std::shared_ptr<CapturedLog> sink = [] {
      auto s = std::make_shared<CapturedLog>();
      dtrain::logger()->sinks().push_back(s);
      return s;
    }();
    sink_ = sink;
    if (level_ > spdlog::level::warn) dtrain::logger()->set_level(spdlog::level::warn);
  }
  ~LogCapture() { dtrain::logger()->set_level(level_); }
  LogCapture(const LogCapture&) = delete;
  LogCapture& operator=(const LogCapture&) = delete;
  std::vector<std::string> lines_containing(const std::string& part) const { return sink_->lines_containing(part); }

 private:
  spdlog::level::level_enum level_;
  std::shared_ptr<CapturedLog> sink_;
};

// Expects `fn` to throw dtrain::Error saying the secret is too weak and how to make one;
// returns the message.
template <typename F>
std::string expect_weak_secret_error(F fn, const std::string& where) {
  try {
    fn();
  } catch (const dtrain::Error& e) {
    const std::string what = e.what();
    EXPECT_TRUE(contains(what, where)) << what;
    EXPECT_TRUE(contains(what, "job secret is too weak")) << what;
    EXPECT_TRUE(contains(what, "128 bits")) << what;
    EXPECT_TRUE(contains(what, "export DTRAIN_SECRET=$(openssl rand -hex 32)")) << what;
    return what;
  }
  ADD_FAILURE() << where << ": a weak secret was accepted";
  return "";
}

// ---- the rule ----

std::vector<std::string> weak_secrets() {
  return {"",
          "q7",
          "s",
          "k",
          "secret",
          "password",
          "tcp-test-secret",
          std::string(64, 'a'),
          "passwordpasswordpasswordpassword",          // 32 characters: one word repeated
          "0123456789abcdef0123456789abcdef01234567",  // 40 characters, 16 different: a pattern repeated
          "abababababababababababababababababababab",
          "aaaaaaaaaaaaaaaaaaaaaaaaaaaaabcd",  // 32 characters, 4 different
          "0123456789abcdef0123456789abcde"};  // 31 characters
}

TEST(CommSecretRule, WeakSecretsAreRefusedSayingHowToMakeOne) {
  for (const std::string& s : weak_secrets()) {
    const std::string what = expect_weak_secret_error([&] { dc::check_secret(s, "the unit test"); }, "the unit test");
    if (s.size() >= 8) {
      EXPECT_FALSE(contains(what, s)) << "the error repeats the secret: " << what;
    }
  }
}

TEST(CommSecretRule, RandomSecretsPass) {
  for (int i = 0; i < 1000; ++i) {
    EXPECT_NO_THROW(dc::check_secret(dc::make_secret(), "make_secret"));
    // What `openssl rand -hex 16` prints: 128 random bits as 32 hex digits.
    uint8_t bytes[24];
    dc::auth::random_bytes(bytes, sizeof(bytes));
    const std::string hex16 = dc::auth::to_hex(bytes, 16);
    ASSERT_EQ(hex16.size(), 32u);
    EXPECT_NO_THROW(dc::check_secret(hex16, "openssl rand -hex 16")) << hex16;
    // What `openssl rand -base64 24` prints: 32 characters of base64.
    static constexpr char kB64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    std::string b64;
    for (size_t k = 0; k < sizeof(bytes); k += 3) {
      const uint32_t v = (uint32_t{bytes[k]} << 16) | (uint32_t{bytes[k + 1]} << 8) | bytes[k + 2];
      for (int shift = 18; shift >= 0; shift -= 6) b64.push_back(kB64[(v >> shift) & 63]);
    }
    EXPECT_NO_THROW(dc::check_secret(b64, "openssl rand -base64 24")) << b64;
  }
  EXPECT_NO_THROW(dc::check_secret("3f9a2c7e1b8d4f6a0e5c9b2d7a1f8e3c", "a fixed 32-digit hex secret"));
}

TEST(CommSecretRule, TheStoreServerRefusesAWeakSecret) {
  for (const std::string& s : {std::string("q7"), std::string("secret")}) {
    expect_weak_secret_error([&] { dc::TcpStoreServer server("127.0.0.1", 0, s); }, "TcpStoreServer");
  }
}

TEST(CommSecretRule, TheStoreClientRefusesAWeakSecretBeforeConnecting) {
  const std::string secret = dc::make_secret();
  dc::TcpStoreServer server("127.0.0.1", 0, secret);
  const auto start = dc::Clock::now();
  expect_weak_secret_error([&] { dc::connect_tcp_store("127.0.0.1", server.port(), "q7", 3000ms); },
                           "connect_tcp_store");
  EXPECT_LT(since(start), 1000ms);
  EXPECT_EQ(server.rejected_connections(), 0u);  // it never tried
  EXPECT_NO_THROW(dc::connect_tcp_store("127.0.0.1", server.port(), secret, 3000ms)->set("k", "v"));
}

TEST(CommSecretRule, TheTcpTransportAndGroupsRefuseAWeakSecret) {
  auto store = dc::make_memory_store();
  expect_weak_secret_error([&] { dc::make_tcp_transport(*store, "weak", 0, 1, "q7", "127.0.0.1", 1000ms); },
                           "tcp transport");
  dc::GroupOptions o;
  o.transport = dc::TransportKind::tcp;
  o.secret = "q7";
  o.timeout = 2000ms;
  expect_weak_secret_error([&] { dc::Group::create(store, 0, 1, o, "weak"); }, "group 'weak'");
  {
    ScopedEnv env("DTRAIN_SECRET", "password");
    o.secret.clear();
    expect_weak_secret_error([&] { dc::Group::create(store, 0, 1, o, "weak-env"); }, "DTRAIN_SECRET");
  }
}

TEST(CommSecretRule, TheLaunchersRefuseAWeakSecretBeforeStartingAnything) {
  dtrain::launch::LaunchOptions o;
  o.command = {"/bin/true"};
  o.bind = "none";
  {
    ScopedEnv env("DTRAIN_SECRET", "q7");
    expect_weak_secret_error([&] { dtrain::launch::run_launch(o); }, "DTRAIN_SECRET");
  }
  {
    ScopedEnv env("DTRAIN_SECRET", std::nullopt);
    o.secret = "s";
    expect_weak_secret_error([&] { dtrain::launch::run_launch(o); }, "dtrain launch");
  }
  {
    ScopedEnv env("DTRAIN_SECRET", "q7");
    dtrain::launch::LaunchOptions e;
    e.command = {"/bin/true"};
    e.bind = "none";
    e.min_nodes = e.max_nodes = 1;
    e.join_timeout_seconds = 5;
    e.last_call_seconds = 0;
    {
      dc::TcpStoreServer probe("127.0.0.1", 0, dc::make_secret());
      e.master_port = probe.port();  // free a moment ago
    }
    expect_weak_secret_error([&] { dtrain::launch::run_elastic(e); }, "DTRAIN_SECRET");
  }
}

// ---- the store's guard, on a clock of its own ----

namespace guard = dtrain::comm::store_guard;

TEST(CommStoreGuard, AHostIsThrottledAfterItsFreeFailuresThenForgiven) {
  guard::GreetingThrottle t;
  const dc::Deadline t0 = dc::Deadline{} + std::chrono::hours(1);
  for (int i = 0; i < 10; ++i) t.failed("10.0.0.2", t0);
  EXPECT_TRUE(t.may_greet("10.0.0.2", t0));
  EXPECT_TRUE(t.may_greet("10.0.0.2", t0));  // still free: every connection is greeted
  t.failed("10.0.0.2", t0);
  EXPECT_EQ(t.spacing("10.0.0.2", t0), guard::kBaseSpacing);
  EXPECT_FALSE(t.may_greet("10.0.0.2", t0));  // one greeting per 100 ms now
  EXPECT_EQ(t.next_greeting("10.0.0.2", t0), t0 + guard::kBaseSpacing);
  EXPECT_TRUE(t.may_greet("10.0.0.2", t0 + guard::kBaseSpacing));
  EXPECT_FALSE(t.may_greet("10.0.0.2", t0 + guard::kBaseSpacing));
  EXPECT_TRUE(t.may_greet("10.0.0.3", t0));  // other hosts are not held back
  EXPECT_EQ(t.spacing("10.0.0.3", t0), Ms(0));
  for (int i = 0; i < 10; ++i) t.failed("10.0.0.2", t0);
  EXPECT_EQ(t.spacing("10.0.0.2", t0), 2 * guard::kBaseSpacing);
  for (int i = 0; i < 1000; ++i) t.failed("10.0.0.2", t0);
  EXPECT_EQ(t.spacing("10.0.0.2", t0), guard::kMaxSpacing);
  // The score leaks one failure a second and is capped: forgiven within a minute.
  const auto later = t0 + std::chrono::seconds(static_cast<int>(guard::kMaxScore - guard::kFreeFailures));
  EXPECT_EQ(t.spacing("10.0.0.2", later), Ms(0));
  EXPECT_TRUE(t.may_greet("10.0.0.2", later));
  EXPECT_TRUE(t.may_greet("10.0.0.2", later));
}

TEST(CommStoreGuard, RefusalsAreLoggedInOneSummaryLinePerInterval) {
  LogCapture log;
  const std::string where = "guard-test-" + dc::make_secret().substr(0, 8);
  guard::RejectionLog r(where);
  const dc::Deadline t0 = dc::Deadline{} + std::chrono::hours(1);
  const std::string long_reason(5000, '\x01');  // peer-influenced text is cut short
  for (int i = 0; i < 1200; ++i) {
    const auto now = t0 + Ms(10 * i);  // 1200 refusals in 12 s
    r.note("10.0.0." + std::to_string(i % 200) + ":4000", "10.0.0." + std::to_string(i % 200),
           i % 2 == 0 ? "wrong authentication answer" : long_reason, true, "", now);
    r.flush(now);
  }
  r.flush(t0 + Ms(12'000), /*force=*/true);
  const auto lines = log.lines_containing(where);
  ASSERT_EQ(lines.size(), 4u);  // the first in full, summaries at 5 s and 10 s, the rest at the end
  EXPECT_TRUE(contains(lines[1], "500 connections failed authentication in the last 5.0 s")) << lines[1];
  EXPECT_TRUE(contains(lines[3], "199 connections failed authentication in the last 2.0 s")) << lines[3];
  EXPECT_TRUE(contains(lines[3], "last: \\x01\\x01")) << lines[3];
  EXPECT_TRUE(contains(lines[1], "and others")) << lines[1];
  for (const auto& l : lines) EXPECT_LE(l.size(), 800u) << l;
}

// ---- guessing the secret ----

enum class Verdict { accepted, refused, no_greeting };

// One handshake with the store at 127.0.0.1:port from the loopback address `source`
// (127.0.0.2 plays another host), answering the challenge with `secret`.
Verdict handshake_from(const char* source, uint16_t port, const std::string& secret, Ms timeout) {
  const auto deadline = dc::deadline_after(timeout);
  net::Fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd) return Verdict::no_greeting;
  sockaddr_in from{};
  from.sin_family = AF_INET;
  ::inet_pton(AF_INET, source, &from.sin_addr);
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(port);
  ::inet_pton(AF_INET, "127.0.0.1", &to.sin_addr);
  if (::bind(fd.get(), reinterpret_cast<const sockaddr*>(&from), sizeof(from)) != 0 ||
      ::connect(fd.get(), reinterpret_cast<const sockaddr*>(&to), sizeof(to)) != 0) {
    return Verdict::no_greeting;
  }
  net::set_nonblocking(fd.get());
  uint8_t greeting[wire::kGreetingBytes];
  try {
    net::recv_all(fd.get(), greeting, sizeof(greeting), deadline);
  } catch (const net::NetError&) {
    return Verdict::no_greeting;
  }
  dc::auth::Challenge challenge;
  std::copy(greeting + 5, greeting + sizeof(greeting), challenge.begin());
  const auto mac = dc::auth::answer_challenge(secret, wire::kAuthContext, challenge);
  uint8_t verdict = wire::kAuthRefused;
  try {
    net::send_all(fd.get(), mac.data(), mac.size(), deadline);
    net::recv_all(fd.get(), &verdict, 1, deadline);
  } catch (const net::NetError&) {
    return Verdict::refused;
  }
  return verdict == wire::kAuthAccepted ? Verdict::accepted : Verdict::refused;
}

// Four threads on "another host" (127.0.0.2) guess the secret (up to 200 guesses, for at
// most 2.5 s). Meanwhile a rank's established connection, a rank connecting from 127.0.0.1
// and one from the attacker's host must keep working; the guesses must be slowed down to a
// few per second, and the log must say so in a few lines, not one per guess.
TEST(CommSecretBruteForce, GuessesAreSlowedDownAndLoggedInAFewLinesWhileRanksKeepWorking) {
  LogCapture log;
  const std::string secret = dc::make_secret();
  auto server = std::make_unique<dc::TcpStoreServer>("127.0.0.1", 0, secret);
  const uint16_t port = server->port();
  const std::string where = "store 127.0.0.1:" + std::to_string(port);
  auto heartbeat = dc::connect_tcp_store("127.0.0.1", port, secret, 5000ms);

  constexpr int kAttackers = 4;
  constexpr int kMaxGuesses = 200;
  constexpr Ms kBudget = 2500ms;
  std::atomic<int> started{0}, refused{0}, other{0};
  std::atomic<int64_t> last_verdict_ms{0};
  const auto start = dc::Clock::now();
  std::vector<std::thread> attackers;
  for (int t = 0; t < kAttackers; ++t) {
    attackers.emplace_back([&] {
      while (since(start) < kBudget && started.fetch_add(1) < kMaxGuesses) {
        const Verdict v = handshake_from("127.0.0.2", port, dc::make_secret(), 5000ms);
        (v == Verdict::refused ? refused : other).fetch_add(1);
        last_verdict_ms.store(std::max<int64_t>(last_verdict_ms.load(), since(start).count()));
      }
    });
  }
  // Past the first few guesses, which are answered at once:
  EXPECT_TRUE(eventually([&] { return refused.load() >= 15; }, 3000ms));
  // the established connection (a heartbeat's) is served without delay,
  Ms worst_beat{0};
  for (int i = 0; i < 20; ++i) {
    const auto t0 = dc::Clock::now();
    heartbeat->add("beat", 1);
    worst_beat = std::max(worst_beat, since(t0));
  }
  // a rank on another host connects at once,
  auto t0 = dc::Clock::now();
  auto rank = dc::connect_tcp_store("127.0.0.1", port, secret, 5000ms);
  const Ms other_host_connect = since(t0);
  rank->set("k", "v");
  EXPECT_EQ(heartbeat->get("k", 0ms), "v");
  // and one on the attacker's host still gets in, after the attackers' connections ahead of it.
  t0 = dc::Clock::now();
  const Verdict same_host = handshake_from("127.0.0.2", port, secret, 10'000ms);
  const Ms same_host_connect = since(t0);
  for (auto& t : attackers) t.join();
  const double seconds = std::max<int64_t>(last_verdict_ms.load(), 1) / 1000.0;
  const double rate = refused.load() / seconds;
  EXPECT_EQ(heartbeat->add("beat", 0), 20);
  server.reset();  // writes the last summary
  const auto lines = log.lines_containing(where);
  size_t bytes = 0;
  for (const auto& l : lines) bytes += l.size();
  std::cout << "[ figures  ] " << refused.load() << " wrong guesses refused in " << seconds << " s (" << rate << "/s), "
            << other.load() << " without a verdict; " << lines.size() << " log lines (" << bytes
            << " bytes); worst heartbeat " << worst_beat.count() << " ms; rank connect: other host "
            << other_host_connect.count() << " ms, attacker's host " << same_host_connect.count() << " ms\n";
  for (const auto& l : lines) std::cout << "[ log line ] " << l << "\n";
  EXPECT_LT(worst_beat, 250ms);
  EXPECT_LT(other_host_connect, 500ms);
  EXPECT_EQ(same_host, Verdict::accepted);
  EXPECT_LT(same_host_connect, 5000ms);
  EXPECT_LT(refused.load(), kMaxGuesses / 2) << "the guesses were not slowed down";
  EXPECT_LE(rate, 25.0) << "guesses per second";
  EXPECT_GE(lines.size(), 1u);
  EXPECT_LE(lines.size(), 4u);
  for (const auto& l : lines) EXPECT_LE(l.size(), 400u) << l;
  EXPECT_TRUE(std::any_of(lines.begin(), lines.end(), [](const std::string& l) {
    return contains(l, "connections failed authentication") && contains(l, "127.0.0.2");
  }));
}

// 300 connections that send garbage instead of an answer: each is refused, and the log holds
// a few lines however many there are.
TEST(CommSecretBruteForce, AFloodOfBadConnectionsIsLoggedInAFewLines) {
  LogCapture log;
  const std::string secret = dc::make_secret();
  auto server = std::make_unique<dc::TcpStoreServer>("127.0.0.1", 0, secret);
  const uint16_t port = server->port();
  const std::string where = "store 127.0.0.1:" + std::to_string(port);
  constexpr int kConnections = 300;
  const auto start = dc::Clock::now();
  for (int i = 0; i < kConnections; ++i) {
    net::Fd fd = net::connect_tcp("127.0.0.1", port, dc::deadline_after(2000ms));
    const std::string garbage(40, 'Z');
    net::send_all(fd.get(), garbage.data(), garbage.size(), dc::deadline_after(2000ms));
    ::shutdown(fd.get(), SHUT_WR);
    // Waits for the server to close it: one refusal at a time.
    char buf[256];
    const auto deadline = dc::deadline_after(2000ms);
    for (;;) {
      ASSERT_TRUE(net::wait_ready(fd.get(), POLLIN, deadline)) << "connection " << i << " was not closed";
      const ssize_t n = ::recv(fd.get(), buf, sizeof(buf), 0);
      if (n == 0 || (n < 0 && errno == ECONNRESET)) break;
    }
  }
  EXPECT_TRUE(eventually([&] { return server->rejected_connections() == kConnections; }));
  const Ms took = since(start);
  // A rank on another host connects at once; one on the flooding host within one spacing.
  auto t0 = dc::Clock::now();
  EXPECT_EQ(handshake_from("127.0.0.2", port, secret, 2000ms), Verdict::accepted);
  EXPECT_LT(since(t0), 500ms);
  t0 = dc::Clock::now();
  auto good = dc::connect_tcp_store("127.0.0.1", port, secret, 3000ms);
  good->set("k", "v");
  EXPECT_LT(since(t0), 1500ms);
  server.reset();
  const auto lines = log.lines_containing(where);
  size_t bytes = 0;
  for (const auto& l : lines) bytes += l.size();
  std::cout << "[ figures  ] " << kConnections << " bad connections in " << took.count() << " ms: " << lines.size()
            << " log lines (" << bytes << " bytes)\n";
  for (const auto& l : lines) std::cout << "[ log line ] " << l << "\n";
  EXPECT_GE(lines.size(), 1u);
  EXPECT_LE(lines.size(), 4u);
  EXPECT_LE(bytes, 1600u);
}

}  // namespace
