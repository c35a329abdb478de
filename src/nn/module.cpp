#include "dtrain/nn/module.h"

#include "dtrain/core/error.h"

namespace dtrain::nn {

Tensor Module::register_parameter(const std::string& name, Tensor value) {
  for (const auto& [n, t] : params_) {
    DT_CHECK(n != name, "nn", "parameter '{}' registered twice", name);
  }
  value.set_requires_grad(true);
  params_.emplace_back(name, value);
  return value;
}

void Module::collect(const std::string& prefix, std::vector<NamedTensor>& out) const {
  for (const auto& [name, t] : params_) out.emplace_back(prefix + name, t);
  for (const auto& [name, child] : children_) child->collect(prefix + name + ".", out);
}

std::vector<NamedTensor> Module::named_parameters() const {
  std::vector<NamedTensor> out;
  collect("", out);
  return out;
}

std::vector<Tensor> Module::parameters() const {
  std::vector<Tensor> out;
  for (auto& [name, t] : named_parameters()) out.push_back(t);
  return out;
}

int64_t Module::num_parameters() const {
  int64_t n = 0;
  for (const auto& [name, t] : named_parameters()) n += t.numel();
  return n;
}

void Module::zero_grad() {
  for (auto& [name, t] : named_parameters()) t.zero_grad();
}

void Module::replace_module(size_t i, std::shared_ptr<Module> module) {
  DT_CHECK(i < children_.size(), "nn", "replace_module: child {} of {}", i, children_.size());
  DT_CHECK(module != nullptr, "nn", "replace_module: child {} ('{}') replaced by null", i, children_[i].first);
  children_[i].second = std::move(module);
}

void Module::train(bool on) {
  training_ = on;
  for (auto& [name, child] : children_) child->train(on);
}

void Module::apply(const std::function<void(Module&)>& fn) {
  fn(*this);
  for (auto& [name, child] : children_) child->apply(fn);
}

void Sequential::add(const std::string& name, std::shared_ptr<Module> block) {
  blocks_.push_back(register_module(name, std::move(block)));
}

void Sequential::replace_block(size_t i, std::shared_ptr<Module> block) {
  DT_CHECK(i < blocks_.size(), "nn", "replace_block: block {} of {}", i, blocks_.size());
  replace_module(i, block);  // Sequential's children are exactly its blocks, in order
  blocks_[i] = std::move(block);
}

Tensor Sequential::forward(const Tensor& x) { return forward_range(x, 0, blocks_.size()); }

Tensor Sequential::forward_range(const Tensor& x, size_t begin, size_t end) {
  DT_CHECK(begin <= end && end <= blocks_.size(), "nn", "forward_range [{}, {}) of {} blocks", begin, end,
           blocks_.size());
  Tensor h = x;
  for (size_t i = begin; i < end; ++i) {
    if (hooks_) hooks_->before_block(i, begin, end);
    h = blocks_[i]->forward(h);
    if (hooks_) h = hooks_->after_block(i, begin, end, h);
  }
  return h;
}

}  // namespace dtrain::nn
