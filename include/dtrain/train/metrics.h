// Run observability: JSON-lines metrics, a terminal progress bar, resident memory.
#pragma once

#include <chrono>
#include <cstdint>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

namespace dtrain::train {

/// Appends one JSON object per line; flushed per record so a crashed run keeps its history.
class MetricsWriter {
 public:
  MetricsWriter() = default;
  /// Opens `path` (never through a symlink) and takes an exclusive lock on it: a second process
  /// writing the same file is refused, naming it, instead of interleaving its lines. Empties it
  /// unless `append` (a restarted job goes on with its first start's records).
  explicit MetricsWriter(const std::string& path, bool append = false);
  ~MetricsWriter();
  MetricsWriter(MetricsWriter&& other) noexcept;
  MetricsWriter& operator=(MetricsWriter&& other) noexcept;
  bool enabled() const { return fd_ >= 0; }
  void write(const nlohmann::json& record);

 private:
  int fd_ = -1;
  std::string path_;
};

/// A one-line progress bar on a terminal (redrawn at most 10 times a second), or plain log
/// lines every `log_every` steps when stderr is not a terminal or the bar is disabled.
class Progress {
 public:
  Progress(int64_t total_steps, int64_t log_every, bool bar_allowed);
  /// `rate` is samples/s or tokens/s; `unit` names it.
  void update(int64_t step, int64_t epoch, double loss, double lr, double rate, const char* unit);
  void finish();

 private:
  int64_t total_, log_every_;
  bool bar_;
  std::chrono::steady_clock::time_point start_, last_draw_;
  bool drawn_ = false;
};

/// Peak resident set size of this process in bytes (VmHWM).
int64_t peak_rss_bytes();

}  // namespace dtrain::train
