// ExactSync: --deterministic data parallelism (see sync.h, exact.h and docs/determinism.md). The
// buckets keep their f32 layout for the optimizer; beside each, a padded int64 buffer holds the
// fixed-point sum of this rank's micro-batch gradients, and the step's one collective adds those
// sums over the ranks as integers (the comm layer's i64 sum), so every layout gets the same bits.
#include <sys/statvfs.h>

#include <algorithm>
#include <cstring>

#include "dtrain/core/error.h"
#include "dtrain/parallel/exact.h"
#include "sync.h"

namespace dtrain::parallel {

namespace {

// Whether every rank sees room for `bytes` in /dev/shm (every rank gets the same answer).
bool shm_has_room(comm::Group& group, size_t bytes) {
  struct statvfs fs {};
  int64_t room =
      ::statvfs("/dev/shm", &fs) == 0 && static_cast<double>(fs.f_bavail) * static_cast<double>(fs.f_frsize) >=
                                             1.05 * static_cast<double>(bytes) + (64 << 20);
  group.all_reduce(&room, &room, 1, comm::DataType::i64, comm::ReduceOp::min);
  return room != 0;
}

}  // namespace

ExactSync::ExactSync(SyncContext context, int64_t micro_batches, bool share_memory)
    : ZeroSync(std::move(context)),
      micro_batches_(micro_batches),
      limit_(exact_limit(micro_batches)),
      share_memory_(share_memory) {}

void ExactSync::place(std::vector<Bucket>& buckets, const std::vector<ReducerParam>& params) {
  // Every bucket's sums, 64-byte aligned, one after the other; with ZeRO 1 on one host the
  // values too (one copy for the host, as the shared ZeRO 1 strategy keeps them).
  size_t elements = 0, value_floats = 0;
  std::vector<size_t> value_at;
  for (const Bucket& b : buckets) {
    sum_at_.push_back(elements);
    elements += (b.padded + 7) / 8 * 8;
    value_at.push_back(value_floats);
    value_floats += (b.padded + 15) / 16 * 16;
  }
  stride_ = std::max<size_t>(64, elements * sizeof(int64_t));
  const size_t world = ctx_.world();
  const bool can = share_memory_ && world > 1 && comm::can_share_memory(ctx_.group);
  values_shared_ = can && ctx_.zero == 1;
  sums_offset_ = values_shared_ ? value_floats * sizeof(float) : 0;
  if (can && shm_has_room(ctx_.group, sums_offset_ + stride_ * world)) {
    shared_ = comm::allocate_shared(ctx_.group, sums_offset_ + stride_ * world);
    sums_base_ =
        reinterpret_cast<int64_t*>(shared_.data() + sums_offset_ + static_cast<size_t>(ctx_.group.rank()) * stride_);
  } else {
    values_shared_ = false;
    sums_offset_ = 0;
    own_.assign(stride_ / sizeof(int64_t), 0);
    sums_base_ = own_.data();
  }
  if (values_shared_) {
    const bool lead = ctx_.group.rank() == 0;
    for (Bucket& b : buckets) {
      b.values = Floats(shared_.keep_alive(), reinterpret_cast<float*>(shared_.data()) + value_at[b.index]);
      if (lead) copy_values_in(b, params);  // rank 0's values become the host's copy
      b.grad = zeroed_floats(ctx_.allocate, b.padded);
      b.piece_grad = zeroed_floats(ctx_.allocate, ctx_.piece_of(b));
    }
    ctx_.group.barrier();  // rank 0's values are in place before anyone reads them
  } else if (ctx_.zero == 0) {
    for (Bucket& b : buckets) {
      if (!b.grad) b.grad = zeroed_floats(ctx_.allocate, b.padded);
    }
  } else {
    ZeroSync::place(buckets, params);
  }
  if (ctx_.zero > 0) {
    for (const Bucket& b : buckets) pieces_.emplace_back(ctx_.piece_of(b), 0);
  }
}

void ExactSync::gather(std::vector<Bucket>& buckets) {
  if (values_shared_) {
    ctx_.group.barrier();  // every rank updated its piece of the one copy
  } else {
    ZeroSync::gather(buckets);
  }
}

comm::Work ExactSync::start(Bucket& b) {
  DT_THROW("ddp", "--deterministic: bucket {} cannot start alone: the exact sums travel after the last micro-batch",
           b.index);
}

size_t ExactSync::add(const Bucket& b, size_t offset, const float* gradient, size_t n) {
  return exact_add(sums(b.index) + offset, gradient, n, limit_);
}

void ExactSync::reduce_all(std::vector<Bucket>& buckets) {
  std::vector<comm::Work> works;
  const uint64_t world = ctx_.world();
  for (Bucket& b : buckets) {
    int64_t* sum = sums(b.index);
    const size_t at = sums_offset_ + sum_at_[b.index] * sizeof(int64_t);
    if (ctx_.zero == 0) {
      works.push_back(shared_.valid()
                          ? comm::all_reduce_shared_async(ctx_.group, shared_, at, stride_, b.count,
                                                          comm::DataType::i64, comm::ReduceOp::sum)
                          : ctx_.group.all_reduce_async(sum, sum, b.count, comm::DataType::i64, comm::ReduceOp::sum));
      volume_.wire_bytes += 2 * b.count * sizeof(int64_t) * (world - 1) / world;
      volume_.raw_bytes += 2 * b.count * sizeof(float) * (world - 1) / world;
    } else {
      int64_t* piece = pieces_[b.index].data();
      works.push_back(shared_.valid()
                          ? comm::reduce_scatter_shared_async(ctx_.group, shared_, at, stride_, piece, ctx_.piece_of(b),
                                                              comm::DataType::i64, comm::ReduceOp::sum)
                          : ctx_.group.reduce_scatter_async(sum, piece, ctx_.piece_of(b), comm::DataType::i64,
                                                            comm::ReduceOp::sum));
      volume_.wire_bytes += b.padded * sizeof(int64_t) * (world - 1) / world;
      volume_.raw_bytes += b.padded * sizeof(float) * (world - 1) / world;
    }
  }
  for (comm::Work& w : works) w.wait();
  for (Bucket& b : buckets) {
    int64_t* sum = sums(b.index);
    if (ctx_.zero == 0) {
      exact_to_float(sum, b.grad.get(), b.count, micro_batches_);
    } else {
      std::vector<int64_t>& piece = pieces_[b.index];
      exact_to_float(piece.data(), b.piece_grad.get(), piece.size(), micro_batches_);
      std::memset(piece.data(), 0, piece.size() * sizeof(int64_t));
    }
    std::memset(sum, 0, b.padded * sizeof(int64_t));
  }
}

}  // namespace dtrain::parallel
