// Register-tiled products for the attention's many small per-head products, where a library
// call's fixed costs (oneDNN's primitive and memory objects, its packing of strided operands)
// cost more than the arithmetic: f32 on AVX-512's FMA, and bf16 with f32 sums on AVX512_BF16's
// dot-product instruction (vdpbf16ps); and the causal softmax of a tile of score rows.
//
// f32: A's element (i, kk) is a[i * a_row + kk * a_k] (rows: a_row = lda, a_k = 1; a transpose
// read in place: a_row = 1, a_k = lda); B's row kk is b + kk * ldb (rows in place, or a
// transpose packed by pack_transposed).
//
// bf16 layout: B is packed in pairs of its rows (kernel's "VNNI" layout): element (kk, j) of B (k, n) is
// b[(kk / 2) * ldb + 2 j + kk % 2], so that one 32-bit word holds the two values that one lane of
// the instruction multiplies by a pair of A's values. A is read in place, pair by pair: element
// (i, kk) is a[i * a_row + (kk / 2) * a_pair + kk % 2]; rows of contiguous values are a_row = lda,
// a_pair = 2, and a matrix packed by pack_pairs read as its transpose is a_row = 2, a_pair = ldb.
// An odd k reads only the first value of A's last pair; the packers write zeros past k.
//
// Compiled for AVX-512 with AVX512_BF16 (dot_tiles.cpp): call the f32 functions only when
// f32_dot_available(), the bf16 ones only when bf16_dot_available().
#pragma once

#include <cstdint>

namespace dtrain::detail {

/// Whether these kernels run here: the kernels' instruction set (kernels::table(), capped by
/// DTRAIN_KERNELS_ISA or ONEDNN_MAX_CPU_ISA) is AVX-512 with AVX512_BF16 (a cap of avx512 or
/// AVX512_CORE holds the attention's products off bf16 instructions as it holds oneDNN's).
bool bf16_dot_available();

/// Whether the f32 functions run here: the kernels' instruction set is AVX-512.
bool f32_dot_available();

/// C (m, n) = alpha A B, row stride ldc; A (m, k) and B (k, n) f32 as above.
void f32_dot_gemm(int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t a_row, int64_t a_k,
                  const float* b, int64_t ldb, float* c, int64_t ldc);
/// X^T for B: X (n, k), element (j, kk) at x[j * ld + kk], written as dst[kk * ldd + j].
void pack_transposed(const float* x, int64_t ld, int64_t n, int64_t k, float* dst, int64_t ldd);

/// C (m, n) = alpha A B, row stride ldc; A (m, k) and B (k, n) bf16 as above, sums in f32.
void bf16_dot_gemm(int64_t m, int64_t n, int64_t k, float alpha, const uint16_t* a, int64_t a_row, int64_t a_pair,
                   const uint16_t* b, int64_t ldb, float* c, int64_t ldc);

/// The causal softmax of the rows [i0, i0 + r) of the scores at s (row stride ld; row i's keys
/// [0, i + 1)): P written back in f32 with zeros up to column zero_to; or, where tile is not null,
/// rounded to bf16 into tile (r, i0 + r) with zeros past the diagonal, ready to be A of P V, and
/// the f32 rows then hold the unnormalised exponentials (the tile is all a caller reads).
/// Where stats is not null, each row's shift (its maximum) and 1 / sum go to stats[2 (i - i0)]
/// and stats[2 (i - i0) + 1]: what causal_softmax_recompute_tile needs to give P again.
void causal_softmax_tile(float* s, int64_t ld, int64_t i0, int64_t r, int64_t zero_to, uint16_t* tile, float* stats);
/// P again from the same scores and the stats causal_softmax_tile wrote for them: the same
/// operations on the same values, so the same bits, without the passes for the maximum and sum.
/// Where pairs is not null, P's rows also go there in pairs (the B layout above, row stride ldp,
/// columns up to zero_to, an odd last row paired with zeros; i0 even), rounded from the registers.
void causal_softmax_recompute_tile(float* s, int64_t ld, int64_t i0, int64_t r, int64_t zero_to, const float* stats,
                                   uint16_t* pairs = nullptr, int64_t ldp = 0);
/// Its gradient from those rows of P (p) and dP (dp): dS = P (dP - rowsum(dP P)), zeros up to
/// zero_to, and rounded into tile as above (where not null). dS goes in place into dp, or, where
/// pairs is not null, into pairs as the recompute writes P (and dp keeps dP).
void causal_softmax_backward_tile(const float* p, float* dp, int64_t ld, int64_t i0, int64_t r, int64_t zero_to,
                                  uint16_t* tile, uint16_t* pairs = nullptr, int64_t ldp = 0);
/// Packs X (k, n), element (kk, j) at x[kk * ld + j], in pairs of rows into dst (row stride ldd
/// >= 2 n).
void pack_pairs(const uint16_t* x, int64_t ld, int64_t k, int64_t n, uint16_t* dst, int64_t ldd);
/// Packs the transpose of X (n, k), element (j, kk) at x[j * ld + kk]: B = X^T, so that
/// bf16_dot_gemm gives A X^T.
void pack_pairs_transposed(const uint16_t* x, int64_t ld, int64_t n, int64_t k, uint16_t* dst, int64_t ldd);

}  // namespace dtrain::detail
