// sgemm on OpenBLAS or oneDNN, and the per-shape calibration of the auto policy (see gemm.h).
//
// Calibration of a shape: both libraries run the call's own operands into a scratch C, once each
// to warm up (oneDNN generates its kernels, caches fill), then in interleaved repetitions
// (OpenBLAS first on even ones, oneDNN first on odd ones, so a drift in the machine's speed
// hits both alike) until each has kMinReps and the time spent passes kBudgetS, or kMaxReps.
// Each library's figure is its best repetition: noise on a shared machine only ever adds time.
// On one thread the time is the calling thread's CPU time, which time slices lost to other
// processes do not inflate; that keeps the choice the same from run to run on a busy machine.
//
// Threads: OpenBLAS's count is process-wide; OpenMP's (oneDNN's runtime) is per calling
// thread, and a thread that never set it uses the default, every CPU. So set_num_threads
// records the count and each oneDNN call first applies it to the calling thread if that
// thread has not got it yet: ranks and pipeline stages running as threads get it too.
#include "dtrain/tensor/gemm.h"

#include <cblas.h>
#include <fmt/format.h>
#include <time.h>

#if DTRAIN_HAVE_ONEDNN
#include <omp.h>
#include <oneapi/dnnl/dnnl.h>
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <map>
#include <mutex>
#include <tuple>
#include <vector>

#include "dtrain/core/error.h"
#include "dtrain/core/log.h"
#include "dtrain/tensor/kernels.h"
#include "dtrain/tensor/ops.h"
#include "dtrain/tensor/profile.h"
#include "gemm_cache.h"
#include "gemm_internal.h"

namespace dtrain {

namespace {

// OpenBLAS keeps a shape only when its best time beats oneDNN's by more than this fraction.
constexpr double kMargin = 0.10;
constexpr int kMinReps = 5;
constexpr int kMaxReps = 9;
constexpr double kBudgetS = 0.03;
constexpr double kLongCallS = 0.05;  // a call this long: one warm-up and two repetitions are enough

std::atomic<int> g_policy{-1};  // a GemmBackend, or -1 before DTRAIN_GEMM is read
std::atomic<int> g_threads{0};  // set_num_threads' count; 0: never set
std::atomic<int> g_precision{static_cast<int>(Precision::f32)};

using ShapeKey = std::tuple<bool, bool, int64_t, int64_t, int64_t, int>;

struct Calibrations {
  std::mutex mu;  // guards the two containers
  std::map<ShapeKey, GemmBackend> chosen;
  std::vector<GemmCalibration> made;
  std::mutex calibrating;  // one calibration at a time: two at once would time each other
};

Calibrations& calibrations() {
  static Calibrations c;
  return c;
}

void check_library(GemmBackend b, const char* where) {
  DT_CHECK(b != GemmBackend::onednn || onednn_available(), "tensor",
           "{}: onednn asked for, but this build has no oneDNN (install libdnnl-dev with scripts/install-deps "
           "and reconfigure)",
           where);
}

// The CPU (model name, family, model, stepping) and the libraries with the kernels they picked:
// calibrations are shared only between processes with the same.
const std::string& machine_signature() {
  static const std::string signature = [] {
    std::ifstream in("/proc/cpuinfo");
    std::string cpu, line;
    int fields = 0;
    while (fields < 4 && std::getline(in, line)) {
      for (const char* key : {"model name", "cpu family", "model\t", "stepping"}) {
        if (line.rfind(key, 0) == 0) {
          cpu += (cpu.empty() ? "" : ", ") + line.substr(0, line.find('\t')) + " " +
                 line.substr(std::min(line.size(), line.find(':') + 2));
          ++fields;
        }
      }
    }
    return gemm_libraries() + "; " + (cpu.empty() ? std::string("unknown CPU") : cpu);
  }();
  return signature;
}

int effective_threads() {
  const int t = g_threads.load(std::memory_order_relaxed);
  return t > 0 ? t : openblas_get_num_threads();
}

#if DTRAIN_HAVE_ONEDNN
thread_local int tl_omp_threads = 0;  // the count this thread last gave OpenMP
#endif

void run_openblas(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
                  const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, static_cast<blasint>(m),
              static_cast<blasint>(n), static_cast<blasint>(k), alpha, a, static_cast<blasint>(lda), b,
              static_cast<blasint>(ldb), beta, c, static_cast<blasint>(ldc));
}

void run_onednn(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
                const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
#if DTRAIN_HAVE_ONEDNN
  detail::apply_omp_threads();
  const dnnl_status_t s = dnnl_sgemm(ta ? 'T' : 'N', tb ? 'T' : 'N', m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  DT_CHECK(s == dnnl_success, "tensor", "sgemm: oneDNN failed (status {}) on M {} N {} K {} trans {}{}",
           static_cast<int>(s), m, n, k, ta ? 'T' : 'N', tb ? 'T' : 'N');
#else
  (void)ta, (void)tb, (void)m, (void)n, (void)k, (void)alpha, (void)a, (void)lda, (void)b, (void)ldb, (void)beta;
  (void)c, (void)ldc;
  check_library(GemmBackend::onednn, "sgemm");
#endif
}

void run_library(GemmBackend lib, bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
                 int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  if (lib == GemmBackend::onednn) {
    run_onednn(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  } else {
    run_openblas(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  }
}

GemmCalibration calibrate(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
                          const float* b, int64_t ldb, int threads) {
  GemmCalibration cal;
  cal.trans_a = ta;
  cal.trans_b = tb;
  cal.m = m;
  cal.n = n;
  cal.k = k;
  cal.threads = threads;
  std::vector<float> scratch(static_cast<size_t>(m * n));
  // One thread: both libraries compute on the calling thread, so its CPU time is the measure,
  // blind to the time the scheduler gives to other processes. More threads: wall time.
  auto clock = [threads] {
    if (threads == 1) {
      timespec ts{};
      clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
      return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
    }
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  };
  auto time_one = [&](GemmBackend lib) {
    const double t0 = clock();
    run_library(lib, ta, tb, m, n, k, alpha, a, lda, b, ldb, 0.0f, scratch.data(), n);
    return clock() - t0;
  };
  // Warm up: oneDNN generates its kernels, the allocator settles on the libraries' buffers.
  const double first = std::max(time_one(GemmBackend::openblas), time_one(GemmBackend::onednn));
  const bool long_call = first > kLongCallS;
  if (!long_call) {
    time_one(GemmBackend::openblas);
    time_one(GemmBackend::onednn);
  }
  const int min_reps = long_call ? 2 : kMinReps;
  double best_blas = std::numeric_limits<double>::infinity(), best_dnnl = best_blas, spent = 0;
  for (int rep = 0; rep < kMaxReps; ++rep) {
    const bool blas_first = rep % 2 == 0;
    const double t1 = time_one(blas_first ? GemmBackend::openblas : GemmBackend::onednn);
    const double t2 = time_one(blas_first ? GemmBackend::onednn : GemmBackend::openblas);
    best_blas = std::min(best_blas, blas_first ? t1 : t2);
    best_dnnl = std::min(best_dnnl, blas_first ? t2 : t1);
    spent += t1 + t2;
    if (rep + 1 >= min_reps && (spent > kBudgetS || long_call)) break;
  }
  cal.openblas_s = best_blas;
  cal.onednn_s = best_dnnl;
  cal.chosen = best_blas * (1.0 + kMargin) < best_dnnl ? GemmBackend::openblas : GemmBackend::onednn;
  return cal;
}

// The library for this shape under auto, calibrating it on these operands on its first call.
GemmBackend auto_choice(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
                        const float* b, int64_t ldb) {
  Calibrations& cs = calibrations();
  const int threads = effective_threads();
  const ShapeKey key{ta, tb, m, n, k, threads};
  {
    std::lock_guard<std::mutex> lock(cs.mu);
    auto it = cs.chosen.find(key);
    if (it != cs.chosen.end()) return it->second;
  }
  std::lock_guard<std::mutex> one_at_a_time(cs.calibrating);
  {
    std::lock_guard<std::mutex> lock(cs.mu);  // another thread may have calibrated it meanwhile
    auto it = cs.chosen.find(key);
    if (it != cs.chosen.end()) return it->second;
  }
  // Other processes on this machine first: the one that met the shape first decided it.
  detail::GemmCacheFile file(machine_signature());
  GemmCalibration cal;
  bool found = false;
  for (const GemmCalibration& e : file.entries()) {
    if (ShapeKey{e.trans_a, e.trans_b, e.m, e.n, e.k, e.threads} == key) {
      cal = e;
      cal.cached = true;
      found = true;
      break;
    }
  }
  if (!found) {
    cal = calibrate(ta, tb, m, n, k, alpha, a, lda, b, ldb, threads);
    file.append(cal);
  }
  std::lock_guard<std::mutex> lock(cs.mu);
  cs.chosen.emplace(key, cal.chosen);
  cs.made.push_back(cal);
  return cal.chosen;
}

GemmBackend current_policy() {
  int p = g_policy.load(std::memory_order_acquire);
  if (p >= 0) return static_cast<GemmBackend>(p);
  // oneDNN by default where the build has it, pinned rather than auto: measured on the models'
  // shapes it is 1.05-1.5x OpenBLAS on every GPT product and within noise on the MLP as a whole
  // (OpenBLAS wins only its 10-wide last layer), and a pinned library gives the same bits on every
  // run and on every host with the same instruction set, where auto's per-machine timings could
  // pick differently on two hosts. DTRAIN_GEMM=openblas|auto overrides it.
  GemmBackend b = onednn_available() ? GemmBackend::onednn : GemmBackend::openblas;
  if (const char* env = std::getenv("DTRAIN_GEMM"); env != nullptr && *env != '\0') {
    b = parse_gemm_backend(env);
    check_library(b, "DTRAIN_GEMM");
  }
  int expected = -1;
  g_policy.compare_exchange_strong(expected, static_cast<int>(b), std::memory_order_acq_rel);
  return static_cast<GemmBackend>(g_policy.load(std::memory_order_acquire));
}

}  // namespace

const char* gemm_backend_name(GemmBackend backend) {
  switch (backend) {
    case GemmBackend::automatic:
      return "auto";
    case GemmBackend::openblas:
      return "openblas";
    case GemmBackend::onednn:
      return "onednn";
  }
  return "?";
}

GemmBackend parse_gemm_backend(std::string_view text) {
  if (text == "auto") return GemmBackend::automatic;
  if (text == "openblas") return GemmBackend::openblas;
  if (text == "onednn") return GemmBackend::onednn;
  DT_THROW("tensor", "gemm backend '{}': expected auto, openblas or onednn", text);
}

bool onednn_available() {
#if DTRAIN_HAVE_ONEDNN
  return true;
#else
  return false;
#endif
}

std::string onednn_isa() {
#if DTRAIN_HAVE_ONEDNN
  switch (dnnl_get_effective_cpu_isa()) {
    case dnnl_cpu_isa_sse41:
      return "sse41";
    case dnnl_cpu_isa_avx:
      return "avx";
    case dnnl_cpu_isa_avx2:
      return "avx2";
    case dnnl_cpu_isa_avx2_vnni:
      return "avx2_vnni";
    case dnnl_cpu_isa_avx512_core:
      return "avx512_core";
    case dnnl_cpu_isa_avx512_core_vnni:
      return "avx512_core_vnni";
    case dnnl_cpu_isa_avx512_core_bf16:
      return "avx512_core_bf16";
    case dnnl_cpu_isa_avx512_core_amx:
      return "avx512_core_amx";
    default:
      return fmt::format("isa {:#x}", static_cast<unsigned>(dnnl_get_effective_cpu_isa()));
  }
#else
  return "none";
#endif
}

std::string gemm_libraries() {
  std::string config = openblas_get_config();  // "OpenBLAS 0.3.21 DYNAMIC_ARCH ..."
  std::string out = config.substr(0, config.find(' ', config.find(' ') + 1));
  out += fmt::format(" (core {})", openblas_get_corename());
#if DTRAIN_HAVE_ONEDNN
  const dnnl_version_t* v = dnnl_version();
  out += fmt::format(", oneDNN {}.{}.{} ({})", v->major, v->minor, v->patch, onednn_isa());
#endif
  return out;
}

GemmBackend gemm_backend() { return current_policy(); }

void set_gemm_backend(GemmBackend backend) {
  check_library(backend, "set_gemm_backend");
  g_policy.store(static_cast<int>(backend), std::memory_order_release);
}

namespace {

// C += R where a residual R (M, N) was given and the product could not add it itself: the same sum
// as R + C.
void add_residual(const float* residual, int64_t count, float* c) {
  if (residual != nullptr) kernels::table().add_into(c, residual, count);
}

// The checks of sgemm's arguments; false when nothing is left to multiply (M, N or K is 0: then
// C is already beta C).
bool product_to_run(const char* op, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, int64_t lda,
                    int64_t ldb, float beta, float* c, int64_t ldc) {
  DT_CHECK(m >= 0 && n >= 0 && k >= 0 && m <= INT_MAX && n <= INT_MAX && k <= INT_MAX, "tensor",
           "{}: dimensions M {} N {} K {} out of range [0, {}]", op, m, n, k, INT_MAX);
  if (m == 0 || n == 0) return false;
  DT_CHECK(ldc >= n && ldc <= INT_MAX, "tensor", "{}: ldc {} too small for N {}", op, ldc, n);
  if (k == 0) {  // C = beta C; beta = 0 never reads C (it may be uninitialised)
    for (int64_t i = 0; i < m; ++i) {
      float* row = c + i * ldc;
      for (int64_t j = 0; j < n; ++j) row[j] = beta == 0.0f ? 0.0f : row[j] * beta;
    }
    return false;
  }
  DT_CHECK(lda >= (trans_a ? m : k) && ldb >= (trans_b ? k : n) && lda <= INT_MAX && ldb <= INT_MAX, "tensor",
           "{}: leading dimensions lda {} ldb {} too small for M {} N {} K {} trans {}{}", op, lda, ldb, m, n, k,
           trans_a ? 'T' : 'N', trans_b ? 'T' : 'N');
  return true;
}

}  // namespace

void gemm_bf16(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const uint16_t* a, int64_t lda,
               const uint16_t* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  profile::Scope scope(profile::Kind::matmul);
  if (!product_to_run("gemm_bf16", trans_a, trans_b, m, n, k, lda, ldb, beta, c, ldc)) return;
  detail::gemm_bf16_operands(GemmBackend::automatic, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void sgemm_on(GemmBackend library, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
              const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  profile::Scope scope(profile::Kind::matmul);
  if (!product_to_run("sgemm", trans_a, trans_b, m, n, k, lda, ldb, beta, c, ldc)) return;
  if (matmul_precision() == Precision::bf16) {
    detail::sgemm_bf16(library, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  } else {
    detail::run_f32_library(library, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  }
}

namespace detail {

GemmBackend library_for(GemmBackend library, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                        const float* a, int64_t lda, const float* b, int64_t ldb) {
  if (library != GemmBackend::automatic) return library;
  library = current_policy();
  if (library != GemmBackend::automatic) return library;
  return onednn_available() ? auto_choice(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb) : GemmBackend::openblas;
}

void run_f32_library(GemmBackend library, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                     const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  library = library_for(library, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb);
  run_library(library, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void fill_rows(const float* bias, int64_t m, int64_t n, float* c) {
  for (int64_t r = 0; r < m; ++r) std::memcpy(c + r * n, bias, static_cast<size_t>(n) * sizeof(float));
}

int apply_omp_threads() {
#if DTRAIN_HAVE_ONEDNN
  const int want = g_threads.load(std::memory_order_relaxed);
  if (want > 0 && want != tl_omp_threads) {
    omp_set_num_threads(want);
    tl_omp_threads = want;
  }
  return want > 0 ? want : omp_get_max_threads();
#else
  return 1;
#endif
}

}  // namespace detail

void set_matmul_precision(Precision precision) {
  g_precision.store(static_cast<int>(precision), std::memory_order_release);
  if (precision == Precision::bf16) {
    static std::once_flag said;
    std::call_once(said, [] { DT_LOG_INFO("{}", detail::bf16_products_route()); });
  }
}

Precision matmul_precision() { return static_cast<Precision>(g_precision.load(std::memory_order_acquire)); }

std::string bf16_products_route() { return detail::bf16_products_route(); }

bool bf16_products_native() { return detail::bf16_products_native(); }

void sgemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
           const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  sgemm_on(GemmBackend::automatic, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void sgemm_f32(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
               const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  profile::Scope scope(profile::Kind::matmul);
  if (!product_to_run("sgemm_f32", trans_a, trans_b, m, n, k, lda, ldb, beta, c, ldc)) return;
  detail::run_f32_library(GemmBackend::automatic, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void sgemm_bias(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda,
                const float* b, int64_t ldb, const float* bias, float* c, const float* residual) {
  profile::Scope scope(profile::Kind::matmul);
  if (m == 0 || n == 0) return;
  if (k == 0 || matmul_precision() == Precision::bf16) {
    detail::fill_rows(bias, m, n, c);
    sgemm_on(GemmBackend::automatic, trans_a, trans_b, m, n, k, 1.0f, a, lda, b, ldb, 1.0f, c, n);
    add_residual(residual, m * n, c);
    return;
  }
  if (!product_to_run("sgemm_bias", trans_a, trans_b, m, n, k, lda, ldb, 0.0f, c, n)) return;
  const GemmBackend library =
      detail::library_for(GemmBackend::automatic, trans_a, trans_b, m, n, k, 1.0f, a, lda, b, ldb);
#if DTRAIN_HAVE_ONEDNN
  if (library == GemmBackend::onednn) {
    detail::MatmulShape shape = detail::matmul_shape(false, trans_a, trans_b, m, n, k, lda, ldb, n, 1.0f, 0.0f, true);
    shape.residual = residual != nullptr;
    detail::run_matmul(shape, a, b, bias, c, residual);
    return;
  }
#endif
  detail::fill_rows(bias, m, n, c);
  run_library(library, trans_a, trans_b, m, n, k, 1.0f, a, lda, b, ldb, 1.0f, c, n);
  add_residual(residual, m * n, c);
}

namespace {

// A dense bf16 product on oneDNN's matmul, the bias (if any) added in its epilogue, C (M, N) dense
// in f32 or (c_bf16) bf16; false where it cannot run there (no bf16 kernels, strided operands, K 0).
bool onednn_bf16_dense(const char* op, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const uint16_t* a,
                       int64_t lda, const uint16_t* b, int64_t ldb, const float* bias, void* c, bool c_bf16,
                       const float* residual = nullptr) {
#if DTRAIN_HAVE_ONEDNN
  const bool dense = lda == (trans_a ? m : k) && ldb == (trans_b ? k : n);
  const bool native = c_bf16 ? detail::bf16_results_native() : detail::bf16_products_native();
  if (k > 0 && dense && native && product_to_run(op, trans_a, trans_b, m, n, k, lda, ldb, 0.0f, nullptr, n)) {
    detail::MatmulShape shape =
        detail::matmul_shape(true, trans_a, trans_b, m, n, k, lda, ldb, n, 1.0f, 0.0f, bias != nullptr);
    shape.c_bf16 = c_bf16;
    shape.residual = residual != nullptr;
    detail::run_matmul(shape, a, b, bias, c, residual);
    return true;
  }
#else
  (void)op, (void)trans_a, (void)trans_b, (void)m, (void)n, (void)k, (void)a, (void)lda, (void)b, (void)ldb;
  (void)bias, (void)c, (void)c_bf16, (void)residual;
#endif
  return false;
}

}  // namespace

void gemm_bf16_bias(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const uint16_t* a, int64_t lda,
                    const uint16_t* b, int64_t ldb, const float* bias, float* c, const float* residual) {
  profile::Scope scope(profile::Kind::matmul);
  if (m == 0 || n == 0) return;
  if (onednn_bf16_dense("gemm_bf16_bias", trans_a, trans_b, m, n, k, a, lda, b, ldb, bias, c, false, residual)) return;
  detail::fill_rows(bias, m, n, c);
  gemm_bf16(trans_a, trans_b, m, n, k, 1.0f, a, lda, b, ldb, 1.0f, c, n);
  add_residual(residual, m * n, c);
}

void gemm_bf16_to_bf16(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const uint16_t* a, int64_t lda,
                       const uint16_t* b, int64_t ldb, const float* bias, uint16_t* c) {
  profile::Scope scope(profile::Kind::matmul);
  if (m == 0 || n == 0) return;
  // oneDNN's epilogue rounds to nearest even with vcvtneps2bf16: round_to_bf16's bits but for
  // f32 denormals, which it flushes to zero.
  if (onednn_bf16_dense("gemm_bf16_to_bf16", trans_a, trans_b, m, n, k, a, lda, b, ldb, bias, c, true)) return;
  std::vector<float> sums(static_cast<size_t>(m * n));
  if (bias != nullptr) {
    gemm_bf16_bias(trans_a, trans_b, m, n, k, a, lda, b, ldb, bias, sums.data());
  } else {
    gemm_bf16(trans_a, trans_b, m, n, k, 1.0f, a, lda, b, ldb, 0.0f, sums.data(), n);
  }
  kernels::table().round_to_bf16(sums.data(), 1, m * n, m * n, c);
}

GemmBackend gemm_backend_for(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k) {
  const GemmBackend policy = current_policy();
  if (policy != GemmBackend::automatic) return policy;
  if (!onednn_available() || m == 0 || n == 0 || k == 0) return GemmBackend::openblas;  // degenerate: neither runs
  // Scratch operands: small values that neither overflow nor run into denormals.
  std::vector<float> a(static_cast<size_t>(std::max<int64_t>(1, m * k)));
  std::vector<float> b(static_cast<size_t>(std::max<int64_t>(1, k * n)));
  for (size_t i = 0; i < a.size(); ++i) a[i] = static_cast<float>(static_cast<int>(i % 17) - 8) * 0.125f;
  for (size_t i = 0; i < b.size(); ++i) b[i] = static_cast<float>(static_cast<int>(i % 13) - 6) * 0.125f;
  return auto_choice(trans_a, trans_b, m, n, k, 1.0f, a.data(), trans_a ? m : k, b.data(), trans_b ? k : n);
}

std::string gemm_cache_file() { return detail::gemm_cache_path(machine_signature()); }

std::vector<GemmCalibration> gemm_calibrations() {
  Calibrations& cs = calibrations();
  std::lock_guard<std::mutex> lock(cs.mu);
  return cs.made;
}

int gemm_threads() { return g_threads.load(std::memory_order_relaxed); }

void set_num_threads(int threads) {
  DT_CHECK(threads >= 1, "tensor", "set_num_threads: {} threads, expected at least 1", threads);
  openblas_set_num_threads(threads);
  g_threads.store(threads, std::memory_order_relaxed);
  detail::apply_omp_threads();
}

}  // namespace dtrain
