// dtrain bench collectives: an nccl-tests style sweep of one collective over message sizes,
// with p50/p99 latency, algorithm and bus bandwidth, an exact correctness check, the memcpy
// bandwidth of this machine, and (--model) alpha/beta/gamma from ping-pong with the cost
// model's prediction next to each measurement. With --compress CODECS it runs the compressed
// all_reduce / reduce_scatter instead (comm/compress.h): busbw counts the uncompressed f32
// bytes (effbw), wirebw the bytes on the wire, and the check accepts every element within the
// collective's derived error bound. Started without RANK in the environment it launches -n
// copies of itself through dtrain launch.
#include <fmt/format.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <numeric>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "commands.h"
#include "dtrain/comm/compress.h"
#include "dtrain/comm/compressed.h"
#include "dtrain/comm/group.h"
#include "dtrain/comm/reduce.h"
#include "dtrain/comm/shared.h"
#include "dtrain/core/error.h"
#include "dtrain/core/file.h"
#include "dtrain/tensor/half.h"

namespace dtrain::tools {

namespace {

using comm::Algorithm;
using comm::Codec;
using comm::DataType;
using comm::Group;
using comm::ReduceOp;
using Seconds = std::chrono::duration<double>;

double now_s() { return Seconds(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// ------------------------------------------------------------------ element access by dtype

void store_value(void* buf, size_t i, DataType t, double v) {
  switch (t) {
    case DataType::f32:
      static_cast<float*>(buf)[i] = static_cast<float>(v);
      break;
    case DataType::f64:
      static_cast<double*>(buf)[i] = v;
      break;
    case DataType::bf16:
      static_cast<uint16_t*>(buf)[i] = f32_to_bf16(static_cast<float>(v));
      break;
    case DataType::f16:
      static_cast<uint16_t*>(buf)[i] = f32_to_f16(static_cast<float>(v));
      break;
    case DataType::i32:
      static_cast<int32_t*>(buf)[i] = static_cast<int32_t>(v);
      break;
    case DataType::i64:
      static_cast<int64_t*>(buf)[i] = static_cast<int64_t>(v);
      break;
    case DataType::u8:
      static_cast<uint8_t*>(buf)[i] = static_cast<uint8_t>(v);
      break;
  }
}

double load_value(const void* buf, size_t i, DataType t) {
  switch (t) {
    case DataType::f32:
      return static_cast<const float*>(buf)[i];
    case DataType::f64:
      return static_cast<const double*>(buf)[i];
    case DataType::bf16:
      return bf16_to_f32(static_cast<const uint16_t*>(buf)[i]);
    case DataType::f16:
      return f16_to_f32(static_cast<const uint16_t*>(buf)[i]);
    case DataType::i32:
      return static_cast<const int32_t*>(buf)[i];
    case DataType::i64:
      return static_cast<double>(static_cast<const int64_t*>(buf)[i]);
    case DataType::u8:
      return static_cast<const uint8_t*>(buf)[i];
  }
  return 0;
}

// Inputs whose reduction is exact in every dtype (small integers; sums stay below 256 for 8
// ranks so bf16 and u8 hold them), and the expected reduction of element i over p ranks.
double input_value(ReduceOp op, int rank, int p, size_t i) {
  switch (op) {
    case ReduceOp::sum:
      return static_cast<double>((rank + 1) * static_cast<int>(i % 5 + 1));
    case ReduceOp::avg:
      return rank == 0 ? static_cast<double>(p * static_cast<int>(i % 5 + 1)) : 0.0;
    case ReduceOp::prod:
      return (i + static_cast<size_t>(rank)) % 3 == 0 ? 2.0 : 1.0;
    case ReduceOp::max:
    case ReduceOp::min:
      return static_cast<double>((i * 7 + static_cast<size_t>(rank) * 3) % 11);
  }
  return 0;
}

double expected_value(ReduceOp op, int p, size_t i) {
  double acc = input_value(op, 0, p, i);
  for (int r = 1; r < p; ++r) {
    const double v = input_value(op, r, p, i);
    switch (op) {
      case ReduceOp::sum:
      case ReduceOp::avg:
        acc += v;
        break;
      case ReduceOp::prod:
        acc *= v;
        break;
      case ReduceOp::max:
        acc = std::max(acc, v);
        break;
      case ReduceOp::min:
        acc = std::min(acc, v);
        break;
    }
  }
  return op == ReduceOp::avg ? acc / p : acc;
}

// A value that identifies (rank, index) for the data-movement collectives; exact in every dtype.
double tag_value(int rank, size_t i) { return static_cast<double>((static_cast<size_t>(rank) * 37 + i) % 101); }

// ------------------------------------------------------------------ one collective

enum class Op { allreduce, allgather, reducescatter, broadcast, sendrecv, alltoall };

Op parse_op_name(const std::string& s) {
  if (s == "allreduce") return Op::allreduce;
  if (s == "allgather") return Op::allgather;
  if (s == "reducescatter") return Op::reducescatter;
  if (s == "broadcast") return Op::broadcast;
  if (s == "sendrecv") return Op::sendrecv;
  if (s == "alltoall") return Op::alltoall;
  DT_THROW("bench", "--op '{}': expected allreduce, allgather, reducescatter, broadcast, sendrecv or alltoall", s);
}

// nccl-tests' bus bandwidth factors (../shared/BENCHMARKS.md).
double bus_factor(Op op, int p) {
  const double n = p;
  switch (op) {
    case Op::allreduce:
      return 2.0 * (n - 1) / n;
    case Op::allgather:
    case Op::reducescatter:
    case Op::alltoall:
      return (n - 1) / n;
    case Op::broadcast:
    case Op::sendrecv:
      return 1.0;
  }
  return 1.0;
}

// Buffers and the call of one collective at one size. `bytes` is nccl-tests' size: the whole
// vector (all_reduce, broadcast, sendrecv), the gathered output (all_gather), the input to
// scatter (reduce_scatter, all_to_all).
struct Case {
  Op op;
  Group* g;
  DataType dtype;
  ReduceOp redop;
  bool inplace;
  size_t count;  // elements of the whole vector
  size_t block;  // elements per rank where the collective has blocks
  std::vector<char> send, recv;
  comm::SharedMemory shared;  // --shared: every rank's vector, `stride` bytes apart
  size_t stride = 0;
  char* in = nullptr;          // this rank's input: send, or its vector in `shared`
  std::optional<Codec> codec;  // the compressed collective (f32 all_reduce / reduce_scatter)
  comm::CompressStats stats;   // added to by every compressed run

  // `elements`: the whole vector, or (all_gather, reduce_scatter, all_to_all) each rank's block.
  Case(Op o, Group& group, DataType t, ReduceOp r, bool in_place, size_t elements, bool in_shared = false)
      : op(o), g(&group), dtype(t), redop(r), inplace(in_place || in_shared) {
    const size_t es = comm::size_of(t);
    const size_t p = static_cast<size_t>(group.size());
    const bool blocks = op == Op::allgather || op == Op::reducescatter || op == Op::alltoall;
    block = blocks ? elements : elements / p;
    count = blocks ? elements * p : elements;
    const size_t send_elems = op == Op::allgather ? block : count;
    const size_t recv_elems = op == Op::reducescatter ? block : count;
    recv.assign(in_shared ? 1 : std::max<size_t>(1, recv_elems * es), 0);  // shared: in place, no recv
    if (in_shared) {
      stride = (std::max<size_t>(1, count * es) + 4095) / 4096 * 4096;  // page-aligned vectors
      shared = comm::allocate_shared(group, stride * p);
      in = shared.data() + stride * static_cast<size_t>(group.rank());
    } else {
      send.assign(std::max<size_t>(1, send_elems * es), 0);
      in = send.data();
    }
  }

  size_t es() const { return comm::size_of(dtype); }
  void* out() { return inplace && op == Op::allreduce ? in : recv.data(); }

  void fill() {
    const int r = g->rank(), p = g->size();
    switch (op) {
      case Op::allreduce:
      case Op::reducescatter:
        for (size_t i = 0; i < count; ++i) store_value(in, i, dtype, input_value(redop, r, p, i));
        break;
      case Op::allgather:
        for (size_t i = 0; i < block; ++i) store_value(in, i, dtype, tag_value(r, i));
        break;
      case Op::broadcast:
        for (size_t i = 0; i < count; ++i) store_value(in, i, dtype, r == 0 ? tag_value(0, i) : 0.0);
        break;
      case Op::sendrecv:
      case Op::alltoall:
        for (size_t i = 0; i < count; ++i) store_value(in, i, dtype, tag_value(r, i));
        break;
    }
    std::fill(recv.begin(), recv.end(), 0);
  }

  void run() {
    const int r = g->rank(), p = g->size();
    if (codec) {
      const auto* src = reinterpret_cast<const float*>(in);
      if (op == Op::allreduce) {
        comm::all_reduce_compressed(*g, src, static_cast<float*>(out()), count, *codec, redop, nullptr, &stats);
      } else {
        comm::reduce_scatter_compressed(*g, src, reinterpret_cast<float*>(recv.data()), block, *codec, redop, nullptr,
                                        &stats);
      }
      return;
    }
    switch (op) {
      case Op::allreduce:
        if (shared.valid()) {
          comm::all_reduce_shared(*g, shared, 0, stride, count, dtype, redop);
        } else {
          g->all_reduce(in, out(), count, dtype, redop);
        }
        break;
      case Op::allgather:
        g->all_gather(in, recv.data(), block, dtype);
        break;
      case Op::reducescatter:
        g->reduce_scatter(in, recv.data(), block, dtype, redop);
        break;
      case Op::broadcast:
        g->broadcast(in, count, dtype, 0);
        break;
      case Op::alltoall:
        g->all_to_all(in, recv.data(), block, dtype);
        break;
      case Op::sendrecv: {
        if (p == 1) {
          std::memcpy(recv.data(), in, count * es());
          break;
        }
        comm::Work w = g->send_async(in, count, dtype, (r + 1) % p);
        g->recv(recv.data(), count, dtype, (r + p - 1) % p);
        w.wait();
        break;
      }
    }
  }

  // Elements of this rank's result that differ from the exact expectation (compressed: that
  // lie outside the derived bound).
  uint64_t wrong() const {
    if (codec) return wrong_compressed();
    const int r = g->rank(), p = g->size();
    uint64_t bad = 0;
    auto expect = [&](const void* buf, size_t i, double want) { bad += load_value(buf, i, dtype) != want; };
    const void* res = inplace && op == Op::allreduce ? in : recv.data();
    switch (op) {
      case Op::allreduce:
        for (size_t i = 0; i < count; ++i) expect(res, i, cast(expected_value(redop, p, i)));
        break;
      case Op::reducescatter:
        for (size_t i = 0; i < block; ++i)
          expect(res, i, cast(expected_value(redop, p, static_cast<size_t>(r) * block + i)));
        break;
      case Op::allgather:
        for (size_t i = 0; i < count; ++i) expect(res, i, tag_value(static_cast<int>(i / block), i % block));
        break;
      case Op::broadcast:
        for (size_t i = 0; i < count; ++i) expect(in, i, tag_value(0, i));
        break;
      case Op::sendrecv:
        for (size_t i = 0; i < count; ++i) expect(res, i, tag_value((r + p - 1) % p, i));
        break;
      case Op::alltoall:
        for (size_t i = 0; i < count; ++i) {
          const int from = static_cast<int>(i / block);
          expect(res, i, tag_value(from, static_cast<size_t>(r) * block + i % block));
        }
        break;
    }
    return bad;
  }

  // The bound derived in comm/compress_collectives.cpp, element i of block b (owned by rank b):
  //   sum_{q != b} e(x_q) + f32 rounding of the p-term sum (avg: both / p, + the division's)
  //   + all_reduce: e(result), its chunk's largest value bounded through the first terms,
  // e() being the codec's max_error over the element's chunk; chunks start at each block.
  uint64_t wrong_compressed() const {
    const int r = g->rank(), p = g->size();
    const bool all_reduce = op == Op::allreduce;
    const bool avg = redop == ReduceOp::avg;
    const auto* res = reinterpret_cast<const float*>(all_reduce && inplace ? in : recv.data());
    // Blocks: all_reduce, the even split of the vector (larger first); reduce_scatter, `block` each.
    std::vector<size_t> begins(static_cast<size_t>(p) + 1, 0);
    const auto np = static_cast<size_t>(p);
    for (size_t q = 0; q < np; ++q) begins[q + 1] = begins[q] + (all_reduce ? count / np + (q < count % np) : block);
    const double u = 0x1p-24;
    uint64_t bad = 0;
    std::vector<double> chunk_max(static_cast<size_t>(p)), bound(comm::kQuantChunk), magnitude(comm::kQuantChunk);
    for (int b = 0; b < p; ++b) {
      if (!all_reduce && b != r) continue;
      const size_t begin = begins[static_cast<size_t>(b)], end = begins[static_cast<size_t>(b) + 1];
      const float* out = all_reduce ? res + begin : res;
      for (size_t c0 = begin; c0 < end; c0 += comm::kQuantChunk) {
        const size_t n = std::min(comm::kQuantChunk, end - c0);
        std::fill(chunk_max.begin(), chunk_max.end(), 0.0);
        for (int q = 0; q < p; ++q) {
          for (size_t j = 0; j < n; ++j) {
            chunk_max[static_cast<size_t>(q)] =
                std::max(chunk_max[static_cast<size_t>(q)], std::fabs(input_value(redop, q, p, c0 + j)));
          }
        }
        double largest = 0;
        for (size_t j = 0; j < n; ++j) {
          double e1 = 0, abs_sum = 0, sum = 0;
          for (int q = 0; q < p; ++q) {
            const double v = input_value(redop, q, p, c0 + j);
            const double e = q == b ? 0.0 : comm::max_error(*codec, std::fabs(v), chunk_max[static_cast<size_t>(q)]);
            e1 += e;
            abs_sum += std::fabs(v) + e;
            sum += v;
          }
          double err = e1 + p * u * abs_sum;
          double mag = std::fabs(sum) + err;
          if (avg) {
            err /= p;
            mag /= p;
            err += u * mag;
          }
          bound[j] = err;
          magnitude[j] = mag;
          largest = std::max(largest, mag);
        }
        for (size_t j = 0; j < n; ++j) {
          const double b2 = all_reduce ? comm::max_error(*codec, magnitude[j], largest) : 0.0;
          const double got = out[c0 - begin + j];
          bad += !(std::fabs(got - expected_value(redop, p, c0 + j)) <= bound[j] + b2);  // NaN is wrong
        }
      }
    }
    return bad;
  }

  // The expected value as the dtype holds it (integer average truncates).
  double cast(double v) const {
    if (dtype == DataType::i32 || dtype == DataType::i64 || dtype == DataType::u8) return std::trunc(v);
    return v;
  }
};

// ------------------------------------------------------------------ measurements

double percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const double pos = q * static_cast<double>(v.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(pos));
  const size_t hi = std::min(v.size() - 1, lo + 1);
  return v[lo] + (v[hi] - v[lo]) * (pos - static_cast<double>(lo));
}

// Single-core memcpy bandwidth (GB/s, bytes copied per second), median of 7.
double memcpy_gbs() {
  const size_t n = size_t{64} << 20;
  std::vector<char> a(n, 1), b(n, 2);
  std::vector<double> rates;
  for (int k = 0; k < 7; ++k) {
    const double t0 = now_s();
    std::memcpy(b.data(), a.data(), n);
    const double t = now_s() - t0;
    rates.push_back(static_cast<double>(n) / t / 1e9);
    a[static_cast<size_t>(k)] = b[n - 1 - static_cast<size_t>(k)];  // keep the copies observable
  }
  return percentile(rates, 0.5);
}

// Reduction throughput gamma (seconds per byte) of the f32 sum kernel on 4 MiB vectors.
double reduce_gamma(DataType dtype) {
  const size_t bytes = size_t{4} << 20;
  const size_t n = bytes / comm::size_of(dtype);
  std::vector<char> a(bytes, 0), b(bytes, 0);
  std::vector<double> t;
  for (int k = 0; k < 9; ++k) {
    const double t0 = now_s();
    comm::reduce_into(a.data(), b.data(), n, dtype, ReduceOp::sum);
    t.push_back((now_s() - t0) / static_cast<double>(bytes));
  }
  return percentile(t, 0.5);
}

struct PingPong {
  double alpha = 0;                               // seconds
  double beta = 0;                                // seconds per byte
  std::vector<std::pair<size_t, double>> points;  // bytes, one-way seconds
};

// Ranks 0 and 1 bounce messages of 8 B .. 4 MiB; one-way time = half the round trip (median).
// alpha and beta from a least-squares line through the points. Every rank takes part in the
// barriers; ranks >= 2 only wait.
PingPong ping_pong(Group& g) {
  PingPong pp;
  const int r = g.rank();
  std::vector<char> buf(size_t{4} << 20, 1);
  for (size_t bytes = 8; bytes <= buf.size(); bytes *= 4) {
    const int reps = bytes <= (64 << 10) ? 200 : 20;
    std::vector<double> t;
    g.barrier();
    for (int k = 0; k < reps + 5; ++k) {
      const double t0 = now_s();
      if (r == 0) {
        g.send(buf.data(), bytes, DataType::u8, 1, 7);
        g.recv(buf.data(), bytes, DataType::u8, 1, 8);
      } else if (r == 1) {
        g.recv(buf.data(), bytes, DataType::u8, 0, 7);
        g.send(buf.data(), bytes, DataType::u8, 0, 8);
      }
      if (k >= 5) t.push_back((now_s() - t0) / 2);
    }
    pp.points.push_back({bytes, percentile(t, 0.5)});
  }
  // beta: least-squares slope through the messages of 32 KiB and more (bandwidth-bound);
  // alpha: the fastest one-way time of the small ones (the fitted intercept is dominated by
  // the large messages and noise).
  double sx = 0, sy = 0, sxx = 0, sxy = 0, n = 0;
  pp.alpha = 1e9;
  for (auto [b, y] : pp.points) {
    if (b <= 2048) pp.alpha = std::min(pp.alpha, y);
    if (b < 32768) continue;
    const double x = static_cast<double>(b);
    sx += x, sy += y, sxx += x * x, sxy += x * y, n += 1;
  }
  pp.beta = n >= 2 ? (n * sxy - sx * sy) / (n * sxx - sx * sx) : 0.0;
  return pp;
}

// Cost model of all_reduce (../shared/BENCHMARKS.md), seconds. When ranks outnumber cores the
// per-byte terms are stretched by p / cores (they time-share).
double model_all_reduce(Algorithm a, double n, int p, const PingPong& pp, double gamma, double copy_beta,
                        size_t stage_bytes, int cores) {
  const double P = p;
  const double share = std::max(1.0, P / cores);
  const double lg = std::ceil(std::log2(P));
  switch (a) {
    case Algorithm::ring:
      return 2 * (P - 1) * pp.alpha + share * (2 * n * (P - 1) / P * pp.beta + n * (P - 1) / P * gamma);
    case Algorithm::halving_doubling:
      return 2 * lg * pp.alpha + share * (2 * n * (P - 1) / P * pp.beta + n * (P - 1) / P * gamma);
    case Algorithm::recursive_doubling:
      return lg * pp.alpha + share * lg * n * (pp.beta + gamma);
    case Algorithm::direct: {
      // Per chunk: copy in (n), reduce a 1/p slice from p-1 slots, copy out (n); two syncs per
      // chunk, each about one one-way latency.
      const double chunks = std::max(1.0, std::ceil(n / static_cast<double>(stage_bytes)));
      const bool small = n <= 16384;
      const double bytes_moved = small ? n + (P - 1) * n : 2 * n;
      const double reduced = small ? (P - 1) * n : n * (P - 1) / P;
      return chunks * (small ? 1 : 2) * pp.alpha + share * (bytes_moved * copy_beta + reduced * gamma);
    }
    default:
      return 0;
  }
}

size_t parse_bytes(const std::string& text) {
  size_t mult = 1;
  std::string digits = text;
  if (!text.empty()) {
    switch (text.back()) {
      case 'K':
      case 'k':
        mult = size_t{1} << 10;
        break;
      case 'M':
      case 'm':
        mult = size_t{1} << 20;
        break;
      case 'G':
      case 'g':
        mult = size_t{1} << 30;
        break;
      default:
        break;
    }
    if (mult != 1) digits.pop_back();
  }
  char* end = nullptr;
  const unsigned long long v = std::strtoull(digits.c_str(), &end, 10);
  DT_CHECK(!digits.empty() && end != nullptr && *end == '\0', "bench", "'{}' is not a byte count (e.g. 8, 64K, 256M)",
           text);
  return static_cast<size_t>(v) * mult;
}

std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= s.size()) {
    const size_t comma = s.find(',', start);
    const size_t end = comma == std::string::npos ? s.size() : comma;
    if (end > start) out.push_back(s.substr(start, end - start));
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return out;
}

struct Machine {
  int cores = 1;
  size_t stage_bytes = size_t{1} << 20;
  double copy_gbs = 0;
  double gamma = 0;
  PingPong pp;
  bool model = false;
};

// One sweep's fixed choices: the collective, how it runs, and where its rows go.
struct SweepCase {
  Op op;
  const std::string& op_name;
  Algorithm algo;
  std::optional<Codec> codec;
  DataType dtype;
  ReduceOp redop;
  bool inplace;
};

// What one size measured, the same on every rank: wrong elements (summed over ranks), the
// bytes one compressed call sent and would have sent as f32 (the most of any rank), and each
// timed iteration's time (that of its slowest rank).
struct Measurement {
  uint64_t wrong = 0;
  int64_t sent[2] = {0, 0};
  std::vector<double> times;
};

// Collective over `g`: the correctness check on fresh inputs (twice more with --check), the
// warm-up, then the timed iterations.
Measurement measure(const CollBenchOptions& o, Group& g, Case& c) {
  Measurement r;
  // Correctness first, on fresh inputs (the timed runs may overflow the in-place data).
  c.fill();
  g.barrier();
  c.run();
  r.wrong = c.wrong();
  // Bytes one call sent (compressed), the most of any rank.
  r.sent[0] = static_cast<int64_t>(c.stats.wire_bytes_sent);
  r.sent[1] = static_cast<int64_t>(c.stats.raw_bytes);
  if (c.codec) g.all_reduce(r.sent, r.sent, 2, DataType::i64, ReduceOp::max);
  if (o.check) {
    for (int k = 0; k < 2; ++k) {
      c.fill();
      c.run();
      r.wrong += c.wrong();
    }
  }
  for (int k = 0; k < o.warmup; ++k) c.run();
  r.times.assign(static_cast<size_t>(o.iters), 0.0);
  for (int k = 0; k < o.iters; ++k) {
    g.barrier();
    const double t0 = now_s();
    c.run();
    r.times[static_cast<size_t>(k)] = now_s() - t0;
  }
  // The time of an iteration is that of its slowest rank.
  g.all_reduce(r.times.data(), r.times.data(), r.times.size(), DataType::f64, ReduceOp::max);
  g.all_reduce(&r.wrong, &r.wrong, 1, DataType::i64, ReduceOp::sum);
  return r;
}

// Rank 0: the sweep's title line.
void print_sweep_title(const CollBenchOptions& o, const SweepCase& s) {
  const bool reducing = s.op == Op::allreduce || s.op == Op::reducescatter;
  const std::string how = s.codec ? fmt::format("codec {} (two-phase)", comm::name_of(*s.codec))
                                  : fmt::format("algo {}", comm::name_of(s.algo));
  std::printf("# %s %s%s%s, %s, %s\n", s.op_name.c_str(), comm::name_of(s.dtype), reducing ? " " : "",
              reducing ? comm::name_of(s.redop) : "",
              o.shared    ? "in place in shared memory"
              : s.inplace ? "in place"
                          : "out of place",
              how.c_str());
  std::fflush(stdout);
}

// Rank 0: a compressed collective's row: busbw on the f32 bytes is the effective bandwidth; on
// the bytes sent, the wire's.
void report_compressed(const SweepCase& s, const Case& c, const Measurement& r, double p50, double p99, double busbw,
                       nlohmann::json& rows) {
  const double data_bytes = static_cast<double>(c.count * c.es());
  const double algbw = data_bytes / p50 / 1e9;
  const double ratio = r.sent[0] > 0 ? static_cast<double>(r.sent[1]) / static_cast<double>(r.sent[0]) : 1.0;
  const double wirebw = busbw / ratio;
  std::printf("%12zu %11zu %5s %6s %7s %10.2f %10.2f %9.3f %9.3f %9.3f %12lld %6.2f %6llu\n",
              static_cast<size_t>(data_bytes), c.count, comm::name_of(s.dtype), comm::name_of(s.redop),
              comm::name_of(*s.codec), p50 * 1e6, p99 * 1e6, algbw, busbw, wirebw, static_cast<long long>(r.sent[0]),
              ratio, static_cast<unsigned long long>(r.wrong));
  std::fflush(stdout);
  rows.push_back({{"op", s.op_name},
                  {"bytes", static_cast<size_t>(data_bytes)},
                  {"count", c.count},
                  {"type", comm::name_of(s.dtype)},
                  {"redop", comm::name_of(s.redop)},
                  {"inplace", s.inplace},
                  {"algo", "two_phase"},
                  {"codec", comm::name_of(*s.codec)},
                  {"p50_us", p50 * 1e6},
                  {"p99_us", p99 * 1e6},
                  {"algbw_GBs", algbw},
                  {"busbw_GBs", busbw},
                  {"effbw_GBs", busbw},
                  {"wirebw_GBs", wirebw},
                  {"wire_bytes", r.sent[0]},
                  {"raw_bytes", r.sent[1]},
                  {"wrong", r.wrong}});
}

// Rank 0: one size's row of the table and of the JSON document.
void report(const CollBenchOptions& o, Group& g, const SweepCase& s, const Case& c, const Measurement& r,
            const Machine& m, nlohmann::json& rows) {
  const int p = g.size();
  const bool reducing = s.op == Op::allreduce || s.op == Op::reducescatter;
  const double p50 = percentile(r.times, 0.5), p99 = percentile(r.times, 0.99);
  const double data_bytes = static_cast<double>(c.count * c.es());
  const double algbw = data_bytes / p50 / 1e9;
  const double busbw = algbw * bus_factor(s.op, p);
  // What actually ran: the direct path where the group uses it for this collective.
  const bool direct_op = s.op != Op::sendrecv && s.op != Op::alltoall;
  Algorithm ran = s.algo;
  if (s.op == Op::allreduce) ran = g.all_reduce_algorithm(c.count * c.es());
  if (direct_op && g.all_reduce_algorithm(0) == Algorithm::direct) ran = Algorithm::direct;
  const char* ran_name = o.shared ? "shared" : comm::name_of(ran);
  double model = 0;
  if (m.model && s.op == Op::allreduce && p >= 2 && !o.shared) {
    model = model_all_reduce(ran, data_bytes, p, m.pp, m.gamma, 1e-9 / m.copy_gbs, m.stage_bytes, m.cores);
  }
  if (s.codec) {
    report_compressed(s, c, r, p50, p99, busbw, rows);
    return;
  }
  std::printf("%12zu %11zu %5s %6s %7s %10.2f %10.2f %9.3f %9.3f %7.3f %6llu", static_cast<size_t>(data_bytes), c.count,
              comm::name_of(s.dtype), reducing ? comm::name_of(s.redop) : "-", ran_name, p50 * 1e6, p99 * 1e6, algbw,
              busbw, busbw / m.copy_gbs, static_cast<unsigned long long>(r.wrong));
  if (model > 0) std::printf(" %10.2f %11.2f", model * 1e6, p50 / model);
  std::printf("\n");
  std::fflush(stdout);
  nlohmann::json row = {{"op", s.op_name},
                        {"bytes", static_cast<size_t>(data_bytes)},
                        {"count", c.count},
                        {"type", comm::name_of(s.dtype)},
                        {"redop", comm::name_of(s.redop)},
                        {"inplace", s.inplace},
                        {"algo", ran_name},
                        {"p50_us", p50 * 1e6},
                        {"p99_us", p99 * 1e6},
                        {"algbw_GBs", algbw},
                        {"busbw_GBs", busbw},
                        {"wrong", r.wrong}};
  if (model > 0) row["model_us"] = model * 1e6;
  rows.push_back(row);
}

// One sweep over `sizes` of one collective with one algorithm (or codec: the compressed
// collective), dtype, op and placement, on a group of its own. Returns the elements that were
// wrong (summed over ranks).
uint64_t sweep(const CollBenchOptions& o, Group& world, const SweepCase& s, const std::vector<size_t>& sizes,
               const Machine& m, nlohmann::json& rows) {
  comm::GroupOptions sub;
  sub.timeout = std::chrono::milliseconds(static_cast<int64_t>(o.timeout_s * 1000));
  sub.transport = comm::parse_transport(o.transport);
  sub.algorithm = s.algo;
  Group g = world.split(0, world.rank(), sub);
  if (g.rank() == 0) print_sweep_title(o, s);
  uint64_t total_wrong = 0;
  for (size_t elements : sizes) {
    Case c(s.op, g, s.dtype, s.redop, s.inplace, elements, o.shared);
    c.codec = s.codec;
    const Measurement r = measure(o, g, c);
    total_wrong += r.wrong;
    if (g.rank() == 0) report(o, g, s, c, r, m, rows);
  }
  return total_wrong;
}

// The sweeps a run asks for, parsed and checked: every list option is validated before any
// rank joins, so a typo fails fast on every rank.
struct Sweeps {
  size_t min_bytes = 0, max_bytes = 0;
  std::vector<std::string> op_names;
  std::vector<Op> ops;
  std::vector<DataType> dtypes;
  std::vector<ReduceOp> redops;
  std::vector<Algorithm> algos;
  std::vector<std::optional<Codec>> codecs = {std::nullopt};  // --compress: the compressed collectives
  std::vector<size_t> counts;                                 // --counts instead of the byte sweep
  std::vector<bool> placements;                               // all_reduce in place or not
};

// --compress: the compressed collectives (f32, sum or avg, all_reduce and reduce_scatter).
void parse_codecs(const CollBenchOptions& o, Sweeps& w) {
  if (o.compress.empty()) return;
  w.codecs.clear();
  for (const auto& s : split_list(o.compress)) w.codecs.emplace_back(comm::parse_codec(s));
  DT_CHECK(!w.codecs.empty(), "bench", "--compress needs at least one codec");
  for (Op op : w.ops) {
    DT_CHECK(op == Op::allreduce || op == Op::reducescatter, "bench",
             "--compress runs allreduce and reducescatter only, not --op {}", o.op);
  }
  for (DataType t : w.dtypes) {
    DT_CHECK(t == DataType::f32, "bench", "--compress encodes f32 buffers, not --dtype {}", comm::name_of(t));
  }
  for (ReduceOp r : w.redops) {
    DT_CHECK(r == ReduceOp::sum || r == ReduceOp::avg, "bench", "--compress reduces with sum or avg, not --redop {}",
             comm::name_of(r));
  }
  DT_CHECK(w.algos.size() == 1 && w.algos[0] == Algorithm::automatic, "bench",
           "--algo {} does not apply to --compress (the compressed collectives have one algorithm)", o.algo);
}

// --shared: all_reduce in place in shared memory, with its one algorithm.
void check_shared(const CollBenchOptions& o, const Sweeps& w) {
  if (!o.shared) return;
  for (Op op : w.ops) DT_CHECK(op == Op::allreduce, "bench", "--shared applies to --op allreduce only");
  DT_CHECK(o.compress.empty(), "bench", "--shared and --compress do not go together");
  DT_CHECK(!o.all_placements, "bench", "--shared runs in place; drop --all-placements");
  DT_CHECK(w.algos.size() == 1 && w.algos[0] == Algorithm::automatic, "bench",
           "--algo {} does not apply to --shared (all_reduce_shared has one algorithm)", o.algo);
}

Sweeps parse_sweeps(const CollBenchOptions& o) {
  Sweeps w;
  w.min_bytes = parse_bytes(o.min_bytes);
  w.max_bytes = parse_bytes(o.max_bytes);
  DT_CHECK(w.min_bytes >= 1 && w.min_bytes <= w.max_bytes, "bench", "--min-bytes {} must be in [1, --max-bytes {}]",
           w.min_bytes, w.max_bytes);
  DT_CHECK(o.iters >= 1 && o.warmup >= 0, "bench", "--iters must be >= 1 and --warmup >= 0");
  w.op_names = split_list(o.op);
  for (const auto& s : w.op_names) w.ops.push_back(parse_op_name(s));
  for (const auto& s : split_list(o.dtype)) w.dtypes.push_back(comm::parse_dtype(s));
  for (const auto& s : split_list(o.redop)) w.redops.push_back(comm::parse_op(s));
  for (const auto& a : split_list(o.algo)) w.algos.push_back(comm::parse_algorithm(a));
  DT_CHECK(!w.ops.empty() && !w.dtypes.empty() && !w.redops.empty() && !w.algos.empty(), "bench",
           "--op, --dtype, --redop and --algo need at least one value each");
  parse_codecs(o, w);
  for (const auto& c : split_list(o.counts)) w.counts.push_back(parse_bytes(c));
  check_shared(o, w);
  w.placements = {o.inplace || o.shared};
  if (o.all_placements) w.placements = {false, true};
  return w;
}

// Element counts of one sweep: --counts, or powers of two of bytes (nccl-tests' size is the
// whole vector).
std::vector<size_t> sizes_of(const Sweeps& w, Op op, DataType dtype, int p) {
  std::vector<size_t> sizes = w.counts;
  if (!sizes.empty()) return sizes;
  const bool blocks = op == Op::allgather || op == Op::reducescatter || op == Op::alltoall;
  const size_t es = comm::size_of(dtype);
  for (size_t bytes = w.min_bytes; bytes <= w.max_bytes; bytes *= 2) {
    const size_t elements = blocks ? bytes / es / static_cast<size_t>(p) : bytes / es;
    if (elements == 0 && bytes < w.max_bytes) continue;
    sizes.push_back(elements);
  }
  return sizes;
}

// Machine figures, measured on rank 0 while the others sleep in a barrier; with --model the
// ping-pong's alpha and beta. Collective.
Machine measure_machine(const CollBenchOptions& o, Group& world, DataType dtype) {
  Machine m;
  m.cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  if (const char* stage_env = std::getenv("DTRAIN_SHM_STAGE_BYTES")) m.stage_bytes = parse_bytes(stage_env);
  if (world.rank() == 0) {
    m.copy_gbs = memcpy_gbs();
    m.gamma = reduce_gamma(dtype);
  }
  world.barrier();
  m.model = o.model && world.size() >= 2;
  if (m.model) m.pp = ping_pong(world);
  world.broadcast(&m.copy_gbs, 1, DataType::f64, 0);
  return m;
}

// The JSON document's fields before the rows (--json).
nlohmann::json bench_document(const CollBenchOptions& o, Group& world, const Machine& m) {
  nlohmann::json doc;
  doc["tool"] = "dtrain";
  doc["op"] = o.op;
  doc["world"] = world.size();
  doc["transport"] = comm::name_of(world.transport_kind());
  doc["dtype"] = o.dtype;
  doc["redop"] = o.redop;
  if (!o.compress.empty()) doc["compress"] = o.compress;
  doc["iters"] = o.iters;
  doc["warmup"] = o.warmup;
  doc["inplace"] = o.inplace || o.shared;
  doc["shared"] = o.shared;
  doc["memcpy_GBs"] = m.copy_gbs;
  doc["cores"] = m.cores;
  doc["rows"] = nlohmann::json::array();
  if (world.rank() == 0 && m.model) {
    doc["alpha_us"] = m.pp.alpha * 1e6;
    doc["beta_ns_per_byte"] = m.pp.beta * 1e9;
    doc["gamma_ns_per_byte"] = m.gamma * 1e9;
  }
  return doc;
}

// Rank 0: the machine's figures and the table's header.
void print_header(const CollBenchOptions& o, Group& world, const Machine& m) {
  std::printf("# dtrain bench collectives: %d ranks, transport %s, %d iters (%d warm-up), time = slowest rank\n",
              world.size(), comm::name_of(world.transport_kind()), o.iters, o.warmup);
  std::printf("# memcpy (one core): %.2f GB/s; bus/cpy = busbw as a fraction of it\n", m.copy_gbs);
  if (m.model) {
    std::printf("# ping-pong rank 0 <-> 1 (%s): alpha %.2f us, beta %.4f ns/B (%.2f GB/s); reduce gamma %.4f ns/B\n",
                comm::name_of(world.transport_kind()), m.pp.alpha * 1e6, m.pp.beta * 1e9, 1e-9 / m.pp.beta,
                m.gamma * 1e9);
    for (auto [b, t] : m.pp.points) std::printf("#   %9zu B one-way %9.2f us\n", b, t * 1e6);
  }
  if (o.compress.empty()) {
    std::printf("#%11s %11s %5s %6s %7s %10s %10s %9s %9s %7s %6s%s\n", "size", "count", "type", "redop", "algo",
                "p50_us", "p99_us", "algbw", "busbw", "bus/cpy", "wrong", m.model ? "   model_us  meas/model" : "");
  } else {
    std::printf(
        "# effbw: busbw of the f32 bytes; wirebw: of the bytes sent; wire_B: bytes one call sent (the most "
        "of any rank); ratio: f32 / wire bytes; wrong: outside the derived bound\n");
    std::printf("#%11s %11s %5s %6s %7s %10s %10s %9s %9s %9s %12s %6s %6s\n", "size", "count", "type", "redop",
                "codec", "p50_us", "p99_us", "algbw", "effbw", "wirebw", "wire_B", "ratio", "wrong");
  }
  std::fflush(stdout);
}

// Every sweep: op x dtype x redop x placement x algorithm x codec. Returns the wrong elements.
uint64_t run_sweeps(const CollBenchOptions& o, const Sweeps& w, Group& world, const Machine& m, nlohmann::json& rows) {
  uint64_t total_wrong = 0;
  for (size_t oi = 0; oi < w.ops.size(); ++oi) {
    const Op op = w.ops[oi];
    const bool reducing = op == Op::allreduce || op == Op::reducescatter;
    for (DataType dtype : w.dtypes) {
      const std::vector<size_t> sizes = sizes_of(w, op, dtype, world.size());
      for (ReduceOp redop : reducing ? w.redops : std::vector<ReduceOp>{ReduceOp::sum}) {
        for (bool inplace : op == Op::allreduce ? w.placements : std::vector<bool>{false}) {
          for (Algorithm algo : w.algos) {
            for (const auto& codec : w.codecs) {
              const SweepCase s{op, w.op_names[oi], algo, codec, dtype, redop, inplace};
              total_wrong += sweep(o, world, s, sizes, m, rows);
            }
          }
        }
      }
    }
  }
  return total_wrong;
}

double seconds_of(const timeval& t) { return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_usec) * 1e-6; }

// One rank of the bench: the sweeps parsed, the world joined, the machine measured, every sweep
// run, then the CPU time of the sweeps, all ranks together: ranks that spin instead of sleeping
// while they wait show as CPU time near wall time x cores even when they have nothing to do.
int worker(const CollBenchOptions& o) {
  const Sweeps w = parse_sweeps(o);
  comm::GroupOptions gopts;
  gopts.timeout = std::chrono::milliseconds(static_cast<int64_t>(o.timeout_s * 1000));
  gopts.transport = comm::parse_transport(o.transport);
  Group world = gopts.transport == comm::TransportKind::mpi ? Group::from_mpi(gopts) : Group::from_env(gopts);
  const int rank = world.rank(), p = world.size();
  const Machine m = measure_machine(o, world, w.dtypes.front());
  nlohmann::json doc = bench_document(o, world, m);
  if (rank == 0) print_header(o, world, m);

  const double wall0 = now_s();
  rusage ru0{};
  ::getrusage(RUSAGE_SELF, &ru0);
  const uint64_t total_wrong = run_sweeps(o, w, world, m, doc["rows"]);
  rusage ru{};
  ::getrusage(RUSAGE_SELF, &ru);
  double cpu[2] = {seconds_of(ru.ru_utime) - seconds_of(ru0.ru_utime),
                   seconds_of(ru.ru_stime) - seconds_of(ru0.ru_stime)};
  world.all_reduce(cpu, cpu, 2, DataType::f64, ReduceOp::sum);
  const double wall = now_s() - wall0;
  doc["wall_s"] = wall;
  doc["cpu_user_s"] = cpu[0];
  doc["cpu_sys_s"] = cpu[1];
  if (rank == 0) {
    std::printf(
        "# wall %.2f s; CPU time of all %d ranks: user %.2f s + sys %.2f s = %.2f cores busy on average (%d cores)\n",
        wall, p, cpu[0], cpu[1], (cpu[0] + cpu[1]) / wall, m.cores);
    if (total_wrong != 0)
      std::printf("# WRONG RESULTS: %llu elements differ\n", static_cast<unsigned long long>(total_wrong));
    if (!o.json.empty()) {
      write_file_atomic(o.json, doc.dump(1) + "\n", "bench");
    }
  }
  world.barrier();
  return total_wrong == 0 ? 0 : 1;
}

}  // namespace

int run_bench_collectives(const CollBenchOptions& o, const std::vector<std::string>& argv) {
  // Started by a launcher, or one rank of an MPI job (mpirun -np N ... --transport mpi).
  if (std::getenv("RANK") != nullptr || o.transport == "mpi") return worker(o);
  DT_CHECK(o.nranks >= 1 && o.nranks <= 256, "bench", "-n {}: expected 1..256 ranks", o.nranks);
  // Not started by a launcher: launch -n copies of this very command.
  return launch_self(o.nranks, argv, false);
}

}  // namespace dtrain::tools
