// Collective algorithms as plans: a plan is the list of sends, receives and local
// reductions one rank performs, computed before anything runs (so algorithms are testable
// without a network: tests/comm_plan_test.cpp executes the plans of all ranks in memory).
//
// Vocabulary: a plan addresses three buffers of the rank, `input`, `output` and a private
// `scratch`, by element offset and count (Region). A plan is a sequence of rounds. A round
// runs in three phases: (1) its local ops (copy, reduce_local) in order, (2) all its sends
// and receives posted together and waited for, (3) for each recv_reduce, the received data
// (landed in the op's `src` scratch region) reduced into `dst`, in order. Plans read `input`
// only in local ops, so they are correct when input and output are the same buffer (in place).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "dtrain/comm/transport.h"
#include "dtrain/comm/types.h"

namespace dtrain::comm {

enum class Buf : uint8_t { input, output, scratch };

struct Region {
  Buf buf = Buf::output;
  size_t offset = 0;  // elements
  size_t count = 0;   // elements
};

struct PlanOp {
  enum class Kind : uint8_t {
    copy,          // dst = src (local)
    reduce_local,  // dst = dst op src (local)
    send,          // send src to peer
    recv,          // receive from peer into dst
    recv_reduce,   // receive from peer into src (scratch), then dst = dst op src
  };
  Kind kind;
  int peer = -1;
  Region src;
  Region dst;
};

struct Round {
  std::vector<PlanOp> ops;
};

struct Plan {
  std::vector<Round> rounds;
  size_t scratch_count = 0;  // elements of scratch the plan needs
  std::string algorithm;     // for logs and benchmarks
};

enum class Algorithm : uint8_t {
  automatic,
  ring,                // reduce-scatter + all-gather around a ring, chunked
  halving_doubling,    // recursive halving (reduce-scatter) + recursive doubling (all-gather)
  recursive_doubling,  // lg(p) rounds exchanging the whole vector: small messages
  binomial,            // binomial tree: broadcast, reduce, gather, scatter
  linear,              // root talks to every rank directly
  pairwise,            // all_to_all: p-1 rounds of pairwise exchange
  direct,              // the transport's native collective (shm: straight from shared staging
                       // buffers); not a plan: Group runs it through Transport::direct()
  hierarchical,        // all_reduce of a group spanning hosts: reduce_scatter within each host
                       // (shm), all_reduce of each 1/L piece across hosts, all_gather within the
                       // host; not a plan: Group composes it from two sub-groups
};
const char* name_of(Algorithm a);
/// "auto", "ring", "hd", "rd", "tree", "linear", "pairwise", "direct", "hier"; throws dtrain::Error.
Algorithm parse_algorithm(const std::string& text);

/// Plans of the collectives for `rank` of `size`. Counts are elements. For the "v" forms,
/// counts[r] is rank r's share. Non power-of-two sizes are handled by every algorithm (the
/// power-of-two ones fold the extra ranks in first and out last).
Plan plan_all_reduce(Algorithm a, int rank, int size, size_t count);
Plan plan_reduce_scatter(Algorithm a, int rank, int size, const std::vector<size_t>& counts);
Plan plan_all_gather(Algorithm a, int rank, int size, const std::vector<size_t>& counts);
Plan plan_broadcast(Algorithm a, int rank, int size, size_t count, int root);
Plan plan_reduce(Algorithm a, int rank, int size, size_t count, int root);
Plan plan_gather(Algorithm a, int rank, int size, const std::vector<size_t>& counts, int root);
Plan plan_scatter(Algorithm a, int rank, int size, const std::vector<size_t>& counts, int root);
Plan plan_all_to_all(Algorithm a, int rank, int size, size_t count_per_rank);
Plan plan_barrier(int rank, int size);

/// Message-size and world-size based choice (measured crossover points, see bench/).
Algorithm choose_all_reduce(size_t bytes, int size);

/// Runs `plan` over `transport`. Message tags are tag_base + round index. Throws
/// TransportError from the transport unchanged.
void execute(const Plan& plan, Transport& transport, const void* input, void* output, DataType dtype, ReduceOp op,
             uint64_t tag_base, Deadline deadline);

}  // namespace dtrain::comm
