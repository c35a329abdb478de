// Optimizers over a list of parameters, a learning-rate schedule and gradient clipping.
// Updates run under NoGradGuard; a parameter without a gradient is skipped (no update, state
// untouched), as PyTorch does.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/nn/module.h"
#include "dtrain/tensor/tensor.h"

namespace dtrain::optim {

/// Where an optimizer's state tensors live: the heap by default; memory-mapped files with
/// --offload (offload.h), whose pages the step hands back as it goes.
class StateStorage {
 public:
  virtual ~StateStorage() = default;
  /// A zeroed, contiguous tensor for the state `name` ("exp_avg.3").
  virtual Tensor allocate(const std::string& name, const Shape& shape, DType dtype) = 0;
  /// The step is done with [data, data + bytes) for now: its memory may be given back (the
  /// values stay). A no-op on the heap.
  virtual void release(void* data, size_t bytes) = 0;
};

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
  /// Before any step or load_state: where the state tensors live from now on (null: the heap).
  void set_state_storage(std::shared_ptr<StateStorage> storage) { storage_ = std::move(storage); }
  /// The parameters are a host's one copy that other processes read next (DataParallel's
  /// shares_parameters()): AdamW writes them with non-temporal stores, which leave the other
  /// cores' caches alone (the same values; measured on a 2-core EPYC, the MLP's AdamW step on
  /// its half of the copy took 1.19 ms with ordinary stores and 0.73 ms with these).
  void set_shared_parameters(bool shared) { shared_params_ = shared; }

 protected:
  /// A zeroed state tensor from the storage (the heap without one).
  Tensor new_state(const std::string& name, const Shape& shape, DType dtype = DType::f32) const;
  /// `t` copied into a new state tensor named `name`.
  Tensor stored_copy(const std::string& name, const Tensor& t) const;
  /// Hands elements [offset, offset + count) of state tensor `t` back to the storage.
  void release(const Tensor& t, int64_t offset, int64_t count) const;

  std::vector<Tensor> params_;
  std::shared_ptr<StateStorage> storage_;
  float lr_ = 1e-3f;
  int64_t step_count_ = 0;
  bool shared_params_ = false;
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

/// How AdamW keeps its two moments: f32 (8 bytes per parameter), or int8: block-wise 8-bit codes
/// with an f32 scale per block of 256 (quantize.h), about 2.03 bytes per parameter.
enum class StateFormat : uint8_t { f32, int8 };
/// "f32" | "int8"; throws dtrain::Error naming anything else.
StateFormat parse_state_format(const std::string& name);
const char* state_format_name(StateFormat format);

/// Bytes of the optimizer's state tensors (what state() returns).
int64_t state_bytes(const Optimizer& optimizer);

/// AdamW (decoupled weight decay), PyTorch semantics with bias correction.
///
/// StateFormat::int8: each step dequantizes a block of 256 moments into f32, runs the same
/// update kernel as f32 on it, and quantizes the block again; an element whose second moment
/// codes to 0 gets a first moment of 0 (|m| <= 7.3 sqrt(v) for the default betas, so its m is
/// below its block's resolution too), which keeps m / sqrt(v) from blowing up. state() then
/// holds the codes (u8, shaped like the parameter: "exp_avg_q8.I", "exp_avg_sq_q8.I") and
/// the scales (f32 [blocks]: "exp_avg_scale.I", "exp_avg_sq_scale.I"); load_state() takes
/// either format's state and converts (exact when the format is the same).
class AdamW : public Optimizer {
 public:
  AdamW(std::vector<Tensor> params, float lr, float beta1 = 0.9f, float beta2 = 0.999f, float eps = 1e-8f,
        float weight_decay = 0.01f, StateFormat format = StateFormat::f32);
  void step() override;
  std::vector<nn::NamedTensor> state() const override;
  std::string name() const override { return "adamw"; }
  StateFormat format() const { return format_; }
  std::vector<int64_t> counters() const override;
  void load_state(const std::vector<nn::NamedTensor>& state, const std::vector<int64_t>& counters) override;

 private:
  // One step of parameter i on 8-bit state, block by block.
  void step_int8(size_t i, const float* g, float decay, float step_size, float inv_bc2_sqrt);

  float beta1_, beta2_, eps_, weight_decay_;
  StateFormat format_;
  std::vector<Tensor> exp_avg_, exp_avg_sq_;  // f32: the moments; int8: their codes (u8)
  std::vector<Tensor> avg_scale_, sq_scale_;  // int8: one scale per block
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
