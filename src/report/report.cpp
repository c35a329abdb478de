// dtrain report (report.h): load every run, analyse it, render one page.
#include "dtrain/report/report.h"

#include "analyse.h"
#include "dtrain/core/error.h"
#include "html.h"
#include "run_data.h"

namespace dtrain::report {

std::string build_report(const std::vector<ReportInput>& runs, const std::string& title) {
  DT_CHECK(!runs.empty(), "report", "no run given (dtrain report RUN... -o report.html)");
  std::vector<RunData> loaded;
  std::vector<nlohmann::json> data;
  for (const ReportInput& in : runs) {
    RunData run = load_metrics(in);
    load_trace(in, run);
    load_checkpoints(in, run);
    data.push_back(analyse(run));
    loaded.push_back(std::move(run));
  }
  return render_html(title, loaded, data);
}

bool is_sweep(const std::string& path) { return is_sweep_dir(path); }

std::string build_sweep_report(const std::string& dir, const std::string& title) {
  return render_sweep_html(title, load_sweep(dir));
}

}  // namespace dtrain::report
