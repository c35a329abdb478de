// TcpStore: the rendezvous store served over TCP (server thread + client), wire format in store_wire.h.
//
// Server: one thread polls the listening socket, an eventfd (to stop it) and every client
// socket (non-blocking). A connection goes through three phases:
//   wait   accepted, not greeted yet: only while its host is throttled after failed
//          authentications (store_guard.h); any data or EOF now is refused.
//   auth   the server sent the greeting with a fresh challenge; it reads exactly the 32-byte
//          HMAC answer, within kAuthTimeout. A wrong answer gets the refusal byte and is
//          closed; anything else (early data, EOF, timeout) is closed. Both count as rejected
//          and as failures of the peer's host.
//   ready  frames are decoded strictly, one request at a time per connection. A get or wait
//          whose keys are missing parks the connection on a waiter (its deadline is the
//          client's timeout); later requests from it stay buffered until the waiter resolves.
// Malformed, oversized or truncated frames close that connection only (rejected). Memory per
// connection is bounded: one frame (<= kMaxFrameBytes) plus kBacklogBytes while it is busy.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>

#include "../tcp/net.h"
#include "auth.h"
#include "dtrain/comm/store.h"
#include "dtrain/core/log.h"
#include "store_guard.h"
#include "store_wire.h"

namespace dtrain::comm {

namespace {

namespace wire = net::store_wire;
using wire::Op;

constexpr Duration kAuthTimeout{5000};
constexpr size_t kMaxUnauthenticated = 256;
constexpr size_t kReadChunk = 64u << 10;
constexpr size_t kBacklogBytes = 64u << 10;
constexpr uint64_t kMaxWaitMs = 7ull * 24 * 3600 * 1000;
constexpr Duration kAcceptPause{100};
// Non-blocking requests (set, add, ...) fail when no reply arrives within max(timeout, this).
constexpr Duration kMinIoTimeout{1000};

std::string join_keys(const std::vector<std::string>& keys) {
  std::vector<std::string> shown;
  shown.reserve(keys.size());
  for (const auto& k : keys) shown.push_back(net::printable(k));
  return fmt::format("{}", fmt::join(shown, ", "));
}

std::optional<int64_t> parse_int64(const std::string& text) {
  int64_t v = 0;
  const char* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, v);
  if (ec != std::errc() || ptr != end || text.empty()) return std::nullopt;
  return v;
}

struct Waiter {
  Op op;
  std::vector<std::string> keys;
  Deadline deadline;
};

// Why a connection is refused: a failed authentication (charged to its host: it could be a
// guess), no room for another handshake (the server's load, not the host's doing: a large job
// starting), or an authenticated client's malformed request.
enum class Refusal { failed_auth, no_room, bad_request };

struct Conn {
  net::Fd fd;
  std::string peer;
  std::string host;  // store_guard::peer_host: what failures are charged to
  bool greeted = false;
  bool authenticated = false;
  auth::Challenge challenge{};
  Deadline auth_deadline{};
  std::string in;
  std::string out;
  size_t out_pos = 0;
  bool eof = false;
  bool close_after_flush = false;
  bool closed = false;
  std::optional<Waiter> waiter;
  size_t pending_out() const { return out.size() - out_pos; }
};

}  // namespace

struct TcpStoreServer::Impl {
  std::string secret;
  std::string where;  // "127.0.0.1:port" for logs
  net::Fd listener;
  uint16_t port = 0;
  net::WakeEvent wake;
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> rejected{0};

  // Touched only by the server thread.
  std::unordered_map<std::string, std::string> data;
  std::vector<std::unique_ptr<Conn>> conns;
  size_t unauthenticated = 0;                       // greeted or waiting for the greeting
  std::unordered_map<std::string, size_t> waiting;  // connections waiting for their greeting, by host
  store_guard::GreetingThrottle throttle;
  store_guard::RejectionLog rejections;
  bool dirty = false;  // a key changed since waiters were last checked
  Deadline accept_paused_until{};
  std::string read_buffer;

  std::thread thread;

  void run();
  void loop();
  void accept_all();
  void greet(Conn& c, Deadline now);
  void greet_waiting(Deadline now);
  void count_refusal(const std::string& peer, const std::string& host, const std::string& reason, Refusal why);
  size_t read_limit(const Conn& c) const;
  bool wants_read(const Conn& c) const {
    return !c.eof && !c.closed && !c.close_after_flush && c.in.size() < read_limit(c);
  }
  void on_readable(Conn& c, short revents);
  void flush(Conn& c);
  void progress(Conn& c);
  void execute(Conn& c, wire::Request& q);
  void send_reply(Conn& c, Op op, const wire::Reply& y);
  bool resolve_waiter(Conn& c, bool expired);
  std::vector<std::string> missing(const std::vector<std::string>& keys) const;
  void reject(Conn& c, const std::string& reason);
  void close(Conn& c);
};

TcpStoreServer::TcpStoreServer(const std::string& bind_address, uint16_t port, std::string secret)
    : impl_(std::make_unique<Impl>()) {
  DT_CHECK(!secret.empty(), "comm", "TcpStoreServer: the job secret is empty (use make_secret())");
  check_secret(secret, "TcpStoreServer");
  impl_->secret = std::move(secret);
  const std::string host = bind_address.empty() ? "127.0.0.1" : bind_address;
  try {
    impl_->listener = net::listen_tcp(host, port, 1024);
    impl_->port = net::local_port(impl_->listener.get());
  } catch (const net::NetError& e) {
    throw CommError("store.serve", 0, {}, e.message(), __FILE__, __LINE__);
  }
  impl_->where = net::endpoint(host, impl_->port);
  impl_->rejections = store_guard::RejectionLog(impl_->where);
  impl_->read_buffer.resize(kReadChunk);
  impl_->thread = std::thread([impl = impl_.get()] { impl->run(); });
}

TcpStoreServer::~TcpStoreServer() {
  impl_->stop.store(true);
  impl_->wake.notify();
  impl_->thread.join();
}

uint16_t TcpStoreServer::port() const { return impl_->port; }
uint64_t TcpStoreServer::rejected_connections() const { return impl_->rejected.load(); }

void TcpStoreServer::Impl::run() {
  try {
    loop();
  } catch (const std::exception& e) {
    DT_LOG_ERROR("[comm] store {}: server stopped: {}", where, e.what());
  }
  rejections.flush(Clock::now(), /*force=*/true);
  // Close every socket: clients see EOF (or a refused connect) instead of waiting for their timeout.
  conns.clear();
  listener.reset();
}

void TcpStoreServer::Impl::loop() {
  std::vector<pollfd> fds;
  while (!stop.load()) {
    const Deadline now = Clock::now();
    const bool accepting = now >= accept_paused_until;
    Deadline next = accepting ? Deadline::max() : accept_paused_until;
    fds.clear();
    fds.push_back({wake.fd(), POLLIN, 0});
    fds.push_back({accepting ? listener.get() : -1, POLLIN, 0});
    for (const auto& c : conns) {
      short events = 0;
      if (wants_read(*c)) events |= POLLIN;
      if (c->pending_out() > 0) events |= POLLOUT;
      fds.push_back({c->fd.get(), events, 0});
      if (!c->greeted) next = std::min(next, throttle.next_greeting(c->host, now));
      if (c->greeted && !c->authenticated) next = std::min(next, c->auth_deadline);
      if (c->waiter) next = std::min(next, c->waiter->deadline);
    }
    next = std::min(next, rejections.next_flush());
    int timeout_ms = -1;
    if (next != Deadline::max()) {
      const auto left = std::chrono::ceil<std::chrono::milliseconds>(next - now).count();
      timeout_ms = static_cast<int>(std::clamp<int64_t>(left, 0, 60'000));
    }
    if (::poll(fds.data(), fds.size(), timeout_ms) < 0) {
      if (errno == EINTR) continue;
      throw net::NetError(net::NetError::Kind::system, "poll", errno, fmt::format("poll: {}", std::strerror(errno)),
                          __FILE__, __LINE__);
    }
    if (fds[0].revents != 0) wake.drain();
    if (stop.load()) break;

    const size_t polled = conns.size();  // accept_all() appends after these
    for (size_t i = 0; i < polled; ++i) {
      Conn& c = *conns[i];
      const short revents = fds[i + 2].revents;
      if ((revents & (POLLIN | POLLHUP | POLLERR)) != 0) on_readable(c, revents);
      if (!c.closed && (revents & POLLOUT) != 0) flush(c);
    }
    if ((fds[1].revents & POLLIN) != 0) accept_all();

    // Greet the connections whose turn came, expire deadlines, then run buffered requests and
    // wake satisfied waiters until nothing changes (a set wakes waiters whose replies unblock
    // more buffered requests).
    const Deadline after = Clock::now();
    greet_waiting(after);
    for (const auto& c : conns) {
      if (c->closed) continue;
      if (c->greeted && !c->authenticated && after >= c->auth_deadline) {
        reject(*c, "authentication timed out");
      } else if (c->waiter && after >= c->waiter->deadline) {
        resolve_waiter(*c, /*expired=*/true);
      }
    }
    dirty = true;
    while (dirty) {
      dirty = false;
      for (const auto& c : conns) {
        if (c->closed) continue;
        if (c->waiter) resolve_waiter(*c, /*expired=*/false);
        progress(*c);
      }
    }
    std::erase_if(conns, [](const std::unique_ptr<Conn>& c) { return c->closed; });
    rejections.flush(Clock::now());
  }
}

void TcpStoreServer::Impl::accept_all() {
  for (;;) {
    const int fd = ::accept4(listener.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED || errno == EPROTO) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return;
      // EMFILE, ENFILE, ENOBUFS, ...: the listener stays readable, so pause it rather than spin.
      DT_LOG_WARN("[comm] store {}: accept: {}; pausing accepts for {} ms", where, std::strerror(errno),
                  kAcceptPause.count());
      accept_paused_until = Clock::now() + kAcceptPause;
      return;
    }
    net::Fd sock(fd);
    std::string host = store_guard::peer_host(fd);
    if (unauthenticated >= kMaxUnauthenticated) {
      count_refusal(net::peer_name(fd), host,
                    fmt::format("{} connections are already authenticating", kMaxUnauthenticated), Refusal::no_room);
      continue;
    }
    if (auto it = waiting.find(host); it != waiting.end() && it->second >= store_guard::kMaxWaitingPerHost) {
      count_refusal(net::peer_name(fd), host,
                    fmt::format("{} connections of {} already wait for their greeting (throttled after failed "
                                "authentications)",
                                it->second, host),
                    Refusal::no_room);
      continue;
    }
    auto c = std::make_unique<Conn>();
    c->peer = net::peer_name(fd);
    c->host = std::move(host);
    c->fd = std::move(sock);
    try {
      net::set_nodelay(c->fd.get());
    } catch (const net::NetError&) {
      continue;  // the peer already vanished
    }
    ++unauthenticated;
    const Deadline now = Clock::now();
    if (throttle.may_greet(c->host, now)) {
      greet(*c, now);
    } else {
      ++waiting[c->host];
    }
    conns.push_back(std::move(c));
  }
}

void TcpStoreServer::Impl::greet(Conn& c, Deadline now) {
  c.greeted = true;
  c.challenge = auth::make_challenge();
  c.auth_deadline = now + kAuthTimeout;
  c.out.append(wire::kGreetingMagic, sizeof(wire::kGreetingMagic));
  net::put_u8(c.out, wire::kVersion);
  c.out.append(reinterpret_cast<const char*>(c.challenge.data()), c.challenge.size());
  flush(c);
}

// In arrival order: at most one connection per throttled host each spacing.
void TcpStoreServer::Impl::greet_waiting(Deadline now) {
  if (waiting.empty()) return;
  for (const auto& c : conns) {
    if (c->closed || c->greeted || !throttle.may_greet(c->host, now)) continue;
    auto it = waiting.find(c->host);
    if (--it->second == 0) waiting.erase(it);
    greet(*c, now);
  }
}

// A refused connection: counted, charged to its host when it failed authentication, logged
// in bounded form.
void TcpStoreServer::Impl::count_refusal(const std::string& peer, const std::string& host, const std::string& reason,
                                         Refusal why) {
  rejected.fetch_add(1);
  const Deadline now = Clock::now();
  if (why == Refusal::failed_auth) throttle.failed(host, now);
  rejections.note(peer, host, reason, why != Refusal::bad_request,
                  throttle.spacing(host, now) > Duration::zero() ? host : "", now);
}

size_t TcpStoreServer::Impl::read_limit(const Conn& c) const {
  if (!c.greeted) return 1;  // any byte before the greeting is a protocol error
  // One byte past the answer reveals data sent before the verdict.
  if (!c.authenticated) return auth::kMacBytes + 1;
  if (c.waiter || c.pending_out() > 0) return kBacklogBytes;
  size_t need = kBacklogBytes;
  if (c.in.size() >= 4) {
    const uint32_t len = net::load_u32(reinterpret_cast<const uint8_t*>(c.in.data()));
    if (len <= kMaxFrameBytes) need = std::max(need, 4 + static_cast<size_t>(len));
  }
  return need;
}

void TcpStoreServer::Impl::on_readable(Conn& c, short revents) {
  if (!wants_read(c)) {
    // Not reading this connection now, so POLLHUP/POLLERR means it is gone.
    if ((revents & (POLLHUP | POLLERR)) != 0) {
      if (c.authenticated) {
        close(c);
      } else {
        reject(c, "connection lost during authentication");
      }
    }
    return;
  }
  while (wants_read(c)) {
    const size_t want = std::min(kReadChunk, read_limit(c) - c.in.size());
    const ssize_t n = ::recv(c.fd.get(), read_buffer.data(), want, 0);
    if (n > 0) {
      c.in.append(read_buffer.data(), static_cast<size_t>(n));
      continue;
    }
    if (n == 0) {
      c.eof = true;
      return;
    }
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return;
    if (c.authenticated && c.in.empty()) {
      close(c);  // a client that went away between requests
    } else {
      reject(c, fmt::format("recv: {}", std::strerror(errno)));
    }
    return;
  }
}

void TcpStoreServer::Impl::flush(Conn& c) {
  while (c.pending_out() > 0) {
    const ssize_t n = ::send(c.fd.get(), c.out.data() + c.out_pos, c.pending_out(), MSG_NOSIGNAL);
    if (n > 0) {
      c.out_pos += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    close(c);  // EPIPE, ECONNRESET: the client is gone
    return;
  }
  c.out.clear();
  c.out_pos = 0;
  if (c.close_after_flush) close(c);
}

void TcpStoreServer::Impl::progress(Conn& c) {
  if (c.closed) return;
  if (c.close_after_flush) {
    flush(c);
    return;
  }
  if (!c.greeted) {
    if (!c.in.empty()) {
      reject(c, "data sent before the greeting");
    } else if (c.eof) {
      reject(c, "connection closed before the greeting");
    }
    return;
  }
  if (!c.authenticated) {
    if (c.in.size() > auth::kMacBytes) {
      reject(c, "data sent before authentication completed");
      return;
    }
    if (c.in.size() == auth::kMacBytes) {
      if (!auth::verify_answer(secret, wire::kAuthContext, c.challenge, reinterpret_cast<const uint8_t*>(c.in.data()),
                               c.in.size())) {
        count_refusal(c.peer, c.host, "wrong authentication answer (different job secret?)", Refusal::failed_auth);
        net::put_u8(c.out, wire::kAuthRefused);
        c.close_after_flush = true;
        flush(c);
        return;
      }
      c.authenticated = true;
      --unauthenticated;
      c.in.clear();
      net::put_u8(c.out, wire::kAuthAccepted);
    } else if (c.eof) {
      reject(c, "connection closed during authentication");
      return;
    }
    flush(c);
    return;
  }

  size_t pos = 0;
  while (!c.closed && !c.waiter && c.pending_out() < kBacklogBytes) {
    auto d = wire::decode_request_frame(reinterpret_cast<const uint8_t*>(c.in.data()) + pos, c.in.size() - pos);
    if (d.status == wire::Decode::incomplete) break;
    if (d.status == wire::Decode::error) {
      reject(c, d.error);
      return;
    }
    pos += d.consumed;
    try {
      execute(c, d.request);
    } catch (const CommError& e) {  // a reply over kMaxFrameBytes; replies are smaller than requests
      reject(c, e.what());
      return;
    }
  }
  if (c.closed) return;
  c.in.erase(0, pos);
  if (c.eof && !c.waiter && c.pending_out() == 0) {
    if (!c.in.empty()) {
      reject(c, fmt::format("connection closed in the middle of a frame ({} bytes pending)", c.in.size()));
    } else {
      close(c);
    }
    return;
  }
  if (c.eof && c.waiter) {
    close(c);  // nobody left to answer
    return;
  }
  flush(c);
}

void TcpStoreServer::Impl::send_reply(Conn& c, Op op, const wire::Reply& y) {
  c.out += wire::encode_reply_frame(op, y);
}

std::vector<std::string> TcpStoreServer::Impl::missing(const std::vector<std::string>& keys) const {
  std::vector<std::string> out;
  for (const auto& k : keys) {
    if (data.count(k) == 0) out.push_back(k);
  }
  return out;
}

void TcpStoreServer::Impl::execute(Conn& c, wire::Request& q) {
  wire::Reply y;
  switch (q.op) {
    case Op::set:
      data[q.key] = std::move(q.value);
      dirty = true;
      break;
    case Op::get:
    case Op::wait: {
      if (q.op == Op::get) q.keys = {q.key};
      c.waiter = Waiter{q.op, std::move(q.keys), Clock::now() + Duration(std::min(q.timeout_ms, kMaxWaitMs))};
      // Answered now when satisfied or when the timeout is zero; parked otherwise.
      resolve_waiter(c, /*expired=*/q.timeout_ms == 0);
      return;
    }
    case Op::try_get: {
      auto it = data.find(q.key);
      y.present = it != data.end();
      if (y.present) y.value = it->second;
      break;
    }
    case Op::add: {
      int64_t current = 0;
      auto it = data.find(q.key);
      if (it != data.end()) {
        const auto parsed = parse_int64(it->second);
        if (!parsed) {
          y.status = wire::Status::error;
          y.message = fmt::format("add: the value of key '{}' is not an integer: '{}'", net::printable(q.key),
                                  net::printable(it->second));
          break;
        }
        current = *parsed;
      }
      if (__builtin_add_overflow(current, q.delta, &y.number)) {
        y.status = wire::Status::error;
        y.message = fmt::format("add: {} + {} overflows int64 (key '{}')", current, q.delta, net::printable(q.key));
        break;
      }
      data[q.key] = std::to_string(y.number);
      dirty = true;
      break;
    }
    case Op::compare_set: {
      auto it = data.find(q.key);
      const bool matches = it == data.end() ? q.value.empty() : it->second == q.value;
      if (matches) {
        data[q.key] = q.desired;
        y.value = std::move(q.desired);
        dirty = true;
      } else {
        y.value = it == data.end() ? std::string() : it->second;
      }
      break;
    }
  }
  send_reply(c, q.op, y);
}

bool TcpStoreServer::Impl::resolve_waiter(Conn& c, bool expired) {
  Waiter& w = *c.waiter;
  std::vector<std::string> absent = missing(w.keys);
  wire::Reply y;
  if (absent.empty()) {
    if (w.op == Op::get) y.value = data.at(w.keys.front());
  } else if (expired) {
    y.status = wire::Status::timeout;
    y.keys = std::move(absent);
  } else {
    return false;
  }
  const Op op = w.op;
  c.waiter.reset();
  send_reply(c, op, y);
  return true;
}

void TcpStoreServer::Impl::reject(Conn& c, const std::string& reason) {
  if (c.closed) return;
  if (!c.close_after_flush) {  // a refused answer was counted already
    count_refusal(c.peer, c.host, reason, c.authenticated ? Refusal::bad_request : Refusal::failed_auth);
  }
  close(c);
}

void TcpStoreServer::Impl::close(Conn& c) {
  if (c.closed) return;
  if (!c.authenticated) --unauthenticated;
  if (!c.greeted) {
    auto it = waiting.find(c.host);
    if (--it->second == 0) waiting.erase(it);
  }
  c.closed = true;
  c.waiter.reset();
  c.fd.reset();
  c.in.clear();
  c.in.shrink_to_fit();
  c.out.clear();
  c.out.shrink_to_fit();
}

// ---- client ----

namespace {

class TcpStoreClient final : public Store {
 public:
  TcpStoreClient(net::Fd fd, std::string endpoint, Duration io_timeout)
      : fd_(std::move(fd)), endpoint_(std::move(endpoint)), io_timeout_(io_timeout) {}

  void set(const std::string& key, const std::string& value) override {
    wire::Request q;
    q.op = Op::set;
    q.key = key;
    q.value = value;
    call(q, Duration::zero());
  }

  std::string get(const std::string& key, Duration timeout) override {
    wire::Request q;
    q.op = Op::get;
    q.key = key;
    q.timeout_ms = to_ms(timeout);
    wire::Reply y = call(q, timeout);
    if (y.status == wire::Status::timeout) throw_timeout("store.get", timeout, y.keys);
    return std::move(y.value);
  }

  std::optional<std::string> try_get(const std::string& key) override {
    wire::Request q;
    q.op = Op::try_get;
    q.key = key;
    wire::Reply y = call(q, Duration::zero());
    if (!y.present) return std::nullopt;
    return std::move(y.value);
  }

  int64_t add(const std::string& key, int64_t delta) override {
    wire::Request q;
    q.op = Op::add;
    q.key = key;
    q.delta = delta;
    return call(q, Duration::zero()).number;
  }

  std::string compare_set(const std::string& key, const std::string& expected, const std::string& desired) override {
    wire::Request q;
    q.op = Op::compare_set;
    q.key = key;
    q.value = expected;
    q.desired = desired;
    return std::move(call(q, Duration::zero()).value);
  }

  void wait(const std::vector<std::string>& keys, Duration timeout) override {
    wire::Request q;
    q.op = Op::wait;
    q.keys = keys;
    q.timeout_ms = to_ms(timeout);
    const wire::Reply y = call(q, timeout);
    if (y.status == wire::Status::timeout) throw_timeout("store.wait", timeout, y.keys);
  }

 private:
  static uint64_t to_ms(Duration d) { return static_cast<uint64_t>(clamp_wait(d).count()); }
  static Duration clamp_wait(Duration d) { return std::clamp(d, Duration::zero(), Duration(kMaxWaitMs)); }

  [[noreturn]] void throw_timeout(const char* op, Duration timeout, const std::vector<std::string>& keys) const {
    throw CommError(
        op, 0, {},
        fmt::format("{}: timed out after {} ms waiting for keys: {}", endpoint_, timeout.count(), join_keys(keys)),
        __FILE__, __LINE__);
  }

  // Sends one request and reads its reply. `server_wait` is how long the server may hold
  // the reply back (get, wait); the read deadline adds the I/O timeout to it.
  wire::Reply call(const wire::Request& q, Duration server_wait) {
    const std::string op = fmt::format("store.{}", wire::op_name(q.op));
    const std::string frame = wire::encode_request_frame(q);
    std::lock_guard<std::mutex> lock(mu_);
    if (!fd_) {
      throw CommError(op, 0, {}, fmt::format("{}: connection unusable after an earlier error ({})", endpoint_, broken_),
                      __FILE__, __LINE__);
    }
    const Duration reply_budget = clamp_wait(server_wait) + io_timeout_;
    std::string body;
    try {
      net::send_all(fd_.get(), frame.data(), frame.size(), Clock::now() + io_timeout_);
      const Deadline reply_deadline = Clock::now() + reply_budget;
      uint8_t header[4];
      net::recv_all(fd_.get(), header, sizeof(header), reply_deadline);
      const uint32_t len = net::load_u32(header);
      if (len == 0 || len > kMaxFrameBytes) fail(op, fmt::format("malformed reply: frame length {}", len));
      body.resize(len);
      net::recv_all(fd_.get(), body.data(), body.size(), reply_deadline);
    } catch (const net::NetError& e) {
      switch (e.kind()) {
        case net::NetError::Kind::closed:
          fail(op, "server closed the connection");
        case net::NetError::Kind::timeout:
          fail(op, fmt::format("no reply from the server within {} ms", reply_budget.count()));
        case net::NetError::Kind::system:
          fail(op, e.message());
      }
      fail(op, e.message());
    }
    auto d = wire::decode_reply_body(q.op, reinterpret_cast<const uint8_t*>(body.data()), body.size());
    if (!d.ok) fail(op, "malformed reply: " + d.error);
    if (d.reply.status == wire::Status::error) {
      throw CommError(op, 0, {}, fmt::format("{}: {}", endpoint_, d.reply.message), __FILE__, __LINE__);
    }
    return std::move(d.reply);
  }

  // The stream is out of step after any I/O or protocol error: close it for good.
  [[noreturn]] void fail(const std::string& op, const std::string& what) {
    broken_ = what;
    fd_.reset();
    throw CommError(op, 0, {}, fmt::format("{}: {}", endpoint_, what), __FILE__, __LINE__);
  }

  std::mutex mu_;
  net::Fd fd_;
  std::string endpoint_;
  Duration io_timeout_;
  std::string broken_;
};

// Reads the greeting, answers the challenge and reads the verdict. NetError (the server is
// not up yet or dropped us before the greeting) lets the caller retry; a wrong greeting or a
// refusal throws CommError at once.
void handshake(int fd, const std::string& ep, const std::string& secret, Deadline deadline) {
  uint8_t greeting[wire::kGreetingBytes];
  net::recv_all(fd, greeting, sizeof(greeting), deadline);
  if (std::memcmp(greeting, wire::kGreetingMagic, sizeof(wire::kGreetingMagic)) != 0) {
    throw CommError("store.connect", 0, {}, fmt::format("{}: not a dtrain store (unexpected greeting)", ep), __FILE__,
                    __LINE__);
  }
  if (greeting[4] != wire::kVersion) {
    throw CommError("store.connect", 0, {},
                    fmt::format("{}: store protocol version {}, this build speaks {}", ep, greeting[4], wire::kVersion),
                    __FILE__, __LINE__);
  }
  auth::Challenge challenge;
  std::memcpy(challenge.data(), greeting + 5, challenge.size());
  const auth::Mac mac = auth::answer_challenge(secret, wire::kAuthContext, challenge);
  net::send_all(fd, mac.data(), mac.size(), deadline);
  uint8_t verdict = wire::kAuthRefused;
  try {
    net::recv_all(fd, &verdict, 1, deadline);
  } catch (const net::NetError& e) {
    if (e.kind() != net::NetError::Kind::closed) throw;
  }
  if (verdict != wire::kAuthAccepted) {
    throw CommError("store.connect", 0, {}, fmt::format("{}: authentication refused: wrong job secret?", ep), __FILE__,
                    __LINE__);
  }
}

}  // namespace

std::shared_ptr<Store> connect_tcp_store(const std::string& host, uint16_t port, const std::string& secret,
                                         Duration timeout) {
  DT_CHECK(!secret.empty(), "comm", "connect_tcp_store: the job secret is empty");
  check_secret(secret, "connect_tcp_store");
  const std::string ep = net::endpoint(host, port);
  const Deadline deadline = deadline_after(timeout);
  Duration backoff{5};
  std::string last_error = "no attempt made";
  for (;;) {
    try {
      net::Fd fd = net::connect_tcp(host, port, deadline);
      handshake(fd.get(), ep, secret, deadline);
      const Duration io_timeout = std::clamp(timeout, kMinIoTimeout, Duration(kMaxWaitMs));
      return std::make_shared<TcpStoreClient>(std::move(fd), ep, io_timeout);
    } catch (const net::NetError& e) {
      last_error = e.message();
    }
    const Deadline now = Clock::now();
    if (now >= deadline) {
      throw CommError("store.connect", 0, {},
                      fmt::format("{}: could not connect within {} ms ({})", ep, timeout.count(), last_error), __FILE__,
                      __LINE__);
    }
    std::this_thread::sleep_for(std::min<Clock::duration>(backoff, deadline - now));
    backoff = std::min(backoff * 2, Duration(200));
  }
}

}  // namespace dtrain::comm
