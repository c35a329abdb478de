// Reading a run's trace (run_data.h): the spans of every rank on one clock, after checking that
// the trace was written by one of the run's starts.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstdlib>
#include <limits>
#include <map>

#include "dtrain/core/file.h"
#include "run_data.h"

namespace dtrain::report {

void load_trace(const ReportInput& in, RunData& run) {
  std::string path = in.trace;
  if (path.empty() && !run.starts.empty()) path = run.starts.back().trace;
  if (path.empty()) {
    run.problems.push_back("no trace (train with --trace FILE): no time per rank, no Gantt chart");
    return;
  }
  run.trace_path = path;
  std::string text;
  if (const std::string why = read_regular_file(path, &text); !why.empty()) {
    run.problems.push_back(fmt::format("trace {}: {}: no time per rank, no Gantt chart", path, why));
    return;
  }
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
  if (!j.is_object() || !j.contains("traceEvents") || !j["traceEvents"].is_array()) {
    run.problems.push_back(fmt::format(
        "trace {}: not a Chrome/Perfetto trace object with traceEvents (truncated or another file?): left out", path));
    return;
  }
  const nlohmann::json other = j.value("otherData", nlohmann::json::object());
  const std::string id = other.is_object() ? other.value("run_id", "") : "";
  std::vector<std::string> ours;
  for (const Start& s : run.starts) ours.push_back(s.run_id);
  if (!id.empty() && !ours.empty() && std::find(ours.begin(), ours.end(), id) == ours.end()) {
    run.problems.push_back(
        fmt::format("trace {} belongs to another run (its run id {}; this run's starts: {}): left out", path, id,
                    fmt::join(ours, ", ")));
    return;
  }
  if (id.empty()) run.problems.push_back(fmt::format("trace {} names no run: used, but it may be another run's", path));
  // Each rank counts from its own origin; on one host the origins put them on one clock.
  std::map<int, double> origin;
  if (other.is_object() && other.contains("clock_origin_us") && other["clock_origin_us"].is_array()) {
    for (const auto& o : other["clock_origin_us"]) {
      if (o.is_object() && o.contains("rank") && o.contains("us") && o["us"].is_number()) {
        origin[o["rank"].get<int>()] = o["us"].get<double>();
      }
    }
  }
  double base = std::numeric_limits<double>::max();
  for (const auto& [r, us] : origin) base = std::min(base, us);
  size_t unreadable = 0;
  for (const auto& e : j["traceEvents"]) {
    if (!e.is_object() || e.value("ph", "") != "X") continue;
    if (!e.contains("pid") || !e.contains("ts") || !e.contains("dur") || !e["ts"].is_number() ||
        !e["dur"].is_number() || !e["pid"].is_number_integer()) {
      ++unreadable;
      continue;
    }
    Span s;
    s.rank = e["pid"].get<int>();
    s.tid = e.value("tid", 0);
    const std::string name = e.value("name", "");
    const size_t space = name.find(' ');
    s.name = name.substr(0, space);
    if (space != std::string::npos) s.index = std::atoi(name.c_str() + space + 1);
    const nlohmann::json args = e.value("args", nlohmann::json::object());
    s.step = args.is_object() ? args.value("step", int64_t{0}) : 0;
    s.bytes = args.is_object() ? args.value("bytes", int64_t{-1}) : -1;
    auto o = origin.find(s.rank);
    s.ts = e["ts"].get<double>() + (o != origin.end() ? o->second - base : 0.0);
    s.dur = e["dur"].get<double>();
    run.trace_world = std::max(run.trace_world, s.rank + 1);
    run.spans.push_back(std::move(s));
  }
  if (unreadable > 0) run.problems.push_back(fmt::format("trace {}: {} events unreadable: left out", path, unreadable));
  if (origin.empty() && run.trace_world > 1) {
    run.problems.push_back(fmt::format("trace {} has no clock origins: the ranks' rows are not aligned", path));
  }
  run.has_trace = !run.spans.empty();
  if (!run.has_trace) run.problems.push_back(fmt::format("trace {} has no spans", path));
}

}  // namespace dtrain::report
