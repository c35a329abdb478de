#include "dtrain/plan/cost.h"

#include <algorithm>
#include <cmath>

namespace dtrain::plan {

namespace {

// dtrain's shared-memory direct collectives stage chunks of this many bytes (DTRAIN_SHM_STAGE_BYTES).
constexpr double kShmStageBytes = 1 << 20;
// Up to this size a direct all_reduce copies every contribution whole (one synchronisation).
constexpr double kShmSmallBytes = 16384;

// `bytes` moved over a link: the wire and the cores that move them.
Cost moved(double bytes, const LinkCost& l) { return Cost{0.0, bytes * l.beta_wire, bytes * l.beta_cpu}; }

}  // namespace

double Cost::seconds() const { return latency + std::max(wire, cpu); }

Cost& Cost::operator+=(const Cost& o) {
  latency += o.latency;
  wire += o.wire;
  cpu += o.cpu;
  return *this;
}

comm::Algorithm all_reduce_algorithm(double bytes, int p, const LinkCost& link) {
  if (link.direct) return comm::Algorithm::direct;
  if (link.cheapest) {
    comm::Algorithm best = comm::Algorithm::ring;
    for (comm::Algorithm a : {comm::Algorithm::halving_doubling, comm::Algorithm::recursive_doubling}) {
      if (all_reduce_cost(a, bytes, p, link).seconds() < all_reduce_cost(best, bytes, p, link).seconds()) best = a;
    }
    return best;
  }
  return comm::choose_all_reduce(static_cast<size_t>(std::max(0.0, bytes)), p);
}

Cost all_reduce_cost(comm::Algorithm a, double n, int p, const LinkCost& l) {
  if (p <= 1 || n <= 0) return {};
  if (a == comm::Algorithm::automatic) a = all_reduce_algorithm(n, p, l);
  const double P = p;
  const double lg = std::ceil(std::log2(P));
  const double share = n * (P - 1) / P;  // bytes each rank reduces in a reduce-scatter
  Cost c;
  switch (a) {
    case comm::Algorithm::halving_doubling:
      c = moved(2 * share, l);
      c.latency = 2 * lg * l.alpha;
      c.cpu += share * l.gamma;
      return c;
    case comm::Algorithm::recursive_doubling:
      c = moved(lg * n, l);
      c.latency = lg * l.alpha;
      c.cpu += lg * n * l.gamma;
      return c;
    case comm::Algorithm::direct: {
      // Per chunk: copy in, reduce a 1/p slice from the p-1 other slots, copy out; two
      // synchronisations per chunk (one for small messages, copied whole by every rank).
      const double chunks = std::max(1.0, std::ceil(n / kShmStageBytes));
      const bool small = n <= kShmSmallBytes;
      c.latency = chunks * (small ? 1 : 2) * l.alpha;
      c.cpu = (small ? n + (P - 1) * n : 2 * n) * l.copy + (small ? (P - 1) * n : share) * l.gamma;
      return c;
    }
    default:  // ring
      c = moved(2 * share, l);
      c.latency = 2 * (P - 1) * l.alpha;
      c.cpu += share * l.gamma;
      return c;
  }
}

Cost reduce_scatter_cost(double n, int p, const LinkCost& l) {
  if (p <= 1 || n <= 0) return {};
  const double share = n * (p - 1) / p;
  if (l.direct) return Cost{2 * l.alpha, 0.0, 2 * n / p * l.copy + share * l.gamma};
  Cost c = moved(share, l);
  c.latency = (p - 1) * l.alpha;
  c.cpu += share * l.gamma;
  return c;
}

Cost all_gather_cost(double n, int p, const LinkCost& l) {
  if (p <= 1 || n <= 0) return {};
  const double share = n * (p - 1) / p;
  if (l.direct) return Cost{2 * l.alpha, 0.0, (n / p + n) * l.copy};
  Cost c = moved(share, l);
  c.latency = (p - 1) * l.alpha;
  return c;
}

Cost p2p_cost(double n, const LinkCost& l) {
  Cost c = moved(std::max(0.0, n), l);
  c.latency = l.alpha;
  return c;
}

}  // namespace dtrain::plan
