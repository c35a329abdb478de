// Data sets and the sharding sampler.
//
// A Batch carries inputs and targets as f32 tensors: images (B, 784) scaled to [0, 1] with
// integer class targets (B), or token ids (B, T) with next-token targets (B, T). Integers
// are exact in f32 up to 2^24, which covers class ids and byte tokens.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dtrain/tensor/tensor.h"

namespace dtrain::data {

struct Batch {
  Tensor x;
  Tensor y;
};

class Dataset {
 public:
  virtual ~Dataset() = default;
  virtual int64_t size() const = 0;
  /// Stacks the samples with these indices into one batch.
  virtual Batch get(const std::vector<int64_t>& indices) const = 0;
};

/// Fashion-MNIST (or MNIST) from the four gzip'd IDX files in `dir`
/// (train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz, t10k-...). Throws dtrain::Error
/// naming the file for a missing, truncated or malformed file.
class FashionMnist : public Dataset {
 public:
  static constexpr const char* kDefaultDir = "/usr/share/datasets/fashion-mnist";
  FashionMnist(const std::string& dir, bool train);
  int64_t size() const override { return count_; }
  Batch get(const std::vector<int64_t>& indices) const override;
  static constexpr int64_t kPixels = 784;
  static constexpr int64_t kClasses = 10;

 private:
  int64_t count_ = 0;
  std::vector<uint8_t> images_;  // count * 784
  std::vector<uint8_t> labels_;  // count
};

/// A byte-level text corpus from a file, or from every regular text file in a folder (sorted by
/// name, not recursive; symbolic links and binary files, those with a NUL byte, are skipped).
/// The corpus is split into a training part (the first 1 - val_fraction) and a validation part;
/// each must hold at least one window of seq_len + 1 bytes (val_fraction = 0 gives an empty
/// validation part). Sample i of a part starting at byte b is the window starting at
/// s = b + i * T: x = bytes [s, s+T), y = bytes [s+1, s+T+1), both (T).
/// The splits point into the corpus, so a TextCorpus is neither copied nor moved.
class TextCorpus {
 public:
  TextCorpus(const std::string& path, int64_t seq_len, double val_fraction = 0.1);
  TextCorpus(const TextCorpus&) = delete;
  TextCorpus& operator=(const TextCorpus&) = delete;

  /// Bytes [begin, end) of a corpus, cut into windows of seq_len + 1 bytes.
  class Split : public Dataset {
   public:
    Split() = default;  // empty
    Split(const std::vector<uint8_t>* bytes, int64_t begin, int64_t end, int64_t seq_len);
    /// The number of full windows: (end - begin - 1) / seq_len.
    int64_t size() const override;
    /// x (B, T) and y (B, T), y shifted one byte ahead of x.
    Batch get(const std::vector<int64_t>& indices) const override;

   private:
    const std::vector<uint8_t>* bytes_ = nullptr;
    int64_t begin_ = 0, end_ = 0, seq_len_ = 1;
  };
  const Split& train() const { return train_; }
  const Split& val() const { return val_; }
  int64_t num_bytes() const { return static_cast<int64_t>(bytes_.size()); }
  int64_t num_files() const { return num_files_; }

 private:
  std::vector<uint8_t> bytes_;
  int64_t num_files_ = 0;
  Split train_, val_;
};

/// Splits an epoch's sample indices over `world` ranks, like PyTorch's DistributedSampler:
/// with shuffling, a permutation seeded by (seed, epoch); every rank gets
/// floor(n / world) indices (the tail that does not divide evenly is dropped, so every rank
/// takes the same number of steps), rank r taking positions r, r + world, ...
class ShardedSampler {
 public:
  ShardedSampler(int64_t size, int rank, int world, uint64_t seed, bool shuffle = true);
  std::vector<int64_t> indices(int64_t epoch) const;
  int64_t per_rank() const;

 private:
  int64_t size_;
  int rank_, world_;
  uint64_t seed_;
  bool shuffle_;
};

}  // namespace dtrain::data
