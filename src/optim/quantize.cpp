#include "dtrain/optim/quantize.h"

#include <algorithm>
#include <cmath>

namespace dtrain::optim {

namespace {

constexpr float kSignedLevels = 127.0f;
constexpr float kUnsignedLevels = 255.0f;

// Round half up of a non-negative float to a level in [0, levels].
int level(float x, float levels) { return std::min(static_cast<int>(x + 0.5f), static_cast<int>(levels)); }

}  // namespace

float quantize_block(QuantCode code, const float* x, int64_t n, uint8_t* codes) {
  if (code == QuantCode::kSigned) {
    float a = 0.0f;
    for (int64_t i = 0; i < n; ++i) a = std::max(a, std::fabs(x[i]));
    if (!(a > 0.0f)) {
      std::fill(codes, codes + n, uint8_t{0});
      return 0.0f;
    }
    const float inv = 1.0f / a;
    for (int64_t i = 0; i < n; ++i) {
      const int c = level(kSignedLevels * std::sqrt(std::fabs(x[i]) * inv), kSignedLevels);
      codes[i] = static_cast<uint8_t>(static_cast<int8_t>(x[i] < 0.0f ? -c : c));
    }
    return a;
  }
  float s = 0.0f;
  for (int64_t i = 0; i < n; ++i) s = std::max(s, std::sqrt(std::max(x[i], 0.0f)));
  if (!(s > 0.0f)) {
    std::fill(codes, codes + n, uint8_t{0});
    return 0.0f;
  }
  const float inv = 1.0f / s;
  for (int64_t i = 0; i < n; ++i) {
    const float r = std::sqrt(std::max(x[i], 0.0f)) * inv;
    codes[i] = static_cast<uint8_t>(level(kUnsignedLevels * std::sqrt(std::sqrt(r)), kUnsignedLevels));
  }
  return s;
}

void dequantize_block(QuantCode code, const uint8_t* codes, int64_t n, float scale, float* x) {
  if (code == QuantCode::kSigned) {
    for (int64_t i = 0; i < n; ++i) {
      const int c = static_cast<int8_t>(codes[i]);
      const float r = static_cast<float>(c < 0 ? -c : c) / kSignedLevels;
      const float m = scale * (r * r);
      x[i] = c < 0 ? -m : m;
    }
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    const float r = static_cast<float>(codes[i]) / kUnsignedLevels;
    const float r2 = r * r;
    const float root = scale * (r2 * r2);  // sqrt(v)
    x[i] = root * root;
  }
}

double quantize_error_bound(QuantCode code, double x, double scale) {
  if (scale <= 0.0) return 0.0;
  // A code's value is scale * t^p for t on a grid of spacing 1/levels; rounding moves t by at
  // most half a step, so the value moves by at most scale ((t + d)^p - t^p).
  const bool is_signed = code == QuantCode::kSigned;
  const double levels = is_signed ? kSignedLevels : kUnsignedLevels;
  const double p = is_signed ? 2.0 : 4.0;
  const double value = is_signed ? std::fabs(x) : std::sqrt(std::max(x, 0.0));
  const double t = std::pow(std::min(value / scale, 1.0), 1.0 / p);
  const double d = 0.5 / levels;
  return scale * (std::pow(std::min(t + d, 1.0 + d), p) - std::pow(t, p)) + 1e-6 * scale;
}

}  // namespace dtrain::optim
