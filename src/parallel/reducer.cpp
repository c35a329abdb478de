// Reducer: bucket layout, ready notifications, launch order, wait (see reducer.h); the ways of
// synchronising are the strategies of sync.h.
#include "dtrain/parallel/reducer.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "dtrain/comm/copy.h"
#include "dtrain/core/error.h"
#include "dtrain/parallel/exact.h"
#include "sync.h"

namespace dtrain::parallel {

using comm::DataType;

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

Floats zeroed_floats(const Allocate& allocate, size_t count) {
  const size_t bytes = std::max<size_t>(1, count) * sizeof(float);
  std::shared_ptr<void> memory;
  if (allocate) {
    memory = allocate(bytes);
  } else {
    void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
    DT_CHECK(p != nullptr, "ddp", "out of memory allocating {} bytes", bytes);
    memory = std::shared_ptr<void>(p, std::free);
  }
  std::memset(memory.get(), 0, bytes);
  return Floats(memory, static_cast<float*>(memory.get()));
}

const StateEntry& state_entry(const std::vector<StateEntry>& state, const std::string& name,
                              const std::vector<int64_t>& shape) {
  auto it = std::find_if(state.begin(), state.end(), [&](const StateEntry& e) { return e.name == name; });
  int64_t elements = 1;
  for (int64_t s : shape) elements *= s;
  DT_CHECK(it != state.end() && it->shape == shape && it->values.size() == static_cast<size_t>(elements), "ddp",
           "compression state has no '{}' of shape [{}]", name, fmt::join(shape, ", "));
  return *it;
}

namespace {

// The strategy for these options, picked once.
std::unique_ptr<SyncStrategy> choose_sync(const SyncContext& context, const ReducerOptions& o,
                                          const std::vector<Bucket>& buckets, const std::vector<ReducerParam>& params) {
  const Compression& c = o.compression;
  DT_CHECK(o.zero < 3 || (!o.exact && c.codec == comm::Codec::none && c.powersgd_rank == 0), "ddp",
           "ZeRO 3 gathers parameters around each block's use; it has no --deterministic or --compress path yet");
  if (o.exact) {
    DT_CHECK(c.powersgd_rank == 0 && c.codec == comm::Codec::none, "ddp",
             "--deterministic needs exact gradients: lossy --compress cannot keep the guarantee");
    return std::make_unique<ExactSync>(context, o.exact_micro_batches, o.share_memory);
  }
  if (c.powersgd_rank > 0) {
    DT_CHECK(o.zero == 0, "ddp", "--compress powersgd:{} needs --zero 0 (it exchanges whole low-rank gradients)",
             c.powersgd_rank);
    return make_powersgd_sync(context, c.powersgd_rank, o.seed, params);
  }
  if (c.codec != comm::Codec::none) return make_compressed_sync(context, c.codec);
  if (o.share_memory && o.zero != 2 && context.world() > 1) {
    if (auto shared = make_shared_sync(context, buckets)) return shared;
  }
  if (o.zero == 0) return std::make_unique<AllReduceSync>(context);
  return std::make_unique<ZeroSync>(context);
}

}  // namespace

struct Reducer::Impl {
  std::vector<ReducerParam> params;  // values: only until the strategy placed the buckets
  comm::Group group;
  ReducerOptions options;
  std::vector<Bucket> buckets;
  std::vector<std::pair<size_t, size_t>> where;  // parameter -> (bucket, offset)
  std::vector<bool> ready;
  size_t ready_count = 0;
  size_t next_launch = 0;
  int64_t step = 0;
  std::vector<BucketEvent> events;
  std::unique_ptr<SyncStrategy> sync;
  ExactSync* exact = nullptr;  // sync, with --deterministic

  size_t piece_of(const Bucket& b) const { return b.padded / static_cast<size_t>(group.size()); }

  float* grad_data(Bucket& b) {
    if (b.grad) return b.grad.get();
    if (options.zero == 3 && options.allocate) {
      // ZeRO 3 allocates it each step: every parameter's slot is written before the bucket
      // starts (its gradient in mark_ready(), or zeros in finish()), so only the padding is zeroed.
      std::shared_ptr<void> memory = options.allocate(b.padded * sizeof(float));
      b.grad = Floats(memory, static_cast<float*>(memory.get()));
      std::memset(b.grad.get() + b.count, 0, (b.padded - b.count) * sizeof(float));
      return b.grad.get();
    }
    b.grad = zeroed_floats(options.allocate, b.padded);  // ZeRO 2 frees it after each step
    return b.grad.get();
  }

  // Starts every bucket whose gradients are final, in bucket order (the same on every rank).
  void launch_in_order() {
    while (next_launch < buckets.size() && buckets[next_launch].pending == 0) launch(next_launch++);
  }

  void launch(size_t bi) {
    Bucket& b = buckets[bi];
    grad_data(b);
    b.launched = true;
    b.started = comm::Clock::now();
    b.work = sync->start(b);
  }

  const Bucket& bucket(size_t b) const {
    DT_CHECK(b < buckets.size(), "ddp", "bucket {} of {}", b, buckets.size());
    return buckets[b];
  }
  size_t checked_param(size_t k) const {
    DT_CHECK(k < params.size(), "ddp", "parameter {} of {}", k, params.size());
    return k;
  }
};

Reducer::Reducer(std::vector<ReducerParam> params, comm::Group group, ReducerOptions options)
    : impl_(std::make_unique<Impl>()) {
  Impl& d = *impl_;
  DT_CHECK(group.size() >= 1, "ddp", "the gradient reducer needs a group");
  DT_CHECK(options.zero >= 0 && options.zero <= 3, "ddp", "zero stage {} is not 0, 1, 2 or 3", options.zero);
  DT_CHECK(options.bucket_bytes >= sizeof(float), "ddp", "bucket size {} bytes is too small", options.bucket_bytes);
  for (const ReducerParam& p : params) {
    DT_CHECK(p.values.dtype == DataType::f32 && (p.values.data != nullptr || p.values.count == 0), "ddp",
             "parameter '{}' must be f32 values, is {} elements of {}", p.name, p.values.count,
             comm::name_of(p.values.dtype));
  }
  d.params = std::move(params);
  d.group = std::move(group);
  d.options = std::move(options);
  const size_t world = static_cast<size_t>(d.group.size());
  // Buckets in reverse registration order, about bucket_bytes each.
  d.where.resize(d.params.size());
  Bucket cur;
  auto close = [&] {
    if (cur.params.empty()) return;
    cur.index = d.buckets.size();
    cur.padded = (cur.count + world - 1) / world * world;
    cur.pending = cur.params.size();
    d.buckets.push_back(std::move(cur));
    cur = Bucket();
  };
  for (size_t k = d.params.size(); k-- > 0;) {
    const size_t n = d.params[k].values.count;
    const bool new_unit =
        d.options.zero == 3 && !cur.params.empty() && d.params[cur.params.back()].unit != d.params[k].unit;
    if (new_unit || (!cur.params.empty() && (cur.count + n) * sizeof(float) > d.options.bucket_bytes)) close();
    d.where[k] = {d.buckets.size(), cur.count};
    cur.params.push_back(k);
    cur.offsets.push_back(cur.count);
    cur.count += n;
  }
  close();
  const SyncContext context{d.group, d.options.zero, d.options.allocate};
  d.sync = choose_sync(context, d.options, d.buckets, d.params);
  d.exact = dynamic_cast<ExactSync*>(d.sync.get());
  d.sync->place(d.buckets, d.params);
  for (ReducerParam& p : d.params) p.values.data = nullptr;  // the caller moves them (ZeRO): not ours to read
  d.ready.assign(d.params.size(), false);
}

Reducer::~Reducer() {
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

comm::Group& Reducer::group() const { return impl_->group; }
const ReducerOptions& Reducer::options() const { return impl_->options; }
size_t Reducer::num_params() const { return impl_->params.size(); }
const std::string& Reducer::name(size_t k) const { return impl_->params[impl_->checked_param(k)].name; }
size_t Reducer::num_buckets() const { return impl_->buckets.size(); }
const std::vector<size_t>& Reducer::bucket_params(size_t b) const { return impl_->bucket(b).params; }
const std::vector<size_t>& Reducer::bucket_offsets(size_t b) const { return impl_->bucket(b).offsets; }
size_t Reducer::bucket_count(size_t b) const { return impl_->bucket(b).count; }
size_t Reducer::bucket_padded(size_t b) const { return impl_->bucket(b).padded; }
size_t Reducer::piece_count(size_t b) const { return impl_->piece_of(impl_->bucket(b)); }
size_t Reducer::bucket_of(size_t k) const { return impl_->where[impl_->checked_param(k)].first; }
bool Reducer::sharded() const { return impl_->options.zero > 0; }
bool Reducer::shares_memory() const { return impl_->sync->shares_memory(); }
bool Reducer::shares_values() const { return impl_->sync->shares_values(); }
bool Reducer::pieces_in_slots() const { return impl_->sync->pieces_in_slots(); }

BufferView Reducer::grad(size_t k) const {
  const Impl& d = *impl_;
  const auto [bi, offset] = d.where[d.checked_param(k)];
  const Bucket& b = d.buckets[bi];
  if (!b.grad) return {};
  return {b.grad.get() + offset, d.params[k].values.count, DataType::f32, b.grad};
}

BufferView Reducer::values(size_t k) const {
  const Impl& d = *impl_;
  const auto [bi, offset] = d.where[d.checked_param(k)];
  const Bucket& b = d.buckets[bi];
  DT_CHECK(b.values != nullptr, "ddp", "parameter '{}' has no place in a bucket's values {}", d.params[k].name,
           d.options.zero == 3 ? "while its bucket is not gathered (ZeRO 3)" : "without ZeRO");
  return {b.values.get() + offset, d.params[k].values.count, DataType::f32, b.values};
}

BufferView Reducer::piece(size_t bi) const {
  const Impl& d = *impl_;
  const Bucket& b = d.bucket(bi);
  const size_t piece = d.piece_of(b);
  if (d.options.zero == 3) return {b.own.get(), piece, DataType::f32, b.own};
  DT_CHECK(b.values != nullptr, "ddp", "bucket {} has no pieces without ZeRO", bi);
  return {b.values.get() + static_cast<size_t>(d.group.rank()) * piece, piece, DataType::f32, b.values};
}

BufferView Reducer::piece_grad(size_t bi) const {
  const Impl& d = *impl_;
  const Bucket& b = d.bucket(bi);
  DT_CHECK(b.piece_grad != nullptr, "ddp", "bucket {} has no pieces without ZeRO", bi);
  return {b.piece_grad.get(), d.piece_of(b), DataType::f32, b.piece_grad};
}

void Reducer::mark_ready(size_t k, const void* gradient) {
  Impl& d = *impl_;
  auto [bi, offset] = d.where[d.checked_param(k)];
  Bucket& b = d.buckets[bi];
  DT_CHECK(!d.ready[k] && !b.launched, "ddp",
           "parameter '{}' received a second gradient in step {} before synchronize(): backward ran more than "
           "once with gradient sync on (accumulate with set_sync(false) / --accumulate)",
           d.params[k].name, d.step + 1);
  DT_CHECK(gradient != nullptr || d.params[k].values.count == 0, "ddp",
           "parameter '{}': gradient hook fired without a contiguous f32 gradient", d.params[k].name);
  float* dst = d.grad_data(b) + offset;
  if (gradient != dst) comm::copy_bytes(dst, gradient, d.params[k].values.count * sizeof(float));
  d.ready[k] = true;
  ++d.ready_count;
  if (--b.pending == 0 && d.options.overlap && d.sync->per_bucket()) d.launch_in_order();
}

void Reducer::add_exact(size_t k, const float* gradient) {
  Impl& d = *impl_;
  DT_CHECK(d.exact != nullptr, "ddp", "add_exact: the reducer was not built with --deterministic");
  const auto [bi, offset] = d.where[d.checked_param(k)];
  const size_t n = d.params[k].values.count;
  const size_t at = d.exact->add(d.buckets[bi], offset, gradient, n);
  if (at != n) throw_exact_range(d.params[k].name, gradient[at], d.step + 1, d.group.rank(), d.exact->micro_batches());
}

void Reducer::finish() {
  Impl& d = *impl_;
  const int world = d.group.size();
  // Parameters without a gradient in this step contribute zeros; then every bucket starts,
  // in order.
  for (Bucket& b : d.buckets) {
    if (b.launched || b.pending == 0) continue;
    float* g = d.grad_data(b);
    for (size_t i = 0; i < b.params.size(); ++i) {
      const size_t k = b.params[i];
      if (d.ready[k]) continue;
      std::memset(g + b.offsets[i], 0, d.params[k].values.count * sizeof(float));
    }
    b.pending = 0;
  }
  const bool per_bucket = d.sync->per_bucket();
  if (per_bucket) d.launch_in_order();
  // Did every rank run its backward? (A rank without one would silently average in zeros.)
  // Also the barrier that ExactSync's in-place reduction relies on (sync_exact.cpp): keep it.
  int64_t mine = static_cast<int64_t>(d.ready_count);
  std::vector<int64_t> counts(static_cast<size_t>(world));
  d.group.all_gather(&mine, counts.data(), 1, DataType::i64);
  if (!per_bucket) {
    const auto t0 = comm::Clock::now();
    d.sync->reduce_all(d.buckets);
    if (d.options.record_events) {
      size_t bytes = 0;
      for (const Bucket& b : d.buckets) bytes += b.count * sizeof(float);
      d.events.push_back({0, bytes, t0, comm::Clock::now()});
    }
  } else {
    for (Bucket& b : d.buckets) {
      b.work.wait();
      if (d.options.record_events) {
        d.events.push_back({static_cast<int>(b.index), b.count * sizeof(float), b.started, b.work.finish_time()});
      }
      d.sync->finished(b);
    }
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
  for (Bucket& b : d.buckets) {
    b.launched = false;
    b.pending = b.params.size();
    b.work = comm::Work();
  }
  d.sync->end_step(d.buckets);
  std::fill(d.ready.begin(), d.ready.end(), false);
  d.ready_count = 0;
  d.next_launch = 0;
  ++d.step;
}

void Reducer::gather() {
  if (sharded()) impl_->sync->gather(impl_->buckets);
}

comm::Work Reducer::gather_values(size_t bi) {
  Impl& d = *impl_;
  DT_CHECK(d.options.zero == 3 && bi < d.buckets.size(), "ddp", "gather_values: bucket {} of {} (ZeRO {})", bi,
           d.buckets.size(), d.options.zero);
  return static_cast<ZeroSync&>(*d.sync).gather_values(d.buckets[bi]);
}

void Reducer::release_values(size_t bi) {
  Impl& d = *impl_;
  DT_CHECK(d.options.zero == 3 && bi < d.buckets.size(), "ddp", "release_values: bucket {} of {} (ZeRO {})", bi,
           d.buckets.size(), d.options.zero);
  d.buckets[bi].values.reset();
}

bool Reducer::has_values(size_t bi) const { return impl_->bucket(bi).values != nullptr; }

double Reducer::piece_square_sum(const std::function<bool(size_t k)>& counted) const {
  const Impl& d = *impl_;
  DT_CHECK(sharded(), "ddp", "piece_square_sum: no pieces without ZeRO");
  double sq = 0.0;
  auto add = [&sq](const float* g, size_t n) {
    for (size_t i = 0; i < n; ++i) sq += static_cast<double>(g[i]) * g[i];
  };
  const size_t rank = static_cast<size_t>(d.group.rank());
  for (const Bucket& b : d.buckets) {
    const float* g = b.piece_grad.get();
    const size_t piece = d.piece_of(b), lo = rank * piece, hi = lo + piece;
    if (!counted) {
      add(g, piece);  // the padding past the last parameter holds zeros
      continue;
    }
    // The part of each counted parameter that falls in this rank's piece.
    for (size_t i = 0; i < b.params.size(); ++i) {
      const size_t k = b.params[i];
      if (!counted(k)) continue;
      const size_t begin = std::max(lo, b.offsets[i]);
      const size_t end = std::min(hi, b.offsets[i] + d.params[k].values.count);
      if (begin < end) add(g + (begin - lo), end - begin);
    }
  }
  return sq;
}

void Reducer::scale_pieces(float factor) {
  Impl& d = *impl_;
  DT_CHECK(sharded(), "ddp", "scale_pieces: no pieces without ZeRO");
  for (Bucket& b : d.buckets) {
    float* g = b.piece_grad.get();
    for (size_t i = 0, n = d.piece_of(b); i < n; ++i) g[i] *= factor;
  }
}

std::vector<BucketEvent> Reducer::take_events() {
  std::vector<BucketEvent> out;
  out.swap(impl_->events);
  return out;
}

CommVolume Reducer::take_volume() { return impl_->sync->take_volume(); }

std::vector<StateEntry> Reducer::state() const { return impl_->sync->state(impl_->buckets); }

void Reducer::load_state(const std::vector<StateEntry>& state) { impl_->sync->load_state(impl_->buckets, state); }

}  // namespace dtrain::parallel
