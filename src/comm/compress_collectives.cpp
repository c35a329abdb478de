// Compressed all_reduce and reduce_scatter: the two-phase scheme.
//
// Vocabulary. The vector is cut into p *blocks*; block q (counts[q] elements, at offsets[q])
// is *owned* by rank q, which reduces it. all_reduce: counts = the even split (sizes differ
// by at most one, larger first); reduce_scatter: recv_count each. A block's *payload* is its
// encoding (compress.h), chunked from the block's own start, so every block's payload is a
// separate message and an empty block sends nothing.
//
// Phase 1 (reduce-scatter): rank r encodes each block q != r of its input and sends the
// payload to rank q (all p-1 messages at once, all-to-all style); it receives block r's
// payload from every other rank and sums in f32, in rank order, its own block raw and the
// others decoded: acc = x_0 (+) x^_1 (+) ... (own term exact). avg divides acc by p.
// Phase 2 (all-gather, all_reduce only): the owner encodes acc once and sends the same
// payload to every rank; every rank, the owner included, decodes it into the output. So all
// ranks end with bitwise identical results, and each element went through at most one
// quantization per contributor plus one for the result (no requantization per hop).
//
// Error, element i of block b, sum (avg: divide the first two terms by p):
//   |out - sum_q x_q| <= sum_{q != b} e(x_q) + f32 rounding of the p-term sum + e(acc)
// with e() the codec's max_error over the element's chunk. The residual (when asked for) is
// the phase-1 error x_q - x^_q of this rank's contribution, 0 on its own block, plus on its
// own block the phase-2 error acc - out (times p for avg: it is added to an input that gets
// summed, then divided). Fed back into the next call's input, it makes the sum of outputs
// over steps track the sum of exact results within one step's error.
//
// Wire bytes per rank: phase 1 sum_{q != r} payload(counts[q]), phase 2 (p-1) payload(counts[r]):
// about 2 (p-1)/p payload(n), like a ring; raw bytes count 4 bytes per element instead.
//
// Scratch (one block, parked if a wait throws since requests may still use it):
// acc (counts[r] floats), the phase-2 residual (counts[r] floats, when asked for), the
// payloads of the whole input (the own block's slot carries the phase-2 payload, the others'
// slots are reused as phase-2 landings once their phase-1 sends completed), and p-1 phase-1
// landings of payload(counts[r]) bytes.
#include "compress_collectives.h"

#include <algorithm>
#include <cstring>

#include "dtrain/comm/reduce.h"
#include "plan_common.h"
#include "scratch.h"

namespace dtrain::comm::detail {

namespace {

constexpr uint64_t kCompressedTagBit = uint64_t{1} << 62;

size_t align_up(size_t bytes) { return (bytes + Scratch::kAlign - 1) / Scratch::kAlign * Scratch::kAlign; }

void add_raw(float* __restrict acc, const float* __restrict x, size_t n) {
  for (size_t i = 0; i < n; ++i) acc[i] += x[i];
}

}  // namespace

uint64_t compressed_tag(uint64_t seq, CompressedKind kind, Codec codec, ReduceOp op, int phase) {
  return kCompressedTagBit | (seq << 20) | (static_cast<uint64_t>(kind) << 12) | (static_cast<uint64_t>(codec) << 8) |
         (static_cast<uint64_t>(op) << 4) | static_cast<uint64_t>(phase);
}

void execute_compressed(const CompressedCall& c, Transport& t, uint64_t seq, Deadline deadline) {
  const int rank = t.rank();
  const int size = t.size();
  const auto r = static_cast<size_t>(rank);
  const std::vector<size_t> offsets = prefix_sums(c.counts);
  const size_t total = offsets.back();
  const size_t mine = c.counts[r];
  const bool all_reduce = c.kind == CompressedKind::all_reduce;
  float* const own_out = all_reduce ? c.recv + offsets[r] : c.recv;

  if (size == 1) {  // nothing on the wire: the result is the input, nothing is lost
    if (mine > 0 && own_out != c.send) std::memmove(own_out, c.send, mine * sizeof(float));
    if (c.residual != nullptr) std::fill(c.residual, c.residual + total, 0.0f);
    return;
  }

  std::vector<size_t> payload(c.counts.size());
  std::vector<size_t> payload_at(c.counts.size() + 1, 0);
  for (size_t q = 0; q < c.counts.size(); ++q) {
    payload[q] = encoded_bytes(c.codec, c.counts[q]);
    payload_at[q + 1] = payload_at[q] + payload[q];
  }
  const bool phase2_residual = all_reduce && c.residual != nullptr;
  const size_t acc_at = 0;
  const size_t e2_at = acc_at + align_up(mine * sizeof(float));
  const size_t enc_at = e2_at + (phase2_residual ? align_up(mine * sizeof(float)) : 0);
  const size_t land_at = enc_at + align_up(payload_at.back());
  const size_t scratch_bytes = land_at + static_cast<size_t>(size - 1) * payload[r];
  Scratch scratch(scratch_bytes);
  std::byte* base = scratch.data();
  auto* acc = reinterpret_cast<float*>(base + acc_at);
  auto* e2 = reinterpret_cast<float*>(base + e2_at);
  auto* enc = reinterpret_cast<uint8_t*>(base + enc_at);
  auto* land = reinterpret_cast<uint8_t*>(base + land_at);
  // Phase-1 landing of rank q's contribution (q != r).
  auto landing = [&](int q) { return land + static_cast<size_t>(q < rank ? q : q - 1) * payload[r]; };

  uint64_t wire = 0;
  uint64_t raw = 0;
  std::vector<RequestId> recvs(static_cast<size_t>(size), 0);
  std::vector<RequestId> sends;
  try {
    // ---- phase 1: reduce-scatter
    const uint64_t tag1 = compressed_tag(seq, c.kind, c.codec, c.op, 1);
    if (payload[r] > 0) {
      for (int q = 0; q < size; ++q) {
        if (q != rank) recvs[static_cast<size_t>(q)] = t.post_recv(q, tag1, landing(q), payload[r]);
      }
    }
    for (int k = 1; k < size; ++k) {  // start with the right neighbour: no rank is everyone's first
      const auto q = static_cast<size_t>((rank + k) % size);
      if (payload[q] == 0) continue;
      encode(c.codec, c.send + offsets[q], c.counts[q], enc + payload_at[q],
             c.residual != nullptr ? c.residual + offsets[q] : nullptr);
      sends.push_back(t.post_send(static_cast<int>(q), tag1, enc + payload_at[q], payload[q]));
      wire += payload[q];
      raw += c.counts[q] * sizeof(float);
    }
    if (mine > 0) {
      for (int q = 0; q < size; ++q) {  // rank order: the same sum whatever arrives first
        if (q == rank) {
          if (q == 0) {
            std::memcpy(acc, c.send + offsets[r], mine * sizeof(float));
          } else {
            add_raw(acc, c.send + offsets[r], mine);
          }
          continue;
        }
        t.wait({recvs[static_cast<size_t>(q)]}, deadline);
        if (q == 0) {
          decode(c.codec, landing(q), mine, acc);
        } else {
          decode_add(c.codec, landing(q), mine, acc);
        }
      }
      finish_avg(acc, mine, DataType::f32, c.op, size);
    }
    t.wait(sends, deadline);
    sends.clear();
    if (c.residual != nullptr) std::fill(c.residual + offsets[r], c.residual + offsets[r] + mine, 0.0f);

    if (!all_reduce) {
      if (mine > 0) std::memmove(c.recv, acc, mine * sizeof(float));
    } else {
      // ---- phase 2: all-gather of the owners' payloads
      const uint64_t tag2 = compressed_tag(seq, c.kind, c.codec, c.op, 2);
      for (int q = 0; q < size; ++q) {
        const auto qs = static_cast<size_t>(q);
        if (q != rank && payload[qs] > 0) recvs[qs] = t.post_recv(q, tag2, enc + payload_at[qs], payload[qs]);
      }
      if (mine > 0) {
        uint8_t* own = enc + payload_at[r];
        encode(c.codec, acc, mine, own, phase2_residual ? e2 : nullptr);
        for (int k = 1; k < size; ++k) {
          sends.push_back(t.post_send((rank + k) % size, tag2, own, payload[r]));
          wire += payload[r];
          raw += mine * sizeof(float);
        }
        decode(c.codec, own, mine, own_out);
        if (phase2_residual) {
          const float factor = c.op == ReduceOp::avg ? static_cast<float>(size) : 1.0f;
          float* res = c.residual + offsets[r];
          for (size_t i = 0; i < mine; ++i) res[i] = factor * e2[i];
        }
      }
      for (int k = 1; k < size; ++k) {
        const auto q = static_cast<size_t>((rank + k) % size);
        if (payload[q] == 0) continue;
        t.wait({recvs[q]}, deadline);
        decode(c.codec, enc + payload_at[q], c.counts[q], c.recv + offsets[q]);
      }
      t.wait(sends, deadline);
    }
  } catch (...) {
    scratch.park();
    throw;
  }
  if (c.stats != nullptr) {
    c.stats->wire_bytes_sent += wire;
    c.stats->raw_bytes += raw;
  }
}

}  // namespace dtrain::comm::detail
