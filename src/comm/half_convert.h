// bf16 / f16 <-> f32 conversions of the comm layer (round to nearest even), scalar and, where the
// build has AVX2 and F16C, eight lanes at a time. Shared by the reduction kernels (reduce.cpp)
// and the codecs (compress.cpp). Own copies: dtrain_comm does not depend on the tensor layer.
//
// NaN stays NaN (quiet, sign and top of the payload kept); infinities stay infinite; finite
// values that round past the largest finite value become infinite (the codecs clamp first).
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>

#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#define DTRAIN_COMM_HALF_SIMD 1
#else
#define DTRAIN_COMM_HALF_SIMD 0
#endif

namespace dtrain::comm::detail {

inline float bf16_to_f32(uint16_t h) { return std::bit_cast<float>(static_cast<uint32_t>(h) << 16); }

inline uint16_t f32_to_bf16(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  // NaN: keep the sign and the top of the payload, force the quiet bit so it stays a NaN
  // (rounding could otherwise carry a low-payload NaN into infinity).
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);  // round to nearest even
}

inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return std::bit_cast<float>(sign | 0x7f800000u | (mant << 13) | (mant != 0 ? 0x00400000u : 0u));
  if (exp == 0) {  // zero or subnormal: mant * 2^-24 is exact in f32
    return std::bit_cast<float>(sign | std::bit_cast<uint32_t>(static_cast<float>(mant) * 0x1p-24f));
  }
  return std::bit_cast<float>(sign | ((exp + 112u) << 23) | (mant << 13));
}

inline uint16_t f32_to_f16(float f) {
  uint32_t u = std::bit_cast<uint32_t>(f);
  const auto sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  u &= 0x7fffffffu;
  if (u > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((u >> 13) & 0x3ffu));  // quiet NaN
  if (u >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520 rounds to infinity
  if (u < 0x38800000u) {  // below 2^-14: f16 subnormal, quantum 2^-24 (exact scaling, RNE)
    const float scaled = std::nearbyint(std::bit_cast<float>(u) * 0x1p24f);
    return static_cast<uint16_t>(sign | static_cast<uint16_t>(scaled));  // 1024 -> smallest normal
  }
  u -= 112u << 23;  // rebias the exponent from 127 to 15
  return static_cast<uint16_t>(sign | ((u + 0xfffu + ((u >> 13) & 1u)) >> 13));
}

#if DTRAIN_COMM_HALF_SIMD
inline __m256 load_bf16x8(const uint16_t* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

inline void store_bf16x8(uint16_t* p, __m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
  const __m256i nan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x0040));
  const __m256i r = _mm256_blendv_epi8(rounded, nan, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  // Every lane is <= 0xffff, so the unsigned-saturating pack is exact.
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}

inline __m256 load_f16x8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline void store_f16x8(uint16_t* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}
#endif

}  // namespace dtrain::comm::detail
