// dtrain status (status_command.h).
#include "status_command.h"

#include <fmt/format.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "dtrain/comm/store.h"
#include "dtrain/core/error.h"
#include "dtrain/launch/status.h"

namespace dtrain::tools {

void add_status_options(CLI::App& app, StatusOptions& opts) {
  app.add_option("--master-addr", opts.master_addr,
                 "the store of a job elsewhere (with --master-port; its secret from DTRAIN_SECRET); default: the "
                 "jobs of this host");
  app.add_option("--master-port", opts.master_port, "the port of that store");
  app.add_flag("--watch", opts.watch, "refresh until the job ends (Ctrl-C stops)");
  app.add_option("--interval", opts.interval, "--watch: seconds between refreshes")->capture_default_str();
  app.add_option("--count", opts.count, "--watch: stop after this many refreshes (0: never)")->capture_default_str();
}

namespace {

struct Target {
  launch::JobInfo job;
  bool from_file = false;
  std::shared_ptr<comm::Store> store;
};

std::vector<Target> targets(const StatusOptions& o) {
  std::vector<Target> out;
  if (!o.master_addr.empty() || o.master_port != 0) {
    DT_CHECK(!o.master_addr.empty() && o.master_port > 0 && o.master_port < 65536, "status",
             "--master-addr '{}' --master-port {}: give both, the port in [1, 65535]", o.master_addr, o.master_port);
    const char* secret = std::getenv("DTRAIN_SECRET");
    DT_CHECK(secret != nullptr && *secret != '\0', "status",
             "--master-addr {}: the job's store needs its secret; export DTRAIN_SECRET as the job has it",
             o.master_addr);
    Target t;
    t.job.addr = o.master_addr;
    t.job.port = o.master_port;
    t.job.secret = secret;
    out.push_back(std::move(t));
    return out;
  }
  for (launch::JobInfo& j : launch::find_jobs()) out.push_back(Target{std::move(j), true, nullptr});
  return out;
}

// One look at every target: false when none could be read.
bool show(std::vector<Target>& ts) {
  bool any = false;
  for (Target& t : ts) {
    std::string text;
    try {
      if (!t.store) {
        t.store = comm::connect_tcp_store(t.job.addr, static_cast<uint16_t>(t.job.port), t.job.secret,
                                          std::chrono::seconds(2));
      }
      const launch::JobStatus st = launch::read_job_status(*t.store);
      text = launch::format_job_status(st, t.from_file ? &t.job : nullptr);
      any = true;
    } catch (const std::exception& e) {
      t.store.reset();
      text = t.from_file ? fmt::format("job of launcher pid {} at {}:{}: cannot read its status: {}\n", t.job.pid,
                                       t.job.addr, t.job.port, e.what())
                         : fmt::format("{}:{}: cannot read the job's status: {}\n", t.job.addr, t.job.port, e.what());
    }
    std::fputs(text.c_str(), stdout);
  }
  return any;
}

}  // namespace

int run_status(const StatusOptions& o) {
  DT_CHECK(o.interval >= 0.05 && o.interval <= 3600, "status", "--interval {}: expected seconds in [0.05, 3600]",
           o.interval);
  DT_CHECK(o.count >= 0, "status", "--count {} must be non-negative", o.count);
  std::vector<Target> ts = targets(o);
  if (ts.empty()) {
    std::printf("no dtrain jobs of this user on this host (job files in %s)\n", launch::jobs_dir().c_str());
    return o.watch ? 0 : 1;
  }
  const bool tty = ::isatty(STDOUT_FILENO) != 0;
  for (int n = 1;; ++n) {
    if (o.watch && tty) std::fputs("\x1b[H\x1b[2J", stdout);  // redraw in place
    const bool any = show(ts);
    std::fflush(stdout);
    if (!o.watch) return any ? 0 : 1;
    if (!any || (o.count > 0 && n >= o.count)) return any ? 0 : 1;
    if (!tty) std::fputs("\n", stdout);
    std::this_thread::sleep_for(std::chrono::duration<double>(o.interval));  // the refresh period
  }
}

}  // namespace dtrain::tools
