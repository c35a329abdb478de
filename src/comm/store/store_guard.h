// The TCP store server's defences against guessing the job secret and against floods of bad
// connections. Internal to dtrain_comm; used by the server thread only (not thread-safe).
//
// Vocabulary. A *failure* is a connection refused before it authenticated: a wrong answer, no
// answer in time, data before the greeting or the answer, a close. (A connection refused for
// want of room is the server's load, not its host's doing: logged, not charged.) Failures
// are charged to the peer's *host*: its IPv4 address, or the /64 prefix of an IPv6 one (one
// machine usually holds a whole /64). A host's *score* counts its failures and leaks
// kLeakPerSecond a second, and is capped at kMaxScore, so that a host is forgiven within a
// minute of its last failure. While the score is above kFreeFailures the host is *throttled*:
// the server greets at most one of its connections per *spacing* (kBaseSpacing, doubled for
// each further kFreeFailures of score, at most kMaxSpacing); its other connections wait,
// unanswered, in the order they arrived. Only a greeting carries a challenge, and an answer is
// good for that one challenge, so a host makes at most one guess per spacing however many
// connections it opens and whether or not it waits for the verdicts. Other hosts, and
// connections that already authenticated (the ranks' requests and heartbeats), are never held
// back; a rank on a throttled host waits for the connections ahead of it.
//
// RejectionLog: every refusal (failures, and authenticated clients sending malformed frames)
// is counted; the first one after a quiet interval is written in full, the others in one
// summary line per kLogInterval. Text that a peer can influence is truncated.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "dtrain/comm/types.h"

namespace dtrain::comm::store_guard {

constexpr double kFreeFailures = 10;
constexpr double kLeakPerSecond = 1;
constexpr double kMaxScore = 60;
constexpr Duration kBaseSpacing{100};
constexpr Duration kMaxSpacing{1000};
constexpr size_t kMaxHosts = 4096;         // tracked hosts; the rest share one entry
constexpr size_t kMaxWaitingPerHost = 32;  // connections of one host waiting for their greeting
constexpr Duration kLogInterval{5000};
constexpr size_t kMaxReasonChars = 120;

/// The host key of the peer of a connected socket ("10.0.0.2", "2001:db8:1:2::/64"; "?").
std::string peer_host(int fd);

class GreetingThrottle {
 public:
  /// Charges one failure to `host`.
  void failed(const std::string& host, Deadline now);
  /// True when a connection of `host` may be greeted now; then it counts as greeted.
  bool may_greet(const std::string& host, Deadline now);
  /// When a connection of `host` may be greeted next (now or earlier when not throttled).
  Deadline next_greeting(const std::string& host, Deadline now) const;
  /// The spacing of `host`'s greetings, zero when it is not throttled.
  Duration spacing(const std::string& host, Deadline now) const;

 private:
  struct Host {
    double score = 0;
    Deadline updated{};
    Deadline last_greeting{};
  };
  static double score_at(const Host& h, Deadline now);
  static Duration spacing_for(double score);
  Host& entry(const std::string& host, Deadline now);
  const Host* find(const std::string& host) const;

  std::unordered_map<std::string, Host> hosts_;
};

class RejectionLog {
 public:
  RejectionLog() = default;
  explicit RejectionLog(std::string where) : where_(std::move(where)) {}
  /// Records one refused connection; `throttled` describes its host's throttle ("" if none).
  void note(const std::string& peer, const std::string& host, std::string_view reason, bool authenticating,
            const std::string& throttled, Deadline now);
  /// Writes the summary once its interval is over, or at once with `force` (the server stops).
  void flush(Deadline now, bool force = false);
  /// When flush() has a summary to write; Deadline::max() when none is pending.
  Deadline next_flush() const;

 private:
  static constexpr size_t kShown = 3;  // hosts named in a summary
  static void add_shown(std::vector<std::string>& shown, bool& more, const std::string& item);

  std::string where_;
  bool wrote_ = false;
  Deadline last_line_{};
  uint64_t failed_ = 0;  // connections that failed authentication since the last line
  uint64_t bad_ = 0;     // authenticated connections refused (malformed frames)
  std::vector<std::string> hosts_, throttled_;
  bool more_hosts_ = false, more_throttled_ = false;
  std::string last_;
};

}  // namespace dtrain::comm::store_guard
