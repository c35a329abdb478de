// --precision bf16: bf16 products with f32 sums through the ops (gradients against f32 within
// bf16's rounding), and the trainer on every layout, with compression and a resumed checkpoint.
//
// Bound for the ops: each product element is off from f32 by at most (2^-7 + 2^-16 + gamma_K)
// sum |a b| (both operands rounded by at most 2^-8 relative); on these random operands that is a
// relative (Frobenius) error of a few 2^-9, so 2^-5 fails only a product that is not bf16 at all
// or wrong; and an error below 1e-6 means the products were not rounded.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <tuple>
#include <vector>

#include "cli_util.h"
#include "dtrain/core/error.h"
#include "dtrain/nn/models.h"
#include "dtrain/tensor/autograd.h"
#include "dtrain/tensor/gemm.h"
#include "dtrain/tensor/ops.h"
#include "dtrain/tensor/random.h"
#include "gradcheck.h"

namespace dtrain {
namespace {

struct PrecisionGuard {
  Precision saved = matmul_precision();
  explicit PrecisionGuard(Precision p) { set_matmul_precision(p); }
  ~PrecisionGuard() { set_matmul_precision(saved); }
};

double relative_error(const std::vector<float>& got, const std::vector<float>& want) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    diff += (static_cast<double>(got[i]) - want[i]) * (static_cast<double>(got[i]) - want[i]);
    norm += static_cast<double>(want[i]) * want[i];
  }
  return std::sqrt(diff / std::max(norm, 1e-300));
}

using Forward = std::function<Tensor(const std::vector<Tensor>&)>;

// The output and every input's gradient of sum(f(inputs) * R) at `precision`.
std::vector<std::vector<float>> run(const Forward& f, const std::vector<Tensor>& inputs, Precision precision) {
  PrecisionGuard guard(precision);
  std::vector<Tensor> leaves;
  for (const Tensor& t : inputs) leaves.push_back(t.detach().clone().set_requires_grad(true));
  Tensor y = f(leaves);
  Generator gen(99);
  ops::sum(ops::mul(y, Tensor::randn(y.shape(), gen))).backward();
  std::vector<std::vector<float>> out{y.to_vector()};
  for (const Tensor& t : leaves) out.push_back(t.grad().to_vector());
  return out;
}

// The output and each input's gradient within the bound of f32's; those that come out of a
// product (all but `not_a_product`, e.g. a bias gradient, a plain sum) must also differ from f32.
void expect_bf16_close(const char* what, const Forward& f, const std::vector<Tensor>& inputs,
                       size_t not_a_product = SIZE_MAX) {
  const auto f32 = run(f, inputs, Precision::f32);
  const auto bf16 = run(f, inputs, Precision::bf16);
  for (size_t i = 0; i < f32.size(); ++i) {
    const double e = relative_error(bf16[i], f32[i]);
    EXPECT_LT(e, std::ldexp(1.0, -5)) << what << (i == 0 ? " output" : " gradient of input ") << i;
    if (i != not_a_product) {
      EXPECT_GT(e, 1e-6) << what << (i == 0 ? " output" : " gradient of input ") << i << ": not rounded to bf16";
    }
  }
}

Tensor randn(const Shape& s, uint64_t seed) {
  Generator gen(seed);
  return Tensor::randn(s, gen);
}

TEST(Bf16Ops, EveryProductOpAndItsGradientsStayWithinBf16RoundingOfF32) {
  expect_bf16_close(
      "linear", [](const std::vector<Tensor>& in) { return ops::linear(in[0], in[1], in[2]); },
      {randn({48, 40}, 1), randn({24, 40}, 2), randn({24}, 3)}, /*the bias gradient, a sum*/ 3);
  expect_bf16_close("matmul", [](const std::vector<Tensor>& in) { return ops::matmul(in[0], in[1]); },
                    {randn({3, 20, 36}, 4), randn({3, 36, 28}, 5)});
  // Head dimension 8 (qkv 96 = 3 x 32, 4 heads): bf16 products from a threshold of 8 down. On
  // dtrain's AVX512_BF16 kernel where the CPU has it, and on the library's products block by block.
  const int64_t saved_dim = ops::attention_bf16_min_head_dim();
  ops::set_attention_bf16_min_head_dim(8);
  for (const bool kernel : {true, false}) {
    if (kernel && !ops::attention_bf16_kernel()) continue;  // this CPU: the library's route only
    ops::set_attention_kernels(kernel);
    expect_bf16_close("causal_attention", [](const std::vector<Tensor>& in) { return ops::causal_attention(in[0], 4); },
                      {randn({2, 24, 96}, 6)});
    // The same in causal blocks of 10 rows (24 = 10 + 10 + 4; the library's route).
    const int64_t saved = ops::attention_block_rows();
    ops::set_attention_block_rows(10);
    expect_bf16_close("causal_attention in blocks",
                      [](const std::vector<Tensor>& in) { return ops::causal_attention(in[0], 4); },
                      {randn({2, 24, 96}, 6)});
    ops::set_attention_block_rows(saved);
  }
  ops::set_attention_kernels(true);
  ops::set_attention_bf16_min_head_dim(saved_dim);
}

// Below attention_bf16_min_head_dim() the attention's products stay f32 under bf16: output and
// gradient bit for bit those of --precision f32; from it up, rounded (checked above).
// Layer norm, GELU and the attention write a bf16 output (for the linear layer after them under
// bf16 products) with the bits Tensor::to gives their f32 output, and a linear layer fed that bf16
// output gives the same output and gradients, bit for bit, as one fed the f32 output: it rounds
// its input to the same values. Both attention routes (kernels and library) included.
TEST(Bf16Ops, OpsWriteBf16OutputsAsTheLinearLayerWouldRoundThem) {
  PrecisionGuard guard(Precision::bf16);
  const Tensor w = randn({12, 24}, 40), bias = randn({12}, 41);
  using Op = std::function<Tensor(const Tensor&, DType)>;
  const std::vector<std::pair<std::string, Op>> ops_under_test = {
      {"layer_norm",
       [](const Tensor& x, DType out) {
         return ops::layer_norm(x, Tensor::ones({24}), Tensor::full({24}, 0.25f), 1e-5f, out);
       }},
      {"gelu", [](const Tensor& x, DType out) { return ops::gelu(x, out); }},
      {"attention, kernels", [](const Tensor& x, DType out) { return ops::causal_attention(x, 2, out); }},
      {"attention, library", [](const Tensor& x, DType out) {
         ops::set_attention_kernels(false);
         Tensor y = ops::causal_attention(x, 2, out);
         ops::set_attention_kernels(true);
         return y;
       }}};
  for (const auto& [name, op] : ops_under_test) {
    const bool attention = name.rfind("attention", 0) == 0;
    // (2, 9, 24) rows for the first two; the attention reads (2, 9, 72) and writes (2, 9, 24).
    const Tensor x0 = randn({2, 9, attention ? 72 : 24}, 42);
    auto run_with = [&](DType out) {
      Tensor x = x0.detach().clone().set_requires_grad(true);
      Tensor y = op(x, out);
      EXPECT_EQ(y.dtype(), out) << name;
      Tensor z = ops::linear(y, w, bias);
      ops::sum(ops::mul(z, z)).backward();
      return std::make_tuple(y.to(DType::bf16), z.to_vector(), x.grad().to_vector());
    };
    const auto [y16, z16, g16] = run_with(DType::bf16);
    const auto [y32, z32, g32] = run_with(DType::f32);
    EXPECT_EQ(std::memcmp(y16.raw_data(), y32.raw_data(), static_cast<size_t>(y16.numel()) * 2), 0) << name;
    EXPECT_EQ(z16, z32) << name;
    EXPECT_EQ(g16, g32) << name;
  }
  EXPECT_TRUE(test::throws_with([] { ops::gelu(Tensor::zeros({3}), DType::f16); }, {"gelu", "f16", "f32 or bf16"}));
  set_matmul_precision(Precision::f32);
  EXPECT_TRUE(test::throws_with(
      [&] {
        ops::linear(Tensor::zeros({2, 24}).to(DType::bf16), w, bias);
      },
      {"linear", "[2, 24]", "bf16", "--precision bf16"}));
}

// linear with a bf16 output (the GPT's qkv under bf16 products, rounded by oneDNN's epilogue
// where it runs the product) has the bits of its f32 output rounded by Tensor::to (but for f32
// denormals, which oneDNN flushes to zero; there are none here); the attention
// fed it gives the output and gradients of the attention fed the f32 qkv (which it rounds the same
// way), bit for bit, on both routes. Under f32 products the attention refuses a bf16 qkv.
TEST(Bf16Ops, LinearWritesTheAttentionsBf16QkvAsItWouldRoundIt) {
  const int64_t saved_dim = ops::attention_bf16_min_head_dim();
  ops::set_attention_bf16_min_head_dim(1);  // bf16 products on the library's route too
  for (const Precision precision : {Precision::f32, Precision::bf16}) {
    PrecisionGuard guard(precision);
    for (const bool kernels : {true, false}) {
      ops::set_attention_kernels(kernels);
      const std::string where =
          std::string(precision == Precision::bf16 ? "bf16" : "f32") + (kernels ? ", kernels" : ", library");
      auto run_with = [&](DType qkv_dtype, bool attend) {
        Tensor x = randn({2, 9, 24}, 70).set_requires_grad(true);
        Tensor w = randn({72, 24}, 71).set_requires_grad(true);
        Tensor b = randn({72}, 72).set_requires_grad(true);
        Tensor qkv = ops::linear(x, w, b, qkv_dtype);
        EXPECT_EQ(qkv.dtype(), qkv_dtype) << where;
        EXPECT_EQ(qkv.shape(), (Shape{2, 9, 72})) << where;
        const Tensor rounded = qkv.to(DType::bf16);
        std::vector<uint16_t> bits(static_cast<size_t>(rounded.numel()));
        std::memcpy(bits.data(), rounded.raw_data(), bits.size() * 2);
        std::vector<std::vector<float>> r;
        if (attend) {
          Tensor z = ops::causal_attention(qkv, 2);
          ops::sum(ops::mul(z, z)).backward();
          r = {z.to_vector(), x.grad().to_vector(), w.grad().to_vector(), b.grad().to_vector()};
        }
        return std::make_pair(bits, r);
      };
      const auto [bits16, r16] = run_with(DType::bf16, precision == Precision::bf16);
      const auto [bits32, r32] = run_with(DType::f32, precision == Precision::bf16);
      EXPECT_EQ(bits16, bits32) << where;
      ASSERT_EQ(r16.size(), r32.size());
      for (size_t i = 0; i < r16.size(); ++i) EXPECT_EQ(r16[i], r32[i]) << where << " result " << i;
    }
  }
  ops::set_attention_kernels(true);
  set_matmul_precision(Precision::f32);
  EXPECT_TRUE(test::throws_with(
      [] {
        ops::causal_attention(Tensor::zeros({1, 4, 24}).to(DType::bf16), 2);
      },
      {"causal_attention", "[1, 4, 24]", "bf16", "--precision bf16"}));
  EXPECT_TRUE(test::throws_with(
      [] {
        ops::linear(Tensor::zeros({2, 3}), Tensor::zeros({4, 3}), Tensor(), DType::f16);
      },
      {"linear", "f16", "f32 or bf16"}));
  ops::set_attention_bf16_min_head_dim(saved_dim);
}

// linear_gelu is gelu(linear(...)) in one node: the same output and gradients, bit for bit, at
// both precisions, with a bias and without, with a bf16 output under bf16 products.
TEST(Bf16Ops, LinearGeluIsGeluOfLinearBitForBit) {
  for (const Precision precision : {Precision::f32, Precision::bf16}) {
    PrecisionGuard guard(precision);
    const DType out = precision == Precision::bf16 ? DType::bf16 : DType::f32;
    for (const bool with_bias : {true, false}) {
      auto run_with = [&](bool fused) {
        Tensor x = randn({3, 7, 24}, 50).set_requires_grad(true);
        Tensor w = randn({40, 24}, 51).set_requires_grad(true);
        Tensor b = with_bias ? randn({40}, 52).set_requires_grad(true) : Tensor();
        Tensor y = fused ? ops::linear_gelu(x, w, b, out) : ops::gelu(ops::linear(x, w, b), out);
        EXPECT_EQ(y.dtype(), out);
        Tensor z = ops::linear(y, randn({5, 40}, 53), Tensor());
        ops::sum(ops::mul(z, z)).backward();
        std::vector<std::vector<float>> r{z.to_vector(), x.grad().to_vector(), w.grad().to_vector()};
        if (with_bias) r.push_back(b.grad().to_vector());
        return r;
      };
      const auto fused = run_with(true), apart = run_with(false);
      ASSERT_EQ(fused.size(), apart.size());
      for (size_t i = 0; i < fused.size(); ++i) {
        EXPECT_EQ(fused[i], apart[i]) << (precision == Precision::bf16 ? "bf16" : "f32") << " bias " << with_bias
                                      << " result " << i;
      }
    }
  }
}

// The residual connection as one op (the byte GPT's projections): the output and every gradient,
// the residual's included, are add(residual, linear(x))'s bits, at both precisions, with and
// without a bias; a residual of another shape is refused.
TEST(Bf16Ops, LinearResidualIsAddOfLinearBitForBit) {
  for (const Precision precision : {Precision::f32, Precision::bf16}) {
    PrecisionGuard guard(precision);
    for (const bool with_bias : {true, false}) {
      auto run_with = [&](bool fused) {
        Tensor x = randn({3, 7, 24}, 60).set_requires_grad(true);
        Tensor w = randn({40, 24}, 61).set_requires_grad(true);
        Tensor b = with_bias ? randn({40}, 62).set_requires_grad(true) : Tensor();
        Tensor r = randn({3, 7, 40}, 63).set_requires_grad(true);
        Tensor y = fused ? ops::linear_residual(x, w, b, r) : ops::add(r, ops::linear(x, w, b));
        // r feeds the next op too, as the residual stream does: its gradient has two parts.
        Tensor z = ops::add(ops::linear(y, randn({5, 40}, 64), Tensor()), ops::linear(r, randn({5, 40}, 65), Tensor()));
        ops::sum(ops::mul(z, z)).backward();
        std::vector<std::vector<float>> out{y.to_vector(), x.grad().to_vector(), w.grad().to_vector(),
                                            r.grad().to_vector()};
        if (with_bias) out.push_back(b.grad().to_vector());
        return out;
      };
      const auto fused = run_with(true), apart = run_with(false);
      ASSERT_EQ(fused.size(), apart.size());
      for (size_t i = 0; i < fused.size(); ++i) {
        EXPECT_EQ(fused[i], apart[i]) << (precision == Precision::bf16 ? "bf16" : "f32") << " bias " << with_bias
                                      << " result " << i;
      }
    }
  }
  try {
    ops::linear_residual(randn({4, 24}, 1), randn({40, 24}, 2), randn({40}, 3), randn({4, 24}, 4));
    ADD_FAILURE() << "a (4, 24) residual for a (4, 40) output was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("residual [4, 24] does not match the output [4, 40]"), std::string::npos)
        << e.what();
  }
}

TEST(Bf16Ops, AttentionBelowTheBf16HeadDimensionIsF32BitForBit) {
  const int64_t saved_dim = ops::attention_bf16_min_head_dim();
  ops::set_attention_bf16_min_head_dim(9);  // head dimension 32 / 4 = 8: just below
  const Forward f = [](const std::vector<Tensor>& in) { return ops::causal_attention(in[0], 4); };
  const std::vector<Tensor> in{randn({2, 24, 96}, 6)};
  const auto f32 = run(f, in, Precision::f32), bf16 = run(f, in, Precision::bf16);
  ops::set_attention_bf16_min_head_dim(saved_dim);
  ASSERT_EQ(f32.size(), bf16.size());
  for (size_t i = 0; i < f32.size(); ++i) EXPECT_EQ(bf16[i], f32[i]) << (i == 0 ? "output" : "gradient");
  EXPECT_THROW(ops::set_attention_bf16_min_head_dim(-1), Error);
}

// dtrain's own AVX512_BF16 attention kernel (ops::attention_bf16_kernel) against the library's
// products on the same bf16 operands: the same rounding of qkv, dO, P and dS, so the two differ
// only in the order of their f32 sums (on the AMD EPYC of stop 39 not at all: oneDNN's bf16
// kernel sums the same pairs in the same order, and the two agree bit for bit). On shapes
// that cut its 8-row tiles, its 16-column vectors and its pairs of k: odd T and head dimensions,
// one row, T below and above a tile, head dimensions 5 to 128. Each within bf16's bound of f32 too.
TEST(Bf16Ops, AttentionKernelMatchesLibraryProductsOnEveryShape) {
  if (!ops::attention_bf16_kernel())
    GTEST_SKIP() << "this CPU has no AVX512_BF16 (or the kernels are capped below AVX-512)";
  struct Case {
    int64_t b, t, c, h;
  };
  const Case cases[] = {{2, 24, 32, 4}, {1, 23, 15, 3},  {2, 37, 66, 2}, {1, 5, 8, 1},
                        {1, 1, 4, 1},   {1, 40, 128, 1}, {2, 17, 64, 1}};
  const int64_t saved_dim = ops::attention_bf16_min_head_dim();
  ops::set_attention_bf16_min_head_dim(1);
  for (const Case& k : cases) {
    const int64_t heads = k.h;
    const Forward f = [heads](const std::vector<Tensor>& in) { return ops::causal_attention(in[0], heads); };
    const std::vector<Tensor> in{randn({k.b, k.t, 3 * k.c}, 10 + static_cast<uint64_t>(k.t))};
    const auto dot = run(f, in, Precision::bf16);
    ops::set_attention_kernels(false);
    const auto library = run(f, in, Precision::bf16);
    ops::set_attention_kernels(true);
    const auto f32 = run(f, in, Precision::f32);
    for (size_t i = 0; i < dot.size(); ++i) {
      const char* what = i == 0 ? "output" : "gradient";
      EXPECT_LT(relative_error(dot[i], library[i]), 1e-5)
          << what << " B " << k.b << " T " << k.t << " C " << k.c << " H " << k.h;
      EXPECT_LT(relative_error(dot[i], f32[i]), std::ldexp(1.0, -5)) << what << " T " << k.t << " C " << k.c;
      EXPECT_GT(relative_error(dot[i], f32[i]), 1e-6)
          << what << " T " << k.t << " C " << k.c << ": not rounded to bf16";
    }
  }
  ops::set_attention_bf16_min_head_dim(saved_dim);
}

// A whole GPT: its loss and the gradient of every parameter.
TEST(Bf16Ops, AGptLossAndParameterGradientsStayWithinBf16RoundingOfF32) {
  nn::GptConfig cfg;
  cfg.layers = 2;
  cfg.heads = 2;
  cfg.width = 32;
  cfg.seq_len = 16;
  cfg.vocab = 64;
  std::vector<float> ids(4 * 16), next(4 * 16);
  Generator gen(7);
  for (size_t i = 0; i < ids.size(); ++i) {
    ids[i] = static_cast<float>(gen.below(64));
    next[i] = static_cast<float>(gen.below(64));
  }
  auto step = [&](Precision p) {
    PrecisionGuard guard(p);
    nn::Gpt model(cfg, 3);
    Tensor loss = model.loss(model.forward(Tensor::from_vector({4, 16}, ids)), Tensor::from_vector({4, 16}, next));
    loss.backward();
    std::vector<std::vector<float>> out{{loss.item()}};
    for (const Tensor& p : model.parameters()) out.push_back(p.grad().to_vector());
    return out;
  };
  const auto f32 = step(Precision::f32), bf16 = step(Precision::bf16);
  ASSERT_EQ(f32.size(), bf16.size());
  EXPECT_NEAR(bf16[0][0], f32[0][0], 1e-2 * std::fabs(f32[0][0]));
  for (size_t i = 1; i < f32.size(); ++i) EXPECT_LT(relative_error(bf16[i], f32[i]), std::ldexp(1.0, -4)) << i;
}

}  // namespace
}  // namespace dtrain

namespace {

class PrecisionCli : public CliTest {
 protected:
  std::string gpt() const {
    std::string text;
    for (int i = 0; i < 400; ++i) text += "the quick brown fox jumps over the lazy dog " + std::to_string(i % 7) + "\n";
    write("corpus.txt", text);
    return "train --model gpt --data text:" + path("corpus.txt") +
           " --layers 2 --heads 4 --width 32 --seq-len 16 --batch-size 8 --optimizer sgd --lr 0.05"
           " --progress=false --eval-batches 2";
  }
};

// bf16 on every layout ends where one bf16 process ends, up to the rounding of sums in another
// order (which can move an operand across a bf16 rounding boundary, 2^-8 relative for that
// element: hence a tolerance above f32's 1e-5); and differs from f32 by more than that.
TEST_F(PrecisionCli, Bf16TrainsOnEveryLayoutLikeOneBf16ProcessAndResumesBitwise) {
  const std::string base = gpt() + " --steps 6";
  ProcessResult one = dtrain(base + " --precision bf16 --save " + path("one.dtm") + " --metrics " + path("one.jsonl"));
  ASSERT_EQ(one.code, 0) << one.output;
  const nlohmann::json f = final_record("one.jsonl");
  EXPECT_EQ(f["precision"], "bf16");
  EXPECT_FALSE(f["bf16_route"].get<std::string>().empty());
  EXPECT_NE(one.output.find("bf16 products"), std::string::npos) << "the route was not logged:\n" << one.output;
  // Head dimension 32 / 4 = 8: the attention's products bf16 on dtrain's kernel where this CPU
  // has AVX512_BF16; elsewhere below ops::attention_bf16_min_head_dim() (128), so f32. Either way said.
  if (dtrain::ops::attention_bf16_kernel()) {
    EXPECT_EQ(f["bf16_attention"], true);
    EXPECT_EQ(f["bf16_attention_route"], "dtrain's AVX512_BF16 kernel");
    EXPECT_NE(one.output.find("the attention's products are bf16 on dtrain's AVX512_BF16 kernel"), std::string::npos)
        << one.output;
  } else {
    EXPECT_EQ(f["bf16_attention"], false);
    EXPECT_EQ(f["bf16_attention_route"], "f32");
    EXPECT_NE(one.output.find("the attention's products stay f32 (head dimension 8 < 128"), std::string::npos)
        << one.output;
  }
  EXPECT_TRUE(std::isfinite(f["val_loss"].get<double>()));
  ProcessResult f32 = dtrain(base + " --save " + path("f32.dtm"));
  ASSERT_EQ(f32.code, 0) << f32.output;
  EXPECT_NE(dtrain("diff --tol 1e-4 --quiet " + path("one.dtm") + " " + path("f32.dtm")).code, 0)
      << "bf16 and f32 ended at the same parameters";
  EXPECT_EQ(dtrain("diff --tol 5e-2 --quiet " + path("one.dtm") + " " + path("f32.dtm")).code, 0);

  for (const std::string layout : {"--dp 2", "--pp 2 --micro-batches 2", "--tp 2", "--dp 2 --zero 1"}) {
    ProcessResult r = dtrain(base + " --precision bf16 " + layout + " --save " + path("l.dtm"), 300);
    ASSERT_EQ(r.code, 0) << layout << ": " << r.output;
    ProcessResult d = dtrain("diff --tol 1e-3 --quiet " + path("one.dtm") + " " + path("l.dtm"));
    EXPECT_EQ(d.code, 0) << layout << ": " << d.output;
  }
  // Compressed gradients with bf16 products train (their own math: compared to nothing).
  ProcessResult c = dtrain(base + " --precision bf16 --dp 2 --compress int8 --metrics " + path("c.jsonl"), 300);
  ASSERT_EQ(c.code, 0) << c.output;
  EXPECT_TRUE(std::isfinite(final_record("c.jsonl")["train_loss"].get<double>()));

  // A checkpoint at step 3, resumed to step 6: the parameters of the run that never stopped.
  const std::string ckpt = " --checkpoint-dir " + path("ck") + " --checkpoint-every 3";
  ProcessResult first = dtrain(gpt() + " --steps 3 --precision bf16" + ckpt);
  ASSERT_EQ(first.code, 0) << first.output;
  ProcessResult resumed = dtrain(base + " --precision bf16" + ckpt + " --save " + path("resumed.dtm"));
  ASSERT_EQ(resumed.code, 0) << resumed.output;
  ProcessResult same = dtrain("diff --tol 0 --quiet " + path("one.dtm") + " " + path("resumed.dtm"));
  EXPECT_EQ(same.code, 0) << same.output;
}

TEST_F(PrecisionCli, AnUnknownPrecisionIsRefusedNamingIt) {
  ProcessResult r = dtrain("train --model mlp --steps 1 --precision fp8");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.output.find("--precision 'fp8': expected f32 or bf16"), std::string::npos) << r.output;
}

}  // namespace
