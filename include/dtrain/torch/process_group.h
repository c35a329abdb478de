// A torch.distributed backend over dtrain_comm: c10d::ProcessGroup implemented by a
// dtrain::comm::Group, so that PyTorch programs (and DistributedDataParallel) run on dtrain's
// collectives and failure handling. The Python module dtrain_torch registers it as "dtrain".
//
// Tensors become (pointer, count, dtype) buffers: a contiguous CPU tensor of a dtype dtrain
// reduces (float32, float64, float16, bfloat16, int32, int64, uint8) goes to dtrain as it is,
// with no copy; bool reduces as uint8 (sum and max are "or", product and min "and"), int8 is
// reduced in int32 and narrowed back (sums wrap as they do in int8), other dtypes only move
// (broadcast, gathers, scatters, all_to_all, send/recv) as bytes. A non-contiguous tensor is
// copied to a contiguous one and the result copied back. Tensors not on the CPU, sparse
// tensors and reductions of other dtypes raise an error naming the tensor and what was expected.
//
// Operations reach the group in the caller's order. all_reduce, reduce_scatter, all_gather
// and broadcast are deferred until something needs them started (a wait() right away runs
// them in the calling thread, as dtrain's blocking calls do; see src/torch/work.h), send and
// recv are posted at once; the other collectives run in the calling thread and return a
// completed Work. Work::wait(timeout) waits up to `timeout` (the group's timeout when 0) and
// rethrows the operation's error; getFuture() returns a future completed by a thread of the
// process group when the operation ends (DistributedDataParallel's communication hooks use it).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <vector>

#include "dtrain/comm/compress.h"
#include "dtrain/comm/group.h"

namespace dtrain::torch_backend {

class Completer;
class FaultPlan;
class Ordering;

/// A dtrain Store whose keys live in a c10d::Store (torch's TCPStore, FileStore, HashStore,
/// PrefixStore), so that dtrain's groups meet wherever torch's process groups meet.
std::shared_ptr<comm::Store> wrap_c10d_store(c10::intrusive_ptr<c10d::Store> store);

/// A c10d::Store over a dtrain Store (dtrain launch's authenticated TCP store), for torch's
/// rendezvous under dtrain launch. deleteKey and getNumKeys are not supported.
c10::intrusive_ptr<c10d::Store> wrap_dtrain_store(std::shared_ptr<comm::Store> store,
                                                  std::chrono::milliseconds timeout);

struct BackendOptions {
  std::chrono::milliseconds timeout = std::chrono::minutes(30);
  /// The group's name in dtrain's messages ("" = "world").
  std::string name;
};

class ProcessGroupDtrain final : public c10d::ProcessGroup {
 public:
  /// Joins a dtrain group of `size` ranks through `store` (every rank calls it). The TCP
  /// transport's secret is DTRAIN_SECRET when set; otherwise rank 0 makes one and passes it
  /// through the store. A TCP rank listens on DTRAIN_BIND_ADDR, or else on the local address
  /// that routes to the store's host (torch's TCPStore, or MASTER_ADDR), so that a job across
  /// hosts (torchrun --nnodes N) needs no setting.
  ProcessGroupDtrain(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, const BackendOptions& options);
  ~ProcessGroupDtrain() override;

  const std::string getBackendName() const override { return "dtrain"; }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts = c10d::BroadcastOptions()) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts = c10d::AllreduceOptions()) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceCoalescedOptions& opts = c10d::AllreduceCoalescedOptions()) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts = c10d::ReduceOptions()) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(
      at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(
      std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts = c10d::GatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts = c10d::ScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(
      std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ReduceScatterOptions& opts = c10d::ReduceScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input,
      const c10d::ReduceScatterOptions& opts = c10d::ReduceScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_split_sizes,
                                               std::vector<int64_t>& input_split_sizes,
                                               const c10d::AllToAllOptions& opts = c10d::AllToAllOptions()) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts = c10d::AllToAllOptions()) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts = c10d::BarrierOptions()) override;
  void setSequenceNumberForGroup() override {}
  /// The number of collectives issued on this group (the same on every rank).
  uint64_t getSequenceNumberForGroup() override { return collectives_.load(); }

  /// dtrain's compressed all_reduce of a float32 tensor (sum or avg; codecs: comm/compress.h),
  /// with error feedback when `residual` is defined (a float32 tensor of the same size; see
  /// Group::all_reduce_compressed). Asynchronous; the future's value is [tensor].
  c10::intrusive_ptr<c10d::Work> allreduce_compressed(at::Tensor& tensor, comm::Codec codec, comm::ReduceOp op,
                                                      const at::Tensor& residual);

  comm::Group& group() { return group_; }
  std::chrono::milliseconds timeout() const { return timeout_; }

 private:
  struct Op;
  c10::intrusive_ptr<c10d::Work> issue(Op&& op);
  std::chrono::milliseconds call_timeout(std::chrono::milliseconds requested) const;

  std::chrono::milliseconds timeout_;
  std::atomic<uint64_t> collectives_{0};
  std::shared_ptr<Completer> completer_;
  std::shared_ptr<Ordering> ordering_;       // issue order, the deferred collective (src/torch/work.h)
  bool defer_ = true;                        // DTRAIN_TORCH_DEFER=0: every collective starts at once
  std::shared_ptr<const FaultPlan> faults_;  // DTRAIN_FAULT, on the world group (src/torch/fault.h)
  comm::Group group_;
};

/// The creator torch.distributed.Backend.register_backend calls (extended_api=False).
c10::intrusive_ptr<ProcessGroupDtrain> create_process_group(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                                            int size, std::chrono::milliseconds timeout,
                                                            const std::string& name = "");

}  // namespace dtrain::torch_backend
