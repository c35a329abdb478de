// dot_tiles.h's kernels, compiled for AVX-512 with AVX512_BF16 (CMakeLists.txt): a register tile
// of up to 8 rows x 32 columns of C (16 accumulators), one vdpbf16ps per row and 16 columns for
// each pair of k, B's 32-bit pairs loaded (masked past n) and A's broadcast from memory.
#include "dot_tiles.h"

#include <immintrin.h>

#include <array>
#include <cstring>
#include <utility>

#include "exp16.h"

namespace dtrain::detail {

namespace {

inline __m512i broadcast_pair(const uint16_t* p) {
  int32_t w;
  std::memcpy(&w, p, 4);
  return _mm512_set1_epi32(w);
}

inline __m512 dot(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);  // NOLINT: a vector cast, the same 512 bits
}

// A tile's accumulators: MR rows x NV vectors of 16 f32, zeroed, and stored scaled by alpha
// under the column masks m0 and m1 (the second vector's).
template <int MR, int NV>
inline void zero(__m512 (&acc)[MR][NV]) {
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  }
}

template <int MR, int NV>
inline void store(const __m512 (&acc)[MR][NV], float alpha, __mmask16 m0, __mmask16 m1, float* c, int64_t ldc) {
  const __m512 s = _mm512_set1_ps(alpha);
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    _mm512_mask_storeu_ps(c + r * ldc, m0, _mm512_mul_ps(acc[r][0], s));
    if constexpr (NV > 1) _mm512_mask_storeu_ps(c + r * ldc + 16, m1, _mm512_mul_ps(acc[r][1], s));
  }
}

// Rows [0, MR) of C, columns [0, 16 NV) of the block at b and c (masks m0, m1 for the last one).
template <int MR, int NV>
void tile(int64_t k, float alpha, const uint16_t* a, int64_t a_row, int64_t a_pair, const uint16_t* b, int64_t ldb,
          __mmask16 m0, __mmask16 m1, float* c, int64_t ldc) {
  __m512 acc[MR][NV];
  zero(acc);
  const int64_t pairs = k / 2;
  for (int64_t p = 0; p < pairs; ++p) {
    const uint16_t* bp = b + p * ldb;
    __m512i bv[NV];
    bv[0] = _mm512_maskz_loadu_epi32(m0, bp);
    if constexpr (NV > 1) bv[1] = _mm512_maskz_loadu_epi32(m1, bp + 32);
    const uint16_t* ap = a + p * a_pair;
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m512i av = broadcast_pair(ap + r * a_row);
#pragma GCC unroll 2
      for (int v = 0; v < NV; ++v) acc[r][v] = dot(acc[r][v], av, bv[v]);
    }
  }
  if (k % 2 != 0) {  // the last value of k alone: A's second half zero (B's is zero too)
    const uint16_t* bp = b + pairs * ldb;
    __m512i bv[NV];
    bv[0] = _mm512_maskz_loadu_epi32(m0, bp);
    if constexpr (NV > 1) bv[1] = _mm512_maskz_loadu_epi32(m1, bp + 32);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m512i av = _mm512_set1_epi32(static_cast<int32_t>(a[r * a_row + pairs * a_pair]));
#pragma GCC unroll 2
      for (int v = 0; v < NV; ++v) acc[r][v] = dot(acc[r][v], av, bv[v]);
    }
  }
  store(acc, alpha, m0, m1, c, ldc);
}

// One f32 tile: the same shape with vfmadd231ps, A's element (i, kk) at a[i * a_row + kk * a_k]
// broadcast, B's row kk loaded from b + kk * ldb.
template <int MR, int NV>
void tile_f32(int64_t k, float alpha, const float* a, int64_t a_row, int64_t a_k, const float* b, int64_t ldb,
              __mmask16 m0, __mmask16 m1, float* c, int64_t ldc) {
  __m512 acc[MR][NV];
  zero(acc);
  for (int64_t kk = 0; kk < k; ++kk) {
    const float* bp = b + kk * ldb;
    __m512 bv[NV];
    bv[0] = _mm512_maskz_loadu_ps(m0, bp);
    if constexpr (NV > 1) bv[1] = _mm512_maskz_loadu_ps(m1, bp + 16);
    const float* ap = a + kk * a_k;
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m512 av = _mm512_set1_ps(ap[r * a_row]);
#pragma GCC unroll 2
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_fmadd_ps(av, bv[v], acc[r][v]);
    }
  }
  store(acc, alpha, m0, m1, c, ldc);
}

// The first `count` of 16 lanes (none for count <= 0).
inline __mmask16 lanes(int64_t count) {
  if (count <= 0) return 0;
  return count >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << count) - 1u);
}

// 16 x 16 32-bit words transposed in registers: r[i] lane j becomes r[j] lane i.
inline void transpose16(__m512i r[16]) {
  // The masked forms with every lane set: GCC 12's unmasked ones pass an undefined vector that
  // -Wmaybe-uninitialized reports.
  constexpr __mmask16 all16 = 0xffff;
  constexpr __mmask8 all8 = 0xff;
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_mask_unpacklo_epi32(r[i], all16, r[i], r[i + 1]);
    t[i + 1] = _mm512_mask_unpackhi_epi32(r[i], all16, r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_mask_unpacklo_epi64(t[i], all8, t[i], t[i + 2]);
    r[i + 1] = _mm512_mask_unpackhi_epi64(t[i], all8, t[i], t[i + 2]);
    r[i + 2] = _mm512_mask_unpacklo_epi64(t[i + 1], all8, t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_mask_unpackhi_epi64(t[i + 1], all8, t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_mask_shuffle_i32x4(r[i], all16, r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_mask_shuffle_i32x4(r[i], all16, r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_mask_shuffle_i32x4(r[i + 8], all16, r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_mask_shuffle_i32x4(r[i + 8], all16, r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_mask_shuffle_i32x4(t[i], all16, t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_mask_shuffle_i32x4(t[i], all16, t[i], t[i + 8], 0xdd);
  }
}

// dst[kk * ldd + j] = word kk of row j of X (n rows of k 32-bit words, row j at x + j * ld_bytes),
// 16 x 16 blocks at a time through registers (AMD's gathers cost more per word than this).
void transpose_words(const char* x, int64_t ld_bytes, int64_t n, int64_t k, uint32_t* dst, int64_t ldd) {
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int64_t rows = n - j0 < 16 ? n - j0 : 16;
    const __mmask16 mj = lanes(rows);
    for (int64_t k0 = 0; k0 < k; k0 += 16) {
      const __mmask16 mk = lanes(k - k0);
      __m512i r[16];
      for (int64_t i = 0; i < 16; ++i) {
        r[i] = i < rows ? _mm512_maskz_loadu_epi32(mk, x + (j0 + i) * ld_bytes + 4 * k0) : _mm512_setzero_si512();
      }
      transpose16(r);
      const int64_t words = k - k0 < 16 ? k - k0 : 16;
      for (int64_t i = 0; i < words; ++i) _mm512_mask_storeu_epi32(dst + (k0 + i) * ldd + j0, mj, r[i]);
    }
  }
}

// C (m, n) in tiles of up to 8 rows x 32 columns: the tile of each height (1-8), one or two
// vectors wide; `col` elements of B per column of C (2 for bf16 pairs, 1 for f32).
template <typename T>
using TileFn = void (*)(int64_t, float, const T*, int64_t, int64_t, const T*, int64_t, __mmask16, __mmask16, float*,
                        int64_t);

template <typename T>
void tiled(const std::array<TileFn<T>, 8>& one, const std::array<TileFn<T>, 8>& two, int64_t col, int64_t m, int64_t n,
           int64_t k, float alpha, const T* a, int64_t a_row, int64_t a_step, const T* b, int64_t ldb, float* c,
           int64_t ldc) {
  for (int64_t i0 = 0; i0 < m; i0 += 8) {
    const size_t h = static_cast<size_t>((m - i0 < 8 ? m - i0 : 8) - 1);
    for (int64_t j0 = 0; j0 < n; j0 += 32) {
      const int64_t left = n - j0;
      (left > 16 ? two : one)[h](k, alpha, a + i0 * a_row, a_row, a_step, b + col * j0, ldb, lanes(left),
                                 lanes(left - 16), c + i0 * ldc + j0, ldc);
    }
  }
}

template <int NV, size_t... R>
constexpr std::array<TileFn<uint16_t>, sizeof...(R)> bf16_tiles(std::index_sequence<R...>) {
  return {&tile<static_cast<int>(R) + 1, NV>...};
}

template <int NV, size_t... R>
constexpr std::array<TileFn<float>, sizeof...(R)> f32_tiles(std::index_sequence<R...>) {
  return {&tile_f32<static_cast<int>(R) + 1, NV>...};
}

}  // namespace

void bf16_dot_gemm(int64_t m, int64_t n, int64_t k, float alpha, const uint16_t* a, int64_t a_row, int64_t a_pair,
                   const uint16_t* b, int64_t ldb, float* c, int64_t ldc) {
  static constexpr auto one = bf16_tiles<1>(std::make_index_sequence<8>());
  static constexpr auto two = bf16_tiles<2>(std::make_index_sequence<8>());
  tiled<uint16_t>(one, two, 2, m, n, k, alpha, a, a_row, a_pair, b, ldb, c, ldc);
}

void f32_dot_gemm(int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t a_row, int64_t a_k,
                  const float* b, int64_t ldb, float* c, int64_t ldc) {
  static constexpr auto one = f32_tiles<1>(std::make_index_sequence<8>());
  static constexpr auto two = f32_tiles<2>(std::make_index_sequence<8>());
  tiled<float>(one, two, 1, m, n, k, alpha, a, a_row, a_k, b, ldb, c, ldc);
}

void pack_transposed(const float* x, int64_t ld, int64_t n, int64_t k, float* dst, int64_t ldd) {
  transpose_words(reinterpret_cast<const char*>(x), ld * 4, n, k, reinterpret_cast<uint32_t*>(dst), ldd);
}

namespace {

// The 32 bf16 of v (16 from each 256-bit half) interleaved: out[2 j] = low[j], out[2 j + 1] = high[j].
inline __m512i interleave_halves(__m512i v) {
  const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21,
                                       5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(idx, v);
}

inline __mmask32 lanes32(int64_t count) {
  if (count <= 0) return 0;
  return count >= 32 ? static_cast<__mmask32>(0xffffffffu) : static_cast<__mmask32>((1u << count) - 1u);
}

// n pairs into d, 16 at a time: load(j, mask) gives the pairs j to j + 15 (fewer at the end).
template <typename Load>
void interleave_rows(const Load& load, int64_t n, uint16_t* d) {
  for (int64_t j = 0; j < n; j += 16) {
    const int64_t left = n - j;
    const __m512i v = load(j, lanes(left));
    _mm512_mask_storeu_epi16(d + 2 * j, lanes32(2 * left), v);
  }
}

}  // namespace

void pack_pairs(const uint16_t* x, int64_t ld, int64_t k, int64_t n, uint16_t* dst, int64_t ldd) {
  // out[2 j] = lo[j], out[2 j + 1] = hi[j] (index 32 + j picks the second operand's lane j)
  const __m512i pair_up = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                           37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  for (int64_t p = 0; 2 * p < k; ++p) {
    const uint16_t* r0 = x + 2 * p * ld;
    const uint16_t* r1 = 2 * p + 1 < k ? r0 + ld : nullptr;
    interleave_rows(
        [&](int64_t j, __mmask16 m) {
          const __m512i lo = _mm512_maskz_loadu_epi16(m, r0 + j);  // lanes 0-15
          const __m512i hi = r1 != nullptr ? _mm512_maskz_loadu_epi16(m, r1 + j) : _mm512_setzero_si512();
          return _mm512_permutex2var_epi16(lo, pair_up, hi);
        },
        n, dst + p * ldd);
  }
}

void pack_pairs_transposed(const uint16_t* x, int64_t ld, int64_t n, int64_t k, uint16_t* dst, int64_t ldd) {
  const int64_t pairs = k / 2;  // ldd is even: its rows are 32-bit words
  transpose_words(reinterpret_cast<const char*>(x), ld * 2, n, pairs, reinterpret_cast<uint32_t*>(dst), ldd / 2);
  if (k % 2 != 0) {
    for (int64_t j = 0; j < n; ++j) {
      dst[pairs * ldd + 2 * j] = x[j * ld + k - 1];
      dst[pairs * ldd + 2 * j + 1] = 0;
    }
  }
}

namespace {

// Horizontal max in four halvings (max is exact, so any order gives its bits; a NaN lane gives a
// NaN row either way, through the exp), and the sum through memory in lane order (its bits are the
// order). GCC 12's _mm512_reduce_* trip -Wmaybe-uninitialized.
inline float max_of(__m512 v) {
  constexpr __mmask16 all = 0xffff;
  v = _mm512_mask_max_ps(v, all, v, _mm512_mask_shuffle_f32x4(v, all, v, v, 0x4e));  // halves swapped
  v = _mm512_mask_max_ps(v, all, v, _mm512_mask_shuffle_f32x4(v, all, v, v, 0xb1));  // quarters swapped
  v = _mm512_mask_max_ps(v, all, v, _mm512_mask_permute_ps(v, all, v, 0x4e));        // pairs of lanes swapped
  v = _mm512_mask_max_ps(v, all, v, _mm512_mask_permute_ps(v, all, v, 0xb1));        // lanes swapped
  return _mm512_cvtss_f32(v);
}

inline float sum_of(__m512 v) {
  alignas(64) float l[16];
  _mm512_store_ps(l, v);
  float s = 0.0f;
  for (float x : l) s += x;
  return s;
}

// f32 lanes [j, j + 16) of row: the f32 row (when there is one) written under `keep` lanes, its
// bf16 rounding (when there is a tile) under `tile_lanes`.
inline void store_both(float* row, uint16_t* t, int64_t j, __m512 v, __mmask16 keep, __mmask16 tile_lanes) {
  if (row != nullptr) _mm512_mask_storeu_ps(row + j, keep, v);
  if (t == nullptr) return;
  const __m256bh h = _mm512_cvtneps_pbh(v);
  _mm256_mask_storeu_epi16(t + j, tile_lanes, (__m256i)h);  // NOLINT: a vector cast, the same 256 bits
}

}  // namespace

void causal_softmax_tile(float* s, int64_t ld, int64_t i0, int64_t r, int64_t zero_to, uint16_t* tile, float* stats) {
  const int64_t n = i0 + r;
  constexpr int64_t kRows = 8;  // rows whose sums are taken together
  for (int64_t g0 = i0; g0 < n; g0 += kRows) {
    const int64_t g1 = n - g0 < kRows ? n : g0 + kRows;
    // Each row's shift and exponentials (into the row), and their sum lane by lane.
    alignas(64) float lane_sums[kRows][16];
    float tops[kRows];
    for (int64_t i = g0; i < g1; ++i) {
      float* row = s + (i - i0) * ld;
      const int64_t len = i + 1;
      __m512 mx = _mm512_set1_ps(-__builtin_inff());
      for (int64_t j = 0; j < len; j += 16) {
        const __mmask16 m = lanes(len - j);
        mx = _mm512_mask_max_ps(mx, m, mx, _mm512_maskz_loadu_ps(m, row + j));
      }
      const float top = max_of(mx);
      const __m512 shift = _mm512_set1_ps(top);
      __m512 sum = _mm512_setzero_ps();
      for (int64_t j = 0; j < len; j += 16) {
        const __mmask16 m = lanes(len - j);
        const __m512 e = _mm512_maskz_mov_ps(m, simd::exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, row + j), shift)));
        _mm512_mask_storeu_ps(row + j, m, e);
        sum = _mm512_add_ps(sum, e);
      }
      tops[i - g0] = top;
      _mm512_store_ps(lane_sums[i - g0], sum);
    }
    for (int64_t i = g1 - g0; i < kRows; ++i) _mm512_store_ps(lane_sums[i], _mm512_setzero_ps());
    // The rows' sums of lanes, each in lane order from zero (sum_of's bits), the rows side by side
    // so that their chains of additions overlap instead of each waiting for the one before.
    float totals[kRows] = {};
    for (int64_t k = 0; k < 16; ++k) {
      for (int64_t i = 0; i < kRows; ++i) totals[i] += lane_sums[i][k];
    }
    for (int64_t i = g0; i < g1; ++i) {
      float* row = s + (i - i0) * ld;
      uint16_t* t = tile != nullptr ? tile + (i - i0) * n : nullptr;
      const int64_t len = i + 1;
      const float inv_sum = 1.0f / totals[i - g0];
      if (stats != nullptr) {
        stats[2 * (i - i0)] = tops[i - g0];
        stats[2 * (i - i0) + 1] = inv_sum;
      }
      const __m512 inv = _mm512_set1_ps(inv_sum);
      // P = e / sum, zeros past the diagonal: into the tile where there is one (its f32 row is
      // not read again), else into the f32 row up to zero_to.
      const int64_t end = t != nullptr ? n : (zero_to > n ? zero_to : n);
      for (int64_t j = 0; j < end; j += 16) {
        const __m512 v = _mm512_maskz_mul_ps(lanes(len - j), _mm512_maskz_loadu_ps(lanes(len - j), row + j), inv);
        store_both(t != nullptr ? nullptr : row, t, j, v, lanes(zero_to - j), lanes(n - j));
      }
    }
  }
}

namespace {

// Lanes [j, j + 16) of two rows of a tile (the second zero past a tile's last row) into their
// pair's packed row (the B layout above, rounded to nearest even): 32 words at pair + 2 j, up to
// column `cols`.
inline void store_pair(uint16_t* pair, int64_t j, __m512 lo, __m512 hi, int64_t cols) {
  const __m512i words = interleave_halves((__m512i)_mm512_cvtne2ps_pbh(hi, lo));  // NOLINT: the same 512 bits
  _mm512_mask_storeu_epi16(pair + 2 * j, lanes32(2 * (cols - j)), words);
}

}  // namespace

void causal_softmax_recompute_tile(float* s, int64_t ld, int64_t i0, int64_t r, int64_t zero_to, const float* stats,
                                   uint16_t* pairs, int64_t ldp) {
  const int64_t n = i0 + r;
  const int64_t end = zero_to > n ? zero_to : n;
  // As causal_softmax_tile: e, then e / sum, zeros past the diagonal; written into the f32 row.
  const auto values = [&](int64_t i, int64_t j) {
    float* row = s + (i - i0) * ld;
    const __mmask16 m = lanes(i + 1 - j);
    const __m512 shift = _mm512_set1_ps(stats[2 * (i - i0)]);
    const __m512 inv = _mm512_set1_ps(stats[2 * (i - i0) + 1]);
    const __m512 e = _mm512_maskz_mov_ps(m, simd::exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, row + j), shift)));
    const __m512 v = _mm512_maskz_mul_ps(m, e, inv);
    _mm512_mask_storeu_ps(row + j, lanes(zero_to - j), v);
    return v;
  };
  for (int64_t i = i0; i < n; i += pairs != nullptr ? 2 : 1) {
    uint16_t* pair = pairs != nullptr ? pairs + ((i - i0) / 2) * ldp : nullptr;
    for (int64_t j = 0; j < end; j += 16) {
      const __m512 lo = values(i, j);
      if (pair == nullptr) continue;
      store_pair(pair, j, lo, i + 1 < n ? values(i + 1, j) : _mm512_setzero_ps(), zero_to);
    }
  }
}

void causal_softmax_backward_tile(const float* p, float* dp, int64_t ld, int64_t i0, int64_t r, int64_t zero_to,
                                  uint16_t* tile, uint16_t* pairs, int64_t ldp) {
  const int64_t n = i0 + r;
  const int64_t end = zero_to > n ? zero_to : n;
  // rowsum(dP * P) of row i.
  const auto dot_of = [&](int64_t i) {
    const float* pr = p + (i - i0) * ld;
    const float* row = dp + (i - i0) * ld;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t j = 0; j <= i; j += 16) {
      const __mmask16 m = lanes(i + 1 - j);
      acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, row + j), _mm512_maskz_loadu_ps(m, pr + j), acc);
    }
    return _mm512_set1_ps(sum_of(acc));
  };
  // dS = P (dP - dot) of row i, lanes [j, j + 16), zeros past the diagonal: rounded into the tile
  // and, without pairs, written back into the f32 row.
  const auto values = [&](int64_t i, int64_t j, __m512 dot) {
    const float* pr = p + (i - i0) * ld;
    float* row = dp + (i - i0) * ld;
    const __mmask16 m = lanes(i + 1 - j);
    const __m512 v = _mm512_maskz_mul_ps(m, _mm512_maskz_loadu_ps(m, pr + j),
                                         _mm512_maskz_sub_ps(m, _mm512_maskz_loadu_ps(m, row + j), dot));
    store_both(pairs != nullptr ? nullptr : row, tile != nullptr ? tile + (i - i0) * n : nullptr, j, v,
               lanes(zero_to - j), lanes(n - j));
    return v;
  };
  for (int64_t i = i0; i < n; i += pairs != nullptr ? 2 : 1) {
    const __m512 dot0 = dot_of(i);
    if (pairs == nullptr) {
      for (int64_t j = 0; j < end; j += 16) values(i, j, dot0);
      continue;
    }
    const bool two = i + 1 < n;
    const __m512 dot1 = two ? dot_of(i + 1) : _mm512_setzero_ps();
    uint16_t* pair = pairs + ((i - i0) / 2) * ldp;
    for (int64_t j = 0; j < end; j += 16) {
      const __m512 lo = values(i, j, dot0);
      store_pair(pair, j, lo, two ? values(i + 1, j, dot1) : _mm512_setzero_ps(), zero_to);
    }
  }
}

}  // namespace dtrain::detail
