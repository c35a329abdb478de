// AllReduceSync: ZeRO 0, buckets on the heap, each all_reduced (avg) in place (see sync.h).
#include "sync.h"

namespace dtrain::parallel {

void AllReduceSync::place(std::vector<Bucket>& buckets, const std::vector<ReducerParam>& /*params*/) {
  for (Bucket& b : buckets) {
    if (!b.grad) b.grad = zeroed_floats(ctx_.allocate, b.padded);
  }
}

void AllReduceSync::count_volume(const Bucket& b) {
  const uint64_t world = ctx_.world();
  const uint64_t bytes = 2 * b.count * sizeof(float) * (world - 1) / world;
  volume_.wire_bytes += bytes;
  volume_.raw_bytes += bytes;
}

comm::Work AllReduceSync::start(Bucket& b) {
  count_volume(b);
  float* g = b.grad.get();
  return ctx_.group.all_reduce_async(g, g, b.count, comm::DataType::f32, comm::ReduceOp::avg);
}

}  // namespace dtrain::parallel
