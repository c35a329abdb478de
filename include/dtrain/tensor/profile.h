// Time per op kind (`dtrain train --profile`): where a step's time goes, so that the next
// bottleneck is visible.
//
// Vocabulary: a *scope* is a stretch of code charged to one *kind* (matmul, layer_norm, ...).
// Scopes nest, and time is charged *exclusively*: while an inner scope runs (the sgemm inside
// the attention op), its time goes to the inner kind only, so the kinds add up to at most the
// wall time of the code they cover. The *phase* is backward while autograd's engine runs
// (Tensor::backward), forward otherwise. When profiling is off (the default) a scope costs one
// relaxed atomic load.
#pragma once

#include <atomic>
#include <cstdint>
#include <vector>

namespace dtrain::profile {

enum class Kind : uint8_t {
  matmul,  // every product on sgemm (linear, matmul, the attention's products on the library's route)
  linear,  // linear's own work besides its products: the bias and its gradient
  layer_norm,
  gelu,
  softmax,    // softmax and log-softmax
  attention,  // causal attention besides its library products (mask, softmax and its gradient); on
              // dtrain's own kernels (AVX-512, ops::attention_f32_kernel) its products too, fused with them
  cross_entropy,
  embedding,
  elementwise,  // add, mul, activations other than GELU, copies, sums
  dropout,
  grad_accumulate,  // gradients summed into a leaf or into a node's pending gradient
  bucket_copy,      // grad-ready hooks: data parallelism's copies into its buckets, bucket launches
  comm_wait,        // waiting for the gradient buckets' collectives (synchronize)
  optimizer,        // clipping and the optimizer's update
  grad_zero,        // zeroing (dropping) the gradients after the update
  data,             // drawing a batch
  count
};
constexpr int kKinds = static_cast<int>(Kind::count);

/// "matmul", "layer_norm", ...
const char* kind_name(Kind kind);

/// Turns profiling on or off for the whole process (all threads).
void set_enabled(bool on);
bool enabled();
/// Forgets the time charged so far.
void reset();

struct Entry {
  Kind kind = Kind::matmul;
  double forward_s = 0, backward_s = 0;
  int64_t calls = 0;  // scopes entered
  double total_s() const { return forward_s + backward_s; }
};
/// Time charged to every kind since the last reset, in Kind order (kinds never charged too).
std::vector<Entry> snapshot();

namespace detail {
void enter(Kind kind, Kind* saved, bool* saved_active);
void leave(Kind saved, bool saved_active);
inline std::atomic<bool> g_enabled{false};
inline bool enabled_fast() { return g_enabled.load(std::memory_order_relaxed); }
}  // namespace detail

/// Charges the code until the end of the enclosing block to `kind`.
class Scope {
 public:
  explicit Scope(Kind kind) : active_(detail::enabled_fast()) {
    if (active_) detail::enter(kind, &saved_, &saved_active_);
  }
  ~Scope() {
    if (active_) detail::leave(saved_, saved_active_);
  }
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

 private:
  bool active_;
  bool saved_active_ = false;
  Kind saved_ = Kind::matmul;
};

/// Marks the calling thread as running backward until the end of the block.
class BackwardPhase {
 public:
  BackwardPhase();
  ~BackwardPhase();
  BackwardPhase(const BackwardPhase&) = delete;
  BackwardPhase& operator=(const BackwardPhase&) = delete;

 private:
  bool saved_;
};

}  // namespace dtrain::profile
