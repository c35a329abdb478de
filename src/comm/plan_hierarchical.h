// The hierarchical all_reduce of a group whose ranks span hosts (internal to comm; group.h,
// "Algorithms", says when it runs). Unlike the plans beside it, it is not a list of sends and
// receives over one transport but a composition of two sub-groups: the ranks of this host
// (shm) and the ranks of the same local index on every host (tcp).
//
// Vocabulary: the group has `hosts` hosts with `local_size` >= 2 ranks on each; this rank is
// `local_rank` on host `host` (hosts numbered in order of their lowest rank). A vector goes
// in `segments`; a segment is `local_size` pieces of `block` elements, piece q reduced by the
// local rank q, across the hosts.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "dtrain/comm/group.h"
#include "dtrain/comm/store.h"

namespace dtrain::comm::detail {

class Executor;

struct HostLayout {
  int hosts = 0, host = 0, local_size = 0, local_rank = 0;
};

class HierarchicalAllReduce {
 public:
  /// For rank `rank` of `size` in group `group` (its store and options, which the sub-groups
  /// inherit) laid out as `layout`.
  HierarchicalAllReduce(HostLayout layout, int rank, int size, std::shared_ptr<Store> store, std::string group,
                        GroupOptions options);

  /// Whether all_reduce of `bytes` bytes runs hierarchically on a group of this shape whose
  /// algorithm is `requested`: when asked to, or when it is auto and the vector large enough.
  static bool chosen(Algorithm requested, size_t bytes);

  /// reduce_scatter within the host, all_reduce across hosts, all_gather within the host. Runs
  /// on the group's executor `parent`, whose sends and receives in flight keep moving while
  /// it waits for the sub-groups. The first call (every rank makes it at the same point)
  /// creates the two sub-groups. Throws the first sub-operation's error after every
  /// sub-operation touching the buffers ended.
  void run(Executor& parent, const void* send, void* recv, size_t count, DataType dtype, ReduceOp op,
           Deadline deadline);

  /// Aborts the sub-groups, so that an abandoned all_reduce stops touching the caller's
  /// buffers. Any thread.
  void abort(const std::string& reason);

 private:
  void ensure_groups();

  const HostLayout layout_;
  const int rank_, size_;
  const std::shared_ptr<Store> store_;
  const std::string group_;
  const GroupOptions options_;
  Group local_;                  // the ranks of this host (shm)
  Group cross_;                  // the ranks of the same local_rank on every host (tcp)
  std::vector<uint8_t> padded_;  // count rounded up to a multiple of local_size, when it is not one
  std::vector<uint8_t> piece_;   // this rank's 1/local_size of the vector
  std::mutex mu_;                // local_ and cross_, against abort() from other threads
};

}  // namespace dtrain::comm::detail
