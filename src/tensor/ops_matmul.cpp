// Matrix products (batched matmul and linear) with gradients, on dtrain::sgemm (gemm.h).
#include <algorithm>

#include "bf16_out.h"
#include "dtrain/core/error.h"
#include "dtrain/tensor/autograd.h"
#include "dtrain/tensor/gemm.h"
#include "dtrain/tensor/kernels.h"
#include "dtrain/tensor/ops.h"
#include "dtrain/tensor/profile.h"

namespace dtrain::ops {

namespace {

// C (M, N) = alpha * op(A) op(B) + beta * C, row-major, contiguous operands.
void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a, const float* b, float beta,
          float* c) {
  sgemm(ta, tb, m, n, k, alpha, a, std::max<int64_t>(1, ta ? m : k), b, std::max<int64_t>(1, tb ? k : n), beta, c,
        std::max<int64_t>(1, n));
}

void check_f32(const Tensor& t, const char* op, const char* what) {
  DT_CHECK(t.defined(), "tensor", "{}: {} is undefined", op, what);
  DT_CHECK(t.dtype() == DType::f32, "tensor", "{}: {} is {}, expected f32", op, what, dtype_name(t.dtype()));
}

// Batched product of contiguous a (batch, M, K) and b (batch or 1, K, N), optional transposes.
Tensor bmm_kernel(const Tensor& a, bool ta, const Tensor& b, bool tb, int64_t batch, int64_t m, int64_t n, int64_t k,
                  bool b_shared) {
  Tensor out = Tensor::empty({batch, m, n});
  const float* pa = a.data();
  const float* pb = b.data();
  float* po = out.data();
  for (int64_t i = 0; i < batch; ++i) {
    gemm(ta, tb, m, n, k, 1.0f, pa + i * m * k, pb + (b_shared ? 0 : i * k * n), 0.0f, po + i * m * n);
  }
  return out;
}

struct MatmulBackward : Node {
  Tensor a, b;  // contiguous (batch, M, K) and (K, N) or (batch, K, N)
  Shape a_shape, b_shape;
  int64_t batch, m, n, k;
  bool b_shared;
  std::vector<Tensor> apply(const Tensor& g_in) override {
    Tensor g = g_in.contiguous();
    Tensor ga, gb;
    if (next[0]) {
      // dA (batch, M, K) = g (batch, M, N) B^T
      ga = Tensor::empty({batch, m, k});
      for (int64_t i = 0; i < batch; ++i) {
        gemm(false, true, m, k, n, 1.0f, g.data() + i * m * n, b.data() + (b_shared ? 0 : i * k * n), 0.0f,
             ga.data() + i * m * k);
      }
      ga = ga.reshape(a_shape);
    }
    if (next[1]) {
      if (b_shared) {
        // dB (K, N) = A^T g with the batch folded into rows.
        gb = Tensor::empty({k, n});
        gemm(true, false, k, n, batch * m, 1.0f, a.data(), g.data(), 0.0f, gb.data());
      } else {
        gb = Tensor::empty({batch, k, n});
        for (int64_t i = 0; i < batch; ++i) {
          gemm(true, false, k, n, m, 1.0f, a.data() + i * m * k, g.data() + i * m * n, 0.0f, gb.data() + i * k * n);
        }
      }
      gb = gb.reshape(b_shape);
    }
    return {ga, gb};
  }
  void release() override { a = b = Tensor(); }
  const char* name() const override { return "matmul"; }
  profile::Kind profile_kind() const override { return profile::Kind::linear; }
};

const uint16_t* bf16_bits(const Tensor& t) { return static_cast<const uint16_t*>(t.raw_data()); }

// C (M, N) = op(A) op(B) from bf16 operands, contiguous: gemm's layout with gemm_bf16.
void gemm_bf16_packed(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const Tensor& a, const Tensor& b, float beta,
                      float* c) {
  gemm_bf16(ta, tb, m, n, k, 1.0f, bf16_bits(a), std::max<int64_t>(1, ta ? m : k), bf16_bits(b),
            std::max<int64_t>(1, tb ? k : n), beta, c, std::max<int64_t>(1, n));
}

// With --precision bf16 the forward rounds x and W to bf16 once and keeps those copies (not the
// f32 ones) for the backward, which rounds the output gradient once for both of its products.
struct LinearBackward : Node {
  Tensor x, w;  // x (M, in) contiguous, w (out, in): f32, or bf16 under bf16 products
  Shape x_shape;
  int64_t m, in, out;
  std::vector<Tensor> apply(const Tensor& g_in) override { return grads(g_in.contiguous(), Tensor(), Tensor()); }
  // The gradients from g (M, out), f32; under bf16 products g16 (its rounding) and gb (the bias's
  // gradient) may come made already, and then g is not read (LinearGeluBackward).
  std::vector<Tensor> grads(const Tensor& g, Tensor g16, Tensor gb) {
    Tensor gx, gw;
    const bool bf16 = x.dtype() == DType::bf16;
    const bool bias = next.size() > 2 && next[2];
    if (bf16 && (next[0] || next[1]) && !g16.defined()) {
      if (bias) {  // the bias's gradient summed in the same read of g as its rounding
        g16 = Tensor::empty({m, out}, DType::bf16);
        gb = autograd::gradient_buffer(next[2], {out});
        kernels::table().round_to_bf16_sum_rows(g.data(), m, out, static_cast<uint16_t*>(g16.raw_data()), gb.data());
      } else {
        g16 = g.to(DType::bf16);
      }
    }
    if (next[0]) {
      gx = Tensor::empty({m, in});
      if (bf16) {
        gemm_bf16_packed(false, false, m, in, out, g16, w, 0.0f, gx.data());
      } else {
        gemm(false, false, m, in, out, 1.0f, g.data(), w.data(), 0.0f, gx.data());
      }
      gx = gx.reshape(x_shape);
    }
    if (next[1]) {
      gw = autograd::gradient_buffer(next[1], {out, in});
      if (bf16) {
        gemm_bf16_packed(true, false, out, in, m, g16, x, 0.0f, gw.data());
      } else {
        gemm(true, false, out, in, m, 1.0f, g.data(), x.data(), 0.0f, gw.data());
      }
    }
    if (bias && !gb.defined()) {
      gb = autograd::gradient_buffer(next[2], {out});
      kernels::table().sum_rows(g.data(), gb.data(), m, out);
    }
    return {gx, gw, gb};
  }
  void release() override { x = w = Tensor(); }
  const char* name() const override { return "linear"; }
  profile::Kind profile_kind() const override { return profile::Kind::linear; }
};

// gelu(linear(x)) as one node, so that under bf16 products GELU's gradient is rounded for the
// products and summed for the bias in registers (gelu_backward_bf16), never written out in f32.
struct LinearGeluBackward : LinearBackward {
  Tensor h;  // the pre-activation x W^T + b (M, out), f32
  std::vector<Tensor> apply(const Tensor& g_in) override {
    const Tensor g = g_in.contiguous();
    const kernels::Table& kern = kernels::table();
    if (x.dtype() != DType::bf16) {
      Tensor dh = Tensor::empty({m, out});
      {
        profile::Scope scope(profile::Kind::gelu);
        kern.gelu_backward(h.data(), g.data(), dh.data(), m * out);
      }
      return grads(dh, Tensor(), Tensor());
    }
    Tensor g16 = Tensor::empty({m, out}, DType::bf16);
    Tensor gb;
    if (next.size() > 2 && next[2]) {  // sum_rows' order: zeros, then row after row
      gb = autograd::gradient_buffer(next[2], {out});
      gb.fill_(0.0f);
    }
    {  // GELU's gradient rounded and summed for the bias in registers, never written in f32
      profile::Scope scope(profile::Kind::gelu);
      kern.gelu_backward_bf16(h.data(), g.data(), m, out, static_cast<uint16_t*>(g16.raw_data()),
                              gb.defined() ? gb.data() : nullptr);
    }
    return grads(Tensor(), g16, gb);
  }
  void release() override {
    LinearBackward::release();
    h = Tensor();
  }
  const char* name() const override { return "linear_gelu"; }
};

// residual + linear(x) as one node: the residual's gradient is the output's, as add's backward
// passes it on.
struct LinearResidualBackward : LinearBackward {
  std::vector<Tensor> apply(const Tensor& g_in) override {
    std::vector<Tensor> out = grads(g_in.contiguous(), Tensor(), Tensor());
    out.push_back(next[3] ? g_in : Tensor());
    return out;
  }
  const char* name() const override { return "linear_residual"; }
};

// x W^T + b: the operands checked, rounded and kept as LinearBackward wants them.
struct LinearProduct {
  Tensor x, w, b;  // x, w contiguous (bf16 under bf16 products); b the bias, contiguous, or undefined
  int64_t m = 0, in = 0, out_f = 0;
  bool bf16 = false;  // bf16 products
};

LinearProduct linear_operands(const Tensor& x_in, const Tensor& weight, const Tensor& bias);

// The node's inputs: x, the weight, the bias if any [and the residual, with the bias's slot
// empty where there is none].
template <typename Node>
void attach_linear(const std::shared_ptr<Node>& node, const LinearProduct& p, Tensor& out, const Tensor& x_in,
                   const Tensor& weight, const Tensor& bias, const Tensor* residual = nullptr) {
  node->x = p.x;
  node->w = p.w;
  node->x_shape = x_in.shape();
  node->m = p.m;
  node->in = p.in;
  node->out = p.out_f;
  if (residual != nullptr) {
    autograd::attach(out, node, {&x_in, &weight, bias.defined() ? &bias : nullptr, residual});
  } else if (bias.defined()) {
    autograd::attach(out, node, {&x_in, &weight, &bias});
  } else {
    autograd::attach(out, node, {&x_in, &weight});
  }
}

}  // namespace

Tensor matmul(const Tensor& a_in, const Tensor& b_in) {
  profile::Scope scope(profile::Kind::linear);
  check_f32(a_in, "matmul", "left operand");
  check_f32(b_in, "matmul", "right operand");
  DT_CHECK(a_in.dim() >= 2 && b_in.dim() >= 2, "tensor", "matmul: operands need at least 2 dims, got {} and {}",
           shape_str(a_in.shape()), shape_str(b_in.shape()));
  const int64_t m = a_in.size(-2);
  const int64_t k = a_in.size(-1);
  const int64_t n = b_in.size(-1);
  DT_CHECK(b_in.size(-2) == k, "tensor", "matmul: shapes {} and {} do not match (inner dims {} vs {})",
           shape_str(a_in.shape()), shape_str(b_in.shape()), k, b_in.size(-2));
  const bool b_shared = b_in.dim() == 2;
  if (!b_shared) {
    DT_CHECK(a_in.dim() == b_in.dim() && std::equal(a_in.shape().begin(), a_in.shape().end() - 2, b_in.shape().begin()),
             "tensor", "matmul: batch dimensions of {} and {} differ", shape_str(a_in.shape()),
             shape_str(b_in.shape()));
  }
  int64_t batch_dims = 1;
  for (int64_t i = 0; i < a_in.dim() - 2; ++i) batch_dims *= a_in.shape()[i];
  Tensor a = a_in.detach().contiguous();
  Tensor b = b_in.detach().contiguous();
  Tensor out = b_shared ? bmm_kernel(a, false, b, false, 1, batch_dims * m, n, k, true)
                        : bmm_kernel(a, false, b, false, batch_dims, m, n, k, false);
  Shape out_shape = a_in.shape();
  out_shape.back() = n;
  out = out.reshape(out_shape);
  if (autograd::needs_grad({&a_in, &b_in})) {
    auto node = std::make_shared<MatmulBackward>();
    node->a = a;
    node->b = b;
    node->a_shape = a_in.shape();
    node->b_shape = b_in.shape();
    node->batch = b_shared ? 1 : batch_dims;
    node->m = b_shared ? batch_dims * m : m;
    node->n = n;
    node->k = k;
    node->b_shared = b_shared;
    autograd::attach(out, node, {&a_in, &b_in});
  }
  return out;
}

namespace {

LinearProduct linear_operands(const Tensor& x_in, const Tensor& weight, const Tensor& bias) {
  const bool bf16 = matmul_precision() == Precision::bf16;
  if (x_in.defined() && x_in.dtype() == DType::bf16) {  // the rounding the bf16 product does anyway
    DT_CHECK(bf16, "tensor", "linear: input {} is bf16, which needs bf16 products (--precision bf16)",
             shape_str(x_in.shape()));
  } else {
    check_f32(x_in, "linear", "input");
  }
  check_f32(weight, "linear", "weight");
  DT_CHECK(weight.dim() == 2, "tensor", "linear: weight must be (out, in), got {}", shape_str(weight.shape()));
  DT_CHECK(x_in.dim() >= 1 && x_in.size(-1) == weight.size(1), "tensor",
           "linear: input {} does not match weight {} (expected last dim {})", shape_str(x_in.shape()),
           shape_str(weight.shape()), weight.size(1));
  LinearProduct p;
  p.in = weight.size(1);
  p.out_f = weight.size(0);
  if (bias.defined()) {
    check_f32(bias, "linear", "bias");
    DT_CHECK(bias.dim() == 1 && bias.size(0) == p.out_f, "tensor", "linear: bias {} does not match weight {}",
             shape_str(bias.shape()), shape_str(weight.shape()));
    p.b = bias.detach().contiguous();
  }
  p.m = p.in == 0 ? shape_numel(Shape(x_in.shape().begin(), x_in.shape().end() - 1)) : x_in.numel() / p.in;
  p.x = x_in.detach().contiguous();
  p.w = weight.detach().contiguous();
  p.bf16 = bf16;
  if (bf16) {
    if (p.x.dtype() != DType::bf16) p.x = p.x.to(DType::bf16);
    p.w = p.w.to(DType::bf16);
  }
  return p;
}

// x W^T + b [+ residual, added last] into out (M, out), f32; the bias (and the residual) added by
// the product itself (gemm.h's sgemm_bias and gemm_bf16_bias).
void linear_f32(const LinearProduct& p, float* out, const float* residual = nullptr) {
  const int64_t lx = std::max<int64_t>(1, p.in);
  if (p.bf16) {
    if (p.b.defined()) {
      gemm_bf16_bias(false, true, p.m, p.out_f, p.in, bf16_bits(p.x), lx, bf16_bits(p.w), lx, p.b.data(), out,
                     residual);
      return;
    }
    gemm_bf16_packed(false, true, p.m, p.out_f, p.in, p.x, p.w, 0.0f, out);
  } else if (p.b.defined()) {
    sgemm_bias(false, true, p.m, p.out_f, p.in, p.x.data(), lx, p.w.data(), lx, p.b.data(), out, residual);
    return;
  } else {
    gemm(false, true, p.m, p.out_f, p.in, 1.0f, p.x.data(), p.w.data(), 0.0f, out);
  }
  // No bias: the product's C, then the residual added as add would (the same sum either way round).
  if (residual != nullptr) kernels::table().add_into(out, residual, p.m * p.out_f);
}

Shape linear_shape(const Tensor& x_in, int64_t out_f) {
  Shape s = x_in.shape();
  s.back() = out_f;
  return s;
}

}  // namespace

Tensor linear(const Tensor& x_in, const Tensor& weight, const Tensor& bias, DType out_dtype) {
  profile::Scope scope(profile::Kind::linear);
  detail::check_out_dtype(out_dtype, "linear");
  LinearProduct p = linear_operands(x_in, weight, bias);
  Tensor out;
  if (out_dtype == DType::bf16 && p.bf16) {  // rounded in oneDNN's epilogue where it can (gemm.h)
    out = Tensor::empty({p.m, p.out_f}, DType::bf16);
    gemm_bf16_to_bf16(false, true, p.m, p.out_f, p.in, bf16_bits(p.x), std::max<int64_t>(1, p.in), bf16_bits(p.w),
                      std::max<int64_t>(1, p.in), p.b.defined() ? p.b.data() : nullptr,
                      static_cast<uint16_t*>(out.raw_data()));
  } else {
    out = Tensor::empty({p.m, p.out_f});
    linear_f32(p, out.data());
    if (out_dtype == DType::bf16) out = out.to(DType::bf16);  // f32 products, their results rounded
  }
  out = out.reshape(linear_shape(x_in, p.out_f));
  if (autograd::needs_grad({&x_in, &weight, &bias})) {
    attach_linear(std::make_shared<LinearBackward>(), p, out, x_in, weight, bias);
  }
  return out;
}

Tensor linear_gelu(const Tensor& x_in, const Tensor& weight, const Tensor& bias, DType out_dtype) {
  profile::Scope scope(profile::Kind::linear);
  detail::check_out_dtype(out_dtype, "linear_gelu");
  LinearProduct p = linear_operands(x_in, weight, bias);
  Tensor h = Tensor::empty({p.m, p.out_f});  // the pre-activation, kept for the backward
  linear_f32(p, h.data());
  Tensor out = Tensor::empty(linear_shape(x_in, p.out_f), out_dtype);
  {
    profile::Scope gelu_scope(profile::Kind::gelu);
    detail::gelu_into(h.data(), out);
  }
  if (autograd::needs_grad({&x_in, &weight, &bias})) {
    auto node = std::make_shared<LinearGeluBackward>();
    node->h = h;
    attach_linear(node, p, out, x_in, weight, bias);
  }
  return out;
}

Tensor linear_residual(const Tensor& x_in, const Tensor& weight, const Tensor& bias, const Tensor& residual) {
  profile::Scope scope(profile::Kind::linear);
  LinearProduct p = linear_operands(x_in, weight, bias);
  check_f32(residual, "linear_residual", "residual");
  const Shape shape = linear_shape(x_in, p.out_f);
  DT_CHECK(residual.shape() == shape, "tensor", "linear_residual: residual {} does not match the output {}",
           shape_str(residual.shape()), shape_str(shape));
  const Tensor r = residual.detach().contiguous();
  Tensor out = Tensor::empty({p.m, p.out_f});
  linear_f32(p, out.data(), r.data());
  out = out.reshape(shape);
  if (autograd::needs_grad({&x_in, &weight, &bias, &residual})) {
    attach_linear(std::make_shared<LinearResidualBackward>(), p, out, x_in, weight, bias, &residual);
  }
  return out;
}

}  // namespace dtrain::ops
