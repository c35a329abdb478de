// Models: a Sequential of blocks plus a loss. MLP for classification, GPT for text.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "dtrain/nn/layers.h"

namespace dtrain::nn {

/// Blocks [begin, end) of a model's block sequence: a pipeline stage. The default is all.
struct BlockRange {
  size_t begin = 0;
  size_t end = static_cast<size_t>(-1);
  bool contains(size_t i) const { return i >= begin && i < end; }
};

class Model : public Sequential {
 public:
  /// Loss of the final block's output against targets (mean over the batch).
  virtual Tensor loss(const Tensor& output, const Tensor& targets) const = 0;
  /// "mlp" or "gpt".
  virtual std::string kind() const = 0;
  /// Forward FLOPs per sample (classification) or per token (text), for throughput and MFU.
  virtual double flops_per_sample() const = 0;
  /// Forward FLOPs per sample and parameter count of every block of the whole model (also when
  /// this object holds only a stage of it): what pipeline stages are balanced by.
  virtual std::vector<double> block_flops() const = 0;
  virtual std::vector<int64_t> block_params() const = 0;
  /// Blocks of the whole model this object holds.
  const BlockRange& range() const { return range_; }

 protected:
  /// Builds every block in order from one generator (so a stage's values are those of the whole
  /// model) and keeps those in range; the others are dropped as soon as they are built.
  void add_in_range(size_t index, const std::string& name, std::shared_ptr<Module> block);
  BlockRange range_;
};

/// Multi-layer perceptron in -> widths... -> classes with ReLU between layers.
/// Blocks: "fc0" .. "fcN" (LinearAct); parameters "fcI.fc.weight", "fcI.fc.bias".
class Mlp : public Model {
 public:
  Mlp(int64_t in, const std::vector<int64_t>& hidden, int64_t classes, uint64_t seed, BlockRange range = {});
  Tensor loss(const Tensor& output, const Tensor& targets) const override;
  std::string kind() const override { return "mlp"; }
  double flops_per_sample() const override;
  std::vector<double> block_flops() const override;
  std::vector<int64_t> block_params() const override;

 private:
  std::vector<int64_t> widths_;
};

/// Byte-level decoder-only transformer (GPT-2 style, untied output head).
/// Blocks: "embed" (GptEmbedding), "h0" .. "h{L-1}" (TransformerBlock), "head" (GptHead).
class Gpt : public Model {
 public:
  Gpt(const GptConfig& cfg, uint64_t seed, BlockRange range = {});
  Tensor loss(const Tensor& output, const Tensor& targets) const override;
  std::string kind() const override { return "gpt"; }
  std::vector<double> block_flops() const override;
  std::vector<int64_t> block_params() const override;
  /// Per token, forward: 2N (N = non-embedding parameters, head included) + 4 L T C
  /// (attention's QK^T and PV, the causal half counted in full as the kernels compute it).
  double flops_per_sample() const override;
  const GptConfig& config() const { return cfg_; }

 private:
  GptConfig cfg_;
};

}  // namespace dtrain::nn
