// PowerSGD: see powersgd.h.
#include "powersgd.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "dtrain/core/error.h"
#include "dtrain/tensor/autograd.h"
#include "dtrain/tensor/ops.h"
#include "dtrain/tensor/random.h"

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

}  // namespace

PowerSgd::PowerSgd(int rank, std::vector<Tensor> grads, uint64_t seed) : rank_(rank), grads_(std::move(grads)) {
  DT_CHECK(rank >= 1, "ddp", "powersgd rank {} must be at least 1", rank);
  Generator gen(seed);  // the same on every rank: every rank starts from the same Q
  for (size_t k = 0; k < grads_.size(); ++k) {
    const Tensor& g = grads_[k];
    const int64_t r = rank;
    if (g.dim() == 2 && (g.size(0) + g.size(1)) * r < g.size(0) * g.size(1)) {
      Matrix mat{k, g.size(0), g.size(1), Tensor::randn({g.size(1), r}, gen), Tensor::zeros(g.shape())};
      matrices_.push_back(std::move(mat));
    } else {
      vectors_.push_back(k);
    }
  }
}

void PowerSgd::reduce(comm::Group& group, uint64_t* wire, uint64_t* raw) {
  NoGradGuard no_grad;
  std::vector<Tensor>& grads = grads_;
  const int world = group.size();
  const int64_t r = rank_;
  // The uncompressed ones, in one buffer.
  size_t vec_count = 0;
  for (size_t k : vectors_) vec_count += static_cast<size_t>(grads[k].numel());
  std::vector<float> vec(vec_count);
  size_t at = 0;
  for (size_t k : vectors_) {
    std::memcpy(vec.data() + at, grads[k].data(), static_cast<size_t>(grads[k].numel()) * sizeof(float));
    at += static_cast<size_t>(grads[k].numel());
  }
  if (vec_count > 0) group.all_reduce(vec.data(), vec.data(), vec_count, comm::DataType::f32, comm::ReduceOp::avg);
  at = 0;
  for (size_t k : vectors_) {
    std::memcpy(grads[k].data(), vec.data() + at,
                static_cast<size_t>(grads[k].numel()) * sizeof(float));
    at += static_cast<size_t>(grads[k].numel());
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
  std::vector<Tensor> ms;
  std::vector<float> ps(p_count), qs(q_count);
  at = 0;
  for (const Matrix& mat : matrices_) {
    Tensor m = ops::add(grads[mat.index].reshape({mat.n, mat.m}), mat.error);
    const Tensor p = ops::matmul(m, mat.q);
    std::memcpy(ps.data() + at, p.data(), static_cast<size_t>(mat.n * r) * sizeof(float));
    at += static_cast<size_t>(mat.n * r);
    ms.push_back(std::move(m));
  }
  if (p_count > 0) group.all_reduce(ps.data(), ps.data(), p_count, comm::DataType::f32, comm::ReduceOp::avg);
  // Orthonormal P, then Q = M^T P, the Q's in one buffer.
  at = 0;
  size_t qat = 0;
  std::vector<Tensor> pts;
  for (size_t i = 0; i < matrices_.size(); ++i) {
    const Matrix& mat = matrices_[i];
    orthonormalize(ps.data() + at, mat.n, r);
    Tensor p = Tensor::empty({mat.n, r});
    std::memcpy(p.data(), ps.data() + at, static_cast<size_t>(mat.n * r) * sizeof(float));
    at += static_cast<size_t>(mat.n * r);
    const Tensor q = ops::matmul(ms[i].transpose(0, 1), p);
    std::memcpy(qs.data() + qat, q.data(), static_cast<size_t>(mat.m * r) * sizeof(float));
    qat += static_cast<size_t>(mat.m * r);
    pts.push_back(std::move(p));
  }
  if (q_count > 0) group.all_reduce(qs.data(), qs.data(), q_count, comm::DataType::f32, comm::ReduceOp::avg);
  // G^ = P Q^T; E = M - G^; the gradient becomes G^. Q stays for the next step.
  qat = 0;
  for (size_t i = 0; i < matrices_.size(); ++i) {
    Matrix& mat = matrices_[i];
    std::memcpy(mat.q.data(), qs.data() + qat, static_cast<size_t>(mat.m * r) * sizeof(float));
    qat += static_cast<size_t>(mat.m * r);
    const Tensor approx = ops::matmul(pts[i], mat.q.transpose(0, 1));
    mat.error.copy_from(ops::sub(ms[i], approx));
    std::memcpy(grads[mat.index].data(), approx.data(),
                static_cast<size_t>(mat.n * mat.m) * sizeof(float));
  }
  if (wire) *wire += all_reduce_bytes(sent, world);
  if (raw) *raw += all_reduce_bytes(full, world);
}

std::vector<nn::NamedTensor> PowerSgd::state() const {
  std::vector<nn::NamedTensor> out;
  for (const Matrix& mat : matrices_) {
    out.emplace_back("powersgd.q." + std::to_string(mat.index), mat.q.clone());
    out.emplace_back("powersgd.error." + std::to_string(mat.index), mat.error.clone());
  }
  return out;
}

void PowerSgd::load_state(const std::vector<nn::NamedTensor>& state) {
  for (Matrix& mat : matrices_) {
    for (auto [prefix, target] :
         {std::pair<const char*, Tensor*>{"powersgd.q.", &mat.q}, {"powersgd.error.", &mat.error}}) {
      target->copy_from(compression_entry(state, prefix + std::to_string(mat.index), target->shape()));
    }
  }
}

const Tensor& compression_entry(const std::vector<nn::NamedTensor>& state, const std::string& name,
                                const Shape& shape) {
  auto it = std::find_if(state.begin(), state.end(), [&](const nn::NamedTensor& e) { return e.first == name; });
  DT_CHECK(it != state.end() && it->second.shape() == shape, "ddp", "compression state has no '{}' of shape {}", name,
           shape_str(shape));
  return it->second;
}

}  // namespace dtrain::parallel
