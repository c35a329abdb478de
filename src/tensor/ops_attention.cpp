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
#include <cmath>

#include "dtrain/core/error.h"
#include "dtrain/tensor/autograd.h"
#include "dtrain/tensor/gemm.h"
#include "dtrain/tensor/kernels.h"
#include "dtrain/tensor/ops.h"
#include "dtrain/tensor/profile.h"

namespace dtrain::ops {

namespace {

struct AttentionBackward : Node {
  Tensor qkv;  // (B, T, 3C) contiguous
  Tensor att;  // (B, H, T, T) probabilities
  int64_t b_size, t_size, c_size, n_head;
  std::vector<Tensor> apply(const Tensor& g_in) override {
    Tensor g = g_in.contiguous();  // (B, T, C)
    const int64_t T = t_size, C = c_size, H = n_head, hd = C / H;
    const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
    Tensor dqkv = Tensor::empty({b_size, T, 3 * C});
    std::vector<float> dp(static_cast<size_t>(T * T));
    const kernels::Table& kern = kernels::table();
    const float* pq = qkv.data();
    const float* pg = g.data();
    const float* pa = att.data();
    float* pd = dqkv.data();
    for (int64_t b = 0; b < b_size; ++b) {
      for (int64_t h = 0; h < H; ++h) {
        const float* q = pq + b * T * 3 * C + h * hd;
        const float* k = q + C;
        const float* v = q + 2 * C;
        const float* go = pg + b * T * C + h * hd;
        const float* p = pa + (b * H + h) * T * T;
        float* dq = pd + b * T * 3 * C + h * hd;
        float* dk = dq + C;
        float* dv = dq + 2 * C;
        // dP = dO V^T
        sgemm(false, true, T, T, hd, 1.0f, go, C, v, 3 * C, 0.0f, dp.data(), T);
        // dS = P * (dP - rowsum(dP * P)), in place in dp; masked entries have P = 0.
        for (int64_t i = 0; i < T; ++i) kern.causal_softmax_backward_row(p + i * T, dp.data() + i * T, i + 1, T);
        sgemm(false, false, T, hd, T, scale, dp.data(), T, k, 3 * C, 0.0f, dq, 3 * C);
        sgemm(true, false, T, hd, T, scale, dp.data(), T, q, 3 * C, 0.0f, dk, 3 * C);
        sgemm(true, false, T, hd, T, 1.0f, p, T, go, C, 0.0f, dv, 3 * C);
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
  for (int64_t b = 0; b < B && T > 0 && hd > 0; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      const float* q = pq + b * T * 3 * C + h * hd;
      const float* k = q + C;
      const float* v = q + 2 * C;
      float* p = pa + (b * H + h) * T * T;
      sgemm(false, true, T, T, hd, scale, q, 3 * C, k, 3 * C, 0.0f, p, T);
      for (int64_t i = 0; i < T; ++i) kern.causal_softmax_row(p + i * T, i + 1, T);
      sgemm(false, false, T, hd, T, 1.0f, p, T, v, 3 * C, 0.0f, po + b * T * C + h * hd, C);
    }
  }
  if (hd == 0 || T == 0) out.fill_(0.0f);
  if (autograd::needs_grad({&qkv_in})) {
    auto node = std::make_shared<AttentionBackward>();
    node->qkv = qkv;
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
