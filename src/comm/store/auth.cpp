#include "auth.h"

#include <openssl/crypto.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <climits>
#include <vector>

#include "dtrain/comm/store.h"
#include "dtrain/core/error.h"

namespace dtrain::comm::auth {

void random_bytes(uint8_t* out, size_t size) {
  DT_CHECK(size <= static_cast<size_t>(INT_MAX), "comm", "random_bytes: {} bytes is too many", size);
  if (size == 0) return;
  if (RAND_bytes(out, static_cast<int>(size)) != 1) {
    DT_THROW("comm", "RAND_bytes failed: {}", ERR_error_string(ERR_get_error(), nullptr));
  }
}

Challenge make_challenge() {
  Challenge c;
  random_bytes(c.data(), c.size());
  return c;
}

Mac answer_challenge(std::string_view secret, std::string_view context, const Challenge& challenge) {
  std::vector<uint8_t> message(context.begin(), context.end());
  message.push_back(0);
  message.insert(message.end(), challenge.begin(), challenge.end());
  Mac mac{};
  unsigned int mac_len = 0;
  DT_CHECK(secret.size() <= static_cast<size_t>(INT_MAX), "comm", "job secret too long");
  const unsigned char* ok = HMAC(EVP_sha256(), secret.data(), static_cast<int>(secret.size()), message.data(),
                                 message.size(), mac.data(), &mac_len);
  DT_CHECK(ok != nullptr && mac_len == kMacBytes, "comm", "HMAC-SHA256 failed: {}",
           ERR_error_string(ERR_get_error(), nullptr));
  return mac;
}

bool verify_answer(std::string_view secret, std::string_view context, const Challenge& challenge, const uint8_t* answer,
                   size_t size) {
  if (size != kMacBytes) return false;
  const Mac expected = answer_challenge(secret, context, challenge);
  return CRYPTO_memcmp(expected.data(), answer, kMacBytes) == 0;
}

std::string to_hex(const uint8_t* data, size_t size) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out;
  out.reserve(2 * size);
  for (size_t i = 0; i < size; ++i) {
    out.push_back(kDigits[data[i] >> 4]);
    out.push_back(kDigits[data[i] & 0xf]);
  }
  return out;
}

}  // namespace dtrain::comm::auth

namespace dtrain::comm {

std::string make_secret() {
  uint8_t bytes[32];
  auth::random_bytes(bytes, sizeof(bytes));
  return auth::to_hex(bytes, sizeof(bytes));
}

namespace {

// What makes `secret` fail the rule of check_secret, or "" when it passes. Never quotes it.
//
// Why these numbers: 32 random hex digits are 128 bits. Fewer than 6 different characters
// among 32 random hex digits happens with probability 1e-16, a smallest period of at most half
// the length (for 32 characters) 1e-19; a word, "aaaa..." or "abcabc..." fails at once.
std::string secret_weakness(std::string_view s) {
  if (s.empty()) return "it is empty";
  if (s.size() < kMinSecretChars) {
    return fmt::format("it has {} character{}, fewer than {}", s.size(), s.size() == 1 ? "" : "s", kMinSecretChars);
  }
  bool seen[256] = {};
  size_t distinct = 0;
  for (const char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    if (!seen[c]) ++distinct;
    seen[c] = true;
  }
  if (distinct < kMinSecretDistinct) {
    return fmt::format("it uses only {} different character{}, fewer than {}", distinct, distinct == 1 ? "" : "s",
                       kMinSecretDistinct);
  }
  // The smallest period, from the prefix function (border lengths): n - border(n).
  std::vector<size_t> border(s.size(), 0);
  for (size_t i = 1; i < s.size(); ++i) {
    size_t k = border[i - 1];
    while (k > 0 && s[i] != s[k]) k = border[k - 1];
    if (s[i] == s[k]) ++k;
    border[i] = k;
  }
  const size_t period = s.size() - border.back();
  if (2 * period <= s.size()) return fmt::format("it repeats its first {} characters", period);
  return "";
}

}  // namespace

void check_secret(std::string_view secret, std::string_view where) {
  const std::string why = secret_weakness(secret);
  if (why.empty()) return;
  DT_THROW("comm",
           "{}: the job secret is too weak: {}. A job secret needs at least 128 bits of entropy; dtrain asks for at "
           "least {} characters, {} different ones, not a shorter string repeated, and it should be random. Make one "
           "with: export DTRAIN_SECRET=$(openssl rand -hex 32)",
           where, why, kMinSecretChars, kMinSecretDistinct);
}

}  // namespace dtrain::comm
