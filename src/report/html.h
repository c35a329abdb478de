// The report page (internal to src/report): text tables written here, charts drawn in the page
// by web/report.js (uPlot for the curves, SVG for bars, Gantt and timeline) from the runs' data
// embedded as JSON. Everything is inline: the page needs no network.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "run_data.h"

namespace dtrain::report {

/// The whole page for `runs` and their analyse() data (same order).
std::string render_html(const std::string& title, const std::vector<RunData>& runs,
                        const std::vector<nlohmann::json>& data);

/// The page of a sweep: every trial's metric and loss curves, the results table.
std::string render_sweep_html(const std::string& title, const SweepData& sweep);

}  // namespace dtrain::report
