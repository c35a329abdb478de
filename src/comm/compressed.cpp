// The compressed collectives' entry points (compressed.h): the arguments checked in the
// caller's thread, so that a bad one raises without breaking the group, then one collective
// submitted to the group (the algorithm: compress_collectives.cpp).
#include "dtrain/comm/compressed.h"

#include <cstdint>

#include "compress_collectives.h"
#include "group_impl.h"
#include "plan_common.h"

namespace dtrain::comm {

namespace {

bool overlaps(const float* a, size_t na, const float* b, size_t nb) {
  if (na == 0 || nb == 0) return false;
  const auto a0 = reinterpret_cast<uintptr_t>(a);
  const auto b0 = reinterpret_cast<uintptr_t>(b);
  return a0 < b0 + nb * sizeof(float) && b0 < a0 + na * sizeof(float);
}

Work compressed(Group& group, detail::CompressedKind kind, const float* send, float* recv, size_t block_count,
                Codec codec, ReduceOp op, float* residual, CompressStats* stats, bool blocking) {
  const bool all_reduce = kind == detail::CompressedKind::all_reduce;
  const char* name = all_reduce ? "all_reduce_compressed" : "reduce_scatter_compressed";
  Group::Impl& g = detail::GroupAccess::impl(group, name);
  DT_CHECK(op == ReduceOp::sum || op == ReduceOp::avg, "comm", "{}: op {} is not supported (sum or avg)", name,
           name_of(op));
  DT_CHECK(codec <= Codec::int4, "comm", "{}: unknown codec {}", name, static_cast<int>(codec));
  const auto p = static_cast<size_t>(g.size);
  const size_t total = all_reduce ? block_count : block_count * p;
  DT_CHECK(!overlaps(residual, total, send, total) && !overlaps(residual, total, recv, block_count), "comm",
           "{}: the residual buffer overlaps the send or recv buffer", name);
  detail::CompressedCall call{kind, send, recv, {}, codec, op, residual, stats};
  call.counts = all_reduce ? detail::even_counts(block_count, g.size) : std::vector<size_t>(p, block_count);
  return g.submit(
      name, blocking,
      [call = std::move(call)](Transport& t, uint64_t seq, Deadline deadline) {
        detail::execute_compressed(call, t, seq, deadline);
      },
      total * sizeof(float));
}

}  // namespace

void all_reduce_compressed(Group& group, const float* send, float* recv, size_t count, Codec codec, ReduceOp op,
                           float* residual, CompressStats* stats) {
  compressed(group, detail::CompressedKind::all_reduce, send, recv, count, codec, op, residual, stats, true).wait();
}

Work all_reduce_compressed_async(Group& group, const float* send, float* recv, size_t count, Codec codec, ReduceOp op,
                                 float* residual, CompressStats* stats) {
  return compressed(group, detail::CompressedKind::all_reduce, send, recv, count, codec, op, residual, stats, false);
}

void reduce_scatter_compressed(Group& group, const float* send, float* recv, size_t recv_count, Codec codec,
                               ReduceOp op, float* residual, CompressStats* stats) {
  compressed(group, detail::CompressedKind::reduce_scatter, send, recv, recv_count, codec, op, residual, stats, true)
      .wait();
}

Work reduce_scatter_compressed_async(Group& group, const float* send, float* recv, size_t recv_count, Codec codec,
                                     ReduceOp op, float* residual, CompressStats* stats) {
  return compressed(group, detail::CompressedKind::reduce_scatter, send, recv, recv_count, codec, op, residual, stats,
                    false);
}

}  // namespace dtrain::comm
