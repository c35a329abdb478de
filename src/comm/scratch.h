// Scratch memory for the algorithms that run inside a collective (plans, compressed
// collectives): one 64-byte-aligned block per call, taken from a per-thread cache so that a
// stream of collectives does not allocate. Collectives never nest on one thread, so one cached
// block per thread is enough.
//
// If a wait throws, requests may still be posted against the block (a send still reading it, a
// receive still writing it); the caller then parks it: it is never reused nor freed (kept
// reachable until exit).
#pragma once

#include <cstddef>
#include <cstdlib>
#include <memory>

namespace dtrain::comm::detail {

struct AlignedFree {
  void operator()(std::byte* p) const { std::free(p); }
};
using AlignedBlock = std::unique_ptr<std::byte, AlignedFree>;

class Scratch {
 public:
  static constexpr size_t kAlign = 64;
  /// Larger blocks are freed after the call rather than kept by the thread.
  static constexpr size_t kCacheMaxBytes = size_t{64} << 20;

  explicit Scratch(size_t bytes);
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  ~Scratch() = default;

  std::byte* data() const { return data_; }

  /// After a failed wait: the transport may still complete requests into this block.
  void park();

 private:
  std::byte* data_ = nullptr;
  bool cached_ = false;
  AlignedBlock own_;
};

}  // namespace dtrain::comm::detail
