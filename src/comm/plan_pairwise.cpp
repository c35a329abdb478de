// all_to_all by pairwise exchange, and the dissemination barrier.
//
// all_to_all: block j of rank r's input (c elements) goes to rank j, landing in its block r.
// Round s = 1..p-1 exchanges one block with one peer: with p a power of two the peers pair
// up (r ^ s, a true swap); otherwise r sends to r+s and receives from r-s. The input is
// copied to scratch first so that input and output may be the same buffer. Cost: p-1
// rounds, c elements per message, (p-1)c sent per rank.
//
// Barrier (dissemination): round k sends a zero-byte message to r + 2^k and receives one
// from r - 2^k; after ceil(lg p) rounds every rank has heard, transitively, from every
// other, so none leaves before all arrived.
#include "plan_common.h"

namespace dtrain::comm::detail {

Plan plan_pairwise_all_to_all(int rank, int size, size_t count_per_rank) {
  PlanBuilder b(name_of(Algorithm::pairwise));
  const size_t c = count_per_rank;
  if (c == 0) return b.finish();
  const auto r = static_cast<size_t>(rank);
  const auto p = static_cast<size_t>(size);
  b.copy(0, in_region(0, r * c), scratch_region(0, r * c));
  b.copy(0, in_region((r + 1) * c, (p - r - 1) * c), scratch_region((r + 1) * c, (p - r - 1) * c));
  b.copy(0, in_region(r * c, c), out_region(r * c, c));
  const bool power_of_two = (size & (size - 1)) == 0;
  for (int s = 1; s < size; ++s) {
    const int to = power_of_two ? rank ^ s : mod(rank + s, size);
    const int from = power_of_two ? rank ^ s : mod(rank - s, size);
    const auto round = static_cast<size_t>(s - 1);
    b.send(round, to, scratch_region(static_cast<size_t>(to) * c, c));
    b.recv(round, from, out_region(static_cast<size_t>(from) * c, c));
  }
  b.set_rounds(static_cast<size_t>(std::max(size - 1, 1)));
  return b.finish();
}

Plan plan_dissemination_barrier(int rank, int size) {
  PlanBuilder b("dissemination");
  const int levels = ceil_log2(size);
  for (int k = 0; k < levels; ++k) {
    const auto round = static_cast<size_t>(k);
    b.send_token(round, mod(rank + (1 << k), size));
    b.recv_token(round, mod(rank - (1 << k), size));
  }
  return b.finish();
}

}  // namespace dtrain::comm::detail
