// The hierarchical all_reduce (see plan_hierarchical.h for its vocabulary).
#include "plan_hierarchical.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include "dtrain/comm/reduce.h"
#include "executor.h"
#include "group_impl.h"

namespace dtrain::comm::detail {

namespace {
// A vector of at least twice this goes in segments of about this size (at most 8), pipelined
// between the host's shm and the link between hosts.
constexpr size_t kSegmentBytes = size_t{512} << 10;
// Below this, auto runs the flat algorithms on such a group (see chosen()).
constexpr size_t kMinBytes = size_t{64} << 10;
}  // namespace

HierarchicalAllReduce::HierarchicalAllReduce(HostLayout layout, int rank, int size, std::shared_ptr<Store> store,
                                             std::string group, GroupOptions options)
    : layout_(layout),
      rank_(rank),
      size_(size),
      store_(std::move(store)),
      group_(std::move(group)),
      options_(std::move(options)) {}

// On the 4-host test cluster (4 x 2 ranks, 1 Gbit/s; bench/netns_cluster.py) the flat
// recursive doubling wins up to 32 KiB (about 0.6 ms against 1.0: three phases and two
// hand-offs) and the hierarchical one from 64 KiB (1.3-1.9 ms against 1.9-2.0 for rd, 2.3 for
// the ring).
bool HierarchicalAllReduce::chosen(Algorithm requested, size_t bytes) {
  if (requested == Algorithm::hierarchical) return true;
  return requested == Algorithm::automatic && bytes >= kMinBytes;
}

void HierarchicalAllReduce::abort(const std::string& reason) {
  std::lock_guard<std::mutex> lock(mu_);
  for (Group* g : {&local_, &cross_}) {
    if (Group::Impl* impl = GroupAccess::impl_or_null(*g)) impl->abort(reason);
  }
}

void HierarchicalAllReduce::ensure_groups() {
  if (local_.size() > 0) return;
  const HostLayout& h = layout_;
  GroupOptions sub = options_;
  sub.heartbeat_timeout = Duration::zero();  // this group's processes are covered already
  sub.heartbeat_store = nullptr;
  sub.transport = TransportKind::shm;
  sub.algorithm = Algorithm::direct;
  Group local = Group::create(store_, h.local_rank, h.local_size, sub, fmt::format("{}/hier/host{}", group_, h.host));
  sub.transport = TransportKind::tcp;
  // The ring between hosts: one stream per link and direction. Halving-doubling (auto's
  // choice for the pieces of 512 KiB segments) ran both local ranks' exchanges at once over
  // the same rate-limited links and stalled on retransmissions (4 MiB: 113 ms, p99 283 ms,
  // against 64 ms for the flat ring; bench/netns_cluster.py).
  sub.algorithm = Algorithm::ring;
  Group cross = Group::create(store_, h.host, h.hosts, sub, fmt::format("{}/hier/local{}", group_, h.local_rank));
  std::lock_guard<std::mutex> lock(mu_);
  local_ = std::move(local);
  cross_ = std::move(cross);
}

// Every rank ends with the same bytes: piece q is reduced by the same ring on every host, and
// every rank gathers the same pieces. avg sums and divides once at the end. A large vector
// goes in segments, pipelined: the host's reduce_scatter of segment s+1 and its all_gather of
// segment s-1 run (on the local group's thread) while segment s crosses the hosts (on the
// cross group's), so the link is rarely idle.
void HierarchicalAllReduce::run(Executor& parent, const void* send, void* recv, size_t count, DataType dtype,
                                ReduceOp op, Deadline deadline) {
  ensure_groups();
  const ReduceOp inner = op == ReduceOp::avg ? ReduceOp::sum : op;
  const size_t es = size_of(dtype);
  const auto l = static_cast<size_t>(layout_.local_size);
  const size_t segments = std::clamp<size_t>(count * es / kSegmentBytes, 1, 8);
  const size_t block = (count + l * segments - 1) / (l * segments);  // elements of one piece
  const size_t padded = block * l * segments;
  const bool pad = padded != count;
  const char* in = static_cast<const char*>(send);
  char* out = static_cast<char*>(recv);
  if (pad) {
    padded_.resize(padded * es);
    if (count > 0) std::memcpy(padded_.data(), send, count * es);
    std::memset(padded_.data() + count * es, 0, (padded - count) * es);  // only the tail needs zeros
    in = out = reinterpret_cast<char*>(padded_.data());
  }
  piece_.resize(std::max<size_t>(block * segments * es, 1));
  char* piece = reinterpret_cast<char*>(piece_.data());
  const size_t seg_bytes = block * l * es;
  std::vector<Work> rs(segments), ar(segments), ag(segments);
  std::exception_ptr failed;
  // Waits for a sub-operation until this call's deadline; meanwhile the group's sends and
  // receives in flight keep moving (a peer may need them before it reaches this call).
  auto wait = [&](Work& w) {
    if (!w.valid()) return false;
    try {
      parent.wait_polling(w, deadline);
      return true;
    } catch (...) {
      if (!failed) {
        failed = std::current_exception();
        // The peers on this host and across hosts must not wait for phases this rank skips.
        abort(fmt::format("rank {}: hierarchical all_reduce failed", rank_));
      }
      return false;
    }
  };
  for (size_t k = 0; k < segments; ++k) {
    rs[k] = local_.reduce_scatter_async(in + k * seg_bytes, piece + k * block * es, block, dtype, inner);
  }
  for (size_t k = 0; k < segments && !failed; ++k) {
    if (!wait(rs[k])) break;
    ar[k] = cross_.all_reduce_async(piece + k * block * es, piece + k * block * es, block, dtype, inner);
    if (k > 0 && wait(ar[k - 1])) {
      ag[k - 1] = local_.all_gather_async(piece + (k - 1) * block * es, out + (k - 1) * seg_bytes, block, dtype);
    }
  }
  if (!failed && wait(ar[segments - 1])) {
    ag[segments - 1] =
        local_.all_gather_async(piece + (segments - 1) * block * es, out + (segments - 1) * seg_bytes, block, dtype);
  }
  // Every operation still touching the buffers ends before this returns or throws.
  for (auto* works : {&rs, &ar, &ag}) {
    for (Work& w : *works) wait(w);
  }
  if (failed) std::rethrow_exception(failed);
  if (pad && count > 0) std::memcpy(recv, padded_.data(), count * es);
  finish_avg(recv, count, dtype, op, size_);
}

}  // namespace dtrain::comm::detail
