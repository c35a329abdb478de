// The memory-bound kernels behind the ops and the optimizer (layer norm, softmax, cross-entropy,
// GELU, attention's softmax, AdamW, gradient sums, bf16 rounding), vectorised.
//
// One source (src/tensor/kernels_impl.h) is compiled once per instruction set: AVX-512 with
// AVX512_BF16 (the same bits as AVX-512, bf16 rounding in one instruction), AVX-512, AVX2+FMA
// and the build's own flags. The widest one this CPU runs is picked at the first call, capped by
// DTRAIN_KERNELS_ISA or, when that is unset, ONEDNN_MAX_CPU_ISA (avx512 or avx512_core: AVX-512
// without bf16, the attention's bf16 kernel included; avx2: the AVX2 build; sse41 or avx: the
// build's flags), so that one switch holds oneDNN and these kernels to a smaller CPU and the AVX2
// path can be tested on an AVX-512 machine. Sums over a row run in vector lanes, so the last bits
// of a result depend on the instruction set (as oneDNN's and OpenBLAS's do).
#pragma once

#include <cstdint>
#include <string_view>

namespace dtrain::kernels {

struct Table {
  const char* isa;  // "avx512", "avx2", "build" (the build's own flags)

  /// Layer norm of rows (rows, c): y = (x - mean) * rstd * w + b; mean and rstd per row.
  void (*layer_norm_forward)(const float* x, const float* w, const float* b, float* y, float* mean, float* rstd,
                             int64_t rows, int64_t c, float eps);
  /// The same with y written as bf16 (round_to_bf16's bits of its f32 y) without an f32 copy: the
  /// input of a bf16 product.
  void (*layer_norm_forward_bf16)(const float* x, const float* w, const float* b, uint16_t* y, float* mean, float* rstd,
                                  int64_t rows, int64_t c, float eps);
  /// Its gradient: gx (rows, c) written, gw and gb (c) accumulated into.
  void (*layer_norm_backward)(const float* x, const float* w, const float* g, const float* mean, const float* rstd,
                              float* gx, float* gw, float* gb, int64_t rows, int64_t c);
  /// Row-wise softmax (log_space: log-softmax) of (rows, n), and its gradient from the output y.
  void (*softmax_forward)(const float* x, float* y, int64_t rows, int64_t n, bool log_space);
  void (*softmax_backward)(const float* y, const float* g, float* gx, int64_t rows, int64_t n, bool log_space);
  /// Cross-entropy: probs (n, c) = softmax(x); returns the sum over rows of -log p[target].
  double (*cross_entropy_forward)(const float* x, const int32_t* targets, float* probs, int64_t n, int64_t c);
  /// Its gradient: (probs - onehot(target)) * scale.
  void (*cross_entropy_backward)(const float* probs, const int32_t* targets, float scale, float* gx, int64_t n,
                                 int64_t c);
  /// GELU (tanh form) and its gradient g * gelu'(x).
  void (*gelu_forward)(const float* x, float* y, int64_t n);
  void (*gelu_backward)(const float* x, const float* g, float* gx, int64_t n);
  /// The same written as bf16 (round_to_bf16's bits) without an f32 copy: GELU's output for a
  /// bf16 product; and the gradient of rows x n for the fc layer's bf16 products, with its column
  /// sums added into sums (sum_rows' order, row after row) where sums is not null.
  void (*gelu_forward_bf16)(const float* x, uint16_t* y, int64_t n);
  void (*gelu_backward_bf16)(const float* x, const float* g, int64_t rows, int64_t n, uint16_t* gx, float* sums);
  /// Causal attention's softmax of one score row in place: entries [0, len) normalised, the
  /// rest [len, t) zeroed; and the backward of a row, dS = P * (dP - sum(dP * P)), in place.
  void (*causal_softmax_row)(float* row, int64_t len, int64_t t);
  void (*causal_softmax_backward_row)(const float* p, float* dp, int64_t len, int64_t t);
  /// dst += src.
  void (*add_into)(float* dst, const float* src, int64_t n);
  /// out[j] = sum over rows of x (rows, n): the gradient of a broadcast over leading dimensions.
  void (*sum_rows)(const float* x, float* out, int64_t rows, int64_t n);
  /// AdamW on n elements (PyTorch semantics, decoupled decay):
  ///   p *= decay; m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2; p -= step_size m / (sqrt(v) inv_bc2_sqrt + eps).
  void (*adamw)(float* p, const float* g, float* m, float* v, int64_t n, float decay, float beta1, float beta2,
                float step_size, float inv_bc2_sqrt, float eps);
  /// The same update (the same bits) with p written by non-temporal stores, for parameters that
  /// other processes read next (a host's one shared copy under ZeRO 1 and 3): an ordinary store
  /// first takes each line out of the readers' caches, which costs more than the update.
  void (*adamw_stream)(float* p, const float* g, float* m, float* v, int64_t n, float decay, float beta1, float beta2,
                       float step_size, float inv_bc2_sqrt, float eps);
  /// bf16 (round to nearest even) of rows x cols of src with row stride ld, packed into dst.
  void (*round_to_bf16)(const float* src, int64_t rows, int64_t cols, int64_t ld, uint16_t* dst);
  /// The same rounding with the values kept as f32.
  void (*round_to_bf16_values)(const float* src, int64_t rows, int64_t cols, int64_t ld, float* dst);
  /// round_to_bf16 of contiguous x (rows, n) into dst and sum_rows of it into out (the same bits
  /// as the two apart) in one read of x: a bf16 linear layer's output gradient and its bias's.
  void (*round_to_bf16_sum_rows)(const float* x, int64_t rows, int64_t n, uint16_t* dst, float* out);
};

/// The table for this CPU (chosen once; see the top of this file).
const Table& table();
/// The table of one instruction set ("avx512_bf16", "avx512", "avx2", "build"), or null when this CPU cannot
/// run it (or the name is none of them): for tests and benchmarks of every variant.
const Table* table_for(std::string_view isa);

}  // namespace dtrain::kernels
