// What a Group handle points at (internal to comm): the group's identity, its transport, the
// executor that runs its operations, and its health hooks. group.cpp (the facade),
// bootstrap.cpp (creation), compressed.cpp and shared.cpp (the collectives outside the core
// API) see it through detail::GroupAccess.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "dtrain/comm/group.h"
#include "dtrain/comm/plan.h"
#include "dtrain/comm/transport.h"
#include "executor.h"
#include "health.h"
#include "plan_hierarchical.h"

namespace dtrain::comm {

struct Group::Impl {
  int rank = 0;
  int size = 0;
  std::string name;
  GroupOptions options;
  std::shared_ptr<Store> store;
  std::shared_ptr<void> keep_alive;  // e.g. the store server hosted by rank 0
  std::unique_ptr<Transport> transport;
  TransportKind kind = TransportKind::none;
  uint64_t splits = 0;
  uint64_t shared_allocations = 0;
  /// The world ranks of the members, by group rank (empty: the group is its own world, 0..size-1);
  /// in the flight record, so that a report can name a member whose own record is missing.
  std::vector<int> members;

  std::shared_ptr<detail::FlightRecorder> recorder;
  std::unique_ptr<detail::Executor> executor;  // the queue, the progress thread, the failure rule
  std::unique_ptr<health::Heartbeat> heartbeat;
  std::shared_ptr<health::Registration> registration;
  // A world started by dtrain launch: the key that tells the launcher this rank left the job
  // cleanly (see from_env); empty otherwise.
  std::string left_key;

  // A group spanning two or more hosts with the same number (>= 2) of ranks on each: its
  // hierarchical all_reduce (null otherwise).
  std::unique_ptr<detail::HierarchicalAllReduce> hierarchy;

  ~Impl();

  /// Aborts the transport and the hierarchy's sub-groups (any thread).
  void abort(const std::string& reason) {
    if (executor) executor->abort(reason);  // and abort_hierarchy, its also_abort
  }

  // The hierarchy's sub-groups stop too, so that an abandoned hierarchical all_reduce stops
  // touching the caller's buffers. May run on any thread.
  void abort_hierarchy(const std::string& reason);

  // The transport's native collectives when the algorithm is auto or direct (or hier, which
  // a one-host group runs as auto) and it has them.
  DirectCollectives* direct_for(Algorithm requested) const {
    if (requested != Algorithm::automatic && requested != Algorithm::direct && requested != Algorithm::hierarchical) {
      return nullptr;
    }
    return transport->direct();
  }

  // The plan algorithm for all_reduce of `bytes` bytes when neither direct nor hier runs.
  Algorithm algorithm_for(size_t bytes) const {
    const Algorithm a = options.algorithm;
    return a == Algorithm::automatic || a == Algorithm::hierarchical ? choose_all_reduce(bytes, size) : a;
  }

  // Whether all_reduce of `bytes` bytes runs hierarchically.
  bool hierarchical_for(size_t bytes) const;

  Work run_plan(const std::string& op, Plan plan, const void* in, void* out, DataType dtype, ReduceOp rop,
                bool blocking, size_t bytes = 0, int root = -1);
  Work run_direct(const std::string& op, bool blocking, std::function<void(DirectCollectives&, Deadline)> body,
                  size_t bytes = 0, int root = -1);

  /// The one entry point of the collectives outside the core API (compressed.h, shared.h):
  /// runs body(transport, seq, deadline) as collective `op` under the group's ordering and
  /// failure rules (blocking: inline when the group is idle). `bytes` and `root` are for the
  /// flight record.
  Work submit(const std::string& op, bool blocking, std::function<void(Transport&, uint64_t seq, Deadline)> body,
              size_t bytes, int root = -1);

  // This group and its flight record as JSON (times in ms before now).
  std::string describe_json() const;
  // The oldest operation of this group that has not completed, as a JSON object for a live
  // status (dtrain status); empty when none is pending.
  std::string pending_json() const;
};

namespace detail {

// The internal view of a Group handle: what the free functions of compressed.h and shared.h
// and the bootstrap need (Group declares it a friend).
struct GroupAccess {
  static Group::Impl& impl(const Group& g, const char* op) { return g.impl(op); }
  static Group::Impl* impl_or_null(const Group& g) { return g.impl_.get(); }
  static Group wrap(std::shared_ptr<Group::Impl> impl) { return Group(std::move(impl)); }
};

}  // namespace detail
}  // namespace dtrain::comm
