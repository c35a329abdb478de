// Between gemm.cpp (the entry point, f32 libraries, threads) and gemm_bf16.cpp (bf16 products).
#pragma once

#include <cstdint>
#include <string>

#if DTRAIN_HAVE_ONEDNN
#include <oneapi/dnnl/dnnl.hpp>
#endif

#include "dtrain/tensor/gemm.h"

namespace dtrain::detail {

/// An f32 product on `library` (automatic: the policy's library for this shape), arguments
/// already checked by sgemm_on.
void run_f32_library(GemmBackend library, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                     const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc);

/// The library that runs an f32 product: `library`, or for automatic the policy's (calibrating
/// the shape on first use under auto).
GemmBackend library_for(GemmBackend library, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                        const float* a, int64_t lda, const float* b, int64_t ldb);
/// Every one of the M rows of C (M, N), dense, set to the N values of `bias`.
void fill_rows(const float* bias, int64_t m, int64_t n, float* c);

/// Gives the calling thread's OpenMP runtime (oneDNN's) the count set_num_threads set, if any;
/// returns the count oneDNN will use on this thread.
int apply_omp_threads();

/// A product with bf16 operands and f32 accumulation (gemm_bf16.cpp); `f32_library` runs the
/// fallback's f32 product.
void sgemm_bf16(GemmBackend f32_library, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc);
/// The same from operands already in bf16 (gemm.h's gemm_bf16, arguments checked).
void gemm_bf16_operands(GemmBackend f32_library, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                        float alpha, const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb, float beta,
                        float* c, int64_t ldc);
bool bf16_products_native();
/// Whether oneDNN writes a bf16 result of bf16 products on the same native kernels (not a
/// reference one): gemm_bf16_to_bf16 asks it for one only then.
bool bf16_results_native();
const std::string& bf16_products_route();

#if DTRAIN_HAVE_ONEDNN
/// One product on oneDNN's matmul primitive (gemm_matmul.cpp): C (M, N) = alpha op(A) op(B)
/// [+ bias on every row] + beta C, operands f32 or bf16 in sgemm's layout, C f32 (or bf16: the
/// f32 sums rounded to nearest even by the kernel's epilogue, dtrain's rounding but for f32
/// denormals, which it flushes to zero) [+ a residual R (M, N), dense f32, added last: R + the
/// rest, the bits of adding R to the result afterwards].
struct MatmulShape {
  bool bf16 = false;  // operands in bf16
  bool ta = false, tb = false;
  int64_t m = 0, n = 0, k = 0, lda = 0, ldb = 0, ldc = 0;
  float alpha = 1.0f, beta = 0.0f;
  bool bias = false;      // N f32 values added to every row of C
  bool c_bf16 = false;    // C written as bf16 (with beta 0)
  bool residual = false;  // an (M, N) dense f32 matrix added last, as C is written (with beta 0)
};
inline MatmulShape matmul_shape(bool bf16, bool ta, bool tb, int64_t m, int64_t n, int64_t k, int64_t lda, int64_t ldb,
                                int64_t ldc, float alpha, float beta, bool bias) {
  return MatmulShape{bf16, ta, tb, m, n, k, lda, ldb, ldc, alpha, beta, bias, false};
}
dnnl::engine& onednn_engine();
/// The primitive's description (built and kept by run_matmul; also asked what kernel it runs).
dnnl::matmul::primitive_desc describe_matmul(const MatmulShape& shape);
/// Runs the product on the primitive kept for `shape` and the calling thread's thread count.
void run_matmul(const MatmulShape& shape, const void* a, const void* b, const float* bias, void* c,
                const float* residual = nullptr);
#endif

}  // namespace dtrain::detail
