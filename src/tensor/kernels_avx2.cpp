// The kernels of dtrain/tensor/kernels.h compiled for AVX2 and FMA, without AVX-512; CMakeLists.txt gives
// this file its instruction-set flags.
#include <immintrin.h>

#include <cstdint>

#include "dtrain/tensor/kernels.h"
#include "exp16.h"

namespace dtrain::kernels::avx2 {
#include "kernels_impl.h"
}  // namespace dtrain::kernels::avx2
