// The one sgemm (tensor/gemm.h) on each library against a double-precision reference, for every
// transpose, odd shapes and strided operands; the auto policy's per-shape choice; threads (one
// thread is one thread, on threads that never set it too); bf16 products (--precision bf16);
// oneDNN held to AVX2 in a child process (results, every op's gradients, the kernels and bf16's
// fallback there); and the FMA probe's peak (tensor/peak.h).
//
// Error bound: any summation order of a K-term dot product in f32 is off from the exact value by
// at most gamma_K sum_k |a_ik b_kj|, gamma_K = K u / (1 - K u), u = 2^-24; alpha and beta add a
// few u of |alpha| sum |a b| + |beta c|. The bound holds for every blocking and FMA use, so a
// failure is a wrong element, not rounding. With bf16 products the reference multiplies the
// operands rounded to bf16, so the same bound checks that exactly those products were summed in
// f32 (against the unrounded operands that is (2^-7 + 2^-16 + gamma_K) sum |a b|).
#include "dtrain/tensor/gemm.h"

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>
#include <vector>

#include "../src/tensor/gemm_internal.h"
#include "dtrain/core/error.h"
#include "dtrain/tensor/half.h"
#include "dtrain/tensor/kernels.h"
#include "dtrain/tensor/ops.h"
#include "dtrain/tensor/peak.h"
#include "dtrain/tensor/random.h"

namespace dtrain {
namespace {

struct Case {
  bool ta, tb;
  int64_t m, n, k;
  int64_t pad = 0;  // extra elements per row of A, B and C (leading dimensions above the minimum)
  float alpha = 1.0f, beta = 0.0f;
};

std::string describe(const Case& c) {
  return fmt::format("{}{} M {} N {} K {} pad {} alpha {} beta {}", c.ta ? 'T' : 'N', c.tb ? 'T' : 'N', c.m, c.n, c.k,
                     c.pad, c.alpha, c.beta);
}

// Runs `c` on `library` (automatic: through sgemm and the policy) and checks every element of C
// against the double reference within the bound above; returns C.
std::vector<float> check_case(GemmBackend library, const Case& c) {
  const int64_t lda = (c.ta ? c.m : c.k) + c.pad, ldb = (c.tb ? c.k : c.n) + c.pad, ldc = c.n + c.pad;
  Generator gen(static_cast<uint64_t>(c.m * 131 + c.n * 17 + c.k));
  const std::vector<float> a = Tensor::randn({(c.ta ? c.k : c.m) * lda}, gen).to_vector();
  const std::vector<float> b = Tensor::randn({(c.tb ? c.n : c.k) * ldb}, gen).to_vector();
  const std::vector<float> c0 = Tensor::randn({c.m * ldc}, gen).to_vector();
  std::vector<float> out = c0;
  if (library == GemmBackend::automatic) {
    sgemm(c.ta, c.tb, c.m, c.n, c.k, c.alpha, a.data(), lda, b.data(), ldb, c.beta, out.data(), ldc);
  } else {
    sgemm_on(library, c.ta, c.tb, c.m, c.n, c.k, c.alpha, a.data(), lda, b.data(), ldb, c.beta, out.data(), ldc);
  }
  // With bf16 products the reference multiplies the operands rounded to bf16, as they are.
  const bool bf16 = matmul_precision() == Precision::bf16;
  auto operand = [bf16](float v) { return bf16 ? bf16_to_f32(f32_to_bf16(v)) : v; };
  const double u = std::ldexp(1.0, -24);
  const double gamma = static_cast<double>(c.k) * u / (1.0 - static_cast<double>(c.k) * u);
  int wrong = 0;
  double worst_rel = 0;
  for (int64_t i = 0; i < c.m; ++i) {
    for (int64_t j = 0; j < c.n; ++j) {
      double exact = 0, magnitude = 0;
      for (int64_t p = 0; p < c.k; ++p) {
        const double x = operand(a[static_cast<size_t>(c.ta ? p * lda + i : i * lda + p)]);
        const double y = operand(b[static_cast<size_t>(c.tb ? j * ldb + p : p * ldb + j)]);
        exact += x * y;
        magnitude += std::fabs(x * y);
      }
      const double cij = c0[static_cast<size_t>(i * ldc + j)];
      const double want = c.alpha * exact + c.beta * cij;
      const double bound = (gamma + 3 * u) * std::fabs(c.alpha) * magnitude + 3 * u * std::fabs(c.beta * cij) + 1e-30;
      const double err = std::fabs(static_cast<double>(out[static_cast<size_t>(i * ldc + j)]) - want);
      worst_rel = std::max(worst_rel, err / bound);
      if (err > bound && ++wrong <= 3) {
        ADD_FAILURE() << gemm_backend_name(library) << " " << describe(c) << ": C[" << i << "][" << j
                      << "] = " << out[static_cast<size_t>(i * ldc + j)] << ", reference " << want << ", bound "
                      << bound;
      }
    }
  }
  // The padding between rows is never written.
  for (int64_t i = 0; i < c.m; ++i) {
    for (int64_t j = c.n; j < ldc; ++j) {
      EXPECT_EQ(out[static_cast<size_t>(i * ldc + j)], c0[static_cast<size_t>(i * ldc + j)])
          << gemm_backend_name(library) << " " << describe(c) << " wrote padding at row " << i;
    }
  }
  EXPECT_EQ(wrong, 0) << gemm_backend_name(library) << " " << describe(c) << ": worst error " << worst_rel
                      << " x the bound";
  return out;
}

std::vector<Case> cases() {
  std::vector<Case> all;
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      all.push_back({ta, tb, 1, 1, 1});
      all.push_back({ta, tb, 67, 129, 511});
      all.push_back({ta, tb, 64, 10, 1024});                 // the MLP's last layer
      all.push_back({ta, tb, 33, 47, 10});                   // K = 10
      all.push_back({ta, tb, 130, 70, 33, 5, 0.75f, 0.5f});  // strided, alpha, beta
      all.push_back({ta, tb, 16, 24, 7, 3, -2.0f, 1.0f});
    }
  }
  return all;
}

std::vector<GemmBackend> libraries() {
  std::vector<GemmBackend> libs = {GemmBackend::openblas};
  if (onednn_available()) libs.push_back(GemmBackend::onednn);
  return libs;
}

// Restores the policy a test changed.
struct PolicyGuard {
  GemmBackend saved = gemm_backend();
  ~PolicyGuard() { set_gemm_backend(saved); }
};

TEST(Gemm, EachLibraryMatchesTheDoubleReferenceForEveryTranspose) {
  for (GemmBackend lib : libraries()) {
    for (const Case& c : cases()) check_case(lib, c);
  }
}

TEST(Gemm, ThePolicyRoutesEveryProductToTheForcedLibrary) {
  PolicyGuard guard;
  for (GemmBackend lib : libraries()) {
    set_gemm_backend(lib);
    EXPECT_EQ(gemm_backend(), lib);
    EXPECT_EQ(gemm_backend_for(false, true, 64, 1024, 784), lib);
    for (const Case& c : cases()) {
      // Through the policy: bit for bit what the library gives when named.
      const std::vector<float> via_policy = check_case(GemmBackend::automatic, c);
      const std::vector<float> named = check_case(lib, c);
      EXPECT_EQ(via_policy, named) << gemm_backend_name(lib) << " " << describe(c);
    }
  }
}

TEST(Gemm, EveryLibraryGivesTheSameBitsTwice) {
  for (GemmBackend lib : libraries()) {
    const Case c{false, true, 67, 129, 511};
    EXPECT_EQ(check_case(lib, c), check_case(lib, c)) << gemm_backend_name(lib);
  }
}

TEST(Gemm, AutoCalibratesEachShapeOnceAndKeepsItsChoice) {
  PolicyGuard guard;
  set_gemm_backend(GemmBackend::automatic);
  // A shape no other test uses, so this test makes its calibration.
  const Case c{true, false, 97, 61, 43};
  const GemmBackend first = gemm_backend_for(c.ta, c.tb, c.m, c.n, c.k);
  const std::vector<float> once = check_case(GemmBackend::automatic, c);
  for (int i = 0; i < 5; ++i) {
    EXPECT_EQ(gemm_backend_for(c.ta, c.tb, c.m, c.n, c.k), first);
    EXPECT_EQ(check_case(GemmBackend::automatic, c), once) << "call " << i + 2;
  }
  int seen = 0;
  for (const GemmCalibration& cal : gemm_calibrations()) {
    if (cal.trans_a == c.ta && cal.trans_b == c.tb && cal.m == c.m && cal.n == c.n && cal.k == c.k) {
      ++seen;
      EXPECT_EQ(cal.chosen, first);
      EXPECT_GT(cal.openblas_s, 0.0);
      EXPECT_GT(cal.onednn_s, 0.0);
      // oneDNN is the tie-breaker: OpenBLAS only when clearly faster.
      if (cal.chosen == GemmBackend::openblas) {
        EXPECT_LT(cal.openblas_s, cal.onednn_s);
      }
    }
  }
  EXPECT_EQ(seen, onednn_available() ? 1 : 0);
  if (!onednn_available()) {
    EXPECT_EQ(first, GemmBackend::openblas);
  }
  // The auto result is one library's result exactly.
  EXPECT_EQ(once, check_case(first, c));
}

TEST(Gemm, DegenerateShapesAndBadArgumentsSayWhatIsWrong) {
  for (GemmBackend lib : libraries()) {
    std::vector<float> c = {1, 2, 3, 4, 5, 6};
    sgemm_on(lib, false, false, 2, 3, 0, 1.0f, nullptr, 1, nullptr, 3, 0.5f, c.data(), 3);  // K = 0: C = beta C
    EXPECT_EQ(c, (std::vector<float>{0.5f, 1, 1.5f, 2, 2.5f, 3}));
    sgemm_on(lib, false, false, 0, 3, 4, 1.0f, nullptr, 4, nullptr, 3, 0.0f, nullptr, 3);  // M = 0: nothing
    std::vector<float> a(12), b(12);
    try {
      sgemm_on(lib, false, false, 3, 3, 4, 1.0f, a.data(), 3, b.data(), 3, 0.0f, c.data(), 3);
      ADD_FAILURE() << "lda 3 < K 4 was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("lda 3 ldb 3 too small for M 3 N 3 K 4 trans NN"), std::string::npos)
          << e.what();
    }
  }
  try {
    parse_gemm_backend("mkl");
    ADD_FAILURE() << "mkl was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("gemm backend 'mkl': expected auto, openblas or onednn"), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(parse_gemm_backend("auto"), GemmBackend::automatic);
  EXPECT_EQ(parse_gemm_backend("onednn"), GemmBackend::onednn);
  if (!onednn_available()) {
    EXPECT_THROW(set_gemm_backend(GemmBackend::onednn), Error);
  }
}

int threads_of_this_process() {
  int n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/task")) ++n;
  return n;
}

// Waits (up to 10 s) until no thread of this process but the caller is running, so that CPU time
// measured next is the caller's and whatever it starts: OpenBLAS's server threads spin on
// sched_yield for about 2^28 cycles after the library loads before they sleep, and on an idle
// core that spin alone reads as a second busy thread. Returns the threads still running.
std::string wait_for_other_threads_to_sleep() {
  const std::string self = std::to_string(gettid());
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  std::string running;
  do {
    running.clear();
    for (const auto& e : std::filesystem::directory_iterator("/proc/self/task")) {
      const std::string tid = e.path().filename().string();
      std::ifstream stat(e.path() / "stat");
      const std::string line((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
      const size_t close = line.rfind(')');  // state follows "pid (comm) "
      if (tid != self && close != std::string::npos && close + 2 < line.size() && line[close + 2] == 'R') {
        running += " " + tid;
      }
    }
    if (running.empty()) return running;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));  // polling a condition, with a deadline
  } while (std::chrono::steady_clock::now() < deadline);
  return running;
}

// OpenMP's thread count is per calling thread; set_num_threads must reach oneDNN on threads that
// never set it (ranks and pipeline stages are threads): one thread starts no OpenMP team, two do.
TEST(Gemm, OneThreadIsOneThreadOnEveryCallingThread) {
  if (!onednn_available()) GTEST_SKIP() << "built without oneDNN";
  const int saved = gemm_threads();
  const Case c{false, false, 384, 384, 384};
  int before1 = 0, after1 = 0, before2 = 0, after2 = 0;
  double cpu_per_wall = 0;
  set_num_threads(1);
  std::string busy;
  std::thread([&] {
    busy = wait_for_other_threads_to_sleep();
    before1 = threads_of_this_process();
    const auto w0 = std::chrono::steady_clock::now();
    const std::clock_t c0 = std::clock();
    for (int i = 0; i < 10; ++i) check_case(GemmBackend::onednn, {false, false, 256, 256, 256});
    cpu_per_wall = static_cast<double>(std::clock() - c0) / CLOCKS_PER_SEC /
                   std::chrono::duration<double>(std::chrono::steady_clock::now() - w0).count();
    after1 = threads_of_this_process();
  }).join();
  EXPECT_EQ(after1, before1) << "oneDNN started threads with set_num_threads(1)";
  EXPECT_EQ(busy, "") << "threads still running 10 s after the test started";
  EXPECT_LT(cpu_per_wall, 1.3) << "CPU time over wall time with one thread";
  if (std::thread::hardware_concurrency() >= 2) {
    set_num_threads(2);
    std::thread([&] {
      before2 = threads_of_this_process();
      check_case(GemmBackend::onednn, c);
      after2 = threads_of_this_process();
    }).join();
    EXPECT_GT(after2, before2) << "oneDNN did not use the second thread of set_num_threads(2)";
  }
  set_num_threads(saved > 0 ? saved : static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
}

// ---------------------------------------------------------------- bf16 products

// Restores the product precision a test changed.
struct PrecisionGuard {
  Precision saved = matmul_precision();
  explicit PrecisionGuard(Precision p) { set_matmul_precision(p); }
  ~PrecisionGuard() { set_matmul_precision(saved); }
};

// The linear layer's product with its bias (sgemm_bias, gemm_bf16_bias) on each library and with
// bf16 products: every element within the summation bound of the exact product plus the bias
// (a bias fused into oneDNN's matmul, or C filled with it and the product added), every
// transpose, K = 0 (C is the bias) and the MLP's and GPT's shapes.
TEST(Gemm, WithBiasEachRouteIsTheProductPlusTheBias) {
  PolicyGuard guard;
  const double u = std::ldexp(1.0, -24);
  for (const Precision precision : {Precision::f32, Precision::bf16}) {
    PrecisionGuard p(precision);
    const bool bf16 = precision == Precision::bf16;
    auto operand = [bf16](float v) { return bf16 ? bf16_to_f32(f32_to_bf16(v)) : v; };
    for (GemmBackend lib : libraries()) {
      set_gemm_backend(lib);
      for (const Case& c : std::vector<Case>{{false, true, 64, 1024, 784},
                                             {false, true, 200, 384, 128},
                                             {false, false, 33, 47, 10},
                                             {true, false, 5, 7, 3},
                                             {true, true, 1, 1, 1},
                                             {false, true, 6, 5, 0}}) {
        const int64_t lda = c.ta ? c.m : c.k, ldb = c.tb ? c.k : c.n;
        Generator gen(static_cast<uint64_t>(c.m * 13 + c.n * 5 + c.k + 1));
        const std::vector<float> a = Tensor::randn({std::max<int64_t>(1, c.m * c.k)}, gen).to_vector();
        const std::vector<float> b = Tensor::randn({std::max<int64_t>(1, c.k * c.n)}, gen).to_vector();
        const std::vector<float> bias = Tensor::randn({c.n}, gen).to_vector();
        std::vector<float> out(static_cast<size_t>(c.m * c.n), std::nanf(""));
        if (bf16) {
          std::vector<uint16_t> a16(a.size()), b16(b.size());
          for (size_t i = 0; i < a.size(); ++i) a16[i] = f32_to_bf16(a[i]);
          for (size_t i = 0; i < b.size(); ++i) b16[i] = f32_to_bf16(b[i]);
          gemm_bf16_bias(c.ta, c.tb, c.m, c.n, c.k, a16.data(), lda, b16.data(), ldb, bias.data(), out.data());
        } else {
          sgemm_bias(c.ta, c.tb, c.m, c.n, c.k, a.data(), lda, b.data(), ldb, bias.data(), out.data());
        }
        const double gamma = static_cast<double>(c.k + 1) * u / (1.0 - static_cast<double>(c.k + 1) * u);
        int wrong = 0;
        for (int64_t i = 0; i < c.m; ++i) {
          for (int64_t j = 0; j < c.n; ++j) {
            double exact = bias[static_cast<size_t>(j)], magnitude = std::fabs(exact);
            for (int64_t q = 0; q < c.k; ++q) {
              const double x = operand(a[static_cast<size_t>(c.ta ? q * lda + i : i * lda + q)]);
              const double y = operand(b[static_cast<size_t>(c.tb ? j * ldb + q : q * ldb + j)]);
              exact += x * y;
              magnitude += std::fabs(x * y);
            }
            const double got = out[static_cast<size_t>(i * c.n + j)];
            if (!(std::fabs(got - exact) <= (gamma + 3 * u) * magnitude + 1e-30) && ++wrong <= 3) {
              ADD_FAILURE() << gemm_backend_name(lib) << (bf16 ? " bf16 " : " f32 ") << describe(c) << ": C[" << i
                            << "][" << j << "] = " << got << ", reference " << exact;
            }
          }
        }
        EXPECT_EQ(wrong, 0) << gemm_backend_name(lib) << (bf16 ? " bf16 " : " f32 ") << describe(c);
      }
    }
  }
}

// A residual given to sgemm_bias or gemm_bf16_bias (oneDNN's binary post-op, or the pass after
// OpenBLAS or the bf16 fallback) is added last: the bits of the same call without it plus the
// residual, on each library, both precisions and the linear layers' shapes (K = 0 included).
TEST(Gemm, WithResidualEachRouteAddsItLastBitForBit) {
  PolicyGuard guard;
  for (const Precision precision : {Precision::f32, Precision::bf16}) {
    PrecisionGuard p(precision);
    const bool bf16 = precision == Precision::bf16;
    for (GemmBackend lib : libraries()) {
      set_gemm_backend(lib);
      for (const Case& c : std::vector<Case>{{false, true, 2048, 128, 128},
                                             {false, true, 200, 128, 512},
                                             {false, true, 33, 47, 10},
                                             {false, true, 6, 5, 0}}) {
        Generator gen(static_cast<uint64_t>(c.m * 7 + c.n * 3 + c.k + 2));
        const std::vector<float> a = Tensor::randn({std::max<int64_t>(1, c.m * c.k)}, gen).to_vector();
        const std::vector<float> b = Tensor::randn({std::max<int64_t>(1, c.k * c.n)}, gen).to_vector();
        const std::vector<float> bias = Tensor::randn({c.n}, gen).to_vector();
        const std::vector<float> residual = Tensor::randn({c.m * c.n}, gen).to_vector();
        std::vector<float> plain(static_cast<size_t>(c.m * c.n), std::nanf(""));
        std::vector<float> added(plain.size(), std::nanf(""));
        const int64_t k = std::max<int64_t>(1, c.k);
        if (bf16) {
          std::vector<uint16_t> a16(a.size()), b16(b.size());
          for (size_t i = 0; i < a.size(); ++i) a16[i] = f32_to_bf16(a[i]);
          for (size_t i = 0; i < b.size(); ++i) b16[i] = f32_to_bf16(b[i]);
          gemm_bf16_bias(c.ta, c.tb, c.m, c.n, c.k, a16.data(), k, b16.data(), k, bias.data(), plain.data());
          gemm_bf16_bias(c.ta, c.tb, c.m, c.n, c.k, a16.data(), k, b16.data(), k, bias.data(), added.data(),
                         residual.data());
        } else {
          sgemm_bias(c.ta, c.tb, c.m, c.n, c.k, a.data(), k, b.data(), k, bias.data(), plain.data());
          sgemm_bias(c.ta, c.tb, c.m, c.n, c.k, a.data(), k, b.data(), k, bias.data(), added.data(), residual.data());
        }
        int wrong = 0;
        for (size_t i = 0; i < plain.size(); ++i) {
          const float want = residual[i] + plain[i];
          if (std::memcmp(&want, &added[i], sizeof(float)) != 0 && ++wrong <= 3) {
            ADD_FAILURE() << gemm_backend_name(lib) << (bf16 ? " bf16 " : " f32 ") << describe(c) << ": C[" << i
                          << "] = " << added[i] << ", product + bias + residual " << want;
          }
        }
        EXPECT_EQ(wrong, 0) << gemm_backend_name(lib) << (bf16 ? " bf16 " : " f32 ") << describe(c);
      }
    }
  }
}

// With bf16 products every element is within the f32-summation bound of the product of the
// operands rounded to bf16 (check_case's reference rounds them): the operands are bf16, the sums
// f32. Against the unrounded operands that is within (2^-7 + 2^-16 + gamma_K) sum |a b|.
TEST(GemmBf16, ProductsRoundBothOperandsToBf16AndSumInF32) {
  PrecisionGuard bf16(Precision::bf16);
  for (const Case& c : cases()) check_case(GemmBackend::automatic, c);
  for (GemmBackend lib : libraries()) check_case(lib, {false, true, 67, 129, 511});
}

// gemm_bf16 on operands already rounded (strided, with alpha, beta and a strided C) gives the
// bits sgemm gives under bf16 products on the f32 operands: the same rounding, the same kernel.
TEST(GemmBf16, FromRoundedOperandsEqualsTheF32EntryPointBitwise) {
  PrecisionGuard bf16(Precision::bf16);
  for (const Case& c : cases()) {
    const int64_t lda = (c.ta ? c.m : c.k) + c.pad, ldb = (c.tb ? c.k : c.n) + c.pad, ldc = c.n + c.pad;
    Generator gen(static_cast<uint64_t>(c.m * 7 + c.n * 3 + c.k));
    const std::vector<float> a = Tensor::randn({(c.ta ? c.k : c.m) * lda}, gen).to_vector();
    const std::vector<float> b = Tensor::randn({(c.tb ? c.n : c.k) * ldb}, gen).to_vector();
    const std::vector<float> c0 = Tensor::randn({c.m * ldc}, gen).to_vector();
    std::vector<uint16_t> a16(a.size()), b16(b.size());
    for (size_t i = 0; i < a.size(); ++i) a16[i] = f32_to_bf16(a[i]);
    for (size_t i = 0; i < b.size(); ++i) b16[i] = f32_to_bf16(b[i]);
    std::vector<float> want = c0, got = c0;
    sgemm(c.ta, c.tb, c.m, c.n, c.k, c.alpha, a.data(), lda, b.data(), ldb, c.beta, want.data(), ldc);
    gemm_bf16(c.ta, c.tb, c.m, c.n, c.k, c.alpha, a16.data(), lda, b16.data(), ldb, c.beta, got.data(), ldc);
    EXPECT_EQ(got, want) << describe(c);
  }
}

// Rounding matters: the same product in f32 differs from it (so bf16 was not silently f32).
TEST(GemmBf16, DiffersFromTheF32Product) {
  const Case c{false, true, 64, 96, 128};
  const std::vector<float> f32 = check_case(GemmBackend::automatic, c);
  PrecisionGuard bf16(Precision::bf16);
  const std::vector<float> b = check_case(GemmBackend::automatic, c);
  double diff = 0, norm = 0;
  for (size_t i = 0; i < f32.size(); ++i) {
    diff += (static_cast<double>(b[i]) - f32[i]) * (static_cast<double>(b[i]) - f32[i]);
    norm += static_cast<double>(f32[i]) * f32[i];
  }
  EXPECT_GT(std::sqrt(diff / norm), 1e-4);
  EXPECT_LT(std::sqrt(diff / norm), 1e-2);
}

// The route is oneDNN's matmul on bf16 instructions where the CPU has them (and ONEDNN_MAX_CPU_ISA
// lets oneDNN use them), else the fallback, and it says which.
TEST(GemmBf16, TheRouteIsNativeWhereTheCpuHasBf16InstructionsAndSaysSo) {
  const std::string route = bf16_products_route();
  const std::string isa = onednn_isa();
  const bool has = onednn_available() && (isa == "avx512_core_bf16" || isa == "avx512_core_amx");
  EXPECT_EQ(bf16_products_native(), has) << route;
  // A bf16 result (linear's, for the attention's qkv) on the same kernels, where the products run.
  EXPECT_EQ(detail::bf16_results_native(), has) << route;
  if (has) {
    EXPECT_EQ(route.rfind("bf16 products: oneDNN's matmul (" + isa, 0), 0u) << route;
    EXPECT_EQ(route.find("fallback"), std::string::npos) << route;
  } else {
    EXPECT_EQ(route.rfind("bf16 products: fallback: operands rounded to bf16, products and sums in f32", 0), 0u)
        << route;
  }
}

// The child half of the next test: runs only in the process that test starts, with oneDNN held
// to AVX2 before its first call.
TEST(GemmAvx2Child, OneDnnRunsOnAvx2AndMatchesTheReference) {
  const char* child = std::getenv("DTRAIN_GEMM_TEST_CHILD");
  if (child == nullptr || std::string(child) != "avx2") GTEST_SKIP() << "runs in Gemm.OneDnnHeldToAvx2...'s child";
  ASSERT_TRUE(onednn_available());
  EXPECT_EQ(gemm_backend(), GemmBackend::onednn) << "DTRAIN_GEMM=onednn was not read";
  const std::string isa = onednn_isa();
  EXPECT_EQ(isa.find("avx512"), std::string::npos) << isa;
  if (__builtin_cpu_supports("avx2")) {
    EXPECT_EQ(isa, "avx2");
  }
  for (const Case& c : cases()) check_case(GemmBackend::onednn, c);
  for (const Case& c : cases()) check_case(GemmBackend::automatic, c);
  // dtrain's own kernels follow the same cap, and bf16 products take the fallback.
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    EXPECT_EQ(std::string(kernels::table().isa), "avx2");
  }
  EXPECT_FALSE(bf16_products_native()) << bf16_products_route();
  EXPECT_FALSE(detail::bf16_results_native());
  EXPECT_NE(bf16_products_route().find("fallback"), std::string::npos) << bf16_products_route();
}

// A CPU without AVX-512: oneDNN's kernels held to AVX2 (ONEDNN_MAX_CPU_ISA, read once before the
// first call, so in a fresh process), and with them dtrain's own kernels (tensor/kernels.h) and
// the bf16 products (the fallback: no bf16 instructions below AVX-512). Products against the
// double reference, every op's values and finite-difference gradients, the kernels' references,
// bf16 against f32, models and optimizers: all in the child, every product on oneDNN.
TEST(Gemm, OneDnnHeldToAvx2MatchesTheReferenceAndGradients) {
  if (!onednn_available()) GTEST_SKIP() << "built without oneDNN";
  const std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  // Everything that computes: products (f32 and bf16), every op's values and gradients, the
  // kernels, the models and the optimizers.
  const std::string filter =
      "GemmAvx2Child.*:GemmBf16.*:Bf16Ops.*:Ops*:Kernels.*:Autograd*:Nn*:Optim*:Gemm.EachLibrary*:Gemm.EveryLibrary*";
  const std::string cmd = "ONEDNN_MAX_CPU_ISA=AVX2 DTRAIN_GEMM=onednn DTRAIN_GEMM_TEST_CHILD=avx2 timeout -k 5 240 " +
                          self + " --gtest_filter='" + filter + "' 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  ASSERT_NE(p, nullptr);
  std::string out;
  std::array<char, 4096> buf{};
  while (fgets(buf.data(), buf.size(), p) != nullptr) out += buf.data();
  const int status = pclose(p);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << out;
  EXPECT_NE(out.find("[       OK ] GemmAvx2Child.OneDnnRunsOnAvx2AndMatchesTheReference"), std::string::npos) << out;
  EXPECT_NE(out.find("[       OK ] OpsMatmul.Gradients"), std::string::npos) << out;
  EXPECT_NE(out.find("[       OK ] OpsAttention.Gradient"), std::string::npos) << out;
  EXPECT_NE(out.find("[       OK ] OpsWideRows."), std::string::npos) << out;
  EXPECT_NE(out.find("[       OK ] GemmBf16.ProductsRoundBothOperandsToBf16AndSumInF32"), std::string::npos) << out;
  EXPECT_NE(out.find("[       OK ] Bf16Ops.AGptLossAndParameterGradientsStayWithinBf16RoundingOfF32"),
            std::string::npos)
      << out;
  // dtrain's AVX512_BF16 attention kernel is off below AVX-512: its test skips, saying why.
  EXPECT_NE(out.find("[  SKIPPED ] Bf16Ops.AttentionKernelMatchesLibraryProductsOnEveryShape"), std::string::npos)
      << out;
  EXPECT_EQ(out.find("FAILED"), std::string::npos) << out;
}

std::string run_command(const std::string& cmd, int* code) {
  FILE* p = popen(cmd.c_str(), "r");
  std::string out;
  std::array<char, 4096> buf{};
  while (p != nullptr && fgets(buf.data(), buf.size(), p) != nullptr) out += buf.data();
  const int status = p != nullptr ? pclose(p) : -1;
  *code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return out;
}

// The auto choice is made once per machine: a second process reads the first one's decision
// from the cache file instead of timing the shape again, and a decision in the file is obeyed.
TEST(Gemm, AutoChoicesAreSharedByEveryProcessThroughTheCacheFile) {
  if (!onednn_available()) GTEST_SKIP() << "built without oneDNN: auto is OpenBLAS";
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("dtrain-gemm-cache-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  const std::string bench = "DTRAIN_GEMM=auto DTRAIN_GEMM_CACHE=" + dir.string() + " timeout -k 5 120 " +
                            std::string(DTRAIN_BINARY) + " bench gemm --shapes square --seconds 0.05 --size ";
  auto backend_of = [&](int size) {
    int code = 0;
    const std::string out = run_command(bench + std::to_string(size) + " 2>&1", &code);
    EXPECT_EQ(code, 0) << out;
    const size_t at = out.find("\"backend\":\"");
    return at == std::string::npos ? out : out.substr(at + 11, out.find('"', at + 11) - at - 11);
  };
  const std::string first = backend_of(96);
  EXPECT_TRUE(first == "openblas" || first == "onednn") << first;
  EXPECT_EQ(backend_of(96), first);
  std::vector<std::filesystem::path> files;
  for (const auto& e : std::filesystem::directory_iterator(dir)) files.push_back(e.path());
  ASSERT_EQ(files.size(), 1u);
  std::string text;
  {
    std::ifstream in(files[0]);
    text.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  EXPECT_EQ(text.rfind("dtrain-gemm-auto 1\n# OpenBLAS", 0), 0u) << text;
  const std::string line = "0 0 96 96 96 1 " + first + " ";
  EXPECT_NE(text.find(line), std::string::npos) << text;
  EXPECT_EQ(text.find(line), text.rfind(line)) << "the second process timed the shape again:\n" << text;
  // A decision in the file is obeyed (here one no timing would make for a shape of 80), and a
  // damaged line is skipped.
  {
    std::ofstream out(files[0], std::ios::app);
    out << "garbage line\n0 0 80 80 80 1 mkl 1 1\n0 0 80 80 80 1 openblas 2e-05 1\n";
  }
  EXPECT_EQ(backend_of(80), "openblas");
  std::filesystem::remove_all(dir);
}

// Without DTRAIN_GEMM every product runs on oneDNN (a pinned library: the same bits on every run),
// or on OpenBLAS in a build without it.
TEST(Gemm, TheDefaultPolicyIsOneDnnWhereTheBuildHasIt) {
  int code = 0;
  const std::string out = run_command("env -u DTRAIN_GEMM timeout -k 5 120 " + std::string(DTRAIN_BINARY) +
                                          " bench gemm --shapes square --seconds 0.02 --size 64 2>&1",
                                      &code);
  ASSERT_EQ(code, 0) << out;
  const std::string want = onednn_available() ? "onednn" : "openblas";
  EXPECT_NE(out.find("\"gemm\":\"" + want + "\""), std::string::npos) << out;
  EXPECT_NE(out.find("\"backend\":\"" + want + "\""), std::string::npos) << out;
}

// The probe's peak is positive and no gemm library beats it (25% slack for a machine whose load
// changed between the two measurements; a probe that missed the widest unit is off by 2x).
TEST(Peak, ProbeIsPositiveAndNotBelowTheMeasuredSgemmRate) {
  const double peak = measured_peak_flops(1, Precision::f32);
  EXPECT_GT(peak, 1e8) << peak_probe_isa(Precision::f32);
  EXPECT_EQ(measured_peak_flops(1, Precision::f32), peak) << "not cached";
  const int saved = gemm_threads();
  set_num_threads(1);
  const int64_t n = 256;
  Generator gen(3);
  const std::vector<float> a = Tensor::randn({n * n}, gen).to_vector(), b = Tensor::randn({n * n}, gen).to_vector();
  std::vector<float> c(static_cast<size_t>(n * n));
  for (GemmBackend lib : libraries()) {
    double best = 0;
    for (int r = 0; r < 5; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < 4; ++i)
        sgemm_on(lib, false, false, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(), n);
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      best = std::max(best, 4 * 2.0 * static_cast<double>(n * n * n) / s);
    }
    EXPECT_LE(best, 1.25 * peak) << gemm_backend_name(lib) << " " << best / 1e9 << " GFLOP/s against a peak of "
                                 << peak / 1e9 << " (" << peak_probe_isa(Precision::f32) << ")";
  }
  set_num_threads(saved > 0 ? saved : static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
  if (std::string(peak_probe_isa(Precision::bf16)) != "none") {
    EXPECT_GT(measured_peak_flops(1, Precision::bf16), 1e8);
  } else {
    EXPECT_EQ(measured_peak_flops(1, Precision::bf16), 0.0);
  }
  EXPECT_THROW(measured_peak_flops(0, Precision::f32), Error);
}

}  // namespace
}  // namespace dtrain
