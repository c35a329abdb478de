// Rendezvous: a small key-value store the ranks of a job meet at.
//
// TcpStore: served by the launcher or rank 0, binds to loopback unless told otherwise. Every
// connection authenticates with the per-job secret by HMAC-SHA256 challenge-response before
// any request is read; frames are length-prefixed and bounded (kMaxFrameBytes); an
// unauthenticated, malformed, oversized or truncated frame closes that connection only, and
// the server keeps serving the other clients. A host whose connections keep failing to
// authenticate gets its challenges slowly (a few guesses a second), and refusals are logged
// in one summary line per interval (src/comm/store/store_guard.h).
// FileStore: one file per key in a directory on a shared file system.
// MemoryStore: in-process, for ranks running as threads in tests.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "dtrain/comm/types.h"

namespace dtrain::comm {

class Store {
 public:
  virtual ~Store() = default;
  virtual void set(const std::string& key, const std::string& value) = 0;
  /// Waits until `key` exists (or throws CommError after `timeout`) and returns its value.
  virtual std::string get(const std::string& key, Duration timeout) = 0;
  /// Returns the value if present, without waiting.
  virtual std::optional<std::string> try_get(const std::string& key) = 0;
  /// Atomically adds `delta` to the integer stored at `key` (absent = 0); returns the new value.
  virtual int64_t add(const std::string& key, int64_t delta) = 0;
  /// Atomically sets `key` to `desired` if its value is `expected` (absent matches "");
  /// returns the value after the call.
  virtual std::string compare_set(const std::string& key, const std::string& expected, const std::string& desired) = 0;
  /// Waits until every key exists; throws CommError naming the missing keys after `timeout`.
  virtual void wait(const std::vector<std::string>& keys, Duration timeout) = 0;
};

std::shared_ptr<Store> make_memory_store();
std::shared_ptr<Store> make_file_store(const std::string& directory);

constexpr size_t kMaxFrameBytes = 16u << 20;

/// Serves a store over TCP until destroyed. port 0 picks a free port (see port()).
class TcpStoreServer {
 public:
  TcpStoreServer(const std::string& bind_address, uint16_t port, std::string secret);
  ~TcpStoreServer();
  TcpStoreServer(const TcpStoreServer&) = delete;
  TcpStoreServer& operator=(const TcpStoreServer&) = delete;
  uint16_t port() const;
  /// Connections refused so far (bad secret, malformed frames): for tests and logs.
  uint64_t rejected_connections() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// Connects (retrying until `timeout`) and authenticates; throws CommError on failure.
std::shared_ptr<Store> connect_tcp_store(const std::string& host, uint16_t port, const std::string& secret,
                                         Duration timeout);

/// A fresh random job secret: 32 bytes (256 bits) from OpenSSL's CSPRNG (RAND_bytes), as 64
/// hex digits.
std::string make_secret();

/// The job secret must carry at least 128 bits of entropy. Entropy cannot be measured from
/// one string, so this checks a floor that every random secret of 128 bits or more passes
/// (`openssl rand -hex 16` and up, `openssl rand -base64 24`, make_secret()) and that words,
/// short keys and hand-typed patterns fail: at least kMinSecretChars characters, at least
/// kMinSecretDistinct different ones, and not a shorter string repeated ("abcabc...").
/// Throws dtrain::Error naming `where` (who was given the secret), what is wrong with it
/// (never the secret itself) and how to make a good one. The TCP store's server and client,
/// the TCP transport and the launchers call it.
constexpr size_t kMinSecretChars = 32;
constexpr size_t kMinSecretDistinct = 6;
void check_secret(std::string_view secret, std::string_view where);

}  // namespace dtrain::comm
