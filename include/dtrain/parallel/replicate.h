// The start-up check of data parallelism, shared by dtrain's DataParallel (ddp.h) and the
// libtorch adapter (dtrain/torch/ddp.h): every rank must hold the same model, and after the
// broadcast the same bytes. It knows tensors only as named plain memory, like the reducer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "dtrain/comm/group.h"

namespace dtrain::parallel {

/// A tensor every rank must hold identically: `shape` elements of `element_size` bytes each,
/// contiguous at `data`.
struct ReplicaTensor {
  std::string name;
  void* data = nullptr;
  std::vector<int64_t> shape;
  size_t element_size = sizeof(float);
  int64_t numel() const;
  size_t bytes() const { return static_cast<size_t>(numel()) * element_size; }
};

/// Collective, once before training. Checks that every rank has the same tensors (number,
/// elements, names, shapes and element sizes), naming the first rank that differs and ending
/// the message with "every rank must build the same model" and `hint`; copies rank 0's bytes
/// to every rank unless `broadcast` is false (the memory is already one copy the ranks
/// share); then verifies that every rank holds the same bytes (a digest of all of them).
/// Throws dtrain::Error tagged "ddp" on every rank.
void replicate_from_rank0(comm::Group& group, const std::vector<ReplicaTensor>& tensors, bool broadcast,
                          const std::string& hint = "");

/// The digest replicate_from_rank0 compares: FNV-1a over the tensors' bytes in order.
uint64_t replica_digest(const std::vector<ReplicaTensor>& tensors);

}  // namespace dtrain::parallel
