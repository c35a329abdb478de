// The report page (html.h).
#include "html.h"

#include <fmt/format.h>

#include <chrono>
#include <ctime>
#include <map>

#include "assets.h"

namespace dtrain::report {

namespace {

using nlohmann::json;

std::string esc(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

std::string bytes_text(double b) {
  if (b < 0) return "-";
  if (b >= 1024.0 * 1024 * 1024) return fmt::format("{:.2f} GiB", b / (1024.0 * 1024 * 1024));
  if (b >= 1024.0 * 1024) return fmt::format("{:.1f} MiB", b / (1024.0 * 1024));
  if (b >= 1024.0) return fmt::format("{:.1f} KiB", b / 1024.0);
  return fmt::format("{:.0f} B", b);
}

std::string secs(double s) {
  if (s < 0) return "-";
  if (s < 1) return fmt::format("{:.2f} ms", s * 1000);
  if (s < 10) return fmt::format("{:.3f} s", s);
  return fmt::format("{:.1f} s", s);
}

std::string clock_text(double unix_s) {
  if (unix_s <= 0) return "-";
  const auto t = static_cast<std::time_t>(unix_s);
  std::tm tm{};
  ::localtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%H:%M:%S", &tm);
  return buf;
}

double num(const json& j, const char* key, double fallback = -1) {
  if (!j.is_object()) return fallback;
  auto it = j.find(key);
  return it != j.end() && it->is_number() ? it->get<double>() : fallback;
}

// The runs' summary: one row per run.
std::string summary_table(const std::vector<RunData>& runs, const std::vector<json>& data) {
  std::string t =
      "<table><tr><th>run</th><th>model</th><th>layout</th><th>steps</th><th>train loss</th><th>evaluation</th>"
      "<th>throughput</th><th>MFU</th><th>starts</th><th>trace</th></tr>\n";
  for (size_t i = 0; i < runs.size(); ++i) {
    const RunData& r = runs[i];
    const json f = r.final ? *r.final : json::object();
    const Start s = r.starts.empty() ? Start{} : r.starts.back();
    std::string mfu = "-";
    if (!r.logs.empty() && r.logs.back().mfu >= 0) mfu = fmt::format("{:.1f}%", r.logs.back().mfu * 100);
    if (num(f, "mfu") >= 0) mfu = fmt::format("{:.1f}%", num(f, "mfu") * 100);
    const double rate =
        num(f, r.unit == "tok" ? "tokens_per_s" : "samples_per_s", r.logs.empty() ? -1 : r.logs.back().rate);
    t += fmt::format(
        "<tr><td><span class=\"swatch\" data-run=\"{}\"></span>{}</td><td>{}</td><td>dp {} x pp {} x tp {}</td>"
        "<td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>\n",
        i, esc(r.name), esc(s.model.empty() ? f.value("model", "?") : s.model), s.dp, s.pp, s.tp,
        r.logs.empty() ? 0 : r.logs.back().step,
        num(f, "train_loss") >= 0 ? fmt::format("{:.4f}", num(f, "train_loss"))
                                  : (r.logs.empty() ? "-" : fmt::format("{:.4f}", r.logs.back().loss)),
        r.evals.empty() ? "-" : fmt::format("{} {:.4f}", esc(r.eval_name), r.evals.back().value),
        rate >= 0 ? fmt::format("{:.1f} {}/s", rate, r.unit) : "-", mfu,
        r.starts.size() > 1
            ? fmt::format("{} ({} restart{})", r.starts.size(), r.starts.size() - 1, r.starts.size() > 2 ? "s" : "")
            : std::to_string(r.starts.size()),
        r.has_trace ? "yes" : "no");
  }
  (void)data;
  return t + "</table>\n";
}

std::string problems_list(const std::vector<RunData>& runs) {
  std::string items;
  for (const RunData& r : runs) {
    for (const std::string& p : r.problems) items += fmt::format("<li><b>{}</b>: {}</li>\n", esc(r.name), esc(p));
  }
  if (items.empty()) return "";
  return "<section class=\"problems\" id=\"problems\"><h2>What is missing</h2><ul>\n" + items + "</ul></section>\n";
}

std::string split_table(const RunData& r, const json& d) {
  const json& s = d["split"];
  if (s.is_null()) return "<p class=\"note\">No trace: no time per rank.</p>";
  std::string t = fmt::format(
      "<table><tr><th>rank</th><th>step</th><th>compute</th><th>communication</th><th>waiting</th><th>{}</th></tr>\n",
      s["rest_name"].get<std::string>());
  for (size_t i = 0; i < s["ranks"].size(); ++i) {
    t += fmt::format("<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>\n",
                     s["ranks"][i].get<int>(), secs(s["step_s"][i]), secs(s["compute"][i]), secs(s["communication"][i]),
                     secs(s["waiting"][i]), secs(s["rest"][i]));
  }
  (void)r;
  return t + fmt::format("</table><p class=\"note\">Mean per step over {} steps (the first left out).</p>",
                         s["steps"].get<int64_t>());
}

std::string wire_table(const json& d) {
  const json& w = d["wire"];
  if (w.is_null())
    return "<p class=\"note\">No gradient communication recorded (one process, or no data parallelism).</p>";
  std::string t;
  if (w.contains("f32_per_step")) {
    const double wire = w["wire_per_step"].get<double>(), f32 = w["f32_per_step"].get<double>();
    t += fmt::format(
        "<table><tr><th>compression</th><th>on the wire / step</th><th>as f32 / step</th><th>ratio</th></tr>"
        "<tr><td>{}</td><td>{}</td><td>{}</td><td>{:.2f}x</td></tr></table>\n",
        esc(w["compress"].get<std::string>()), bytes_text(wire), bytes_text(f32), wire > 0 ? f32 / wire : 1.0);
  }
  if (w.contains("ranks")) {
    t += "<table><tr><th>rank</th><th>gradient buckets / step</th></tr>\n";
    for (size_t i = 0; i < w["ranks"].size(); ++i) {
      t += fmt::format("<tr><td>{}</td><td>{}</td></tr>\n", w["ranks"][i].get<int>(),
                       bytes_text(w["bucket_bytes_per_step"][i].get<double>()));
    }
    t += "</table>\n";
  }
  return t;
}

std::string memory_table(const json& d) {
  const json& m = d["memory"];
  if (m.is_null()) return "<p class=\"note\">No final record: no memory figures.</p>";
  std::string t = "<table><tr><th>rank</th><th>peak resident</th></tr>\n";
  if (m.contains("peak_rss")) {
    for (size_t i = 0; i < m["peak_rss"].size(); ++i) {
      t += fmt::format("<tr><td>{}</td><td>{}</td></tr>\n", i, bytes_text(m["peak_rss"][i].get<double>()));
    }
  }
  t += "</table>\n";
  if (m.contains("state_bytes")) {
    t += fmt::format("<p class=\"note\">Model and optimizer state per rank (estimate): {}.</p>",
                     bytes_text(m["state_bytes"].get<double>()));
  }
  if (m.contains("stage_step_peak_bytes")) {
    t += "<table><tr><th>stage</th><th>step peak</th><th>activations peak</th></tr>\n";
    for (size_t i = 0; i < m["stage_step_peak_bytes"].size(); ++i) {
      t += fmt::format(
          "<tr><td>{}</td><td>{}</td><td>{}</td></tr>\n", i, bytes_text(m["stage_step_peak_bytes"][i].get<double>()),
          m.contains("stage_activation_peak_bytes") ? bytes_text(m["stage_activation_peak_bytes"][i].get<double>())
                                                    : "-");
    }
    t += "</table>\n";
  }
  return t;
}

std::string restarts_table(const std::vector<RunData>& runs, const std::vector<json>& data) {
  std::string rows;
  for (size_t i = 0; i < runs.size(); ++i) {
    for (const json& r : data[i]["restarts"]) {
      rows += fmt::format(
          "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td class=\"text\">{}</td><td>{}</td><td>&ge; "
          "{}</td><td>{}</td>"
          "<td>{}</td></tr>\n",
          esc(runs[i].name), r["attempt"].get<int>(),
          r["kind"] == "resize"
              ? fmt::format("resize {} &rarr; {} ranks", r["world_before"].get<int>(), r["world_after"].get<int>())
              : std::string("restart"),
          clock_text(r["failed_at"].get<double>()), esc(r["reason"].get<std::string>()),
          r["resumed_step"].get<int64_t>(), r["lost_steps"].get<int64_t>(),
          r["lost_work_s"].is_null() ? "-" : secs(r["lost_work_s"].get<double>()), secs(r["downtime_s"].get<double>()));
    }
  }
  if (rows.empty()) return "<p class=\"note\">No faults, restarts or resizes.</p>";
  return "<table><tr><th>run</th><th>start</th><th>what</th><th>failed at</th><th>cause</th><th>resumed at step</th>"
         "<th>steps redone</th><th>work lost</th><th>downtime</th></tr>\n" +
         rows + "</table>\n";
}

std::string checkpoints_table(const std::vector<RunData>& runs) {
  std::string rows;
  for (const RunData& r : runs) {
    for (const Checkpoint& c : r.checkpoints) {
      rows += fmt::format("<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>\n", esc(r.name), c.step,
                          c.complete ? "committed" : "incomplete (no manifest)", clock_text(c.time));
    }
  }
  if (rows.empty()) return "<p class=\"note\">No checkpoints.</p>";
  return "<table><tr><th>run</th><th>step</th><th>state</th><th>written at</th></tr>\n" + rows + "</table>\n";
}

std::string rate_table(const std::vector<RunData>& runs) {
  std::string rows;
  for (const RunData& r : runs) {
    double sum = 0, last = -1;
    int n = 0;
    for (const LogPoint& p : r.logs) {
      if (p.rate < 0) continue;
      sum += p.rate;
      last = p.rate;
      ++n;
    }
    if (n == 0) continue;
    rows += fmt::format("<tr><td>{}</td><td>{:.1f}</td><td>{:.1f}</td><td>{}/s</td></tr>\n", esc(r.name), sum / n, last,
                        r.unit);
  }
  if (rows.empty()) return "";
  return "<table><tr><th>run</th><th>mean of the points</th><th>last</th><th>unit</th></tr>\n" + rows +
         "</table><p class=\"note\">Each point: the run's rate since its start (a restart starts afresh).</p>";
}

std::string mfu_table(const std::vector<RunData>& runs, const std::vector<json>& data) {
  std::string rows;
  for (size_t i = 0; i < runs.size(); ++i) {
    const json& series = data[i]["series"];
    if (series["mfu"].is_null()) continue;
    double last = -1;
    for (const json& v : series["mfu"]) {
      if (v.is_number()) last = v.get<double>();
    }
    if (last < 0) continue;
    const bool fraction = series["mfu_label"] == "MFU";
    rows += fmt::format("<tr><td>{}</td><td>{}</td></tr>\n", esc(runs[i].name),
                        fraction ? fmt::format("{:.1f}% MFU", last * 100) : fmt::format("{:.2f} GFLOP/s", last));
  }
  if (rows.empty()) return "";
  return "<table><tr><th>run</th><th>last point</th></tr>\n" + rows + "</table>";
}

// Per rank: the spans shown and the time they cover, in the Gantt chart's steps.
std::string gantt_table(const json& d) {
  const json& g = d["gantt"];
  if (g.is_null() || g["spans"].empty()) return "";
  std::map<int, std::pair<int, double>> compute, comm;  // rank -> (spans, ms)
  for (const json& sp : g["spans"]) {
    const bool is_comm = g["kinds"][sp[3].get<size_t>()] == "bucket";
    auto& slot = (is_comm ? comm : compute)[sp[0].get<int>()];
    ++slot.first;
    slot.second += sp[2].get<double>();
  }
  std::string t = fmt::format(
      "<table><tr><th>rank</th><th>compute spans</th><th>compute ms</th><th>bucket spans</th><th>bucket "
      "ms</th></tr>\n");
  for (int r = 0; r < g["ranks"].get<int>(); ++r) {
    t += fmt::format("<tr><td>{}</td><td>{}</td><td>{:.2f}</td><td>{}</td><td>{:.2f}</td></tr>\n", r, compute[r].first,
                     compute[r].second, comm[r].first, comm[r].second);
  }
  std::string steps;
  for (const json& s : g["steps"]) steps += (steps.empty() ? "" : " and ") + std::to_string(s.get<int64_t>());
  return t + fmt::format("</table><p class=\"note\">Steps {}.</p>", steps);
}

// JSON inside <script>: "</" must not close the element.
std::string script_json(const json& j) {
  std::string s = j.dump();
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '<' && i + 1 < s.size() && s[i + 1] == '/') {
      out += "<\\/";
      ++i;
    } else {
      out += s[i];
    }
  }
  return out;
}

// A chart with its table beside it, a note under both, then `below` (a table too wide to sit beside).
std::string section(const std::string& id, const std::string& title, const std::string& chart_note,
                    const std::string& table, const std::string& below = "") {
  return fmt::format(
      "<section id=\"{0}\"><h2>{1}</h2><div class=\"pair\"><div class=\"chart\" id=\"chart-{0}\"></div>"
      "<div class=\"table\">{3}</div></div>{2}{4}</section>\n",
      id, title, chart_note.empty() ? "" : "<p class=\"note\">" + chart_note + "</p>", table, below);
}

}  // namespace

std::string render_html(const std::string& title, const std::vector<RunData>& runs, const std::vector<json>& data) {
  const auto now = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
  std::tm tm{};
  ::localtime_r(&now, &tm);
  char when[40];
  std::strftime(when, sizeof(when), "%Y-%m-%d %H:%M:%S", &tm);
  std::string splits, gantts, wires, memories;
  for (size_t i = 0; i < runs.size(); ++i) {
    const std::string head = runs.size() > 1 ? "<h3>" + esc(runs[i].name) + "</h3>" : "";
    splits += head + split_table(runs[i], data[i]);
    wires += head + wire_table(data[i]);
    memories += head + memory_table(data[i]);
  }
  std::string loss_rows, eval_rows;
  for (const RunData& r : runs) {
    if (!r.logs.empty()) {
      loss_rows += fmt::format("<tr><td>{}</td><td>{}</td><td>{:.4f}</td><td>{:.4f}</td><td>{}</td></tr>\n",
                               esc(r.name), r.logs.size(), r.logs.front().loss, r.logs.back().loss, r.logs.back().step);
    }
    for (const EvalPoint& e : r.evals) {
      eval_rows += fmt::format("<tr><td>{}</td><td>{}</td><td>{}</td><td>{:.4f}</td></tr>\n", esc(r.name), e.step,
                               esc(r.eval_name), e.value);
    }
  }
  const std::string loss_table =
      "<table><tr><th>run</th><th>points</th><th>first loss</th><th>last loss</th><th>last step</th></tr>\n" +
      loss_rows + "</table>" +
      (eval_rows.empty()
           ? std::string()
           : "<table><tr><th>run</th><th>step</th><th>evaluation</th><th>value</th></tr>\n" + eval_rows + "</table>");
  json page{{"title", title}, {"runs", data}};
  std::string html = fmt::format(
      "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\n"
      "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n<title>{0}</title>\n"
      "<style>{1}</style>\n<style>{2}</style>\n</head><body>\n"
      "<header><h1>{0}</h1><p class=\"note\">dtrain report, {3}: {4} run{5}. Every chart has its numbers in the "
      "table beside it.</p></header>\n",
      esc(title), kUplotCss, kReportCss, when, runs.size(), runs.size() > 1 ? "s" : "");
  html += "<section id=\"summary\"><h2>Runs</h2>" + summary_table(runs, data) + "</section>\n";
  html += problems_list(runs);
  html += section("loss", "Training loss", "Dashed lines: restarts and resizes (the step the job resumed from).",
                  loss_table);
  html += section("throughput", "Throughput", "", rate_table(runs));
  html += section("mfu", "Model FLOP utilisation", "", mfu_table(runs, data));
  html += section("split", "Time per step on each rank",
                  "compute: forward, backward, optimizer; communication: gradient synchronisation not hidden "
                  "behind backward; waiting: for a later rank; bubble (pipelines): idle while other stages work.",
                  splits);
  std::string gantt_tables;
  for (size_t i = 0; i < runs.size(); ++i) {
    gantt_tables += (runs.size() > 1 ? "<h3>" + esc(runs[i].name) + "</h3>" : "") + gantt_table(data[i]);
  }
  html += section("gantt", "The first steps, per rank",
                  "Compute spans (forward and backward numbered by micro-batch) on each rank's row, its gradient "
                  "buckets' communication under them.",
                  gantt_tables);
  html += section("wire", "Bytes on the wire", "", wires);
  html += section("memory", "Memory per rank", "", memories);
  // The causes are long lines: their table goes under the chart, the checkpoints beside it.
  html += section("timeline", "Faults, restarts and resizes",
                  "Wall-clock time from the first start: each start as a band, failures in red, the work they cost "
                  "hatched (from the checkpoint resumed to the failure, then the downtime), checkpoints as ticks.",
                  checkpoints_table(runs), restarts_table(runs, data));
  html += "<pre id=\"dtrain-render\" hidden></pre>\n";
  html += "<script id=\"dtrain-data\" type=\"application/json\">" + script_json(page) + "</script>\n";
  html += fmt::format("<script>{}</script>\n<script>{}</script>\n</body></html>\n", kUplotJs, kReportJs);
  return html;
}

namespace {

std::string value_text(const json& v) {
  if (v.is_number()) return fmt::format("{:.6g}", v.get<double>());
  if (v.is_string()) return v.get<std::string>();
  return v.is_null() ? "-" : v.dump();
}

std::string problems_section(const std::vector<std::string>& problems) {
  if (problems.empty()) return "";
  std::string items;
  for (const std::string& p : problems) items += "<li>" + esc(p) + "</li>\n";
  return "<section class=\"problems\" id=\"problems\"><h2>What is missing</h2><ul>\n" + items + "</ul></section>\n";
}

}  // namespace

std::string render_sweep_html(const std::string& title, const SweepData& sweep) {
  // The params' names, in the first result's order (every trial has the same axes).
  std::vector<std::string> axes;
  if (sweep.trials.front().result.contains("params") && sweep.trials.front().result["params"].is_object()) {
    for (const auto& [name, v] : sweep.trials.front().result["params"].items()) axes.push_back(name);
  }
  std::string beside = fmt::format(
      "<table><tr><th>rank</th><th>trial</th><th>{}</th><th>steps</th><th>status</th><th>points</th></tr>\n",
      esc(sweep.metric));
  std::string below = "<table class=\"wide\"><tr><th>rank</th><th>trial</th>";
  for (const auto& a : axes) below += "<th>" + esc(a) + "</th>";
  below +=
      fmt::format("<th>{}</th><th>steps</th><th>time</th><th>status</th><th>command</th></tr>\n", esc(sweep.metric));
  json trials = json::array();
  std::string loss_rows;
  int stopped = 0, failed = 0;
  for (size_t i = 0; i < sweep.trials.size(); ++i) {
    const SweepTrialData& t = sweep.trials[i];
    const json& r = t.result;
    const std::string status = r.value("status", "?");
    stopped += status == "stopped" ? 1 : 0;
    failed += status == "failed" ? 1 : 0;
    const std::string swatch = fmt::format("<span class=\"swatch\" data-run=\"{}\"></span>", i);
    const std::string status_text =
        status == "failed" && r.contains("error") ? "failed: " + r["error"].get<std::string>() : status;
    beside += fmt::format("<tr><td>{}</td><td>{}{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>\n",
                          value_text(r.value("rank", json())), swatch, t.trial, value_text(r.value("value", json())),
                          value_text(r.value("steps", json())), esc(status), t.metric.size());
    below += fmt::format("<tr><td>{}</td><td>{}</td>", value_text(r.value("rank", json())), t.trial);
    for (const auto& a : axes) below += "<td>" + esc(value_text(r["params"].value(a, json()))) + "</td>";
    below += fmt::format(
        "<td>{}</td><td>{}</td><td>{}</td><td class=\"text\">{}</td><td class=\"text\"><code>{}</code></td></tr>\n",
        value_text(r.value("value", json())), value_text(r.value("steps", json())),
        r.contains("time_s") && r["time_s"].is_number() ? secs(r["time_s"].get<double>()) : "-", esc(status_text),
        esc(r.value("command", "")));
    json metric_steps = json::array(), metric_values = json::array(), loss_steps = json::array(),
         loss_values = json::array();
    for (const EvalPoint& e : t.metric) {
      metric_steps.push_back(e.step);
      metric_values.push_back(e.value);
    }
    for (const LogPoint& p : t.run.logs) {
      loss_steps.push_back(p.step);
      loss_values.push_back(p.loss);
    }
    if (!t.run.logs.empty()) {
      loss_rows += fmt::format("<tr><td>{}</td><td>{}</td><td>{:.4f}</td><td>{}</td></tr>\n", t.trial,
                               t.run.logs.size(), t.run.logs.back().loss, t.run.logs.back().step);
    }
    trials.push_back({{"name", t.run.name},
                      {"trial", t.trial},
                      {"status", status},
                      {"metric", {{"steps", metric_steps}, {"values", metric_values}}},
                      {"loss", {{"steps", loss_steps}, {"values", loss_values}}}});
  }
  beside += "</table>";
  below += "</table>";
  const json& best = sweep.trials.front().result;
  if (best.value("status", "") == "done" && best.contains("command")) {
    below += "<p class=\"note\">The best trial, reproduced: <code>" + esc(best["command"].get<std::string>()) +
             "</code></p>";
  }
  json page{
      {"title", title},
      {"sweep", {{"metric", sweep.metric}, {"mode", sweep.mode}, {"strategy", sweep.strategy}, {"trials", trials}}}};
  std::string html = fmt::format(
      "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\n"
      "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n<title>{0}</title>\n"
      "<style>{1}</style>\n<style>{2}</style>\n</head><body>\n"
      "<header><h1>{0}</h1><p class=\"note\">dtrain report of the sweep in {3}: {4}, {5} trials by {6} ({7}), "
      "{8} stopped early, {9} failed.</p></header>\n",
      esc(title), kUplotCss, kReportCss, esc(sweep.dir), esc(sweep.strategy), sweep.trials.size(), esc(sweep.metric),
      esc(sweep.mode), stopped, failed);
  html += section("sweep", fmt::format("{} of every trial", esc(sweep.metric)),
                  "One line per trial, best first, a point at the end of each of its jobs (each rung of asha): "
                  "trials stopped early dashed, failed trials without their last point. The table under the chart: "
                  "every trial's values and the dtrain train command that reproduces it.",
                  beside, below);
  html += section(
      "loss", "Training loss of every trial", "",
      "<table><tr><th>trial</th><th>points</th><th>last loss</th><th>last step</th></tr>\n" + loss_rows + "</table>");
  html += problems_section(sweep.problems);
  html += "<pre id=\"dtrain-render\" hidden></pre>\n";
  html += "<script id=\"dtrain-data\" type=\"application/json\">" + script_json(page) + "</script>\n";
  html += fmt::format("<script>{}</script>\n<script>{}</script>\n</body></html>\n", kUplotJs, kReportJs);
  return html;
}

}  // namespace dtrain::report
