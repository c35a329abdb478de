// exp on 16 lanes of AVX-512, shared by the kernels compiled for AVX-512 (kernels_avx512.cpp
// through kernels_impl.h, and dot_tiles.cpp). Internal linkage: each file keeps its own copy,
// compiled with its own flags; empty where the file is not compiled for AVX-512F.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

namespace dtrain::simd {
namespace {

// kernels_impl.h's exp_v (Cephes' polynomial with Cody-Waite range reduction, ~1 ulp on
// [-87, 88]) on 16 lanes: the same clamp, reduction and polynomial, the power of two applied by
// vscalefps instead of building it from the exponent bits. A NaN stays NaN (max and min return
// their second operand when one is NaN: x is passed second).
inline __m512 exp16(__m512 x) {
  // The masked forms with every lane set: GCC 12's unmasked ones pass an undefined vector that
  // -Wmaybe-uninitialized reports.
  constexpr __mmask16 all = 0xffff;
  x = _mm512_mask_max_ps(x, all, _mm512_set1_ps(-87.0f), x);
  x = _mm512_mask_min_ps(x, all, _mm512_set1_ps(88.0f), x);
  const __m512 xl = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_mask_roundscale_ps(xl, all, xl, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_mask_scalef_ps(p, all, p, n);
}

}  // namespace
}  // namespace dtrain::simd
#endif
