// The kernels of dtrain/tensor/kernels.h compiled for the build's own flags (the CPUs with neither); CMakeLists.txt
// gives this file its instruction-set flags.
#if defined(__AVX512F__) || defined(__AVX__)
#include <immintrin.h>
#endif

#include <cstdint>

#include "dtrain/tensor/kernels.h"
#include "exp16.h"

namespace dtrain::kernels::build {
#include "kernels_impl.h"
}  // namespace dtrain::kernels::build
