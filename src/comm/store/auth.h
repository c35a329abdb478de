// Job-secret authentication: HMAC-SHA256 challenge-response and random bytes (OpenSSL).
//
// The side that accepts a connection sends a fresh random challenge; the connecting side
// answers with HMAC-SHA256(secret, context || 0x00 || challenge). `context` names the protocol
// ("dtrain.store.v1", the TCP transport its own), so an answer captured on one protocol can
// never be replayed to another. Internal to dtrain_comm.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace dtrain::comm::auth {

constexpr size_t kChallengeBytes = 32;
constexpr size_t kMacBytes = 32;
using Challenge = std::array<uint8_t, kChallengeBytes>;
using Mac = std::array<uint8_t, kMacBytes>;

/// Fills `out` from OpenSSL's CSPRNG; throws dtrain::Error when it fails.
void random_bytes(uint8_t* out, size_t size);
Challenge make_challenge();

/// HMAC-SHA256(secret, context || 0x00 || challenge).
Mac answer_challenge(std::string_view secret, std::string_view context, const Challenge& challenge);

/// Constant-time check (CRYPTO_memcmp) of a received answer; false for a wrong size.
bool verify_answer(std::string_view secret, std::string_view context, const Challenge& challenge, const uint8_t* answer,
                   size_t size);

/// Lower-case hex of `size` bytes.
std::string to_hex(const uint8_t* data, size_t size);

}  // namespace dtrain::comm::auth
