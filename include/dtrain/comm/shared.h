// Collectives over memory that every rank of a group on one host maps (like
// MPI_Win_allocate_shared): the data is read and written in place, with no copy into or out
// of the transport's staging buffers. Only a group over the shm transport has such memory
// (can_share_memory). Each call is one collective on the group: ordering, timeout and failure
// rules are those of group.h, with the differences noted below.
#pragma once

#include <cstddef>
#include <memory>

#include "dtrain/comm/group.h"

namespace dtrain::comm {

/// Memory that every rank of a group on one host maps: the same bytes, at its own address in
/// each process, zeroed at creation. Copies share the mapping, which lasts until the last
/// copy (and keep_alive()) in this process is gone. Writes by one rank are visible to the
/// others after a collective that both took part in (a barrier).
class SharedMemory {
 public:
  SharedMemory() = default;
  bool valid() const { return mapping_ != nullptr; }
  char* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  /// Holds the mapping (e.g. for tensors whose storage is in it).
  std::shared_ptr<const void> keep_alive() const { return mapping_; }

 private:
  friend SharedMemory allocate_shared(Group& group, size_t bytes);
  std::shared_ptr<const void> mapping_;
  char* data_ = nullptr;
  size_t bytes_ = 0;
};

/// Whether allocate_shared works on `group`: every rank on this host, over the shm transport.
bool can_share_memory(const Group& group);

/// Collective (every rank calls it, in the same order as its other allocate_shared calls):
/// `bytes` of memory every rank maps. Throws naming the transport when can_share_memory() is
/// false; nothing is left in /dev/shm, even after a crash.
SharedMemory allocate_shared(Group& group, size_t bytes);

/// reduce_scatter with no copy in: rank q's input, group.size() * recv_count elements, lies in
/// `memory` at byte `offset + q * stride`; each rank reduces its block straight from every
/// input, in rank order (the same bits as reduce_scatter). The inputs must be written before
/// the call and stay untouched until its Work completed, which it does only after every rank
/// has read every input. `recv` may be this rank's block of rank 0's or rank 1's input (the
/// reduction reads those two before it writes), not of any other.
Work reduce_scatter_shared_async(Group& group, const SharedMemory& memory, size_t offset, size_t stride, void* recv,
                                 size_t recv_count, DataType dtype, ReduceOp op);

/// all_reduce in place with no copy in or out: rank q's vector, `count` elements, lies in
/// `memory` at byte `offset + q * stride`. Each rank reduces one slice straight from every
/// vector, in rank order (the same bits as all_reduce), and writes it into every vector, so
/// the data crosses the memory system once instead of through staging copies. The vectors
/// must be written before the call and stay untouched until its Work completed, which it
/// does when every vector holds the result. Every rank must pass the same offset and stride
/// into the same allocation (not checked: the call records compare dtype, count and op).
/// One difference from the other collectives: after a failure the vectors' contents are
/// undefined, and a peer may still be writing them until it sees the abort (at most one
/// 32 KiB block later), since other processes write them. The blocking form runs in the
/// caller's thread when nothing is queued, like the blocking all_reduce.
Work all_reduce_shared_async(Group& group, const SharedMemory& memory, size_t offset, size_t stride, size_t count,
                             DataType dtype, ReduceOp op);
void all_reduce_shared(Group& group, const SharedMemory& memory, size_t offset, size_t stride, size_t count,
                       DataType dtype, ReduceOp op);

}  // namespace dtrain::comm
