// The gradient reducer of data parallelism, over plain memory: it knows parameters and their
// gradients only as (pointer, count, dtype) views, so dtrain's own tensors (DataParallel,
// ddp.h) and other tensor types (the libtorch adapter) share it. It includes no tensor header.
//
// Vocabulary:
// - a *parameter* is a buffer the ranks keep identical; its *gradient* is what this rank
//   computed for it in a step, and the reducer averages it over the ranks;
// - a *bucket* is a run of parameters, in reverse order of registration (about the order
//   backward produces their gradients), of about `bucket_bytes`; its gradients live in one
//   buffer the reducer owns (a parameter's *slot* is its place there) and travel in one
//   collective. `padded` is its element count rounded up to a multiple of the world size;
// - under ZeRO (zero 1 or 2) each bucket is cut into world() equal *pieces*: rank r receives
//   the averaged gradients of piece r (piece_grad) and owns piece r of the bucket's *values*,
//   where the parameters then live (the adapter moves them there); gather() shares the pieces
//   after the update;
// - under ZeRO 3 a rank keeps only its piece of the values between uses: gather_values(b)
//   all-gathers bucket b's whole values into a fresh buffer (the adapter points the parameters
//   there while a block runs) and release_values(b) frees it; the pieces are updated in place, so
//   gather() has nothing to do (on one host sharing memory the values are one copy for the host,
//   a rank's piece is its slice of it, gather_values() is never needed and gather() is a
//   barrier). Buckets are cut at `unit` boundaries (blocks), so a block's
//   parameters are whole buckets;
// - the *strategy* is the way of synchronising, picked once at construction from the options:
//   all_reduce, all_reduce in shared memory, ZeRO reduce_scatter + all_gather (in shared
//   memory: reduce_scatter in place + barrier), compressed with error feedback, PowerSGD.
//
// A step: the adapter calls mark_ready(k, gradient) from parameter k's autograd hook; the
// gradient is copied into its slot unless it was written there. A bucket whose parameters are
// all ready starts its collective at once, if every earlier bucket has started: buckets start
// in the same order on every rank, overlapping the rest of backward. finish() gives the
// parameters that got no gradient zeros, starts the rest, waits for every bucket, and checks
// that every rank ran a backward; then the averaged gradients are in the slots (ZeRO: in
// piece_grad).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/comm/compress.h"
#include "dtrain/comm/group.h"

namespace dtrain::parallel {

/// Plain memory: `count` elements of `dtype` at `data`. Views the reducer hands out carry the
/// `owner` that keeps the memory alive (a tensor over it holds on to it).
struct BufferView {
  void* data = nullptr;
  size_t count = 0;
  comm::DataType dtype = comm::DataType::f32;
  std::shared_ptr<const void> owner;
  size_t bytes() const { return count * comm::size_of(dtype); }
};

/// A parameter as the reducer sees it.
struct ReducerParam {
  std::string name;            // for messages
  BufferView values;           // its values now, f32 (ZeRO copies them into the buckets)
  int64_t rows = 0, cols = 0;  // a matrix (2-D) parameter's shape, for PowerSGD; 0, 0 otherwise
  size_t unit = 0;             // ZeRO 3: what is gathered together (a model's block); buckets never span two
};

/// A parsed compression option: a codec, or PowerSGD of a rank.
struct Compression {
  comm::Codec codec = comm::Codec::none;
  int powersgd_rank = 0;  // > 0: PowerSGD
};
/// Parses none | bf16 | fp16 | int8 | int4 | powersgd:RANK (RANK in [1, 1024]); throws
/// dtrain::Error naming the text.
Compression parse_compression(const std::string& text);

/// Bytes this rank sent for gradient synchronisation, and what f32 would have sent.
struct CommVolume {
  uint64_t wire_bytes = 0;
  uint64_t raw_bytes = 0;
};

/// One bucket's communication in one step, for traces.
struct BucketEvent {
  int bucket = 0;
  size_t bytes = 0;
  comm::Clock::time_point start, end;
};

/// One entry of a compression state: row-major f32 values of a shape.
struct StateEntry {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<float> values;
};

struct ReducerOptions {
  size_t bucket_bytes = size_t{25} << 20;
  int zero = 0;                // 0: replicate; 1: shard the values' updates; 2: also the gradient buffers;
                               // 3: also the values (gather_values / release_values around their use)
  bool overlap = true;         // false: start every bucket in finish() (for measuring overlap)
  bool record_events = false;  // keep BucketEvents for take_events()
  bool share_memory = true;    // ZeRO 0/1/3, every rank on one host: the buckets in memory the ranks share
  Compression compression;     // compressed collectives with error feedback, or PowerSGD (ZeRO 0)
  uint64_t seed = 0;           // PowerSGD: the initial Q (the same on every rank)
  /// --deterministic (exact.h): a rank's micro-batches but the last added with add_exact() in 64-bit
  /// fixed point, the last one marked ready as usual, all summed over the ranks as integers in
  /// finish(); the result is sum / exact_micro_batches (the step's micro-batches over all ranks).
  /// No compression, no overlap.
  bool exact = false;
  int64_t exact_micro_batches = 1;
  /// Allocates `bytes` (64-byte aligned) for a buffer of the reducer; empty: the heap.
  std::function<std::shared_ptr<void>(size_t bytes)> allocate;
};

class Reducer {
 public:
  /// Lays the parameters out in buckets and picks the strategy. Collective where the buckets
  /// go into shared memory. Throws naming a parameter that is not f32 or a bad option.
  Reducer(std::vector<ReducerParam> params, comm::Group group, ReducerOptions options);
  /// Waits for buckets in flight (they use its buffers).
  ~Reducer();
  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;

  comm::Group& group() const;
  const ReducerOptions& options() const;
  size_t num_params() const;
  const std::string& name(size_t k) const;
  size_t num_buckets() const;
  /// Bucket b's parameters (indices), their element offsets in it, its element count and its
  /// padded count (a multiple of the world size).
  const std::vector<size_t>& bucket_params(size_t b) const;
  const std::vector<size_t>& bucket_offsets(size_t b) const;
  size_t bucket_count(size_t b) const;
  size_t bucket_padded(size_t b) const;
  /// ZeRO: the elements of one piece of bucket b (padded / world).
  size_t piece_count(size_t b) const;
  /// The bucket that holds parameter k.
  size_t bucket_of(size_t k) const;

  /// ZeRO (zero > 0): pieces, values in the buckets.
  bool sharded() const;
  /// The gradient buckets live in memory the ranks share.
  bool shares_memory() const;
  /// The values too are one copy in that memory (ZeRO 1): each rank writes only its piece.
  bool shares_values() const;
  /// ZeRO: the averaged pieces (piece_grad) are written over the gradient slots, using no
  /// memory of their own (ZeRO 1 on shared memory).
  bool pieces_in_slots() const;

  /// Parameter k's gradient slot in its bucket. ZeRO 2 frees the buckets between steps: then
  /// an empty view.
  BufferView grad(size_t k) const;
  /// ZeRO: parameter k's place in its bucket's values, holding its values (move it there).
  BufferView values(size_t k) const;
  /// ZeRO: this rank's piece of bucket b's values, and the piece's averaged gradients.
  BufferView piece(size_t b) const;
  BufferView piece_grad(size_t b) const;

  /// Parameter k's gradient is final for this step: `gradient` points at its elements
  /// (contiguous, the parameter's dtype), or is null when it has none (an error). Starts
  /// the buckets that can start. Throws when k was already ready in this step.
  void mark_ready(size_t k, const void* gradient);
  /// --deterministic: adds the gradient of parameter k (contiguous f32) of a micro-batch that is
  /// not this rank's last of the step to the exact sums (the last one: mark_ready). Both throw
  /// naming the parameter, the step and this rank when an element is out of the fixed-point
  /// range or not finite.
  void add_exact(size_t k, const float* gradient);
  /// Collective, after the synchronising backward: see above. Throws a clear error when the
  /// ranks ran different numbers of backward passes (some none), and CommError when a
  /// collective fails or times out.
  void finish();
  /// ZeRO, collective, after the update of the pieces: every rank gets every updated piece.
  void gather();
  /// ZeRO 3, collective (every rank gathers the same buckets in the same order): starts the
  /// all_gather of bucket b's whole values into a fresh buffer, which values(k) views from now
  /// on; wait for the Work before reading them.
  comm::Work gather_values(size_t b);
  /// ZeRO 3: drops bucket b's whole values (memory still viewed elsewhere lives until let go).
  void release_values(size_t b);
  /// ZeRO 3: whether bucket b's whole values are there (gathered, not released).
  bool has_values(size_t b) const;

  /// ZeRO: the sum of the squares of this rank's averaged pieces, over the parameters
  /// `counted(k)` accepts (all when empty). Local.
  double piece_square_sum(const std::function<bool(size_t k)>& counted = {}) const;
  /// ZeRO: multiplies this rank's averaged pieces by `factor`.
  void scale_pieces(float factor);

  /// Bucket communications since the last call (record_events).
  std::vector<BucketEvent> take_events();
  /// Gradient bytes sent since the last call.
  CommVolume take_volume();
  /// The compression state of this rank (copies): error-feedback residuals per bucket
  /// ("ef.B"), PowerSGD's Q and error per matrix ("powersgd.q.K", "powersgd.error.K", K the
  /// parameter). Empty without compression.
  std::vector<StateEntry> state() const;
  /// Restores state(); throws naming a missing or misshapen entry.
  void load_state(const std::vector<StateEntry>& state);

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace dtrain::parallel
