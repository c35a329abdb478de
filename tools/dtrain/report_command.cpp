// dtrain report (report_command.h).
#include "report_command.h"

#include <CLI/CLI.hpp>
#include <cstdio>

#include "dtrain/core/error.h"
#include "dtrain/core/file.h"
#include "dtrain/report/report.h"

namespace dtrain::tools {

void add_report_options(CLI::App& app, ReportOptions& opts) {
  app.add_option("runs", opts.runs,
                 "runs: each a --metrics file of dtrain train (or a directory holding metrics.jsonl); several are "
                 "overlaid; or one dtrain sweep directory (every trial's curves and the results)")
      ->required();
  app.add_option("-o,--out", opts.out, "the HTML file to write")->capture_default_str();
  app.add_option("--title", opts.title, "the page's title")->capture_default_str();
  app.add_option("--trace", opts.trace, "one run: its --trace file, when its metrics do not name it");
  app.add_option("--checkpoint-dir", opts.checkpoint_dir,
                 "one run: its --checkpoint-dir, when its metrics do not name it");
}

int run_report(const ReportOptions& o) {
  DT_CHECK(o.runs.size() == 1 || (o.trace.empty() && o.checkpoint_dir.empty()), "report",
           "--trace and --checkpoint-dir name one run's files, but {} runs were given", o.runs.size());
  check_output_path(o.out, "-o", "report");
  if (o.runs.size() == 1 && report::is_sweep(o.runs[0])) {
    DT_CHECK(o.trace.empty() && o.checkpoint_dir.empty(), "report",
             "{} is a sweep directory: --trace and --checkpoint-dir name one run's files", o.runs[0]);
    const std::string html = report::build_sweep_report(o.runs[0], o.title);
    write_file_atomic(o.out, html, "report");
    std::printf("dtrain report: wrote %s (%zu bytes, the sweep in %s)\n", o.out.c_str(), html.size(),
                o.runs[0].c_str());
    return 0;
  }
  std::vector<report::ReportInput> inputs;
  for (const std::string& r : o.runs) inputs.push_back({r, o.trace, o.checkpoint_dir});
  const std::string html = report::build_report(inputs, o.title);
  write_file_atomic(o.out, html, "report");
  std::printf("dtrain report: wrote %s (%zu bytes, %zu run%s)\n", o.out.c_str(), html.size(), o.runs.size(),
              o.runs.size() > 1 ? "s" : "");
  return 0;
}

}  // namespace dtrain::tools
