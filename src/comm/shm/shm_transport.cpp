// Shared-memory transport between the ranks of one host (processes or threads).
//
// Vocabulary. The segment (shm_segment.h) holds one ring per ordered pair of ranks; seen from
// a rank, the ring it writes to peer p is p's *out channel* and the ring p writes to it is p's
// *in channel*. A ring position counts bytes ever written (head, producer only) or consumed
// (tail, consumer only); both are monotonic u64, the ring index is position & (ring_bytes - 1).
// A *frame* is a 16-byte header {tag, bytes} followed by the payload; frames start on a 64-byte
// boundary (the *pad* after a payload is skipped by both sides), so a header never wraps and a
// small message shares one cache line with its header. A payload streams through the ring in
// *pieces* of at most kChunkBytes: a *step* moves one piece of the request at the front of a
// channel's FIFO queue and publishes the new head/tail; a *pass* steps every channel once.
//
// wait() runs passes over ALL queued requests (not just the listed ones) until the listed ones
// completed, so two ranks streaming large messages at each other always drain each other's
// rings. When a pass moves nothing it spins (pause, later also sched_yield) for kSpinIterations
// passes, then sleeps on its own futex word for at most kMaxSleep. Writers bump and FUTEX_WAKE
// that word only if its owner announced a sleep (RankSlot::sleepers), so the fast path makes no
// system call:
//   sleeper: seq = futex; sleepers++ (full barrier); re-run a pass; futex_wait(seq)
//   writer:  store head/tail (release); full fence; if sleepers: futex++, FUTEX_WAKE
// Either the sleeper's pass sees the new position or the writer sees the sleeper (Dekker).
//
// Threads: post_send/post_recv/wait must not run concurrently on one transport (a concurrent
// call throws); abort() may be called from any thread.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sched.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <deque>
#include <exception>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "../transport_requests.h"
#include "dtrain/comm/copy.h"
#include "dtrain/comm/store.h"
#include "dtrain/comm/transport.h"
#include "shm_collectives.h"
#include "shm_segment.h"

namespace dtrain::comm {

namespace {

using shm::cpu_relax;
using shm::Segment;
using transport_requests::all_complete;
using transport_requests::deliver_to_self;
using transport_requests::describe;
using transport_requests::peers_of;
using transport_requests::pending_of;
using transport_requests::throw_timeout;
using transport_requests::UseGuard;

constexpr size_t kHeaderBytes = 16;
constexpr size_t kFrameAlign = 64;
constexpr size_t kChunkBytes = size_t{64} << 10;  // a piece: ~20 us of memcpy, so the reader rarely sleeps
constexpr int kSpinIterations = 2000;
constexpr int kClockEvery = 64;   // passes between clock reads while spinning
constexpr int kYieldAfter = 256;  // idle passes of pure spinning before yielding too
constexpr int kYieldEvery = 16;   // then sched_yield every kYieldEvery idle passes
constexpr Duration kMaxSleep{20};
constexpr auto kLivenessPeriod = std::chrono::milliseconds(5);

struct FrameHeader {
  uint64_t tag;
  uint64_t bytes;
};
static_assert(sizeof(FrameHeader) == kHeaderBytes);

struct Request : transport_requests::RequestBase {
  bool header_done = false;  // header written (send) or read and matched (recv)
};
// One direction of one pair, seen from this rank.
struct Channel {
  shm::RingCtl* ctl = nullptr;
  char* data = nullptr;
  uint64_t pos = 0;    // our head (out) or tail (in); we are its only writer
  uint64_t other = 0;  // last tail (out) or head (in) read from the other side
  uint64_t pad = 0;    // bytes to skip before the next frame
  std::deque<Request*> queue;
};

struct Peer {
  Channel out;
  Channel in;
};

class ShmTransport final : public Transport {
 public:
  ShmTransport(Segment segment, int rank, int size, std::chrono::microseconds spin)
      : seg_(std::move(segment)),
        rank_(rank),
        size_(size),
        cap_(seg_.ring_bytes()),
        mask_(seg_.ring_bytes() - 1),
        peers_(static_cast<size_t>(size)),
        requests_("shm", rank, size),
        collectives_(seg_, rank, size, [this] { check_abort(); }),
        spin_(spin) {
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) continue;
      Peer& peer = peers_[static_cast<size_t>(p)];
      peer.out.ctl = &seg_.ring_ctl(rank_, p);
      peer.out.data = seg_.ring_data(rank_, p);
      peer.in.ctl = &seg_.ring_ctl(p, rank_);
      peer.in.data = seg_.ring_data(p, rank_);
    }
  }

  ~ShmTransport() override {
    // Peers blocked on this rank notice at once instead of at their deadline.
    seg_.rank(rank_).departed.store(1, std::memory_order_release);
    for (int p = 0; p < size_; ++p) {
      if (p != rank_) shm::futex_wake_all(seg_.rank(p).futex);
    }
  }

  ShmTransport(const ShmTransport&) = delete;
  ShmTransport& operator=(const ShmTransport&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  TransportKind kind() const override { return TransportKind::shm; }
  DirectCollectives* direct() override { return &collectives_; }
  MappedCollectives* mapped() override { return &collectives_; }

  RequestId post_send(int peer, uint64_t tag, const void* data, size_t bytes) override {
    UseGuard guard(in_use_, "shm");
    Request& r = requests_.add("post_send", true, peer, tag, const_cast<void*>(data), bytes);
    if (peer == rank_) {
      self_sends_.push_back(&r);
    } else {
      Channel& c = peers_[static_cast<size_t>(peer)].out;
      c.queue.push_back(&r);
      // Eagerly start the send: the peer can read a small message before we even wait.
      if (c.queue.size() == 1 && step_send(peer, c, r) && r.complete) c.queue.pop_front();
    }
    return r.id;
  }

  RequestId post_recv(int peer, uint64_t tag, void* data, size_t bytes) override {
    UseGuard guard(in_use_, "shm");
    Request& r = requests_.add("post_recv", false, peer, tag, data, bytes);
    (peer == rank_ ? self_recvs_ : peers_[static_cast<size_t>(peer)].in.queue).push_back(&r);
    return r.id;
  }

  void wait(const std::vector<RequestId>& ids, Deadline deadline) override {
    UseGuard guard(in_use_, "shm");
    if (broken_) std::rethrow_exception(broken_);
    const std::vector<Request*> listed = requests_.find(ids);
    try {
      drive(listed, deadline);
    } catch (const TransportError& e) {
      // A timeout leaves the requests queued; anything else means the streams are unusable.
      if (e.kind() != TransportError::Kind::timeout) broken_ = std::current_exception();
      throw;
    }
    requests_.reap(listed);
  }

  bool test(const std::vector<RequestId>& ids) override {
    UseGuard guard(in_use_, "shm");
    if (broken_) std::rethrow_exception(broken_);
    const std::vector<Request*> listed = requests_.find(ids);
    size_t cursor = 0;
    try {
      check_abort();
      pass();
      if (!all_complete(listed, cursor)) {
        const auto now = Clock::now();
        if (now - last_test_liveness_ < kLivenessPeriod) return false;
        last_test_liveness_ = now;
        check_liveness(listed);
        if (!all_complete(listed, cursor)) return false;
      }
    } catch (const TransportError&) {
      broken_ = std::current_exception();
      throw;
    }
    requests_.reap(listed);
    return true;
  }

  void abort(const std::string& reason) override {
    shm::SegmentHeader& h = seg_.header();
    uint32_t expected = shm::kNotAborted;
    if (h.abort_state.compare_exchange_strong(expected, shm::kAbortWriting, std::memory_order_acq_rel)) {
      h.abort_rank = rank_;
      const size_t n = std::min(reason.size(), shm::kAbortReasonBytes - 1);
      std::memcpy(h.abort_reason, reason.data(), n);
      h.abort_reason[n] = '\0';
      h.abort_state.store(shm::kAbortPublished, std::memory_order_release);
    }
    for (int p = 0; p < size_; ++p) shm::futex_wake_all(seg_.rank(p).futex);
  }

 private:
  // The progress loop of wait(): pass, spin, sleep, with the failure checks in between.
  void drive(const std::vector<Request*>& listed, Deadline deadline) {
    const auto start = Clock::now();
    bool slept = false;  // after a sleep, only the brief default spin
    auto last_liveness = start;
    size_t cursor = 0;
    int idle = 0;  // passes in a row that moved nothing
    for (uint64_t iteration = 1;; ++iteration) {
      check_abort();
      const bool moved = pass();
      if (all_complete(listed, cursor)) return;
      idle = moved ? 0 : idle + 1;
      // The clock is read every kClockEvery passes, moving or not, so a deadline always fires.
      Clock::time_point now{};
      if (iteration % kClockEvery == 0 || idle >= kSpinIterations) {
        now = Clock::now();
        if (now >= deadline) throw_timeout("shm", rank_, listed, now - start);
        if (now - last_liveness >= kLivenessPeriod) {
          check_liveness(listed);
          last_liveness = now;
          if (all_complete(listed, cursor)) return;
        }
      }
      if (idle == 0) continue;
      // Spin for kSpinIterations idle passes, and until spin_ since the wait began.
      if (idle < kSpinIterations || (!slept && now - start < spin_)) {
        // After the first microseconds, also let a rank that shares our core run (threads, or
        // more ranks than cores); on an otherwise idle core sched_yield returns at once.
        if (idle >= kYieldAfter && idle % kYieldEvery == 0) {
          ::sched_yield();
        } else {
          cpu_relax();
        }
        continue;
      }
      idle = 0;
      sleep(listed, cursor, std::min<Duration>(kMaxSleep, std::chrono::ceil<Duration>(deadline - now)));
      slept = true;
    }
  }

  // Announces the sleep, re-checks the rings, then sleeps on the futex unless woken already.
  void sleep(const std::vector<Request*>& listed, size_t& cursor, Duration timeout) {
    shm::RankSlot& slot = seg_.rank(rank_);
    const uint32_t seq = slot.futex.load(std::memory_order_acquire);
    const shm::SleepAnnouncement announce(slot);
    check_abort();
    if (pass() || all_complete(listed, cursor)) return;
    shm::futex_wait(slot.futex, seq, timeout);
  }

  bool pass() {
    bool moved = !self_sends_.empty() && deliver_to_self("shm", rank_, self_sends_, self_recvs_);
    for (int k = 1; k < size_; ++k) {
      const int p = (rank_ + k) % size_;
      Peer& peer = peers_[static_cast<size_t>(p)];
      if (!peer.out.queue.empty()) moved |= drive_channel(p, peer.out, true);
      if (!peer.in.queue.empty()) moved |= drive_channel(p, peer.in, false);
    }
    return moved;
  }

  bool drive_channel(int peer, Channel& c, bool is_send) {
    bool moved = false;
    while (!c.queue.empty()) {
      Request& r = *c.queue.front();
      if (!(is_send ? step_send(peer, c, r) : step_recv(peer, c, r))) break;
      moved = true;
      if (!r.complete) break;  // one piece per request per pass keeps the channels fair
      c.queue.pop_front();
    }
    return moved;
  }

  // Free bytes in an out channel; re-reads the consumer's tail only when the cache is short.
  size_t free_bytes(Channel& c, size_t want) {
    size_t free = cap_ - static_cast<size_t>(c.pos - c.other);
    if (free < want) {
      c.other = c.ctl->tail.load(std::memory_order_acquire);
      free = cap_ - static_cast<size_t>(c.pos - c.other);
    }
    return free;
  }

  // Readable bytes in an in channel; re-reads the producer's head only when the cache is short.
  size_t readable_bytes(Channel& c, size_t want) {
    size_t avail = static_cast<size_t>(c.other - c.pos);
    if (avail < want) {
      c.other = c.ctl->head.load(std::memory_order_acquire);
      avail = static_cast<size_t>(c.other - c.pos);
    }
    return avail;
  }

  void copy_to_ring(char* ring, uint64_t pos, const char* src, size_t n) const {
    const size_t off = static_cast<size_t>(pos) & mask_;
    const size_t first = std::min(n, cap_ - off);
    copy_bytes(ring + off, src, first);
    if (n > first) copy_bytes(ring, src + first, n - first);
  }

  void copy_from_ring(char* dst, const char* ring, uint64_t pos, size_t n) const {
    const size_t off = static_cast<size_t>(pos) & mask_;
    const size_t first = std::min(n, cap_ - off);
    copy_bytes(dst, ring + off, first);
    if (n > first) copy_bytes(dst + first, ring, n - first);
  }

  // Moves at most one piece of `r` into the ring; true if the head moved.
  bool step_send(int peer, Channel& c, Request& r) {
    const uint64_t start = c.pos;
    bool blocked = false;
    if (c.pad != 0) {
      if (free_bytes(c, c.pad) >= c.pad) {
        c.pos += c.pad;
        c.pad = 0;
      } else {
        blocked = true;
      }
    }
    if (!blocked && !r.header_done) {
      if (free_bytes(c, kHeaderBytes) >= kHeaderBytes) {
        const FrameHeader h{r.tag, r.bytes};
        std::memcpy(c.data + (c.pos & mask_), &h, kHeaderBytes);
        c.pos += kHeaderBytes;
        r.header_done = true;
      } else {
        blocked = true;
      }
    }
    if (!blocked && r.done < r.bytes) {
      const size_t want = std::min(r.bytes - r.done, kChunkBytes);
      const size_t n = std::min(want, free_bytes(c, want));
      copy_to_ring(c.data, c.pos, r.data + r.done, n);
      c.pos += n;
      r.done += n;
    }
    if (!blocked && r.done == r.bytes) {
      r.complete = true;
      const size_t pad = static_cast<size_t>(-c.pos) & (kFrameAlign - 1);
      if (pad != 0 && free_bytes(c, pad) >= pad) {
        c.pos += pad;
      } else {
        c.pad = pad;
      }
    }
    if (c.pos == start) return false;
    c.ctl->head.store(c.pos, std::memory_order_release);
    notify(peer);
    return true;
  }

  // Moves at most one piece of the next message from the ring into `r`; true if the tail moved.
  bool step_recv(int peer, Channel& c, Request& r) {
    const uint64_t start = c.pos;
    bool blocked = false;
    if (c.pad != 0) {
      if (readable_bytes(c, c.pad) >= c.pad) {
        c.pos += c.pad;
        c.pad = 0;
      } else {
        blocked = true;
      }
    }
    if (!blocked && !r.header_done) {
      if (readable_bytes(c, kHeaderBytes) >= kHeaderBytes) {
        FrameHeader h{};
        std::memcpy(&h, c.data + (c.pos & mask_), kHeaderBytes);
        if (h.tag != r.tag || h.bytes != r.bytes) {
          publish_tail(peer, c, start);
          throw TransportError(TransportError::Kind::protocol, {peer},
                               fmt::format("shm: rank {} sent tag {} ({} bytes) but rank {} expected tag {} ({} bytes)",
                                           peer, h.tag, h.bytes, rank_, r.tag, r.bytes),
                               __FILE__, __LINE__);
        }
        c.pos += kHeaderBytes;
        r.header_done = true;
      } else {
        blocked = true;
      }
    }
    if (!blocked && r.done < r.bytes) {
      const size_t want = std::min(r.bytes - r.done, kChunkBytes);
      const size_t n = std::min(want, readable_bytes(c, want));
      copy_from_ring(r.data + r.done, c.data, c.pos, n);
      c.pos += n;
      r.done += n;
    }
    if (!blocked && r.done == r.bytes) {
      r.complete = true;
      const size_t pad = static_cast<size_t>(-c.pos) & (kFrameAlign - 1);
      if (pad != 0 && readable_bytes(c, pad) >= pad) {
        c.pos += pad;
      } else {
        c.pad = pad;
      }
    }
    return publish_tail(peer, c, start);
  }

  bool publish_tail(int peer, Channel& c, uint64_t start) {
    if (c.pos == start) return false;
    c.ctl->tail.store(c.pos, std::memory_order_release);
    notify(peer);
    return true;
  }

  // Wakes `peer` if it announced a sleep (see the file comment for why the fence is needed).
  void notify(int peer) {
    std::atomic_thread_fence(std::memory_order_seq_cst);
    shm::RankSlot& slot = seg_.rank(peer);
    if (slot.sleepers.load(std::memory_order_relaxed) != 0) shm::futex_wake_all(slot.futex);
  }

  void check_abort() {
    if (seg_.header().abort_state.load(std::memory_order_acquire) != shm::kNotAborted) [[unlikely]] {
      throw_aborted();
    }
  }

  [[noreturn]] void throw_aborted() {
    shm::SegmentHeader& h = seg_.header();
    // The aborting rank writes the reason between two stores of abort_state; give it a moment.
    for (int i = 0; i < 100000 && h.abort_state.load(std::memory_order_acquire) != shm::kAbortPublished; ++i) {
      cpu_relax();
    }
    std::string reason = "(reason not published)";
    int by = -1;
    if (h.abort_state.load(std::memory_order_acquire) == shm::kAbortPublished) {
      by = h.abort_rank;
      reason.assign(h.abort_reason, ::strnlen(h.abort_reason, shm::kAbortReasonBytes));
    }
    std::vector<int> peers;
    if (by >= 0 && by != rank_) peers.push_back(by);
    throw TransportError(TransportError::Kind::aborted, std::move(peers),
                         by >= 0 ? fmt::format("shm: transport aborted by rank {}: {}", by, reason)
                                 : fmt::format("shm: transport aborted: {}", reason),
                         __FILE__, __LINE__);
  }

  // Throws peer_dead if a peer that a pending request needs is gone and left nothing to read.
  void check_liveness(const std::vector<Request*>& listed) {
    std::vector<int> gone;
    for (int p : peers_of(pending_of(listed))) {
      if (p == rank_) continue;
      if (shm::gone_reason(seg_.rank(p)) != nullptr) gone.push_back(p);
    }
    if (gone.empty()) return;
    // It may have written its last messages before it went: take what is in the rings.
    while (pass()) {
    }
    const auto pending = pending_of(listed);
    std::vector<int> dead;
    std::string who;
    for (int p : gone) {
      if (std::none_of(pending.begin(), pending.end(), [p](const Request* r) { return r->peer == p; })) continue;
      const shm::RankSlot& slot = seg_.rank(p);
      const char* why = shm::gone_reason(slot);  // permanent once seen, so not null here
      if (!who.empty()) who += ", ";
      who += fmt::format("rank {} (pid {}) {}", p, slot.pid.load(std::memory_order_relaxed), why ? why : "died");
      dead.push_back(p);
    }
    if (dead.empty()) return;
    throw TransportError(TransportError::Kind::peer_dead, dead,
                         fmt::format("shm: {} while rank {} waited for: {}", who, rank_, describe(pending)), __FILE__,
                         __LINE__);
  }

  Segment seg_;
  const int rank_;
  const int size_;
  const size_t cap_;
  const size_t mask_;
  std::vector<Peer> peers_;  // by rank; the entry of this rank is unused
  std::deque<Request*> self_sends_;
  std::deque<Request*> self_recvs_;
  transport_requests::RequestTable<Request> requests_;
  std::exception_ptr broken_;
  std::atomic<bool> in_use_{false};
  Clock::time_point last_test_liveness_{};
  shm::Collectives collectives_;
  std::chrono::microseconds spin_;  // a wait spins at least this long before it sleeps
};

Duration remaining(Deadline deadline) {
  return std::max(Duration{0}, std::chrono::ceil<Duration>(deadline - Clock::now()));
}

// Ranks whose pid is not yet in the segment.
std::vector<int> unmapped_ranks(const Segment& seg, int size) {
  std::vector<int> missing;
  for (int r = 0; r < size; ++r) {
    if (seg.rank(r).pid.load(std::memory_order_acquire) == 0) missing.push_back(r);
  }
  return missing;
}

void join(const Segment& seg, int rank) {
  shm::RankSlot& slot = seg.rank(rank);
  const pid_t pid = ::getpid();
  slot.start_time.store(shm::process_start_time(pid), std::memory_order_relaxed);
  slot.pid.store(pid, std::memory_order_release);
}

// Rank 0 creates a named shared object (`create(name)`) and publishes its name under
// `prefix`/shm/name; the others open it (`open(name)`). Everyone waits until the last rank
// to map it set `prefix`/shm/ready, naming the absent ranks (`absent(object)`) if it never
// comes; then the name is unlinked, so nothing is left in /dev/shm whatever happens later.
template <typename T, typename Create, typename Open, typename Absent>
T rendezvous(Store& store, const std::string& prefix, const char* what, int rank, int size, Duration timeout,
             Create create, Open open, Absent absent) {
  const Deadline deadline = deadline_after(timeout);
  const std::string name_key = prefix + "/shm/name";
  const std::string mapped_key = prefix + "/shm/mapped";
  const std::string ready_key = prefix + "/shm/ready";
  auto wait_ready = [&](const T& object) {
    try {
      (void)store.get(ready_key, remaining(deadline));
    } catch (const CommError&) {
      std::vector<int> missing = absent(object);
      throw TransportError(TransportError::Kind::timeout, missing,
                           fmt::format("shm: rank {} waited {} ms for all {} ranks to map the {}; rank(s) {} did not "
                                       "(store key '{}')",
                                       rank, timeout.count(), size, what, fmt::join(missing, ", "), ready_key),
                           __FILE__, __LINE__);
    }
  };
  if (rank == 0) {
    const std::string name = shm::make_segment_name(prefix);
    T object = [&] {
      try {
        return create(name);
      } catch (const std::exception& e) {
        try {  // the others hear why at once instead of at their deadline
          store.set(name_key, std::string("!") + e.what());
        } catch (...) {
        }
        throw;
      }
    }();
    try {
      store.set(name_key, name);
      if (size > 1) wait_ready(object);
    } catch (...) {
      shm::unlink_segment(name);
      throw;
    }
    // Everyone mapped it: from now on the mappings keep it alive and nothing can leak.
    shm::unlink_segment(name);
    return object;
  }
  std::string name;
  try {
    name = store.get(name_key, remaining(deadline));
  } catch (const CommError&) {
    throw TransportError(TransportError::Kind::timeout, {0},
                         fmt::format("shm: rank {} waited {} ms for rank 0 to publish the {}'s name (store key '{}')",
                                     rank, timeout.count(), what, name_key),
                         __FILE__, __LINE__);
  }
  if (name.starts_with("!")) {
    throw TransportError(TransportError::Kind::protocol, {0},
                         fmt::format("shm: rank 0 could not create the {}: {}", what, name.substr(1)), __FILE__,
                         __LINE__);
  }
  try {
    T object = open(name);
    if (store.add(mapped_key, 1) == size - 1) store.set(ready_key, "1");
    wait_ready(object);
    return object;
  } catch (...) {
    shm::unlink_segment(name);  // in case rank 0 is gone too: never leave it in /dev/shm
    throw;
  }
}

}  // namespace

std::unique_ptr<Transport> make_shm_transport(Store& store, const std::string& prefix, int rank, int size,
                                              Duration timeout, std::chrono::microseconds spin) {
  DT_CHECK(size >= 1 && rank >= 0 && rank < size, "comm", "shm transport: rank {} is not in a group of size {}", rank,
           size);
  Segment seg = rendezvous<Segment>(
      store, prefix, "segment", rank, size, timeout,
      [&](const std::string& name) {
        Segment created = Segment::create(name, size, shm::ring_bytes_from_env(), shm::stage_bytes_from_env(size));
        join(created, 0);
        return created;
      },
      [&](const std::string& name) {
        Segment opened = Segment::open(name, size);
        join(opened, rank);
        return opened;
      },
      [&](const Segment& s) { return unmapped_ranks(s, size); });
  return std::make_unique<ShmTransport>(std::move(seg), rank, size, spin);
}

shm::Mapping shm::share_mapping(Store& store, const std::string& prefix, int rank, int size, size_t bytes,
                                Duration timeout) {
  return rendezvous<shm::Mapping>(
      store, prefix, "shared memory", rank, size, timeout,
      [&](const std::string& name) { return shm::Mapping::create(name, bytes); },
      [&](const std::string& name) { return shm::Mapping::open(name, bytes); },
      [&](const shm::Mapping&) {
        // The store counts the ranks that mapped it, not which: name the ones it could be.
        std::vector<int> all;
        for (int r = 1; r < size; ++r) all.push_back(r);
        return all;
      });
}

}  // namespace dtrain::comm
