// The kernels of dtrain/tensor/kernels.h compiled for AVX-512 (F, BW, DQ, VL) with 512-bit vectors; CMakeLists.txt
// gives this file its instruction-set flags.
#include <immintrin.h>

#include <cstdint>

#include "dtrain/tensor/kernels.h"
#include "exp16.h"

namespace dtrain::kernels::avx512 {
#include "kernels_impl.h"
}  // namespace dtrain::kernels::avx512
