// Small TCP helpers for dtrain_comm (internal): an owning file descriptor, listen/connect,
// deadline-bounded send/recv on non-blocking sockets, a wake-up eventfd for poll() loops and
// little-endian wire encoding. The TCP store's frames are ../store/store_wire.h.
//
// Errors inside this layer are NetError (error.h: syscall, errno, kind); the store and
// transports translate them into CommError naming the peer and the operation.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "dtrain/comm/types.h"
#include "error.h"

namespace dtrain::comm::net {

/// Owns a file descriptor; closes it on destruction. Move-only.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() { reset(); }
  Fd(Fd&& other) noexcept : fd_(other.release()) {}
  Fd& operator=(Fd&& other) noexcept {
    if (this != &other) reset(other.release());
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  explicit operator bool() const { return fd_ >= 0; }
  int release() {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }
  void reset(int fd = -1);

 private:
  int fd_ = -1;
};

/// "host:port", or "[v6]:port" when host contains a colon.
std::string endpoint(const std::string& host, uint16_t port);
/// The inverse of endpoint(): false when `text` is not "host:port" / "[v6]:port" with a port in 1..65535.
bool parse_endpoint(const std::string& text, std::string& host, uint16_t& port);

/// A non-blocking, close-on-exec listening socket bound to `address` (a numeric address or a
/// host name; "" means 127.0.0.1) with SO_REUSEADDR. Throws NetError.
Fd listen_tcp(const std::string& address, uint16_t port, int backlog);
/// The local port a socket is bound to.
uint16_t local_port(int fd);
/// The peer of a connected socket as "host:port" ("?" when unknown).
std::string peer_name(int fd);
/// The numeric local address this host would use to reach `host` (a UDP connect() that sends
/// nothing, then getsockname): the address of the interface that routes there. Throws NetError.
std::string local_address_toward(const std::string& host, uint16_t port);

/// An address of one of this host's network interfaces, as getifaddrs lists them.
struct InterfaceAddress {
  std::string name;     // "eth0"
  std::string address;  // numeric
  int family = 0;       // AF_INET or AF_INET6
  bool up = false;
  bool loopback = false;
};
/// This host's interfaces' IPv4 and IPv6 addresses (getifaddrs), in its order; empty on failure.
std::vector<InterfaceAddress> interface_addresses();
/// The address other hosts are most likely to reach this one at, when routing cannot tell: the
/// first interface that is up and not loopback with an IPv4 address, else one with an IPv6
/// address that is not link-local (fe80::/10); nullptr when there is none.
const InterfaceAddress* outward_address(const std::vector<InterfaceAddress>& interfaces);

/// One connection attempt to every address `host` resolves to, until `deadline`. Returns a
/// non-blocking, close-on-exec socket with TCP_NODELAY. Throws NetError (refused, timeout,
/// resolution failure).
Fd connect_tcp(const std::string& host, uint16_t port, Deadline deadline);

void set_nonblocking(int fd);
void set_nodelay(int fd);

/// Waits until `fd` is ready for `events` (POLLIN/POLLOUT); false when `deadline` passed.
bool wait_ready(int fd, short events, Deadline deadline);
/// Sends all bytes of a non-blocking socket (MSG_NOSIGNAL) or throws NetError.
void send_all(int fd, const void* data, size_t size, Deadline deadline);
/// Receives exactly `size` bytes or throws NetError (closed on EOF, timeout at the deadline).
void recv_all(int fd, void* data, size_t size, Deadline deadline);

/// An eventfd that wakes a poll() loop from another thread.
class WakeEvent {
 public:
  WakeEvent();
  int fd() const { return fd_.get(); }
  void notify();
  void drain();

 private:
  Fd fd_;
};

// ---- little-endian wire encoding ----

void put_u8(std::string& out, uint8_t v);
void put_u32(std::string& out, uint32_t v);
void put_u64(std::string& out, uint64_t v);
/// u32 length followed by the bytes.
void put_bytes(std::string& out, std::string_view bytes);
uint32_t load_u32(const uint8_t* p);
uint64_t load_u64(const uint8_t* p);
/// Fixed-size fields written in place (headers kept in a struct rather than a string).
void store_u32(uint8_t* p, uint32_t v);
void store_u64(uint8_t* p, uint64_t v);

/// Strict reader over a byte range: every read checks the remaining size and fails (returns
/// false, consuming nothing) rather than reading past the end.
class WireReader {
 public:
  WireReader(const uint8_t* data, size_t size) : p_(data), end_(data + size) {}
  size_t remaining() const { return static_cast<size_t>(end_ - p_); }
  bool u8(uint8_t& v);
  bool u32(uint32_t& v);
  bool u64(uint64_t& v);
  bool bytes(std::string& v);

 private:
  const uint8_t* p_;
  const uint8_t* end_;
};

/// `text` with non-printable bytes escaped as \xNN, cut to `max_len` characters ("..." added).
std::string printable(std::string_view text, size_t max_len = 64);

}  // namespace dtrain::comm::net
