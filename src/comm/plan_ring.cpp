// Ring algorithms: reduce-scatter, all-gather, and all-reduce as the two back to back.
//
// Vocabulary. The vector is cut into p *chunks* (all_reduce: sizes differ by at most one,
// larger first; the v forms: chunk b is counts[b]), and every chunk into *segments* of at
// most `segment` elements; segment g of a chunk is its elements [g*segment, (g+1)*segment)
// (empty for a short chunk). Rank r sends to right = r+1 and receives from left = r-1.
// A *step* moves one segment of one chunk to the right neighbour; a round is one step.
// Segment-major order: all steps of segment g, then segment g+1, so the segment a rank just
// reduced is the one it sends next while it is still in cache.
//
// Reduce-scatter, step s = 0..p-2: rank r sends chunk (r-1-s) and receives chunk (r-2-s),
// reducing its own contribution into it. Chunk c starts at rank c+1 and travels right
// through every rank once; after p-1 steps rank r holds chunk r fully reduced.
// All-gather, step s = 0..p-2: rank r sends chunk (r-s), receives chunk (r-1-s) into output.
//
// Same result on every rank: each chunk is reduced by exactly one chain of ranks, in one
// order, and then copied verbatim to the others, so all ranks end with bitwise-identical
// floats (data parallelism relies on identical parameters everywhere).
//
// Cost, n elements, p ranks, S segments per chunk: all_reduce 2(p-1)S rounds, each rank
// sends 2n - chunk(r) - chunk(r+1) ~ 2n(p-1)/p elements; reduce_scatter / all_gather (p-1)S
// and p-1 rounds, sending total - counts[r] and total - counts[r+1] elements.
#include <algorithm>

#include "plan_common.h"

namespace dtrain::comm::detail {

namespace {

struct Segments {
  Segments(const std::vector<size_t>& chunk_counts, size_t max_segment) : counts(chunk_counts) {
    offsets = prefix_sums(counts);
    const size_t largest = *std::max_element(counts.begin(), counts.end());
    length = std::min(std::max<size_t>(max_segment, 1), largest);
    number = length == 0 ? 0 : (largest + length - 1) / length;
  }
  /// Chunk-local start and size of segment g of chunk c.
  size_t begin(int c, size_t g) const { return std::min(g * length, counts[static_cast<size_t>(c)]); }
  size_t size(int c, size_t g) const {
    return std::min(begin(c, g) + length, counts[static_cast<size_t>(c)]) - begin(c, g);
  }
  /// Offset of segment g of chunk c in the whole vector.
  size_t at(int c, size_t g) const { return offsets[static_cast<size_t>(c)] + begin(c, g); }

  std::vector<size_t> counts;
  std::vector<size_t> offsets;
  size_t length = 0;  // elements per segment
  size_t number = 0;  // segments per (largest) chunk
};

}  // namespace

Plan plan_ring_all_reduce(int rank, int size, size_t count, size_t segment) {
  PlanBuilder b(name_of(Algorithm::ring));
  if (count == 0) return b.finish();
  if (size == 1) {
    b.copy(0, in_region(0, count), out_region(0, count));
    return b.finish();
  }
  const Segments seg(even_counts(count, size), segment);
  const int right = mod(rank + 1, size);
  const int left = mod(rank - 1, size);
  const size_t steps = static_cast<size_t>(size - 1);
  size_t round = 0;
  // In place is free: a chunk's input is copied into output (a no-op when they are the same
  // buffer) just before the step that first reduces into it or sends it.
  auto load = [&](size_t r, int c, size_t g) {
    b.copy(r, in_region(seg.at(c, g), seg.size(c, g)), out_region(seg.at(c, g), seg.size(c, g)));
  };
  for (size_t g = 0; g < seg.number; ++g) {
    for (size_t s = 0; s < steps; ++s, ++round) {
      const int send_c = mod(rank - 1 - static_cast<int>(s), size);
      const int recv_c = mod(rank - 2 - static_cast<int>(s), size);
      if (s == 0) load(round, send_c, g);
      load(round, recv_c, g);
      b.send(round, right, out_region(seg.at(send_c, g), seg.size(send_c, g)));
      b.recv_reduce(round, left, scratch_region(0, seg.size(recv_c, g)),
                    out_region(seg.at(recv_c, g), seg.size(recv_c, g)));
    }
    for (size_t s = 0; s < steps; ++s, ++round) {
      const int send_c = mod(rank - static_cast<int>(s), size);
      const int recv_c = mod(rank - 1 - static_cast<int>(s), size);
      b.send(round, right, out_region(seg.at(send_c, g), seg.size(send_c, g)));
      b.recv(round, left, out_region(seg.at(recv_c, g), seg.size(recv_c, g)));
    }
  }
  b.set_rounds(round);
  return b.finish();
}

Plan plan_ring_reduce_scatter(int rank, int size, const std::vector<size_t>& counts, size_t segment) {
  PlanBuilder b(name_of(Algorithm::ring));
  const size_t own = counts[static_cast<size_t>(rank)];
  if (size == 1) {
    b.copy(0, in_region(0, own), out_region(0, own));
    return b.finish();
  }
  const Segments seg(counts, segment);
  if (seg.number == 0) return b.finish();
  const int right = mod(rank + 1, size);
  const int left = mod(rank - 1, size);
  const size_t steps = static_cast<size_t>(size - 1);
  // output holds only chunk `rank`, so partial sums travel through two scratch segments:
  // the one received last step (reduced with our input, then sent) and the one landing now.
  // Input is read by local ops only, output is written only at the last step of a segment:
  // with output aliasing the front of input, every input element under output segment g
  // belongs to a segment <= g of its chunk and has been read by then.
  auto buffer = [&](size_t s, size_t n) { return scratch_region((s % 2) * seg.length, n); };
  size_t round = 0;
  for (size_t g = 0; g < seg.number; ++g) {
    for (size_t s = 0; s < steps; ++s, ++round) {
      const int send_c = mod(rank - 1 - static_cast<int>(s), size);
      const int recv_c = mod(rank - 2 - static_cast<int>(s), size);
      const size_t send_n = seg.size(send_c, g);
      const size_t recv_n = seg.size(recv_c, g);
      if (s == 0) {
        b.copy(round, in_region(seg.at(send_c, g), send_n), buffer(s, send_n));
      } else {
        b.reduce_local(round, in_region(seg.at(send_c, g), send_n), buffer(s, send_n));
      }
      b.send(round, right, buffer(s, send_n));
      if (s + 1 < steps) {
        b.recv(round, left, buffer(s + 1, recv_n));
      } else {  // recv_c == rank: the last contribution lands and is reduced into output
        const size_t local = seg.begin(recv_c, g);
        b.copy(round, in_region(seg.at(recv_c, g), recv_n), out_region(local, recv_n));
        b.recv_reduce(round, left, buffer(s + 1, recv_n), out_region(local, recv_n));
      }
    }
  }
  b.set_rounds(round);
  return b.finish();
}

Plan plan_ring_all_gather(int rank, int size, const std::vector<size_t>& counts) {
  PlanBuilder b(name_of(Algorithm::ring));
  const std::vector<size_t> off = prefix_sums(counts);
  const size_t total = off.back();
  if (total == 0) return b.finish();
  const auto block = [&](int c) { return out_region(off[static_cast<size_t>(c)], counts[static_cast<size_t>(c)]); };
  b.copy(0, in_region(0, counts[static_cast<size_t>(rank)]), block(rank));
  const int right = mod(rank + 1, size);
  const int left = mod(rank - 1, size);
  for (int s = 0; s < size - 1; ++s) {
    b.send(static_cast<size_t>(s), right, block(mod(rank - s, size)));
    b.recv(static_cast<size_t>(s), left, block(mod(rank - 1 - s, size)));
  }
  b.set_rounds(static_cast<size_t>(std::max(size - 1, 1)));
  return b.finish();
}

}  // namespace dtrain::comm::detail
