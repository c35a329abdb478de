#include "dtrain/nn/layers.h"

#include <cmath>

#include "dtrain/core/error.h"
#include "dtrain/tensor/gemm.h"
#include "dtrain/tensor/ops.h"

namespace dtrain::nn {

Linear::Linear(int64_t in, int64_t out, bool with_bias, Generator& gen) {
  DT_CHECK(in > 0 && out > 0, "nn", "Linear({}, {}): sizes must be positive", in, out);
  const float bound = 1.0f / std::sqrt(static_cast<float>(in));
  weight = register_parameter("weight", Tensor::uniform({out, in}, gen, -bound, bound));
  if (with_bias) bias = register_parameter("bias", Tensor::uniform({out}, gen, -bound, bound));
}

Tensor Linear::forward(const Tensor& x) { return ops::linear(x, weight, bias); }

LayerNorm::LayerNorm(int64_t width, float epsilon) : eps(epsilon) {
  weight = register_parameter("weight", Tensor::ones({width}));
  bias = register_parameter("bias", Tensor::zeros({width}));
}

Tensor LayerNorm::forward(const Tensor& x) { return ops::layer_norm(x, weight, bias, eps); }

Tensor ReLU::forward(const Tensor& x) { return ops::relu(x); }

Tensor GELU::forward(const Tensor& x) { return ops::gelu(x); }

Tensor Dropout::forward(const Tensor& x) { return ops::dropout(x, p_, is_training(), gen_); }

bool Dropout::identity() const { return p_ == 0.0f || !is_training(); }

void Dropout::reseed(uint64_t salt) {
  // splitmix64 of the pair: nearby salts give unrelated streams.
  uint64_t z = seed_ ^ (salt + 0x9e3779b97f4a7c15ULL + (seed_ << 6) + (seed_ >> 2));
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  gen_.seed(z ^ (z >> 31));
}

void reseed_dropout(Module& module, uint64_t salt) {
  module.apply([salt](Module& m) {
    if (auto* d = dynamic_cast<Dropout*>(&m)) d->reseed(salt);
  });
}

LinearAct::LinearAct(int64_t in, int64_t out, bool relu, Generator& gen)
    : fc_(register_module("fc", std::make_shared<Linear>(in, out, true, gen))), relu_(relu) {}

Tensor LinearAct::forward(const Tensor& x) {
  Tensor y = fc_->forward(x);
  return relu_ ? ops::relu(y) : y;
}

namespace {
constexpr float kInitStd = 0.02f;

// GPT-2 initialisation: weights N(0, 0.02), biases zero.
void gpt_init(Linear& l, Generator& gen, float std) {
  l.weight.copy_from(Tensor::randn(l.weight.shape(), gen, std));
  if (l.bias.defined()) l.bias.fill_(0.0f);
}
}  // namespace

GptEmbedding::GptEmbedding(const GptConfig& cfg, Generator& gen) {
  wte = register_parameter("wte", Tensor::randn({cfg.vocab, cfg.width}, gen, kInitStd));
  wpe = register_parameter("wpe", Tensor::randn({cfg.seq_len, cfg.width}, gen, kInitStd));
  drop_ = register_module("drop", std::make_shared<Dropout>(cfg.dropout, gen.next_u64()));
}

Tensor GptEmbedding::forward(const Tensor& ids) {
  DT_CHECK(ids.dim() == 2, "nn", "GPT input must be token ids (B, T), got {}", shape_str(ids.shape()));
  const int64_t t = ids.size(1);
  DT_CHECK(t <= wpe.size(0), "nn", "sequence length {} exceeds the model's {}", t, wpe.size(0));
  Tensor tok = ops::embedding(wte, ids);  // (B, T, C)
  Tensor pos = wpe.slice(0, 0, t);        // (T, C)
  return drop_->forward(ops::add(tok, pos));
}

TransformerBlock::TransformerBlock(const GptConfig& cfg, int64_t /*layer*/, Generator& gen) : heads_(cfg.heads) {
  DT_CHECK(cfg.heads > 0 && cfg.width % cfg.heads == 0, "nn", "GPT width {} is not divisible by {} heads", cfg.width,
           cfg.heads);
  const int64_t c = cfg.width;
  ln1_ = register_module("ln1", std::make_shared<LayerNorm>(c));
  qkv_ = register_module("qkv", std::make_shared<Linear>(c, 3 * c, true, gen));
  proj_ = register_module("proj", std::make_shared<Linear>(c, c, true, gen));
  ln2_ = register_module("ln2", std::make_shared<LayerNorm>(c));
  fc_ = register_module("fc", std::make_shared<Linear>(c, 4 * c, true, gen));
  fc_proj_ = register_module("fc_proj", std::make_shared<Linear>(4 * c, c, true, gen));
  drop_ = register_module("drop", std::make_shared<Dropout>(cfg.dropout, gen.next_u64()));
  // Residual projections are scaled down by sqrt(2 L) (GPT-2).
  const float res_std = kInitStd / std::sqrt(2.0f * static_cast<float>(cfg.layers));
  gpt_init(*qkv_, gen, kInitStd);
  gpt_init(*proj_, gen, res_std);
  gpt_init(*fc_, gen, kInitStd);
  gpt_init(*fc_proj_, gen, res_std);
}

namespace {

// Under bf16 products the inputs of the linear layers (the layer norms', the attention's and
// GELU's outputs) are written as bf16 by the ops that make them: the bits the layers would round
// them to, without an f32 copy in between.
DType linear_input_dtype() { return matmul_precision() == Precision::bf16 ? DType::bf16 : DType::f32; }

}  // namespace

Tensor TransformerBlock::forward(const Tensor& x) {
  const DType in = linear_input_dtype();
  const Tensor n1 = ops::layer_norm(x, ln1_->weight, ln1_->bias, ln1_->eps, in);
  // The attention reads qkv only as bf16 where its products are bf16: the product writes it so.
  const int64_t head_dim = qkv_->weight.size(0) / 3 / heads_;
  const DType qkv_dtype = ops::attention_products_bf16(head_dim) ? DType::bf16 : DType::f32;
  const Tensor qkv = ops::linear(n1, qkv_->weight, qkv_->bias, qkv_dtype);
  const Tensor att = ops::causal_attention(qkv, heads_, in);
  // Without dropout (p 0, or evaluation) the residual is added by the projection's product itself.
  const bool fused = drop_->identity();
  const Tensor h = fused ? ops::linear_residual(att, proj_->weight, proj_->bias, x)
                         : ops::add(x, drop_->forward(proj_->forward(att)));
  const Tensor n2 = ops::layer_norm(h, ln2_->weight, ln2_->bias, ln2_->eps, in);
  const Tensor g = ops::linear_gelu(n2, fc_->weight, fc_->bias, in);
  return fused ? ops::linear_residual(g, fc_proj_->weight, fc_proj_->bias, h)
               : ops::add(h, drop_->forward(fc_proj_->forward(g)));
}

GptHead::GptHead(const GptConfig& cfg, Generator& gen) {
  ln_f_ = register_module("ln_f", std::make_shared<LayerNorm>(cfg.width));
  lm_head_ = register_module("lm_head", std::make_shared<Linear>(cfg.width, cfg.vocab, false, gen));
  gpt_init(*lm_head_, gen, kInitStd);
}

Tensor GptHead::forward(const Tensor& x) {
  return lm_head_->forward(ops::layer_norm(x, ln_f_->weight, ln_f_->bias, ln_f_->eps, linear_input_dtype()));
}

}  // namespace dtrain::nn
