#include "dtrain/tensor/tensor.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <numeric>

#include "dtrain/core/error.h"
#include "dtrain/tensor/autograd.h"
#include "dtrain/tensor/half.h"
#include "dtrain/tensor/kernels.h"
#include "dtrain/tensor/ops.h"
#include "dtrain/tensor/random.h"
#include "strided.h"

namespace dtrain {

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return 4;
    case DType::bf16:
    case DType::f16:
      return 2;
    case DType::u8:
      return 1;
  }
  return 4;
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return "f32";
    case DType::bf16:
      return "bf16";
    case DType::f16:
      return "f16";
    case DType::u8:
      return "u8";
  }
  return "?";
}

std::string shape_str(const Shape& shape) { return fmt::format("[{}]", fmt::join(shape, ", ")); }

int64_t shape_numel(const Shape& shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

Shape contiguous_strides(const Shape& shape) {
  Shape strides(shape.size());
  int64_t s = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    strides[i] = s;
    s *= shape[i];
  }
  return strides;
}

namespace {
std::atomic<int64_t> g_live_bytes{0};
std::atomic<int64_t> g_peak_bytes{0};
}  // namespace

namespace memory {
int64_t live_bytes() { return g_live_bytes.load(std::memory_order_relaxed); }
int64_t peak_bytes() { return g_peak_bytes.load(std::memory_order_relaxed); }
void reset_peak() { g_peak_bytes.store(live_bytes(), std::memory_order_relaxed); }
}  // namespace memory

Storage::Storage(size_t n) : nbytes(n) {
  const size_t rounded = ((n + 63) / 64) * 64;
  data = rounded == 0 ? nullptr : std::aligned_alloc(64, rounded);
  DT_CHECK(rounded == 0 || data != nullptr, "tensor", "out of memory allocating {} bytes", n);
  const int64_t live =
      g_live_bytes.fetch_add(static_cast<int64_t>(n), std::memory_order_relaxed) + static_cast<int64_t>(n);
  int64_t peak = g_peak_bytes.load(std::memory_order_relaxed);
  while (live > peak && !g_peak_bytes.compare_exchange_weak(peak, live, std::memory_order_relaxed)) {
  }
}

Storage::Storage(void* borrowed, size_t n, std::shared_ptr<const void> keep)
    : data(borrowed), nbytes(n), owner(std::move(keep)) {
  DT_CHECK(owner != nullptr, "tensor", "borrowed storage of {} bytes without an owner", n);
}

Storage::~Storage() {
  if (owner) return;
  std::free(data);
  g_live_bytes.fetch_sub(static_cast<int64_t>(nbytes), std::memory_order_relaxed);
}

namespace {

std::shared_ptr<TensorImpl> make_impl(const Shape& shape, DType dtype) {
  for (int64_t s : shape) {
    DT_CHECK(s >= 0, "tensor", "negative dimension in shape {}", shape_str(shape));
  }
  auto impl = std::make_shared<TensorImpl>();
  impl->shape = shape;
  impl->strides = contiguous_strides(shape);
  impl->dtype = dtype;
  impl->storage = std::make_shared<Storage>(static_cast<size_t>(shape_numel(shape)) * dtype_size(dtype));
  return impl;
}

TensorImpl& checked(const std::shared_ptr<TensorImpl>& impl) {
  DT_CHECK(impl != nullptr, "tensor", "use of an undefined tensor");
  return *impl;
}

int64_t wrap_dim(int64_t d, int64_t ndim, const char* op) {
  const int64_t w = d < 0 ? d + ndim : d;
  DT_CHECK(w >= 0 && w < ndim, "tensor", "{}: dimension {} out of range for {} dims", op, d, ndim);
  return w;
}

// ---- autograd nodes of view ops ----
struct ReshapeBackward : Node {
  Shape in_shape;
  std::vector<Tensor> apply(const Tensor& g) override { return {g.reshape(in_shape)}; }
  const char* name() const override { return "reshape"; }
};

struct TransposeBackward : Node {
  int64_t d0, d1;
  std::vector<Tensor> apply(const Tensor& g) override { return {g.transpose(d0, d1)}; }
  const char* name() const override { return "transpose"; }
};

struct SliceBackward : Node {
  Shape in_shape;
  int64_t d, start, end;
  std::vector<Tensor> apply(const Tensor& g) override {
    Tensor out = Tensor::zeros(in_shape);
    out.slice(d, start, end).copy_from(g);
    return {out};
  }
  const char* name() const override { return "slice"; }
};

struct IdentityBackward : Node {
  std::vector<Tensor> apply(const Tensor& g) override { return {g}; }
  const char* name() const override { return "contiguous"; }
};

}  // namespace

// ---- factories ----
Tensor Tensor::empty(const Shape& shape, DType dtype) { return Tensor(make_impl(shape, dtype)); }

Tensor Tensor::zeros(const Shape& shape, DType dtype) {
  Tensor t = empty(shape, dtype);
  if (t.impl_->storage->nbytes > 0) std::memset(t.impl_->storage->data, 0, t.impl_->storage->nbytes);
  return t;
}

Tensor Tensor::ones(const Shape& shape) { return full(shape, 1.0f); }

Tensor Tensor::full(const Shape& shape, float value) {
  Tensor t = empty(shape);
  t.fill_(value);
  return t;
}

Tensor Tensor::from_vector(const Shape& shape, const std::vector<float>& values) {
  DT_CHECK(shape_numel(shape) == static_cast<int64_t>(values.size()), "tensor",
           "from_vector: shape {} holds {} elements but {} values were given", shape_str(shape), shape_numel(shape),
           values.size());
  Tensor t = empty(shape);
  if (!values.empty()) std::memcpy(t.data(), values.data(), values.size() * sizeof(float));
  return t;
}

Tensor Tensor::scalar(float value) { return full({}, value); }

Tensor Tensor::randn(const Shape& shape, Generator& gen, float std) {
  Tensor t = empty(shape);
  float* p = t.data();
  for (int64_t i = 0, n = t.numel(); i < n; ++i) p[i] = gen.normal() * std;
  return t;
}

Tensor Tensor::borrow(void* data, const Shape& shape, std::shared_ptr<const void> owner, DType dtype) {
  auto impl = std::make_shared<TensorImpl>();
  impl->storage =
      std::make_shared<Storage>(data, static_cast<size_t>(shape_numel(shape)) * dtype_size(dtype), std::move(owner));
  impl->shape = shape;
  impl->strides = contiguous_strides(shape);
  impl->dtype = dtype;
  return Tensor(impl);
}

void Tensor::rebind(void* data, std::shared_ptr<const void> owner) {
  TensorImpl& t = checked(impl_);
  t.storage = std::make_shared<Storage>(data, static_cast<size_t>(shape_numel(t.shape)) * dtype_size(t.dtype),
                                        std::move(owner));
  t.offset = 0;
  t.strides = contiguous_strides(t.shape);
}

Tensor Tensor::uniform(const Shape& shape, Generator& gen, float lo, float hi) {
  Tensor t = empty(shape);
  float* p = t.data();
  for (int64_t i = 0, n = t.numel(); i < n; ++i) p[i] = lo + (hi - lo) * gen.uniform();
  return t;
}

// ---- metadata ----
const Shape& Tensor::shape() const { return checked(impl_).shape; }
const Shape& Tensor::strides() const { return checked(impl_).strides; }
int64_t Tensor::dim() const { return static_cast<int64_t>(shape().size()); }
int64_t Tensor::size(int64_t d) const { return shape()[wrap_dim(d, dim(), "size")]; }
int64_t Tensor::numel() const { return shape_numel(shape()); }
DType Tensor::dtype() const { return checked(impl_).dtype; }

bool Tensor::is_contiguous() const {
  const auto& im = checked(impl_);
  int64_t expected = 1;
  for (size_t i = im.shape.size(); i-- > 0;) {
    if (im.shape[i] == 1) continue;
    if (im.strides[i] != expected) return false;
    expected *= im.shape[i];
  }
  return true;
}

std::string Tensor::str() const {
  if (!defined()) return "Tensor(undefined)";
  return fmt::format("Tensor({}, {})", dtype_name(dtype()), shape_str(shape()));
}

// ---- data access ----
float* Tensor::data() {
  auto& im = checked(impl_);
  DT_CHECK(im.dtype == DType::f32, "tensor", "data(): tensor is {}, expected f32", dtype_name(im.dtype));
  return static_cast<float*>(im.storage->data) + im.offset;
}

const float* Tensor::data() const { return const_cast<Tensor*>(this)->data(); }

void* Tensor::raw_data() {
  auto& im = checked(impl_);
  return static_cast<char*>(im.storage->data) + im.offset * static_cast<int64_t>(dtype_size(im.dtype));
}

const void* Tensor::raw_data() const { return const_cast<Tensor*>(this)->raw_data(); }

float Tensor::item() const {
  DT_CHECK(numel() == 1, "tensor", "item(): tensor {} has {} elements, expected 1", shape_str(shape()), numel());
  return to_vector()[0];
}

std::vector<float> Tensor::to_vector() const {
  Tensor c = (dtype() == DType::f32 ? *this : to(DType::f32)).detach().contiguous();
  std::vector<float> out(static_cast<size_t>(c.numel()));
  if (!out.empty()) std::memcpy(out.data(), c.data(), out.size() * sizeof(float));
  return out;
}

// ---- views and copies ----
Tensor Tensor::contiguous() const {
  if (is_contiguous()) return *this;
  Tensor out = empty(shape(), dtype());
  detail::strided_copy(*this, out);
  if (autograd::needs_grad({this})) autograd::attach(out, std::make_shared<IdentityBackward>(), {this});
  return out;
}

Tensor Tensor::reshape(const Shape& new_shape_in) const {
  Shape new_shape = new_shape_in;
  int64_t known = 1;
  int infer = -1;
  for (size_t i = 0; i < new_shape.size(); ++i) {
    if (new_shape[i] == -1) {
      DT_CHECK(infer < 0, "tensor", "reshape {} -> {}: more than one -1", shape_str(shape()), shape_str(new_shape_in));
      infer = static_cast<int>(i);
    } else {
      DT_CHECK(new_shape[i] >= 0, "tensor", "reshape to {}: negative size", shape_str(new_shape_in));
      known *= new_shape[i];
    }
  }
  if (infer >= 0) {
    DT_CHECK(known > 0 && numel() % known == 0, "tensor", "reshape {} -> {}: cannot infer -1", shape_str(shape()),
             shape_str(new_shape_in));
    new_shape[infer] = numel() / known;
  }
  DT_CHECK(shape_numel(new_shape) == numel(), "tensor", "reshape {} -> {}: element counts differ ({} vs {})",
           shape_str(shape()), shape_str(new_shape_in), numel(), shape_numel(new_shape));
  Tensor src = is_contiguous() ? *this : contiguous();
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = src.impl_->storage;
  impl->offset = src.impl_->offset;
  impl->shape = new_shape;
  impl->strides = contiguous_strides(new_shape);
  impl->dtype = src.dtype();
  Tensor out(impl);
  if (autograd::needs_grad({&src})) {
    auto node = std::make_shared<ReshapeBackward>();
    node->in_shape = src.shape();
    autograd::attach(out, node, {&src});
  }
  return out;
}

Tensor Tensor::transpose(int64_t d0, int64_t d1) const {
  const int64_t n = dim();
  d0 = wrap_dim(d0, n, "transpose");
  d1 = wrap_dim(d1, n, "transpose");
  auto impl = std::make_shared<TensorImpl>(*impl_);
  impl->requires_grad = false;
  impl->grad.reset();
  impl->grad_fn.reset();
  impl->grad_accumulator.reset();
  impl->grad_ready_hooks.clear();
  std::swap(impl->shape[d0], impl->shape[d1]);
  std::swap(impl->strides[d0], impl->strides[d1]);
  Tensor out(impl);
  if (autograd::needs_grad({this})) {
    auto node = std::make_shared<TransposeBackward>();
    node->d0 = d0;
    node->d1 = d1;
    autograd::attach(out, node, {this});
  }
  return out;
}

Tensor Tensor::slice(int64_t d, int64_t start, int64_t end) const {
  d = wrap_dim(d, dim(), "slice");
  const int64_t len = shape()[d];
  DT_CHECK(0 <= start && start <= end && end <= len, "tensor", "slice [{}, {}) of dimension {} with size {}", start,
           end, d, len);
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = impl_->storage;
  impl->dtype = impl_->dtype;
  impl->shape = impl_->shape;
  impl->strides = impl_->strides;
  impl->offset = impl_->offset + start * impl_->strides[d];
  impl->shape[d] = end - start;
  Tensor out(impl);
  if (autograd::needs_grad({this})) {
    auto node = std::make_shared<SliceBackward>();
    node->in_shape = shape();
    node->d = d;
    node->start = start;
    node->end = end;
    autograd::attach(out, node, {this});
  }
  return out;
}

Tensor Tensor::clone() const {
  Tensor out = empty(shape(), dtype());
  detail::strided_copy(*this, out);
  if (autograd::needs_grad({this})) autograd::attach(out, std::make_shared<IdentityBackward>(), {this});
  return out;
}

Tensor Tensor::detach() const {
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = checked(impl_).storage;
  impl->offset = impl_->offset;
  impl->shape = impl_->shape;
  impl->strides = impl_->strides;
  impl->dtype = impl_->dtype;
  return Tensor(impl);
}

Tensor Tensor::to(DType target) const {
  Tensor src = detach().contiguous();
  if (target == dtype()) return src.clone();
  DT_CHECK(target != DType::u8 && dtype() != DType::u8, "tensor",
           "to: no conversion from {} to {} (u8 holds raw codes)", dtype_name(dtype()), dtype_name(target));
  Tensor out = empty(shape(), target);
  const int64_t n = numel();
  if (dtype() == DType::f32) {
    const float* s = src.data();
    auto* d = static_cast<uint16_t*>(out.raw_data());
    if (target == DType::bf16) {
      kernels::table().round_to_bf16(s, 1, n, n, d);  // f32_to_bf16's rounding, vectorised
    } else {
      for (int64_t i = 0; i < n; ++i) d[i] = f32_to_f16(s[i]);
    }
    return out;
  }
  const auto* s = static_cast<const uint16_t*>(src.raw_data());
  if (target == DType::f32) {
    float* d = out.data();
    if (dtype() == DType::bf16) {
      for (int64_t i = 0; i < n; ++i) d[i] = bf16_to_f32(s[i]);
    } else {
      for (int64_t i = 0; i < n; ++i) d[i] = f16_to_f32(s[i]);
    }
    return out;
  }
  return src.to(DType::f32).to(target);
}

void Tensor::copy_from(const Tensor& src) {
  DT_CHECK(src.numel() == numel(), "tensor", "copy_from: source {} has {} elements, destination {} has {}",
           shape_str(src.shape()), src.numel(), shape_str(shape()), numel());
  DT_CHECK(src.dtype() == dtype(), "tensor", "copy_from: dtype {} into {}", dtype_name(src.dtype()),
           dtype_name(dtype()));
  Tensor s = src.detach();
  if (s.shape() != shape()) s = s.contiguous().reshape(shape());
  Tensor d = detach();
  detail::strided_copy(s, d);
}

void Tensor::fill_(float value) {
  DT_CHECK(dtype() == DType::f32, "tensor", "fill_: tensor is {}, expected f32", dtype_name(dtype()));
  if (is_contiguous()) {
    float* p = data();
    for (int64_t i = 0, n = numel(); i < n; ++i) p[i] = value;
  } else {
    Tensor full_t = full(shape(), value);
    copy_from(full_t);
  }
}

// ---- autograd ----
bool Tensor::requires_grad() const { return checked(impl_).requires_grad; }

Tensor& Tensor::set_requires_grad(bool requires_grad) {
  DT_CHECK(is_leaf() || requires_grad, "autograd", "set_requires_grad(false) on a non-leaf tensor");
  DT_CHECK(dtype() == DType::f32 || !requires_grad, "autograd", "only f32 tensors can require grad, got {}",
           dtype_name(dtype()));
  impl_->requires_grad = requires_grad;
  return *this;
}

bool Tensor::is_leaf() const { return checked(impl_).grad_fn == nullptr; }

Tensor Tensor::grad() const { return Tensor(checked(impl_).grad); }

void Tensor::set_grad(const Tensor& grad) {
  if (grad.defined()) {
    DT_CHECK(grad.shape() == shape(), "autograd", "set_grad: gradient {} for tensor {}", shape_str(grad.shape()),
             shape_str(shape()));
    // Accumulation and the optimizers walk gradients linearly, so a strided view is copied.
    if (!grad.is_contiguous()) {
      checked(impl_).grad = grad.detach().contiguous().impl_ptr();
      return;
    }
  }
  checked(impl_).grad = grad.impl_ptr();
}

void Tensor::zero_grad() { checked(impl_).grad.reset(); }

std::shared_ptr<Node> Tensor::grad_fn() const { return checked(impl_).grad_fn; }

void Tensor::backward() const { autograd::run_backward(*this); }
void Tensor::backward(const Tensor& grad) const { autograd::run_backward(*this, grad); }

void Tensor::set_grad_home(const Tensor& home) {
  DT_CHECK(is_leaf() && requires_grad(), "autograd", "a gradient home goes on a leaf that requires grad");
  DT_CHECK(!home.defined() || (home.shape() == shape() && home.is_contiguous() && home.dtype() == DType::f32),
           "autograd", "gradient home {} for tensor {}: must be contiguous f32 of the same shape",
           home.defined() ? home.str() : std::string("?"), str());
  impl_->grad_home = home.defined() ? home.impl_ptr() : nullptr;
}

void Tensor::register_grad_ready_hook(GradReadyHook hook) {
  DT_CHECK(is_leaf() && requires_grad(), "autograd", "grad-ready hooks go on leaves that require grad");
  impl_->grad_ready_hooks.push_back(std::move(hook));
}

// ---- operators ----
Tensor operator+(const Tensor& a, const Tensor& b) { return ops::add(a, b); }
Tensor operator-(const Tensor& a, const Tensor& b) { return ops::sub(a, b); }
Tensor operator*(const Tensor& a, const Tensor& b) { return ops::mul(a, b); }
Tensor operator/(const Tensor& a, const Tensor& b) { return ops::div(a, b); }
Tensor operator+(const Tensor& a, float b) { return ops::add_scalar(a, b); }
Tensor operator-(const Tensor& a, float b) { return ops::add_scalar(a, -b); }
Tensor operator*(const Tensor& a, float b) { return ops::mul_scalar(a, b); }
Tensor operator/(const Tensor& a, float b) { return ops::mul_scalar(a, 1.0f / b); }
Tensor operator-(const Tensor& a) { return ops::neg(a); }

}  // namespace dtrain
