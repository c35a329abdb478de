// Ops that feed a bf16 product can write their output as bf16 (ops.h's `out` arguments): the
// f32 values rounded to nearest even, the bits Tensor::to(DType::bf16) gives, without writing
// the f32 tensor out and reading it back to round it (a memory round trip per activation). The
// kernels round in registers (kernels.h: layer_norm_forward_bf16, gelu_forward_bf16).
#pragma once

#include <cstdint>

#include "dtrain/core/error.h"
#include "dtrain/tensor/kernels.h"
#include "dtrain/tensor/tensor.h"

namespace dtrain::detail {

inline void check_out_dtype(DType out, const char* op) {
  DT_CHECK(out == DType::f32 || out == DType::bf16, "tensor", "{}: output dtype {}, expected f32 or bf16", op,
           dtype_name(out));
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

}  // namespace dtrain::detail
