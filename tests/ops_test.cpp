// Every op in ops.h: forward values against naive references written here, gradients against
// finite differences (gradcheck.h), broadcasting and empty shapes, views, dtype conversion,
// and the errors ops raise.
#include "dtrain/tensor/ops.h"

#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "../src/tensor/dot_tiles.h"
#include "dtrain/core/error.h"
#include "dtrain/tensor/autograd.h"
#include "dtrain/tensor/half.h"
#include "dtrain/tensor/random.h"
#include "gradcheck.h"

using namespace dtrain;
using test::all_close;
using test::gradcheck;
using test::GradcheckOptions;
using test::throws_with;

namespace {

using BinaryOp = Tensor (*)(const Tensor&, const Tensor&);

struct BinaryCase {
  const char* name;
  BinaryOp op;
  double (*ref)(double, double);
};

const BinaryCase kBinaryOps[] = {
    {"add", ops::add, [](double x, double y) { return x + y; }},
    {"sub", ops::sub, [](double x, double y) { return x - y; }},
    {"mul", ops::mul, [](double x, double y) { return x * y; }},
    {"div", ops::div, [](double x, double y) { return x / y; }},
};

// Naive NumPy broadcasting: out[i] = f(a[broadcast(i)], b[broadcast(i)]).
std::vector<float> naive_binary(const Tensor& a, const Tensor& b, double (*f)(double, double)) {
  const Shape out = ops::broadcast_shapes(a.shape(), b.shape(), "test");
  const std::vector<float> av = a.to_vector();
  const std::vector<float> bv = b.to_vector();
  std::vector<float> o(static_cast<size_t>(shape_numel(out)));
  for (int64_t i = 0; i < shape_numel(out); ++i) {
    const auto idx = test::unravel(i, out);
    o[static_cast<size_t>(i)] = static_cast<float>(f(av[static_cast<size_t>(test::broadcast_index(idx, a.shape()))],
                                                     bv[static_cast<size_t>(test::broadcast_index(idx, b.shape()))]));
  }
  return o;
}

// Divisors in [0.5, 2) keep 1/b and its finite differences well conditioned.
Tensor operand(const Shape& shape, uint64_t seed, bool divisor) {
  return divisor ? test::uniform(shape, seed, 0.5f, 2.0f) : test::randn(shape, seed);
}

const std::pair<Shape, Shape> kBroadcastPairs[] = {
    {{2, 3}, {2, 3}},       {{3, 1}, {1, 4}}, {{2, 3, 4}, {4}},       {{4}, {2, 3, 4}},
    {{}, {2, 3}},           {{2, 3}, {}},     {{2, 1, 4}, {3, 1}},    {{1}, {5}},
    {{2, 3, 4}, {1, 3, 1}}, {{1, 1}, {1, 1}}, {{2, 3, 4}, {2, 1, 4}}, {{}, {}},
};

}  // namespace

// ---------------------------------------------------------------- elementwise binary

TEST(OpsBinary, ForwardMatchesNaiveBroadcasting) {
  for (const auto& op : kBinaryOps) {
    for (const auto& [sa, sb] : kBroadcastPairs) {
      SCOPED_TRACE(std::string(op.name) + " " + shape_str(sa) + " x " + shape_str(sb));
      const Tensor a = operand(sa, 1, false);
      const Tensor b = operand(sb, 2, op.op == ops::div);
      const Tensor y = op.op(a, b);
      EXPECT_EQ(y.shape(), ops::broadcast_shapes(sa, sb, "test"));
      EXPECT_TRUE(all_close(y, naive_binary(a, b, op.ref), 1e-6, 1e-6));
    }
  }
}

TEST(OpsBinary, HandComputedBroadcast3x1By1x4) {
  const Tensor a = Tensor::from_vector({3, 1}, {1, 2, 3});
  const Tensor b = Tensor::from_vector({1, 4}, {10, 20, 30, 40});
  const Tensor y = ops::add(a, b);
  ASSERT_EQ(y.shape(), (Shape{3, 4}));
  EXPECT_EQ(y.to_vector(), (std::vector<float>{11, 21, 31, 41, 12, 22, 32, 42, 13, 23, 33, 43}));
  const Tensor z = ops::sub(b, a);  // (1,4) - (3,1)
  EXPECT_EQ(z.to_vector(), (std::vector<float>{9, 19, 29, 39, 8, 18, 28, 38, 7, 17, 27, 37}));
}

TEST(OpsBinary, NonContiguousAndOffsetOperands) {
  for (const auto& op : kBinaryOps) {
    SCOPED_TRACE(op.name);
    const bool div = op.op == ops::div;
    // (3, 4) transposed view against a (4) vector and against a same-shape contiguous tensor.
    const Tensor at = operand({4, 3}, 3, false).transpose(0, 1);
    ASSERT_FALSE(at.is_contiguous());
    const Tensor b4 = operand({4}, 4, div);
    EXPECT_TRUE(all_close(op.op(at, b4), naive_binary(at, b4, op.ref), 1e-6, 1e-6));
    const Tensor full = operand({3, 4}, 5, div);
    EXPECT_TRUE(all_close(op.op(full, at.contiguous()), naive_binary(full, at, op.ref), 1e-6, 1e-6));
    EXPECT_TRUE(all_close(op.op(at, full), naive_binary(at, full, op.ref), 1e-6, 1e-6));
    // A slice starts at a non-zero offset and has a non-unit row stride.
    const Tensor sl = operand({4, 5}, 7, div).slice(1, 1, 4);  // (4, 3)
    const Tensor a43 = operand({4, 3}, 8, false);
    EXPECT_TRUE(all_close(op.op(a43, sl), naive_binary(a43, sl, op.ref), 1e-6, 1e-6));
    const Tensor s3 = operand({3}, 9, div);
    EXPECT_TRUE(all_close(op.op(sl, s3), naive_binary(sl, s3, op.ref), 1e-6, 1e-6));
  }
}

TEST(OpsBinary, GradientsWithBroadcasting) {
  for (const auto& op : kBinaryOps) {
    for (const auto& [sa, sb] : kBroadcastPairs) {
      SCOPED_TRACE(std::string(op.name) + " " + shape_str(sa) + " x " + shape_str(sb));
      const BinaryOp f = op.op;
      EXPECT_TRUE(gradcheck([f](const std::vector<Tensor>& in) { return f(in[0], in[1]); },
                            {operand(sa, 11, false), operand(sb, 12, f == ops::div)}));
    }
  }
}

TEST(OpsBinary, GradientsOfOneSideOnly) {
  // Only b requires grad (and then only a): the node must not produce the other gradient.
  for (const auto& op : kBinaryOps) {
    SCOPED_TRACE(op.name);
    const BinaryOp f = op.op;
    const Tensor a = operand({2, 3}, 13, false);
    const Tensor b = operand({3}, 14, f == ops::div);
    GradcheckOptions only_b;
    only_b.wrt = {false, true};
    EXPECT_TRUE(gradcheck([f](const std::vector<Tensor>& in) { return f(in[0], in[1]); }, {a, b}, only_b));
    GradcheckOptions only_a;
    only_a.wrt = {true, false};
    EXPECT_TRUE(gradcheck([f](const std::vector<Tensor>& in) { return f(in[0], in[1]); }, {a, b}, only_a));
  }
}

TEST(OpsBinary, GradientsThroughNonContiguousInputs) {
  for (const auto& op : kBinaryOps) {
    SCOPED_TRACE(op.name);
    const BinaryOp f = op.op;
    EXPECT_TRUE(gradcheck([f](const std::vector<Tensor>& in) { return f(in[0].transpose(0, 1), in[1].slice(0, 1, 4)); },
                          {operand({4, 3}, 15, false), operand({5, 4}, 16, f == ops::div)}));
  }
}

TEST(OpsBinary, ScalarTensorAndOperators) {
  const Tensor a = Tensor::from_vector({2, 2}, {1, 2, 3, 4});
  const Tensor s = Tensor::scalar(2.0f);
  EXPECT_EQ(ops::mul(s, a).to_vector(), (std::vector<float>{2, 4, 6, 8}));
  EXPECT_EQ(ops::div(a, s).to_vector(), (std::vector<float>{0.5f, 1, 1.5f, 2}));
  EXPECT_EQ(ops::sub(s, a).to_vector(), (std::vector<float>{1, 0, -1, -2}));
  EXPECT_EQ((a + a).to_vector(), (std::vector<float>{2, 4, 6, 8}));
  EXPECT_EQ((a - s).to_vector(), (std::vector<float>{-1, 0, 1, 2}));
  EXPECT_EQ((a * a).to_vector(), (std::vector<float>{1, 4, 9, 16}));
  EXPECT_EQ((a / a).to_vector(), (std::vector<float>{1, 1, 1, 1}));
  EXPECT_EQ((a + 1.0f).to_vector(), (std::vector<float>{2, 3, 4, 5}));
  EXPECT_EQ((a - 1.0f).to_vector(), (std::vector<float>{0, 1, 2, 3}));
  EXPECT_EQ((a * 3.0f).to_vector(), (std::vector<float>{3, 6, 9, 12}));
  EXPECT_EQ((a / 2.0f).to_vector(), (std::vector<float>{0.5f, 1, 1.5f, 2}));
  EXPECT_EQ((-a).to_vector(), (std::vector<float>{-1, -2, -3, -4}));
}

TEST(OpsBinary, EmptyDimensions) {
  struct Case {
    Shape a, b, out;
  };
  const Case cases[] = {
      {{0, 3}, {3}, {0, 3}}, {{0, 3}, {1, 3}, {0, 3}}, {{2, 0}, {2, 1}, {2, 0}},
      {{0}, {}, {0}},        {{3, 0}, {0}, {3, 0}},    {{0, 3}, {0, 3}, {0, 3}},
  };
  for (const auto& op : kBinaryOps) {
    for (const auto& c : cases) {
      SCOPED_TRACE(std::string(op.name) + " " + shape_str(c.a) + " x " + shape_str(c.b));
      Tensor a = Tensor::ones(c.a).set_requires_grad(true);
      Tensor b = Tensor::ones(c.b).set_requires_grad(true);
      Tensor y = op.op(a, b);
      EXPECT_EQ(y.shape(), c.out);
      EXPECT_EQ(y.numel(), 0);
      ops::sum(y).backward();
      ASSERT_TRUE(a.grad().defined());
      ASSERT_TRUE(b.grad().defined());
      EXPECT_EQ(a.grad().shape(), c.a);
      EXPECT_EQ(b.grad().shape(), c.b);
      // Nothing flowed back: a broadcast operand with elements gets zeros.
      for (float v : b.grad().to_vector()) EXPECT_EQ(v, 0.0f);
      for (float v : a.grad().to_vector()) EXPECT_EQ(v, 0.0f);
    }
  }
}

TEST(OpsBinary, ShapeMismatchNamesBothShapes) {
  const Tensor a = Tensor::zeros({2, 3});
  const Tensor b = Tensor::zeros({4});
  for (const auto& op : kBinaryOps) {
    SCOPED_TRACE(op.name);
    EXPECT_TRUE(throws_with([&] { op.op(a, b); }, {op.name, "[2, 3]", "[4]"}));
  }
  EXPECT_TRUE(throws_with([&] { ops::add(Tensor::zeros({3, 2}), Tensor::zeros({2, 3})); }, {"[3, 2]", "[2, 3]"}));
  EXPECT_TRUE(throws_with([&] { ops::broadcast_shapes({5, 1}, {3, 4}, "myop"); }, {"myop", "[5, 1]", "[3, 4]"}));
}

TEST(OpsBinary, SumToReducesBroadcastDimensions) {
  const Tensor g = Tensor::from_vector({2, 3}, {1, 2, 3, 4, 5, 6});
  EXPECT_EQ(ops::sum_to(g, {3}).to_vector(), (std::vector<float>{5, 7, 9}));
  EXPECT_EQ(ops::sum_to(g, {2, 1}).to_vector(), (std::vector<float>{6, 15}));
  EXPECT_EQ(ops::sum_to(g, {1, 3}).shape(), (Shape{1, 3}));
  EXPECT_EQ(ops::sum_to(g, {}).to_vector(), (std::vector<float>{21}));
  EXPECT_EQ(ops::sum_to(g, {}).shape(), Shape{});
  EXPECT_EQ(ops::sum_to(g, {2, 3}).to_vector(), g.to_vector());
}

// ---------------------------------------------------------------- elementwise unary

namespace {

struct UnaryCase {
  const char* name;
  Tensor (*op)(const Tensor&);
  double (*ref)(double);
  float lo, hi;  // input domain
  bool avoid_zero;
};

double gelu_ref(double x) {
  const double kC = std::sqrt(2.0 / M_PI);
  return 0.5 * x * (1.0 + std::tanh(kC * (x + 0.044715 * x * x * x)));
}

const UnaryCase kUnaryOps[] = {
    {"add_scalar", [](const Tensor& a) { return ops::add_scalar(a, 0.75f); }, [](double x) { return x + 0.75; }, -2, 2,
     false},
    {"mul_scalar", [](const Tensor& a) { return ops::mul_scalar(a, -1.5f); }, [](double x) { return -1.5 * x; }, -2, 2,
     false},
    {"neg", ops::neg, [](double x) { return -x; }, -2, 2, false},
    {"relu", ops::relu, [](double x) { return x > 0 ? x : 0.0; }, -2, 2, true},
    {"gelu", [](const Tensor& a) { return ops::gelu(a); }, gelu_ref, -3, 3, false},
    {"tanh", ops::tanh, [](double x) { return std::tanh(x); }, -2, 2, false},
    {"exp", ops::exp, [](double x) { return std::exp(x); }, -2, 2, false},
    {"log", ops::log, [](double x) { return std::log(x); }, 0.5, 3, false},
    {"square", ops::square, [](double x) { return x * x; }, -2, 2, false},
    {"sqrt", ops::sqrt, [](double x) { return std::sqrt(x); }, 0.5, 3, false},
};

Tensor unary_input(const UnaryCase& c, const Shape& shape, uint64_t seed) {
  Tensor x = test::uniform(shape, seed, c.lo, c.hi);
  if (c.avoid_zero) {  // keep x +- eps on one side of relu's kink
    float* p = x.data();
    for (int64_t i = 0; i < x.numel(); ++i) {
      if (std::abs(p[i]) < 0.1f) p[i] = p[i] < 0 ? p[i] - 0.1f : p[i] + 0.1f;
    }
  }
  return x;
}

}  // namespace

TEST(OpsUnary, ForwardMatchesReference) {
  for (const auto& c : kUnaryOps) {
    SCOPED_TRACE(c.name);
    const Tensor x = unary_input(c, {3, 7}, 21);
    const Tensor y = c.op(x);
    EXPECT_EQ(y.shape(), x.shape());
    std::vector<float> expected;
    for (float v : x.to_vector()) expected.push_back(static_cast<float>(c.ref(v)));
    EXPECT_TRUE(all_close(y, expected, 1e-6, 1e-6));
  }
}

TEST(OpsUnary, KnownValues) {
  const Tensor x = Tensor::from_vector({5}, {-1, 0, 1, 2, 4});
  EXPECT_EQ(ops::relu(x).to_vector(), (std::vector<float>{0, 0, 1, 2, 4}));
  EXPECT_EQ(ops::square(x).to_vector(), (std::vector<float>{1, 0, 1, 4, 16}));
  EXPECT_TRUE(all_close(ops::gelu(x), {-0.158808f, 0.0f, 0.841192f, 1.954598f, 3.999930f}, 1e-5, 0));
  EXPECT_EQ(ops::sqrt(Tensor::from_vector({3}, {0, 4, 9})).to_vector(), (std::vector<float>{0, 2, 3}));
  EXPECT_EQ(ops::exp(Tensor::scalar(0.0f)).item(), 1.0f);
  EXPECT_EQ(ops::log(Tensor::scalar(1.0f)).item(), 0.0f);
}

TEST(OpsUnary, Gradients) {
  for (const auto& c : kUnaryOps) {
    SCOPED_TRACE(c.name);
    const auto op = c.op;
    EXPECT_TRUE(gradcheck([op](const std::vector<Tensor>& in) { return op(in[0]); }, {unary_input(c, {3, 7}, 22)}));
    // Through a transposed (non-contiguous) view.
    EXPECT_TRUE(gradcheck([op](const std::vector<Tensor>& in) { return op(in[0].transpose(0, 1)); },
                          {unary_input(c, {4, 3}, 23)}));
    // 0-d and empty inputs keep their shape.
    EXPECT_TRUE(gradcheck([op](const std::vector<Tensor>& in) { return op(in[0]); }, {unary_input(c, {}, 24)}));
    Tensor e = Tensor::zeros({0, 3}).set_requires_grad(true);
    Tensor ye = op(e);
    EXPECT_EQ(ye.shape(), (Shape{0, 3}));
    ops::sum(ye).backward();
    EXPECT_EQ(e.grad().shape(), (Shape{0, 3}));
  }
}

TEST(OpsUnary, ReluGradientIsStepFunction) {
  Tensor x = Tensor::from_vector({4}, {-2, -0.5f, 0.5f, 3}).set_requires_grad(true);
  ops::sum(ops::relu(x)).backward();
  EXPECT_EQ(x.grad().to_vector(), (std::vector<float>{0, 0, 1, 1}));
}

// ---------------------------------------------------------------- reductions

namespace {

// Naive sum (or mean) of (2, 3, 4)-like data over `dims`, output in keepdim layout.
std::vector<float> naive_reduce(const Tensor& a, const std::vector<int64_t>& dims, bool mean) {
  const Shape& s = a.shape();
  std::vector<bool> mask(s.size(), dims.empty());
  for (int64_t d : dims) mask[static_cast<size_t>(d < 0 ? d + a.dim() : d)] = true;
  Shape keep = s;
  int64_t count = 1;
  for (size_t i = 0; i < s.size(); ++i) {
    if (mask[i]) {
      keep[i] = 1;
      count *= s[i];
    }
  }
  std::vector<double> acc(static_cast<size_t>(shape_numel(keep)), 0.0);
  const std::vector<float> v = a.to_vector();
  for (int64_t i = 0; i < a.numel(); ++i) {
    acc[static_cast<size_t>(test::broadcast_index(test::unravel(i, s), keep))] += v[static_cast<size_t>(i)];
  }
  std::vector<float> out;
  for (double x : acc) out.push_back(static_cast<float>(mean ? x / static_cast<double>(count) : x));
  return out;
}

Shape reduced_shape(const Shape& s, const std::vector<int64_t>& dims, bool keepdim) {
  std::vector<bool> mask(s.size(), dims.empty());
  for (int64_t d : dims) mask[static_cast<size_t>(d < 0 ? d + static_cast<int64_t>(s.size()) : d)] = true;
  Shape out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (!mask[i]) {
      out.push_back(s[i]);
    } else if (keepdim) {
      out.push_back(1);
    }
  }
  return out;
}

const std::vector<int64_t> kReduceDims[] = {{}, {0}, {1}, {2}, {-1}, {0, 2}, {-1, -3}, {0, 1, 2}, {1, -1}};

}  // namespace

TEST(OpsReduce, SumAndMeanMatchNaive) {
  const Tensor a = test::randn({2, 3, 4}, 31);
  const Tensor at = test::randn({4, 3, 2}, 32).transpose(0, 2);  // non-contiguous (2, 3, 4)
  for (const Tensor& x : {a, at}) {
    for (const auto& dims : kReduceDims) {
      for (bool keepdim : {false, true}) {
        for (bool mean : {false, true}) {
          SCOPED_TRACE(fmt::format("{} dims [{}] keepdim {} contiguous {}", mean ? "mean" : "sum", fmt::join(dims, ","),
                                   keepdim, x.is_contiguous()));
          const Tensor y = mean ? ops::mean(x, dims, keepdim) : ops::sum(x, dims, keepdim);
          EXPECT_EQ(y.shape(), reduced_shape(x.shape(), dims, keepdim));
          EXPECT_TRUE(all_close(y, naive_reduce(x, dims, mean), 1e-5, 1e-5));
        }
      }
    }
  }
}

TEST(OpsReduce, ExactlyVerifiableSums) {
  // Values 1..24: every partial sum is an exact small integer in f32.
  std::vector<float> v(24);
  for (int i = 0; i < 24; ++i) v[static_cast<size_t>(i)] = static_cast<float>(i + 1);
  const Tensor a = Tensor::from_vector({2, 3, 4}, v);
  EXPECT_EQ(ops::sum(a).item(), 300.0f);
  EXPECT_EQ(ops::sum(a).shape(), Shape{});
  EXPECT_EQ(ops::sum(a, {}, true).shape(), (Shape{1, 1, 1}));
  EXPECT_EQ(ops::sum(a, {-1}).to_vector(), (std::vector<float>{10, 26, 42, 58, 74, 90}));
  EXPECT_EQ(ops::sum(a, {0}).to_vector(), (std::vector<float>{14, 16, 18, 20, 22, 24, 26, 28, 30, 32, 34, 36}));
  EXPECT_EQ(ops::mean(a, {0, 1}).to_vector(), (std::vector<float>{11, 12, 13, 14}));
  EXPECT_EQ(ops::mean(a).item(), 12.5f);
}

TEST(OpsReduce, Gradients) {
  for (const auto& dims : kReduceDims) {
    for (bool keepdim : {false, true}) {
      for (bool mean : {false, true}) {
        SCOPED_TRACE(fmt::format("{} dims [{}] keepdim {}", mean ? "mean" : "sum", fmt::join(dims, ","), keepdim));
        const auto d = dims;
        EXPECT_TRUE(gradcheck(
            [d, keepdim, mean](const std::vector<Tensor>& in) {
              return mean ? ops::mean(in[0], d, keepdim) : ops::sum(in[0], d, keepdim);
            },
            {test::randn({2, 3, 4}, 33)}));
        EXPECT_TRUE(gradcheck(
            [d, keepdim, mean](const std::vector<Tensor>& in) {
              const Tensor x = in[0].transpose(0, 2);
              return mean ? ops::mean(x, d, keepdim) : ops::sum(x, d, keepdim);
            },
            {test::randn({4, 3, 2}, 34)}));
      }
    }
  }
}

TEST(OpsReduce, ScalarsAndEmptyDimensions) {
  EXPECT_EQ(ops::sum(Tensor::scalar(3.0f)).item(), 3.0f);
  EXPECT_EQ(ops::mean(Tensor::scalar(3.0f)).item(), 3.0f);
  const Tensor e = Tensor::zeros({0, 3});
  const Tensor s0 = ops::sum(e, {0});
  EXPECT_EQ(s0.shape(), (Shape{3}));
  EXPECT_EQ(s0.to_vector(), (std::vector<float>{0, 0, 0}));
  EXPECT_EQ(ops::sum(e, {1}).shape(), (Shape{0}));
  EXPECT_EQ(ops::sum(e).item(), 0.0f);
  Tensor x = Tensor::zeros({0, 3}).set_requires_grad(true);
  ops::sum(ops::sum(x, {0})).backward();
  EXPECT_EQ(x.grad().shape(), (Shape{0, 3}));
}

TEST(OpsReduce, BadDimensionsThrow) {
  const Tensor a = Tensor::zeros({2, 3, 4});
  EXPECT_TRUE(throws_with([&] { ops::sum(a, {3}); }, {"sum", "3", "[2, 3, 4]"}));
  EXPECT_TRUE(throws_with([&] { ops::mean(a, {-4}); }, {"mean", "-4", "[2, 3, 4]"}));
  EXPECT_TRUE(throws_with([&] { ops::sum(a, {1, -2}); }, {"sum", "twice"}));
}

// ---------------------------------------------------------------- matmul and linear

namespace {

// Naive (..., M, K) x (K, N) or (..., K, N) in double.
std::vector<float> naive_matmul(const Tensor& a, const Tensor& b) {
  const int64_t m = a.size(-2), k = a.size(-1), n = b.size(-1);
  const int64_t batch = m * k == 0 ? shape_numel(Shape(a.shape().begin(), a.shape().end() - 2)) : a.numel() / (m * k);
  const bool shared = b.dim() == 2;
  const std::vector<float> av = a.to_vector(), bv = b.to_vector();
  std::vector<float> out(static_cast<size_t>(batch * m * n));
  for (int64_t z = 0; z < batch; ++z) {
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n; ++j) {
        double s = 0.0;
        for (int64_t l = 0; l < k; ++l) {
          s += static_cast<double>(av[static_cast<size_t>((z * m + i) * k + l)]) *
               bv[static_cast<size_t>((shared ? 0 : z * k * n) + l * n + j)];
        }
        out[static_cast<size_t>((z * m + i) * n + j)] = static_cast<float>(s);
      }
    }
  }
  return out;
}

const std::pair<Shape, Shape> kMatmulCases[] = {
    {{3, 4}, {4, 5}},       {{2, 3, 4}, {4, 5}},    {{2, 3, 4}, {2, 4, 5}}, {{2, 2, 3, 4}, {2, 2, 4, 5}},
    {{2, 2, 3, 4}, {4, 5}}, {{3, 1}, {1, 4}},       {{2, 3, 1}, {2, 1, 4}}, {{1, 1}, {1, 1}},
    {{0, 4}, {4, 5}},       {{3, 0}, {0, 5}},       {{3, 4}, {4, 0}},       {{0, 3, 4}, {0, 4, 5}},
    {{2, 0, 4}, {4, 3}},    {{2, 3, 0}, {2, 0, 5}},
};

}  // namespace

TEST(OpsMatmul, ForwardMatchesNaive) {
  for (const auto& [sa, sb] : kMatmulCases) {
    SCOPED_TRACE(shape_str(sa) + " x " + shape_str(sb));
    const Tensor a = test::randn(sa, 41);
    const Tensor b = test::randn(sb, 42);
    const Tensor y = ops::matmul(a, b);
    Shape expected_shape = sa;
    expected_shape.back() = sb.back();
    EXPECT_EQ(y.shape(), expected_shape);
    EXPECT_TRUE(all_close(y, naive_matmul(a, b), 1e-5, 1e-5));
  }
}

TEST(OpsMatmul, ExactSmallProduct) {
  const Tensor a = Tensor::from_vector({2, 3}, {1, 2, 3, 4, 5, 6});
  const Tensor b = Tensor::from_vector({3, 2}, {7, 8, 9, 10, 11, 12});
  EXPECT_EQ(ops::matmul(a, b).to_vector(), (std::vector<float>{58, 64, 139, 154}));
}

TEST(OpsMatmul, Gradients) {
  for (const auto& [sa, sb] : kMatmulCases) {
    SCOPED_TRACE(shape_str(sa) + " x " + shape_str(sb));
    EXPECT_TRUE(gradcheck([](const std::vector<Tensor>& in) { return ops::matmul(in[0], in[1]); },
                          {test::randn(sa, 43), test::randn(sb, 44)}));
  }
}

TEST(OpsMatmul, EmptyInnerDimensionGivesZerosAndShapedGradients) {
  Tensor a = Tensor::ones({3, 0}).set_requires_grad(true);
  Tensor b = Tensor::ones({0, 5}).set_requires_grad(true);
  Tensor y = ops::matmul(a, b);
  EXPECT_EQ(y.shape(), (Shape{3, 5}));
  for (float v : y.to_vector()) EXPECT_EQ(v, 0.0f);
  ops::sum(y).backward();
  EXPECT_EQ(a.grad().shape(), (Shape{3, 0}));
  EXPECT_EQ(b.grad().shape(), (Shape{0, 5}));
}

TEST(OpsMatmul, NonContiguousOperands) {
  const Tensor at = test::randn({4, 3}, 45).transpose(0, 1);  // (3, 4)
  const Tensor bt = test::randn({5, 4}, 46).transpose(0, 1);  // (4, 5)
  EXPECT_TRUE(all_close(ops::matmul(at, bt), naive_matmul(at, bt), 1e-5, 1e-5));
  EXPECT_TRUE(
      gradcheck([](const std::vector<Tensor>& in) { return ops::matmul(in[0].transpose(0, 1), in[1].transpose(0, 1)); },
                {test::randn({4, 3}, 47), test::randn({5, 4}, 48)}));
}

TEST(OpsMatmul, ShapeErrorsNameBothShapes) {
  EXPECT_TRUE(throws_with(
      [] {
        ops::matmul(Tensor::zeros({2, 3}), Tensor::zeros({4, 5}));
      },
      {"matmul", "[2, 3]", "[4, 5]"}));
  EXPECT_TRUE(throws_with(
      [] {
        ops::matmul(Tensor::zeros({2, 3, 4}), Tensor::zeros({3, 4, 5}));
      },
      {"matmul", "[2, 3, 4]", "[3, 4, 5]"}));
  EXPECT_TRUE(throws_with([] { ops::matmul(Tensor::zeros({4}), Tensor::zeros({4, 5})); }, {"matmul", "[4]"}));
}

namespace {

std::vector<float> naive_linear(const Tensor& x, const Tensor& w, const Tensor& b) {
  const int64_t in = w.size(1), out = w.size(0);
  const int64_t m = x.numel() / in;
  const std::vector<float> xv = x.to_vector(), wv = w.to_vector();
  const std::vector<float> bv = b.defined() ? b.to_vector() : std::vector<float>(static_cast<size_t>(out), 0.0f);
  std::vector<float> y(static_cast<size_t>(m * out));
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t o = 0; o < out; ++o) {
      double s = bv[static_cast<size_t>(o)];
      for (int64_t i = 0; i < in; ++i) {
        s += static_cast<double>(xv[static_cast<size_t>(r * in + i)]) * wv[static_cast<size_t>(o * in + i)];
      }
      y[static_cast<size_t>(r * out + o)] = static_cast<float>(s);
    }
  }
  return y;
}

}  // namespace

TEST(OpsLinear, ForwardAndGradients) {
  const Shape x_shapes[] = {{4, 3}, {2, 4, 3}, {3}, {1, 3}};
  for (const Shape& xs : x_shapes) {
    for (bool with_bias : {true, false}) {
      SCOPED_TRACE(shape_str(xs) + (with_bias ? " with bias" : " without bias"));
      const Tensor x = test::randn(xs, 51);
      const Tensor w = test::randn({5, 3}, 52);
      const Tensor b = with_bias ? test::randn({5}, 53) : Tensor();
      const Tensor y = ops::linear(x, w, b);
      Shape ys = xs;
      ys.back() = 5;
      EXPECT_EQ(y.shape(), ys);
      EXPECT_TRUE(all_close(y, naive_linear(x, w, b), 1e-5, 1e-5));
      if (with_bias) {
        EXPECT_TRUE(
            gradcheck([](const std::vector<Tensor>& in) { return ops::linear(in[0], in[1], in[2]); }, {x, w, b}));
      } else {
        EXPECT_TRUE(
            gradcheck([](const std::vector<Tensor>& in) { return ops::linear(in[0], in[1], Tensor()); }, {x, w}));
      }
    }
  }
}

TEST(OpsLinear, PartialGradientsAndNonContiguousWeight) {
  const Tensor x = test::randn({4, 3}, 54);
  const Tensor w = test::randn({3, 5}, 55);  // used transposed: (5, 3)
  const Tensor b = test::randn({5}, 56);
  const auto f = [](const std::vector<Tensor>& in) { return ops::linear(in[0], in[1].transpose(0, 1), in[2]); };
  EXPECT_TRUE(gradcheck(f, {x, w, b}));
  for (int which = 0; which < 3; ++which) {
    GradcheckOptions opt;
    opt.wrt = {which == 0, which == 1, which == 2};
    EXPECT_TRUE(gradcheck(f, {x, w, b}, opt)) << "only input " << which;
  }
}

TEST(OpsLinear, EmptyBatch) {
  Tensor x = Tensor::zeros({0, 3}).set_requires_grad(true);
  Tensor w = test::randn({5, 3}, 57).set_requires_grad(true);
  Tensor b = test::randn({5}, 58).set_requires_grad(true);
  Tensor y = ops::linear(x, w, b);
  EXPECT_EQ(y.shape(), (Shape{0, 5}));
  ops::sum(y).backward();
  EXPECT_EQ(x.grad().shape(), (Shape{0, 3}));
  EXPECT_EQ(w.grad().to_vector(), std::vector<float>(15, 0.0f));
  EXPECT_EQ(b.grad().to_vector(), std::vector<float>(5, 0.0f));
}

TEST(OpsLinear, ShapeErrorsNameShapes) {
  EXPECT_TRUE(throws_with(
      [] {
        ops::linear(Tensor::zeros({4, 3}), Tensor::zeros({5, 4}), Tensor());
      },
      {"linear", "[4, 3]", "[5, 4]"}));
  EXPECT_TRUE(throws_with(
      [] {
        ops::linear(Tensor::zeros({4, 3}), Tensor::zeros({5, 3}), Tensor::zeros({4}));
      },
      {"linear", "[4]", "[5, 3]"}));
  EXPECT_TRUE(throws_with(
      [] {
        ops::linear(Tensor::zeros({4, 3}), Tensor::zeros({15}), Tensor());
      },
      {"linear", "[15]"}));
}

// ---------------------------------------------------------------- softmax family

namespace {

std::vector<float> naive_softmax(const Tensor& x, bool log_space) {
  const int64_t n = x.size(-1);
  const std::vector<float> v = x.to_vector();
  std::vector<float> out(v.size());
  for (size_t r = 0; r * static_cast<size_t>(n) < v.size(); ++r) {
    const float* row = v.data() + r * static_cast<size_t>(n);
    double mx = -INFINITY;
    for (int64_t j = 0; j < n; ++j) mx = std::max(mx, static_cast<double>(row[j]));
    double s = 0.0;
    for (int64_t j = 0; j < n; ++j) s += std::exp(row[j] - mx);
    for (int64_t j = 0; j < n; ++j) {
      const double ls = row[j] - mx - std::log(s);
      out[r * static_cast<size_t>(n) + static_cast<size_t>(j)] = static_cast<float>(log_space ? ls : std::exp(ls));
    }
  }
  return out;
}

}  // namespace

TEST(OpsSoftmax, ForwardMatchesNaive) {
  for (const Shape& s : {Shape{2, 3, 5}, Shape{7}, Shape{4, 1}}) {
    SCOPED_TRACE(shape_str(s));
    const Tensor x = test::randn(s, 61, 2.0f);
    EXPECT_TRUE(all_close(ops::softmax(x), naive_softmax(x, false), 1e-6, 1e-5));
    EXPECT_TRUE(all_close(ops::log_softmax(x), naive_softmax(x, true), 1e-5, 1e-5));
  }
  const Tensor xt = test::randn({5, 3}, 62).transpose(0, 1);
  EXPECT_TRUE(all_close(ops::softmax(xt), naive_softmax(xt, false), 1e-6, 1e-5));
}

TEST(OpsSoftmax, RowsSumToOneAndLargeLogitsStayFinite) {
  const Tensor x = Tensor::from_vector({2, 3}, {1e4f, 1e4f + 1, 1e4f - 1, -1e4f, -1e4f + 2, 0});
  const Tensor p = ops::softmax(x);
  const Tensor lp = ops::log_softmax(x);
  for (float v : p.to_vector()) EXPECT_TRUE(std::isfinite(v));
  for (float v : lp.to_vector()) EXPECT_TRUE(std::isfinite(v));
  EXPECT_TRUE(all_close(ops::sum(p, {-1}), {1.0f, 1.0f}, 1e-6, 0));
  // Shift invariance: the first row equals softmax([0, 1, -1]).
  const Tensor shifted = ops::softmax(Tensor::from_vector({3}, {0, 1, -1}));
  const std::vector<float> pv = p.to_vector();
  EXPECT_TRUE(all_close(std::vector<float>(pv.begin(), pv.begin() + 3), shifted.to_vector(), 1e-6, 1e-5));
}

TEST(OpsSoftmax, Gradients) {
  EXPECT_TRUE(
      gradcheck([](const std::vector<Tensor>& in) { return ops::softmax(in[0]); }, {test::randn({2, 3, 5}, 63)}));
  EXPECT_TRUE(
      gradcheck([](const std::vector<Tensor>& in) { return ops::log_softmax(in[0]); }, {test::randn({2, 3, 5}, 64)}));
  EXPECT_TRUE(gradcheck([](const std::vector<Tensor>& in) { return ops::softmax(in[0].transpose(0, 1)); },
                        {test::randn({5, 3}, 65)}));
  EXPECT_TRUE(gradcheck([](const std::vector<Tensor>& in) { return ops::log_softmax(in[0].transpose(0, 1)); },
                        {test::randn({5, 3}, 66)}));
}

TEST(OpsSoftmax, EmptyRows) {
  EXPECT_EQ(ops::softmax(Tensor::zeros({0, 4})).shape(), (Shape{0, 4}));
  EXPECT_EQ(ops::log_softmax(Tensor::zeros({3, 0})).shape(), (Shape{3, 0}));
}

// ---------------------------------------------------------------- cross-entropy

TEST(OpsCrossEntropy, ForwardMatchesHandComputation) {
  const Tensor logits = Tensor::from_vector({2, 3}, {1, 2, 3, 1, 1, 1});
  const Tensor targets = Tensor::from_vector({2}, {2, 0});
  // Row 0: log(e^1 + e^2 + e^3) - 3; row 1: log(3) - 1 + 1 = log 3.
  const double row0 = std::log(std::exp(1.0) + std::exp(2.0) + std::exp(3.0)) - 3.0;
  const double row1 = std::log(3.0);
  const Tensor loss = ops::cross_entropy(logits, targets);
  EXPECT_EQ(loss.shape(), Shape{});
  EXPECT_NEAR(loss.item(), (row0 + row1) / 2.0, 1e-6);
  EXPECT_NEAR(loss.item(), 0.7531091, 1e-6);
}

TEST(OpsCrossEntropy, GradientIsSoftmaxMinusOneHotOverN) {
  Tensor logits = Tensor::from_vector({2, 3}, {1, 2, 3, 1, 1, 1}).set_requires_grad(true);
  ops::cross_entropy(logits, Tensor::from_vector({2}, {2, 0})).backward();
  const double z = std::exp(1.0) + std::exp(2.0) + std::exp(3.0);
  const std::vector<float> expected = {static_cast<float>(std::exp(1.0) / z / 2),
                                       static_cast<float>(std::exp(2.0) / z / 2),
                                       static_cast<float>((std::exp(3.0) / z - 1) / 2),
                                       static_cast<float>((1.0 / 3 - 1) / 2),
                                       static_cast<float>(1.0 / 3 / 2),
                                       static_cast<float>(1.0 / 3 / 2)};
  EXPECT_TRUE(all_close(logits.grad(), expected, 1e-6, 1e-5));
}

TEST(OpsCrossEntropy, StableWithHugeLogits) {
  for (float base : {1e4f, -1e4f}) {
    SCOPED_TRACE(base);
    Tensor big = Tensor::from_vector({2, 3}, {base, base + 1, base - 1, base + 2, base, base}).set_requires_grad(true);
    Tensor small = Tensor::from_vector({2, 3}, {0, 1, -1, 2, 0, 0}).set_requires_grad(true);
    const Tensor targets = Tensor::from_vector({2}, {0, 2});
    Tensor lb = ops::cross_entropy(big, targets);
    Tensor ls = ops::cross_entropy(small, targets);
    ASSERT_TRUE(std::isfinite(lb.item()));
    // Only the final "+ max - logit" is done at magnitude 1e4, where the f32 spacing is ~1e-3.
    EXPECT_NEAR(lb.item(), ls.item(), 2e-3);
    lb.backward();
    ls.backward();
    EXPECT_TRUE(all_close(big.grad(), small.grad(), 1e-6, 1e-5));
  }
}

TEST(OpsCrossEntropy, Gradient) {
  const Tensor targets = Tensor::from_vector({4}, {0, 4, 2, 2});
  EXPECT_TRUE(gradcheck([targets](const std::vector<Tensor>& in) { return ops::cross_entropy(in[0], targets); },
                        {test::randn({4, 5}, 71, 2.0f)}));
  EXPECT_TRUE(
      gradcheck([targets](const std::vector<Tensor>& in) { return ops::cross_entropy(in[0].transpose(0, 1), targets); },
                {test::randn({5, 4}, 72, 2.0f)}));
}

TEST(OpsCrossEntropy, BadTargetsThrow) {
  const Tensor logits = Tensor::zeros({2, 3});
  EXPECT_TRUE(throws_with(
      [&] {
        ops::cross_entropy(logits, Tensor::from_vector({2}, {0, 3}));
      },
      {"cross_entropy", "3", "[0, 3)"}));
  EXPECT_TRUE(throws_with(
      [&] {
        ops::cross_entropy(logits, Tensor::from_vector({2}, {0, -1}));
      },
      {"cross_entropy", "-1"}));
  EXPECT_TRUE(throws_with(
      [&] {
        ops::cross_entropy(logits, Tensor::from_vector({2}, {0.5f, 1}));
      },
      {"cross_entropy", "0.5"}));
  EXPECT_TRUE(throws_with(
      [&] {
        ops::cross_entropy(logits, Tensor::from_vector({3}, {0, 1, 2}));
      },
      {"cross_entropy", "[3]", "[2, 3]"}));
  EXPECT_TRUE(throws_with(
      [&] {
        ops::cross_entropy(Tensor::zeros({2, 3, 4}), Tensor::zeros({2}));
      },
      {"cross_entropy", "[2, 3, 4]"}));
}

// ---------------------------------------------------------------- layer norm

namespace {

std::vector<float> naive_layer_norm(const Tensor& x, const Tensor& w, const Tensor& b, double eps) {
  const int64_t c = x.size(-1);
  const std::vector<float> xv = x.to_vector(), wv = w.to_vector(), bv = b.to_vector();
  std::vector<float> out(xv.size());
  for (size_t r = 0; r * static_cast<size_t>(c) < xv.size(); ++r) {
    const float* row = xv.data() + r * static_cast<size_t>(c);
    double mu = 0.0, var = 0.0;
    for (int64_t j = 0; j < c; ++j) mu += row[j];
    mu /= static_cast<double>(c);
    for (int64_t j = 0; j < c; ++j) var += (row[j] - mu) * (row[j] - mu);
    var /= static_cast<double>(c);
    for (int64_t j = 0; j < c; ++j) {
      out[r * static_cast<size_t>(c) + static_cast<size_t>(j)] = static_cast<float>(
          (row[j] - mu) / std::sqrt(var + eps) * wv[static_cast<size_t>(j)] + bv[static_cast<size_t>(j)]);
    }
  }
  return out;
}

}  // namespace

TEST(OpsLayerNorm, ForwardMatchesNaive) {
  const Tensor x = test::randn({2, 3, 5}, 81, 3.0f);
  const Tensor w = test::randn({5}, 82);
  const Tensor b = test::randn({5}, 83);
  EXPECT_TRUE(all_close(ops::layer_norm(x, w, b), naive_layer_norm(x, w, b, 1e-5), 1e-5, 1e-5));
  EXPECT_TRUE(all_close(ops::layer_norm(x, w, b, 0.5f), naive_layer_norm(x, w, b, 0.5), 1e-5, 1e-5));
  // With unit weight and zero bias each row has mean 0 and variance ~1.
  const Tensor y = ops::layer_norm(x, Tensor::ones({5}), Tensor::zeros({5}));
  EXPECT_TRUE(all_close(ops::mean(y, {-1}), std::vector<float>(6, 0.0f), 1e-6, 0));
  EXPECT_TRUE(all_close(ops::mean(ops::square(y), {-1}), std::vector<float>(6, 1.0f), 1e-4, 0));
}

TEST(OpsLayerNorm, Gradients) {
  EXPECT_TRUE(gradcheck([](const std::vector<Tensor>& in) { return ops::layer_norm(in[0], in[1], in[2]); },
                        {test::randn({2, 3, 5}, 84), test::randn({5}, 85), test::randn({5}, 86)}));
  EXPECT_TRUE(
      gradcheck([](const std::vector<Tensor>& in) { return ops::layer_norm(in[0].transpose(0, 1), in[1], in[2]); },
                {test::randn({6, 4}, 87), test::randn({6}, 88), test::randn({6}, 89)}));
  GradcheckOptions only_x;
  only_x.wrt = {true, false, false};
  EXPECT_TRUE(gradcheck([](const std::vector<Tensor>& in) { return ops::layer_norm(in[0], in[1], in[2]); },
                        {test::randn({3, 8}, 90), test::randn({8}, 91), test::randn({8}, 92)}, only_x));
}

TEST(OpsLayerNorm, ShapeErrorsNameShapes) {
  EXPECT_TRUE(throws_with(
      [] {
        ops::layer_norm(Tensor::zeros({2, 5}), Tensor::ones({4}), Tensor::zeros({4}));
      },
      {"layer_norm", "[2, 5]", "[4]"}));
}

// ---------------------------------------------------------------- embedding

TEST(OpsEmbedding, PicksRowsAndAccumulatesRepeatedIds) {
  const Tensor w0 = test::randn({6, 4}, 101);
  Tensor w = w0.clone().set_requires_grad(true);
  const std::vector<float> ids_v = {1, 3, 1, 1, 0, 5};
  const Tensor ids = Tensor::from_vector({2, 3}, ids_v);
  Tensor y = ops::embedding(w, ids);
  ASSERT_EQ(y.shape(), (Shape{2, 3, 4}));
  const std::vector<float> wv = w0.to_vector(), yv = y.to_vector();
  for (size_t i = 0; i < 6; ++i) {
    for (size_t j = 0; j < 4; ++j) EXPECT_EQ(yv[i * 4 + j], wv[static_cast<size_t>(ids_v[i]) * 4 + j]);
  }
  const Tensor r = test::randn({2, 3, 4}, 102);
  ops::sum(ops::mul(y, r)).backward();
  const std::vector<float> rv = r.to_vector();
  std::vector<float> expected(24, 0.0f);
  for (size_t i = 0; i < 6; ++i) {
    for (size_t j = 0; j < 4; ++j) expected[static_cast<size_t>(ids_v[i]) * 4 + j] += rv[i * 4 + j];
  }
  EXPECT_TRUE(all_close(w.grad(), expected, 1e-6, 1e-6));
  // Rows 2 and 4 were never picked.
  for (size_t j = 0; j < 4; ++j) {
    EXPECT_EQ(w.grad().to_vector()[2 * 4 + j], 0.0f);
    EXPECT_EQ(w.grad().to_vector()[4 * 4 + j], 0.0f);
  }
}

TEST(OpsEmbedding, GradientByFiniteDifferences) {
  GradcheckOptions opt;
  opt.wrt = {true, false};
  EXPECT_TRUE(gradcheck([](const std::vector<Tensor>& in) { return ops::embedding(in[0], in[1]); },
                        {test::randn({5, 3}, 103), Tensor::from_vector({4}, {4, 4, 0, 2})}, opt));
  EXPECT_TRUE(gradcheck([](const std::vector<Tensor>& in) { return ops::embedding(in[0].transpose(0, 1), in[1]); },
                        {test::randn({3, 5}, 104), Tensor::from_vector({2, 2}, {1, 1, 3, 0})}, opt));
}

TEST(OpsEmbedding, ScalarAndEmptyIds) {
  const Tensor w = test::randn({4, 3}, 105);
  const Tensor y = ops::embedding(w, Tensor::scalar(2.0f));
  EXPECT_EQ(y.shape(), (Shape{3}));
  EXPECT_EQ(y.to_vector(), w.slice(0, 2, 3).to_vector());
  EXPECT_EQ(ops::embedding(w, Tensor::zeros({0, 5})).shape(), (Shape{0, 5, 3}));
}

TEST(OpsEmbedding, BadIdsThrow) {
  const Tensor w = Tensor::zeros({6, 4});
  EXPECT_TRUE(throws_with(
      [&] {
        ops::embedding(w, Tensor::from_vector({3}, {0, 6, 1}));
      },
      {"embedding", "6", "[0, 6)"}));
  EXPECT_TRUE(throws_with([&] { ops::embedding(w, Tensor::from_vector({2}, {-1, 0})); }, {"embedding", "-1"}));
  EXPECT_TRUE(throws_with([&] { ops::embedding(w, Tensor::from_vector({2}, {1.5f, 0})); }, {"embedding", "1.5"}));
  EXPECT_TRUE(throws_with([&] { ops::embedding(w, Tensor::from_vector({1}, {NAN})); }, {"embedding", "nan"}));
  EXPECT_TRUE(throws_with([&] { ops::embedding(Tensor::zeros({6}), Tensor::zeros({2})); }, {"embedding", "[6]"}));
}

// ---------------------------------------------------------------- causal attention

namespace {

// Naive causal self-attention in double over qkv (B, T, 3C) laid out [q | k | v].
std::vector<float> naive_attention(const Tensor& qkv, int64_t n_head) {
  const int64_t B = qkv.size(0), T = qkv.size(1), C = qkv.size(2) / 3, hd = C / n_head;
  const std::vector<float> v = qkv.to_vector();
  auto at = [&](int64_t b, int64_t t, int64_t col) {
    return static_cast<double>(v[static_cast<size_t>((b * T + t) * 3 * C + col)]);
  };
  std::vector<float> out(static_cast<size_t>(B * T * C), 0.0f);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < n_head; ++h) {
      for (int64_t i = 0; i < T; ++i) {
        std::vector<double> s(static_cast<size_t>(i + 1));
        double mx = -INFINITY;
        for (int64_t j = 0; j <= i; ++j) {
          double dot = 0.0;
          for (int64_t d = 0; d < hd; ++d) dot += at(b, i, h * hd + d) * at(b, j, C + h * hd + d);
          s[static_cast<size_t>(j)] = dot / std::sqrt(static_cast<double>(hd));
          mx = std::max(mx, s[static_cast<size_t>(j)]);
        }
        double z = 0.0;
        for (auto& x : s) z += (x = std::exp(x - mx));
        for (int64_t d = 0; d < hd; ++d) {
          double o = 0.0;
          for (int64_t j = 0; j <= i; ++j) o += s[static_cast<size_t>(j)] / z * at(b, j, 2 * C + h * hd + d);
          out[static_cast<size_t>((b * T + i) * C + h * hd + d)] = static_cast<float>(o);
        }
      }
    }
  }
  return out;
}

}  // namespace

TEST(OpsAttention, ForwardMatchesNaive) {
  const Tensor qkv = test::randn({2, 5, 24}, 111);
  const Tensor y = ops::causal_attention(qkv, 2);
  ASSERT_EQ(y.shape(), (Shape{2, 5, 8}));
  EXPECT_TRUE(all_close(y, naive_attention(qkv, 2), 1e-5, 1e-5));
  // One head and four heads over the same data.
  EXPECT_TRUE(all_close(ops::causal_attention(qkv, 1), naive_attention(qkv, 1), 1e-5, 1e-5));
  EXPECT_TRUE(all_close(ops::causal_attention(qkv, 4), naive_attention(qkv, 4), 1e-5, 1e-5));
}

TEST(OpsAttention, FirstPositionAttendsOnlyToItself) {
  // Output at t = 0 is v at t = 0, whatever the later positions hold.
  const Tensor qkv = test::randn({1, 3, 12}, 112);
  const std::vector<float> y = ops::causal_attention(qkv, 2).to_vector();
  const std::vector<float> v = qkv.to_vector();
  for (size_t d = 0; d < 4; ++d) EXPECT_NEAR(y[d], v[8 + d], 1e-6);
}

TEST(OpsAttention, Gradient) {
  EXPECT_TRUE(gradcheck([](const std::vector<Tensor>& in) { return ops::causal_attention(in[0], 2); },
                        {test::randn({2, 5, 24}, 113)}));
  // A non-contiguous input (qkv built by a transpose).
  EXPECT_TRUE(gradcheck([](const std::vector<Tensor>& in) { return ops::causal_attention(in[0].transpose(1, 2), 1); },
                        {test::randn({1, 6, 3}, 114)}));
}

// The causal blocks (ops::attention_block_rows) at sizes that cut T = 5 and 7 into several
// blocks, the last one ragged: the same output as the naive double-precision loop, and gradients
// that pass the finite-difference check (which the single-block path at these sizes passes above).
TEST(OpsAttention, CausalBlocksMatchNaiveAndGradcheck) {
  ops::set_attention_kernels(false);  // the library's route, whose blocks these are
  const int64_t saved = ops::attention_block_rows();
  for (int64_t rows : {1, 2, 3}) {
    ops::set_attention_block_rows(rows);
    const Tensor qkv = test::randn({2, 7, 24}, 115);
    EXPECT_TRUE(all_close(ops::causal_attention(qkv, 2), naive_attention(qkv, 2), 1e-5, 1e-5)) << rows << " rows";
    EXPECT_TRUE(gradcheck([](const std::vector<Tensor>& in) { return ops::causal_attention(in[0], 2); },
                          {test::randn({2, 5, 24}, 116)}))
        << rows << " rows";
  }
  ops::set_attention_block_rows(saved);
  ops::set_attention_kernels(true);
  EXPECT_TRUE(throws_with([] { ops::set_attention_block_rows(0); }, {"set_attention_block_rows", "0"}));
}

// dtrain's own f32 attention kernel (ops::attention_f32_kernel: 8-row tiles, 16-column vectors)
// on shapes that cut them: T from 1 to 40 with ragged last tiles, head dimensions 1 to 33. The
// naive double-precision loop's output, the library route's output and gradient (the same math
// summed in another order), and a finite-difference check across three tiles.
TEST(OpsAttention, KernelTilesMatchNaiveLibraryAndGradcheck) {
  if (!ops::attention_f32_kernel()) GTEST_SKIP() << "the kernels' instruction set is below AVX-512";
  struct Case {
    int64_t t, c, h;
  };
  for (const Case k :
       {Case{1, 4, 1}, Case{7, 10, 2}, Case{8, 33, 1}, Case{9, 24, 3}, Case{17, 66, 2}, Case{40, 32, 1}}) {
    const Tensor qkv = test::randn({2, k.t, 3 * k.c}, 117 + static_cast<uint64_t>(k.t));
    const Tensor y = ops::causal_attention(qkv, k.h);
    EXPECT_TRUE(all_close(y, naive_attention(qkv, k.h), 1e-5, 1e-5)) << "T " << k.t << " C " << k.c;
    auto grad = [&](bool kernel) {
      ops::set_attention_kernels(kernel);
      Tensor x = qkv.detach().clone().set_requires_grad(true);
      Tensor out = ops::causal_attention(x, k.h);
      ops::sum(ops::mul(out, ops::mul(out, out))).backward();
      ops::set_attention_kernels(true);
      return std::make_pair(out.to_vector(), x.grad().to_vector());
    };
    const auto mine = grad(true), library = grad(false);
    for (size_t i = 0; i < mine.first.size(); ++i) EXPECT_NEAR(mine.first[i], library.first[i], 1e-5) << k.t;
    for (size_t i = 0; i < mine.second.size(); ++i) EXPECT_NEAR(mine.second[i], library.second[i], 1e-4) << k.t;
  }
  EXPECT_TRUE(gradcheck([](const std::vector<Tensor>& in) { return ops::causal_attention(in[0], 2); },
                        {test::randn({1, 19, 18}, 118)}));
}

// The kernels' backward keeps no probabilities: it computes P again from S and the forward's
// stats (each row's shift and 1 / sum), and that must give the forward's P bit for bit, or the
// gradient would not be the gradient of what the forward computed.
TEST(OpsAttention, RecomputedProbabilitiesAreTheForwardsBits) {
  if (!detail::f32_dot_available()) GTEST_SKIP() << "the kernels' instruction set is below AVX-512";
  for (const int64_t t : {1, 7, 8, 9, 17, 40, 128}) {
    const int64_t ld = t + 3;
    const std::vector<float> scores = test::randn({t, ld}, 300 + static_cast<uint64_t>(t)).to_vector();
    for (int64_t i0 = 0; i0 < t; i0 += 8) {
      const int64_t r = std::min<int64_t>(8, t - i0), zero_to = std::min(t, i0 + r + 8);
      std::vector<float> forward(scores.begin() + i0 * ld, scores.begin() + (i0 + r) * ld);
      std::vector<float> again = forward;
      std::vector<float> stats(static_cast<size_t>(2 * r), -1.0f);
      detail::causal_softmax_tile(forward.data(), ld, i0, r, zero_to, nullptr, stats.data());
      detail::causal_softmax_recompute_tile(again.data(), ld, i0, r, zero_to, stats.data());
      for (int64_t i = 0; i < r; ++i) {
        float sum = 0.0f;
        for (int64_t j = 0; j < zero_to; ++j) {
          const size_t at = static_cast<size_t>(i * ld + j);
          EXPECT_EQ(std::memcmp(&forward[at], &again[at], sizeof(float)), 0)
              << "T " << t << " row " << i0 + i << " key " << j << ": " << forward[at] << " vs " << again[at];
          if (j > i0 + i) {
            EXPECT_EQ(forward[at], 0.0f) << "T " << t << " row " << i0 + i << " key " << j;
          }
          sum += forward[at];
        }
        EXPECT_NEAR(sum, 1.0f, 1e-5) << "T " << t << " row " << i0 + i;
        EXPECT_GT(stats[static_cast<size_t>(2 * i + 1)], 0.0f);
      }
    }
  }
}

// Rows [0, k) of x (row stride ld), columns [0, n), in pairs of rows as dot_tiles.h's B layout
// holds them: element (kk, j) at dst[(kk / 2) * ldd + 2 j + kk % 2], rounded to bf16 (nearest
// even), the pair of an odd last row completed with zeros; words past 2 n left as they are.
std::vector<uint16_t> packed_pairs(const std::vector<float>& x, int64_t ld, int64_t k, int64_t n, int64_t ldd,
                                   std::vector<uint16_t> dst) {
  for (int64_t kk = 0; kk < k + k % 2; ++kk) {
    for (int64_t j = 0; j < n; ++j) {
      dst[static_cast<size_t>((kk / 2) * ldd + 2 * j + kk % 2)] =
          kk < k ? f32_to_bf16(x[static_cast<size_t>(kk * ld + j)]) : uint16_t{0};
    }
  }
  return dst;
}

// The bf16 backward takes P and dS in pairs of rows for dK and dV straight from the tiles'
// registers: the words of their f32 rows rounded and packed in pairs, up to the columns the
// tiles read (an odd last row paired with zeros), and the same dS rounded into the tile.
TEST(OpsAttention, TilesWritePairsAsPackingTheirRowsWould) {
  if (!detail::bf16_dot_available()) GTEST_SKIP() << "no AVX512_BF16 kernels here";
  for (const int64_t t : {1, 7, 8, 9, 17, 40, 128}) {
    const int64_t ld = t + 3;
    const std::vector<float> scores = test::randn({t, ld}, 500 + static_cast<uint64_t>(t)).to_vector();
    const std::vector<float> grads = test::randn({t, ld}, 600 + static_cast<uint64_t>(t)).to_vector();
    for (int64_t i0 = 0; i0 < t; i0 += 8) {
      const int64_t r = std::min<int64_t>(8, t - i0), n = i0 + r, zero_to = std::min(t, n + 8);
      const int64_t rows = (r + 1) / 2, ldp = 2 * t;
      std::vector<float> p(scores.begin() + i0 * ld, scores.begin() + n * ld);
      std::vector<float> stats(static_cast<size_t>(2 * r));
      std::vector<uint16_t> unused(static_cast<size_t>(r * n));
      detail::causal_softmax_tile(p.data(), ld, i0, r, zero_to, unused.data(), stats.data());
      // P: recomputed with pairs against recomputed without and packed.
      std::vector<float> p1(scores.begin() + i0 * ld, scores.begin() + n * ld), p2 = p1;
      std::vector<uint16_t> pairs(static_cast<size_t>(rows * ldp), 0xdead);
      detail::causal_softmax_recompute_tile(p1.data(), ld, i0, r, zero_to, stats.data(), pairs.data(), ldp);
      detail::causal_softmax_recompute_tile(p2.data(), ld, i0, r, zero_to, stats.data());
      EXPECT_EQ(pairs, packed_pairs(p2, ld, r, zero_to, ldp, std::vector<uint16_t>(pairs.size(), 0xdead)))
          << "P, T " << t << " rows from " << i0;
      EXPECT_EQ(std::memcmp(p1.data(), p2.data(), p1.size() * sizeof(float)), 0) << "T " << t << " rows from " << i0;
      // dS: with pairs (dp keeps dP) against in place and packed; the tiles alike.
      std::vector<float> d1(grads.begin() + i0 * ld, grads.begin() + n * ld), d2 = d1;
      std::vector<uint16_t> tile1(static_cast<size_t>(r * n), 0xbeef), tile2 = tile1;
      std::vector<uint16_t> ds(static_cast<size_t>(rows * ldp), 0xdead);
      detail::causal_softmax_backward_tile(p2.data(), d1.data(), ld, i0, r, zero_to, tile1.data(), ds.data(), ldp);
      detail::causal_softmax_backward_tile(p2.data(), d2.data(), ld, i0, r, zero_to, tile2.data());
      EXPECT_EQ(ds, packed_pairs(d2, ld, r, zero_to, ldp, std::vector<uint16_t>(ds.size(), 0xdead)))
          << "dS, T " << t << " rows from " << i0;
      EXPECT_EQ(tile1, tile2) << "dS tile, T " << t << " rows from " << i0;
      EXPECT_TRUE(std::equal(d1.begin(), d1.end(), grads.begin() + i0 * ld)) << "dP kept, T " << t;
    }
  }
}

TEST(OpsAttention, BadShapesThrow) {
  EXPECT_TRUE(throws_with(
      [] {
        ops::causal_attention(Tensor::zeros({2, 5, 10}), 2);
      },
      {"causal_attention", "[2, 5, 10]"}));
  EXPECT_TRUE(throws_with([] { ops::causal_attention(Tensor::zeros({2, 5, 24}), 3); }, {"causal_attention", "8", "3"}));
  EXPECT_TRUE(throws_with([] { ops::causal_attention(Tensor::zeros({5, 24}), 2); }, {"causal_attention", "[5, 24]"}));
}

// ---------------------------------------------------------------- dropout

TEST(OpsDropout, IdentityWhenPZeroOrEval) {
  const Tensor x = test::randn({4, 5}, 121);
  Generator gen(1);
  EXPECT_EQ(ops::dropout(x, 0.0f, true, gen).to_vector(), x.to_vector());
  EXPECT_EQ(ops::dropout(x, 0.5f, false, gen).to_vector(), x.to_vector());
  // Identity passes gradients straight through.
  Tensor xg = x.clone().set_requires_grad(true);
  ops::sum(ops::dropout(xg, 0.5f, false, gen)).backward();
  EXPECT_EQ(xg.grad().to_vector(), std::vector<float>(20, 1.0f));
}

TEST(OpsDropout, MaskStatistics) {
  const int64_t n = 200000;
  const float p = 0.25f;
  const Tensor x = test::uniform({n}, 122, 1.0f, 2.0f);
  Generator gen(7);
  const std::vector<float> y = ops::dropout(x, p, true, gen).to_vector();
  const std::vector<float> xv = x.to_vector();
  int64_t zeros = 0;
  const float keep = 1.0f / (1.0f - p);
  for (size_t i = 0; i < y.size(); ++i) {
    if (y[i] == 0.0f) {
      ++zeros;
    } else {
      ASSERT_EQ(y[i], xv[i] * keep) << i;
    }
  }
  // Binomial(n, p): standard deviation of the zero fraction ~ 1e-3; 5 sigma.
  EXPECT_NEAR(static_cast<double>(zeros) / static_cast<double>(n), p, 5e-3);
}

TEST(OpsDropout, SameSeedSameMaskAndGradientEqualsMask) {
  const Tensor x0 = test::uniform({50}, 123, 1.0f, 2.0f);
  Generator g1(9), g2(9), g3(10);
  const std::vector<float> a = ops::dropout(x0, 0.5f, true, g1).to_vector();
  EXPECT_EQ(a, ops::dropout(x0, 0.5f, true, g2).to_vector());
  EXPECT_NE(a, ops::dropout(x0, 0.5f, true, g3).to_vector());

  Tensor x = x0.clone().set_requires_grad(true);
  Generator gen(11);
  Tensor y = ops::dropout(x, 0.4f, true, gen);
  ops::sum(y).backward();
  const std::vector<float> yv = y.to_vector(), gv = x.grad().to_vector(), xv = x0.to_vector();
  int kept = 0;
  for (size_t i = 0; i < yv.size(); ++i) {
    if (yv[i] == 0.0f) {
      EXPECT_EQ(gv[i], 0.0f) << i;
    } else {
      ++kept;
      EXPECT_EQ(gv[i], 1.0f / (1.0f - 0.4f)) << i;
      EXPECT_EQ(yv[i], xv[i] * gv[i]) << i;
    }
  }
  EXPECT_GT(kept, 0);
  EXPECT_LT(kept, 50);
  // With a fixed mask (a fresh generator per call), dropout is linear and checks exactly.
  EXPECT_TRUE(gradcheck(
      [](const std::vector<Tensor>& in) {
        Generator g(12);
        return ops::dropout(in[0], 0.3f, true, g);
      },
      {test::randn({3, 8}, 124)}));
}

TEST(OpsDropout, BadProbabilityThrows) {
  Generator gen(1);
  EXPECT_TRUE(throws_with([&] { ops::dropout(Tensor::zeros({2}), 1.0f, true, gen); }, {"dropout", "1"}));
  EXPECT_TRUE(throws_with([&] { ops::dropout(Tensor::zeros({2}), -0.1f, true, gen); }, {"dropout", "-0.1"}));
}

// ---------------------------------------------------------------- views

TEST(OpsViews, ReshapeSharesStorageAndInfers) {
  Tensor a = Tensor::from_vector({2, 3}, {0, 1, 2, 3, 4, 5});
  Tensor r = a.reshape({3, -1});
  EXPECT_EQ(r.shape(), (Shape{3, 2}));
  EXPECT_EQ(r.to_vector(), a.to_vector());
  r.data()[0] = 42.0f;  // a view: writes are visible through the original
  EXPECT_EQ(a.to_vector()[0], 42.0f);
  EXPECT_EQ(a.reshape({6}).shape(), (Shape{6}));
  EXPECT_EQ(a.reshape({1, 6, 1}).shape(), (Shape{1, 6, 1}));
  EXPECT_EQ(Tensor::zeros({0, 3}).reshape({-1, 3}).shape(), (Shape{0, 3}));
  EXPECT_EQ(Tensor::scalar(1.0f).reshape({1, 1}).shape(), (Shape{1, 1}));
  // A transposed tensor is copied first; values follow the logical order.
  const Tensor t = Tensor::from_vector({2, 3}, {0, 1, 2, 3, 4, 5}).transpose(0, 1);
  EXPECT_EQ(t.reshape({6}).to_vector(), (std::vector<float>{0, 3, 1, 4, 2, 5}));
}

TEST(OpsViews, TransposeValues) {
  const Tensor a = Tensor::from_vector({2, 3}, {0, 1, 2, 3, 4, 5});
  const Tensor t = a.transpose(0, 1);
  EXPECT_EQ(t.shape(), (Shape{3, 2}));
  EXPECT_FALSE(t.is_contiguous());
  EXPECT_EQ(t.to_vector(), (std::vector<float>{0, 3, 1, 4, 2, 5}));
  EXPECT_EQ(a.transpose(-1, -2).to_vector(), t.to_vector());
  const Tensor c = t.contiguous();
  EXPECT_TRUE(c.is_contiguous());
  EXPECT_EQ(c.to_vector(), t.to_vector());
  EXPECT_EQ(c.strides(), (Shape{2, 1}));
}

TEST(OpsViews, SliceValuesAndBounds) {
  const Tensor a = Tensor::from_vector({3, 4}, {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11});
  EXPECT_EQ(a.slice(0, 1, 3).to_vector(), (std::vector<float>{4, 5, 6, 7, 8, 9, 10, 11}));
  EXPECT_EQ(a.slice(1, 1, 3).to_vector(), (std::vector<float>{1, 2, 5, 6, 9, 10}));
  EXPECT_EQ(a.slice(-1, 3, 4).to_vector(), (std::vector<float>{3, 7, 11}));
  EXPECT_EQ(a.slice(1, 1, 3).slice(0, 2, 3).to_vector(), (std::vector<float>{9, 10}));
  EXPECT_EQ(a.slice(0, 2, 2).shape(), (Shape{0, 4}));
  EXPECT_TRUE(throws_with([&] { a.slice(0, 2, 1); }, {"slice", "[2, 1)"}));
  EXPECT_TRUE(throws_with([&] { a.slice(1, 0, 5); }, {"slice", "5"}));
  EXPECT_TRUE(throws_with([&] { a.slice(2, 0, 1); }, {"slice", "2"}));
}

TEST(OpsViews, Gradients) {
  using In = const std::vector<Tensor>&;
  EXPECT_TRUE(gradcheck([](In in) { return in[0].reshape({3, -1}); }, {test::randn({2, 3}, 131)}));
  EXPECT_TRUE(gradcheck([](In in) { return in[0].transpose(0, 2); }, {test::randn({2, 3, 4}, 132)}));
  EXPECT_TRUE(gradcheck([](In in) { return in[0].transpose(0, 1).reshape({-1}); }, {test::randn({2, 3}, 133)}));
  EXPECT_TRUE(gradcheck([](In in) { return in[0].slice(1, 1, 3); }, {test::randn({3, 4}, 134)}));
  EXPECT_TRUE(
      gradcheck([](In in) { return in[0].transpose(0, 1).slice(0, 1, 4).contiguous(); }, {test::randn({3, 5}, 135)}));
  EXPECT_TRUE(gradcheck([](In in) { return in[0].clone(); }, {test::randn({2, 2}, 136)}));
  // Two slices of the same tensor: the gradient is the sum of both scatters.
  EXPECT_TRUE(gradcheck([](In in) { return ops::add(in[0].slice(0, 0, 2), in[0].slice(0, 1, 3)); },
                        {test::randn({3, 2}, 137)}));
}

TEST(OpsViews, SliceGradientIsZeroOutside) {
  Tensor a = test::randn({3, 4}, 138).set_requires_grad(true);
  ops::sum(a.slice(1, 1, 3)).backward();
  EXPECT_EQ(a.grad().to_vector(), (std::vector<float>{0, 1, 1, 0, 0, 1, 1, 0, 0, 1, 1, 0}));
}

TEST(OpsViews, DetachCutsTheGraph) {
  Tensor a = test::randn({2}, 139).set_requires_grad(true);
  Tensor d = a.detach();
  EXPECT_FALSE(d.requires_grad());
  EXPECT_EQ(d.raw_data(), a.raw_data());
  Tensor y = ops::mul(ops::mul(a, d), Tensor::scalar(1.0f));
  ops::sum(y).backward();
  EXPECT_EQ(a.grad().to_vector(), d.to_vector());  // d/da (a * const) = const
}

TEST(OpsViews, BadReshapeThrows) {
  const Tensor a = Tensor::zeros({2, 3});
  EXPECT_TRUE(throws_with([&] { a.reshape({4}); }, {"reshape", "[2, 3]", "[4]"}));
  EXPECT_TRUE(throws_with([&] { a.reshape({-1, -1}); }, {"reshape", "[2, 3]", "[-1, -1]"}));
  EXPECT_TRUE(throws_with([&] { a.reshape({-1, 4}); }, {"reshape", "[2, 3]", "[-1, 4]"}));
  EXPECT_TRUE(throws_with([&] { a.reshape({-2, -3}); }, {"reshape", "[-2, -3]"}));
  EXPECT_TRUE(throws_with([&] { a.transpose(0, 2); }, {"transpose", "2"}));
}

// ---------------------------------------------------------------- dtype conversion

namespace {

uint16_t bits16(const Tensor& t, size_t i) { return static_cast<const uint16_t*>(t.raw_data())[i]; }

float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace

TEST(OpsDtype, Bf16RoundTripAndRounding) {
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> in = {1.0f,
                                 -2.0f,
                                 0.0f,
                                 -0.0f,
                                 3.140625f,
                                 std::ldexp(1.0f, -130) /* f32 subnormal, exact */,
                                 1.0f + std::ldexp(1.0f, -8) /* tie -> even (1) */,
                                 1.0f + 3 * std::ldexp(1.0f, -8) /* tie -> even (1+2^-6) */,
                                 1.0f + std::ldexp(1.0f, -8) + std::ldexp(1.0f, -20) /* above the tie -> up */,
                                 std::numeric_limits<float>::max() /* rounds up to inf */,
                                 inf,
                                 -inf};
  const std::vector<float> expected = {1.0f,
                                       -2.0f,
                                       0.0f,
                                       -0.0f,
                                       3.140625f,
                                       std::ldexp(1.0f, -130),
                                       1.0f,
                                       1.0f + std::ldexp(1.0f, -6),
                                       1.0f + std::ldexp(1.0f, -7),
                                       inf,
                                       inf,
                                       -inf};
  const Tensor h = Tensor::from_vector({static_cast<int64_t>(in.size())}, in).to(DType::bf16);
  EXPECT_EQ(h.dtype(), DType::bf16);
  EXPECT_EQ(bits16(h, 0), 0x3f80);
  EXPECT_EQ(bits16(h, 3), 0x8000);  // sign of -0 kept
  const std::vector<float> back = h.to(DType::f32).to_vector();
  ASSERT_EQ(back.size(), expected.size());
  for (size_t i = 0; i < back.size(); ++i) {
    EXPECT_EQ(back[i], expected[i]) << i;
    EXPECT_EQ(std::signbit(back[i]), std::signbit(expected[i])) << i;
  }
  const Tensor nan =
      Tensor::from_vector({2}, {NAN, from_bits(0x7f800001u) /* signalling NaN payload */}).to(DType::bf16);
  for (float v : nan.to_vector()) EXPECT_TRUE(std::isnan(v));
}

TEST(OpsDtype, F16RoundTripAndRounding) {
  const float inf = std::numeric_limits<float>::infinity();
  const float s = std::ldexp(1.0f, -24);  // smallest f16 subnormal
  const std::vector<float> in = {1.0f,
                                 65504.0f,
                                 65519.0f /* below the tie with 65536 */,
                                 65520.0f /* tie -> inf */,
                                 -1e5f,
                                 s,
                                 std::ldexp(1.0f, -25) /* tie -> 0 */,
                                 std::ldexp(1.0f, -25) + std::ldexp(1.0f, -35) /* -> s */,
                                 3 * std::ldexp(1.0f, -25) /* tie -> 2s */,
                                 5 * std::ldexp(1.0f, -25) /* tie -> 2s */,
                                 std::ldexp(1.0f, -14) /* min normal */,
                                 std::ldexp(1.0f, -14) - s /* max subnormal */,
                                 std::ldexp(1.0f, -14) - std::ldexp(1.0f, -25) /* tie -> min normal */,
                                 1.0f + std::ldexp(1.0f, -11) /* tie -> 1 */,
                                 1.0f + 3 * std::ldexp(1.0f, -11) /* tie -> 1 + 2^-9 */,
                                 -0.0f,
                                 inf,
                                 -inf,
                                 1e-10f};
  const std::vector<float> expected = {1.0f,
                                       65504.0f,
                                       65504.0f,
                                       inf,
                                       -inf,
                                       s,
                                       0.0f,
                                       s,
                                       2 * s,
                                       2 * s,
                                       std::ldexp(1.0f, -14),
                                       std::ldexp(1.0f, -14) - s,
                                       std::ldexp(1.0f, -14),
                                       1.0f,
                                       1.0f + std::ldexp(1.0f, -9),
                                       -0.0f,
                                       inf,
                                       -inf,
                                       0.0f};
  const Tensor h = Tensor::from_vector({static_cast<int64_t>(in.size())}, in).to(DType::f16);
  EXPECT_EQ(h.dtype(), DType::f16);
  EXPECT_EQ(bits16(h, 0), 0x3c00);
  EXPECT_EQ(bits16(h, 1), 0x7bff);
  EXPECT_EQ(bits16(h, 5), 0x0001);
  EXPECT_EQ(bits16(h, 15), 0x8000);
  const std::vector<float> back = h.to(DType::f32).to_vector();
  ASSERT_EQ(back.size(), expected.size());
  for (size_t i = 0; i < back.size(); ++i) {
    EXPECT_EQ(back[i], expected[i]) << i << ": " << in[i];
    EXPECT_EQ(std::signbit(back[i]), std::signbit(expected[i])) << i;
  }
  EXPECT_EQ(f32_to_f16(0.001f), 0x1419);  // 0.0010004...
  const Tensor nan = Tensor::from_vector({2}, {NAN, -NAN}).to(DType::f16);
  for (float v : nan.to_vector()) EXPECT_TRUE(std::isnan(v));
  EXPECT_EQ(bits16(nan, 0) & 0x7c00, 0x7c00);
}

TEST(OpsDtype, EveryF16AndBf16ValueRoundTripsExactly) {
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const auto h = static_cast<uint16_t>(b);
    const float f16 = f16_to_f32(h);
    if (!std::isnan(f16)) {
      ASSERT_EQ(f32_to_f16(f16), h) << std::hex << b;
    }
    const float bf = bf16_to_f32(h);
    if (!std::isnan(bf)) {
      ASSERT_EQ(f32_to_bf16(bf), h) << std::hex << b;
    }
  }
}

TEST(OpsDtype, ConversionsBetweenHalfTypesAndViews) {
  const Tensor a = Tensor::from_vector({2, 3}, {1, 2, 3, 4, 5, 6});
  const Tensor t = a.transpose(0, 1).to(DType::bf16);  // non-contiguous source
  EXPECT_EQ(t.shape(), (Shape{3, 2}));
  EXPECT_EQ(t.to_vector(), (std::vector<float>{1, 4, 2, 5, 3, 6}));
  const Tensor f = t.to(DType::f16);
  EXPECT_EQ(f.dtype(), DType::f16);
  EXPECT_EQ(f.to_vector(), (std::vector<float>{1, 4, 2, 5, 3, 6}));
  // Same-dtype conversion is a copy, not an alias.
  Tensor c = a.to(DType::f32);
  c.data()[0] = 9.0f;
  EXPECT_EQ(a.to_vector()[0], 1.0f);
  EXPECT_TRUE(throws_with([&] { t.data(); }, {"bf16"}));
}

// ---------------------------------------------------------------- non-f32 inputs

TEST(OpsErrors, NonF32InputsThrowNamingOpAndDtype) {
  const Tensor h = Tensor::zeros({2, 3}, DType::bf16);
  const Tensor f = Tensor::zeros({2, 3});
  Generator gen(1);
  EXPECT_TRUE(throws_with([&] { ops::add(h, f); }, {"add", "bf16"}));
  EXPECT_TRUE(throws_with([&] { ops::mul(f, h); }, {"mul", "bf16"}));
  EXPECT_TRUE(throws_with([&] { ops::relu(h); }, {"relu", "bf16"}));
  EXPECT_TRUE(throws_with([&] { ops::exp(Tensor::zeros({2}, DType::f16)); }, {"exp", "f16"}));
  EXPECT_TRUE(throws_with([&] { ops::sum(h); }, {"sum", "bf16"}));
  EXPECT_TRUE(throws_with([&] { ops::mean(h, {0}); }, {"mean", "bf16"}));
  EXPECT_TRUE(throws_with([&] { ops::matmul(h, Tensor::zeros({3, 2})); }, {"matmul", "bf16"}));
  EXPECT_TRUE(throws_with([&] { ops::linear(f, Tensor::zeros({4, 3}, DType::f16), Tensor()); }, {"linear", "f16"}));
  EXPECT_TRUE(throws_with([&] { ops::softmax(h); }, {"softmax", "bf16"}));
  EXPECT_TRUE(throws_with([&] { ops::log_softmax(h); }, {"log_softmax", "bf16"}));
  EXPECT_TRUE(throws_with([&] { ops::cross_entropy(h, Tensor::zeros({2})); }, {"cross_entropy", "bf16"}));
  EXPECT_TRUE(throws_with([&] { ops::cross_entropy(f, Tensor::zeros({2}, DType::bf16)); }, {"cross_entropy", "bf16"}));
  EXPECT_TRUE(throws_with([&] { ops::layer_norm(h, Tensor::ones({3}), Tensor::zeros({3})); }, {"layer_norm", "bf16"}));
  EXPECT_TRUE(throws_with([&] { ops::embedding(h, Tensor::zeros({2})); }, {"embedding", "bf16"}));
  EXPECT_TRUE(throws_with([&] { ops::embedding(f, Tensor::zeros({2}, DType::f16)); }, {"embedding", "f16"}));
  EXPECT_TRUE(throws_with(
      [&] {
        ops::causal_attention(Tensor::zeros({1, 2, 6}, DType::bf16), 1);
      },
      {"causal_attention", "bf16"}));
  EXPECT_TRUE(throws_with([&] { ops::dropout(h, 0.5f, true, gen); }, {"dropout", "bf16"}));
  EXPECT_TRUE(throws_with([&] { Tensor(h).set_requires_grad(true); }, {"bf16"}));
}

TEST(OpsAttention, EmptySequenceAndBatch) {
  for (const Shape& s : {Shape{2, 0, 24}, Shape{0, 5, 24}}) {
    SCOPED_TRACE(shape_str(s));
    Tensor qkv = Tensor::zeros(s).set_requires_grad(true);
    Tensor y = ops::causal_attention(qkv, 2);
    EXPECT_EQ(y.shape(), (Shape{s[0], s[1], 8}));
    ops::sum(y).backward();
    ASSERT_TRUE(qkv.grad().defined());
    EXPECT_EQ(qkv.grad().shape(), s);
  }
}

// ---------------------------------------------------------------- random generator

TEST(OpsRandom, DeterministicStreamsAndState) {
  Generator a(5), b(5), c(6);
  EXPECT_EQ(a.next_u64(), b.next_u64());
  EXPECT_NE(Generator(5).next_u64(), c.next_u64());
  // state() captures the engine and the spare Box-Muller normal.
  Generator g(7);
  (void)g.normal();  // leaves a spare
  const std::string st = g.state();
  std::vector<float> expected;
  for (int i = 0; i < 5; ++i) expected.push_back(g.normal());
  Generator h(0);
  h.set_state(st);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(h.normal(), expected[static_cast<size_t>(i)]) << i;
  EXPECT_TRUE(throws_with([&] { h.set_state("not a state"); }, {"generator"}));
}

TEST(OpsRandom, DistributionsHaveTheRightRangeAndMoments) {
  Generator g(8);
  const int n = 100000;
  double sum = 0.0, sq = 0.0;
  for (int i = 0; i < n; ++i) {
    const double x = g.normal();
    sum += x;
    sq += x * x;
  }
  // Mean and variance of N(0, 1) over 1e5 draws: standard errors ~0.003 and ~0.0045.
  EXPECT_NEAR(sum / n, 0.0, 0.015);
  EXPECT_NEAR(sq / n, 1.0, 0.025);
  std::vector<int> counts(7, 0);
  for (int i = 0; i < 70000; ++i) {
    const float u = g.uniform();
    ASSERT_GE(u, 0.0f);
    ASSERT_LT(u, 1.0f);
    const uint64_t k = g.below(7);
    ASSERT_LT(k, 7u);
    ++counts[k];
  }
  for (int c : counts) EXPECT_NEAR(c, 10000, 500);  // ~5 sigma
  const Tensor t = Tensor::uniform({1000}, g, -2.0f, 3.0f);
  for (float v : t.to_vector()) {
    ASSERT_GE(v, -2.0f);
    ASSERT_LT(v, 3.0f);
  }
}

// ---------------------------------------------------------------- rows as wide as vectors

// The ops whose rows run in vector lanes (tensor/kernels.h), at widths with whole vectors and a
// tail (37 = 2 x 16 + 5 = 4 x 8 + 5): forward against the naive references, gradients against
// finite differences.
TEST(OpsWideRows, VectorisedOpsMatchReferencesAndFiniteDifferencesOverWholeVectorsAndTails) {
  const Tensor x = test::randn({3, 37}, 131, 2.0f);
  const Tensor w = test::randn({37}, 132), b = test::randn({37}, 133);
  EXPECT_TRUE(all_close(ops::layer_norm(x, w, b), naive_layer_norm(x, w, b, 1e-5), 1e-5, 1e-5));
  EXPECT_TRUE(all_close(ops::softmax(x), naive_softmax(x, false), 1e-6, 1e-5));
  EXPECT_TRUE(all_close(ops::log_softmax(x), naive_softmax(x, true), 1e-5, 1e-5));
  EXPECT_TRUE(gradcheck([](const std::vector<Tensor>& in) { return ops::layer_norm(in[0], in[1], in[2]); }, {x, w, b}));
  EXPECT_TRUE(gradcheck([](const std::vector<Tensor>& in) { return ops::softmax(in[0]); }, {x}));
  EXPECT_TRUE(gradcheck([](const std::vector<Tensor>& in) { return ops::log_softmax(in[0]); }, {x}));
  const Tensor targets = Tensor::from_vector({3}, {0, 36, 17});
  EXPECT_TRUE(gradcheck([targets](const std::vector<Tensor>& in) { return ops::cross_entropy(in[0], targets); }, {x}));
  const Tensor qkv = test::randn({1, 19, 96}, 134);
  EXPECT_TRUE(all_close(ops::causal_attention(qkv, 2), naive_attention(qkv, 2), 1e-5, 1e-5));
  GradcheckOptions some;
  some.max_checks_per_input = 300;
  EXPECT_TRUE(gradcheck([](const std::vector<Tensor>& in) { return ops::causal_attention(in[0], 2); }, {qkv}, some));
}
