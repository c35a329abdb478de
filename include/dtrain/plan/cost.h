// Cost of communication for the planner: the alpha-beta-gamma model of ../shared/BENCHMARKS.md.
//
// Vocabulary: a message of n bytes over a link costs alpha (latency, seconds) plus n x beta
// (seconds per byte); a reduction costs gamma seconds per byte reduced. The planner splits every
// cost into three parts because they behave differently when resources are shared:
//   latency  waiting that uses neither a link nor a core (alpha terms);
//   wire     time a link is busy (n x beta of a network link; slows when flows share a link);
//   cpu      work a core does (shared-memory copies, TCP stack, reductions; slows when ranks
//            share cores).
// A collective on idle resources takes latency + max(wire, cpu). With all bytes on the cpu side
// (shared memory) this is exactly the BENCHMARKS.md formula, e.g. for the ring all-reduce
// 2(p-1) alpha + 2n(p-1)/p beta + n(p-1)/p gamma.
#pragma once

#include "dtrain/comm/plan.h"

namespace dtrain::plan {

/// One kind of connection between two ranks.
struct LinkCost {
  double alpha = 0.0;      // seconds per message
  double beta_wire = 0.0;  // seconds per byte the link is busy
  double beta_cpu = 0.0;   // seconds per byte a core is busy moving it (copies, protocol)
  double gamma = 0.0;      // seconds per byte reduced (a core)
  double copy = 0.0;       // seconds per byte of a local memcpy (shared-memory direct collectives)
  bool direct = false;     // the transport has native collectives (dtrain's shared memory)
  bool cheapest = false;   // the library picks the cheapest algorithm (as NCCL does), not Group's choice
};

/// A communication's time split as described above.
struct Cost {
  double latency = 0.0, wire = 0.0, cpu = 0.0;
  /// Time on idle resources: latency + max(wire, cpu).
  double seconds() const;
  Cost& operator+=(const Cost& o);
};

/// The algorithm dtrain's Group runs for an all_reduce of `bytes` over `p` ranks on `link`:
/// direct on shared memory, else comm::choose_all_reduce; with link.cheapest the cheapest of
/// ring, halving-doubling and recursive doubling.
comm::Algorithm all_reduce_algorithm(double bytes, int p, const LinkCost& link);

/// all_reduce of n bytes over p ranks: ring 2(p-1) alpha + 2n(p-1)/p beta + n(p-1)/p gamma;
/// halving-doubling 2 lg(p) alpha + (the ring's bytes); recursive doubling lg(p)(alpha + n beta +
/// n gamma); direct (shared memory) as modelled by `dtrain bench collectives --model`.
/// `automatic` picks as all_reduce_algorithm(). p = 1 or n = 0 cost nothing.
Cost all_reduce_cost(comm::Algorithm a, double n, int p, const LinkCost& link);
/// reduce_scatter of n bytes in total (n/p per rank): (p-1) alpha + n(p-1)/p (beta + gamma).
Cost reduce_scatter_cost(double n, int p, const LinkCost& link);
/// all_gather of n bytes in total: (p-1) alpha + n(p-1)/p beta.
Cost all_gather_cost(double n, int p, const LinkCost& link);
/// One message of n bytes: alpha + n beta.
Cost p2p_cost(double n, const LinkCost& link);

}  // namespace dtrain::plan
