// The subcommands of the dtrain tool.
#pragma once

#include <string>
#include <vector>

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

struct CollBenchOptions {
  int nranks = 2;
  std::string op = "allreduce";
  std::string min_bytes = "8";
  std::string max_bytes = "64M";
  std::string counts;  // comma-separated element counts instead of the byte sweep
  std::string dtype = "f32";
  std::string redop = "sum";
  std::string algo = "auto";  // comma-separated list: one sweep per algorithm
  std::string transport = "auto";
  std::string compress;  // codecs (comma-separated): run the compressed collectives instead
  int iters = 20;
  int warmup = 5;
  bool check = false;
  bool inplace = false;
  bool all_placements = false;  // all_reduce both out of place and in place
  bool shared = false;          // all_reduce in place in comm::allocate_shared memory
  bool model = false;
  double timeout_s = 120;
  std::string json;
};

struct PipeBenchOptions {
  int stages = 4;
  int micro_batches = 8;
  std::string schedule = "1f1b";
  int64_t forward_us = 16000;   // one micro-batch's forward through one stage
  int64_t backward_us = 32000;  // and its backward
  int blocks_per_stage = 2;
  int64_t payload = 65536;  // floats per activation and gradient message
  int steps = 4;
  int warmup = 2;
  bool json = false;
};

/// `argv` is the whole command line: with --dp N > 1 it is relaunched on N local workers.
int run_train(train::TrainConfig& cfg, const std::vector<std::string>& argv);
int run_diff(const DiffOptions& opts);
int run_bench_gemm(const BenchOptions& opts);
int run_launch(const launch::LaunchOptions& opts);
/// --nnodes N (fixed) or MIN:MAX (elastic) into opts.nnodes / min_nodes / max_nodes.
void parse_nnodes(const std::string& text, launch::LaunchOptions& opts);
/// Runs `argv` (this tool's command line) on `n` local workers under dtrain launch.
int launch_self(int n, const std::vector<std::string>& argv, bool prefix_output, int max_restarts = 0,
                int min_workers = 0);
/// `argv` is the tool's whole command line (relaunched as is under dtrain launch).
int run_bench_collectives(const CollBenchOptions& opts, const std::vector<std::string>& argv);
/// The pipeline engine's bubble with balanced stages on an emulated device (bench_pipeline.cpp).
int run_bench_pipeline(const PipeBenchOptions& opts, const std::vector<std::string>& argv);

}  // namespace dtrain::tools
