// Modules and models: canonical parameter order and names, seeding, shapes, gradients of a
// whole model by finite differences, pipeline-style forward_range, and a short training run.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "dtrain/core/error.h"
#include "dtrain/nn/models.h"
#include "dtrain/optim/optim.h"
#include "dtrain/tensor/autograd.h"
#include "dtrain/tensor/ops.h"
#include "gradcheck.h"

using namespace dtrain;
using test::throws_with;

namespace {

nn::GptConfig small_gpt_config() { return {.vocab = 256, .seq_len = 8, .layers = 2, .heads = 2, .width = 16}; }

// Token ids (B, T) in [0, vocab), fixed by seed.
Tensor token_ids(int64_t b, int64_t t, int64_t vocab, uint64_t seed) {
  Generator gen(seed);
  std::vector<float> v(static_cast<size_t>(b * t));
  for (float& x : v) x = static_cast<float>(gen.below(static_cast<uint64_t>(vocab)));
  return Tensor::from_vector({b, t}, v);
}

std::vector<std::string> names_of(const nn::Module& m) {
  std::vector<std::string> out;
  for (const auto& [name, t] : m.named_parameters()) out.push_back(name);
  return out;
}

}  // namespace

TEST(NnParameters, MlpNamesShapesAndOrder) {
  nn::Mlp mlp(784, {32, 16}, 10, 1);
  const auto named = mlp.named_parameters();
  const std::vector<std::pair<std::string, Shape>> expected = {{"fc0.fc.weight", {32, 784}}, {"fc0.fc.bias", {32}},
                                                               {"fc1.fc.weight", {16, 32}},  {"fc1.fc.bias", {16}},
                                                               {"fc2.fc.weight", {10, 16}},  {"fc2.fc.bias", {10}}};
  ASSERT_EQ(named.size(), expected.size());
  for (size_t i = 0; i < named.size(); ++i) {
    EXPECT_EQ(named[i].first, expected[i].first) << i;
    EXPECT_EQ(named[i].second.shape(), expected[i].second) << named[i].first;
    EXPECT_TRUE(named[i].second.requires_grad()) << named[i].first;
    EXPECT_TRUE(named[i].second.is_leaf()) << named[i].first;
  }
  EXPECT_EQ(mlp.num_parameters(), 784 * 32 + 32 + 32 * 16 + 16 + 16 * 10 + 10);
  EXPECT_EQ(mlp.num_blocks(), 3u);
  EXPECT_EQ(mlp.block_name(0), "fc0");
  EXPECT_EQ(mlp.block_name(2), "fc2");
  EXPECT_EQ(mlp.kind(), "mlp");
  // parameters() is named_parameters() without the names, same handles.
  const auto params = mlp.parameters();
  ASSERT_EQ(params.size(), named.size());
  for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(params[i].same(named[i].second));
  // Stable: asking twice, or building again, gives the same list.
  EXPECT_EQ(names_of(mlp), names_of(nn::Mlp(784, {32, 16}, 10, 2)));
}

TEST(NnParameters, GptNamesShapesAndOrder) {
  const nn::GptConfig cfg = small_gpt_config();
  nn::Gpt gpt(cfg, 1);
  std::vector<std::pair<std::string, Shape>> expected = {{"embed.wte", {256, 16}}, {"embed.wpe", {8, 16}}};
  for (int l = 0; l < 2; ++l) {
    const std::string p = "h" + std::to_string(l) + ".";
    const std::vector<std::pair<std::string, Shape>> block = {
        {p + "ln1.weight", {16}}, {p + "ln1.bias", {16}},           {p + "qkv.weight", {48, 16}},
        {p + "qkv.bias", {48}},   {p + "proj.weight", {16, 16}},    {p + "proj.bias", {16}},
        {p + "ln2.weight", {16}}, {p + "ln2.bias", {16}},           {p + "fc.weight", {64, 16}},
        {p + "fc.bias", {64}},    {p + "fc_proj.weight", {16, 64}}, {p + "fc_proj.bias", {16}}};
    expected.insert(expected.end(), block.begin(), block.end());
  }
  expected.push_back({"head.ln_f.weight", {16}});
  expected.push_back({"head.ln_f.bias", {16}});
  expected.push_back({"head.lm_head.weight", {256, 16}});
  const auto named = gpt.named_parameters();
  ASSERT_EQ(named.size(), expected.size());
  int64_t total = 0;
  for (size_t i = 0; i < named.size(); ++i) {
    EXPECT_EQ(named[i].first, expected[i].first) << i;
    EXPECT_EQ(named[i].second.shape(), expected[i].second) << named[i].first;
    total += shape_numel(expected[i].second);
  }
  EXPECT_EQ(gpt.num_parameters(), total);
  ASSERT_EQ(gpt.num_blocks(), 4u);
  EXPECT_EQ(gpt.block_name(0), "embed");
  EXPECT_EQ(gpt.block_name(1), "h0");
  EXPECT_EQ(gpt.block_name(2), "h1");
  EXPECT_EQ(gpt.block_name(3), "head");
  EXPECT_EQ(gpt.kind(), "gpt");
  EXPECT_EQ(names_of(gpt), names_of(nn::Gpt(cfg, 2)));
}

TEST(NnParameters, GptInitialisation) {
  nn::Gpt gpt(small_gpt_config(), 3);
  for (const auto& [name, t] : gpt.named_parameters()) {
    const std::vector<float> v = t.to_vector();
    const bool is_ln = name.find("ln") != std::string::npos;
    if (is_ln && name.ends_with(".weight")) {
      EXPECT_EQ(v, std::vector<float>(v.size(), 1.0f)) << name;
    } else if (name.ends_with(".bias")) {
      EXPECT_EQ(v, std::vector<float>(v.size(), 0.0f)) << name;
    } else {
      // N(0, 0.02) weights (residual projections smaller): small and not all equal.
      double sq = 0.0;
      for (float x : v) sq += static_cast<double>(x) * x;
      const double rms = std::sqrt(sq / static_cast<double>(v.size()));
      EXPECT_GT(rms, 0.002) << name;
      EXPECT_LT(rms, 0.03) << name;
    }
  }
}

TEST(NnSeeding, SameSeedSameParametersDifferentSeedDiffers) {
  const nn::GptConfig cfg = small_gpt_config();
  nn::Gpt a(cfg, 42), b(cfg, 42), c(cfg, 43);
  const auto pa = a.named_parameters(), pb = b.named_parameters(), pc = c.named_parameters();
  bool any_diff = false;
  for (size_t i = 0; i < pa.size(); ++i) {
    EXPECT_EQ(pa[i].second.to_vector(), pb[i].second.to_vector()) << pa[i].first;
    EXPECT_FALSE(pa[i].second.raw_data() == pb[i].second.raw_data()) << "models must not share storage";
    if (pa[i].second.to_vector() != pc[i].second.to_vector()) any_diff = true;
  }
  EXPECT_TRUE(any_diff);
  EXPECT_NE(pa[0].second.to_vector(), pc[0].second.to_vector());  // embed.wte

  nn::Mlp m1(20, {8}, 3, 7), m2(20, {8}, 3, 7), m3(20, {8}, 3, 8);
  for (size_t i = 0; i < m1.parameters().size(); ++i) {
    EXPECT_EQ(m1.parameters()[i].to_vector(), m2.parameters()[i].to_vector());
    EXPECT_NE(m1.parameters()[i].to_vector(), m3.parameters()[i].to_vector());
  }
}

TEST(NnGpt, ForwardShapeAndLoss) {
  nn::Gpt gpt(small_gpt_config(), 5);
  const Tensor ids = token_ids(2, 8, 256, 6);
  const Tensor logits = gpt.forward(ids);
  EXPECT_EQ(logits.shape(), (Shape{2, 8, 256}));
  for (float v : logits.to_vector()) ASSERT_TRUE(std::isfinite(v));
  // Shorter sequences are fine; at init the loss is close to log(V).
  EXPECT_EQ(gpt.forward(token_ids(3, 5, 256, 7)).shape(), (Shape{3, 5, 256}));
  const Tensor loss = gpt.loss(logits, token_ids(2, 8, 256, 8));
  EXPECT_EQ(loss.shape(), Shape{});
  EXPECT_NEAR(loss.item(), std::log(256.0), 0.3);
  EXPECT_TRUE(throws_with([&] { gpt.forward(token_ids(1, 9, 256, 9)); }, {"nn", "9", "8"}));
  EXPECT_TRUE(throws_with([&] { gpt.forward(Tensor::zeros({8})); }, {"nn", "[8]"}));
}

TEST(NnGpt, CausalOutputsIgnoreFutureTokens) {
  nn::Gpt gpt(small_gpt_config(), 10);
  Tensor ids = token_ids(1, 8, 256, 11);
  const std::vector<float> before = gpt.forward(ids).to_vector();
  ids.data()[6] = static_cast<float>((static_cast<int>(ids.data()[6]) + 1) % 256);  // change position 6
  const std::vector<float> after = gpt.forward(ids).to_vector();
  for (size_t i = 0; i < 6 * 256; ++i) ASSERT_EQ(before[i], after[i]) << i;
  bool changed = false;
  for (size_t i = 6 * 256; i < before.size(); ++i) changed |= before[i] != after[i];
  EXPECT_TRUE(changed);
}

TEST(NnGpt, LossGradientMatchesFiniteDifferences) {
  // A tiny GPT; a few elements of parameters spread over every kind of layer.
  nn::GptConfig cfg;
  cfg.vocab = 11;
  cfg.seq_len = 5;
  cfg.layers = 2;
  cfg.heads = 2;
  cfg.width = 8;
  nn::Gpt gpt(cfg, 12);
  // Larger weights than the 0.02 init so that every element has a sizeable gradient.
  {
    NoGradGuard no_grad;
    Generator gen(13);
    for (auto& [name, p] : gpt.named_parameters()) {
      p.copy_from(ops::add(p, Tensor::randn(p.shape(), gen, 0.3f)));
    }
  }
  const Tensor ids = token_ids(2, 5, 11, 14);
  const Tensor targets = token_ids(2, 5, 11, 15);
  gpt.loss(gpt.forward(ids), targets).backward();

  const std::vector<std::pair<std::string, int64_t>> probes = {
      {"embed.wte", -1},      {"embed.wpe", 9},        {"h0.ln1.weight", 3},       {"h0.ln1.bias", 5},
      {"h0.qkv.weight", 17},  {"h0.qkv.weight", 70},   {"h0.qkv.weight", 120},     {"h0.qkv.bias", 20},
      {"h0.proj.weight", 33}, {"h0.fc.weight", 100},   {"h0.fc.bias", 7},          {"h1.fc_proj.weight", 200},
      {"h1.ln2.bias", 2},     {"head.ln_f.weight", 6}, {"head.lm_head.weight", 40}};
  const auto named = gpt.named_parameters();
  auto find = [&](const std::string& n) {
    for (const auto& [name, t] : named) {
      if (name == n) return t;
    }
    ADD_FAILURE() << "no parameter " << n;
    return Tensor();
  };
  NoGradGuard no_grad;
  const float eps = 1e-2f;
  for (auto [name, index] : probes) {
    Tensor p = find(name);
    if (index < 0) index = static_cast<int64_t>(ids.to_vector()[0]) * cfg.width + 1;  // a used token row
    float* v = p.data() + index;
    const float orig = *v;
    *v = orig + eps;
    const double hi = gpt.loss(gpt.forward(ids), targets).item();
    *v = orig - eps;
    const double lo = gpt.loss(gpt.forward(ids), targets).item();
    *v = orig;
    const double numeric = (hi - lo) / (2.0 * eps);
    const double analytic = p.grad().to_vector()[static_cast<size_t>(index)];
    // The loss (~2.4) is an f32 mean: its rounding, ~3e-7, over 2 eps is ~2e-5; observed
    // differences are <= 1.5e-5 for gradients of 3e-3 .. 0.2.
    EXPECT_NEAR(analytic, numeric, 1e-4 + 1e-2 * std::abs(numeric)) << name << "[" << index << "]";
  }
}

TEST(NnSequential, ForwardRangeComposes) {
  nn::Gpt gpt(small_gpt_config(), 20);
  const Tensor ids = token_ids(2, 8, 256, 21);
  const std::vector<float> full = gpt.forward(ids).to_vector();
  for (size_t k = 0; k <= gpt.num_blocks(); ++k) {
    const Tensor mid = gpt.forward_range(ids, 0, k);
    EXPECT_EQ(gpt.forward_range(mid, k, gpt.num_blocks()).to_vector(), full) << "cut at " << k;
  }
  nn::Mlp mlp(12, {8, 6}, 4, 22);
  const Tensor x = test::randn({5, 12}, 23);
  const std::vector<float> mfull = mlp.forward(x).to_vector();
  for (size_t k = 0; k <= mlp.num_blocks(); ++k) {
    EXPECT_EQ(mlp.forward_range(mlp.forward_range(x, 0, k), k, mlp.num_blocks()).to_vector(), mfull) << k;
  }
  EXPECT_TRUE(throws_with([&] { mlp.forward_range(x, 2, 1); }, {"nn", "[2, 1)"}));
  EXPECT_TRUE(throws_with([&] { mlp.forward_range(x, 0, 4); }, {"nn", "4", "3"}));
}

TEST(NnSequential, GradientsFlowAcrossACut) {
  // Backward through a graph built in two forward_range calls equals the one-piece backward.
  nn::Mlp a(6, {5}, 3, 30);
  const Tensor x = test::randn({4, 6}, 31);
  const Tensor y = Tensor::from_vector({4}, {0, 2, 1, 2});
  a.loss(a.forward(x), y).backward();
  std::vector<std::vector<float>> whole;
  for (const auto& p : a.parameters()) whole.push_back(p.grad().to_vector());
  a.zero_grad();
  for (const auto& p : a.parameters()) EXPECT_FALSE(p.grad().defined());
  a.loss(a.forward_range(a.forward_range(x, 0, 1), 1, 2), y).backward();
  for (size_t i = 0; i < whole.size(); ++i) EXPECT_EQ(a.parameters()[i].grad().to_vector(), whole[i]);
}

TEST(NnDropout, TrainAndEvalModes) {
  nn::GptConfig cfg = small_gpt_config();
  cfg.dropout = 0.5f;
  nn::Gpt gpt(cfg, 40);
  const Tensor ids = token_ids(2, 8, 256, 41);
  EXPECT_TRUE(gpt.is_training());
  const std::vector<float> t1 = gpt.forward(ids).to_vector();
  const std::vector<float> t2 = gpt.forward(ids).to_vector();
  EXPECT_NE(t1, t2);  // fresh masks each call
  gpt.train(false);
  EXPECT_FALSE(gpt.is_training());
  const std::vector<float> e1 = gpt.forward(ids).to_vector();
  EXPECT_EQ(e1, gpt.forward(ids).to_vector());
  // Evaluation equals the same model built without dropout.
  nn::GptConfig cfg0 = cfg;
  cfg0.dropout = 0.0f;
  nn::Gpt plain(cfg0, 40);
  EXPECT_EQ(e1, plain.forward(ids).to_vector());
}

TEST(NnTraining, MlpLossDecreasesWithSgd) {
  nn::Mlp mlp(10, {16}, 3, 50);
  const Tensor x = test::randn({12, 10}, 51);
  const Tensor y = Tensor::from_vector({12}, {0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2});
  optim::Sgd sgd(mlp.parameters(), 0.2f, 0.9f);
  float first = 0.0f, last = 0.0f;
  for (int step = 0; step < 30; ++step) {
    sgd.zero_grad();
    Tensor loss = mlp.loss(mlp.forward(x), y);
    if (step == 0) first = loss.item();
    last = loss.item();
    loss.backward();
    sgd.step();
  }
  EXPECT_LT(last, 0.5f * first) << "first " << first << " last " << last;
}

TEST(NnTraining, GptLossDecreasesWithAdamW) {
  nn::Gpt gpt(small_gpt_config(), 60);
  const Tensor ids = token_ids(2, 8, 256, 61);
  const Tensor targets = token_ids(2, 8, 256, 62);
  optim::AdamW adam(gpt.parameters(), 1e-2f);
  float first = 0.0f, last = 0.0f;
  for (int step = 0; step < 15; ++step) {
    adam.zero_grad();
    Tensor loss = gpt.loss(gpt.forward(ids), targets);
    if (step == 0) first = loss.item();
    last = loss.item();
    loss.backward();
    adam.step();
  }
  EXPECT_LT(last, first - 1.0f) << "first " << first << " last " << last;
}

TEST(NnLayers, LinearAndLayerNormModules) {
  Generator gen(70);
  nn::Linear lin(4, 3, true, gen);
  const float bound = 0.5f;  // 1/sqrt(4)
  for (float v : lin.weight.to_vector()) {
    EXPECT_GE(v, -bound);
    EXPECT_LT(v, bound);
  }
  const Tensor x = test::randn({2, 4}, 71);
  EXPECT_EQ(lin.forward(x).to_vector(), ops::linear(x, lin.weight, lin.bias).to_vector());
  nn::Linear nobias(4, 3, false, gen);
  EXPECT_FALSE(nobias.bias.defined());
  EXPECT_EQ(nobias.named_parameters().size(), 1u);
  nn::LayerNorm ln(4);
  EXPECT_EQ(ln.forward(x).to_vector(), ops::layer_norm(x, Tensor::ones({4}), Tensor::zeros({4})).to_vector());
  EXPECT_TRUE(throws_with([&] { nn::Linear(0, 3, true, gen); }, {"nn", "0"}));
}
