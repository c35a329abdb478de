// Recursive halving-doubling (Rabenseifner): all_reduce and reduce_scatter.
//
// Vocabulary. p2 = 2^floor(lg p) *survivors* run the power-of-two algorithm; with p not a
// power of two the first 2(p - p2) ranks *fold* in pairs first (the odd rank sends its whole
// vector to the even one, which reduces it: lower rank op higher rank) and *unfold* last
// (the even rank returns the result). Survivor nr stands for original ranks
// [first_old(nr), end_old(nr)), so survivors own contiguous, increasing ranges of blocks.
//
// The vector is cut into p2 *blocks* (all_reduce: sizes differ by at most one; reduce_scatter:
// block of survivor nr = the counts of the ranks it stands for). Halving step with distance
// m = p2/2, p2/4, ..., 1: the survivor keeps the half of its current block range containing
// nr (upper half if nr & m), sends the other half to nr ^ m and reduces the half it receives;
// after lg p2 steps survivor nr holds block nr fully reduced. Doubling steps with m = 1, 2,
// ..., p2/2 exchange the ranges held, so every survivor ends with every block.
//
// Same result on every rank: each block is reduced by exactly one survivor and copied
// verbatim to the others (bitwise-identical floats everywhere).
//
// Cost: 2 lg p2 rounds (+2 with the fold), each survivor sends about 2n(p2-1)/p2 elements
// (+n on folded pairs); reduce_scatter: lg p2 rounds (+2), no all-gather half.
#include "plan_common.h"

namespace dtrain::comm::detail {

namespace {

// Element range [begin, end) of survivors [lo, hi).
struct SurvivorRanges {
  SurvivorRanges(const Fold& fold, const std::vector<size_t>& block_offsets, bool blocks_are_survivors)
      : fold_(fold), off_(block_offsets), by_survivor_(blocks_are_survivors) {}
  size_t begin(int lo) const { return off_[static_cast<size_t>(by_survivor_ ? lo : fold_.first_old(lo))]; }
  size_t end(int hi) const { return off_[static_cast<size_t>(by_survivor_ ? hi : fold_.end_old(hi - 1))]; }
  Region range(Buf buf, int lo, int hi, size_t base = 0) const { return {buf, base + begin(lo), end(hi) - begin(lo)}; }

 private:
  const Fold& fold_;
  const std::vector<size_t>& off_;
  bool by_survivor_;
};

}  // namespace

Plan plan_hd_all_reduce(int rank, int size, size_t count) {
  PlanBuilder b(name_of(Algorithm::halving_doubling));
  if (count == 0) return b.finish();
  const Fold fold(size);
  const std::vector<size_t> off = prefix_sums(even_counts(count, fold.p2));
  const SurvivorRanges ranges(fold, off, /*blocks_are_survivors=*/true);
  const Region all = out_region(0, count);
  b.copy(0, in_region(0, count), all);
  size_t round = 0;
  if (fold.extra > 0) {
    if (rank < 2 * fold.extra) {
      if (rank % 2 == 1) {
        b.send(round, rank - 1, all);
      } else {
        b.recv_reduce(round, rank + 1, scratch_region(0, count), all);
      }
    }
    ++round;
  }
  const int nr = fold.new_rank(rank);
  const auto L = static_cast<size_t>(fold.log2_p2);
  if (nr >= 0) {
    for (size_t k = 0; k < L; ++k) {  // halving: reduce-scatter
      const int m = fold.p2 >> (k + 1);
      const int base = nr & ~(2 * m - 1);
      const int peer = fold.first_old(nr ^ m);
      const bool upper = (nr & m) != 0;
      const int keep_lo = upper ? base + m : base;
      const int give_lo = upper ? base : base + m;
      const Region keep = ranges.range(Buf::output, keep_lo, keep_lo + m);
      b.send(round + k, peer, ranges.range(Buf::output, give_lo, give_lo + m));
      b.recv_reduce(round + k, peer, scratch_region(0, keep.count), keep);
    }
    for (size_t k = 0; k < L; ++k) {  // doubling: all-gather
      const int m = 1 << k;
      const int mine = nr & ~(m - 1);
      const int theirs = (nr ^ m) & ~(m - 1);
      const int peer = fold.first_old(nr ^ m);
      b.send(round + L + k, peer, ranges.range(Buf::output, mine, mine + m));
      b.recv(round + L + k, peer, ranges.range(Buf::output, theirs, theirs + m));
    }
  }
  round += 2 * L;
  if (fold.extra > 0) {
    if (rank < 2 * fold.extra) {
      if (rank % 2 == 0) {
        b.send(round, rank + 1, all);
      } else {
        b.recv(round, rank - 1, all);
      }
    }
    ++round;
  }
  b.set_rounds(round);
  return b.finish();
}

Plan plan_hd_reduce_scatter(int rank, int size, const std::vector<size_t>& counts) {
  PlanBuilder b(name_of(Algorithm::halving_doubling));
  const std::vector<size_t> off = prefix_sums(counts);
  const size_t total = off.back();
  const size_t own = counts[static_cast<size_t>(rank)];
  if (total == 0) return b.finish();
  if (size == 1) {
    b.copy(0, in_region(0, own), out_region(0, own));
    return b.finish();
  }
  const Fold fold(size);
  const SurvivorRanges ranges(fold, off, /*blocks_are_survivors=*/false);
  // Partial sums live in scratch [0, total) (output is only our block); landings after it.
  // The whole input is copied in round 0, so output (possibly the front of input) is free
  // to write from then on.
  const Region acc = scratch_region(0, total);
  b.copy(0, in_region(0, total), acc);
  size_t round = 0;
  if (fold.extra > 0) {
    if (rank < 2 * fold.extra) {
      if (rank % 2 == 1) {
        b.send(round, rank - 1, acc);
      } else {
        b.recv_reduce(round, rank + 1, scratch_region(total, total), acc);
      }
    }
    ++round;
  }
  const int nr = fold.new_rank(rank);
  const auto L = static_cast<size_t>(fold.log2_p2);
  const bool folded_pair = rank < 2 * fold.extra;
  if (nr >= 0) {
    for (size_t k = 0; k < L; ++k) {
      const int m = fold.p2 >> (k + 1);
      const int base = nr & ~(2 * m - 1);
      const int peer = fold.first_old(nr ^ m);
      const bool upper = (nr & m) != 0;
      const int keep_lo = upper ? base + m : base;
      const int give_lo = upper ? base : base + m;
      const Region keep = ranges.range(Buf::scratch, keep_lo, keep_lo + m);
      b.send(round + k, peer, ranges.range(Buf::scratch, give_lo, give_lo + m));
      const Region landing = scratch_region(total, keep.count);
      if (k + 1 == L && !folded_pair) {  // the last step reduces straight into output
        b.copy(round + k, scratch_region(off[static_cast<size_t>(rank)], own), out_region(0, own));
        b.recv_reduce(round + k, peer, landing, out_region(0, own));
      } else {
        b.recv_reduce(round + k, peer, landing, keep);
      }
    }
  }
  round += L;
  if (fold.extra > 0) {
    if (folded_pair) {
      if (rank % 2 == 0) {
        b.copy(round, scratch_region(off[static_cast<size_t>(rank)], own), out_region(0, own));
        b.send(round, rank + 1,
               scratch_region(off[static_cast<size_t>(rank) + 1], counts[static_cast<size_t>(rank) + 1]));
      } else {
        b.recv(round, rank - 1, out_region(0, own));
      }
    }
    ++round;
  }
  b.set_rounds(round);
  return b.finish();
}

}  // namespace dtrain::comm::detail
