// Data parallelism: every rank holds the whole model, runs forward and backward on its shard
// of the global batch, and the gradients are averaged across ranks before an identical
// optimizer step, so every rank keeps identical parameters.
//
// DataParallel is the adapter of dtrain's tensors over the gradient Reducer (reducer.h), which
// owns the buckets, their order and the ways of synchronising, and knows only plain memory:
// it gives the reducer views of its parameters, points their gradient homes at the reducer's
// buckets, calls Reducer::mark_ready from their grad-ready hooks, and (ZeRO) moves the
// parameters into the buckets' values (Tensor::rebind).
//
// How a step goes (the trainer, or your own loop):
//   DataParallel dp(model->named_parameters(), group, options);
//   dp.broadcast_parameters();                 // once: rank 0's values everywhere, verified
//   for each step:
//     for each micro-batch m < K:
//       dp.set_sync(m == K - 1);               // accumulate locally until the last one
//       loss(model(x_m)) / K .backward();      // the last backward launches bucket all_reduces
//     dp.synchronize();                        // waits; gradients now averaged over ranks
//     optimizer.step(); [dp.gather_parameters() with ZeRO]; zero the gradients
//
// Gradient as bucket view (ZeRO 0 and 1): each parameter's gradient home
// (Tensor::set_grad_home) is its place in its bucket, so linear layers write their gradients
// there directly and the hook has nothing to copy.
//
// Buckets: the parameters in reverse order of registration (about the order backward produces
// their gradients), packed into buckets of about `bucket_bytes`. An autograd grad-ready hook
// copies each gradient into its bucket; a bucket whose gradients are all final starts its
// asynchronous all_reduce (avg) at once, so communication overlaps the rest of backward.
// Buckets always start in the same order on every rank. A parameter that got no gradient in
// a step contributes zeros. Averaged gradients are views into the bucket buffers (no copy
// back).
//
// ZeRO (options.zero): each bucket is split into world() equal pieces and rank r owns piece r
// of every bucket. Gradients are reduce-scattered (each rank receives its pieces, averaged);
// the optimizer is built over optimizer_params() (1-D views of the owned pieces of the
// parameters) so its state is 1/world() of the unsharded one; gather_parameters() all-gathers
// the updated pieces. zero=1 keeps full-size gradient buffers, zero=2 keeps only the pieces.
// The parameters themselves are moved into the bucket buffers (their tensors stay valid).
//
// ZeRO 3 (options.zero = 3) also shards the parameters: between uses a rank keeps only its piece
// of every bucket (the optimizer's piece, updated in place), and the parameters' tensors point at
// nothing. What is gathered together is a *unit*: a run of consecutive blocks (options.units
// gives each parameter's block, from block_units()) of up to 1 MiB (bucket_bytes if smaller), or
// one block larger than that (FSDP's size-based wrapping); buckets never span two units. The model calls
// block_hooks() around each block's forward (nn::Sequential::set_block_hooks): before a unit's
// first block runs its buckets are all-gathered into fresh buffers that the parameters point at
// (the next unit's gather starts too, so it overlaps this unit's compute), and after its last
// block they are freed. Backward is the same in reverse: a node on the unit's output gathers it
// again just before its backward (and starts the previous unit's), and once every parameter of
// the unit has its gradient its buffers are freed. Gradients are reduce-scattered per bucket as in ZeRO 2. So a
// rank holds 1/world() of the parameters, gradients and optimizer state between steps, plus
// about two units' parameters while a unit runs. Reading every parameter at once (checkpoints,
// the final digest) goes through gather_pieces(optimizer_params()).
//
// Compression (options.compress) cuts the bytes on the wire:
// - "bf16", "fp16", "int8", "int4": each bucket's all_reduce (ZeRO: reduce_scatter) runs the
//   comm layer's compressed collective (comm/compress.h: blocks encoded once per contributor,
//   reduced in f32, the result encoded once). Error feedback: what a step's encoding lost (its
//   residual, kept per bucket) is added to the next step's gradients before they are sent.
// - "powersgd:R": matrix gradients travel as rank-R factors P, Q (see src/parallel/sync_powersgd.cpp), with error
//   feedback and a warm-started Q; vectors uncompressed. Runs in synchronize() after backward
//   (no overlap); ZeRO 0 only.
// take_comm_volume() tells how many bytes this rank sent and what f32 would have sent.
//
// Shared memory (options.share_memory, ZeRO 0, 1 or 3, every rank on one host over shm, no
// compression): the buckets live in memory every rank maps (comm::Group::allocate_shared).
// Same bits as the other paths.
// - ZeRO 0: each rank's gradients are its slot there, and each bucket is averaged with
//   Group::all_reduce_shared: every rank reduces its slice straight from the slots and writes
//   it into all of them, with no staging copies (several times the copying all_reduce's
//   bandwidth on large buckets: docs/measurements.md). A bucket's Work completes only when nobody touches the slots
//   any more, so the next backward may write them. Buckets up to 16 KiB take the copying
//   all_reduce on the slot (fewer phases), and a group told to use a plan (DTRAIN_ALGO) does
//   not share.
// - ZeRO 1: the parameters are ONE copy for the host, which every rank's tensors point at;
//   each rank writes its gradients into its own slot, and the reduce_scatter reads the peers'
//   slots in place (no copy in). The optimizer updates this rank's piece of the shared copy
//   directly, so gather_parameters() is a barrier instead of an all_gather. The barrier
//   inside synchronize() (every rank finished backward) and the one in gather_parameters()
//   (every rank finished its update) keep writes and reads apart. Each rank's averaged piece
//   lies over its range of slot 0 or 1 (no memory of its own), so no backward may run between
//   synchronize() and gather_parameters(): rank 0's or 1's would overwrite the others' pieces.
// - ZeRO 3: the same one copy of the parameters, each rank's piece its slice of it (so 1/N of
//   the parameters per rank, as the gathered path holds), and the blocks need no gathering:
//   block_hooks() is null and gather_parameters() the barrier. The gradients take ZeRO 2's
//   path (heap buckets for the step, reduce_scatter, freed).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/comm/group.h"
#include "dtrain/nn/module.h"
#include "dtrain/optim/optim.h"
#include "dtrain/parallel/reducer.h"

namespace dtrain::parallel {

struct DdpOptions {
  size_t bucket_bytes = size_t{25} << 20;
  int zero = 0;                // 0: replicate everything; 1: shard optimizer state; 2: also gradients;
                               // 3: also parameters (gathered per block around its use, see above)
  std::vector<size_t> units;   // ZeRO 3: each parameter's block (block_units); empty: one block
  bool overlap = true;         // false: start every bucket in synchronize() (for measuring overlap)
  bool record_events = false;  // keep BucketEvents for take_bucket_events() (traces)
  bool share_memory = true;    // ZeRO 0/1/3 on one host: gradients (ZeRO 0/1), parameters (ZeRO 1/3) in shared memory
  std::string compress = "none";  // none | bf16 | fp16 | int8 | int4 | powersgd:RANK (see above)
  uint64_t seed = 0;              // powersgd: the initial Q (the same on every rank)
  /// --deterministic (exact.h): call add_micro_batch() after every micro-batch's backward; the
  /// step's gradient is then the exact sum over the `micro_batches` of the step (all ranks) / that
  /// number, the same bits whatever the layout. Gradient hooks do nothing; no compression.
  bool deterministic = false;
  int64_t micro_batches = 1;
};

/// Bytes this rank holds for the model's training state.
struct MemoryReport {
  int64_t param_bytes = 0;      // with shared parameters (ZeRO 1): this rank's share of the host's one copy
  int64_t grad_bytes = 0;       // persistent gradient buffers (buckets or ZeRO pieces)
  int64_t optimizer_bytes = 0;  // the optimizer's state tensors
};

/// Each parameter's block in `model` (canonical order): ZeRO 3's units of gathering.
std::vector<size_t> block_units(const nn::Sequential& model);

class DataParallel {
 public:
  DataParallel(std::vector<nn::NamedTensor> params, comm::Group group, DdpOptions options = {});
  ~DataParallel();
  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;

  int rank() const;
  int world() const;
  size_t num_buckets() const;

  /// Collective, once before training: checks that every rank has the same parameter names and
  /// shapes (naming the first rank that differs), copies rank 0's values to all ranks and
  /// verifies that every rank then holds the same bytes.
  void broadcast_parameters();

  /// Whether the next backward passes synchronise gradients (default true). Off: gradients
  /// accumulate locally and nothing is communicated (gradient accumulation / no_sync).
  void set_sync(bool on);

  /// --deterministic: adds the model's gradients of one micro-batch to the exact sums and drops
  /// them (the next micro-batch is computed from scratch). Local. With sync on (the rank's last
  /// micro-batch of the step) they stay in the buckets until synchronize(), and a backward before
  /// it (an audit's) writes its gradients elsewhere.
  void add_micro_batch();
  bool deterministic() const;

  /// Collective, after the synchronising backward: starts the buckets not started yet (params
  /// without a gradient contribute zeros), waits for all of them, and leaves the averaged
  /// gradients in the parameters' grads (ZeRO: in optimizer_params()' grads). Throws a clear error
  /// when ranks ran a different number of backward passes.
  void synchronize();

  /// Global L2 norm of the synchronised gradients; scales them to `max_norm` when larger
  /// (max_norm <= 0: only measures). Collective under ZeRO.
  float clip_grad_norm(float max_norm);

  /// Sum of the squares of this rank's share of the synchronised gradients, over the parameters
  /// `counted(name)` accepts (all when empty). The share is every gradient without ZeRO, and this
  /// rank's pieces under ZeRO (the ranks' pieces are disjoint). Local: not reduced across ranks.
  /// With scale_grads, the building block of a norm over more than this group (pp/tp meshes).
  double grad_square_sum(const std::function<bool(const std::string&)>& counted = {}) const;
  /// Multiplies this rank's share of the synchronised gradients by `factor`.
  void scale_grads(float factor);

  /// ZeRO: the tensors the optimizer owns on this rank. Without ZeRO: the model's parameters.
  std::vector<Tensor> optimizer_params() const;
  /// True under ZeRO: optimizer_params() are pieces of buckets, not the parameters.
  bool sharded() const;
  /// True when the gradient buckets live in memory shared by the ranks (see above).
  bool shares_memory() const;
  /// True when the parameters, too, are one copy in that memory (ZeRO 1): one rank writes them.
  bool shares_parameters() const;
  /// ZeRO, collective, after the optimizer step: every rank gets every updated piece. ZeRO 3:
  /// frees whatever block is still gathered (its values are stale now).
  void gather_parameters();
  /// ZeRO 3: the hooks the model must call around its blocks (Sequential::set_block_hooks);
  /// null otherwise. They hold this object weakly.
  std::shared_ptr<nn::BlockHooks> block_hooks() const;
  /// ZeRO 3: the parameters are not held whole between uses.
  bool shards_parameters() const;
  /// ZeRO 3: the most bytes of whole blocks' parameters gathered at once so far (the transient
  /// part of parameter memory).
  int64_t gathered_peak_bytes() const;

  /// ZeRO, collective (checkpoints): from one tensor per optimizer_params() entry (this rank's
  /// piece of a bucket, e.g. an optimizer state), the whole tensor of every parameter, in
  /// parameter order, shaped like the parameter.
  std::vector<Tensor> gather_pieces(const std::vector<Tensor>& pieces) const;
  /// ZeRO, the inverse: this rank's piece of every bucket from whole per-parameter tensors
  /// (undefined ones count as zeros).
  std::vector<Tensor> scatter_pieces(const std::vector<Tensor>& per_param) const;
  /// ZeRO: the optimizer_params() entry (bucket) that holds parameter `index`.
  size_t piece_holding(size_t index) const;
  /// Drops the synchronised gradients (model and shards).
  void zero_grad();

  MemoryReport memory(const optim::Optimizer& optimizer) const;
  /// Bucket communications since the last call (completed ones only).
  std::vector<BucketEvent> take_bucket_events();
  /// ZeRO 3, record_events: the all-gathers of whole blocks since the last call, from their start
  /// to their completion (`bucket` is the block), for traces that show them beside compute.
  std::vector<BucketEvent> take_gather_events();
  /// Gradient bytes sent since the last call (see CommVolume).
  CommVolume take_comm_volume();
  /// The compression state of this rank (copies): error-feedback residuals per bucket
  /// ("ef.B"), PowerSGD's Q and error per matrix ("powersgd.q.K", "powersgd.error.K"). Empty
  /// without compression. For checkpoints: it belongs to this rank and this layout.
  std::vector<nn::NamedTensor> compression_state() const;
  /// Restores what compression_state() returned (same options and parameters); throws naming
  /// a missing or misshapen entry.
  void load_compression_state(const std::vector<nn::NamedTensor>& state);

  struct Impl;

 private:
  std::shared_ptr<Impl> impl_;
};

}  // namespace dtrain::parallel
