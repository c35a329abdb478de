// Sharding an epoch's sample indices over ranks (PyTorch DistributedSampler, drop_last).
#include <numeric>
#include <utility>
#include <vector>

#include "dtrain/core/error.h"
#include "dtrain/data/data.h"
#include "dtrain/tensor/random.h"

namespace dtrain::data {

ShardedSampler::ShardedSampler(int64_t size, int rank, int world, uint64_t seed, bool shuffle)
    : size_(size), rank_(rank), world_(world), seed_(seed), shuffle_(shuffle) {
  DT_CHECK(size >= 0, "data", "ShardedSampler: size must be >= 0, got {}", size);
  DT_CHECK(world >= 1, "data", "ShardedSampler: world must be >= 1, got {}", world);
  DT_CHECK(rank >= 0 && rank < world, "data", "ShardedSampler: rank {} out of range [0, {})", rank, world);
}

int64_t ShardedSampler::per_rank() const { return size_ / world_; }

std::vector<int64_t> ShardedSampler::indices(int64_t epoch) const {
  std::vector<int64_t> order(static_cast<size_t>(size_));
  std::iota(order.begin(), order.end(), int64_t{0});
  if (shuffle_) {
    // Every rank draws the same permutation, so the shards are disjoint.
    Generator gen(seed_ * 0x9E3779B97F4A7C15ULL + static_cast<uint64_t>(epoch));
    for (int64_t i = size_ - 1; i > 0; --i) {
      const auto j = static_cast<int64_t>(gen.below(static_cast<uint64_t>(i + 1)));
      std::swap(order[i], order[j]);
    }
  }
  const int64_t n = per_rank();
  std::vector<int64_t> out(static_cast<size_t>(n));
  for (int64_t k = 0; k < n; ++k) out[k] = order[rank_ + k * world_];
  return out;
}

}  // namespace dtrain::data
