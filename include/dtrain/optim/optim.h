// Optimizers over a list of parameters, a learning-rate schedule and gradient clipping.
// Updates run under NoGradGuard; a parameter without a gradient is skipped (no update, state
// untouched), as PyTorch does.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dtrain/nn/module.h"
#include "dtrain/tensor/tensor.h"

namespace dtrain::optim {

class Optimizer {
 public:
  explicit Optimizer(std::vector<Tensor> params) : params_(std::move(params)) {}
  virtual ~Optimizer() = default;
  virtual void step() = 0;
  void zero_grad();
  void set_lr(float lr) { lr_ = lr; }
  float lr() const { return lr_; }
  const std::vector<Tensor>& params() const { return params_; }
  /// Named state tensors in a stable order ("exp_avg.3"), for checkpoints and sharding.
  virtual std::vector<nn::NamedTensor> state() const = 0;
  int64_t step_count() const { return step_count_; }
  virtual std::string name() const = 0;
  /// The counters that are not tensors (steps taken), for checkpoints.
  virtual std::vector<int64_t> counters() const { return {step_count_}; }
  /// Restores what state() and counters() returned for the same parameters; names, shapes and
  /// counts are checked (dtrain::Error naming the first mismatch).
  virtual void load_state(const std::vector<nn::NamedTensor>& state, const std::vector<int64_t>& counters) = 0;

 protected:
  std::vector<Tensor> params_;
  float lr_ = 1e-3f;
  int64_t step_count_ = 0;
};

/// SGD with momentum (PyTorch semantics: buf = m * buf + g; p -= lr * buf), optional
/// Nesterov, L2 weight decay added to the gradient.
class Sgd : public Optimizer {
 public:
  Sgd(std::vector<Tensor> params, float lr, float momentum = 0.0f, float weight_decay = 0.0f, bool nesterov = false);
  void step() override;
  std::vector<nn::NamedTensor> state() const override;
  std::string name() const override { return "sgd"; }
  void load_state(const std::vector<nn::NamedTensor>& state, const std::vector<int64_t>& counters) override;

 private:
  float momentum_, weight_decay_;
  bool nesterov_;
  std::vector<Tensor> momentum_buf_;
};

/// AdamW (decoupled weight decay), PyTorch semantics with bias correction.
class AdamW : public Optimizer {
 public:
  AdamW(std::vector<Tensor> params, float lr, float beta1 = 0.9f, float beta2 = 0.999f, float eps = 1e-8f,
        float weight_decay = 0.01f);
  void step() override;
  std::vector<nn::NamedTensor> state() const override;
  std::string name() const override { return "adamw"; }
  std::vector<int64_t> counters() const override;
  void load_state(const std::vector<nn::NamedTensor>& state, const std::vector<int64_t>& counters) override;

 private:
  float beta1_, beta2_, eps_, weight_decay_;
  std::vector<Tensor> exp_avg_, exp_avg_sq_;
  std::vector<int64_t> steps_;
};

/// Linear warmup (step s gets base_lr * (s + 1) / warmup) over `warmup` steps, then cosine decay to min_lr at
/// `total` steps (constant min_lr after). warmup = 0 and min_lr = base_lr gives a constant.
struct LrSchedule {
  float base_lr = 1e-3f;
  float min_lr = 0.0f;
  int64_t warmup = 0;
  int64_t total = 1;
  bool cosine = true;
  float at(int64_t step) const;
};

/// Scales all gradients so that their global L2 norm is at most max_norm; returns the norm
/// before clipping. max_norm <= 0 only measures.
float clip_grad_norm(const std::vector<Tensor>& params, float max_norm);
/// The sum of the squares of the params' gradients (params without one are skipped): the
/// building block of a norm summed over ranks (pipeline stages, tensor shards).
double grad_square_sum(const std::vector<Tensor>& params);
/// Multiplies the params' gradients by `factor`, in place.
void scale_grads(const std::vector<Tensor>& params, float factor);

}  // namespace dtrain::optim
