#include "dtrain/train/metrics.h"

#include <fmt/format.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>

#include "dtrain/core/error.h"
#include "dtrain/core/file.h"

namespace dtrain::train {

MetricsWriter::MetricsWriter(const std::string& path, bool append) : path_(path) {
  // Lock, then truncate: a second writer must not empty the file the first one is writing.
  fd_ = open_locked_file(path, "metrics");
  DT_CHECK(fd_ >= 0, "metrics",
           "--metrics {}: another process is writing this file (a second run, or workers started without --dp?)", path);
  if (!append && ::ftruncate(fd_, 0) != 0) {  // the file is opened O_APPEND
    const int err = errno;
    ::close(fd_);
    fd_ = -1;
    DT_THROW("metrics", "--metrics {}: cannot truncate: {}", path, std::strerror(err));
  }
}

MetricsWriter::~MetricsWriter() {
  if (fd_ >= 0) ::close(fd_);
}

MetricsWriter::MetricsWriter(MetricsWriter&& other) noexcept : fd_(other.fd_), path_(std::move(other.path_)) {
  other.fd_ = -1;
}

MetricsWriter& MetricsWriter::operator=(MetricsWriter&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = other.fd_;
    path_ = std::move(other.path_);
    other.fd_ = -1;
  }
  return *this;
}

void MetricsWriter::write(const nlohmann::json& record) {
  if (fd_ < 0) return;
  write_all(fd_, record.dump() + '\n', "--metrics " + path_, "metrics");
}

Progress::Progress(int64_t total_steps, int64_t log_every, bool bar_allowed)
    : total_(total_steps),
      log_every_(log_every),
      bar_(bar_allowed && ::isatty(STDERR_FILENO) != 0),
      start_(std::chrono::steady_clock::now()),
      last_draw_(start_) {}

namespace {
std::string format_duration(double s) {
  if (s < 0 || s > 1e7) return "--:--";
  const auto t = static_cast<int64_t>(std::llround(s));
  if (t >= 3600) return fmt::format("{}:{:02}:{:02}", t / 3600, (t / 60) % 60, t % 60);
  return fmt::format("{:02}:{:02}", t / 60, t % 60);
}

std::string format_rate(double rate) {
  if (rate >= 1e6) return fmt::format("{:.2f}M", rate / 1e6);
  if (rate >= 1e4) return fmt::format("{:.1f}k", rate / 1e3);
  return fmt::format("{:.1f}", rate);
}
}  // namespace

void Progress::update(int64_t step, int64_t epoch, double loss, double lr, double rate, const char* unit) {
  const auto now = std::chrono::steady_clock::now();
  const double elapsed = std::chrono::duration<double>(now - start_).count();
  const double eta = step > 0 ? elapsed / static_cast<double>(step) * static_cast<double>(total_ - step) : -1.0;
  if (bar_) {
    if (step != total_ && now - last_draw_ < std::chrono::milliseconds(100)) return;
    last_draw_ = now;
    constexpr int kWidth = 24;
    const int filled = total_ > 0 ? static_cast<int>(kWidth * step / total_) : 0;
    std::string bar(static_cast<size_t>(filled), '#');
    bar.resize(kWidth, '.');
    std::fprintf(stderr, "\r[%s] step %ld/%ld  epoch %ld  loss %.4f  %s %s/s  eta %s   ", bar.c_str(),
                 static_cast<long>(step), static_cast<long>(total_), static_cast<long>(epoch), loss,
                 format_rate(rate).c_str(), unit, format_duration(eta).c_str());
    std::fflush(stderr);
    drawn_ = true;
    return;
  }
  if (step % log_every_ != 0 && step != total_) return;
  std::fprintf(stderr, "step %ld/%ld epoch %ld loss %.4f lr %.3g %s %s/s elapsed %s eta %s\n", static_cast<long>(step),
               static_cast<long>(total_), static_cast<long>(epoch), loss, lr, format_rate(rate).c_str(), unit,
               format_duration(elapsed).c_str(), format_duration(eta).c_str());
}

void Progress::finish() {
  if (bar_ && drawn_) std::fprintf(stderr, "\n");
}

int64_t peak_rss_bytes() {
  FILE* f = std::fopen("/proc/self/status", "r");
  if (f == nullptr) return -1;
  char line[256];
  int64_t kb = -1;
  while (std::fgets(line, sizeof(line), f) != nullptr) {
    if (std::strncmp(line, "VmHWM:", 6) == 0) {
      kb = std::strtoll(line + 6, nullptr, 10);
      break;
    }
  }
  std::fclose(f);
  return kb < 0 ? -1 : kb * 1024;
}

}  // namespace dtrain::train
