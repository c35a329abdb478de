// Neural-network ops over the last dimension: softmax, log-softmax, cross-entropy,
// layer norm, embedding, dropout.
#include <cmath>

#include "bf16_out.h"
#include "dtrain/core/error.h"
#include "dtrain/tensor/autograd.h"
#include "dtrain/tensor/kernels.h"
#include "dtrain/tensor/ops.h"
#include "dtrain/tensor/profile.h"
#include "dtrain/tensor/random.h"

namespace dtrain::ops {

namespace {

void check_input(const Tensor& t, const char* op, const char* what) {
  DT_CHECK(t.defined(), "tensor", "{}: {} is undefined", op, what);
  DT_CHECK(t.dtype() == DType::f32, "tensor", "{}: {} is {}, expected f32", op, what, dtype_name(t.dtype()));
  DT_CHECK(t.dim() >= 1, "tensor", "{}: {} must have at least one dimension", op, what);
}

struct SoftmaxBackward : Node {
  Tensor y;  // output
  bool log_space;
  std::vector<Tensor> apply(const Tensor& g_in) override {
    Tensor g = g_in.contiguous();
    Tensor out = Tensor::empty(y.shape());
    const int64_t n = y.size(-1);
    const int64_t rows = n == 0 ? 0 : y.numel() / n;
    kernels::table().softmax_backward(y.data(), g.data(), out.data(), rows, n, log_space);
    return {out};
  }
  void release() override { y = Tensor(); }
  const char* name() const override { return log_space ? "log_softmax" : "softmax"; }
  profile::Kind profile_kind() const override { return profile::Kind::softmax; }
};

Tensor softmax_impl(const Tensor& a, bool log_space) {
  profile::Scope scope(profile::Kind::softmax);
  const char* op = log_space ? "log_softmax" : "softmax";
  check_input(a, op, "input");
  Tensor x = a.detach().contiguous();
  Tensor out = Tensor::empty(a.shape());
  const int64_t n = a.size(-1);
  kernels::table().softmax_forward(x.data(), out.data(), n == 0 ? 0 : a.numel() / n, n, log_space);
  if (autograd::needs_grad({&a})) {
    auto node = std::make_shared<SoftmaxBackward>();
    node->y = out.detach();
    node->log_space = log_space;
    autograd::attach(out, node, {&a});
  }
  return out;
}

struct CrossEntropyBackward : Node {
  Tensor probs;  // (N, C) softmax of the logits
  std::vector<int32_t> targets;
  std::vector<Tensor> apply(const Tensor& g) override {
    const int64_t n = probs.size(0);
    const int64_t c = probs.size(1);
    const float scale = g.item() / static_cast<float>(n);
    Tensor out = Tensor::empty(probs.shape());
    kernels::table().cross_entropy_backward(probs.data(), targets.data(), scale, out.data(), n, c);
    return {out};
  }
  void release() override { probs = Tensor(); }
  const char* name() const override { return "cross_entropy"; }
  profile::Kind profile_kind() const override { return profile::Kind::cross_entropy; }
};

struct LayerNormBackward : Node {
  Tensor x, w, mean, rstd;  // x (rows, C), mean/rstd (rows)
  Shape x_shape;
  std::vector<Tensor> apply(const Tensor& g_in) override {
    Tensor g = g_in.contiguous();
    const int64_t c = w.numel();
    const int64_t rows = c == 0 ? 0 : x.numel() / c;
    Tensor gx = Tensor::empty({rows, c});
    Tensor gw = Tensor::zeros({c});
    Tensor gb = Tensor::zeros({c});
    kernels::table().layer_norm_backward(x.data(), w.data(), g.data(), mean.data(), rstd.data(), gx.data(), gw.data(),
                                         gb.data(), rows, c);
    return {gx.reshape(x_shape), gw, gb};
  }
  void release() override { x = w = mean = rstd = Tensor(); }
  const char* name() const override { return "layer_norm"; }
  profile::Kind profile_kind() const override { return profile::Kind::layer_norm; }
};

struct EmbeddingBackward : Node {
  std::vector<int32_t> ids;
  int64_t vocab, dim;
  std::vector<Tensor> apply(const Tensor& g_in) override {
    Tensor g = g_in.contiguous();
    Tensor gw = Tensor::zeros({vocab, dim});
    float* pw = gw.data();
    const float* pg = g.data();
    for (size_t i = 0; i < ids.size(); ++i) {
      float* row = pw + static_cast<int64_t>(ids[i]) * dim;
      const float* grow = pg + static_cast<int64_t>(i) * dim;
      for (int64_t j = 0; j < dim; ++j) row[j] += grow[j];
    }
    return {gw, Tensor()};
  }
  void release() override { ids.clear(); }
  const char* name() const override { return "embedding"; }
  profile::Kind profile_kind() const override { return profile::Kind::embedding; }
};

struct DropoutBackward : Node {
  Tensor mask;  // 0 or 1/(1-p)
  std::vector<Tensor> apply(const Tensor& g) override { return {mul(g, mask)}; }
  void release() override { mask = Tensor(); }
  const char* name() const override { return "dropout"; }
  profile::Kind profile_kind() const override { return profile::Kind::dropout; }
};

// Integer ids stored as f32; every id must be a whole number in [0, limit).
std::vector<int32_t> read_ids(const Tensor& ids, int64_t limit, const char* op) {
  DT_CHECK(ids.defined(), "tensor", "{}: ids are undefined", op);
  DT_CHECK(ids.dtype() == DType::f32, "tensor", "{}: ids {} are {}, expected f32", op, shape_str(ids.shape()),
           dtype_name(ids.dtype()));
  std::vector<float> v = ids.to_vector();
  std::vector<int32_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    const float f = v[i];
    DT_CHECK(f >= 0.0f && f < static_cast<float>(limit) && f == std::floor(f), "tensor",
             "{}: id {} at position {} is not an integer in [0, {})", op, f, i, limit);
    out[i] = static_cast<int32_t>(f);
  }
  return out;
}

}  // namespace

Tensor softmax(const Tensor& a) { return softmax_impl(a, false); }

Tensor log_softmax(const Tensor& a) { return softmax_impl(a, true); }

Tensor cross_entropy(const Tensor& logits, const Tensor& targets) {
  profile::Scope scope(profile::Kind::cross_entropy);
  check_input(logits, "cross_entropy", "logits");
  DT_CHECK(logits.dim() == 2, "tensor", "cross_entropy: logits must be (N, C), got {}", shape_str(logits.shape()));
  const int64_t n = logits.size(0);
  const int64_t c = logits.size(1);
  DT_CHECK(targets.defined() && targets.dim() == 1 && targets.size(0) == n, "tensor",
           "cross_entropy: targets {} do not match logits {} (expected [{}])",
           targets.defined() ? shape_str(targets.shape()) : "undefined", shape_str(logits.shape()), n);
  DT_CHECK(n > 0, "tensor", "cross_entropy: empty batch (logits {})", shape_str(logits.shape()));
  std::vector<int32_t> t = read_ids(targets, c, "cross_entropy");
  Tensor x = logits.detach().contiguous();
  Tensor probs = Tensor::empty({n, c});
  const double loss = kernels::table().cross_entropy_forward(x.data(), t.data(), probs.data(), n, c);
  Tensor out = Tensor::scalar(static_cast<float>(loss / static_cast<double>(n)));
  if (autograd::needs_grad({&logits})) {
    auto node = std::make_shared<CrossEntropyBackward>();
    node->probs = probs;
    node->targets = std::move(t);
    autograd::attach(out, node, {&logits});
  }
  return out;
}

Tensor layer_norm(const Tensor& x_in, const Tensor& weight, const Tensor& bias, float eps, DType out_dtype) {
  profile::Scope scope(profile::Kind::layer_norm);
  check_input(x_in, "layer_norm", "input");
  check_input(weight, "layer_norm", "weight");
  check_input(bias, "layer_norm", "bias");
  const int64_t c = x_in.size(-1);
  DT_CHECK(weight.dim() == 1 && weight.size(0) == c && bias.dim() == 1 && bias.size(0) == c, "tensor",
           "layer_norm: input {} needs weight and bias [{}], got {} and {}", shape_str(x_in.shape()), c,
           shape_str(weight.shape()), shape_str(bias.shape()));
  detail::check_out_dtype(out_dtype, "layer_norm");
  const int64_t rows = c == 0 ? 0 : x_in.numel() / c;
  Tensor x = x_in.detach().contiguous();
  Tensor w = weight.detach().contiguous();
  Tensor b = bias.detach().contiguous();
  Tensor out = Tensor::empty(x_in.shape(), out_dtype);
  Tensor mean_t = Tensor::empty({rows});
  Tensor rstd_t = Tensor::empty({rows});
  const float* px = x.data();
  float* pm = mean_t.data();
  float* pr = rstd_t.data();
  if (out_dtype == DType::bf16) {  // rounded in registers, never written in f32
    kernels::table().layer_norm_forward_bf16(px, w.data(), b.data(), static_cast<uint16_t*>(out.raw_data()), pm, pr,
                                             rows, c, eps);
  } else {
    kernels::table().layer_norm_forward(px, w.data(), b.data(), out.data(), pm, pr, rows, c, eps);
  }
  if (autograd::needs_grad({&x_in, &weight, &bias})) {
    auto node = std::make_shared<LayerNormBackward>();
    node->x = x;
    node->w = w;
    node->mean = mean_t;
    node->rstd = rstd_t;
    node->x_shape = x_in.shape();
    autograd::attach(out, node, {&x_in, &weight, &bias});
  }
  return out;
}

Tensor embedding(const Tensor& weight, const Tensor& ids) {
  profile::Scope scope(profile::Kind::embedding);
  check_input(weight, "embedding", "weight");
  DT_CHECK(weight.dim() == 2, "tensor", "embedding: weight must be (V, C), got {}", shape_str(weight.shape()));
  const int64_t vocab = weight.size(0);
  const int64_t dim = weight.size(1);
  std::vector<int32_t> id = read_ids(ids, vocab, "embedding");
  Tensor w = weight.detach().contiguous();
  Shape out_shape = ids.shape();
  out_shape.push_back(dim);
  Tensor out = Tensor::empty(out_shape);
  const float* pw = w.data();
  float* po = out.data();
  for (size_t i = 0; i < id.size(); ++i) {
    std::copy_n(pw + static_cast<int64_t>(id[i]) * dim, dim, po + static_cast<int64_t>(i) * dim);
  }
  if (autograd::needs_grad({&weight})) {
    auto node = std::make_shared<EmbeddingBackward>();
    node->ids = std::move(id);
    node->vocab = vocab;
    node->dim = dim;
    autograd::attach(out, node, {&weight, &ids});
  }
  return out;
}

Tensor dropout(const Tensor& a, float p, bool training, Generator& gen) {
  profile::Scope scope(profile::Kind::dropout);
  check_input(a, "dropout", "input");
  DT_CHECK(p >= 0.0f && p < 1.0f, "tensor", "dropout: probability {} not in [0, 1)", p);
  if (!training || p == 0.0f) return a;
  Tensor mask = Tensor::empty(a.shape());
  float* pm = mask.data();
  const float keep = 1.0f / (1.0f - p);
  for (int64_t i = 0, n = mask.numel(); i < n; ++i) pm[i] = gen.uniform() < p ? 0.0f : keep;
  Tensor out;
  {
    NoGradGuard no_grad;
    out = mul(a, mask);
  }
  if (autograd::needs_grad({&a})) {
    auto node = std::make_shared<DropoutBackward>();
    node->mask = mask;
    autograd::attach(out, node, {&a});
  }
  return out;
}

}  // namespace dtrain::ops
