// Finite-difference gradient checks and small tensor helpers shared by the tensor, autograd and
// nn tests.
//
// Vocabulary: f maps a list of input tensors to an output y of any shape. The checked scalar is
// L = sum(y * R) with R a fixed standard-normal tensor of y's shape, so every output element
// contributes with a distinct weight (a gradient that is wrong for one element, or summed over
// the wrong axis, cannot cancel out). The analytic gradient dL/dx comes from backward(); the
// numeric one from central differences (L(x + eps) - L(x - eps)) / 2 eps, one element at a
// time, with L accumulated in double from the f32 outputs.
#pragma once

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "dtrain/core/error.h"
#include "dtrain/tensor/autograd.h"
#include "dtrain/tensor/ops.h"
#include "dtrain/tensor/random.h"
#include "dtrain/tensor/tensor.h"

namespace dtrain::test {

using OpFn = std::function<Tensor(const std::vector<Tensor>&)>;

// Tolerances. With eps = 1e-2 the central difference has truncation error eps^2/6 |f'''|
// ~ 2e-5 |f'''|. The f32 forward rounds each output element by ~6e-8 |y|; divided by 2 eps that
// is ~3e-6 |y| per element, ~1e-4 for a thousand unit-sized outputs weighted by R. atol = 2e-3
// is more than ten times that noise, and rtol = 2e-2 absorbs the curvature term where |f'''| is
// large next to |f'| (exp, log, sqrt and division near 0.5). A real gradient bug (a missing
// factor, a wrong sign, a transposed or dropped index) is off by O(|g|) and fails both.
struct GradcheckOptions {
  float eps = 1e-2f;
  double atol = 2e-3;
  double rtol = 2e-2;
  /// Which inputs to differentiate (empty: all). Others are passed through unchanged (ids,
  /// targets) and must not require grad.
  std::vector<bool> wrt;
  uint64_t seed = 0x5eedULL;
  /// Checks at most this many evenly spaced elements per input (<= 0: all of them).
  int64_t max_checks_per_input = 0;
};

inline double weighted_sum(const Tensor& y, const std::vector<float>& r) {
  const std::vector<float> v = y.to_vector();
  double s = 0.0;
  for (size_t i = 0; i < v.size(); ++i) s += static_cast<double>(v[i]) * static_cast<double>(r[i]);
  return s;
}

/// Compares analytic and numeric gradients of sum(f(inputs) * R) for every selected input.
inline ::testing::AssertionResult gradcheck(const OpFn& f, const std::vector<Tensor>& inputs_in,
                                            const GradcheckOptions& opt = {}) {
  auto wrt = [&](size_t i) { return opt.wrt.empty() || (i < opt.wrt.size() && opt.wrt[i]); };
  // Own, contiguous leaves so that perturbing an element touches exactly one value.
  std::vector<Tensor> inputs;
  for (size_t i = 0; i < inputs_in.size(); ++i) {
    Tensor x = inputs_in[i].detach().clone();
    if (wrt(i)) x.set_requires_grad(true);
    inputs.push_back(x);
  }
  Tensor y = f(inputs);
  Generator gen(opt.seed);
  const Tensor r = Tensor::randn(y.shape(), gen);
  const std::vector<float> rv = r.to_vector();
  if (y.requires_grad()) {
    Tensor loss = ops::sum(ops::mul(y, r));
    loss.backward();
  }

  NoGradGuard no_grad;
  std::string failures;
  int n_fail = 0;
  double worst = 0.0;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!wrt(i)) continue;
    Tensor& x = inputs[i];
    const Tensor g = x.grad();
    if (g.defined() && g.shape() != x.shape()) {
      return ::testing::AssertionFailure() << "input " << i << ": gradient shape " << shape_str(g.shape())
                                           << " != input shape " << shape_str(x.shape());
    }
    const std::vector<float> analytic =
        g.defined() ? g.to_vector() : std::vector<float>(static_cast<size_t>(x.numel()), 0.0f);
    const int64_t n = x.numel();
    const int64_t step = opt.max_checks_per_input > 0 ? std::max<int64_t>(1, n / opt.max_checks_per_input) : 1;
    float* p = x.data();
    for (int64_t j = 0; j < n; j += step) {
      const float orig = p[j];
      const float hi = orig + opt.eps;
      const float lo = orig - opt.eps;
      p[j] = hi;
      const double l_hi = weighted_sum(f(inputs), rv);
      p[j] = lo;
      const double l_lo = weighted_sum(f(inputs), rv);
      p[j] = orig;
      // The f32 perturbation actually applied, not the nominal 2 eps.
      const double numeric = (l_hi - l_lo) / (static_cast<double>(hi) - static_cast<double>(lo));
      const double a = analytic[static_cast<size_t>(j)];
      const double err = std::abs(a - numeric);
      const double allowed = opt.atol + opt.rtol * std::abs(numeric);
      worst = std::max(worst, err / allowed);
      if (!(err <= allowed)) {
        if (++n_fail <= 8) {
          failures += fmt::format("\n  input {} {} element {}: analytic {:.6g}, numeric {:.6g}, |diff| {:.3g} > {:.3g}",
                                  i, shape_str(x.shape()), j, a, numeric, err, allowed);
        }
      }
    }
  }
  if (n_fail > 0) {
    return ::testing::AssertionFailure() << n_fail << " gradient element(s) differ (worst error/allowed " << worst
                                         << "):" << failures;
  }
  return ::testing::AssertionSuccess();
}

// ---- small helpers for building inputs and comparing values ----

/// Normal(0, std) values from a fixed seed.
inline Tensor randn(const Shape& shape, uint64_t seed, float std = 1.0f) {
  Generator gen(seed);
  return Tensor::randn(shape, gen, std);
}

/// Uniform [lo, hi) values from a fixed seed.
inline Tensor uniform(const Shape& shape, uint64_t seed, float lo, float hi) {
  Generator gen(seed);
  return Tensor::uniform(shape, gen, lo, hi);
}

/// Normal values pushed at least `margin` away from zero (for kinks such as relu at 0).
inline Tensor randn_away_from_zero(const Shape& shape, uint64_t seed, float margin) {
  Tensor t = randn(shape, seed);
  float* p = t.data();
  for (int64_t i = 0; i < t.numel(); ++i) {
    if (std::abs(p[i]) < margin) p[i] = p[i] < 0.0f ? p[i] - margin : p[i] + margin;
  }
  return t;
}

/// Element-wise comparison with |a - b| <= atol + rtol |b|, naming the first differences.
inline ::testing::AssertionResult all_close(const std::vector<float>& actual, const std::vector<float>& expected,
                                            double atol = 1e-5, double rtol = 1e-5) {
  if (actual.size() != expected.size()) {
    return ::testing::AssertionFailure() << "sizes differ: " << actual.size() << " vs " << expected.size();
  }
  int n_fail = 0;
  std::string msg;
  for (size_t i = 0; i < actual.size(); ++i) {
    const double a = actual[i];
    const double e = expected[i];
    const bool both_nan = std::isnan(a) && std::isnan(e);
    const bool same_inf = std::isinf(a) && std::isinf(e) && (a > 0) == (e > 0);
    if (both_nan || same_inf) continue;
    if (!(std::abs(a - e) <= atol + rtol * std::abs(e))) {
      if (++n_fail <= 8) msg += fmt::format("\n  [{}]: {:.8g} vs expected {:.8g}", i, a, e);
    }
  }
  if (n_fail > 0) return ::testing::AssertionFailure() << n_fail << " of " << actual.size() << " differ:" << msg;
  return ::testing::AssertionSuccess();
}

inline ::testing::AssertionResult all_close(const Tensor& actual, const std::vector<float>& expected,
                                            double atol = 1e-5, double rtol = 1e-5) {
  return all_close(actual.to_vector(), expected, atol, rtol);
}

inline ::testing::AssertionResult all_close(const Tensor& actual, const Tensor& expected, double atol = 1e-5,
                                            double rtol = 1e-5) {
  if (actual.shape() != expected.shape()) {
    return ::testing::AssertionFailure() << "shapes differ: " << shape_str(actual.shape()) << " vs "
                                         << shape_str(expected.shape());
  }
  return all_close(actual.to_vector(), expected.to_vector(), atol, rtol);
}

/// Row-major multi-index of flat index i in `shape`.
inline std::vector<int64_t> unravel(int64_t i, const Shape& shape) {
  std::vector<int64_t> idx(shape.size());
  for (size_t d = shape.size(); d-- > 0;) {
    idx[d] = shape[d] == 0 ? 0 : i % shape[d];
    i = shape[d] == 0 ? 0 : i / shape[d];
  }
  return idx;
}

/// Flat index into `shape` of a multi-index aligned to its trailing dimensions, broadcasting
/// size-1 dimensions (a naive reference for NumPy broadcasting).
inline int64_t broadcast_index(const std::vector<int64_t>& out_idx, const Shape& shape) {
  const size_t off = out_idx.size() - shape.size();
  int64_t flat = 0;
  for (size_t d = 0; d < shape.size(); ++d) flat = flat * shape[d] + (shape[d] == 1 ? 0 : out_idx[off + d]);
  return flat;
}

/// Runs fn and checks that it throws dtrain::Error whose what() contains every one of `parts`.
template <typename Fn>
::testing::AssertionResult throws_with(Fn&& fn, const std::vector<std::string>& parts) {
  try {
    fn();
  } catch (const Error& e) {
    const std::string what = e.what();
    for (const auto& part : parts) {
      if (what.find(part) == std::string::npos) {
        return ::testing::AssertionFailure() << "message \"" << what << "\" does not contain \"" << part << "\"";
      }
    }
    return ::testing::AssertionSuccess();
  } catch (const std::exception& e) {
    return ::testing::AssertionFailure() << "threw a non-dtrain exception: " << e.what();
  }
  return ::testing::AssertionFailure() << "did not throw";
}

}  // namespace dtrain::test
