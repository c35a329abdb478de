// dtrain bench gemm: the core's peak from the FMA probe (tensor/peak.h), each gemm library's
// GFLOP/s on the shapes dtrain's models run (the MLP 784-1024-1024-10 at batch 64, the GPT at
// width 128, sequence 128, batch 16: its linears, their gradients and the attention's per-head
// products with their real strides), on a grid of sizes (M 64..4096, N and K 10..4096, every
// transpose), and last the old one-line record of the N x N x N product of --size. Beside the f32
// libraries, the bf16 products of --precision bf16 (gemm.h: bf16 operands, f32 sums; the route
// they take on this CPU is printed in the header).
//
// Per shape the libraries are measured in interleaved rounds (OpenBLAS, oneDNN, bf16, OpenBLAS, ...)
// and each keeps its best round: the machine's noise only ever slows a round down. Each round is
// timed both by the wall clock and by the process's CPU time; on one thread the table shows the
// latter (the rate while the core was ours), the JSON both, and cpu_per_wall their ratio.
#include "bench_gemm.h"

#include <time.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "dtrain/core/error.h"
#include "dtrain/tensor/autograd.h"
#include "dtrain/tensor/gemm.h"
#include "dtrain/tensor/ops.h"
#include "dtrain/tensor/peak.h"
#include "dtrain/tensor/random.h"

namespace dtrain::tools {

namespace {

struct GemmShape {
  const char* what;
  bool ta, tb;
  int64_t m, n, k;
  int64_t lda = 0, ldb = 0, ldc = 0;  // 0: packed
};

// (B, T, C) = (16, 128, 128), 4 heads of 32: rows M = B T = 2048; the attention's per-head
// operands are read in place from qkv (row stride 3C = 384) and written into (B, T, C).
const std::vector<GemmShape>& model_shapes() {
  static const std::vector<GemmShape> shapes = {
      {"mlp fc1 (784->1024)", false, true, 64, 1024, 784},
      {"mlp fc2 (1024->1024)", false, true, 64, 1024, 1024},
      {"mlp fc3 (1024->10)", false, true, 64, 10, 1024},
      {"mlp fc2 dX", false, false, 64, 1024, 1024},
      {"mlp fc3 dX", false, false, 64, 1024, 10},
      {"mlp fc1 dW", true, false, 1024, 784, 64},
      {"mlp fc2 dW", true, false, 1024, 1024, 64},
      {"mlp fc3 dW", true, false, 10, 1024, 64},
      {"gpt qkv (128->384)", false, true, 2048, 384, 128},
      {"gpt qkv dX", false, false, 2048, 128, 384},
      {"gpt qkv dW", true, false, 384, 128, 2048},
      {"gpt proj (128->128)", false, true, 2048, 128, 128},
      {"gpt proj dW", true, false, 128, 128, 2048},
      {"gpt fc (128->512)", false, true, 2048, 512, 128},
      {"gpt fc dX", false, false, 2048, 128, 512},
      {"gpt fc dW", true, false, 512, 128, 2048},
      {"gpt fc2 (512->128)", false, true, 2048, 128, 512},
      {"gpt fc2 dX", false, false, 2048, 512, 128},
      {"gpt fc2 dW", true, false, 128, 512, 2048},
      {"gpt head (128->256)", false, true, 2048, 256, 128},
      {"gpt head dW", true, false, 256, 128, 2048},
      {"attn S = Q K^T", false, true, 128, 128, 32, 384, 384, 128},
      {"attn O = P V", false, false, 128, 32, 128, 128, 384, 128},
      {"attn dK = dS^T Q", true, false, 128, 32, 128, 128, 384, 384},
      {"square 64", false, false, 64, 64, 64},
      {"square 256", false, false, 256, 256, 256},
      {"square 512", false, false, 512, 512, 512},
      {"square 512 NT", false, true, 512, 512, 512},
      {"square 512 TN", true, false, 512, 512, 512},
      {"square 512 TT", true, true, 512, 512, 512},
      {"square 1024", false, false, 1024, 1024, 1024},
      {"square 2048", false, false, 2048, 2048, 2048},
      {"odd 67x129x511", false, false, 67, 129, 511},
      {"tall K=10", false, false, 4096, 4096, 10},
      {"tall N=10", false, true, 4096, 10, 4096},
      {"wide M=64", false, true, 64, 4096, 4096},
      {"M=4096 1024x1024", false, false, 4096, 1024, 1024},
      {"M=4096 N=4096 K=128", false, false, 4096, 4096, 128},
  };
  return shapes;
}

double now_s() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

double cpu_s() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

// One way to run a product: an f32 library, or bf16 products (the library is then the fallback's).
struct Runner {
  const char* name;
  GemmBackend library;
  Precision precision;
};

struct Operands {
  GemmShape s;
  std::vector<float> a, b, c;
  explicit Operands(const GemmShape& shape) : s(shape) {
    if (s.lda == 0) s.lda = s.ta ? s.m : s.k;
    if (s.ldb == 0) s.ldb = s.tb ? s.k : s.n;
    if (s.ldc == 0) s.ldc = s.n;
    Generator gen(11);
    a = Tensor::randn({(s.ta ? s.k : s.m) * s.lda}, gen).to_vector();
    b = Tensor::randn({(s.tb ? s.n : s.k) * s.ldb}, gen).to_vector();
    c.assign(static_cast<size_t>(s.m * s.ldc), 0.0f);
  }
  double flops() const { return 2.0 * static_cast<double>(s.m) * static_cast<double>(s.n) * static_cast<double>(s.k); }
  void run(const Runner& r) {
    if (matmul_precision() != r.precision) set_matmul_precision(r.precision);
    sgemm_on(r.library, s.ta, s.tb, s.m, s.n, s.k, 1.0f, a.data(), s.lda, b.data(), s.ldb, 0.0f, c.data(), s.ldc);
  }
};

struct Rate {
  double gflops = 0;      // best round, against wall time
  double gflops_cpu = 0;  // best round, against the process's CPU time (the rate while it ran)
  double cpu_wall = 0;    // over all rounds
};

// Interleaved rounds of every runner for `seconds` in all; each round runs one for at least one
// call and about seconds / (rounds x runners). Products run at f32 afterwards.
std::vector<Rate> measure(Operands& o, const std::vector<Runner>& libs, double seconds) {
  constexpr int kRounds = 3;
  std::vector<Rate> rates(libs.size());
  std::vector<double> cpu(libs.size()), wall(libs.size());
  for (const Runner& lib : libs) o.run(lib);  // warm up: kernels generated, caches and pages touched
  const double per_round = seconds / (kRounds * static_cast<double>(libs.size()));
  const double start = now_s();
  for (int round = 0; round < kRounds; ++round) {
    for (size_t i = 0; i < libs.size(); ++i) {
      const double w0 = now_s(), c0 = cpu_s();
      int64_t calls = 0;
      double elapsed = 0;
      do {
        o.run(libs[i]);
        ++calls;
        elapsed = now_s() - w0;
      } while (elapsed < per_round);
      const double used = cpu_s() - c0;
      cpu[i] += used;
      wall[i] += elapsed;
      const double flop = o.flops() * static_cast<double>(calls);
      rates[i].gflops = std::max(rates[i].gflops, flop / elapsed / 1e9);
      if (used > 0) rates[i].gflops_cpu = std::max(rates[i].gflops_cpu, flop / used / 1e9);
    }
    if (now_s() - start > 4 * seconds) break;  // one call outlasts a round: one round is enough
  }
  for (size_t i = 0; i < libs.size(); ++i) rates[i].cpu_wall = wall[i] > 0 ? cpu[i] / wall[i] : 0;
  set_matmul_precision(Precision::f32);
  return rates;
}

std::string cpu_description() {
  std::ifstream in("/proc/cpuinfo");
  std::string line, model, flags;
  while (std::getline(in, line) && (model.empty() || flags.empty())) {
    auto value = [&] { return line.substr(std::min(line.size(), line.find(':') + 2)); };
    if (model.empty() && line.rfind("model name", 0) == 0) model = value();
    if (flags.empty() && line.rfind("flags", 0) == 0) flags = value();
  }
  std::string vector;
  std::istringstream words(flags);
  for (std::string w; words >> w;) {
    if (w == "fma" || w.rfind("avx", 0) == 0 || w.rfind("amx", 0) == 0) vector += (vector.empty() ? "" : " ") + w;
  }
  return (model.empty() ? std::string("unknown CPU") : model) + " [" + (vector.empty() ? "no AVX" : vector) + "]";
}

double round2(double x) { return std::round(x * 100.0) / 100.0; }

}  // namespace

int run_bench_gemm(const BenchOptions& opts, const GemmBenchOptions& gemm) {
  DT_CHECK(gemm.shapes == "models" || gemm.shapes == "square", "bench", "--shapes '{}': expected models or square",
           gemm.shapes);
  DT_CHECK(opts.size >= 1 && opts.seconds > 0 && gemm.shape_seconds > 0, "bench",
           "--size {} --seconds {} --shape-seconds {}: expected positive values", opts.size, opts.seconds,
           gemm.shape_seconds);
  set_num_threads(opts.threads);
  NoGradGuard no_grad;
  std::vector<Runner> libs = {{"openblas", GemmBackend::openblas, Precision::f32}};
  if (onednn_available()) libs.push_back({"onednn", GemmBackend::onednn, Precision::f32});
  const size_t bf16 = libs.size();
  libs.push_back({"bf16", GemmBackend::automatic, Precision::bf16});
  const GemmBackend policy = gemm_backend();
  const double peak_f32 = measured_peak_flops(opts.threads, Precision::f32) / 1e9;
  const double peak_bf16 = measured_peak_flops(opts.threads, Precision::bf16) / 1e9;

  std::printf("# %s\n# %s; %d thread%s; DTRAIN_GEMM %s\n", cpu_description().c_str(), gemm_libraries().c_str(),
              opts.threads, opts.threads == 1 ? "" : "s", gemm_backend_name(policy));
  std::printf("# peak (FMA probe): f32 %.1f GFLOP/s (%s), bf16 %.1f GFLOP/s (%s)\n", peak_f32,
              peak_probe_isa(Precision::f32), peak_bf16, peak_probe_isa(Precision::bf16));
  std::printf("# bf16 column: %s\n", bf16_products_route().c_str());
  if (gemm.shapes == "models") {
    if (!gemm.json) {
      std::printf(
          "# GFLOP/s against %s; ratio onednn / openblas; dtrain: the library the policy runs the shape on; %%peak: "
          "the faster f32 library against the f32 peak; bf16: --precision bf16's products\n",
          opts.threads == 1 ? "CPU time (the rate while running)" : "wall time");
      std::printf("%-22s %2s %5s %5s %5s %9s %9s %7s %8s %6s %9s\n", "shape", "op", "M", "N", "K", "openblas", "onednn",
                  "ratio", "dtrain", "%peak", "bf16");
    }
    for (const GemmShape& shape : model_shapes()) {
      Operands o(shape);
      const std::vector<Rate> r = measure(o, libs, gemm.shape_seconds * static_cast<double>(libs.size()));
      const GemmBackend used = gemm_backend_for(shape.ta, shape.tb, shape.m, shape.n, shape.k);
      // One thread: the rate while it ran (CPU time), blind to time slices given to other
      // processes on a shared machine; more threads: wall time.
      auto shown = [&](const Rate& x) { return opts.threads == 1 ? x.gflops_cpu : x.gflops; };
      const bool two = bf16 > 1;  // both f32 libraries
      const double best = std::max(shown(r[0]), two ? shown(r[1]) : 0.0);
      const std::string op = std::string(shape.ta ? "T" : "N") + (shape.tb ? "T" : "N");
      if (gemm.json) {
        nlohmann::ordered_json j = {{"op", "sgemm_shape"},    {"shape", shape.what}, {"trans", op},
                                    {"m", shape.m},           {"n", shape.n},        {"k", shape.k},
                                    {"threads", opts.threads}};
        j["openblas_gflops"] = round2(r[0].gflops);
        j["openblas_gflops_cpu"] = round2(r[0].gflops_cpu);
        j["openblas_cpu_per_wall"] = round2(r[0].cpu_wall);
        if (two) {
          j["onednn_gflops"] = round2(r[1].gflops);
          j["onednn_gflops_cpu"] = round2(r[1].gflops_cpu);
          j["onednn_cpu_per_wall"] = round2(r[1].cpu_wall);
        }
        j["bf16_gflops"] = round2(r[bf16].gflops);
        j["bf16_gflops_cpu"] = round2(r[bf16].gflops_cpu);
        j["dtrain_backend"] = gemm_backend_name(used);
        j["peak_f32_gflops"] = round2(peak_f32);
        std::printf("%s\n", j.dump().c_str());
      } else {
        std::printf("%-22s %2s %5ld %5ld %5ld %9.1f %9s %7s %8s %5.0f%% %9.1f\n", shape.what, op.c_str(),
                    static_cast<long>(shape.m), static_cast<long>(shape.n), static_cast<long>(shape.k), shown(r[0]),
                    two ? fmt::format("{:.1f}", shown(r[1])).c_str() : "-",
                    two ? fmt::format("{:.2f}", shown(r[1]) / shown(r[0])).c_str() : "-", gemm_backend_name(used),
                    peak_f32 > 0 ? 100.0 * best / peak_f32 : 0.0, shown(r[bf16]));
      }
      std::fflush(stdout);
    }
  }

  // The old record: N x N x N through ops::matmul (the policy's library), then each library.
  const int64_t n = opts.size;
  Generator gen(1);
  Tensor a = Tensor::randn({n, n}, gen);
  Tensor b = Tensor::randn({n, n}, gen);
  ops::matmul(a, b);  // warm up (and calibrate the shape under auto)
  int64_t iters = 0;
  const double t0 = now_s(), c0 = cpu_s();
  double elapsed = 0.0;
  while (elapsed < opts.seconds) {
    ops::matmul(a, b);
    ++iters;
    elapsed = now_s() - t0;
  }
  const double cpu_wall = (cpu_s() - c0) / elapsed;
  const double gflops = 2.0 * static_cast<double>(n * n * n) * static_cast<double>(iters) / elapsed / 1e9;
  Operands sq(GemmShape{"square", false, false, n, n, n});
  const std::vector<Rate> r = measure(sq, libs, opts.seconds);
  nlohmann::ordered_json j = {
      {"op", "sgemm"}, {"n", n}, {"threads", opts.threads}, {"iters", iters}, {"gflops", round2(gflops)}};
  j["cpu_per_wall"] = round2(cpu_wall);
  j["gemm"] = gemm_backend_name(policy);
  j["backend"] = gemm_backend_name(gemm_backend_for(false, false, n, n, n));
  j["openblas_gflops"] = round2(r[0].gflops);
  j["openblas_gflops_cpu"] = round2(r[0].gflops_cpu);
  if (bf16 > 1) {
    j["onednn_gflops"] = round2(r[1].gflops);
    j["onednn_gflops_cpu"] = round2(r[1].gflops_cpu);
  }
  j["bf16_gflops"] = round2(r[bf16].gflops);
  j["bf16_gflops_cpu"] = round2(r[bf16].gflops_cpu);
  j["bf16_native"] = bf16_products_native();
  j["onednn_isa"] = onednn_isa();
  j["peak_f32_gflops"] = round2(peak_f32);
  j["peak_f32_isa"] = peak_probe_isa(Precision::f32);
  j["peak_bf16_gflops"] = round2(peak_bf16);
  j["peak_bf16_isa"] = peak_probe_isa(Precision::bf16);
  std::printf("%s\n", j.dump().c_str());
  return 0;
}

}  // namespace dtrain::tools
