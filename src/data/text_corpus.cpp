// A byte-level text corpus cut into next-token windows.
//
// Vocabulary: the corpus is one byte string; a part (train or val) is a byte range
// [begin, end) of it; a window is seq_len + 1 consecutive bytes of a part, the first seq_len
// being the input x and the last seq_len the target y. Windows start every seq_len bytes, so
// consecutive windows share one byte and every byte of a part but the last is a target once.
#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/core/error.h"
#include "dtrain/data/data.h"

namespace dtrain::data {

namespace fs = std::filesystem;

namespace {

struct FileCloser {
  void operator()(std::FILE* f) const { std::fclose(f); }
};

std::vector<uint8_t> read_file(const fs::path& path) {
  errno = 0;
  std::unique_ptr<std::FILE, FileCloser> file(std::fopen(path.c_str(), "rb"));
  DT_CHECK(file != nullptr, "data", "{}: cannot open: {}", path.string(), std::strerror(errno));
  std::vector<uint8_t> out;
  uint8_t buf[1 << 16];
  size_t n = 0;
  while ((n = std::fread(buf, 1, sizeof(buf), file.get())) > 0) out.insert(out.end(), buf, buf + n);
  DT_CHECK(!std::ferror(file.get()), "data", "{}: read failed: {}", path.string(), std::strerror(errno));
  return out;
}

}  // namespace

TextCorpus::TextCorpus(const std::string& path, int64_t seq_len, double val_fraction) {
  DT_CHECK(seq_len >= 1, "data", "TextCorpus: seq_len must be >= 1, got {}", seq_len);
  DT_CHECK(val_fraction >= 0.0 && val_fraction < 1.0, "data", "TextCorpus: val_fraction must be in [0, 1), got {}",
           val_fraction);

  std::error_code ec;
  const fs::file_status status = fs::status(path, ec);
  DT_CHECK(fs::exists(status), "data", "{}: cannot open: {}", path,
           ec ? ec.message() : std::string("No such file or directory"));
  int64_t num_binary = 0;
  if (fs::is_directory(status)) {
    std::vector<fs::path> files;
    try {
      for (const fs::directory_entry& entry : fs::directory_iterator(path)) {
        if (entry.is_symlink() || !entry.is_regular_file()) continue;
        files.push_back(entry.path());
      }
    } catch (const fs::filesystem_error& e) {
      DT_THROW("data", "{}: cannot list folder: {}", path, e.code().message());
    }
    std::sort(files.begin(), files.end());
    for (const fs::path& file : files) {
      std::vector<uint8_t> bytes = read_file(file);
      if (std::find(bytes.begin(), bytes.end(), uint8_t{0}) != bytes.end()) {
        ++num_binary;
        continue;
      }
      bytes_.insert(bytes_.end(), bytes.begin(), bytes.end());
      ++num_files_;
    }
  } else {
    bytes_ = read_file(path);
    num_files_ = 1;
  }
  DT_CHECK(!bytes_.empty(), "data", "{}: empty corpus ({} text files, {} binary files skipped)", path, num_files_,
           num_binary);

  const auto total = static_cast<int64_t>(bytes_.size());
  const auto split = static_cast<int64_t>(std::floor(static_cast<double>(total) * (1.0 - val_fraction)));
  train_ = Split(&bytes_, 0, split, seq_len);
  val_ = Split(&bytes_, split, total, seq_len);
  DT_CHECK(train_.size() >= 1 && (val_fraction == 0.0 || val_.size() >= 1), "data",
           "{}: corpus too small: {} bytes split into {} training and {} validation bytes "
           "(val_fraction {}), each part needs at least seq_len + 1 = {} bytes",
           path, total, split, total - split, val_fraction, seq_len + 1);
}

TextCorpus::Split::Split(const std::vector<uint8_t>* bytes, int64_t begin, int64_t end, int64_t seq_len)
    : bytes_(bytes), begin_(begin), end_(end), seq_len_(seq_len) {
  DT_CHECK(bytes != nullptr, "data", "TextCorpus::Split: null byte buffer");
  DT_CHECK(seq_len >= 1, "data", "TextCorpus::Split: seq_len must be >= 1, got {}", seq_len);
  DT_CHECK(0 <= begin && begin <= end && end <= static_cast<int64_t>(bytes->size()), "data",
           "TextCorpus::Split: range [{}, {}) outside a corpus of {} bytes", begin, end, bytes->size());
}

int64_t TextCorpus::Split::size() const {
  const int64_t len = end_ - begin_;
  return len < 1 ? 0 : (len - 1) / seq_len_;
}

Batch TextCorpus::Split::get(const std::vector<int64_t>& indices) const {
  const auto batch = static_cast<int64_t>(indices.size());
  const int64_t n = size();
  Tensor x = Tensor::empty({batch, seq_len_});
  Tensor y = Tensor::empty({batch, seq_len_});
  float* xp = x.data();
  float* yp = y.data();
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t i = indices[b];
    DT_CHECK(i >= 0 && i < n, "data", "TextCorpus::Split::get: index {} out of range [0, {})", i, n);
    const uint8_t* window = bytes_->data() + begin_ + i * seq_len_;
    for (int64_t t = 0; t < seq_len_; ++t) {
      xp[b * seq_len_ + t] = window[t];
      yp[b * seq_len_ + t] = window[t + 1];
    }
  }
  return {x, y};
}

}  // namespace dtrain::data
