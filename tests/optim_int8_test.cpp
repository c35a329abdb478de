// 8-bit optimizer state: the block codes against their error bounds, AdamW on int8 state
// against AdamW on f32 state, and the state's round trip through state() / load_state(). And
// the state offloaded to memory-mapped files: the same bits as in memory.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "dtrain/core/error.h"
#include "dtrain/optim/offload.h"
#include "dtrain/optim/optim.h"
#include "dtrain/optim/quantize.h"
#include "gradcheck.h"

using namespace dtrain;
using optim::QuantCode;
using test::throws_with;

namespace {

// Blocks of every length class (1, a prime, full), magnitudes over 12 decades, with zeros,
// both signs (kSigned) and a wide spread of second moments (kUnsignedSqrt).
std::vector<float> random_block(std::mt19937& rng, QuantCode code, int64_t n) {
  std::normal_distribution<float> normal;
  const float mag = std::pow(10.0f, static_cast<float>(static_cast<int>(rng() % 12) - 8));
  std::vector<float> x(static_cast<size_t>(n));
  for (auto& v : x) {
    v = normal(rng) * mag;
    if (code == QuantCode::kUnsignedSqrt) v = v * v * std::pow(10.0f, static_cast<float>(static_cast<int>(rng() % 6)));
    if (rng() % 17 == 0) v = 0.0f;
  }
  return x;
}

TEST(OptimQuantize, EveryValueIsWithinItsCodesSpacingAndRequantizingIsExact) {
  std::mt19937 rng(7);
  for (QuantCode code : {QuantCode::kSigned, QuantCode::kUnsignedSqrt}) {
    for (int trial = 0; trial < 300; ++trial) {
      const int64_t n = trial % 3 == 0 ? 1 : (trial % 3 == 1 ? 97 : optim::kQuantBlock);
      const std::vector<float> x = random_block(rng, code, n);
      std::vector<uint8_t> codes(static_cast<size_t>(n)), again(static_cast<size_t>(n));
      std::vector<float> y(static_cast<size_t>(n));
      const float scale = optim::quantize_block(code, x.data(), n, codes.data());
      optim::dequantize_block(code, codes.data(), n, scale, y.data());
      for (size_t i = 0; i < x.size(); ++i) {
        // kUnsignedSqrt bounds the error of sqrt(v), the quantity the update divides by.
        const double err = code == QuantCode::kSigned
                               ? std::fabs(static_cast<double>(x[i]) - y[i])
                               : std::fabs(std::sqrt(static_cast<double>(x[i])) - std::sqrt(y[i]));
        ASSERT_LE(err, optim::quantize_error_bound(code, x[i], scale))
            << "code " << static_cast<int>(code) << " x " << x[i] << " -> " << y[i] << ", scale " << scale;
        if (code == QuantCode::kSigned) {
          ASSERT_FALSE(x[i] * y[i] < 0.0f) << "sign flipped: " << x[i] << " " << y[i];
        }
      }
      // The spacing near the block's largest value: 1% or better (x^2 and x^4 steps of 1/127, 1/255).
      EXPECT_LE(optim::quantize_error_bound(code, code == QuantCode::kSigned ? scale : scale * scale, scale),
                0.0085 * scale);
      // A dequantized block codes to itself: a checkpoint that converts goes back unchanged.
      EXPECT_EQ(optim::quantize_block(code, y.data(), n, again.data()), scale);
      EXPECT_EQ(again, codes);
    }
  }
}

TEST(OptimQuantize, AZeroBlockHasScaleZeroAndDecodesToZeros) {
  const std::vector<float> zeros(10, 0.0f);
  std::vector<uint8_t> codes(10, 0xff);
  std::vector<float> back(10, 1.0f);
  for (QuantCode code : {QuantCode::kSigned, QuantCode::kUnsignedSqrt}) {
    EXPECT_EQ(optim::quantize_block(code, zeros.data(), 10, codes.data()), 0.0f);
    optim::dequantize_block(code, codes.data(), 10, 0.0f, back.data());
    EXPECT_EQ(back, zeros);
  }
}

// A noisy quadratic: p -> target, gradients 2 (p - target) + noise, the same draws for both.
struct Toy {
  static constexpr int64_t kN = 1000;  // 3 full blocks and a partial one
  Tensor p = Tensor::zeros({kN}).set_requires_grad(true);
  std::vector<float> target;
  explicit Toy(uint64_t seed) : target(kN) {
    std::mt19937 rng(static_cast<uint32_t>(seed));
    std::normal_distribution<float> normal;
    for (auto& t : target) t = normal(rng);
  }
  void run(optim::Optimizer& opt, int steps, uint32_t seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> noise;
    for (int s = 0; s < steps; ++s) {
      std::vector<float> g(kN);
      const float* pv = p.data();
      for (int64_t i = 0; i < kN; ++i)
        g[static_cast<size_t>(i)] = 2.0f * (pv[i] - target[static_cast<size_t>(i)]) + 0.3f * noise(rng);
      p.set_grad(Tensor::from_vector({kN}, g));
      opt.step();
    }
  }
  double loss() const {
    double l = 0;
    for (int64_t i = 0; i < kN; ++i) l += std::pow(p.data()[i] - target[static_cast<size_t>(i)], 2);
    return l / kN;
  }
};

TEST(OptimAdamWInt8, FollowsTheF32TrajectoryOnANoisyQuadratic) {
  Toy f32(1), q8(1);
  optim::AdamW a({f32.p}, 0.02f, 0.9f, 0.999f, 1e-8f, 0.01f);
  optim::AdamW b({q8.p}, 0.02f, 0.9f, 0.999f, 1e-8f, 0.01f, optim::StateFormat::int8);
  // The first step starts from zero state, which both formats hold exactly: the same bits.
  f32.run(a, 1, 5);
  q8.run(b, 1, 5);
  ASSERT_EQ(f32.p.to_vector(), q8.p.to_vector());
  f32.run(a, 399, 6);
  q8.run(b, 399, 6);
  const double start = Toy(1).loss();
  // Both reach the noise floor, 500x below the start; int8 within 1.5x of f32's floor, and every
  // element within 0.1 of its f32 value (the floor's spread is about 0.03).
  EXPECT_LT(f32.loss(), 2e-3 * start);
  EXPECT_LT(q8.loss(), 2e-3 * start);
  EXPECT_LT(q8.loss(), 1.5 * f32.loss());
  double worst = 0;
  for (int64_t i = 0; i < Toy::kN; ++i) worst = std::max(worst, std::fabs(double{q8.p.data()[i]} - f32.p.data()[i]));
  EXPECT_LT(worst, 0.1);
}

TEST(OptimAdamWInt8, StateIsAboutFourTimesSmallerAndRoundTripsBitwise) {
  Toy f32(2), q8(2), copy(2);
  optim::AdamW a({f32.p}, 0.02f);
  optim::AdamW b({q8.p}, 0.02f, 0.9f, 0.999f, 1e-8f, 0.01f, optim::StateFormat::int8);
  f32.run(a, 5, 9);
  q8.run(b, 5, 9);
  EXPECT_EQ(optim::state_bytes(a), 8 * Toy::kN);
  EXPECT_EQ(optim::state_bytes(b), 2 * Toy::kN + 2 * 4 * optim::quant_blocks(Toy::kN));
  EXPECT_GE(static_cast<double>(optim::state_bytes(a)) / static_cast<double>(optim::state_bytes(b)), 3.9);
  // Resume: the state and counters into a fresh int8 AdamW over a copy of the parameters; the
  // next steps then give the same bits.
  copy.p.copy_from(q8.p);
  optim::AdamW c({copy.p}, 0.02f, 0.9f, 0.999f, 1e-8f, 0.01f, optim::StateFormat::int8);
  c.load_state(b.state(), b.counters());
  q8.run(b, 7, 11);
  copy.run(c, 7, 11);
  EXPECT_EQ(q8.p.to_vector(), copy.p.to_vector());
  // Across formats: int8 state loads into an f32 AdamW as its dequantized moments (and back).
  optim::AdamW d({Tensor::zeros({Toy::kN})}, 0.02f);
  d.load_state(b.state(), b.counters());
  optim::AdamW e({Tensor::zeros({Toy::kN})}, 0.02f, 0.9f, 0.999f, 1e-8f, 0.01f, optim::StateFormat::int8);
  e.load_state(d.state(), d.counters());
  const auto sb = b.state(), se = e.state();
  ASSERT_EQ(sb.size(), se.size());
  for (size_t i = 0; i < sb.size(); ++i) {
    EXPECT_EQ(sb[i].first, se[i].first);
    EXPECT_EQ(sb[i].second.dtype(), se[i].second.dtype()) << sb[i].first;
    const auto* x = static_cast<const uint8_t*>(sb[i].second.raw_data());
    const auto* y = static_cast<const uint8_t*>(se[i].second.raw_data());
    const size_t bytes = static_cast<size_t>(sb[i].second.numel()) * dtype_size(sb[i].second.dtype());
    EXPECT_EQ(std::vector<uint8_t>(x, x + bytes), std::vector<uint8_t>(y, y + bytes)) << sb[i].first;
  }
}

TEST(OptimAdamWInt8, BadStateIsRefusedByName) {
  Toy t(3);
  optim::AdamW a({t.p}, 0.02f, 0.9f, 0.999f, 1e-8f, 0.01f, optim::StateFormat::int8);
  t.run(a, 2, 1);
  std::vector<nn::NamedTensor> state = a.state();
  optim::AdamW b({Tensor::zeros({Toy::kN})}, 0.02f, 0.9f, 0.999f, 1e-8f, 0.01f, optim::StateFormat::int8);
  auto with = [&](const std::string& name, const Tensor& t2) {
    std::vector<nn::NamedTensor> s = state;
    for (auto& [n, v] : s) {
      if (n == name) v = t2;
    }
    return s;
  };
  EXPECT_TRUE(throws_with([&] { b.load_state(with("exp_avg_q8.0", Tensor::zeros({Toy::kN})), a.counters()); },
                          {"exp_avg_q8.0", "f32", "u8 codes"}));
  EXPECT_TRUE(throws_with([&] { b.load_state(with("exp_avg_sq_scale.0", Tensor::zeros({3})), a.counters()); },
                          {"exp_avg_sq_scale.0", "[3]", "[4]"}));
  state.pop_back();  // one of the four int8 tensors missing
  EXPECT_TRUE(throws_with([&] { b.load_state(state, a.counters()); }, {"parameter 0 is incomplete"}));
  EXPECT_TRUE(throws_with([] { optim::parse_state_format("int4"); }, {"'int4'", "f32 or int8"}));
}

// Offloaded state steps in chunks of kOffloadChunk through files: a parameter of two and a half
// chunks and a small one give the same bits as the heap, in both formats, and leave no file.
TEST(OptimOffload, StateInMappedFilesGivesTheSameBitsAsInMemory) {
  char tmpl[] = "/tmp/dtrain-offload-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string dir = std::string(tmpl) + "/rank-0";
  const int64_t big = 2 * optim::kOffloadChunk + optim::kOffloadChunk / 2 + 3;
  for (auto format : {optim::StateFormat::f32, optim::StateFormat::int8}) {
    std::vector<Tensor> heap{Tensor::zeros({big}).set_requires_grad(true), Tensor::zeros({5}).set_requires_grad(true)};
    std::vector<Tensor> mapped{Tensor::zeros({big}).set_requires_grad(true),
                               Tensor::zeros({5}).set_requires_grad(true)};
    optim::AdamW a(heap, 0.01f, 0.9f, 0.999f, 1e-8f, 0.01f, format);
    optim::AdamW b(mapped, 0.01f, 0.9f, 0.999f, 1e-8f, 0.01f, format);
    b.set_state_storage(optim::offload_storage(dir));
    std::mt19937 rng(3);
    std::normal_distribution<float> normal;
    for (int step = 0; step < 3; ++step) {
      for (size_t k = 0; k < heap.size(); ++k) {
        std::vector<float> g(static_cast<size_t>(heap[k].numel()));
        for (auto& x : g) x = normal(rng);
        heap[k].set_grad(Tensor::from_vector(heap[k].shape(), g));
        mapped[k].set_grad(Tensor::from_vector(heap[k].shape(), g));
      }
      a.step();
      b.step();
    }
    for (size_t k = 0; k < heap.size(); ++k) EXPECT_EQ(heap[k].to_vector(), mapped[k].to_vector()) << k;
    // Loaded into another offloaded optimizer, the state goes on to the same bits too.
    std::vector<Tensor> again{mapped[0].clone().set_requires_grad(true), mapped[1].clone().set_requires_grad(true)};
    optim::AdamW c(again, 0.01f, 0.9f, 0.999f, 1e-8f, 0.01f, format);
    c.set_state_storage(optim::offload_storage(dir));
    c.load_state(b.state(), b.counters());
    EXPECT_EQ(optim::state_bytes(c), optim::state_bytes(a));
    for (size_t k = 0; k < heap.size(); ++k) {
      again[k].set_grad(mapped[k].grad());
      heap[k].set_grad(mapped[k].grad());
    }
    a.step();
    c.step();
    for (size_t k = 0; k < heap.size(); ++k) EXPECT_EQ(heap[k].to_vector(), again[k].to_vector()) << k;
    // The files were unlinked as soon as they were mapped.
    EXPECT_TRUE(std::filesystem::is_empty(dir));
  }
  // A directory that cannot be made is named.
  const std::string file = std::string(tmpl) + "/file";
  std::ofstream(file) << "x";
  EXPECT_TRUE(throws_with([&] { optim::offload_storage(file + "/sub"); }, {"--offload", file + "/sub"}));
  std::filesystem::remove_all(tmpl);
}

}  // namespace
