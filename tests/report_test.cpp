// dtrain report end to end: real runs (a short demo job, a 2 x 2 pipeline, a run with a fault
// and a restart, one resized to fewer workers) rendered by headless Chromium: no errors, and every chart holds the
// points the run's own files say it should (counted here from the metrics and the trace). Bad
// input gets a clear error or a page that says what was missing, never a crash.
#include <sys/wait.h>

#include <map>
#include <regex>
#include <set>

#include "cli_util.h"

namespace {

struct Page {
  int code = -1;
  std::string log;          // Chromium's stderr (console messages)
  nlohmann::json rendered;  // what report.js drew: {"errors": [...], "charts": {...}}
  std::string body_state;   // <body data-rendered="ok|errors">
};

std::string unescape_html(std::string s) {
  for (const auto& [from, to] : std::vector<std::pair<std::string, std::string>>{
           {"&lt;", "<"}, {"&gt;", ">"}, {"&quot;", "\""}, {"&#39;", "'"}, {"&amp;", "&"}}) {
    for (size_t at = s.find(from); at != std::string::npos; at = s.find(from, at + to.size()))
      s.replace(at, from.size(), to);
  }
  return s;
}

class Report : public ::testing::Test {
 protected:
  static fs::path dir_;
  static std::string path(const std::string& name) { return (dir_ / name).string(); }

  // A failed assertion in SetUpTestSuite makes gtest skip the suite's tests, and CTest counts a
  // skip as a pass: the suite's runs record what went wrong and every test fails with it.
  static std::string setup_error_;
  static void fail_setup(const std::string& what) {
    setup_error_ = what;
    ::unsetenv("DTRAIN_FAULT");
  }
  void SetUp() override { ASSERT_TRUE(setup_error_.empty()) << "the runs the reports are made of: " << setup_error_; }

  static void SetUpTestSuite() {
    char tmpl[] = "/tmp/dtrain-report-XXXXXX";
    if (mkdtemp(tmpl) == nullptr) return fail_setup("mkdtemp failed");
    dir_ = tmpl;
    ::setenv("DTRAIN_FLIGHT_DIR", dir_.c_str(), 1);
    // The demo's job, shorter.
    ProcessResult demo = dtrain(
        "train --dp 2 --zero 1 --model mlp --hidden 256,256 --steps 60 --batch-size 64 --optimizer adamw --lr 1e-3 "
        "--lr-schedule cosine --min-lr 1e-5 --log-every 5 --progress=false --metrics " +
        path("demo.jsonl") + " --trace " + path("demo-trace.json"));
    if (demo.code != 0) return fail_setup("the demo job failed:\n" + demo.output);
    ProcessResult pp = dtrain(
        "train --dp 2 --pp 2 --model mlp --hidden 64,64 --micro-batches 4 --steps 30 --batch-size 64 --log-every 3 "
        "--progress=false --metrics " +
        path("pp.jsonl") + " --trace " + path("pp-trace.json"));
    if (pp.code != 0) return fail_setup("the pipeline job failed:\n" + pp.output);
    ::setenv("DTRAIN_FAULT", "kill:rank=1:step=13", 1);
    ProcessResult fault = dtrain(
        "train --dp 2 --model mlp --hidden 64 --steps 40 --batch-size 32 --log-every 2 --progress=false "
        "--checkpoint-dir " +
        path("ckpt") + " --checkpoint-every 8 --max-restarts 1 --metrics " + path("fault.jsonl") + " --trace " +
        path("fault-trace.json"));
    ::unsetenv("DTRAIN_FAULT");
    if (fault.code != 0) return fail_setup("the fault job failed:\n" + fault.output);
    if (fault.output.find("restarting all 2 workers") == std::string::npos) {
      return fail_setup("the fault job did not restart:\n" + fault.output);
    }
    // Rank 1 fails on every start: after two, the job goes on with one worker (a resize).
    ::setenv("DTRAIN_FAULT", "kill:rank=1:step=15:attempt=any", 1);
    ProcessResult resize = dtrain(
        "train --dp 2 --model mlp --hidden 64 --steps 40 --batch-size 32 --log-every 5 --progress=false "
        "--checkpoint-dir " +
        path("ckpt-resize") + " --checkpoint-every 10 --max-restarts 2 --min-workers 1 --metrics " +
        path("resize.jsonl"));
    ::unsetenv("DTRAIN_FAULT");
    if (resize.code != 0) return fail_setup("the resize job failed:\n" + resize.output);
    if (resize.output.find("continuing with 1 workers") == std::string::npos) {
      return fail_setup("the resize job did not go on with 1 worker:\n" + resize.output);
    }
  }
  static void TearDownTestSuite() {
    ::unsetenv("DTRAIN_FLIGHT_DIR");
    fs::remove_all(dir_);
  }

  // Headless Chromium loads the page and dumps its DOM after the scripts ran.
  static Page render(const std::string& html) {
    static int n = 0;
    const std::string profile = path("chromium-profile-" + std::to_string(n++));
    const std::string dom = html + ".dom", log = html + ".log";
    const std::string cmd =
        "timeout -k 5 120 chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run "
        "--disable-background-networking --disable-component-update --disable-sync --user-data-dir=" +
        profile + " --enable-logging=stderr --v=0 --dump-dom file://" + html + " >" + dom + " 2>" + log;
    Page p;
    p.code = run_shell(cmd).code;
    p.log = slurp(log);
    const std::string text = slurp(dom);
    std::smatch m;
    if (std::regex_search(text, m, std::regex("<pre id=\"dtrain-render\" hidden=\"\">([^<]*)</pre>"))) {
      p.rendered = nlohmann::json::parse(unescape_html(m[1].str()), nullptr, false);
    }
    if (std::regex_search(text, m, std::regex("data-rendered=\"(\\w+)\""))) p.body_state = m[1].str();
    return p;
  }

  // The records of a metrics file.
  static std::vector<nlohmann::json> records(const std::string& metrics) {
    std::vector<nlohmann::json> out;
    std::ifstream in(path(metrics));
    std::string line;
    while (std::getline(in, line)) out.push_back(nlohmann::json::parse(line));
    return out;
  }
  static size_t distinct_log_steps(const std::string& metrics) {
    std::set<int64_t> steps;
    for (const auto& r : records(metrics)) {
      if (r["event"] == "log") steps.insert(r["step"].get<int64_t>());
    }
    return steps.size();
  }
  static size_t starts(const std::string& metrics) {
    size_t n = 0;
    for (const auto& r : records(metrics)) n += r["event"] == "start" ? 1 : 0;
    return n;
  }
  // The trace's forward, backward, optimizer, synchronize and bucket spans of its first two steps.
  static size_t first_steps_spans(const std::string& trace) {
    const nlohmann::json t = nlohmann::json::parse(slurp(path(trace)));
    std::set<int64_t> steps;
    for (const auto& e : t["traceEvents"]) {
      if (e["ph"] == "X") steps.insert(e["args"]["step"].get<int64_t>());
    }
    std::set<int64_t> first(steps.begin(), std::next(steps.begin(), std::min<size_t>(2, steps.size())));
    static const std::regex kinds("^(forward|backward|optimizer|synchronize|bucket)( \\d+)?$");
    size_t n = 0;
    for (const auto& e : t["traceEvents"]) {
      if (e["ph"] != "X" || !first.count(e["args"]["step"].get<int64_t>())) continue;
      n += std::regex_match(e["name"].get<std::string>(), kinds) ? 1 : 0;
    }
    return n;
  }

  static void expect_clean(const Page& p, const std::string& what) {
    EXPECT_EQ(p.code, 0) << what << ": " << p.log;
    ASSERT_TRUE(p.rendered.is_object()) << what << ": the page did not report what it drew\n" << p.log;
    EXPECT_TRUE(p.rendered["errors"].empty()) << what << ": " << p.rendered.dump();
    EXPECT_EQ(p.body_state, "ok") << what;
    EXPECT_EQ(p.log.find("Uncaught"), std::string::npos) << what << ": " << p.log;
  }
};

fs::path Report::dir_;
std::string Report::setup_error_;

std::string fmt_trial(const std::string& dir, int64_t trial) {
  char name[32];
  std::snprintf(name, sizeof(name), "/trial-%04ld", static_cast<long>(trial));
  return dir + name;
}

TEST_F(Report, DemoPipelineAndFaultPagesRenderEveryPointWithoutErrors) {
  struct Case {
    const char* name;
    std::string metrics, trace;
    int world;
  };
  const std::vector<Case> cases = {{"demo", "demo.jsonl", "demo-trace.json", 2},
                                   {"pipeline 2 x 2", "pp.jsonl", "pp-trace.json", 4},
                                   {"fault and restart", "fault.jsonl", "fault-trace.json", 2}};
  for (const Case& c : cases) {
    const std::string html = path(c.metrics + ".html");
    ProcessResult made = dtrain("report " + path(c.metrics) + " -o " + html);
    ASSERT_EQ(made.code, 0) << c.name << ": " << made.output;
    const Page p = render(html);
    expect_clean(p, c.name);
    const nlohmann::json& charts = p.rendered["charts"];
    std::printf("%s: %s\n", c.name, charts.dump().c_str());
    EXPECT_EQ(charts["loss"]["series"][0].get<size_t>(), distinct_log_steps(c.metrics)) << c.name;
    EXPECT_EQ(charts["loss"]["drawn"][0].get<size_t>(), distinct_log_steps(c.metrics)) << c.name;
    EXPECT_EQ(charts["throughput"]["series"][0].get<size_t>(), distinct_log_steps(c.metrics)) << c.name;
    EXPECT_EQ(charts["split"]["bars"].get<int>(), c.world) << c.name;
    EXPECT_EQ(charts["gantt"]["spans"][0].get<size_t>(), first_steps_spans(c.trace)) << c.name;
    EXPECT_GT(charts["gantt"]["spans"][0].get<size_t>(), 0u) << c.name;
    EXPECT_EQ(charts["memory"]["bars"].get<int>(), c.world) << c.name;
    EXPECT_EQ(charts["wire"]["bars"].get<int>(), 2) << c.name;  // on the wire and as f32
    EXPECT_EQ(charts["timeline"]["bands"].get<size_t>(), starts(c.metrics)) << c.name;
    EXPECT_EQ(charts["timeline"]["failures"].get<size_t>(), starts(c.metrics) - 1) << c.name;
    EXPECT_EQ(charts["loss"]["markers"].get<size_t>(), starts(c.metrics) - 1) << c.name;
  }
  // The fault: two starts, the restart's cause in the page, the checkpoints on the timeline.
  EXPECT_EQ(starts("fault.jsonl"), 2u);
  const std::string page = slurp(path("fault.jsonl.html"));
  EXPECT_NE(page.find("rank 1 never called"), std::string::npos);
  EXPECT_NE(page.find("killed by signal 9"), std::string::npos);
  // An elastic resize: three starts, the last with one rank, marked as a resize with its cause.
  ProcessResult resized = dtrain("report " + path("resize.jsonl") + " -o " + path("resize.html"));
  ASSERT_EQ(resized.code, 0) << resized.output;
  const Page r = render(path("resize.html"));
  expect_clean(r, "resize");
  EXPECT_EQ(r.rendered["charts"]["timeline"]["bands"].get<size_t>(), 3u);
  EXPECT_EQ(r.rendered["charts"]["timeline"]["failures"].get<size_t>(), 2u);
  EXPECT_EQ(r.rendered["charts"]["loss"]["series"][0].get<size_t>(), distinct_log_steps("resize.jsonl"));
  EXPECT_NE(slurp(path("resize.html")).find("resize 2 &rarr; 1 ranks"), std::string::npos);
  // Two runs overlaid: one series each.
  ProcessResult both = dtrain("report " + path("demo.jsonl") + " " + path("fault.jsonl") + " -o " + path("both.html"));
  ASSERT_EQ(both.code, 0) << both.output;
  const Page p = render(path("both.html"));
  expect_clean(p, "two runs");
  EXPECT_EQ(p.rendered["charts"]["loss"]["series"].size(), 2u);
  EXPECT_EQ(p.rendered["charts"]["loss"]["series"][1].get<size_t>(), distinct_log_steps("fault.jsonl"));
  EXPECT_EQ(p.rendered["charts"]["split"]["bars"].get<int>(), 4);
}

TEST_F(Report, BadInputGetsAClearErrorOrAPageSayingWhatIsMissing) {
  // No metrics: an error naming the file, exit code 2.
  ProcessResult missing = dtrain("report " + path("nope.jsonl") + " -o " + path("x.html"));
  EXPECT_EQ(missing.code, 2) << missing.output;
  EXPECT_NE(missing.output.find("nope.jsonl: cannot read the run's metrics"), std::string::npos) << missing.output;
  std::ofstream(path("empty.jsonl")).close();
  ProcessResult empty = dtrain("report " + path("empty.jsonl") + " -o " + path("x.html"));
  EXPECT_EQ(empty.code, 2) << empty.output;
  EXPECT_NE(empty.output.find("no metrics records in it"), std::string::npos) << empty.output;
  std::ofstream(path("garbage.jsonl")) << "\x01\x02 not json\n{\"half\": \n";
  ProcessResult garbage = dtrain("report " + path("garbage.jsonl") + " -o " + path("x.html"));
  EXPECT_EQ(garbage.code, 2) << garbage.output;
  ProcessResult no_out = dtrain("report " + path("demo.jsonl") + " -o " + path("no/such/dir/x.html"));
  EXPECT_EQ(no_out.code, 2) << no_out.output;
  EXPECT_NE(no_out.output.find("-o"), std::string::npos) << no_out.output;
  ProcessResult two = dtrain("report " + path("demo.jsonl") + " " + path("pp.jsonl") + " --trace " +
                             path("pp-trace.json") + " -o " + path("x.html"));
  EXPECT_EQ(two.code, 2) << two.output;
  EXPECT_NE(two.output.find("one run's files"), std::string::npos) << two.output;

  // A truncated last line (a run killed while writing): the page says so and draws the rest.
  std::string text = slurp(path("demo.jsonl"));
  text.resize(text.size() - 40);
  std::ofstream(path("truncated.jsonl")) << text;
  struct PageCase {
    const char* name;
    std::string args, says;
  };
  const std::vector<PageCase> pages = {
      {"truncated metrics", path("truncated.jsonl"), "not a readable record"},
      {"a trace from another run", path("demo.jsonl") + " --trace " + path("pp-trace.json"), "belongs to another run"},
      {"a missing trace", path("demo.jsonl") + " --trace " + path("gone.json"), "No such file or directory"},
      {"a trace that is not one", path("demo.jsonl") + " --trace " + path("demo.jsonl"), "not a Chrome/Perfetto trace"},
      {"a missing checkpoint directory", path("fault.jsonl") + " --checkpoint-dir " + path("gone"),
       "checkpoint directory"}};
  for (const PageCase& c : pages) {
    const std::string html = path(std::string("bad-") + std::to_string(&c - pages.data()) + ".html");
    ProcessResult r = dtrain("report " + c.args + " -o " + html);
    ASSERT_EQ(r.code, 0) << c.name << ": " << r.output;
    const std::string page = slurp(html);
    EXPECT_NE(page.find("What is missing"), std::string::npos) << c.name;
    EXPECT_NE(page.find(c.says), std::string::npos) << c.name;
  }
  // The truncated run's page still renders, with one log point fewer at most.
  const Page p = render(path("bad-0.html"));
  expect_clean(p, "truncated metrics");
  EXPECT_GE(p.rendered["charts"]["loss"]["series"][0].get<size_t>() + 1, distinct_log_steps("demo.jsonl"));
}

// A sweep's page (dtrain report SWEEPDIR): one line per trial in the results' order, holding a
// point per job that reported the metric and a loss point per distinct log step of the trial's
// jobs (counted here from its metrics files); trials stopped early by asha dashed; the table with
// every trial's command.
TEST_F(Report, SweepPageDrawsEveryTrialsPointsAndDashesTheStoppedOnes) {
  const std::string dir = path("sweep");
  ProcessResult sweep = dtrain(
      "sweep --strategy asha --param lr=0.0003,0.001,0.003,0.01,1e30 --param weight-decay=0,0.001 --trials 8 --eta 2 "
      "--min-steps 10 --max-steps 40 --parallel 2 --dir " +
      dir + " -- --hidden 16 --batch-size 32");
  ASSERT_EQ(sweep.code, 0) << sweep.output;
  ProcessResult report = dtrain("report " + dir + " -o " + path("sweep.html") + " --title sweep");
  ASSERT_EQ(report.code, 0) << report.output;
  const Page p = render(path("sweep.html"));
  expect_clean(p, "sweep");
  const nlohmann::json& metric = p.rendered["charts"]["sweep"];
  const nlohmann::json& loss = p.rendered["charts"]["loss"];
  const std::string page = slurp(path("sweep.html"));
  std::ifstream in(dir + "/results.jsonl");
  std::string line;
  size_t i = 0, not_done = 0, stopped = 0;
  while (std::getline(in, line)) {
    const nlohmann::json r = nlohmann::json::parse(line);
    const int64_t trial = r["trial"].get<int64_t>();
    ASSERT_LT(i, metric["trials"].size());
    EXPECT_EQ(metric["trials"][i].get<int64_t>(), trial);  // best first, as in the results
    size_t points = 0;
    std::set<int64_t> log_steps;
    for (int rung = 0;; ++rung) {
      const std::string file = fmt_trial(dir, trial) + "/metrics-" + std::to_string(rung) + ".jsonl";
      if (!fs::exists(file)) break;
      std::ifstream m(file);
      for (std::string rec; std::getline(m, rec);) {
        const nlohmann::json j = nlohmann::json::parse(rec);
        if (j["event"] == "log") log_steps.insert(j["step"].get<int64_t>());
        if (j["event"] == "final" && j.contains("test_accuracy")) ++points;
      }
    }
    EXPECT_EQ(metric["series"][i].get<size_t>(), points) << "trial " << trial;
    EXPECT_EQ(metric["drawn"][i].get<size_t>(), points) << "trial " << trial;
    EXPECT_EQ(loss["series"][i].get<size_t>(), log_steps.size()) << "trial " << trial;
    if (r["status"] == "done") {
      EXPECT_GE(points, 1u) << "trial " << trial;
    } else {
      ++not_done;
    }
    stopped += r["status"] == "stopped" ? 1 : 0;
    std::string command = r["command"].get<std::string>();
    EXPECT_NE(page.find(command.substr(0, command.find('\''))), std::string::npos) << command;
    ++i;
  }
  EXPECT_EQ(i, 8u);
  EXPECT_EQ(metric["series"].size(), 8u);
  EXPECT_GT(stopped, 0u);  // asha stopped some early: they are there, dashed
  EXPECT_EQ(metric["dashed"].get<size_t>(), not_done);
  EXPECT_NE(page.find("The best trial, reproduced"), std::string::npos);

  // Not finished (no results yet): a clear error naming the directory.
  fs::remove(dir + "/results.jsonl");
  ProcessResult unfinished = dtrain("report " + dir + " -o " + path("x.html"));
  EXPECT_EQ(unfinished.code, 2) << unfinished.output;
  EXPECT_NE(unfinished.output.find("no results.jsonl: the sweep has not finished"), std::string::npos)
      << unfinished.output;
}

}  // namespace
