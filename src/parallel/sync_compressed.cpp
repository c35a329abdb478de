// Compressed gradients with error feedback (see sync.h, ddp.h and docs/compression.md): each
// bucket's all_reduce (ZeRO: reduce_scatter) runs the comm layer's compressed collective, and
// what a step's encoding lost (the bucket's residual) is added to the next step's gradients
// before they are sent.
#include <cstring>
#include <string>

#include "sync.h"

namespace dtrain::parallel {

namespace {

// The residual of every bucket and the byte counts of its collective in flight.
class ErrorFeedback {
 public:
  explicit ErrorFeedback(Allocate allocate) : allocate_(std::move(allocate)) {}

  void resize(size_t buckets) {
    residuals_.resize(buckets);
    stats_.resize(buckets);
  }

  // Adds the last encoding's loss to bucket b's gradients; returns where this step's goes.
  float* add_to(Bucket& b) {
    Floats& residual = residuals_[b.index];
    if (!residual) residual = zeroed_floats(allocate_, b.padded);
    float* g = b.grad.get();
    const float* r = residual.get();
    for (size_t i = 0; i < b.padded; ++i) g[i] += r[i];
    return residual.get();
  }

  comm::CompressStats* stats(const Bucket& b) { return &stats_[b.index]; }

  // The bytes of bucket b's completed collective.
  void count(const Bucket& b, CommVolume& volume) {
    comm::CompressStats& s = stats_[b.index];
    volume.wire_bytes += s.wire_bytes_sent;
    volume.raw_bytes += s.raw_bytes;
    s = comm::CompressStats{};
  }

  std::vector<StateEntry> state(const std::vector<Bucket>& buckets) const {
    std::vector<StateEntry> out;
    for (const Bucket& b : buckets) {
      StateEntry e{"ef." + std::to_string(b.index), {static_cast<int64_t>(b.padded)}, std::vector<float>(b.padded)};
      if (residuals_[b.index]) std::memcpy(e.values.data(), residuals_[b.index].get(), b.padded * sizeof(float));
      out.push_back(std::move(e));
    }
    return out;
  }

  void load(const std::vector<Bucket>& buckets, const std::vector<StateEntry>& state) {
    for (const Bucket& b : buckets) {
      const StateEntry& saved = state_entry(state, "ef." + std::to_string(b.index), {static_cast<int64_t>(b.padded)});
      Floats& residual = residuals_[b.index];
      if (!residual) residual = zeroed_floats(allocate_, b.padded);
      std::memcpy(residual.get(), saved.values.data(), b.padded * sizeof(float));
    }
  }

 private:
  Allocate allocate_;
  std::vector<Floats> residuals_;           // per bucket, allocated at its first use
  std::vector<comm::CompressStats> stats_;  // per bucket, filled by its collective
};

class CompressedAllReduceSync : public AllReduceSync {
 public:
  CompressedAllReduceSync(SyncContext context, comm::Codec codec)
      : AllReduceSync(std::move(context)), codec_(codec), feedback_(ctx_.allocate) {}

  void place(std::vector<Bucket>& buckets, const std::vector<ReducerParam>& params) override {
    AllReduceSync::place(buckets, params);
    feedback_.resize(buckets.size());
  }

  comm::Work start(Bucket& b) override {
    float* residual = feedback_.add_to(b);
    float* g = b.grad.get();
    return comm::all_reduce_compressed_async(ctx_.group, g, g, b.count, codec_, comm::ReduceOp::avg, residual,
                                             feedback_.stats(b));
  }

  void finished(Bucket& b) override { feedback_.count(b, volume_); }
  std::vector<StateEntry> state(const std::vector<Bucket>& buckets) const override { return feedback_.state(buckets); }
  void load_state(std::vector<Bucket>& buckets, const std::vector<StateEntry>& state) override {
    feedback_.load(buckets, state);
  }

 private:
  comm::Codec codec_;
  ErrorFeedback feedback_;
};

class CompressedZeroSync : public ZeroSync {
 public:
  CompressedZeroSync(SyncContext context, comm::Codec codec)
      : ZeroSync(std::move(context)), codec_(codec), feedback_(ctx_.allocate) {}

  void place(std::vector<Bucket>& buckets, const std::vector<ReducerParam>& params) override {
    ZeroSync::place(buckets, params);
    feedback_.resize(buckets.size());
  }

  comm::Work start(Bucket& b) override {
    float* residual = feedback_.add_to(b);
    return comm::reduce_scatter_compressed_async(ctx_.group, b.grad.get(), b.piece_grad.get(), ctx_.piece_of(b), codec_,
                                                 comm::ReduceOp::avg, residual, feedback_.stats(b));
  }

  void finished(Bucket& b) override { feedback_.count(b, volume_); }
  std::vector<StateEntry> state(const std::vector<Bucket>& buckets) const override { return feedback_.state(buckets); }
  void load_state(std::vector<Bucket>& buckets, const std::vector<StateEntry>& state) override {
    feedback_.load(buckets, state);
  }

 private:
  comm::Codec codec_;
  ErrorFeedback feedback_;
};

}  // namespace

std::unique_ptr<SyncStrategy> make_compressed_sync(SyncContext context, comm::Codec codec) {
  if (context.zero == 0) return std::make_unique<CompressedAllReduceSync>(std::move(context), codec);
  return std::make_unique<CompressedZeroSync>(std::move(context), codec);
}

}  // namespace dtrain::parallel
