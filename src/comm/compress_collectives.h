// The compressed collectives' algorithm, run by Group inside its operation machinery (see
// compress_collectives.cpp for the algorithm and compressed.h for the API).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "dtrain/comm/compress.h"
#include "dtrain/comm/transport.h"

namespace dtrain::comm::detail {

enum class CompressedKind : uint8_t { all_reduce = 1, reduce_scatter = 2 };

/// One compressed collective of one rank. `counts[q]` is block q's share of the vector (the
/// block rank q reduces); `send` holds the whole vector, `recv` the whole vector (all_reduce)
/// or this rank's block (reduce_scatter); `residual`, when set, the whole vector.
struct CompressedCall {
  CompressedKind kind;
  const float* send;
  float* recv;
  std::vector<size_t> counts;
  Codec codec;
  ReduceOp op;  // sum or avg
  float* residual;
  CompressStats* stats;
};

/// The message tag of `phase` (1: reduce-scatter, 2: all-gather) of the collective with
/// sequence number `seq`. Bit 62 keeps them apart from the plans' tags (seq << 20 + round);
/// the kind, codec and op are part of the tag, so ranks that disagree on them fail with a
/// tag mismatch instead of decoding each other's bytes wrongly.
uint64_t compressed_tag(uint64_t seq, CompressedKind kind, Codec codec, ReduceOp op, int phase);

/// Runs `call` over `transport`; throws TransportError from the transport unchanged.
void execute_compressed(const CompressedCall& call, Transport& transport, uint64_t seq, Deadline deadline);

}  // namespace dtrain::comm::detail
