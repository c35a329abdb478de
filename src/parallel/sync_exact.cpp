// ExactSync: --deterministic data parallelism (see sync.h, exact.h and docs/determinism.md). The
// buckets keep their f32 layout for the optimizer. A step's micro-batches on this rank but the
// last are added into a padded int64 buffer of fixed-point sums (add()); the last one stays in the
// buckets' f32 gradients (the reducer's mark_ready, as without --deterministic). Integer addition
// is associative, so every way of adding the images gives the same bits:
// - shared memory (one host): every rank's f32 gradients and sums lie in memory all ranks map;
//   after Reducer::finish()'s all_gather of backward counts (the barrier: every rank has written
//   its gradients, sums and flag) each rank reduces its slice (ZeRO 0) or piece (ZeRO 1/2)
//   straight from every rank's gradients and sums (exact_reduce: image, integer sum, float, in
//   one pass) and writes the floats (ZeRO 0: into every rank's gradients). One small all_reduce
//   then ends the reads and names an element out of range; with ZeRO 1's one copy of the values
//   it is gather()'s, after the optimizer, instead of a barrier (two collectives per step). The
//   memory traffic is the f32 path's, plus the sums' when a rank has more than one micro-batch;
// - otherwise: the last micro-batch's gradients are added into the sums too, and the comm layer's
//   int64 all_reduce (ZeRO 1/2: reduce_scatter into this rank's piece) adds them over the ranks.
//
// Shared layout, each rank's part `stride_` bytes, after the values of every bucket (ZeRO 1):
//   [gradients: elements_ floats][sums: elements_ int64, if a rank has several micro-batches][flag]
// A bucket sits at the same element offset at_[b] in the gradients and the sums (64-byte aligned);
// the flag (one int64 in a 64-byte line) says whether this step's sums of that rank hold anything.
#include <fmt/format.h>
#include <sys/statvfs.h>

#include <algorithm>
#include <cstring>
#include <limits>

#include "dtrain/comm/copy.h"
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

constexpr size_t kAlign = 16;    // elements: 64 bytes of floats
constexpr size_t kBlock = 4096;  // elements reduced, then copied into the other ranks' gradients, while cached
constexpr size_t kFlagBytes = 64;

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

}  // namespace

ExactSync::ExactSync(SyncContext context, int64_t micro_batches, bool share_memory)
    : ZeroSync(std::move(context)),
      micro_batches_(micro_batches),
      limit_(exact_limit(micro_batches)),
      share_memory_(share_memory) {}

void ExactSync::place(std::vector<Bucket>& buckets, const std::vector<ReducerParam>& params) {
  for (const ReducerParam& p : params) names_.push_back(p.name);
  elements_ = 0;
  for (const Bucket& b : buckets) {
    at_.push_back(elements_);
    elements_ += round_up(b.padded, kAlign);
  }
  const size_t world = ctx_.world();
  const bool can = share_memory_ && world > 1 && comm::can_share_memory(ctx_.group);
  // On shared memory only a rank with several micro-batches per step keeps sums.
  const bool sums_needed = micro_batches_ > static_cast<int64_t>(world);
  values_shared_ = can && ctx_.zero == 1;
  values_bytes_ = values_shared_ ? elements_ * sizeof(float) : 0;
  sums_bytes_ = sums_needed ? elements_ * sizeof(int64_t) : 0;
  stride_ = elements_ * sizeof(float) + sums_bytes_ + kFlagBytes;
  if (can && shm_has_room(ctx_.group, values_bytes_ + stride_ * world)) {
    shared_ = comm::allocate_shared(ctx_.group, values_bytes_ + stride_ * world);
    const size_t rank = static_cast<size_t>(ctx_.group.rank());
    for (Bucket& b : buckets) b.grad = Floats(shared_.keep_alive(), gradients_of(rank) + at_[b.index]);
    sums_base_ = sums_needed ? sums_of(rank) : nullptr;
  } else {
    values_shared_ = false;
    values_bytes_ = 0;
    own_.assign(elements_, 0);
    sums_base_ = own_.data();
  }
  if (values_shared_) {
    const bool lead = ctx_.group.rank() == 0;
    for (Bucket& b : buckets) {
      b.values = Floats(shared_.keep_alive(), reinterpret_cast<float*>(shared_.data()) + at_[b.index]);
      if (lead) copy_values_in(b, params);  // rank 0's values become the host's copy
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
  if (ctx_.zero > 0 && !shared_.valid()) {
    for (const Bucket& b : buckets) pieces_.emplace_back(ctx_.piece_of(b), 0);
  }
}

float* ExactSync::gradients_of(size_t rank) const {
  return reinterpret_cast<float*>(shared_.data() + values_bytes_ + rank * stride_);
}

int64_t* ExactSync::sums_of(size_t rank) const {
  return reinterpret_cast<int64_t*>(shared_.data() + values_bytes_ + rank * stride_ + elements_ * sizeof(float));
}

int64_t* ExactSync::flag_of(size_t rank) const {
  return reinterpret_cast<int64_t*>(shared_.data() + values_bytes_ + rank * stride_ + elements_ * sizeof(float) +
                                    sums_bytes_);
}

void ExactSync::gather(std::vector<Bucket>& buckets) {
  if (values_shared_) {
    // Every rank updated its piece of the one copy, and read the peers' gradients and sums of
    // the step before that: this collective ends both, and says whether a rank met a gradient
    // element out of range in its piece (reduce_shared left it in first_bad_).
    agree_in_range(buckets, first_bad_);
    first_bad_ = {};
  } else {
    ZeroSync::gather(buckets);
  }
}

void ExactSync::end_step(std::vector<Bucket>& buckets) {
  if (!shared_.valid()) ZeroSync::end_step(buckets);  // ZeRO 2 on the heap frees the gradients
}

comm::Work ExactSync::start(Bucket& b) {
  DT_THROW("ddp", "--deterministic: bucket {} cannot start alone: the exact sums travel after the last micro-batch",
           b.index);
}

size_t ExactSync::add(const Bucket& b, size_t offset, const float* gradient, size_t n) {
  DT_CHECK(sums_base_ != nullptr, "ddp",
           "--deterministic: a rank added a second micro-batch in a step of {} micro-batches over {} ranks (one "
           "each): call set_sync(false) only before the backward of a micro-batch that is not a rank's last",
           micro_batches_, ctx_.world());
  if (stale_) {
    // The peers read the last step's sums until they were past a collective that follows it.
    std::memset(sums_base_, 0, elements_ * sizeof(int64_t));
    stale_ = false;
  }
  if (!folded_ && shared_.valid()) *flag_of(static_cast<size_t>(ctx_.group.rank())) = 1;
  folded_ = true;
  return exact_add(sums_base_ + at_[b.index] + offset, gradient, n, limit_);
}

void ExactSync::reduce_all(std::vector<Bucket>& buckets) {
  ++step_;
  if (shared_.valid()) {
    reduce_shared(buckets);
  } else {
    reduce_heap(buckets);
  }
}

void ExactSync::throw_out_of_range(const std::vector<Bucket>& buckets, size_t element, int rank, float value) const {
  for (const Bucket& b : buckets) {
    for (size_t i = 0; i < b.params.size(); ++i) {
      const size_t begin = at_[b.index] + b.offsets[i];
      const size_t end = i + 1 < b.offsets.size() ? at_[b.index] + b.offsets[i + 1] : at_[b.index] + b.count;
      if (element >= begin && element < end) {
        throw_exact_range(names_[b.params[i]], value, step_, rank, micro_batches_);
      }
    }
  }
  throw_exact_range(fmt::format("(bucket padding at element {})", element), value, step_, rank, micro_batches_);
}

void ExactSync::reduce_shared(std::vector<Bucket>& buckets) {
  const size_t world = ctx_.world(), rank = static_cast<size_t>(ctx_.group.rank());
  // No barrier first: Reducer::finish() all_gathers the ranks' backward counts right before
  // reduce_all, so every rank has written its gradients, sums and flag (add()) by now.
  std::vector<const float*> grads(world);
  std::vector<const int64_t*> sums(world);
  bool any_sums = false;
  for (size_t q = 0; q < world; ++q) any_sums |= *flag_of(q) != 0;
  // Rank q's gradients and sums from element `at` on.
  auto point = [&](size_t at) {
    for (size_t q = 0; q < world; ++q) {
      grads[q] = gradients_of(q) + at;
      sums[q] = *flag_of(q) != 0 ? sums_of(q) + at : nullptr;
    }
  };
  const uint64_t sum_bytes = any_sums ? sizeof(int64_t) : 0;
  ExactOutOfRange bad;  // the first element out of range in this rank's slice or pieces
  if (ctx_.zero == 0) {
    // Slice `rank` of all buckets' elements; the padding holds zeros and stays so.
    const size_t per = round_up((elements_ + world - 1) / world, kAlign);
    const size_t lo = std::min(elements_, rank * per), hi = std::min(elements_, lo + per);
    float* mine = gradients_of(rank);
    for (size_t at = lo; at < hi && bad.rank < 0; at += kBlock) {
      const size_t n = std::min(kBlock, hi - at);
      point(at);
      bad = exact_reduce(mine + at, grads.data(), sums.data(), static_cast<int>(world), n, micro_batches_, limit_);
      bad.index += at;
      if (bad.rank >= 0) break;
      for (size_t k = 1; k < world; ++k) {
        const size_t q = (rank + k) % world;
        comm::copy_bytes(gradients_of(q) + at, mine + at, n * sizeof(float));
      }
    }
    for (const Bucket& b : buckets) {
      volume_.wire_bytes += 2 * b.count * (sizeof(float) + sum_bytes) * (world - 1) / world;
      volume_.raw_bytes += 2 * b.count * sizeof(float) * (world - 1) / world;
    }
  } else {
    // This rank's piece of every bucket into piece_grad.
    for (Bucket& b : buckets) {
      if (bad.rank >= 0) break;
      const size_t piece = ctx_.piece_of(b);
      point(at_[b.index] + rank * piece);
      bad = exact_reduce(b.piece_grad.get(), grads.data(), sums.data(), static_cast<int>(world), piece, micro_batches_,
                         limit_);
      bad.index += at_[b.index] + rank * piece;
      volume_.wire_bytes += b.padded * (sizeof(float) + sum_bytes) * (world - 1) / world;
      volume_.raw_bytes += b.padded * sizeof(float) * (world - 1) / world;
    }
  }
  if (values_shared_) {
    // ZeRO 1 with one copy of the values: the peers' reads end at gather()'s collective, after
    // the optimizer has updated this rank's piece (which reads only piece_grad); the range
    // check waits for it too (a rank that met an element out of range stops there, before the
    // step ends, as do its peers). One collective per step instead of two.
    first_bad_ = bad;
    return;
  }
  // This collective ends the reads of the peers' gradients and sums and (ZeRO 0) the writes into
  // them: each rank writes its own again after it.
  agree_in_range(buckets, bad);
}

// Did any rank meet a gradient element out of range? The smallest (element, rank) wins, so every
// rank names the same one. A collective over all ranks: it also ends the step's reads of the
// peers' gradients and sums, after which a rank may write its own again.
void ExactSync::agree_in_range(const std::vector<Bucket>& buckets, const ExactOutOfRange& bad) {
  const size_t world = ctx_.world();
  const int64_t none = std::numeric_limits<int64_t>::max();
  int64_t first = bad.rank >= 0 ? static_cast<int64_t>(bad.index * world) + bad.rank : none;
  ctx_.group.all_reduce(&first, &first, 1, comm::DataType::i64, comm::ReduceOp::min);
  if (folded_) {
    if (shared_.valid()) *flag_of(static_cast<size_t>(ctx_.group.rank())) = 0;
    stale_ = true;  // zeroed before the next add(): the peers may have read them until now
  }
  folded_ = false;
  if (first != none) {
    // The value, from the rank that found it.
    uint32_t bits = 0;
    if (bad.rank >= 0 && static_cast<int64_t>(bad.index * world) + bad.rank == first) {
      std::memcpy(&bits, &bad.value, sizeof(bits));
    }
    int64_t value = bits;
    ctx_.group.all_reduce(&value, &value, 1, comm::DataType::i64, comm::ReduceOp::max);
    bits = static_cast<uint32_t>(value);
    float v = 0.0f;
    std::memcpy(&v, &bits, sizeof(v));
    throw_out_of_range(buckets, static_cast<size_t>(first) / world, static_cast<int>(first % world), v);
  }
}

void ExactSync::reduce_heap(std::vector<Bucket>& buckets) {
  std::vector<comm::Work> works;
  const uint64_t world = ctx_.world();
  for (Bucket& b : buckets) {
    int64_t* sum = sums_base_ + at_[b.index];
    // The last micro-batch's gradients (zeros where none) join the sums.
    const size_t at = exact_add(sum, b.grad.get(), b.count, limit_);
    if (at != b.count) throw_out_of_range(buckets, at_[b.index] + at, ctx_.group.rank(), b.grad.get()[at]);
    if (ctx_.zero == 0) {
      works.push_back(ctx_.group.all_reduce_async(sum, sum, b.count, comm::DataType::i64, comm::ReduceOp::sum));
      volume_.wire_bytes += 2 * b.count * sizeof(int64_t) * (world - 1) / world;
      volume_.raw_bytes += 2 * b.count * sizeof(float) * (world - 1) / world;
    } else {
      int64_t* piece = pieces_[b.index].data();
      works.push_back(
          ctx_.group.reduce_scatter_async(sum, piece, ctx_.piece_of(b), comm::DataType::i64, comm::ReduceOp::sum));
      volume_.wire_bytes += b.padded * sizeof(int64_t) * (world - 1) / world;
      volume_.raw_bytes += b.padded * sizeof(float) * (world - 1) / world;
    }
  }
  for (comm::Work& w : works) w.wait();
  for (Bucket& b : buckets) {
    int64_t* sum = sums_base_ + at_[b.index];
    if (ctx_.zero == 0) {
      exact_to_float(sum, b.grad.get(), b.count, micro_batches_);
    } else {
      std::vector<int64_t>& piece = pieces_[b.index];
      exact_to_float(piece.data(), b.piece_grad.get(), piece.size(), micro_batches_);
      std::memset(piece.data(), 0, piece.size() * sizeof(int64_t));
    }
    std::memset(sum, 0, b.padded * sizeof(int64_t));
  }
  folded_ = false;
}

}  // namespace dtrain::parallel
