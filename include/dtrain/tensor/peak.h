// The core's measured peak: the FLOP rate of the widest vector FMA unit present, the
// denominator of MFU (model FLOP utilisation), measured rather than taken from a data sheet.
#pragma once

namespace dtrain {

/// f32: fused multiply-adds (2 FLOPs per f32 lane). bf16: bf16 products summed into f32, the rate
/// bf16 products with f32 accumulation run at: AMX tile products where the CPU has AMX (and Linux
/// grants this process its tiles), else AVX512_BF16 dot products of bf16 pairs (vdpbf16ps: 4
/// FLOPs per f32 lane).
enum class Precision { f32, bf16 };

/// FLOP/s of `threads` threads (>= 1) each running a loop of independent FMAs on the widest
/// unit this CPU has (AVX-512, else AVX2/FMA, else the compiler's own vectors), chosen at run
/// time; the sum of the threads' rates, each its best of several timed runs. Measured on the
/// first call for each (threads, precision), then cached. 0 for bf16 on a CPU without AMX or
/// AVX512_BF16.
double measured_peak_flops(int threads, Precision precision);

/// The instructions the probe runs for `precision` on this CPU: "avx512f", "avx2+fma",
/// "amx_bf16", "avx512_bf16", "generic" (f32 without AVX2/FMA), or "none" (bf16 without AMX or
/// AVX512_BF16).
const char* peak_probe_isa(Precision precision);

}  // namespace dtrain
