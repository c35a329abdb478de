// Direct collectives over the shm segment.
//
// Every rank owns two staging slots of stage_bytes in the segment and a phase counter
// (RankSlot::arrived). A collective moves its data in chunks that fit a slot; chunk c uses
// slot parity c & 1. A *phase* ends when a rank bumps its counter (arrive) and is complete
// when every rank's counter reached the same value (wait_all). All ranks run the same phases,
// so the target is simply this rank's own count.
//
//   all_reduce of at most kLinesPerCall * kLinePayload bytes (192): in lines, see below.
//   all_reduce, small chunk (<= kSmallBytes): copy in | sync | every rank reduces all slots
//     in rank order into its output (same bits everywhere).
//   all_reduce, large chunk: copy in | sync | rank r reduces slice r of every slot, in rank
//     order, into its output and publishes it in its own slot | sync | every rank copies the
//     other slices out of their owners' slots. Both paths sum in rank order, so the result
//     equals one process accumulating the ranks' vectors in order, bit for bit.
//   broadcast: root copies in | sync | the others copy out.
//   all_gather: copy own block in | sync | copy every block out.
//   reduce_scatter: copy in | sync | reduce own block of every slot into the output.
//   all_reduce_mapped (every rank's vector in memory all ranks map, allocate_shared in shared.h):
//     sync | rank r reduces slice r of every vector, in rank order, and writes it into every
//     vector | sync. No staging: each rank reads and writes the data size once, against about
//     three times for the staged path, which made a 4 MiB 2-rank all_reduce about 3x faster on
//     a 2-vCPU Xeon VM where both run near the copy bandwidth of the cache.
//
// Reuse: a rank writes slot parity c & 1 again at chunk c + 2, after the first sync of chunk
// c + 1, which every rank reaches only after it finished reading chunk c. Every call has at
// least one sync, so the same argument covers the call records (parity of the call counter)
// that each rank publishes and compares after the first sync: a rank that called something
// else is reported instead of silently mixing buffers.
//
// Staging writes: a large chunk's copy-in and publish write lines of this rank's slot that the
// peers read in the previous chunk, so each written line first has to be taken back from the
// readers' caches. When the readers' cores share a cache with ours this is cheap; when they
// are far (another core complex or socket, or a VM whose host moved the vCPUs apart) it costs
// a slow cross-core invalidation per line and large all_reduces lose 2-4x (measured on a
// 2-vCPU EPYC VM: busbw 9 against 2.3 GB/s at 4 MiB). Streaming stores skip that: the data
// goes to memory and the readers fetch it from there, placement-independent but slower than
// a near peer's cache (4-5 GB/s there). So each rank times the first kProbeBlocks publish
// blocks of every large all_reduce with plain stores (blocks of at least kMinProbeBytes,
// collected over several calls when a call has fewer), and stages with streaming stores while
// the best of them runs below 1/kFarFactor of a plain copy between two private cached buffers
// (timed once, before the first probe): about 20 GB/s near and 3-5 GB/s far, against 35 GB/s locally.
// The choice only changes how this rank writes its own slot, so ranks need not agree on it.
// DTRAIN_SHM_STREAM_STAGE=0|1 turns it off or on for good.
//
// Small all_reduce in lines: with a phase counter, a peer first waits for the counter's line
// and then fetches the data's line, two cross-core transfers one after the other. Instead each
// rank writes its data in cache lines (RankSlot::lines, parity of its count of such calls) of
// 48 data bytes, the call's signature and the phase, stored last (release), then arrives as
// usual; the peers poll the lines themselves and find the data there. The counter still moves,
// so phases stay aligned with the other calls, a sleeping peer is woken by arrive(), and a peer
// that ended this phase without writing our lines made another call (check_calls() names it;
// a different signature in the lines is reported the same way). Reuse follows the slots' rule.
// Measured on a 2-vCPU EPYC VM, 2 ranks, 8-32 B: 0.72-0.82 us against 1.0-1.2 when the vCPUs
// are far apart, 0.29-0.34 against 0.38-0.43 near; 4 lines (up to 192 B) still gain, at 6
// (256 B) the staged path is faster far apart (1.0-1.2 against 1.2-1.4 us), since the reader
// polls lines the writer is still filling. One-rank groups keep the staged path.
//
// Waiting spins (pause, then sched_yield so that more ranks than cores progress), then sleeps
// on the rank's futex word; arrive() wakes the peers that announced a sleep (the same Dekker
// handshake as the rings: see shm_transport.cpp).
#include "shm_collectives.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "dtrain/comm/copy.h"
#include "dtrain/comm/reduce.h"

namespace dtrain::comm::shm {

namespace {

constexpr size_t kSmallBytes = size_t{16} << 10;
constexpr size_t kAlignBytes = 64;
// Results this large bypass the cache. With more ranks than cores the ranks take turns on a
// core and the cache holds little of anyone's data, so streaming pays off much earlier.
constexpr size_t kStreamingBytes = size_t{32} << 20;
constexpr size_t kStreamingBytesOversubscribed = size_t{1} << 20;
constexpr int kSpinIterations = 4000;
constexpr int kYieldAfter = 200;
constexpr int kYieldEvery = 8;
constexpr int kClockEvery = 64;
constexpr Duration kMaxSleep{20};
constexpr auto kOversubscribedSpin = std::chrono::milliseconds(2);
constexpr auto kLivenessPeriod = std::chrono::milliseconds(5);
// all_reduce's large path reduces its slice and publishes it in blocks of this size.
constexpr size_t kPublishBlockBytes = size_t{32} << 10;
// Staging writes (see above): blocks timed per call, the smallest block worth timing, and how
// many times slower than a private copy a staging write is when the readers are far.
constexpr int kProbeBlocks = 2;
constexpr size_t kMinProbeBytes = size_t{16} << 10;
constexpr double kFarFactor = 4.0;

// dst = part(0) op part(1) op ... op part(p - 1), in rank order, so every caller (and one
// process accumulating the same vectors in order) gets the same bits; then averaged for avg.
// dst may alias part(0) or part(1).
template <typename Part>
void reduce_in_rank_order(char* dst, int p, Part part, size_t n, DataType dtype, ReduceOp op) {
  if (p == 1) {
    if (dst != part(0)) copy_bytes(dst, part(0), n * size_of(dtype));
  } else {
    reduce_pair(dst, part(0), part(1), n, dtype, op);
    for (int q = 2; q < p; ++q) reduce_into(dst, part(q), n, dtype, op);
  }
  finish_avg(dst, n, dtype, op, p);
}

const char* kind_name(uint64_t kind) {
  switch (kind) {
    case 1:
      return "all_reduce";
    case 2:
      return "broadcast";
    case 3:
      return "all_gather";
    case 4:
      return "reduce_scatter";
    case 5:
      return "barrier";
    case 6:
      return "reduce_scatter (shared memory)";
    case 7:
      return "all_reduce (shared memory)";
    default:
      return "unknown";
  }
}

std::string describe_call(const uint64_t* rec) {
  const auto kind = rec[0] & 0xff;
  if (kind == 5) return "barrier";
  const auto dtype = static_cast<DataType>((rec[0] >> 8) & 0xff);
  if (kind == 2) return fmt::format("broadcast({}, {}, root {})", name_of(dtype), rec[1], rec[2]);
  if (kind == 3) return fmt::format("all_gather({}, {})", name_of(dtype), rec[1]);
  return fmt::format("{}({}, {}, {})", kind_name(kind), name_of(dtype), rec[1], name_of(static_cast<ReduceOp>(rec[2])));
}

// [lo, hi) of slice `r` of `m` elements split over `p` ranks, cut on kAlignBytes boundaries.
std::pair<size_t, size_t> slice(size_t m, int r, int p, size_t esize) {
  const size_t align = std::max<size_t>(1, kAlignBytes / esize);
  auto cut = [&](int k) {
    return k >= p ? m : std::min(m, m * static_cast<size_t>(k) / static_cast<size_t>(p) / align * align);
  };
  return {cut(r), cut(r + 1)};
}

Collectives::StageWrites stage_writes_from_env() {
  const char* v = std::getenv("DTRAIN_SHM_STREAM_STAGE");
  if (v == nullptr || *v == '\0' || std::strcmp(v, "auto") == 0) return Collectives::StageWrites::automatic;
  if (std::strcmp(v, "0") == 0) return Collectives::StageWrites::cached;
  if (std::strcmp(v, "1") == 0) return Collectives::StageWrites::streaming;
  DT_THROW("comm", "DTRAIN_SHM_STREAM_STAGE='{}' must be auto, 0 (plain stores) or 1 (streaming stores)", v);
}

// Nanoseconds per byte of the fastest of several plain copies of one publish block between two
// private buffers that stay in this core's cache (1 KiB apart modulo 4 KiB, clear of copy.h's
// slow window).
double local_copy_ns_per_byte() {
  std::vector<char> buffer(2 * kPublishBlockBytes + 8192, 1);
  char* a = buffer.data() + (-reinterpret_cast<uintptr_t>(buffer.data()) & 4095);
  char* b = a + kPublishBlockBytes + 1024;
  double best = std::numeric_limits<double>::max();
  for (int i = 0; i < 16; ++i) {
    const auto t0 = Clock::now();
    copy_bytes(b, a, kPublishBlockBytes);
    asm volatile("" : : "r"(b) : "memory");
    best = std::min(best, std::chrono::duration<double, std::nano>(Clock::now() - t0).count());
  }
  return best / static_cast<double>(kPublishBlockBytes);
}

}  // namespace

Collectives::Collectives(const Segment& segment, int rank, int size, std::function<void()> check_abort)
    : seg_(segment), rank_(rank), size_(size), check_abort_(std::move(check_abort)) {
  DT_CHECK(seg_.stage_bytes() >= static_cast<size_t>(size_) * 8, "comm",
           "shm: staging slots of {} bytes are too small for {} ranks (DTRAIN_SHM_STAGE_BYTES)", seg_.stage_bytes(),
           size_);
  phase_ = seg_.rank(rank_).arrived.load(std::memory_order_relaxed);
  cores_ = job_cores();
  oversubscribed_ = size_ > cores_;
  stage_writes_ = stage_writes_from_env();
  streaming_ = stage_writes_ == StageWrites::streaming;
}

void Collectives::stage_write(char* dst, const char* src, size_t bytes) const {
  if (streaming_) {
    copy_streaming(dst, src, bytes);
  } else {
    copy_bytes(dst, src, bytes);
  }
}

void Collectives::probe_stage_write(char* dst, const char* src, size_t bytes) {
  const auto t0 = Clock::now();
  copy_bytes(dst, src, bytes);
  const double ns = std::chrono::duration<double, std::nano>(Clock::now() - t0).count();
  probe_best_ = std::min(probe_best_, ns / static_cast<double>(bytes));
  if (--probes_left_ == 0) streaming_ = probe_best_ > kFarFactor * local_ns_per_byte_;
}

void Collectives::begin(const Call& call) {
  call_ = call;
  uint64_t* rec = seg_.rank(rank_).call[calls_ & 1];
  rec[0] = static_cast<uint64_t>(call.kind) | static_cast<uint64_t>(call.dtype) << 8;
  rec[1] = call.count;
  rec[2] = call.arg;
  checked_ = false;
}

void Collectives::arrive() {
  seg_.rank(rank_).arrived.store(++phase_, std::memory_order_release);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    RankSlot& slot = seg_.rank(p);
    if (slot.sleepers.load(std::memory_order_relaxed) != 0) futex_wake_all(slot.futex);
  }
}

bool Collectives::all_arrived(uint64_t target, int& cursor) const {
  while (cursor < size_ && seg_.rank(cursor).arrived.load(std::memory_order_acquire) >= target) ++cursor;
  return cursor == size_;
}

void Collectives::wait_all(Deadline deadline) {
  const uint64_t target = phase_;
  wait_until(target, deadline, [&](int& cursor) { return all_arrived(target, cursor); });
}

template <typename Ready>
void Collectives::wait_until(uint64_t target, Deadline deadline, Ready&& ready) {
  int cursor = 0;
  if (ready(cursor)) return;
  const auto start = Clock::now();
  auto last_liveness = start;
  int idle = 0;
  // With more ranks than cores the peers we wait for need our core, and on the progress thread
  // our own process's computation needs it when each rank's two threads outnumber the cores:
  // yield at every turn, and sleep only after kOversubscribedSpin (a futex wake-up costs a
  // scheduler round trip, which dominates small collectives); otherwise spin, then yield now
  // and then, then sleep.
  const bool share_core = oversubscribed_ || (on_progress_thread() && 2 * size_ > cores_);
  const int spin_limit = share_core ? std::numeric_limits<int>::max() : kSpinIterations;
  for (uint64_t iteration = 1;; ++iteration) {
    // Arrival first: a peer that arrived and then aborted (e.g. on a call mismatch) still lets
    // this rank see the phase complete and report the mismatch from its own side.
    if (ready(cursor)) return;
    check_abort_();
    ++idle;
    if (share_core) {
      ::sched_yield();
      if (iteration % 16 != 0) continue;
    }
    if (iteration % kClockEvery == 0 || idle >= spin_limit || share_core) {
      const auto now = Clock::now();
      if (now >= deadline) throw_stalled(target, now - start, true);
      if (now - last_liveness >= kLivenessPeriod) {
        last_liveness = now;
        for (int p = cursor; p < size_; ++p) {
          const RankSlot& s = seg_.rank(p);
          if (s.arrived.load(std::memory_order_acquire) >= target) continue;
          if (gone_reason(s) != nullptr) {
            if (ready(cursor)) return;
            throw_stalled(target, now - start, false);
          }
        }
      }
      if (idle >= spin_limit || (share_core && now - start >= kOversubscribedSpin)) {
        idle = 0;
        RankSlot& me = seg_.rank(rank_);
        const uint32_t seq = me.futex.load(std::memory_order_acquire);
        {
          // ready() may throw (it names a mismatched call); the announcement ends either way.
          const SleepAnnouncement announce(me);
          const bool woken = ready(cursor) || seg_.header().abort_state.load(std::memory_order_acquire) != kNotAborted;
          if (!woken) {
            futex_wait(me.futex, seq,
                       std::min<Duration>(kMaxSleep, std::chrono::ceil<Duration>(deadline - now) + Duration{1}));
          }
        }
        continue;
      }
    }
    if (share_core) continue;
    if (idle >= kYieldAfter && idle % kYieldEvery == 0) {
      ::sched_yield();
    } else {
      cpu_relax();
    }
  }
}

void Collectives::sync(Deadline deadline) {
  arrive();
  wait_all(deadline);
  if (!checked_) {
    checked_ = true;
    check_calls();
    ++calls_;
  }
}

void Collectives::check_calls() const {
  const uint64_t* mine = seg_.rank(rank_).call[calls_ & 1];
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    const uint64_t* theirs = seg_.rank(p).call[calls_ & 1];
    if (std::equal(mine, mine + 3, theirs)) continue;
    throw TransportError(TransportError::Kind::protocol, {p},
                         fmt::format("shm: rank {} called {} but rank {} called {} (call #{} on this transport)", p,
                                     describe_call(theirs), rank_, describe_call(mine), calls_),
                         __FILE__, __LINE__);
  }
}

void Collectives::throw_stalled(uint64_t target, Clock::duration waited, bool timed_out) const {
  std::vector<int> missing;
  std::vector<std::string> dead;
  for (int p = 0; p < size_; ++p) {
    const RankSlot& s = seg_.rank(p);
    if (s.arrived.load(std::memory_order_acquire) >= target) continue;
    missing.push_back(p);
    if (const char* why = gone_reason(s)) dead.push_back(fmt::format("rank {} (pid {}) {}", p, s.pid.load(), why));
  }
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(waited).count();
  const std::string what = describe_call(seg_.rank(rank_).call[calls_ & 1]);
  if (!timed_out && !dead.empty()) {
    throw TransportError(TransportError::Kind::peer_dead, missing,
                         fmt::format("shm: {} while rank {} waited in {}", fmt::join(dead, ", "), rank_, what),
                         __FILE__, __LINE__);
  }
  throw TransportError(TransportError::Kind::timeout, missing,
                       fmt::format("shm: rank {} timed out after {} ms in {} waiting for rank(s) {}", rank_, ms, what,
                                   fmt::join(missing, ", ")),
                       __FILE__, __LINE__);
}

void Collectives::barrier(Deadline deadline) {
  begin({Kind::barrier, DataType::u8, 0, 0});
  sync(deadline);
}

void Collectives::all_reduce(const void* input, void* output, size_t count, DataType dtype, ReduceOp op,
                             Deadline deadline) {
  const size_t esize = size_of(dtype);
  if (size_ > 1 && count > 0 && count * esize <= kLinePayload * kLinesPerCall) {
    all_reduce_lines(static_cast<const char*>(input), static_cast<char*>(output), count, dtype, op, deadline);
    return;
  }
  begin({Kind::all_reduce, dtype, count, static_cast<uint64_t>(op)});
  const size_t chunk_elems = seg_.stage_bytes() / esize;
  const auto* in = static_cast<const char*>(input);
  auto* out = static_cast<char*>(output);
  if (count == 0) sync(deadline);
  for (size_t off = 0; off < count; off += chunk_elems, ++chunk_) {
    const size_t m = std::min(chunk_elems, count - off);
    const size_t bytes = m * esize;
    const bool small = bytes <= kSmallBytes || size_ == 1;
    // Plain variables, not a structured binding: lambdas below capture them (clang 14 cannot
    // capture bindings, and the fuzz build uses clang).
    const auto range = slice(m, rank_, size_, esize);
    const size_t lo = range.first, hi = range.second;
    // Large path: nobody else reads our own slice, so it is reduced straight from the input
    // and only the other slices are staged. In place, the output overwrites the input while
    // the sum runs: safe for ranks 0 and 1 (the first pair is read before anything is
    // written), so ranks from 2 up stage their slice too.
    const bool own_from_input = !small && (in != out || rank_ <= 1);
    if (small) {
      copy_bytes(stage(rank_), in + off * esize, bytes);
    } else if (own_from_input) {
      stage_write(stage(rank_), in + off * esize, lo * esize);
      stage_write(stage(rank_) + hi * esize, in + (off + hi) * esize, (m - hi) * esize);
    } else {
      stage_write(stage(rank_), in + off * esize, bytes);
    }
    sync(deadline);
    if (small) {
      // Every rank reduces everything: one phase, identical bits everywhere.
      reduce_in_rank_order(
          out + off * esize, size_, [&](int q) { return stage(q); }, m, dtype, op);
      // Take the lines of the slot that the next chunk writes back from the peers now, while
      // nobody waits for them (see "Staging writes"; the peers finished reading that slot
      // before they arrived here): its copy-in then writes lines this core owns.
      if (size_ > 1) {
        const char* next = seg_.stage(rank_, static_cast<int>((chunk_ + 1) & 1));
        for (size_t b = 0; b < bytes; b += 64) __builtin_prefetch(next + b, 1, 3);
      }
      continue;
    }
    // Slice `rank_` of every slot, reduced in rank order (the same order as the small path and
    // as one process accumulating micro-batches), into the output, then published in our slot.
    // In cache-sized blocks, so that the copy into our slot reads the result from the cache.
    const size_t block = kPublishBlockBytes / esize;
    if (off == 0 && stage_writes_ == StageWrites::automatic && probes_left_ == 0) {
      if (local_ns_per_byte_ == 0) local_ns_per_byte_ = local_copy_ns_per_byte();
      probes_left_ = kProbeBlocks;
      probe_best_ = std::numeric_limits<double>::max();
    }
    for (size_t b = lo; b < hi; b += block) {
      const size_t e = std::min(hi, b + block);
      char* acc = out + (off + b) * esize;
      auto part = [&](int q) -> const char* {
        return q == rank_ && own_from_input ? in + (off + b) * esize : stage(q) + b * esize;
      };
      reduce_in_rank_order(acc, size_, part, e - b, dtype, op);
      if (probes_left_ > 0 && (e - b) * esize >= kMinProbeBytes) {
        probe_stage_write(stage(rank_) + b * esize, acc, (e - b) * esize);
      } else {
        stage_write(stage(rank_) + b * esize, acc, (e - b) * esize);
      }
    }
    sync(deadline);
    for (int k = 1; k < size_; ++k) {  // our own slice is in the output already
      const int q = (rank_ + k) % size_;
      const auto [qlo, qhi] = slice(m, q, size_, esize);
      if (qhi <= qlo) continue;
      char* dst = out + (off + qlo) * esize;
      const char* src = stage(q) + qlo * esize;
      if (count * esize >= (oversubscribed_ ? kStreamingBytesOversubscribed : kStreamingBytes)) {
        copy_streaming(dst, src, (qhi - qlo) * esize);
      } else {
        copy_bytes(dst, src, (qhi - qlo) * esize);
      }
    }
  }
}

void Collectives::all_reduce_lines(const char* in, char* out, size_t count, DataType dtype, ReduceOp op,
                                   Deadline deadline) {
  begin({Kind::all_reduce, dtype, count, static_cast<uint64_t>(op)});
  const size_t esize = size_of(dtype);
  const size_t bytes = count * esize;
  const int lines = static_cast<int>((bytes + kLinePayload - 1) / kLinePayload);
  const int parity = static_cast<int>(line_calls_++ & 1);
  const uint64_t target = phase_ + 1;  // the phase that arrive() below ends
  const uint64_t signature = static_cast<uint64_t>(Kind::all_reduce) | static_cast<uint64_t>(dtype) << 8 |
                             static_cast<uint64_t>(op) << 16 | static_cast<uint64_t>(count) << 24;
  DataLine* mine = seg_.rank(rank_).lines[parity];
  for (int i = 0; i < lines; ++i) {
    const size_t at = static_cast<size_t>(i) * kLinePayload;
    std::memcpy(mine[i].data, in + at, std::min(kLinePayload, bytes - at));
    mine[i].call.store(signature, std::memory_order_relaxed);
    mine[i].phase.store(target, std::memory_order_release);
  }
  arrive();
  // Every line of every peer, loaded together so that their misses overlap. Every 16th poll
  // also looks at the phase counters: a peer that ended this phase without writing our lines
  // made another call, and check_calls() names it.
  unsigned polls = 0;
  wait_until(target, deadline, [&](int& cursor) {
    bool all = true;
    for (int q = 0; q < size_; ++q) {
      const DataLine* theirs = seg_.rank(q).lines[parity];
      for (int i = 0; i < lines; ++i) all &= theirs[i].phase.load(std::memory_order_acquire) == target;
    }
    if (all) return true;
    // Also before the wait loop looks at the abort flag: a peer that found the mismatch first
    // and aborted still lets this rank report it from its own side.
    const bool aborting = seg_.header().abort_state.load(std::memory_order_acquire) != kNotAborted;
    if ((++polls % 16 != 0 && !aborting) || !all_arrived(target, cursor)) return false;
    check_calls();
    return true;  // the same call everywhere, so every peer wrote its lines before it arrived
  });
  for (int q = 0; q < size_; ++q) {
    const DataLine* theirs = seg_.rank(q).lines[parity];
    for (int i = 0; i < lines; ++i) {
      if (theirs[i].call.load(std::memory_order_relaxed) == signature &&
          theirs[i].phase.load(std::memory_order_acquire) == target) {
        continue;
      }
      check_calls();  // names the other call; if the records agree, the lines broke the protocol
      throw TransportError(
          TransportError::Kind::protocol, {q},
          fmt::format("shm: line {} of rank {} holds call {:#x} of phase {}, expected {:#x} of "
                      "phase {} (rank {}, call #{} on this transport)",
                      i, q, theirs[i].call.load(std::memory_order_relaxed),
                      theirs[i].phase.load(std::memory_order_relaxed), signature, target, rank_, calls_),
          __FILE__, __LINE__);
    }
  }
  checked_ = true;
  ++calls_;
  for (int i = 0; i < lines; ++i) {
    const size_t at = static_cast<size_t>(i) * kLinePayload;
    reduce_in_rank_order(
        out + at, size_, [&](int q) -> const char* { return seg_.rank(q).lines[parity][i].data; },
        std::min(kLinePayload, bytes - at) / esize, dtype, op);
  }
}

void Collectives::broadcast(void* buffer, size_t count, DataType dtype, int root, Deadline deadline) {
  begin({Kind::broadcast, dtype, count, static_cast<uint64_t>(root)});
  const size_t esize = size_of(dtype);
  const size_t chunk_elems = seg_.stage_bytes() / esize;
  auto* buf = static_cast<char*>(buffer);
  if (count == 0) sync(deadline);
  for (size_t off = 0; off < count; off += chunk_elems, ++chunk_) {
    const size_t bytes = std::min(chunk_elems, count - off) * esize;
    if (rank_ == root) copy_bytes(stage(root), buf + off * esize, bytes);
    sync(deadline);
    if (rank_ != root) copy_bytes(buf + off * esize, stage(root), bytes);
  }
}

void Collectives::all_gather(const void* input, void* output, size_t count, DataType dtype, Deadline deadline) {
  begin({Kind::all_gather, dtype, count, 0});
  const size_t esize = size_of(dtype);
  const size_t chunk_elems = seg_.stage_bytes() / esize;
  const auto* in = static_cast<const char*>(input);
  auto* out = static_cast<char*>(output);
  if (count == 0) sync(deadline);
  for (size_t off = 0; off < count; off += chunk_elems, ++chunk_) {
    const size_t bytes = std::min(chunk_elems, count - off) * esize;
    copy_bytes(stage(rank_), in + off * esize, bytes);
    sync(deadline);
    for (int k = 0; k < size_; ++k) {
      const int q = (rank_ + k) % size_;
      char* dst = out + (static_cast<size_t>(q) * count + off) * esize;
      if (!(q == rank_ && dst == in + off * esize)) copy_bytes(dst, stage(q), bytes);
    }
  }
}

void Collectives::reduce_scatter(const void* input, void* output, size_t count, DataType dtype, ReduceOp op,
                                 Deadline deadline) {
  begin({Kind::reduce_scatter, dtype, count, static_cast<uint64_t>(op)});
  const size_t esize = size_of(dtype);
  // A chunk holds the same `m` elements of every rank's block, block q at q * m.
  const size_t chunk_elems = std::max<size_t>(1, seg_.stage_bytes() / esize / static_cast<size_t>(size_));
  const auto* in = static_cast<const char*>(input);
  auto* out = static_cast<char*>(output);
  if (count == 0) sync(deadline);
  for (size_t off = 0; off < count; off += chunk_elems, ++chunk_) {
    const size_t m = std::min(chunk_elems, count - off);
    char* mine = stage(rank_);
    for (int q = 0; q < size_; ++q) {
      copy_bytes(mine + static_cast<size_t>(q) * m * esize, in + (static_cast<size_t>(q) * count + off) * esize,
                 m * esize);
    }
    sync(deadline);
    const size_t at = static_cast<size_t>(rank_) * m * esize;
    reduce_in_rank_order(
        out + off * esize, size_, [&](int q) { return stage(q) + at; }, m, dtype, op);
  }
}

void Collectives::reduce_scatter_mapped(const char* inputs, size_t stride, void* output, size_t count, DataType dtype,
                                        ReduceOp op, Deadline deadline) {
  begin({Kind::reduce_scatter_mapped, dtype, count, static_cast<uint64_t>(op)});
  const size_t at = static_cast<size_t>(rank_) * count * size_of(dtype);
  sync(deadline);  // every rank's input is written
  // In cache-sized blocks, so that the average's division reads what the sum just wrote from the
  // cache (one pass over the slice in memory instead of two).
  const size_t esize = size_of(dtype);
  const size_t block = kPublishBlockBytes / esize;
  for (size_t b = 0; b < count; b += block) {
    const size_t n = std::min(count, b + block) - b;
    reduce_in_rank_order(
        static_cast<char*>(output) + b * esize, size_, [&](int q) { return inputs + q * stride + at + b * esize; }, n,
        dtype, op);
  }
  sync(deadline);  // nobody reads them any more
}

void Collectives::all_reduce_mapped(char* vectors, size_t stride, size_t count, DataType dtype, ReduceOp op,
                                    Deadline deadline) {
  begin({Kind::all_reduce_mapped, dtype, count, static_cast<uint64_t>(op)});
  const size_t esize = size_of(dtype);
  sync(deadline);  // every rank's vector is written
  // Slice rank_ of every vector, reduced in rank order (the bits of the copying all_reduce) in
  // cache-sized blocks into a vector that the sum may overwrite (our own as rank 0 or 1, which
  // reduce_in_rank_order reads before it writes; else rank 0's), then copied from the cache into
  // every other vector. Nobody else reads or writes this slice in this phase.
  const auto range = slice(count, rank_, size_, esize);
  const size_t lo = range.first, hi = range.second;
  const size_t block = kPublishBlockBytes / esize;
  const int into = rank_ <= 1 ? rank_ : 0;
  for (size_t b = lo; b < hi; b += block) {
    // A rank that gave up (timeout, dead peer) aborts the segment: stop writing the others'
    // vectors within a block instead of finishing the slice.
    check_abort_();
    const size_t n = std::min(hi, b + block) - b;
    auto at = [&](int q) { return vectors + static_cast<size_t>(q) * stride + b * esize; };
    reduce_in_rank_order(at(into), size_, at, n, dtype, op);
    for (int k = 1; k < size_; ++k) {
      const int q = (into + k) % size_;
      copy_bytes(at(q), at(into), n * esize);
    }
  }
  sync(deadline);  // every vector holds every slice; nobody reads them any more
}

}  // namespace dtrain::comm::shm
