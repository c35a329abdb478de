#include "store_guard.h"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <algorithm>
#include <chrono>
#include <cmath>

#include "../tcp/net.h"
#include "dtrain/core/log.h"

namespace dtrain::comm::store_guard {

namespace {

constexpr char kOtherHosts[] = "other hosts";

double seconds_between(Deadline from, Deadline to) { return std::chrono::duration<double>(to - from).count(); }

}  // namespace

std::string peer_host(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return "?";
  char text[INET6_ADDRSTRLEN] = "?";
  if (ss.ss_family == AF_INET) {
    ::inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(&ss)->sin_addr, text, sizeof(text));
    return text;
  }
  if (ss.ss_family == AF_INET6) {
    in6_addr a = reinterpret_cast<const sockaddr_in6*>(&ss)->sin6_addr;
    if (IN6_IS_ADDR_V4MAPPED(&a)) {
      ::inet_ntop(AF_INET, &a.s6_addr[12], text, sizeof(text));
      return text;
    }
    std::fill(a.s6_addr + 8, a.s6_addr + 16, 0);
    ::inet_ntop(AF_INET6, &a, text, sizeof(text));
    return std::string(text) + "/64";
  }
  return "?";
}

// ---- GreetingThrottle ----

double GreetingThrottle::score_at(const Host& h, Deadline now) {
  return std::max(0.0, h.score - kLeakPerSecond * std::max(0.0, seconds_between(h.updated, now)));
}

Duration GreetingThrottle::spacing_for(double score) {
  if (score <= kFreeFailures) return Duration::zero();
  const double doublings = std::floor((score - kFreeFailures) / kFreeFailures);
  const double ms = static_cast<double>(kBaseSpacing.count()) * std::exp2(std::min(doublings, 16.0));
  return std::min(kMaxSpacing, Duration(static_cast<int64_t>(ms)));
}

const GreetingThrottle::Host* GreetingThrottle::find(const std::string& host) const {
  auto it = hosts_.find(host);
  if (it == hosts_.end()) it = hosts_.find(kOtherHosts);
  return it == hosts_.end() ? nullptr : &it->second;
}

GreetingThrottle::Host& GreetingThrottle::entry(const std::string& host, Deadline now) {
  auto it = hosts_.find(host);
  if (it != hosts_.end()) return it->second;
  if (hosts_.size() >= kMaxHosts) {
    // Forget the hosts that were forgiven and greeted long enough ago to be greeted at once.
    std::erase_if(hosts_, [&](const auto& kv) {
      return kv.first != kOtherHosts && score_at(kv.second, now) == 0 && now - kv.second.last_greeting >= kMaxSpacing;
    });
  }
  if (hosts_.size() >= kMaxHosts) return hosts_[kOtherHosts];
  return hosts_[host];
}

void GreetingThrottle::failed(const std::string& host, Deadline now) {
  Host& h = entry(host, now);
  h.score = std::min(kMaxScore, score_at(h, now) + 1);
  h.updated = now;
}

bool GreetingThrottle::may_greet(const std::string& host, Deadline now) {
  if (hosts_.empty()) return true;
  auto it = hosts_.find(host);
  if (it == hosts_.end()) {
    if (hosts_.size() < kMaxHosts) return true;  // never failed
    it = hosts_.find(kOtherHosts);
    if (it == hosts_.end()) return true;
  }
  Host& h = it->second;
  if (now < h.last_greeting + spacing_for(score_at(h, now))) return false;
  h.last_greeting = now;
  return true;
}

Deadline GreetingThrottle::next_greeting(const std::string& host, Deadline now) const {
  const Host* h = find(host);
  if (h == nullptr) return now;
  return h->last_greeting + spacing_for(score_at(*h, now));
}

Duration GreetingThrottle::spacing(const std::string& host, Deadline now) const {
  const Host* h = find(host);
  return h == nullptr ? Duration::zero() : spacing_for(score_at(*h, now));
}

// ---- RejectionLog ----

void RejectionLog::add_shown(std::vector<std::string>& shown, bool& more, const std::string& item) {
  if (std::find(shown.begin(), shown.end(), item) != shown.end()) return;
  if (shown.size() < kShown) {
    shown.push_back(item);
  } else {
    more = true;
  }
}

void RejectionLog::note(const std::string& peer, const std::string& host, std::string_view reason, bool authenticating,
                        const std::string& throttled, Deadline now) {
  const std::string why = net::printable(reason, kMaxReasonChars);
  const bool pending = failed_ + bad_ > 0;
  if (!pending && (!wrote_ || now - last_line_ >= kLogInterval)) {
    DT_LOG_WARN("[comm] store {}: rejected {}: {} (further refusals within {} s are summarised in one line)", where_,
                peer, why, std::chrono::duration_cast<std::chrono::seconds>(kLogInterval).count());
    wrote_ = true;
    last_line_ = now;
    return;
  }
  ++(authenticating ? failed_ : bad_);
  add_shown(hosts_, more_hosts_, host);
  if (!throttled.empty()) add_shown(throttled_, more_throttled_, throttled);
  last_ = why;
}

void RejectionLog::flush(Deadline now, bool force) {
  if (failed_ + bad_ == 0 || (!force && now < next_flush())) return;
  std::string what;
  if (failed_ > 0) what = fmt::format("{} connection{} failed authentication", failed_, failed_ == 1 ? "" : "s");
  if (bad_ > 0) {
    what += fmt::format("{}{} authenticated connection{} sent malformed requests", what.empty() ? "" : " and ", bad_,
                        bad_ == 1 ? "" : "s");
  }
  std::string throttle;
  if (!throttled_.empty()) {
    throttle = fmt::format("; throttled: {}{}", fmt::join(throttled_, ", "), more_throttled_ ? " and others" : "");
  }
  DT_LOG_WARN("[comm] store {}: {} in the last {:.1f} s (from {}{}){}; last: {}", where_, what,
              seconds_between(last_line_, now), fmt::join(hosts_, ", "), more_hosts_ ? " and others" : "", throttle,
              last_);
  last_line_ = now;
  failed_ = bad_ = 0;
  hosts_.clear();
  throttled_.clear();
  more_hosts_ = more_throttled_ = false;
  last_.clear();
}

Deadline RejectionLog::next_flush() const { return failed_ + bad_ == 0 ? Deadline::max() : last_line_ + kLogInterval; }

}  // namespace dtrain::comm::store_guard
