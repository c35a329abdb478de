// Between gemm.cpp (the entry point, f32 libraries, threads) and gemm_bf16.cpp (bf16 products).
#pragma once

#include <cstdint>
#include <string>

#include "dtrain/tensor/gemm.h"

namespace dtrain::detail {

/// An f32 product on `library` (automatic: the policy's library for this shape), arguments
/// already checked by sgemm_on.
void run_f32_library(GemmBackend library, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                     const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc);

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
const std::string& bf16_products_route();

}  // namespace dtrain::detail
