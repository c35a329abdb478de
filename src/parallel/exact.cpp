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

// acc[i] += round(g[i] x 2^F), nearest even. Written so that GCC vectorises it (vrndscalepd and
// vcvttpd2qq on AVX-512; the form `acc += (int64_t)nearbyint(x)` in one expression became a
// scalar cvtsd2si loop): g x 2^F is exact in double, nearbyint rounds it to an integer in the
// current (nearest-even) mode and the conversion of that integer is exact.
void add_images(int64_t* __restrict acc, const float* __restrict g, size_t n) {
  const double scale = std::ldexp(1.0, kExactFractionBits);
  for (size_t i = 0; i < n; ++i) {
    const double image = std::nearbyint(static_cast<double>(g[i]) * scale);
    acc[i] += static_cast<int64_t>(image);
  }
}

// add_images, and whether any g[i] was not finite or not below `bound` in magnitude (those
// add garbage: the caller drops the sums then).
int add_images_checked(int64_t* __restrict acc, const float* __restrict g, size_t n, float bound) {
  const double scale = std::ldexp(1.0, kExactFractionBits);
  int bad = 0;
  for (size_t i = 0; i < n; ++i) {
    const bool in = std::fabs(g[i]) < bound;  // false for NaN too
    bad |= in ? 0 : 1;
    // An element out of range adds 0 (its conversion could overflow).
    const double image = std::nearbyint(static_cast<double>(in ? g[i] : 0.0f) * scale);
    acc[i] += static_cast<int64_t>(image);
  }
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

void exact_to_float(const int64_t* acc, float* out, size_t n, int64_t divisor) {
  const double unit = std::ldexp(1.0, -kExactFractionBits);
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
    std::memset(acc, 0, m * sizeof(int64_t));
    int bad = 0;
    for (int q = 0; q < ranks; ++q) bad |= add_images_checked(acc, grads[q] + at, m, bound);
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
