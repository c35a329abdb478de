// Ops that feed a bf16 product can write their output as bf16 (ops.h's `out` arguments): the
// f32 values rounded to nearest even, the bits Tensor::to(DType::bf16) gives, without writing
// the f32 tensor out and reading it back to round it (a memory round trip per activation).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "dtrain/core/error.h"
#include "dtrain/tensor/kernels.h"
#include "dtrain/tensor/tensor.h"

namespace dtrain::detail {

inline void check_out_dtype(DType out, const char* op) {
  DT_CHECK(out == DType::f32 || out == DType::bf16, "tensor", "{}: output dtype {}, expected f32 or bf16", op,
           dtype_name(out));
}

/// n values into dst (bf16), `step` at a time (a multiple of `unit`, about 16 KiB of f32: they
/// stay in L1 between produce and the rounding): produce(buffer, begin, count) writes values
/// [begin, begin + count) in f32.
template <typename Produce>
void produce_bf16(int64_t n, int64_t unit, uint16_t* dst, const Produce& produce) {
  const int64_t step = std::max<int64_t>(1, 4096 / std::max<int64_t>(1, unit)) * std::max<int64_t>(1, unit);
  std::vector<float> buffer(static_cast<size_t>(std::min(n, step)));
  for (int64_t begin = 0; begin < n; begin += step) {
    const int64_t count = std::min(step, n - begin);
    produce(buffer.data(), begin, count);
    kernels::table().round_to_bf16(buffer.data(), 1, count, count, dst + begin);
  }
}

/// GELU of x (out's size of values) into out: f32, or bf16 rounded in registers (the bits of f32
/// GELU rounded by round_to_bf16).
inline void gelu_into(const float* x, Tensor& out) {
  if (out.dtype() == DType::bf16) {
    kernels::table().gelu_forward_bf16(x, static_cast<uint16_t*>(out.raw_data()), out.numel());
  } else {
    kernels::table().gelu_forward(x, out.data(), out.numel());
  }
}

/// out's values from produce(buffer, begin, count), as produce_bf16 gives them where out is bf16,
/// or in one call straight into out (f32). produce is not called for an empty out.
template <typename Produce>
void produce_into(Tensor& out, int64_t unit, const Produce& produce) {
  if (out.numel() == 0) return;
  if (out.dtype() == DType::bf16) {
    produce_bf16(out.numel(), unit, static_cast<uint16_t*>(out.raw_data()), produce);
  } else {
    produce(out.data(), 0, out.numel());
  }
}

}  // namespace dtrain::detail
