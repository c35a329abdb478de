// Gradient codecs of the comm layer: f32 buffers encoded to fewer bytes for the wire, decoded
// (or decoded and added) on the other side. The codecs know only bytes and counts; the policy
// and its state (error-feedback residuals kept per parameter, PowerSGD) belong to the parallel
// layer. all_reduce_compressed / reduce_scatter_compressed (compressed.h) run them inside collectives.
//
// Codecs and their payloads (n elements; chunks of kQuantChunk elements from the start of the
// buffer, the last one possibly shorter):
//   none  f32 as is                          4n bytes
//   bf16  round to nearest even              2n bytes
//   fp16  IEEE half, round to nearest even   2n bytes
//   int8  per chunk: f32 scale s, then one signed byte q per element    n + 4 ceil(n/512)
//   int4  per chunk: f32 scale s, then two 4-bit codes per byte (element 2j in the low nibble
//         of byte j, 2j+1 in the high one; an odd chunk's last high nibble is 0)
//                                            sum over chunks of 4 + ceil(len/2)
// For 1M elements: int8 3.97x smaller than f32, int4 7.88x.
//
// int8 / int4, symmetric per chunk: s = M / Q, where M is the largest |x| over the chunk's
// finite elements and Q = 127 (int8) or 7 (int4); q = round_to_nearest_even(x / s), clamped
// to [-Q, Q]; decoded x^ = q * s. A chunk whose M is below kQuantFloor (2^-119, about
// 1.5e-36) is stored as s = 0 and decodes to zeros (its scale would not be a normal float).
//
// Error bounds, |x - x^| for a finite x, checked by the tests (max_error() computes them):
//   none  0
//   bf16  2^-8 |x| + 2^-134              (half an ulp; subnormals: half the quantum 2^-133)
//   fp16  2^-11 |x| + 2^-25              (|x| <= kFp16Max = 65504; beyond: |x| - 65504)
//   int8  M / 254 * (1 + 2^-14) + 2^-119
//   int4  M / 14  * (1 + 2^-14) + 2^-119
// i.e. half a quantization step (the 2^-14 covers the f32 rounding of s, x / s and q * s;
// the 2^-119 the chunks below kQuantFloor, stored as zeros). Every bound grows with its
// arguments, so one computed from upper bounds of |x| and M is a valid bound too.
// bf16 and fp16 saturate: a finite x beyond the format's largest finite value becomes that
// value, never infinity (for bf16 the bound above still holds; fp16 loses |x| - 65504).
//
// Non-finite inputs never crash and are never hidden: bf16/fp16 keep NaN as NaN and +-inf as
// +-inf; int8/int4 store a NaN or +-inf element as the spare code (-128, -8), which decodes to
// NaN, and leave it out of the chunk's scale (its neighbours keep their precision). The
// residual of a non-finite element is 0, so error feedback never carries it into later steps.
//
// Residual (error feedback): encode(..., residual) writes residual[i] = x[i] - x^[i], the part
// of x the payload lost. The caller adds it to the next step's input: encoding x_t + r_{t-1}
// at every step keeps the sum of everything decoded within one step's error of the sum of
// all x_t (sum_t x^_t = sum_t x_t - r_T).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "dtrain/comm/types.h"

namespace dtrain::comm {

enum class Codec : uint8_t { none, bf16, fp16, int8, int4 };

/// "none", "bf16", "fp16", "int8", "int4"; throws dtrain::Error naming the text.
Codec parse_codec(const std::string& text);
const char* name_of(Codec codec);

/// Elements per int8 / int4 scale.
inline constexpr size_t kQuantChunk = 512;
/// Chunks whose largest finite magnitude is below this (2^-119) encode as zeros.
inline constexpr float kQuantFloor = 0x1p-119f;
/// Largest finite bf16 and fp16 values (where those codecs saturate).
inline constexpr float kBf16Max = 0x1.fep127f;
inline constexpr float kFp16Max = 65504.0f;

/// Bytes of the payload of `count` elements (formulas above).
size_t encoded_bytes(Codec codec, size_t count);

/// Encodes x[0, count) into out[0, encoded_bytes(codec, count)). If residual is not null,
/// residual[i] = x[i] - decode(encode(x))[i] (0 for a non-finite x[i]); it may be x itself.
void encode(Codec codec, const float* x, size_t count, uint8_t* out, float* residual = nullptr);
/// Decodes a payload of `count` elements into out.
void decode(Codec codec, const uint8_t* in, size_t count, float* out);
/// out[i] += decoded element i (the reduction step of the compressed collectives; the f32
/// add is rounded separately from the decode, so it matches decode followed by an add).
void decode_add(Codec codec, const uint8_t* in, size_t count, float* out);

/// The documented bound on |x - decode(encode(x))| for a finite element of magnitude
/// `abs_value` (bf16, fp16) in a chunk whose largest finite magnitude is `chunk_max_abs`
/// (int8, int4); the other argument is ignored. See the table above.
double max_error(Codec codec, double abs_value, double chunk_max_abs);

/// Bytes a compressed collective moved, added to by each call (reset it per step).
struct CompressStats {
  uint64_t wire_bytes_sent = 0;  // payload bytes this rank sent
  uint64_t raw_bytes = 0;        // what the same algorithm would have sent in f32
};

}  // namespace dtrain::comm
