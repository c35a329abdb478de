#include "net.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace dtrain::comm::net {

namespace {

[[noreturn]] void throw_sys(const char* syscall, int err, const std::string& what) {
  const auto kind = (err == ECONNRESET || err == EPIPE) ? NetError::Kind::closed : NetError::Kind::system;
  throw NetError(kind, syscall, err, fmt::format("{}: {}: {}", what, syscall, std::strerror(err)), __FILE__, __LINE__);
}

int remaining_ms(Deadline deadline) {
  const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now()).count();
  if (left <= 0) return 0;
  return left > 1'000'000'000 ? 1'000'000'000 : static_cast<int>(left);
}

struct AddrInfo {
  addrinfo* head = nullptr;
  ~AddrInfo() {
    if (head != nullptr) freeaddrinfo(head);
  }
};

void resolve(const std::string& host, uint16_t port, bool passive, AddrInfo& out) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV | (passive ? AI_PASSIVE : 0);
  const std::string service = std::to_string(port);
  const int rc = getaddrinfo(host.c_str(), service.c_str(), &hints, &out.head);
  if (rc != 0) {
    const int err = rc == EAI_SYSTEM ? errno : 0;
    throw NetError(NetError::Kind::system, "getaddrinfo", err,
                   fmt::format("cannot resolve '{}': {}", host, gai_strerror(rc)), __FILE__, __LINE__);
  }
}

// The numeric address of an IPv4 or IPv6 socket address; "" for another family or when
// inet_ntop fails (errno says why).
std::string numeric_host(const sockaddr* sa) {
  char host[INET6_ADDRSTRLEN] = "";
  const void* addr = nullptr;
  if (sa->sa_family == AF_INET) addr = &reinterpret_cast<const sockaddr_in*>(sa)->sin_addr;
  if (sa->sa_family == AF_INET6) addr = &reinterpret_cast<const sockaddr_in6*>(sa)->sin6_addr;
  if (addr == nullptr || ::inet_ntop(sa->sa_family, addr, host, sizeof(host)) == nullptr) return "";
  return host;
}

std::string address_name(const sockaddr* sa) {
  uint16_t port = 0;
  if (sa->sa_family == AF_INET) {
    port = ntohs(reinterpret_cast<const sockaddr_in*>(sa)->sin_port);
  } else if (sa->sa_family == AF_INET6) {
    port = ntohs(reinterpret_cast<const sockaddr_in6*>(sa)->sin6_port);
  } else {
    return "?";
  }
  const std::string host = numeric_host(sa);
  return endpoint(host.empty() ? "?" : host, port);
}

}  // namespace

void Fd::reset(int fd) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}

std::string endpoint(const std::string& host, uint16_t port) {
  if (host.find(':') != std::string::npos) return fmt::format("[{}]:{}", host, port);
  return fmt::format("{}:{}", host, port);
}

bool parse_endpoint(const std::string& text, std::string& host, uint16_t& port) {
  size_t colon = 0;
  if (!text.empty() && text.front() == '[') {
    const size_t close = text.find(']');
    if (close == std::string::npos || close + 1 >= text.size() || text[close + 1] != ':') return false;
    host = text.substr(1, close - 1);
    colon = close + 1;
  } else {
    colon = text.rfind(':');
    if (colon == std::string::npos) return false;
    host = text.substr(0, colon);
  }
  const std::string digits = text.substr(colon + 1);
  if (host.empty() || digits.empty() || digits.size() > 5) return false;
  unsigned value = 0;
  for (const char c : digits) {
    if (c < '0' || c > '9') return false;
    value = value * 10 + static_cast<unsigned>(c - '0');
  }
  if (value == 0 || value > 65535) return false;
  port = static_cast<uint16_t>(value);
  return true;
}

Fd listen_tcp(const std::string& address, uint16_t port, int backlog) {
  const std::string host = address.empty() ? "127.0.0.1" : address;
  const std::string where = fmt::format("cannot listen on {}", endpoint(host, port));
  AddrInfo ai;
  resolve(host, port, /*passive=*/true, ai);
  int last_err = 0;
  const char* last_call = "socket";
  for (addrinfo* a = ai.head; a != nullptr; a = a->ai_next) {
    Fd fd(::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol));
    if (!fd) {
      last_err = errno, last_call = "socket";
      continue;
    }
    const int one = 1;
    ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd.get(), a->ai_addr, a->ai_addrlen) != 0) {
      last_err = errno, last_call = "bind";
      continue;
    }
    if (::listen(fd.get(), backlog) != 0) {
      last_err = errno, last_call = "listen";
      continue;
    }
    return fd;
  }
  throw_sys(last_call, last_err, where);
}

uint16_t local_port(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) throw_sys("getsockname", errno, "local_port");
  if (ss.ss_family == AF_INET) return ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
  if (ss.ss_family == AF_INET6) return ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port);
  return 0;
}

std::string peer_name(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return "?";
  return address_name(reinterpret_cast<const sockaddr*>(&ss));
}

std::string local_address_toward(const std::string& host, uint16_t port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  hints.ai_flags = AI_NUMERICSERV;
  AddrInfo ai;
  const std::string service = std::to_string(port == 0 ? 1 : port);
  const int rc = getaddrinfo(host.c_str(), service.c_str(), &hints, &ai.head);
  if (rc != 0) {
    throw NetError(NetError::Kind::system, "getaddrinfo", rc == EAI_SYSTEM ? errno : 0,
                   fmt::format("cannot resolve '{}': {}", host, gai_strerror(rc)), __FILE__, __LINE__);
  }
  int last_err = ENETUNREACH;
  for (addrinfo* a = ai.head; a != nullptr; a = a->ai_next) {
    Fd fd(::socket(a->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0));
    if (!fd || ::connect(fd.get(), a->ai_addr, a->ai_addrlen) != 0) {
      last_err = errno;
      continue;
    }
    sockaddr_storage ss{};
    socklen_t len = sizeof(ss);
    if (::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&ss), &len) != 0) {
      last_err = errno;
      continue;
    }
    if (std::string name = numeric_host(reinterpret_cast<const sockaddr*>(&ss)); !name.empty()) return name;
    last_err = errno;
  }
  throw_sys("connect", last_err, fmt::format("no local address routes to '{}'", host));
}

std::vector<InterfaceAddress> interface_addresses() {
  std::vector<InterfaceAddress> out;
  ifaddrs* head = nullptr;
  if (::getifaddrs(&head) != 0) return out;
  for (const ifaddrs* a = head; a != nullptr; a = a->ifa_next) {
    if (a->ifa_addr == nullptr) continue;
    std::string name = numeric_host(a->ifa_addr);  // IPv4 and IPv6 only
    if (name.empty()) continue;
    out.push_back({a->ifa_name != nullptr ? a->ifa_name : "?", std::move(name), a->ifa_addr->sa_family,
                   (a->ifa_flags & IFF_UP) != 0, (a->ifa_flags & IFF_LOOPBACK) != 0});
  }
  ::freeifaddrs(head);
  return out;
}

const InterfaceAddress* outward_address(const std::vector<InterfaceAddress>& interfaces) {
  for (int family : {AF_INET, AF_INET6}) {
    for (const InterfaceAddress& a : interfaces) {
      const bool link_local = family == AF_INET6 && (a.address.starts_with("fe8") || a.address.starts_with("fe9") ||
                                                     a.address.starts_with("fea") || a.address.starts_with("feb"));
      if (a.family == family && a.up && !a.loopback && !link_local) return &a;
    }
  }
  return nullptr;
}

void set_nonblocking(int fd) {
  const int flags = ::fcntl(fd, F_GETFL, 0);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags | O_NONBLOCK) != 0) throw_sys("fcntl", errno, "set_nonblocking");
}

void set_nodelay(int fd) {
  const int one = 1;
  if (::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one)) != 0) throw_sys("setsockopt", errno, "TCP_NODELAY");
}

Fd connect_tcp(const std::string& host, uint16_t port, Deadline deadline) {
  const std::string where = fmt::format("cannot connect to {}", endpoint(host, port));
  AddrInfo ai;
  resolve(host, port, /*passive=*/false, ai);
  int last_err = ECONNREFUSED;
  const char* last_call = "connect";
  for (addrinfo* a = ai.head; a != nullptr; a = a->ai_next) {
    Fd fd(::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol));
    if (!fd) {
      last_err = errno, last_call = "socket";
      continue;
    }
    if (::connect(fd.get(), a->ai_addr, a->ai_addrlen) != 0) {
      if (errno != EINPROGRESS) {
        last_err = errno, last_call = "connect";
        continue;
      }
      if (!wait_ready(fd.get(), POLLOUT, deadline)) {
        throw NetError(NetError::Kind::timeout, "connect", ETIMEDOUT, where + ": timed out", __FILE__, __LINE__);
      }
      int err = 0;
      socklen_t len = sizeof(err);
      if (::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = errno;
      if (err != 0) {
        last_err = err, last_call = "connect";
        continue;
      }
    }
    set_nodelay(fd.get());
    return fd;
  }
  throw_sys(last_call, last_err, where);
}

bool wait_ready(int fd, short events, Deadline deadline) {
  for (;;) {
    pollfd p{fd, events, 0};
    const int rc = ::poll(&p, 1, remaining_ms(deadline));
    if (rc > 0) return true;  // readiness, or an error the next syscall reports
    if (rc == 0) {
      if (Clock::now() >= deadline) return false;
      continue;  // poll rounds down to whole milliseconds
    }
    if (errno != EINTR) throw_sys("poll", errno, "wait_ready");
  }
}

void send_all(int fd, const void* data, size_t size, Deadline deadline) {
  const auto* p = static_cast<const uint8_t*>(data);
  while (size > 0) {
    const ssize_t n = ::send(fd, p, size, MSG_NOSIGNAL);
    if (n > 0) {
      p += n;
      size -= static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      if (!wait_ready(fd, POLLOUT, deadline)) {
        throw NetError(NetError::Kind::timeout, "send", ETIMEDOUT, "send timed out", __FILE__, __LINE__);
      }
      continue;
    }
    throw_sys("send", errno, "send failed");
  }
}

void recv_all(int fd, void* data, size_t size, Deadline deadline) {
  auto* p = static_cast<uint8_t*>(data);
  while (size > 0) {
    const ssize_t n = ::recv(fd, p, size, 0);
    if (n > 0) {
      p += n;
      size -= static_cast<size_t>(n);
      continue;
    }
    if (n == 0) {
      throw NetError(NetError::Kind::closed, "recv", 0, "the peer closed the connection", __FILE__, __LINE__);
    }
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      if (!wait_ready(fd, POLLIN, deadline)) {
        throw NetError(NetError::Kind::timeout, "recv", ETIMEDOUT, "recv timed out", __FILE__, __LINE__);
      }
      continue;
    }
    throw_sys("recv", errno, "recv failed");
  }
}

WakeEvent::WakeEvent() : fd_(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) {
  if (!fd_) throw_sys("eventfd", errno, "WakeEvent");
}

void WakeEvent::notify() {
  const uint64_t one = 1;
  // EAGAIN means the counter is saturated: the loop is already due to wake.
  [[maybe_unused]] const ssize_t n = ::write(fd_.get(), &one, sizeof(one));
}

void WakeEvent::drain() {
  uint64_t count = 0;
  [[maybe_unused]] const ssize_t n = ::read(fd_.get(), &count, sizeof(count));
}

// ---- wire encoding ----

void put_u8(std::string& out, uint8_t v) { out.push_back(static_cast<char>(v)); }

void store_u32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<uint8_t>((v >> (8 * i)) & 0xff);
}

void store_u64(uint8_t* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<uint8_t>((v >> (8 * i)) & 0xff);
}

void put_u32(std::string& out, uint32_t v) {
  uint8_t b[4];
  store_u32(b, v);
  out.append(reinterpret_cast<const char*>(b), sizeof(b));
}

void put_u64(std::string& out, uint64_t v) {
  uint8_t b[8];
  store_u64(b, v);
  out.append(reinterpret_cast<const char*>(b), sizeof(b));
}

void put_bytes(std::string& out, std::string_view bytes) {
  put_u32(out, static_cast<uint32_t>(bytes.size()));
  out.append(bytes);
}

uint32_t load_u32(const uint8_t* p) {
  return static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) | (static_cast<uint32_t>(p[2]) << 16) |
         (static_cast<uint32_t>(p[3]) << 24);
}

uint64_t load_u64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return v;
}

bool WireReader::u8(uint8_t& v) {
  if (remaining() < 1) return false;
  v = *p_++;
  return true;
}

bool WireReader::u32(uint32_t& v) {
  if (remaining() < 4) return false;
  v = load_u32(p_);
  p_ += 4;
  return true;
}

bool WireReader::u64(uint64_t& v) {
  if (remaining() < 8) return false;
  v = load_u64(p_);
  p_ += 8;
  return true;
}

bool WireReader::bytes(std::string& v) {
  if (remaining() < 4) return false;
  const uint32_t n = load_u32(p_);
  if (n > remaining() - 4) return false;
  v.assign(reinterpret_cast<const char*>(p_ + 4), n);
  p_ += 4 + static_cast<size_t>(n);
  return true;
}

std::string printable(std::string_view text, size_t max_len) {
  std::string out;
  for (const char ch : text) {
    if (out.size() >= max_len) {
      out += "...";
      break;
    }
    const auto c = static_cast<unsigned char>(ch);
    if (c >= 0x20 && c < 0x7f && c != '\\') {
      out.push_back(ch);
    } else {
      out += fmt::format("\\x{:02x}", c);
    }
  }
  return out;
}

}  // namespace dtrain::comm::net
