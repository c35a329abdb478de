// The autograd engine: accumulation, fan-out, no-grad mode, grad-ready hooks and errors.
#include "dtrain/tensor/autograd.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "dtrain/core/error.h"
#include "dtrain/tensor/ops.h"
#include "gradcheck.h"

using namespace dtrain;
using test::all_close;
using test::throws_with;

namespace {

Tensor leaf(const Shape& shape, uint64_t seed) { return test::randn(shape, seed).set_requires_grad(true); }

std::vector<float> times(const std::vector<float>& v, float s) {
  std::vector<float> out;
  for (float x : v) out.push_back(x * s);
  return out;
}

}  // namespace

TEST(AutogradAccumulation, TwoBackwardCallsAddUp) {
  Tensor w = leaf({3}, 1);
  const Tensor x = test::randn({3}, 2);
  ops::sum(ops::mul(w, x)).backward();
  EXPECT_EQ(w.grad().to_vector(), x.to_vector());
  ops::sum(ops::mul(w, w)).backward();  // adds 2w
  std::vector<float> expected;
  for (size_t i = 0; i < 3; ++i) expected.push_back(x.to_vector()[i] + 2 * w.to_vector()[i]);
  EXPECT_TRUE(all_close(w.grad(), expected, 1e-6, 1e-6));
  // zero_grad drops the gradient; the next backward starts fresh.
  w.zero_grad();
  EXPECT_FALSE(w.grad().defined());
  ops::sum(ops::mul(w, x)).backward();
  EXPECT_EQ(w.grad().to_vector(), x.to_vector());
}

TEST(AutogradAccumulation, FirstGradientDoesNotAliasUpstreamBuffers) {
  // d(sum(a + b))/da is a broadcast of ones shared with b's gradient path; accumulating a second
  // time into a must not change b's gradient.
  Tensor a = leaf({2}, 3);
  Tensor b = leaf({2}, 4);
  ops::sum(ops::add(a, b)).backward();
  ops::sum(ops::mul_scalar(a, 3.0f)).backward();
  EXPECT_EQ(a.grad().to_vector(), (std::vector<float>{4, 4}));
  EXPECT_EQ(b.grad().to_vector(), (std::vector<float>{1, 1}));
}

TEST(AutogradAccumulation, IntoANonContiguousGradientSetByTheUser) {
  // A gradient installed with set_grad may be any view of the right shape (here a transpose);
  // accumulation must follow logical element order, not storage order.
  Tensor p = leaf({2, 3}, 50);
  p.set_grad(Tensor::from_vector({3, 2}, {1, 4, 2, 5, 3, 6}).transpose(0, 1));  // logical [[1,2,3],[4,5,6]]
  const Tensor r = test::randn({2, 3}, 51);
  ops::sum(ops::mul(p, r)).backward();
  std::vector<float> expected;
  for (size_t i = 0; i < 6; ++i) expected.push_back(static_cast<float>(i + 1) + r.to_vector()[i]);
  EXPECT_TRUE(all_close(p.grad(), expected, 1e-6, 1e-6));
}

TEST(AutogradFanOut, LeafUsedTwiceGetsTheSum) {
  Tensor a = leaf({4}, 5);
  const Tensor b = test::randn({4}, 6);
  ops::sum(ops::add(ops::mul(a, b), a)).backward();  // d/da = b + 1
  std::vector<float> expected;
  for (float v : b.to_vector()) expected.push_back(v + 1.0f);
  EXPECT_TRUE(all_close(a.grad(), expected, 1e-6, 1e-6));

  Tensor c = leaf({4}, 7);
  ops::sum(ops::mul(c, c)).backward();  // the same tensor on both inputs of one op
  EXPECT_TRUE(all_close(c.grad(), times(c.to_vector(), 2.0f), 1e-6, 1e-6));
}

TEST(AutogradFanOut, IntermediateUsedTwiceAtDifferentDepths) {
  // h = 2a; y = sum(exp(h) * h + h): dy/dh = exp(h)(1 + h) + 1, dy/da = 2 dy/dh.
  Tensor a = leaf({5}, 8);
  Tensor h = ops::mul_scalar(a, 2.0f);
  ops::sum(ops::add(ops::mul(ops::exp(h), h), h)).backward();
  std::vector<float> expected;
  for (float av : a.to_vector()) {
    const double hv = 2.0 * av;
    expected.push_back(static_cast<float>(2.0 * (std::exp(hv) * (1.0 + hv) + 1.0)));
  }
  EXPECT_TRUE(all_close(a.grad(), expected, 1e-5, 1e-5));
  EXPECT_TRUE(test::gradcheck(
      [](const std::vector<Tensor>& in) {
        Tensor hh = ops::mul_scalar(in[0], 2.0f);
        return ops::add(ops::mul(ops::exp(hh), hh), hh);
      },
      {test::randn({5}, 9, 0.5f)}));
}

TEST(AutogradNoGrad, GuardDisablesRecordingAndRestores) {
  Tensor a = leaf({3}, 10);
  EXPECT_TRUE(grad_mode_enabled());
  {
    NoGradGuard guard;
    EXPECT_FALSE(grad_mode_enabled());
    Tensor y = ops::mul(a, a);
    EXPECT_FALSE(y.requires_grad());
    EXPECT_EQ(y.grad_fn(), nullptr);
    EXPECT_FALSE(a.transpose(0, 0).requires_grad());
    EXPECT_FALSE(a.reshape({3, 1}).requires_grad());
    {
      NoGradGuard nested;
      EXPECT_FALSE(grad_mode_enabled());
    }
    EXPECT_FALSE(grad_mode_enabled());  // the inner guard restores "off", not "on"
    EXPECT_TRUE(throws_with([&] { ops::sum(y).backward(); }, {"autograd", "does not require grad"}));
  }
  EXPECT_TRUE(grad_mode_enabled());
  Tensor y = ops::mul(a, a);
  EXPECT_TRUE(y.requires_grad());
  EXPECT_NE(y.grad_fn(), nullptr);
}

TEST(AutogradNoGrad, GradModeIsPerThread) {
  NoGradGuard guard;
  bool other_thread_enabled = false;
  std::thread t([&] { other_thread_enabled = grad_mode_enabled(); });
  t.join();
  EXPECT_TRUE(other_thread_enabled);
  EXPECT_FALSE(grad_mode_enabled());
}

TEST(AutogradNoGrad, InputsWithoutGradProduceNoGraph) {
  const Tensor a = test::randn({3}, 11);
  const Tensor y = ops::exp(ops::add(a, a));
  EXPECT_FALSE(y.requires_grad());
  EXPECT_EQ(y.grad_fn(), nullptr);
}

namespace {

// A three-layer MLP chain x -> fc0 -> relu -> fc1 -> relu -> fc2 whose parameters record, in
// their grad-ready hooks, the order they fired in and their gradient at that moment.
struct HookedMlp {
  std::map<std::string, Tensor> params;
  std::vector<std::string> fired;
  std::map<std::string, std::vector<float>> grad_in_hook;
  std::map<std::string, int> calls;

  HookedMlp() {
    const std::vector<std::pair<std::string, Shape>> shapes = {{"fc0.weight", {5, 3}}, {"fc0.bias", {5}},
                                                               {"fc1.weight", {4, 5}}, {"fc1.bias", {4}},
                                                               {"fc2.weight", {2, 4}}, {"fc2.bias", {2}}};
    uint64_t seed = 100;
    for (const auto& [name, shape] : shapes) {
      Tensor p = leaf(shape, seed++);
      const std::string n = name;
      p.register_grad_ready_hook([this, n](Tensor& param) {
        fired.push_back(n);
        ++calls[n];
        grad_in_hook[n] = param.grad().to_vector();
        EXPECT_TRUE(param.same(params.at(n)));
      });
      params[name] = p;
    }
  }

  Tensor loss(const Tensor& x) {
    Tensor h = ops::relu(ops::linear(x, params["fc0.weight"], params["fc0.bias"]));
    h = ops::relu(ops::linear(h, params["fc1.weight"], params["fc1.bias"]));
    Tensor y = ops::linear(h, params["fc2.weight"], params["fc2.bias"]);
    return ops::sum(ops::mul(y, test::randn(y.shape(), 99)));
  }

  size_t position(const std::string& name, size_t from = 0) const {
    for (size_t i = from; i < fired.size(); ++i) {
      if (fired[i] == name) return i;
    }
    return fired.size();
  }
};

}  // namespace

TEST(AutogradHooks, FireOnceWithFinalGradientLastLayerFirst) {
  HookedMlp mlp;
  mlp.loss(test::randn({6, 3}, 98)).backward();
  ASSERT_EQ(mlp.fired.size(), 6u);
  for (const auto& [name, p] : mlp.params) {
    EXPECT_EQ(mlp.calls[name], 1) << name;
    ASSERT_TRUE(p.grad().defined()) << name;
    EXPECT_EQ(mlp.grad_in_hook[name], p.grad().to_vector()) << name;
  }
  // Parameters used last in the forward pass are ready first.
  for (const char* layer : {"fc2", "fc1"}) {
    const std::string next = std::string(layer) == "fc2" ? "fc1" : "fc0";
    for (const char* a : {".weight", ".bias"}) {
      for (const char* b : {".weight", ".bias"}) {
        EXPECT_LT(mlp.position(layer + std::string(a)), mlp.position(next + b)) << layer << a << " vs " << next << b;
      }
    }
  }
}

TEST(AutogradHooks, FireOncePerBackwardAndSeeAccumulatedGradient) {
  HookedMlp mlp;
  const Tensor x = test::randn({6, 3}, 97);
  mlp.loss(x).backward();
  std::map<std::string, std::vector<float>> first;
  for (const auto& [name, p] : mlp.params) first[name] = p.grad().to_vector();
  mlp.loss(x).backward();  // same loss again: gradients double
  ASSERT_EQ(mlp.fired.size(), 12u);
  for (const auto& [name, p] : mlp.params) {
    EXPECT_EQ(mlp.calls[name], 2) << name;
    EXPECT_EQ(mlp.grad_in_hook[name], p.grad().to_vector()) << name;
    EXPECT_TRUE(all_close(p.grad(), times(first[name], 2.0f), 1e-6, 1e-6)) << name;
  }
}

TEST(AutogradHooks, SharedParameterFiresOnceAfterBothUses) {
  // W is used by two layers; its hook must wait for both contributions.
  Tensor w = leaf({3, 3}, 20);
  int calls = 0;
  std::vector<float> seen;
  w.register_grad_ready_hook([&](Tensor& p) {
    ++calls;
    seen = p.grad().to_vector();
  });
  const Tensor x = test::randn({4, 3}, 21);
  Tensor y = ops::linear(ops::tanh(ops::linear(x, w, Tensor())), w, Tensor());
  ops::sum(ops::mul(y, test::randn({4, 3}, 22))).backward();
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(seen, w.grad().to_vector());
  // And that final gradient is the full (both-use) gradient.
  EXPECT_TRUE(test::gradcheck(
      [](const std::vector<Tensor>& in) {
        const Tensor xx = test::randn({4, 3}, 21);
        return ops::linear(ops::tanh(ops::linear(xx, in[0], Tensor())), in[0], Tensor());
      },
      {test::randn({3, 3}, 20)}));
}

// A gradient home (data parallelism's buckets): linear layers write the gradient straight into
// it, it becomes grad() with no copy, and the values are those without a home, also for a
// weight used twice (the home is handed out once) and across accumulating backwards.
TEST(AutogradHooks, LinearLayersWriteGradientsIntoTheirHomes) {
  const Tensor x = test::randn({4, 3}, 21), r = test::randn({4, 3}, 22);
  auto run = [&](Tensor& w, Tensor& b, bool tied) {
    Tensor h = ops::tanh(ops::linear(x, w, b));
    Tensor y = tied ? ops::linear(h, w, Tensor()) : h;
    ops::sum(ops::mul(y, r)).backward();
  };
  for (bool tied : {false, true}) {
    Tensor w0 = leaf({3, 3}, 20), b0 = leaf({3}, 23);
    run(w0, b0, tied);
    Tensor w = leaf({3, 3}, 20), b = leaf({3}, 23);
    Tensor home_w = Tensor::full({3, 3}, 7.0f), home_b = Tensor::full({3}, 7.0f);
    w.set_grad_home(home_w);
    b.set_grad_home(home_b);
    run(w, b, tied);
    EXPECT_EQ(w.grad().to_vector(), w0.grad().to_vector()) << "tied " << tied;
    EXPECT_EQ(b.grad().to_vector(), b0.grad().to_vector()) << "tied " << tied;
    EXPECT_EQ(b.grad().data(), home_b.data()) << "the bias gradient was not written into its home";
    if (!tied) {
      EXPECT_EQ(w.grad().data(), home_w.data()) << "the weight gradient was not written into its home";
    }
    // A second backward accumulates into what is there (the home, when it was adopted).
    run(w0, b0, tied);
    run(w, b, tied);
    EXPECT_EQ(w.grad().to_vector(), w0.grad().to_vector()) << "tied " << tied << ", accumulated";
    EXPECT_EQ(b.grad().data(), home_b.data());
  }
  Tensor w = leaf({3, 3}, 20);
  EXPECT_TRUE(throws_with([&] { w.set_grad_home(Tensor::zeros({3})); }, {"must be contiguous f32 of the same shape"}));
}

TEST(AutogradHooks, UnusedParameterGetsNoHookAndNoGrad) {
  Tensor used = leaf({2}, 30);
  Tensor unused = leaf({2}, 31);
  Tensor detached_only = leaf({2}, 32);
  int used_calls = 0, unused_calls = 0, detached_calls = 0;
  used.register_grad_ready_hook([&](Tensor&) { ++used_calls; });
  unused.register_grad_ready_hook([&](Tensor&) { ++unused_calls; });
  detached_only.register_grad_ready_hook([&](Tensor&) { ++detached_calls; });
  ops::sum(ops::mul(used, detached_only.detach())).backward();
  EXPECT_EQ(used_calls, 1);
  EXPECT_EQ(unused_calls, 0);
  EXPECT_EQ(detached_calls, 0);
  EXPECT_TRUE(used.grad().defined());
  EXPECT_FALSE(unused.grad().defined());
  EXPECT_FALSE(detached_only.grad().defined());
}

TEST(AutogradHooks, OnlyOnLeavesThatRequireGrad) {
  Tensor a = leaf({2}, 33);
  Tensor b = ops::mul_scalar(a, 2.0f);
  EXPECT_TRUE(throws_with([&] { b.register_grad_ready_hook([](Tensor&) {}); }, {"autograd", "leaves"}));
  Tensor c = Tensor::zeros({2});
  EXPECT_TRUE(throws_with([&] { c.register_grad_ready_hook([](Tensor&) {}); }, {"autograd", "leaves"}));
}

TEST(AutogradErrors, BackwardNeedsAScalarThatRequiresGrad) {
  Tensor a = leaf({2, 3}, 40);
  Tensor y = ops::mul_scalar(a, 2.0f);
  EXPECT_TRUE(throws_with([&] { y.backward(); }, {"autograd", "scalar", "[2, 3]"}));
  EXPECT_FALSE(a.grad().defined());
  EXPECT_TRUE(throws_with([] { Tensor::scalar(1.0f).backward(); }, {"autograd", "does not require grad"}));
  EXPECT_TRUE(throws_with([] { Tensor().backward(); }, {"autograd", "undefined"}));
  // A one-element tensor of any rank is a scalar.
  Tensor s = ops::sum(y, {}, /*keepdim=*/true);
  ASSERT_EQ(s.shape(), (Shape{1, 1}));
  s.backward();
  EXPECT_EQ(a.grad().to_vector(), std::vector<float>(6, 2.0f));
}

TEST(AutogradErrors, BackwardFromALeaf) {
  Tensor a = leaf({}, 41);
  a.backward();
  EXPECT_EQ(a.grad().item(), 1.0f);
}

TEST(AutogradErrors, SetGradChecksShape) {
  Tensor a = leaf({2, 3}, 42);
  EXPECT_TRUE(throws_with([&] { a.set_grad(Tensor::zeros({3, 2})); }, {"autograd", "[3, 2]", "[2, 3]"}));
  EXPECT_TRUE(throws_with([&] { ops::mul_scalar(a, 1.0f).set_requires_grad(false); }, {"autograd", "non-leaf"}));
}

TEST(AutogradGraph, NodesRecordOpNames) {
  Tensor a = leaf({2, 2}, 43);
  EXPECT_STREQ(ops::matmul(a, a).grad_fn()->name(), "matmul");
  EXPECT_STREQ(ops::add(a, a).grad_fn()->name(), "add");
  EXPECT_STREQ(ops::sub(a, a).grad_fn()->name(), "sub");
  EXPECT_STREQ(ops::mean(a).grad_fn()->name(), "mean");
  EXPECT_TRUE(a.is_leaf());
  EXPECT_FALSE(ops::relu(a).is_leaf());
}

// ---------------------------------------------------------------- the gradient checker itself

namespace {

// y = 2x with a deliberately configurable backward: g * factor, optionally reversed.
struct DoubleBackward : Node {
  float factor = 2.0f;
  bool reverse = false;
  std::vector<Tensor> apply(const Tensor& g) override {
    std::vector<float> v = ops::mul_scalar(g, factor).to_vector();
    if (reverse) std::reverse(v.begin(), v.end());
    return {Tensor::from_vector(g.shape(), v)};
  }
  const char* name() const override { return "double_for_test"; }
};

Tensor doubled(const Tensor& x, float factor, bool reverse) {
  Tensor out = ops::mul_scalar(x.detach(), 2.0f);
  if (autograd::needs_grad({&x})) {
    auto node = std::make_shared<DoubleBackward>();
    node->factor = factor;
    node->reverse = reverse;
    autograd::attach(out, node, {&x});
  }
  return out;
}

}  // namespace

TEST(GradcheckSelfTest, AcceptsTheRightGradientAndRejectsWrongOnes) {
  const Tensor x = test::randn({3, 4}, 60);
  auto with = [](float factor, bool reverse) {
    return [factor, reverse](const std::vector<Tensor>& in) { return doubled(in[0], factor, reverse); };
  };
  EXPECT_TRUE(test::gradcheck(with(2.0f, false), {x}));
  EXPECT_FALSE(test::gradcheck(with(2.1f, false), {x}));   // 5% off
  EXPECT_FALSE(test::gradcheck(with(-2.0f, false), {x}));  // wrong sign
  EXPECT_FALSE(test::gradcheck(with(2.0f, true), {x}));    // right values, wrong elements
  EXPECT_FALSE(test::gradcheck(with(0.0f, false), {x}));   // no gradient at all
}

TEST(GradcheckSelfTest, MissingGradientCountsAsZero) {
  // f ignores its second input: analytic (undefined) and numeric (zero) agree.
  EXPECT_TRUE(test::gradcheck([](const std::vector<Tensor>& in) { return ops::exp(in[0]); },
                              {test::randn({2}, 61), test::randn({2}, 62)}));
  // But an input the output depends on through a detach() is caught.
  EXPECT_FALSE(
      test::gradcheck([](const std::vector<Tensor>& in) { return ops::exp(in[0].detach()); }, {test::randn({2}, 63)}));
}
