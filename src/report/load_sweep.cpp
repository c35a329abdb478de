// A sweep directory as the report reads it (run_data.h): sweep.json, results.jsonl and each
// trial's metrics-K.jsonl (the job of rung K), which the trial's curves join end to end.
#include <fmt/format.h>

#include <filesystem>
#include <fstream>

#include "dtrain/core/error.h"
#include "dtrain/core/file.h"
#include "run_data.h"

namespace dtrain::report {

namespace fs = std::filesystem;
using nlohmann::json;

bool is_sweep_dir(const std::string& path) {
  std::error_code ec;
  return fs::is_directory(path, ec) && fs::is_regular_file(path + "/sweep.json", ec);
}

SweepData load_sweep(const std::string& dir) {
  SweepData s;
  s.dir = dir;
  std::string bytes;
  const std::string why = read_regular_file(dir + "/sweep.json", &bytes);
  DT_CHECK(why.empty(), "report", "{}/sweep.json: cannot read: {}", dir, why);
  s.search = json::parse(bytes, nullptr, false);
  DT_CHECK(s.search.is_object() && s.search.value("format", "") == "dtrain-sweep", "report",
           "{}/sweep.json: not a dtrain sweep's manifest", dir);
  s.metric = s.search.value("metric", "");
  s.mode = s.search.value("mode", "");
  s.strategy = s.search.value("strategy", "");
  std::ifstream in(dir + "/results.jsonl");
  DT_CHECK(in.good(), "report",
           "{}: no results.jsonl: the sweep has not finished (continue it with dtrain sweep --resume {})", dir, dir);
  std::string line;
  int64_t number = 0;
  while (std::getline(in, line)) {
    ++number;
    const json row = json::parse(line, nullptr, false);
    if (!row.is_object() || !row.contains("trial") || !row["trial"].is_number_integer()) {
      s.problems.push_back(fmt::format("{}/results.jsonl: line {} is not a trial's result: left out", dir, number));
      continue;
    }
    SweepTrialData t;
    t.trial = row["trial"].get<int64_t>();
    t.result = row;
    t.run.name = fmt::format("trial {}", t.trial);
    const std::string tdir = fmt::format("{}/trial-{:04d}", dir, t.trial);
    for (int rung = 0;; ++rung) {
      const std::string metrics = fmt::format("{}/metrics-{}.jsonl", tdir, rung);
      std::error_code ec;
      if (!fs::exists(metrics, ec)) break;
      RunData r;
      try {
        r = load_metrics({metrics, "", ""});
      } catch (const Error& e) {
        s.problems.push_back(e.message());
        continue;
      }
      // The job of rung K continues from rung K-1's checkpoint: its records follow the earlier ones.
      const size_t first_start = t.run.starts.size();
      for (LogPoint p : r.logs) {
        p.start += first_start;
        t.run.logs.push_back(p);
      }
      t.run.starts.insert(t.run.starts.end(), r.starts.begin(), r.starts.end());
      if (r.final && r.final->contains(s.metric) && (*r.final)[s.metric].is_number()) {
        t.metric.push_back({r.final->value("steps", int64_t{0}), (*r.final)[s.metric].get<double>()});
      }
      if (r.final) t.run.final = r.final;
      for (const std::string& p : r.problems) {
        if (p.find("no final record") == std::string::npos || row.value("status", "") != "failed") {
          s.problems.push_back(fmt::format("trial {}: {}", t.trial, p));
        }
      }
    }
    s.trials.push_back(std::move(t));
  }
  DT_CHECK(!s.trials.empty(), "report", "{}/results.jsonl: no trial in it", dir);
  return s;
}

}  // namespace dtrain::report
