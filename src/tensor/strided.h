// Internal helpers for walking strided tensors.
#pragma once

#include <cstdint>
#include <cstring>

#include "dtrain/tensor/tensor.h"

namespace dtrain::detail {

/// Calls fn(offset_0, ..., offset_{K-1}) for every index of `shape`, where offset_k is the
/// element offset into operand k with strides strides[k]. Innermost dimension fastest.
template <size_t K, typename Fn>
void for_each_offset(const Shape& shape, const Shape* const (&strides)[K], Fn&& fn) {
  const size_t nd = shape.size();
  for (int64_t s : shape) {
    if (s == 0) return;
  }
  if (nd == 0) {
    int64_t off[K] = {};
    [&]<size_t... I>(std::index_sequence<I...>) { fn(off[I]...); }
    (std::make_index_sequence<K>{});
    return;
  }
  int64_t idx[16] = {};
  int64_t off[K] = {};
  const int64_t inner = shape[nd - 1];
  int64_t inner_stride[K];
  for (size_t k = 0; k < K; ++k) inner_stride[k] = (*strides[k])[nd - 1];
  while (true) {
    int64_t o[K];
    for (size_t k = 0; k < K; ++k) o[k] = off[k];
    for (int64_t i = 0; i < inner; ++i) {
      [&]<size_t... I>(std::index_sequence<I...>) { fn(o[I]...); }
      (std::make_index_sequence<K>{});
      for (size_t k = 0; k < K; ++k) o[k] += inner_stride[k];
    }
    // advance the outer index
    int64_t d = static_cast<int64_t>(nd) - 2;
    for (; d >= 0; --d) {
      ++idx[d];
      for (size_t k = 0; k < K; ++k) off[k] += (*strides[k])[d];
      if (idx[d] < shape[d]) break;
      for (size_t k = 0; k < K; ++k) off[k] -= (*strides[k])[d] * shape[d];
      idx[d] = 0;
    }
    if (d < 0) return;
  }
}

/// Copies src into dst elementwise (same shape and dtype, any strides).
inline void strided_copy(const Tensor& src, Tensor& dst) {
  const size_t es = dtype_size(src.dtype());
  const char* s = static_cast<const char*>(src.raw_data());
  char* d = static_cast<char*>(dst.raw_data());
  if (src.is_contiguous() && dst.is_contiguous()) {
    if (src.numel() > 0) std::memcpy(d, s, static_cast<size_t>(src.numel()) * es);
    return;
  }
  const Shape* strides[2] = {&src.strides(), &dst.strides()};
  if (es == 4) {
    for_each_offset<2>(src.shape(), strides, [&](int64_t a, int64_t b) {
      reinterpret_cast<float*>(d)[b] = reinterpret_cast<const float*>(s)[a];
    });
  } else if (es == 1) {
    for_each_offset<2>(src.shape(), strides, [&](int64_t a, int64_t b) { d[b] = s[a]; });
  } else {
    for_each_offset<2>(src.shape(), strides, [&](int64_t a, int64_t b) {
      reinterpret_cast<uint16_t*>(d)[b] = reinterpret_cast<const uint16_t*>(s)[a];
    });
  }
}

}  // namespace dtrain::detail
