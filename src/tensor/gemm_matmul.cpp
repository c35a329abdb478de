// oneDNN's matmul primitive, for the products that the BLAS-like dnnl_sgemm cannot express: bf16
// operands (gemm_bf16.cpp), a bias added in the kernel's epilogue (gemm.h's sgemm_bias) and a
// bf16 result rounded there (gemm.h's gemm_bf16_to_bf16).
//
// A primitive is built once per (operand type, shape, strides, alpha, beta, bias, result type,
// threads) and
// kept for the life of the process; building one takes far longer than running it. Threads of one
// process (data-parallel ranks in tests, a trainer's helper threads) run the same primitive at
// once, so each brings its own scratchpad (scratchpad_mode::user): with the library's, concurrent
// runs of one primitive gave wrong results here (the data-parallel tests whose ranks are threads).
#include "gemm_internal.h"

#if DTRAIN_HAVE_ONEDNN
#include <cstring>
#include <map>
#include <mutex>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "dtrain/core/error.h"

namespace dtrain::detail {

namespace {

using dnnl::memory;

// (bf16 operands, trans_a, trans_b, M, N, K, lda, ldb, ldc, alpha bits, beta bits, bias, bf16 C, residual,
// threads)
using PrimitiveKey = std::tuple<bool, bool, bool, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, uint32_t,
                                uint32_t, bool, bool, bool, int>;

struct Built {
  dnnl::matmul::primitive_desc desc;
  dnnl::matmul primitive;
};

struct Primitives {
  std::mutex mu;
  std::map<PrimitiveKey, Built> built;
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

memory::data_type operand_type(bool bf16) { return bf16 ? memory::data_type::bf16 : memory::data_type::f32; }

}  // namespace

dnnl::engine& onednn_engine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

memory::desc matmul_operand(bool bf16, int64_t rows, int64_t cols, bool trans, int64_t ld) {
  return memory::desc({rows, cols}, operand_type(bf16), trans ? memory::dims{1, ld} : memory::dims{ld, 1});
}

memory::desc matmul_result(int64_t m, int64_t n, int64_t ldc, bool bf16) {
  return memory::desc({m, n}, operand_type(bf16), memory::dims{ldc, 1});
}

memory::desc matmul_bias(int64_t n) { return memory::desc({1, n}, memory::data_type::f32, memory::dims{n, 1}); }

dnnl::matmul::primitive_desc describe_matmul(const MatmulShape& s) {
  const memory::desc a = matmul_operand(s.bf16, s.m, s.k, s.ta, s.lda);
  const memory::desc b = matmul_operand(s.bf16, s.k, s.n, s.tb, s.ldb);
  const memory::desc c = matmul_result(s.m, s.n, s.ldc, s.c_bf16);
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  if (s.alpha != 1.0f) attr.set_output_scales(0, {s.alpha});
  if (s.beta != 0.0f || s.residual) {
    dnnl::post_ops ops;
    if (s.beta != 0.0f) ops.append_sum(s.beta);
    // The residual as a binary post-op: added to each f32 value (product + bias) as it is written.
    if (s.residual) ops.append_binary(dnnl::algorithm::binary_add, matmul_result(s.m, s.n, s.n, false));
    attr.set_post_ops(ops);
  }
  if (s.bias) return {dnnl::matmul::desc(a, b, matmul_bias(s.n), c), attr, onednn_engine()};
  return {dnnl::matmul::desc(a, b, c), attr, onednn_engine()};
}

void run_matmul(const MatmulShape& s, const void* a, const void* b, const float* bias, void* c, const float* residual) {
  DT_CHECK(s.residual == (residual != nullptr), "tensor", "matmul M {} N {} K {}: a residual is {} but {}", s.m, s.n,
           s.k, s.residual ? "expected" : "not expected", residual != nullptr ? "given" : "missing");
  const int threads = apply_omp_threads();
  Primitives& p = primitives();
  const PrimitiveKey key{s.bf16, s.ta,          s.tb,         s.m,    s.n,      s.k,        s.lda,  s.ldb,
                         s.ldc,  bits(s.alpha), bits(s.beta), s.bias, s.c_bf16, s.residual, threads};
  Built* built = nullptr;
  {
    std::lock_guard<std::mutex> lock(p.mu);
    auto it = p.built.find(key);
    if (it == p.built.end()) {
      dnnl::matmul::primitive_desc desc = describe_matmul(s);
      dnnl::matmul primitive(desc);
      it = p.built.emplace(key, Built{std::move(desc), std::move(primitive)}).first;
    }
    built = &it->second;
  }
  thread_local dnnl::stream stream(onednn_engine());
  // oneDNN takes the handles as void*; it only reads the operands and the bias.
  std::unordered_map<int, memory> args{
      {DNNL_ARG_SRC, memory(matmul_operand(s.bf16, s.m, s.k, s.ta, s.lda), onednn_engine(), const_cast<void*>(a))},
      {DNNL_ARG_WEIGHTS, memory(matmul_operand(s.bf16, s.k, s.n, s.tb, s.ldb), onednn_engine(), const_cast<void*>(b))},
      {DNNL_ARG_DST, memory(matmul_result(s.m, s.n, s.ldc, s.c_bf16), onednn_engine(), c)}};
  if (s.bias) args.emplace(DNNL_ARG_BIAS, memory(matmul_bias(s.n), onednn_engine(), const_cast<float*>(bias)));
  if (s.residual) {
    args.emplace(DNNL_ARG_ATTR_MULTIPLE_POST_OP(0) | DNNL_ARG_SRC_1,
                 memory(matmul_result(s.m, s.n, s.n, false), onednn_engine(), const_cast<float*>(residual)));
  }
  const memory::desc scratch_desc = built->desc.scratchpad_desc();
  thread_local std::vector<unsigned char> scratch;
  if (scratch.size() < scratch_desc.get_size()) scratch.resize(scratch_desc.get_size());
  args.emplace(DNNL_ARG_SCRATCHPAD, memory(scratch_desc, onednn_engine(), scratch.data()));
  try {
    built->primitive.execute(stream, args);
    stream.wait();
  } catch (const dnnl::error& e) {
    DT_THROW("tensor", "{} product on oneDNN's matmul failed on M {} N {} K {} trans {}{}: {}", s.bf16 ? "bf16" : "f32",
             s.m, s.n, s.k, s.ta ? 'T' : 'N', s.tb ? 'T' : 'N', e.what());
  }
}

}  // namespace dtrain::detail
#endif
