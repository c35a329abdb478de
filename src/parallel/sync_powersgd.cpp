// PowerSGD (Vogels et al., 2019): low-rank gradient exchange with error feedback and warm start,
// over the buckets' plain memory (see sync.h).
//
// Per step, for every matrix gradient G (n x m) with error E from the last step:
//   M = G + E                      the gradient with what earlier steps did not deliver
//   P = M Q                        n x r, Q (m x r) kept from the last step (warm start)
//   P = avg over ranks, then orthonormal columns (Gram-Schmidt)
//   Q = M^T P                      m x r, then avg over ranks
//   G^ = P Q^T                     the rank-r approximation of the averaged M
//   E = M - G^                     (this rank's; fed into the next step)
// P and Q of all matrices travel in one all_reduce each. Vectors, and matrices that a rank-r
// factorisation would not shrink, are averaged uncompressed in one more all_reduce. Every rank
// ends with bitwise identical gradients (the reduced P and Q are identical, the rest is local
// arithmetic on them). The products run on the tensor layer's sgemm, each as a product of
// row-major operands without transposes (a transposed operand is copied first), as dtrain's
// matmul does, so the bits are those of matmul.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "dtrain/core/error.h"
#include "dtrain/tensor/gemm.h"
#include "dtrain/tensor/random.h"
#include "sync.h"

namespace dtrain::parallel {

namespace {

// Ring all_reduce volume per rank: 2 (w - 1) / w of the buffer.
uint64_t all_reduce_bytes(size_t count, int world) {
  return world <= 1 ? 0 : 2 * (static_cast<uint64_t>(world) - 1) * count * sizeof(float) / static_cast<uint64_t>(world);
}

// Orthonormal columns of p (n x r, row-major), in place: modified Gram-Schmidt in double.
// A column that is (numerically) zero becomes zero, not NaN.
void orthonormalize(float* p, int64_t n, int64_t r) {
  std::vector<double> col(static_cast<size_t>(n));
  for (int64_t j = 0; j < r; ++j) {
    for (int64_t i = 0; i < n; ++i) col[static_cast<size_t>(i)] = p[i * r + j];
    for (int64_t k = 0; k < j; ++k) {
      double dot = 0.0;
      for (int64_t i = 0; i < n; ++i) dot += col[static_cast<size_t>(i)] * p[i * r + k];
      for (int64_t i = 0; i < n; ++i) col[static_cast<size_t>(i)] -= dot * p[i * r + k];
    }
    double norm = 0.0;
    for (double v : col) norm += v * v;
    norm = std::sqrt(norm);
    const double inv = norm > 1e-30 ? 1.0 / norm : 0.0;
    for (int64_t i = 0; i < n; ++i) p[i * r + j] = static_cast<float>(col[static_cast<size_t>(i)] * inv);
  }
}

// Zeroed, 64-byte aligned floats (as tensor storages are).
Floats floats(int64_t count) { return zeroed_floats({}, static_cast<size_t>(count)); }

// C (rows, cols) = A (rows, inner) B (inner, cols), row-major: matmul's call of sgemm.
Floats product(const float* a, const float* b, int64_t rows, int64_t cols, int64_t inner) {
  Floats c = floats(rows * cols);
  sgemm(false, false, rows, cols, inner, 1.0f, a, std::max<int64_t>(1, inner), b, std::max<int64_t>(1, cols), 0.0f,
        c.get(), std::max<int64_t>(1, cols));
  return c;
}

// The transpose (cols, rows) of a (rows, cols), row-major.
Floats transposed(const float* a, int64_t rows, int64_t cols) {
  Floats t = floats(rows * cols);
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) t.get()[j * rows + i] = a[i * cols + j];
  }
  return t;
}

class PowerSgdSync : public AllReduceSync {
 public:
  PowerSgdSync(SyncContext context, int rank, uint64_t seed, const std::vector<ReducerParam>& params)
      : AllReduceSync(std::move(context)), rank_(rank) {
    DT_CHECK(rank >= 1, "ddp", "powersgd rank {} must be at least 1", rank);
    Generator gen(seed);  // the same on every rank: every rank starts from the same Q
    const int64_t r = rank;
    for (size_t k = 0; k < params.size(); ++k) {
      const int64_t n = params[k].rows, m = params[k].cols;
      if (n > 0 && m > 0 && (n + m) * r < n * m) {
        // Q and the error persist: from the reducer's allocator, like the buckets.
        Matrix mat{k, n, m, zeroed_floats(ctx_.allocate, static_cast<size_t>(m * r)),
                   zeroed_floats(ctx_.allocate, static_cast<size_t>(n * m))};
        for (int64_t i = 0; i < m * r; ++i) mat.q.get()[i] = gen.normal();
        matrices_.push_back(std::move(mat));
      } else {
        vectors_.push_back(k);
      }
    }
  }

  void place(std::vector<Bucket>& buckets, const std::vector<ReducerParam>& params) override {
    AllReduceSync::place(buckets, params);
    grads_.resize(params.size());
    counts_.resize(params.size());
    for (const Bucket& b : buckets) {
      for (size_t i = 0; i < b.params.size(); ++i) {
        grads_[b.params[i]] = b.grad.get() + b.offsets[i];
        counts_[b.params[i]] = params[b.params[i]].values.count;
      }
    }
  }

  bool per_bucket() const override { return false; }
  comm::Work start(Bucket& /*b*/) override { DT_THROW("ddp", "powersgd reduces every bucket at once, after backward"); }

  // Replaces every gradient (holding this rank's) by the averaged approximation.
  void reduce_all(std::vector<Bucket>& /*buckets*/) override {
    comm::Group& group = ctx_.group;
    const int world = group.size();
    const int64_t r = rank_;
    // The uncompressed ones, in one buffer.
    size_t vec_count = 0;
    for (size_t k : vectors_) vec_count += counts_[k];
    std::vector<float> vec(vec_count);
    size_t at = 0;
    for (size_t k : vectors_) {
      std::memcpy(vec.data() + at, grads_[k], counts_[k] * sizeof(float));
      at += counts_[k];
    }
    if (vec_count > 0) group.all_reduce(vec.data(), vec.data(), vec_count, comm::DataType::f32, comm::ReduceOp::avg);
    at = 0;
    for (size_t k : vectors_) {
      std::memcpy(grads_[k], vec.data() + at, counts_[k] * sizeof(float));
      at += counts_[k];
    }
    uint64_t full = vec_count, sent = vec_count;

    // M = G + E, P = M Q for every matrix, the P's in one buffer.
    size_t p_count = 0, q_count = 0;
    for (const Matrix& mat : matrices_) {
      p_count += static_cast<size_t>(mat.n * r);
      q_count += static_cast<size_t>(mat.m * r);
      full += static_cast<uint64_t>(mat.n * mat.m);
    }
    sent += p_count + q_count;
    std::vector<Floats> ms;
    std::vector<float> ps(p_count), qs(q_count);
    at = 0;
    for (const Matrix& mat : matrices_) {
      Floats m = floats(mat.n * mat.m);
      const float* g = grads_[mat.index];
      const float* e = mat.error.get();
      for (int64_t i = 0; i < mat.n * mat.m; ++i) m.get()[i] = g[i] + e[i];
      const Floats p = product(m.get(), mat.q.get(), mat.n, r, mat.m);
      std::memcpy(ps.data() + at, p.get(), static_cast<size_t>(mat.n * r) * sizeof(float));
      at += static_cast<size_t>(mat.n * r);
      ms.push_back(std::move(m));
    }
    if (p_count > 0) group.all_reduce(ps.data(), ps.data(), p_count, comm::DataType::f32, comm::ReduceOp::avg);
    // Orthonormal P, then Q = M^T P, the Q's in one buffer.
    at = 0;
    size_t qat = 0;
    std::vector<Floats> pts;
    for (size_t i = 0; i < matrices_.size(); ++i) {
      const Matrix& mat = matrices_[i];
      orthonormalize(ps.data() + at, mat.n, r);
      Floats p = floats(mat.n * r);
      std::memcpy(p.get(), ps.data() + at, static_cast<size_t>(mat.n * r) * sizeof(float));
      at += static_cast<size_t>(mat.n * r);
      const Floats mt = transposed(ms[i].get(), mat.n, mat.m);
      const Floats q = product(mt.get(), p.get(), mat.m, r, mat.n);
      std::memcpy(qs.data() + qat, q.get(), static_cast<size_t>(mat.m * r) * sizeof(float));
      qat += static_cast<size_t>(mat.m * r);
      pts.push_back(std::move(p));
    }
    if (q_count > 0) group.all_reduce(qs.data(), qs.data(), q_count, comm::DataType::f32, comm::ReduceOp::avg);
    // G^ = P Q^T; E = M - G^; the gradient becomes G^. Q stays for the next step.
    qat = 0;
    for (size_t i = 0; i < matrices_.size(); ++i) {
      Matrix& mat = matrices_[i];
      std::memcpy(mat.q.get(), qs.data() + qat, static_cast<size_t>(mat.m * r) * sizeof(float));
      qat += static_cast<size_t>(mat.m * r);
      const Floats qt = transposed(mat.q.get(), mat.m, r);
      const Floats approx = product(pts[i].get(), qt.get(), mat.n, mat.m, r);
      const float* m = ms[i].get();
      float* e = mat.error.get();
      for (int64_t j = 0; j < mat.n * mat.m; ++j) e[j] = m[j] - approx.get()[j];
      std::memcpy(grads_[mat.index], approx.get(), static_cast<size_t>(mat.n * mat.m) * sizeof(float));
    }
    volume_.wire_bytes += all_reduce_bytes(sent, world);
    volume_.raw_bytes += all_reduce_bytes(full, world);
  }

  // Q and the error of every matrix: "powersgd.q.K", "powersgd.error.K" (K: the parameter).
  std::vector<StateEntry> state(const std::vector<Bucket>& /*buckets*/) const override {
    std::vector<StateEntry> out;
    const int64_t r = rank_;
    for (const Matrix& mat : matrices_) {
      out.push_back({"powersgd.q." + std::to_string(mat.index),
                     {mat.m, r},
                     std::vector<float>(mat.q.get(), mat.q.get() + mat.m * r)});
      out.push_back({"powersgd.error." + std::to_string(mat.index),
                     {mat.n, mat.m},
                     std::vector<float>(mat.error.get(), mat.error.get() + mat.n * mat.m)});
    }
    return out;
  }

  void load_state(std::vector<Bucket>& /*buckets*/, const std::vector<StateEntry>& state) override {
    const int64_t r = rank_;
    for (Matrix& mat : matrices_) {
      const StateEntry& q = state_entry(state, "powersgd.q." + std::to_string(mat.index), {mat.m, r});
      std::memcpy(mat.q.get(), q.values.data(), q.values.size() * sizeof(float));
      const StateEntry& e = state_entry(state, "powersgd.error." + std::to_string(mat.index), {mat.n, mat.m});
      std::memcpy(mat.error.get(), e.values.data(), e.values.size() * sizeof(float));
    }
  }

 private:
  struct Matrix {
    size_t index;  // the parameter
    int64_t n, m;  // shape (n, m)
    Floats q;      // (m, r), warm start
    Floats error;  // (n, m)
  };
  int rank_;
  std::vector<float*> grads_;   // each parameter's gradient slot
  std::vector<size_t> counts_;  // and its elements
  std::vector<Matrix> matrices_;
  std::vector<size_t> vectors_;  // parameters averaged as they are
};

}  // namespace

std::unique_ptr<SyncStrategy> make_powersgd_sync(SyncContext context, int rank, uint64_t seed,
                                                 const std::vector<ReducerParam>& params) {
  return std::make_unique<PowerSgdSync>(std::move(context), rank, seed, params);
}

}  // namespace dtrain::parallel
