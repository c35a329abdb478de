// Dense tensors with shape, strides and a dtype. Compute is f32; bf16 and f16 are storage
// types (used later to compress communication); u8 holds raw bytes (the codes of 8-bit
// optimizer state) that only copy, clone and files handle. A Tensor is a cheap shared handle: copies
// share storage, views (reshape, transpose, slice) share storage with new strides.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace dtrain {

enum class DType : uint8_t { f32, bf16, f16, u8 };
size_t dtype_size(DType dtype);
const char* dtype_name(DType dtype);

using Shape = std::vector<int64_t>;
std::string shape_str(const Shape& shape);
int64_t shape_numel(const Shape& shape);
Shape contiguous_strides(const Shape& shape);

/// Bytes held by tensor storages in this process (all threads): now, and the most since the
/// last reset_peak(). Pipeline stages measure their activation memory with them.
namespace memory {
int64_t live_bytes();
int64_t peak_bytes();
void reset_peak();
}  // namespace memory

/// A 64-byte aligned, uninitialised byte buffer; or memory owned by someone else (e.g. a
/// mapping shared between processes), kept alive by `owner` and not counted in memory::.
struct Storage {
  explicit Storage(size_t nbytes);
  Storage(void* borrowed, size_t nbytes, std::shared_ptr<const void> owner);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
  void* data = nullptr;
  size_t nbytes = 0;
  std::shared_ptr<const void> owner;  // set for borrowed memory
};

class Node;
class Tensor;
using GradReadyHook = std::function<void(Tensor& param)>;

struct TensorImpl {
  std::shared_ptr<Storage> storage;
  int64_t offset = 0;  // in elements
  Shape shape;
  Shape strides;  // in elements
  DType dtype = DType::f32;
  bool requires_grad = false;
  std::shared_ptr<TensorImpl> grad;
  std::shared_ptr<Node> grad_fn;         // set on results of differentiable ops
  std::weak_ptr<Node> grad_accumulator;  // leaves only; recreated per graph
  std::vector<GradReadyHook> grad_ready_hooks;
  std::shared_ptr<TensorImpl> grad_home;  // leaves: where backward may write the first gradient
};

class Generator;

class Tensor {
 public:
  Tensor() = default;
  explicit Tensor(std::shared_ptr<TensorImpl> impl) : impl_(std::move(impl)) {}

  // ---- factories (results never require grad) ----
  static Tensor empty(const Shape& shape, DType dtype = DType::f32);
  static Tensor zeros(const Shape& shape, DType dtype = DType::f32);
  static Tensor ones(const Shape& shape);
  static Tensor full(const Shape& shape, float value);
  static Tensor from_vector(const Shape& shape, const std::vector<float>& values);
  static Tensor scalar(float value);
  /// Normal(0, std) and Uniform[lo, hi) draws from a deterministic generator.
  static Tensor randn(const Shape& shape, Generator& gen, float std = 1.0f);
  static Tensor uniform(const Shape& shape, Generator& gen, float lo, float hi);
  /// A contiguous tensor of `shape` over memory someone else owns (a data-parallel bucket, a
  /// mapping shared between processes), kept alive by `owner` (required); not counted in
  /// memory::. The caller keeps the memory large enough for the shape.
  static Tensor borrow(void* data, const Shape& shape, std::shared_ptr<const void> owner, DType dtype = DType::f32);

  // ---- metadata ----
  bool defined() const { return impl_ != nullptr; }
  const Shape& shape() const;
  const Shape& strides() const;
  int64_t dim() const;
  /// Size of dimension d; negative d counts from the end.
  int64_t size(int64_t d) const;
  int64_t numel() const;
  DType dtype() const;
  bool is_contiguous() const;
  std::string str() const;  // "Tensor(f32, [2, 3])"

  // ---- data access ----
  /// Pointer to the first element; throws unless dtype is f32.
  float* data();
  const float* data() const;
  void* raw_data();
  const void* raw_data() const;
  float item() const;
  std::vector<float> to_vector() const;  // contiguous copy, f32

  // ---- views and copies (autograd-aware) ----
  Tensor contiguous() const;
  Tensor reshape(const Shape& shape) const;  // one dimension may be -1
  Tensor transpose(int64_t d0, int64_t d1) const;
  /// Elements [start, end) of dimension d, a view.
  Tensor slice(int64_t d, int64_t start, int64_t end) const;
  Tensor clone() const;
  /// Shares storage, cut from the graph.
  Tensor detach() const;
  /// Dtype conversion (no autograd). Rounds to nearest even.
  Tensor to(DType dtype) const;
  /// Copies src's values into this tensor (same numel, no autograd).
  void copy_from(const Tensor& src);
  void fill_(float value);
  /// Moves this tensor onto memory someone else owns: from now on its elements are at `data`,
  /// contiguous, this shape and dtype, kept alive by `owner` (required). The values there are
  /// not touched (copy them first). Every handle of this tensor sees the move, so a model's
  /// parameters stay valid (ZeRO moves them into its buckets); views taken before keep the old
  /// storage.
  void rebind(void* data, std::shared_ptr<const void> owner);

  // ---- autograd ----
  bool requires_grad() const;
  Tensor& set_requires_grad(bool requires_grad);
  bool is_leaf() const;
  Tensor grad() const;
  void set_grad(const Tensor& grad);
  void zero_grad();  // drops the gradient (next backward allocates a fresh one)
  std::shared_ptr<Node> grad_fn() const;
  /// Runs reverse-mode differentiation from this scalar.
  void backward() const;
  /// From a tensor of any shape, given d(loss)/d(this) (same shape): a pipeline stage's
  /// backward from the gradient the next stage sent.
  void backward(const Tensor& grad) const;
  /// Fires after this leaf's gradient is final for the current backward pass.
  void register_grad_ready_hook(GradReadyHook hook);
  /// A leaf's gradient home (contiguous f32, this shape; undefined: none): while the leaf has
  /// no gradient, ops that support it (linear layers) write the gradient straight into it,
  /// and it becomes grad() with no copy (data parallelism's buckets: gradient as bucket view).
  /// Later gradients accumulate into it as usual, so it must not be touched between zero_grad()
  /// and the end of the backward that fills it.
  void set_grad_home(const Tensor& home);

  TensorImpl* impl() const { return impl_.get(); }
  const std::shared_ptr<TensorImpl>& impl_ptr() const { return impl_; }
  bool same(const Tensor& other) const { return impl_ == other.impl_; }

 private:
  std::shared_ptr<TensorImpl> impl_;
};

// Arithmetic operators (broadcasting), defined in ops.
Tensor operator+(const Tensor& a, const Tensor& b);
Tensor operator-(const Tensor& a, const Tensor& b);
Tensor operator*(const Tensor& a, const Tensor& b);
Tensor operator/(const Tensor& a, const Tensor& b);
Tensor operator+(const Tensor& a, float b);
Tensor operator-(const Tensor& a, float b);
Tensor operator*(const Tensor& a, float b);
Tensor operator/(const Tensor& a, float b);
Tensor operator-(const Tensor& a);

}  // namespace dtrain
