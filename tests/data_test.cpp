// Data sets and the sharding sampler: the real Fashion-MNIST and fortunes files, small
// corrupt files written here, and the sampler's sharding invariants over world sizes 1..8.
#include "dtrain/data/data.h"

#include <gtest/gtest.h>
#include <zlib.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "dtrain/core/error.h"

using namespace dtrain;
using namespace dtrain::data;
namespace fs = std::filesystem;

namespace {

/// A fresh folder under TMPDIR, removed with everything in it.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "dtrain-data-test-XXXXXX").string();
    if (mkdtemp(tmpl.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const fs::path& path() const { return path_; }
  std::string operator/(const std::string& name) const { return (path_ / name).string(); }

 private:
  fs::path path_;
};

void write_file(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << path;
}

void write_file(const std::string& path, const std::string& text) {
  write_file(path, std::vector<uint8_t>(text.begin(), text.end()));
}

void write_gz(const std::string& path, const std::vector<uint8_t>& bytes) {
  gzFile f = gzopen(path.c_str(), "wb");
  ASSERT_NE(f, nullptr) << path;
  if (!bytes.empty()) {
    ASSERT_EQ(gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size())), static_cast<int>(bytes.size()));
  }
  ASSERT_EQ(gzclose(f), Z_OK);
}

std::vector<uint8_t> read_gz(const std::string& path) {
  std::vector<uint8_t> out;
  gzFile f = gzopen(path.c_str(), "rb");
  if (f == nullptr) return out;
  uint8_t buf[1 << 16];
  int n = 0;
  while ((n = gzread(f, buf, sizeof(buf))) > 0) out.insert(out.end(), buf, buf + n);
  gzclose(f);
  return out;
}

void put_u32(std::vector<uint8_t>& out, uint32_t v) {
  for (int shift = 24; shift >= 0; shift -= 8) out.push_back(static_cast<uint8_t>(v >> shift));
}

/// An IDX images file: magic, (count, rows, cols), then `pixels` (count * rows * cols by default).
std::vector<uint8_t> idx_images(uint32_t count, uint32_t rows = 28, uint32_t cols = 28, uint32_t magic = 2051) {
  std::vector<uint8_t> out;
  put_u32(out, magic);
  put_u32(out, count);
  put_u32(out, rows);
  put_u32(out, cols);
  for (uint32_t i = 0; i < count * rows * cols; ++i) out.push_back(static_cast<uint8_t>(i % 256));
  return out;
}

std::vector<uint8_t> idx_labels(const std::vector<uint8_t>& labels, uint32_t magic = 2049) {
  std::vector<uint8_t> out;
  put_u32(out, magic);
  put_u32(out, static_cast<uint32_t>(labels.size()));
  out.insert(out.end(), labels.begin(), labels.end());
  return out;
}

/// Runs fn, expecting a dtrain::Error from component "data" whose message holds every part.
void expect_data_error(const std::function<void()>& fn, std::initializer_list<std::string> parts) {
  try {
    fn();
    ADD_FAILURE() << "expected a dtrain::Error";
  } catch (const Error& e) {
    EXPECT_EQ(e.component(), "data") << e.what();
    for (const std::string& part : parts) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << "missing \"" << part << "\" in: " << e.what();
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Fashion-MNIST

constexpr const char* kMnistDir = FashionMnist::kDefaultDir;

std::string mnist_file(const char* name) { return std::string(kMnistDir) + "/" + name; }

bool have_fashion_mnist() { return fs::exists(mnist_file("train-images-idx3-ubyte.gz")); }

TEST(FashionMnistReal, LoadsTrainAndTestSets) {
  ASSERT_TRUE(have_fashion_mnist()) << "scripts/install-deps installs dataset-fashion-mnist";
  FashionMnist train(kMnistDir, true);
  FashionMnist test(kMnistDir, false);
  EXPECT_EQ(train.size(), 60000);
  EXPECT_EQ(test.size(), 10000);

  // The first training label, read straight from the file: byte 8 after the 8-byte header.
  const std::vector<uint8_t> raw = read_gz(mnist_file("train-labels-idx1-ubyte.gz"));
  ASSERT_EQ(raw.size(), 60008u);
  EXPECT_EQ(raw[8], 9);  // Fashion-MNIST's first training image is an ankle boot
  Batch b = train.get({0, 1, 59999});
  ASSERT_EQ(b.x.shape(), (Shape{3, 784}));
  ASSERT_EQ(b.y.shape(), (Shape{3}));
  EXPECT_EQ(b.y.to_vector(), (std::vector<float>{static_cast<float>(raw[8]), static_cast<float>(raw[9]),
                                                 static_cast<float>(raw[8 + 59999])}));

  // The first image's pixels against the raw file.
  const std::vector<uint8_t> pixels = read_gz(mnist_file("train-images-idx3-ubyte.gz"));
  ASSERT_EQ(pixels.size(), 16u + 60000u * 784u);
  const std::vector<float> x = b.x.to_vector();
  for (int p = 0; p < 784; ++p) ASSERT_FLOAT_EQ(x[p], pixels[16 + p] / 255.0f) << p;
}

TEST(FashionMnistReal, PixelsInUnitRangeAndClassesBalanced) {
  ASSERT_TRUE(have_fashion_mnist()) << "scripts/install-deps installs dataset-fashion-mnist";
  FashionMnist test(kMnistDir, false);
  std::vector<int64_t> all(10000);
  for (int64_t i = 0; i < 10000; ++i) all[i] = i;
  Batch b = test.get(all);
  const std::vector<float> x = b.x.to_vector();
  const auto [lo, hi] = std::minmax_element(x.begin(), x.end());
  EXPECT_EQ(*lo, 0.0f);
  EXPECT_EQ(*hi, 1.0f);
  std::vector<int> per_class(10, 0);
  for (float y : b.y.to_vector()) {
    ASSERT_GE(y, 0.0f);
    ASSERT_LT(y, 10.0f);
    ASSERT_EQ(y, static_cast<float>(static_cast<int>(y)));
    ++per_class[static_cast<int>(y)];
  }
  EXPECT_EQ(per_class, std::vector<int>(10, 1000));  // the test set has 1000 per class
}

TEST(FashionMnistReal, IndexOutOfRange) {
  ASSERT_TRUE(have_fashion_mnist()) << "scripts/install-deps installs dataset-fashion-mnist";
  FashionMnist test(kMnistDir, false);
  expect_data_error([&] { test.get({10000}); }, {"index 10000 out of range [0, 10000)"});
  expect_data_error([&] { test.get({0, -1}); }, {"index -1 out of range"});
  EXPECT_EQ(test.get({}).x.shape(), (Shape{0, 784}));
}

// Small files in a temp folder, one defect each.
class FashionMnistFiles : public ::testing::Test {
 protected:
  std::string images(bool train = true) const {
    return dir_ / (train ? "train-images-idx3-ubyte.gz" : "t10k-images-idx3-ubyte.gz");
  }
  std::string labels(bool train = true) const {
    return dir_ / (train ? "train-labels-idx1-ubyte.gz" : "t10k-labels-idx1-ubyte.gz");
  }
  std::string dir() const { return dir_.path().string(); }

  TempDir dir_;
};

TEST_F(FashionMnistFiles, LoadsSmallValidFiles) {
  std::vector<uint8_t> img = idx_images(3);
  img[16] = 255;
  img[17] = 51;
  img[18] = 0;
  write_gz(images(false), img);
  write_gz(labels(false), idx_labels({7, 0, 9}));
  FashionMnist ds(dir(), false);
  EXPECT_EQ(ds.size(), 3);
  Batch b = ds.get({2, 0});
  EXPECT_EQ(b.y.to_vector(), (std::vector<float>{9, 7}));
  const std::vector<float> x = b.x.to_vector();
  EXPECT_EQ(x[784 + 0], 1.0f);
  EXPECT_FLOAT_EQ(x[784 + 1], 0.2f);
  EXPECT_EQ(x[784 + 2], 0.0f);
  EXPECT_FLOAT_EQ(x[5], static_cast<float>((2 * 784 + 5) % 256) / 255.0f);
  // The training files are not there.
  expect_data_error([&] { FashionMnist(dir(), true); }, {images(true), "cannot open"});
}

TEST_F(FashionMnistFiles, MissingFolder) {
  const std::string missing = dir() + "/nope";
  expect_data_error([&] { FashionMnist(missing, true); },
                    {missing + "/train-images-idx3-ubyte.gz", "cannot open: No such file or directory",
                     "scripts/install-deps", "dataset-fashion-mnist"});
}

TEST_F(FashionMnistFiles, BadImageMagic) {
  write_gz(images(), idx_images(2, 28, 28, 2049));
  write_gz(labels(), idx_labels({1, 2}));
  expect_data_error([&] { FashionMnist(dir(), true); }, {images(), "bad magic 2049", "expected 2051"});
}

TEST_F(FashionMnistFiles, BadLabelMagic) {
  write_gz(images(), idx_images(2));
  write_gz(labels(), idx_labels({1, 2}, 2051));
  expect_data_error([&] { FashionMnist(dir(), true); }, {labels(), "bad magic 2051", "expected 2049"});
}

TEST_F(FashionMnistFiles, PlainFileIsNotGzipIdx) {
  // zlib reads a file without a gzip header as is, so the magic check catches it.
  write_file(images(), std::string("not an idx file at all"));
  write_gz(labels(), idx_labels({1}));
  expect_data_error([&] { FashionMnist(dir(), true); }, {images(), "bad magic"});
}

TEST_F(FashionMnistFiles, WrongImageSize) {
  write_gz(images(), idx_images(2, 27, 28));
  write_gz(labels(), idx_labels({1, 2}));
  expect_data_error([&] { FashionMnist(dir(), true); }, {images(), "images are 27x28, expected 28x28"});
}

TEST_F(FashionMnistFiles, TruncatedPixels) {
  std::vector<uint8_t> img = idx_images(3);
  img.resize(16 + 100);
  write_gz(images(), img);
  write_gz(labels(), idx_labels({1, 2, 3}));
  expect_data_error([&] { FashionMnist(dir(), true); },
                    {images(), "truncated: expected 2352 bytes of pixels, got 100"});
}

TEST_F(FashionMnistFiles, TruncatedHeader) {
  write_gz(images(), {0, 0, 8, 3, 0, 0});
  write_gz(labels(), idx_labels({1}));
  expect_data_error([&] { FashionMnist(dir(), true); }, {images(), "truncated: expected a 16-byte IDX header, got 6"});
}

TEST_F(FashionMnistFiles, TruncatedGzipStream) {
  // A gzip file cut off halfway: the decompressor runs out of input.
  write_gz(images(), idx_images(50));
  const std::string tmp = dir_ / "whole.gz";
  fs::rename(images(), tmp);
  std::ifstream in(tmp, std::ios::binary);
  std::vector<uint8_t> gz((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  gz.resize(gz.size() / 2);
  write_file(images(), gz);
  write_gz(labels(), idx_labels(std::vector<uint8_t>(50, 1)));
  expect_data_error([&] { FashionMnist(dir(), true); }, {images(), "truncated: expected 39200 bytes of pixels"});
}

TEST_F(FashionMnistFiles, TruncatedLabels) {
  write_gz(images(), idx_images(3));
  std::vector<uint8_t> lab = idx_labels({1, 2, 3});
  lab.pop_back();
  write_gz(labels(), lab);
  expect_data_error([&] { FashionMnist(dir(), true); }, {labels(), "truncated: expected 3 bytes of labels, got 2"});
}

TEST_F(FashionMnistFiles, TrailingData) {
  std::vector<uint8_t> img = idx_images(2);
  img.push_back(0);
  write_gz(images(), img);
  write_gz(labels(), idx_labels({1, 2}));
  expect_data_error([&] { FashionMnist(dir(), true); }, {images(), "unexpected data after"});
}

TEST_F(FashionMnistFiles, LabelCountMismatch) {
  write_gz(images(), idx_images(3));
  write_gz(labels(), idx_labels({1, 2}));
  expect_data_error([&] { FashionMnist(dir(), true); },
                    {labels(), "label count mismatch: 2 labels for 3 images", images()});
}

TEST_F(FashionMnistFiles, LabelOutOfRange) {
  write_gz(images(), idx_images(3));
  write_gz(labels(), idx_labels({1, 10, 3}));
  expect_data_error([&] { FashionMnist(dir(), true); }, {labels(), "label 10 at index 1 is not a class in [0, 10)"});
}

TEST_F(FashionMnistFiles, FolderInPlaceOfFile) {
  fs::create_directory(images());
  write_gz(labels(), idx_labels({1}));
  expect_data_error([&] { FashionMnist(dir(), true); }, {images()});
}

// ---------------------------------------------------------------------------------------------
// TextCorpus

std::string window_str(const Tensor& t, int64_t row) {
  std::string out;
  const std::vector<float> v = t.to_vector();
  const int64_t cols = t.size(1);
  for (int64_t c = 0; c < cols; ++c) out.push_back(static_cast<char>(v[row * cols + c]));
  return out;
}

TEST(TextCorpusFolder, SkipsBinaryFilesSymlinksAndSubfolders) {
  TempDir dir;
  const std::string a = "the quick brown fox jumps over the lazy dog\n";  // 44 bytes
  const std::string c = "pack my box with five dozen liquor jugs\n";      // 40 bytes
  write_file(dir / "b.txt", c);
  write_file(dir / "a.txt", a);
  write_file(dir / "a.dat", std::vector<uint8_t>{'x', 0, 'y'});
  fs::create_symlink(dir / "a.txt", dir / "z.u8");
  fs::create_directory(dir / "sub");
  write_file(dir / "sub" + "/inner.txt", std::string("never read"));

  TextCorpus corpus(dir.path().string(), 4, 0.25);
  EXPECT_EQ(corpus.num_files(), 2);
  const std::string all = a + c;  // sorted by name: a.txt then b.txt
  ASSERT_EQ(corpus.num_bytes(), 84);

  // 84 bytes: training part [0, 63), validation part [63, 84).
  const int64_t split = 63;
  EXPECT_EQ(corpus.train().size(), (split - 1) / 4);     // 15
  EXPECT_EQ(corpus.val().size(), (84 - split - 1) / 4);  // 5

  Batch tb = corpus.train().get({0, 14, 1});
  ASSERT_EQ(tb.x.shape(), (Shape{3, 4}));
  ASSERT_EQ(tb.y.shape(), (Shape{3, 4}));
  EXPECT_EQ(window_str(tb.x, 0), all.substr(0, 4));
  EXPECT_EQ(window_str(tb.y, 0), all.substr(1, 4));
  EXPECT_EQ(window_str(tb.x, 1), all.substr(56, 4));
  EXPECT_EQ(window_str(tb.y, 1), all.substr(57, 4));  // last target byte 60 < split
  EXPECT_EQ(window_str(tb.x, 2), all.substr(4, 4));

  Batch vb = corpus.val().get({0, 4});
  EXPECT_EQ(window_str(vb.x, 0), all.substr(split, 4));
  EXPECT_EQ(window_str(vb.y, 0), all.substr(split + 1, 4));
  EXPECT_EQ(window_str(vb.x, 1), all.substr(split + 16, 4));
  EXPECT_EQ(window_str(vb.y, 1), all.substr(split + 17, 4));  // ends at byte 83, the last

  expect_data_error([&] { corpus.train().get({15}); }, {"index 15 out of range [0, 15)"});
  expect_data_error([&] { corpus.val().get({-1}); }, {"index -1 out of range [0, 5)"});
}

TEST(TextCorpusFile, SingleFileAndExactWindowCounts) {
  TempDir dir;
  std::string text;
  for (int i = 0; i < 100; ++i) text.push_back(static_cast<char>('a' + i % 26));
  write_file(dir / "t.txt", text);
  // 100 bytes, val_fraction 0.1: train 90 bytes, val 10 bytes.
  for (int64_t t : {1, 2, 3, 8, 9}) {
    TextCorpus corpus(dir / "t.txt", t, 0.1);
    EXPECT_EQ(corpus.num_files(), 1);
    EXPECT_EQ(corpus.num_bytes(), 100);
    EXPECT_EQ(corpus.train().size(), 89 / t) << t;
    EXPECT_EQ(corpus.val().size(), 9 / t) << t;
    const int64_t last = corpus.val().size() - 1;
    Batch b = corpus.val().get({last});
    EXPECT_EQ(window_str(b.y, 0), text.substr(90 + last * t + 1, t));
  }
  // No validation part.
  TextCorpus no_val(dir / "t.txt", 9, 0.0);
  EXPECT_EQ(no_val.train().size(), 11);
  EXPECT_EQ(no_val.val().size(), 0);
}

TEST(TextCorpusErrors, MissingEmptyAndTooSmall) {
  TempDir dir;
  expect_data_error([&] { TextCorpus(dir / "missing", 4); },
                    {dir / "missing", "cannot open: No such file or directory"});

  expect_data_error([&] { TextCorpus(dir.path().string(), 4); },
                    {dir.path().string(), "empty corpus (0 text files, 0 binary files skipped)"});
  write_file(dir / "bin", std::vector<uint8_t>{0, 1, 2});
  expect_data_error([&] { TextCorpus(dir.path().string(), 4); },
                    {"empty corpus (0 text files, 1 binary files skipped)"});
  write_file(dir / "empty.txt", std::string());
  expect_data_error([&] { TextCorpus(dir / "empty.txt", 4); }, {dir / "empty.txt", "empty corpus"});

  // 20 bytes, val_fraction 0.1: 18 + 2 bytes; seq_len 4 needs 5 in each part.
  write_file(dir / "small.txt", std::string(20, 'x'));
  expect_data_error([&] { TextCorpus(dir / "small.txt", 4, 0.1); },
                    {dir / "small.txt",
                     "corpus too small: 20 bytes split into 18 training and 2 "
                     "validation bytes",
                     "seq_len + 1 = 5 bytes"});
  // A training part too small: 20 bytes, seq_len 19 -> 10 + 10 bytes.
  expect_data_error([&] { TextCorpus(dir / "small.txt", 19, 0.5); },
                    {"10 training and 10 validation bytes", "seq_len + 1 = 20"});
  EXPECT_EQ(TextCorpus(dir / "small.txt", 4, 0.25).val().size(), 1);

  expect_data_error([&] { TextCorpus(dir / "small.txt", 0); }, {"seq_len must be >= 1, got 0"});
  expect_data_error([&] { TextCorpus(dir / "small.txt", 4, 1.0); }, {"val_fraction must be in [0, 1)"});
}

TEST(TextCorpusReal, Fortunes) {
  const std::string path = "/usr/share/games/fortunes";
  ASSERT_TRUE(fs::is_directory(path)) << "scripts/install-deps installs fortunes";
  // Expected: the regular files that are not .dat indexes (the only binary ones there).
  int64_t bytes = 0, files = 0;
  for (const auto& e : fs::directory_iterator(path)) {
    if (e.is_symlink() || !e.is_regular_file() || e.path().extension() == ".dat") continue;
    bytes += static_cast<int64_t>(e.file_size());
    ++files;
  }
  TextCorpus corpus(path, 256);
  EXPECT_GT(corpus.num_bytes(), 1000000);
  EXPECT_EQ(corpus.num_bytes(), bytes);
  EXPECT_EQ(corpus.num_files(), files);
  const int64_t split = static_cast<int64_t>(static_cast<double>(bytes) * 0.9);
  EXPECT_EQ(corpus.train().size(), (split - 1) / 256);
  EXPECT_EQ(corpus.val().size(), (bytes - split - 1) / 256);
  Batch b = corpus.val().get({corpus.val().size() - 1});
  for (float v : b.x.to_vector()) {
    ASSERT_GT(v, 0.0f);
    ASSERT_LT(v, 256.0f);
  }
}

// ---------------------------------------------------------------------------------------------
// ShardedSampler

class ShardedSamplerTest : public ::testing::TestWithParam<std::tuple<int, int64_t, bool>> {};

TEST_P(ShardedSamplerTest, ShardsAreDisjointAndEqual) {
  const auto [world, size, shuffle] = GetParam();
  std::set<int64_t> seen;
  int64_t total = 0;
  for (int rank = 0; rank < world; ++rank) {
    ShardedSampler sampler(size, rank, world, 1234, shuffle);
    EXPECT_EQ(sampler.per_rank(), size / world);
    const std::vector<int64_t> idx = sampler.indices(3);
    ASSERT_EQ(static_cast<int64_t>(idx.size()), size / world);
    for (int64_t i : idx) {
      ASSERT_GE(i, 0);
      ASSERT_LT(i, size);
      EXPECT_TRUE(seen.insert(i).second) << "index " << i << " on two ranks";
    }
    total += static_cast<int64_t>(idx.size());
    EXPECT_EQ(idx, sampler.indices(3)) << "not deterministic";
    if (!shuffle) {
      for (int64_t k = 0; k < static_cast<int64_t>(idx.size()); ++k) {
        ASSERT_EQ(idx[k], rank + k * world);
      }
      EXPECT_EQ(idx, sampler.indices(4)) << "no shuffle: every epoch the same";
    }
  }
  EXPECT_EQ(total, (size / world) * world);
}

INSTANTIATE_TEST_SUITE_P(Worlds, ShardedSamplerTest,
                         ::testing::Combine(::testing::Range(1, 9), ::testing::Values<int64_t>(0, 1, 7, 13, 64, 1000),
                                            ::testing::Bool()));

TEST(ShardedSampler, ShuffleDependsOnSeedAndEpoch) {
  const int64_t n = 1000;
  ShardedSampler a(n, 0, 1, 42);
  ShardedSampler b(n, 0, 1, 42);
  ShardedSampler c(n, 0, 1, 43);
  const std::vector<int64_t> e0 = a.indices(0);
  EXPECT_EQ(e0, b.indices(0));
  EXPECT_NE(e0, a.indices(1));
  EXPECT_NE(e0, c.indices(0));

  // World 1 with shuffling is a permutation of [0, n), and not the identity.
  std::vector<int64_t> sorted = e0;
  std::sort(sorted.begin(), sorted.end());
  std::vector<int64_t> identity(n);
  for (int64_t i = 0; i < n; ++i) identity[i] = i;
  EXPECT_EQ(sorted, identity);
  EXPECT_NE(e0, identity);

  // Rank r of world w takes positions r, r + w, ... of the world-1 permutation.
  for (int rank = 0; rank < 3; ++rank) {
    const std::vector<int64_t> shard = ShardedSampler(n, rank, 3, 42).indices(0);
    ASSERT_EQ(shard.size(), 333u);
    for (size_t k = 0; k < shard.size(); ++k) ASSERT_EQ(shard[k], e0[rank + 3 * k]);
  }
}

TEST(ShardedSampler, RejectsBadArguments) {
  expect_data_error([] { ShardedSampler(10, 0, 0, 1); }, {"world must be >= 1, got 0"});
  expect_data_error([] { ShardedSampler(10, 2, 2, 1); }, {"rank 2 out of range [0, 2)"});
  expect_data_error([] { ShardedSampler(10, -1, 2, 1); }, {"rank -1 out of range [0, 2)"});
  expect_data_error([] { ShardedSampler(-1, 0, 1, 1); }, {"size must be >= 0, got -1"});
}

}  // namespace
