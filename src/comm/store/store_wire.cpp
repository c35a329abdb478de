#include "store_wire.h"

#include <fmt/format.h>

#include "../tcp/net.h"
#include "dtrain/comm/store.h"
#include "dtrain/comm/types.h"

namespace dtrain::comm::net {

namespace store_wire {

const char* op_name(Op op) {
  switch (op) {
    case Op::set:
      return "set";
    case Op::get:
      return "get";
    case Op::try_get:
      return "try_get";
    case Op::add:
      return "add";
    case Op::compare_set:
      return "compare_set";
    case Op::wait:
      return "wait";
  }
  return "?";
}

namespace {

std::string finish_frame(const std::string& body, const char* what) {
  if (body.size() > kMaxFrameBytes) {
    throw CommError(
        what, 0, {},
        fmt::format("message of {} bytes exceeds the store's frame limit of {} bytes", body.size(), kMaxFrameBytes),
        __FILE__, __LINE__);
  }
  std::string frame;
  frame.reserve(4 + body.size());
  put_u32(frame, static_cast<uint32_t>(body.size()));
  frame += body;
  return frame;
}

bool read_keys(WireReader& r, std::vector<std::string>& keys, std::string& error) {
  uint32_t n = 0;
  if (!r.u32(n)) return false;
  if (n > kMaxWaitKeys) {
    error = fmt::format("{} keys exceed the limit of {}", n, kMaxWaitKeys);
    return false;
  }
  // Each key takes at least its 4-byte length.
  if (n > r.remaining() / 4) {
    error = fmt::format("{} keys announced but only {} bytes remain", n, r.remaining());
    return false;
  }
  keys.resize(n);
  for (auto& k : keys) {
    if (!r.bytes(k)) return false;
  }
  return true;
}

void put_keys(std::string& out, const std::vector<std::string>& keys) {
  put_u32(out, static_cast<uint32_t>(keys.size()));
  for (const auto& k : keys) put_bytes(out, k);
}

}  // namespace

RequestDecode decode_request_frame(const uint8_t* data, size_t size) {
  RequestDecode d;
  if (size < 4) return d;  // incomplete
  const uint32_t len = load_u32(data);
  if (len == 0 || len > kMaxFrameBytes) {
    d.status = Decode::error;
    d.error = fmt::format("frame length {} outside 1..{}", len, kMaxFrameBytes);
    return d;
  }
  if (size - 4 < len) return d;  // incomplete
  WireReader r(data + 4, len);
  uint8_t opcode = 0;
  r.u8(opcode);
  Request& q = d.request;
  bool ok = false;
  std::string error;
  switch (opcode) {
    case static_cast<uint8_t>(Op::set):
      ok = r.bytes(q.key) && r.bytes(q.value);
      break;
    case static_cast<uint8_t>(Op::get):
      ok = r.bytes(q.key) && r.u64(q.timeout_ms);
      break;
    case static_cast<uint8_t>(Op::try_get):
      ok = r.bytes(q.key);
      break;
    case static_cast<uint8_t>(Op::add): {
      uint64_t bits = 0;
      ok = r.bytes(q.key) && r.u64(bits);
      q.delta = static_cast<int64_t>(bits);
      break;
    }
    case static_cast<uint8_t>(Op::compare_set):
      ok = r.bytes(q.key) && r.bytes(q.value) && r.bytes(q.desired);
      break;
    case static_cast<uint8_t>(Op::wait):
      ok = r.u64(q.timeout_ms) && read_keys(r, q.keys, error);
      break;
    default:
      d.status = Decode::error;
      d.error = fmt::format("unknown opcode 0x{:02x}", opcode);
      return d;
  }
  q.op = static_cast<Op>(opcode);
  if (!ok) {
    d.status = Decode::error;
    d.error = fmt::format("malformed {} request{}{}", op_name(q.op), error.empty() ? "" : ": ", error);
    return d;
  }
  if (r.remaining() != 0) {
    d.status = Decode::error;
    d.error = fmt::format("{} trailing bytes after a {} request", r.remaining(), op_name(q.op));
    return d;
  }
  d.status = Decode::ok;
  d.consumed = 4 + static_cast<size_t>(len);
  return d;
}

std::string encode_request_frame(const Request& q) {
  if (q.op == Op::wait && q.keys.size() > kMaxWaitKeys) {
    throw CommError("store.wait", 0, {}, fmt::format("{} keys exceed the limit of {}", q.keys.size(), kMaxWaitKeys),
                    __FILE__, __LINE__);
  }
  std::string body;
  put_u8(body, static_cast<uint8_t>(q.op));
  switch (q.op) {
    case Op::set:
      put_bytes(body, q.key);
      put_bytes(body, q.value);
      break;
    case Op::get:
      put_bytes(body, q.key);
      put_u64(body, q.timeout_ms);
      break;
    case Op::try_get:
      put_bytes(body, q.key);
      break;
    case Op::add:
      put_bytes(body, q.key);
      put_u64(body, static_cast<uint64_t>(q.delta));
      break;
    case Op::compare_set:
      put_bytes(body, q.key);
      put_bytes(body, q.value);
      put_bytes(body, q.desired);
      break;
    case Op::wait:
      put_u64(body, q.timeout_ms);
      put_keys(body, q.keys);
      break;
  }
  return finish_frame(body, "store.encode");
}

ReplyDecode decode_reply_body(Op op, const uint8_t* data, size_t size) {
  ReplyDecode d;
  WireReader r(data, size);
  uint8_t status = 0;
  if (!r.u8(status)) {
    d.error = "empty reply";
    return d;
  }
  Reply& y = d.reply;
  bool ok = false;
  std::string error;
  if (status == static_cast<uint8_t>(Status::ok)) {
    y.status = Status::ok;
    switch (op) {
      case Op::set:
      case Op::wait:
        ok = true;
        break;
      case Op::get:
      case Op::compare_set:
        ok = r.bytes(y.value);
        break;
      case Op::try_get: {
        uint8_t present = 0;
        ok = r.u8(present) && present <= 1;
        y.present = present == 1;
        if (ok && y.present) ok = r.bytes(y.value);
        break;
      }
      case Op::add: {
        uint64_t bits = 0;
        ok = r.u64(bits);
        y.number = static_cast<int64_t>(bits);
        break;
      }
    }
  } else if (status == static_cast<uint8_t>(Status::timeout) && (op == Op::get || op == Op::wait)) {
    y.status = Status::timeout;
    ok = read_keys(r, y.keys, error);
  } else if (status == static_cast<uint8_t>(Status::error)) {
    y.status = Status::error;
    ok = r.bytes(y.message);
  } else {
    d.error = fmt::format("unexpected status 0x{:02x} in a {} reply", status, op_name(op));
    return d;
  }
  if (!ok) {
    d.error = fmt::format("malformed {} reply{}{}", op_name(op), error.empty() ? "" : ": ", error);
    return d;
  }
  if (r.remaining() != 0) {
    d.error = fmt::format("{} trailing bytes after a {} reply", r.remaining(), op_name(op));
    return d;
  }
  d.ok = true;
  return d;
}

std::string encode_reply_frame(Op op, const Reply& y) {
  std::string body;
  put_u8(body, static_cast<uint8_t>(y.status));
  switch (y.status) {
    case Status::ok:
      switch (op) {
        case Op::set:
        case Op::wait:
          break;
        case Op::get:
        case Op::compare_set:
          put_bytes(body, y.value);
          break;
        case Op::try_get:
          put_u8(body, y.present ? 1 : 0);
          if (y.present) put_bytes(body, y.value);
          break;
        case Op::add:
          put_u64(body, static_cast<uint64_t>(y.number));
          break;
      }
      break;
    case Status::timeout:
      put_keys(body, y.keys);
      break;
    case Status::error:
      put_bytes(body, y.message);
      break;
  }
  return finish_frame(body, "store.reply");
}

}  // namespace store_wire

}  // namespace dtrain::comm::net
