// DistributedDataParallel (dtrain/torch/ddp.h): torch tensors over the gradient Reducer. The
// reducer sees each parameter as (pointer, count, f32); the gradient accumulators' post-hooks
// are its ready notifications, and the parameters' gradients become views of its buckets.
#include "dtrain/torch/ddp.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/types.h>

#include <algorithm>
#include <cstring>
#include <unordered_set>

#include "dtrain/core/error.h"
#include "dtrain/parallel/replicate.h"

namespace dtrain::torch {

using parallel::BufferView;
using parallel::Reducer;
using parallel::ReducerParam;

namespace {

std::string describe(const at::Tensor& t) {
  std::string shape;
  for (int64_t s : t.sizes()) shape += (shape.empty() ? "" : ", ") + std::to_string(s);
  return fmt::format("{} [{}] on {}{}{}", std::string(c10::toString(t.scalar_type())), shape, t.device().str(),
                     t.layout() != c10::kStrided ? ", not dense" : "",
                     t.layout() == c10::kStrided && !t.is_contiguous() ? ", not contiguous" : "");
}

bool usable(const at::Tensor& t) {
  return t.defined() && t.layout() == c10::kStrided && t.device().is_cpu() && t.scalar_type() == at::kFloat &&
         t.is_contiguous();
}

// A torch tensor over reducer memory, keeping that memory alive.
at::Tensor view_of(const BufferView& v, at::IntArrayRef shape) {
  std::shared_ptr<const void> owner = v.owner;
  return ::torch::from_blob(
      v.data, shape, [owner](void*) mutable { owner.reset(); }, at::TensorOptions().dtype(at::kFloat));
}

std::vector<parallel::ReplicaTensor> replicas(const std::vector<std::pair<std::string, at::Tensor>>& tensors) {
  std::vector<parallel::ReplicaTensor> out;
  for (const auto& [name, t] : tensors) {
    out.push_back({name, t.data_ptr(), t.sizes().vec(), static_cast<size_t>(t.element_size())});
  }
  return out;
}

// The compression state of reducer `from` for reducer `to`, whose parameter moved[j] is
// from's parameter j (the same parameters in other buckets): error-feedback residuals
// ("ef.B", per bucket, in bucket coordinates) move with their parameters; PowerSGD's entries
// ("powersgd.q.K", "powersgd.error.K", per parameter) are renamed.
std::vector<parallel::StateEntry> relayout_state(const Reducer& from, const Reducer& to,
                                                 const std::vector<size_t>& moved) {
  std::vector<parallel::StateEntry> state = from.state(), out;
  auto entry = [&](const std::string& name) -> const parallel::StateEntry* {
    for (const parallel::StateEntry& e : state) {
      if (e.name == name) return &e;
    }
    return nullptr;
  };
  // Where each of from's parameters sits: (bucket, offset).
  std::vector<std::pair<size_t, size_t>> where(moved.size());
  for (size_t b = 0; b < from.num_buckets(); ++b) {
    for (size_t i = 0; i < from.bucket_params(b).size(); ++i)
      where[from.bucket_params(b)[i]] = {b, from.bucket_offsets(b)[i]};
  }
  std::vector<size_t> origin(moved.size());  // to's parameter -> from's
  for (size_t j = 0; j < moved.size(); ++j) origin[moved[j]] = j;
  if (entry("ef.0") != nullptr) {
    for (size_t b = 0; b < to.num_buckets(); ++b) {
      parallel::StateEntry e{"ef." + std::to_string(b),
                             {static_cast<int64_t>(to.bucket_padded(b))},
                             std::vector<float>(to.bucket_padded(b), 0.0f)};
      for (size_t i = 0; i < to.bucket_params(b).size(); ++i) {
        const size_t j = origin[to.bucket_params(b)[i]];
        const auto [old_bucket, old_offset] = where[j];
        const parallel::StateEntry* old = entry("ef." + std::to_string(old_bucket));
        const BufferView grad = to.grad(to.bucket_params(b)[i]);
        if (old == nullptr) continue;
        std::copy_n(old->values.begin() + static_cast<std::ptrdiff_t>(old_offset), grad.count,
                    e.values.begin() + static_cast<std::ptrdiff_t>(to.bucket_offsets(b)[i]));
      }
      out.push_back(std::move(e));
    }
  }
  for (const std::string prefix : {"powersgd.q.", "powersgd.error."}) {
    for (size_t j = 0; j < moved.size(); ++j) {
      if (const parallel::StateEntry* e = entry(prefix + std::to_string(j))) {
        out.push_back({prefix + std::to_string(moved[j]), e->shape, e->values});
      }
    }
  }
  return out;
}

}  // namespace

struct DistributedDataParallel::Impl {
  std::shared_ptr<::torch::nn::Module> module;
  std::vector<std::pair<std::string, at::Tensor>> params;   // trainable, in registration order
  std::vector<std::pair<std::string, at::Tensor>> buffers;  // broadcast, not reduced
  comm::Group group;
  parallel::ReducerOptions reducer_options;
  bool rebuild = true;  // lay the buckets out again in the order of the first backward
  std::unique_ptr<Reducer> reducer;
  std::vector<size_t> order;    // the reducer's parameter j is params[order[j]]
  std::vector<size_t> slot_of;  // and params[k] is the reducer's parameter slot_of[k]
  std::vector<std::shared_ptr<::torch::autograd::Node>> accumulators;  // kept alive: they hold the hooks
  std::vector<uintptr_t> hook_keys;
  std::vector<bool> ready;                            // marked in this step's synchronising backward
  std::vector<bool> accumulated;                      // got a gradient in a backward without sync since synchronize()
  std::vector<size_t> first_ready;                    // the order of the first synchronising backward (rebuild)
  std::vector<parallel::BucketEvent> carried_events;  // of a reducer replaced by the rebuild
  parallel::CommVolume carried_volume;
  bool sync = true;

  // A reducer over the parameters in `new_order` (buckets in its reverse: the last one first).
  void make_reducer(std::vector<size_t> new_order) {
    std::vector<ReducerParam> views;
    for (size_t k : new_order) {
      at::Tensor& p = params[k].second;
      ReducerParam v{params[k].first, {p.data_ptr(), static_cast<size_t>(p.numel()), comm::DataType::f32, nullptr}};
      if (p.dim() >= 2) {  // PowerSGD sees a matrix (first dimension, the rest), as torch's hook does
        v.rows = p.size(0);
        v.cols = p.numel() / std::max<int64_t>(1, p.size(0));
      }
      views.push_back(std::move(v));
    }
    reducer = std::make_unique<Reducer>(std::move(views), group, reducer_options);
    order = std::move(new_order);
    slot_of.assign(order.size(), 0);
    for (size_t j = 0; j < order.size(); ++j) slot_of[order[j]] = j;
  }

  // Parameter k's gradient in this gradient-ready call or in synchronize(): its memory for
  // the reducer (null when it has none, which the reducer reports).
  const void* gradient_of(size_t k) {
    const auto& [name, p] = params[k];
    const at::Tensor& g = p.grad();
    if (!g.defined()) return nullptr;
    DT_CHECK(usable(g), "ddp", "parameter '{}': its gradient is {}; expected a dense contiguous float32 CPU tensor",
             name, describe(g));
    return g.data_ptr();
  }

  // The post-hook of parameter k's gradient accumulator: its gradient for this backward is final.
  void on_grad_ready(size_t k) {
    if (!sync) {
      accumulated[k] = true;
      return;
    }
    const void* g = gradient_of(k);
    if (rebuild && !ready[k]) first_ready.push_back(k);
    ready[k] = true;
    reducer->mark_ready(slot_of[k], g);
  }

  // Once, in the first synchronize(): the buckets again, in the order rank 0's first
  // synchronising backward produced the gradients (then those it did not reach, in reverse
  // registration order), when that differs from reverse registration order. Collective: every
  // rank takes rank 0's order. The averaged gradients and the compression state (error
  // feedback, PowerSGD's Q and error) move into the new buckets.
  void rebuild_buckets() {
    rebuild = false;
    const size_t n = params.size();
    std::vector<int64_t> wanted;  // params in the order their gradients came
    std::vector<bool> placed(n, false);
    for (size_t k : first_ready) {
      wanted.push_back(static_cast<int64_t>(k));
      placed[k] = true;
    }
    for (size_t k = n; k-- > 0;) {
      if (!placed[k]) wanted.push_back(static_cast<int64_t>(k));
    }
    first_ready.clear();
    group.broadcast(wanted.data(), n, comm::DataType::i64, 0);
    std::vector<size_t> new_order(n);  // the reducer lays buckets out from its last parameter
    for (size_t j = 0; j < n; ++j) new_order[j] = static_cast<size_t>(wanted[n - 1 - j]);
    if (new_order == order) return;
    std::unique_ptr<Reducer> old = std::move(reducer);
    for (parallel::BucketEvent& e : old->take_events()) carried_events.push_back(e);
    const parallel::CommVolume v = old->take_volume();
    carried_volume.wire_bytes += v.wire_bytes;
    carried_volume.raw_bytes += v.raw_bytes;
    const std::vector<size_t> old_order = order;
    make_reducer(std::move(new_order));
    std::vector<size_t> moved(n);  // the old reducer's parameter j is the new one's moved[j]
    for (size_t j = 0; j < n; ++j) moved[j] = slot_of[old_order[j]];
    for (size_t j = 0; j < n; ++j) {
      const BufferView from = old->grad(j), to = reducer->grad(moved[j]);
      std::memcpy(to.data, from.data, from.bytes());
    }
    reducer->load_state(relayout_state(*old, *reducer, moved));
  }
};

DistributedDataParallel::DistributedDataParallel(std::shared_ptr<::torch::nn::Module> module, comm::Group group,
                                                 DdpOptions options)
    : impl_(std::make_shared<Impl>()) {
  Impl& d = *impl_;
  DT_CHECK(module != nullptr, "ddp", "DistributedDataParallel needs a module, got null");
  DT_CHECK(group.size() >= 1, "ddp", "DistributedDataParallel needs a group, got an empty one");
  DT_CHECK(options.bucket_bytes >= sizeof(float), "ddp", "bucket size {} bytes is too small", options.bucket_bytes);
  const parallel::Compression compression = parallel::parse_compression(options.compress);
  d.module = std::move(module);
  std::unordered_set<const void*> seen;  // a tensor registered under two names counts once
  auto add_buffer = [&](const std::string& name, const at::Tensor& b) {
    DT_CHECK(b.layout() == c10::kStrided && b.device().is_cpu() && b.is_contiguous(), "ddp",
             "buffer '{}' must be a dense contiguous CPU tensor, is {}", name, describe(b));
    d.buffers.emplace_back(name, b);
  };
  for (const auto& item : d.module->named_parameters(/*recurse=*/true)) {
    const at::Tensor& p = item.value();
    if (!seen.insert(p.unsafeGetTensorImpl()).second) continue;
    if (!p.requires_grad()) {
      add_buffer(item.key(), p);  // frozen: kept equal, never reduced
      continue;
    }
    DT_CHECK(usable(p), "ddp", "parameter '{}' must be a dense contiguous float32 CPU tensor, is {}", item.key(),
             describe(p));
    d.params.emplace_back(item.key(), p);
  }
  for (const auto& item : d.module->named_buffers(/*recurse=*/true)) {
    const at::Tensor& b = item.value();
    if (!b.defined() || !seen.insert(b.unsafeGetTensorImpl()).second) continue;
    add_buffer(item.key(), b);
  }

  // Same model, rank 0's values: before the reducer, whose layout assumes the same model.
  {
    at::NoGradGuard no_grad;
    auto all = d.params;
    all.insert(all.end(), d.buffers.begin(), d.buffers.end());
    parallel::replicate_from_rank0(group, replicas(all), /*broadcast=*/true);
  }

  d.group = std::move(group);
  d.reducer_options.bucket_bytes = options.bucket_bytes;
  d.reducer_options.overlap = options.overlap;
  d.reducer_options.record_events = options.record_events;
  d.reducer_options.share_memory = options.share_memory;
  d.reducer_options.compression = compression;
  d.reducer_options.seed = options.seed;
  d.rebuild = options.rebuild_buckets;
  std::vector<size_t> registration(d.params.size());
  for (size_t k = 0; k < registration.size(); ++k) registration[k] = k;
  d.make_reducer(std::move(registration));
  d.ready.assign(d.params.size(), false);
  d.accumulated.assign(d.params.size(), false);

  // Hooks hold the state weakly: a model that outlives its DistributedDataParallel stops syncing.
  std::weak_ptr<Impl> weak = impl_;
  for (size_t k = 0; k < d.params.size(); ++k) {
    std::shared_ptr<::torch::autograd::Node> acc = ::torch::autograd::impl::grad_accumulator(d.params[k].second);
    DT_CHECK(acc != nullptr, "ddp", "parameter '{}' has no gradient accumulator (not a leaf?)", d.params[k].first);
    d.hook_keys.push_back(acc->add_post_hook(std::make_unique<::torch::autograd::utils::LambdaPostHook>(
        [weak, k](const ::torch::autograd::variable_list& outputs, const ::torch::autograd::variable_list&) {
          if (auto s = weak.lock()) s->on_grad_ready(k);
          return outputs;
        })));
    d.accumulators.push_back(std::move(acc));
  }
}

DistributedDataParallel::~DistributedDataParallel() {
  for (size_t k = 0; k < impl_->accumulators.size(); ++k) impl_->accumulators[k]->del_post_hook(impl_->hook_keys[k]);
  // The reducer lets the buckets in flight finish (or fail) before it frees them; gradients
  // that are views of them keep their memory.
}

const std::shared_ptr<::torch::nn::Module>& DistributedDataParallel::module() const { return impl_->module; }
int DistributedDataParallel::rank() const { return impl_->group.rank(); }
int DistributedDataParallel::world() const { return impl_->group.size(); }
size_t DistributedDataParallel::num_buckets() const { return impl_->reducer->num_buckets(); }

std::vector<std::string> DistributedDataParallel::bucket_parameters(size_t b) const {
  std::vector<std::string> out;
  for (size_t j : impl_->reducer->bucket_params(b)) out.push_back(impl_->params[impl_->order[j]].first);
  return out;
}

void DistributedDataParallel::set_sync(bool on) { impl_->sync = on; }
bool DistributedDataParallel::sync() const { return impl_->sync; }

DistributedDataParallel::NoSync::NoSync(DistributedDataParallel& ddp) : ddp_(ddp), was_(ddp.sync()) {
  ddp_.set_sync(false);
}
DistributedDataParallel::NoSync::~NoSync() { ddp_.set_sync(was_); }
DistributedDataParallel::NoSync DistributedDataParallel::no_sync() { return NoSync(*this); }

void DistributedDataParallel::synchronize() {
  Impl& d = *impl_;
  at::NoGradGuard no_grad;
  // Gradients accumulated without sync that this step's synchronising backward did not reach
  // still count (the others contribute zeros).
  for (size_t k = 0; k < d.params.size(); ++k) {
    if (d.accumulated[k] && !d.ready[k]) {
      const void* g = d.gradient_of(k);
      if (g != nullptr) d.reducer->mark_ready(d.slot_of[k], g);
    }
  }
  std::fill(d.ready.begin(), d.ready.end(), false);
  std::fill(d.accumulated.begin(), d.accumulated.end(), false);
  d.reducer->finish();
  if (d.rebuild) d.rebuild_buckets();
  // The averaged gradients are in the buckets: hand them over as views (once; after that
  // backward accumulates into them).
  for (size_t k = 0; k < d.params.size(); ++k) {
    at::Tensor& p = d.params[k].second;
    const BufferView v = d.reducer->grad(d.slot_of[k]);
    if (p.grad().defined() && p.grad().data_ptr() == v.data) continue;
    p.mutable_grad() = view_of(v, p.sizes());
  }
}

void DistributedDataParallel::broadcast_buffers() {
  Impl& d = *impl_;
  at::NoGradGuard no_grad;
  for (auto& [name, b] : d.buffers) d.group.broadcast(b.data_ptr(), b.nbytes(), comm::DataType::u8, 0);
}

std::vector<parallel::BucketEvent> DistributedDataParallel::take_bucket_events() {
  std::vector<parallel::BucketEvent> out;
  out.swap(impl_->carried_events);
  for (parallel::BucketEvent& e : impl_->reducer->take_events()) out.push_back(e);
  return out;
}

parallel::CommVolume DistributedDataParallel::take_comm_volume() {
  parallel::CommVolume v = impl_->reducer->take_volume();
  v.wire_bytes += impl_->carried_volume.wire_bytes;
  v.raw_bytes += impl_->carried_volume.raw_bytes;
  impl_->carried_volume = {};
  return v;
}

}  // namespace dtrain::torch
