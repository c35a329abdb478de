// FMA-throughput probe (peak.h).
//
// Vocabulary: a *kernel* updates kAcc independent vector *accumulators* acc = acc * x + y per
// *iteration*, enough of them to cover the FMA latency times the FMA pipes of any current core,
// so the loop runs at the unit's throughput; a *run* is one timed call of a kernel for a fixed
// iteration count (about kRunSeconds of the thread's CPU time, so that time the scheduler gives
// to other processes does not count); a thread's rate is its best of kRuns runs (noise only
// adds time). The kernels carry target attributes and are picked at run time with
// __builtin_cpu_supports, so the build needs no -mavx512 flags and runs on CPUs without them.
// x is just below 1 and y tiny: the accumulators converge to y / (1 - x) and never overflow or
// turn denormal. bf16 runs on AMX's tiles where the CPU has them and Linux grants them (the
// widest bf16 unit: a tile product is 16 x 16 x 32 multiply-adds), else on AVX512_BF16 dot
// products.
#include "dtrain/tensor/peak.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define DTRAIN_X86 1
#endif
#if defined(__x86_64__) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#define DTRAIN_AMX 1
#endif

#include <time.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "dtrain/core/error.h"

namespace dtrain {

namespace {

constexpr int kRuns = 5;
constexpr double kRunSeconds = 0.01;

using Kernel = float (*)(long iterations);

struct Probe {
  const char* isa = "none";
  Kernel kernel = nullptr;
  double flops_per_iteration = 0;
};

#if DTRAIN_X86
// Not _mm512_reduce_add_ps: GCC 12 warns about its undefined upper half (-Wuninitialized).
__attribute__((target("avx512f"))) float sum_lanes(__m512 v) {
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, v);
  float s = 0;
  for (float x : lanes) s += x;
  return s;
}

__attribute__((target("avx512f"))) float fma_avx512(long iterations) {
  constexpr int kAcc = 16;  // of 32 zmm registers
  __m512 acc[kAcc];
  for (int i = 0; i < kAcc; ++i) acc[i] = _mm512_set1_ps(1.0f + static_cast<float>(i) * 1e-3f);
  const __m512 x = _mm512_set1_ps(0.999999f), y = _mm512_set1_ps(1e-7f);
  for (long it = 0; it < iterations; ++it) {
#pragma GCC unroll 16
    for (int i = 0; i < kAcc; ++i) acc[i] = _mm512_fmadd_ps(acc[i], x, y);
  }
  for (int i = 1; i < kAcc; ++i) acc[0] = _mm512_add_ps(acc[0], acc[i]);
  return sum_lanes(acc[0]);
}

__attribute__((target("avx2,fma"))) float fma_avx2(long iterations) {
  constexpr int kAcc = 12;  // of 16 ymm registers, two hold x and y
  __m256 acc[kAcc];
  for (int i = 0; i < kAcc; ++i) acc[i] = _mm256_set1_ps(1.0f + static_cast<float>(i) * 1e-3f);
  const __m256 x = _mm256_set1_ps(0.999999f), y = _mm256_set1_ps(1e-7f);
  for (long it = 0; it < iterations; ++it) {
#pragma GCC unroll 12
    for (int i = 0; i < kAcc; ++i) acc[i] = _mm256_fmadd_ps(acc[i], x, y);
  }
  for (int i = 1; i < kAcc; ++i) acc[0] = _mm256_add_ps(acc[0], acc[i]);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc[0]);
  float s = 0;
  for (float v : lanes) s += v;
  return s;
}

// vdpbf16ps: acc (16 f32) += x.even * y.even + x.odd * y.odd over 32 bf16 pairs. x = 1.0 and
// y = 2^-25 in bf16: each iteration adds 2^-24 to every lane.
__attribute__((target("avx512f,avx512bf16"))) float dot_avx512_bf16(long iterations) {
  constexpr int kAcc = 16;
  __m512 acc[kAcc];
  for (int i = 0; i < kAcc; ++i) acc[i] = _mm512_set1_ps(static_cast<float>(i) * 1e-3f);
  const __m512bh x = reinterpret_cast<__m512bh>(_mm512_set1_epi16(0x3f80));
  const __m512bh y = reinterpret_cast<__m512bh>(_mm512_set1_epi16(0x3300));
  for (long it = 0; it < iterations; ++it) {
#pragma GCC unroll 16
    for (int i = 0; i < kAcc; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], x, y);
  }
  for (int i = 1; i < kAcc; ++i) acc[0] = _mm512_add_ps(acc[0], acc[i]);
  return sum_lanes(acc[0]);
}
#endif

#if DTRAIN_AMX
// AMX: the CPU has tiles and bf16 tile products (CPUID 7.0 EDX bits 24 and 22), and Linux lets
// this process use the tile data (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA).
bool amx_bf16_usable() {
  static const bool usable = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d) == 0) return false;
    if ((d & (1u << 24)) == 0 || (d & (1u << 22)) == 0) return false;
    constexpr long kReqXcompPerm = 0x1023;
    constexpr long kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return usable;
}

// The tile configuration (palette 1): every tile 16 rows of 64 bytes.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tdpbf16ps: C (16 x 16 f32) += A (16 x 32 bf16) B (32 x 16 bf16, in pairs), four independent
// accumulator tiles from two A and two B tiles. A = 1.0, B = 2^-25: each product adds 2^-20.
__attribute__((target("amx-tile,amx-bf16"))) float dot_amx_bf16(long iterations) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  alignas(64) uint16_t a[16 * 32], b[16 * 32];
  for (int i = 0; i < 16 * 32; ++i) {
    a[i] = 0x3f80;
    b[i] = 0x3300;
  }
  _tile_loadconfig(&cfg);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_loadd(4, a, 64);
  _tile_loadd(5, a, 64);
  _tile_loadd(6, b, 64);
  _tile_loadd(7, b, 64);
  for (long it = 0; it < iterations; ++it) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  alignas(64) float out[16 * 16];
  _tile_stored(0, out, 64);
  _tile_release();
  return out[0];
}
#endif

// Whatever vectors the build targets: a * x + y over plain arrays, which the compiler turns
// into its widest FMAs (or multiply and add where there is no FMA).
float fma_generic(long iterations) {
  constexpr int kLanes = 128;
  float acc[kLanes];
  for (int i = 0; i < kLanes; ++i) acc[i] = 1.0f + static_cast<float>(i) * 1e-3f;
  const float x = 0.999999f, y = 1e-7f;
  for (long it = 0; it < iterations; ++it) {
    for (int i = 0; i < kLanes; ++i) acc[i] = acc[i] * x + y;
  }
  float s = 0;
  for (float v : acc) s += v;
  return s;
}

Probe pick(Precision precision) {
#if DTRAIN_X86
  __builtin_cpu_init();
  if (precision == Precision::bf16) {
#if DTRAIN_AMX
    if (amx_bf16_usable()) return {"amx_bf16", dot_amx_bf16, 4.0 * 16 * 16 * 32 * 2};
#endif
    if (__builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512f")) {
      return {"avx512_bf16", dot_avx512_bf16, 16.0 * 16 * 4};
    }
    return {};
  }
  if (__builtin_cpu_supports("avx512f")) return {"avx512f", fma_avx512, 16.0 * 16 * 2};
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return {"avx2+fma", fma_avx2, 12.0 * 8 * 2};
#endif
  if (precision == Precision::bf16) return {};
  return {"generic", fma_generic, 128.0 * 2};
}

// The calling thread's CPU time: a run that the scheduler interrupts (a shared machine) still
// counts only the time it ran.
double thread_cpu_s() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

// One thread's best rate over kRuns runs, in FLOP/s.
double thread_rate(const Probe& probe, long iterations) {
  volatile float sink = 0;
  double best = 0;
  for (int r = 0; r < kRuns; ++r) {
    const double t0 = thread_cpu_s();
    sink = sink + probe.kernel(iterations);
    const double s = thread_cpu_s() - t0;
    if (s > 0) best = std::max(best, probe.flops_per_iteration * static_cast<double>(iterations) / s);
  }
  (void)sink;
  return best;
}

double measure(const Probe& probe, int threads) {
  // Size a run from a short trial on this thread.
  long iterations = 1000;
  for (;;) {
    const double t0 = thread_cpu_s();
    volatile float sink = probe.kernel(iterations);
    (void)sink;
    const double s = thread_cpu_s() - t0;
    if (s >= kRunSeconds / 8 || iterations > (1L << 40)) {
      iterations =
          std::max(1000L, static_cast<long>(static_cast<double>(iterations) * kRunSeconds / std::max(s, 1e-9)));
      break;
    }
    iterations *= 4;
  }
  std::vector<double> rates(static_cast<size_t>(threads));
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t)
    pool.emplace_back([&, t] { rates[static_cast<size_t>(t)] = thread_rate(probe, iterations); });
  rates[0] = thread_rate(probe, iterations);
  for (std::thread& th : pool) th.join();
  double total = 0;
  for (double r : rates) total += r;
  return total;
}

}  // namespace

const char* peak_probe_isa(Precision precision) { return pick(precision).isa; }

double measured_peak_flops(int threads, Precision precision) {
  DT_CHECK(threads >= 1 && threads <= 4096, "tensor", "measured_peak_flops: {} threads, expected 1..4096", threads);
  static std::mutex mu;
  static std::map<std::pair<int, Precision>, double> cache;
  std::lock_guard<std::mutex> lock(mu);  // one probe at a time: two would share the cores
  auto it = cache.find({threads, precision});
  if (it != cache.end()) return it->second;
  const Probe probe = pick(precision);
  const double flops = probe.kernel == nullptr ? 0.0 : measure(probe, threads);
  cache.emplace(std::make_pair(threads, precision), flops);
  return flops;
}

}  // namespace dtrain
