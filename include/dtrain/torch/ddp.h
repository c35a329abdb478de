// DistributedDataParallel for libtorch, PyTorch's C++ API: a torch::nn::Module trained on
// every rank of a dtrain group, its gradients averaged by dtrain's gradient Reducer
// (dtrain/parallel/reducer.h), the same one dtrain's own DataParallel uses. This file is the
// adapter of torch tensors over it; the buckets, their order and the ways of synchronising
// (plain, shared-memory or compressed all_reduce, PowerSGD) are the reducer's.
//
// A step (your own loop; see examples/torch_cnn.cpp):
//   auto group = dtrain::comm::Group::from_env();        // under `dtrain launch` (mpirun: from_mpi)
//   dtrain::torch::DistributedDataParallel ddp(model, group);  // rank 0's parameters and buffers
//                                                        // everywhere, verified by digest
//   for each step:
//     { auto scope = ddp.no_sync();                      // optional: accumulate locally
//       loss(model->forward(x_m)).backward(); }          //   (micro-batches 0..K-2)
//     loss(model->forward(x)).backward();                // launches the buckets' all_reduces
//     ddp.synchronize();                                 // waits: param.grad() averaged over ranks
//     optimizer.step(); optimizer.zero_grad();
//
// How it works. Each trainable parameter (requires_grad, in named_parameters() order; a tensor
// registered twice counts once) is a ReducerParam over its memory. A post-hook on the
// parameter's gradient accumulator (the AccumulateGrad node of libtorch 1.13's autograd, which
// runs once per backward after every use of the parameter delivered its gradient) calls
// Reducer::mark_ready with param.grad(); a bucket whose gradients are all final starts its
// asynchronous all_reduce (average) at once, so communication overlaps the rest of backward.
// Buckets start in the same order on every rank. At first they hold the parameters in reverse
// order of registration, which is the order backward produces their gradients when modules
// are registered in the order forward uses them (as in a Sequential); the first synchronize()
// lays them out again in the order rank 0's first backward produced the gradients, when that
// differs (as PyTorch's DDP rebuilds its buckets after the first iteration), so that the
// first bucket to fill is the first to start.
//
// Gradients as bucket views: after synchronize() every param.grad() is a tensor over its slot in
// its bucket, so the next backward accumulates straight into the bucket (optimizer.zero_grad()
// zeroes it in place) and the hook has nothing to copy; a gradient that is a fresh tensor is
// copied into the slot.
//
// Parameters without a gradient in a step (unused in this rank's forward) contribute zeros to
// the average, on every path, without a hang. Gradients accumulated inside no_sync() count in
// the next synchronize() even when the synchronising backward did not reach the parameter.
//
// Misuse gets the errors of dtrain's DataParallel, as dtrain::Error tagged "ddp": ranks whose
// models differ (names, shapes, dtypes of the parameters and buffers; the first rank that
// differs is named), a rank that ran no backward before synchronize() (every rank names who
// did and who did not), a second synchronising backward before synchronize(); and parameters
// that are not dense contiguous float32 CPU tensors, named.
//
// Within namespace dtrain, `torch` means this namespace: write ::torch:: for libtorch there.
#pragma once

#include <torch/nn/module.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/comm/group.h"
#include "dtrain/parallel/reducer.h"

namespace dtrain::torch {

struct DdpOptions {
  size_t bucket_bytes = size_t{25} << 20;  // gradient bytes per bucket (one all_reduce each)
  bool overlap = true;                     // false: start every bucket in synchronize() (for measuring overlap)
  bool record_events = false;              // keep BucketEvents for take_bucket_events()
  bool share_memory = true;                // every rank on one host over shm: buckets in memory the ranks share
  std::string compress = "none";           // none | bf16 | fp16 | int8 | int4 | powersgd:RANK (dtrain/parallel/ddp.h)
  uint64_t seed = 0;                       // powersgd: the initial Q (the same on every rank)
  bool rebuild_buckets = true;             // reorder the buckets by the first backward (see above)
};

class DistributedDataParallel {
 public:
  /// Collective. Checks that every rank holds the same model, copies rank 0's parameters and
  /// buffers to every rank and verifies them by digest, lays the trainable parameters out in
  /// buckets and hooks their gradient accumulators. Throws dtrain::Error naming a bad
  /// parameter or option, or the rank whose model differs.
  DistributedDataParallel(std::shared_ptr<::torch::nn::Module> module, comm::Group group, DdpOptions options = {});
  /// The same for a module holder (torch::nn::Linear, TORCH_MODULE(Net), ...).
  template <typename M>
  DistributedDataParallel(const ::torch::nn::ModuleHolder<M>& module, comm::Group group, DdpOptions options = {})
      : DistributedDataParallel(std::static_pointer_cast<::torch::nn::Module>(module.ptr()), std::move(group),
                                std::move(options)) {}
  /// Removes the hooks; the gradients stay valid (they keep their buckets alive).
  ~DistributedDataParallel();
  DistributedDataParallel(const DistributedDataParallel&) = delete;
  DistributedDataParallel& operator=(const DistributedDataParallel&) = delete;

  const std::shared_ptr<::torch::nn::Module>& module() const;
  int rank() const;
  int world() const;
  size_t num_buckets() const;
  /// The names of bucket b's parameters, in the order they sit in it.
  std::vector<std::string> bucket_parameters(size_t b) const;

  /// Whether the next backward passes synchronise gradients (default true). Off: gradients
  /// accumulate locally in param.grad() and nothing is communicated.
  void set_sync(bool on);
  bool sync() const;

  /// Gradient accumulation scope: synchronisation is off while it lives (RAII), then back to
  /// what it was.
  class [[nodiscard]] NoSync {
   public:
    explicit NoSync(DistributedDataParallel& ddp);
    ~NoSync();
    NoSync(const NoSync&) = delete;
    NoSync& operator=(const NoSync&) = delete;

   private:
    DistributedDataParallel& ddp_;
    bool was_;
  };
  NoSync no_sync();

  /// Collective, after the synchronising backward (every rank calls it once per step): starts
  /// the buckets not started yet, waits for all of them, and leaves the gradients averaged over
  /// the ranks in param.grad(). Throws when some ranks ran no backward (naming them), and
  /// comm::CommError when a collective fails or times out.
  void synchronize();

  /// Collective: rank 0's buffers (BatchNorm statistics, ...) to every rank. The constructor
  /// does it once; call it before forward where buffers change in training.
  void broadcast_buffers();

  /// Bucket communications since the last call (record_events).
  std::vector<parallel::BucketEvent> take_bucket_events();
  /// Gradient bytes this rank sent since the last call, and what f32 would have sent.
  parallel::CommVolume take_comm_volume();

  struct Impl;

 private:
  std::shared_ptr<Impl> impl_;
};

}  // namespace dtrain::torch
