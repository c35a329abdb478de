// Elementwise ops with NumPy broadcasting, and their gradients.
#include <cmath>

#include "bf16_out.h"
#include "dtrain/core/error.h"
#include "dtrain/tensor/autograd.h"
#include "dtrain/tensor/kernels.h"
#include "dtrain/tensor/ops.h"
#include "dtrain/tensor/profile.h"
#include "strided.h"

namespace dtrain::ops {

namespace {

void check_f32(const Tensor& t, const char* op) {
  DT_CHECK(t.defined(), "tensor", "{}: undefined input", op);
  DT_CHECK(t.dtype() == DType::f32, "tensor", "{}: input {} is {}, expected f32", op, shape_str(t.shape()),
           dtype_name(t.dtype()));
}

// Strides of `t` seen through broadcasting to `out` (0 on broadcast dimensions).
Shape broadcast_strides(const Tensor& t, const Shape& out) {
  Shape s(out.size(), 0);
  const size_t off = out.size() - t.shape().size();
  for (size_t i = 0; i < t.shape().size(); ++i) {
    s[off + i] = t.shape()[i] == 1 ? 0 : t.strides()[i];
  }
  return s;
}

bool is_suffix(const Shape& small, const Shape& big) {
  if (small.size() > big.size()) return false;
  const size_t off = big.size() - small.size();
  for (size_t i = 0; i < small.size(); ++i) {
    if (small[i] != big[off + i]) return false;
  }
  return true;
}

template <typename F>
Tensor binary_kernel(const Tensor& a, const Tensor& b, const char* op, F f) {
  profile::Scope scope(profile::Kind::elementwise);
  check_f32(a, op);
  check_f32(b, op);
  const Shape out_shape = broadcast_shapes(a.shape(), b.shape(), op);
  Tensor out = Tensor::empty(out_shape);
  float* o = out.data();
  const float* pa = a.data();
  const float* pb = b.data();
  const int64_t n = out.numel();
  const bool ac = a.is_contiguous();
  const bool bc = b.is_contiguous();
  if (ac && bc && a.shape() == out_shape && b.shape() == out_shape) {
    for (int64_t i = 0; i < n; ++i) o[i] = f(pa[i], pb[i]);
  } else if (ac && a.shape() == out_shape && b.numel() == 1) {
    const float s = *pb;
    for (int64_t i = 0; i < n; ++i) o[i] = f(pa[i], s);
  } else if (bc && b.shape() == out_shape && a.numel() == 1) {
    const float s = *pa;
    for (int64_t i = 0; i < n; ++i) o[i] = f(s, pb[i]);
  } else if (ac && bc && a.shape() == out_shape && is_suffix(b.shape(), out_shape) && b.numel() > 0) {
    const int64_t inner = b.numel();
    for (int64_t r = 0; r < n / inner; ++r) {
      const float* ar = pa + r * inner;
      float* orow = o + r * inner;
      for (int64_t j = 0; j < inner; ++j) orow[j] = f(ar[j], pb[j]);
    }
  } else {
    const Shape sa = broadcast_strides(a, out_shape);
    const Shape sb = broadcast_strides(b, out_shape);
    const Shape& so = out.strides();
    const Shape* strides[3] = {&sa, &sb, &so};
    detail::for_each_offset<3>(out_shape, strides,
                               [&](int64_t ia, int64_t ib, int64_t io) { o[io] = f(pa[ia], pb[ib]); });
  }
  return out;
}

template <typename F>
Tensor unary_kernel(const Tensor& a, const char* op, F f) {
  check_f32(a, op);
  Tensor src = a.detach().contiguous();
  Tensor out = Tensor::empty(a.shape());
  const float* p = src.data();
  float* o = out.data();
  for (int64_t i = 0, n = out.numel(); i < n; ++i) o[i] = f(p[i]);
  return out;
}

struct AddBackward : Node {
  Shape a_shape, b_shape;
  float b_sign = 1.0f;
  bool need_a = true, need_b = true;
  std::vector<Tensor> apply(const Tensor& g) override {
    Tensor ga = need_a ? sum_to(g, a_shape) : Tensor();
    Tensor gb;
    if (need_b) gb = b_sign > 0 ? sum_to(g, b_shape) : sum_to(neg(g), b_shape);
    return {ga, gb};
  }
  const char* name() const override { return b_sign > 0 ? "add" : "sub"; }
};

struct MulBackward : Node {
  Tensor a, b;
  bool need_a = true, need_b = true;
  std::vector<Tensor> apply(const Tensor& g) override {
    Tensor ga = need_a ? sum_to(mul(g, b), a.shape()) : Tensor();
    Tensor gb = need_b ? sum_to(mul(g, a), b.shape()) : Tensor();
    return {ga, gb};
  }
  void release() override { a = b = Tensor(); }
  const char* name() const override { return "mul"; }
};

struct DivBackward : Node {
  Tensor a, b;
  bool need_a = true, need_b = true;
  std::vector<Tensor> apply(const Tensor& g) override {
    Tensor ga = need_a ? sum_to(div(g, b), a.shape()) : Tensor();
    Tensor gb;
    if (need_b) {
      gb = sum_to(binary_kernel(mul(g, a), mul(b, b), "div_backward", [](float x, float y) { return -x / y; }),
                  b.shape());
    }
    return {ga, gb};
  }
  void release() override { a = b = Tensor(); }
  const char* name() const override { return "div"; }
};

// Unary op whose gradient is g * dfn(saved input or output).
template <typename DFn>
struct UnaryBackward : Node {
  Tensor saved;
  const char* op;
  DFn dfn;
  UnaryBackward(Tensor s, const char* o, DFn d) : saved(std::move(s)), op(o), dfn(d) {}
  std::vector<Tensor> apply(const Tensor& g) override {
    Tensor gc = g.contiguous();
    Tensor out = Tensor::empty(saved.shape());
    const float* pg = gc.data();
    const float* ps = saved.data();
    float* o = out.data();
    for (int64_t i = 0, n = out.numel(); i < n; ++i) o[i] = pg[i] * dfn(ps[i]);
    return {out};
  }
  void release() override { saved = Tensor(); }
  const char* name() const override { return op; }
};

template <typename F, typename DFn>
Tensor unary_op(const Tensor& a, const char* op, F f, DFn dfn, bool save_output) {
  profile::Scope scope(profile::Kind::elementwise);
  Tensor out = unary_kernel(a, op, f);
  if (autograd::needs_grad({&a})) {
    Tensor saved = save_output ? out.detach() : a.detach().contiguous();
    autograd::attach(out, std::make_shared<UnaryBackward<DFn>>(saved, op, dfn), {&a});
  }
  return out;
}

struct GeluBackward : Node {
  Tensor x;  // the input, contiguous
  std::vector<Tensor> apply(const Tensor& g_in) override {
    Tensor g = g_in.contiguous();
    Tensor out = Tensor::empty(x.shape());
    kernels::table().gelu_backward(x.data(), g.data(), out.data(), x.numel());
    return {out};
  }
  void release() override { x = Tensor(); }
  const char* name() const override { return "gelu"; }
  profile::Kind profile_kind() const override { return profile::Kind::gelu; }
};

}  // namespace

Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op) {
  const size_t n = std::max(a.size(), b.size());
  Shape out(n);
  for (size_t i = 0; i < n; ++i) {
    const int64_t da = i < n - a.size() ? 1 : a[i - (n - a.size())];
    const int64_t db = i < n - b.size() ? 1 : b[i - (n - b.size())];
    DT_CHECK(da == db || da == 1 || db == 1, "tensor", "{}: shapes {} and {} cannot be broadcast", op, shape_str(a),
             shape_str(b));
    out[i] = da == 1 ? db : da;
  }
  return out;
}

Tensor sum_to(const Tensor& grad, const Shape& shape) {
  if (grad.shape() == shape) return grad;
  const size_t lead = grad.shape().size() - shape.size();
  std::vector<int64_t> dims;
  for (size_t i = 0; i < grad.shape().size(); ++i) {
    if (i < lead || (shape[i - lead] == 1 && grad.shape()[i] != 1)) dims.push_back(static_cast<int64_t>(i));
  }
  NoGradGuard no_grad;
  Tensor s = dims.empty() ? grad : sum(grad, dims, /*keepdim=*/true);
  return s.reshape(shape);
}

Tensor add(const Tensor& a, const Tensor& b) {
  Tensor out = binary_kernel(a, b, "add", [](float x, float y) { return x + y; });
  if (autograd::needs_grad({&a, &b})) {
    auto node = std::make_shared<AddBackward>();
    node->a_shape = a.shape();
    node->b_shape = b.shape();
    node->need_a = a.requires_grad();
    node->need_b = b.requires_grad();
    autograd::attach(out, node, {&a, &b});
  }
  return out;
}

Tensor sub(const Tensor& a, const Tensor& b) {
  Tensor out = binary_kernel(a, b, "sub", [](float x, float y) { return x - y; });
  if (autograd::needs_grad({&a, &b})) {
    auto node = std::make_shared<AddBackward>();
    node->a_shape = a.shape();
    node->b_shape = b.shape();
    node->b_sign = -1.0f;
    node->need_a = a.requires_grad();
    node->need_b = b.requires_grad();
    autograd::attach(out, node, {&a, &b});
  }
  return out;
}

Tensor mul(const Tensor& a, const Tensor& b) {
  Tensor out = binary_kernel(a, b, "mul", [](float x, float y) { return x * y; });
  if (autograd::needs_grad({&a, &b})) {
    auto node = std::make_shared<MulBackward>();
    node->a = a.detach();
    node->b = b.detach();
    node->need_a = a.requires_grad();
    node->need_b = b.requires_grad();
    autograd::attach(out, node, {&a, &b});
  }
  return out;
}

Tensor div(const Tensor& a, const Tensor& b) {
  Tensor out = binary_kernel(a, b, "div", [](float x, float y) { return x / y; });
  if (autograd::needs_grad({&a, &b})) {
    auto node = std::make_shared<DivBackward>();
    node->a = a.detach();
    node->b = b.detach();
    node->need_a = a.requires_grad();
    node->need_b = b.requires_grad();
    autograd::attach(out, node, {&a, &b});
  }
  return out;
}

Tensor add_scalar(const Tensor& a, float s) {
  return unary_op(
      a, "add_scalar", [s](float x) { return x + s; }, [](float) { return 1.0f; }, true);
}

Tensor mul_scalar(const Tensor& a, float s) {
  return unary_op(
      a, "mul_scalar", [s](float x) { return x * s; }, [s](float) { return s; }, true);
}

Tensor neg(const Tensor& a) {
  return unary_op(
      a, "neg", [](float x) { return -x; }, [](float) { return -1.0f; }, true);
}

Tensor relu(const Tensor& a) {
  return unary_op(
      a, "relu", [](float x) { return x > 0.0f ? x : 0.0f; }, [](float y) { return y > 0.0f ? 1.0f : 0.0f; },
      /*save_output=*/true);
}

Tensor gelu(const Tensor& a, DType out_dtype) {
  profile::Scope scope(profile::Kind::gelu);
  check_f32(a, "gelu");
  detail::check_out_dtype(out_dtype, "gelu");
  Tensor x = a.detach().contiguous();
  Tensor out = Tensor::empty(a.shape(), out_dtype);
  detail::gelu_into(x.data(), out);
  if (autograd::needs_grad({&a})) {
    auto node = std::make_shared<GeluBackward>();
    node->x = x;
    autograd::attach(out, node, {&a});
  }
  return out;
}

Tensor tanh(const Tensor& a) {
  return unary_op(
      a, "tanh", [](float x) { return std::tanh(x); }, [](float y) { return 1.0f - y * y; }, true);
}

Tensor exp(const Tensor& a) {
  return unary_op(
      a, "exp", [](float x) { return std::exp(x); }, [](float y) { return y; }, true);
}

Tensor log(const Tensor& a) {
  return unary_op(
      a, "log", [](float x) { return std::log(x); }, [](float x) { return 1.0f / x; }, false);
}

Tensor square(const Tensor& a) {
  return unary_op(
      a, "square", [](float x) { return x * x; }, [](float x) { return 2.0f * x; }, false);
}

Tensor sqrt(const Tensor& a) {
  return unary_op(
      a, "sqrt", [](float x) { return std::sqrt(x); }, [](float y) { return 0.5f / y; }, true);
}

}  // namespace dtrain::ops
