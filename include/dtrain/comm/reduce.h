// Vectorised reduction kernels on raw buffers. bf16 and f16 are widened to f32, reduced,
// and rounded back (round to nearest even); integers wrap as in C++ unsigned arithmetic
// for sum and prod.
#pragma once

#include <cstddef>

#include "dtrain/comm/types.h"

namespace dtrain::comm {

/// dst[i] = dst[i] op src[i] for i < count. For ReduceOp::avg this sums; the caller divides
/// once at the end with finish_avg.
void reduce_into(void* dst, const void* src, size_t count, DataType dtype, ReduceOp op);
/// dst[i] = a[i] op b[i] (dst may alias a or b).
void reduce_pair(void* dst, const void* a, const void* b, size_t count, DataType dtype, ReduceOp op);
/// For ReduceOp::avg: dst[i] /= world (integers: truncating division). No-op for other ops.
void finish_avg(void* dst, size_t count, DataType dtype, ReduceOp op, int world);

}  // namespace dtrain::comm
