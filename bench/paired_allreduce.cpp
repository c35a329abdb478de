// dtrain's all_reduce and Open MPI's MPI_Allreduce timed in the same processes, iteration by
// iteration in alternation, so that both meet the same machine at the same moments.
//
//   mpirun --bind-to core -np 2 --mca pml ob1 --mca btl self,vader -x DTRAIN_JOB_CPUS=2
//       build/release/paired_allreduce --store DIR --min-bytes 8 --max-bytes 8K --iters 2000 --warmup 100
//
// Run by bench/latency_paired.py (see bench/README.md). Why: on a virtual machine the host moves
// the vCPUs between cores that share a cache and cores far apart, from one second to the next,
// and a message between far cores takes 4-5x longer. Separate runs of the two libraries, even
// back to back, meet different placements, and a median over a few runs falls whichever way most
// of them fell. Here both are measured within microseconds of each other, over the same seconds.
//
// For every size (powers of two, f32 sum, in place): warm-up, then --iters rounds; in round k
// each library (Open MPI first in even rounds, dtrain first in odd ones) refills its own buffer
// with the rank's pattern (untimed), runs its own barrier, and times one all_reduce, the same
// steps as bench/mpi_allreduce.c and `dtrain bench collectives`. The time of an iteration is the
// maximum over ranks; p50/p99 by linear interpolation. Every timed result is checked against
// the exact sum (small integers; above 1 MiB only each size's first timed result). One JSON
// line per size on rank 0's stdout, with the wrong elements summed over ranks and rounds:
//   {"bytes":B,"dtrain_p50_us":..,"dtrain_p99_us":..,"openmpi_p50_us":..,"openmpi_p99_us":..,
//    "dtrain_wrong":W,"openmpi_wrong":W}
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "dtrain/comm/group.h"

namespace {

using dtrain::comm::DataType;
using dtrain::comm::Group;
using dtrain::comm::ReduceOp;

// A power of two of at least 4 bytes, optionally with K or M.
size_t parse_bytes(const std::string& s) {
  size_t used = 0;
  const unsigned long long v = std::stoull(s, &used);
  size_t mul = 1;
  if (used < s.size()) {
    const char unit = s[used];
    if (used + 1 != s.size() || (unit != 'k' && unit != 'K' && unit != 'm' && unit != 'M')) {
      throw std::invalid_argument("bad size '" + s + "' (bytes, or a number with K or M)");
    }
    mul = unit == 'k' || unit == 'K' ? size_t{1} << 10 : size_t{1} << 20;
  }
  const size_t bytes = static_cast<size_t>(v) * mul;
  if (bytes < 4 || (bytes & (bytes - 1)) != 0) {
    throw std::invalid_argument("size '" + s + "' is not a power of two of at least 4 bytes");
  }
  return bytes;
}

double percentile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  const double pos = q * static_cast<double>(v.size() - 1);
  const auto lo = static_cast<size_t>(pos);
  const size_t hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (v[hi] - v[lo]) * (pos - static_cast<double>(lo));
}

double seconds_now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct Options {
  std::string store;
  size_t min_bytes = 8, max_bytes = 8192;
  int iters = 2000, warmup = 100;
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (i + 1 >= argc) throw std::invalid_argument("option " + a + " needs a value");
    const std::string v = argv[++i];
    if (a == "--store")
      o.store = v;
    else if (a == "--min-bytes")
      o.min_bytes = parse_bytes(v);
    else if (a == "--max-bytes")
      o.max_bytes = parse_bytes(v);
    else if (a == "--iters")
      o.iters = std::stoi(v);
    else if (a == "--warmup")
      o.warmup = std::stoi(v);
    else
      throw std::invalid_argument("unknown option " + a);
  }
  if (o.store.empty()) throw std::invalid_argument("--store DIR is required (a directory both ranks can write)");
  if (o.iters < 1 || o.warmup < 0 || o.max_bytes < o.min_bytes)
    throw std::invalid_argument("bad --iters/--warmup/sizes");
  return o;
}

// Rank r holds ((i + 3r) mod 17) - 8: the f32 sum is exact in any order.
void fill(std::vector<float>& x, int rank) {
  for (size_t i = 0; i < x.size(); ++i)
    x[i] = static_cast<float>(static_cast<int>((i + 3 * static_cast<size_t>(rank)) % 17) - 8);
}

uint64_t wrong(const std::vector<float>& x, int size) {
  uint64_t bad = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    int want = 0;
    for (int r = 0; r < size; ++r) want += static_cast<int>((i + 3 * static_cast<size_t>(r)) % 17) - 8;
    bad += x[i] != static_cast<float>(want);
  }
  return bad;
}

int run(int argc, char** argv) {
  const Options o = parse(argc, argv);
  int rank = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  dtrain::comm::GroupOptions go;
  go.transport = dtrain::comm::TransportKind::shm;
  go.timeout = std::chrono::seconds(120);
  Group g = Group::create(dtrain::comm::make_file_store(o.store), rank, size, go, "paired");
  for (size_t bytes = o.min_bytes; bytes <= o.max_bytes; bytes *= 2) {
    const size_t count = bytes / sizeof(float);
    std::vector<float> mpi_buf(count), dt_buf(count);
    std::vector<double> t_mpi(static_cast<size_t>(o.iters)), t_dt(static_cast<size_t>(o.iters));
    unsigned long long bad[2] = {0, 0};  // dtrain, Open MPI
    auto mpi_once = [&](double* t) {
      fill(mpi_buf, rank);
      MPI_Barrier(MPI_COMM_WORLD);
      const double t0 = seconds_now();
      MPI_Allreduce(MPI_IN_PLACE, mpi_buf.data(), static_cast<int>(count), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      if (t != nullptr) *t = seconds_now() - t0;
    };
    auto dt_once = [&](double* t) {
      fill(dt_buf, rank);
      g.barrier();
      const double t0 = seconds_now();
      g.all_reduce(dt_buf.data(), dt_buf.data(), count, DataType::f32, ReduceOp::sum);
      if (t != nullptr) *t = seconds_now() - t0;
    };
    for (int k = 0; k < o.warmup; ++k) {
      mpi_once(nullptr);
      dt_once(nullptr);
    }
    for (int k = 0; k < o.iters; ++k) {
      double* tm = &t_mpi[static_cast<size_t>(k)];
      double* td = &t_dt[static_cast<size_t>(k)];
      if (k % 2 == 0) {
        mpi_once(tm);
        dt_once(td);
      } else {
        dt_once(td);
        mpi_once(tm);
      }
      // Every result while that is cheap; from 1 MiB the first one (checking takes longer than the call).
      if (count <= (size_t{1} << 18) || k == 0) {
        bad[0] += wrong(dt_buf, size);
        bad[1] += wrong(mpi_buf, size);
      }
    }
    // An iteration takes as long as its slowest rank.
    MPI_Allreduce(MPI_IN_PLACE, t_mpi.data(), o.iters, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    MPI_Allreduce(MPI_IN_PLACE, t_dt.data(), o.iters, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    MPI_Allreduce(MPI_IN_PLACE, bad, 2, MPI_UNSIGNED_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);
    if (rank == 0) {
      std::printf(
          "{\"bytes\":%zu,\"dtrain_p50_us\":%.4f,\"dtrain_p99_us\":%.4f,\"openmpi_p50_us\":%.4f,"
          "\"openmpi_p99_us\":%.4f,\"dtrain_wrong\":%llu,\"openmpi_wrong\":%llu}\n",
          bytes, percentile(t_dt, 0.5) * 1e6, percentile(t_dt, 0.99) * 1e6, percentile(t_mpi, 0.5) * 1e6,
          percentile(t_mpi, 0.99) * 1e6, bad[0], bad[1]);
      std::fflush(stdout);
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rc = 0;
  try {
    rc = run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "paired_allreduce: %s\n", e.what());
    rc = 2;
  }
  if (rc != 0) MPI_Abort(MPI_COMM_WORLD, rc);
  MPI_Finalize();
  return rc;
}
