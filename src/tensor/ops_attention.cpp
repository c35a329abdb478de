// Fused causal self-attention.
//
// Vocabulary: qkv (B, T, 3C) holds, per position, the query, key and value vectors of all
// heads side by side: q = qkv[..., 0:C], k = qkv[..., C:2C], v = qkv[..., 2C:3C]; head h
// owns columns [h*hd, (h+1)*hd) of each, hd = C / H. Per (b, h):
//   S = scale * Q K^T (T, T), scale = 1/sqrt(hd); S[i][j] = -inf for j > i (causal mask)
//   P = softmax(S) row-wise; O = P V (T, hd), written into out[b, :, h*hd:(h+1)*hd].
// Heads are read in place with leading dimension 3C, so no head is ever copied out. P is
// saved (B, H, T, T) for the backward pass:
//   dP = dO V^T; dS = P * (dP - rowsum(dP * P)); dQ = scale dS K; dK = scale dS^T Q; dV = P^T dO.
// With bf16 products, qkv and dO are rounded to bf16 once (qkv is kept in bf16 for the backward),
// and P and dS per head just before their products; softmax and its gradient stay f32.
#include <cmath>
#include <vector>

#include "dtrain/core/error.h"
#include "dtrain/tensor/autograd.h"
#include "dtrain/tensor/gemm.h"
#include "dtrain/tensor/kernels.h"
#include "dtrain/tensor/ops.h"
#include "dtrain/tensor/profile.h"

namespace dtrain::ops {

namespace {

// An operand of one of the attention's products: f32 values, or values already rounded to bf16
// (bf16 products), with its row stride.
struct Operand {
  const float* f32 = nullptr;
  const uint16_t* bf16 = nullptr;
  int64_t ld = 0;
  Operand(const float* p, int64_t stride) : f32(p), ld(stride) {}
  Operand(const uint16_t* p, int64_t stride) : bf16(p), ld(stride) {}
};

const uint16_t* bits(const Tensor& t) { return static_cast<const uint16_t*>(t.raw_data()); }

// C (M, N) = alpha op(A) op(B): sgemm on f32 operands, gemm_bf16 on bf16 ones.
void product(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const Operand& a, const Operand& b,
             float* c, int64_t ldc) {
  if (a.bf16 != nullptr) {
    gemm_bf16(ta, tb, m, n, k, alpha, a.bf16, a.ld, b.bf16, b.ld, 0.0f, c, ldc);
  } else {
    sgemm(ta, tb, m, n, k, alpha, a.f32, a.ld, b.f32, b.ld, 0.0f, c, ldc);
  }
}

// A head's (T, T) probabilities (or their gradient) as an operand: as they are, or rounded into
// `rounded` when it has room (bf16 products).
Operand probabilities(const float* p, int64_t t, std::vector<uint16_t>& rounded) {
  if (rounded.empty()) return {p, t};
  kernels::table().round_to_bf16(p, t, t, t, rounded.data());
  return {rounded.data(), t};
}

struct AttentionBackward : Node {
  Tensor qkv;  // (B, T, 3C) contiguous: f32, or bf16 under bf16 products
  Tensor att;  // (B, H, T, T) probabilities
  int64_t b_size, t_size, c_size, n_head;
  std::vector<Tensor> apply(const Tensor& g_in) override {
    Tensor g = g_in.contiguous();  // (B, T, C)
    const int64_t T = t_size, C = c_size, H = n_head, hd = C / H;
    const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
    Tensor dqkv = Tensor::empty({b_size, T, 3 * C});
    std::vector<float> dp(static_cast<size_t>(T * T));
    const kernels::Table& kern = kernels::table();
    const bool bf16 = qkv.dtype() == DType::bf16;
    const Tensor g16 = bf16 ? g.to(DType::bf16) : Tensor();
    std::vector<uint16_t> rounded(bf16 ? static_cast<size_t>(T * T) : 0);
    auto heads = [&](int64_t offset) {
      return bf16 ? Operand{bits(qkv) + offset, 3 * C} : Operand{qkv.data() + offset, 3 * C};
    };
    auto grads = [&](int64_t offset) { return bf16 ? Operand{bits(g16) + offset, C} : Operand{g.data() + offset, C}; };
    const float* pa = att.data();
    float* pd = dqkv.data();
    for (int64_t b = 0; b < b_size; ++b) {
      for (int64_t h = 0; h < H; ++h) {
        const int64_t q = b * T * 3 * C + h * hd;  // offsets of Q, K = q + C, V = q + 2C (and of dQ, dK, dV)
        const int64_t go = b * T * C + h * hd;
        const float* p = pa + (b * H + h) * T * T;
        // dP = dO V^T
        product(false, true, T, T, hd, 1.0f, grads(go), heads(q + 2 * C), dp.data(), T);
        // dS = P * (dP - rowsum(dP * P)), in place in dp; masked entries have P = 0.
        for (int64_t i = 0; i < T; ++i) kern.causal_softmax_backward_row(p + i * T, dp.data() + i * T, i + 1, T);
        const Operand ds = probabilities(dp.data(), T, rounded);
        product(false, false, T, hd, T, scale, ds, heads(q + C), pd + q, 3 * C);
        product(true, false, T, hd, T, scale, ds, heads(q), pd + q + C, 3 * C);
        product(true, false, T, hd, T, 1.0f, probabilities(p, T, rounded), grads(go), pd + q + 2 * C, 3 * C);
      }
    }
    return {dqkv};
  }
  void release() override { qkv = att = Tensor(); }
  const char* name() const override { return "causal_attention"; }
  profile::Kind profile_kind() const override { return profile::Kind::attention; }
};

}  // namespace

Tensor causal_attention(const Tensor& qkv_in, int64_t n_head) {
  profile::Scope scope(profile::Kind::attention);
  DT_CHECK(qkv_in.defined(), "tensor", "causal_attention: qkv is undefined");
  DT_CHECK(qkv_in.dtype() == DType::f32, "tensor", "causal_attention: qkv {} is {}, expected f32",
           shape_str(qkv_in.shape()), dtype_name(qkv_in.dtype()));
  DT_CHECK(qkv_in.dim() == 3 && qkv_in.size(2) % 3 == 0, "tensor", "causal_attention: qkv must be (B, T, 3C), got {}",
           shape_str(qkv_in.shape()));
  const int64_t B = qkv_in.size(0), T = qkv_in.size(1), C = qkv_in.size(2) / 3;
  DT_CHECK(n_head > 0 && C % n_head == 0, "tensor", "causal_attention: width {} not divisible by {} heads", C, n_head);
  const int64_t H = n_head, hd = C / H;
  const float scale = hd > 0 ? 1.0f / std::sqrt(static_cast<float>(hd)) : 1.0f;
  Tensor qkv = qkv_in.detach().contiguous();
  Tensor out = Tensor::empty({B, T, C});
  Tensor att = Tensor::empty({B, H, T, T});
  const float* pq = qkv.data();
  float* po = out.data();
  float* pa = att.data();
  const kernels::Table& kern = kernels::table();
  // bf16 products: qkv rounded once (and kept for the backward instead of its f32 values), P per head.
  const bool bf16 = matmul_precision() == Precision::bf16;
  const Tensor qkv16 = bf16 ? qkv.to(DType::bf16) : Tensor();
  std::vector<uint16_t> p16(bf16 ? static_cast<size_t>(T * T) : 0);
  auto heads = [&](int64_t offset) {
    return bf16 ? Operand{bits(qkv16) + offset, 3 * C} : Operand{pq + offset, 3 * C};
  };
  for (int64_t b = 0; b < B && T > 0 && hd > 0; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      const int64_t q = b * T * 3 * C + h * hd;  // offsets of Q, K = q + C, V = q + 2C
      float* p = pa + (b * H + h) * T * T;
      product(false, true, T, T, hd, scale, heads(q), heads(q + C), p, T);
      for (int64_t i = 0; i < T; ++i) kern.causal_softmax_row(p + i * T, i + 1, T);
      product(false, false, T, hd, T, 1.0f, probabilities(p, T, p16), heads(q + 2 * C), po + b * T * C + h * hd, C);
    }
  }
  if (hd == 0 || T == 0) out.fill_(0.0f);
  if (autograd::needs_grad({&qkv_in})) {
    auto node = std::make_shared<AttentionBackward>();
    node->qkv = bf16 ? qkv16 : qkv;
    node->att = att;
    node->b_size = B;
    node->t_size = T;
    node->c_size = C;
    node->n_head = H;
    autograd::attach(out, node, {&qkv_in});
  }
  return out;
}

}  // namespace dtrain::ops
