// Shared-memory segment of the shm transport: its layout, creation and mapping, futex helpers
// and the liveness check of peer processes. Internal to src/comm.
//
// Layout (offsets computed by SegmentLayout, every block aligned to kLine = 128 bytes so that
// words written by different ranks never share a cache line, nor an adjacent-line prefetch pair):
//
//   SegmentHeader   magic, version, size, ring bytes; abort state + rank + reason
//   RankSlot[size]  per rank: pid, process start time, departed flag   (written once)
//                   and, on its own line, the futex word + sleeper count  (hot);
//                   the phase counter + call records; 2 x kLinesPerCall data lines of the
//                   small all_reduce (shm_collectives.cpp)
//   RingCtl[P]      per ordered pair (src -> dst), src != dst: head (written by src only) and
//                   tail (written by dst only), each on its own line
//   ring data[P]    page aligned, ring_bytes (a power of two) each
//   stage[size][2]  page aligned, stage_bytes each: the staging slots of the direct
//                   collectives (shm_collectives.cpp), two per rank used alternately
//
// P = size * (size - 1); ring (src -> dst) has index src * (size - 1) + (dst < src ? dst : dst - 1).
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "dtrain/comm/store.h"
#include "dtrain/comm/types.h"

namespace dtrain::comm::shm {

constexpr uint64_t kMagic = 0x315f4d48535f5444ull;  // "DT_SHM_1"
constexpr uint32_t kVersion = 3;
constexpr size_t kLine = 128;
constexpr size_t kDefaultRingBytes = size_t{1} << 20;
constexpr size_t kMinRingBytes = 4096;
constexpr size_t kMaxRingBytes = size_t{1} << 30;
constexpr size_t kAbortReasonBytes = 512;
constexpr size_t kDefaultStageBytes = size_t{1} << 20;
constexpr size_t kOversubscribedStageBytes = size_t{8} << 20;  // see default_stage_bytes
constexpr size_t kMinStageBytes = 4096;
constexpr size_t kMaxStageBytes = size_t{1} << 30;

enum AbortState : uint32_t { kNotAborted = 0, kAbortWriting = 1, kAbortPublished = 2 };

struct alignas(kLine) SegmentHeader {
  uint64_t magic;
  uint32_t version;
  uint32_t size;
  uint64_t ring_bytes;
  uint64_t stage_bytes;
  uint64_t total_bytes;
  alignas(kLine) std::atomic<uint32_t> abort_state;  // AbortState
  int32_t abort_rank;
  char abort_reason[kAbortReasonBytes];
};

// One line of a small all_reduce that carries its own flag (see "Small all_reduce in lines" in
// shm_collectives.cpp): kLinePayload bytes of data, the call's signature, and the phase it
// belongs to, stored last.
constexpr size_t kLinePayload = 48;
constexpr int kLinesPerCall = 4;
struct alignas(64) DataLine {
  char data[kLinePayload];
  std::atomic<uint64_t> call;
  std::atomic<uint64_t> phase;
};
static_assert(sizeof(DataLine) == 64, "a data line is one cache line");

struct RankSlot {
  // Written by the rank itself when it joins / leaves; read by peers' liveness checks.
  alignas(kLine) std::atomic<int32_t> pid;
  std::atomic<uint32_t> departed;
  std::atomic<uint64_t> start_time;  // clock ticks since boot (/proc/<pid>/stat), 0 if unknown
  // Bumped by anyone who wants this rank to re-check its rings; it sleeps on it.
  alignas(kLine) std::atomic<uint32_t> futex;
  std::atomic<uint32_t> sleepers;  // > 0 while one of its threads is about to sleep or sleeps
  // Direct collectives: phases this rank completed (monotonic), and the call it made, one
  // record {kind | dtype << 8, count, op or root} per parity of its call counter (see
  // shm_collectives.cpp); 56 bytes, so a peer's wait and check touch one cache line.
  alignas(kLine) std::atomic<uint64_t> arrived;
  uint64_t call[2][3];
  // Small all_reduces, by parity of the rank's count of them.
  alignas(kLine) DataLine lines[2][kLinesPerCall];
};

struct RingCtl {
  alignas(kLine) std::atomic<uint64_t> head;  // bytes ever written by the producer
  alignas(kLine) std::atomic<uint64_t> tail;  // bytes ever consumed by the consumer
};

static_assert(std::atomic<uint32_t>::is_always_lock_free && sizeof(std::atomic<uint32_t>) == 4,
              "futex words must be plain 32-bit integers");
static_assert(std::atomic<uint64_t>::is_always_lock_free, "ring positions must be lock-free");

struct SegmentLayout {
  SegmentLayout(int world_size, size_t bytes_per_ring, size_t bytes_per_stage);
  int size;
  size_t ring_bytes;
  size_t stage_bytes;
  size_t pairs;
  size_t ranks_offset;
  size_t rings_offset;
  size_t data_offset;
  size_t stage_offset;
  size_t total_bytes;
};

/// A mapping of the segment. Move-only; unmaps on destruction (it never unlinks).
class Segment {
 public:
  /// Creates `name` exclusively, sizes and reserves it (posix_fallocate, so a full /dev/shm is an
  /// error here rather than a SIGBUS later), maps it and initialises the control area.
  /// Unlinks the name again if any step fails.
  static Segment create(const std::string& name, int size, size_t ring_bytes, size_t stage_bytes);
  /// Opens and maps an existing segment; checks magic, version and world size.
  static Segment open(const std::string& name, int size);

  Segment(Segment&& other) noexcept;
  Segment& operator=(Segment&& other) noexcept;
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;
  ~Segment();

  SegmentHeader& header() const { return *reinterpret_cast<SegmentHeader*>(base_); }
  RankSlot& rank(int r) const { return reinterpret_cast<RankSlot*>(base_ + layout_.ranks_offset)[r]; }
  RingCtl& ring_ctl(int src, int dst) const {
    return reinterpret_cast<RingCtl*>(base_ + layout_.rings_offset)[ring_index(src, dst)];
  }
  char* ring_data(int src, int dst) const {
    return base_ + layout_.data_offset + ring_index(src, dst) * layout_.ring_bytes;
  }
  size_t ring_bytes() const { return layout_.ring_bytes; }
  /// Staging slot `parity` (0 or 1) of rank r.
  char* stage(int r, int parity) const {
    return base_ + layout_.stage_offset +
           (static_cast<size_t>(r) * 2 + static_cast<size_t>(parity)) * layout_.stage_bytes;
  }
  size_t stage_bytes() const { return layout_.stage_bytes; }
  size_t total_bytes() const { return layout_.total_bytes; }

 private:
  Segment(char* base, SegmentLayout layout) : base_(base), layout_(layout) {}
  size_t ring_index(int src, int dst) const {
    return static_cast<size_t>(src) * static_cast<size_t>(layout_.size - 1) +
           static_cast<size_t>(dst < src ? dst : dst - 1);
  }
  char* base_ = nullptr;
  SegmentLayout layout_;
};

/// A plain shared mapping (allocate_shared, shared.h): created zeroed by one rank, opened by the
/// others. Move-only; unmaps on destruction (it never unlinks).
class Mapping {
 public:
  /// Creates `name` exclusively with `bytes` reserved (at least 1) and maps it.
  static Mapping create(const std::string& name, size_t bytes);
  /// Opens and maps `name`; throws when its size is not `bytes`.
  static Mapping open(const std::string& name, size_t bytes);
  Mapping(Mapping&& other) noexcept;
  Mapping& operator=(Mapping&&) = delete;
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping();
  char* data() const { return base_; }
  size_t bytes() const { return bytes_; }

 private:
  Mapping(char* base, size_t bytes) : base_(base), bytes_(bytes) {}
  char* base_ = nullptr;
  size_t bytes_ = 0;
};

/// Collective over `store`: rank 0 creates `bytes` of shared memory, the others map it (see
/// make_shm_transport for the handshake under `prefix`); the name is gone from /dev/shm when it
/// returns. Throws TransportError naming the ranks that did not map it within `timeout`.
Mapping share_mapping(Store& store, const std::string& prefix, int rank, int size, size_t bytes, Duration timeout);

/// shm_unlink that ignores a name already gone; never throws.
void unlink_segment(const std::string& name) noexcept;

/// "/dtrain-<prefix, sanitised>-<pid>-<64 random bits in hex>".
std::string make_segment_name(const std::string& prefix);

/// Ring size from DTRAIN_SHM_RING_BYTES (a power of two in [4 KiB, 1 GiB]) or the default.
size_t ring_bytes_from_env();
/// Staging slot size from DTRAIN_SHM_STAGE_BYTES (a power of two in [4 KiB, 1 GiB]), or
/// default_stage_bytes(size, job_cores(), the free bytes of /dev/shm) when it is not set.
size_t stage_bytes_from_env(int size);

/// The staging slot size of a new segment of `size` ranks: kDefaultStageBytes, or
/// kOversubscribedStageBytes when the ranks outnumber `cores` and `shm_free_bytes` holds four
/// times the larger slots. A large all_reduce moves one slot-sized chunk per two phase syncs,
/// and with more ranks than cores each sync waits until every descheduled rank got a core
/// back: 8 MiB chunks take a 4-rank all_reduce on 2 vCPUs from 4.5 to 5.3 GB/s busbw at
/// 16-256 MiB (medians of 3; 1 MiB suits ranks that each have a core, whose chunks stay in
/// cache). Pure: the test gives it the figures.
size_t default_stage_bytes(int size, int cores, size_t shm_free_bytes);

/// The cores this process may run on (its CPU affinity), or DTRAIN_JOB_CPUS when a launcher
/// bound each rank to a slice of the job's CPUs and said how many the job has.
int job_cores();

/// Sleeps while *word == expected, at most `timeout`. Process-shared (not FUTEX_PRIVATE).
void futex_wait(std::atomic<uint32_t>& word, uint32_t expected, Duration timeout);
/// Bumps *word and wakes every sleeper on it.
void futex_wake_all(std::atomic<uint32_t>& word);

/// The sleeper's half of the wake-up handshake (shm_transport.cpp): while it lives, `slot`
/// counts one more sleeper, and the full fence after the count orders the caller's re-check of
/// its condition against the waker's fence (in the C++ model too; on x86 the read-modify-write
/// alone already does). Leaving the scope by an exception takes the count back as well.
class SleepAnnouncement {
 public:
  explicit SleepAnnouncement(RankSlot& slot) : slot_(slot) {
    slot_.sleepers.fetch_add(1, std::memory_order_seq_cst);
    std::atomic_thread_fence(std::memory_order_seq_cst);
  }
  ~SleepAnnouncement() { slot_.sleepers.fetch_sub(1, std::memory_order_seq_cst); }
  SleepAnnouncement(const SleepAnnouncement&) = delete;
  SleepAnnouncement& operator=(const SleepAnnouncement&) = delete;

 private:
  RankSlot& slot_;
};

/// Start time of `pid` in clock ticks since boot, 0 if unknown.
uint64_t process_start_time(pid_t pid);

/// False when the process is gone: no such pid, a zombie, or a different process now holding
/// the pid (start time changed). True when alive or when it cannot tell.
bool process_alive(pid_t pid, uint64_t start_time);

/// Why the rank owning `slot` is gone for good: "closed its transport" (it left), "died" (its
/// process is gone), or nullptr while it lives. Ranks in this process (threads) live as long
/// as it does.
const char* gone_reason(const RankSlot& slot);

/// One turn of a spin-wait loop: tells the core (and an SMT sibling) that we are waiting.
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

}  // namespace dtrain::comm::shm
