// dtrain bench gemm: the core's measured peak and each gemm library's rate over the shapes
// dtrain's models use. Options beyond BenchOptions (commands.h).
#pragma once

#include <string>

#include "commands.h"

namespace dtrain::tools {

struct GemmBenchOptions {
  std::string shapes = "models";  // models: the grid of model shapes, then --size; square: only --size
  double shape_seconds = 0.06;    // measuring time per library and grid shape
  bool json = false;              // one JSON line per grid shape instead of the table
};

/// Prints the FMA probe's peak (f32, bf16), each library's GFLOP/s per shape with the one auto
/// picks, and last one JSON line for the N x N x N product of --size (what bench/ scripts read).
int run_bench_gemm(const BenchOptions& opts, const GemmBenchOptions& gemm);

}  // namespace dtrain::tools
