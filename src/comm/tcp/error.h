// Typed errors of the TCP helpers (net.h): which syscall failed, its errno, and whether the
// deadline passed, the peer closed the connection or something else failed. Internal to
// dtrain_comm: the store and the transports translate them into CommError naming the peer and
// the operation.
#pragma once

#include <string>
#include <utility>

#include "dtrain/core/error.h"

namespace dtrain::comm::net {

class NetError : public Error {
 public:
  enum class Kind {
    timeout,  // the deadline passed
    closed,   // the peer closed the connection (EOF, reset, broken pipe)
    system,   // any other failing syscall
  };
  NetError(Kind kind, std::string syscall, int error_number, const std::string& message, const char* file, int line)
      : Error("comm", message, file, line), kind_(kind), syscall_(std::move(syscall)), errno_(error_number) {}
  Kind kind() const { return kind_; }
  const std::string& syscall() const { return syscall_; }
  int error_number() const { return errno_; }

 private:
  Kind kind_;
  std::string syscall_;
  int errno_;
};

}  // namespace dtrain::comm::net
