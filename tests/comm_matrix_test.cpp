// Every collective x dtype x reduce op x in/out of place x counts (0, 1, primes, sizes that do
// not divide by the world, sizes past the shm staging slot) on world sizes 1-8, for each
// algorithm a user can select (direct = the shm transport's native collectives, ring, hd, rd).
// Ranks are threads over one in-memory store; the same sweep as real processes runs through
// `dtrain bench collectives --check` (tests/CMakeLists: comm_processes_*).
//
// Inputs are small integers, so every reduction is exact in every dtype (bf16 holds integers
// up to 256, sums here stay below that): results are compared with ==. The float bound for
// arbitrary inputs is tested separately (FloatSumWithinBound).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "comm_test_util.h"
#include "dtrain/comm/group.h"
#include "dtrain/tensor/half.h"

namespace dtrain::comm {
namespace {

using test_util::run_ranks;

constexpr DataType kTypes[] = {DataType::f32, DataType::bf16, DataType::f16, DataType::f64,
                               DataType::i32, DataType::i64,  DataType::u8};
constexpr ReduceOp kOps[] = {ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::min, ReduceOp::prod};

void put(std::vector<char>& buf, size_t i, DataType t, double v) {
  switch (t) {
    case DataType::f32:
      reinterpret_cast<float*>(buf.data())[i] = static_cast<float>(v);
      break;
    case DataType::f64:
      reinterpret_cast<double*>(buf.data())[i] = v;
      break;
    case DataType::bf16:
      reinterpret_cast<uint16_t*>(buf.data())[i] = f32_to_bf16(static_cast<float>(v));
      break;
    case DataType::f16:
      reinterpret_cast<uint16_t*>(buf.data())[i] = f32_to_f16(static_cast<float>(v));
      break;
    case DataType::i32:
      reinterpret_cast<int32_t*>(buf.data())[i] = static_cast<int32_t>(v);
      break;
    case DataType::i64:
      reinterpret_cast<int64_t*>(buf.data())[i] = static_cast<int64_t>(v);
      break;
    case DataType::u8:
      reinterpret_cast<uint8_t*>(buf.data())[i] = static_cast<uint8_t>(v);
      break;
  }
}

double get(const std::vector<char>& buf, size_t i, DataType t) {
  switch (t) {
    case DataType::f32:
      return reinterpret_cast<const float*>(buf.data())[i];
    case DataType::f64:
      return reinterpret_cast<const double*>(buf.data())[i];
    case DataType::bf16:
      return bf16_to_f32(reinterpret_cast<const uint16_t*>(buf.data())[i]);
    case DataType::f16:
      return f16_to_f32(reinterpret_cast<const uint16_t*>(buf.data())[i]);
    case DataType::i32:
      return reinterpret_cast<const int32_t*>(buf.data())[i];
    case DataType::i64:
      return static_cast<double>(reinterpret_cast<const int64_t*>(buf.data())[i]);
    case DataType::u8:
      return reinterpret_cast<const uint8_t*>(buf.data())[i];
  }
  return 0;
}

// Rank r's input element i for `op`, and the exact reduction over p ranks.
double input(ReduceOp op, int r, int p, size_t i) {
  switch (op) {
    case ReduceOp::sum:
      return static_cast<double>((r + 1) * static_cast<int>(i % 5 + 1));
    case ReduceOp::avg:
      return r == 0 ? static_cast<double>(p * static_cast<int>(i % 5 + 1)) : 0.0;
    case ReduceOp::prod:
      return (i + static_cast<size_t>(r)) % 3 == 0 ? 2.0 : 1.0;
    default:
      return static_cast<double>((i * 7 + static_cast<size_t>(r) * 3) % 11);
  }
}

double expected(ReduceOp op, int p, size_t i) {
  double acc = input(op, 0, p, i);
  for (int r = 1; r < p; ++r) {
    const double v = input(op, r, p, i);
    if (op == ReduceOp::sum || op == ReduceOp::avg) acc += v;
    if (op == ReduceOp::prod) acc *= v;
    if (op == ReduceOp::max) acc = std::max(acc, v);
    if (op == ReduceOp::min) acc = std::min(acc, v);
  }
  return op == ReduceOp::avg ? acc / p : acc;
}

// Identifies (rank, index); exact in every dtype.
double ident(int r, size_t i) { return static_cast<double>((static_cast<size_t>(r) * 37 + i) % 101); }

std::vector<char> buffer(size_t count, DataType t) {
  return std::vector<char>(std::max<size_t>(1, count * size_of(t)), 0);
}

// Counts: empty, one element, primes, a size that does not divide by 3/5/7, a vector past the
// direct path's small-message threshold, and one spanning several staging slots (f32: 1 MiB).
std::vector<size_t> counts_for(DataType t) {
  std::vector<size_t> c = {0, 1, 2, 7, 131, 4099};
  if (t == DataType::f32 || t == DataType::bf16) {
    c.push_back(70001);
    c.push_back(600011);
  }
  return c;
}

struct Param {
  int world;
  std::string algo;
};

std::string param_name(const ::testing::TestParamInfo<Param>& info) {
  return fmt::format("world{}_{}", info.param.world, info.param.algo);
}

class CollectiveMatrix : public ::testing::TestWithParam<Param> {
 protected:
  GroupOptions options() const {
    GroupOptions o;
    o.algorithm = parse_algorithm(GetParam().algo);
    o.timeout = std::chrono::seconds(60);
    return o;
  }
};

#define EXPECT_ELEMENT(got, want, what)                                                \
  if ((got) != (want)) {                                                               \
    FAIL() << what << ": element " << i << " is " << (got) << ", expected " << (want); \
  }

// all_reduce of every dtype x op x count, in and out of place, checked exactly on this rank.
void all_reduce_every_dtype_and_op(Group& g, const char* what) {
  const int r = g.rank(), p = g.size();
  for (DataType t : kTypes) {
    for (ReduceOp op : kOps) {
      for (size_t n : counts_for(t)) {
        if (n > 4099 && op != ReduceOp::sum && op != ReduceOp::max) continue;
        for (bool in_place : {false, true}) {
          auto send = buffer(n, t), recv = buffer(n, t);
          for (size_t i = 0; i < n; ++i) put(send, i, t, input(op, r, p, i));
          g.all_reduce(send.data(), in_place ? send.data() : recv.data(), n, t, op);
          const auto& out = in_place ? send : recv;
          for (size_t i = 0; i < n; ++i) {
            EXPECT_ELEMENT(get(out, i, t), expected(op, p, i),
                           fmt::format("{} {} {} n={} {} rank {}", what, name_of(t), name_of(op), n,
                                       in_place ? "in place" : "out of place", r));
          }
        }
      }
    }
  }
}

TEST_P(CollectiveMatrix, AllReduceEveryDtypeOpAndPlacement) {
  run_ranks(
      GetParam().world, [&](Group& g) { all_reduce_every_dtype_and_op(g, "all_reduce"); }, options());
}

TEST_P(CollectiveMatrix, ReduceScatterAndAllGather) {
  const int p = GetParam().world;
  run_ranks(
      p,
      [&](Group& g) {
        const int r = g.rank();
        for (DataType t : kTypes) {
          for (size_t n : counts_for(t)) {  // n = elements per rank
            if (n > 70001) continue;
            for (ReduceOp op : kOps) {
              if (n > 4099 && op != ReduceOp::sum) continue;
              auto send = buffer(n * static_cast<size_t>(p), t), recv = buffer(n, t);
              for (size_t i = 0; i < n * static_cast<size_t>(p); ++i) put(send, i, t, input(op, r, p, i));
              g.reduce_scatter(send.data(), recv.data(), n, t, op);
              for (size_t i = 0; i < n; ++i) {
                EXPECT_ELEMENT(get(recv, i, t), expected(op, p, static_cast<size_t>(r) * n + i),
                               fmt::format("reduce_scatter {} {} n={} rank {}", name_of(t), name_of(op), n, r));
              }
            }
            // all_gather out of place and in place (this rank's block already in the output).
            for (bool in_place : {false, true}) {
              auto mine = buffer(n, t), all = buffer(n * static_cast<size_t>(p), t);
              for (size_t i = 0; i < n; ++i) put(mine, i, t, ident(r, i));
              const void* src = mine.data();
              if (in_place) {
                for (size_t i = 0; i < n; ++i) put(all, static_cast<size_t>(r) * n + i, t, ident(r, i));
                src = all.data() + static_cast<size_t>(r) * n * size_of(t);
              }
              g.all_gather(src, all.data(), n, t);
              for (size_t i = 0; i < n * static_cast<size_t>(p); ++i) {
                EXPECT_ELEMENT(
                    get(all, i, t), ident(static_cast<int>(i / n), i % n),
                    fmt::format("all_gather {} n={} {} rank {}", name_of(t), n, in_place ? "in place" : "", r));
              }
            }
          }
        }
      },
      options());
}

TEST_P(CollectiveMatrix, UnevenCountsBroadcastReduceGatherScatterAllToAll) {
  const int p = GetParam().world;
  const auto P = static_cast<size_t>(p);
  run_ranks(
      p,
      [&](Group& g) {
        const int r = g.rank();
        for (DataType t : {DataType::f32, DataType::bf16, DataType::i64, DataType::u8}) {
          for (size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{4099}, size_t{300007}}) {
            // broadcast from every root
            for (int root = 0; root < p; ++root) {
              auto b = buffer(n, t);
              for (size_t i = 0; i < n; ++i) put(b, i, t, r == root ? ident(root, i) : 0.0);
              g.broadcast(b.data(), n, t, root);
              for (size_t i = 0; i < n; ++i) {
                EXPECT_ELEMENT(get(b, i, t), ident(root, i),
                               fmt::format("broadcast {} n={} root {}", name_of(t), n, root));
              }
            }
            if (n > 4099) continue;
            // reduce to the last rank (sum)
            auto send = buffer(n, t), recv = buffer(n, t);
            for (size_t i = 0; i < n; ++i) put(send, i, t, input(ReduceOp::sum, r, p, i));
            g.reduce(send.data(), recv.data(), n, t, ReduceOp::sum, p - 1);
            if (r == p - 1) {
              for (size_t i = 0; i < n; ++i) {
                EXPECT_ELEMENT(get(recv, i, t), expected(ReduceOp::sum, p, i),
                               fmt::format("reduce {} n={}", name_of(t), n));
              }
            }
            // gather / scatter through root 0
            auto mine = buffer(n, t), all = buffer(n * P, t);
            for (size_t i = 0; i < n; ++i) put(mine, i, t, ident(r, i));
            g.gather(mine.data(), all.data(), n, t, 0);
            if (r == 0) {
              for (size_t i = 0; i < n * P; ++i) {
                EXPECT_ELEMENT(get(all, i, t), ident(static_cast<int>(i / n), i % n),
                               fmt::format("gather {} n={}", name_of(t), n));
              }
            }
            auto piece = buffer(n, t);
            g.scatter(all.data(), piece.data(), n, t, 0);
            for (size_t i = 0; i < n; ++i) {
              EXPECT_ELEMENT(get(piece, i, t), ident(r, i), fmt::format("scatter {} n={}", name_of(t), n));
            }
            // all_to_all: block j of rank q is (q, j)
            auto a2a_in = buffer(n * P, t), a2a_out = buffer(n * P, t);
            for (size_t i = 0; i < n * P; ++i) put(a2a_in, i, t, ident(r, i));
            g.all_to_all(a2a_in.data(), a2a_out.data(), n, t);
            for (size_t i = 0; i < n * P; ++i) {
              EXPECT_ELEMENT(get(a2a_out, i, t), ident(static_cast<int>(i / n), static_cast<size_t>(r) * n + i % n),
                             fmt::format("all_to_all {} n={}", name_of(t), n));
            }
            // v-forms: rank q owns q + n elements
            std::vector<size_t> counts(P);
            size_t total = 0, before = 0;
            for (size_t q = 0; q < P; ++q) {
              counts[q] = q + n;
              if (q < static_cast<size_t>(r)) before += counts[q];
              total += counts[q];
            }
            auto vin = buffer(total, t), vout = buffer(counts[static_cast<size_t>(r)], t);
            for (size_t i = 0; i < total; ++i) put(vin, i, t, input(ReduceOp::sum, r, p, i));
            g.reduce_scatter_v(vin.data(), vout.data(), counts, t, ReduceOp::sum);
            for (size_t i = 0; i < counts[static_cast<size_t>(r)]; ++i) {
              EXPECT_ELEMENT(get(vout, i, t), expected(ReduceOp::sum, p, before + i),
                             fmt::format("reduce_scatter_v {} n={}", name_of(t), n));
            }
            auto gin = buffer(counts[static_cast<size_t>(r)], t), gout = buffer(total, t);
            for (size_t i = 0; i < counts[static_cast<size_t>(r)]; ++i) put(gin, i, t, ident(r, i));
            g.all_gather_v(gin.data(), gout.data(), counts, t);
            size_t at = 0;
            for (size_t q = 0; q < P; ++q) {
              for (size_t i = 0; i < counts[q]; ++i, ++at) {
                EXPECT_ELEMENT(get(gout, at, t), ident(static_cast<int>(q), i),
                               fmt::format("all_gather_v {} n={}", name_of(t), n));
              }
            }
            g.barrier();
          }
        }
      },
      options());
}

// Arbitrary floats: the f32 sum is within (p - 1) * eps * sum|x| of the exact (double) sum,
// and every rank holds the same bits.
TEST_P(CollectiveMatrix, FloatSumWithinBoundAndIdenticalOnEveryRank) {
  const int p = GetParam().world;
  const size_t n = 100003;
  std::vector<std::vector<float>> results(static_cast<size_t>(p));
  run_ranks(
      p,
      [&](Group& g) {
        std::mt19937 gen(static_cast<unsigned>(g.rank()) + 11);
        std::normal_distribution<float> dist(0.0f, 1.0f);
        std::vector<float> x(n);
        for (auto& v : x) v = dist(gen);
        std::vector<float> out(n);
        g.all_reduce(x.data(), out.data(), n, DataType::f32, ReduceOp::sum);
        results[static_cast<size_t>(g.rank())] = out;
      },
      options());
  std::vector<double> exact(n, 0.0), mag(n, 0.0);
  for (int r = 0; r < p; ++r) {
    std::mt19937 gen(static_cast<unsigned>(r) + 11);
    std::normal_distribution<float> dist(0.0f, 1.0f);
    for (size_t i = 0; i < n; ++i) {
      const float v = dist(gen);
      exact[i] += v;
      mag[i] += std::fabs(v);
    }
  }
  const double eps = std::ldexp(1.0, -23);
  for (size_t i = 0; i < n; ++i) {
    ASSERT_LE(std::fabs(results[0][i] - exact[i]), std::max(1, p - 1) * eps * mag[i] + 1e-30) << "element " << i;
  }
  for (int r = 1; r < p; ++r) {
    ASSERT_EQ(0, std::memcmp(results[0].data(), results[static_cast<size_t>(r)].data(), n * sizeof(float)))
        << "rank " << r << " differs from rank 0";
  }
}

// Hierarchical all_reduce: ranks as threads on simulated hosts (GroupOptions::host_id), shm
// within a host and tcp over loopback between hosts. Rank r is on host r % hosts, so the
// hosts' ranks interleave. Every dtype and op, in and out of place, counts that do not divide
// by the ranks per host; a shape without equal hosts of 2 or more ranks runs flat, and must
// be just as right.
struct HierParam {
  int hosts;
  int per_host;  // 0: uneven, host 0 has one rank more
};

class HierarchicalAllReduce : public ::testing::TestWithParam<HierParam> {};

TEST_P(HierarchicalAllReduce, EveryDtypeAndOpIsExactOnEveryRank) {
  const auto [hosts, per_host] = GetParam();
  const int p = per_host > 0 ? hosts * per_host : 2 * hosts + 1;
  const bool shaped = per_host >= 2 && hosts >= 2;
  run_ranks(
      p,
      [&](Group& g) {
        const int r = g.rank();
        EXPECT_EQ(g.transport_kind(), TransportKind::tcp);
        EXPECT_EQ(g.all_reduce_algorithm(size_t{1} << 20), shaped ? Algorithm::hierarchical : Algorithm::ring);
        EXPECT_EQ(g.all_reduce_algorithm(4096), shaped ? Algorithm::hierarchical : Algorithm::recursive_doubling);
        all_reduce_every_dtype_and_op(g, "hier all_reduce");
        // Vectors large enough to go in pipelined segments (12 MB: 5), in and out of place.
        for (bool in_place : {false, true}) {
          const size_t n = 3000017;
          std::vector<float> a(n), b(n);
          for (size_t i = 0; i < n; ++i) a[i] = static_cast<float>((r + 1) * static_cast<int>(i % 97));
          g.all_reduce(a.data(), in_place ? a.data() : b.data(), n, DataType::f32, ReduceOp::sum);
          const auto& got = in_place ? a : b;
          for (size_t i = 0; i < n; ++i) {
            ASSERT_EQ(got[i], static_cast<float>(p * (p + 1) / 2 * static_cast<int>(i % 97))) << "element " << i;
          }
        }
        // The asynchronous form, and the float sum identical on every rank.
        std::vector<float> x(100003), y(x.size());
        std::mt19937 rng(static_cast<unsigned>(r));
        std::uniform_real_distribution<float> u(-1.0f, 1.0f);
        for (float& v : x) v = u(rng);
        g.all_reduce_async(x.data(), y.data(), x.size(), DataType::f32, ReduceOp::sum).wait();
        std::vector<float> all(y.size() * static_cast<size_t>(p));
        g.all_gather(y.data(), all.data(), y.size(), DataType::f32);
        for (int q = 1; q < p; ++q) {
          ASSERT_EQ(0,
                    std::memcmp(all.data(), all.data() + y.size() * static_cast<size_t>(q), y.size() * sizeof(float)))
              << "rank " << q << " holds another float sum than rank 0";
        }
      },
      [&](int r) {
        GroupOptions o;
        o.timeout = std::chrono::seconds(60);
        o.secret = "8202ba45e1491e68cf0b9d2ef0bb76666a56e78505349969800e015b93ea291d";
        o.host_id = fmt::format("host{}", r % hosts);
        o.algorithm = Algorithm::hierarchical;  // at every size (auto takes it from 64 KiB)
        return o;
      });
}

// auto: the flat recursive doubling for small vectors, the hierarchy from 64 KiB; a
// sub-group on one host goes back to shared memory.
TEST(HierarchicalAllReduceChoice, AutoTakesItFrom64KiBAndOneHostSplitsUseShm) {
  run_ranks(
      4,
      [](Group& g) {
        EXPECT_EQ(g.all_reduce_algorithm(8 << 10), Algorithm::recursive_doubling);
        EXPECT_EQ(g.all_reduce_algorithm((64 << 10) - 4), Algorithm::halving_doubling);
        EXPECT_EQ(g.all_reduce_algorithm(64 << 10), Algorithm::hierarchical);
        Group host = g.split(g.rank() % 2, g.rank());
        EXPECT_EQ(host.transport_kind(), TransportKind::shm);
        EXPECT_EQ(host.all_reduce_algorithm(64 << 10), Algorithm::direct);
      },
      [](int r) {
        GroupOptions o;
        o.timeout = std::chrono::seconds(60);
        o.secret = "8202ba45e1491e68cf0b9d2ef0bb76666a56e78505349969800e015b93ea291d";
        o.host_id = fmt::format("host{}", r % 2);
        return o;
      });
}

INSTANTIATE_TEST_SUITE_P(Hosts, HierarchicalAllReduce,
                         ::testing::Values(HierParam{2, 2}, HierParam{3, 2}, HierParam{2, 3}, HierParam{4, 2},
                                           HierParam{2, 0}),
                         [](const ::testing::TestParamInfo<HierParam>& info) {
                           return info.param.per_host > 0
                                      ? fmt::format("hosts{}x{}", info.param.hosts, info.param.per_host)
                                      : fmt::format("hosts{}_uneven", info.param.hosts);
                         });

std::vector<Param> params() {
  std::vector<Param> out;
  for (int w = 1; w <= 8; ++w) {
    for (const char* a : {"direct", "ring", "hd", "rd"}) out.push_back({w, a});
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Worlds, CollectiveMatrix, ::testing::ValuesIn(params()), param_name);

}  // namespace
}  // namespace dtrain::comm
