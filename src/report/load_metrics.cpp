// Reading a run's JSON-lines metrics (run_data.h): start, log and final records; lines that do
// not parse (a run killed mid-write leaves a truncated last line) are counted and named.
#include <fmt/format.h>
#include <sys/stat.h>

#include <algorithm>
#include <filesystem>
#include <sstream>

#include "dtrain/core/error.h"
#include "dtrain/core/file.h"
#include "run_data.h"

namespace dtrain::report {

namespace {

namespace fs = std::filesystem;

// The metrics file of `run`: the path itself, or in a directory metrics.jsonl, else its only *.jsonl.
std::string metrics_file(const std::string& run) {
  std::error_code ec;
  if (!fs::is_directory(run, ec)) return run;
  if (fs::exists(fs::path(run) / "metrics.jsonl", ec)) return (fs::path(run) / "metrics.jsonl").string();
  std::vector<std::string> found;
  for (const auto& e : fs::directory_iterator(run, ec)) {
    if (e.path().extension() == ".jsonl") found.push_back(e.path().string());
  }
  DT_CHECK(found.size() == 1, "report", "{}: a directory with {} .jsonl files; name the metrics file", run,
           found.size());
  return found.front();
}

double num(const nlohmann::json& j, const char* key, double fallback = -1) {
  auto it = j.find(key);
  return it != j.end() && it->is_number() ? it->get<double>() : fallback;
}

std::string str(const nlohmann::json& j, const char* key) {
  auto it = j.find(key);
  return it != j.end() && it->is_string() ? it->get<std::string>() : std::string();
}

Start read_start(const nlohmann::json& j) {
  Start s;
  s.time = num(j, "time", 0);
  s.attempt = static_cast<int>(num(j, "attempt", 0));
  s.world = static_cast<int>(num(j, "world", 1));
  s.dp = static_cast<int>(num(j, "dp", 1));
  s.pp = static_cast<int>(num(j, "pp", 1));
  s.tp = static_cast<int>(num(j, "tp", 1));
  s.resumed_step = static_cast<int64_t>(num(j, "resumed_step", 0));
  s.steps = static_cast<int64_t>(num(j, "steps", 0));
  s.batch_size = static_cast<int64_t>(num(j, "batch_size", 0));
  s.run_id = str(j, "run_id");
  s.model = str(j, "model");
  s.trace = str(j, "trace");
  s.checkpoint_dir = str(j, "checkpoint_dir");
  s.reason = str(j, "restart_reason");
  s.failed_at = num(j, "failed_at", 0);
  s.failed_flight_dir = str(j, "failed_flight_dir");
  return s;
}

}  // namespace

RunData load_metrics(const ReportInput& in) {
  RunData run;
  run.metrics_path = metrics_file(in.run);
  run.name = fs::path(run.metrics_path).stem().string();
  if (run.name == "metrics") run.name = fs::path(run.metrics_path).parent_path().filename().string();
  std::string text;
  bool missing = false;
  const std::string why = read_regular_file(run.metrics_path, &text, &missing);
  DT_CHECK(why.empty(), "report", "{}: cannot read the run's metrics: {}", run.metrics_path, why);
  std::istringstream lines(text);
  std::string line;
  int64_t number = 0;
  std::vector<int64_t> bad;
  size_t records = 0;
  while (std::getline(lines, line)) {
    ++number;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    if (!j.is_object() || !j.contains("event") || !j["event"].is_string()) {
      bad.push_back(number);
      continue;
    }
    ++records;
    const std::string event = j["event"].get<std::string>();
    if (event == "start") {
      run.starts.push_back(read_start(j));
    } else if (event == "log") {
      if (!j.contains("step") || !j["step"].is_number() || !j.contains("loss") || !j["loss"].is_number()) {
        bad.push_back(number);
        continue;
      }
      LogPoint p;
      p.step = j["step"].get<int64_t>();
      p.loss = j["loss"].get<double>();
      p.lr = num(j, "lr");
      p.rate = num(j, "samples_per_s", num(j, "tokens_per_s"));
      if (j.contains("tokens_per_s")) run.unit = "tok";
      p.mfu = num(j, "mfu");
      p.time = num(j, "time", 0);
      p.start = run.starts.empty() ? 0 : run.starts.size() - 1;
      run.logs.push_back(p);
    } else if (event == "eval") {
      run.evals.push_back({static_cast<int64_t>(num(j, "step", 0)), num(j, "value", 0)});
    } else if (event == "final") {
      run.final = j;
    }
  }
  DT_CHECK(records > 0, "report", "{}: no metrics records in it ({} lines{}): is it a dtrain --metrics file?",
           run.metrics_path, number, bad.empty() ? "" : ", none of them JSON records");
  if (!bad.empty()) {
    std::string which;
    for (size_t i = 0; i < bad.size() && i < 5; ++i) which += (i ? ", " : "") + std::to_string(bad[i]);
    run.problems.push_back(
        fmt::format("{}: {} line{} not a readable record (line{} {}{}; a run killed while writing "
                    "leaves a truncated last line): left out",
                    run.metrics_path, bad.size(), bad.size() > 1 ? "s are" : " is", bad.size() > 1 ? "s" : "", which,
                    bad.size() > 5 ? ", ..." : ""));
  }
  if (run.starts.empty()) {
    run.problems.push_back(fmt::format(
        "{}: no start record (written by an older dtrain?): restarts are not known, and the trace and checkpoint "
        "directory must be given with --trace and --checkpoint-dir",
        run.metrics_path));
  }
  if (!run.final) {
    run.problems.push_back(
        fmt::format("{}: no final record: the run did not finish (or is still running)", run.metrics_path));
  } else {
    const double acc = num(*run.final, "test_accuracy"), val = num(*run.final, "val_loss");
    const int64_t last = static_cast<int64_t>(num(*run.final, "steps", run.logs.empty() ? 0 : run.logs.back().step));
    if (acc >= 0) {
      run.eval_name = "test accuracy";
      if (run.evals.empty()) run.evals.push_back({last, acc});
    } else if (val >= 0) {
      run.eval_name = "validation loss";
      if (run.evals.empty()) run.evals.push_back({last, val});
    }
  }
  if (run.logs.empty()) run.problems.push_back(fmt::format("{}: no log records: no curves", run.metrics_path));
  return run;
}

}  // namespace dtrain::report
