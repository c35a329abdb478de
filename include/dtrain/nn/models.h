// Models: a Sequential of blocks plus a loss. MLP for classification, GPT for text.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "dtrain/nn/layers.h"

namespace dtrain::nn {

class Model : public Sequential {
 public:
  /// Loss of the final block's output against targets (mean over the batch).
  virtual Tensor loss(const Tensor& output, const Tensor& targets) const = 0;
  /// "mlp" or "gpt".
  virtual std::string kind() const = 0;
  /// Forward FLOPs per sample (classification) or per token (text), for throughput and MFU.
  virtual double flops_per_sample() const = 0;
};

/// Multi-layer perceptron in -> widths... -> classes with ReLU between layers.
/// Blocks: "fc0" .. "fcN" (LinearAct); parameters "fcI.fc.weight", "fcI.fc.bias".
class Mlp : public Model {
 public:
  Mlp(int64_t in, const std::vector<int64_t>& hidden, int64_t classes, uint64_t seed);
  Tensor loss(const Tensor& output, const Tensor& targets) const override;
  std::string kind() const override { return "mlp"; }
  double flops_per_sample() const override;

 private:
  std::vector<int64_t> widths_;
};

/// Byte-level decoder-only transformer (GPT-2 style, untied output head).
/// Blocks: "embed" (GptEmbedding), "h0" .. "h{L-1}" (TransformerBlock), "head" (GptHead).
class Gpt : public Model {
 public:
  Gpt(const GptConfig& cfg, uint64_t seed);
  Tensor loss(const Tensor& output, const Tensor& targets) const override;
  std::string kind() const override { return "gpt"; }
  /// Per token, forward: 2N (N = non-embedding parameters, head included) + 4 L T C
  /// (attention's QK^T and PV, the causal half counted in full as the kernels compute it).
  double flops_per_sample() const override;
  const GptConfig& config() const { return cfg_; }

 private:
  GptConfig cfg_;
};

}  // namespace dtrain::nn
