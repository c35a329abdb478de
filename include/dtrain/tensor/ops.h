// Differentiable operations on f32 tensors. Every op checks its inputs and throws
// dtrain::Error naming the op and the shapes involved.
#pragma once

#include <vector>

#include "dtrain/tensor/tensor.h"

namespace dtrain {

class Generator;

namespace ops {

// ---- elementwise, with NumPy broadcasting ----
Tensor add(const Tensor& a, const Tensor& b);
Tensor sub(const Tensor& a, const Tensor& b);
Tensor mul(const Tensor& a, const Tensor& b);
Tensor div(const Tensor& a, const Tensor& b);
Tensor add_scalar(const Tensor& a, float s);
Tensor mul_scalar(const Tensor& a, float s);
Tensor neg(const Tensor& a);
Tensor relu(const Tensor& a);
/// tanh approximation, as GPT-2. `out` f32, or bf16 for a bf16 product's input (linear under
/// --precision bf16): the f32 values rounded to nearest even, as Tensor::to gives them, without
/// an f32 copy written out and read back. The same holds for layer_norm and causal_attention.
Tensor gelu(const Tensor& a, DType out = DType::f32);
Tensor tanh(const Tensor& a);
Tensor exp(const Tensor& a);
Tensor log(const Tensor& a);
Tensor square(const Tensor& a);
Tensor sqrt(const Tensor& a);

/// Shape of broadcasting a with b; throws naming both shapes when incompatible.
Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op);
/// Sums grad (shape broadcast_shape) down to `shape` (no autograd).
Tensor sum_to(const Tensor& grad, const Shape& shape);

// ---- reductions ----
/// Sum over `dims` (negative counts from the end; empty = all dims).
Tensor sum(const Tensor& a, const std::vector<int64_t>& dims = {}, bool keepdim = false);
Tensor mean(const Tensor& a, const std::vector<int64_t>& dims = {}, bool keepdim = false);

// ---- linear algebra ----
/// a (..., M, K) x b (K, N) or b (..., K, N) with the same leading dims -> (..., M, N).
Tensor matmul(const Tensor& a, const Tensor& b);
/// x (..., in) W (out, in)^T + bias (out) -> (..., out). bias may be undefined. Under bf16
/// products x may be bf16 already (the products round it anyway); its gradient is f32. `out` bf16:
/// the f32 results rounded to nearest even (under bf16 products by the product itself, which
/// flushes f32 denormals to zero), for a result only read as a bf16 operand (the attention's qkv).
Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias, DType out = DType::f32);
/// gelu(linear(x, weight, bias), out) as one op, the same bits: under bf16 products its backward
/// rounds GELU's gradient for the products and sums the bias's in one pass, in registers.
Tensor linear_gelu(const Tensor& x, const Tensor& weight, const Tensor& bias, DType out = DType::f32);
/// add(residual, linear(x, weight, bias)) as one op, the same bits: a residual connection whose
/// product adds the residual (f32, the output's shape) as it writes its result, on oneDNN in the
/// same epilogue as the bias, instead of a second pass over both.
Tensor linear_residual(const Tensor& x, const Tensor& weight, const Tensor& bias, const Tensor& residual);

// ---- neural-network ops (over the last dimension) ----
Tensor softmax(const Tensor& a);
Tensor log_softmax(const Tensor& a);
/// Mean cross-entropy of logits (N, C) against integer class targets (N) stored as f32.
Tensor cross_entropy(const Tensor& logits, const Tensor& targets);
Tensor layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, float eps = 1e-5f, DType out = DType::f32);
/// Rows of weight (V, C) picked by integer ids stored as f32 (any shape S) -> (S..., C).
Tensor embedding(const Tensor& weight, const Tensor& ids);
/// Fused causal self-attention: qkv (B, T, 3C) laid out [q | k | v], n_head heads -> (B, T, C).
/// qkv f32, or bf16 where its products are bf16 (attention_products_bf16: they would round it).
Tensor causal_attention(const Tensor& qkv, int64_t n_head, DType out = DType::f32);
/// Rows per causal block of causal_attention (64): its products skip the masked part block by
/// block. Settable for tests (small blocks on small inputs); not thread-safe.
int64_t attention_block_rows();
void set_attention_block_rows(int64_t rows);
/// Under --precision bf16, causal_attention's products are bf16 from this head dimension (C / H)
/// up and f32 below it. With dtrain's own kernel (attention_bf16_kernel()) that is every head
/// dimension (1): measured on the byte GPT (AMD EPYC, AVX512_BF16, head dimension 32), 4-10%
/// faster per step than f32 attention products. Without it, 128: block by block through a library
/// product each, a bf16 product's fixed costs (rounding, packing, oneDNN's call) outweigh its
/// faster arithmetic on small heads (head dimension 32: f32 11% faster per step; 64: 2%; 128: bf16
/// 4% faster). Settable for tests (0: back to the default); not thread-safe.
int64_t attention_bf16_min_head_dim();
void set_attention_bf16_min_head_dim(int64_t head_dim);
/// Whether causal_attention's products at this head dimension are bf16 now: --precision bf16 and
/// head_dim >= attention_bf16_min_head_dim().
bool attention_products_bf16(int64_t head_dim);
/// Whether causal_attention's products run on dtrain's own kernels (tensor/dot_tiles.h: 8-row
/// tiles whose scores, softmax and product with V run in one pass) rather than a library product
/// per head and causal block: f32 where the kernels' instruction set is AVX-512, bf16 where the
/// CPU also has AVX512_BF16; unless tests turned them off. Settable for tests; not thread-safe.
bool attention_f32_kernel();
bool attention_bf16_kernel();
void set_attention_kernels(bool enabled);
/// Where causal_attention's products at this head dimension run now, for logs and metrics:
/// "dtrain's AVX512_BF16 kernel", "the bf16 product route (block by block)" or "f32".
const char* attention_bf16_route(int64_t head_dim);
/// Zeroes elements with probability p and scales the rest by 1/(1-p); identity if !training.
Tensor dropout(const Tensor& a, float p, bool training, Generator& gen);

}  // namespace ops

/// Threads used by BLAS (and future parallel kernels) in this process.
void set_num_threads(int threads);

}  // namespace dtrain
