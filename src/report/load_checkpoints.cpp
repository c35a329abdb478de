// A run's checkpoint directory as the report shows it (run_data.h): each step directory, whether
// its manifest (the commit point) is there, and when it was written.
#include <fmt/format.h>
#include <sys/stat.h>

#include <algorithm>
#include <filesystem>

#include "run_data.h"

namespace dtrain::report {

namespace {
namespace fs = std::filesystem;

// Modification time in Unix seconds; 0 when it cannot be read.
double mtime(const fs::path& p) {
  struct stat st {};
  if (::stat(p.c_str(), &st) != 0) return 0;
  return static_cast<double>(st.st_mtim.tv_sec) + static_cast<double>(st.st_mtim.tv_nsec) * 1e-9;
}
}  // namespace

void load_checkpoints(const ReportInput& in, RunData& run) {
  std::string dir = in.checkpoint_dir;
  if (dir.empty() && !run.starts.empty()) dir = run.starts.back().checkpoint_dir;
  if (dir.empty()) return;  // the run kept none
  run.checkpoint_dir = dir;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    run.problems.push_back(fmt::format("checkpoint directory {}: {}", dir, ec ? ec.message() : "not a directory"));
    return;
  }
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.size() != 13 || !name.starts_with("step-") || !e.is_directory(ec)) continue;
    Checkpoint c;
    c.step = std::strtoll(name.c_str() + 5, nullptr, 10);
    const fs::path manifest = e.path() / "manifest.json";
    c.complete = fs::is_regular_file(manifest, ec);
    if (c.complete) c.time = mtime(manifest);
    run.checkpoints.push_back(c);
  }
  if (ec) run.problems.push_back(fmt::format("checkpoint directory {}: {}", dir, ec.message()));
  std::sort(run.checkpoints.begin(), run.checkpoints.end(),
            [](const Checkpoint& a, const Checkpoint& b) { return a.step < b.step; });
}

}  // namespace dtrain::report
