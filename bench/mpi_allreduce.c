/* MPI_Allreduce sweep in the shape of `dtrain bench collectives --op allreduce --json FILE`.
 *
 *   mpicc -O2 -o bench/results/mpi_allreduce bench/mpi_allreduce.c
 *   mpirun --allow-run-as-root --oversubscribe --bind-to none -np 4 \
 *       --mca pml ob1 --mca btl self,vader bench/results/mpi_allreduce \
 *       --min-bytes 8 --max-bytes 256M --iters 20 --warmup 5 --check --json out.json
 *
 * Built and run by bench/collectives_compare.py (see bench/README.md for the settings).
 * For every size (powers of two from --min-bytes to --max-bytes, f32, sum):
 *   - every iteration (warm-up and timed) first refills the buffer with the rank's pattern
 *     (untimed), then MPI_Barrier, then times one in-place MPI_Allreduce with MPI_Wtime;
 *   - the time of an iteration is the maximum over ranks of that rank's time;
 *     p50/p99 are percentiles (linear interpolation, as numpy and dtrain) of those maxima over
 *     the --iters timed iterations;
 *   - algbw = bytes / p50, busbw = algbw * 2(n-1)/n (GB = 1e9 bytes);
 *   - --check compares every element of every iteration's result with the exact sum
 *     (rank r holds ((i + 3r) mod 17) - 8: small integers, so the f32 sum is exact whatever
 *     the order of additions); "wrong" is the largest number, over iterations, of wrong
 *     elements summed over ranks.
 * Rank 0 measures single-core memcpy bandwidth (bytes copied / time, 64 MiB buffers, median
 * of 7, as dtrain) while the other ranks sleep, and writes the JSON file.
 */
#define _GNU_SOURCE
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define PATTERN 17

static size_t parse_bytes(const char* s) {
  char* end = NULL;
  double v = strtod(s, &end);
  size_t mul = 1;
  if (end && *end) {
    switch (*end) {
      case 'k':
      case 'K':
        mul = (size_t)1 << 10;
        break;
      case 'm':
      case 'M':
        mul = (size_t)1 << 20;
        break;
      case 'g':
      case 'G':
        mul = (size_t)1 << 30;
        break;
      default:
        fprintf(stderr, "mpi_allreduce: bad size '%s'\n", s);
        exit(2);
    }
  }
  return (size_t)(v * (double)mul);
}

static int cmp_double(const void* a, const void* b) {
  double x = *(const double*)a, y = *(const double*)b;
  return (x > y) - (x < y);
}

/* Percentile of sorted v[0..n), q in [0, 1], linear interpolation between closest ranks
 * (numpy's default; the rule `dtrain bench collectives` uses). */
static double percentile(const double* v, int n, double q) {
  double pos = q * (double)(n - 1);
  int lo = (int)pos;
  int hi = lo + 1 < n ? lo + 1 : n - 1;
  return v[lo] + (v[hi] - v[lo]) * (pos - (double)lo);
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void fill(float* x, size_t count, int rank) {
  int j = (int)((3 * (size_t)rank) % PATTERN);
  for (size_t i = 0; i < count; ++i) {
    x[i] = (float)(j - 8);
    if (++j == PATTERN) j = 0;
  }
}

static long long count_wrong(const float* x, size_t count, const float* expect) {
  long long wrong = 0;
  int j = 0;
  for (size_t i = 0; i < count; ++i) {
    wrong += x[i] != expect[j];
    if (++j == PATTERN) j = 0;
  }
  return wrong;
}

/* Single-core memcpy bandwidth, GB/s of bytes copied (median of 7 copies of 64 MiB). */
static double memcpy_gbs(void) {
  const size_t n = (size_t)64 << 20;
  char *a = malloc(n), *b = malloc(n);
  if (!a || !b) return 0.0;
  memset(a, 1, n);
  memset(b, 2, n);
  double t[7];
  for (int r = 0; r < 7; ++r) {
    double t0 = now_s();
    memcpy(b, a, n);
    t[r] = now_s() - t0;
    a[r] = b[n - 1 - r]; /* keep the copies observable */
  }
  qsort(t, 7, sizeof t[0], cmp_double);
  free(a);
  free(b);
  return (double)n / t[3] / 1e9;
}

/* The value of an MCA variable as the library sees it (MPI_T), written into out as text. */
static void cvar_text(const char* name, char* out, size_t n) {
  snprintf(out, n, "?");
  int idx;
  if (MPI_T_cvar_get_index(name, &idx) != MPI_SUCCESS) return;
  char vname[256], desc[1024];
  int vlen = sizeof vname, dlen = sizeof desc, verb, bind, scope;
  MPI_Datatype dt;
  MPI_T_enum en;
  if (MPI_T_cvar_get_info(idx, vname, &vlen, &verb, &dt, &en, desc, &dlen, &bind, &scope) != MPI_SUCCESS) return;
  MPI_T_cvar_handle h;
  int cnt;
  if (MPI_T_cvar_handle_alloc(idx, NULL, &h, &cnt) != MPI_SUCCESS) return;
  char buf[1024] = {0};
  if (MPI_T_cvar_read(h, buf) == MPI_SUCCESS) {
    if (dt == MPI_CHAR) {
      snprintf(out, n, "%s", buf);
    } else if (dt == MPI_INT || dt == MPI_C_BOOL) {
      int v = dt == MPI_INT ? *(int*)buf : (int)*(_Bool*)buf;
      snprintf(out, n, "%d", v);
      int items;
      if (en != MPI_T_ENUM_NULL && MPI_T_enum_get_info(en, &items, vname, &vlen) == MPI_SUCCESS) {
        for (int i = 0; i < items; ++i) {
          int value, len = sizeof vname;
          if (MPI_T_enum_get_item(en, i, &value, vname, &len) == MPI_SUCCESS && value == v) {
            size_t k = strnlen(vname, sizeof vname - 1);
            if (k >= n) k = n - 1;
            memcpy(out, vname, k);
            out[k] = 0;
          }
        }
      }
    } else if (dt == MPI_UNSIGNED) {
      snprintf(out, n, "%u", *(unsigned*)buf);
    } else if (dt == MPI_UNSIGNED_LONG || dt == MPI_UNSIGNED_LONG_LONG) {
      snprintf(out, n, "%llu",
               dt == MPI_UNSIGNED_LONG ? (unsigned long long)*(unsigned long*)buf : *(unsigned long long*)buf);
    }
  }
  MPI_T_cvar_handle_free(&h);
}

int main(int argc, char** argv) {
  size_t min_bytes = 8, max_bytes = (size_t)256 << 20;
  int iters = 20, warmup = 5, check = 0;
  const char* json = NULL;
  for (int i = 1; i < argc; ++i) {
    const char* a = argv[i];
    const char* v = i + 1 < argc ? argv[i + 1] : NULL;
    if (!strcmp(a, "--check")) {
      check = 1;
      continue;
    }
    if (!v) {
      fprintf(stderr, "mpi_allreduce: %s needs a value\n", a);
      return 2;
    }
    if (!strcmp(a, "--min-bytes"))
      min_bytes = parse_bytes(v);
    else if (!strcmp(a, "--max-bytes"))
      max_bytes = parse_bytes(v);
    else if (!strcmp(a, "--iters"))
      iters = atoi(v);
    else if (!strcmp(a, "--warmup"))
      warmup = atoi(v);
    else if (!strcmp(a, "--json"))
      json = v;
    else {
      fprintf(stderr, "mpi_allreduce: unknown option %s\n", a);
      return 2;
    }
    ++i;
  }
  if (min_bytes < 4 || max_bytes < min_bytes || iters < 1 || warmup < 0) {
    fprintf(stderr, "mpi_allreduce: bad arguments\n");
    return 2;
  }

  MPI_Init(&argc, &argv);
  int rank, world;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);

  /* memcpy on rank 0 while the others sleep (not busy-poll) in a nonblocking barrier. */
  double memcpy_GBs = 0.0;
  {
    MPI_Request req;
    if (rank == 0) memcpy_GBs = memcpy_gbs();
    MPI_Ibarrier(MPI_COMM_WORLD, &req);
    int done = 0;
    while (!done) {
      MPI_Test(&req, &done, MPI_STATUS_IGNORE);
      if (!done && rank != 0) usleep(1000);
    }
  }

  /* The settings that matter for shared-memory speed, as Open MPI resolved them. */
  char yield[64], single_copy[64], oversub[64], pml[64], btl[64];
  {
    int provided;
    MPI_T_init_thread(MPI_THREAD_SINGLE, &provided);
    cvar_text("mpi_yield_when_idle", yield, sizeof yield);
    cvar_text("btl_vader_single_copy_mechanism", single_copy, sizeof single_copy);
    cvar_text("mpi_oversubscribe", oversub, sizeof oversub);
    cvar_text("pml", pml, sizeof pml);
    cvar_text("btl", btl, sizeof btl);
    MPI_T_finalize();
  }

  const char* forced = getenv("OMPI_MCA_coll_tuned_allreduce_algorithm");
  const char* dyn = getenv("OMPI_MCA_coll_tuned_use_dynamic_rules");
  char algo[64];
  if (forced && dyn && atoi(dyn) != 0)
    snprintf(algo, sizeof algo, "tuned:%s", forced);
  else
    snprintf(algo, sizeof algo, "default");

  size_t max_count = max_bytes / sizeof(float);
  float* buf = malloc(max_count * sizeof(float));
  double* t = malloc((size_t)iters * sizeof(double));
  double* tmax = malloc((size_t)iters * sizeof(double));
  if (!buf || !t || !tmax) {
    fprintf(stderr, "mpi_allreduce: out of memory\n");
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  float expect[PATTERN];
  for (int j = 0; j < PATTERN; ++j) {
    int s = 0;
    for (int r = 0; r < world; ++r) s += (int)((j + 3 * r) % PATTERN) - 8;
    expect[j] = (float)s;
  }

  FILE* out = NULL;
  if (rank == 0 && json) {
    out = fopen(json, "w");
    if (!out) {
      perror(json);
      MPI_Abort(MPI_COMM_WORLD, 1);
    }
    int major, minor, len;
    char lib[MPI_MAX_LIBRARY_VERSION_STRING];
    MPI_Get_version(&major, &minor);
    MPI_Get_library_version(lib, &len);
    char* nl = strchr(lib, ','); /* "Open MPI v4.1.4, package: ..." -> "Open MPI v4.1.4" */
    if (nl) *nl = 0;
    fprintf(out,
            "{\"tool\":\"openmpi\",\"op\":\"allreduce\",\"world\":%d,\"transport\":\"shm\","
            "\"dtype\":\"f32\",\"memcpy_GBs\":%.4f,\"library\":\"%s\",\"iters\":%d,\"warmup\":%d,"
            "\"settings\":{\"pml\":\"%s\",\"btl\":\"%s\",\"mpi_yield_when_idle\":\"%s\","
            "\"mpi_oversubscribe\":\"%s\",\"btl_vader_single_copy_mechanism\":\"%s\"},"
            "\"rows\":[",
            world, memcpy_GBs, lib, iters, warmup, pml, btl, yield, oversub, single_copy);
  }
  if (rank == 0) {
    printf(
        "# openmpi allreduce  world %d  f32 sum  in-place  iters %d warmup %d  memcpy %.2f GB/s\n"
        "# pml %s  btl %s  mpi_yield_when_idle %s  mpi_oversubscribe %s  vader single copy %s\n",
        world, iters, warmup, memcpy_GBs, pml, btl, yield, oversub, single_copy);
    printf("#%11s %12s %6s %6s %10s %10s %10s %10s %10s %8s\n", "size", "count", "type", "redop", "algo", "p50_us",
           "p99_us", "algbw_GBs", "busbw_GBs", "wrong");
    fflush(stdout);
  }

  int first = 1;
  for (size_t bytes = min_bytes; bytes <= max_bytes; bytes *= 2) {
    size_t count = bytes / sizeof(float);
    long long wrong_max = 0;
    for (int it = -warmup; it < iters; ++it) {
      fill(buf, count, rank);
      MPI_Barrier(MPI_COMM_WORLD);
      double t0 = MPI_Wtime();
      MPI_Allreduce(MPI_IN_PLACE, buf, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      double dt = MPI_Wtime() - t0;
      if (it >= 0) t[it] = dt;
      if (check) {
        long long w = count_wrong(buf, count, expect), wsum = 0;
        MPI_Reduce(&w, &wsum, 1, MPI_LONG_LONG, MPI_SUM, 0, MPI_COMM_WORLD);
        if (wsum > wrong_max) wrong_max = wsum;
      }
    }
    MPI_Reduce(t, tmax, iters, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
    if (rank == 0) {
      qsort(tmax, (size_t)iters, sizeof tmax[0], cmp_double);
      double p50 = percentile(tmax, iters, 0.50), p99 = percentile(tmax, iters, 0.99);
      double algbw = (double)bytes / p50 / 1e9;
      double busbw = algbw * 2.0 * (world - 1) / world;
      printf("%12zu %12zu %6s %6s %10s %10.2f %10.2f %10.3f %10.3f %8lld\n", bytes, count, "f32", "sum", algo,
             p50 * 1e6, p99 * 1e6, algbw, busbw, wrong_max);
      fflush(stdout);
      if (out)
        fprintf(out,
                "%s\n {\"bytes\":%zu,\"count\":%zu,\"type\":\"f32\",\"redop\":\"sum\",\"algo\":\"%s\","
                "\"p50_us\":%.3f,\"p99_us\":%.3f,\"algbw_GBs\":%.6f,\"busbw_GBs\":%.6f,\"wrong\":%lld}",
                first ? "" : ",", bytes, count, algo, p50 * 1e6, p99 * 1e6, algbw, busbw, wrong_max);
      first = 0;
    }
    if (bytes > max_bytes / 2) break; /* no overflow past max */
  }
  if (out) {
    fprintf(out, "\n]}\n");
    fclose(out);
  }
  free(buf);
  free(t);
  free(tmax);
  MPI_Finalize();
  return 0;
}
