// ExactSync: --deterministic data parallelism (see sync.h, exact.h and docs/determinism.md). The
// buckets keep their f32 layout for the optimizer; beside each, a padded int64 buffer holds the
// fixed-point sum of this rank's micro-batch gradients, and the step's one collective adds those
// sums over the ranks as integers (the comm layer's i64 sum), so every layout gets the same bits.
#include <cstring>

#include "dtrain/core/error.h"
#include "dtrain/parallel/exact.h"
#include "sync.h"

namespace dtrain::parallel {

ExactSync::ExactSync(SyncContext context, int64_t micro_batches)
    : ZeroSync(std::move(context)), micro_batches_(micro_batches), limit_(exact_limit(micro_batches)) {}

void ExactSync::place(std::vector<Bucket>& buckets, const std::vector<ReducerParam>& params) {
  if (ctx_.zero == 0) {
    for (Bucket& b : buckets) {
      if (!b.grad) b.grad = zeroed_floats(ctx_.allocate, b.padded);
    }
  } else {
    ZeroSync::place(buckets, params);
  }
  for (const Bucket& b : buckets) {
    sums_.emplace_back(b.padded, 0);
    if (ctx_.zero > 0) pieces_.emplace_back(ctx_.piece_of(b), 0);
  }
}

comm::Work ExactSync::start(Bucket& b) {
  DT_THROW("ddp", "--deterministic: bucket {} cannot start alone: the exact sums travel after the last micro-batch",
           b.index);
}

size_t ExactSync::add(const Bucket& b, size_t offset, const float* gradient, size_t n) {
  return exact_add(sums_[b.index].data() + offset, gradient, n, limit_);
}

void ExactSync::reduce_all(std::vector<Bucket>& buckets) {
  std::vector<comm::Work> works;
  const uint64_t world = ctx_.world();
  for (Bucket& b : buckets) {
    int64_t* sums = sums_[b.index].data();
    if (ctx_.zero == 0) {
      works.push_back(ctx_.group.all_reduce_async(sums, sums, b.count, comm::DataType::i64, comm::ReduceOp::sum));
      volume_.wire_bytes += 2 * b.count * sizeof(int64_t) * (world - 1) / world;
      volume_.raw_bytes += 2 * b.count * sizeof(float) * (world - 1) / world;
    } else {
      works.push_back(ctx_.group.reduce_scatter_async(sums, pieces_[b.index].data(), ctx_.piece_of(b),
                                                      comm::DataType::i64, comm::ReduceOp::sum));
      volume_.wire_bytes += b.padded * sizeof(int64_t) * (world - 1) / world;
      volume_.raw_bytes += b.padded * sizeof(float) * (world - 1) / world;
    }
  }
  for (comm::Work& w : works) w.wait();
  for (Bucket& b : buckets) {
    std::vector<int64_t>& sums = sums_[b.index];
    if (ctx_.zero == 0) {
      exact_to_float(sums.data(), b.grad.get(), b.count, micro_batches_);
    } else {
      std::vector<int64_t>& piece = pieces_[b.index];
      exact_to_float(piece.data(), b.piece_grad.get(), piece.size(), micro_batches_);
      std::memset(piece.data(), 0, piece.size() * sizeof(int64_t));
    }
    std::memset(sums.data(), 0, sums.size() * sizeof(int64_t));
  }
}

}  // namespace dtrain::parallel
