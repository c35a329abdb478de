// Exact gradient sums for --deterministic (docs/determinism.md): the gradient of a global batch
// that depends only on the global batch, never on how its micro-batches are laid out over
// ranks, accumulation steps and pipeline rounds.
//
// Vocabulary:
// - a *micro-batch gradient* is the f32 gradient of one micro-batch's mean loss, computed from
//   scratch (no other micro-batch added into it): the same bits on every layout, since every
//   layout runs the same kernels on the same micro-batch;
// - its *fixed-point image* is round(g x 2^F) as a 64-bit integer, F = kExactFractionBits,
//   rounded to nearest even (llrint in the default rounding mode);
// - the *exact sum* adds the images of the step's N micro-batches as integers: integer addition
//   is associative, so neither the rank that computed a micro-batch, nor the order, nor the
//   collective's algorithm changes it;
// - the *gradient* the optimizer sees is float(sum x 2^-F / N), converted once per step.
// The range: every image must stay within 2^(62 - ceil(log2 N)) so that N of them never
// overflow, i.e. |g| < exact_limit(N) = 2^(62 - F - ceil(log2 N)); a larger element (or a NaN or
// infinity) fails the run, naming the tensor. With F = 40 that is 2^17 for N <= 32 and the
// resolution is 2^-40 (about 9e-13) per micro-batch.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "dtrain/nn/module.h"

namespace dtrain::parallel {

constexpr int kExactFractionBits = 40;

/// The largest |element| of a micro-batch gradient when `micro_batches` are summed exactly.
double exact_limit(int64_t micro_batches);

/// acc[i] += round(g[i] x 2^F) for i < n. Returns n when every g[i] was finite and below
/// `limit` in magnitude; otherwise the index of the first element that was not (nothing is
/// added then).
size_t exact_add(int64_t* acc, const float* g, size_t n, double limit);

/// The index of the first of g[0..n) that is not finite or not below `limit` in magnitude, or n.
size_t exact_check(const float* g, size_t n, double limit);

/// out[i] = float(acc[i] x 2^-F / divisor).
void exact_to_float(const int64_t* acc, float* out, size_t n, int64_t divisor);

/// Where exact_reduce met a gradient element out of range: rank q's element `index` (of n).
struct ExactOutOfRange {
  int rank = -1;  // -1: none
  size_t index = 0;
  float value = 0.0f;
};

/// The exact sum of several ranks' contributions in one pass, for i < n:
///   out[i] = float((sum over q of round(grads[q][i] x 2^F) + sum over q of sums[q][i]) x 2^-F / divisor)
/// where grads[q] is rank q's last micro-batch gradient and sums[q] its fixed-point sum of the
/// earlier ones (sums, or any sums[q], may be null: none). The same bits as exact_add of every
/// term followed by exact_to_float. Checks every grads element against `limit` on the way
/// (exact_check): at the first one out of range it stops and returns it (out is then partly
/// written). `out` may be one of the grads (each block is read before it is written); nothing
/// else may overlap.
ExactOutOfRange exact_reduce(float* out, const float* const* grads, const int64_t* const* sums, int ranks, size_t n,
                             int64_t divisor, double limit);

/// A checksum of the bits of `n` floats that changes whenever one bit of one of them does
/// (sum of bits[i] x (2i + 1) mod 2^64): --audit compares gradients with it.
uint64_t bits_checksum(const float* g, size_t n);

/// The error for a micro-batch gradient element out of range (exact_add did not return n).
[[noreturn]] void throw_exact_range(const std::string& tensor, float value, int64_t step, int rank,
                                    int64_t micro_batches);

/// Exact sums of a model's gradients in one process (no data parallelism; DataParallel does the
/// same in its reducer over the replicas): after each micro-batch's backward, add() takes the
/// gradients' fixed-point images and drops the gradients; finish() leaves the step's gradient
/// (sum / micro_batches) in every parameter's grad.
class ExactGradients {
 public:
  ExactGradients(std::vector<nn::NamedTensor> params, int64_t micro_batches);
  /// Adds the parameters' gradients (those that have one) and drops them. Throws naming the
  /// tensor, the step and `rank` when an element is out of range.
  void add(int64_t step, int rank = 0);
  /// The step's gradients into the parameters' grads; the sums start again from zero.
  void finish();

 private:
  std::vector<nn::NamedTensor> params_;
  std::vector<std::vector<int64_t>> sums_;
  int64_t micro_batches_;
  double limit_;
};

}  // namespace dtrain::parallel
