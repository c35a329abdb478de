// The TCP store's wire protocol (internal to dtrain_comm): requests and replies as frames,
// encoded and decoded strictly, over net.h's little-endian encoding. The server and the client
// are tcp_store.cpp; fuzz/store_frame_fuzz.cpp fuzzes the decoders.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace dtrain::comm::net {

// After the handshake (server greeting kGreetingMagic, version, 32-byte challenge; client
// answer HMAC; server verdict byte kAuthAccepted) both sides exchange frames:
//   frame   = u32 body_length (1..kMaxFrameBytes) + body
//   request = u8 opcode + fields     reply = u8 status + fields
// strings are u32 length + bytes, integers are little-endian u64 (i64 as two's complement).
//   set         key, value                  -> ok
//   get         key, u64 timeout_ms         -> ok value | timeout [keys]
//   try_get     key                         -> ok u8 present (0|1) [value]
//   add         key, i64 delta              -> ok i64 | error message
//   compare_set key, expected, desired      -> ok value
//   wait        u64 timeout_ms, u32 n, n x key -> ok | timeout [missing keys]   (n <= kMaxWaitKeys)
// Decoding is strict: unknown opcodes, lengths past the end and trailing bytes are errors,
// so encode(decode(frame)) == frame for every accepted frame.
namespace store_wire {

inline constexpr char kGreetingMagic[4] = {'D', 'T', 'R', 'S'};
inline constexpr uint8_t kVersion = 1;
inline constexpr size_t kGreetingBytes = 4 + 1 + 32;
inline constexpr uint8_t kAuthAccepted = 1;
inline constexpr uint8_t kAuthRefused = 0;
inline constexpr std::string_view kAuthContext = "dtrain.store.v1";
/// Bounds the memory a wait frame can make the decoder allocate (32 bytes per key object).
inline constexpr uint32_t kMaxWaitKeys = 1u << 16;

enum class Op : uint8_t { set = 1, get = 2, try_get = 3, add = 4, compare_set = 5, wait = 6 };
enum class Status : uint8_t { ok = 0, timeout = 1, error = 2 };
const char* op_name(Op op);

struct Request {
  Op op = Op::set;
  std::string key;
  std::string value;              // set: value; compare_set: expected
  std::string desired;            // compare_set
  int64_t delta = 0;              // add
  uint64_t timeout_ms = 0;        // get, wait
  std::vector<std::string> keys;  // wait
};

struct Reply {
  Status status = Status::ok;
  std::string value;              // get, compare_set; try_get when present
  bool present = false;           // try_get
  int64_t number = 0;             // add
  std::vector<std::string> keys;  // timeout: the keys still missing
  std::string message;            // error
};

enum class Decode { ok, incomplete, error };

struct RequestDecode {
  Decode status = Decode::incomplete;
  size_t consumed = 0;  // bytes of the frame (prefix included) when ok
  Request request;
  std::string error;
};

/// Decodes the first frame in `data`: ok (with the bytes it took), incomplete (a prefix of a
/// possibly valid frame) or error (no continuation can make it valid). Never throws except
/// std::bad_alloc.
RequestDecode decode_request_frame(const uint8_t* data, size_t size);
/// The frame (length prefix included); throws CommError when it exceeds kMaxFrameBytes.
std::string encode_request_frame(const Request& request);

struct ReplyDecode {
  bool ok = false;
  Reply reply;
  std::string error;
};
/// Decodes a reply body (without its length prefix) to a request of type `op`.
ReplyDecode decode_reply_body(Op op, const uint8_t* data, size_t size);
/// The frame (length prefix included); throws CommError when it exceeds kMaxFrameBytes.
std::string encode_reply_frame(Op op, const Reply& reply);

}  // namespace store_wire

}  // namespace dtrain::comm::net
