// One run's page data (analyse.h holds the vocabulary of the time split).
#include "analyse.h"

#include <algorithm>
#include <limits>
#include <map>
#include <set>

namespace dtrain::report {

namespace {

using nlohmann::json;

// Mean over a rank's steps of each part of the step, in seconds.
struct StepParts {
  double step = 0, compute = 0, sync = 0, backward_end = 0, start = 0;
  bool has_step_span = false;
};

json series(const RunData& run) {
  json steps = json::array(), loss = json::array(), rate = json::array(), mfu = json::array(), time = json::array(),
       start = json::array();
  bool any_mfu = false;
  for (const LogPoint& p : run.logs) {
    steps.push_back(p.step);
    loss.push_back(p.loss);
    rate.push_back(p.rate >= 0 ? json(p.rate) : json());
    mfu.push_back(p.mfu >= 0 ? json(p.mfu) : json());
    any_mfu = any_mfu || p.mfu >= 0;
    time.push_back(p.time);
    start.push_back(p.start);
  }
  json out{{"steps", steps}, {"loss", loss},   {"rate", rate},
           {"time", time},   {"start", start}, {"unit", run.unit + "/s"}};
  out["mfu"] = any_mfu ? mfu : json();
  out["mfu_label"] = "MFU";
  // Without MFU in the log records: each point's throughput times the model's FLOPs per sample
  // (final record), over the measured peak of every rank when the record has it (MFU), else
  // as model FLOP/s.
  if (!any_mfu && run.final) {
    const json& f = *run.final;
    const double flops = f.value("model_flops_per_s", 0.0);
    const double per_s = f.value(run.unit == "tok" ? "tokens_per_s" : "samples_per_s", 0.0);
    const double peak = f.value("peak_flops_per_rank", 0.0) * f.value("world", 1.0);
    if (flops > 0 && per_s > 0) {
      json derived = json::array();
      for (const LogPoint& p : run.logs) {
        derived.push_back(p.rate >= 0 ? json(peak > 0 ? p.rate * flops / per_s / peak : p.rate * flops / per_s / 1e9)
                                      : json());
      }
      out["mfu"] = derived;
      out["mfu_label"] = peak > 0 ? "MFU" : "model GFLOP/s";
    }
  }
  json es = json::array(), ev = json::array();
  for (const EvalPoint& e : run.evals) {
    es.push_back(e.step);
    ev.push_back(e.value);
  }
  out["eval"] = run.evals.empty() ? json() : json{{"name", run.eval_name}, {"steps", es}, {"values", ev}};
  return out;
}

// (rank, step) -> its parts, from the trace's spans.
std::map<std::pair<int, int64_t>, StepParts> step_parts(const RunData& run) {
  std::map<std::pair<int, int64_t>, StepParts> parts;
  std::map<std::pair<int, int64_t>, std::pair<double, double>> extent;  // without step spans: first and last
  for (const Span& s : run.spans) {
    if (s.tid != 0) continue;
    StepParts& p = parts[{s.rank, s.step}];
    auto& [lo, hi] = extent.try_emplace({s.rank, s.step}, std::numeric_limits<double>::max(), 0.0).first->second;
    if (s.name == "step") {
      p.step = s.dur;
      p.start = s.ts;
      p.has_step_span = true;
      continue;
    }
    if (s.name == "checkpoint") continue;  // after the step's end
    lo = std::min(lo, s.ts);
    hi = std::max(hi, s.ts + s.dur);
    if (s.name == "forward" || s.name == "backward" || s.name == "optimizer") p.compute += s.dur;
    if (s.name == "synchronize") p.sync += s.dur;
    if (s.name == "backward") p.backward_end = std::max(p.backward_end, s.ts + s.dur);
  }
  for (auto& [key, p] : parts) {
    if (!p.has_step_span) {
      const auto& [lo, hi] = extent[key];
      p.step = hi > lo ? hi - lo : 0;
      p.start = lo;
    }
  }
  return parts;
}

json split(const RunData& run, bool pipelined) {
  if (!run.has_trace) return json();
  const auto parts = step_parts(run);
  std::set<int64_t> steps;
  for (const auto& [key, p] : parts) steps.insert(key.second);
  if (steps.size() > 1) steps.erase(steps.begin());  // the first step warms up
  const int n = run.trace_world;
  std::vector<double> compute(n), comm(n), wait(n), rest(n), total(n);
  std::vector<int> counted(n);
  for (int64_t step : steps) {
    double last_backward = 0;
    for (int r = 0; r < n; ++r) {
      if (auto it = parts.find({r, step}); it != parts.end())
        last_backward = std::max(last_backward, it->second.backward_end);
    }
    for (int r = 0; r < n; ++r) {
      auto it = parts.find({r, step});
      if (it == parts.end()) continue;
      const StepParts& p = it->second;
      const double waited = p.sync > 0 ? std::clamp(last_backward - p.backward_end, 0.0, p.sync) : 0.0;
      compute[r] += p.compute;
      wait[r] += waited;
      comm[r] += p.sync - waited;
      rest[r] += std::max(0.0, p.step - p.compute - p.sync);
      total[r] += p.step;
      ++counted[r];
    }
  }
  json ranks = json::array(), c = json::array(), m = json::array(), w = json::array(), b = json::array(),
       t = json::array();
  for (int r = 0; r < n; ++r) {
    const double k = counted[r] > 0 ? counted[r] * 1e6 : 1.0;  // microseconds -> seconds per step
    ranks.push_back(r);
    c.push_back(compute[r] / k);
    m.push_back(comm[r] / k);
    w.push_back(wait[r] / k);
    b.push_back(rest[r] / k);
    t.push_back(total[r] / k);
  }
  return json{{"ranks", ranks},     {"compute", c},
              {"communication", m}, {"waiting", w},
              {"rest", b},          {"rest_name", pipelined ? "bubble" : "other"},
              {"step_s", t},        {"steps", steps.size()}};
}

json gantt(const RunData& run) {
  if (!run.has_trace) return json();
  std::set<int64_t> steps;
  for (const Span& s : run.spans) steps.insert(s.step);
  std::vector<int64_t> shown(steps.begin(), steps.end());
  if (shown.size() > 2) shown.resize(2);
  static const std::vector<std::string> kinds = {"forward", "backward", "optimizer", "synchronize", "bucket"};
  double t0 = std::numeric_limits<double>::max();
  for (const Span& s : run.spans) {
    if (std::find(shown.begin(), shown.end(), s.step) != shown.end()) t0 = std::min(t0, s.ts);
  }
  json spans = json::array();
  for (const Span& s : run.spans) {
    if (std::find(shown.begin(), shown.end(), s.step) == shown.end()) continue;
    const auto k = std::find(kinds.begin(), kinds.end(), s.name);
    if (k == kinds.end() || spans.size() >= 5000) continue;
    spans.push_back({s.rank, (s.ts - t0) / 1000.0, s.dur / 1000.0, k - kinds.begin(), s.index, s.step});
  }
  return json{{"ranks", run.trace_world}, {"steps", shown}, {"kinds", kinds}, {"spans", spans}};
}

double number(const json& j, const char* key, double fallback = -1) {
  auto it = j.find(key);
  return it != j.end() && it->is_number() ? it->get<double>() : fallback;
}

json wire(const RunData& run) {
  json out;
  if (run.final && number(*run.final, "f32_bytes_per_step") > 0) {
    out["compress"] = run.final->value("compress", "none");
    out["wire_per_step"] = number(*run.final, "wire_bytes_per_step");
    out["f32_per_step"] = number(*run.final, "f32_bytes_per_step");
  }
  if (run.has_trace) {
    std::map<int, double> bytes;
    std::set<int64_t> steps;
    for (const Span& s : run.spans) {
      if (s.name != "bucket" || s.bytes < 0) continue;
      bytes[s.rank] += static_cast<double>(s.bytes);
      steps.insert(s.step);
    }
    if (!bytes.empty()) {
      json ranks = json::array(), per = json::array();
      for (const auto& [r, b] : bytes) {
        ranks.push_back(r);
        per.push_back(b / static_cast<double>(steps.size()));
      }
      out["ranks"] = ranks;
      out["bucket_bytes_per_step"] = per;
    }
  }
  return out.empty() ? json() : out;
}

json memory(const RunData& run) {
  if (!run.final) return json();
  const json& f = *run.final;
  json out;
  if (f.contains("peak_rss_bytes_per_rank") && f["peak_rss_bytes_per_rank"].is_array()) {
    out["peak_rss"] = f["peak_rss_bytes_per_rank"];
  } else if (number(f, "peak_rss_bytes") > 0) {
    out["peak_rss"] = json::array({number(f, "peak_rss_bytes")});
  }
  if (number(f, "state_bytes_per_rank") > 0) out["state_bytes"] = number(f, "state_bytes_per_rank");
  for (const char* key : {"stage_step_peak_bytes", "stage_activation_peak_bytes"}) {
    if (f.contains(key) && f[key].is_array()) out[key] = f[key];
  }
  return out.empty() ? json() : out;
}

// When step `step` was first reached, from the log records before start `before` (0: unknown).
double time_of_step(const RunData& run, int64_t step, size_t before) {
  const LogPoint* lo = nullptr;
  const LogPoint* hi = nullptr;
  for (const LogPoint& p : run.logs) {
    if (p.start >= before || p.time <= 0) continue;
    if (p.step <= step && (lo == nullptr || p.step > lo->step)) lo = &p;
    if (p.step >= step && (hi == nullptr || p.step < hi->step)) hi = &p;
  }
  if (hi != nullptr && hi->step == step) return hi->time;
  if (lo != nullptr && hi != nullptr && hi->step > lo->step) {
    return lo->time +
           (hi->time - lo->time) * static_cast<double>(step - lo->step) / static_cast<double>(hi->step - lo->step);
  }
  if (step <= run.starts[before - 1].resumed_step) return run.starts[before - 1].time;
  return lo != nullptr ? lo->time : 0.0;
}

json restarts(const RunData& run) {
  json out = json::array();
  for (size_t i = 1; i < run.starts.size(); ++i) {
    const Start& prev = run.starts[i - 1];
    const Start& now = run.starts[i];
    int64_t last = prev.resumed_step;
    for (const LogPoint& p : run.logs) {
      if (p.start == i - 1) last = std::max(last, p.step);
    }
    const double failed_at = now.failed_at > 0 ? now.failed_at : now.time;
    const double reached = time_of_step(run, now.resumed_step, i);
    json r{{"attempt", now.attempt},     {"kind", now.world != prev.world ? "resize" : "restart"},
           {"reason", now.reason},       {"failed_at", failed_at},
           {"restart_at", now.time},     {"resumed_step", now.resumed_step},
           {"last_logged_step", last},   {"lost_steps", std::max<int64_t>(0, last - now.resumed_step)},
           {"world_before", prev.world}, {"world_after", now.world}};
    r["lost_work_s"] = reached > 0 ? json(std::max(0.0, failed_at - reached)) : json();
    r["downtime_s"] = std::max(0.0, now.time - failed_at);
    out.push_back(r);
  }
  return out;
}

json timeline(const RunData& run) {
  if (run.starts.empty()) return json();
  const double t0 = run.starts.front().time;
  json attempts = json::array();
  for (size_t i = 0; i < run.starts.size(); ++i) {
    double end = run.starts[i].time;
    for (const LogPoint& p : run.logs) {
      if (p.start == i) end = std::max(end, p.time);
    }
    if (i + 1 < run.starts.size() && run.starts[i + 1].failed_at > 0) end = run.starts[i + 1].failed_at;
    attempts.push_back({{"attempt", run.starts[i].attempt},
                        {"start", run.starts[i].time - t0},
                        {"end", end - t0},
                        {"world", run.starts[i].world}});
  }
  json checkpoints = json::array();
  for (const Checkpoint& c : run.checkpoints) {
    if (c.complete && c.time > 0) checkpoints.push_back({{"step", c.step}, {"time", c.time - t0}});
  }
  return json{{"t0", t0}, {"attempts", attempts}, {"checkpoints", checkpoints}};
}

}  // namespace

json analyse(const RunData& run) {
  const bool pipelined = !run.starts.empty() && run.starts.back().pp > 1;
  json out{{"name", run.name},          {"series", series(run)},     {"split", split(run, pipelined)},
           {"gantt", gantt(run)},       {"wire", wire(run)},         {"memory", memory(run)},
           {"restarts", restarts(run)}, {"timeline", timeline(run)}, {"pipelined", pipelined}};
  return out;
}

}  // namespace dtrain::report
