// The subcommands of the dtrain tool.
#pragma once

#include <string>

#include "dtrain/launch/launcher.h"
#include "dtrain/train/config.h"

namespace dtrain::tools {

struct DiffOptions {
  std::string a, b;
  double tol = 1e-5;
  bool quiet = false;
};

struct BenchOptions {
  int64_t size = 512;
  double seconds = 1.0;
  int threads = 1;
};

int run_train(train::TrainConfig& cfg);
int run_diff(const DiffOptions& opts);
int run_bench_gemm(const BenchOptions& opts);
int run_launch(const launch::LaunchOptions& opts);

}  // namespace dtrain::tools
