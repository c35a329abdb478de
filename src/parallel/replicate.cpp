// replicate_from_rank0 (replicate.h): same model everywhere, rank 0's values, verified.
#include "dtrain/parallel/replicate.h"

#include "dtrain/core/error.h"

namespace dtrain::parallel {

using comm::DataType;

namespace {

uint64_t fnv1a(const void* data, size_t bytes, uint64_t h = 1469598103934665603ull) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < bytes; ++i) {
    h ^= p[i];
    h *= 1099511628211ull;
  }
  return h;
}

}  // namespace

int64_t ReplicaTensor::numel() const {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

uint64_t replica_digest(const std::vector<ReplicaTensor>& tensors) {
  uint64_t h = fnv1a("", 0);
  for (const ReplicaTensor& t : tensors) h = fnv1a(t.data, t.bytes(), h);
  return h;
}

void replicate_from_rank0(comm::Group& group, const std::vector<ReplicaTensor>& tensors, bool broadcast,
                          const std::string& hint) {
  const int world = group.size();
  // Same model everywhere? Compare (tensors, elements, hash of names, shapes and element sizes).
  uint64_t layout_hash = fnv1a("", 0);
  int64_t elements = 0;
  for (const ReplicaTensor& t : tensors) {
    layout_hash = fnv1a(t.name.data(), t.name.size(), layout_hash);
    for (int64_t s : t.shape) layout_hash = fnv1a(&s, sizeof(s), layout_hash);
    if (t.element_size != sizeof(float)) layout_hash = fnv1a(&t.element_size, sizeof(t.element_size), layout_hash);
    elements += t.numel();
  }
  std::vector<int64_t> mine = {static_cast<int64_t>(tensors.size()), elements, static_cast<int64_t>(layout_hash)};
  std::vector<int64_t> all(3 * static_cast<size_t>(world));
  group.all_gather(mine.data(), all.data(), 3, DataType::i64);
  for (int r = 1; r < world; ++r) {
    const int64_t* o = &all[3 * static_cast<size_t>(r)];
    DT_CHECK(o[0] == all[0] && o[1] == all[1] && o[2] == all[2], "ddp",
             "rank {}'s model differs from rank 0's: {} parameters in {} tensors vs {} in {} (or different names or "
             "shapes); every rank must build the same model{}",
             r, o[1], o[0], all[1], all[0], hint);
  }
  if (broadcast) {
    for (const ReplicaTensor& t : tensors) group.broadcast(t.data, t.bytes(), DataType::u8, 0);
  }
  uint64_t h = replica_digest(tensors);
  std::vector<uint64_t> hashes(static_cast<size_t>(world));
  group.all_gather(&h, hashes.data(), 1, DataType::i64);
  for (int r = 1; r < world; ++r) {
    DT_CHECK(hashes[static_cast<size_t>(r)] == hashes[0], "ddp",
             "after the broadcast rank {}'s parameters differ from rank 0's (digest {:016x} vs {:016x})", r,
             hashes[static_cast<size_t>(r)], hashes[0]);
  }
}

}  // namespace dtrain::parallel
