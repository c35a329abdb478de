// The kernels of dtrain/tensor/kernels.h, written once and compiled once per instruction set:
// each kernels_<isa>.cpp includes this file inside its own namespace with its own compiler flags.
//
// Loops over a row are `omp simd` (-fopenmp-simd: vectorisation only, no OpenMP runtime), sums
// included: a row's sum is kept in vector lanes and added up at the end, which is what makes them
// fast, and why their last bits depend on the vector width. Everything here has internal linkage
// and calls no inline function from another header with external linkage (exp16.h's has
// internal linkage): an out-of-line copy of such a function, compiled with AVX-512 in one file,
// could be the one the linker keeps for all of them.
//
// Where the file is compiled with AVX-512 (__AVX512F__), GELU and the softmax's exponentials also
// have a loop written with intrinsics (exp16: vscalefps for the power of two, which `omp simd`
// cannot express), measured 1.8x the compiler's loop for GELU. GELU's runs its tail masked (the
// same arithmetic for every element, however a caller splits a range); the softmax's scalar loop
// does its tail.
// The includer includes <immintrin.h> before its namespace.
//
// Not a header to include anywhere else (no include guard on purpose).

namespace {

inline float clampf(float x, float lo, float hi) {
  x = x < lo ? lo : x;
  return x > hi ? hi : x;
}

// exp: Cephes' polynomial with Cody-Waite range reduction, ~1 ulp on [-87, 88] (fast_math.h).
inline float exp_v(float x) {
  x = clampf(x, -87.0f, 88.0f);
  const float n = __builtin_nearbyintf(x * 1.44269504088896341f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  __builtin_memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

constexpr float kGeluC = 0.7978845608028654f;  // sqrt(2/pi)

#if defined(__AVX512F__)
// exp16 (exp16.h): exp_v on 16 lanes.
using simd::exp16;

// The logistic s = 1 / (1 + e^(-2u)) of GELU's tanh form at v, u = sqrt(2/pi) (v + 0.044715 v^3).
inline __m512 gelu_s16(__m512 v) {
  const __m512 t = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(0.044715f), v), _mm512_mul_ps(v, v), v);
  const __m512 e = exp16(_mm512_mul_ps(_mm512_set1_ps(-2.0f * kGeluC), t));
  return _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}

// g * gelu'(v) = g (s + 2 v s (1 - s) du), du = sqrt(2/pi) (1 + 3 * 0.044715 v^2).
inline __m512 gelu_grad16(__m512 v, __m512 g) {
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 sv = gelu_s16(v);
  const __m512 du = _mm512_mul_ps(_mm512_set1_ps(kGeluC),
                                  _mm512_fmadd_ps(_mm512_set1_ps(3.0f * 0.044715f), _mm512_mul_ps(v, v), one));
  const __m512 d = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(2.0f), v), sv),
                                   _mm512_mul_ps(_mm512_sub_ps(one, sv), du), sv);
  return _mm512_mul_ps(g, d);
}

// Loads and stores of the lanes [0, n) of a 16-lane step, n < 16: GELU's loops run their tails
// masked, so that every element gets the same arithmetic wherever a caller splits a range. Only
// the tails: a version with every load and store masked ran GELU 2.6x slower on this AMD EPYC.
inline __mmask16 lanes(int64_t n) { return static_cast<__mmask16>((1u << n) - 1u); }

// bf16_of on 16 lanes: nearest even, NaN quieted with its sign and payload, as 16-bit words.
inline __m256i bf16_words16(__m512 v) {
  // (The maskz forms: GCC 12 warns that the plain ones read an uninitialised vector.)
  const __mmask16 all = 0xffff;
  const __m512i u = _mm512_castps_si512(v);
  const __m512i hi = _mm512_maskz_srli_epi32(all, u, 16);
  const __m512i bias = _mm512_add_epi32(_mm512_and_si512(hi, _mm512_set1_epi32(1)), _mm512_set1_epi32(0x7fff));
  const __m512i rounded = _mm512_maskz_srli_epi32(all, _mm512_add_epi32(u, bias), 16);
  const __mmask16 nan =
      _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
  return _mm512_maskz_cvtepi32_epi16(all, _mm512_mask_or_epi32(rounded, nan, hi, _mm512_set1_epi32(0x40)));
}

// Where the file is compiled with AVX512_BF16 (the avx512_bf16 table), the kernels that write
// bf16 round with vcvtneps2bf16: bf16_of's bits in one instruction (GELU's rounding: 3.4 against
// 2.5 ms a step of the byte GPT), except that it flushes denormal inputs to zero. Bf16Stores
// notes where that happened (one vfpclassps a vector, no branch), and bf16_values then writes that
// block of at most kBf16Block values (within a row) again with bf16_words16, so that the bits are
// the other tables' in every case. Per block, not per call, so that a rare denormal costs a block
// (none in 1000 steps of the byte GPT: 0 of 33.8 million rows and blocks).
#if defined(__AVX512BF16__)
constexpr bool kFastBf16 = true;
#else
constexpr bool kFastBf16 = false;
#endif

constexpr int64_t kBf16Block = 4096;

template <bool Fast>
struct Bf16Stores {
  __mmask16 flushed = 0;  // lanes where vcvtneps2bf16 met a denormal
  // v rounded into the lanes m of dst.
  void operator()(uint16_t* dst, __mmask16 m, __m512 v) {
    __m256i words;
#if defined(__AVX512BF16__)
    if constexpr (Fast) {
      flushed |= _mm512_mask_fpclass_ps_mask(m, v, 0x20);  // 0x20: denormal
      words = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
    } else {
      words = bf16_words16(v);
    }
#else
    words = bf16_words16(v);
#endif
    if (m == 0xffff) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), words);
    } else {
      _mm256_mask_storeu_epi16(dst, m, words);
    }
  }
  // v0 and v1 rounded into the 32 values at dst: with AVX512_BF16 in one vcvtne2ps2bf16 and one
  // store (8% off GELU's bf16 forward against two vcvtneps2bf16, the same bits).
  void pair(uint16_t* dst, __m512 v0, __m512 v1) {
#if defined(__AVX512BF16__)
    if constexpr (Fast) {
      constexpr __mmask16 all = 0xffff;
      flushed |= _mm512_mask_fpclass_ps_mask(all, v0, 0x20) | _mm512_mask_fpclass_ps_mask(all, v1, 0x20);
      _mm512_storeu_si512(dst, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(v1, v0)));
      return;
    }
#endif
    (*this)(dst, 0xffff, v0);
    (*this)(dst + 16, 0xffff, v1);
  }
  bool exact() const { return flushed == 0; }
};

// 16 floats from p, the lanes m (all of them: an unmasked load).
inline __m512 load16(const float* p, __mmask16 m) {
  return m == 0xffff ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(m, p);
}

// n values, 16 lanes at a time from value(i, lanes) (a masked tail), rounded into dst by store and
// added into sums unless it is null.
template <typename Store, typename Value>
inline void bf16_row(Store& store, uint16_t* dst, int64_t n, float* sums, const Value& value) {
  const auto add_to_sums = [sums](int64_t i, __mmask16 m, __m512 v) {
    if (sums != nullptr) _mm512_mask_storeu_ps(sums + i, m, _mm512_add_ps(load16(sums + i, m), v));
  };
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512 v0 = value(i, __mmask16(0xffff)), v1 = value(i + 16, __mmask16(0xffff));
    store.pair(dst + i, v0, v1);
    add_to_sums(i, 0xffff, v0);
    add_to_sums(i + 16, 0xffff, v1);
  }
  for (; i + 16 <= n; i += 16) {
    const __m512 v = value(i, __mmask16(0xffff));
    store(dst + i, 0xffff, v);
    add_to_sums(i, 0xffff, v);
  }
  if (i < n) {
    const __mmask16 m = lanes(n - i);
    const __m512 v = value(i, m);
    store(dst + i, m, v);
    add_to_sums(i, m, v);
  }
}

// bf16_row in blocks of kBf16Block values, each with the fast stores and, where they met a
// denormal, again with exact ones and without the sums (added once already): a rerun stays small.
template <typename Value>
inline void bf16_values(uint16_t* dst, int64_t n, float* sums, const Value& value) {
  for (int64_t b = 0; b < n; b += kBf16Block) {
    const int64_t len = n - b < kBf16Block ? n - b : kBf16Block;
    const auto at = [&](int64_t i, __mmask16 m) { return value(b + i, m); };
    Bf16Stores<kFastBf16> fast;
    bf16_row(fast, dst + b, len, sums != nullptr ? sums + b : nullptr, at);
    if (!fast.exact()) {
      Bf16Stores<false> exact;
      bf16_row(exact, dst + b, len, nullptr, at);
    }
  }
}
#endif

inline uint16_t bf16_of(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t nan = (u >> 16) | 0x40u;  // quiet NaN, sign and payload kept
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

inline float f32_of_bf16(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}

float row_max(const float* x, int64_t n) {
  float mx = -__builtin_inff();
#pragma omp simd reduction(max : mx)
  for (int64_t j = 0; j < n; ++j) mx = x[j] > mx ? x[j] : mx;
  return mx;
}

// y = exp(x - mx); returns the sum of y.
float exp_shifted(const float* x, float* y, int64_t n, float mx) {
  float sum = 0.0f;
  int64_t i = 0;
#if defined(__AVX512F__)
  if (n >= 16) {
    const __m512 shift = _mm512_set1_ps(mx);
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) {
      const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(x + i), shift));
      _mm512_storeu_ps(y + i, e);
      acc = _mm512_add_ps(acc, e);
    }
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, acc);
    for (float lane : lanes) sum += lane;
  }
#endif
#pragma omp simd reduction(+ : sum)
  for (int64_t j = i; j < n; ++j) {
    const float e = exp_v(x[j] - mx);
    y[j] = e;
    sum += e;
  }
  return sum;
}

void scale_row(float* y, int64_t n, float s) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) y[j] *= s;
}

// A row's mean and 1 / standard deviation, written to mean and rstd.
inline void layer_norm_stats(const float* __restrict xr, int64_t c, float eps, float* mean, float* rstd) {
  const float inv_c = 1.0f / static_cast<float>(c);
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t j = 0; j < c; ++j) s += xr[j];
  const float mu = s * inv_c;
  float v = 0.0f;
#pragma omp simd reduction(+ : v)
  for (int64_t j = 0; j < c; ++j) v += (xr[j] - mu) * (xr[j] - mu);
  *mean = mu;
  *rstd = 1.0f / __builtin_sqrtf(v * inv_c + eps);
}

#if defined(__AVX512F__)
// layer_norm_stats of kStatRows rows, c a multiple of 16, the same bits: each row's two sums in
// the order the compiler gives layer_norm_stats' `omp simd` loops with AVX-512 (lane j sums the
// row's elements j, j + 16, ... from zero; then 0 + lane 0 + lane 1 + ... + lane 15 in turn).
// The rows' lanes are summed row after row (memory order: taking the rows' vectors in turn
// slowed rows that come from L3), and the sums of their lanes, the sixteen dependent adds that
// left the core waiting, for all the rows together.
constexpr int kStatRows = 8;

// sums[k] = 0 + lane 0 + lane 1 + ... + lane 15 of acc[k], for Rows rows, their adds interleaved.
template <int Rows>
inline void sums_of_lanes(const __m512 (&acc)[Rows], float* sums) {
  alignas(64) float lane[Rows][16];
  for (int k = 0; k < Rows; ++k) {
    _mm512_store_ps(lane[k], acc[k]);
    sums[k] = 0.0f;
  }
  for (int l = 0; l < 16; ++l) {
    for (int k = 0; k < Rows; ++k) sums[k] += lane[k][l];
  }
}

inline void layer_norm_stats_rows(const float* x, int64_t c, float eps, float* mean, float* rstd) {
  const float inv_c = 1.0f / static_cast<float>(c);
  __m512 acc[kStatRows];
  for (int k = 0; k < kStatRows; ++k) {  // row after row, in memory order (the prefetcher's)
    acc[k] = _mm512_setzero_ps();
    for (int64_t j = 0; j < c; j += 16) acc[k] = _mm512_add_ps(acc[k], _mm512_loadu_ps(x + k * c + j));
  }
  float mu[kStatRows];
  sums_of_lanes(acc, mu);
  __m512 mu16[kStatRows];
  for (int k = 0; k < kStatRows; ++k) {
    mu[k] *= inv_c;
    mu16[k] = _mm512_set1_ps(mu[k]);
    acc[k] = _mm512_setzero_ps();
  }
  for (int k = 0; k < kStatRows; ++k) {
    for (int64_t j = 0; j < c; j += 16) {
      const __m512 d = _mm512_sub_ps(_mm512_loadu_ps(x + k * c + j), mu16[k]);
      acc[k] = _mm512_fmadd_ps(d, d, acc[k]);
    }
  }
  float v[kStatRows];
  sums_of_lanes(acc, v);
  for (int k = 0; k < kStatRows; ++k) {
    mean[k] = mu[k];
    rstd[k] = 1.0f / __builtin_sqrtf(__builtin_fmaf(v[k], inv_c, eps));
  }
}
#endif

// Each row's stats, then write_row(r, xr, mu, rs) writes its output.
template <typename WriteRow>
inline void layer_norm_rows(const float* x, float* mean, float* rstd, int64_t rows, int64_t c, float eps,
                            const WriteRow& write_row) {
  int64_t r = 0;
#if defined(__AVX512F__)
  if (c > 0 && c % 16 == 0) {
    for (; r + kStatRows <= rows; r += kStatRows) {
      layer_norm_stats_rows(x + r * c, c, eps, mean + r, rstd + r);
      for (int64_t k = r; k < r + kStatRows; ++k) write_row(k, x + k * c, mean[k], rstd[k]);
    }
  }
#endif
  for (; r < rows; ++r) {
    const float* xr = x + r * c;
    layer_norm_stats(xr, c, eps, mean + r, rstd + r);
    write_row(r, xr, mean[r], rstd[r]);
  }
}

void layer_norm_forward(const float* x, const float* w, const float* b, float* y, float* mean, float* rstd,
                        int64_t rows, int64_t c, float eps) {
  layer_norm_rows(x, mean, rstd, rows, c, eps, [&](int64_t r, const float* __restrict xr, float mu, float rs) {
    float* __restrict yr = y + r * c;
#pragma omp simd
    for (int64_t j = 0; j < c; ++j) yr[j] = (xr[j] - mu) * rs * w[j] + b[j];
  });
}

// The same, y written as bf16 (round_to_bf16's bits of layer_norm_forward's y) in registers.
// ((x - mu) rs) w + b: the f32 loop's one contraction is the last multiply and add (fma).
void layer_norm_forward_bf16(const float* x, const float* w, const float* b, uint16_t* y, float* mean, float* rstd,
                             int64_t rows, int64_t c, float eps) {
  layer_norm_rows(x, mean, rstd, rows, c, eps, [&](int64_t r, const float* __restrict xr, float mu, float rs) {
    uint16_t* __restrict yr = y + r * c;
#if defined(__AVX512F__)
    const __m512 mu16 = _mm512_set1_ps(mu), rs16 = _mm512_set1_ps(rs);
    bf16_values(yr, c, nullptr, [&](int64_t i, __mmask16 m) {
      return _mm512_fmadd_ps(_mm512_mul_ps(_mm512_sub_ps(load16(xr + i, m), mu16), rs16), load16(w + i, m),
                             load16(b + i, m));
    });
#else
#pragma omp simd
    for (int64_t j = 0; j < c; ++j) yr[j] = bf16_of((xr[j] - mu) * rs * w[j] + b[j]);
#endif
  });
}

// dxhat = g * w; dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)): one row's dx from
// a = mean(dxhat) and bb = mean(dxhat * xhat).
inline void layer_norm_backward_row(const float* __restrict xr, const float* __restrict w, const float* __restrict gr,
                                    float mu, float rs, float a, float bb, float* __restrict gxr, int64_t c) {
#pragma omp simd
  for (int64_t j = 0; j < c; ++j) {
    const float xhat = (xr[j] - mu) * rs;
    gxr[j] = rs * (gr[j] * w[j] - a - xhat * bb);
  }
}

void layer_norm_backward(const float* x, const float* w, const float* g, const float* mean, const float* rstd,
                         float* gx, float* gw, float* gb, int64_t rows, int64_t c) {
  const float inv_c = 1.0f / static_cast<float>(c);
  int64_t r = 0;
#if defined(__AVX512F__)
  // kGradRows rows at a time where c is a multiple of 16, the same bits as the loop below: each
  // row's lanes summed as there, the sums of the lanes left for the rows together (as
  // layer_norm_stats_rows does).
  constexpr int kGradRows = 2;
  if (c > 0 && c % 16 == 0) {
    for (; r + kGradRows <= rows; r += kGradRows) {
      __m512 s1[kGradRows], s2[kGradRows];
      for (int k = 0; k < kGradRows; ++k) {  // row after row, in memory order
        s1[k] = s2[k] = _mm512_setzero_ps();
        const __m512 mu16 = _mm512_set1_ps(mean[r + k]), rs16 = _mm512_set1_ps(rstd[r + k]);
        for (int64_t j = 0; j < c; j += 16) {
          const int64_t at = (r + k) * c + j;
          const __m512 xhat = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(x + at), mu16), rs16);
          const __m512 g16 = _mm512_loadu_ps(g + at);
          const __m512 dxhat = _mm512_mul_ps(g16, _mm512_loadu_ps(w + j));
          s1[k] = _mm512_add_ps(s1[k], dxhat);
          s2[k] = _mm512_fmadd_ps(xhat, dxhat, s2[k]);
          _mm512_storeu_ps(gw + j, _mm512_fmadd_ps(xhat, g16, _mm512_loadu_ps(gw + j)));
          _mm512_storeu_ps(gb + j, _mm512_add_ps(_mm512_loadu_ps(gb + j), g16));
        }
      }
      float a[kGradRows], bb[kGradRows];
      sums_of_lanes(s1, a);
      sums_of_lanes(s2, bb);
      for (int k = 0; k < kGradRows; ++k) {
        const int64_t at = (r + k) * c;
        layer_norm_backward_row(x + at, w, g + at, mean[r + k], rstd[r + k], a[k] * inv_c, bb[k] * inv_c, gx + at, c);
      }
    }
  }
#endif
  for (; r < rows; ++r) {
    const float* __restrict xr = x + r * c;
    const float* __restrict gr = g + r * c;
    const float mu = mean[r], rs = rstd[r];
    float sum_dxhat = 0.0f, sum_dxhat_xhat = 0.0f;
#pragma omp simd reduction(+ : sum_dxhat, sum_dxhat_xhat)
    for (int64_t j = 0; j < c; ++j) {
      const float xhat = (xr[j] - mu) * rs;
      const float dxhat = gr[j] * w[j];
      sum_dxhat += dxhat;
      sum_dxhat_xhat += dxhat * xhat;
      gw[j] += gr[j] * xhat;
      gb[j] += gr[j];
    }
    layer_norm_backward_row(xr, w, gr, mu, rs, sum_dxhat * inv_c, sum_dxhat_xhat * inv_c, gx + r * c, c);
  }
}

void softmax_forward(const float* x, float* y, int64_t rows, int64_t n, bool log_space) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * n;
    float* yr = y + r * n;
    const float mx = row_max(xr, n);
    const float sum = exp_shifted(xr, yr, n, mx);
    if (log_space) {
      const float shift = mx + __builtin_logf(sum);
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) yr[j] = xr[j] - shift;
    } else {
      scale_row(yr, n, 1.0f / sum);
    }
  }
}

void softmax_backward(const float* y, const float* g, float* gx, int64_t rows, int64_t n, bool log_space) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* __restrict yr = y + r * n;
    const float* __restrict gr = g + r * n;
    float* __restrict o = gx + r * n;
    float s = 0.0f;
    if (log_space) {  // dx = g - softmax * sum(g)
#pragma omp simd reduction(+ : s)
      for (int64_t j = 0; j < n; ++j) s += gr[j];
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) o[j] = gr[j] - exp_v(yr[j]) * s;
    } else {  // dx = y * (g - sum(g * y))
#pragma omp simd reduction(+ : s)
      for (int64_t j = 0; j < n; ++j) s += gr[j] * yr[j];
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) o[j] = yr[j] * (gr[j] - s);
    }
  }
}

double cross_entropy_forward(const float* x, const int32_t* targets, float* probs, int64_t n, int64_t c) {
  double loss = 0.0;
  for (int64_t r = 0; r < n; ++r) {
    const float* xr = x + r * c;
    float* pr = probs + r * c;
    const float mx = row_max(xr, c);
    const float sum = exp_shifted(xr, pr, c, mx);
    scale_row(pr, c, 1.0f / sum);
    loss += static_cast<double>(__builtin_logf(sum) + mx - xr[targets[r]]);
  }
  return loss;
}

void cross_entropy_backward(const float* probs, const int32_t* targets, float scale, float* gx, int64_t n, int64_t c) {
  for (int64_t r = 0; r < n; ++r) {
    const float* __restrict pr = probs + r * c;
    float* __restrict o = gx + r * c;
#pragma omp simd
    for (int64_t j = 0; j < c; ++j) o[j] = pr[j] * scale;
    o[targets[r]] -= scale;
  }
}

// GELU's tanh form through the logistic function: 0.5 x (1 + tanh(u)) = x s with s = 1 / (1 + e^(-2u)),
// u = sqrt(2/pi) (x + 0.044715 x^3); one exp and one division per element.
// Gradient: s + 2 x s (1 - s) du/dx, the tanh form's 0.5 (1 + t) + 0.5 x (1 - t^2) du/dx.
inline float gelu_of(float v) {
  const float u = kGeluC * (v + 0.044715f * v * v * v);
  return v / (1.0f + exp_v(-2.0f * u));
}

inline float gelu_grad_of(float v, float g) {
  const float u = kGeluC * (v + 0.044715f * v * v * v);
  const float s = 1.0f / (1.0f + exp_v(-2.0f * u));
  const float du = kGeluC * (1.0f + 3.0f * 0.044715f * v * v);
  return g * (s + 2.0f * v * s * (1.0f - s) * du);
}

void gelu_forward(const float* __restrict x, float* __restrict y, int64_t n) {
#if defined(__AVX512F__)
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    _mm512_storeu_ps(y + i, _mm512_mul_ps(v, gelu_s16(v)));
  }
  if (i < n) {
    const __mmask16 m = lanes(n - i);
    const __m512 v = _mm512_maskz_loadu_ps(m, x + i);
    _mm512_mask_storeu_ps(y + i, m, _mm512_mul_ps(v, gelu_s16(v)));
  }
#else
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) y[j] = gelu_of(x[j]);
#endif
}

void gelu_forward_bf16(const float* __restrict x, uint16_t* __restrict y, int64_t n) {
#if defined(__AVX512F__)
  bf16_values(y, n, nullptr, [&](int64_t i, __mmask16 m) {
    const __m512 v = load16(x + i, m);
    return _mm512_mul_ps(v, gelu_s16(v));
  });
#else
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) y[j] = bf16_of(gelu_of(x[j]));
#endif
}

void gelu_backward(const float* __restrict x, const float* __restrict g, float* __restrict gx, int64_t n) {
#if defined(__AVX512F__)
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    _mm512_storeu_ps(gx + i, gelu_grad16(_mm512_loadu_ps(x + i), _mm512_loadu_ps(g + i)));
  }
  if (i < n) {
    const __mmask16 m = lanes(n - i);
    _mm512_mask_storeu_ps(gx + i, m, gelu_grad16(_mm512_maskz_loadu_ps(m, x + i), _mm512_maskz_loadu_ps(m, g + i)));
  }
#else
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) gx[j] = gelu_grad_of(x[j], g[j]);
#endif
}

void gelu_backward_bf16(const float* __restrict x, const float* __restrict g, int64_t rows, int64_t n,
                        uint16_t* __restrict gx, float* __restrict sums) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * n;
    const float* gr = g + r * n;
#if defined(__AVX512F__)
    bf16_values(gx + r * n, n, sums,
                [&](int64_t i, __mmask16 m) { return gelu_grad16(load16(xr + i, m), load16(gr + i, m)); });
#else
    uint16_t* dr = gx + r * n;
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) {
      const float d = gelu_grad_of(xr[j], gr[j]);
      dr[j] = bf16_of(d);
      if (sums != nullptr) sums[j] += d;
    }
#endif
  }
}

void causal_softmax_row(float* row, int64_t len, int64_t t) {
  const float mx = row_max(row, len);
  const float sum = exp_shifted(row, row, len, mx);
  scale_row(row, len, 1.0f / sum);
#pragma omp simd
  for (int64_t j = len; j < t; ++j) row[j] = 0.0f;
}

void causal_softmax_backward_row(const float* __restrict p, float* __restrict dp, int64_t len, int64_t t) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t j = 0; j < len; ++j) s += dp[j] * p[j];
#pragma omp simd
  for (int64_t j = 0; j < len; ++j) dp[j] = p[j] * (dp[j] - s);
#pragma omp simd
  for (int64_t j = len; j < t; ++j) dp[j] = 0.0f;
}

void add_into(float* __restrict dst, const float* __restrict src, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] += src[i];
}

void sum_rows(const float* __restrict x, float* __restrict out, int64_t rows, int64_t n) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) out[j] = 0.0f;
  for (int64_t r = 0; r < rows; ++r) {
    const float* __restrict xr = x + r * n;
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) out[j] += xr[j];
  }
}

// One AdamW element; adamw and adamw_stream both use it, so they give the same bits.
inline __attribute__((always_inline)) float adamw_one(float p, float g, float& m, float& v, float decay, float beta1,
                                                      float beta2, float step_size, float inv_bc2_sqrt, float eps) {
  const float pj = p * decay;
  const float mj = beta1 * m + (1.0f - beta1) * g;
  const float vj = beta2 * v + (1.0f - beta2) * g * g;
  m = mj;
  v = vj;
  return pj - step_size * mj / (__builtin_sqrtf(vj) * inv_bc2_sqrt + eps);
}

void adamw(float* __restrict p, const float* __restrict g, float* __restrict m, float* __restrict v, int64_t n,
           float decay, float beta1, float beta2, float step_size, float inv_bc2_sqrt, float eps) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j)
    p[j] = adamw_one(p[j], g[j], m[j], v[j], decay, beta1, beta2, step_size, inv_bc2_sqrt, eps);
}

// dst[0, n) = src[0, n) with non-temporal stores where the vector unit has them (aligned body),
// ordinary ones at the ends; fenced, so that the stores are visible before the caller's next
// synchronisation.
void stream_copy(float* __restrict dst, const float* __restrict src, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__) || defined(__AVX__)
#if defined(__AVX512F__)
  constexpr int64_t kLanes = 16;
#else
  constexpr int64_t kLanes = 8;
#endif
  for (; i < n && (reinterpret_cast<uintptr_t>(dst + i) % (kLanes * sizeof(float))) != 0; ++i) dst[i] = src[i];
  for (; i + kLanes <= n; i += kLanes) {
#if defined(__AVX512F__)
    _mm512_stream_ps(dst + i, _mm512_loadu_ps(src + i));
#else
    _mm256_stream_ps(dst + i, _mm256_loadu_ps(src + i));
#endif
  }
#endif
  for (; i < n; ++i) dst[i] = src[i];
#if defined(__AVX512F__) || defined(__AVX__)
  _mm_sfence();
#endif
}

// AdamW with p written by non-temporal stores: for parameters that other cores read next (one
// copy shared by the ranks of a host), where an ordinary store must first take each cache line
// away from the readers' caches. Computed in chunks that stay in L1, then streamed out.
void adamw_stream(float* p, const float* __restrict g, float* __restrict m, float* __restrict v, int64_t n, float decay,
                  float beta1, float beta2, float step_size, float inv_bc2_sqrt, float eps) {
  constexpr int64_t kChunk = 512;
  alignas(64) float out[kChunk];
  for (int64_t off = 0; off < n; off += kChunk) {
    const int64_t len = n - off < kChunk ? n - off : kChunk;
    const float* __restrict pin = p + off;
    const float* __restrict gin = g + off;
    float* __restrict mo = m + off;
    float* __restrict vo = v + off;
#pragma omp simd
    for (int64_t j = 0; j < len; ++j)
      out[j] = adamw_one(pin[j], gin[j], mo[j], vo[j], decay, beta1, beta2, step_size, inv_bc2_sqrt, eps);
    stream_copy(p + off, out, len);
  }
}

void round_to_bf16(const float* src, int64_t rows, int64_t cols, int64_t ld, uint16_t* dst) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* __restrict s = src + r * ld;
    uint16_t* __restrict d = dst + r * cols;
#if defined(__AVX512F__)
    bf16_values(d, cols, nullptr, [&](int64_t i, __mmask16 m) { return load16(s + i, m); });
#else
#pragma omp simd
    for (int64_t j = 0; j < cols; ++j) d[j] = bf16_of(s[j]);
#endif
  }
}

void round_to_bf16_values(const float* src, int64_t rows, int64_t cols, int64_t ld, float* dst) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* __restrict s = src + r * ld;
    float* __restrict d = dst + r * cols;
#pragma omp simd
    for (int64_t j = 0; j < cols; ++j) d[j] = f32_of_bf16(bf16_of(s[j]));
  }
}

void round_to_bf16_sum_rows(const float* x, int64_t rows, int64_t n, uint16_t* dst, float* __restrict out) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) out[j] = 0.0f;
  for (int64_t r = 0; r < rows; ++r) {  // sum_rows' order: row by row, each column on its own
    const float* __restrict xr = x + r * n;
    uint16_t* __restrict d = dst + r * n;
#if defined(__AVX512F__)
    bf16_values(d, n, out, [&](int64_t i, __mmask16 m) { return load16(xr + i, m); });
#else
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) {
      d[j] = bf16_of(xr[j]);
      out[j] += xr[j];
    }
#endif
  }
}

}  // namespace

const Table& make_table(const char* isa) {
  static const Table t{isa,
                       layer_norm_forward,
                       layer_norm_forward_bf16,
                       layer_norm_backward,
                       softmax_forward,
                       softmax_backward,
                       cross_entropy_forward,
                       cross_entropy_backward,
                       gelu_forward,
                       gelu_backward,
                       gelu_forward_bf16,
                       gelu_backward_bf16,
                       causal_softmax_row,
                       causal_softmax_backward_row,
                       add_into,
                       sum_rows,
                       adamw,
                       adamw_stream,
                       round_to_bf16,
                       round_to_bf16_values,
                       round_to_bf16_sum_rows};
  return t;
}
