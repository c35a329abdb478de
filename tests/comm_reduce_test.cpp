// Reduction kernels (dtrain/comm/reduce.h) against a scalar reference: every dtype x op,
// lengths 0..67 (vector bodies and every tail), all aliasing shapes, NaN propagation,
// signed zeros, bf16/f16 rounding, integer wrap-around, and finish_avg.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "dtrain/comm/reduce.h"

namespace dtrain::comm {
namespace {

// ---- reference conversions, written differently from reduce.cpp: exact double arithmetic

// Rounds x to `bits` significant bits, RNE, with the given subnormal quantum and overflow
// threshold (|result| >= overflow -> infinity).
double round_to_format(double x, int bits, double min_quantum, double overflow) {
  if (std::isnan(x) || std::isinf(x) || x == 0) return x;
  int e = 0;
  std::frexp(x, &e);  // |x| = m * 2^e, m in [0.5, 1)
  const double quantum = std::max(std::ldexp(1.0, e - bits), min_quantum);
  const double r = std::nearbyint(x / quantum) * quantum;
  if (std::fabs(r) >= overflow) return std::copysign(INFINITY, x);
  return r;
}

uint16_t ref_to_bf16(float f) {
  if (std::isnan(f)) return 0x7fc0;
  const double r = round_to_format(f, 8, std::ldexp(1.0, -133), std::ldexp(1.0, 128));
  return static_cast<uint16_t>(std::bit_cast<uint32_t>(static_cast<float>(r)) >> 16);  // r is exact in f32
}
float ref_from_bf16(uint16_t h) { return std::bit_cast<float>(static_cast<uint32_t>(h) << 16); }

uint16_t ref_to_f16(float f) {
  if (std::isnan(f)) return 0x7e00;
  const double r = round_to_format(f, 11, std::ldexp(1.0, -24), 65536.0);
  const uint16_t sign = std::signbit(r) ? 0x8000 : 0;
  const double a = std::fabs(r);
  if (std::isinf(a)) return sign | 0x7c00;
  if (a < std::ldexp(1.0, -14)) return sign | static_cast<uint16_t>(a * std::ldexp(1.0, 24));
  int e = 0;
  const double m = std::frexp(a, &e);  // a = (2m) * 2^(e-1)
  return sign | static_cast<uint16_t>((e - 1 + 15) << 10) | static_cast<uint16_t>((2 * m - 1) * 1024);
}
float ref_from_f16(uint16_t h) {
  const int sign = (h & 0x8000) ? -1 : 1;
  const int exp = (h >> 10) & 0x1f;
  const int mant = h & 0x3ff;
  if (exp == 0x1f) return mant ? NAN : sign * INFINITY;
  if (exp == 0) return static_cast<float>(sign * std::ldexp(mant, -24));
  return static_cast<float>(sign * std::ldexp(1024 + mant, exp - 25));
}

bool is_half(DataType t) { return t == DataType::bf16 || t == DataType::f16; }
bool is_float(DataType t) { return t == DataType::f32 || t == DataType::f64 || is_half(t); }

// Elements as doubles (floats) or wrapped integers, read and written through the dtype.
double load_f(DataType t, const void* p, size_t i) {
  switch (t) {
    case DataType::f32:
      return static_cast<const float*>(p)[i];
    case DataType::f64:
      return static_cast<const double*>(p)[i];
    case DataType::bf16:
      return ref_from_bf16(static_cast<const uint16_t*>(p)[i]);
    case DataType::f16:
      return ref_from_f16(static_cast<const uint16_t*>(p)[i]);
    default:
      return 0;
  }
}
void store_f(DataType t, void* p, size_t i, double v) {
  switch (t) {
    case DataType::f32:
      static_cast<float*>(p)[i] = static_cast<float>(v);
      break;
    case DataType::f64:
      static_cast<double*>(p)[i] = v;
      break;
    case DataType::bf16:
      static_cast<uint16_t*>(p)[i] = ref_to_bf16(static_cast<float>(v));
      break;
    case DataType::f16:
      static_cast<uint16_t*>(p)[i] = ref_to_f16(static_cast<float>(v));
      break;
    default:
      break;
  }
}
int64_t load_i(DataType t, const void* p, size_t i) {
  switch (t) {
    case DataType::i32:
      return static_cast<const int32_t*>(p)[i];
    case DataType::i64:
      return static_cast<const int64_t*>(p)[i];
    case DataType::u8:
      return static_cast<const uint8_t*>(p)[i];
    default:
      return 0;
  }
}
void store_i(DataType t, void* p, size_t i, uint64_t bits) {  // wraps to the type's width
  switch (t) {
    case DataType::i32:
      static_cast<int32_t*>(p)[i] = static_cast<int32_t>(static_cast<uint32_t>(bits));
      break;
    case DataType::i64:
      static_cast<int64_t*>(p)[i] = static_cast<int64_t>(bits);
      break;
    case DataType::u8:
      static_cast<uint8_t*>(p)[i] = static_cast<uint8_t>(bits);
      break;
    default:
      break;
  }
}

// Reference a op b for one element, written into out[i].
void ref_op(DataType t, ReduceOp op, const void* a, const void* b, void* out, size_t i) {
  if (is_float(t)) {
    // Halves compute in f32 (widen, op, round once), f32 in f32, f64 in f64.
    const double x = load_f(t, a, i);
    const double y = load_f(t, b, i);
    double r = 0;
    switch (op) {
      case ReduceOp::sum:
      case ReduceOp::avg:
        r = t == DataType::f64 ? x + y : static_cast<double>(static_cast<float>(x) + static_cast<float>(y));
        break;
      case ReduceOp::prod:
        r = t == DataType::f64 ? x * y : static_cast<double>(static_cast<float>(x) * static_cast<float>(y));
        break;
      case ReduceOp::max:
        if (std::isnan(x) || std::isnan(y)) {
          r = NAN;
        } else if (x == 0 && y == 0) {
          r = std::signbit(x) && std::signbit(y) ? -0.0 : 0.0;  // -0 < +0
        } else {
          r = std::max(x, y);
        }
        break;
      case ReduceOp::min:
        if (std::isnan(x) || std::isnan(y)) {
          r = NAN;
        } else if (x == 0 && y == 0) {
          r = std::signbit(x) || std::signbit(y) ? -0.0 : 0.0;
        } else {
          r = std::min(x, y);
        }
        break;
    }
    store_f(t, out, i, r);
    return;
  }
  const int64_t x = load_i(t, a, i);
  const int64_t y = load_i(t, b, i);
  uint64_t r = 0;
  switch (op) {
    case ReduceOp::sum:
    case ReduceOp::avg:
      r = static_cast<uint64_t>(x) + static_cast<uint64_t>(y);
      break;
    case ReduceOp::prod:
      r = static_cast<uint64_t>(x) * static_cast<uint64_t>(y);
      break;
    case ReduceOp::max:
      r = static_cast<uint64_t>(std::max(x, y));
      break;
    case ReduceOp::min:
      r = static_cast<uint64_t>(std::min(x, y));
      break;
  }
  store_i(t, out, i, r);
}

// Random finite values of the dtype, including negatives, zeros of both signs, ties.
void fill_random(DataType t, void* p, size_t n, std::mt19937& rng, ReduceOp op) {
  std::uniform_int_distribution<int> pick(0, 15);
  for (size_t i = 0; i < n; ++i) {
    if (is_float(t)) {
      double v = std::uniform_real_distribution<double>(-100, 100)(rng);
      if (op == ReduceOp::prod) v = std::uniform_real_distribution<double>(-3, 3)(rng);
      const int k = pick(rng);
      if (k == 0) v = 0.0;
      if (k == 1) v = -0.0;
      if (k == 2) v = std::round(v);
      store_f(t, p, i, v);
    } else {
      std::uniform_int_distribution<int64_t> d(std::numeric_limits<int64_t>::min(),
                                               std::numeric_limits<int64_t>::max());
      store_i(t, p, i, static_cast<uint64_t>(d(rng)));
    }
  }
}

constexpr DataType kDtypes[] = {DataType::f32, DataType::bf16, DataType::f16, DataType::f64,
                                DataType::i32, DataType::i64,  DataType::u8};
constexpr ReduceOp kOps[] = {ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::min, ReduceOp::prod};

// Bitwise equality, except that any NaN matches any NaN.
bool same_element(DataType t, const void* a, const void* b, size_t i) {
  const size_t e = size_of(t);
  if (std::memcmp(static_cast<const char*>(a) + i * e, static_cast<const char*>(b) + i * e, e) == 0) return true;
  return is_float(t) && std::isnan(load_f(t, a, i)) && std::isnan(load_f(t, b, i));
}

TEST(CommReduce, EveryDtypeAndOpMatchesScalarReference) {
  std::mt19937 rng(1234);
  for (DataType t : kDtypes) {
    const size_t e = size_of(t);
    for (ReduceOp op : kOps) {
      for (size_t n = 0; n <= 67; ++n) {
        // One element of offset so the vector loops also see unaligned pointers.
        // Plus one guard element after the end.
        std::vector<std::byte> a((n + 2) * e), b((n + 2) * e), expect((n + 1) * e);
        void* pa = a.data() + e;
        void* pb = b.data() + e;
        fill_random(t, pa, n, rng, op);
        fill_random(t, pb, n, rng, op);
        for (size_t i = 0; i < n; ++i) ref_op(t, op, pa, pb, expect.data(), i);

        std::vector<std::byte> out(n * e + 1);  // distinct destination
        reduce_pair(out.data(), pa, pb, n, t, op);
        std::vector<std::byte> into_a(a), into_b(b);
        reduce_into(into_a.data() + e, pb, n, t, op);                     // dst == a
        reduce_pair(into_b.data() + e, pa, into_b.data() + e, n, t, op);  // dst == b
        for (size_t i = 0; i < n; ++i) {
          ASSERT_TRUE(same_element(t, out.data(), expect.data(), i))
              << name_of(t) << " " << name_of(op) << " n=" << n << " i=" << i << " distinct dst";
          ASSERT_TRUE(same_element(t, into_a.data() + e, expect.data(), i))
              << name_of(t) << " " << name_of(op) << " n=" << n << " i=" << i << " dst == a";
          ASSERT_TRUE(same_element(t, into_b.data() + e, expect.data(), i))
              << name_of(t) << " " << name_of(op) << " n=" << n << " i=" << i << " dst == b";
        }
        // Nothing written outside [0, n).
        ASSERT_EQ(std::memcmp(into_a.data(), a.data(), e), 0);
        ASSERT_EQ(std::memcmp(into_a.data() + (n + 1) * e, a.data() + (n + 1) * e, e), 0);
        ASSERT_EQ(std::memcmp(into_b.data() + (n + 1) * e, b.data() + (n + 1) * e, e), 0);
      }
    }
  }
}

TEST(CommReduce, OpsAreBitwiseCommutative) {
  // Recursive doubling relies on a op b == b op a bit for bit, on every lane and tail.
  std::mt19937 rng(7);
  for (DataType t : kDtypes) {
    for (ReduceOp op : kOps) {
      const size_t n = 37;
      const size_t e = size_of(t);
      std::vector<std::byte> a(n * e), b(n * e), ab(n * e), ba(n * e);
      fill_random(t, a.data(), n, rng, op);
      fill_random(t, b.data(), n, rng, op);
      reduce_pair(ab.data(), a.data(), b.data(), n, t, op);
      reduce_pair(ba.data(), b.data(), a.data(), n, t, op);
      EXPECT_EQ(std::memcmp(ab.data(), ba.data(), n * e), 0) << name_of(t) << " " << name_of(op);
    }
  }
}

TEST(CommReduce, NaNPropagatesAtEveryPosition) {
  for (DataType t : {DataType::f32, DataType::f64, DataType::bf16, DataType::f16}) {
    for (ReduceOp op : {ReduceOp::sum, ReduceOp::max, ReduceOp::min, ReduceOp::prod}) {
      const size_t n = 19;  // two 8-lane blocks and a tail
      const size_t e = size_of(t);
      for (size_t pos = 0; pos < n; ++pos) {
        for (int side = 0; side < 2; ++side) {
          std::vector<std::byte> a(n * e), b(n * e), out(n * e);
          for (size_t i = 0; i < n; ++i) {
            store_f(t, a.data(), i, 1.0 + static_cast<double>(i));
            store_f(t, b.data(), i, 2.0);
          }
          store_f(t, side == 0 ? a.data() : b.data(), pos, NAN);
          reduce_pair(out.data(), a.data(), b.data(), n, t, op);
          for (size_t i = 0; i < n; ++i) {
            EXPECT_EQ(std::isnan(load_f(t, out.data(), i)), i == pos)
                << name_of(t) << " " << name_of(op) << " nan at " << pos << " side " << side << " i=" << i;
          }
        }
      }
    }
  }
}

TEST(CommReduce, Bf16NaNWithLowPayloadStaysNaN) {
  // 0x7f81 widens to 0x7f810000; rounding it blindly would carry into infinity (0x7f80).
  const size_t n = 11;
  std::vector<uint16_t> a(n, 0x7f81), b(n, 0x3f80), out(n);  // NaN and 1.0
  for (ReduceOp op : {ReduceOp::sum, ReduceOp::max, ReduceOp::prod}) {
    reduce_pair(out.data(), a.data(), b.data(), n, DataType::bf16, op);
    for (size_t i = 0; i < n; ++i)
      EXPECT_TRUE(std::isnan(ref_from_bf16(out[i]))) << name_of(op) << " i=" << i << " bits " << out[i];
  }
}

TEST(CommReduce, MaxMinOfSignedZerosDoNotDependOnOrder) {
  for (DataType t : {DataType::f32, DataType::f64, DataType::bf16, DataType::f16}) {
    const size_t n = 10;
    const size_t e = size_of(t);
    std::vector<std::byte> pz(n * e), nz(n * e), out1(n * e), out2(n * e);
    for (size_t i = 0; i < n; ++i) {
      store_f(t, pz.data(), i, 0.0);
      store_f(t, nz.data(), i, -0.0);
    }
    reduce_pair(out1.data(), pz.data(), nz.data(), n, t, ReduceOp::max);
    reduce_pair(out2.data(), nz.data(), pz.data(), n, t, ReduceOp::max);
    for (size_t i = 0; i < n; ++i) {
      EXPECT_FALSE(std::signbit(load_f(t, out1.data(), i))) << name_of(t);
      EXPECT_FALSE(std::signbit(load_f(t, out2.data(), i))) << name_of(t);
    }
    reduce_pair(out1.data(), pz.data(), nz.data(), n, t, ReduceOp::min);
    reduce_pair(out2.data(), nz.data(), pz.data(), n, t, ReduceOp::min);
    for (size_t i = 0; i < n; ++i) {
      EXPECT_TRUE(std::signbit(load_f(t, out1.data(), i))) << name_of(t);
      EXPECT_TRUE(std::signbit(load_f(t, out2.data(), i))) << name_of(t);
    }
  }
}

// Sums a + b for halves, repeating each case 19 times so it lands in vector lanes and tails.
std::vector<uint16_t> half_sums(DataType t, uint16_t a, uint16_t b) {
  std::vector<uint16_t> x(19, a), y(19, b), out(19);
  reduce_pair(out.data(), x.data(), y.data(), out.size(), t, ReduceOp::sum);
  return out;
}

TEST(CommReduce, Bf16RoundsToNearestEven) {
  struct Case {
    float a, b;
    uint16_t expect;
  };
  const Case cases[] = {
      {1.0f, 0x1p-8f, 0x3f80},            // 1 + 2^-8 is a tie: even mantissa (1.0) wins
      {1.0f + 0x1p-7f, 0x1p-8f, 0x3f82},  // 1 + 3*2^-8 is a tie: rounds up to even 1 + 2^-6
      {1.0f, 0x1p-9f, 0x3f80},            // below half: down
      {1.0f, 0x1p-8f + 0x1p-9f, 0x3f81},  // above half: up
      {0x1.fep127f, 0x1p120f, 0x7f80},    // overflow rounds to +inf
      {-1.0f, -0x1p-8f, 0xbf80},          // negative tie to even
  };
  for (const Case& c : cases) {
    const uint16_t a = ref_to_bf16(c.a);
    const uint16_t b = ref_to_bf16(c.b);
    EXPECT_EQ(ref_to_bf16(ref_from_bf16(a) + ref_from_bf16(b)), c.expect) << "reference " << c.a << " + " << c.b;
    for (uint16_t got : half_sums(DataType::bf16, a, b)) EXPECT_EQ(got, c.expect) << c.a << " + " << c.b;
  }
  // The hand-computed ones, independent of the reference rounding.
  for (uint16_t got : half_sums(DataType::bf16, 0x3f80, 0x3b80)) EXPECT_EQ(got, 0x3f80);  // 1 + 2^-8
  for (uint16_t got : half_sums(DataType::bf16, 0x3f81, 0x3b80)) EXPECT_EQ(got, 0x3f82);  // (1+2^-7) + 2^-8
  for (uint16_t got : half_sums(DataType::bf16, 0x7f7f, 0x7f7f)) EXPECT_EQ(got, 0x7f80);  // max + max = inf
}

TEST(CommReduce, F16RoundsToNearestEven) {
  // 0x3c00 = 1.0, 0x1000 = 2^-11, 0x3c01 = 1 + 2^-10.
  for (uint16_t got : half_sums(DataType::f16, 0x3c00, 0x1000)) EXPECT_EQ(got, 0x3c00);  // tie -> even (1.0)
  for (uint16_t got : half_sums(DataType::f16, 0x3c01, 0x1000)) EXPECT_EQ(got, 0x3c02);  // tie -> even (up)
  for (uint16_t got : half_sums(DataType::f16, 0x7bff, 0x5000)) EXPECT_EQ(got, 0x7c00);  // 65504 + 32 -> inf
  for (uint16_t got : half_sums(DataType::f16, 0x7bff, 0x4c00))
    EXPECT_EQ(got, 0x7c00);  // 65504 + 16: tie, 65504 is odd -> inf
  for (uint16_t got : half_sums(DataType::f16, 0x7bff, 0x4800)) EXPECT_EQ(got, 0x7bff);  // 65504 + 8: below the tie
  // Subnormals: 2^-24 + 2^-24 = 2^-23, and the smallest subnormal plus a tie.
  for (uint16_t got : half_sums(DataType::f16, 0x0001, 0x0001)) EXPECT_EQ(got, 0x0002);
  for (uint16_t got : half_sums(DataType::f16, 0x03ff, 0x0001)) EXPECT_EQ(got, 0x0400);  // subnormal -> normal
  for (uint16_t got : half_sums(DataType::f16, 0x8001, 0x0001)) EXPECT_EQ(got, 0x0000);  // -tiny + tiny = +0
}

TEST(CommReduce, IntegersWrapAround) {
  {
    std::vector<int32_t> a(13, std::numeric_limits<int32_t>::max()), b(13, 1), out(13);
    reduce_pair(out.data(), a.data(), b.data(), 13, DataType::i32, ReduceOp::sum);
    for (int32_t v : out) EXPECT_EQ(v, std::numeric_limits<int32_t>::min());
    std::vector<int32_t> c(13, 65536), d(13, 65537);
    reduce_pair(out.data(), c.data(), d.data(), 13, DataType::i32, ReduceOp::prod);
    for (int32_t v : out) EXPECT_EQ(v, 65536);  // 2^32 + 2^16 wraps to 2^16
  }
  {
    std::vector<int64_t> a(9, std::numeric_limits<int64_t>::min()), b(9, -1), out(9);
    reduce_pair(out.data(), a.data(), b.data(), 9, DataType::i64, ReduceOp::sum);
    for (int64_t v : out) EXPECT_EQ(v, std::numeric_limits<int64_t>::max());
    reduce_pair(out.data(), a.data(), b.data(), 9, DataType::i64, ReduceOp::prod);
    for (int64_t v : out) EXPECT_EQ(v, std::numeric_limits<int64_t>::min());  // -(-2^63) wraps
  }
  {
    std::vector<uint8_t> a(40, 200), b(40, 100), out(40);
    reduce_pair(out.data(), a.data(), b.data(), 40, DataType::u8, ReduceOp::sum);
    for (uint8_t v : out) EXPECT_EQ(v, 44);
    reduce_pair(out.data(), a.data(), b.data(), 40, DataType::u8, ReduceOp::prod);
    for (uint8_t v : out) EXPECT_EQ(v, static_cast<uint8_t>(20000 % 256));
    reduce_pair(out.data(), a.data(), b.data(), 40, DataType::u8, ReduceOp::max);
    for (uint8_t v : out) EXPECT_EQ(v, 200);  // unsigned compare
  }
}

TEST(CommReduce, FinishAvgDividesOnceAndTruncatesIntegers) {
  for (DataType t : kDtypes) {
    for (size_t n : {size_t{0}, size_t{1}, size_t{8}, size_t{67}}) {
      const size_t e = size_of(t);
      std::vector<std::byte> buf(n * e), expect(n * e);
      for (size_t i = 0; i < n; ++i) {
        const auto v = static_cast<int64_t>(i * 3) - (t == DataType::u8 ? 0 : 50);
        if (is_float(t)) {
          store_f(t, buf.data(), i, static_cast<double>(v));
          // f32/f64 divide in their own precision, halves in f32 then round.
          const double q =
              t == DataType::f64 ? static_cast<double>(v) / 3 : static_cast<double>(static_cast<float>(v) / 3.0f);
          store_f(t, expect.data(), i, q);
        } else {
          store_i(t, buf.data(), i, static_cast<uint64_t>(v));
          store_i(t, expect.data(), i, static_cast<uint64_t>(load_i(t, buf.data(), i) / 3));  // truncates
        }
      }
      std::vector<std::byte> untouched(buf);
      finish_avg(untouched.data(), n, t, ReduceOp::sum, 3);
      EXPECT_EQ(untouched, buf) << "finish_avg must ignore ops other than avg";
      finish_avg(buf.data(), n, t, ReduceOp::avg, 3);
      for (size_t i = 0; i < n; ++i)
        ASSERT_TRUE(same_element(t, buf.data(), expect.data(), i)) << name_of(t) << " i=" << i;
    }
  }
  std::vector<int32_t> neg(5, -7);
  finish_avg(neg.data(), neg.size(), DataType::i32, ReduceOp::avg, 2);
  for (int32_t v : neg) EXPECT_EQ(v, -3);  // toward zero
  std::vector<uint8_t> big(5, 250);
  finish_avg(big.data(), big.size(), DataType::u8, ReduceOp::avg, 300);  // the divisor must not wrap to 44
  for (uint8_t v : big) EXPECT_EQ(v, 0);
}

}  // namespace
}  // namespace dtrain::comm
