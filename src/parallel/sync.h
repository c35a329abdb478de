// The ways the Reducer synchronises a step's gradients (internal to the parallel layer), one
// class each, picked once when the Reducer is built (choose_sync): like c10d's communication
// hooks, a strategy gets a bucket whose gradients are final and returns the Work of its
// collective. It also decides where the buckets' memory lives (the heap, or memory the ranks
// share) and, under ZeRO, how the updated pieces reach every rank.
//
//   AllReduceSync            ZeRO 0: all_reduce (avg) per bucket                 sync_allreduce.cpp
//   SharedAllReduceSync      ZeRO 0, one host: all_reduce in the shared slots    sync_shared.cpp
//   ZeroSync                 ZeRO 1/2/3: reduce_scatter per bucket, all_gather   sync_zero.cpp
//   SharedZeroSync           ZeRO 1, one host: reduce_scatter in place, barrier  sync_shared.cpp
//   CompressedAllReduceSync  ZeRO 0, a codec, error feedback                     sync_compressed.cpp
//   CompressedZeroSync       ZeRO 1/2, a codec, error feedback                   sync_compressed.cpp
//   PowerSgdSync             ZeRO 0, low-rank factors after backward             sync_powersgd.cpp
//   ExactSync                --deterministic: integer sums, shared or i64        sync_exact.cpp
//
// Every call of a Group method that is asynchronous, compressed or on shared memory is in one
// of these files, once.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dtrain/comm/compressed.h"
#include "dtrain/comm/group.h"
#include "dtrain/comm/shared.h"
#include "dtrain/parallel/exact.h"
#include "dtrain/parallel/reducer.h"

namespace dtrain::parallel {

/// Floats in memory that the pointer keeps alive (an aliasing shared_ptr into its owner).
using Floats = std::shared_ptr<float>;
using Allocate = std::function<std::shared_ptr<void>(size_t bytes)>;

/// max(1, count) zeroed floats from `allocate` (64-byte aligned heap when empty).
Floats zeroed_floats(const Allocate& allocate, size_t count);

/// A bucket as a strategy sees it (c10d's GradBucket): its layout, its memory, its step.
struct Bucket {
  size_t index = 0;
  std::vector<size_t> params;   // parameter indices
  std::vector<size_t> offsets;  // element offset of each in the bucket
  size_t count = 0;             // elements used
  size_t padded = 0;            // count rounded up to a multiple of the world size
  Floats grad;                  // padded gradients, reduced in place (ZeRO 2: only during a step)
  Floats values;                // ZeRO: the parameters' home, padded (ZeRO 3: only while gathered)
  Floats own;                   // ZeRO 3: this rank's piece of the values, kept between steps
  Floats piece_grad;            // ZeRO: this rank's averaged piece, padded / world
  // The reducer's step state.
  size_t pending = 0;  // gradients not final yet in this step
  bool launched = false;
  comm::Work work;
  comm::Clock::time_point started;
};

/// What every strategy is built with.
struct SyncContext {
  comm::Group group;
  int zero = 0;
  Allocate allocate;
  size_t world() const { return static_cast<size_t>(group.size()); }
  size_t piece_of(const Bucket& b) const { return b.padded / world(); }
};

class SyncStrategy {
 public:
  explicit SyncStrategy(SyncContext context) : ctx_(std::move(context)) {}
  virtual ~SyncStrategy() = default;
  SyncStrategy(const SyncStrategy&) = delete;
  SyncStrategy& operator=(const SyncStrategy&) = delete;

  /// Once, when the reducer is built: every bucket's buffers (grad; ZeRO: values holding the
  /// parameters' values, and piece_grad). Collective where the memory is shared.
  virtual void place(std::vector<Bucket>& buckets, const std::vector<ReducerParam>& params) = 0;
  /// Starts bucket b's reduction: its gradients are final on this rank.
  virtual comm::Work start(Bucket& b) = 0;
  /// False: the buckets do not start one by one; reduce_all() runs them after backward.
  virtual bool per_bucket() const { return true; }
  virtual void reduce_all(std::vector<Bucket>& /*buckets*/) {}
  /// After bucket b's Work completed.
  virtual void finished(Bucket& /*b*/) {}
  /// After every bucket of the step was handed over.
  virtual void end_step(std::vector<Bucket>& /*buckets*/) {}
  /// ZeRO, collective: every rank gets every updated piece of the values.
  virtual void gather(std::vector<Bucket>& /*buckets*/) {}
  virtual bool shares_memory() const { return false; }
  virtual bool shares_values() const { return false; }
  /// ZeRO: each piece_grad lies inside the gradient slots, not in memory of its own.
  virtual bool pieces_in_slots() const { return false; }
  virtual std::vector<StateEntry> state(const std::vector<Bucket>& /*buckets*/) const { return {}; }
  virtual void load_state(std::vector<Bucket>& /*buckets*/, const std::vector<StateEntry>& /*state*/) {}

  CommVolume take_volume() {
    const CommVolume v = volume_;
    volume_ = CommVolume{};
    return v;
  }

 protected:
  SyncContext ctx_;
  CommVolume volume_;
};

/// ZeRO 0 on the heap: each bucket all_reduced (avg) in place.
class AllReduceSync : public SyncStrategy {
 public:
  using SyncStrategy::SyncStrategy;
  void place(std::vector<Bucket>& buckets, const std::vector<ReducerParam>& params) override;
  comm::Work start(Bucket& b) override;

 protected:
  /// Adds an all_reduce of bucket b to the volume (ring: 2 (world - 1) / world of it).
  void count_volume(const Bucket& b);
};

/// ZeRO 1/2 on the heap: the values in the buckets, each bucket reduce_scattered (avg) into
/// this rank's piece, the updated pieces all_gathered; ZeRO 2 frees the gradient buckets after
/// each step. ZeRO 3 also keeps only this rank's piece of the values (`own`): gather_values()
/// all-gathers a bucket's whole values when a block needs them, and gather() has nothing to do.
class ZeroSync : public SyncStrategy {
 public:
  using SyncStrategy::SyncStrategy;
  void place(std::vector<Bucket>& buckets, const std::vector<ReducerParam>& params) override;
  comm::Work start(Bucket& b) override;
  void end_step(std::vector<Bucket>& buckets) override;
  void gather(std::vector<Bucket>& buckets) override;
  /// ZeRO 3: a fresh buffer for bucket b's whole values, and the all_gather that fills it.
  comm::Work gather_values(Bucket& b);

 protected:
  /// Copies the parameters' values into bucket b's values.
  static void copy_values_in(Bucket& b, const std::vector<ReducerParam>& params);
  /// Adds a reduce_scatter of bucket b to the volume ((world - 1) / world of it).
  void count_volume(const Bucket& b);
};

/// --deterministic (exact.h, sync_exact.cpp): a rank's micro-batches but the last are added into
/// per-bucket 64-bit fixed-point sums (add()); the last one's gradients are marked ready into the
/// buckets as usual. After it, reduce_all() sums both over the ranks as integers and converts
/// the sum / micro_batches once into the grad slots (ZeRO: piece_grad): layout-independent bits.
/// On one host the ranks' gradients and sums are shared and reduced in place, in one pass that
/// also checks the last micro-batch's range.
class ExactSync : public ZeroSync {
 public:
  /// share_memory: the gradients and sums live in memory the ranks on this host map, reduced in
  /// place when the group can and /dev/shm has room.
  ExactSync(SyncContext context, int64_t micro_batches, bool share_memory);
  void place(std::vector<Bucket>& buckets, const std::vector<ReducerParam>& params) override;
  comm::Work start(Bucket& b) override;
  bool per_bucket() const override { return false; }
  void reduce_all(std::vector<Bucket>& buckets) override;
  void end_step(std::vector<Bucket>& buckets) override;
  void gather(std::vector<Bucket>& buckets) override;
  bool shares_memory() const override { return shared_.valid(); }
  bool shares_values() const override { return values_shared_; }
  /// Adds `n` gradient elements of a micro-batch that is not this rank's last of the step at
  /// `offset` of bucket b; returns exact_add's answer (n: in range).
  size_t add(const Bucket& b, size_t offset, const float* gradient, size_t n);
  int64_t micro_batches() const { return micro_batches_; }

 private:
  void reduce_shared(std::vector<Bucket>& buckets);
  void reduce_heap(std::vector<Bucket>& buckets);
  float* gradients_of(size_t rank) const;
  int64_t* sums_of(size_t rank) const;
  int64_t* flag_of(size_t rank) const;
  /// One collective over the ranks: ends the step's reads of the peers' gradients and sums and
  /// throws, naming the same element on every rank, when any rank's `bad` names one.
  void agree_in_range(const std::vector<Bucket>& buckets, const ExactOutOfRange& bad);
  /// The error for rank `rank`'s gradient element `element` (of all buckets' elements).
  [[noreturn]] void throw_out_of_range(const std::vector<Bucket>& buckets, size_t element, int rank, float value) const;

  int64_t micro_batches_;
  double limit_;
  bool share_memory_;
  comm::SharedMemory shared_;                 // valid: every rank's gradients and sums, `stride_` bytes apart
  size_t elements_ = 0;                       // elements of all buckets, each padded and aligned
  std::vector<size_t> at_;                    // bucket -> its element offset in the gradients and sums
  size_t stride_ = 0;                         // bytes of one rank's part of shared_
  size_t values_bytes_ = 0;                   // ZeRO 1 on shared memory: the values before the ranks' parts
  size_t sums_bytes_ = 0;                     // bytes of one rank's sums in shared_ (0: none)
  bool values_shared_ = false;                // ZeRO 1: the values are one copy in shared_ (as SharedZeroSync)
  std::vector<int64_t> own_;                  // this rank's sums on the heap (not shared)
  int64_t* sums_base_ = nullptr;              // this rank's sums, all buckets (null: none)
  bool folded_ = false;                       // this step added a micro-batch into the sums
  bool stale_ = false;                        // shared: the sums hold the last step's (zeroed before the next add)
  int64_t step_ = 0;                          // steps reduced (the reducer's step + 1 while reducing)
  ExactOutOfRange first_bad_;                 // ZeRO 1 shared: this rank's element out of range, until gather()
  std::vector<std::string> names_;            // parameter names, for errors
  std::vector<std::vector<int64_t>> pieces_;  // heap ZeRO: per bucket, this rank's piece of the sums
};

/// The shared-memory strategy for ZeRO 0 (all_reduce in the slots) or 1 (one copy of the
/// values, reduce_scatter in place), or null where the ranks cannot share: not every rank on
/// this host over shm, a plan chosen for ZeRO 0 (DTRAIN_ALGO), or no room in /dev/shm (that
/// one collective: every rank gets the same answer).
std::unique_ptr<SyncStrategy> make_shared_sync(SyncContext context, const std::vector<Bucket>& buckets);
/// A codec with error feedback: all_reduce (ZeRO 0) or reduce_scatter (ZeRO 1/2) compressed.
std::unique_ptr<SyncStrategy> make_compressed_sync(SyncContext context, comm::Codec codec);
/// PowerSGD of `rank` (ZeRO 0).
std::unique_ptr<SyncStrategy> make_powersgd_sync(SyncContext context, int rank, uint64_t seed,
                                                 const std::vector<ReducerParam>& params);

/// The entry `name` of a saved state, checked against `shape`; throws naming a missing or
/// misshapen entry.
const StateEntry& state_entry(const std::vector<StateEntry>& state, const std::string& name,
                              const std::vector<int64_t>& shape);

}  // namespace dtrain::parallel
