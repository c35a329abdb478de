// Wire format of the TCP transport (internal to dtrain_comm; tests use it to play a bad peer).
//
// Rendezvous: each rank listens and publishes "host:port" under address_key(prefix, rank).
// Rank c dials every rank a > c; the handshake authenticates both ends with the job secret
// (../store/auth.h) and fixes who is who (integers little-endian):
//   a -> c  greeting  "DTRT" | u8 kVersion | u32 rank a | u32 group size | 32-byte challenge_a
//   c -> a  hello     u32 rank c | HMAC(secret, connect_context(c, a), challenge_a) | 32-byte challenge_c
//   a -> c  verdict   u8 kAccepted | HMAC(secret, accept_context(a, c), challenge_c)
//                  or u8 kRefused  | u32 length | reason (at most kMaxRefusalBytes)
// The two contexts differ, and name both ranks, the group size and the group's prefix, so an
// answer can be neither reflected back to its author nor replayed for another pair or group.
//
// Then each direction carries frames: a kHeaderBytes header {u8 kind, u64 tag, u64 bytes}
// followed by `bytes` bytes of payload.
//   data     one message: the sender's tag and byte count, payload = the message
//   abort    tag = the rank that aborted first, payload = its reason (at most kMaxReasonBytes)
//   goodbye  the sender closed its transport; nothing follows (tag = bytes = 0)
#pragma once

#include <fmt/format.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "../store/auth.h"
#include "net.h"

namespace dtrain::comm::tcp_wire {

inline constexpr char kMagic[4] = {'D', 'T', 'R', 'T'};
inline constexpr uint8_t kVersion = 1;
inline constexpr size_t kGreetingBytes = 4 + 1 + 4 + 4 + auth::kChallengeBytes;
inline constexpr size_t kHelloBytes = 4 + auth::kMacBytes + auth::kChallengeBytes;
inline constexpr uint8_t kAccepted = 1;
inline constexpr uint8_t kRefused = 0;
inline constexpr uint32_t kMaxRefusalBytes = 512;

inline constexpr size_t kHeaderBytes = 1 + 8 + 8;
inline constexpr uint64_t kMaxReasonBytes = 1024;
enum class FrameKind : uint8_t { data = 1, abort = 2, goodbye = 3 };

/// The store key under which `rank` publishes its "host:port".
inline std::string address_key(const std::string& prefix, int rank) {
  return fmt::format("{}/tcp/addr/{}", prefix, rank);
}

/// What the dialling rank `from` proves to `to`, and what `to` proves back.
inline std::string connect_context(const std::string& prefix, int from, int to, int size) {
  return fmt::format("dtrain.tcp.v1 connect {}->{} of {} in {}", from, to, size, prefix);
}
inline std::string accept_context(const std::string& prefix, int to, int from, int size) {
  return fmt::format("dtrain.tcp.v1 accept {}<-{} of {} in {}", to, from, size, prefix);
}

struct FrameHeader {
  uint8_t kind = 0;  // a FrameKind, unchecked
  uint64_t tag = 0;
  uint64_t bytes = 0;
};

inline void encode_header(uint8_t* out, FrameKind kind, uint64_t tag, uint64_t bytes) {
  out[0] = static_cast<uint8_t>(kind);
  net::store_u64(out + 1, tag);
  net::store_u64(out + 9, bytes);
}

inline FrameHeader decode_header(const uint8_t* in) { return {in[0], net::load_u64(in + 1), net::load_u64(in + 9)}; }

}  // namespace dtrain::comm::tcp_wire
