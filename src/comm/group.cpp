// Group, the facade: each collective picks how it runs on this group (the transport's direct
// collective, a plan, the hierarchy) and hands it to the group's executor (executor.h), which
// owns the ordering, the progress thread and the failure rule. Creation is in bootstrap.cpp.
#include "dtrain/comm/group.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>

#include "dtrain/comm/plan.h"
#include "dtrain/comm/reduce.h"
#include "dtrain/comm/transport.h"
#include "group_impl.h"
#include "plan_common.h"

namespace dtrain::comm {
// ---------------------------------------------------------------------------------- Impl

Group::Impl::~Impl() {
  registration.reset();  // no abort_all() reaches a group being torn down
  heartbeat.reset();
  if (!left_key.empty() && !(executor && executor->broken())) {
    try {
      store->set(left_key, std::to_string(::getpid()));
    } catch (const std::exception&) {  // the launcher then reports this rank's exit as early
    }
  }
  executor.reset();  // before the transport and the hierarchy it runs over
}

void Group::Impl::abort_hierarchy(const std::string& reason) {
  if (hierarchy) hierarchy->abort(reason);
}

bool Group::Impl::hierarchical_for(size_t bytes) const {
  return hierarchy != nullptr && detail::HierarchicalAllReduce::chosen(options.algorithm, bytes);
}

Work Group::Impl::run_plan(const std::string& op, Plan plan, const void* in, void* out, DataType dtype, ReduceOp rop,
                           bool blocking, size_t bytes, int root) {
  return executor->submit(
      op, blocking,
      [this, plan = std::move(plan), in, out, dtype, rop](uint64_t seq, Deadline deadline) {
        execute(plan, *transport, in, out, dtype, rop, seq << 20, deadline);
      },
      bytes, root);
}

Work Group::Impl::run_direct(const std::string& op, bool blocking,
                             std::function<void(DirectCollectives&, Deadline)> body, size_t bytes, int root) {
  return executor->submit(
      op, blocking,
      [this, body = std::move(body)](uint64_t, Deadline deadline) { body(*transport->direct(), deadline); }, bytes,
      root);
}

Work Group::Impl::submit(const std::string& op, bool blocking, std::function<void(Transport&, uint64_t, Deadline)> body,
                         size_t bytes, int root) {
  return executor->submit(
      op, blocking,
      [this, body = std::move(body)](uint64_t seq, Deadline deadline) { body(*transport, seq, deadline); }, bytes,
      root);
}

std::string Group::Impl::describe_json() const {
  return detail::flight_record_json(name, rank, size, name_of(kind), recorder->entries(), members);
}

std::string Group::Impl::pending_json() const { return detail::pending_json(name, recorder->oldest_pending()); }

namespace {

void check_root(int root, int size, const char* op) {
  DT_CHECK(root >= 0 && root < size, "comm", "{}: root {} out of range for a group of {}", op, root, size);
}

}  // namespace

int Group::rank() const { return impl_ ? impl_->rank : -1; }
int Group::size() const { return impl_ ? impl_->size : 0; }
TransportKind Group::transport_kind() const { return impl_ ? impl_->kind : TransportKind::none; }

const GroupOptions& Group::options() const { return impl("options").options; }

std::vector<FlightEntry> Group::flight_record() const { return impl("flight_record").recorder->entries(); }

Group Group::split(int color, int key) const {
  DT_CHECK(impl_ != nullptr, "comm", "split on an empty group");
  return split(color, key, impl_->options);
}

Algorithm Group::all_reduce_algorithm(size_t bytes) const {
  const Impl& g = impl("all_reduce_algorithm");
  if (g.direct_for(g.options.algorithm) != nullptr) return Algorithm::direct;
  return g.hierarchical_for(bytes) ? Algorithm::hierarchical : g.algorithm_for(bytes);
}

Group Group::split(int color, int key, const GroupOptions& requested) const {
  DT_CHECK(impl_ != nullptr, "comm", "split on an empty group");
  GroupOptions options = requested;
  // Where this process listens, its secret and its host are the parent's unless set.
  if (options.bind_address.empty()) options.bind_address = impl_->options.bind_address;
  if (options.secret.empty()) options.secret = impl_->options.secret;
  if (options.host_id.empty()) options.host_id = impl_->options.host_id;
  options.heartbeat_timeout = Duration::zero();  // the parent's heartbeat covers these processes
  options.heartbeat_store = nullptr;
  const int n = size();
  std::vector<int32_t> mine = {color, key};
  std::vector<int32_t> all(static_cast<size_t>(2 * n));
  const_cast<Group*>(this)->all_gather(mine.data(), all.data(), 2, DataType::i32);
  const uint64_t split_id = impl_->splits++;
  if (color < 0) return Group();
  std::vector<std::pair<std::pair<int, int>, int>> members;  // ((key, rank), rank)
  for (int r = 0; r < n; ++r) {
    const size_t at = 2 * static_cast<size_t>(r);
    if (all[at] == color) members.push_back({{all[at + 1], r}, r});
  }
  std::sort(members.begin(), members.end());
  int new_rank = -1;
  for (size_t i = 0; i < members.size(); ++i) {
    if (members[i].second == rank()) new_rank = static_cast<int>(i);
  }
  Group g = create(impl_->store, new_rank, static_cast<int>(members.size()), options,
                   fmt::format("{}/split{}/color{}", impl_->name, split_id, color));
  // The members' world ranks, for the flight record.
  for (const auto& m : members) {
    const auto parent = static_cast<size_t>(m.second);
    g.impl_->members.push_back(parent < impl_->members.size() ? impl_->members[parent] : m.second);
  }
  return g;
}

// ---------------------------------------------------------------------------------- collectives
//
// Each collective is written once, with a `blocking` flag: the blocking form may run inline.

namespace {

using Impl = Group::Impl;

Work all_reduce_impl(Impl& g, const void* send, void* recv, size_t count, DataType dtype, ReduceOp op, bool blocking) {
  if (g.hierarchical_for(count * size_of(dtype))) {
    return g.executor->submit(
        "all_reduce", blocking,
        [&g, send, recv, count, dtype, op](uint64_t, Deadline deadline) {
          g.hierarchy->run(*g.executor, send, recv, count, dtype, op, deadline);
        },
        count * size_of(dtype));
  }
  if (g.direct_for(g.options.algorithm) != nullptr) {
    return g.run_direct(
        "all_reduce", blocking,
        [=](DirectCollectives& d, Deadline deadline) { d.all_reduce(send, recv, count, dtype, op, deadline); },
        count * size_of(dtype));
  }
  Plan plan = plan_all_reduce(g.algorithm_for(count * size_of(dtype)), g.rank, g.size, count);
  return g.run_plan("all_reduce", std::move(plan), send, recv, dtype, op, blocking, count * size_of(dtype));
}

// The group's algorithm where it applies to reduce_scatter / all_gather, else the ring.
Algorithm reduce_scatter_algorithm(const Impl& g) {
  const Algorithm a = g.options.algorithm;
  return a == Algorithm::halving_doubling ? a : Algorithm::ring;
}

Algorithm all_gather_algorithm(const Impl& g) {
  const Algorithm a = g.options.algorithm;
  return a == Algorithm::halving_doubling || a == Algorithm::recursive_doubling ? a : Algorithm::ring;
}

Work reduce_scatter_impl(Impl& g, const void* send, void* recv, size_t recv_count, DataType dtype, ReduceOp op,
                         bool blocking) {
  if (g.direct_for(g.options.algorithm) != nullptr) {
    return g.run_direct(
        "reduce_scatter", blocking,
        [=](DirectCollectives& d, Deadline deadline) { d.reduce_scatter(send, recv, recv_count, dtype, op, deadline); },
        recv_count * g.size * size_of(dtype));
  }
  std::vector<size_t> counts(static_cast<size_t>(g.size), recv_count);
  return g.run_plan("reduce_scatter", plan_reduce_scatter(reduce_scatter_algorithm(g), g.rank, g.size, counts), send,
                    recv, dtype, op, blocking, recv_count * g.size * size_of(dtype));
}

Work all_gather_impl(Impl& g, const void* send, void* recv, size_t send_count, DataType dtype, bool blocking) {
  if (g.direct_for(g.options.algorithm) != nullptr) {
    return g.run_direct(
        "all_gather", blocking,
        [=](DirectCollectives& d, Deadline deadline) { d.all_gather(send, recv, send_count, dtype, deadline); },
        send_count * size_of(dtype));
  }
  std::vector<size_t> counts(static_cast<size_t>(g.size), send_count);
  return g.run_plan("all_gather", plan_all_gather(all_gather_algorithm(g), g.rank, g.size, counts), send, recv, dtype,
                    ReduceOp::sum, blocking, send_count * size_of(dtype));
}

Work broadcast_impl(Impl& g, void* buffer, size_t count, DataType dtype, int root, bool blocking) {
  check_root(root, g.size, "broadcast");
  if (g.direct_for(g.options.algorithm) != nullptr) {
    return g.run_direct(
        "broadcast", blocking,
        [=](DirectCollectives& d, Deadline deadline) { d.broadcast(buffer, count, dtype, root, deadline); },
        count * size_of(dtype), root);
  }
  return g.run_plan("broadcast", plan_broadcast(Algorithm::binomial, g.rank, g.size, count, root), buffer, buffer,
                    dtype, ReduceOp::sum, blocking, count * size_of(dtype), root);
}

void check_peer(const Impl& g, int peer, const char* op) {
  DT_CHECK(peer >= 0 && peer < g.size && peer != g.rank, "comm", "{}: peer {} invalid for rank {} of {}", op, peer,
           g.rank, g.size);
}

Work p2p_impl(Impl& g, bool is_send, void* buffer, size_t count, DataType dtype, int peer, uint32_t tag,
              bool blocking) {
  check_peer(g, peer, is_send ? "send" : "recv");
  return g.executor->post(is_send, buffer, count * size_of(dtype), peer, tag, blocking);
}

}  // namespace

Impl& Group::impl(const char* op) const {
  DT_CHECK(impl_ != nullptr, "comm", "{} on an empty group", op);
  return *impl_;
}

Work Group::all_reduce_async(const void* send, void* recv, size_t count, DataType dtype, ReduceOp op) {
  return all_reduce_impl(impl("all_reduce"), send, recv, count, dtype, op, false);
}

Work Group::reduce_scatter_async(const void* send, void* recv, size_t recv_count, DataType dtype, ReduceOp op) {
  return reduce_scatter_impl(impl("reduce_scatter"), send, recv, recv_count, dtype, op, false);
}

Work Group::all_gather_async(const void* send, void* recv, size_t send_count, DataType dtype) {
  return all_gather_impl(impl("all_gather"), send, recv, send_count, dtype, false);
}

Work Group::broadcast_async(void* buffer, size_t count, DataType dtype, int root) {
  return broadcast_impl(impl("broadcast"), buffer, count, dtype, root, false);
}

Work Group::send_async(const void* buffer, size_t count, DataType dtype, int peer, uint32_t tag) {
  return p2p_impl(impl("send"), true, const_cast<void*>(buffer), count, dtype, peer, tag, false);
}

Work Group::recv_async(void* buffer, size_t count, DataType dtype, int peer, uint32_t tag) {
  return p2p_impl(impl("recv"), false, buffer, count, dtype, peer, tag, false);
}

void Group::all_reduce(const void* send, void* recv, size_t count, DataType dtype, ReduceOp op) {
  Impl& g = impl("all_reduce");
  if (DirectCollectives* d = g.direct_for(g.options.algorithm)) {
    if (g.executor->run_inline("all_reduce", count * size_of(dtype), -1,
                               [&](Deadline deadline) { d->all_reduce(send, recv, count, dtype, op, deadline); })) {
      return;
    }
  }
  all_reduce_impl(g, send, recv, count, dtype, op, true).wait();
}

void Group::reduce_scatter(const void* send, void* recv, size_t recv_count, DataType dtype, ReduceOp op) {
  reduce_scatter_impl(impl("reduce_scatter"), send, recv, recv_count, dtype, op, true).wait();
}

void Group::reduce_scatter_v(const void* send, void* recv, const std::vector<size_t>& counts, DataType dtype,
                             ReduceOp op) {
  Impl& g = impl("reduce_scatter_v");
  DT_CHECK(counts.size() == static_cast<size_t>(size()), "comm", "reduce_scatter_v: {} counts for a group of {}",
           counts.size(), size());
  g.run_plan("reduce_scatter_v", plan_reduce_scatter(reduce_scatter_algorithm(g), rank(), size(), counts), send, recv,
             dtype, op, true)
      .wait();
}

void Group::all_gather(const void* send, void* recv, size_t send_count, DataType dtype) {
  all_gather_impl(impl("all_gather"), send, recv, send_count, dtype, true).wait();
}

void Group::all_gather_v(const void* send, void* recv, const std::vector<size_t>& counts, DataType dtype) {
  Impl& g = impl("all_gather_v");
  DT_CHECK(counts.size() == static_cast<size_t>(size()), "comm", "all_gather_v: {} counts for a group of {}",
           counts.size(), size());
  g.run_plan("all_gather_v", plan_all_gather(all_gather_algorithm(g), rank(), size(), counts), send, recv, dtype,
             ReduceOp::sum, true)
      .wait();
}

void Group::broadcast(void* buffer, size_t count, DataType dtype, int root) {
  broadcast_impl(impl("broadcast"), buffer, count, dtype, root, true).wait();
}

void Group::reduce(const void* send, void* recv, size_t count, DataType dtype, ReduceOp op, int root) {
  Impl& g = impl("reduce");
  check_root(root, size(), "reduce");
  g.run_plan("reduce", plan_reduce(Algorithm::binomial, rank(), size(), count, root), send, recv, dtype, op, true,
             count * size_of(dtype), root)
      .wait();
}

void Group::gather(const void* send, void* recv, size_t count, DataType dtype, int root) {
  Impl& g = impl("gather");
  check_root(root, size(), "gather");
  std::vector<size_t> counts(static_cast<size_t>(size()), count);
  g.run_plan("gather", plan_gather(Algorithm::binomial, rank(), size(), counts, root), send, recv, dtype, ReduceOp::sum,
             true)
      .wait();
}

void Group::scatter(const void* send, void* recv, size_t count, DataType dtype, int root) {
  Impl& g = impl("scatter");
  check_root(root, size(), "scatter");
  std::vector<size_t> counts(static_cast<size_t>(size()), count);
  g.run_plan("scatter", plan_scatter(Algorithm::binomial, rank(), size(), counts, root), send, recv, dtype,
             ReduceOp::sum, true)
      .wait();
}

void Group::all_to_all(const void* send, void* recv, size_t count, DataType dtype) {
  Impl& g = impl("all_to_all");
  DT_CHECK(send != recv || count == 0 || size() == 1, "comm", "all_to_all cannot run in place");
  g.run_plan("all_to_all", plan_all_to_all(Algorithm::pairwise, rank(), size(), count), send, recv, dtype,
             ReduceOp::sum, true)
      .wait();
}

void Group::barrier() {
  Impl& g = impl("barrier");
  if (DirectCollectives* d = g.direct_for(g.options.algorithm)) {
    if (g.executor->run_inline("barrier", 0, -1, [&](Deadline deadline) { d->barrier(deadline); })) return;
    g.run_direct("barrier", true, [](DirectCollectives& dc, Deadline deadline) { dc.barrier(deadline); }).wait();
    return;
  }
  g.run_plan("barrier", plan_barrier(rank(), size()), nullptr, nullptr, DataType::u8, ReduceOp::sum, true).wait();
}

void Group::send(const void* buffer, size_t count, DataType dtype, int peer, uint32_t tag) {
  p2p_impl(impl("send"), true, const_cast<void*>(buffer), count, dtype, peer, tag, true).wait();
}

void Group::recv(void* buffer, size_t count, DataType dtype, int peer, uint32_t tag) {
  p2p_impl(impl("recv"), false, buffer, count, dtype, peer, tag, true).wait();
}

}  // namespace dtrain::comm
