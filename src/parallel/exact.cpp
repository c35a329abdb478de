// Exact gradient sums in 64-bit fixed point (exact.h, docs/determinism.md). The loops are
// written so the compiler vectorises them (nearbyint and the conversion to int64 have vector
// forms on AVX-512; elsewhere the conversion runs scalar, with the same results: rounding to
// nearest even is the same instruction's job in either form).
#include "dtrain/parallel/exact.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "dtrain/core/error.h"

namespace dtrain::parallel {

namespace {

int ceil_log2(int64_t n) {
  int bits = 0;
  while ((int64_t{1} << bits) < n) ++bits;
  return bits;
}

// round(x x 2^F) to nearest even, as an int64, for |x| < 2^(62 - F): x x 2^F is exact in float
// (a power-of-two scaling of a value far inside float's range), it is rounded to an integer in
// the current (nearest-even) rounding mode and that integer converts to int64 exactly. The same
// bits as nearbyint(double(x) x 2^F), with float vectors (vrndscaleps and vcvttps2qq on
// AVX-512: a float vector holds twice the elements of a double one). A subnormal x gives 0
// either way.
inline int64_t image_of(float x) {
  constexpr float kScale = static_cast<float>(int64_t{1} << kExactFractionBits);
  return static_cast<int64_t>(std::nearbyint(x * kScale));
}

// acc[i] += image_of(g[i]). Written so that GCC vectorises it (the form `acc += llrint(x)`
// became a scalar loop).
void add_images(int64_t* __restrict acc, const float* __restrict g, size_t n) {
  for (size_t i = 0; i < n; ++i) acc[i] += image_of(g[i]);
}

// add_images, and whether any g[i] was not finite or not below `bound` in magnitude (those
// add garbage: the caller drops the sums then).
int add_images_checked(int64_t* __restrict acc, const float* __restrict g, size_t n, float bound) {
  int bad = 0;
  for (size_t i = 0; i < n; ++i) {
    const bool in = std::fabs(g[i]) < bound;  // false for NaN too
    bad |= in ? 0 : 1;
    acc[i] += image_of(in ? g[i] : 0.0f);  // an element out of range adds 0 (its image could overflow)
  }
  return bad;
}

// acc[i] = the sum over the R ranks of image_of(g[q][i]), the sum kept in a register (one
// store per element instead of R loads and stores of acc); whether any element was out of range.
template <int R>
int sum_images(int64_t* __restrict acc, const float* const* grads, size_t at, size_t n, float bound) {
  const float* g[R];
  for (int q = 0; q < R; ++q) g[q] = grads[q] + at;
  int bad = 0;
#pragma GCC ivdep  // acc overlaps none of the gradients
  for (size_t i = 0; i < n; ++i) {
    int64_t s = 0;
    for (int q = 0; q < R; ++q) {
      const float x = g[q][i];
      const bool in = std::fabs(x) < bound;
      bad |= in ? 0 : 1;
      s += image_of(in ? x : 0.0f);
    }
    acc[i] = s;
  }
  return bad;
}

int sum_images_any(int64_t* acc, const float* const* grads, int ranks, size_t at, size_t n, float bound) {
  switch (ranks) {
    case 1:
      return sum_images<1>(acc, grads, at, n, bound);
    case 2:
      return sum_images<2>(acc, grads, at, n, bound);
    case 3:
      return sum_images<3>(acc, grads, at, n, bound);
    case 4:
      return sum_images<4>(acc, grads, at, n, bound);
    default:
      break;
  }
  if (ranks < 4) {  // none
    std::memset(acc, 0, n * sizeof(int64_t));
    return 0;
  }
  int bad = sum_images<4>(acc, grads, at, n, bound);
  for (int q = 4; q < ranks; ++q) bad |= add_images_checked(acc, grads[q] + at, n, bound);
  return bad;
}

void add_ints(int64_t* __restrict acc, const int64_t* __restrict x, size_t n) {
  for (size_t i = 0; i < n; ++i) acc[i] += x[i];
}

}  // namespace

double exact_limit(int64_t micro_batches) {
  DT_CHECK(micro_batches >= 1 && micro_batches <= (int64_t{1} << 20), "ddp",
           "--deterministic: {} micro-batches per step; expected 1 to 2^20", micro_batches);
  return std::ldexp(1.0, 62 - kExactFractionBits - ceil_log2(micro_batches));
}

size_t exact_check(const float* g, size_t n, double limit) {
  const auto bound = static_cast<float>(limit);  // a power of two: exact
  int bad = 0;
  for (size_t i = 0; i < n; ++i) bad |= !(std::fabs(g[i]) < bound) ? 1 : 0;  // NaN too
  if (bad != 0) {
    for (size_t i = 0; i < n; ++i) {
      if (!(std::fabs(g[i]) < bound)) return i;
    }
  }
  return n;
}

size_t exact_add(int64_t* acc, const float* g, size_t n, double limit) {
  const size_t at = exact_check(g, n, limit);
  if (at == n) add_images(acc, g, n);
  return at;
}

void exact_to_float(const int64_t* __restrict acc, float* __restrict out, size_t n, int64_t divisor) {
  const double unit = std::ldexp(1.0, -kExactFractionBits);
  if ((divisor & (divisor - 1)) == 0) {
    // x x 2^-F / 2^k is x x 2^-(F + k) exactly (no rounding before the last): no division.
    const double factor = unit / static_cast<double>(divisor);
    for (size_t i = 0; i < n; ++i) out[i] = static_cast<float>(static_cast<double>(acc[i]) * factor);
    return;
  }
  const auto d = static_cast<double>(divisor);
  for (size_t i = 0; i < n; ++i) out[i] = static_cast<float>(static_cast<double>(acc[i]) * unit / d);
}

ExactOutOfRange exact_reduce(float* out, const float* const* grads, const int64_t* const* sums, int ranks, size_t n,
                             int64_t divisor, double limit) {
  // A block of sums that stays in the L1 cache between the passes over the ranks.
  constexpr size_t kBlock = 1024;
  alignas(64) int64_t acc[kBlock];
  const auto bound = static_cast<float>(limit);  // a power of two: exact
  for (size_t at = 0; at < n; at += kBlock) {
    const size_t m = std::min(kBlock, n - at);
    const int bad = sum_images_any(acc, grads, ranks, at, m, bound);
    if (bad != 0) {
      for (int q = 0; q < ranks; ++q) {
        const size_t i = exact_check(grads[q] + at, m, limit);
        if (i != m) return {q, at + i, grads[q][at + i]};
      }
    }
    for (int q = 0; sums != nullptr && q < ranks; ++q) {
      if (sums[q] != nullptr) add_ints(acc, sums[q] + at, m);
    }
    exact_to_float(acc, out + at, m, divisor);
  }
  return {};
}

uint64_t bits_checksum(const float* g, size_t n) {
  uint64_t sum = 0;
  for (size_t i = 0; i < n; ++i) {
    uint32_t bits = 0;
    std::memcpy(&bits, g + i, sizeof(bits));
    sum += static_cast<uint64_t>(bits) * (2 * static_cast<uint64_t>(i) + 1);
  }
  return sum;
}

void throw_exact_range(const std::string& tensor, float value, int64_t step, int rank, int64_t micro_batches) {
  DT_THROW("ddp",
           "--deterministic: the gradient of '{}' on rank {} at step {} has an element {} outside the exact "
           "fixed-point range (|g| < 2^{} for {} micro-batches per step, resolution 2^-{}); the run diverged or "
           "the learning rate is too high: lower --lr, use --clip-grad on a run without --deterministic, or drop "
           "--deterministic",
           tensor, rank, step, value, std::ilogb(exact_limit(micro_batches)), micro_batches, kExactFractionBits);
}

ExactGradients::ExactGradients(std::vector<nn::NamedTensor> params, int64_t micro_batches)
    : params_(std::move(params)), micro_batches_(micro_batches), limit_(exact_limit(micro_batches)) {
  for (const auto& [name, t] : params_) {
    DT_CHECK(t.dtype() == DType::f32 && t.is_contiguous(), "ddp", "--deterministic: parameter '{}' must be f32", name);
    sums_.emplace_back(static_cast<size_t>(t.numel()), 0);
  }
}

void ExactGradients::add(int64_t step, int rank) {
  for (size_t k = 0; k < params_.size(); ++k) {
    Tensor& p = params_[k].second;
    Tensor g = p.grad();
    if (!g.defined()) continue;
    g = g.contiguous();
    const size_t n = sums_[k].size();
    const size_t at = exact_add(sums_[k].data(), g.data(), n, limit_);
    if (at != n) throw_exact_range(params_[k].first, g.data()[at], step, rank, micro_batches_);
    p.zero_grad();
  }
}

void ExactGradients::finish() {
  for (size_t k = 0; k < params_.size(); ++k) {
    Tensor& p = params_[k].second;
    Tensor g = Tensor::empty(p.shape());
    exact_to_float(sums_[k].data(), g.data(), sums_[k].size(), micro_batches_);
    std::memset(sums_[k].data(), 0, sums_[k].size() * sizeof(int64_t));
    p.set_grad(g);
  }
}

}  // namespace dtrain::parallel
