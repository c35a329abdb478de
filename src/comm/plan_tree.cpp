// Rooted collectives: broadcast, reduce, gather, scatter as binomial trees or linear.
//
// Vocabulary. Ranks are renumbered relative to the root: v = (rank - root) mod p, so the
// root is v = 0 and any root works. In the binomial tree of L = ceil(lg p) levels, node v's
// *parent* is v - lowbit(v) and its *subtree* is the contiguous range [v, min(v + lowbit(v), p))
// (lowbit(0) = 2^L). Down the tree (broadcast, scatter) round i uses distance m = 2^(L-1-i):
// a node v with v % 2m == 0 sends to v + m, the node v % 2m == m receives. Up the tree
// (reduce, gather) round k uses m = 2^k in the mirror pattern. Every rank has L rounds.
//
// Block layout for gather/scatter: blocks are ordered by *relative* rank in a node's scratch
// (rel_off[u] = sum of counts of relative ranks < u), so a subtree is one contiguous range;
// the root's output is in absolute order, where a subtree may wrap past rank p-1, so the
// messages to or from the root are cut at the wrap.
//
// Linear: one round, the root exchanges with every rank directly.
//
// Cost (n elements): binomial broadcast/reduce L rounds, n per message; gather/scatter L
// rounds, a subtree's blocks per message; linear 1 round, p-1 messages at the root.
#include <algorithm>

#include "plan_common.h"

namespace dtrain::comm::detail {

namespace {

struct Tree {
  Tree(int my_rank, int group_size, int root_rank)
      : rank(my_rank), size(group_size), root(root_rank), levels(ceil_log2(group_size)) {
    v = mod(rank - root, size);
  }
  int abs(int rel) const { return mod(rel + root, size); }
  int lowbit(int rel) const { return rel == 0 ? 1 << levels : rel & -rel; }
  int subtree_end(int rel) const { return std::min(rel + lowbit(rel), size); }

  int rank, size, root, levels, v;
};

// Blocks in relative order: counts and offsets indexed by relative rank.
struct RelativeBlocks {
  RelativeBlocks(const Tree& t, const std::vector<size_t>& counts) : abs_off(prefix_sums(counts)) {
    rel_count.resize(counts.size());
    for (int u = 0; u < t.size; ++u) rel_count[static_cast<size_t>(u)] = counts[static_cast<size_t>(t.abs(u))];
    rel_off = prefix_sums(rel_count);
  }
  size_t span(int lo, int hi) const { return rel_off[static_cast<size_t>(hi)] - rel_off[static_cast<size_t>(lo)]; }

  std::vector<size_t> abs_off;
  std::vector<size_t> rel_count;
  std::vector<size_t> rel_off;
};

// Relative ranks [lo, hi) split where absolute ranks wrap from p-1 to 0.
std::vector<std::pair<int, int>> split_at_wrap(const Tree& t, int lo, int hi) {
  const int wrap = t.size - t.root;  // relative rank of absolute rank 0
  if (lo < wrap && wrap < hi) return {{lo, wrap}, {wrap, hi}};
  return {{lo, hi}};
}

}  // namespace

Plan plan_tree_broadcast(int rank, int size, size_t count, int root) {
  PlanBuilder b(name_of(Algorithm::binomial));
  if (count == 0) return b.finish();
  const Tree t(rank, size, root);
  const Region all = out_region(0, count);
  if (t.v == 0) b.copy(0, in_region(0, count), all);
  for (int i = 0; i < t.levels; ++i) {
    const int m = 1 << (t.levels - 1 - i);
    const auto round = static_cast<size_t>(i);
    if (t.v % (2 * m) == 0 && t.v + m < size) b.send(round, t.abs(t.v + m), all);
    if (t.v % (2 * m) == m) b.recv(round, t.abs(t.v - m), all);
  }
  b.set_rounds(static_cast<size_t>(std::max(t.levels, 1)));
  return b.finish();
}

Plan plan_tree_reduce(int rank, int size, size_t count, int root) {
  PlanBuilder b(name_of(Algorithm::binomial));
  if (count == 0) return b.finish();
  const Tree t(rank, size, root);
  // The root accumulates in output; the others in scratch, leaving their output untouched.
  const Region acc = t.v == 0 ? out_region(0, count) : scratch_region(0, count);
  const Region landing = scratch_region(t.v == 0 ? 0 : count, count);
  b.copy(0, in_region(0, count), acc);
  for (int k = 0; k < t.levels; ++k) {
    const int m = 1 << k;
    const auto round = static_cast<size_t>(k);
    if (t.v % (2 * m) == 0 && t.v + m < size) b.recv_reduce(round, t.abs(t.v + m), landing, acc);
    if (t.v % (2 * m) == m) b.send(round, t.abs(t.v - m), acc);
  }
  b.set_rounds(static_cast<size_t>(std::max(t.levels, 1)));
  return b.finish();
}

Plan plan_tree_gather(int rank, int size, const std::vector<size_t>& counts, int root) {
  PlanBuilder b(name_of(Algorithm::binomial));
  const Tree t(rank, size, root);
  const RelativeBlocks blocks(t, counts);
  if (blocks.abs_off.back() == 0) return b.finish();
  const size_t own = counts[static_cast<size_t>(rank)];
  // A non-root node's scratch holds its subtree's blocks in relative order from its own.
  const auto local = [&](int lo, int hi) { return scratch_region(blocks.span(t.v, lo), blocks.span(lo, hi)); };
  if (t.v == 0) {
    b.copy(0, in_region(0, own), out_region(blocks.abs_off[static_cast<size_t>(rank)], own));
  } else {
    b.copy(0, in_region(0, own), scratch_region(0, own));
  }
  for (int k = 0; k < t.levels; ++k) {
    const int m = 1 << k;
    const auto round = static_cast<size_t>(k);
    if (t.v % (2 * m) == 0 && t.v + m < size) {
      const int child = t.v + m;
      const int end = t.subtree_end(child);
      if (t.v == 0) {  // straight into output, cut where absolute ranks wrap
        for (auto [lo, hi] : split_at_wrap(t, child, end)) {
          b.recv(round, t.abs(child), out_region(blocks.abs_off[static_cast<size_t>(t.abs(lo))], blocks.span(lo, hi)));
        }
      } else {
        b.recv(round, t.abs(child), local(child, end));
      }
    }
    if (t.v % (2 * m) == m) {
      const int parent = t.v - m;
      const int end = t.subtree_end(t.v);
      if (parent == 0) {
        for (auto [lo, hi] : split_at_wrap(t, t.v, end)) b.send(round, t.abs(parent), local(lo, hi));
      } else {
        b.send(round, t.abs(parent), local(t.v, end));
      }
    }
  }
  b.set_rounds(static_cast<size_t>(std::max(t.levels, 1)));
  return b.finish();
}

Plan plan_tree_scatter(int rank, int size, const std::vector<size_t>& counts, int root) {
  PlanBuilder b(name_of(Algorithm::binomial));
  const Tree t(rank, size, root);
  const RelativeBlocks blocks(t, counts);
  const size_t total = blocks.abs_off.back();
  if (total == 0) return b.finish();
  const size_t own = counts[static_cast<size_t>(rank)];
  // Scratch holds the blocks of relative ranks (v, subtree end) in relative order; the root's
  // holds everything, rotated so that relative rank 0 comes first.
  const int first = t.v == 0 ? 0 : t.v + 1;
  const auto local = [&](int lo, int hi) { return scratch_region(blocks.span(first, lo), blocks.span(lo, hi)); };
  if (t.v == 0) {
    const size_t head = blocks.abs_off[static_cast<size_t>(root)];  // blocks of ranks before the root
    b.copy(0, in_region(head, total - head), scratch_region(0, total - head));
    b.copy(0, in_region(0, head), scratch_region(total - head, head));
    b.copy(0, in_region(head, own), out_region(0, own));  // after the reads above: output may alias input
  }
  for (int i = 0; i < t.levels; ++i) {
    const int m = 1 << (t.levels - 1 - i);
    const auto round = static_cast<size_t>(i);
    if (t.v % (2 * m) == 0 && t.v + m < size) {
      const int child = t.v + m;
      const int end = t.subtree_end(child);
      b.send(round, t.abs(child), local(child, child + 1));  // lands in the child's output
      b.send(round, t.abs(child), local(child + 1, end));    // the rest of its subtree
    }
    if (t.v % (2 * m) == m) {
      b.recv(round, t.abs(t.v - m), out_region(0, own));
      b.recv(round, t.abs(t.v - m), local(t.v + 1, t.subtree_end(t.v)));
    }
  }
  b.set_rounds(static_cast<size_t>(std::max(t.levels, 1)));
  return b.finish();
}

Plan plan_linear_broadcast(int rank, int size, size_t count, int root) {
  PlanBuilder b(name_of(Algorithm::linear));
  if (count == 0) return b.finish();
  const Region all = out_region(0, count);
  if (rank == root) {
    b.copy(0, in_region(0, count), all);
    for (int j = 0; j < size; ++j) {
      if (j != root) b.send(0, j, all);
    }
  } else {
    b.recv(0, root, all);
  }
  b.set_rounds(1);
  return b.finish();
}

Plan plan_linear_reduce(int rank, int size, size_t count, int root) {
  PlanBuilder b(name_of(Algorithm::linear));
  if (count == 0) return b.finish();
  if (rank == root) {
    // One landing slot per peer; contributions are reduced in rank order.
    b.copy(0, in_region(0, count), out_region(0, count));
    size_t slot = 0;
    for (int j = 0; j < size; ++j) {
      if (j == root) continue;
      b.recv_reduce(0, j, scratch_region(slot * count, count), out_region(0, count));
      ++slot;
    }
  } else {
    b.copy(0, in_region(0, count), scratch_region(0, count));
    b.send(0, root, scratch_region(0, count));
  }
  b.set_rounds(1);
  return b.finish();
}

Plan plan_linear_gather(int rank, int size, const std::vector<size_t>& counts, int root) {
  PlanBuilder b(name_of(Algorithm::linear));
  const std::vector<size_t> off = prefix_sums(counts);
  if (off.back() == 0) return b.finish();
  const auto r = static_cast<size_t>(rank);
  if (rank == root) {
    b.copy(0, in_region(0, counts[r]), out_region(off[r], counts[r]));
    for (int j = 0; j < size; ++j) {
      const auto jj = static_cast<size_t>(j);
      if (j != root) b.recv(0, j, out_region(off[jj], counts[jj]));
    }
  } else {
    b.copy(0, in_region(0, counts[r]), scratch_region(0, counts[r]));
    b.send(0, root, scratch_region(0, counts[r]));
  }
  b.set_rounds(1);
  return b.finish();
}

Plan plan_linear_scatter(int rank, int size, const std::vector<size_t>& counts, int root) {
  PlanBuilder b(name_of(Algorithm::linear));
  const std::vector<size_t> off = prefix_sums(counts);
  const size_t total = off.back();
  if (total == 0) return b.finish();
  const auto r = static_cast<size_t>(rank);
  if (rank == root) {
    // Everything but our own block goes through scratch (sends never read input).
    b.copy(0, in_region(0, off[r]), scratch_region(0, off[r]));
    b.copy(0, in_region(off[r + 1], total - off[r + 1]), scratch_region(off[r + 1], total - off[r + 1]));
    b.copy(0, in_region(off[r], counts[r]), out_region(0, counts[r]));  // after: output may alias input
    for (int j = 0; j < size; ++j) {
      const auto jj = static_cast<size_t>(j);
      if (j != root) b.send(0, j, scratch_region(off[jj], counts[jj]));
    }
  } else {
    b.recv(0, root, out_region(0, counts[r]));
  }
  b.set_rounds(1);
  return b.finish();
}

}  // namespace dtrain::comm::detail
