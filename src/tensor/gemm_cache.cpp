// The auto policy's calibrations on disk (gemm_cache.h).
#include "gemm_cache.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/file.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <sstream>

namespace dtrain::detail {

namespace {

constexpr const char* kMagic = "dtrain-gemm-auto 1";

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ULL;
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ULL;
  }
  return h;
}

std::string cache_folder() {
  if (const char* dir = std::getenv("DTRAIN_GEMM_CACHE"); dir != nullptr) {
    const std::string d = dir;
    return d == "off" ? std::string() : d;
  }
  if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg != nullptr && *xdg != '\0') {
    return std::string(xdg) + "/dtrain";
  }
  if (const char* home = std::getenv("HOME"); home != nullptr && *home != '\0') {
    return std::string(home) + "/.cache/dtrain";
  }
  return {};
}

bool parse_entry(const std::string& line, GemmCalibration& cal) {
  std::istringstream in(line);
  int ta = 0, tb = 0;
  std::string lib;
  if (!(in >> ta >> tb >> cal.m >> cal.n >> cal.k >> cal.threads >> lib >> cal.openblas_s >> cal.onednn_s)) {
    return false;
  }
  if ((ta != 0 && ta != 1) || (tb != 0 && tb != 1) || cal.m <= 0 || cal.n <= 0 || cal.k <= 0 || cal.threads <= 0) {
    return false;
  }
  if (lib == "openblas") {
    cal.chosen = GemmBackend::openblas;
  } else if (lib == "onednn") {
    cal.chosen = GemmBackend::onednn;
  } else {
    return false;
  }
  cal.trans_a = ta == 1;
  cal.trans_b = tb == 1;
  return true;
}

bool write_all(int fd, const std::string& text) {
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n <= 0) return false;
    done += static_cast<size_t>(n);
  }
  return true;
}

}  // namespace

std::string gemm_cache_path(const std::string& signature) {
  const std::string folder = cache_folder();
  if (folder.empty()) return {};
  return fmt::format("{}/gemm-auto-{:016x}.txt", folder, fnv1a(signature));
}

GemmCacheFile::GemmCacheFile(const std::string& signature) : signature_(signature) {
  const std::string path = gemm_cache_path(signature);
  if (path.empty()) return;
  std::error_code ec;
  std::filesystem::create_directories(std::filesystem::path(path).parent_path(), ec);
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0) return;
  if (::flock(fd_, LOCK_EX) != 0) {
    ::close(fd_);
    fd_ = -1;
    return;
  }
  std::string text;
  char buf[8192];
  for (ssize_t n; (n = ::read(fd_, buf, sizeof(buf))) > 0;) text.append(buf, static_cast<size_t>(n));
  if (text.empty()) {
    valid_ = write_all(fd_, fmt::format("{}\n# {}\n", kMagic, signature_));
    return;
  }
  std::istringstream lines(text);
  std::string magic, sig;
  std::getline(lines, magic);
  std::getline(lines, sig);
  if (magic != kMagic || sig != "# " + signature_) return;  // another format or machine: not ours
  valid_ = true;
  for (std::string line; std::getline(lines, line);) {
    GemmCalibration cal;
    if (parse_entry(line, cal)) entries_.push_back(cal);
  }
}

GemmCacheFile::~GemmCacheFile() {
  if (fd_ >= 0) {
    ::flock(fd_, LOCK_UN);
    ::close(fd_);
  }
}

void GemmCacheFile::append(const GemmCalibration& cal) {
  if (!is_open()) return;
  // One write of the whole line, at the end (O_APPEND semantics by hand: we hold the lock).
  ::lseek(fd_, 0, SEEK_END);
  write_all(fd_, fmt::format("{} {} {} {} {} {} {} {:.9g} {:.9g}\n", cal.trans_a ? 1 : 0, cal.trans_b ? 1 : 0, cal.m,
                             cal.n, cal.k, cal.threads, gemm_backend_name(cal.chosen), cal.openblas_s, cal.onednn_s));
}

}  // namespace dtrain::detail
