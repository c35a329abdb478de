// Gradient codecs (see compress.h for the formats and their error bounds).
//
// Kernels: eight lanes at a time with AVX2 (and F16C for fp16) when the build has them, a
// scalar path for the tails and for builds without. Both paths compute the same IEEE
// operations in the same order (x * inv, round to nearest even, clamp, q * s, x - q * s; no
// fused multiply-add), so a payload decodes to the same bits on every rank whichever path
// encoded or decodes it: the compressed collectives rely on this for identical results.
#include "dtrain/comm/compress.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

#include "dtrain/core/error.h"
#include "half_convert.h"

#if defined(__AVX2__)
#include <immintrin.h>
#define DTRAIN_COMM_QUANT_SIMD 1
#else
#define DTRAIN_COMM_QUANT_SIMD 0
#endif

namespace dtrain::comm {

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// ---- int8 / int4: symmetric per-chunk quantization

struct Quant {
  int levels;       // Q: codes are -Q..Q
  int8_t nan_code;  // the spare code: a NaN or infinite element
};
constexpr Quant kInt8{127, -128};
constexpr Quant kInt4{7, -8};

size_t code_bytes(Codec codec, size_t len) { return codec == Codec::int8 ? len : (len + 1) / 2; }

// Largest |x| over the finite elements of x[0, n) (0 when there are none).
float finite_max_abs(const float* x, size_t n) {
  size_t i = 0;
  float m = 0.0f;
#if DTRAIN_COMM_QUANT_SIMD
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256 inf = _mm256_set1_ps(kInf);
  __m256 vm = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 a = _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i));
    vm = _mm256_max_ps(vm, _mm256_and_ps(a, _mm256_cmp_ps(a, inf, _CMP_LT_OQ)));  // NaN, inf -> 0
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vm);
  for (float v : lanes) m = std::max(m, v);
#endif
  for (; i < n; ++i) {
    const float a = std::fabs(x[i]);
    if (a < kInf) m = std::max(m, a);
  }
  return m;
}

// codes[i] = round(x[i] * inv) clamped to [-Q, Q] (the spare code for a non-finite x[i]);
// residual[i] = x[i] - code * scale (0 for a non-finite x[i]). residual may alias x.
void quantize(const float* x, size_t n, float scale, float inv, Quant q, int8_t* codes, float* residual) {
  const auto levels = static_cast<float>(q.levels);
  size_t i = 0;
#if DTRAIN_COMM_QUANT_SIMD
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256 inf = _mm256_set1_ps(kInf);
  const __m256 vinv = _mm256_set1_ps(inv);
  const __m256 vscale = _mm256_set1_ps(scale);
  const __m256 hi = _mm256_set1_ps(levels);
  const __m256 lo = _mm256_set1_ps(-levels);
  const __m256i spare = _mm256_set1_epi32(q.nan_code);
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const __m256 finite = _mm256_cmp_ps(_mm256_andnot_ps(sign, v), inf, _CMP_LT_OQ);
    __m256 r = _mm256_round_ps(_mm256_mul_ps(v, vinv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    r = _mm256_min_ps(_mm256_max_ps(r, lo), hi);  // a NaN r (non-finite x) becomes -Q: masked below
    if (residual != nullptr) {
      const __m256 res = _mm256_sub_ps(v, _mm256_mul_ps(r, vscale));
      _mm256_storeu_ps(residual + i, _mm256_and_ps(res, finite));
    }
    const __m256i c = _mm256_blendv_epi8(spare, _mm256_cvtps_epi32(r), _mm256_castps_si256(finite));
    const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(codes + i), _mm_packs_epi16(words, words));
  }
#endif
  for (; i < n; ++i) {
    const float v = x[i];
    if (!(std::fabs(v) < kInf)) {
      codes[i] = q.nan_code;
      if (residual != nullptr) residual[i] = 0.0f;
      continue;
    }
    const float r = std::min(std::max(std::nearbyint(v * inv), -levels), levels);
    codes[i] = static_cast<int8_t>(r);
    if (residual != nullptr) residual[i] = v - r * scale;
  }
}

// out[i] (+)= code * scale, NaN for the spare code.
template <bool kAdd>
void dequantize(const int8_t* codes, size_t n, float scale, Quant q, float* out) {
  size_t i = 0;
#if DTRAIN_COMM_QUANT_SIMD
  const __m256 vscale = _mm256_set1_ps(scale);
  const __m256 nan = _mm256_set1_ps(kNaN);
  const __m256i spare = _mm256_set1_epi32(q.nan_code);
  for (; i + 8 <= n; i += 8) {
    const __m256i c = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i)));
    __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(c), vscale);
    v = _mm256_blendv_ps(v, nan, _mm256_castsi256_ps(_mm256_cmpeq_epi32(c, spare)));
    if constexpr (kAdd) v = _mm256_add_ps(_mm256_loadu_ps(out + i), v);
    _mm256_storeu_ps(out + i, v);
  }
#endif
  for (; i < n; ++i) {
    const float v = codes[i] == q.nan_code ? kNaN : static_cast<float>(codes[i]) * scale;
    if constexpr (kAdd) {
      out[i] += v;
    } else {
      out[i] = v;
    }
  }
}

// Two codes per byte: element 2j in the low nibble of byte j, 2j+1 in the high one.
void pack_nibbles(const int8_t* __restrict codes, size_t n, uint8_t* __restrict out) {
  const size_t pairs = n / 2;
  for (size_t j = 0; j < pairs; ++j) {
    out[j] = static_cast<uint8_t>((static_cast<uint8_t>(codes[2 * j]) & 0x0fu) |
                                  (static_cast<uint8_t>(codes[2 * j + 1]) << 4));
  }
  if (n % 2 != 0) out[pairs] = static_cast<uint8_t>(codes[n - 1]) & 0x0fu;
}

void unpack_nibbles(const uint8_t* __restrict in, size_t n, int8_t* __restrict codes) {
  const size_t pairs = n / 2;
  for (size_t j = 0; j < pairs; ++j) {
    // Sign-extend each nibble: shift it to the top of a signed byte, then back.
    codes[2 * j] = static_cast<int8_t>(static_cast<int8_t>(in[j] << 4) >> 4);
    codes[2 * j + 1] = static_cast<int8_t>(static_cast<int8_t>(in[j]) >> 4);
  }
  if (n % 2 != 0) codes[n - 1] = static_cast<int8_t>(static_cast<int8_t>(in[pairs] << 4) >> 4);
}

void encode_quant(Codec codec, const float* x, size_t count, uint8_t* out, float* residual) {
  const Quant q = codec == Codec::int8 ? kInt8 : kInt4;
  alignas(32) int8_t codes[kQuantChunk];
  for (size_t begin = 0; begin < count; begin += kQuantChunk) {
    const size_t len = std::min(kQuantChunk, count - begin);
    const float m = finite_max_abs(x + begin, len);
    float scale = m >= kQuantFloor ? m / static_cast<float>(q.levels) : 0.0f;
    // Near FLT_MAX, Q * s may round past it: one step down keeps every decoded value finite.
    if (!(scale * static_cast<float>(q.levels) < kInf)) scale = std::nextafter(scale, 0.0f);
    const float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
    std::memcpy(out, &scale, sizeof(scale));
    out += sizeof(scale);
    float* res = residual != nullptr ? residual + begin : nullptr;
    if (codec == Codec::int8) {
      quantize(x + begin, len, scale, inv, q, reinterpret_cast<int8_t*>(out), res);
    } else {
      quantize(x + begin, len, scale, inv, q, codes, res);
      pack_nibbles(codes, len, out);
    }
    out += code_bytes(codec, len);
  }
}

template <bool kAdd>
void decode_quant(Codec codec, const uint8_t* in, size_t count, float* out) {
  const Quant q = codec == Codec::int8 ? kInt8 : kInt4;
  alignas(32) int8_t codes[kQuantChunk];
  for (size_t begin = 0; begin < count; begin += kQuantChunk) {
    const size_t len = std::min(kQuantChunk, count - begin);
    float scale = 0.0f;
    std::memcpy(&scale, in, sizeof(scale));
    in += sizeof(scale);
    if (codec == Codec::int8) {
      dequantize<kAdd>(reinterpret_cast<const int8_t*>(in), len, scale, q, out + begin);
    } else {
      unpack_nibbles(in, len, codes);
      dequantize<kAdd>(codes, len, scale, q, out + begin);
    }
    in += code_bytes(codec, len);
  }
}

// ---- bf16 / fp16: saturating round to nearest even

struct Bf16Codec {
  static constexpr float kMax = kBf16Max;
  static uint16_t to_half(float f) { return detail::f32_to_bf16(f); }
  static float to_f32(uint16_t h) { return detail::bf16_to_f32(h); }
#if DTRAIN_COMM_HALF_SIMD
  static void store(uint16_t* p, __m256 v) { detail::store_bf16x8(p, v); }
  static __m256 load(const uint16_t* p) { return detail::load_bf16x8(p); }
#endif
};

struct Fp16Codec {
  static constexpr float kMax = kFp16Max;
  static uint16_t to_half(float f) { return detail::f32_to_f16(f); }
  static float to_f32(uint16_t h) { return detail::f16_to_f32(h); }
#if DTRAIN_COMM_HALF_SIMD
  static void store(uint16_t* p, __m256 v) { detail::store_f16x8(p, v); }
  static __m256 load(const uint16_t* p) { return detail::load_f16x8(p); }
#endif
};

template <class H>
void encode_half(const float* x, size_t count, uint8_t* out_bytes, float* residual) {
  auto* out = reinterpret_cast<uint16_t*>(out_bytes);
  size_t i = 0;
#if DTRAIN_COMM_HALF_SIMD
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256 inf = _mm256_set1_ps(kInf);
  const __m256 hi = _mm256_set1_ps(H::kMax);
  const __m256 lo = _mm256_set1_ps(-H::kMax);
  for (; i + 8 <= count; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const __m256 finite = _mm256_cmp_ps(_mm256_andnot_ps(sign, v), inf, _CMP_LT_OQ);
    const __m256 clamped = _mm256_blendv_ps(v, _mm256_min_ps(_mm256_max_ps(v, lo), hi), finite);
    H::store(out + i, clamped);
    if (residual != nullptr) {
      _mm256_storeu_ps(residual + i, _mm256_and_ps(_mm256_sub_ps(v, H::load(out + i)), finite));
    }
  }
#endif
  for (; i < count; ++i) {
    const float v = x[i];
    const bool finite = std::fabs(v) < kInf;
    out[i] = H::to_half(finite ? std::min(std::max(v, -H::kMax), H::kMax) : v);
    if (residual != nullptr) residual[i] = finite ? v - H::to_f32(out[i]) : 0.0f;
  }
}

template <class H, bool kAdd>
void decode_half(const uint8_t* in_bytes, size_t count, float* out) {
  const auto* in = reinterpret_cast<const uint16_t*>(in_bytes);
  size_t i = 0;
#if DTRAIN_COMM_HALF_SIMD
  for (; i + 8 <= count; i += 8) {
    __m256 v = H::load(in + i);
    if constexpr (kAdd) v = _mm256_add_ps(_mm256_loadu_ps(out + i), v);
    _mm256_storeu_ps(out + i, v);
  }
#endif
  for (; i < count; ++i) {
    const float v = H::to_f32(in[i]);
    if constexpr (kAdd) {
      out[i] += v;
    } else {
      out[i] = v;
    }
  }
}

template <bool kAdd>
void decode_impl(Codec codec, const uint8_t* in, size_t count, float* out) {
  if (count == 0) return;
  switch (codec) {
    case Codec::none:
      if constexpr (kAdd) {
        for (size_t i = 0; i < count; ++i) {
          float v;
          std::memcpy(&v, in + i * sizeof(float), sizeof(float));
          out[i] += v;
        }
      } else {
        std::memcpy(out, in, count * sizeof(float));
      }
      return;
    case Codec::bf16:
      return decode_half<Bf16Codec, kAdd>(in, count, out);
    case Codec::fp16:
      return decode_half<Fp16Codec, kAdd>(in, count, out);
    case Codec::int8:
    case Codec::int4:
      return decode_quant<kAdd>(codec, in, count, out);
  }
  DT_THROW("comm", "decode: unknown codec {}", static_cast<int>(codec));
}

}  // namespace

Codec parse_codec(const std::string& text) {
  if (text == "none") return Codec::none;
  if (text == "bf16") return Codec::bf16;
  if (text == "fp16") return Codec::fp16;
  if (text == "int8") return Codec::int8;
  if (text == "int4") return Codec::int4;
  DT_THROW("comm", "'{}' is not a codec: expected none, bf16, fp16, int8 or int4", text);
}

const char* name_of(Codec codec) {
  switch (codec) {
    case Codec::none:
      return "none";
    case Codec::bf16:
      return "bf16";
    case Codec::fp16:
      return "fp16";
    case Codec::int8:
      return "int8";
    case Codec::int4:
      return "int4";
  }
  return "?";
}

size_t encoded_bytes(Codec codec, size_t count) {
  switch (codec) {
    case Codec::none:
      return count * sizeof(float);
    case Codec::bf16:
    case Codec::fp16:
      return count * sizeof(uint16_t);
    case Codec::int8:
    case Codec::int4: {
      const size_t full = count / kQuantChunk;
      const size_t tail = count % kQuantChunk;
      return full * (sizeof(float) + code_bytes(codec, kQuantChunk)) +
             (tail > 0 ? sizeof(float) + code_bytes(codec, tail) : 0);
    }
  }
  DT_THROW("comm", "encoded_bytes: unknown codec {}", static_cast<int>(codec));
}

void encode(Codec codec, const float* x, size_t count, uint8_t* out, float* residual) {
  if (count == 0) return;
  switch (codec) {
    case Codec::none:
      std::memmove(out, x, count * sizeof(float));
      if (residual != nullptr) std::fill(residual, residual + count, 0.0f);
      return;
    case Codec::bf16:
      return encode_half<Bf16Codec>(x, count, out, residual);
    case Codec::fp16:
      return encode_half<Fp16Codec>(x, count, out, residual);
    case Codec::int8:
    case Codec::int4:
      return encode_quant(codec, x, count, out, residual);
  }
  DT_THROW("comm", "encode: unknown codec {}", static_cast<int>(codec));
}

void decode(Codec codec, const uint8_t* in, size_t count, float* out) { decode_impl<false>(codec, in, count, out); }

void decode_add(Codec codec, const uint8_t* in, size_t count, float* out) { decode_impl<true>(codec, in, count, out); }

double max_error(Codec codec, double abs_value, double chunk_max_abs) {
  const double slack = 1.0 + 0x1p-14;
  switch (codec) {
    case Codec::none:
      return 0.0;
    case Codec::bf16:
      return 0x1p-8 * abs_value + 0x1p-134;
    case Codec::fp16:
      return std::max(0x1p-11 * abs_value + 0x1p-25, abs_value - static_cast<double>(kFp16Max));
    case Codec::int8:
      return chunk_max_abs / (2.0 * kInt8.levels) * slack + kQuantFloor;
    case Codec::int4:
      return chunk_max_abs / (2.0 * kInt4.levels) * slack + kQuantFloor;
  }
  DT_THROW("comm", "max_error: unknown codec {}", static_cast<int>(codec));
}

}  // namespace dtrain::comm
