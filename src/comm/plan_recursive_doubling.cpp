// Recursive doubling: all_reduce for small vectors and all_gather.
//
// Vocabulary as in plan_halving_doubling.cpp: p2 = 2^floor(lg p) *survivors*; the first
// 2(p - p2) ranks *fold* in pairs before (odd sends to even, even reduces lower op higher)
// and *unfold* after. Step k = 0..lg(p2)-1 pairs survivor nr with nr ^ 2^k.
//
// all_reduce: at every step the partners exchange their whole vectors and both reduce.
// Same result on every rank: both partners combine the same two vectors, and every reduction
// kernel is bitwise commutative (reduce.cpp: IEEE add/mul are; max/min are symmetric,
// -0 < +0), so "mine op theirs" on one side equals "theirs op mine" on the other, bit for
// bit, and by induction all ranks end with identical results. Cost: lg p2 rounds (+2 with
// the fold), n elements sent per round.
//
// all_gather: at step k a survivor holds the blocks of an aligned group of 2^k survivors and
// swaps them with its partner's group; lg p2 rounds (+2), total - own elements received.
#include "plan_common.h"

namespace dtrain::comm::detail {

Plan plan_rd_all_reduce(int rank, int size, size_t count) {
  PlanBuilder b(name_of(Algorithm::recursive_doubling));
  if (count == 0) return b.finish();
  const Fold fold(size);
  const Region all = out_region(0, count);
  const Region landing = scratch_region(0, count);
  b.copy(0, in_region(0, count), all);
  size_t round = 0;
  const bool folded_pair = rank < 2 * fold.extra;
  if (fold.extra > 0) {
    if (folded_pair && rank % 2 == 1) b.send(round, rank - 1, all);
    if (folded_pair && rank % 2 == 0) b.recv_reduce(round, rank + 1, landing, all);
    ++round;
  }
  const int nr = fold.new_rank(rank);
  const auto L = static_cast<size_t>(fold.log2_p2);
  if (nr >= 0) {
    for (size_t k = 0; k < L; ++k) {
      const int peer = fold.first_old(nr ^ (1 << k));
      b.send(round + k, peer, all);
      b.recv_reduce(round + k, peer, landing, all);
    }
  }
  round += L;
  if (fold.extra > 0) {
    if (folded_pair && rank % 2 == 0) b.send(round, rank + 1, all);
    if (folded_pair && rank % 2 == 1) b.recv(round, rank - 1, all);
    ++round;
  }
  b.set_rounds(round);
  return b.finish();
}

Plan plan_rd_all_gather(int rank, int size, const std::vector<size_t>& counts) {
  PlanBuilder b(name_of(Algorithm::recursive_doubling));
  const std::vector<size_t> off = prefix_sums(counts);
  const size_t total = off.back();
  if (total == 0) return b.finish();
  const auto r = static_cast<size_t>(rank);
  const auto block = [&](size_t first, size_t end) { return out_region(off[first], off[end] - off[first]); };
  b.copy(0, in_region(0, counts[r]), block(r, r + 1));
  const Fold fold(size);
  size_t round = 0;
  const bool folded_pair = rank < 2 * fold.extra;
  if (fold.extra > 0) {
    if (folded_pair && rank % 2 == 1) b.send(round, rank - 1, block(r, r + 1));
    if (folded_pair && rank % 2 == 0) b.recv(round, rank + 1, block(r + 1, r + 2));
    ++round;
  }
  const int nr = fold.new_rank(rank);
  const auto L = static_cast<size_t>(fold.log2_p2);
  // Blocks of survivors [lo, hi): the original ranks they stand for are contiguous.
  const auto group = [&](int lo, int hi) {
    return block(static_cast<size_t>(fold.first_old(lo)), static_cast<size_t>(fold.end_old(hi - 1)));
  };
  if (nr >= 0) {
    for (size_t k = 0; k < L; ++k) {
      const int m = 1 << k;
      const int mine = nr & ~(m - 1);
      const int theirs = (nr ^ m) & ~(m - 1);
      const int peer = fold.first_old(nr ^ m);
      b.send(round + k, peer, group(mine, mine + m));
      b.recv(round + k, peer, group(theirs, theirs + m));
    }
  }
  round += L;
  if (fold.extra > 0) {
    // The folded rank already has its own block: send what lies before and after it.
    const size_t n = static_cast<size_t>(size);
    if (folded_pair && rank % 2 == 0) {
      b.send(round, rank + 1, block(0, r + 1));
      b.send(round, rank + 1, block(r + 2, n));
    }
    if (folded_pair && rank % 2 == 1) {
      b.recv(round, rank - 1, block(0, r));
      b.recv(round, rank - 1, block(r + 1, n));
    }
    ++round;
  }
  b.set_rounds(round);
  return b.finish();
}

}  // namespace dtrain::comm::detail
