// Compressed collectives on f32 buffers (codecs, formats and error bounds: compress.h), the
// gradient path of data parallelism. Each is one collective on the group: ordering, timeout
// and failure rules are those of group.h.
//
// The two-phase scheme: each rank encodes the blocks of its input and sends block q to rank
// q, which decodes and sums them in f32 (its own block raw); all_reduce then has each owner
// encode its reduced block once and every rank decode those same bytes, so every rank ends
// with bitwise identical results. Each call uses the message tags of its own sequence number;
// ranks that call them with different codecs or ops fail with a tag mismatch naming both
// sides, different counts with a size mismatch (or, when one side sends nothing, the
// timeout). Only ReduceOp::sum and avg.
//
// `residual` (optional, the size of `send`, overlapping neither buffer) receives what this
// rank's contribution lost to compression: x - decode(encode(x)) on the blocks it sent, and
// for all_reduce, on its own block, the error of the result's encoding (times size() for
// avg). Adding it to the next call's input (error feedback) keeps the sum of the results
// over steps within one step's error of the sum of the exact results. `stats` (optional) is
// added to: the payload bytes this rank sent and the f32 bytes the same exchange would have
// sent. A world of one rank copies send to recv, sends nothing and leaves a zero residual.
// Buffers, residual and stats of an _async call must stay untouched until its Work completed.
#pragma once

#include <cstddef>

#include "dtrain/comm/compress.h"
#include "dtrain/comm/group.h"

namespace dtrain::comm {

/// all_reduce: send and recv hold `count` elements (may be the same buffer); rank r reduces
/// the r-th part of the even split (sizes differ by at most one, larger first).
void all_reduce_compressed(Group& group, const float* send, float* recv, size_t count, Codec codec, ReduceOp op,
                           float* residual = nullptr, CompressStats* stats = nullptr);
Work all_reduce_compressed_async(Group& group, const float* send, float* recv, size_t count, Codec codec, ReduceOp op,
                                 float* residual = nullptr, CompressStats* stats = nullptr);

/// reduce_scatter: send holds group.size() * recv_count elements; rank r receives block r
/// reduced (summed in f32 from decoded contributions, not encoded again).
void reduce_scatter_compressed(Group& group, const float* send, float* recv, size_t recv_count, Codec codec,
                               ReduceOp op, float* residual = nullptr, CompressStats* stats = nullptr);
Work reduce_scatter_compressed_async(Group& group, const float* send, float* recv, size_t recv_count, Codec codec,
                                     ReduceOp op, float* residual = nullptr, CompressStats* stats = nullptr);

}  // namespace dtrain::comm
