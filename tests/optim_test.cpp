// Optimizers against PyTorch's update formulas evaluated here in double, the learning-rate
// schedule at known steps, and gradient clipping.
#include "dtrain/optim/optim.h"

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "dtrain/core/error.h"
#include "dtrain/tensor/ops.h"
#include "gradcheck.h"

using namespace dtrain;
using test::throws_with;

namespace {

using Vec = std::vector<double>;

Tensor param(const std::vector<float>& v) {
  return Tensor::from_vector({static_cast<int64_t>(v.size())}, v).set_requires_grad(true);
}

void set_grad(Tensor& p, const std::vector<float>& g) {
  p.set_grad(Tensor::from_vector({static_cast<int64_t>(g.size())}, g));
}

void expect_near(const Tensor& actual, const Vec& expected, double tol, const std::string& what) {
  const std::vector<float> a = actual.to_vector();
  ASSERT_EQ(a.size(), expected.size()) << what;
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], expected[i], tol) << what << " [" << i << "]";
}

const std::vector<float> kP0 = {1.0f, -2.0f, 0.5f};
// Gradients of three successive steps (different each step, so momentum state matters).
const std::vector<std::vector<float>> kGrads = {{0.5f, -1.0f, 2.0f}, {-0.25f, 0.75f, 1.5f}, {1.0f, 0.0f, -3.0f}};

// PyTorch torch.optim.SGD, per element:
//   d = g + wd * p
//   buf = d (first step) | momentum * buf + d      (dampening 0)
//   d = d + momentum * buf (nesterov) | buf
//   p = p - lr * d
Vec sgd_reference(double lr, double momentum, double wd, bool nesterov, int steps) {
  Vec p(kP0.begin(), kP0.end()), buf(3, 0.0);
  for (int s = 0; s < steps; ++s) {
    for (size_t i = 0; i < 3; ++i) {
      double d = kGrads[static_cast<size_t>(s)][i] + wd * p[i];
      if (momentum != 0.0) {
        buf[i] = s == 0 ? d : momentum * buf[i] + d;
        d = nesterov ? d + momentum * buf[i] : buf[i];
      }
      p[i] -= lr * d;
    }
  }
  return p;
}

// PyTorch torch.optim.AdamW, per element, step t = 1, 2, ...:
//   p = p * (1 - lr * wd)
//   m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
//   p = p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
Vec adamw_reference(double lr, double b1, double b2, double eps, double wd, int steps, Vec* m_out = nullptr,
                    Vec* v_out = nullptr) {
  Vec p(kP0.begin(), kP0.end()), m(3, 0.0), v(3, 0.0);
  for (int s = 0; s < steps; ++s) {
    const double t = s + 1;
    for (size_t i = 0; i < 3; ++i) {
      const double g = kGrads[static_cast<size_t>(s)][i];
      p[i] *= 1.0 - lr * wd;
      m[i] = b1 * m[i] + (1.0 - b1) * g;
      v[i] = b2 * v[i] + (1.0 - b2) * g * g;
      p[i] -= lr / (1.0 - std::pow(b1, t)) * m[i] / (std::sqrt(v[i]) / std::sqrt(1.0 - std::pow(b2, t)) + eps);
    }
  }
  if (m_out) *m_out = m;
  if (v_out) *v_out = v;
  return p;
}

template <typename Opt>
void run_steps(Opt& opt, Tensor& p, int steps) {
  for (int s = 0; s < steps; ++s) {
    set_grad(p, kGrads[static_cast<size_t>(s)]);
    opt.step();
  }
}

}  // namespace

TEST(OptimSgd, PlainMatchesHandComputation) {
  Tensor p = param(kP0);
  optim::Sgd sgd({p}, 0.1f);
  run_steps(sgd, p, 2);
  // By hand: p - 0.1 (g1 + g2) = [1 - 0.025, -2 + 0.025, 0.5 - 0.35].
  expect_near(p, {0.975, -1.975, 0.15}, 1e-6, "by hand");
  expect_near(p, sgd_reference(0.1, 0, 0, false, 2), 1e-6, "formula");
  EXPECT_EQ(sgd.step_count(), 2);
  EXPECT_TRUE(sgd.state().empty());  // no momentum buffers
  EXPECT_EQ(sgd.name(), "sgd");
}

TEST(OptimSgd, MomentumNesterovAndWeightDecay) {
  struct Case {
    double momentum, wd;
    bool nesterov;
  };
  for (const Case c :
       {Case{0.9, 0, false}, Case{0.9, 0, true}, Case{0, 0.1, false}, Case{0.8, 0.05, false}, Case{0.8, 0.05, true}}) {
    SCOPED_TRACE(::testing::Message() << "momentum " << c.momentum << " wd " << c.wd << " nesterov " << c.nesterov);
    Tensor p = param(kP0);
    optim::Sgd sgd({p}, 0.05f, static_cast<float>(c.momentum), static_cast<float>(c.wd), c.nesterov);
    run_steps(sgd, p, 3);
    expect_near(p, sgd_reference(0.05, c.momentum, c.wd, c.nesterov, 3), 1e-6, "3 steps");
    if (c.momentum != 0.0) {
      const auto state = sgd.state();
      ASSERT_EQ(state.size(), 1u);
      EXPECT_EQ(state[0].first, "momentum.0");
    }
  }
}

TEST(OptimSgd, MomentumByHand) {
  // Two steps, momentum 0.9, lr 0.1, constant g = 1: buf1 = 1, buf2 = 1.9; p = 1 - 0.1 - 0.19.
  Tensor p = param({1.0f});
  optim::Sgd sgd({p}, 0.1f, 0.9f);
  set_grad(p, {1.0f});
  sgd.step();
  sgd.step();
  expect_near(p, {0.71}, 1e-6, "momentum");
  // Nesterov: step 1 uses g + 0.9 * 1 = 1.9, step 2 uses g + 0.9 * 1.9 = 2.71: p = 1 - 0.19 - 0.271.
  Tensor q = param({1.0f});
  optim::Sgd nag({q}, 0.1f, 0.9f, 0.0f, true);
  set_grad(q, {1.0f});
  nag.step();
  nag.step();
  expect_near(q, {0.539}, 1e-6, "nesterov");
}

TEST(OptimAdamW, MatchesPyTorchFormulas) {
  for (double wd : {0.0, 0.01, 0.1}) {
    SCOPED_TRACE(wd);
    Tensor p = param(kP0);
    const auto f = static_cast<float>(wd);
    optim::AdamW adam({p}, 1e-2f, 0.9f, 0.999f, 1e-8f, f);
    for (int s = 1; s <= 3; ++s) {
      set_grad(p, kGrads[static_cast<size_t>(s - 1)]);
      adam.step();
      Vec m, v;
      // The reference takes the f32 hyperparameters the optimizer actually holds (0.999f is
      // not 0.999: 1 - 0.999f differs from 1e-3 in the 5th digit).
      expect_near(p, adamw_reference(1e-2f, 0.9f, 0.999f, 1e-8f, f, s, &m, &v), 1e-6, "step " + std::to_string(s));
      const auto state = adam.state();
      ASSERT_EQ(state.size(), 2u);
      EXPECT_EQ(state[0].first, "exp_avg.0");
      EXPECT_EQ(state[1].first, "exp_avg_sq.0");
      expect_near(state[0].second, m, 1e-6, "exp_avg");
      expect_near(state[1].second, v, 1e-8, "exp_avg_sq");
    }
  }
}

TEST(OptimAdamW, FirstStepMovesEachElementByLr) {
  // After bias correction, step 1 is p -= lr * g / (|g| + eps) = lr * sign(g) (wd = 0).
  Tensor p = param(kP0);
  optim::AdamW adam({p}, 0.1f, 0.9f, 0.999f, 1e-8f, 0.0f);
  set_grad(p, kGrads[0]);
  adam.step();
  expect_near(p, {0.9, -1.9, 0.4}, 1e-6, "sign step");
  EXPECT_EQ(adam.name(), "adamw");
}

TEST(OptimCommon, ParameterWithoutGradIsSkipped) {
  Tensor a = param(kP0);
  Tensor b = param({4.0f, 5.0f});
  optim::AdamW adam({a, b}, 0.1f);
  set_grad(a, kGrads[0]);
  adam.step();
  EXPECT_EQ(b.to_vector(), (std::vector<float>{4.0f, 5.0f}));  // not even weight decay
  const auto state = adam.state();
  ASSERT_EQ(state.size(), 2u);  // only parameter 0 has state
  EXPECT_EQ(state[0].first, "exp_avg.0");

  // b's first real step later uses bias correction for t = 1, not t = 2.
  set_grad(b, {1.0f, -1.0f});
  a.zero_grad();
  const std::vector<float> a_before = a.to_vector();
  adam.step();
  EXPECT_EQ(a.to_vector(), a_before);
  const double decay = 1.0 - 0.1 * 0.01;
  expect_near(b, {4.0 * decay - 0.1, 5.0 * decay + 0.1}, 1e-6, "b first step");

  Tensor c = param({1.0f, 2.0f});
  Tensor d = param({3.0f});
  optim::Sgd sgd({c, d}, 0.5f, 0.9f, 0.1f);
  set_grad(d, {1.0f});
  sgd.step();
  EXPECT_EQ(c.to_vector(), (std::vector<float>{1.0f, 2.0f}));
  ASSERT_EQ(sgd.state().size(), 1u);
  EXPECT_EQ(sgd.state()[0].first, "momentum.1");
}

TEST(OptimCommon, NonContiguousGradientsAreReadInLogicalOrder) {
  // A (2, 2) parameter whose gradient was installed as a transposed view.
  Tensor p = Tensor::from_vector({2, 2}, {1, 2, 3, 4}).set_requires_grad(true);
  p.set_grad(Tensor::from_vector({2, 2}, {10, 30, 20, 40}).transpose(0, 1));  // logical [[10, 20], [30, 40]]
  optim::Sgd sgd({p}, 0.1f);
  sgd.step();
  expect_near(p, {0.0, 0.0, 0.0, 0.0}, 1e-6, "sgd");
  p.set_grad(Tensor::from_vector({2, 2}, {3, 0, 4, 0}).transpose(0, 1));  // logical [[3, 4], [0, 0]]
  EXPECT_FLOAT_EQ(optim::clip_grad_norm({p}, 1.0f), 5.0f);
  expect_near(p.grad(), {0.6, 0.8, 0.0, 0.0}, 1e-6, "clipped");
}

TEST(OptimCommon, ZeroGradAndLr) {
  Tensor a = param(kP0);
  optim::Sgd sgd({a}, 0.1f);
  set_grad(a, kGrads[0]);
  sgd.zero_grad();
  EXPECT_FALSE(a.grad().defined());
  sgd.set_lr(0.25f);
  EXPECT_EQ(sgd.lr(), 0.25f);
  set_grad(a, {1.0f, 1.0f, 1.0f});
  sgd.step();
  expect_near(a, {0.75, -2.25, 0.25}, 1e-7, "lr 0.25");
  EXPECT_EQ(sgd.params().size(), 1u);
}

TEST(OptimCommon, StepDoesNotRecordAGraph) {
  Tensor a = param(kP0);
  optim::AdamW adam({a}, 0.1f);
  set_grad(a, kGrads[0]);
  adam.step();
  EXPECT_TRUE(a.is_leaf());
  EXPECT_TRUE(a.requires_grad());
}

TEST(OptimCommon, InvalidHyperparametersThrow) {
  Tensor a = param(kP0);
  EXPECT_TRUE(throws_with([&] { optim::Sgd({a}, -0.1f); }, {"optim", "-0.1"}));
  EXPECT_TRUE(throws_with([&] { optim::AdamW({a}, 0.1f, 1.0f); }, {"optim", "1"}));
  EXPECT_TRUE(throws_with([&] { optim::AdamW({a}, 0.1f, 0.9f, 0.999f, 0.0f); }, {"optim", "eps"}));
}

TEST(OptimLrSchedule, WarmupThenCosine) {
  optim::LrSchedule s;
  s.base_lr = 1.0f;
  s.min_lr = 0.1f;
  s.warmup = 10;
  s.total = 110;
  // Warmup: base * (step + 1) / warmup (the first step already trains).
  EXPECT_FLOAT_EQ(s.at(0), 0.1f);
  EXPECT_FLOAT_EQ(s.at(4), 0.5f);
  EXPECT_FLOAT_EQ(s.at(9), 1.0f);
  // Cosine: min + 0.5 (1 + cos(pi (step - warmup) / (total - warmup))) (base - min).
  EXPECT_FLOAT_EQ(s.at(10), 1.0f);
  EXPECT_FLOAT_EQ(s.at(35), static_cast<float>(0.1 + 0.5 * (1 + std::cos(M_PI * 0.25)) * 0.9));
  EXPECT_FLOAT_EQ(s.at(60), 0.55f);
  EXPECT_FLOAT_EQ(s.at(110), 0.1f);
  EXPECT_FLOAT_EQ(s.at(1000), 0.1f);
  for (int64_t step = 10; step < 110; ++step) EXPECT_GE(s.at(step), s.at(step + 1)) << step;
  for (int64_t step = 0; step < 9; ++step) EXPECT_LT(s.at(step), s.at(step + 1)) << step;
}

TEST(OptimLrSchedule, ConstantAndLinearVariants) {
  optim::LrSchedule constant;
  constant.base_lr = 3e-4f;
  constant.min_lr = 3e-4f;
  constant.total = 100;
  for (int64_t step : {0, 1, 50, 99, 100, 500}) EXPECT_FLOAT_EQ(constant.at(step), 3e-4f) << step;

  optim::LrSchedule no_cosine;
  no_cosine.base_lr = 2.0f;
  no_cosine.warmup = 4;
  no_cosine.total = 10;
  no_cosine.cosine = false;
  EXPECT_FLOAT_EQ(no_cosine.at(1), 1.0f);
  for (int64_t step : {3, 4, 9, 10, 100}) EXPECT_FLOAT_EQ(no_cosine.at(step), 2.0f) << step;

  optim::LrSchedule no_warmup;
  no_warmup.base_lr = 1.0f;
  no_warmup.total = 4;
  EXPECT_FLOAT_EQ(no_warmup.at(0), 1.0f);
  EXPECT_FLOAT_EQ(no_warmup.at(2), 0.5f);
  EXPECT_NEAR(no_warmup.at(4), 0.0f, 1e-7);
}

TEST(OptimClip, ScalesToMaxNormAndReturnsOriginalNorm) {
  Tensor a = param({0, 0});
  Tensor b = param({0});
  Tensor c = param({7});  // no gradient: ignored
  set_grad(a, {3.0f, 4.0f});
  set_grad(b, {12.0f});
  const float norm = optim::clip_grad_norm({a, b, c}, 6.5f);
  EXPECT_FLOAT_EQ(norm, 13.0f);
  // Scaled by 6.5 / 13 (PyTorch divides by norm + 1e-6).
  expect_near(a.grad(), {1.5, 2.0}, 1e-6, "a");
  expect_near(b.grad(), {6.0}, 1e-6, "b");
  EXPECT_FALSE(c.grad().defined());
  double sq = 0.0;
  for (const Tensor& g : {a.grad(), b.grad()}) {
    for (float v : g.to_vector()) sq += static_cast<double>(v) * v;
  }
  EXPECT_NEAR(std::sqrt(sq), 6.5, 1e-5);
}

TEST(OptimClip, BelowMaxNormOrMeasureOnlyLeavesGradients) {
  Tensor a = param({0, 0});
  set_grad(a, {3.0f, 4.0f});
  EXPECT_FLOAT_EQ(optim::clip_grad_norm({a}, 10.0f), 5.0f);
  EXPECT_EQ(a.grad().to_vector(), (std::vector<float>{3.0f, 4.0f}));
  EXPECT_FLOAT_EQ(optim::clip_grad_norm({a}, 0.0f), 5.0f);
  EXPECT_EQ(a.grad().to_vector(), (std::vector<float>{3.0f, 4.0f}));
  EXPECT_FLOAT_EQ(optim::clip_grad_norm({a}, -1.0f), 5.0f);
  EXPECT_EQ(a.grad().to_vector(), (std::vector<float>{3.0f, 4.0f}));
  EXPECT_EQ(optim::clip_grad_norm({}, 1.0f), 0.0f);
}
