// The one single-precision matrix product behind every op (linear, matmul, attention), on
// OpenBLAS or oneDNN.
//
// Vocabulary: a *library* is OpenBLAS or oneDNN; the *policy* is a library or `automatic`.
// The policy comes from DTRAIN_GEMM=onednn|openblas|auto (default onednn where the build has it,
// else openblas; see gemm.cpp) at the first product,
// or from set_gemm_backend. Under auto each *shape* (trans_a, trans_b, M, N, K, threads) is
// *calibrated* on its first call: both libraries run it on the call's own operands a few times,
// interleaved (on one thread timed by the thread's CPU time, which other processes' load does
// not inflate), and the shape keeps the faster library. oneDNN is the tie-breaker: OpenBLAS is
// kept only when it is faster by more than a margin (gemm.cpp).
//
// The bits of a product depend on the library, so runs agree bitwise only if their choices
// agree. A choice is therefore made once per machine, not per process: it is kept in a cache
// file (gemm_cache_file(); DTRAIN_GEMM_CACHE=DIR moves it, =off keeps choices in the process)
// that every process on the machine reads and appends under a lock, so a second run, and the
// other data-parallel ranks on the host, use the first decision. Ranks on different hosts may
// still choose differently (their averaged parameters stay identical all the same); runs that
// must reproduce bitwise across machines pin the library: DTRAIN_GEMM=onednn or openblas.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "dtrain/tensor/peak.h"

namespace dtrain {

enum class GemmBackend { automatic, openblas, onednn };

/// "auto", "openblas", "onednn".
const char* gemm_backend_name(GemmBackend backend);
/// Parses auto | openblas | onednn; throws naming the text otherwise.
GemmBackend parse_gemm_backend(std::string_view text);

/// Whether this build has oneDNN (libdnnl-dev found at configure time).
bool onednn_available();
/// The instruction set oneDNN dispatches to on this CPU ("avx512_core_bf16", "avx2", ...; it
/// honours ONEDNN_MAX_CPU_ISA), or "none" without oneDNN.
std::string onednn_isa();
/// The libraries linked, their versions and the kernels they chose on this CPU, for reports:
/// "OpenBLAS 0.3.21 (core Haswell), oneDNN 2.6.3 (avx512_core_bf16)".
std::string gemm_libraries();

/// The policy in force (reads DTRAIN_GEMM on first use).
GemmBackend gemm_backend();
/// Overrides DTRAIN_GEMM for this process; onednn throws if this build has no oneDNN.
void set_gemm_backend(GemmBackend backend);

/// C (M, N) = alpha * op(A) op(B) + beta * C, all row-major. op(A) is (M, K): A is stored
/// (M, K) with row stride lda >= K, or (K, M) with lda >= M when trans_a; likewise op(B) (K, N)
/// from B (K, N), ldb >= N, or (N, K), ldb >= K when trans_b; C (M, N) with ldc >= N. beta = 0
/// never reads C. Runs on the library the policy picks for this shape.
void sgemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
           const float* b, int64_t ldb, float beta, float* c, int64_t ldc);
/// The linear layer's product: C (M, N) = op(A) op(B) + bias, the N values of `bias` added to
/// every row of C (dense: ldc = N). Where the shape runs on oneDNN, its matmul primitive adds the
/// bias as it writes C (one pass over C); elsewhere C is filled with the bias and the product
/// added to it (beta 1). The two differ in the last bits, like the two libraries.
/// With a `residual` R (M, N), dense, not C: C = R + (op(A) op(B) + bias), the bits of adding R
/// afterwards (a residual connection); oneDNN adds it in the same epilogue (a binary post-op),
/// elsewhere a pass over C adds it.
void sgemm_bias(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda,
                const float* b, int64_t ldb, const float* bias, float* c, const float* residual = nullptr);
/// sgemm in f32 whatever matmul_precision() says: for an op whose products are faster in f32
/// at its shapes (causal_attention's per-head products below attention_bf16_min_head_dim()).
void sgemm_f32(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
               const float* b, int64_t ldb, float beta, float* c, int64_t ldc);
/// The same product on one named library (automatic: as sgemm), whatever the policy.
void sgemm_on(GemmBackend library, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
              const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc);

/// One shape's calibration under auto: the best time of each library and the one kept.
struct GemmCalibration {
  bool trans_a = false, trans_b = false;
  int64_t m = 0, n = 0, k = 0;
  int threads = 0;
  double openblas_s = 0, onednn_s = 0;  // best of the interleaved repetitions
  GemmBackend chosen = GemmBackend::openblas;
  bool cached = false;  // read from the cache file (decided by an earlier process), not timed here
};
/// The library sgemm runs this shape on now: the policy's library, or under auto the shape's
/// calibration (made now on scratch operands if the shape has not been seen).
GemmBackend gemm_backend_for(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k);
/// The shapes this process has run under auto with their calibrations (timed here or read from
/// the cache file), in the order they were first met.
std::vector<GemmCalibration> gemm_calibrations();
/// The cache file of this machine's calibrations, or "" when DTRAIN_GEMM_CACHE=off.
std::string gemm_cache_file();

/// The thread count set_num_threads gave both libraries (0: never set, each library's default).
int gemm_threads();

/// The precision of every product from now on, process-wide (default f32). bf16: both operands
/// are rounded to bf16 and the products summed in f32 (`--precision bf16`), on oneDNN's matmul
/// where oneDNN has bf16 instructions on this CPU (AVX512_BF16, AMX); elsewhere the fallback
/// rounds the operands to bf16 and runs the f32 sgemm (the same arithmetic: a product of two bf16
/// values is exact in f32). The first switch to bf16 logs the route (bf16_products_route()).
void set_matmul_precision(Precision precision);
Precision matmul_precision();
/// The product --precision bf16 runs, from operands already rounded to bf16 (their bits, laid out
/// as sgemm's A and B with the same leading dimensions); C in f32 as sgemm's. For ops that use one
/// operand in several products (linear's input, weight and output gradient), rounded once.
void gemm_bf16(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const uint16_t* a, int64_t lda,
               const uint16_t* b, int64_t ldb, float beta, float* c, int64_t ldc);
/// gemm_bf16 with a bias, as sgemm_bias: C (M, N), dense, = op(A) op(B) + bias on every row
/// [+ a residual, as sgemm_bias adds it].
void gemm_bf16_bias(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const uint16_t* a, int64_t lda,
                    const uint16_t* b, int64_t ldb, const float* bias, float* c, const float* residual = nullptr);
/// gemm_bf16 (bias: nullptr, or as gemm_bf16_bias) with C (M, N), dense, written as bf16: the f32
/// sums rounded to nearest even, for a product whose result is only ever read as a bf16 operand
/// (the attention's qkv). oneDNN rounds them in its epilogue: the bits of Tensor::to(DType::bf16),
/// except that f32 denormals (below 1.2e-38) become zero there.
void gemm_bf16_to_bf16(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const uint16_t* a, int64_t lda,
                       const uint16_t* b, int64_t ldb, const float* bias, uint16_t* c);
/// What bf16 products run on here, or what they fall back to and why, for logs and reports.
std::string bf16_products_route();
/// Whether bf16 products run on bf16 instructions (false: the fallback).
bool bf16_products_native();

}  // namespace dtrain
