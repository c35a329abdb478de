// Per-thread scratch blocks of the collectives (see scratch.h).
#include "scratch.h"

#include <mutex>
#include <new>
#include <vector>

namespace dtrain::comm::detail {

namespace {

AlignedBlock allocate_aligned(size_t bytes) {
  const size_t rounded = (bytes + Scratch::kAlign - 1) / Scratch::kAlign * Scratch::kAlign;
  void* p = std::aligned_alloc(Scratch::kAlign, rounded);
  if (p == nullptr) throw std::bad_alloc();
  return AlignedBlock(static_cast<std::byte*>(p));
}

struct ScratchCache {
  AlignedBlock block;
  size_t bytes = 0;
};
thread_local ScratchCache t_scratch;

// Scratch that a failed wait may still write into: kept alive until exit.
std::mutex g_parked_mu;
std::vector<AlignedBlock>& parked() {
  static auto* blocks = new std::vector<AlignedBlock>();  // never destroyed: outlives late writes
  return *blocks;
}

}  // namespace

Scratch::Scratch(size_t bytes) {
  if (bytes == 0) return;
  if (bytes <= kCacheMaxBytes) {
    if (t_scratch.bytes < bytes) {
      t_scratch.block.reset();
      t_scratch.block = allocate_aligned(bytes);
      t_scratch.bytes = bytes;
    }
    data_ = t_scratch.block.get();
    cached_ = true;
  } else {
    own_ = allocate_aligned(bytes);
    data_ = own_.get();
  }
}

void Scratch::park() {
  AlignedBlock block = cached_ ? std::move(t_scratch.block) : std::move(own_);
  if (cached_) t_scratch.bytes = 0;
  if (block == nullptr) return;
  std::lock_guard<std::mutex> lock(g_parked_mu);
  parked().push_back(std::move(block));
}

}  // namespace dtrain::comm::detail
