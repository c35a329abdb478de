// ZeroSync: ZeRO 1/2 on the heap (see sync.h). Each bucket's values hold its parameters; rank r
// receives piece r of the averaged gradients by reduce_scatter, updates piece r of the values,
// and the all_gather of every rank's piece makes the values whole again.
#include <algorithm>
#include <cstring>

#include "sync.h"

namespace dtrain::parallel {

void ZeroSync::copy_values_in(Bucket& b, const std::vector<ReducerParam>& params) {
  for (size_t i = 0; i < b.params.size(); ++i) {
    const BufferView& v = params[b.params[i]].values;
    std::memcpy(b.values.get() + b.offsets[i], v.data, v.count * sizeof(float));
  }
}

void ZeroSync::place(std::vector<Bucket>& buckets, const std::vector<ReducerParam>& params) {
  if (ctx_.zero == 3) {
    // Only this rank's piece of each bucket's values stays: [rank * piece, (rank + 1) * piece)
    // of the bucket's elements (the padding past the last parameter is zeros).
    const size_t rank = static_cast<size_t>(ctx_.group.rank());
    for (Bucket& b : buckets) {
      const size_t piece = ctx_.piece_of(b), lo = rank * piece, hi = lo + piece;
      b.own = zeroed_floats(ctx_.allocate, piece);
      for (size_t i = 0; i < b.params.size(); ++i) {
        const BufferView& v = params[b.params[i]].values;
        const auto* src = static_cast<const float*>(v.data);
        const size_t begin = std::max(lo, b.offsets[i]), end = std::min(hi, b.offsets[i] + v.count);
        if (begin < end)
          std::memcpy(b.own.get() + (begin - lo), src + (begin - b.offsets[i]), (end - begin) * sizeof(float));
      }
      b.piece_grad = zeroed_floats(ctx_.allocate, piece);
    }
    return;
  }
  for (Bucket& b : buckets) {
    // ZeRO 2 keeps no gradient buffer between steps: the reducer allocates one when needed.
    if (!b.grad && ctx_.zero == 1) b.grad = zeroed_floats(ctx_.allocate, b.padded);
    if (!b.values) {
      b.values = zeroed_floats(ctx_.allocate, b.padded);
      copy_values_in(b, params);
    }
    b.piece_grad = zeroed_floats(ctx_.allocate, ctx_.piece_of(b));
  }
}

void ZeroSync::count_volume(const Bucket& b) {
  const uint64_t world = ctx_.world();
  const uint64_t bytes = b.padded * sizeof(float) * (world - 1) / world;
  volume_.wire_bytes += bytes;
  volume_.raw_bytes += bytes;
}

comm::Work ZeroSync::start(Bucket& b) {
  count_volume(b);
  return ctx_.group.reduce_scatter_async(b.grad.get(), b.piece_grad.get(), ctx_.piece_of(b), comm::DataType::f32,
                                         comm::ReduceOp::avg);
}

void ZeroSync::end_step(std::vector<Bucket>& buckets) {
  if (ctx_.zero < 2) return;
  for (Bucket& b : buckets) b.grad.reset();
}

void ZeroSync::gather(std::vector<Bucket>& buckets) {
  if (ctx_.zero == 3) return;  // the pieces were updated where they live; gather_values() reads them
  const size_t rank = static_cast<size_t>(ctx_.group.rank());
  std::vector<comm::Work> works;
  for (Bucket& b : buckets) {
    const size_t piece = ctx_.piece_of(b);
    float* v = b.values.get();
    works.push_back(ctx_.group.all_gather_async(v + rank * piece, v, piece, comm::DataType::f32));
  }
  for (auto& w : works) w.wait();
}

}  // namespace dtrain::parallel

namespace dtrain::parallel {

comm::Work ZeroSync::gather_values(Bucket& b) {
  const size_t piece = ctx_.piece_of(b);
  // Uninitialised: the all_gather writes every element.
  std::shared_ptr<void> memory = ctx_.allocate ? ctx_.allocate(b.padded * sizeof(float)) : nullptr;
  b.values = memory ? Floats(memory, static_cast<float*>(memory.get())) : zeroed_floats(ctx_.allocate, b.padded);
  return ctx_.group.all_gather_async(b.own.get(), b.values.get(), piece, comm::DataType::f32);
}

}  // namespace dtrain::parallel
