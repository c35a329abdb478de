#include "dtrain/checkpoint/model_io.h"

#include <fcntl.h>
#include <openssl/evp.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>
#include <memory>

#include "dtrain/core/error.h"
#include "dtrain/core/file.h"

namespace dtrain::checkpoint {

namespace {

constexpr char kMagic[8] = {'D', 'T', 'R', 'A', 'I', 'N', 'M', 'D'};
constexpr uint32_t kVersion = 1;
constexpr size_t kDigestBytes = 32;

template <typename T>
void put(std::string& out, T v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof(T));
}

// Bounds-checked reader over the file bytes; every overrun names the file and the field.
struct Reader {
  const std::string& path;
  const std::string& bytes;
  size_t end;
  size_t pos = 0;
  void need(size_t n, const char* what) const {
    DT_CHECK(n <= end - pos, "model", "{}: truncated or corrupt: {} needs {} bytes at offset {}, {} left", path, what,
             n, pos, end - pos);
  }
  template <typename T>
  T get(const char* what) {
    need(sizeof(T), what);
    T v;
    std::memcpy(&v, bytes.data() + pos, sizeof(T));
    pos += sizeof(T);
    return v;
  }
  std::string str(size_t n, const char* what) {
    need(n, what);
    std::string s = bytes.substr(pos, n);
    pos += n;
    return s;
  }
};

std::string hex_encode(const unsigned char* bytes, unsigned int len) {
  static const char* hex = "0123456789abcdef";
  std::string out;
  for (unsigned int i = 0; i < len; ++i) {
    out.push_back(hex[bytes[i] >> 4]);
    out.push_back(hex[bytes[i] & 15]);
  }
  return out;
}

}  // namespace

std::string sha256_hex(const void* data, size_t size) {
  unsigned char digest[kDigestBytes];
  unsigned int len = 0;
  DT_CHECK(EVP_Digest(data, size, digest, &len, EVP_sha256(), nullptr) == 1, "model", "SHA-256 failed");
  return hex_encode(digest, len);
}

std::string params_digest(const std::vector<nn::NamedTensor>& tensors) {
  std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)> ctx(EVP_MD_CTX_new(), EVP_MD_CTX_free);
  DT_CHECK(ctx && EVP_DigestInit_ex(ctx.get(), EVP_sha256(), nullptr) == 1, "model", "SHA-256 init failed");
  for (const auto& [name, t] : tensors) {
    Tensor c = t.dtype() == DType::f32 ? t.detach().contiguous() : t.to(DType::f32);
    EVP_DigestUpdate(ctx.get(), c.data(), static_cast<size_t>(c.numel()) * sizeof(float));
  }
  unsigned char digest[kDigestBytes];
  unsigned int len = 0;
  EVP_DigestFinal_ex(ctx.get(), digest, &len);
  return hex_encode(digest, len);
}

std::string encode_model(const ModelFile& file) {
  std::string out;
  out.append(kMagic, sizeof(kMagic));
  put<uint32_t>(out, kVersion);
  put<uint32_t>(out, static_cast<uint32_t>(file.metadata.size()));
  out += file.metadata;
  put<uint32_t>(out, static_cast<uint32_t>(file.tensors.size()));
  for (const auto& [name, t] : file.tensors) {
    Tensor c = t.detach().contiguous();
    put<uint32_t>(out, static_cast<uint32_t>(name.size()));
    out += name;
    put<uint8_t>(out, static_cast<uint8_t>(c.dtype()));
    put<uint32_t>(out, static_cast<uint32_t>(c.dim()));
    for (int64_t d : c.shape()) put<int64_t>(out, d);
    const uint64_t nbytes = static_cast<uint64_t>(c.numel()) * dtype_size(c.dtype());
    put<uint64_t>(out, nbytes);
    out.append(static_cast<const char*>(c.raw_data()), nbytes);
  }
  unsigned char digest[kDigestBytes];
  unsigned int len = 0;
  EVP_Digest(out.data(), out.size(), digest, &len, EVP_sha256(), nullptr);
  out.append(reinterpret_cast<const char*>(digest), kDigestBytes);
  return out;
}

void save_model(const std::string& path, const ModelFile& file) {
  write_file_atomic(path, encode_model(file), "model");
}

ModelFile load_model(const std::string& path) {
  // Anything but a regular file is refused by name (an ifstream on a directory failed with
  // "basic_filebuf::underflow"), and a FIFO does not block.
  std::string bytes;
  bool opened = false;
  const std::string why = read_regular_file(path, &bytes, nullptr, &opened);
  DT_CHECK(opened, "model", "{}: cannot open: {}", path, why);
  DT_CHECK(why != "is a directory" && why != "not a regular file", "model", "{}: {}, not a model file", path, why);
  DT_CHECK(why.empty(), "model", "{}: {}", path, why);
  return decode_model(bytes, path);
}

ModelFile decode_model(const std::string& bytes, const std::string& path) {
  DT_CHECK(bytes.size() >= sizeof(kMagic) + 8 + kDigestBytes && std::memcmp(bytes.data(), kMagic, 8) == 0, "model",
           "{}: not a dtrain model file (bad magic or {} bytes only)", path, bytes.size());
  const size_t body = bytes.size() - kDigestBytes;
  unsigned char digest[kDigestBytes];
  unsigned int len = 0;
  EVP_Digest(bytes.data(), body, digest, &len, EVP_sha256(), nullptr);
  Reader r{path, bytes, body};
  r.pos = sizeof(kMagic);
  const auto version = r.get<uint32_t>("version");
  DT_CHECK(version == kVersion, "model", "{}: unsupported version {} (this build reads version {})", path, version,
           kVersion);
  DT_CHECK(std::memcmp(digest, bytes.data() + body, kDigestBytes) == 0, "model",
           "{}: checksum mismatch: the file is corrupted or truncated", path);
  ModelFile file;
  file.metadata = r.str(r.get<uint32_t>("metadata length"), "metadata");
  const auto count = r.get<uint32_t>("tensor count");
  for (uint32_t i = 0; i < count; ++i) {
    std::string name = r.str(r.get<uint32_t>("name length"), "tensor name");
    const auto dtype = r.get<uint8_t>("dtype");
    DT_CHECK(dtype <= static_cast<uint8_t>(DType::u8), "model", "{}: tensor '{}': unknown dtype code {}", path, name,
             dtype);
    const auto ndim = r.get<uint32_t>("ndim");
    DT_CHECK(ndim <= 16, "model", "{}: tensor '{}': {} dimensions", path, name, ndim);
    Shape shape(ndim);
    int64_t numel = 1;
    for (auto& d : shape) {
      d = r.get<int64_t>("dimension");
      DT_CHECK(d >= 0 && d < (int64_t{1} << 40), "model", "{}: tensor '{}': bad dimension {}", path, name, d);
      // The element count must fit, or the byte count below could wrap around.
      DT_CHECK(d == 0 || numel <= (int64_t{1} << 40) / d, "model", "{}: tensor '{}': more than 2^40 elements", path,
               name);
      numel *= d;
    }
    const auto nbytes = r.get<uint64_t>("byte count");
    const auto dt = static_cast<DType>(dtype);
    DT_CHECK(nbytes == static_cast<uint64_t>(shape_numel(shape)) * dtype_size(dt), "model",
             "{}: tensor '{}' {} holds {} bytes, expected {}", path, name, shape_str(shape), nbytes,
             shape_numel(shape) * static_cast<int64_t>(dtype_size(dt)));
    r.need(nbytes, "tensor data");
    Tensor t = Tensor::empty(shape, dt);
    if (nbytes > 0) std::memcpy(t.raw_data(), bytes.data() + r.pos, nbytes);
    r.pos += nbytes;
    file.tensors.emplace_back(std::move(name), t);
  }
  DT_CHECK(r.pos == body, "model", "{}: {} unexpected bytes after the last tensor", path, body - r.pos);
  return file;
}

DiffResult diff_models(const ModelFile& a, const ModelFile& b) {
  DT_CHECK(a.tensors.size() == b.tensors.size(), "diff", "models have {} and {} tensors", a.tensors.size(),
           b.tensors.size());
  DiffResult result;
  for (size_t i = 0; i < a.tensors.size(); ++i) {
    const auto& [na, ta] = a.tensors[i];
    const auto& [nb, tb] = b.tensors[i];
    DT_CHECK(na == nb, "diff", "tensor {} is '{}' in the first model and '{}' in the second", i, na, nb);
    DT_CHECK(ta.shape() == tb.shape(), "diff", "tensor '{}' has shape {} and {}", na, shape_str(ta.shape()),
             shape_str(tb.shape()));
    const std::vector<float> va = ta.to_vector();
    const std::vector<float> vb = tb.to_vector();
    TensorDiff d{na};
    double max_a = 0.0;
    for (size_t j = 0; j < va.size(); ++j) {
      const double diff = std::fabs(static_cast<double>(va[j]) - vb[j]);
      d.max_abs = std::isnan(diff) ? INFINITY : std::max(d.max_abs, diff);
      max_a = std::max(max_a, std::fabs(static_cast<double>(va[j])));
    }
    d.rel = d.max_abs == 0.0 ? 0.0 : (max_a == 0.0 ? INFINITY : d.max_abs / max_a);
    result.max_abs = std::max(result.max_abs, d.max_abs);
    result.max_rel = std::max(result.max_rel, d.rel);
    result.tensors.push_back(d);
  }
  return result;
}

}  // namespace dtrain::checkpoint
