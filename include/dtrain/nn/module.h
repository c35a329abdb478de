// Modules own named parameters and child modules.
//
// Canonical parameter order: a module's own parameters in registration order, then each
// child's, depth first, in registration order; names are dotted paths ("h.0.attn.weight").
// Data parallelism (buckets), ZeRO (shards), pipeline stages and checkpoints all rely on this
// order being stable for a given model configuration.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dtrain/tensor/tensor.h"

namespace dtrain::nn {

using NamedTensor = std::pair<std::string, Tensor>;

class Module {
 public:
  virtual ~Module() = default;
  Module() = default;
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  virtual Tensor forward(const Tensor& x) = 0;
  Tensor operator()(const Tensor& x) { return forward(x); }

  /// All parameters in canonical order.
  std::vector<NamedTensor> named_parameters() const;
  std::vector<Tensor> parameters() const;
  int64_t num_parameters() const;
  void zero_grad();
  /// Training mode (dropout active) or evaluation mode, recursively.
  void train(bool on = true);
  bool is_training() const { return training_; }
  /// Calls fn on this module and every descendant, parents first.
  void apply(const std::function<void(Module&)>& fn);

 protected:
  Tensor register_parameter(const std::string& name, Tensor value);
  template <typename M>
  std::shared_ptr<M> register_module(const std::string& name, std::shared_ptr<M> module) {
    children_.emplace_back(name, module);
    return module;
  }
  const std::vector<std::pair<std::string, std::shared_ptr<Module>>>& children() const { return children_; }
  /// Puts `module` in place of child i, keeping its name (and so the parameter names).
  void replace_module(size_t i, std::shared_ptr<Module> module);

 private:
  void collect(const std::string& prefix, std::vector<NamedTensor>& out) const;
  std::vector<NamedTensor> params_;
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> children_;
  bool training_ = true;
};

/// Called around each block's forward by Sequential (like PyTorch's module forward hooks):
/// ZeRO-3 gathers a block's parameters there and frees them after use. Blocks [begin, end) run
/// in this call; `i` is the block about to run or just run.
class BlockHooks {
 public:
  virtual ~BlockHooks() = default;
  virtual void before_block(size_t i, size_t begin, size_t end) = 0;
  /// Returns what the next block gets: `output`, or a tensor over it with an autograd node of
  /// its own (whose backward runs just before block i's).
  virtual Tensor after_block(size_t i, size_t begin, size_t end, const Tensor& output) = 0;
};

/// Runs its children in order. Models are Sequentials of blocks so that a pipeline can cut
/// them into stages between any two blocks.
class Sequential : public Module {
 public:
  void add(const std::string& name, std::shared_ptr<Module> block);
  Tensor forward(const Tensor& x) override;
  size_t num_blocks() const { return blocks_.size(); }
  const std::shared_ptr<Module>& block(size_t i) const { return blocks_.at(i); }
  const std::string& block_name(size_t i) const { return children().at(i).first; }
  /// Replaces block i, keeping its name, so named_parameters() keeps the same names (tensor
  /// parallelism swaps blocks for sharded ones this way).
  void replace_block(size_t i, std::shared_ptr<Module> block);
  /// Forward through blocks [begin, end) only.
  Tensor forward_range(const Tensor& x, size_t begin, size_t end);
  /// Hooks around every block's forward from now on (null: none).
  void set_block_hooks(std::shared_ptr<BlockHooks> hooks) { hooks_ = std::move(hooks); }

 private:
  std::vector<std::shared_ptr<Module>> blocks_;
  std::shared_ptr<BlockHooks> hooks_;
};

}  // namespace dtrain::nn
