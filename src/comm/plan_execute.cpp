// execute(): runs one rank's plan over a Transport.
//
// Per round: (1) local ops in order (copy is a memmove, skipped when source and destination
// are the same memory, which is how in-place runs cost nothing); (2) every receive posted
// (recv into its dst, recv_reduce into its landing region in scratch), then every send, and
// one wait for all of them with the caller's deadline; (3) the recv_reduce reductions, in
// order. Tags are tag_base + round index.
//
// ReduceOp::avg: plans reduce with sum; execute() divides once, at the end, the part of
// output the plan wrote (all_reduce: all of it; reduce_scatter: the rank's block; reduce: the
// root's output, non-roots write none). So a data-movement collective (all_gather, broadcast,
// ...) must be run with a non-avg op, e.g. ReduceOp::sum, which it ignores.
//
// Scratch: one block per call from the per-thread cache (scratch.h); if a wait throws, requests
// may still be posted against it, so it is parked (never reused nor freed).
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "dtrain/comm/reduce.h"
#include "plan_common.h"
#include "scratch.h"

namespace dtrain::comm {

namespace {

using detail::Scratch;

// Pointer for zero-byte messages: transports may not accept null.
std::byte g_empty[1];

struct Buffers {
  const std::byte* input;
  std::byte* output;
  std::byte* scratch;
  size_t esize;

  std::byte* at(const Region& r) const {
    if (r.count == 0) return g_empty;
    switch (r.buf) {
      case Buf::input:
        return const_cast<std::byte*>(input) + r.offset * esize;
      case Buf::output:
        return output + r.offset * esize;
      case Buf::scratch:
        return scratch + r.offset * esize;
    }
    return nullptr;
  }
  size_t bytes(const Region& r) const { return r.count * esize; }
};

void check_plan(const Plan& plan, int rank, int size) {
  for (const Round& round : plan.rounds) {
    for (const PlanOp& op : round.ops) {
      const bool is_message =
          op.kind == PlanOp::Kind::send || op.kind == PlanOp::Kind::recv || op.kind == PlanOp::Kind::recv_reduce;
      if (is_message) {
        DT_CHECK(op.peer >= 0 && op.peer < size && op.peer != rank, "comm",
                 "execute: plan '{}' of rank {} names peer {} in a world of {}", plan.algorithm, rank, op.peer, size);
      }
      for (const Region* r : {&op.src, &op.dst}) {
        DT_CHECK(r->buf != Buf::scratch || r->offset + r->count <= plan.scratch_count, "comm",
                 "execute: plan '{}' addresses scratch [{}, {}) beyond its {} elements", plan.algorithm, r->offset,
                 r->offset + r->count, plan.scratch_count);
      }
      DT_CHECK(op.kind != PlanOp::Kind::recv_reduce || (op.src.buf == Buf::scratch && op.src.count == op.dst.count),
               "comm", "execute: plan '{}' has a recv_reduce whose landing is not a scratch region of its size",
               plan.algorithm);
      DT_CHECK(op.dst.buf != Buf::input || op.kind == PlanOp::Kind::send, "comm",
               "execute: plan '{}' writes its input buffer", plan.algorithm);
    }
  }
}

// The part of output the plan writes, [begin, end) in elements (empty when none).
std::pair<size_t, size_t> written_output(const Plan& plan) {
  size_t begin = SIZE_MAX;
  size_t end = 0;
  for (const Round& round : plan.rounds) {
    for (const PlanOp& op : round.ops) {
      if (op.kind == PlanOp::Kind::send || op.dst.buf != Buf::output || op.dst.count == 0) continue;
      begin = std::min(begin, op.dst.offset);
      end = std::max(end, op.dst.offset + op.dst.count);
    }
  }
  return begin < end ? std::pair{begin, end} : std::pair{size_t{0}, size_t{0}};
}

}  // namespace

void execute(const Plan& plan, Transport& transport, const void* input, void* output, DataType dtype, ReduceOp op,
             uint64_t tag_base, Deadline deadline) {
  const int rank = transport.rank();
  const int size = transport.size();
  check_plan(plan, rank, size);
  const size_t esize = size_of(dtype);
  Scratch scratch(plan.scratch_count * esize);
  const Buffers buf{static_cast<const std::byte*>(input), static_cast<std::byte*>(output), scratch.data(), esize};

  std::vector<RequestId> requests;
  for (size_t index = 0; index < plan.rounds.size(); ++index) {
    const Round& round = plan.rounds[index];
    const uint64_t tag = tag_base + index;
    bool has_messages = false;
    for (const PlanOp& o : round.ops) {
      if (o.kind == PlanOp::Kind::copy) {
        std::byte* dst = buf.at(o.dst);
        const std::byte* src = buf.at(o.src);
        if (dst != src) std::memmove(dst, src, buf.bytes(o.src));
      } else if (o.kind == PlanOp::Kind::reduce_local) {
        reduce_into(buf.at(o.dst), buf.at(o.src), o.src.count, dtype, op);
      } else {
        has_messages = true;
      }
    }
    if (!has_messages) continue;
    requests.clear();
    try {
      for (const PlanOp& o : round.ops) {
        if (o.kind == PlanOp::Kind::recv) {
          requests.push_back(transport.post_recv(o.peer, tag, buf.at(o.dst), buf.bytes(o.dst)));
        } else if (o.kind == PlanOp::Kind::recv_reduce) {
          requests.push_back(transport.post_recv(o.peer, tag, buf.at(o.src), buf.bytes(o.src)));
        }
      }
      for (const PlanOp& o : round.ops) {
        if (o.kind == PlanOp::Kind::send) {
          requests.push_back(transport.post_send(o.peer, tag, buf.at(o.src), buf.bytes(o.src)));
        }
      }
      transport.wait(requests, deadline);
    } catch (...) {
      scratch.park();
      throw;
    }
    for (const PlanOp& o : round.ops) {
      if (o.kind == PlanOp::Kind::recv_reduce) reduce_into(buf.at(o.dst), buf.at(o.src), o.dst.count, dtype, op);
    }
  }

  if (op == ReduceOp::avg) {
    const auto [begin, end] = written_output(plan);
    finish_avg(buf.output + begin * esize, end - begin, dtype, op, size);
  }
}

}  // namespace dtrain::comm
