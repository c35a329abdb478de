// PowerSGD (Vogels et al., 2019): low-rank gradient exchange with error feedback and warm
// start, for DataParallel (internal to the parallel layer).
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
// arithmetic on them).
#pragma once

#include <cstdint>
#include <vector>

#include "dtrain/comm/group.h"
#include "dtrain/nn/module.h"
#include "dtrain/tensor/tensor.h"

namespace dtrain::parallel {

class PowerSgd {
 public:
  /// `grads`: views of every parameter's gradient buffer (shapes as the parameters), kept:
  /// the buffers must outlive this object.
  PowerSgd(int rank, std::vector<Tensor> grads, uint64_t seed);
  /// Replaces every gradient (holding this rank's) by the averaged approximation. Adds to
  /// *wire and *raw the bytes this rank sent and what the f32 exchange of the same gradients
  /// would have sent (ring all_reduce volume).
  void reduce(comm::Group& group, uint64_t* wire, uint64_t* raw);
  /// Q and the error of every matrix: "powersgd.q.K", "powersgd.error.K" (K: index in grads).
  std::vector<nn::NamedTensor> state() const;
  /// Restores state(); throws naming a missing or misshapen entry.
  void load_state(const std::vector<nn::NamedTensor>& state);

 private:
  struct Matrix {
    size_t index;  // into grads
    int64_t n, m;  // shape (n, m)
    Tensor q;      // (m, r), warm start
    Tensor error;  // (n, m)
  };
  int rank_;
  std::vector<Tensor> grads_;
  std::vector<Matrix> matrices_;
  std::vector<size_t> vectors_;  // grads averaged as they are
};

/// The entry `name` of a saved compression state, checked against `shape`; throws naming a
/// missing or misshapen entry.
const Tensor& compression_entry(const std::vector<nn::NamedTensor>& state, const std::string& name,
                                const Shape& shape);

}  // namespace dtrain::parallel
