/* Core-to-core cache-line round trip, for collectives_compare.py.
 *
 *   core_latency [--cpus A,B] [--trips N]
 *
 * Two threads, pinned to CPUs A and B (default: the first two CPUs this process may use), pass
 * one cache line back and forth N times (default 20000) in 5 batches; prints the median batch's
 * nanoseconds per round trip as JSON: {"cpus":[A,B],"round_trip_ns":X}. With fewer than two
 * CPUs it prints {"round_trip_ns":null}.
 *
 * Why: on a virtual machine the host may run the two vCPUs on cores that share a cache, or on
 * cores far apart (another core complex or socket). Every message between the ranks then
 * crosses that distance; on the 2-core machine the benchmarks run on, the round trip moves
 * between about 100 and 450-550 ns from minute to minute, and shared-memory collectives slow
 * down 2-3x with it. Measured before and after each tool's sweep, it tells which runs met which.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static _Atomic long flag __attribute__((aligned(64)));
static long trips = 20000;

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static int pin(int cpu) {
  cpu_set_t s;
  CPU_ZERO(&s);
  CPU_SET(cpu, &s);
  return pthread_setaffinity_np(pthread_self(), sizeof s, &s);
}

static void* pong(void* arg) {
  if (pin(*(int*)arg) != 0) return NULL;
  const long total = 5 * trips;
  for (long i = 0; i < total; ++i) {
    while (atomic_load_explicit(&flag, memory_order_acquire) != 2 * i + 1) {
    }
    atomic_store_explicit(&flag, 2 * i + 2, memory_order_release);
  }
  return NULL;
}

static int cmp(const void* a, const void* b) {
  const double x = *(const double*)a, y = *(const double*)b;
  return (x > y) - (x < y);
}

int main(int argc, char** argv) {
  int cpus[2] = {-1, -1};
  for (int i = 1; i < argc; ++i) {
    if (strcmp(argv[i], "--cpus") == 0 && i + 1 < argc) {
      if (sscanf(argv[++i], "%d,%d", &cpus[0], &cpus[1]) != 2) {
        fprintf(stderr, "core_latency: --cpus expects A,B\n");
        return 2;
      }
    } else if (strcmp(argv[i], "--trips") == 0 && i + 1 < argc) {
      trips = atol(argv[++i]);
      if (trips < 1) {
        fprintf(stderr, "core_latency: --trips must be positive\n");
        return 2;
      }
    } else {
      fprintf(stderr, "usage: core_latency [--cpus A,B] [--trips N]\n");
      return 2;
    }
  }
  if (cpus[0] < 0) {
    cpu_set_t mine;
    CPU_ZERO(&mine);
    if (sched_getaffinity(0, sizeof mine, &mine) != 0) CPU_ZERO(&mine);
    int k = 0;
    for (int c = 0; c < CPU_SETSIZE && k < 2; ++c) {
      if (CPU_ISSET(c, &mine)) cpus[k++] = c;
    }
    if (k < 2) {
      printf("{\"round_trip_ns\":null}\n");
      return 0;
    }
  }
  pthread_t t;
  if (pthread_create(&t, NULL, pong, &cpus[1]) != 0 || pin(cpus[0]) != 0) {
    fprintf(stderr, "core_latency: cannot run threads on CPUs %d and %d\n", cpus[0], cpus[1]);
    return 1;
  }
  double batch[5];
  long i = 0;
  for (int b = 0; b < 5; ++b) {
    const double t0 = now();
    for (long end = i + trips; i < end; ++i) {
      atomic_store_explicit(&flag, 2 * i + 1, memory_order_release);
      while (atomic_load_explicit(&flag, memory_order_acquire) != 2 * i + 2) {
      }
    }
    batch[b] = (now() - t0) / (double)trips * 1e9;
  }
  pthread_join(t, NULL);
  qsort(batch, 5, sizeof batch[0], cmp);
  printf("{\"cpus\":[%d,%d],\"round_trip_ns\":%.1f}\n", cpus[0], cpus[1], batch[2]);
  return 0;
}
