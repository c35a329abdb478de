// dtrain report: one self-contained HTML page of one or more runs (report/report.h).
#pragma once

#include <string>
#include <vector>

namespace CLI {
class App;
}

namespace dtrain::tools {

struct ReportOptions {
  std::vector<std::string> runs;  // metrics files or directories
  std::string out = "report.html";
  std::string title = "dtrain run report";
  std::string trace;           // one run only: its trace, when the metrics do not name it
  std::string checkpoint_dir;  // one run only
};

void add_report_options(CLI::App& app, ReportOptions& opts);
int run_report(const ReportOptions& opts);

}  // namespace dtrain::tools
