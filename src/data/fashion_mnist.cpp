// Fashion-MNIST from its gzip'd IDX files.
//
// An IDX file is a big-endian header, magic then one u32 per dimension, followed by the u8
// data: images are magic 2051, (count, rows, cols); labels are magic 2049, (count).
#include <zlib.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "dtrain/core/error.h"
#include "dtrain/data/data.h"

namespace dtrain::data {

namespace {

constexpr uint32_t kImagesMagic = 2051;
constexpr uint32_t kLabelsMagic = 2049;
constexpr uint32_t kSide = 28;

struct GzCloser {
  void operator()(gzFile_s* f) const { gzclose(f); }
};
using GzFile = std::unique_ptr<gzFile_s, GzCloser>;

/// One open IDX file; every error names its path.
class IdxReader {
 public:
  explicit IdxReader(std::string path) : path_(std::move(path)) {
    errno = 0;
    file_.reset(gzopen(path_.c_str(), "rb"));
    if (!file_) {
      const int err = errno;
      DT_THROW("data", "{}: cannot open: {} (scripts/install-deps installs dataset-fashion-mnist)", path_,
               err != 0 ? std::strerror(err) : "out of memory");
    }
  }

  const std::string& path() const { return path_; }

  /// Reads up to n bytes into out; returns how many arrived (fewer only at end of data).
  int64_t read(uint8_t* out, int64_t n) {
    int64_t got = 0;
    while (got < n) {
      const auto chunk = static_cast<unsigned>(std::min<int64_t>(n - got, 1 << 20));
      const int r = gzread(file_.get(), out + got, chunk);
      if (r < 0) throw_stream_error();
      if (r == 0) break;
      got += r;
    }
    return got;
  }

  /// Reads the header: the magic and `dims` big-endian u32 dimensions.
  std::vector<uint32_t> header(uint32_t magic, size_t dims, const char* kind) {
    std::array<uint8_t, 16> buf{};
    const int64_t want = static_cast<int64_t>(4 * (dims + 1));
    const int64_t got = read(buf.data(), want);
    if (got < want) throw_truncated(fmt::format("a {}-byte IDX header", want), got);
    std::vector<uint32_t> words(dims + 1);
    for (size_t i = 0; i < words.size(); ++i) {
      const uint8_t* p = buf.data() + 4 * i;
      words[i] = (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | p[3];
    }
    DT_CHECK(words[0] == magic, "data", "{}: bad magic {} (0x{:08x}): expected {} for IDX {}", path_, words[0],
             words[0], magic, kind);
    return {words.begin() + 1, words.end()};
  }

  /// Reads exactly n bytes of `what`, then checks that nothing follows.
  std::vector<uint8_t> body(int64_t n, const char* what) {
    // Grows as data arrives, so a corrupt count cannot allocate more than the file holds.
    std::vector<uint8_t> out;
    int64_t got = 0;
    while (got < n) {
      const int64_t step = std::min<int64_t>(n - got, int64_t{16} << 20);
      out.resize(static_cast<size_t>(got + step));
      const int64_t r = read(out.data() + got, step);
      got += r;
      if (r < step) throw_truncated(fmt::format("{} bytes of {}", n, what), got);
    }
    uint8_t extra = 0;
    DT_CHECK(read(&extra, 1) == 0, "data", "{}: unexpected data after {} bytes of {}", path_, n, what);
    return out;
  }

 private:
  [[noreturn]] void throw_stream_error() {
    int code = Z_OK;
    const char* msg = gzerror(file_.get(), &code);
    if (code == Z_ERRNO) DT_THROW("data", "{}: read failed: {}", path_, std::strerror(errno));
    // zlib prefixes its message with the path.
    std::string_view what = msg != nullptr ? msg : "unknown error";
    if (what.starts_with(path_ + ": ")) what.remove_prefix(path_.size() + 2);
    DT_THROW("data", "{}: corrupt gzip data: {}", path_, what);
  }

  [[noreturn]] void throw_truncated(const std::string& expected, int64_t got) {
    // A cut-off gzip stream ends the data early with Z_BUF_ERROR rather than failing the read.
    int code = Z_OK;
    gzerror(file_.get(), &code);
    DT_THROW("data", "{}: truncated: expected {}, got {}{}", path_, expected, got,
             code == Z_BUF_ERROR ? " (the gzip stream ends early)" : "");
  }

  std::string path_;
  GzFile file_;
};

}  // namespace

FashionMnist::FashionMnist(const std::string& dir, bool train) {
  const std::string prefix = dir + (train ? "/train" : "/t10k");

  IdxReader images(prefix + "-images-idx3-ubyte.gz");
  const std::vector<uint32_t> dims = images.header(kImagesMagic, 3, "images");
  DT_CHECK(dims[1] == kSide && dims[2] == kSide, "data", "{}: images are {}x{}, expected {}x{}", images.path(), dims[1],
           dims[2], kSide, kSide);
  count_ = dims[0];
  images_ = images.body(count_ * kPixels, "pixels");

  IdxReader labels(prefix + "-labels-idx1-ubyte.gz");
  const int64_t num_labels = labels.header(kLabelsMagic, 1, "labels")[0];
  DT_CHECK(num_labels == count_, "data", "{}: label count mismatch: {} labels for {} images in {}", labels.path(),
           num_labels, count_, images.path());
  labels_ = labels.body(count_, "labels");
  for (int64_t i = 0; i < count_; ++i) {
    DT_CHECK(labels_[i] < kClasses, "data", "{}: label {} at index {} is not a class in [0, {})", labels.path(),
             labels_[i], i, kClasses);
  }
}

Batch FashionMnist::get(const std::vector<int64_t>& indices) const {
  const auto batch = static_cast<int64_t>(indices.size());
  Tensor x = Tensor::empty({batch, kPixels});
  Tensor y = Tensor::empty({batch});
  float* xp = x.data();
  float* yp = y.data();
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t i = indices[b];
    DT_CHECK(i >= 0 && i < count_, "data", "FashionMnist::get: index {} out of range [0, {})", i, count_);
    const uint8_t* src = images_.data() + i * kPixels;
    for (int64_t p = 0; p < kPixels; ++p) xp[b * kPixels + p] = static_cast<float>(src[p]) / 255.0f;
    yp[b] = labels_[i];
  }
  return {x, y};
}

}  // namespace dtrain::data
