// Memory every rank of a one-host group maps, and the collectives that reduce in it
// (shared.h): the arguments checked in the caller's thread, then one collective submitted to
// the group, run by the transport's mapped collectives (Transport::mapped()).
#include "dtrain/comm/shared.h"

#include <fmt/format.h>

#include "group_impl.h"
#include "shm/shm_segment.h"

namespace dtrain::comm {

namespace {

bool can_share(const Group::Impl& g) { return g.transport->mapped() != nullptr; }

// The byte at which rank 0's vector of `bytes` starts in `memory`, after checking that every
// rank's vector, `stride` bytes apart from `offset`, fits without overlapping.
char* shared_vectors(const SharedMemory& memory, const Group::Impl& g, const char* op, size_t offset, size_t stride,
                     size_t bytes) {
  DT_CHECK(memory.valid() && can_share(g), "comm",
           "group '{}': {} needs memory from allocate_shared on a shm group ({})", g.name, op, name_of(g.kind));
  size_t span = 0, end = 0;
  const bool wraps = __builtin_mul_overflow(static_cast<size_t>(g.size - 1), stride, &span) ||
                     __builtin_add_overflow(span, offset, &end) || __builtin_add_overflow(end, bytes, &end);
  DT_CHECK(!wraps && end <= memory.bytes() && (g.size == 1 || stride >= bytes), "comm",
           "{}: vectors of {} bytes at offset {} every {} bytes do not fit {} bytes of shared memory without "
           "overlapping",
           op, bytes, offset, stride, memory.bytes());
  return memory.data() + offset;
}

Work run_all_reduce_shared(Group& group, const SharedMemory& memory, size_t offset, size_t stride, size_t count,
                           DataType dtype, ReduceOp op, bool blocking) {
  Group::Impl& g = detail::GroupAccess::impl(group, "all_reduce_shared");
  size_t bytes = 0;
  DT_CHECK(!__builtin_mul_overflow(count, size_of(dtype), &bytes), "comm",
           "all_reduce_shared: {} elements of {} overflow", count, name_of(dtype));
  char* vectors = shared_vectors(memory, g, "all_reduce_shared", offset, stride, bytes);
  return g.submit(
      "all_reduce_shared", blocking,
      [=, keep = memory.keep_alive()](Transport& t, uint64_t, Deadline deadline) {
        t.mapped()->all_reduce_mapped(vectors, stride, count, dtype, op, deadline);
      },
      bytes);
}

}  // namespace

bool can_share_memory(const Group& group) { return can_share(detail::GroupAccess::impl(group, "can_share_memory")); }

SharedMemory allocate_shared(Group& group, size_t bytes) {
  Group::Impl& g = detail::GroupAccess::impl(group, "allocate_shared");
  DT_CHECK(can_share(g), "comm",
           "group '{}': allocate_shared needs every rank on one host over the shm transport, not {}", g.name,
           name_of(g.kind));
  const std::string prefix = fmt::format("{}/mem{}", g.name, g.shared_allocations++);
  auto mapping =
      std::make_shared<shm::Mapping>(shm::share_mapping(*g.store, prefix, g.rank, g.size, bytes, g.options.timeout));
  SharedMemory m;
  m.data_ = mapping->data();
  m.bytes_ = bytes;
  m.mapping_ = std::move(mapping);
  return m;
}

Work reduce_scatter_shared_async(Group& group, const SharedMemory& memory, size_t offset, size_t stride, void* recv,
                                 size_t recv_count, DataType dtype, ReduceOp op) {
  Group::Impl& g = detail::GroupAccess::impl(group, "reduce_scatter_shared");
  const size_t input = static_cast<size_t>(g.size) * recv_count * size_of(dtype);
  const char* inputs = shared_vectors(memory, g, "reduce_scatter_shared", offset, stride, input);
  return g.submit(
      "reduce_scatter_shared", false,
      [=, keep = memory.keep_alive()](Transport& t, uint64_t, Deadline deadline) {
        t.mapped()->reduce_scatter_mapped(inputs, stride, recv, recv_count, dtype, op, deadline);
      },
      input);
}

Work all_reduce_shared_async(Group& group, const SharedMemory& memory, size_t offset, size_t stride, size_t count,
                             DataType dtype, ReduceOp op) {
  return run_all_reduce_shared(group, memory, offset, stride, count, dtype, op, false);
}

void all_reduce_shared(Group& group, const SharedMemory& memory, size_t offset, size_t stride, size_t count,
                       DataType dtype, ReduceOp op) {
  run_all_reduce_shared(group, memory, offset, stride, count, dtype, op, true).wait();
}

}  // namespace dtrain::comm
