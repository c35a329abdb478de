// dtrain sweep: a hyperparameter search whose trials are `dtrain train` processes (this binary),
// each with its own metrics file and checkpoints in the sweep directory.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace CLI {
class App;
}

namespace dtrain::tools {

struct SweepOptions {
  std::string dir;     // a new sweep directory
  std::string resume;  // the directory of a sweep to continue
  std::string config;  // the sweep's TOML file
  std::string strategy = "grid";
  std::vector<std::string> params;      // --param NAME=SPEC
  std::vector<std::string> train_args;  // dtrain train flags after --
  int64_t trials = 0;
  uint64_t seed = 0;
  std::string metric, mode;
  int64_t min_steps = 0, max_steps = 0, eta = 3, checkpoint_every = 0;
  int parallel = 1;
  int retries = 2;  // restarts from the checkpoint of a job whose process was killed by a signal
  bool retry_failed = false;
  bool json = false;
  bool keep_checkpoints = false;
  double host_timeout = 60.0;  // across hosts: seconds without a heartbeat before a host is lost
};

void add_sweep_options(CLI::App& app, SweepOptions& opts);
int run_sweep(const CLI::App& app, const SweepOptions& opts);

}  // namespace dtrain::tools
