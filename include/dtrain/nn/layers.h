// Layers: Linear, LayerNorm, Embedding, activations, Dropout, and the GPT blocks.
#pragma once

#include <memory>

#include "dtrain/nn/module.h"
#include "dtrain/tensor/random.h"

namespace dtrain::nn {

/// y = x W^T + b, W (out, in). Initialised as PyTorch: U(-1/sqrt(in), 1/sqrt(in)).
class Linear : public Module {
 public:
  Linear(int64_t in, int64_t out, bool bias, Generator& gen);
  Tensor forward(const Tensor& x) override;
  Tensor weight, bias;
};

class LayerNorm : public Module {
 public:
  explicit LayerNorm(int64_t width, float eps = 1e-5f);
  Tensor forward(const Tensor& x) override;
  Tensor weight, bias;
  float eps;
};

class ReLU : public Module {
 public:
  Tensor forward(const Tensor& x) override;
};

class GELU : public Module {
 public:
  Tensor forward(const Tensor& x) override;
};

class Dropout : public Module {
 public:
  Dropout(float p, uint64_t seed) : p_(p), seed_(seed), gen_(seed) {}
  Tensor forward(const Tensor& x) override;
  /// Whether forward returns its input as it is (p 0, or not training): no mask, no random draws.
  bool identity() const;
  Generator& generator() { return gen_; }
  /// Restarts the masks from a state that depends only on this module's seed and `salt`.
  void reseed(uint64_t salt);

 private:
  float p_;
  uint64_t seed_;
  Generator gen_;
};

/// Reseeds every Dropout in `module` from `salt` (the trainer passes the step and the
/// data-parallel rank), so that the masks of a step do not depend on what ran before it: a run
/// resumed from a checkpoint draws exactly the masks of the run that never stopped.
void reseed_dropout(Module& module, uint64_t salt);

/// Linear followed by an activation: one block of the MLP.
class LinearAct : public Module {
 public:
  LinearAct(int64_t in, int64_t out, bool relu, Generator& gen);
  Tensor forward(const Tensor& x) override;

 private:
  std::shared_ptr<Linear> fc_;
  bool relu_;
};

struct GptConfig {
  int64_t vocab = 256;
  int64_t seq_len = 128;
  int64_t layers = 4;
  int64_t heads = 4;
  int64_t width = 128;
  float dropout = 0.0f;
};

/// Token ids (B, T) stored as f32 -> token + position embeddings (B, T, C).
class GptEmbedding : public Module {
 public:
  GptEmbedding(const GptConfig& cfg, Generator& gen);
  Tensor forward(const Tensor& ids) override;
  Tensor wte, wpe;

 private:
  std::shared_ptr<Dropout> drop_;
};

/// Pre-LayerNorm transformer block: x + attn(ln1(x)), then x + mlp(ln2(x)).
class TransformerBlock : public Module {
 public:
  TransformerBlock(const GptConfig& cfg, int64_t layer, Generator& gen);
  Tensor forward(const Tensor& x) override;

  // Sub-modules, for tensor parallelism (which rebuilds the block from them).
  int64_t heads() const { return heads_; }
  const std::shared_ptr<LayerNorm>& ln1() const { return ln1_; }
  const std::shared_ptr<Linear>& qkv() const { return qkv_; }
  const std::shared_ptr<Linear>& proj() const { return proj_; }
  const std::shared_ptr<LayerNorm>& ln2() const { return ln2_; }
  const std::shared_ptr<Linear>& fc() const { return fc_; }
  const std::shared_ptr<Linear>& fc_proj() const { return fc_proj_; }
  const std::shared_ptr<Dropout>& drop() const { return drop_; }

 private:
  int64_t heads_;
  std::shared_ptr<LayerNorm> ln1_, ln2_;
  std::shared_ptr<Linear> qkv_, proj_, fc_, fc_proj_;
  std::shared_ptr<Dropout> drop_;
};

/// Final LayerNorm and the output projection to vocabulary logits (B, T, V).
class GptHead : public Module {
 public:
  GptHead(const GptConfig& cfg, Generator& gen);
  Tensor forward(const Tensor& x) override;

 private:
  std::shared_ptr<LayerNorm> ln_f_;
  std::shared_ptr<Linear> lm_head_;
};

}  // namespace dtrain::nn
