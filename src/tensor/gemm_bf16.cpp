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

#if DTRAIN_HAVE_ONEDNN
#include <omp.h>

#include <oneapi/dnnl/dnnl.hpp>
#endif

#include <cstring>
#include <map>
#include <mutex>
#include <tuple>
#include <vector>

#include "dtrain/core/error.h"
#include "dtrain/tensor/kernels.h"
#include "gemm_internal.h"

namespace dtrain::detail {

namespace {

#if DTRAIN_HAVE_ONEDNN
using dnnl::memory;

dnnl::engine& cpu_engine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

// (trans_a, trans_b, M, N, K, ldc, alpha bits, beta bits, threads)
using PrimitiveKey = std::tuple<bool, bool, int64_t, int64_t, int64_t, int64_t, uint32_t, uint32_t, int>;

struct Primitives {
  std::mutex mu;
  std::map<PrimitiveKey, dnnl::matmul> built;
};

Primitives& primitives() {
  static Primitives p;
  return p;
}

uint32_t bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}

// op(A) (M, K) from A packed (M, K), or (K, M) when trans_a; likewise op(B) (K, N).
dnnl::matmul::primitive_desc describe(bool ta, bool tb, int64_t m, int64_t n, int64_t k, int64_t ldc, float alpha,
                                      float beta) {
  const memory::desc a({m, k}, memory::data_type::bf16, ta ? memory::dims{1, m} : memory::dims{k, 1});
  const memory::desc b({k, n}, memory::data_type::bf16, tb ? memory::dims{1, k} : memory::dims{n, 1});
  const memory::desc c({m, n}, memory::data_type::f32, memory::dims{ldc, 1});
  dnnl::primitive_attr attr;
  if (alpha != 1.0f) attr.set_output_scales(0, {alpha});
  if (beta != 0.0f) {
    dnnl::post_ops ops;
    ops.append_sum(beta);
    attr.set_post_ops(ops);
  }
  return dnnl::matmul::primitive_desc(dnnl::matmul::desc(a, b, c), attr, cpu_engine());
}

dnnl::matmul& primitive_for(bool ta, bool tb, int64_t m, int64_t n, int64_t k, int64_t ldc, float alpha, float beta,
                            int threads) {
  Primitives& p = primitives();
  const PrimitiveKey key{ta, tb, m, n, k, ldc, bits(alpha), bits(beta), threads};
  std::lock_guard<std::mutex> lock(p.mu);
  auto it = p.built.find(key);
  if (it == p.built.end()) it = p.built.emplace(key, dnnl::matmul(describe(ta, tb, m, n, k, ldc, alpha, beta))).first;
  return it->second;
}

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
        const std::string impl = describe(false, true, 64, 64, 64, 64, 1.0f, 0.0f).impl_info_str();
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

const std::string& bf16_products_route() { return route().description; }

void sgemm_bf16(GemmBackend f32_library, bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
                int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  // Operands in their stored orientation: A (M, K) or (K, M), B (K, N) or (N, K).
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
#if DTRAIN_HAVE_ONEDNN
  thread_local std::vector<uint16_t> a_scratch, b_scratch;
  uint16_t* ah = scratch(a_scratch, a_rows * a_cols);
  uint16_t* bh = scratch(b_scratch, b_rows * b_cols);
  kernels::table().round_to_bf16(a, a_rows, a_cols, lda, ah);
  kernels::table().round_to_bf16(b, b_rows, b_cols, ldb, bh);
  const int threads = apply_omp_threads();
  dnnl::matmul& prim = primitive_for(ta, tb, m, n, k, ldc, alpha, beta, threads);
  const memory::desc amd({m, k}, memory::data_type::bf16, ta ? memory::dims{1, m} : memory::dims{k, 1});
  const memory::desc bmd({k, n}, memory::data_type::bf16, tb ? memory::dims{1, k} : memory::dims{n, 1});
  const memory::desc cmd({m, n}, memory::data_type::f32, memory::dims{ldc, 1});
  thread_local dnnl::stream stream(cpu_engine());
  try {
    prim.execute(stream, {{DNNL_ARG_SRC, memory(amd, cpu_engine(), ah)},
                          {DNNL_ARG_WEIGHTS, memory(bmd, cpu_engine(), bh)},
                          {DNNL_ARG_DST, memory(cmd, cpu_engine(), c)}});
    stream.wait();
  } catch (const dnnl::error& e) {
    DT_THROW("tensor", "bf16 product on oneDNN failed on M {} N {} K {} trans {}{}: {}", m, n, k, ta ? 'T' : 'N',
             tb ? 'T' : 'N', e.what());
  }
#endif
}

}  // namespace dtrain::detail
