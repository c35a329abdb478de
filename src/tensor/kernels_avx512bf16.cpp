// The kernels of dtrain/tensor/kernels.h compiled for AVX-512 (F, BW, DQ, VL) with AVX512_BF16:
// the same as kernels_avx512.cpp, bit for bit, with bf16 rounding in one instruction where no
// denormal is in the way (kernels_impl.h's Bf16Stores). CMakeLists.txt gives its flags.
#include <immintrin.h>

#include <cstdint>

#include "dtrain/tensor/kernels.h"
#include "exp16.h"

namespace dtrain::kernels::avx512_bf16 {
#include "kernels_impl.h"
}  // namespace dtrain::kernels::avx512_bf16
