// Sum and mean over a set of dimensions, and their gradients.
#include <algorithm>

#include "dtrain/core/error.h"
#include "dtrain/tensor/autograd.h"
#include "dtrain/tensor/kernels.h"
#include "dtrain/tensor/ops.h"
#include "dtrain/tensor/profile.h"
#include "strided.h"

namespace dtrain::ops {

namespace {

std::vector<bool> reduced_mask(const Tensor& a, const std::vector<int64_t>& dims, const char* op) {
  const int64_t nd = a.dim();
  std::vector<bool> mask(static_cast<size_t>(nd), dims.empty());
  for (int64_t d : dims) {
    const int64_t w = d < 0 ? d + nd : d;
    DT_CHECK(w >= 0 && w < nd, "tensor", "{}: dimension {} out of range for shape {}", op, d, shape_str(a.shape()));
    DT_CHECK(!mask[w] || dims.empty(), "tensor", "{}: dimension {} listed twice", op, d);
    mask[static_cast<size_t>(w)] = true;
  }
  return mask;
}

// Sum without autograd into a keepdim-shaped output.
Tensor sum_kernel(const Tensor& a, const std::vector<bool>& mask) {
  Shape keep = a.shape();
  for (size_t i = 0; i < keep.size(); ++i) {
    if (mask[i]) keep[i] = 1;
  }
  Tensor out = Tensor::zeros(keep);
  float* o = out.data();
  const float* p = a.data();
  if (a.is_contiguous() && std::all_of(mask.begin(), mask.end(), [](bool m) { return m; })) {
    double acc = 0.0;
    for (int64_t i = 0, n = a.numel(); i < n; ++i) acc += p[i];
    o[0] = static_cast<float>(acc);
    return out;
  }
  if (a.is_contiguous() && !mask.empty() && mask.back() && std::count(mask.begin(), mask.end(), true) == 1 &&
      a.size(-1) > 0) {
    const int64_t inner = a.size(-1);
    for (int64_t r = 0, rows = a.numel() / inner; r < rows; ++r) {
      double acc = 0.0;
      const float* row = p + r * inner;
      for (int64_t j = 0; j < inner; ++j) acc += row[j];
      o[r] = static_cast<float>(acc);
    }
    return out;
  }
  // Leading dimensions summed (a gradient broadcast over them, e.g. positions over the batch):
  // rows added element by element in order, as below, but vectorised.
  const size_t lead = static_cast<size_t>(std::find(mask.begin(), mask.end(), false) - mask.begin());
  if (a.is_contiguous() && lead > 0 && lead < mask.size() &&
      std::none_of(mask.begin() + lead, mask.end(), [](bool m) { return m; })) {
    const int64_t n = out.numel();
    if (n > 0) kernels::table().sum_rows(p, o, a.numel() / n, n);
    return out;
  }
  Shape out_strides = out.strides();
  for (size_t i = 0; i < mask.size(); ++i) {
    if (mask[i]) out_strides[i] = 0;
  }
  const Shape* strides[2] = {&a.strides(), &out_strides};
  detail::for_each_offset<2>(a.shape(), strides, [&](int64_t ia, int64_t io) { o[io] += p[ia]; });
  return out;
}

// Materialises g (keepdim shape) broadcast to `shape`, times `scale`.
Tensor expand_kernel(const Tensor& g, const Shape& shape, float scale) {
  Tensor gc = g.contiguous();
  Tensor out = Tensor::empty(shape);
  Shape in_strides = gc.strides();
  for (size_t i = 0; i < shape.size(); ++i) {
    if (gc.shape()[i] == 1) in_strides[i] = 0;
  }
  const float* pg = gc.data();
  float* o = out.data();
  const Shape* strides[2] = {&in_strides, &out.strides()};
  detail::for_each_offset<2>(shape, strides, [&](int64_t ig, int64_t io) { o[io] = pg[ig] * scale; });
  return out;
}

struct SumBackward : Node {
  Shape in_shape, keep_shape;
  float scale = 1.0f;
  std::vector<Tensor> apply(const Tensor& g) override {
    return {expand_kernel(g.reshape(keep_shape), in_shape, scale)};
  }
  const char* name() const override { return scale == 1.0f ? "sum" : "mean"; }
};

Tensor reduce(const Tensor& a, const std::vector<int64_t>& dims, bool keepdim, bool is_mean) {
  profile::Scope scope(profile::Kind::elementwise);
  const char* op = is_mean ? "mean" : "sum";
  DT_CHECK(a.defined(), "tensor", "{}: undefined input", op);
  DT_CHECK(a.dtype() == DType::f32, "tensor", "{}: input {} is {}, expected f32", op, shape_str(a.shape()),
           dtype_name(a.dtype()));
  const std::vector<bool> mask = reduced_mask(a, dims, op);
  Tensor kept = sum_kernel(a, mask);
  int64_t count = 1;
  Shape squeezed;
  for (size_t i = 0; i < mask.size(); ++i) {
    if (mask[i]) {
      count *= a.shape()[i];
    } else {
      squeezed.push_back(a.shape()[i]);
    }
  }
  const float scale = is_mean ? 1.0f / static_cast<float>(std::max<int64_t>(count, 1)) : 1.0f;
  if (is_mean) {
    float* o = kept.data();
    for (int64_t i = 0, n = kept.numel(); i < n; ++i) o[i] *= scale;
  }
  Shape keep_shape = kept.shape();
  Tensor out = keepdim ? kept : kept.reshape(squeezed);
  if (autograd::needs_grad({&a})) {
    auto node = std::make_shared<SumBackward>();
    node->in_shape = a.shape();
    node->keep_shape = keep_shape;
    node->scale = scale;
    autograd::attach(out, node, {&a});
  }
  return out;
}

}  // namespace

Tensor sum(const Tensor& a, const std::vector<int64_t>& dims, bool keepdim) { return reduce(a, dims, keepdim, false); }

Tensor mean(const Tensor& a, const std::vector<int64_t>& dims, bool keepdim) { return reduce(a, dims, keepdim, true); }

}  // namespace dtrain::ops
