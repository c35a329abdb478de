// Reverse-mode autograd over a dynamic graph.
//
// Vocabulary: every differentiable op creates a Node that knows how to turn the gradient of
// its output into gradients of its inputs; `next` holds, per input, the Node that produced
// that input (or an AccumulateGrad for a leaf that requires grad, or null). backward() walks
// the graph in dependency order; a leaf's gradient is final once its AccumulateGrad ran,
// which is when grad-ready hooks fire.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "dtrain/tensor/profile.h"
#include "dtrain/tensor/tensor.h"

namespace dtrain {

class Node {
 public:
  Node();
  virtual ~Node() = default;
  Node(const Node&) = delete;
  Node& operator=(const Node&) = delete;

  /// Given d(loss)/d(output), returns d(loss)/d(input_i) for each input (undefined tensors for
  /// inputs that need no gradient).
  virtual std::vector<Tensor> apply(const Tensor& grad_output) = 0;
  virtual const char* name() const = 0;
  /// What --profile charges this node's backward to (profile.h).
  virtual profile::Kind profile_kind() const { return profile::Kind::elementwise; }
  /// Frees saved tensors once the node ran (the graph is used once).
  virtual void release() {}

  std::vector<std::shared_ptr<Node>> next;
  uint64_t sequence_nr;  // creation order; later nodes run first when both are ready
};

/// True while gradients are recorded on this thread.
bool grad_mode_enabled();

/// Disables graph recording in a scope (evaluation, optimizer updates).
class NoGradGuard {
 public:
  NoGradGuard();
  ~NoGradGuard();
  NoGradGuard(const NoGradGuard&) = delete;
  NoGradGuard& operator=(const NoGradGuard&) = delete;

 private:
  bool previous_;
};

namespace autograd {
/// True when any input requires grad and grad mode is on.
bool needs_grad(std::initializer_list<const Tensor*> inputs);
/// Wires `node` to the inputs and marks `output` as its result.
void attach(Tensor& output, const std::shared_ptr<Node>& node, std::initializer_list<const Tensor*> inputs);
void run_backward(const Tensor& root);
/// An output buffer for the gradient an op sends along `edge` (one of its `next`): the leaf's
/// gradient home (Tensor::set_grad_home) when `edge` accumulates into a leaf that has one of
/// this shape and no gradient yet, so the result needs no copy; else a fresh uninitialised
/// tensor.
Tensor gradient_buffer(const std::shared_ptr<Node>& edge, const Shape& shape);
/// Backward from `root` seeded with `grad` (same shape as root).
void run_backward(const Tensor& root, const Tensor& grad);
}  // namespace autograd

}  // namespace dtrain
