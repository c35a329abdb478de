// TCP transport between the ranks of a group: processes on one host or on several.
//
// Vocabulary. Every pair of ranks shares one *connection* (the lower rank dialled the higher;
// the rendezvous at the end of this file). Each direction of it carries *frames* (tcp_wire.h):
// a 17-byte *header* {kind, tag, bytes} and a payload. A *data frame* is one message; the
// *control frames* are abort (which rank aborted first, and why) and goodbye (the sender
// closed its transport). Seen from a rank, each peer has a *send queue* and a *receive queue*
// of requests, FIFO like the stream they map onto.
//
// Progress happens only inside post_send (an eager write), wait() and test(). Both pump EVERY
// peer with queued work, not just the listed requests, so two ranks streaming large messages
// at each other always drain each other; test() runs one round without sleeping, wait() runs
// rounds and between them sleeps in poll() until a socket is ready, abort() wakes it, or the
// deadline passes. Pumping a send queue gathers the headers
// and payloads of the queued requests into one sendmsg(); pumping a receive queue reads the
// next header, checks it against the front receive, then reads the payload straight into the
// caller's buffer. No message is ever copied whole.
//
// Memory is bounded: nothing is read from a peer unless a receive from it is posted (or it
// hung up, below), so a message that arrives early waits in the kernel's socket buffer and TCP
// flow control holds its sender back. The price: a send larger than the socket buffers
// completes only once the peer posted the matching receive.
//
// Failures. A peer *hung up* when poll() reports RDHUP/HUP/ERR: it closed its transport,
// aborted or died, and will send nothing after what is already in our socket buffer. Its next
// header is then read even without a posted receive, so an abort frame is seen at once (a data
// header is kept for the receive that will match it). Then a listed send to it fails
// (peer_dead: nobody reads it any more), a listed receive from it fails once its stream ended
// (messages it sent before leaving are still delivered), and an abort frame aborts this
// transport too, which forwards the abort to our other peers. abort() writes the abort frame
// on every connection that is between two frames, then shuts the sending half down, so every
// peer sees the reason; a connection in the middle of a frame (or too full for the abort
// frame) is reset instead, since a FIN queued behind unread payload could go unnoticed.
//
// Threads: post_send/post_recv/wait must not run concurrently on one transport (a concurrent
// call throws); abort() may be called from any thread. io_mu_ serialises the socket I/O of
// those calls with abort(); wait() releases it while it sleeps in poll().
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "../store/auth.h"
#include "../transport_requests.h"
#include "dtrain/comm/store.h"
#include "dtrain/comm/transport.h"
#include "net.h"
#include "tcp_wire.h"

namespace dtrain::comm {

namespace {

using FrameKind = tcp_wire::FrameKind;
using transport_requests::all_complete;
using transport_requests::deliver_to_self;
using transport_requests::describe;
using transport_requests::pending_of;
using transport_requests::throw_timeout;
using transport_requests::UseGuard;
constexpr size_t kHeaderBytes = tcp_wire::kHeaderBytes;
constexpr int kMaxIov = 64;  // iovecs per sendmsg: up to 32 queued messages in one system call
constexpr int kMaxPollMs = 60'000;

struct Request : transport_requests::RequestBase {
  size_t header_done = 0;             // send: header bytes written; recv: kHeaderBytes once matched
  uint8_t header[kHeaderBytes] = {};  // send: the encoded header
};
// One connection, seen from this rank.
struct Peer {
  int rank = -1;
  net::Fd fd;
  std::string endpoint;  // the peer's address, for messages
  std::deque<Request*> sends;
  std::deque<Request*> recvs;
  // Reading: the next frame's header, then (abort frames) the reason.
  uint8_t in_header[kHeaderBytes] = {};
  size_t in_header_got = 0;
  bool header_kept = false;  // a data header read and not yet matched by a receive
  tcp_wire::FrameHeader next;
  bool reading_reason = false;
  std::string reason;
  // What we know of the connection.
  bool hung_up = false;      // it sends nothing after what is buffered, nor reads what we send
  bool ended = false;        // its stream ended (EOF, reset, goodbye): nothing left to read
  bool send_failed = false;  // a send on this socket failed (EPIPE, reset)
  std::string why;           // how it ended, for messages

  bool between_frames() const { return sends.empty() || (sends.front()->header_done == 0 && sends.front()->done == 0); }
};

int poll_timeout_ms(Deadline deadline) {
  const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return static_cast<int>(std::clamp<int64_t>(left, 0, kMaxPollMs));
}

class TcpTransport final : public Transport {
 public:
  TcpTransport(int rank, int size, std::vector<net::Fd> fds, std::vector<std::string> endpoints)
      : rank_(rank), size_(size), peers_(static_cast<size_t>(size)), requests_("tcp", rank, size) {
    for (int p = 0; p < size_; ++p) {
      Peer& peer = peers_[static_cast<size_t>(p)];
      peer.rank = p;
      peer.fd = std::move(fds[static_cast<size_t>(p)]);
      peer.endpoint = std::move(endpoints[static_cast<size_t>(p)]);
    }
  }

  ~TcpTransport() override {
    // Tell the peers this is a goodbye, not a crash; the sockets close with the peers_ vector.
    std::lock_guard<std::mutex> lock(io_mu_);
    if (aborted_.load(std::memory_order_acquire)) return;
    uint8_t frame[kHeaderBytes];
    tcp_wire::encode_header(frame, FrameKind::goodbye, 0, 0);
    for (Peer& p : peers_) {
      if (p.fd && !p.send_failed && !p.hung_up && p.between_frames()) {
        [[maybe_unused]] const ssize_t n = ::send(p.fd.get(), frame, sizeof(frame), MSG_NOSIGNAL | MSG_DONTWAIT);
      }
    }
  }

  TcpTransport(const TcpTransport&) = delete;
  TcpTransport& operator=(const TcpTransport&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  TransportKind kind() const override { return TransportKind::tcp; }

  RequestId post_send(int peer, uint64_t tag, const void* data, size_t bytes) override {
    UseGuard guard(in_use_, "tcp");
    std::lock_guard<std::mutex> lock(io_mu_);
    Request& r = requests_.add("post_send", true, peer, tag, const_cast<void*>(data), bytes);
    tcp_wire::encode_header(r.header, FrameKind::data, tag, bytes);
    if (peer == rank_) {
      self_sends_.push_back(&r);
      return r.id;
    }
    Peer& p = peers_[static_cast<size_t>(peer)];
    p.sends.push_back(&r);
    // Eagerly start the send: a small message leaves before the caller even waits.
    if (p.sends.size() == 1 && !aborted_.load(std::memory_order_relaxed) && !p.hung_up) pump_send(p);
    return r.id;
  }

  RequestId post_recv(int peer, uint64_t tag, void* data, size_t bytes) override {
    UseGuard guard(in_use_, "tcp");
    std::lock_guard<std::mutex> lock(io_mu_);
    Request& r = requests_.add("post_recv", false, peer, tag, data, bytes);
    (peer == rank_ ? self_recvs_ : peers_[static_cast<size_t>(peer)].recvs).push_back(&r);
    return r.id;
  }

  void wait(const std::vector<RequestId>& ids, Deadline deadline) override {
    UseGuard guard(in_use_, "tcp");
    std::unique_lock<std::mutex> lock(io_mu_);
    if (broken_) std::rethrow_exception(broken_);
    const std::vector<Request*> listed = requests_.find(ids);
    try {
      drive(listed, deadline, lock);
    } catch (const TransportError& e) {
      // A timeout leaves the requests queued; anything else means the streams are unusable.
      if (e.kind() != TransportError::Kind::timeout) broken_ = std::current_exception();
      throw;
    }
    requests_.reap(listed);
  }

  bool test(const std::vector<RequestId>& ids) override {
    UseGuard guard(in_use_, "tcp");
    std::unique_lock<std::mutex> lock(io_mu_);
    if (broken_) std::rethrow_exception(broken_);
    const std::vector<Request*> listed = requests_.find(ids);
    size_t cursor = 0;
    try {
      if (!progress(listed, cursor, 0, true, lock)) return false;
    } catch (const TransportError&) {
      broken_ = std::current_exception();
      throw;
    }
    requests_.reap(listed);
    return true;
  }

  void abort(const std::string& reason) override {
    std::lock_guard<std::mutex> lock(io_mu_);
    abort_locked(rank_, reason, -1);
  }

 private:
  // The progress loop of wait(). The first round does not sleep, so an abort or hang-up that
  // already arrived fails this wait too.
  void drive(const std::vector<Request*>& listed, Deadline deadline, std::unique_lock<std::mutex>& lock) {
    const auto start = Clock::now();
    size_t cursor = 0;
    for (bool first = true;; first = false) {
      if (progress(listed, cursor, first ? 0 : poll_timeout_ms(deadline), first, lock)) return;
      const auto now = Clock::now();
      if (now >= deadline) throw_timeout("tcp", rank_, listed, now - start);
    }
  }

  // One round: poll (sleeping at most timeout_ms, without io_mu_), pump the peers that are
  // ready (every peer with work when `all`), deliver messages to self, then throw for an abort
  // or for a peer that can no longer complete a listed request. True when all listed completed.
  bool progress(const std::vector<Request*>& listed, size_t& cursor, int timeout_ms, bool all,
                std::unique_lock<std::mutex>& lock) {
    fds_.clear();
    polled_.clear();
    fds_.push_back({wake_.fd(), POLLIN, 0});
    for (Peer& p : peers_) {
      const short events = poll_events(p);
      if (events == 0) continue;
      fds_.push_back({p.fd.get(), events, 0});
      polled_.push_back(p.rank);
    }
    lock.unlock();
    const int rc = ::poll(fds_.data(), fds_.size(), timeout_ms);
    const int poll_errno = errno;
    lock.lock();
    if (rc < 0 && poll_errno != EINTR) {
      throw net::NetError(net::NetError::Kind::system, "poll", poll_errno,
                          fmt::format("tcp: rank {}: poll: {}", rank_, std::strerror(poll_errno)), __FILE__, __LINE__);
    }
    if (fds_[0].revents != 0) wake_.drain();
    for (size_t i = 1; i < fds_.size(); ++i) {
      if ((fds_[i].revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0) {
        Peer& p = peers_[static_cast<size_t>(polled_[i - 1])];
        p.hung_up = true;
        int err = 0;
        socklen_t len = sizeof(err);
        if ((fds_[i].revents & POLLERR) != 0 && p.why.empty() &&
            ::getsockopt(p.fd.get(), SOL_SOCKET, SO_ERROR, &err, &len) == 0 && err != 0) {
          p.why = fmt::format("reset the connection ({})", std::strerror(err));
        }
      }
    }
    if (all) {
      pump_all();
    } else {
      for (size_t i = 1; i < fds_.size(); ++i) {
        if (fds_[i].revents != 0) pump(peers_[static_cast<size_t>(polled_[i - 1])]);
      }
    }
    if (!self_sends_.empty()) deliver_to_self("tcp", rank_, self_sends_, self_recvs_);
    if (aborted_.load(std::memory_order_acquire)) throw_aborted();
    if (all_complete(listed, cursor)) return true;
    check_peers(listed);
    return false;
  }

  static short poll_events(const Peer& p) {
    if (!p.fd) return 0;
    short events = 0;
    if (!p.ended) {
      if (!p.recvs.empty() || (p.hung_up && !p.header_kept)) events |= POLLIN;
      if (!p.hung_up) events |= POLLRDHUP;
    }
    if (!p.sends.empty() && !p.send_failed && !p.hung_up) events |= POLLOUT;
    return events;
  }

  void pump_all() {
    for (Peer& p : peers_) {
      if (p.fd) pump(p);
    }
  }

  void pump(Peer& p) {
    if (!p.sends.empty() && !p.send_failed && !p.hung_up) pump_send(p);
    if (!p.ended && (!p.recvs.empty() || (p.hung_up && !p.header_kept))) pump_recv(p);
  }

  // Writes as much of the send queue as the socket takes, headers and payloads gathered.
  void pump_send(Peer& p) {
    while (!p.sends.empty() && !p.send_failed) {
      iovec iov[kMaxIov];
      int count = 0;
      size_t offered = 0;
      for (Request* r : p.sends) {
        if (count + 2 > kMaxIov) break;
        if (r->header_done < kHeaderBytes) {
          iov[count++] = {r->header + r->header_done, kHeaderBytes - r->header_done};
          offered += kHeaderBytes - r->header_done;
        }
        if (r->done < r->bytes) {
          iov[count++] = {r->data + r->done, r->bytes - r->done};
          offered += r->bytes - r->done;
        }
      }
      msghdr msg{};
      msg.msg_iov = iov;
      msg.msg_iovlen = static_cast<size_t>(count);
      const ssize_t n = ::sendmsg(p.fd.get(), &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return;
        p.send_failed = true;
        p.hung_up = true;
        if (p.why.empty()) p.why = fmt::format("reset the connection (send: {})", std::strerror(errno));
        return;
      }
      advance_sends(p, static_cast<size_t>(n));
      if (static_cast<size_t>(n) < offered) return;  // the socket buffer is full
    }
  }

  static void advance_sends(Peer& p, size_t n) {
    while (!p.sends.empty()) {
      Request& r = *p.sends.front();
      const size_t h = std::min(n, kHeaderBytes - r.header_done);
      r.header_done += h;
      n -= h;
      const size_t d = std::min(n, r.bytes - r.done);
      r.done += d;
      n -= d;
      if (r.header_done < kHeaderBytes || r.done < r.bytes) return;
      r.complete = true;
      p.sends.pop_front();
    }
  }

  // Marks the end of `p`'s stream: nothing more will be read from it.
  static void end_stream(Peer& p, std::string why) {
    p.ended = true;
    p.hung_up = true;
    if (p.why.empty() || why.starts_with("closed its transport")) p.why = std::move(why);
  }

  // One recv() into `dst`; returns the byte count, or 0 when nothing can be read now. End of
  // stream and errors end the stream, described by `what` ("... in the middle of <what>").
  static size_t read_some(Peer& p, void* dst, size_t want, const char* what, bool mid_frame) {
    for (;;) {
      const ssize_t n = ::recv(p.fd.get(), dst, want, 0);
      if (n > 0) return static_cast<size_t>(n);
      if (n == 0) {
        end_stream(p, mid_frame ? fmt::format("closed the connection in the middle of {}", what)
                                : std::string("closed the connection without a goodbye (its process exited or died)"));
        return 0;
      }
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
      end_stream(p, fmt::format("reset the connection (recv: {})", std::strerror(errno)));
      return 0;
    }
  }

  // Reads frames for `p`'s posted receives, or (it hung up) up to its next data header.
  void pump_recv(Peer& p) {
    while (!p.ended) {
      if (p.reading_reason) {
        const size_t want = p.next.bytes - p.reason.size();
        char buf[tcp_wire::kMaxReasonBytes];
        const size_t n = read_some(p, buf, want, "an abort frame", true);
        if (n == 0) return;
        p.reason.append(buf, n);
        if (p.reason.size() < p.next.bytes) continue;
        p.reading_reason = false;
        on_abort_frame(p);
        return;
      }
      if (!p.header_kept) {
        if (p.recvs.empty() && !p.hung_up) return;  // never read ahead of the receives
        const size_t n = read_some(p, p.in_header + p.in_header_got, kHeaderBytes - p.in_header_got, "a frame header",
                                   p.in_header_got > 0);
        if (n == 0) return;
        p.in_header_got += n;
        if (p.in_header_got < kHeaderBytes) continue;
        p.in_header_got = 0;
        p.next = tcp_wire::decode_header(p.in_header);
        switch (static_cast<FrameKind>(p.next.kind)) {
          case FrameKind::data:
            p.header_kept = true;
            break;
          case FrameKind::abort:
            if (p.next.bytes > tcp_wire::kMaxReasonBytes || p.next.tag >= static_cast<uint64_t>(size_)) {
              throw_protocol(
                  p, fmt::format("an abort frame from rank {} with a {}-byte reason", p.next.tag, p.next.bytes));
            }
            p.reading_reason = true;
            p.reason.clear();
            if (p.next.bytes == 0) {
              p.reading_reason = false;
              on_abort_frame(p);
              return;
            }
            continue;
          case FrameKind::goodbye:
            end_stream(p, "closed its transport");
            return;
          default:
            throw_protocol(p, fmt::format("a frame of unknown kind 0x{:02x}", p.next.kind));
        }
      }
      if (p.recvs.empty()) return;  // the header waits for the receive that will match it
      Request& r = *p.recvs.front();
      if (r.header_done == 0) {
        if (p.next.tag != r.tag || p.next.bytes != r.bytes) {
          throw TransportError(TransportError::Kind::protocol, {p.rank},
                               fmt::format("tcp: rank {} sent tag {} ({} bytes) but rank {} expected tag {} ({} bytes)",
                                           p.rank, p.next.tag, p.next.bytes, rank_, r.tag, r.bytes),
                               __FILE__, __LINE__);
        }
        r.header_done = kHeaderBytes;
      }
      while (r.done < r.bytes) {
        const size_t n = read_some(p, r.data + r.done, r.bytes - r.done, "a message", true);
        if (n == 0) {
          if (p.ended && p.why.ends_with("a message"))
            p.why += fmt::format(" ({} of {} bytes received)", r.done, r.bytes);
          return;
        }
        r.done += n;
      }
      r.complete = true;
      p.recvs.pop_front();
      p.header_kept = false;
    }
  }

  [[noreturn]] void throw_protocol(const Peer& p, const std::string& what) {
    throw TransportError(TransportError::Kind::protocol, {p.rank},
                         fmt::format("tcp: rank {} ({}) sent {} to rank {}", p.rank, p.endpoint, what, rank_), __FILE__,
                         __LINE__);
  }

  void on_abort_frame(Peer& p) {
    end_stream(p, "aborted");  // an aborting rank writes nothing after its abort frame
    abort_locked(static_cast<int>(p.next.tag), p.reason, p.rank);
  }

  // Aborts this transport (first abort wins) and tells every peer but `origin` and `from`.
  void abort_locked(int origin, const std::string& reason, int from) {
    if (aborted_.load(std::memory_order_relaxed)) return;
    abort_origin_ = origin;
    abort_reason_ = reason.substr(0, tcp_wire::kMaxReasonBytes);
    aborted_.store(true, std::memory_order_release);
    std::string frame(kHeaderBytes, '\0');
    tcp_wire::encode_header(reinterpret_cast<uint8_t*>(frame.data()), FrameKind::abort, static_cast<uint64_t>(origin),
                            abort_reason_.size());
    frame += abort_reason_;
    for (Peer& p : peers_) {
      if (!p.fd || p.rank == origin || p.rank == from) continue;
      bool delivered = false;
      if (!p.send_failed && p.between_frames()) {
        const ssize_t n = ::send(p.fd.get(), frame.data(), frame.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
        delivered = n == static_cast<ssize_t>(frame.size());
      }
      if (delivered) {
        ::shutdown(p.fd.get(), SHUT_WR);  // the end of the stream follows the reason
      } else {
        // Mid-frame (or no room for the frame) a FIN would queue behind payload that the peer
        // may never read: reset instead, which it notices at once.
        reset_connection(p.fd.get());
        p.send_failed = true;
      }
    }
    wake_.notify();
  }

  // Dissolves the connection with a RST (connect to AF_UNSPEC); the descriptor stays ours.
  static void reset_connection(int fd) {
    sockaddr unspecified{};
    unspecified.sa_family = AF_UNSPEC;
    if (::connect(fd, &unspecified, sizeof(unspecified)) != 0) ::shutdown(fd, SHUT_RDWR);
  }

  [[noreturn]] void throw_aborted() {
    std::vector<int> peers;
    if (abort_origin_ != rank_) peers.push_back(abort_origin_);
    throw TransportError(TransportError::Kind::aborted, std::move(peers),
                         fmt::format("tcp: transport aborted by rank {}: {}", abort_origin_, abort_reason_), __FILE__,
                         __LINE__);
  }

  // Throws peer_dead when a listed request can never complete: a send to a peer that hung up
  // (nobody reads it), a receive from a peer whose stream ended.
  void check_peers(const std::vector<Request*>& listed) {
    std::vector<int> dead;
    for (const Request* r : listed) {
      if (r->complete || r->peer == rank_) continue;
      const Peer& p = peers_[static_cast<size_t>(r->peer)];
      if (r->is_send ? (p.hung_up || p.send_failed) : p.ended) dead.push_back(r->peer);
    }
    if (dead.empty()) return;
    std::sort(dead.begin(), dead.end());
    dead.erase(std::unique(dead.begin(), dead.end()), dead.end());
    std::string who;
    for (int d : dead) {
      const Peer& p = peers_[static_cast<size_t>(d)];
      if (!who.empty()) who += "; ";
      who += fmt::format("rank {} ({}) {}", d, p.endpoint,
                         p.why.empty() ? "hung up (it closed its transport, aborted or died)" : p.why);
    }
    throw TransportError(TransportError::Kind::peer_dead, dead,
                         fmt::format("tcp: {} while rank {} waited for: {}", who, rank_, describe(pending_of(listed))),
                         __FILE__, __LINE__);
  }

  const int rank_;
  const int size_;
  std::vector<Peer> peers_;  // by rank; the entry of this rank has no socket
  std::deque<Request*> self_sends_;
  std::deque<Request*> self_recvs_;
  transport_requests::RequestTable<Request> requests_;
  std::exception_ptr broken_;
  std::atomic<bool> in_use_{false};
  std::mutex io_mu_;
  net::WakeEvent wake_;
  std::vector<pollfd> fds_;  // progress(): the wake event, then the polled peers
  std::vector<int> polled_;  // peer rank of fds_[i + 1]
  std::atomic<bool> aborted_{false};
  int abort_origin_ = -1;     // under io_mu_
  std::string abort_reason_;  // under io_mu_
};

// ---------------------------------------------------------------------------------- rendezvous
//
// Each rank listens, publishes its address, dials every higher rank (connect() completes in the
// peer's listen backlog, so no rank waits for another to call accept), then runs every
// handshake at once in one poll() loop: the greetings of the ranks it dialled and the hellos
// of the ranks that dialled it. A dialled connection that fails is fatal (that peer is broken
// or not of this job); an accepted one that fails is refused and logged for the timeout
// message, and the rank keeps waiting for the real one.

Duration remaining(Deadline deadline) {
  return std::max(Duration{0}, std::chrono::ceil<Duration>(deadline - Clock::now()));
}

constexpr size_t kMaxHandshakes = 256;  // unauthenticated connections held at once
constexpr size_t kMaxRejectionsListed = 4;

struct Handshake {
  enum class Step { greeting, hello, verdict, refusal_length, refusal, answer, done };
  net::Fd fd;
  bool dialled = false;  // we connected; otherwise we accepted
  int peer = -1;         // dialled: the rank we called; accepted: the rank it proved to be
  std::string where;     // its address
  Step step = Step::greeting;
  std::string in;
  size_t need = 0;  // bytes `in` must hold for the current step
  std::string out;
  size_t out_pos = 0;
  auth::Challenge challenge{};  // the challenge we sent
  bool drop_after_flush = false;
  bool dropped = false;
};

class Rendezvous {
 public:
  Rendezvous(Store& store, const std::string& prefix, int rank, int size, const std::string& secret, Duration timeout)
      : store_(store),
        prefix_(prefix),
        rank_(rank),
        size_(size),
        secret_(secret),
        timeout_(timeout),
        deadline_(deadline_after(timeout)),
        fds_(static_cast<size_t>(size)),
        endpoints_(static_cast<size_t>(size)),
        accepted_(static_cast<size_t>(size), false) {}

  std::unique_ptr<Transport> run(const std::string& bind_address) {
    listen(bind_address);
    dial_higher_ranks();
    handshake_all();
    listener_.reset();
    return std::make_unique<TcpTransport>(rank_, size_, std::move(fds_), std::move(endpoints_));
  }

 private:
  void listen(const std::string& bind_address) {
    const std::string host = bind_address.empty() ? "127.0.0.1" : bind_address;
    try {
      listener_ = net::listen_tcp(host, 0, std::clamp(size_, 16, 4096));
    } catch (const net::NetError& e) {
      DT_THROW("comm", "tcp: rank {} cannot listen on '{}': {}", rank_, host, e.message());
    }
    // A wildcard address is no address to dial: publish the host name instead.
    const bool wildcard = host == "0.0.0.0" || host == "::";
    std::string published = host;
    if (wildcard) {
      char name[256] = {};
      ::gethostname(name, sizeof(name) - 1);
      published = name;
    }
    store_.set(tcp_wire::address_key(prefix_, rank_), net::endpoint(published, net::local_port(listener_.get())));
  }

  void dial_higher_ranks() {
    std::vector<std::string> keys;
    for (int p = rank_ + 1; p < size_; ++p) keys.push_back(tcp_wire::address_key(prefix_, p));
    if (keys.empty()) return;
    try {
      store_.wait(keys, remaining(deadline_));
    } catch (const CommError&) {
      std::vector<int> missing;
      for (int p = rank_ + 1; p < size_; ++p) {
        if (!store_.try_get(tcp_wire::address_key(prefix_, p))) missing.push_back(p);
      }
      throw TransportError(TransportError::Kind::timeout, missing,
                           fmt::format("tcp: rank {} waited {} ms for rank(s) {} to publish their address (store key "
                                       "'{}')",
                                       rank_, timeout_.count(), fmt::join(missing, ", "),
                                       tcp_wire::address_key(prefix_, missing.empty() ? rank_ + 1 : missing.front())),
                           __FILE__, __LINE__);
    }
    for (int p = rank_ + 1; p < size_; ++p) {
      const std::string address = store_.get(tcp_wire::address_key(prefix_, p), remaining(deadline_));
      std::string host;
      uint16_t port = 0;
      if (!net::parse_endpoint(address, host, port)) {
        throw TransportError(TransportError::Kind::protocol, {p},
                             fmt::format("tcp: rank {} published a malformed address '{}' (store key '{}')", p,
                                         net::printable(address), tcp_wire::address_key(prefix_, p)),
                             __FILE__, __LINE__);
      }
      auto h = std::make_unique<Handshake>();
      h->dialled = true;
      h->peer = p;
      h->where = address;
      try {
        h->fd = net::connect_tcp(host, port, deadline_);
      } catch (const net::NetError& e) {
        const bool timed_out = e.kind() == net::NetError::Kind::timeout;
        throw TransportError(
            timed_out ? TransportError::Kind::timeout : TransportError::Kind::peer_dead, {p},
            fmt::format("tcp: rank {} cannot connect to rank {} at {}: {}", rank_, p, address, e.message()), __FILE__,
            __LINE__);
      }
      h->step = Handshake::Step::greeting;
      h->need = tcp_wire::kGreetingBytes;
      shakes_.push_back(std::move(h));
    }
  }

  bool complete() const {
    for (int p = 0; p < size_; ++p) {
      if (p != rank_ && !fds_[static_cast<size_t>(p)]) return false;
    }
    return true;
  }

  void handshake_all() {
    std::vector<pollfd> fds;
    while (!complete()) {
      const bool accepting =
          std::find(accepted_.begin(), accepted_.begin() + rank_, false) != accepted_.begin() + rank_;
      fds.clear();
      fds.push_back({accepting ? listener_.get() : -1, POLLIN, 0});
      for (const auto& h : shakes_) {
        short events = 0;
        if (h->in.size() < h->need) events |= POLLIN;
        if (h->out_pos < h->out.size()) events |= POLLOUT;
        fds.push_back({h->fd.get(), events, 0});
      }
      if (Clock::now() >= deadline_) throw_timeout();
      if (::poll(fds.data(), fds.size(), poll_timeout_ms(deadline_)) < 0 && errno != EINTR) {
        DT_THROW("comm", "tcp: rank {}: poll: {}", rank_, std::strerror(errno));
      }
      const size_t polled = shakes_.size();  // accept_all() appends after these
      for (size_t i = 0; i < polled; ++i) {
        if (fds[i + 1].revents != 0) progress(*shakes_[i]);
      }
      if ((fds[0].revents & POLLIN) != 0) accept_all();
      std::erase_if(shakes_, [](const std::unique_ptr<Handshake>& h) { return h->dropped; });
    }
  }

  void accept_all() {
    for (;;) {
      const int fd = ::accept4(listener_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno == EINTR || errno == ECONNABORTED || errno == EPROTO) continue;
        return;  // EAGAIN, or EMFILE and friends: the dialling ranks retry nothing, so do we
      }
      net::Fd sock(fd);
      const std::string where = net::peer_name(fd);
      if (shakes_.size() >= kMaxHandshakes) {
        reject(where, -1, fmt::format("{} connections are already authenticating", kMaxHandshakes));
        continue;
      }
      auto h = std::make_unique<Handshake>();
      h->fd = std::move(sock);
      h->where = where;
      try {
        net::set_nodelay(h->fd.get());
      } catch (const net::NetError&) {
        continue;  // it already vanished
      }
      h->challenge = auth::make_challenge();
      h->out.append(tcp_wire::kMagic, sizeof(tcp_wire::kMagic));
      net::put_u8(h->out, tcp_wire::kVersion);
      net::put_u32(h->out, static_cast<uint32_t>(rank_));
      net::put_u32(h->out, static_cast<uint32_t>(size_));
      h->out.append(reinterpret_cast<const char*>(h->challenge.data()), h->challenge.size());
      h->step = Handshake::Step::hello;
      h->need = tcp_wire::kHelloBytes;
      progress(*h);
      shakes_.push_back(std::move(h));
    }
  }

  // Flushes, reads what the current step needs (never more: frames follow the handshake in
  // the same stream) and advances the steps.
  void progress(Handshake& h) {
    while (!h.dropped) {
      if (!flush(h)) return;
      if (h.step == Handshake::Step::done) {
        if (!h.drop_after_flush) {  // authenticated and the verdict written: hand the socket over
          fds_[static_cast<size_t>(h.peer)] = std::move(h.fd);
          endpoints_[static_cast<size_t>(h.peer)] = h.where;
        }
        h.dropped = true;
        return;
      }
      if (h.in.size() < h.need) {
        char buf[tcp_wire::kMaxRefusalBytes];
        const ssize_t n = ::recv(h.fd.get(), buf, std::min(sizeof(buf), h.need - h.in.size()), 0);
        if (n > 0) {
          h.in.append(buf, static_cast<size_t>(n));
          continue;
        }
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
        fail(h, n == 0 ? std::string("closed the connection during the handshake")
                       : fmt::format("handshake recv: {}", std::strerror(errno)));
        return;
      }
      advance(h);
    }
  }

  // False while bytes remain to be written (or the connection failed).
  bool flush(Handshake& h) {
    while (h.out_pos < h.out.size()) {
      const ssize_t n = ::send(h.fd.get(), h.out.data() + h.out_pos, h.out.size() - h.out_pos, MSG_NOSIGNAL);
      if (n > 0) {
        h.out_pos += static_cast<size_t>(n);
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return false;
      fail(h, fmt::format("handshake send: {}", std::strerror(errno)));
      return false;
    }
    return true;
  }

  // `h` holds the bytes its step needs: check them and move on.
  void advance(Handshake& h) {
    const auto* bytes = reinterpret_cast<const uint8_t*>(h.in.data());
    switch (h.step) {
      case Handshake::Step::greeting: {  // we dialled h.peer
        const uint32_t their_rank = net::load_u32(bytes + 5);
        const uint32_t their_size = net::load_u32(bytes + 9);
        if (std::memcmp(bytes, tcp_wire::kMagic, sizeof(tcp_wire::kMagic)) != 0) {
          dialled_error(h, TransportError::Kind::protocol, "is not a dtrain TCP transport (unexpected greeting)");
        }
        if (bytes[4] != tcp_wire::kVersion) {
          dialled_error(
              h, TransportError::Kind::protocol,
              fmt::format("speaks transport protocol version {}, this build speaks {}", bytes[4], tcp_wire::kVersion));
        }
        if (their_rank != static_cast<uint32_t>(h.peer) || their_size != static_cast<uint32_t>(size_)) {
          dialled_error(h, TransportError::Kind::protocol,
                        fmt::format("answered as rank {} of a group of {}, expected rank {} of {} (a stale address "
                                    "from another job?)",
                                    their_rank, their_size, h.peer, size_));
        }
        auth::Challenge theirs;
        std::memcpy(theirs.data(), bytes + 13, theirs.size());
        const auth::Mac mac =
            auth::answer_challenge(secret_, tcp_wire::connect_context(prefix_, rank_, h.peer, size_), theirs);
        h.challenge = auth::make_challenge();
        net::put_u32(h.out, static_cast<uint32_t>(rank_));
        h.out.append(reinterpret_cast<const char*>(mac.data()), mac.size());
        h.out.append(reinterpret_cast<const char*>(h.challenge.data()), h.challenge.size());
        next(h, Handshake::Step::verdict, 1);
        return;
      }
      case Handshake::Step::verdict:
        if (bytes[0] == tcp_wire::kAccepted) {
          next(h, Handshake::Step::answer, auth::kMacBytes);
        } else if (bytes[0] == tcp_wire::kRefused) {
          next(h, Handshake::Step::refusal_length, 4);
        } else {
          dialled_error(h, TransportError::Kind::protocol, fmt::format("sent verdict byte 0x{:02x}", bytes[0]));
        }
        return;
      case Handshake::Step::refusal_length: {
        const uint32_t length = net::load_u32(bytes);
        if (length == 0 || length > tcp_wire::kMaxRefusalBytes) {
          dialled_error(h, TransportError::Kind::protocol, fmt::format("refused us with a {}-byte reason", length));
        }
        next(h, Handshake::Step::refusal, length);
        return;
      }
      case Handshake::Step::refusal:
        dialled_error(h, TransportError::Kind::protocol,
                      fmt::format("refused the connection from rank {}: {}", rank_, net::printable(h.in, 512)));
      case Handshake::Step::answer:
        if (!auth::verify_answer(secret_, tcp_wire::accept_context(prefix_, h.peer, rank_, size_), h.challenge, bytes,
                                 h.in.size())) {
          dialled_error(h, TransportError::Kind::protocol,
                        "could not prove the job secret (a different secret, or not a rank of this group)");
        }
        next(h, Handshake::Step::done, 0);
        return;
      case Handshake::Step::hello:
        on_hello(h, bytes);
        return;
      case Handshake::Step::done:
        return;
    }
  }

  // An accepted connection said who it is: check it, then accept or refuse.
  void on_hello(Handshake& h, const uint8_t* bytes) {
    const uint32_t claimed = net::load_u32(bytes);
    std::string refusal;
    if (claimed >= static_cast<uint32_t>(rank_)) {
      refusal = fmt::format("rank {} may not dial rank {}: in a group of {} each rank dials the higher ranks only",
                            claimed, rank_, size_);
    } else if (!auth::verify_answer(secret_,
                                    tcp_wire::connect_context(prefix_, static_cast<int>(claimed), rank_, size_),
                                    h.challenge, bytes + 4, auth::kMacBytes)) {
      refusal = "authentication failed: wrong job secret (or a connection meant for another group)";
    } else if (accepted_[claimed]) {
      refusal = fmt::format("rank {} is already connected to rank {}", claimed, rank_);
    }
    if (!refusal.empty()) {
      reject(h.where, static_cast<int>(claimed), refusal);
      net::put_u8(h.out, tcp_wire::kRefused);
      net::put_bytes(h.out, refusal);
      h.drop_after_flush = true;
      next(h, Handshake::Step::done, 0);
      return;
    }
    accepted_[claimed] = true;
    h.peer = static_cast<int>(claimed);
    auth::Challenge theirs;
    std::memcpy(theirs.data(), bytes + 4 + auth::kMacBytes, theirs.size());
    const auth::Mac mac =
        auth::answer_challenge(secret_, tcp_wire::accept_context(prefix_, rank_, h.peer, size_), theirs);
    net::put_u8(h.out, tcp_wire::kAccepted);
    h.out.append(reinterpret_cast<const char*>(mac.data()), mac.size());
    next(h, Handshake::Step::done, 0);
  }

  static void next(Handshake& h, Handshake::Step step, size_t need) {
    h.step = step;
    h.in.clear();
    h.need = need;
  }

  void fail(Handshake& h, const std::string& what) {
    if (h.dialled) dialled_error(h, TransportError::Kind::peer_dead, what);
    if (h.step == Handshake::Step::hello) reject(h.where, -1, what);
    if (h.peer >= 0 && accepted_[static_cast<size_t>(h.peer)] && !fds_[static_cast<size_t>(h.peer)]) {
      accepted_[static_cast<size_t>(h.peer)] = false;  // it proved its rank but vanished: wait for another
    }
    h.dropped = true;
  }

  [[noreturn]] void dialled_error(const Handshake& h, TransportError::Kind kind, const std::string& what) {
    throw TransportError(kind, {h.peer},
                         fmt::format("tcp: rank {} at {} (dialled by rank {}) {}", h.peer, h.where, rank_, what),
                         __FILE__, __LINE__);
  }

  void reject(const std::string& where, int claimed, const std::string& why) {
    ++rejected_;
    if (rejections_.size() < kMaxRejectionsListed) {
      rejections_.push_back(claimed >= 0 ? fmt::format("{} claiming rank {}: {}", where, claimed, why)
                                         : fmt::format("{}: {}", where, why));
    }
  }

  [[noreturn]] void throw_timeout() {
    std::vector<int> missing;
    for (int p = 0; p < size_; ++p) {
      if (p != rank_ && !fds_[static_cast<size_t>(p)]) missing.push_back(p);
    }
    std::string refused;
    if (rejected_ > 0) {
      refused = fmt::format("; refused {} connection(s): {}{}", rejected_, fmt::join(rejections_, "; "),
                            rejected_ > rejections_.size() ? "; ..." : "");
    }
    throw TransportError(TransportError::Kind::timeout, missing,
                         fmt::format("tcp: rank {} waited {} ms to connect the group of {}; no authenticated "
                                     "connection with rank(s) {}{}",
                                     rank_, timeout_.count(), size_, fmt::join(missing, ", "), refused),
                         __FILE__, __LINE__);
  }

  Store& store_;
  const std::string prefix_;
  const int rank_;
  const int size_;
  const std::string secret_;
  const Duration timeout_;
  const Deadline deadline_;
  net::Fd listener_;
  std::vector<net::Fd> fds_;            // by rank: the authenticated connections
  std::vector<std::string> endpoints_;  // by rank: their addresses
  std::vector<bool> accepted_;          // by rank: a lower rank that proved itself
  std::vector<std::unique_ptr<Handshake>> shakes_;
  size_t rejected_ = 0;
  std::vector<std::string> rejections_;
};

}  // namespace

std::unique_ptr<Transport> make_tcp_transport(Store& store, const std::string& prefix, int rank, int size,
                                              const std::string& secret, const std::string& bind_address,
                                              Duration timeout) {
  DT_CHECK(size >= 1 && rank >= 0 && rank < size, "comm", "tcp transport: rank {} is not in a group of size {}", rank,
           size);
  DT_CHECK(!secret.empty(), "comm",
           "tcp transport: the job secret is empty (set GroupOptions::secret or DTRAIN_SECRET)");
  check_secret(secret, "tcp transport");
  if (size == 1) {
    return std::make_unique<TcpTransport>(0, 1, std::vector<net::Fd>(1), std::vector<std::string>(1));
  }
  return Rendezvous(store, prefix, rank, size, secret, timeout).run(bind_address);
}

}  // namespace dtrain::comm
