// DataParallel: dtrain's tensors over the gradient Reducer (reducer.h). The parameters'
// gradients become views of the reducer's buckets, its hooks are the tensors' grad-ready hooks,
// and under ZeRO the parameters move into the buckets' values.
#include "dtrain/parallel/ddp.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "dtrain/core/error.h"
#include "dtrain/parallel/replicate.h"
#include "dtrain/tensor/autograd.h"

namespace dtrain::parallel {

using comm::DataType;
using comm::ReduceOp;

namespace {

// A tensor of `shape` over reducer memory (not part of any graph).
Tensor view_of(const BufferView& v, const Shape& shape) { return Tensor::borrow(v.data, shape, v.owner); }

// The reducer's buffers are tensor storages, so they count in dtrain::memory like the model's.
std::shared_ptr<void> tensor_storage(size_t bytes) {
  Tensor t = Tensor::empty({static_cast<int64_t>(bytes / sizeof(float))});
  return std::shared_ptr<void>(t.impl_ptr(), t.raw_data());
}

}  // namespace

struct DataParallel::Impl {
  std::vector<nn::NamedTensor> params;
  DdpOptions options;
  std::unique_ptr<Reducer> reducer;
  std::vector<Tensor> pieces;  // ZeRO: per bucket, this rank's piece of the values (the optimizer's)
  bool sync = true;

  comm::Group& group() const { return reducer->group(); }

  // Gradient as bucket view: linear layers write their gradients straight into the buckets
  // (ZeRO 2 frees its full-size buffers between steps, so it keeps copying). Off: backward
  // writes new tensors.
  void set_grad_homes(bool on) {
    if (options.zero == 2) return;
    for (size_t k = 0; k < params.size(); ++k) {
      Tensor& t = params[k].second;
      t.set_grad_home(on ? view_of(reducer->grad(k), t.shape()) : Tensor());
    }
  }

  void on_grad_ready(size_t index, Tensor& param) {
    if (!sync || options.deterministic) return;
    const Tensor g = param.grad();
    const bool usable = g.defined() && g.is_contiguous() && g.dtype() == DType::f32;
    reducer->mark_ready(index, usable ? g.data() : nullptr);
  }
};

DataParallel::DataParallel(std::vector<nn::NamedTensor> params, comm::Group group, DdpOptions options)
    : impl_(std::make_shared<Impl>()) {
  Impl& d = *impl_;
  DT_CHECK(group.size() >= 1, "ddp", "DataParallel needs a group");
  DT_CHECK(options.zero >= 0 && options.zero <= 2, "ddp", "zero stage {} is not 0, 1 or 2", options.zero);
  DT_CHECK(options.bucket_bytes >= sizeof(float), "ddp", "bucket size {} bytes is too small", options.bucket_bytes);
  d.params = std::move(params);
  d.options = options;
  for (const auto& [name, t] : d.params) {
    DT_CHECK(t.dtype() == DType::f32 && t.is_contiguous(), "ddp", "parameter '{}' must be contiguous f32, is {}", name,
             t.str());
  }
  const Compression compression = parse_compression(options.compress);
  DT_CHECK(compression.powersgd_rank == 0 || options.zero == 0, "ddp",
           "--compress {} needs --zero 0 (it exchanges whole low-rank gradients)", options.compress);
  std::vector<ReducerParam> views;
  for (auto& [name, t] : d.params) {
    ReducerParam p{name, {t.data(), static_cast<size_t>(t.numel()), DataType::f32, nullptr}};
    if (t.dim() == 2) {
      p.rows = t.size(0);
      p.cols = t.size(1);
    }
    views.push_back(std::move(p));
  }
  ReducerOptions o;
  o.bucket_bytes = options.bucket_bytes;
  o.zero = options.zero;
  o.overlap = options.overlap;
  o.record_events = options.record_events;
  o.share_memory = options.share_memory;
  o.compression = compression;
  o.seed = options.seed;
  o.allocate = tensor_storage;
  o.exact = options.deterministic;
  o.exact_micro_batches = options.micro_batches;
  d.reducer = std::make_unique<Reducer>(std::move(views), std::move(group), std::move(o));
  const Reducer& reducer = *d.reducer;
  if (options.zero > 0) {
    // The parameters move into the buckets' values (which hold their values now); their
    // tensors keep working.
    for (size_t k = 0; k < d.params.size(); ++k) {
      const BufferView v = reducer.values(k);
      d.params[k].second.rebind(v.data, v.owner);
    }
    for (size_t b = 0; b < reducer.num_buckets(); ++b) {
      Tensor piece = view_of(reducer.piece(b), {static_cast<int64_t>(reducer.piece_count(b))});
      piece.set_requires_grad(true);
      d.pieces.push_back(std::move(piece));
    }
  }
  d.set_grad_homes(true);
  // Hooks hold the state weakly: a model that outlives its DataParallel stops syncing.
  std::weak_ptr<Impl> weak = impl_;
  for (size_t k = 0; k < d.params.size(); ++k) {
    d.params[k].second.register_grad_ready_hook([weak, k](Tensor& p) {
      if (auto s = weak.lock()) s->on_grad_ready(k, p);
    });
  }
}

DataParallel::~DataParallel() {
  for (auto& [name, t] : impl_->params) {
    if (t.is_leaf() && t.requires_grad()) t.set_grad_home(Tensor());
  }
  // The reducer lets the buckets in flight finish (or fail) before it frees them.
}

int DataParallel::rank() const { return impl_->group().rank(); }
int DataParallel::world() const { return impl_->group().size(); }
size_t DataParallel::num_buckets() const { return impl_->reducer->num_buckets(); }

void DataParallel::broadcast_parameters() {
  Impl& d = *impl_;
  std::vector<ReplicaTensor> tensors;
  for (auto& [name, t] : d.params) tensors.push_back({name, t.data(), t.shape(), sizeof(float)});
  // Shared values: every rank's tensors are rank 0's values already.
  replicate_from_rank0(d.group(), tensors, !d.reducer->shares_values(),
                       " (same --model, --hidden, --layers, --width ...)");
}

void DataParallel::set_sync(bool on) { impl_->sync = on; }

bool DataParallel::deterministic() const { return impl_->options.deterministic; }

void DataParallel::add_micro_batch() {
  Impl& d = *impl_;
  DT_CHECK(d.options.deterministic, "ddp", "add_micro_batch: DataParallel was not built with deterministic");
  // With sync on, this is the rank's last micro-batch of the step: its gradients stay in the
  // buckets (marked ready, as without --deterministic) and finish() reduces them with the sums.
  for (size_t k = 0; k < d.params.size(); ++k) {
    Tensor& t = d.params[k].second;
    Tensor g = t.grad();
    if (!g.defined()) continue;
    g = g.contiguous();
    if (d.sync) {
      d.reducer->mark_ready(k, g.data());
    } else {
      d.reducer->add_exact(k, g.data());
    }
    t.zero_grad();
  }
  // A backward before synchronize() (--audit recomputes a micro-batch) must not write into them.
  if (d.sync) d.set_grad_homes(false);
}

void DataParallel::synchronize() {
  Impl& d = *impl_;
  Reducer& reducer = *d.reducer;
  reducer.finish();
  if (d.options.deterministic) d.set_grad_homes(true);
  // Hand the averaged gradients over as views of the buffers.
  if (d.options.zero == 0) {
    for (size_t k = 0; k < d.params.size(); ++k) {
      Tensor& t = d.params[k].second;
      t.set_grad(view_of(reducer.grad(k), t.shape()));
    }
    return;
  }
  for (size_t b = 0; b < d.pieces.size(); ++b)
    d.pieces[b].set_grad(view_of(reducer.piece_grad(b), d.pieces[b].shape()));
  for (auto& [name, t] : d.params) t.zero_grad();
}

float DataParallel::clip_grad_norm(float max_norm) {
  Impl& d = *impl_;
  if (d.options.zero == 0) {
    std::vector<Tensor> ps;
    for (auto& [name, t] : d.params) ps.push_back(t);
    return max_norm > 0 ? optim::clip_grad_norm(ps, max_norm) : optim::clip_grad_norm(ps, 1e30f);
  }
  double sq = grad_square_sum();
  d.group().all_reduce(&sq, &sq, 1, DataType::f64, ReduceOp::sum);
  const float norm = static_cast<float>(std::sqrt(sq));
  if (max_norm > 0 && norm > max_norm) scale_grads(max_norm / (norm + 1e-6f));
  return norm;
}

double DataParallel::grad_square_sum(const std::function<bool(const std::string&)>& counted) const {
  const Impl& d = *impl_;
  if (d.options.zero == 0) {
    std::vector<Tensor> ps;
    for (const auto& [name, t] : d.params) {
      if (!counted || counted(name)) ps.push_back(t);
    }
    return optim::grad_square_sum(ps);
  }
  if (!counted) return d.reducer->piece_square_sum();
  return d.reducer->piece_square_sum([&](size_t k) { return counted(d.params[k].first); });
}

void DataParallel::scale_grads(float factor) {
  Impl& d = *impl_;
  if (d.options.zero == 0) {
    std::vector<Tensor> ps;
    for (auto& [name, t] : d.params) ps.push_back(t);
    optim::scale_grads(ps, factor);
    return;
  }
  d.reducer->scale_pieces(factor);
}

bool DataParallel::sharded() const { return impl_->options.zero > 0; }

bool DataParallel::shares_memory() const { return impl_->reducer->shares_memory(); }

bool DataParallel::shares_parameters() const { return impl_->reducer->shares_values(); }

std::vector<Tensor> DataParallel::optimizer_params() const {
  if (impl_->options.zero > 0) return impl_->pieces;
  std::vector<Tensor> out;
  for (auto& [name, t] : impl_->params) out.push_back(t);
  return out;
}

void DataParallel::gather_parameters() {
  if (impl_->options.zero == 0) return;
  impl_->reducer->gather();
}

std::vector<Tensor> DataParallel::gather_pieces(const std::vector<Tensor>& pieces) const {
  const Impl& d = *impl_;
  const Reducer& reducer = *d.reducer;
  DT_CHECK(d.options.zero > 0 && pieces.size() == reducer.num_buckets(), "ddp",
           "gather_pieces: {} pieces for {} buckets (ZeRO {})", pieces.size(), reducer.num_buckets(), d.options.zero);
  std::vector<Tensor> out(d.params.size());
  for (size_t j = 0; j < reducer.num_buckets(); ++j) {
    const size_t piece = reducer.piece_count(j);
    Tensor mine = pieces[j].contiguous();
    DT_CHECK(static_cast<size_t>(mine.numel()) == piece, "ddp",
             "gather_pieces: bucket {} piece has {} elements, not {}", j, mine.numel(), piece);
    Tensor whole = Tensor::empty({static_cast<int64_t>(reducer.bucket_padded(j))});
    d.group().all_gather(mine.data(), whole.data(), piece, DataType::f32);
    const auto& params = reducer.bucket_params(j);
    const auto& offsets = reducer.bucket_offsets(j);
    for (size_t i = 0; i < params.size(); ++i) {
      const Tensor& p = d.params[params[i]].second;
      out[params[i]] = whole.slice(0, static_cast<int64_t>(offsets[i]), static_cast<int64_t>(offsets[i]) + p.numel())
                           .reshape(p.shape())
                           .contiguous();
    }
  }
  return out;
}

std::vector<Tensor> DataParallel::scatter_pieces(const std::vector<Tensor>& per_param) const {
  const Impl& d = *impl_;
  const Reducer& reducer = *d.reducer;
  DT_CHECK(d.options.zero > 0 && per_param.size() == d.params.size(), "ddp",
           "scatter_pieces: {} tensors for {} parameters (ZeRO {})", per_param.size(), d.params.size(), d.options.zero);
  std::vector<Tensor> out;
  const size_t rank = static_cast<size_t>(d.group().rank());
  for (size_t j = 0; j < reducer.num_buckets(); ++j) {
    const size_t piece = reducer.piece_count(j), lo = rank * piece, hi = lo + piece;
    Tensor t = Tensor::zeros({static_cast<int64_t>(piece)});
    float* dst = t.data();
    const auto& params = reducer.bucket_params(j);
    const auto& offsets = reducer.bucket_offsets(j);
    for (size_t i = 0; i < params.size(); ++i) {
      const Tensor& src = per_param[params[i]];
      if (!src.defined()) continue;
      DT_CHECK(src.shape() == d.params[params[i]].second.shape(), "ddp", "scatter_pieces: '{}' has shape {}, not {}",
               d.params[params[i]].first, shape_str(src.shape()), shape_str(d.params[params[i]].second.shape()));
      const std::vector<float> v = src.to_vector();
      const size_t begin = offsets[i], end = begin + v.size();
      for (size_t e = std::max(begin, lo); e < std::min(end, hi); ++e) dst[e - lo] = v[e - begin];
    }
    out.push_back(t);
  }
  return out;
}

size_t DataParallel::piece_holding(size_t index) const {
  DT_CHECK(index < impl_->params.size(), "ddp", "parameter {} of {}", index, impl_->params.size());
  return impl_->reducer->bucket_of(index);
}

void DataParallel::zero_grad() {
  for (auto& [name, t] : impl_->params) t.zero_grad();
  for (auto& piece : impl_->pieces) piece.zero_grad();
}

MemoryReport DataParallel::memory(const optim::Optimizer& optimizer) const {
  const Impl& d = *impl_;
  const Reducer& reducer = *d.reducer;
  MemoryReport m;
  for (const auto& [name, t] : d.params) m.param_bytes += t.numel() * 4;
  if (reducer.shares_values()) m.param_bytes /= d.group().size();
  for (size_t b = 0; b < reducer.num_buckets(); ++b) {
    const auto piece_bytes = static_cast<int64_t>(reducer.piece_count(b) * sizeof(float));
    if (d.options.zero == 2) {
      m.grad_bytes += piece_bytes;
    } else {
      m.grad_bytes += static_cast<int64_t>(reducer.bucket_padded(b) * sizeof(float));
      if (d.options.zero == 1) m.grad_bytes += piece_bytes;
    }
  }
  for (const auto& [name, t] : optimizer.state())
    m.optimizer_bytes += t.numel() * static_cast<int64_t>(dtype_size(t.dtype()));
  return m;
}

std::vector<nn::NamedTensor> DataParallel::compression_state() const {
  std::vector<nn::NamedTensor> out;
  for (StateEntry& e : impl_->reducer->state()) out.emplace_back(e.name, Tensor::from_vector(e.shape, e.values));
  return out;
}

void DataParallel::load_compression_state(const std::vector<nn::NamedTensor>& state) {
  std::vector<StateEntry> entries;
  entries.reserve(state.size());
  for (const auto& [name, t] : state) entries.push_back({name, t.shape(), t.to_vector()});
  impl_->reducer->load_state(entries);
}

CommVolume DataParallel::take_comm_volume() { return impl_->reducer->take_volume(); }

std::vector<BucketEvent> DataParallel::take_bucket_events() { return impl_->reducer->take_events(); }

}  // namespace dtrain::parallel
