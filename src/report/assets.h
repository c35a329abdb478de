// The files the report page embeds (internal to src/report), generated at build time by
// cmake/embed.cmake: uPlot (from web/node_modules, pinned by web/package-lock.json) and the
// page's own script and style (web/report.js, web/report.css).
#pragma once

namespace dtrain::report {

extern const char kUplotJs[];
extern const char kUplotCss[];
extern const char kReportJs[];
extern const char kReportCss[];

}  // namespace dtrain::report
