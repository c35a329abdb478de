#include "dtrain/nn/models.h"

#include "dtrain/core/error.h"
#include "dtrain/tensor/ops.h"

namespace dtrain::nn {

Mlp::Mlp(int64_t in, const std::vector<int64_t>& hidden, int64_t classes, uint64_t seed) {
  Generator gen(seed);
  widths_.push_back(in);
  for (int64_t h : hidden) {
    DT_CHECK(h > 0, "nn", "MLP hidden width {} must be positive", h);
    widths_.push_back(h);
  }
  widths_.push_back(classes);
  for (size_t i = 0; i + 1 < widths_.size(); ++i) {
    const bool last = i + 2 == widths_.size();
    add("fc" + std::to_string(i), std::make_shared<LinearAct>(widths_[i], widths_[i + 1], !last, gen));
  }
}

Tensor Mlp::loss(const Tensor& output, const Tensor& targets) const { return ops::cross_entropy(output, targets); }

double Mlp::flops_per_sample() const {
  double f = 0.0;
  for (size_t i = 0; i + 1 < widths_.size(); ++i) f += 2.0 * static_cast<double>(widths_[i] * widths_[i + 1]);
  return f;
}

Gpt::Gpt(const GptConfig& cfg, uint64_t seed) : cfg_(cfg) {
  DT_CHECK(cfg.layers > 0 && cfg.width > 0 && cfg.seq_len > 0 && cfg.vocab > 0, "nn",
           "GPT needs positive layers, width, seq_len and vocab (got {}, {}, {}, {})", cfg.layers, cfg.width,
           cfg.seq_len, cfg.vocab);
  Generator gen(seed);
  add("embed", std::make_shared<GptEmbedding>(cfg, gen));
  for (int64_t l = 0; l < cfg.layers; ++l) add("h" + std::to_string(l), std::make_shared<TransformerBlock>(cfg, l, gen));
  add("head", std::make_shared<GptHead>(cfg, gen));
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
