// Products in bf16 with f32 accumulation (gemm.h, Precision::bf16).
//
// Both operands are rounded to bf16 (nearest even) into packed scratch buffers, in their stored
// orientation; the product runs on oneDNN's matmul primitive with bf16 source and weights and an
// f32 destination, which oneDNN dispatches to AMX tiles or AVX512_BF16 dot products, and alpha and
// beta become its output scale and sum post-op. A primitive is built once per shape and kept.
//
// The *fallback*, where oneDNN has no bf16 instructions to run on (a CPU without AVX512_BF16, or
// ONEDNN_MAX_CPU_ISA below it, or a build without oneDNN): the operands are rounded to bf16 but
// kept as f32 values, and the product runs on the f32 sgemm. A product of two bf16 values is
// exact in f32, so this is the same arithmetic (bf16 products, f32 sums) in another order,
// rather than a slow emulation of the instructions.
#include <fmt/format.h>

#include <cstring>
#include <vector>

#include "dtrain/core/error.h"
#include "dtrain/tensor/half.h"
#include "dtrain/tensor/kernels.h"
#include "gemm_internal.h"

namespace dtrain::detail {

namespace {

#if DTRAIN_HAVE_ONEDNN
// oneDNN runs bf16 matmuls natively from AVX512_BF16 up (AMX included); below that it would
// emulate them, slower than the fallback.
bool onednn_has_bf16() {
  const dnnl_cpu_isa_t isa = dnnl_get_effective_cpu_isa();
  return isa == dnnl_cpu_isa_avx512_core_bf16 || isa == dnnl_cpu_isa_avx512_core_amx;
}
#endif

struct Route {
  bool native = false;
  std::string description;
};

const Route& route() {
  static const Route r = [] {
    Route out;
    std::string why;  // why the fallback
#if DTRAIN_HAVE_ONEDNN
    if (onednn_has_bf16()) {
      try {
        const std::string impl =
            describe_matmul(matmul_shape(true, false, true, 64, 64, 64, 64, 64, 64, 1.0f, 0.0f, false)).impl_info_str();
        out.native = impl.rfind("ref", 0) != 0;
        out.description = fmt::format("bf16 products: oneDNN's matmul ({}, kernel {})", onednn_isa(), impl);
        why = fmt::format("oneDNN offers only a reference kernel ({})", impl);
      } catch (const dnnl::error& e) {
        why = fmt::format("oneDNN ({}) has no bf16 matmul here: {}", onednn_isa(), e.what());
      }
    } else {
      why = fmt::format("this CPU has no bf16 instructions for oneDNN, whose kernels here are {}", onednn_isa());
    }
#else
    why = "this build has no oneDNN";
#endif
    if (!out.native) {
      out.description =
          "bf16 products: fallback: operands rounded to bf16, products and sums in f32 on sgemm (" + why + ")";
    }
    return out;
  }();
  return r;
}

template <typename T>
T* scratch(std::vector<T>& v, int64_t n) {
  if (v.size() < static_cast<size_t>(n)) v.resize(static_cast<size_t>(n));
  return v.data();
}

}  // namespace

bool bf16_products_native() { return route().native; }

bool bf16_results_native() {
  static const bool native = [] {
#if DTRAIN_HAVE_ONEDNN
    if (!route().native) return false;
    try {  // a bf16 result on the kernel that runs bf16 products, not on oneDNN's reference one
      MatmulShape shape = matmul_shape(true, false, true, 64, 64, 64, 64, 64, 64, 1.0f, 0.0f, true);
      shape.c_bf16 = true;
      return std::string(describe_matmul(shape).impl_info_str()).rfind("ref", 0) != 0;
    } catch (const dnnl::error&) {
      return false;
    }
#else
    return false;
#endif
  }();
  return native;
}

const std::string& bf16_products_route() { return route().description; }

void gemm_bf16_operands(GemmBackend f32_library, bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha,
                        const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb, float beta, float* c,
                        int64_t ldc) {
  if (!route().native) {  // the fallback: the bf16 values exactly in f32, on the f32 sgemm
    const int64_t a_rows = ta ? k : m, a_cols = ta ? m : k;
    const int64_t b_rows = tb ? n : k, b_cols = tb ? k : n;
    thread_local std::vector<float> a_scratch, b_scratch;
    float* af = scratch(a_scratch, a_rows * a_cols);
    float* bf = scratch(b_scratch, b_rows * b_cols);
    for (int64_t r = 0; r < a_rows; ++r) {
      for (int64_t j = 0; j < a_cols; ++j) af[r * a_cols + j] = bf16_to_f32(a[r * lda + j]);
    }
    for (int64_t r = 0; r < b_rows; ++r) {
      for (int64_t j = 0; j < b_cols; ++j) bf[r * b_cols + j] = bf16_to_f32(b[r * ldb + j]);
    }
    run_f32_library(f32_library, ta, tb, m, n, k, alpha, af, a_cols, bf, b_cols, beta, c, ldc);
    return;
  }
#if DTRAIN_HAVE_ONEDNN
  // oneDNN's AMX and AVX512_BF16 kernels (brgemm) take dense operands only; with a row stride
  // above the minimum (a head read in place) it would fall back to a slower gemm with a scalar
  // epilogue. So strided operands are packed first, and a strided C computed densely and copied.
  const int64_t a_rows = ta ? k : m, a_cols = ta ? m : k;
  const int64_t b_rows = tb ? n : k, b_cols = tb ? k : n;
  thread_local std::vector<uint16_t> a_pack, b_pack;
  thread_local std::vector<float> c_pack;
  auto pack = [](const uint16_t* src, int64_t rows, int64_t cols, int64_t ld, std::vector<uint16_t>& into) {
    uint16_t* dst = scratch(into, rows * cols);
    for (int64_t r = 0; r < rows; ++r) std::memcpy(dst + r * cols, src + r * ld, static_cast<size_t>(cols) * 2);
    return dst;
  };
  if (lda != a_cols) a = pack(a, a_rows, a_cols, lda, a_pack), lda = a_cols;
  if (ldb != b_cols) b = pack(b, b_rows, b_cols, ldb, b_pack), ldb = b_cols;
  float* dense_c = c;
  if (ldc != n) {
    dense_c = scratch(c_pack, m * n);
    if (beta != 0.0f) {
      for (int64_t r = 0; r < m; ++r) std::memcpy(dense_c + r * n, c + r * ldc, static_cast<size_t>(n) * 4);
    }
  }
  run_matmul(matmul_shape(true, ta, tb, m, n, k, lda, ldb, n, alpha, beta, false), a, b, nullptr, dense_c);
  if (dense_c != c) {
    for (int64_t r = 0; r < m; ++r) std::memcpy(c + r * ldc, dense_c + r * n, static_cast<size_t>(n) * 4);
  }
#endif
}

void sgemm_bf16(GemmBackend f32_library, bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
                int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  // Operands in their stored orientation: A (M, K) or (K, M), B (K, N) or (N, K), packed here.
  const int64_t a_rows = ta ? k : m, a_cols = ta ? m : k;
  const int64_t b_rows = tb ? n : k, b_cols = tb ? k : n;
  if (!route().native) {
    thread_local std::vector<float> a_scratch, b_scratch;
    float* ar = scratch(a_scratch, a_rows * a_cols);
    float* br = scratch(b_scratch, b_rows * b_cols);
    kernels::table().round_to_bf16_values(a, a_rows, a_cols, lda, ar);
    kernels::table().round_to_bf16_values(b, b_rows, b_cols, ldb, br);
    run_f32_library(f32_library, ta, tb, m, n, k, alpha, ar, a_cols, br, b_cols, beta, c, ldc);
    return;
  }
  thread_local std::vector<uint16_t> a_scratch, b_scratch;
  uint16_t* ah = scratch(a_scratch, a_rows * a_cols);
  uint16_t* bh = scratch(b_scratch, b_rows * b_cols);
  kernels::table().round_to_bf16(a, a_rows, a_cols, lda, ah);
  kernels::table().round_to_bf16(b, b_rows, b_cols, ldb, bh);
  gemm_bf16_operands(f32_library, ta, tb, m, n, k, alpha, ah, a_cols, bh, b_cols, beta, c, ldc);
}

}  // namespace dtrain::detail
