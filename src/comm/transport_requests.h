// What the point-to-point transports share (internal to dtrain_comm): the part of a request
// every transport keeps, the table that issues and finds request ids, the texts that name
// pending requests, a guard against concurrent use, and the delivery of messages to self.
//
// A transport's request type derives from RequestBase and adds its framing state.
#pragma once

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <deque>
#include <string>
#include <unordered_map>
#include <vector>

#include "dtrain/comm/transport.h"

namespace dtrain::comm::transport_requests {

inline constexpr size_t kMaxListedInMessage = 8;

struct RequestBase {
  RequestId id = 0;
  bool is_send = false;
  int peer = -1;
  uint64_t tag = 0;
  char* data = nullptr;
  size_t bytes = 0;
  size_t done = 0;  // payload bytes moved
  bool complete = false;
};

/// "send to rank 1 (tag 5, 0 of 4096 bytes)".
inline std::string describe(const RequestBase& r) {
  return fmt::format("{} rank {} (tag {}, {} of {} bytes)", r.is_send ? "send to" : "recv from", r.peer, r.tag, r.done,
                     r.bytes);
}

/// The first kMaxListedInMessage requests, then how many more.
template <typename R>
std::string describe(const std::vector<R*>& pending) {
  std::string out;
  for (size_t i = 0; i < pending.size() && i < kMaxListedInMessage; ++i) {
    if (i > 0) out += "; ";
    out += describe(*pending[i]);
  }
  if (pending.size() > kMaxListedInMessage) out += fmt::format("; and {} more", pending.size() - kMaxListedInMessage);
  return out;
}

/// Requests complete roughly in order: resumes the scan where the last one stopped, so a wait
/// on thousands of requests costs O(1) per pass instead of O(n).
template <typename R>
bool all_complete(const std::vector<R*>& listed, size_t& cursor) {
  while (cursor < listed.size() && listed[cursor]->complete) ++cursor;
  return cursor == listed.size();
}

template <typename R>
std::vector<R*> pending_of(const std::vector<R*>& listed) {
  std::vector<R*> pending;
  for (R* r : listed) {
    if (!r->complete) pending.push_back(r);
  }
  return pending;
}

/// The peers of `pending`, sorted, each once.
template <typename R>
std::vector<int> peers_of(const std::vector<R*>& pending) {
  std::vector<int> peers;
  peers.reserve(pending.size());
  for (const R* r : pending) peers.push_back(r->peer);
  std::sort(peers.begin(), peers.end());
  peers.erase(std::unique(peers.begin(), peers.end()), peers.end());
  return peers;
}

/// TransportError timeout naming the peers of the listed requests still pending.
template <typename R>
[[noreturn]] void throw_timeout(const char* kind, int rank, const std::vector<R*>& listed, Clock::duration waited) {
  const auto pending = pending_of(listed);
  std::vector<int> peers = peers_of(pending);
  throw TransportError(TransportError::Kind::timeout, peers,
                       fmt::format("{}: rank {} timed out after {} ms waiting for rank(s) {}: {}", kind, rank,
                                   std::chrono::duration_cast<std::chrono::milliseconds>(waited).count(),
                                   fmt::join(peers, ", "), describe(pending)),
                       __FILE__, __LINE__);
}

/// Issues request ids and owns the requests until a wait reaps them. Node-based: R* stay valid.
template <typename R>
class RequestTable {
 public:
  RequestTable(const char* kind, int rank, int size) : kind_(kind), rank_(rank), size_(size) {}

  /// A new request; throws naming `op` for a peer outside the group or a null buffer.
  R& add(const char* op, bool is_send, int peer, uint64_t tag, void* data, size_t bytes) {
    if (peer < 0 || peer >= size_) {
      DT_THROW("comm", "{} {}: peer {} out of range (rank {} of a group of {})", kind_, op, peer, rank_, size_);
    }
    if (data == nullptr && bytes != 0) {
      DT_THROW("comm", "{} {}: null buffer for {} bytes to/from rank {}", kind_, op, bytes, peer);
    }
    const RequestId id = next_id_++;
    R& r = map_[id];
    r.id = id;
    r.is_send = is_send;
    r.peer = peer;
    r.tag = tag;
    r.data = static_cast<char*>(data);
    r.bytes = bytes;
    return r;
  }

  /// The requests `ids` names that a wait has not reaped yet; throws for an id never issued.
  std::vector<R*> find(const std::vector<RequestId>& ids) {
    std::vector<R*> listed;
    listed.reserve(ids.size());
    for (RequestId id : ids) {
      auto it = map_.find(id);
      if (it != map_.end()) {
        listed.push_back(&it->second);
      } else if (id == 0 || id >= next_id_) {
        DT_THROW("comm", "{} wait: unknown request id {} (rank {} issued ids 1..{})", kind_, id, rank_, next_id_ - 1);
      }  // else: completed and reaped by an earlier wait
    }
    return listed;
  }

  void reap(const std::vector<R*>& listed) {
    for (R* r : listed) map_.erase(r->id);
  }

 private:
  const char* kind_;
  int rank_;
  int size_;
  std::unordered_map<RequestId, R> map_;
  RequestId next_id_ = 1;
};

/// Rejects concurrent post/wait calls on one transport instead of corrupting its queues.
class UseGuard {
 public:
  UseGuard(std::atomic<bool>& flag, const char* kind) : flag_(flag) {
    if (flag_.exchange(true, std::memory_order_acquire)) {
      DT_THROW("comm", "{} transport used by two threads at once (post_send/post_recv/wait must be serialized)", kind);
    }
  }
  ~UseGuard() { flag_.store(false, std::memory_order_release); }
  UseGuard(const UseGuard&) = delete;
  UseGuard& operator=(const UseGuard&) = delete;

 private:
  std::atomic<bool>& flag_;
};

/// Messages to self: matched in order and copied directly; true if any completed. A tag or
/// size mismatch throws TransportError protocol naming both.
template <typename R>
bool deliver_to_self(const char* kind, int rank, std::deque<R*>& sends, std::deque<R*>& recvs) {
  bool moved = false;
  while (!sends.empty() && !recvs.empty()) {
    R& s = *sends.front();
    R& r = *recvs.front();
    if (s.tag != r.tag || s.bytes != r.bytes) {
      throw TransportError(TransportError::Kind::protocol, {rank},
                           fmt::format("{}: rank {} sent tag {} ({} bytes) to itself but expected tag {} ({} bytes)",
                                       kind, rank, s.tag, s.bytes, r.tag, r.bytes),
                           __FILE__, __LINE__);
    }
    if (s.bytes != 0) std::memcpy(r.data, s.data, s.bytes);
    s.done = r.done = s.bytes;
    s.complete = r.complete = true;
    sends.pop_front();
    recvs.pop_front();
    moved = true;
  }
  return moved;
}

}  // namespace dtrain::comm::transport_requests
