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
#include "dtrain/tensor/profile.h"

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

// ZeRO 3 gathers consecutive blocks together up to this many bytes. Larger units leave nothing to
// prefetch behind: a GPT of 4 blocks of 0.8 MB on 4 ranks of one host trained at 0.6x ZeRO 1's
// speed gathered as one 3.2 MB unit, and at 0.8-1.1x gathered block by block (docs/zero3.md).
constexpr size_t kUnitBytes = size_t{1} << 20;

// What a ZeRO-3 parameter points at between uses: nothing (a read would fault, not see stale
// values).
const std::shared_ptr<const void>& released_owner() {
  static const std::shared_ptr<const void> owner = std::make_shared<int>(0);
  return owner;
}

}  // namespace

std::vector<size_t> block_units(const nn::Sequential& model) {
  std::vector<size_t> units;
  for (size_t i = 0; i < model.num_blocks(); ++i) units.insert(units.end(), model.block(i)->parameters().size(), i);
  DT_CHECK(units.size() == model.parameters().size(), "ddp",
           "block_units: the model's blocks hold {} of its {} parameters", units.size(), model.parameters().size());
  return units;
}

struct DataParallel::Impl {
  std::vector<nn::NamedTensor> params;
  DdpOptions options;
  std::unique_ptr<Reducer> reducer;
  std::vector<Tensor> pieces;  // ZeRO: per bucket, this rank's piece of the values (the optimizer's)
  bool sync = true;

  // ZeRO 3: a block's parameters, gathered while someone uses them. `users` counts the forwards
  // and backwards running it; a gather started ahead (prefetch) has no user yet.
  struct Unit {
    std::vector<size_t> buckets, params;
    int users = 0;
    bool gathered = false;
    std::vector<comm::Work> works;  // the gather in flight
    size_t ready = 0;               // parameters whose gradient is final in this backward
    size_t index = 0, bytes = 0;
    comm::Clock::time_point started;
  };
  std::vector<BucketEvent> gather_events;
  std::vector<Unit> units;
  std::vector<size_t> unit_of;                  // parameter -> unit
  std::vector<size_t> block_unit;               // block -> unit
  std::vector<size_t> first_block, last_block;  // unit -> its blocks
  int64_t gathered_bytes = 0, gathered_peak = 0;

  comm::Group& group() const { return reducer->group(); }

  // Gradient as bucket view: linear layers write their gradients straight into the buckets
  // (ZeRO 2 and 3 free their full-size buffers between steps, so they keep copying). Off:
  // backward writes new tensors.
  void set_grad_homes(bool on) {
    if (options.zero >= 2) return;
    for (size_t k = 0; k < params.size(); ++k) {
      Tensor& t = params[k].second;
      t.set_grad_home(on ? view_of(reducer->grad(k), t.shape()) : Tensor());
    }
  }

  void on_grad_ready(size_t index, Tensor& param) {
    if (sync && !options.deterministic) {
      const Tensor g = param.grad();
      const bool usable = g.defined() && g.is_contiguous() && g.dtype() == DType::f32;
      reducer->mark_ready(index, usable ? g.data() : nullptr);
    }
    // Every use of the block's parameters in this backward is done once all their gradients are.
    if (!units.empty()) {
      Unit& u = units[unit_of[index]];
      if (++u.ready == u.params.size()) {
        u.ready = 0;
        release(u, false);
      }
    }
  }

  void start_gather(Unit& u) {
    u.started = comm::Clock::now();
    for (size_t b : u.buckets) {
      u.works.push_back(reducer->gather_values(b));
      gathered_bytes += static_cast<int64_t>(reducer->bucket_padded(b) * sizeof(float));
    }
    gathered_peak = std::max(gathered_peak, gathered_bytes);
    for (size_t k : u.params) {
      const BufferView v = reducer->values(k);
      params[k].second.rebind(v.data, v.owner);
    }
    u.gathered = true;
  }
  void finish_gather(Unit& u) {
    if (u.works.empty()) return;
    profile::Scope scope(profile::Kind::comm_wait);
    comm::Clock::time_point end = u.started;
    for (comm::Work& w : u.works) {
      w.wait();
      end = std::max(end, w.finish_time());
    }
    u.works.clear();
    if (options.record_events) gather_events.push_back({static_cast<int>(u.index), u.bytes, u.started, end});
  }
  void prefetch(size_t i) {
    if (i < units.size() && !units[i].gathered) start_gather(units[i]);
  }
  void acquire(size_t i) {
    if (i >= units.size()) return;
    Unit& u = units[i];
    if (!u.gathered) start_gather(u);
    finish_gather(u);
    ++u.users;
  }
  // One user less; with none left, the whole values go (unless `keep`: the backward that comes
  // next uses them again).
  void release(Unit& u, bool keep) {
    if (u.users > 0) --u.users;
    if (u.users > 0 || !u.gathered || keep) return;
    finish_gather(u);  // the all_gather writes into the buffers until it completes
    for (size_t k : u.params) params[k].second.rebind(nullptr, released_owner());
    for (size_t b : u.buckets) {
      reducer->release_values(b);
      gathered_bytes -= static_cast<int64_t>(reducer->bucket_padded(b) * sizeof(float));
    }
    u.gathered = false;
  }
  void release_all() {
    for (Unit& u : units) {
      u.users = 0;
      u.ready = 0;
      release(u, false);
    }
  }
};

namespace {

// ZeRO 3: the backward of unit u's blocks starts here (the output of its last block has its whole
// gradient): gather unit u again and start the gather of the unit before it.
struct GatherForBackward : Node {
  std::weak_ptr<DataParallel::Impl> ddp;
  size_t unit = 0, begin = 0;
  std::vector<Tensor> apply(const Tensor& g) override {
    if (auto d = ddp.lock()) {
      // Both gathers in flight before waiting for the first.
      d->prefetch(unit);
      if (unit > 0 && d->last_block[unit - 1] >= begin) d->prefetch(unit - 1);
      d->acquire(unit);
    }
    return {g};
  }
  const char* name() const override { return "zero3_gather"; }
};

// A unit is gathered before its first block in [begin, end) runs (and the next unit's gather
// starts) and let go after its last one.
class ZeroThreeHooks : public nn::BlockHooks {
 public:
  explicit ZeroThreeHooks(std::weak_ptr<DataParallel::Impl> ddp) : ddp_(std::move(ddp)) {}
  void before_block(size_t i, size_t begin, size_t end) override {
    auto d = ddp_.lock();
    if (!d || i >= d->block_unit.size()) return;
    const size_t u = d->block_unit[i];
    if (i != begin && d->first_block[u] != i) return;
    d->prefetch(u);
    if (u + 1 < d->units.size() && d->first_block[u + 1] < end) d->prefetch(u + 1);
    d->acquire(u);
  }
  Tensor after_block(size_t i, size_t begin, size_t end, const Tensor& output) override {
    auto d = ddp_.lock();
    if (!d || i >= d->block_unit.size()) return output;
    const size_t u = d->block_unit[i];
    if (i + 1 != end && d->last_block[u] != i) return output;
    const bool backward = autograd::needs_grad({&output});
    // The last unit's backward comes right after its forward: keep it.
    d->release(d->units[u], backward && i + 1 == end);
    if (!backward) return output;
    Tensor out = output.detach();
    auto node = std::make_shared<GatherForBackward>();
    node->ddp = ddp_;
    node->unit = u;
    node->begin = begin;
    autograd::attach(out, node, {&output});
    return out;
  }

 private:
  std::weak_ptr<DataParallel::Impl> ddp_;
};

}  // namespace

DataParallel::DataParallel(std::vector<nn::NamedTensor> params, comm::Group group, DdpOptions options)
    : impl_(std::make_shared<Impl>()) {
  Impl& d = *impl_;
  DT_CHECK(group.size() >= 1, "ddp", "DataParallel needs a group");
  DT_CHECK(options.zero >= 0 && options.zero <= 3, "ddp", "zero stage {} is not 0, 1, 2 or 3", options.zero);
  DT_CHECK(options.units.empty() || options.units.size() == params.size(), "ddp", "{} units for {} parameters",
           options.units.size(), params.size());
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
  if (options.zero == 3) {
    // Units: runs of consecutive blocks up to kUnitBytes (or bucket_bytes if smaller; a block
    // larger than that alone), like FSDP's size-based wrapping: small blocks share a gather.
    size_t blocks = 1;
    for (size_t b : options.units) blocks = std::max(blocks, b + 1);
    std::vector<size_t> bytes(blocks, 0);
    for (size_t k = 0; k < d.params.size(); ++k) {
      bytes[options.units.empty() ? 0 : options.units[k]] += static_cast<size_t>(d.params[k].second.numel()) * 4;
    }
    size_t unit = 0, filled = 0;
    for (size_t b = 0; b < blocks; ++b) {
      if (filled > 0 && filled + bytes[b] > std::min(options.bucket_bytes, kUnitBytes)) {
        ++unit;
        filled = 0;
      }
      filled += bytes[b];
      d.block_unit.push_back(unit);
      if (d.first_block.size() == unit) d.first_block.push_back(b);
      if (d.last_block.size() == unit) d.last_block.push_back(b);
      d.last_block[unit] = b;
    }
    d.units.resize(unit + 1);
    d.unit_of.assign(d.params.size(), 0);
    for (size_t k = 0; k < d.params.size(); ++k) {
      d.unit_of[k] = d.block_unit[options.units.empty() ? 0 : options.units[k]];
    }
  }
  std::vector<ReducerParam> views;
  for (size_t k = 0; k < d.params.size(); ++k) {
    auto& [name, t] = d.params[k];
    ReducerParam p{name, {t.data(), static_cast<size_t>(t.numel()), DataType::f32, nullptr}};
    if (options.zero == 3) p.unit = d.unit_of[k];
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
  if (options.zero == 3) {
    // The parameters keep their own memory until broadcast_parameters() (which takes this
    // rank's pieces from rank 0's values) or the first gather.
    for (size_t b = 0; b < reducer.num_buckets(); ++b) {
      const auto& ps = reducer.bucket_params(b);
      Impl::Unit& u = d.units[d.unit_of[ps.front()]];
      u.buckets.push_back(b);
      u.params.insert(u.params.end(), ps.begin(), ps.end());
    }
    for (size_t u = 0; u < d.units.size(); ++u) {
      d.units[u].index = u;
      for (size_t b : d.units[u].buckets) d.units[u].bytes += reducer.bucket_padded(b) * sizeof(float);
    }
  }
  if (options.zero == 3 && reducer.shares_values()) {
    // One host: the buckets' values are the host's one copy, each rank's piece a slice of it,
    // always whole. The parameters live there for good (as under ZeRO 1), nothing is gathered
    // around the blocks, and gather_parameters() is the barrier after the pieces' updates.
    d.units.clear();
    d.block_unit.clear();
  }
  if ((options.zero > 0 && options.zero < 3) || (options.zero == 3 && reducer.shares_values())) {
    // The parameters move into the buckets' values (which hold their values now); their
    // tensors keep working.
    for (size_t k = 0; k < d.params.size(); ++k) {
      const BufferView v = reducer.values(k);
      d.params[k].second.rebind(v.data, v.owner);
    }
  }
  if (options.zero > 0) {
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
  if (d.options.zero == 3 && !d.reducer->shares_values()) {
    // The parameters still hold their whole values (rank 0's now): keep this rank's pieces of
    // them, and let the rest go.
    const Reducer& reducer = *d.reducer;
    const size_t rank = static_cast<size_t>(d.group().rank());
    for (size_t b = 0; b < reducer.num_buckets(); ++b) {
      const size_t piece = reducer.piece_count(b), lo = rank * piece, hi = lo + piece;
      float* dst = d.pieces[b].data();
      const auto& ps = reducer.bucket_params(b);
      const auto& offsets = reducer.bucket_offsets(b);
      for (size_t i = 0; i < ps.size(); ++i) {
        const Tensor& t = d.params[ps[i]].second;
        const size_t begin = std::max(lo, offsets[i]), end = std::min(hi, offsets[i] + static_cast<size_t>(t.numel()));
        if (begin < end)
          std::memcpy(dst + (begin - lo), t.data() + (begin - offsets[i]), (end - begin) * sizeof(float));
      }
    }
    for (auto& [name, t] : d.params) t.rebind(nullptr, released_owner());
    d.release_all();
  }
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
  impl_->release_all();
}

std::shared_ptr<nn::BlockHooks> DataParallel::block_hooks() const {
  if (impl_->options.zero != 3 || impl_->units.empty()) return nullptr;  // shared values: nothing to gather
  return std::make_shared<ZeroThreeHooks>(impl_);
}

bool DataParallel::shards_parameters() const { return impl_->options.zero == 3; }

int64_t DataParallel::gathered_peak_bytes() const { return impl_->gathered_peak; }

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
  if (d.options.zero == 3) m.param_bytes = 0;  // the pieces, below
  for (size_t b = 0; b < reducer.num_buckets(); ++b) {
    const auto piece_bytes = static_cast<int64_t>(reducer.piece_count(b) * sizeof(float));
    if (d.options.zero == 3) m.param_bytes += piece_bytes;
    if (d.options.zero >= 2) {
      m.grad_bytes += piece_bytes;
    } else {
      m.grad_bytes += static_cast<int64_t>(reducer.bucket_padded(b) * sizeof(float));
      if (d.options.zero == 1 && !reducer.pieces_in_slots()) m.grad_bytes += piece_bytes;
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

std::vector<BucketEvent> DataParallel::take_gather_events() {
  std::vector<BucketEvent> out;
  out.swap(impl_->gather_events);
  return out;
}

}  // namespace dtrain::parallel
