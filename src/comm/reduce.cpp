// Reduction kernels on raw buffers (see reduce.h).
//
// f32/f64/integers: plain loops over __restrict pointers that GCC vectorises at -O3
// -march=native. bf16/f16: 8 lanes at a time widened to f32 with AVX2/F16C when the build
// has them, reduced in f32 and rounded back to nearest even; a scalar path does the tails and
// builds without those extensions.
//
// Every kernel is bitwise commutative, a op b == b op a: IEEE add and multiply are, and
// max/min are written symmetrically (-0 < +0; equal values give the same bits). Collectives
// rely on this: recursive doubling has both partners combine the same two vectors, in
// opposite roles, and they must agree bit for bit. A NaN operand gives a NaN result; for
// max/min the NaN is the same on both sides, for sum/prod its payload follows the hardware.
#include "dtrain/comm/reduce.h"

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "half_convert.h"

namespace dtrain::comm {

namespace {

using detail::bf16_to_f32;
using detail::f16_to_f32;
using detail::f32_to_bf16;
using detail::f32_to_f16;

// ---- operators

template <class F>
struct FloatBits;
template <>
struct FloatBits<float> {
  using U = uint32_t;
  static constexpr U kQuiet = 0x00400000u;
};
template <>
struct FloatBits<double> {
  using U = uint64_t;
  static constexpr U kQuiet = 0x0008000000000000ull;
};

template <class T>
constexpr bool kIsFloat = std::is_floating_point_v<T>;

struct SumOp {
  template <class T>
  static T apply(T a, T b) {
    if constexpr (kIsFloat<T>) {
      return a + b;
    } else {
      using U = std::make_unsigned_t<T>;
      return static_cast<T>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b)));
    }
  }
#if DTRAIN_COMM_HALF_SIMD
  static __m256 vec(__m256 a, __m256 b) { return _mm256_add_ps(a, b); }
#endif
};

struct ProdOp {
  template <class T>
  static T apply(T a, T b) {
    if constexpr (kIsFloat<T>) {
      return a * b;
    } else if constexpr (sizeof(T) < sizeof(unsigned)) {
      // Narrow types promote to int; their product fits, the cast wraps.
      return static_cast<T>(static_cast<unsigned>(a) * static_cast<unsigned>(b));
    } else {
      using U = std::make_unsigned_t<T>;
      return static_cast<T>(static_cast<U>(a) * static_cast<U>(b));
    }
  }
#if DTRAIN_COMM_HALF_SIMD
  static __m256 vec(__m256 a, __m256 b) { return _mm256_mul_ps(a, b); }
#endif
};

// max/min: NaN propagates; equal values (only +0/-0 differ in bits) combine bitwise so the
// result does not depend on the operand order; a NaN result is the OR of both patterns
// with the quiet bit set, again symmetric.
struct MaxOp {
  template <class T>
  static T apply(T a, T b) {
    if constexpr (kIsFloat<T>) {
      using U = typename FloatBits<T>::U;
      const U ua = std::bit_cast<U>(a);
      const U ub = std::bit_cast<U>(b);
      U r = a > b ? ua : ub;
      r = a == b ? (ua & ub) : r;
      r = ((a != a) | (b != b)) ? (ua | ub | FloatBits<T>::kQuiet) : r;
      return std::bit_cast<T>(r);
    } else {
      return a > b ? a : b;
    }
  }
#if DTRAIN_COMM_HALF_SIMD
  static __m256 vec(__m256 a, __m256 b) {
    __m256 r = _mm256_blendv_ps(b, a, _mm256_cmp_ps(a, b, _CMP_GT_OQ));
    r = _mm256_blendv_ps(r, _mm256_and_ps(a, b), _mm256_cmp_ps(a, b, _CMP_EQ_OQ));
    const __m256 nan = _mm256_or_ps(_mm256_or_ps(a, b), _mm256_castsi256_ps(_mm256_set1_epi32(0x00400000)));
    return _mm256_blendv_ps(r, nan, _mm256_cmp_ps(a, b, _CMP_UNORD_Q));
  }
#endif
};

struct MinOp {
  template <class T>
  static T apply(T a, T b) {
    if constexpr (kIsFloat<T>) {
      using U = typename FloatBits<T>::U;
      const U ua = std::bit_cast<U>(a);
      const U ub = std::bit_cast<U>(b);
      U r = a < b ? ua : ub;
      r = a == b ? (ua | ub) : r;
      r = ((a != a) | (b != b)) ? (ua | ub | FloatBits<T>::kQuiet) : r;
      return std::bit_cast<T>(r);
    } else {
      return a < b ? a : b;
    }
  }
#if DTRAIN_COMM_HALF_SIMD
  static __m256 vec(__m256 a, __m256 b) {
    __m256 r = _mm256_blendv_ps(b, a, _mm256_cmp_ps(a, b, _CMP_LT_OQ));
    r = _mm256_blendv_ps(r, _mm256_or_ps(a, b), _mm256_cmp_ps(a, b, _CMP_EQ_OQ));
    const __m256 nan = _mm256_or_ps(_mm256_or_ps(a, b), _mm256_castsi256_ps(_mm256_set1_epi32(0x00400000)));
    return _mm256_blendv_ps(r, nan, _mm256_cmp_ps(a, b, _CMP_UNORD_Q));
  }
#endif
};

// ---- loops over native element types

// Three shapes because __restrict forbids aliasing: dst op= src, dst = src op dst, and
// dst = a op b with three distinct buffers.
template <class T, class Op>
void loop_into(T* __restrict dst, const T* __restrict src, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = Op::apply(dst[i], src[i]);
}
template <class T, class Op>
void loop_into_rev(T* __restrict dst, const T* __restrict src, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = Op::apply(src[i], dst[i]);
}
template <class T, class Op>
void loop_pair(T* __restrict dst, const T* __restrict a, const T* __restrict b, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = Op::apply(a[i], b[i]);
}

template <class T, class Op>
void native_pair(void* dst, const void* a, const void* b, size_t n) {
  auto* d = static_cast<T*>(dst);
  const auto* x = static_cast<const T*>(a);
  const auto* y = static_cast<const T*>(b);
  if (d == x) {
    loop_into<T, Op>(d, y, n);
  } else if (d == y) {
    loop_into_rev<T, Op>(d, x, n);
  } else {
    loop_pair<T, Op>(d, x, y, n);
  }
}

// ---- bf16 / f16: widen, reduce in f32, round back

struct Bf16 {
  static float to_f32(uint16_t h) { return bf16_to_f32(h); }
  static uint16_t from_f32(float f) { return f32_to_bf16(f); }
#if DTRAIN_COMM_HALF_SIMD
  static __m256 load(const uint16_t* p) { return detail::load_bf16x8(p); }
  static void store(uint16_t* p, __m256 v) { detail::store_bf16x8(p, v); }
#endif
};

struct F16 {
  static float to_f32(uint16_t h) { return f16_to_f32(h); }
  static uint16_t from_f32(float f) { return f32_to_f16(f); }
#if DTRAIN_COMM_HALF_SIMD
  static __m256 load(const uint16_t* p) { return detail::load_f16x8(p); }
  static void store(uint16_t* p, __m256 v) { detail::store_f16x8(p, v); }
#endif
};

// dst[i] = a[i] op b[i]; element-wise, so any exact aliasing of dst with a or b is fine.
template <class H, class Op>
void half_pair(void* dst, const void* a, const void* b, size_t n) {
  auto* d = static_cast<uint16_t*>(dst);
  const auto* x = static_cast<const uint16_t*>(a);
  const auto* y = static_cast<const uint16_t*>(b);
  size_t i = 0;
#if DTRAIN_COMM_HALF_SIMD
  for (; i + 8 <= n; i += 8) H::store(d + i, Op::vec(H::load(x + i), H::load(y + i)));
#endif
  for (; i < n; ++i) d[i] = H::from_f32(Op::apply(H::to_f32(x[i]), H::to_f32(y[i])));
}

template <class H>
void half_divide(void* dst, size_t n, int world) {
  auto* d = static_cast<uint16_t*>(dst);
  const auto w = static_cast<float>(world);
  size_t i = 0;
#if DTRAIN_COMM_HALF_SIMD
  const __m256 wv = _mm256_set1_ps(w);
  for (; i + 8 <= n; i += 8) H::store(d + i, _mm256_div_ps(H::load(d + i), wv));
#endif
  for (; i < n; ++i) d[i] = H::from_f32(H::to_f32(d[i]) / w);
}

template <class Op>
void dispatch_dtype(void* dst, const void* a, const void* b, size_t n, DataType dtype) {
  switch (dtype) {
    case DataType::f32:
      return native_pair<float, Op>(dst, a, b, n);
    case DataType::f64:
      return native_pair<double, Op>(dst, a, b, n);
    case DataType::i32:
      return native_pair<int32_t, Op>(dst, a, b, n);
    case DataType::i64:
      return native_pair<int64_t, Op>(dst, a, b, n);
    case DataType::u8:
      return native_pair<uint8_t, Op>(dst, a, b, n);
    case DataType::bf16:
      return half_pair<Bf16, Op>(dst, a, b, n);
    case DataType::f16:
      return half_pair<F16, Op>(dst, a, b, n);
  }
  DT_THROW("comm", "reduce: unknown dtype {}", static_cast<int>(dtype));
}

template <class T>
void divide_floats(T* __restrict d, size_t n, T w) {
  for (size_t i = 0; i < n; ++i) d[i] = d[i] / w;
}

template <class T>
void divide_ints(T* __restrict d, size_t n, int world) {
  // Divide in 64 bits: a world larger than T's range must not wrap the divisor.
  const auto w = static_cast<int64_t>(world);
  for (size_t i = 0; i < n; ++i) d[i] = static_cast<T>(static_cast<int64_t>(d[i]) / w);
}

}  // namespace

void reduce_pair(void* dst, const void* a, const void* b, size_t count, DataType dtype, ReduceOp op) {
  if (count == 0) return;
  switch (op) {
    case ReduceOp::sum:
    case ReduceOp::avg:
      return dispatch_dtype<SumOp>(dst, a, b, count, dtype);
    case ReduceOp::prod:
      return dispatch_dtype<ProdOp>(dst, a, b, count, dtype);
    case ReduceOp::max:
      return dispatch_dtype<MaxOp>(dst, a, b, count, dtype);
    case ReduceOp::min:
      return dispatch_dtype<MinOp>(dst, a, b, count, dtype);
  }
  DT_THROW("comm", "reduce: unknown op {}", static_cast<int>(op));
}

void reduce_into(void* dst, const void* src, size_t count, DataType dtype, ReduceOp op) {
  reduce_pair(dst, dst, src, count, dtype, op);
}

void finish_avg(void* dst, size_t count, DataType dtype, ReduceOp op, int world) {
  if (op != ReduceOp::avg || count == 0) return;
  DT_CHECK(world > 0, "comm", "finish_avg: world size must be positive, got {}", world);
  switch (dtype) {
    case DataType::f32:
      return divide_floats(static_cast<float*>(dst), count, static_cast<float>(world));
    case DataType::f64:
      return divide_floats(static_cast<double*>(dst), count, static_cast<double>(world));
    case DataType::i32:
      return divide_ints(static_cast<int32_t*>(dst), count, world);
    case DataType::i64:
      return divide_ints(static_cast<int64_t*>(dst), count, world);
    case DataType::u8:
      return divide_ints(static_cast<uint8_t*>(dst), count, world);
    case DataType::bf16:
      return half_divide<Bf16>(dst, count, world);
    case DataType::f16:
      return half_divide<F16>(dst, count, world);
  }
  DT_THROW("comm", "finish_avg: unknown dtype {}", static_cast<int>(dtype));
}

}  // namespace dtrain::comm
