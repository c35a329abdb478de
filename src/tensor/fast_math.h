// Vectorisable exp and tanh for activation kernels. libm's scalar expf/tanhf dominated the
// GPT profile (GELU alone took 30% of a step); these are branch-free so GCC vectorises the
// loops that call them. exp: Cephes' polynomial with Cody-Waite range reduction, ~1 ulp on
// [-87, 88]. tanh: 1 - 2 / (exp(2|x|) + 1) with the sign restored, absolute error < 1e-7.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace dtrain::detail {

inline float fast_exp(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

inline float fast_tanh(float x) {
  const float t = 1.0f - 2.0f / (fast_exp(2.0f * std::fabs(x)) + 1.0f);
  return std::copysign(t, x);
}

}  // namespace dtrain::detail
