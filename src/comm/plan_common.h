// Internal helpers shared by the plan_*.cpp algorithm files: a builder that appends ops to
// numbered rounds, block offsets, the fold of non power-of-two worlds, and the per-algorithm
// entry points that plan_common.cpp dispatches to (tests call the ring ones directly to pick
// a small segment size).
//
// Conventions every plan keeps (tests/comm_plan_test.cpp checks them on every plan):
// - `input` is only the source of local ops, and a reduce_local reading `input` writes
//   scratch, so input == output (in place) is safe;
// - a message of round k is sent and received in round k on both sides, so tags
//   (tag_base + k) match; empty messages are dropped on both sides (sizes are global);
// - within a round, what the wait writes (recv dst, recv_reduce landing) overlaps neither
//   another such region nor a send source.
#pragma once

#include <algorithm>
#include <cstddef>
#include <string>
#include <vector>

#include "dtrain/comm/plan.h"

namespace dtrain::comm::detail {

/// Ring segment: a round of the ring moves at most this many elements per message
/// (pipelining, bounded scratch, the landing segment stays in cache while reduced).
inline constexpr size_t kRingSegmentElems = size_t{64} * 1024;

inline Region in_region(size_t offset, size_t count) { return {Buf::input, offset, count}; }
inline Region out_region(size_t offset, size_t count) { return {Buf::output, offset, count}; }
inline Region scratch_region(size_t offset, size_t count) { return {Buf::scratch, offset, count}; }

class PlanBuilder {
 public:
  explicit PlanBuilder(std::string algorithm) { plan_.algorithm = std::move(algorithm); }

  // Empty regions are dropped: both ends of a message compute the same size.
  void copy(size_t round, Region src, Region dst) {
    if (src.count > 0) add(round, {PlanOp::Kind::copy, -1, src, dst});
  }
  void reduce_local(size_t round, Region src, Region dst) {
    if (src.count > 0) add(round, {PlanOp::Kind::reduce_local, -1, src, dst});
  }
  void send(size_t round, int peer, Region src) {
    if (src.count > 0) add(round, {PlanOp::Kind::send, peer, src, {}});
  }
  void recv(size_t round, int peer, Region dst) {
    if (dst.count > 0) add(round, {PlanOp::Kind::recv, peer, {}, dst});
  }
  void recv_reduce(size_t round, int peer, Region landing, Region dst) {
    if (dst.count > 0) add(round, {PlanOp::Kind::recv_reduce, peer, landing, dst});
  }
  /// Zero-byte messages for the barrier (not dropped).
  void send_token(size_t round, int peer) { add(round, {PlanOp::Kind::send, peer, scratch_region(0, 0), {}}); }
  void recv_token(size_t round, int peer) { add(round, {PlanOp::Kind::recv, peer, {}, scratch_region(0, 0)}); }

  /// Every rank of a collective gets the same number of rounds (some possibly empty).
  void set_rounds(size_t n) { plan_.rounds.resize(std::max(n, plan_.rounds.size())); }
  Plan finish() { return std::move(plan_); }

 private:
  void add(size_t round, PlanOp op) {
    if (round >= plan_.rounds.size()) plan_.rounds.resize(round + 1);
    for (const Region* r : {&op.src, &op.dst}) {
      if (r->buf == Buf::scratch) plan_.scratch_count = std::max(plan_.scratch_count, r->offset + r->count);
    }
    plan_.rounds[round].ops.push_back(op);
  }
  Plan plan_;
};

/// offsets[i] = counts[0] + ... + counts[i-1]; size counts.size() + 1.
std::vector<size_t> prefix_sums(const std::vector<size_t>& counts);
/// `count` cut into `parts` chunks whose sizes differ by at most one (larger ones first).
std::vector<size_t> even_counts(size_t count, int parts);
inline int mod(int a, int p) { return ((a % p) + p) % p; }
/// Smallest L with 2^L >= n (0 for n <= 1).
int ceil_log2(int n);

/// Fold of a non power-of-two world of `size` ranks onto p2 = 2^floor(lg size): the first
/// 2 * extra ranks pair up (2i, 2i+1); the odd one hands its data to the even one before the
/// power-of-two algorithm and gets the result after. new_rank numbers the p2 survivors.
struct Fold {
  explicit Fold(int size);
  int size;
  int p2;
  int extra;
  int log2_p2;
  /// -1 for a folded-out (odd) rank.
  int new_rank(int rank) const { return rank < 2 * extra ? (rank % 2 == 0 ? rank / 2 : -1) : rank - extra; }
  /// The original ranks a survivor stands for: [first_old, end_old).
  int first_old(int nr) const { return nr < extra ? 2 * nr : nr + extra; }
  int end_old(int nr) const { return nr < extra ? 2 * nr + 2 : nr + extra + 1; }
};

// Per-algorithm plans (arguments already validated; size >= 1).
Plan plan_ring_all_reduce(int rank, int size, size_t count, size_t segment = kRingSegmentElems);
Plan plan_ring_reduce_scatter(int rank, int size, const std::vector<size_t>& counts,
                              size_t segment = kRingSegmentElems);
Plan plan_ring_all_gather(int rank, int size, const std::vector<size_t>& counts);
Plan plan_hd_all_reduce(int rank, int size, size_t count);
Plan plan_hd_reduce_scatter(int rank, int size, const std::vector<size_t>& counts);
Plan plan_rd_all_reduce(int rank, int size, size_t count);
Plan plan_rd_all_gather(int rank, int size, const std::vector<size_t>& counts);
Plan plan_tree_broadcast(int rank, int size, size_t count, int root);
Plan plan_tree_reduce(int rank, int size, size_t count, int root);
Plan plan_tree_gather(int rank, int size, const std::vector<size_t>& counts, int root);
Plan plan_tree_scatter(int rank, int size, const std::vector<size_t>& counts, int root);
Plan plan_linear_broadcast(int rank, int size, size_t count, int root);
Plan plan_linear_reduce(int rank, int size, size_t count, int root);
Plan plan_linear_gather(int rank, int size, const std::vector<size_t>& counts, int root);
Plan plan_linear_scatter(int rank, int size, const std::vector<size_t>& counts, int root);
Plan plan_pairwise_all_to_all(int rank, int size, size_t count_per_rank);
Plan plan_dissemination_barrier(int rank, int size);

}  // namespace dtrain::comm::detail
