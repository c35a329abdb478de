// DataParallel: buckets, grad-ready hooks, overlapped all_reduce / reduce_scatter, ZeRO pieces.
#include "dtrain/parallel/ddp.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include <sys/statvfs.h>

#include <fmt/format.h>

#include "dtrain/core/error.h"
#include "dtrain/core/log.h"
#include "dtrain/comm/compress.h"
#include "dtrain/comm/copy.h"
#include "dtrain/tensor/autograd.h"
#include "powersgd.h"

namespace dtrain::parallel {

using comm::DataType;
using comm::ReduceOp;

namespace {

// ZeRO 0 with shared buckets: buckets up to this size still take the copying all_reduce on the
// rank's slot (one phase, or the lines path up to 192 B) instead of all_reduce_shared's two
// full phases; the result is the same bits.
constexpr size_t kCopyingBucketBytes = size_t{16} << 10;

// A 1-D or shaped f32 view into `storage` at element `offset` (not part of any graph).
Tensor view_of(const std::shared_ptr<Storage>& storage, size_t offset, const Shape& shape) {
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = storage;
  impl->offset = static_cast<int64_t>(offset);
  impl->shape = shape;
  impl->strides = contiguous_strides(shape);
  impl->dtype = DType::f32;
  return Tensor(impl);
}

std::shared_ptr<Storage> zeroed_storage(size_t count) {
  auto s = std::make_shared<Storage>(std::max<size_t>(1, count) * sizeof(float));
  std::memset(s->data, 0, s->nbytes);
  return s;
}

uint64_t fnv1a(const void* data, size_t bytes, uint64_t h = 1469598103934665603ull) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < bytes; ++i) {
    h ^= p[i];
    h *= 1099511628211ull;
  }
  return h;
}

}  // namespace

struct DataParallel::Impl {
  struct Bucket {
    std::vector<size_t> params;   // indices into Impl::params
    std::vector<size_t> offsets;  // element offset of each in the bucket
    size_t count = 0;             // elements used
    size_t padded = 0;            // count rounded up to a multiple of the world size (ZeRO)
    size_t pending = 0;           // gradients not final yet in this step
    bool launched = false;
    std::shared_ptr<Storage> grad;    // gradients, in place reduced (ZeRO 2: only during a step)
    std::shared_ptr<Storage> values;  // ZeRO: the parameters' home
    std::shared_ptr<Storage> piece_grad;  // ZeRO: this rank's averaged piece
    Tensor piece;                     // ZeRO: view of this rank's piece of `values`
    comm::Work work;
    comm::Clock::time_point started;
    size_t grad_at = 0;                 // shared memory: byte offset of rank 0's gradient slot
    std::shared_ptr<Storage> residual;  // compressed codecs: what the last encoding lost
    comm::CompressStats stats;          // filled by the compressed collective
  };

  std::vector<nn::NamedTensor> params;
  comm::Group group;
  DdpOptions options;
  std::vector<Bucket> buckets;
  std::vector<std::pair<size_t, size_t>> where;  // param index -> (bucket, offset)
  std::vector<bool> ready;
  size_t ready_count = 0;
  size_t next_launch = 0;
  bool sync = true;
  int64_t step = 0;
  std::vector<BucketEvent> events;
  comm::Codec codec = comm::Codec::none;
  std::unique_ptr<PowerSgd> powersgd;
  CommVolume volume;
  comm::SharedMemory shared;  // valid when the buckets live in shared memory
  size_t shared_stride = 0;   // bytes between two ranks' gradient slots
  // ZeRO 1 with shared buckets: the parameters' one copy is in `shared` too.
  bool shared_values() const { return shared.valid() && options.zero == 1; }

  // Puts the buckets' gradient slots (ZeRO 1: and parameters) in memory the ranks share
  // (collective): [values of every bucket (ZeRO 1)][rank 0's gradients][rank 1's]..., each
  // part `stride` bytes. ZeRO 1: rank 0's parameter values become the host's copy; every
  // rank's tensors point at it. Without room in /dev/shm it leaves `shared` invalid (the
  // copying path).
  void share_buckets() {
    const size_t world = static_cast<size_t>(group.size());
    const bool values_too = options.zero == 1;
    const size_t align = 64 / sizeof(float);
    // Each bucket's place (in floats) in the values and in every rank's gradient slot: the
    // same offsets, as both hold `padded` floats, 64-byte aligned.
    size_t floats = 0;
    std::vector<size_t> at;
    for (const Bucket& b : buckets) {
      at.push_back(floats);
      floats += (b.padded + align - 1) / align * align;
    }
    const size_t stride = floats * sizeof(float);
    const size_t bytes = ((values_too ? 1 : 0) + world) * stride;
    // Every rank must take the same path: share only if /dev/shm has room as every rank sees it
    // and every rank wants the same size (a rank with another model copies, and
    // broadcast_parameters() names the difference).
    struct statvfs fs {};
    const int64_t room = ::statvfs("/dev/shm", &fs) == 0 &&
                         static_cast<double>(fs.f_bavail) * static_cast<double>(fs.f_frsize) >=
                             1.05 * static_cast<double>(bytes) + (64 << 20);
    int64_t agree[3] = {room, static_cast<int64_t>(bytes), -static_cast<int64_t>(bytes)};
    group.all_reduce(agree, agree, 3, DataType::i64, ReduceOp::min);
    if (agree[1] != -agree[2]) return;
    if (agree[0] == 0) {
      if (group.rank() == 0) {
        DT_LOG_WARN("data parallel: /dev/shm has no room for the {} MiB of {} the ranks would share; copying "
                    "through the collectives instead (make /dev/shm larger, e.g. docker --shm-size)",
                    bytes >> 20, values_too ? "parameters and gradients" : "gradients");
      }
      return;
    }
    shared = group.allocate_shared(bytes);
    shared_stride = stride;
    const auto keep = shared.keep_alive();
    const size_t rank = static_cast<size_t>(group.rank());
    for (size_t bi = 0; bi < buckets.size(); ++bi) {
      Bucket& b = buckets[bi];
      b.grad_at = (values_too ? stride : 0) + at[bi] * sizeof(float);
      if (values_too) {
        b.values = std::make_shared<Storage>(shared.data() + at[bi] * sizeof(float), b.padded * sizeof(float), keep);
      }
      b.grad = std::make_shared<Storage>(shared.data() + b.grad_at + rank * stride, b.padded * sizeof(float), keep);
    }
    if (values_too && rank == 0) {
      for (Bucket& b : buckets) {
        for (size_t i = 0; i < b.params.size(); ++i) {
          const Tensor& t = params[b.params[i]].second;
          std::memcpy(static_cast<float*>(b.values->data) + b.offsets[i], t.data(),
                      static_cast<size_t>(t.numel()) * sizeof(float));
        }
      }
    }
  }

  size_t piece_of(const Bucket& b) const { return b.padded / static_cast<size_t>(group.size()); }

  float* grad_data(Bucket& b) {
    if (!b.grad) {  // ZeRO 2 frees it after each step
      b.grad = zeroed_storage(b.padded);
    }
    return static_cast<float*>(b.grad->data);
  }

  void on_grad_ready(size_t index, Tensor& param) {
    if (!sync) return;
    auto [bi, offset] = where[index];
    Bucket& b = buckets[bi];
    DT_CHECK(!ready[index] && !b.launched, "ddp",
             "parameter '{}' received a second gradient in step {} before synchronize(): backward ran more than "
             "once with gradient sync on (accumulate with set_sync(false) / --accumulate)",
             params[index].first, step + 1);
    const Tensor g = param.grad();
    DT_CHECK(g.defined() && g.is_contiguous() && g.dtype() == DType::f32, "ddp",
             "parameter '{}': gradient hook fired without a contiguous f32 gradient", params[index].first);
    float* dst = grad_data(b) + offset;
    if (g.data() != dst) comm::copy_bytes(dst, g.data(), static_cast<size_t>(g.numel()) * sizeof(float));
    ready[index] = true;
    ++ready_count;
    if (--b.pending == 0 && options.overlap && !powersgd) launch_in_order();
  }

  // Starts every bucket whose gradients are final, in bucket order (the same on every rank).
  void launch_in_order() {
    while (next_launch < buckets.size() && buckets[next_launch].pending == 0) launch(next_launch++);
  }

  void launch(size_t bi) {
    Bucket& b = buckets[bi];
    float* g = grad_data(b);
    b.launched = true;
    b.started = comm::Clock::now();
    if (codec != comm::Codec::none) {
      // Error feedback: send this step's gradients plus what the last encoding lost.
      if (!b.residual) b.residual = zeroed_storage(b.padded);
      float* r = static_cast<float*>(b.residual->data);
      for (size_t i = 0; i < b.padded; ++i) g[i] += r[i];
      if (options.zero == 0) {
        b.work = group.all_reduce_compressed_async(g, g, b.count, codec, ReduceOp::avg, r, &b.stats);
      } else {
        b.work = group.reduce_scatter_compressed_async(g, static_cast<float*>(b.piece_grad->data), piece_of(b), codec,
                                                       ReduceOp::avg, r, &b.stats);
      }
      return;
    }
    const uint64_t world = static_cast<uint64_t>(group.size());
    const uint64_t bytes = (options.zero == 0 ? 2 * b.count : b.padded) * sizeof(float) * (world - 1) / world;
    volume.wire_bytes += bytes;
    volume.raw_bytes += bytes;
    if (options.zero == 0 && shared.valid() && b.count * sizeof(float) > kCopyingBucketBytes) {
      b.work = group.all_reduce_shared_async(shared, b.grad_at, shared_stride, b.count, DataType::f32, ReduceOp::avg);
    } else if (options.zero == 0) {
      b.work = group.all_reduce_async(g, g, b.count, DataType::f32, ReduceOp::avg);
    } else if (shared.valid()) {
      b.work = group.reduce_scatter_shared_async(shared, b.grad_at, shared_stride, b.piece_grad->data, piece_of(b),
                                                 DataType::f32, ReduceOp::avg);
    } else {
      b.work = group.reduce_scatter_async(g, b.piece_grad->data, piece_of(b), DataType::f32, ReduceOp::avg);
    }
  }
};

Compression parse_compression(const std::string& text) {
  Compression c;
  if (!text.starts_with("powersgd")) {
    try {
      c.codec = comm::parse_codec(text);
    } catch (const Error&) {
      DT_THROW("ddp", "--compress '{}': expected none, bf16, fp16, int8, int4 or powersgd:RANK", text);
    }
    return c;
  }
  const std::string rank = text.starts_with("powersgd:") ? text.substr(9) : "";
  char* end = nullptr;
  const long r = std::strtol(rank.c_str(), &end, 10);
  DT_CHECK(!rank.empty() && *end == '\0' && r >= 1 && r <= 1024, "ddp",
           "--compress '{}': expected powersgd:RANK with RANK in [1, 1024], e.g. powersgd:4", text);
  c.powersgd_rank = static_cast<int>(r);
  return c;
}

DataParallel::DataParallel(std::vector<nn::NamedTensor> params, comm::Group group, DdpOptions options)
    : impl_(std::make_shared<Impl>()) {
  Impl& d = *impl_;
  DT_CHECK(group.size() >= 1, "ddp", "DataParallel needs a group");
  DT_CHECK(options.zero >= 0 && options.zero <= 2, "ddp", "zero stage {} is not 0, 1 or 2", options.zero);
  DT_CHECK(options.bucket_bytes >= sizeof(float), "ddp", "bucket size {} bytes is too small", options.bucket_bytes);
  d.params = std::move(params);
  d.group = std::move(group);
  d.options = options;
  const size_t world = static_cast<size_t>(d.group.size());
  for (const auto& [name, t] : d.params) {
    DT_CHECK(t.dtype() == DType::f32 && t.is_contiguous(), "ddp", "parameter '{}' must be contiguous f32, is {}", name,
             t.str());
  }
  // Buckets in reverse registration order, about bucket_bytes each.
  d.where.resize(d.params.size());
  Impl::Bucket cur;
  auto close = [&] {
    if (cur.params.empty()) return;
    cur.padded = (cur.count + world - 1) / world * world;
    cur.pending = cur.params.size();
    d.buckets.push_back(std::move(cur));
    cur = Impl::Bucket();
  };
  for (size_t k = d.params.size(); k-- > 0;) {
    const size_t n = static_cast<size_t>(d.params[k].second.numel());
    if (!cur.params.empty() && (cur.count + n) * sizeof(float) > options.bucket_bytes) close();
    d.where[k] = {d.buckets.size(), cur.count};
    cur.params.push_back(k);
    cur.offsets.push_back(cur.count);
    cur.count += n;
  }
  close();
  const Compression compression = parse_compression(options.compress);
  d.codec = compression.codec;
  // ZeRO 0 shares only where the group runs its direct collectives: a plan chosen with
  // DTRAIN_ALGO (ring, hd, ...) is what the user asked for, and the shared all_reduce is not it.
  const bool direct = d.group.all_reduce_algorithm(0) == comm::Algorithm::direct;
  if (((options.zero == 0 && direct) || options.zero == 1) && options.share_memory && world > 1 &&
      d.codec == comm::Codec::none && compression.powersgd_rank == 0 && d.group.can_share_memory()) {
    d.share_buckets();
  }
  for (auto& b : d.buckets) {
    if (!b.grad) b.grad = zeroed_storage(b.padded);
    if (options.zero > 0) {
      // The parameters move into the bucket's buffer; their tensors keep working.
      if (!b.values) {
        b.values = zeroed_storage(b.padded);
        for (size_t i = 0; i < b.params.size(); ++i) {
          const Tensor& t = d.params[b.params[i]].second;
          std::memcpy(static_cast<float*>(b.values->data) + b.offsets[i], t.data(),
                      static_cast<size_t>(t.numel()) * sizeof(float));
        }
      }
      for (size_t i = 0; i < b.params.size(); ++i) {
        Tensor& t = d.params[b.params[i]].second;
        TensorImpl* impl = t.impl();
        impl->storage = b.values;
        impl->offset = static_cast<int64_t>(b.offsets[i]);
        impl->strides = contiguous_strides(impl->shape);
      }
      const size_t piece = d.piece_of(b);
      b.piece = view_of(b.values, static_cast<size_t>(d.group.rank()) * piece, {static_cast<int64_t>(piece)});
      b.piece.set_requires_grad(true);
      b.piece_grad = zeroed_storage(piece);
      if (options.zero == 2) b.grad.reset();
    }
  }
  d.ready.assign(d.params.size(), false);
  // Gradient as bucket view: linear layers write their gradients straight into the buckets
  // (ZeRO 2 frees its full-size buffers between steps, so it keeps copying).
  if (options.zero < 2) {
    for (size_t k = 0; k < d.params.size(); ++k) {
      const auto [bi, offset] = d.where[k];
      d.params[k].second.set_grad_home(view_of(d.buckets[bi].grad, offset, d.params[k].second.shape()));
    }
  }
  if (d.shared_values()) d.group.barrier();  // rank 0's values are in place before anyone reads them
  if (compression.powersgd_rank > 0) {
    DT_CHECK(options.zero == 0, "ddp", "--compress {} needs --zero 0 (it exchanges whole low-rank gradients)",
             options.compress);
    std::vector<Tensor> grads;
    for (size_t k = 0; k < d.params.size(); ++k) {
      const auto [bi, offset] = d.where[k];
      grads.push_back(view_of(d.buckets[bi].grad, offset, d.params[k].second.shape()));
    }
    d.powersgd = std::make_unique<PowerSgd>(compression.powersgd_rank, std::move(grads), options.seed);
  }
  // Hooks hold the state weakly: a model that outlives its DataParallel stops syncing.
  std::weak_ptr<Impl> weak = impl_;
  for (size_t k = 0; k < d.params.size(); ++k) {
    d.params[k].second.register_grad_ready_hook([weak, k](Tensor& p) {
      if (auto s = weak.lock()) s->on_grad_ready(k, p);
    });
  }
}

DataParallel::~DataParallel() {
  for (auto& [name, t] : impl_->params) t.impl()->grad_home.reset();
  // Buckets in flight reference our buffers: let them finish (or fail) before freeing them.
  for (auto& b : impl_->buckets) {
    if (b.launched && b.work.valid()) {
      try {
        b.work.wait();
      } catch (...) {
      }
    }
  }
}

int DataParallel::rank() const { return impl_->group.rank(); }
int DataParallel::world() const { return impl_->group.size(); }
size_t DataParallel::num_buckets() const { return impl_->buckets.size(); }

void DataParallel::broadcast_parameters() {
  Impl& d = *impl_;
  const int world = d.group.size();
  // Same model everywhere? Compare (tensors, elements, hash of names and shapes).
  uint64_t shape_hash = fnv1a("", 0);
  int64_t elements = 0;
  for (const auto& [name, t] : d.params) {
    shape_hash = fnv1a(name.data(), name.size(), shape_hash);
    for (int64_t s : t.shape()) shape_hash = fnv1a(&s, sizeof(s), shape_hash);
    elements += t.numel();
  }
  std::vector<int64_t> mine = {static_cast<int64_t>(d.params.size()), elements, static_cast<int64_t>(shape_hash)};
  std::vector<int64_t> all(3 * static_cast<size_t>(world));
  d.group.all_gather(mine.data(), all.data(), 3, DataType::i64);
  for (int r = 1; r < world; ++r) {
    const int64_t* o = &all[3 * static_cast<size_t>(r)];
    DT_CHECK(o[0] == all[0] && o[1] == all[1] && o[2] == all[2], "ddp",
             "rank {}'s model differs from rank 0's: {} parameters in {} tensors vs {} in {} (or different names or "
             "shapes); every rank must build the same model (same --model, --hidden, --layers, --width ...)",
             r, o[1], o[0], all[1], all[0]);
  }
  if (!d.shared_values()) {  // shared values: every rank's tensors are rank 0's values already
    for (auto& [name, t] : d.params) d.group.broadcast(t.data(), static_cast<size_t>(t.numel()), DataType::f32, 0);
  }
  uint64_t h = fnv1a("", 0);
  for (const auto& [name, t] : d.params) h = fnv1a(t.data(), static_cast<size_t>(t.numel()) * sizeof(float), h);
  std::vector<uint64_t> hashes(static_cast<size_t>(world));
  d.group.all_gather(&h, hashes.data(), 1, DataType::i64);
  for (int r = 1; r < world; ++r) {
    DT_CHECK(hashes[static_cast<size_t>(r)] == hashes[0], "ddp",
             "after the broadcast rank {}'s parameters differ from rank 0's (digest {:016x} vs {:016x})", r,
             hashes[static_cast<size_t>(r)], hashes[0]);
  }
}

void DataParallel::set_sync(bool on) { impl_->sync = on; }

void DataParallel::synchronize() {
  Impl& d = *impl_;
  const int world = d.group.size();
  // Parameters without a gradient in this step contribute zeros; then every bucket starts,
  // in order.
  for (size_t bi = 0; bi < d.buckets.size(); ++bi) {
    Impl::Bucket& b = d.buckets[bi];
    if (b.launched || b.pending == 0) continue;
    float* g = d.grad_data(b);
    for (size_t i = 0; i < b.params.size(); ++i) {
      const size_t k = b.params[i];
      if (d.ready[k]) continue;
      std::memset(g + b.offsets[i], 0, static_cast<size_t>(d.params[k].second.numel()) * sizeof(float));
    }
    b.pending = 0;
  }
  if (!d.powersgd) d.launch_in_order();
  // Did every rank run its backward? (A rank without one would silently average in zeros.)
  int64_t mine = static_cast<int64_t>(d.ready_count);
  std::vector<int64_t> counts(static_cast<size_t>(world));
  d.group.all_gather(&mine, counts.data(), 1, DataType::i64);
  if (d.powersgd) {
    const auto t0 = comm::Clock::now();
    d.powersgd->reduce(d.group, &d.volume.wire_bytes, &d.volume.raw_bytes);
    if (d.options.record_events) {
      size_t bytes = 0;
      for (const auto& b : d.buckets) bytes += b.count * sizeof(float);
      d.events.push_back({0, bytes, t0, comm::Clock::now()});
    }
  }
  for (size_t bi = 0; bi < d.buckets.size() && !d.powersgd; ++bi) {
    Impl::Bucket& b = d.buckets[bi];
    b.work.wait();
    if (d.options.record_events) d.events.push_back({static_cast<int>(bi), b.count * sizeof(float), b.started, b.work.finish_time()});
    d.volume.wire_bytes += b.stats.wire_bytes_sent;
    d.volume.raw_bytes += b.stats.raw_bytes;
    b.stats = comm::CompressStats{};
  }
  const bool none = std::any_of(counts.begin(), counts.end(), [](int64_t c) { return c == 0; });
  const bool some = std::any_of(counts.begin(), counts.end(), [](int64_t c) { return c > 0; });
  if (none && some) {
    std::string who;
    for (int r = 0; r < world; ++r) {
      who += fmt::format("{}rank {}: {}", r ? ", " : "", r, counts[static_cast<size_t>(r)] > 0 ? "backward" : "none");
    }
    DT_THROW("ddp",
             "step {}: ranks ran different numbers of backward passes before synchronize() ({}); every rank must "
             "run the same number of backward passes per step",
             d.step + 1, who);
  }
  // Hand the averaged gradients over as views of the buffers.
  for (Impl::Bucket& b : d.buckets) {
    if (d.options.zero == 0) {
      for (size_t i = 0; i < b.params.size(); ++i) {
        Tensor& t = d.params[b.params[i]].second;
        t.set_grad(view_of(b.grad, b.offsets[i], t.shape()));
      }
    } else {
      b.piece.set_grad(view_of(b.piece_grad, 0, b.piece.shape()));
      for (size_t i = 0; i < b.params.size(); ++i) d.params[b.params[i]].second.zero_grad();
      if (d.options.zero == 2) b.grad.reset();
    }
    b.launched = false;
    b.pending = b.params.size();
    b.work = comm::Work();
  }
  std::fill(d.ready.begin(), d.ready.end(), false);
  d.ready_count = 0;
  d.next_launch = 0;
  ++d.step;
}

float DataParallel::clip_grad_norm(float max_norm) {
  Impl& d = *impl_;
  if (d.options.zero == 0) {
    std::vector<Tensor> ps;
    for (auto& [name, t] : d.params) ps.push_back(t);
    return max_norm > 0 ? optim::clip_grad_norm(ps, max_norm) : optim::clip_grad_norm(ps, 1e30f);
  }
  double sq = grad_square_sum();
  d.group.all_reduce(&sq, &sq, 1, DataType::f64, ReduceOp::sum);
  const float norm = static_cast<float>(std::sqrt(sq));
  if (max_norm > 0 && norm > max_norm) scale_grads(max_norm / (norm + 1e-6f));
  return norm;
}

double DataParallel::grad_square_sum(const std::function<bool(const std::string&)>& counted) const {
  const Impl& d = *impl_;
  double sq = 0.0;
  auto add = [&sq](const float* g, size_t n) {
    for (size_t i = 0; i < n; ++i) sq += static_cast<double>(g[i]) * g[i];
  };
  if (d.options.zero == 0) {
    std::vector<Tensor> ps;
    for (const auto& [name, t] : d.params) {
      if (!counted || counted(name)) ps.push_back(t);
    }
    return optim::grad_square_sum(ps);
  }
  const size_t rank = static_cast<size_t>(d.group.rank());
  for (const Impl::Bucket& b : d.buckets) {
    const float* g = static_cast<const float*>(b.piece_grad->data);
    const size_t piece = d.piece_of(b), lo = rank * piece, hi = lo + piece;
    if (!counted) {
      add(g, piece);  // the padding past the last parameter holds zeros
      continue;
    }
    // The part of each counted parameter that falls in this rank's piece.
    for (size_t k = 0; k < b.params.size(); ++k) {
      const auto& [name, t] = d.params[b.params[k]];
      if (!counted(name)) continue;
      const size_t begin = std::max(lo, b.offsets[k]);
      const size_t end = std::min(hi, b.offsets[k] + static_cast<size_t>(t.numel()));
      if (begin < end) add(g + (begin - lo), end - begin);
    }
  }
  return sq;
}

void DataParallel::scale_grads(float factor) {
  Impl& d = *impl_;
  if (d.options.zero == 0) {
    std::vector<Tensor> ps;
    for (auto& [name, t] : d.params) ps.push_back(t);
    optim::scale_grads(ps, factor);
    return;
  }
  for (Impl::Bucket& b : d.buckets) {
    float* g = static_cast<float*>(b.piece_grad->data);
    for (size_t i = 0, n = d.piece_of(b); i < n; ++i) g[i] *= factor;
  }
}

bool DataParallel::sharded() const { return impl_->options.zero > 0; }

bool DataParallel::shares_memory() const { return impl_->shared.valid(); }

bool DataParallel::shares_parameters() const { return impl_->shared_values(); }

std::vector<Tensor> DataParallel::optimizer_params() const {
  std::vector<Tensor> out;
  if (impl_->options.zero == 0) {
    for (auto& [name, t] : impl_->params) out.push_back(t);
  } else {
    for (auto& b : impl_->buckets) out.push_back(b.piece);
  }
  return out;
}

void DataParallel::gather_parameters() {
  Impl& d = *impl_;
  if (d.options.zero == 0) return;
  if (d.shared_values()) {  // every rank updated its piece of the one copy: wait until all did
    d.group.barrier();
    return;
  }
  std::vector<comm::Work> works;
  for (Impl::Bucket& b : d.buckets) {
    const size_t piece = d.piece_of(b);
    float* v = static_cast<float*>(b.values->data);
    works.push_back(d.group.all_gather_async(v + static_cast<size_t>(d.group.rank()) * piece, v, piece, DataType::f32));
  }
  for (auto& w : works) w.wait();
}

std::vector<Tensor> DataParallel::gather_pieces(const std::vector<Tensor>& pieces) const {
  Impl& d = *impl_;
  DT_CHECK(d.options.zero > 0 && pieces.size() == d.buckets.size(), "ddp",
           "gather_pieces: {} pieces for {} buckets (ZeRO {})", pieces.size(), d.buckets.size(), d.options.zero);
  std::vector<Tensor> out(d.params.size());
  for (size_t j = 0; j < d.buckets.size(); ++j) {
    const Impl::Bucket& b = d.buckets[j];
    const size_t piece = d.piece_of(b);
    Tensor mine = pieces[j].contiguous();
    DT_CHECK(static_cast<size_t>(mine.numel()) == piece, "ddp", "gather_pieces: bucket {} piece has {} elements, not {}",
             j, mine.numel(), piece);
    Tensor whole = Tensor::empty({static_cast<int64_t>(b.padded)});
    d.group.all_gather(mine.data(), whole.data(), piece, DataType::f32);
    for (size_t i = 0; i < b.params.size(); ++i) {
      const Tensor& p = d.params[b.params[i]].second;
      out[b.params[i]] = whole.slice(0, static_cast<int64_t>(b.offsets[i]), static_cast<int64_t>(b.offsets[i]) + p.numel())
                             .reshape(p.shape())
                             .contiguous();
    }
  }
  return out;
}

std::vector<Tensor> DataParallel::scatter_pieces(const std::vector<Tensor>& per_param) const {
  Impl& d = *impl_;
  DT_CHECK(d.options.zero > 0 && per_param.size() == d.params.size(), "ddp",
           "scatter_pieces: {} tensors for {} parameters (ZeRO {})", per_param.size(), d.params.size(), d.options.zero);
  std::vector<Tensor> out;
  const size_t rank = static_cast<size_t>(d.group.rank());
  for (const Impl::Bucket& b : d.buckets) {
    const size_t piece = d.piece_of(b), lo = rank * piece, hi = lo + piece;
    Tensor t = Tensor::zeros({static_cast<int64_t>(piece)});
    float* dst = t.data();
    for (size_t i = 0; i < b.params.size(); ++i) {
      const Tensor& src = per_param[b.params[i]];
      if (!src.defined()) continue;
      DT_CHECK(src.shape() == d.params[b.params[i]].second.shape(), "ddp", "scatter_pieces: '{}' has shape {}, not {}",
               d.params[b.params[i]].first, shape_str(src.shape()), shape_str(d.params[b.params[i]].second.shape()));
      const std::vector<float> v = src.to_vector();
      const size_t begin = b.offsets[i], end = begin + v.size();
      for (size_t e = std::max(begin, lo); e < std::min(end, hi); ++e) dst[e - lo] = v[e - begin];
    }
    out.push_back(t);
  }
  return out;
}

size_t DataParallel::piece_holding(size_t index) const {
  DT_CHECK(index < impl_->where.size(), "ddp", "parameter {} of {}", index, impl_->where.size());
  return impl_->where[index].first;
}

void DataParallel::zero_grad() {
  for (auto& [name, t] : impl_->params) t.zero_grad();
  for (auto& b : impl_->buckets) {
    if (b.piece.defined()) b.piece.zero_grad();
  }
}

MemoryReport DataParallel::memory(const optim::Optimizer& optimizer) const {
  MemoryReport m;
  for (const auto& [name, t] : impl_->params) m.param_bytes += t.numel() * 4;
  if (impl_->shared_values()) m.param_bytes /= impl_->group.size();
  for (const auto& b : impl_->buckets) {
    if (impl_->options.zero == 2) {
      m.grad_bytes += static_cast<int64_t>(impl_->piece_of(b) * sizeof(float));
    } else {
      m.grad_bytes += static_cast<int64_t>(b.padded * sizeof(float));
      if (impl_->options.zero == 1) m.grad_bytes += static_cast<int64_t>(impl_->piece_of(b) * sizeof(float));
    }
  }
  for (const auto& [name, t] : optimizer.state()) m.optimizer_bytes += t.numel() * static_cast<int64_t>(dtype_size(t.dtype()));
  return m;
}

std::vector<nn::NamedTensor> DataParallel::compression_state() const {
  const Impl& d = *impl_;
  std::vector<nn::NamedTensor> out;
  if (d.powersgd) return d.powersgd->state();
  if (d.codec == comm::Codec::none) return out;
  for (size_t bi = 0; bi < d.buckets.size(); ++bi) {
    const Impl::Bucket& b = d.buckets[bi];
    Tensor t = Tensor::zeros({static_cast<int64_t>(b.padded)});
    if (b.residual) std::memcpy(t.data(), b.residual->data, b.padded * sizeof(float));
    out.emplace_back("ef." + std::to_string(bi), t);
  }
  return out;
}

void DataParallel::load_compression_state(const std::vector<nn::NamedTensor>& state) {
  Impl& d = *impl_;
  if (d.powersgd) {
    d.powersgd->load_state(state);
    return;
  }
  if (d.codec == comm::Codec::none) return;
  for (size_t bi = 0; bi < d.buckets.size(); ++bi) {
    Impl::Bucket& b = d.buckets[bi];
    const Tensor& saved = compression_entry(state, "ef." + std::to_string(bi), {static_cast<int64_t>(b.padded)});
    if (!b.residual) b.residual = zeroed_storage(b.padded);
    std::memcpy(b.residual->data, saved.data(), b.padded * sizeof(float));
  }
}

CommVolume DataParallel::take_comm_volume() {
  const CommVolume v = impl_->volume;
  impl_->volume = CommVolume{};
  return v;
}

std::vector<BucketEvent> DataParallel::take_bucket_events() {
  std::vector<BucketEvent> out;
  out.swap(impl_->events);
  return out;
}

}  // namespace dtrain::parallel
