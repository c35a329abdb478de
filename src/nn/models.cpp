#include "dtrain/nn/models.h"

#include <algorithm>

#include "dtrain/core/error.h"
#include "dtrain/tensor/ops.h"

namespace dtrain::nn {

void Model::add_in_range(size_t index, const std::string& name, std::shared_ptr<Module> block) {
  if (range_.contains(index)) add(name, std::move(block));
}

Mlp::Mlp(int64_t in, const std::vector<int64_t>& hidden, int64_t classes, uint64_t seed, BlockRange range) {
  range_ = range;
  Generator gen(seed);
  widths_.push_back(in);
  for (int64_t h : hidden) {
    DT_CHECK(h > 0, "nn", "MLP hidden width {} must be positive", h);
    widths_.push_back(h);
  }
  widths_.push_back(classes);
  for (size_t i = 0; i + 1 < widths_.size(); ++i) {
    const bool last = i + 2 == widths_.size();
    add_in_range(i, "fc" + std::to_string(i), std::make_shared<LinearAct>(widths_[i], widths_[i + 1], !last, gen));
  }
  range_.end = std::min(range_.end, widths_.size() - 1);
  DT_CHECK(range_.begin < range_.end, "nn", "blocks [{}, {}) of an MLP with {} blocks", range.begin, range.end,
           widths_.size() - 1);
}

std::vector<double> Mlp::block_flops() const {
  std::vector<double> f;
  for (size_t i = 0; i + 1 < widths_.size(); ++i) f.push_back(2.0 * static_cast<double>(widths_[i] * widths_[i + 1]));
  return f;
}

std::vector<int64_t> Mlp::block_params() const {
  std::vector<int64_t> p;
  for (size_t i = 0; i + 1 < widths_.size(); ++i) p.push_back(widths_[i] * widths_[i + 1] + widths_[i + 1]);
  return p;
}

Tensor Mlp::loss(const Tensor& output, const Tensor& targets) const { return ops::cross_entropy(output, targets); }

double Mlp::flops_per_sample() const {
  double f = 0.0;
  for (size_t i = 0; i + 1 < widths_.size(); ++i) f += 2.0 * static_cast<double>(widths_[i] * widths_[i + 1]);
  return f;
}

Gpt::Gpt(const GptConfig& cfg, uint64_t seed, BlockRange range) : cfg_(cfg) {
  range_ = range;
  DT_CHECK(cfg.layers > 0 && cfg.width > 0 && cfg.seq_len > 0 && cfg.vocab > 0, "nn",
           "GPT needs positive layers, width, seq_len and vocab (got {}, {}, {}, {})", cfg.layers, cfg.width,
           cfg.seq_len, cfg.vocab);
  Generator gen(seed);
  const size_t blocks = static_cast<size_t>(cfg.layers) + 2;
  range_.end = std::min(range_.end, blocks);
  DT_CHECK(range_.begin < range_.end, "nn", "blocks [{}, {}) of a GPT with {} blocks", range.begin, range.end, blocks);
  add_in_range(0, "embed", std::make_shared<GptEmbedding>(cfg, gen));
  for (int64_t l = 0; l < cfg.layers; ++l) {
    add_in_range(static_cast<size_t>(l) + 1, "h" + std::to_string(l), std::make_shared<TransformerBlock>(cfg, l, gen));
  }
  add_in_range(blocks - 1, "head", std::make_shared<GptHead>(cfg, gen));
}

std::vector<double> Gpt::block_flops() const {
  const double c = static_cast<double>(cfg_.width), t = static_cast<double>(cfg_.seq_len);
  const double v = static_cast<double>(cfg_.vocab);
  // Per token: the embedding adds two rows; a block's matmuls are 2 x 12 C^2 plus attention's
  // 4 T C; the head is LayerNorm and 2 C V.
  std::vector<double> f{c};
  for (int64_t l = 0; l < cfg_.layers; ++l) f.push_back(24.0 * c * c + 4.0 * t * c);
  f.push_back(2.0 * c * v + 8.0 * c);
  return f;
}

std::vector<int64_t> Gpt::block_params() const {
  const int64_t c = cfg_.width;
  std::vector<int64_t> p{cfg_.vocab * c + cfg_.seq_len * c};
  for (int64_t l = 0; l < cfg_.layers; ++l) p.push_back(12 * c * c + 13 * c);
  p.push_back(c * cfg_.vocab + 2 * c);
  return p;
}

Tensor Gpt::loss(const Tensor& output, const Tensor& targets) const {
  const int64_t v = output.size(-1);
  return ops::cross_entropy(output.reshape({-1, v}), targets.reshape({-1}));
}

double Gpt::flops_per_sample() const {
  const double c = static_cast<double>(cfg_.width);
  const double l = static_cast<double>(cfg_.layers);
  const double non_embedding = l * 12.0 * c * c + c * static_cast<double>(cfg_.vocab);
  return 2.0 * non_embedding + 4.0 * l * static_cast<double>(cfg_.seq_len) * c;
}

}  // namespace dtrain::nn
