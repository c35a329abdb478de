#include "dtrain/optim/optim.h"

#include <cmath>

#include "dtrain/core/error.h"
#include "dtrain/tensor/autograd.h"
#include "dtrain/tensor/kernels.h"

namespace dtrain::optim {

void Optimizer::zero_grad() {
  for (auto& p : params_) p.zero_grad();
}

Sgd::Sgd(std::vector<Tensor> params, float lr, float momentum, float weight_decay, bool nesterov)
    : Optimizer(std::move(params)), momentum_(momentum), weight_decay_(weight_decay), nesterov_(nesterov) {
  DT_CHECK(lr >= 0.0f && momentum >= 0.0f && weight_decay >= 0.0f, "optim",
           "SGD: lr {}, momentum {} and weight decay {} must be non-negative", lr, momentum, weight_decay);
  lr_ = lr;
  momentum_buf_.resize(params_.size());
}

void Sgd::step() {
  NoGradGuard no_grad;
  ++step_count_;
  for (size_t i = 0; i < params_.size(); ++i) {
    Tensor g = params_[i].grad();
    if (!g.defined()) continue;
    float* p = params_[i].data();
    const float* pg = g.data();
    const int64_t n = params_[i].numel();
    if (momentum_ == 0.0f) {
      for (int64_t j = 0; j < n; ++j) p[j] -= lr_ * (pg[j] + weight_decay_ * p[j]);
      continue;
    }
    const bool first = !momentum_buf_[i].defined();
    if (first) momentum_buf_[i] = Tensor::empty(params_[i].shape());
    float* buf = momentum_buf_[i].data();
    for (int64_t j = 0; j < n; ++j) {
      const float d = pg[j] + weight_decay_ * p[j];
      buf[j] = first ? d : momentum_ * buf[j] + d;
      p[j] -= lr_ * (nesterov_ ? d + momentum_ * buf[j] : buf[j]);
    }
  }
}

std::vector<nn::NamedTensor> Sgd::state() const {
  std::vector<nn::NamedTensor> out;
  for (size_t i = 0; i < momentum_buf_.size(); ++i) {
    if (momentum_buf_[i].defined()) out.emplace_back("momentum." + std::to_string(i), momentum_buf_[i]);
  }
  return out;
}

namespace {

// "exp_avg.3" -> 3 when the name starts with `prefix` and the index is a parameter's.
int state_index(const std::string& name, const std::string& prefix, size_t params) {
  if (name.rfind(prefix, 0) != 0 || name.size() == prefix.size()) return -1;
  size_t used = 0;
  unsigned long i = 0;
  try {
    i = std::stoul(name.substr(prefix.size()), &used);
  } catch (const std::exception&) {
    return -1;
  }
  return used == name.size() - prefix.size() && i < params ? static_cast<int>(i) : -1;
}

Tensor restored(const std::string& name, const Tensor& saved, const Tensor& param) {
  DT_CHECK(saved.shape() == param.shape(), "optim", "optimizer state '{}' has shape {} but its parameter {}", name,
           shape_str(saved.shape()), shape_str(param.shape()));
  return saved.clone();
}

}  // namespace

void Sgd::load_state(const std::vector<nn::NamedTensor>& state, const std::vector<int64_t>& counters) {
  DT_CHECK(counters.size() == 1 && counters[0] >= 0, "optim", "SGD state: {} counters, expected 1", counters.size());
  std::vector<Tensor> bufs(params_.size());
  for (const auto& [name, t] : state) {
    const int i = state_index(name, "momentum.", params_.size());
    DT_CHECK(i >= 0, "optim", "SGD state has an unknown tensor '{}' ({} parameters)", name, params_.size());
    bufs[static_cast<size_t>(i)] = restored(name, t, params_[static_cast<size_t>(i)]);
  }
  momentum_buf_ = std::move(bufs);
  step_count_ = counters[0];
}

AdamW::AdamW(std::vector<Tensor> params, float lr, float beta1, float beta2, float eps, float weight_decay)
    : Optimizer(std::move(params)), beta1_(beta1), beta2_(beta2), eps_(eps), weight_decay_(weight_decay) {
  DT_CHECK(lr >= 0.0f && beta1 >= 0.0f && beta1 < 1.0f && beta2 >= 0.0f && beta2 < 1.0f && eps > 0.0f, "optim",
           "AdamW: invalid lr {}, betas ({}, {}) or eps {}", lr, beta1, beta2, eps);
  lr_ = lr;
  exp_avg_.resize(params_.size());
  exp_avg_sq_.resize(params_.size());
  steps_.assign(params_.size(), 0);
}

void AdamW::step() {
  NoGradGuard no_grad;
  ++step_count_;
  for (size_t i = 0; i < params_.size(); ++i) {
    Tensor g = params_[i].grad();
    if (!g.defined()) continue;
    if (!exp_avg_[i].defined()) {
      exp_avg_[i] = Tensor::zeros(params_[i].shape());
      exp_avg_sq_[i] = Tensor::zeros(params_[i].shape());
    }
    const int64_t t = ++steps_[i];
    const float bc1 = 1.0f - std::pow(beta1_, static_cast<float>(t));
    const float bc2 = 1.0f - std::pow(beta2_, static_cast<float>(t));
    const float step_size = lr_ / bc1;
    const float inv_bc2_sqrt = 1.0f / std::sqrt(bc2);
    const float decay = 1.0f - lr_ * weight_decay_;
    kernels::table().adamw(params_[i].data(), g.data(), exp_avg_[i].data(), exp_avg_sq_[i].data(), params_[i].numel(),
                           decay, beta1_, beta2_, step_size, inv_bc2_sqrt, eps_);
  }
}

std::vector<nn::NamedTensor> AdamW::state() const {
  std::vector<nn::NamedTensor> out;
  for (size_t i = 0; i < exp_avg_.size(); ++i) {
    if (!exp_avg_[i].defined()) continue;
    out.emplace_back("exp_avg." + std::to_string(i), exp_avg_[i]);
    out.emplace_back("exp_avg_sq." + std::to_string(i), exp_avg_sq_[i]);
  }
  return out;
}

std::vector<int64_t> AdamW::counters() const {
  std::vector<int64_t> c{step_count_};
  c.insert(c.end(), steps_.begin(), steps_.end());
  return c;
}

void AdamW::load_state(const std::vector<nn::NamedTensor>& state, const std::vector<int64_t>& counters) {
  DT_CHECK(counters.size() == params_.size() + 1, "optim", "AdamW state: {} counters, expected {} (1 + parameters)",
           counters.size(), params_.size() + 1);
  std::vector<Tensor> m(params_.size()), v(params_.size());
  for (const auto& [name, t] : state) {
    int i = state_index(name, "exp_avg.", params_.size());
    if (i >= 0) {
      m[static_cast<size_t>(i)] = restored(name, t, params_[static_cast<size_t>(i)]);
      continue;
    }
    i = state_index(name, "exp_avg_sq.", params_.size());
    DT_CHECK(i >= 0, "optim", "AdamW state has an unknown tensor '{}' ({} parameters)", name, params_.size());
    v[static_cast<size_t>(i)] = restored(name, t, params_[static_cast<size_t>(i)]);
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    DT_CHECK(m[i].defined() == v[i].defined() && (m[i].defined() || counters[i + 1] == 0), "optim",
             "AdamW state of parameter {} is incomplete", i);
  }
  exp_avg_ = std::move(m);
  exp_avg_sq_ = std::move(v);
  step_count_ = counters[0];
  steps_.assign(counters.begin() + 1, counters.end());
}

float LrSchedule::at(int64_t step) const {
  if (warmup > 0 && step < warmup) return base_lr * static_cast<float>(step + 1) / static_cast<float>(warmup);
  if (!cosine) return base_lr;
  const int64_t span = std::max<int64_t>(total - warmup, 1);
  const double progress = std::min(1.0, static_cast<double>(step - warmup) / static_cast<double>(span));
  return min_lr + static_cast<float>(0.5 * (1.0 + std::cos(M_PI * progress))) * (base_lr - min_lr);
}

double grad_square_sum(const std::vector<Tensor>& params) {
  double sq = 0.0;
  for (const auto& p : params) {
    Tensor g = p.grad();
    if (!g.defined()) continue;
    const float* pg = g.data();
    for (int64_t j = 0, n = g.numel(); j < n; ++j) sq += static_cast<double>(pg[j]) * pg[j];
  }
  return sq;
}

void scale_grads(const std::vector<Tensor>& params, float factor) {
  for (const auto& p : params) {
    Tensor g = p.grad();
    if (!g.defined()) continue;
    float* pg = g.data();
    for (int64_t j = 0, n = g.numel(); j < n; ++j) pg[j] *= factor;
  }
}

float clip_grad_norm(const std::vector<Tensor>& params, float max_norm) {
  const auto norm = static_cast<float>(std::sqrt(grad_square_sum(params)));
  if (max_norm > 0.0f && norm > max_norm) scale_grads(params, max_norm / (norm + 1e-6f));
  return norm;
}

}  // namespace dtrain::optim
