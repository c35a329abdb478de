#include "dtrain/tensor/autograd.h"

#include <atomic>
#include <queue>
#include <unordered_map>

#include "dtrain/core/error.h"
#include "dtrain/tensor/kernels.h"
#include "dtrain/tensor/ops.h"

namespace dtrain {

namespace {

std::atomic<uint64_t> g_next_sequence_nr{0};
thread_local bool t_grad_mode = true;

// Adds the incoming gradient into a leaf's .grad and fires its grad-ready hooks. It runs
// once all of the leaf's uses delivered their gradient, so the hooks see the final value.
struct AccumulateGrad : Node {
  std::shared_ptr<TensorImpl> leaf;
  // gradient_buffer handed out the leaf's home in this graph: a second use of the leaf (tied
  // weights) must not get the same buffer before the engine summed the first one.
  bool home_taken = false;

  std::vector<Tensor> apply(const Tensor& g) override {
    Tensor param(leaf);
    accumulate(param, g);
    home_taken = false;  // a node that outlives its graph may hand the home out again
    return {};
  }
  const char* name() const override { return "accumulate_grad"; }
  profile::Kind profile_kind() const override { return profile::Kind::grad_accumulate; }

  static void accumulate(Tensor& param, const Tensor& g) {
    DT_CHECK(g.shape() == param.shape(), "autograd", "gradient {} for parameter {}", shape_str(g.shape()),
             shape_str(param.shape()));
    Tensor existing = param.grad();
    const std::shared_ptr<TensorImpl>& home = param.impl()->grad_home;
    if (!existing.defined() && home && g.impl()->storage == home->storage && g.impl()->offset == home->offset &&
        g.is_contiguous()) {
      param.set_grad(g);  // written straight into the home (gradient_buffer)
    } else if (!existing.defined()) {
      // The gradient must own a contiguous buffer. A fresh result nobody else references
      // (the usual case: a gemm output) is adopted as is; anything that may alias another
      // tensor is copied.
      const bool exclusive = g.impl_ptr().use_count() == 1 && g.impl()->storage.use_count() == 1 &&
                             g.impl()->offset == 0 && g.is_contiguous() && !g.requires_grad();
      if (exclusive) {
        param.set_grad(g);
      } else {
        Tensor own = Tensor::empty(g.shape());
        own.copy_from(g);
        param.set_grad(own);
      }
    } else {
      Tensor gc = g.contiguous();
      kernels::table().add_into(existing.data(), gc.data(), existing.numel());
    }
    profile::Scope scope(profile::Kind::bucket_copy);
    for (auto& hook : param.impl()->grad_ready_hooks) hook(param);
  }
};

// The sum of two gradients for the same node input. In place when `slot` is the only handle on
// its storage (a fresh result an op returned): the same values as ops::add, without a new
// buffer.
void add_gradient(Tensor& slot, const Tensor& g) {
  profile::Scope scope(profile::Kind::grad_accumulate);
  const TensorImpl& s = *slot.impl();
  const bool exclusive = slot.impl_ptr().use_count() == 1 && s.storage.use_count() == 1 && slot.is_contiguous() &&
                         g.is_contiguous() && slot.shape() == g.shape() && slot.dtype() == DType::f32 &&
                         g.dtype() == DType::f32 && !slot.requires_grad() && !slot.same(g);
  if (!exclusive) {
    slot = ops::add(slot, g);
    return;
  }
  kernels::table().add_into(slot.data(), g.data(), slot.numel());
}

constexpr uint64_t kAccumulatePriority = UINT64_MAX;

uint64_t priority(const Node* n) {
  return dynamic_cast<const AccumulateGrad*>(n) != nullptr ? kAccumulatePriority : n->sequence_nr;
}

std::shared_ptr<Node> edge_for(const Tensor& t) {
  if (!t.defined() || !t.requires_grad()) return nullptr;
  if (t.grad_fn()) return t.grad_fn();
  TensorImpl* impl = t.impl();
  auto acc = impl->grad_accumulator.lock();
  if (!acc) {
    auto node = std::make_shared<AccumulateGrad>();
    node->leaf = t.impl_ptr();
    acc = node;
    impl->grad_accumulator = acc;
  }
  return acc;
}

}  // namespace

Node::Node() : sequence_nr(g_next_sequence_nr.fetch_add(1, std::memory_order_relaxed)) {}

bool grad_mode_enabled() { return t_grad_mode; }

NoGradGuard::NoGradGuard() : previous_(t_grad_mode) { t_grad_mode = false; }
NoGradGuard::~NoGradGuard() { t_grad_mode = previous_; }

namespace autograd {

bool needs_grad(std::initializer_list<const Tensor*> inputs) {
  if (!t_grad_mode) return false;
  for (const Tensor* t : inputs) {
    if (t != nullptr && t->defined() && t->requires_grad()) return true;
  }
  return false;
}

void attach(Tensor& output, const std::shared_ptr<Node>& node, std::initializer_list<const Tensor*> inputs) {
  node->next.clear();
  node->next.reserve(inputs.size());
  for (const Tensor* t : inputs) node->next.push_back(t != nullptr ? edge_for(*t) : nullptr);
  output.impl()->requires_grad = true;
  output.impl()->grad_fn = node;
}

Tensor gradient_buffer(const std::shared_ptr<Node>& edge, const Shape& shape) {
  if (auto* acc = dynamic_cast<AccumulateGrad*>(edge.get())) {
    const TensorImpl& leaf = *acc->leaf;
    if (!acc->home_taken && !leaf.grad && leaf.grad_home && leaf.grad_home->shape == shape) {
      acc->home_taken = true;
      return Tensor(leaf.grad_home);
    }
  }
  return Tensor::empty(shape);
}

void run_backward(const Tensor& root) {
  DT_CHECK(root.defined(), "autograd", "backward() on an undefined tensor");
  DT_CHECK(root.numel() == 1, "autograd", "backward() needs a scalar, got shape {}", shape_str(root.shape()));
  run_backward(root, Tensor::ones(root.shape()));
}

void run_backward(const Tensor& root, const Tensor& seed) {
  DT_CHECK(root.defined() && seed.defined(), "autograd", "backward() on an undefined tensor");
  DT_CHECK(seed.shape() == root.shape(), "autograd", "backward() gradient of shape {} for a tensor of shape {}",
           shape_str(seed.shape()), shape_str(root.shape()));
  DT_CHECK(root.requires_grad(), "autograd", "backward() on a tensor that does not require grad");
  NoGradGuard no_grad;
  profile::BackwardPhase backward_phase;
  if (root.is_leaf()) {
    Tensor leaf = root;
    AccumulateGrad::accumulate(leaf, seed);
    return;
  }
  std::shared_ptr<Node> start = root.grad_fn();

  // Count, per node, how many edges point at it.
  std::unordered_map<Node*, int> dependencies;
  std::vector<Node*> stack{start.get()};
  std::unordered_map<Node*, bool> seen{{start.get(), true}};
  while (!stack.empty()) {
    Node* n = stack.back();
    stack.pop_back();
    for (auto& nx : n->next) {
      if (!nx) continue;
      dependencies[nx.get()] += 1;
      if (!seen[nx.get()]) {
        seen[nx.get()] = true;
        stack.push_back(nx.get());
      }
    }
  }

  struct Ready {
    uint64_t priority;
    std::shared_ptr<Node> node;
    bool operator<(const Ready& o) const { return priority < o.priority; }
  };
  std::priority_queue<Ready> ready;
  std::unordered_map<Node*, Tensor> pending;
  pending[start.get()] = seed;
  ready.push({priority(start.get()), start});

  while (!ready.empty()) {
    std::shared_ptr<Node> node = ready.top().node;
    ready.pop();
    Tensor grad;
    if (auto it = pending.find(node.get()); it != pending.end()) {
      grad = std::move(it->second);
      pending.erase(it);
    }
    std::vector<Tensor> input_grads;
    if (grad.defined()) {
      profile::Scope scope(node->profile_kind());
      input_grads = node->apply(grad);
    }
    grad = Tensor();
    for (size_t i = 0; i < node->next.size(); ++i) {
      const std::shared_ptr<Node>& nx = node->next[i];
      if (!nx) continue;
      if (i < input_grads.size() && input_grads[i].defined()) {
        Tensor& slot = pending[nx.get()];
        if (slot.defined()) {
          add_gradient(slot, input_grads[i]);
        } else {
          slot = std::move(input_grads[i]);
        }
      }
      if (--dependencies[nx.get()] == 0) ready.push({priority(nx.get()), nx});
    }
    node->release();
    node->next.clear();  // the graph is used once: drop references as we go
  }
}

}  // namespace autograd
}  // namespace dtrain
