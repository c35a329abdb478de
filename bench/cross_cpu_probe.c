/* What it costs two CPUs to hand data to each other through memory, the way two data-parallel
 * ranks on one host do every step (docs/measurements.md, the world-2 MLP rows).
 *
 *   cc -O3 -march=native -fno-math-errno -pthread -o bench/results/cross_cpu_probe bench/cross_cpu_probe.c
 *   bench/results/cross_cpu_probe [--cpus A,B] [--mib N] [--reps R]
 *
 * Two threads, pinned to CPUs A and B (default: the first two this process may use), and a
 * buffer of N MiB (default 4). Each figure is the median over R rounds (default 30) of GB/s,
 * printed as one JSON object:
 *   round_trip_ns        one cache line passed A -> B -> A, the median of 5 batches of 20000
 *                        after one untimed batch (as bench/core_latency.c measures it)
 *   read_own             A reads the buffer it wrote itself (its cache)
 *   read_remote          A reads the buffer B has just written
 *   rmw_own              A adds 1 to every float of a buffer only it touches
 *   rmw_after_remote     the same after B has read the buffer (B then holds copies of its lines)
 *   rmw_stream_after_remote   the same with streaming (non-temporal) stores
 *   rmw_after_remote_flushed  the same, B having flushed each line after reading it
 *                        (clflushopt, or clflush where the CPU lacks it); remote_read_flush is
 *                        B's read-and-flush rate
 *   adamw_alone_ms, adamw_both_ms   an AdamW-like update of 2^18 x N floats (p, m, v read and
 *                        written, g read; the working set 4 x that) on A alone, and on A while
 *                        B runs the same on its own arrays; cold (after 64 MiB of other reads).
 * With fewer than two CPUs it prints {"cpus":null}.
 */
#define _GNU_SOURCE
#include <cpuid.h>
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static int cpu_a = -1, cpu_b = -1, reps = 30;
static size_t floats = (size_t)4 << 18;  // 4 MiB
static float* buf;
static _Atomic int turn;  // whose move it is; both threads advance it
static _Atomic long line __attribute__((aligned(64)));
static volatile float sink;

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void pin(int cpu) {
  cpu_set_t s;
  CPU_ZERO(&s);
  CPU_SET(cpu, &s);
  if (sched_setaffinity(0, sizeof s, &s) != 0) {
    fprintf(stderr, "cannot run on CPU %d (sched_setaffinity)\n", cpu);
    exit(1);
  }
}

static void* checked_alloc(size_t bytes) {
  void* p = aligned_alloc(64, bytes);
  if (p == NULL) {
    fprintf(stderr, "out of memory: %zu bytes\n", bytes);
    exit(1);
  }
  return p;
}

static void wait_turn(int t) {
  while (atomic_load(&turn) != t) __builtin_ia32_pause();
}

static int cmp(const void* x, const void* y) {
  const double a = *(const double*)x, b = *(const double*)y;
  return (a > b) - (a < b);
}

static double median(double* v, int n) {
  qsort(v, (size_t)n, sizeof *v, cmp);
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static float sum(const float* p, size_t n) {
  float s[16] = {0};
  for (size_t i = 0; i < n; i += 16)
    for (int k = 0; k < 16; ++k) s[k] += p[i + (size_t)k];
  float t = 0;
  for (int k = 0; k < 16; ++k) t += s[k];
  return t;
}

static void fill(float* p, size_t n, float v) {
  for (size_t i = 0; i < n; ++i) p[i] = v + (float)(i & 7);
}

static void rmw(float* p, size_t n) {
  for (size_t i = 0; i < n; ++i) p[i] += 1.0f;
}

static void rmw_stream(float* p, size_t n) {
  const __m128 one = _mm_set1_ps(1.0f);
  for (size_t i = 0; i < n; i += 4) _mm_stream_ps(p + i, _mm_add_ps(_mm_load_ps(p + i), one));
  _mm_sfence();
}

static int has_clflushopt(void) {
  unsigned a = 0, b = 0, c = 0, d = 0;
  return __get_cpuid_count(7, 0, &a, &b, &c, &d) && (b & (1u << 23));
}

__attribute__((target("clflushopt"))) static void flush_opt(const float* p, size_t n) {
  for (size_t i = 0; i < n; i += 16) __builtin_ia32_clflushopt(p + i);
  _mm_mfence();
}

static void flush(const float* p, size_t n) {
  if (has_clflushopt()) {
    flush_opt(p, n);
    return;
  }
  for (size_t i = 0; i < n; i += 16) _mm_clflush(p + i);
  _mm_mfence();
}

// AdamW's memory traffic: p, m, v read and written, g read (vectorised with -fno-math-errno).
static void adamw(float* p, float* m, float* v, const float* g, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    m[i] = 0.9f * m[i] + 0.1f * g[i];
    v[i] = 0.999f * v[i] + 0.001f * g[i] * g[i];
    p[i] = 0.9999f * p[i] - 1e-3f * m[i] / (__builtin_sqrtf(v[i]) + 1e-8f);
  }
}

static float* junk;
static void evict_caches(void) { sink = sum(junk, (size_t)16 << 20); }

struct adam_arrays {
  float *p, *m, *v, *g;
};

static struct adam_arrays adam_alloc(void) {
  struct adam_arrays a;
  float** all[4] = {&a.p, &a.m, &a.v, &a.g};
  for (int k = 0; k < 4; ++k) {
    *all[k] = checked_alloc(floats * sizeof(float));
    fill(*all[k], floats, 0.5f);
  }
  return a;
}

// The protocol: B acts on even turns 2k (for round k), A on odd ones; each step hands over.
enum { kPingPong, kRemote, kAfterRead, kAfterReadStream, kAfterReadFlush, kAdamBoth, kPhases };
enum { kTrips = 20000, kTripBatches = 6 };  // the first batch untimed
static double b_seconds[256];
static _Atomic int b_ready;

static void* thread_b(void* arg) {
  (void)arg;
  pin(cpu_b);
  struct adam_arrays mine = adam_alloc();
  atomic_store(&b_ready, 1);
  for (int ph = 0; ph < kPhases; ++ph) {
    if (ph == kPingPong) {
      for (long i = 0; i < (long)kTrips * kTripBatches; ++i) {
        while (atomic_load(&line) != 2 * i + 1) __builtin_ia32_pause();
        atomic_store(&line, 2 * i + 2);
      }
      continue;
    }
    for (int r = 0; r < reps; ++r) {
      const int t = 2 * (ph * reps + r);
      wait_turn(t);
      const double t0 = now();
      if (ph == kRemote) fill(buf, floats, (float)r);
      if (ph == kAfterRead || ph == kAfterReadStream) sink = sum(buf, floats);
      if (ph == kAfterReadFlush) {
        sink = sum(buf, floats);
        flush(buf, floats);
      }
      if (ph == kAdamBoth) {
        evict_caches();
        atomic_store(&turn, t + 1);  // start together
        adamw(mine.p, mine.m, mine.v, mine.g, floats);
        continue;
      }
      b_seconds[r] = now() - t0;
      atomic_store(&turn, t + 1);
    }
  }
  return NULL;
}

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (!strcmp(argv[i], "--cpus") && i + 1 < argc) {
      if (sscanf(argv[++i], "%d,%d", &cpu_a, &cpu_b) != 2) {
        fprintf(stderr, "--cpus A,B\n");
        return 2;
      }
    } else if (!strcmp(argv[i], "--mib") && i + 1 < argc) {
      const long mib = atol(argv[++i]);
      if (mib < 1 || mib > 1024) {
        fprintf(stderr, "--mib: 1 to 1024\n");
        return 2;
      }
      floats = (size_t)mib << 18;
    } else if (!strcmp(argv[i], "--reps") && i + 1 < argc) {
      reps = atoi(argv[++i]);
      if (reps < 1 || reps > 256) {
        fprintf(stderr, "--reps: 1 to 256\n");
        return 2;
      }
    } else {
      fprintf(stderr, "usage: %s [--cpus A,B] [--mib N] [--reps R]\n", argv[0]);
      return 2;
    }
  }
  if (cpu_a < 0) {
    cpu_set_t allowed;
    sched_getaffinity(0, sizeof allowed, &allowed);
    for (int c = 0; c < CPU_SETSIZE && cpu_b < 0; ++c)
      if (CPU_ISSET(c, &allowed)) {
        if (cpu_a < 0)
          cpu_a = c;
        else
          cpu_b = c;
      }
    if (cpu_b < 0) {
      printf("{\"cpus\":null}\n");
      return 0;
    }
  }
  if (cpu_a == cpu_b || cpu_a < 0 || cpu_b < 0 || cpu_a >= CPU_SETSIZE || cpu_b >= CPU_SETSIZE) {
    fprintf(stderr, "--cpus A,B: two different CPUs\n");
    return 2;
  }
  buf = checked_alloc(floats * sizeof(float));
  junk = checked_alloc((size_t)64 << 20);
  fill(buf, floats, 0.0f);
  fill(junk, (size_t)16 << 20, 1.0f);
  const double bytes = (double)floats * sizeof(float);
  // B starts before A pins itself (B would else begin on A's CPU) and is ready on its own
  // CPU, its arrays allocated, before anything is timed.
  pthread_t tb;
  if (pthread_create(&tb, NULL, thread_b, NULL) != 0) {
    fprintf(stderr, "pthread_create failed\n");
    return 1;
  }
  pin(cpu_a);
  while (!atomic_load(&b_ready)) __builtin_ia32_pause();

  // A alone first: its own buffer, nobody else touching it.
  double own_read[256], own_rmw[256], adam_alone[256];
  for (int r = 0; r < reps; ++r) {
    double t0 = now();
    rmw(buf, floats);
    own_rmw[r] = bytes / (now() - t0) / 1e9;
    t0 = now();
    sink = sum(buf, floats);
    own_read[r] = bytes / (now() - t0) / 1e9;
  }
  struct adam_arrays mine = adam_alloc();
  for (int r = 0; r < reps; ++r) {
    evict_caches();
    const double t0 = now();
    adamw(mine.p, mine.m, mine.v, mine.g, floats);
    adam_alone[r] = 1e3 * (now() - t0);
  }

  double trip = 0;
  double out[kPhases][256], remote_flush[256];
  for (int phase = 0; phase < kPhases; ++phase) {
    if (phase == kPingPong) {
      double batch[kTripBatches];
      for (int k = 0; k < kTripBatches; ++k) {
        const double t0 = now();
        for (long i = (long)k * kTrips; i < (long)(k + 1) * kTrips; ++i) {
          atomic_store(&line, 2 * i + 1);
          while (atomic_load(&line) != 2 * i + 2) __builtin_ia32_pause();
        }
        batch[k] = (now() - t0) / kTrips * 1e9;
      }
      trip = median(batch + 1, kTripBatches - 1);
      continue;
    }
    for (int r = 0; r < reps; ++r) {
      const int t = 2 * (phase * reps + r);
      if (phase == kAdamBoth) evict_caches();  // then both start from memory
      atomic_store(&turn, t);                  // B's move
      wait_turn(t + 1);
      const double t0 = now();
      if (phase == kRemote) sink = sum(buf, floats);
      if (phase == kAfterRead || phase == kAfterReadFlush) rmw(buf, floats);
      if (phase == kAfterReadStream) rmw_stream(buf, floats);
      if (phase == kAdamBoth) adamw(mine.p, mine.m, mine.v, mine.g, floats);
      const double s = now() - t0;
      out[phase][r] = phase == kAdamBoth ? 1e3 * s : bytes / s / 1e9;
      if (phase == kAfterReadFlush) remote_flush[r] = bytes / b_seconds[r] / 1e9;
    }
  }
  pthread_join(tb, NULL);
  printf(
      "{\"cpus\":[%d,%d],\"mib\":%zu,\"reps\":%d,\"round_trip_ns\":%.1f,\"read_own\":%.1f,\"read_remote\":%.1f,"
      "\"rmw_own\":%.1f,\"rmw_after_remote\":%.1f,\"rmw_stream_after_remote\":%.1f,"
      "\"rmw_after_remote_flushed\":%.1f,\"remote_read_flush\":%.1f,\"adamw_alone_ms\":%.3f,"
      "\"adamw_both_ms\":%.3f}\n",
      cpu_a, cpu_b, floats >> 18, reps, trip, median(own_read, reps), median(out[kRemote], reps), median(own_rmw, reps),
      median(out[kAfterRead], reps), median(out[kAfterReadStream], reps), median(out[kAfterReadFlush], reps),
      median(remote_flush, reps), median(adam_alone, reps), median(out[kAdamBoth], reps));
  return 0;
}
