// dtrain status: what every rank of a running job is doing, from its store (launch/status.h).
#pragma once

#include <string>

namespace CLI {
class App;
}

namespace dtrain::tools {

struct StatusOptions {
  std::string master_addr;  // empty: the jobs of this host (their job files)
  int master_port = 0;
  bool watch = false;
  double interval = 1.0;  // --watch: seconds between refreshes
  int count = 0;          // --watch: refreshes before it stops (0: until the job ends or Ctrl-C)
};

void add_status_options(CLI::App& app, StatusOptions& opts);
int run_status(const StatusOptions& opts);

}  // namespace dtrain::tools
