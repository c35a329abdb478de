// Block-wise 8-bit codes for optimizer state (8-bit optimizers, Dettmers et al. 2022): a
// tensor is cut into blocks of kQuantBlock values; each block keeps one f32 scale and one byte
// per value. The codes are non-linear (companded) so that values much smaller than their
// block's largest keep a relative precision, as the dynamic quantization of 8-bit optimizers
// does:
//
//   signed   (AdamW's first moment m)   scale A = max |m|,          code c in [-127, 127]
//            c = round(127 sqrt(|m| / A)) sign(m)      m' = A (c / 127)^2 sign(m)
//   unsigned (AdamW's second moment v)  scale S = max sqrt(v),      code c in [0, 255]
//            c = round(255 (sqrt(v) / S)^(1/4))        sqrt(v') = S (c / 255)^4
//
// The second moment is coded in the sqrt domain (the update divides by sqrt(v)), with a fourth
// root so that 8 bits span about ten decades of sqrt(v). A block of zeros has scale 0. Both
// directions are deterministic (the same bits on every rank and every run), and quantizing a
// dequantized block gives back the same codes and scale.
#pragma once

#include <cstdint>

namespace dtrain::optim {

/// Values per quantization block (one f32 scale each).
constexpr int64_t kQuantBlock = 256;

/// Blocks of a tensor of `n` values (the last may be partial).
constexpr int64_t quant_blocks(int64_t n) { return (n + kQuantBlock - 1) / kQuantBlock; }

/// Which code a block uses: kSigned for values of any sign, kUnsignedSqrt for non-negative
/// values (a second moment), coded by their square root.
enum class QuantCode : uint8_t { kSigned, kUnsignedSqrt };

/// Codes `n` <= kQuantBlock values `x` into `codes`; returns the block's scale.
float quantize_block(QuantCode code, const float* x, int64_t n, uint8_t* codes);
/// Values of `n` codes with scale `scale` into `x`.
void dequantize_block(QuantCode code, const uint8_t* codes, int64_t n, float scale, float* x);

/// The worst absolute error of quantize + dequantize for a value `x` in a block of scale
/// `scale` (kUnsignedSqrt: of sqrt(x)), from the code's spacing: for tests and docs.
double quantize_error_bound(QuantCode code, double x, double scale);

}  // namespace dtrain::optim
